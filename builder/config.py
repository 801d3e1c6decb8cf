"""The build configuration: one YAML file -> frozen dataclasses, the single source of defaults.

    model:
      checkpoint: ../checkpoints/llama-7b        # Hugging Face checkpoint directory (required)
    draft:
      method: medusa                             # a drafter kind: medusa | eagle | lookup | none (default none)
      checkpoint: ../heads/medusa-llama-7b       # head weights, medusa / eagle only
      tree: {preset: mc_sim_7b_63}               # or {choices: [[0], [0, 0], [1]]}
                                                 # or {dynamic: {total_tokens: 60, depth: 5, top_k: 10}} (eagle)
      lookup: {max_ngram: 3, num_draft_tokens: 10}   # lookup; on medusa / eagle: merged into their trees
      quantization: int8                         # or int4 (eagle): its head's weights as drafting reads them (CPU)
      pruning: {min_path_prob: 0.02, by_cost: true}  # eagle: nodes the head finds less likely are not verified;
                                                 # by_cost: each step's tree cut by this machine's verify cost
    build:
      dtype: auto                                # auto | float32 | bfloat16 | float16 (default: the checkpoint's;
                                                 # auto: bfloat16 where the weight-streaming kernel builds
                                                 # or the CPU has native bf16, else float32)
      tp_size: 1
      max_seq_len: 2048
      max_draft_len: 63
      max_batch_size: 8
      output: ../engines/llama-7b-medusa
      onnx: true                                 # export model.onnx
      tensorrt: true                             # build model.plan where `tensorrt` is importable

Relative paths are resolved from the config file's directory. Parsing checks keys and types (`load_config`);
`builder.plan.plan_build` then checks the config against the checkpoints it names (architecture, head shapes, tree
depth vs heads, tree size vs max_draft_len, tp_size vs head counts) using the runtime's own loaders, into a
`BuildPlan`. Every error names the key path, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from runtime import schema
from runtime.api import LoadConfig
from runtime.config import DTYPE_CHOICES, DtypeChoice, ModelConfig
from runtime.draft_spec import DYNAMIC, PLAIN, DraftSpec, DynamicTreeOptions, LookupOptions, PruneOptions, field_names
from runtime.errors import ConfigError, SpectreeError
from runtime.schema import setting
from runtime.tree import Tree

Dtype = Literal[DTYPE_CHOICES]  # type: ignore[valid-type]


class BuildConfigError(ConfigError):
    """A build configuration is malformed or does not fit the checkpoints it names."""


class BuildError(SpectreeError, RuntimeError):
    """The build could not run or complete (output in the way, a stage failed: the ONNX export or its checks,
    TensorRT's parser or builder)."""


@dataclass(frozen=True)
class ModelSection:
    checkpoint: Path  # Hugging Face checkpoint directory


@dataclass(frozen=True)
class TreeSection:
    """Exactly one of: a preset name, explicit choice paths, or EAGLE-2 dynamic-tree options."""

    preset: str | None = None  # "mc_sim_7b_63", "chain-K"
    choices: tuple[tuple[int, ...], ...] | None = None  # Medusa-style choice paths
    dynamic: DynamicTreeOptions | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("preset", "choices", "dynamic") if getattr(self, name) is not None]
        if len(given) != 1:
            raise BuildConfigError(
                f"draft.tree: exactly one of preset, choices, dynamic must be set, got {', '.join(given) if given else 'none'}"
            )
        try:
            self.draft_tree  # noqa: B018  (validates the preset name / choice paths)
        except SpectreeError as exc:
            raise BuildConfigError(f"draft.tree: {exc}") from exc

    @property
    def draft_tree(self) -> Tree | str:
        """DraftSpec.tree: the static tree (validated by runtime.tree), or DYNAMIC."""
        if self.preset is not None:
            return Tree.preset(self.preset)
        if self.choices is not None:
            return Tree.from_choices(self.choices) if self.choices else Tree.root_only()
        return DYNAMIC


@dataclass(frozen=True)
class DraftSection:
    """The YAML form of a `runtime.draft_spec.DraftSpec` (`spec()`), whose rules it is checked by (the YAML's keys
    for its fields: `runtime.draft_spec.FIELD_NAMES`)."""

    method: str = PLAIN  # the drafter kind (DraftSpec.kind)
    checkpoint: Path | None = None  # head weights (DraftSpec.path): e.g. a FasterDecoding Medusa or EAGLE-1 directory
    tree: TreeSection | None = None  # default: the drafter's own (Medusa: mc_sim_7b_63 / chain; EAGLE: dynamic)
    # prompt-lookup bounds: method lookup's own, or (medusa / eagle) continuations merged into each step's tree
    lookup: LookupOptions | None = None
    quantization: str | None = None  # "int8" / "int4": the head's weights as drafting reads them (eagle, CPU)
    pruning: PruneOptions | None = None  # eagle: each step verifies only the nodes the head finds likely enough

    def __post_init__(self) -> None:
        with field_names("yaml", BuildConfigError):
            self.spec().require_weights()

    def spec(self, max_draft_len: int | None = None) -> DraftSpec:
        """The drafter this section describes (paths as resolved from the config file)."""
        with field_names("yaml", BuildConfigError):
            return DraftSpec(self.method, path=self.checkpoint, tree=None if self.tree is None else self.tree.draft_tree,
                             dynamic=None if self.tree is None else self.tree.dynamic, lookup=self.lookup,
                             max_draft_len=max_draft_len, quantization=self.quantization, pruning=self.pruning)


@dataclass(frozen=True)
class BuildSection:
    # None: the checkpoint's own dtype; auto: chosen for the building machine (runtime.config.choose_dtype), and
    # chosen again by the runtime for the machine that loads the engine
    dtype: Dtype | None = None
    tp_size: int = setting(1, ge=1)
    # prompt + generated tokens; None: the model's context (max_position_embeddings)
    max_seq_len: int | None = setting(None, ge=2)
    # draft nodes per step, root excluded (TensorRT-LLM's meaning)
    max_draft_len: int = setting(LoadConfig.max_draft_len, ge=0)
    max_batch_size: int = setting(8, ge=1)
    output: Path | None = None  # engine directory (the CLI's --output overrides it)
    onnx: bool = True
    tensorrt: bool = True

    def __post_init__(self) -> None:
        schema.check(self, BuildConfigError, "build")
        if self.max_seq_len is not None and self.max_draft_len + 1 > self.max_seq_len:
            raise BuildConfigError(
                f"build.max_draft_len: got {self.max_draft_len}, expected at most max_seq_len - 1 = "
                f"{self.max_seq_len - 1} (a tree step must fit in the sequence)"
            )


@dataclass(frozen=True)
class BuildConfig:
    model: ModelSection
    draft: DraftSection = field(default_factory=DraftSection)
    build: BuildSection = field(default_factory=BuildSection)
    source: str = setting("config", parsed=False)  # where it came from, for error messages

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, as engine.json records it (paths absolute)."""
        return schema.jsonable(self)

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of everything that determines the engine (the output path excluded)."""
        d = self.to_dict()
        d["build"].pop("output", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def with_output(self, output: str | Path | None) -> BuildConfig:
        if output is None:
            return self
        return dataclasses.replace(self, build=dataclasses.replace(self.build, output=Path(output).resolve()))


# ---- YAML -> dataclasses (runtime.schema, raising BuildConfigError) -------------------------------------


def read_yaml(path: str | Path, error: type[BuildConfigError] = BuildConfigError) -> tuple[Any, Path]:
    """The YAML document in `path` and the directory relative paths in it resolve from; failures raise `error`."""
    return schema.read_yaml(path, error)


def load_config(path: str | Path) -> BuildConfig:
    """Read and type-check a YAML build config; relative paths resolve from its directory."""
    data, base_dir = read_yaml(path)
    return parse_config(data, base_dir=base_dir, source=str(path))


def parse_config(data: Any, base_dir: str | Path = ".", source: str = "config") -> BuildConfig:
    """A parsed YAML document (dict) -> BuildConfig, every key and type checked."""
    config = from_mapping(BuildConfig, data, "", Path(base_dir).resolve(), source)
    return dataclasses.replace(config, source=source)


def from_mapping(cls: type, data: Any, path: str, base_dir: Path, source: str,
                 error: type[BuildConfigError] = BuildConfigError) -> Any:
    """A YAML mapping -> the frozen dataclass `cls` (`runtime.schema.load`: nested dataclasses, Literal / Path /
    tuple fields, declared bounds), rejecting unknown keys and wrong types with the key path; `path` is the key
    path of `data` in its document."""
    return schema.load(cls, data, error, path=path, source=source, base_dir=base_dir)


# ---- checking the config against its checkpoints ---------------------------------------------------------


@dataclass(frozen=True)
class BuildPlan:
    """A config checked against its checkpoints, with every default resolved."""

    config: BuildConfig
    model: ModelConfig  # the target, in the build dtype
    dtype_choice: DtypeChoice  # how the build dtype was chosen
    # The drafter as loaded: its tree and options resolved (the drafter's defaults filled in), the config's weights
    # path, max_draft_len = build.max_draft_len.
    draft: DraftSpec
    output: Path | None  # None only when plan_build(require_output=False)
    max_seq_len: int  # build.max_seq_len, or the model's context

    @property
    def dtype(self) -> str:
        return self.model.dtype


def default_of(cls: type, name: str) -> Any:
    """A dataclass field's default (the CLI reads its defaults from here)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


__all__ = [
    "BuildConfig", "ModelSection", "DraftSection", "TreeSection", "BuildSection", "BuildConfigError", "BuildError",
    "BuildPlan", "load_config", "parse_config", "default_of",
]
