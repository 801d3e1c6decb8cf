"""An EAGLE draft layer's whole forward on int8 weights in one native call (eagle_layer.c), for CPU drafting: EAGLE-1's
layer (fc, then a decoder layer without input norm) or EAGLE-3's midlayer (attention over the normed [embeddings |
features]).

Why: a speculative step drafts with three head forwards of a few rows each (the accepted tokens' catch-up, then one
per tree level), right after a target forward has streamed the target's weights through the caches. In torch each
forward is ~60 small ops (int8 matmuls, RoPE, the cache write, a masked attention, norm, SiLU, copies), and their
dispatch, not the 4 MB of int8 weights, was most of its time: on SmolLM2-135M's head on 2 AMD EPYC cores, ~1.3 ms
for a 2-row forward with cold caches against ~0.2 ms to read the weights; drafting went from 4.2 to 2.9 ms per step
(commit 79251af). Here the forward is one call: the matmuls multiply a few rows into each int8 weight row as it
streams by (AVX-512 where the CPU has it, else AVX2 + FMA, else portable loops), and everything between them runs
on float32 rows in place. On an AVX2-only EPYC the AVX2 route runs the head's int8 matmuls 2-3.5x faster than the
portable loops (the 8192-row draft lm_head: 0.22 ms for one row, at the machine's bandwidth).

Arithmetic: the torch route rounds activations to the model's dtype (bf16) between ops; this keeps float32 from the
layer's input to its output, and writes the new keys and values to the cache in the cache's dtype (as the torch
route does) before attending over it. Drafts may differ from the torch route's where two candidates are within a
rounding step; what verification accepts never depends on them (the target checks every drafted token).

Build: `plugins/native_build.py` (the system C compiler, `-O3 -march=native` with OpenMP, cached). Where no compiler
works, `load()` gives None, `unavailable()` says why, and the head keeps its torch route.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from plugins import native_build

SOURCE = Path(__file__).with_name("eagle_layer.c")
CACHE_DTYPES = (torch.float32, torch.bfloat16)
# The kernel's matmuls read their input in chunks of 32 values (2 x 16 lanes): every input width must be a multiple.
WIDTH_MULTIPLE = 32


@dataclass(frozen=True)
class Int8Matrix:
    """A weight as the kernel reads it: int8 values [out, in] with a float32 scale per output row (w ~= scale * q)
    and an optional float32 bias [out]."""

    q: torch.Tensor  # [out, in] int8, contiguous
    scale: torch.Tensor  # [out] float32
    bias: torch.Tensor | None = None  # [out] float32

    @classmethod
    def of(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Matrix:
        as_f32 = (lambda t: None if t is None else t.detach().to(torch.float32).contiguous())
        return cls(q.detach().contiguous(), as_f32(scale), as_f32(bias))


@dataclass(frozen=True)
class EagleLayerWeights:
    """What the kernel needs of an EAGLE head's one decoder layer (o_proj and MLP without bias): EAGLE-1's (`fc`
    given; no input norm) or EAGLE-3's midlayer (`input_norms` given: attention over the normed [embeddings |
    features], 2H wide)."""

    fc: Int8Matrix | None  # EAGLE-1: [H, 2H]: [embeddings | features] -> H; None for EAGLE-3
    qkv: Int8Matrix  # [(Hq + 2 Hkv) D, H] (EAGLE-1) or [(Hq + 2 Hkv) D, 2H] (EAGLE-3): q | k | v
    o: Int8Matrix  # [H, Hq D]
    norm: torch.Tensor  # [H] float32: the post-attention RMSNorm's weight
    eps: float  # every RMSNorm's
    gate_up: Int8Matrix  # [2 I, H]: gate | up
    down: Int8Matrix  # [H, I]
    inv_freq: torch.Tensor  # [D / 2] float32: RoPE's frequencies, scaling folded in
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # EAGLE-3: the embeddings' (input_layernorm) and features' (hidden_norm) RMSNorm weights, each [H] float32
    input_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    norm_before_residual: bool = False  # EAGLE-3: the residual is the features' norm, not the features

    @property
    def hidden(self) -> int:
        return self.o.q.shape[0]

    @property
    def intermediate(self) -> int:
        return self.down.q.shape[1]

    def unsupported(self) -> str | None:
        """Why the kernel cannot run these weights (None: it can)."""
        h, d, hq, hkv = self.hidden, self.head_dim, self.num_heads, self.num_kv_heads
        if (self.fc is None) == (self.input_norms is None):
            return "exactly one of fc (EAGLE-1) and input_norms (EAGLE-3) must be given"
        widths = (("hidden size", h), ("intermediate size", self.intermediate), ("heads x head size", hq * d))
        for name, width in widths:
            if width % WIDTH_MULTIPLE:
                return f"{name} {width} is not a multiple of {WIDTH_MULTIPLE}"
        if d % 2 or hq % hkv:
            return f"head size {d} must be even and {hq} query heads a multiple of {hkv} KV heads"
        attention_in = h if self.fc is not None else 2 * h
        shapes = {"qkv": (self.qkv.q, ((hq + 2 * hkv) * d, attention_in)), "o": (self.o.q, (h, hq * d)),
                  "gate_up": (self.gate_up.q, (2 * self.intermediate, h)),
                  "down": (self.down.q, (h, self.intermediate))}
        if self.fc is not None:
            shapes["fc"] = (self.fc.q, (h, 2 * h))
        for name, (q, shape) in shapes.items():
            if tuple(q.shape) != shape or q.dtype != torch.int8 or q.device.type != "cpu":
                return f"{name} is {tuple(q.shape)} {q.dtype} on {q.device}, expected {shape} int8 on cpu"
        for name, t in zip(("input_layernorm", "hidden_norm"), self.input_norms or ()):
            if tuple(t.shape) != (h,) or t.dtype != torch.float32:
                return f"{name} is {tuple(t.shape)} {t.dtype}, expected ({h},) float32"
        return None


@dataclass(frozen=True)
class Kernels:
    """The loaded library's functions, argument types set."""

    layer: ctypes._CFuncPtr  # spectree_eagle_layer
    matmul: ctypes._CFuncPtr  # spectree_qmatmul


def bind(lib: ctypes.CDLL) -> Kernels:
    """The kernels of a built eagle_layer library, argument types set."""
    fn = lib.spectree_eagle_layer
    fn.restype = ctypes.c_int
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.argtypes = [ptr, i64, i64, ptr, ptr,  # x, n, hidden, positions, inv_freq
                   ptr, ptr, ptr, ptr, ptr, ctypes.c_int,  # fc q/scale/bias, EAGLE-3's two norms, norm_before_residual
                   ptr, ptr, ptr, ptr, ptr,  # qkv q/scale/bias, o q/scale
                   ptr, f32, ptr, ptr, i64, ptr, ptr,  # norm, eps, gate_up q/scale, intermediate, down q/scale
                   i64, i64, i64, f32,  # heads, kv heads, head size, attention scale
                   ptr, ptr, i64, i64, ctypes.c_int,  # k, v cache, their head and slot strides, bf16
                   i64, i64, ptr, i64, ptr]  # length, base, visible, its row stride, out
    matmul = lib.spectree_qmatmul
    matmul.restype = None
    matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr]  # x, rows, in, q, scale, bias, out, y
    return Kernels(fn, matmul)


def _build() -> Kernels:
    return bind(native_build.build(SOURCE, "eagle_layer")[0])


_library = native_build.Lazy(_build)


def load() -> Kernels | None:
    """The kernels, built on first call; None where they cannot be built (see `unavailable`)."""
    return _library.get()


def unavailable() -> str | None:
    """Why `load()` gave None (None while it has not been tried or when it worked)."""
    return _library.failure


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _kernels(kernels: Kernels | None) -> Kernels:
    kernels = kernels or load()
    if kernels is None:
        raise RuntimeError(f"the native EAGLE layer is unavailable: {unavailable()}")
    return kernels


def matmul(
    weight: Int8Matrix,  # [out, in], in a multiple of WIDTH_MULTIPLE
    x: torch.Tensor,  # [rows, in], any float dtype
    kernels: Kernels | None = None,  # None: this CPU's build (`load`); tests pass another build's
) -> torch.Tensor:  # [rows, out] float32
    """x times the int8 weight (its scales and bias applied) in float32: each weight row is read once per four rows of
    x (the draft output layer over a step's few rows)."""
    rows, width = x.shape
    if width != weight.q.shape[1] or width % WIDTH_MULTIPLE:
        raise ValueError(f"x must be [rows, {weight.q.shape[1]}] (a multiple of {WIDTH_MULTIPLE}), "
                         f"got {tuple(x.shape)}")
    x = x.to(torch.float32).contiguous()
    out = torch.empty(rows, weight.q.shape[0], dtype=torch.float32)
    _kernels(kernels).matmul(x.data_ptr(), rows, width, weight.q.data_ptr(), weight.scale.data_ptr(), _ptr(weight.bias),
                      weight.q.shape[0], out.data_ptr())
    return out


def eagle_layer(
    weights: EagleLayerWeights,
    x: torch.Tensor,  # [n, 2H]: embeddings | features, any float dtype
    positions: torch.Tensor,  # [n] int64
    k_cache: torch.Tensor,  # [Hkv, slots, D]: the layer's keys (float32 or bfloat16), slots >= length + n
    v_cache: torch.Tensor,  # [Hkv, slots, D], k_cache's dtype and strides
    length: int,  # slots [0, length) hold earlier keys; the n new ones are written at [length, length + n)
    base: int,  # every row sees slots [0, base)
    visible: torch.Tensor,  # [n, length + n - base] bool: which of slots [base, length + n) each row sees
    kernels: Kernels | None = None,  # None: this CPU's build (`load`); tests pass another build's
) -> torch.Tensor:  # [n, H] float32
    """The layer's output for n rows (module doc); its keys and values are written into the caches. Raises where the
    kernel is unavailable or an argument does not fit."""
    n, h = x.shape[0], weights.hidden
    hkv, d = weights.num_kv_heads, weights.head_dim
    if tuple(x.shape) != (n, 2 * h) or tuple(positions.shape) != (n,) or positions.dtype != torch.int64:
        raise ValueError(f"x must be [n, {2 * h}] and positions [n] int64, got {tuple(x.shape)} and "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if (k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype or k_cache.stride() != v_cache.stride()
            or k_cache.shape != v_cache.shape or k_cache.shape[0] != hkv or k_cache.shape[2] != d
            or k_cache.stride(2) != 1 or k_cache.shape[1] < length + n):
        raise ValueError(f"k/v caches must be [{hkv}, >= {length + n}, {d}] with unit last stride, alike, in one of "
                         f"{[str(t) for t in CACHE_DTYPES]}; got {tuple(k_cache.shape)} {k_cache.dtype}")
    if not 0 <= base <= length or tuple(visible.shape) != (n, length + n - base):
        raise ValueError(f"visible must be [{n}, {length + n - base}] for base {base} <= length {length}, "
                         f"got {tuple(visible.shape)}")
    x = x.to(torch.float32).contiguous()
    positions = positions.contiguous()
    vis = visible.to(torch.uint8).contiguous()
    out = torch.empty(n, h, dtype=torch.float32)
    w = weights
    fc, norms = w.fc, w.input_norms or (None, None)
    rc = _kernels(kernels).layer(x.data_ptr(), n, h, positions.data_ptr(), w.inv_freq.data_ptr(),
            _ptr(fc and fc.q), _ptr(fc and fc.scale), _ptr(fc and fc.bias), _ptr(norms[0]), _ptr(norms[1]),
            int(w.norm_before_residual), w.qkv.q.data_ptr(), w.qkv.scale.data_ptr(),
            _ptr(w.qkv.bias), w.o.q.data_ptr(), w.o.scale.data_ptr(), w.norm.data_ptr(), w.eps,
            w.gate_up.q.data_ptr(), w.gate_up.scale.data_ptr(), w.intermediate, w.down.q.data_ptr(),
            w.down.scale.data_ptr(), w.num_heads, hkv, d, d**-0.5,
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
            int(k_cache.dtype == torch.bfloat16), length, base, vis.data_ptr(), vis.shape[1], out.data_ptr())
    if rc != 0:
        raise MemoryError("eagle_layer: the kernel could not allocate its scratch memory")
    return out


__all__ = ["CACHE_DTYPES", "EagleLayerWeights", "Int8Matrix", "Kernels", "SOURCE", "WIDTH_MULTIPLE", "bind",
           "eagle_layer", "load", "matmul", "unavailable"]
