"""The target model: a Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) that runs tree steps.

Module and parameter names mirror Hugging Face's (model.embed_tokens, model.layers.{i}.self_attn.q_proj, ...)
so a checkpoint's state dict loads by name; only lm_head.weight is stored as `output.weight` because
`lm_head` is the method below. Attention always goes through `torch.ops.spectree.tree_attention`.

One forward pass = N new tokens (a causal chunk of a prompt, or a draft tree) on top of the cache:
    tokens, positions  # [B, N] int64
    tree_mask          # [B, N, ceil(N / 32)] int32 packed: bit j of row i <=> token i sees new token j
The committed prefix [0, cache.length) is always fully visible. For a causal chunk the mask is lower
triangular and positions are cache.length + arange(N); for a tree, positions are cache.length + depth and
the mask is ancestor-or-self.

Ragged batches (`forward_segments`, used by the in-flight batching scheduler): several sequences, each with its
own cache, prefix length and N_i new tokens (a draft tree or a prompt chunk), in ONE forward. Every token-wise
layer (embedding, q/k/v, o, MLP, norms, lm_head: where the weights are read) runs over the packed rows
[sum of N_i, H]; attention runs per sequence against its own cache with the unchanged tree-attention op (B = 1),
as vLLM packs variable-length sequences.

Feature layers (`Segment.feature_layers`, for drafters that read the target's inner layers, EAGLE-3): layer j's
feature is the residual stream entering decoder layer j (the output of layer j - 1, before any norm; j = 0 the
embedding, j = num_hidden_layers the last layer's output), as vLLM's and SGLang's EAGLE-3 capture it. A segment
that asks for some gets, as its hidden states, the final-norm state followed by those layers' features, in
ascending layer order: # [N, H * (1 + len(feature_layers))]. They are values the forward computes anyway, so
asking for them changes no logit.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import plugins.tree_attention.op  # noqa: F401  (registers torch.ops.spectree.tree_attention)
from plugins import cpu
from plugins.decoder_layer import native as native_layer
from plugins.rowwise import native as rowwise
from plugins.stream_linear import native as stream_linear
from plugins.stream_linear.native import BlockWeight
from plugins.tree_attention import native as native_attention
from plugins.tree_attention.mask import mask_words, pack_mask
from runtime.checkpoint import LM_HEAD, load_checkpoint, validate_tensors
from runtime.config import TARGET_QUANTIZATIONS, ModelConfig
from runtime.errors import CacheError, CheckpointError, ConfigError, RequestError
from runtime.kv_cache import KVCache
from runtime.rope import RotaryEmbedding, apply_rope

_OUTPUT = "output.weight"


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) computed in fp32, cast back, then scaled (HF Llama's order of operations)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x  # [..., H]
        out = rowwise.rms_norm(x, self.weight, self.eps)  # one native call on CPU (plugins/rowwise/native.py)
        if out is not None:
            return out
        dtype = x.dtype
        xf = x.to(torch.float32)
        if pads_rows(x.device) and batch_invariant(dtype, x.device) and not torch.compiler.is_compiling():
            # A GPU reduction splits a row's sum by how many rows there are; in float64 every split rounds to
            # the same float32 (see "batch invariance"; an exported graph keeps HF's arithmetic, as in `linear`)
            variance = xf.to(torch.float64).pow(2).mean(-1, keepdim=True).to(torch.float32)
        else:
            variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.eps)
        return self.weight * xf.to(dtype)


class _Fused(nn.Module):
    """Projections that read the same input run as ONE matmul over their stacked rows (q/k/v; gate/up): fewer,
    larger GEMMs per layer (faster on CPU; the measurement is in this class's commit history).

    The stacked weight (and bias) is the storage; the named projections' parameters are views of its row blocks,
    so state-dict names stay Hugging Face's and no weight is held twice. It is rebuilt whenever parameters are
    replaced: after any load_state_dict (a post-hook) and after .to() / dtype or device moves (`_apply`).
    """

    _fused_names: tuple[str, ...] = ()
    _out_name: str = ""
    quantized: tuple[QuantizedWeight, QuantizedWeight] | None = None  # (fused, out) when quantize() was called
    packed: tuple[PackedWeight, PackedWeight] | None = None  # (fused, out) when pack() was called
    blocks: tuple[BlockWeight, BlockWeight] | None = None  # (fused, out) when quantize_blocks() was called

    def _setup_fusion(self) -> None:
        self.register_load_state_dict_post_hook(lambda module, _keys: module._fuse())
        self._fuse()

    def _fuse(self) -> None:
        mods = [getattr(self, n) for n in self._fused_names]
        with torch.no_grad():
            weight = torch.cat([m.weight for m in mods])  # [sum of out, in]
            bias = None if mods[0].bias is None else torch.cat([m.bias for m in mods])
        # Non-persistent buffers: not in state dicts, but named module state for exporters (ONNX initialisers).
        self.register_buffer("fused_weight", weight, persistent=False)
        self.register_buffer("fused_bias", bias, persistent=False)
        self.fused_sizes = [m.weight.shape[0] for m in mods]
        self.quantized = self.packed = self.blocks = None  # quantized / packed copies describe the old weights
        start = 0
        for m, size in zip(mods, self.fused_sizes):
            m.weight = nn.Parameter(weight[start:start + size], requires_grad=m.weight.requires_grad)
            if bias is not None:
                m.bias = nn.Parameter(bias[start:start + size], requires_grad=m.bias.requires_grad)
            start += size

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._fuse()
        return out

    def fused_output(self, x: torch.Tensor) -> torch.Tensor:
        """x # [..., in] -> the projections' outputs side by side # [..., sum of out], from one matmul."""
        return linear(x, self._weights()[0], self.fused_bias)

    def fused(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x # [..., in] -> each projection's output, from one matmul."""
        return self.fused_output(x).split(self.fused_sizes, dim=-1)

    def out(self, x: torch.Tensor) -> torch.Tensor:
        """The projection that reads what the fused ones produced (o_proj / down_proj): x # [..., in] -> [..., H]."""
        proj = getattr(self, self._out_name)
        return linear(x, self._weights(proj.weight)[1], proj.bias)

    def _weights(self, out: torch.Tensor | None = None) -> tuple:
        """(fused, out) as the matmuls read them: quantized copies, packed copies or the weights themselves."""
        if self.quantized is not None:
            return self.quantized
        if self.blocks is not None:
            return self.blocks
        if self.packed is not None:
            return self.packed
        return self._buffers["fused_weight"], out

    def quantize(self, kind: type[QuantizedWeight]) -> None:
        """Run this module's matmuls on quantized copies of its weights (`Int8Weight` / `Int4Weight`; draft heads on
        CPU). Undone by any change of the weights (a load, a move), which re-fuses them."""
        self.quantized = (kind.of(self.fused_weight), kind.of(getattr(self, self._out_name).weight))

    def quantize_blocks(self, kind: str) -> None:
        """Run this module's matmuls on block-quantised weights (`BlockWeight`, "q8" / "q4": a quantised target),
        dropping the dense copies' use until the weights change (which re-fuses them)."""
        make = stream_linear.QUANT_FORMATS[kind]
        self.blocks = (make(self.fused_weight), make(getattr(self, self._out_name).weight))

    def pack(self) -> None:
        """Run this module's matmuls on oneDNN-packed copies of its weights (`PackedWeight`). Undone like quantize()."""
        self.packed = (PackedWeight.of(self.fused_weight), PackedWeight.of(getattr(self, self._out_name).weight))


class Attention(_Fused):
    _fused_names = ("q_proj", "k_proj", "v_proj")
    _out_name = "o_proj"

    def __init__(self, config: ModelConfig, in_features: int | None = None) -> None:
        """in_features: what q/k/v read (None: hidden_size; EAGLE-3's draft layer reads 2 * hidden_size)."""
        super().__init__()
        h = config.hidden_size
        i = h if in_features is None else in_features
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.q_proj = nn.Linear(i, config.q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(i, config.kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(i, config.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=config.o_proj_bias)
        self._setup_fusion()

    def forward(
        self,
        x: torch.Tensor,  # [B, N, in_features]
        cos: torch.Tensor,  # [B, N, D] (RotaryEmbedding's, in x's dtype)
        sin: torch.Tensor,  # [B, N, D]
        cache: KVCache,
        cache_layer: int,
        tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32
    ) -> torch.Tensor:  # [B, N, H]
        b, n, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.fused_output(x)  # [B, N, (Hq + 2 Hkv) D]: q | k | v
        # q and k rotated together as Hq + Hkv heads: RoPE is elementwise, so the values are those of rotating each
        # alone, for half the ops (a layer's small ops are a measurable share of a one-token step on CPU).
        qk = apply_rope(qkv[..., : (hq + hkv) * d].view(b, n, hq + hkv, d).transpose(1, 2), cos, sin)
        q, k = qk[:, :hq], qk[:, hq:]  # [B, Hq, N, D], [B, Hkv, N, D]
        v = qkv[..., (hq + hkv) * d:].view(b, n, hkv, d).transpose(1, 2)  # [B, Hkv, N, D]
        if isinstance(cache, AttendingCache):
            out = cache.attend(cache_layer, q, k, v, self.scale)
        else:
            out = attend(cache, cache_layer, q, k, v, tree_mask, self.scale)  # [B, Hq, N, D]
        return self.out(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


def attend(
    cache: Any,
    layer: int,
    q: torch.Tensor,  # [B, Hq, N, D]
    k: torch.Tensor,  # [B, Hkv, N, D]
    v: torch.Tensor,  # [B, Hkv, N, D]
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, N, D]
    """Store the N new tokens' K/V in `cache` (anything with KVCache's `write`) and attend over prefix + tree, in
    the cache's dtype (see `kv_dtype`); the output comes back in q's dtype."""
    k_all, v_all = cache.write(layer, k, v)  # [B, Hkv, L + N, D], in the cache's dtype
    if q.dtype == torch.bfloat16 and k_all.dtype == torch.float32 and not torch.compiler.is_compiling():
        # a bf16 model's float32 cache (`kv_dtype`): the row-invariant kernel's float32 route, which the op keeps
        # for bf16 inputs (it gives float32 to SDPA)
        out = native_attention.tree_attention_native(q.float(), k_all, v_all, tree_mask, scale)
        return out.to(q.dtype)
    return torch.ops.spectree.tree_attention(q.to(k_all.dtype), k_all, v_all, tree_mask, scale).to(q.dtype)


# ---- batch invariance ------------------------------------------------------------------------------------
# Greedy speculative output equals plain greedy output only if a token's logits do not depend on how many other
# rows share its forward or which cache slots are masked: a tree step (or a packed batch of requests) must
# reproduce, bit for bit, the token-by-token pass of plain decoding. Kernels reduce in shape-dependent orders;
# float32 moves results by ~1e-7 relative, too fine to show in greedy output, but a bfloat16 model rounds them to
# its 8-bit mantissa: measured on SmolLM2-135M in bf16 on CPU, a tree step's logits differed from the sequential
# pass's by up to 0.375 and greedy text diverged within 6-60 tokens. So bf16 weights on CPU run batch-invariant:
# - weight matmuls through the weight-streaming kernel (plugins/stream_linear), invariant by construction: each
#   (row, output) sum has one fixed sequence of operations whatever the other rows are. Where it cannot be built (no
#   C compiler), torch's linear in the blocks described below;
# - attention through a kernel that is row-invariant by construction (plugins/tree_attention/native.py: every
#   reduction runs over a row's keys in their logical order, in a shape that does not depend on the other rows or on
#   where masked keys sit), in float32 over the bf16 cache; where that kernel cannot be built (no C compiler), in
#   float64 through SDPA (`kv_dtype`): the order effects shrink to ~1e-16 relative, ~13 orders below a bf16 rounding
#   step, so the rounded outputs agree (2-3x slower at 16 rows, 4x the cache memory);
# - (torch's route) weight matmuls in blocks of at most INVARIANT_ROWS rows (`linear`): oneDNN's bf16 GEMM gives a
#   row the same result at every row count from 2 to 32 and switches kernels beyond (measured on Intel Xeon with AMX:
#   2-182 elements of a row differ at 48 or 64 rows, none at 1-32).
# - a lone row (plain decoding, a block's tail) takes a GEMV kernel. On Intel Xeon (AMX) it rounds like the GEMM; on
#   AMD EPYC (AVX512-BF16, no AMX) it does not: for inputs of 1536+ features about one row in 20 has an element
#   rounded differently, and greedy speculative text left plain decoding's after 60-100 tokens. There a lone row runs
#   as a 2-row GEMM, only at the shapes that need it: for every shape it cost plain decoding ~12% (SmolLM2-135M),
#   for the one that needs it (the down projection) ~2%.
# What a CPU's kernels do is measured, not assumed (`row_plan`, per weight shape, once per process): whether a lone
# row needs the GEMM, and that every row count then gives each row its lone result. A bfloat16 model checks its
# shapes when it loads and runs in float32 where they fail.
# On CUDA, bfloat16 and float16 weights run batch-invariant too, by other means (`pads_rows`): on an H200, bf16
# SmolLM2 without them gave 5 of 6 greedy speculative answers that left plain decoding's, with them 0 of 6
# (perf/results/2026-12-04-gpu-nvidia-h200*/). cuBLAS picks its kernel by shape, so
# - every weight matmul runs exactly PADDED_ROWS rows (zero-padded; more rows: blocks of PADDED_ROWS): one kernel
#   for a one-token step, a tree step and a prompt chunk, whose rows do not mix (`row_plan` measures that too);
# - attention runs in float64 (`kv_dtype`; the Triton kernel's bf16 blocking depends on N and on where the tree
#   slots sit), as on a CPU without the kernel above;
# - RMSNorm sums its squares in float64 (GPU reductions split a row by the number of rows).
# Its cost there, measured: an 8B-shaped bf16 forward 44 ms against 27-31 ms without it (this eager runtime is
# launch- and host-bound; the weights' bytes alone take 3.8 ms). float16 on CPU gains nothing (its matmuls differ
# from 2 rows on, measured) and runs unchanged with a warning; float32 needs nothing.
# Checked, with negative controls, in tests/test_batch_invariance.py (the CUDA route also on the CPU).
INVARIANT_ROWS = 32  # CPU: blocks of at most this many rows
PADDED_ROWS = 64  # CUDA: every weight matmul exactly this many rows (a draft tree of 63 nodes + its root)
_PADDED_DEVICE_TYPES = ("cuda",)


def pads_rows(device: torch.device) -> bool:
    """Whether batch invariance on `device` pads every weight matmul to PADDED_ROWS rows (see above)."""
    return device.type in _PADDED_DEVICE_TYPES


def batch_invariant(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` run batch-invariant (see above)."""
    if pads_rows(device):
        return dtype in (torch.bfloat16, torch.float16)
    return device.type == "cpu" and dtype == torch.bfloat16


def kv_dtype(dtype: torch.dtype, device: torch.device, head_dim: int) -> torch.dtype:
    """The dtype a target model's KV cache is kept and its attention computed in, for weights in `dtype`. bfloat16 on
    a CPU whose native attention multiplies bfloat16 itself (AVX512-BF16, `rounds_weights`); float32 on other CPUs,
    where that kernel would widen the whole cache to float32 at every call (the same values: a bfloat16 key or value is
    a float32 exactly)."""
    if not batch_invariant(dtype, device):
        return dtype
    native = native_attention.load() if not pads_rows(device) else None
    if native is not None:
        return dtype if native.rounds_weights(head_dim, dtype) else torch.float32
    return torch.float64


QUANT_MAX_ROWS = 16  # above it, a quantized weight multiplies by its source weight (a step's head forwards don't)


class QuantizedWeight:
    """A draft head's weight as drafting reads it, quantized (Int8Weight, Int4Weight; by name in QUANTIZED_WEIGHTS):
    a `source` weight [out, in] and a kernel over a few rows. Each kind also gives `of(weight)`, `supported(dtype,
    device, shape)` and `needs(dtype)`."""

    name: ClassVar[str]  # its DraftSpec.quantization value
    source: torch.Tensor  # [out, in]: the weight it was quantised from

    @property
    def shape(self) -> torch.Size:
        return self.source.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > QUANT_MAX_ROWS:
            return F.linear(x, self.source)
        return self._kernel(flat).reshape(*x.shape[:-1], self.source.shape[0])

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:  # flat [rows, in] -> [rows, out]
        raise NotImplementedError


@dataclass(frozen=True)
class Int8Weight(QuantizedWeight):
    """A weight stored as int8 with one float scale per output row (symmetric, weight-only), multiplied by torch's
    packed CPU kernel (`aten._weight_int8pack_mm`; activations stay in their dtype). For draft heads on CPU: they
    run on a handful of rows per call, so reading their weights is the cost, and int8 halves the bytes of bf16.
    Only what is drafted changes (slightly): verification reads the target's own weights.

    A call over more than QUANT_MAX_ROWS rows (a head's first forward, over the whole prompt) multiplies by the source
    weight instead: the int8 kernel's time grows with the rows from a few on (measured on 2 AMD EPYC cores, bf16, a
    head's matmul shapes: 2x F.linear's at 16 rows, 2.7-3x from 256), and the exact weights only bring the draft
    closer to the trained head's. It is a reference, not a copy: the head keeps its weights anyway."""

    name: ClassVar[str] = "int8"
    q: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out], the activations' dtype
    source: torch.Tensor  # [out, in]: the weight it was quantised from

    @classmethod
    def of(cls, weight: torch.Tensor) -> Int8Weight:  # weight [out, in]
        w = weight.detach().float()
        # The scale as the kernel will read it (in the activations' dtype), nudged up by one rounding step so that
        # rounding it cannot push the row's largest weight past 127 steps: every weight is then within half a step.
        amax = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
        scales = (amax / 127.0 * (1.0 + torch.finfo(weight.dtype).eps)).to(weight.dtype)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scales, weight.detach())

    @staticmethod
    def supported(dtype: torch.dtype, device: torch.device, shape: Sequence[int] | None = None) -> bool:
        """Whether the packed int8 kernel runs for activations of `dtype` on `device` (and, when given, a weight of
        `shape` [out, in]: in bfloat16 `in` a multiple of 16; any other width crashes the process from 2 rows on,
        measured on torch 2.13's CPU kernel)."""
        if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
            return False
        return shape is None or dtype == torch.float32 or shape[1] % 16 == 0

    @staticmethod
    def needs(dtype: torch.dtype) -> str:
        """What `supported` asks of a weight's shape, in words."""
        return f"{dtype} rows a multiple of 16 wide"

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:  # flat [rows, in] -> [rows, out]
        return torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scales)


INT4_GROUP = 32  # inputs sharing one int4 scale and zero
INT4_SHRINK = tuple(1.0 - 0.025 * i for i in range(13))  # range factors searched per group (1.0 .. 0.7)


@dataclass(frozen=True)
class Int4Weight(QuantizedWeight):
    """A weight stored as int4, asymmetric, with a scale and a zero per group of INT4_GROUP inputs of a row
    (weight-only), multiplied by torch's CPU kernel (`aten._weight_int4pack_mm_for_cpu`). Half the bytes of
    `Int8Weight`, at about eight times its rounding error (relative output error ~7.5% against ~1%): what a draft
    head gains in bytes it gives back in tau, and which wins depends on the machine (perf/results/
    2026-12-04-cpu-intel-xeon-2c-head-features/: on 2 Intel Xeon cores drafting 1.05 ms cheaper per step, tau 2-3%
    lower, +1.9% and +0.4% over int8 on two halves of the merge-tuning prompts).

    Each group's range is its [min, max] shrunk by the factor of INT4_SHRINK that gives the group the least squared
    error (its scale and zero rounded as the kernel reads them): against rounding over the whole range, that kept
    0.02 of tau the int4 head had lost (2.89 -> 2.91, int8 2.94). The kernel takes a multiple of 16 output rows:
    others are padded with zero rows, whose outputs are cut off. Calls over more than QUANT_MAX_ROWS rows multiply
    by the source weight, as for `Int8Weight`."""

    name: ClassVar[str] = "int4"
    packed: torch.Tensor  # the int4 values in the kernel's layout (opaque), out padded to a multiple of 16 rows
    scale_zeros: torch.Tensor  # [in / INT4_GROUP, padded out, 2]: each group's scale and zero, the activations' dtype
    source: torch.Tensor  # [out, in]: the weight it was quantised from

    @classmethod
    def of(cls, weight: torch.Tensor) -> Int4Weight:  # weight [out, in]
        inp = weight.shape[1]
        out = -(-weight.shape[0] // 16) * 16
        w = F.pad(weight.detach().float(), (0, 0, 0, out - weight.shape[0]))  # [out, in], zero rows appended
        w = w.reshape(out, inp // INT4_GROUP, INT4_GROUP)  # [out, groups, INT4_GROUP]
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)  # [out, groups, 1] each
        best = None  # (error, low end, step) per group
        for factor in INT4_SHRINK:
            low = lo * factor
            step = ((hi - lo) * factor / 15).clamp(min=torch.finfo(torch.float32).tiny)
            q = torch.round((w - low) / step).clamp(0, 15)
            # the kernel computes (q - 8) * scale + zero, scale and zero in the activations' dtype
            zero = (low + 8 * step).to(weight.dtype).float()
            err = ((q - 8) * step.to(weight.dtype).float() + zero - w).pow(2).sum(-1, keepdim=True)
            if best is None:
                best = (err, low, step)
            else:
                better = err < best[0]
                best = tuple(torch.where(better, new, old) for new, old in zip((err, low, step), best))
        _, low, step = best
        q = torch.round((w - low) / step).clamp(0, 15).to(torch.int32).reshape(out, inp)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scale_zeros = torch.cat([step, low + 8 * step], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
        return cls(packed, scale_zeros, weight.detach())

    @staticmethod
    def supported(dtype: torch.dtype, device: torch.device, shape: Sequence[int] | None = None) -> bool:
        """Whether torch's int4 CPU kernel runs for activations of `dtype` on `device` (and, when given, a weight of
        `shape` [out, in]: `in` a multiple of INT4_GROUP; torch refuses other widths)."""
        if (device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32)
                or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")):
            return False
        return shape is None or shape[1] % INT4_GROUP == 0

    @staticmethod
    def needs(dtype: torch.dtype) -> str:
        """What `supported` asks of a weight's shape, in words."""
        return f"rows a multiple of {INT4_GROUP} wide"

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:  # flat [rows, in] -> [rows, out]
        n = self.source.shape[0]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scale_zeros)
        return out if out.shape[1] == n else out[:, :n]  # [rows, out padded to 16] -> [rows, out]


QUANTIZED_WEIGHTS: dict[str, type[QuantizedWeight]] = {kind.name: kind for kind in (Int8Weight, Int4Weight)}


@dataclass(frozen=True)
class PackedWeight:
    """A CPU weight also held in oneDNN's blocked layout (`mkldnn._reorder_linear_weight`, what torch's compiler does
    to frozen CPU linears). F.linear reorders a bf16 weight on every call, reading and writing it once more than the
    matmul does; a packed copy skips that: measured on SmolLM2-135M in bf16 on 2 cores, a one-token forward 27.8 ->
    21.8 ms and a 16-node tree step 41.4 -> 30.9 ms, logits bit-identical (same kernels). The copy costs the weight's
    bytes again; the plain weight stays for everything else (state dicts, exports, int8 copies), and an in-place edit
    of it (`stale`) sends `linear` back to it."""

    weight: torch.Tensor  # [out, in]
    packed: torch.Tensor  # the same values in oneDNN's layout (an opaque mkldnn tensor)
    # weight._version when packed: an in-place edit of the weight since makes the copy stale. -1: not tracked (an
    # inference-mode tensor has no version counter)
    version: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> PackedWeight:  # weight [out, in]
        version = -1 if weight.is_inference() else weight._version
        return cls(weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), INVARIANT_ROWS), version)

    @property
    def stale(self) -> bool:
        """The weight was written in place after packing (`linear` then multiplies by the weight itself)."""
        return self.version >= 0 and self.weight._version != self.version

    @staticmethod
    def supported(dtype: torch.dtype, device: torch.device) -> bool:
        """Whether weights of `dtype` on `device` are packed: bf16 on a CPU whose oneDNN takes bf16 weights
        (plugins/cpu/ `onednn_bf16`: AVX-512 BW/VL/DQ or AVX-NE-CONVERT), where this torch packs one (tried once)."""
        return (device.type == "cpu" and dtype == torch.bfloat16 and not streams(dtype, device)
                and _packs_bf16())

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # x [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], self.weight.shape[0])


@functools.lru_cache(maxsize=1)
def _packs_bf16() -> bool:
    """Whether this process packs bf16 weights for oneDNN: the CPU's features say so and packing one works (torch
    refuses where its own check of the CPU, or ATEN_CPU_CAPABILITY, says no)."""
    if not (cpu.features().onednn_bf16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), INVARIANT_ROWS)
    except RuntimeError:
        return False
    return True


def streams(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` are multiplied by the weight-streaming kernel (plugins/stream_linear:
    batch-invariant by construction, bfloat16 widened in registers, so it needs neither row blocks nor native bf16);
    built on first call."""
    return stream_linear.covers(dtype, device) and stream_linear.load() is not None


def linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor | QuantizedWeight | PackedWeight,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out]
    """F.linear (a PackedWeight by its packed copy), in blocks of INVARIANT_ROWS rows when the weights run
    batch-invariant; a quantized weight (Int8Weight, Int4Weight) by its kernel (draft heads only: nothing verified
    reads one, so it needs no batch invariance)."""
    if isinstance(weight, QuantizedWeight):
        out = weight.matmul(x)
        return out if bias is None else out + bias
    if isinstance(weight, PackedWeight) and weight.stale:
        weight = weight.weight
    plain = weight.weight if isinstance(weight, PackedWeight) else weight
    # Static tests first (no guard on traced shapes); an exported or compiled graph (the ONNX model TensorRT builds
    # from) runs other kernels: the blocks are for the eager CPU runtime.
    if not torch.compiler.is_compiling() and not pads_rows(x.device):
        out = stream_linear.linear(x, plain, bias)  # CPU: batch-invariant by construction, any row count
        if out is not None:
            return out
    if isinstance(plain, BlockWeight):
        return plain.torch_linear(x, bias)
    if torch.compiler.is_compiling():
        return F.linear(x, plain, bias)
    if not batch_invariant(plain.dtype, plain.device):
        return _matmul(x, weight, bias)
    if pads_rows(plain.device):
        return _padded_linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if 2 <= rows <= INVARIANT_ROWS:
        return _matmul(x, weight, bias)
    return _invariant_linear(x, weight, bias, row_plan(plain.shape, plain.dtype, plain.device).gemm_lone_row)


def _matmul(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return weight.linear(x, bias) if isinstance(weight, PackedWeight) else F.linear(x, weight, bias)


def _invariant_linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor | PackedWeight,  # [out, in]
    bias: torch.Tensor | None,  # [out]
    gemm_lone_row: bool,
) -> torch.Tensor:  # [..., out]
    """`linear`'s batch-invariant path: blocks of at most INVARIANT_ROWS rows, a lone row as a 2-row GEMM when
    `gemm_lone_row`."""
    rows = x.numel() // x.shape[-1]
    if rows == 1 and not gemm_lone_row:
        return _matmul(x, weight, bias)
    blocks = x.reshape(rows, x.shape[-1]).split(INVARIANT_ROWS)
    out = torch.cat([
        _matmul(block.repeat(2, 1), weight, bias)[:1] if block.shape[0] == 1 and gemm_lone_row
        else _matmul(block, weight, bias)  # a GEMM's rows are independent: the copy changes nothing in the first
        for block in blocks
    ])
    return out.view(*x.shape[:-1], weight.shape[0])


def _padded_linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor | PackedWeight,  # [out, in]
    bias: torch.Tensor | None,  # [out]
) -> torch.Tensor:  # [..., out]
    """`linear`'s batch-invariant path on devices that pad (`pads_rows`): matmuls of exactly PADDED_ROWS rows, the
    last block zero-padded, one call per block (a batched call would run as one taller GEMM)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    padded = flat.new_zeros(-(-rows // PADDED_ROWS) * PADDED_ROWS, x.shape[-1])
    padded[:rows] = flat
    out = torch.cat([_matmul(block, weight, bias) for block in padded.split(PADDED_ROWS)])[:rows]
    return out.view(*x.shape[:-1], weight.shape[0])


@dataclass(frozen=True)
class RowPlan:
    """How `linear` keeps a weight shape's rows invariant on this machine (`row_plan`)."""

    gemm_lone_row: bool  # a lone row runs as a 2-row GEMM (its GEMV kernel rounds otherwise)
    error: str | None  # None: each row count 1 .. INVARIANT_ROWS + 1 gives every row its lone result; else what
    #                    differed


# (shape, dtype, device, torch threads) -> RowPlan, measured on random weights of that shape: kernels are picked by
# shape, so one answer serves every layer (and every model) with that shape.
_ROW_PLANS: dict[tuple, RowPlan] = {}


def row_plan(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> RowPlan:
    """The RowPlan for weights of `shape` (out, in), measured once per process and torch thread count.

    Random rows: where two kernels reduce in different orders, about one element in 10^4 lands on the other side of
    a bf16 rounding step, and each check compares 10^5 or more elements."""
    key = (tuple(shape), dtype, device, torch.get_num_threads())
    plan = _ROW_PLANS.get(key)
    if plan is None:
        plan = _ROW_PLANS[key] = _measure_row_plan(tuple(shape), dtype, device)
    return plan


@torch.no_grad()
def _measure_row_plan(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> RowPlan:
    out_f, in_f = shape
    block = PADDED_ROWS if pads_rows(device) else INVARIANT_ROWS
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_f, in_f, generator=g) * in_f**-0.5).to(dtype=dtype, device=device)
    if PackedWeight.supported(dtype, device):  # measured on the kernels the model runs
        weight = PackedWeight.of(weight)
    x = torch.randn(block + 1, in_f, generator=g).to(dtype=dtype, device=device)
    if pads_rows(device):  # a lone row is padded like any other: the check is that rows do not mix
        gemm_lone_row = False
        run = functools.partial(_padded_linear, weight=weight, bias=None)
        alone = torch.cat([run(row[None]) for row in x])  # [rows, out]
    else:
        gemv = torch.cat([_matmul(row[None], weight, None) for row in x])  # [rows, out]
        gemm = torch.cat([_matmul(row[None].repeat(2, 1), weight, None)[:1] for row in x])
        gemm_lone_row = not torch.equal(gemv, gemm)
        alone = gemm if gemm_lone_row else gemv
        run = functools.partial(_invariant_linear, weight=weight, bias=None, gemm_lone_row=gemm_lone_row)
    # Enough row counts to compare at least ~2 * 10^5 elements (every count for small outputs), the last two always.
    step = max(1, (block * out_f) // 200_000)
    for n in sorted({*range(2, block, step), block, block + 1}):
        differ = (run(x[:n]) != alone[:n]).any(dim=-1)
        if bool(differ.any()):
            rows = differ.nonzero().flatten().tolist()[:4]
            return RowPlan(gemm_lone_row, f"a [{n}, {in_f}] x [{in_f}, {out_f}] {str(dtype).removeprefix('torch.')} "
                                          f"matmul gives row(s) {rows} other values than each row alone")
    return RowPlan(gemm_lone_row, None)


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a ragged forward: N new tokens on top of its own cache (B = 1)."""

    cache: KVCache
    tokens: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    tree_mask: torch.Tensor  # [N, ceil(N / 32)] int32 packed
    logits_from: int = 0  # lm_head runs on rows [logits_from, N) only (a prompt chunk needs at most its last row)
    # Or the rows to run it on, chosen from the segment's hidden states once they exist: hidden # [N, H] -> row
    # indices # [M] int64 (a greedy tree step: the nodes verification will likely read, `runtime.verify.likely_path`)
    logit_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    # target layers whose features (see the module docstring) follow the final-norm state in its hidden states;
    # strictly increasing
    feature_layers: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


class AttendingCache:
    """Stands in for a KVCache in a layer's forward and runs the layer's attention itself: stores the N new tokens'
    K/V and attends their queries over what it holds, under masks of its own (the layer's tree_mask is unused)."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [B, Hq, N, D]
        k: torch.Tensor,  # [B, Hkv, N, D]
        v: torch.Tensor,  # [B, Hkv, N, D]
        scale: float,
    ) -> torch.Tensor:  # [B, Hq, N, D]
        raise NotImplementedError


class SegmentCaches(AttendingCache):
    """The caches of a ragged forward's segments, standing in for one cache: `attend` splits the packed rows by
    segment and runs the op once per segment against that segment's cache."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.segments = tuple(segments)
        bounds, start = [], 0
        for seg in self.segments:
            bounds.append((start, start + seg.size))
            start += seg.size
        self.bounds = tuple(bounds)
        self.masks = tuple(seg.tree_mask[None] for seg in self.segments)  # each [1, N_i, words_i]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [1, Hq, T, D], T = sum of N_i
        k: torch.Tensor,  # [1, Hkv, T, D]
        v: torch.Tensor,  # [1, Hkv, T, D]
        scale: float,
    ) -> torch.Tensor:  # [1, Hq, T, D]
        outs = [
            attend(seg.cache, layer, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], mask, scale)
            for seg, (a, b), mask in zip(self.segments, self.bounds, self.masks)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class MLP(_Fused):
    """down(silu(gate(x)) * up(x))."""

    _fused_names = ("gate_proj", "up_proj")
    _out_name = "down_proj"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)
        self._setup_fusion()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.fused_output(x)
        act = rowwise.silu_mul(gate_up)  # one native call on CPU (plugins/rowwise/native.py)
        if act is None:
            gate, up = gate_up.split(self.fused_sizes, dim=-1)
            act = F.silu(gate) * up
        return self.out(act)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)).

    input_norm=False drops input_layernorm (EAGLE-1's draft layer feeds its fused input to attention
    directly); the parameter then does not exist, so its state dict has no input_layernorm.weight.

    Usable on its own with its own KVCache (e.g. KVCache(1, Hkv, D, max_len) and cache_layer=0):
        y = layer(x, positions, cache, cache_layer, tree_mask)
    It writes K/V of the N tokens at slots [cache.length, cache.length + N) of `cache_layer` and does not
    advance the cache. A model running many layers computes RoPE once and passes `cos_sin`.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, input_norm: bool = True) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.rotary = RotaryEmbedding.from_config(config)
        self._prepared: native_layer.Prepared | None = None  # the one-call route's argument block (`_native`)

    def forward(
        self,
        x: torch.Tensor,  # [B, N, H]
        positions: torch.Tensor,  # [B, N] int64
        cache: KVCache,
        cache_layer: int,
        tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,  # each [B, N, D] in x's dtype, from positions
    ) -> torch.Tensor:  # [B, N, H]
        cos, sin = self.rotary(positions, x.dtype) if cos_sin is None else cos_sin
        out = self._native(x, cos, sin, cache, cache_layer, tree_mask)
        if out is not None:
            return out
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, cache, cache_layer, tree_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _native(
        self,
        x: torch.Tensor,  # [B, N, H]
        cos: torch.Tensor,  # [B, N, D]
        sin: torch.Tensor,  # [B, N, D]
        cache: Any,
        cache_layer: int,
        tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32
    ) -> torch.Tensor | None:  # [B, N, H]; None: the torch route runs
        """The whole layer in one native call (plugins/decoder_layer: the torch route's kernels, the same bits) for a
        bfloat16 sequence on the CPU with its own KVCache; None elsewhere."""
        return native_run((self,), cache_layer, x, cos, sin, cache, tree_mask)

    def native_prepared(self) -> native_layer.Prepared | None:
        """This layer's argument block for the one-call route, made again when its weights changed; None where the
        call does not take them."""
        # Called for every layer of every forward: the modules' dicts read directly (nn.Module's __getattr__ is
        # ~1 us a lookup, a measurable share of a one-token step)
        mods = self._modules
        attn, mlp = mods["self_attn"], mods["mlp"]
        o_proj, down_proj = attn._modules["o_proj"], mlp._modules["down_proj"]
        qkv_w, o_w = attn._weights(o_proj._parameters["weight"])
        gu_w, down_w = mlp._weights(down_proj._parameters["weight"])
        norm_in, norm_post = mods["input_layernorm"], mods["post_attention_layernorm"]
        norms = (norm_in._parameters["weight"], norm_post._parameters["weight"])
        matrices = ((qkv_w, attn._buffers["fused_bias"]), (o_w, o_proj._parameters["bias"]),
                    (gu_w, mlp._buffers["fused_bias"]), (down_w, down_proj._parameters["bias"]))
        tensors = (*norms, *(t for pair in matrices for t in pair if t is not None))
        prepared = self._prepared
        if prepared is None or not prepared.current(tensors):
            prepared = self._prepared = native_layer.prepare(
                norms, norm_in.eps, matrices, (attn.num_heads, attn.num_kv_heads, attn.head_dim), attn.scale)
        return prepared


def native_run(
    layers: Sequence[DecoderLayer],  # consecutive layers, the first one's cache layer `first`
    first: int,
    x: torch.Tensor,  # [B, N, H]
    cos: torch.Tensor,  # [B, N, D]
    sin: torch.Tensor,  # [B, N, D]
    cache: Any,
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32
) -> torch.Tensor | None:  # [B, N, H]; None: the layers run one by one through the torch route
    """`layers` in one native call (`native_layer.stack_forward`) where `native_ready` says they can and each takes its
    weights (`DecoderLayer.native_prepared`); CacheError where their cache layers are out of range."""
    if not native_ready(x, cache, layers):
        return None
    stop = first + len(layers)
    if not 0 <= first < stop <= cache.num_layers:
        raise CacheError(f"layers [{first}, {stop}) out of range for a cache with {cache.num_layers} layers")
    prepared = [layer.native_prepared() for layer in layers]
    if any(p is None for p in prepared):
        return None
    cache.open(x.shape[1])
    out = native_layer.stack_forward(prepared, x[0].contiguous(), cos[0].contiguous(), sin[0].contiguous(),
                                     cache.k[first:stop, 0], cache.v[first:stop, 0], cache.length,
                                     tree_mask[0].contiguous())
    return out.unsqueeze(0)


def native_ready(x: torch.Tensor, cache: Any, layers: Sequence[DecoderLayer]) -> bool:  # x [B, N, H]
    """Whether `layers` can run through the one-call route (plugins/decoder_layer) on x with `cache`: a bfloat16
    sequence (B = 1) on the CPU with its own KVCache (in x's dtype or float32, `kv_dtype`), nothing recording
    gradients or compiling, every layer with its input norm, and the kernels built."""
    return (x.dtype in native_layer.DTYPES and x.device.type == "cpu" and x.shape[0] == 1
            and type(cache) is KVCache and cache.dtype in (x.dtype, torch.float32) and cache.batch == 1
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or any(
                layer.mlp.fused_weight.requires_grad for layer in layers)))
            and all(layer.input_layernorm is not None for layer in layers)
            and native_attention.load() is not None and native_layer.load() is not None)


class Backbone(nn.Module):
    """HF's `model.` submodule: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@functools.lru_cache(maxsize=64)
def _packed_tril(n: int) -> torch.Tensor:  # [n, ceil(n / 32)] int32, shared: never written to
    return pack_mask(torch.ones(n, n, dtype=torch.bool).tril())


def causal_mask(n: int, batch: int = 1, device: torch.device | str = "cpu") -> torch.Tensor:
    """Packed lower-triangular mask for a causal chunk of n tokens: # [batch, n, ceil(n / 32)] int32 (read-only:
    small sizes are cached and shared)."""
    return _packed_tril(n).to(device).expand(batch, n, mask_words(n)).contiguous()


class TargetModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        """Uninitialised parameters; use from_pretrained / from_state (or load_state) to fill them."""
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.rotary = RotaryEmbedding.from_config(config)
        self.output = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)
        self._packed_lm_head: PackedWeight | None = None  # set by pack_weights(), dropped when the weights change
        self._block_lm_head: BlockWeight | None = None  # set by quantize_weights(), likewise
        self.weight_format: str | None = None  # "q8" / "q4" after quantize_weights(); None: the dtype's own weights
        self.register_load_state_dict_post_hook(lambda module, _keys: module._drop_weight_copies())

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: str | torch.dtype | None = None, device: torch.device | str = "cpu"
    ) -> TargetModel:
        """Load an HF checkpoint directory; dtype defaults to the config's (torch_dtype / dtype)."""
        config, tensors = load_checkpoint(path, dtype=dtype, device=device)
        return cls.from_state(config, tensors, source=str(path))

    @classmethod
    def from_state(
        cls, config: ModelConfig, tensors: dict[str, torch.Tensor], source: str = "state dict"
    ) -> TargetModel:
        """Build from HF-named tensors (validated against config; cast to config.dtype, device kept)."""
        with torch.device("meta"):
            model = cls(config)
        model.load_state(tensors, source=source)
        return model

    def load_state(self, tensors: dict[str, torch.Tensor], source: str = "state dict") -> None:
        """Replace every parameter with HF-named `tensors` (validated; floats cast to config.dtype)."""
        valid = validate_tensors(self.config, tensors, source=source)
        devices = {t.device for t in valid.values()}
        if len(devices) != 1:
            raise CheckpointError(f"{source}: tensors are spread over several devices {sorted(map(str, devices))}")
        dtype = self.config.torch_dtype
        state = {(_OUTPUT if n == LM_HEAD else n): t.to(dtype) for n, t in valid.items()}
        self.load_state_dict(state, strict=True, assign=True)
        self.to(devices.pop())  # rotary buffers follow the weights
        self.requires_grad_(False)
        self.eval()
        self._ensure_row_invariance()
        if PackedWeight.supported(self.dtype, self.device):
            self.pack_weights()
        if rowwise.covers(self.dtype, self.device):
            # built (or read from the cache) now rather than inside the first request; None: torch's ops run
            rowwise.load()

    def pack_weights(self) -> None:
        """Keep oneDNN-packed copies of every weight the forward multiplies by (`PackedWeight`: faster matmuls, the
        same values; the weights' bytes again). Dropped by any later load or move of the weights."""
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        self._packed_lm_head = PackedWeight.of(self.lm_head_weight)

    def quantize_weights(self, kind: str) -> None:
        """Run every weight matmul of the forward (q/k/v, o, gate/up, down, lm_head) on block-quantised copies:
        "q8" (int8 in blocks of 32 with a scale, GGUF Q8_0's layout) or "q4" (4-bit in blocks of 32 with a scale and
        a minimum, Q4_1's, times activations quantised to int8 per block as llama.cpp's Q4_1 matmuls do), through the
        weight-streaming kernel. The quantised model is then the target: plain and
        speculative decoding both run it, and losslessness holds against it. The embedding lookup keeps its dense
        rows. Undone by any later load or move of the weights. CPU only (`streams`)."""
        if kind not in TARGET_QUANTIZATIONS:
            raise ConfigError(f"target quantization must be one of {', '.join(TARGET_QUANTIZATIONS)}, got {kind!r}")
        if not streams(self.dtype, self.device):
            raise ConfigError(
                f"target quantization {kind!r} runs through the weight-streaming kernel, which takes "
                f"{self.dtype} weights on {self.device.type}: "
                f"{stream_linear.unavailable() or 'expected a float32 or bfloat16 model on the cpu'}")
        bad = sorted({f"[{o}, {i}]" for o, i in self._matmul_shapes() if i % stream_linear.Q_BLOCK})
        if bad:
            raise ConfigError(f"target quantization {kind!r} needs weight rows a multiple of {stream_linear.Q_BLOCK} "
                              f"wide; this model has {', '.join(bad)}")
        for layer in self.model.layers:
            layer.self_attn.quantize_blocks(kind)
            layer.mlp.quantize_blocks(kind)
        self._block_lm_head = stream_linear.QUANT_FORMATS[kind](self.lm_head_weight)
        self.weight_format = kind

    def _matmul_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of every weight matmul of the forward (each layer's are the first's)."""
        layer = self.model.layers[0]
        return [tuple(w.shape) for w in (layer.self_attn.fused_weight, layer.self_attn.o_proj.weight,
                                         layer.mlp.fused_weight, layer.mlp.down_proj.weight, self.lm_head_weight)]

    def _drop_weight_copies(self) -> None:
        self._packed_lm_head = self._block_lm_head = self.weight_format = None

    def _apply(self, fn, recurse=True):
        self._drop_weight_copies()
        return super()._apply(fn, recurse)

    def _ensure_row_invariance(self) -> None:
        """Weights that run batch-invariant (bfloat16 on CPU; bfloat16 / float16 on CUDA): check that this machine's
        matmul kernels give each row its lone-row result at the model's weight shapes (`row_plan`); where they do
        not, run in float32 (with a warning), whose rounding needs no invariance: a 16-bit tree step would not
        reproduce plain decoding and greedy output would change; likewise bfloat16 on a CPU without native bf16
        (plugins/cpu/), whose emulated bf16 matmuls are also ~10-20x slower than float32 (the loaders refuse to
        run one so when asked: runtime.config.choose_dtype). float16 on CPU runs as asked, with a warning that
        greedy output may change."""
        if not batch_invariant(self.dtype, self.device):
            if self.dtype in (torch.bfloat16, torch.float16):
                warnings.warn(
                    f"{self.config.dtype} weights on {self.device.type} do not run batch-invariant in this runtime: a "
                    "tree step can round a token's logits differently from plain decoding's one-token steps, so "
                    "greedy speculative output may differ from plain greedy decoding (float32 keeps it identical)",
                    RuntimeWarning, stacklevel=3,
                )
            return
        if streams(self.dtype, self.device):
            self._warn_without_native_attention()
            return
        if self.dtype == torch.bfloat16 and not pads_rows(self.device) and not cpu.features().native_bf16:
            self._run_in_float32(f"bfloat16 on this cpu: {cpu.features().missing_bf16()}")
            return
        for shape in sorted(set(self._matmul_shapes())):
            error = row_plan(shape, self.dtype, self.device).error
            if error is not None:
                self._run_in_float32(
                    f"{self.config.dtype} matmuls on this {self.device.type} are not row-invariant ({error})")
                return
        self._warn_without_native_attention()

    def _warn_without_native_attention(self) -> None:
        if not pads_rows(self.device) and native_attention.load() is None:
            warnings.warn(
                f"the row-invariant attention kernel is unavailable ({native_attention.unavailable()}): this bfloat16 "
                "model attends in float64 instead (slower, 4x the KV cache memory)", RuntimeWarning, stacklevel=3,
            )

    def _run_in_float32(self, why: str) -> None:
        warnings.warn(
            f"{why}: a tree step would not reproduce plain decoding "
            "bit for bit, so the model runs in float32 (dtype 'auto' or 'float32' chooses so without this warning)",
            RuntimeWarning, stacklevel=4,
        )
        self.config = self.config.with_dtype("float32")
        self.to(torch.float32)

    def new_cache(self, max_len: int, batch: int = 1, capacity: int | None = None) -> KVCache:
        """An empty cache for up to max_len positions (at most config.max_context), on the model's device, in the
        dtype `kv_dtype`; capacity: slots allocated now (None: all max_len; the cache grows on demand, see KVCache)."""
        c = self.config
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 0 < max_len <= c.max_context:
            raise CacheError(
                f"cache max_len must be in [1, {c.max_context}] (the model's max_context"
                f"{', capped by sliding_window' if c.sliding_window else ''}), got {max_len!r}"
            )
        return KVCache(
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len, batch, self.kv_dtype, self.device,
            capacity,
        )

    def cache_bytes(self, slots: int) -> int:
        """Bytes of a batch-1 cache (`new_cache`) holding `slots` positions."""
        c = self.config
        return KVCache.bytes_for(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, slots, self.kv_dtype)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's and attention's dtype (`kv_dtype`)."""
        return kv_dtype(self.dtype, self.device, self.config.head_dim)

    # ---- compute ------------------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens # [...] int64 -> # [..., H] in the model dtype."""
        return self.model.embed_tokens(tokens)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """# [V, H]; the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.output is None else self.output.weight

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden # [..., H] (final-norm output) -> logits # [..., V] float32."""
        head = self._block_lm_head or self._packed_lm_head
        return linear(hidden, self.lm_head_weight if head is None else head).float()

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, N] int64
        positions: torch.Tensor,  # [B, N] int64
        cache: KVCache,
        tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32 packed
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [B, N, V] float32, hidden [B, N, H]
        """Run N new tokens over the cache; writes their K/V at [cache.length, +N), does not advance it."""
        self._check_inputs(tokens, positions, cache, tree_mask)
        return self.run(tokens, positions, cache, tree_mask)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any, tree_mask: torch.Tensor):
        """`forward` without its input checks (which are data-dependent, so graph exporters cannot trace them).

        `cache` is anything with KVCache's `write(layer, k_new, v_new) -> (k_all, v_all)`.
        """
        hidden = self.hidden_states(tokens, positions, cache, tree_mask)
        return self.lm_head(hidden), hidden

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any,
                      tree_mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder stack up to the final norm: # [B, N, H] (tree_mask is None for SegmentCaches)."""
        return self._stack(tokens, positions, cache, tree_mask)[0]

    def _stack(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any, tree_mask: torch.Tensor | None,
               feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final-norm hidden states # [B, N, H] and the features of `feature_layers` (ascending) # [B, N, H]
        each."""
        x = self.embed(tokens)
        cos_sin = self.rotary(positions, x.dtype)
        features = []
        layers = self.model.layers
        bounds = [0, *(i for i in feature_layers if 0 < i < len(layers)), len(layers)]
        for start, stop in zip(bounds, bounds[1:]):  # the runs of layers between feature layers
            if start in feature_layers:
                features.append(x)
            out = self._native_run(x, cos_sin, cache, tree_mask, start, stop)
            if out is not None:
                x = out
                continue
            for i in range(start, stop):
                x = layers[i](x, positions, cache, i, tree_mask, cos_sin)
        if len(layers) in feature_layers:
            features.append(x)
        return self.model.norm(x), features

    def _native_run(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], cache: Any,
                    tree_mask: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
        """Layers [start, stop) on x # [1, N, H] in one native call (`native_layer.stack_forward`); None where the
        one-call route does not run (`native_ready`), and the layers then run one by one."""
        if tree_mask is None:
            return None
        return native_run(self.model.layers[start:stop], start, x, *cos_sin, cache, tree_mask)

    @torch.no_grad()
    def forward_segments(self, segments: Sequence[Segment],
                         check: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward over several sequences (see the module docstring); per segment, in order,
        (logits # [N - logits_from, V] float32, or [M, V] for the rows its `logit_rows` picked, hidden # [N, H], or
        [N, H * (1 + F)] with its F `feature_layers`' features after the final-norm state). Writes each segment's K/V
        at [cache.length, +N) of its cache, advances none of them. check=False skips `check_segment` (for a caller
        that ran it on each segment already)."""
        if not segments:
            raise RequestError("forward_segments needs at least one segment")
        if check:
            for seg in segments:
                self.check_segment(seg)
        tokens = torch.cat([seg.tokens for seg in segments])[None]  # [1, T]
        positions = torch.cat([seg.positions for seg in segments])[None]  # [1, T]
        caches = SegmentCaches(segments)
        layers = tuple(sorted({j for seg in segments for j in seg.feature_layers}))
        if len(segments) == 1:  # its own cache and mask: the same attention, and the one-call layers can run
            hidden, features = self._stack(tokens, positions, segments[0].cache, segments[0].tree_mask[None], layers)
        else:
            hidden, features = self._stack(tokens, positions, caches, None, layers)
        hidden = hidden[0]  # [T, H]
        rows = [hidden[a:b][seg.logit_rows(hidden[a:b])] if seg.logit_rows is not None
                else hidden[a + seg.logits_from:b] for seg, (a, b) in zip(segments, caches.bounds)]
        wanted = [r.shape[0] for r in rows]
        whole = all(seg.logits_from == 0 and seg.logit_rows is None for seg in segments)
        picked = hidden if whole else torch.cat(rows)  # [sum wanted, H]
        logits = self.lm_head(picked).split(wanted)  # one matmul for every segment's rows
        if not layers:
            return [(lg, hidden[a:b]) for lg, (a, b) in zip(logits, caches.bounds)]
        return [(lg, torch.cat([hidden[a:b], *(features[layers.index(j)][0, a:b] for j in seg.feature_layers)], -1))
                for lg, seg, (a, b) in zip(logits, segments, caches.bounds)]

    def check_segment(self, seg: Segment) -> None:
        """RequestError / CacheError unless `seg` fits this model (the checks of `forward`, for one sequence)."""
        if seg.tokens.ndim != 1 or seg.positions.ndim != 1 or seg.tree_mask.ndim != 2:
            raise RequestError(
                f"a segment takes tokens [N], positions [N] and tree_mask [N, words], got "
                f"{tuple(seg.tokens.shape)}, {tuple(seg.positions.shape)}, {tuple(seg.tree_mask.shape)}"
            )
        n = seg.size
        if isinstance(seg.logits_from, bool) or not isinstance(seg.logits_from, int) or not 0 <= seg.logits_from <= n:
            raise RequestError(f"segment logits_from must be an int in [0, {n}], got {seg.logits_from!r}")
        if seg.logit_rows is not None and (seg.logits_from != 0 or not callable(seg.logit_rows)):
            raise RequestError(f"segment logit_rows must be callable and logits_from 0 with it, got "
                               f"{type(seg.logit_rows).__name__} and logits_from {seg.logits_from}")
        check_feature_layers(seg.feature_layers, self.config.num_hidden_layers, "segment feature_layers")
        self._check_inputs(seg.tokens[None], seg.positions[None], seg.cache, seg.tree_mask[None])

    def prefill(self, tokens: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal pass over tokens # [B, P] at positions cache.length.. and commit them all.

        Returns logits # [B, P, V] float32 and hidden # [B, P, H].
        """
        b, p = tokens.shape
        start = cache.length
        positions = torch.arange(start, start + p, device=tokens.device).expand(b, p)
        logits, hidden = self.forward(tokens, positions, cache, causal_mask(p, b, tokens.device))
        cache.advance(p)
        return logits, hidden

    def _check_inputs(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, tree_mask: torch.Tensor
    ) -> None:
        c = self.config
        if tokens.ndim != 2 or tokens.shape[1] == 0 or tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise RequestError(
                f"tokens must be a non-empty [B, N] integer tensor, got {tokens.dtype} {tuple(tokens.shape)}"
            )
        b, n = tokens.shape
        if positions.shape != tokens.shape or positions.is_floating_point():
            raise RequestError(
                f"positions must be an integer tensor of shape {(b, n)}, got {positions.dtype} {tuple(positions.shape)}"
            )
        expected_mask = (b, n, mask_words(n))
        if tree_mask.dtype != torch.int32 or tuple(tree_mask.shape) != expected_mask:
            raise RequestError(
                f"tree_mask must be packed int32 of shape {expected_mask}, "
                f"got {tree_mask.dtype} {tuple(tree_mask.shape)}"
            )
        layout = (c.num_hidden_layers, b, c.num_key_value_heads, c.head_dim, self.kv_dtype)
        got = (cache.num_layers, cache.batch, cache.num_kv_heads, cache.head_dim, cache.dtype)
        if got != layout:
            raise CacheError(
                f"cache (layers, batch, kv heads, head_dim, dtype) = {got} does not fit this model: {layout}"
            )
        cache.check_room(n)
        # One host sync; an out-of-range id would otherwise be a device-side assert on GPU.
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= c.vocab_size:
            raise RequestError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {c.vocab_size})")

def check_feature_layers(layers: Any, num_layers: int, what: str,
                         error: type[Exception] = RequestError) -> tuple[int, ...]:
    """`layers` as a tuple of feature layers (see the module docstring) of a model with `num_layers` decoder layers:
    strictly increasing integers in [0, num_layers]; `error` naming `what` otherwise."""
    if not isinstance(layers, tuple) or any(isinstance(j, bool) or not isinstance(j, int) for j in layers) or \
            any(not 0 <= j <= num_layers for j in layers) or list(layers) != sorted(set(layers)):
        raise error(f"{what}: got {layers!r}, expected a tuple of strictly increasing layer indices in "
                           f"[0, {num_layers}] (the model's num_hidden_layers)")
    return layers


__all__ = [
    "RMSNorm", "Attention", "MLP", "DecoderLayer", "Backbone", "TargetModel", "Segment", "AttendingCache",
    "SegmentCaches", "attend",
    "causal_mask", "kv_dtype", "batch_invariant", "pads_rows", "linear", "INVARIANT_ROWS", "PADDED_ROWS", "RowPlan",
    "row_plan", "PackedWeight", "check_feature_layers",
]
