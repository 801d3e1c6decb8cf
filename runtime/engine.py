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
                                 EAGLE: SafeAILab), in the engine dtype, read by runtime/drafters/; plus the
                                 head directory's datastore.npz when it has one (runtime/drafters/datastore.py)
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.config import AUTO, DtypeChoice, ModelConfig, choose_dtype
from runtime.draft_spec import DraftSpec, field_names
from runtime.errors import CheckpointError, ConfigError
from runtime.files import read_json_object

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


# ---- TensorRT-LLM tensor layout, and reading it back (the export direction: builder/trtllm_layout.py) -------


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
QKV, SPLIT0, SPLIT1, VOCAB, REPLICATE = "qkv", "split0", "split1", "vocab", "replicate"
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), rule)
    for p, rule in (
        (r".*\.attention\.qkv\.(weight|bias)", QKV),
        (r"(.*\.)?lm_head\.weight", VOCAB),
        (r".*\.attention\.dense\.weight|.*\.mlp\.proj\.weight", SPLIT1),
        (r".*\.mlp\.(fc|gate)\.(weight|bias)", SPLIT0),
        (r"medusa_heads\.\d+\.medusa_layers\.\d+\.linear\.(weight|bias)", SPLIT0),
        (r"eagle_nets\.\d+\.drafter\.fc\.(weight|bias)", SPLIT0),
        (r".*\.attention\.dense\.bias|.*\.mlp\.proj\.bias", REPLICATE),  # RowLinear bias: added once, after the reduce
        (r".*(input_layernorm|post_layernorm|ln_f)\.weight", REPLICATE),
        (r".*vocab_embedding\.weight", REPLICATE),  # use_parallel_embedding = false
    )
)


def shard_rule(name: str) -> str:
    for pattern, rule in _RULES:
        if pattern.fullmatch(name):
            return rule
    raise EngineError(f"no tensor-parallel rule for TensorRT-LLM tensor {name!r}")


def unshard(ranks: Sequence[Mapping[str, torch.Tensor]], layout: TPLayout) -> dict[str, torch.Tensor]:
    """Inverse of `builder.trtllm_layout.shard`, bit-exact. Replicated tensors and duplicated kv heads must agree
    across ranks and vocabulary padding must be zero: anything else means the shards do not come from one checkpoint."""
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
        if rule == REPLICATE:
            _check_equal(parts, name, "replicated tensor")
            full[name] = parts[0]
        elif rule == SPLIT0 or rule == SPLIT1:
            full[name] = torch.cat(parts, dim=0 if rule == SPLIT0 else 1)
        elif rule == VOCAB:
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
LAYER_NAMES = (
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


def layer_names(hf_prefix: str, trt_prefix: str, num_layers: int) -> Iterator[tuple[str, str]]:
    """(HF name, TensorRT-LLM name) of every 1:1 tensor of decoder layers 0 .. num_layers - 1 (q/k/v, fused into
    one qkv tensor, are not 1:1)."""
    for i in range(num_layers):
        for hf, trt in LAYER_NAMES:
            yield f"{hf_prefix}{i}.{hf}", f"{trt_prefix}{i}.{trt}"


def layers_from_trtllm(
    tensors: Mapping[str, torch.Tensor], trt_prefix: str, hf_prefix: str, num_layers: int, qkv: QKVLayout
) -> dict[str, torch.Tensor]:
    """Inverse of `builder.trtllm_layout.layers_to_trtllm` (full, unsharded tensors)."""
    out = {hf: tensors[trt] for hf, trt in layer_names(hf_prefix, trt_prefix, num_layers) if trt in tensors}
    for i in range(num_layers):
        src, dst = f"{trt_prefix}{i}.", f"{hf_prefix}{i}."
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


# ---- reading an engine directory -------------------------------------------------------------------------


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
    draft: DraftSpec  # the drafter it was built for (engine.json "draft", path relative to root; limits' max_draft_len)
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
        return read_json_object(path, EngineError)

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

    def dtype_choice(self, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu") -> DtypeChoice:
        """The dtype to run this engine in on `device` (`runtime.config.choose_dtype`): `dtype` as asked; by default
        "auto" again, for this machine, where the build chose by "auto" (engine.json "dtype_requested"), else the
        engine's dtype (a bfloat16 one as float32 on a CPU without native bf16)."""
        if dtype is None and self.manifest.get("dtype_requested") == AUTO:
            dtype = AUTO
        return choose_dtype(dtype, self.dtype, device)

    def load_target(self, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"):
        """The target model (a runtime.model.TargetModel) in `dtype_choice(dtype, device)`'s dtype: weights from
        target/ when the engine has it (its TensorRT-LLM checkpoint is in another dtype than the runtime's), else read
        back from trtllm_checkpoint/."""
        from runtime.model import TargetModel

        choice = self.dtype_choice(dtype, device)
        choice.warn_if_demoted(str(self.root))
        config = self.model_config(choice.dtype)
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

    def own_draft(self) -> DraftSpec:
        """The drafter the engine was built for, its weights path absolute: every weight file under it is verified
        against engine.json first (it is about to be read)."""
        spec = self.draft
        if spec.path is None:
            return spec
        self.paths_under(spec.path)
        return dataclasses.replace(spec, path=str(self.root / spec.path))


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
    manifest = read_json_object(path, EngineError)
    if manifest.get("format") != FORMAT:
        raise EngineError(f"{path}: not a {FORMAT} manifest (format {manifest.get('format')!r})")
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
        lim = manifest["limits"]
        limits = Limits(int(lim["max_seq_len"]), int(lim["max_draft_len"]), int(lim["max_batch_size"]),
                        int(lim["tp_size"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{where}: malformed limits section ({exc!r})") from exc
    with field_names("record", EngineError, f"{where}: draft: "):
        draft = dataclasses.replace(DraftSpec.from_mapping(manifest["draft"]), max_draft_len=limits.max_draft_len)
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
    "EngineError", "EngineChecksumError", "QKVLayout", "TPLayout", "Engine", "Limits",
    "QKV", "SPLIT0", "SPLIT1", "VOCAB", "REPLICATE", "LAYER_NAMES", "layer_names", "pad_vocab_size", "unshard", "shard_rule",
    "target_from_trtllm", "layers_from_trtllm", "is_target_tensor", "open_engine",
    "read_manifest", "verify_file", "sha256_file", "rank_file", "is_engine_dir", "model_config_dict", "iter_files",
]
