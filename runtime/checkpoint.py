"""Hugging Face checkpoint loading: config.json + model.safetensors, or model.safetensors.index.json shards.

`load_tensors` reads every tensor (name -> tensor, HF names); `validate_tensors` checks them against the
config (missing / unexpected names, shapes) and resolves tied embeddings. `load_checkpoint` does both.
The builder reuses these to export engines.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from runtime.config import ModelConfig, choose_dtype
from runtime.errors import CheckpointError
from runtime.files import read_json_object

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
# Buffers some older checkpoints carry that are recomputed here, not weights.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_MAX_LISTED = 8


def read_head_state(path: Path, files: tuple[str, ...], what: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A draft head directory's weights: the first of `files` in `path` that exists, a safetensors file or a torch
    state dict read weights-only (a pickle that would run code is refused, as a corrupt file is); weights stored as
    int8 are read back in float32 (`dequantized`: the loaders cast them to the target's dtype). `what` names the
    head in errors ("EAGLE", "Medusa")."""
    for name in files:
        file = path / name
        if not file.is_file():
            continue
        if name.endswith(".safetensors"):
            try:
                return file, dequantized(load_file(str(file), device="cpu"), file)
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"cannot read {what} weights {file}: {exc}") from exc
        try:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:  # corrupt or unsafe
            raise CheckpointError(f"cannot read {what} weights {file} (weights-only torch.load): {exc}") from exc
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{file} must hold a state dict of tensors, got {type(state).__name__}")
        return file, dequantized(dict(state), file)
    raise CheckpointError(f"{what} head directory {path} has neither {' nor '.join(files)}")


# A draft head's weights file may store a weight [out, in] as int8 with one scale per output row (symmetric,
# weight-only: runtime.model.Int8Weight's rule, written by `python -m builder convert-head --storage int8`): the int8
# tensor under the weight's name and its scales [out] under the name + INT8_SCALE_SUFFIX. Drafts are proposals, so
# the rounding changes what is drafted (slightly), never what is emitted.
INT8_SCALE_SUFFIX = ".int8_scale"


def dequantized(state: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """`state` with every int8-stored weight as float32 (q * its row's scale) and the scales gone; an int8 weight
    without scales, or scales without an int8 weight of their rows, is a CheckpointError naming the tensor."""
    scales = {k[:-len(INT8_SCALE_SUFFIX)]: state.pop(k) for k in list(state) if k.endswith(INT8_SCALE_SUFFIX)}
    for name, scale in scales.items():  # scale [out]
        q = state.get(name)  # [out, in] int8
        if q is None or q.dtype != torch.int8 or q.ndim != 2 or tuple(scale.shape) != (q.shape[0],):
            found = "nothing" if q is None else f"{q.dtype} {tuple(q.shape)}"
            raise CheckpointError(f"{file}: {name}{INT8_SCALE_SUFFIX} {tuple(scale.shape)} scales {found} under "
                                  f"{name}; expected an int8 weight [out, in] with one scale per row")
        state[name] = q.float() * scale.float()[:, None]
    unscaled = sorted(k for k, v in state.items() if v.dtype == torch.int8)
    if unscaled:
        raise CheckpointError(f"{file}: {unscaled[:4]} are int8 without scales ({unscaled[0]}{INT8_SCALE_SUFFIX}); "
                              "expected floating-point weights, or int8 ones with their per-row scales")
    return state


def weight_files(path: str | Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of checkpoint directory `path`, and the index's weight_map (None if unsharded)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    index_path = root / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json_object(index_path, CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no 'weight_map' object mapping tensor names to shard files")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise CheckpointError(f"shard file(s) listed in {index_path} are missing: {', '.join(missing)}")
        return [root / s for s in shards], weight_map
    single = root / SINGLE_FILE
    if single.is_file():
        return [single], None
    others = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    hint = f"; found {', '.join(others)} (convert them to safetensors)" if others else ""
    raise CheckpointError(f"missing weights in {root}: neither {SINGLE_FILE} nor {INDEX_FILE} exists{hint}")


def load_tensors(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path`, by HF name; floating tensors cast to `dtype` if given."""
    files, weight_map = weight_files(path)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names = list(f.keys())
                for name in names:
                    if name in tensors:
                        raise CheckpointError(f"tensor {name} appears in both {origin[name].name} and {file.name}")
                    t = f.get_tensor(name)
                    if dtype is not None and t.is_floating_point():
                        t = t.to(dtype)
                    tensors[name] = t.to(device)
                    origin[name] = file
        except SafetensorError as exc:
            raise CheckpointError(f"corrupt or truncated safetensors file {file}: {exc}") from exc
    if weight_map is not None:
        absent = [n for n, shard in weight_map.items() if origin.get(n, Path()).name != Path(shard).name]
        if absent:
            listed = ", ".join(f"{n} (in {weight_map[n]})" for n in absent[:_MAX_LISTED])
            more = f" and {len(absent) - _MAX_LISTED} more" if len(absent) > _MAX_LISTED else ""
            raise CheckpointError(f"{INDEX_FILE} lists tensors missing from their shard: {listed}{more}")
    return tensors


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape the config implies (lm_head included only when untied)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (v, h), "model.norm.weight": (h,)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, out_features in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size)):
            shapes[p + f"self_attn.{proj}_proj.weight"] = (out_features, h)
            if config.attention_bias:
                shapes[p + f"self_attn.{proj}_proj.bias"] = (out_features,)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.q_size)
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        for proj, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            shapes[p + f"mlp.{proj}_proj.weight"] = shape
            if config.mlp_bias:
                shapes[p + f"mlp.{proj}_proj.bias"] = (shape[0],)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (v, h)
    return shapes


def _listing(names: list[str]) -> str:
    head = ", ".join(names[:_MAX_LISTED])
    return head + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def validate_tensors(
    config: ModelConfig, tensors: dict[str, torch.Tensor], source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Check names and shapes against `config`; return the tensors the model uses (a new dict).

    With tied embeddings, lm_head.weight may be absent (the usual case) or present and equal to the embedding;
    a different lm_head under tie_word_embeddings is an error, since one of the two would be silently dropped.
    """
    expected = expected_shapes(config)
    present = {n: t for n, t in tensors.items() if not n.endswith(IGNORED_SUFFIXES)}
    if config.tie_word_embeddings and LM_HEAD in present:
        head = present.pop(LM_HEAD)
        embed = present.get(EMBED)
        if embed is not None and (head.shape != embed.shape or not torch.equal(head, embed)):
            raise CheckpointError(
                f"{source}: tie_word_embeddings is true but {LM_HEAD} differs from {EMBED}; "
                "set tie_word_embeddings to false in config.json to use a separate lm_head"
            )
    missing = [n for n in expected if n not in present]
    extra = sorted(n for n in present if n not in expected)
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_listing(extra)}")
    wrong = [
        f"{n} has shape {tuple(present[n].shape)}, expected {expected[n]}"
        for n in expected
        if n in present and tuple(present[n].shape) != expected[n]
    ]
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:_MAX_LISTED]))
    if problems:
        raise CheckpointError(f"{source} does not match its config ({config.architecture}): " + " | ".join(problems))
    not_float = [n for n, t in present.items() if not t.is_floating_point()]
    if not_float:
        raise CheckpointError(f"{source}: tensors must be floating point, got {_listing(not_float)}")
    return present


def load_checkpoint(
    path: str | Path, dtype: str | torch.dtype | None = None, device: torch.device | str = "cpu",
    runs_here: bool = True,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, validated tensors) of the HF checkpoint directory `path`, tensors in the run dtype: `dtype` as
    `runtime.config.choose_dtype` resolves it ("auto", None: the checkpoint's own, or a dtype) for `device`
    (runs_here=False: for a conversion, see there)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if not (root / "config.json").is_file():
        raise CheckpointError(f"missing config.json in checkpoint directory {root}")
    config = ModelConfig.from_hf(root)
    choice = choose_dtype(dtype, config.dtype, device, runs_here)
    choice.warn_if_demoted(str(root))
    config = config.with_dtype(choice.dtype)
    tensors = load_tensors(root, config.torch_dtype, device)
    return config, validate_tensors(config, tensors, source=str(root))


__all__ = ["INT8_SCALE_SUFFIX", "dequantized", "expected_shapes", "load_checkpoint", "load_tensors", "read_head_state",
           "validate_tensors", "weight_files"]
