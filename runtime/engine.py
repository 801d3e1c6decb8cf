"""Engine directories: what `python -m builder build` writes and `runtime.load(engine_dir)` serves.

Layout (FORMAT_VERSION 2; every file except engine.json is listed in engine.json["files"] with its sha256):

    engine.json                  the manifest: format version, model config, dtype, drafter (kind, config,
                                 tree), limits, TensorRT-LLM / ONNX / TensorRT stage records, provenance, files
    config.json                  the target's Hugging Face config.json (and generation_config.json), verbatim
    tokenizer.json ...           the tokenizer files, verbatim
    trtllm_checkpoint/           TensorRT-LLM unified checkpoint: config.json + rank{N}.safetensors, in a dtype
                                 TensorRT-LLM supports (float16 / bfloat16; engine.json "trtllm"."dtype")
    target/model.safetensors     the target's weights (Hugging Face names) in the runtime dtype, only when that is
                                 not the TensorRT-LLM checkpoint's dtype (a float32 runtime)
    draft/                       drafter weights in their public format (Medusa: FasterDecoding,
                                 EAGLE: SafeAILab), in the engine dtype, read by runtime/drafters/
    model.onnx (+ .data)         the target's verification step, attention as the tree-attention plugin node
    trtllm-build.sh              the TensorRT-LLM 1.2 build commands for trtllm_checkpoint/
    model.plan                   serialized TensorRT engine (only where TensorRT was importable at build time)

The torch backend reads the target's weights back from trtllm_checkpoint/ (re-assembling tensor-parallel shards
exactly) when it is in the runtime dtype, so that checkpoint is what was tested; otherwise from target/. Format 1
(no target/, TensorRT-LLM checkpoint always in the runtime dtype) is still read. Every file is checked against its
sha256 when it is read; a tampered or truncated file raises EngineChecksumError.

TensorRT-LLM checkpoint layout (reference-facts section 6). Linear weights are [out_features, in_features].
    HF (Llama family)                          TensorRT-LLM
    model.embed_tokens.weight                  transformer.vocab_embedding.weight        replicated
    model.layers.{i}.input_layernorm.weight    transformer.layers.{i}.input_layernorm.weight
    self_attn.{q,k,v}_proj.{weight,bias}       attention.qkv.{weight,bias}  q|k|v on dim 0, per rank
    self_attn.o_proj.weight (bias)             attention.dense.weight (bias)   split dim 1 (bias replicated)
    post_attention_layernorm.weight            post_layernorm.weight
    mlp.gate_proj.*                            mlp.fc.*        (the naming trap: gate_proj is "fc")
    mlp.up_proj.*                              mlp.gate.*      (... and up_proj is "gate")
    mlp.down_proj.weight (bias)                mlp.proj.weight (bias)          split dim 1 (bias replicated)
    model.norm.weight                          transformer.ln_f.weight
    lm_head.weight (or the tied embedding)     lm_head.weight                  vocab padded, split dim 0
Medusa heads: medusa_heads.{h}.medusa_layers.{l}.linear.{weight,bias} (split dim 0),
              medusa_heads.{h}.lm_head.weight (vocab padded, split dim 0).
EAGLE-1:      eagle_nets.{d}.drafter.fc.{weight,bias} (split dim 0), eagle_nets.{d}.drafter.layers.{i}.* (as the
              target's layers, layer 0 without input_layernorm), eagle_nets.{d}.drafter.vocab_embedding.weight,
              eagle_nets.{d}.lm_head.weight (the target's lm_head); one copy per EagleNet d < num_eagle_layers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.config import ModelConfig
from runtime.errors import CheckpointError, ConfigError

FORMAT = "spectree-engine"
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
MANIFEST = "engine.json"
TRTLLM_DIR = "trtllm_checkpoint"
TRTLLM_CONFIG = "config.json"
DRAFT_DIR = "draft"
TARGET_DIR = "target"
TARGET_FILE = f"{TARGET_DIR}/model.safetensors"
ONNX_FILE = "model.onnx"
PLAN_FILE = "model.plan"
BUILD_SCRIPT = "trtllm-build.sh"
DRAFT_METHODS = ("medusa", "eagle", "lookup", "none")
_HASH_CHUNK = 8 << 20


class EngineError(CheckpointError):
    """An engine directory is missing, malformed, or inconsistent with its manifest."""


class EngineChecksumError(EngineError):
    """A file of an engine directory does not match the size / sha256 recorded in engine.json."""


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def sha256_file(path: str | Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a file, read in chunks; on_bytes(n) is called after each chunk (progress)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return h.hexdigest()


# ---- TensorRT-LLM tensor layout ----------------------------------------------------------------------------


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    """TensorRT-LLM pads the vocabulary of every vocab-parallel lm_head to a multiple of tp_size."""
    return -(-vocab_size // tp_size) * tp_size


@dataclass(frozen=True)
class QKVLayout:
    """Head counts of one attention block, for splitting its fused qkv projection over tensor-parallel ranks."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: ModelConfig) -> QKVLayout:
        return cls(config.num_attention_heads, config.num_key_value_heads, config.head_dim)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_tp(self, tp_size: int, where: str = "attention") -> None:
        """ConfigError unless the heads shard over tp_size ranks the way TensorRT-LLM shards them."""
        if self.num_heads % tp_size:
            raise ConfigError(
                f"{where}: num_attention_heads {self.num_heads} is not divisible by tp_size {tp_size}"
            )
        kv, tp = self.num_kv_heads, tp_size
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ConfigError(
                f"{where}: num_key_value_heads {kv} and tp_size {tp} must divide one another "
                "(kv heads are split when there are at least tp_size of them, duplicated otherwise)"
            )

    def kv_copies(self, tp_size: int) -> int:
        """How many ranks hold each kv head (1 unless kv heads are fewer than ranks)."""
        return max(1, tp_size // self.num_kv_heads)


@dataclass(frozen=True)
class TPLayout:
    """What sharding a TensorRT-LLM state dict needs: the vocabulary and every attention block's head counts."""

    vocab_size: int
    target: QKVLayout
    eagle: QKVLayout | None = None

    def qkv(self, name: str) -> QKVLayout:
        if name.startswith("eagle_nets."):
            if self.eagle is None:
                raise EngineError(f"{name}: an EAGLE tensor, but no EAGLE head layout was given")
            return self.eagle
        return self.target


# How each TensorRT-LLM tensor is laid out over ranks (TensorRT-LLM's ColumnLinear / RowLinear conventions).
_QKV, _SPLIT0, _SPLIT1, _VOCAB, _REPLICATE = "qkv", "split0", "split1", "vocab", "replicate"
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), rule)
    for p, rule in (
        (r".*\.attention\.qkv\.(weight|bias)", _QKV),
        (r"(.*\.)?lm_head\.weight", _VOCAB),
        (r".*\.attention\.dense\.weight|.*\.mlp\.proj\.weight", _SPLIT1),
        (r".*\.mlp\.(fc|gate)\.(weight|bias)", _SPLIT0),
        (r"medusa_heads\.\d+\.medusa_layers\.\d+\.linear\.(weight|bias)", _SPLIT0),
        (r"eagle_nets\.\d+\.drafter\.fc\.(weight|bias)", _SPLIT0),
        (r".*\.attention\.dense\.bias|.*\.mlp\.proj\.bias", _REPLICATE),  # RowLinear bias: added once, after the reduce
        (r".*(input_layernorm|post_layernorm|ln_f)\.weight", _REPLICATE),
        (r".*vocab_embedding\.weight", _REPLICATE),  # use_parallel_embedding = false
    )
)


def shard_rule(name: str) -> str:
    for pattern, rule in _RULES:
        if pattern.fullmatch(name):
            return rule
    raise EngineError(f"no tensor-parallel rule for TensorRT-LLM tensor {name!r}")


def shard(tensors: Mapping[str, torch.Tensor], layout: TPLayout, tp_size: int) -> list[dict[str, torch.Tensor]]:
    """Full (unsharded) TensorRT-LLM tensors -> one state dict per rank; the inverse is `unshard`."""
    return [shard_rank(tensors, layout, tp_size, rank) for rank in range(tp_size)]


def shard_rank(
    tensors: Mapping[str, torch.Tensor], layout: TPLayout, tp_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state dict (one rank at a time keeps the writer's memory at full model + one rank).

    Every shard is a fresh contiguous tensor (safetensors refuses views sharing storage).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        rule = shard_rule(name)
        if rule == _REPLICATE:
            part = t
        elif rule == _SPLIT0 or rule == _SPLIT1:
            part = _split(t, 0 if rule == _SPLIT0 else 1, tp_size, name)[rank]
        elif rule == _VOCAB:
            padded = pad_vocab_size(layout.vocab_size, tp_size)
            if t.shape[0] != layout.vocab_size:
                raise EngineError(f"{name} has {t.shape[0]} rows, expected the vocabulary size {layout.vocab_size}")
            rows = padded // tp_size
            part = t[rank * rows : min((rank + 1) * rows, t.shape[0])]
            if part.shape[0] < rows:  # the last rank(s) carry the zero padding rows
                part = torch.cat([part, t.new_zeros(rows - part.shape[0], *t.shape[1:])])
        else:
            part = _split_qkv(t, layout.qkv(name), tp_size, name)[rank]
        out[name] = part.contiguous().clone()
    return out


def unshard(ranks: Sequence[Mapping[str, torch.Tensor]], layout: TPLayout) -> dict[str, torch.Tensor]:
    """Inverse of `shard`, bit-exact. Replicated tensors and duplicated kv heads must agree across ranks and
    vocabulary padding must be zero: anything else means the shards do not come from one checkpoint."""
    tp_size = len(ranks)
    if tp_size == 0:
        raise EngineError("no tensor-parallel ranks to re-assemble")
    names = list(ranks[0])
    for r, state in enumerate(ranks[1:], start=1):
        if set(state) != set(names):
            diff = sorted(set(state) ^ set(names))[:6]
            raise EngineError(f"rank {r} and rank 0 hold different tensor names (e.g. {diff})")
    full: dict[str, torch.Tensor] = {}
    for name in names:
        parts = [state[name] for state in ranks]
        rule = shard_rule(name)
        if rule == _REPLICATE:
            _check_equal(parts, name, "replicated tensor")
            full[name] = parts[0]
        elif rule == _SPLIT0 or rule == _SPLIT1:
            full[name] = torch.cat(parts, dim=0 if rule == _SPLIT0 else 1)
        elif rule == _VOCAB:
            t = torch.cat(parts, dim=0)
            if t.shape[0] != pad_vocab_size(layout.vocab_size, tp_size):
                raise EngineError(
                    f"{name} re-assembles to {t.shape[0]} rows; expected the vocabulary {layout.vocab_size} padded "
                    f"to a multiple of tp_size {tp_size}"
                )
            if torch.any(t[layout.vocab_size :] != 0):
                raise EngineError(f"{name}: vocabulary padding rows [{layout.vocab_size}, {t.shape[0]}) are not zero")
            full[name] = t[: layout.vocab_size]
        else:
            full[name] = _unsplit_qkv(parts, layout.qkv(name), name)
    return full


def _split(t: torch.Tensor, dim: int, tp_size: int, name: str) -> list[torch.Tensor]:
    if t.ndim <= dim or t.shape[dim] % tp_size:
        raise ConfigError(f"{name} {tuple(t.shape)}: dim {dim} does not split evenly over tp_size {tp_size}")
    return list(torch.chunk(t, tp_size, dim=dim))


def _split_qkv(t: torch.Tensor, qkv: QKVLayout, tp_size: int, name: str) -> list[torch.Tensor]:
    """[q; k; v] rows -> per rank [q_r; k_r; v_r]; kv heads are duplicated when fewer than ranks."""
    qkv.check_tp(tp_size, name)
    if t.shape[0] != qkv.q_size + 2 * qkv.kv_size:
        raise EngineError(f"{name} has {t.shape[0]} rows, expected q + k + v = {qkv.q_size + 2 * qkv.kv_size}")
    q, k, v = torch.split(t, [qkv.q_size, qkv.kv_size, qkv.kv_size], dim=0)
    copies = qkv.kv_copies(tp_size)
    if copies > 1:  # [h0, h1] -> [h0, h0, h1, h1]: rank r gets kv head r // copies
        d = qkv.head_dim
        k = k.reshape(qkv.num_kv_heads, d, *k.shape[1:]).repeat_interleave(copies, 0).reshape(-1, *k.shape[1:])
        v = v.reshape(qkv.num_kv_heads, d, *v.shape[1:]).repeat_interleave(copies, 0).reshape(-1, *v.shape[1:])
    return [torch.cat(parts) for parts in zip(q.chunk(tp_size), k.chunk(tp_size), v.chunk(tp_size))]


def _unsplit_qkv(parts: list[torch.Tensor], qkv: QKVLayout, name: str) -> torch.Tensor:
    tp_size = len(parts)
    qkv.check_tp(tp_size, name)
    copies = qkv.kv_copies(tp_size)
    q_r = qkv.q_size // tp_size
    kv_r = qkv.kv_size * copies // tp_size
    qs, ks, vs = [], [], []
    for r, p in enumerate(parts):
        if p.shape[0] != q_r + 2 * kv_r:
            raise EngineError(f"{name} on rank {r} has {p.shape[0]} rows, expected {q_r + 2 * kv_r}")
        q, k, v = torch.split(p, [q_r, kv_r, kv_r], dim=0)
        qs.append(q)
        ks.append(k)
        vs.append(v)
    # Ranks g * copies .. (g + 1) * copies - 1 hold the same kv head g.
    for group in range(tp_size // copies):
        members = range(group * copies, (group + 1) * copies)
        _check_equal([ks[r] for r in members], name, f"duplicated k head {group}")
        _check_equal([vs[r] for r in members], name, f"duplicated v head {group}")
    return torch.cat(qs + ks[::copies] + vs[::copies])


def _check_equal(parts: list[torch.Tensor], name: str, what: str) -> None:
    for r, p in enumerate(parts[1:], start=1):
        if p.shape != parts[0].shape or p.dtype != parts[0].dtype or not torch.equal(p, parts[0]):
            raise EngineError(f"{name}: {what} differs between ranks (rank {r} vs the first)")


# ---- HF <-> TensorRT-LLM names ---------------------------------------------------------------------------

# (HF suffix under model.layers.{i}., TensorRT-LLM suffix under transformer.layers.{i}.), for 1:1 tensors.
_LAYER_NAMES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attn.o_proj.weight", "attention.dense.weight"),
    ("self_attn.o_proj.bias", "attention.dense.bias"),
    ("post_attention_layernorm.weight", "post_layernorm.weight"),
    ("mlp.gate_proj.weight", "mlp.fc.weight"),  # the trap: HF gate_proj is TensorRT-LLM's fc ...
    ("mlp.gate_proj.bias", "mlp.fc.bias"),
    ("mlp.up_proj.weight", "mlp.gate.weight"),  # ... and HF up_proj is TensorRT-LLM's gate
    ("mlp.up_proj.bias", "mlp.gate.bias"),
    ("mlp.down_proj.weight", "mlp.proj.weight"),
    ("mlp.down_proj.bias", "mlp.proj.bias"),
)


def layers_to_trtllm(
    tensors: Mapping[str, torch.Tensor], hf_prefix: str, trt_prefix: str, num_layers: int
) -> dict[str, torch.Tensor]:
    """Decoder layers from HF names ({hf_prefix}{i}.self_attn.q_proj.weight ...) to TensorRT-LLM names."""
    out: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        src, dst = f"{hf_prefix}{i}.", f"{trt_prefix}{i}."
        for hf, trt in _LAYER_NAMES:
            if src + hf in tensors:
                out[dst + trt] = tensors[src + hf]
        for kind in ("weight", "bias"):
            names = [f"{src}self_attn.{p}_proj.{kind}" for p in "qkv"]
            present = [n in tensors for n in names]
            if all(present):
                out[f"{dst}attention.qkv.{kind}"] = torch.cat([tensors[n] for n in names], dim=0)
            elif any(present):
                raise CheckpointError(f"layer {i}: q/k/v {kind}s must all be present or all absent")
    return out


def layers_from_trtllm(
    tensors: Mapping[str, torch.Tensor], trt_prefix: str, hf_prefix: str, num_layers: int, qkv: QKVLayout
) -> dict[str, torch.Tensor]:
    """Inverse of `layers_to_trtllm` (full, unsharded tensors)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        src, dst = f"{trt_prefix}{i}.", f"{hf_prefix}{i}."
        for hf, trt in _LAYER_NAMES:
            if src + trt in tensors:
                out[dst + hf] = tensors[src + trt]
        for kind in ("weight", "bias"):
            fused = tensors.get(f"{src}attention.qkv.{kind}")
            if fused is None:
                continue
            if fused.shape[0] != qkv.q_size + 2 * qkv.kv_size:
                raise EngineError(f"{src}attention.qkv.{kind} has {fused.shape[0]} rows, expected "
                                  f"{qkv.q_size + 2 * qkv.kv_size}")
            q, k, v = torch.split(fused, [qkv.q_size, qkv.kv_size, qkv.kv_size], dim=0)
            out[f"{dst}self_attn.q_proj.{kind}"] = q
            out[f"{dst}self_attn.k_proj.{kind}"] = k
            out[f"{dst}self_attn.v_proj.{kind}"] = v
    return out


def target_to_trtllm(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The target's HF tensors (validated, see runtime.checkpoint) -> full TensorRT-LLM tensors."""
    out = {
        "transformer.vocab_embedding.weight": tensors["model.embed_tokens.weight"],
        "transformer.ln_f.weight": tensors["model.norm.weight"],
        # Tied embeddings: TensorRT-LLM still stores lm_head.weight (a copy of the embedding).
        "lm_head.weight": tensors["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"],
    }
    out.update(layers_to_trtllm(tensors, "model.layers.", "transformer.layers.", config.num_hidden_layers))
    return out


def is_target_tensor(name: str) -> bool:
    """A TensorRT-LLM tensor of the target model itself (not of the Medusa / EAGLE heads)."""
    return not name.startswith(("medusa_heads.", "eagle_nets."))


def target_from_trtllm(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full TensorRT-LLM tensors -> the target's HF tensors (draft-head tensors are ignored)."""
    missing = [n for n in ("transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight")
               if n not in tensors]
    if missing:
        raise EngineError(f"TensorRT-LLM checkpoint lacks {missing}")
    out = {
        "model.embed_tokens.weight": tensors["transformer.vocab_embedding.weight"],
        "model.norm.weight": tensors["transformer.ln_f.weight"],
    }
    if config.tie_word_embeddings:
        if not torch.equal(tensors["lm_head.weight"], out["model.embed_tokens.weight"]):
            raise EngineError("tie_word_embeddings is true but lm_head.weight differs from the vocabulary embedding")
    else:
        out["lm_head.weight"] = tensors["lm_head.weight"]
    out.update(layers_from_trtllm(tensors, "transformer.layers.", "model.layers.", config.num_hidden_layers,
                                  QKVLayout.of(config)))
    return out


def medusa_to_trtllm(
    res_weight: torch.Tensor,  # [heads, layers, H, H]
    res_bias: torch.Tensor,  # [heads, layers, H]
    lm_weight: torch.Tensor,  # [heads, V, H]
) -> dict[str, torch.Tensor]:
    """Medusa heads (runtime.drafters.medusa.MedusaHeads parameters) -> TensorRT-LLM medusa_heads.* tensors."""
    out: dict[str, torch.Tensor] = {}
    for h in range(lm_weight.shape[0]):
        for layer in range(res_weight.shape[1]):
            p = f"medusa_heads.{h}.medusa_layers.{layer}.linear."
            out[p + "weight"] = res_weight[h, layer]
            out[p + "bias"] = res_bias[h, layer]
        out[f"medusa_heads.{h}.lm_head.weight"] = lm_weight[h]
    return out


def eagle_to_trtllm(
    head_state: Mapping[str, torch.Tensor],
    head_config: ModelConfig,
    num_eagle_layers: int,
    target_embedding: torch.Tensor,  # [V, H]
    target_lm_head: torch.Tensor,  # [V, H]
) -> dict[str, torch.Tensor]:
    """An EAGLE-1 head (EAGLE checkpoint names: fc.*, layers.{i}.*, embed_tokens.weight) -> TensorRT-LLM's
    eagle_nets.{d}.* for each of the num_eagle_layers EagleNets (TensorRT-LLM keeps one copy per draft depth).

    TensorRT-LLM's fc always has a bias; a head trained without one gets zeros (the same function).
    """
    fc_w = head_state["fc.weight"]
    fc_b = head_state.get("fc.bias", fc_w.new_zeros(fc_w.shape[0]))
    embedding = head_state.get("embed_tokens.weight", target_embedding)
    layers = layers_to_trtllm(head_state, "layers.", "layers.", head_config.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for d in range(num_eagle_layers):
        p = f"eagle_nets.{d}."
        out[p + "drafter.fc.weight"] = fc_w
        out[p + "drafter.fc.bias"] = fc_b
        out[p + "drafter.vocab_embedding.weight"] = embedding
        out[p + "lm_head.weight"] = target_lm_head
        out.update({p + "drafter." + n: t for n, t in layers.items()})
    return out


# ---- reading an engine directory -------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftSpec:
    """The drafter an engine was built for (engine.json "draft")."""

    method: str  # medusa | eagle | lookup | none
    path: str | None  # weights directory relative to the engine root (medusa / eagle)
    choices: tuple[tuple[int, ...], ...] | None  # static tree, canonical order; None: none / dynamic / lookup
    options: dict[str, Any]  # drafter options: EAGLE-2 dynamic tree or lookup bounds


@dataclass(frozen=True)
class Limits:
    max_seq_len: int
    max_draft_len: int
    max_batch_size: int
    tp_size: int


@dataclass(frozen=True)
class Engine:
    """An engine directory opened for reading; files are verified against engine.json as they are read."""

    root: Path
    manifest: dict[str, Any]
    dtype: str
    draft: DraftSpec
    limits: Limits

    def path(self, relpath: str) -> Path:
        """The verified path of a file listed in engine.json (EngineChecksumError if it was changed)."""
        files = self.manifest["files"]
        if relpath not in files:
            raise EngineError(f"{self.root}: {relpath} is not listed in {MANIFEST}")
        path = self.root / relpath
        verify_file(path, files[relpath], relpath)
        return path

    def paths_under(self, folder: str) -> list[Path]:
        """Verify and return every listed file under `folder`/."""
        prefix = folder.rstrip("/") + "/"
        return [self.path(rel) for rel in sorted(self.manifest["files"]) if rel.startswith(prefix)]

    def has(self, relpath: str) -> bool:
        return relpath in self.manifest["files"]

    def model_config(self, dtype: str | torch.dtype | None = None) -> ModelConfig:
        """The target's config in `dtype` (default: the engine's), its context capped at the engine's max_seq_len."""
        if self.has("generation_config.json"):
            self.path("generation_config.json")
        config = ModelConfig.from_hf(self.path("config.json")).with_dtype(dtype or self.dtype)
        recorded = self.manifest.get("model")
        if recorded != model_config_dict(config.with_dtype(self.dtype)):
            raise EngineError(f"{self.root}: config.json does not match the model config recorded in {MANIFEST}")
        return dataclasses.replace(config, max_context=min(config.max_context, self.limits.max_seq_len))

    def trtllm_config(self) -> dict[str, Any]:
        path = self.path(f"{TRTLLM_DIR}/{TRTLLM_CONFIG}")
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EngineError(f"cannot read {path}: {exc}") from exc

    def read_trtllm_tensors(
        self, include: Callable[[str], bool] | None = None, on_rank: Callable[[int], None] | None = None
    ) -> dict[str, torch.Tensor]:
        """The rank files of trtllm_checkpoint/ re-assembled into full (unsharded) TensorRT-LLM tensors.

        include(name) selects tensors (default: all); the others are never read from disk.
        """
        from safetensors import SafetensorError, safe_open

        cfg = self.trtllm_config()
        tp = cfg.get("mapping", {}).get("tp_size")
        if tp != self.limits.tp_size:
            raise EngineError(f"{TRTLLM_DIR}/{TRTLLM_CONFIG}: mapping.tp_size {tp!r} != {MANIFEST} tp_size "
                              f"{self.limits.tp_size}")
        ranks = []
        for r in range(tp):
            path = self.path(f"{TRTLLM_DIR}/{rank_file(r)}")
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    ranks.append({n: f.get_tensor(n) for n in f.keys() if include is None or include(n)})
            except (SafetensorError, OSError) as exc:
                raise EngineError(f"cannot read {path}: {exc}") from exc
            if on_rank is not None:
                on_rank(r)
        config = self.model_config()
        eagle = None
        if cfg.get("architecture") == "EagleForCausalLM":
            e = cfg["eagle_net_config"]
            eagle = QKVLayout(e["num_attention_heads"], e["num_key_value_heads"], e["head_size"])
        return unshard(ranks, TPLayout(config.vocab_size, QKVLayout.of(config), eagle))

    def load_target(self, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"):
        """The target model (a runtime.model.TargetModel): weights from target/ when the engine has it (its
        TensorRT-LLM checkpoint is in another dtype than the runtime's), else read back from trtllm_checkpoint/."""
        from runtime.model import TargetModel

        config = self.model_config(dtype)
        if self.has(TARGET_FILE):
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            path = self.path(TARGET_FILE)
            try:
                tensors = load_file(str(path))
            except (SafetensorError, OSError) as exc:
                raise EngineError(f"cannot read {path}: {exc}") from exc
            tensors = {name: t.to(device) for name, t in tensors.items()}
            return TargetModel.from_state(config, tensors, source=f"{self.root}/{TARGET_FILE}")
        # Draft-head tensors are TensorRT-LLM's copy; the runtime's drafters read draft/.
        tensors = target_from_trtllm(config, self.read_trtllm_tensors(include=is_target_tensor))
        tensors = {name: t.to(device) for name, t in tensors.items()}
        return TargetModel.from_state(config, tensors, source=f"{self.root}/{TRTLLM_DIR}")

    def tokenizer(self):
        """The engine's tokenizer (runtime.tokenizer.Tokenizer), or None when it was built without one."""
        from runtime.tokenizer import Tokenizer

        if not self.has("tokenizer.json"):
            return None
        for rel in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                    "config.json"):
            if self.has(rel):
                self.path(rel)
        return Tokenizer.from_dir(self.root)

    def draft_settings(
        self,
        kind: str | None,
        draft_model: str | None,
        tree: str | None,
        options: Mapping[str, Any],
    ) -> tuple[str, str | None, Any, dict[str, Any]]:
        """(kind, weights path, tree, options) for `load_drafter`: the engine's own drafter settings as defaults.

        kind None keeps the engine's drafter. Its weights (draft/) and tree are used only while that drafter is
        kept and no draft_model is given; its options (EAGLE-2 dynamic tree, lookup bounds) only while no tree is
        given either; explicit options override them key by key.
        """
        spec = self.draft
        if kind is None or (kind == spec.method and draft_model is None):
            kind = spec.method
            path = None
            if spec.path is not None:
                self.paths_under(spec.path)  # verify every weight file before the drafter reads them
                path = str(self.root / spec.path)
            if tree is None:
                choices = None if spec.choices is None else [list(c) for c in spec.choices]
                return kind, path, choices, {**spec.options, **options}
            return kind, path, tree, dict(options)
        return kind, draft_model, tree, dict(options)


def verify_file(path: Path, entry: Mapping[str, Any], relpath: str) -> None:
    if not path.is_file():
        raise EngineChecksumError(f"{relpath}: listed in {MANIFEST} but missing from {path.parent}")
    size = path.stat().st_size
    if size != entry.get("size"):
        raise EngineChecksumError(f"{relpath}: size {size} bytes, {MANIFEST} records {entry.get('size')}")
    digest = sha256_file(path)
    if digest != entry.get("sha256"):
        raise EngineChecksumError(
            f"{relpath}: sha256 {digest} does not match {entry.get('sha256')} recorded in {MANIFEST} "
            "(the file was modified after the build)"
        )


def read_manifest(root: str | Path) -> dict[str, Any]:
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise EngineError(f"{root} is not an engine directory: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(f"cannot read {path}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise EngineError(f"{path}: not a {FORMAT} manifest (format {manifest.get('format')!r})"
                          if isinstance(manifest, dict) else f"{path}: expected a JSON object")
    version = manifest.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        raise EngineError(f"{path}: format_version {version!r} is not supported (this runtime reads "
                          f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))})")
    for key in ("model", "dtype", "draft", "limits", "files"):
        if key not in manifest:
            raise EngineError(f"{path}: missing key {key!r}")
    return manifest


def open_engine(root: str | Path) -> Engine:
    """Open an engine directory: parse engine.json. Files are verified when read (`Engine.path`)."""
    root = Path(root)
    manifest = read_manifest(root)
    where = root / MANIFEST
    try:
        d = manifest["draft"]
        tree = d.get("tree") or {}
        choices = tree.get("choices") if tree.get("kind") == "static" else None
        draft = DraftSpec(
            method=d["method"],
            path=d.get("path"),
            choices=None if choices is None else tuple(tuple(int(r) for r in c) for c in choices),
            options=dict(d.get("options") or {}),
        )
        lim = manifest["limits"]
        limits = Limits(int(lim["max_seq_len"]), int(lim["max_draft_len"]), int(lim["max_batch_size"]),
                        int(lim["tp_size"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{where}: malformed draft / limits section ({exc!r})") from exc
    if draft.method not in DRAFT_METHODS:
        raise EngineError(f"{where}: draft method {draft.method!r} is not one of {', '.join(DRAFT_METHODS)}")
    return Engine(root=root, manifest=manifest, dtype=str(manifest["dtype"]), draft=draft, limits=limits)


def is_engine_dir(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def model_config_dict(config: ModelConfig) -> dict[str, Any]:
    """ModelConfig as JSON-ready data (how engine.json records it)."""
    d = dataclasses.asdict(config)
    d["eos_token_ids"] = list(config.eos_token_ids)
    return json.loads(json.dumps(d))


def iter_files(root: Path) -> Iterable[str]:
    """Relative paths of every regular file under root except the manifest, sorted."""
    for p in sorted(root.rglob("*")):
        if p.is_file() and not (p.parent == root and p.name == MANIFEST):
            yield p.relative_to(root).as_posix()


__all__ = [
    "FORMAT", "FORMAT_VERSION", "READABLE_FORMAT_VERSIONS", "MANIFEST", "TRTLLM_DIR", "DRAFT_DIR", "TARGET_DIR",
    "TARGET_FILE", "ONNX_FILE", "PLAN_FILE", "BUILD_SCRIPT",
    "EngineError", "EngineChecksumError", "QKVLayout", "TPLayout", "Engine", "DraftSpec", "Limits",
    "pad_vocab_size", "shard", "shard_rank", "unshard", "shard_rule", "target_to_trtllm", "target_from_trtllm",
    "layers_to_trtllm", "layers_from_trtllm", "is_target_tensor", "medusa_to_trtllm", "eagle_to_trtllm", "open_engine",
    "read_manifest", "verify_file", "sha256_file", "rank_file", "is_engine_dir", "model_config_dict", "iter_files",
]
