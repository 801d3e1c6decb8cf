"""`runtime.load(...)`: the Python entry point (its keywords mirror the CLI's flags)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.config import DTYPE_CHOICES, TARGET_QUANTIZATIONS
from runtime.decode import SpecDecoder
from runtime.draft_spec import PLAIN, DraftSpec, field_names, kinds
from runtime.drafters import load_drafter
from runtime.errors import CheckpointError, ConfigError
from runtime.model import TargetModel
from runtime.tokenizer import Tokenizer



@dataclass(frozen=True)
class LoadConfig:
    """How to assemble a SpecDecoder. The CLI reads its defaults from here."""

    model: str  # HF checkpoint directory, or an engine directory
    draft: str | None = None  # a drafter kind (runtime.draft_spec.kind_names()); None: the engine's, else inferred
    #                           from draft_model, else plain decoding (PLAIN)
    draft_model: str | None = None  # head checkpoint directory (a weighted kind's)
    tree: str | None = None  # preset name ("mc_sim_7b_63", "chain-4") or JSON list of choice paths
    dtype: str | None = None  # auto | float32 | bfloat16 | float16 (runtime.config.choose_dtype); None: the
    #                           checkpoint's own (an engine's: what its build asked for)
    max_draft_len: int = 63  # most draft nodes per step (root excluded), as TensorRT-LLM's max_draft_len
    device: str = "cpu"  # torch device for the target and drafter weights: "cpu", "cuda", "cuda:1", ...
    draft_options: dict[str, Any] = field(default_factory=dict)  # the drafter's options (DraftSpec.with_options)
    # "int8" / "int4": the draft head's weights as drafting reads them (DraftSpec.quantization); None: an engine's own
    # choice, else the weights' dtype
    draft_quantization: str | None = None
    # "q8" / "q4": the target's weight matmuls run on block-quantised copies (TargetModel.quantize_weights; CPU; q4
    # with int8 activations, as llama.cpp's Q4_1): the quantised model is then the target that decoding is lossless
    # against. None: the dtype's own weights
    target_quantization: str | None = None

    def __post_init__(self) -> None:
        with field_names("load"):  # DraftSpec's rules, errors naming these fields
            DraftSpec(max_draft_len=self.max_draft_len)
            if self.draft is not None:
                DraftSpec.create(self.draft, path=self.draft_model, tree=self.tree, options=self.draft_options,
                                 quantization=self.draft_quantization)
        if self.target_quantization is not None and self.target_quantization not in TARGET_QUANTIZATIONS:
            raise ConfigError(f"target_quantization must be one of {', '.join(TARGET_QUANTIZATIONS)}, got "
                              f"{self.target_quantization!r}")
        if self.dtype is not None and self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {self.device!r}") from e
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but torch sees no CUDA device on this machine")

    def draft_spec(self, engine: Any = None) -> DraftSpec:
        """The drafter this config asks for. With `engine` (a runtime.engine.Engine), the engine's own drafter is the
        default: kept when no other kind and no other weights are asked for (its weight files verified), its tree
        and options only while no tree is given, explicit options overriding its options key by key; the engine's
        max_draft_len caps this one."""
        kind = self.draft or (infer_draft_kind(self.draft_model) if self.draft_model else None)
        max_draft_len = self.max_draft_len
        with field_names("load"):
            if engine is not None:
                max_draft_len = min(max_draft_len, engine.limits.max_draft_len)
                if kind is None or (kind == engine.draft.kind and self.draft_model is None):
                    own = engine.own_draft()
                    quantization = self.draft_quantization or own.quantization
                    if self.tree is None:
                        return dataclasses.replace(own.with_options(self.draft_options), max_draft_len=max_draft_len,
                                                   quantization=quantization)
                    return DraftSpec.create(own.kind, path=own.path, tree=self.tree, options=self.draft_options,
                                            max_draft_len=max_draft_len, quantization=quantization)
            return DraftSpec.create(kind or PLAIN, path=self.draft_model, tree=self.tree, options=self.draft_options,
                                    quantization=self.draft_quantization,
                                    max_draft_len=max_draft_len)


def infer_draft_kind(draft_model: str | Path) -> str:
    """The kind of a head directory, told by its public format (`DrafterKind.recognizes`; the first kind, in
    registry order, that recognizes it)."""
    d = Path(draft_model)
    if not d.is_dir():
        raise CheckpointError(f"draft model directory {str(d)!r} does not exist")
    for kind in kinds():
        if kind.recognizes(d):
            return kind.name
    formats = "; ".join(f"{k.title}: {' or '.join(k.weight_files)}" for k in kinds() if k.weighted)
    raise CheckpointError(f"cannot tell what kind of draft model {str(d)!r} is: expected the files of a draft head "
                          f"({formats}); pass draft= explicitly")


def build(config: LoadConfig) -> SpecDecoder:
    path = Path(config.model)
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    if (path / "engine.json").exists():
        # An engine directory (runtime/engine.py): weights from its TensorRT-LLM checkpoint, files verified against
        # engine.json as they are read; its drafter, tree and limits are defaults that explicit settings override.
        from runtime.engine import open_engine

        engine = open_engine(path)
        model = engine.load_target(dtype=config.dtype, device=config.device)
        spec, tokenizer = config.draft_spec(engine), engine.tokenizer()
    else:
        model = TargetModel.from_pretrained(path, dtype=config.dtype, device=config.device)
        tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
        spec = config.draft_spec()
    if config.target_quantization is not None:
        with field_names("load"):
            model.quantize_weights(config.target_quantization)
    with field_names("load"):
        drafter = load_drafter(spec, model)
    return SpecDecoder.for_spec(model, tokenizer, drafter, spec)


def load(
    path: str | Path,
    draft: str | None = None,
    draft_model: str | Path | None = None,
    tree: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_draft_len: int = LoadConfig.max_draft_len,
    device: str | torch.device = LoadConfig.device,
    draft_quantization: str | None = LoadConfig.draft_quantization,
    target_quantization: str | None = LoadConfig.target_quantization,
    **draft_options: Any,
) -> SpecDecoder:
    """Load a checkpoint directory with a drafter; returns a SpecDecoder (`generate`, `stream`), whose prompt is
    text, token ids or chat messages ([{"role": "user", "content": "..."}], rendered by the chat template).

    path         HF checkpoint directory (config.json, model.safetensors[.index.json], tokenizer.json)
    draft        the drafter kind: medusa | eagle | eagle3 | lookup | none (default: an engine's own, else inferred from
                 draft_model, else none)
    draft_model  Medusa heads (FasterDecoding format), EAGLE-1 head (EAGLE repo layout) or EAGLE-3 head directory
    tree         static tree: preset name or JSON list of choice paths (EAGLE without a tree: dynamic EAGLE-2)
    dtype        auto | float32 | bfloat16 | float16 (default: the checkpoint's; auto: bfloat16 on a CPU where it runs
                 fast, through the weight-streaming kernel or natively, else float32: runtime.config.choose_dtype)
    device       where the weights live and the loop runs ("cpu", "cuda", ...)
    draft_quantization  "int8" / "int4": the EAGLE head runs on int8 / int4 copies of its weights (CPU; drafts
                 change slightly, the output never)
    target_quantization  "q8" / "q4": the target runs on block-quantised weights (CPU; GGUF Q8_0 / Q4_1 layouts; q4
                 also quantises its activations to int8, as llama.cpp does): a quantised target, which decoding is
                 then lossless against
    draft_options  the drafter's options (EAGLE-2: total_tokens, depth, top_k; EAGLE: min_path_prob, the path
                 probability below which drafted nodes are not verified; lookup: max_ngram, ...; lookup's on medusa /
                 eagle merge prompt lookup into their trees)
    """
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    return build(
        LoadConfig(
            model=str(path),
            draft=draft,
            draft_model=None if draft_model is None else str(draft_model),
            tree=tree,
            dtype=dtype,
            max_draft_len=max_draft_len,
            device=str(device),
            draft_options=dict(draft_options),
            draft_quantization=draft_quantization,
            target_quantization=target_quantization,
        )
    )


__all__ = ["LoadConfig", "load", "build", "infer_draft_kind"]
