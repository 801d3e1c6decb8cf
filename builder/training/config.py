"""The training configuration: one YAML file -> frozen dataclasses (checked like the build config).

    corpus:                      # the text the target and its heads learn from
      source: stdlib             # stdlib (this Python's own Lib/, test folders excluded) | files | chat
      path: null                 # root directory when source is files
      prompts: null              # chat: JSON Lines prompts the frozen target answers (self-distillation data;
                                 # builder.training.distill), held_out by prompt id
      pattern: "**/*.py"
      held_out: 0.05             # fraction of FILES kept apart, chosen by sha256 of the relative path
    target:                      # python -m builder train-target
      output: ../demo/target     # the Hugging Face checkpoint written at the end
      work_dir: ../out/demo-train/target   # tokens, resumable training state
      vocab_size: 4096           # byte-level BPE trained on the training split
      hidden_size: 256 ...       # Llama shape
      train: {lr: 3.0e-3, max_steps: 3000, max_minutes: 22, batch_size: 8, seq_len: 512, ...}
    heads:                       # python -m builder train-heads
      target: ../demo/target     # frozen target checkpoint (HF directory with tokenizer.json)
      work_dir: ../out/demo-train/heads
      medusa: {output: ../demo/medusa, num_heads: 4, num_layers: 1, train: {...}}
      eagle: {output: ../demo/eagle, train: {...}}

Relative paths resolve from the config file's directory; errors name the key path, the value and what was
expected (the parser is builder.config's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from builder.config import BuildConfigError, from_mapping, read_yaml

SaveDtype = Literal["float32", "bfloat16"]


class TrainConfigError(BuildConfigError):
    """A training configuration is malformed."""


def _check_min(section: str, obj: Any, minimums: dict[str, float], allow_none: tuple[str, ...] = ()) -> None:
    for name, minimum in minimums.items():
        value = getattr(obj, name)
        if value is None and name in allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
            raise TrainConfigError(f"{section}.{name}: got {value!r}, expected a number >= {minimum}")


@dataclass(frozen=True)
class CorpusSection:
    source: Literal["stdlib", "files", "chat"] = "stdlib"
    path: Path | None = None  # root directory (source: files)
    prompts: Path | None = None  # chat prompts (source: chat), answered by the frozen target
    max_new_tokens: int = 256  # chat: answer length cap
    generate_batch: int = 32  # chat: prompts answered per batched generate call
    answers: int = 1  # chat: answers per prompt, the greedy one then sampled ones
    answer_temperature: float = 0.8  # chat: temperature of the sampled answers
    pattern: str = "**/*.py"  # glob under the root
    # Path components that drop a file (test folders, installed third-party packages, caches).
    exclude_dirs: tuple[str, ...] = ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__")
    held_out: float = 0.05  # fraction of files kept apart
    max_file_bytes: int = 1_000_000  # larger files (generated tables) are skipped

    def __post_init__(self) -> None:
        if self.source == "files" and self.path is None:
            raise TrainConfigError("corpus.path: missing; source 'files' needs the corpus root directory")
        if self.source != "files" and self.path is not None:
            raise TrainConfigError(f"corpus.path: got {str(self.path)!r}, expected none for source {self.source!r}")
        if (self.source == "chat") != (self.prompts is not None):
            raise TrainConfigError(f"corpus.prompts: got {self.prompts!r}, expected a prompts file exactly when "
                                   f"source is 'chat' (source is {self.source!r})")
        _check_min("corpus", self, {"max_new_tokens": 1, "generate_batch": 1, "answers": 1,
                                    "answer_temperature": 1e-6})
        if not 0.0 < self.held_out < 1.0:
            raise TrainConfigError(f"corpus.held_out: got {self.held_out!r}, expected a fraction in (0, 1)")
        _check_min("corpus", self, {"max_file_bytes": 1})


@dataclass(frozen=True)
class OptimSection:
    """AdamW with linear warm-up then cosine decay to min_lr_ratio * lr, over whichever budget ends first."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    warmup_steps: int = 100
    max_steps: int = 1000
    max_minutes: float | None = None  # wall-clock budget (resumed runs count their earlier time)
    batch_size: int = 8
    seq_len: int = 512
    grad_clip: float = 1.0
    eval_every: int = 100  # steps between held-out evaluations
    eval_batches: int = 8  # fixed held-out windows per evaluation
    checkpoint_every: int = 100  # steps between resumable checkpoints
    seed: int = 0
    threads: int | None = None  # torch intra-op threads (None: torch's default)

    def __post_init__(self) -> None:
        _check_min("train", self, {
            "lr": 0.0, "min_lr_ratio": 0.0, "weight_decay": 0.0, "warmup_steps": 0, "max_steps": 1,
            "max_minutes": 0.0, "batch_size": 1, "seq_len": 2, "grad_clip": 0.0, "eval_every": 1,
            "eval_batches": 1, "checkpoint_every": 1, "seed": 0, "threads": 1,
        }, allow_none=("max_minutes", "threads"))
        if self.min_lr_ratio > 1.0:
            raise TrainConfigError(f"train.min_lr_ratio: got {self.min_lr_ratio!r}, expected a value in [0, 1]")


@dataclass(frozen=True)
class TargetSection:
    output: Path  # Hugging Face checkpoint directory written at the end
    work_dir: Path  # tokenizer + token cache + resumable state
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    save_dtype: SaveDtype = "bfloat16"
    train: OptimSection = field(default_factory=OptimSection)

    def __post_init__(self) -> None:
        _check_min("target", self, {
            "vocab_size": 260, "hidden_size": 8, "intermediate_size": 1, "num_hidden_layers": 1,
            "num_attention_heads": 1, "num_key_value_heads": 1, "max_position_embeddings": 2, "rope_theta": 1.0,
        })
        if self.hidden_size % self.num_attention_heads:
            raise TrainConfigError(f"target.num_attention_heads: got {self.num_attention_heads}, expected a divisor "
                                   f"of hidden_size {self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise TrainConfigError(f"target.num_key_value_heads: got {self.num_key_value_heads}, expected a divisor "
                                   f"of num_attention_heads {self.num_attention_heads}")
        if self.train.seq_len > self.max_position_embeddings:
            raise TrainConfigError(f"target.train.seq_len: got {self.train.seq_len}, expected at most "
                                   f"max_position_embeddings {self.max_position_embeddings}")


@dataclass(frozen=True)
class MedusaSection:
    output: Path  # FasterDecoding head directory
    num_heads: int = 4  # head i predicts the token i + 2 positions ahead
    num_layers: int = 1  # ResBlocks per head
    train: OptimSection = field(default_factory=OptimSection)

    def __post_init__(self) -> None:
        _check_min("heads.medusa", self, {"num_heads": 1, "num_layers": 0})


@dataclass(frozen=True)
class EagleSection:
    output: Path  # EAGLE-1 head directory (config.json + pytorch_model.bin)
    ce_weight: float = 0.1  # loss = SmoothL1(features) + ce_weight * CE(tokens); EAGLE uses 0.1
    feature_noise: float = 0.0  # uniform noise +-feature_noise on the input features (robustness to drift)
    train: OptimSection = field(default_factory=OptimSection)

    def __post_init__(self) -> None:
        _check_min("heads.eagle", self, {"ce_weight": 0.0, "feature_noise": 0.0})


@dataclass(frozen=True)
class HeadsSection:
    target: Path  # frozen target checkpoint
    work_dir: Path  # token cache + resumable state
    # What the heads learn to predict: the target's own distribution ("target", self-distillation: acceptance is
    # agreement with the target) or the corpus tokens ("data", Medusa-1's original recipe).
    labels: Literal["target", "data"] = "target"
    save_dtype: SaveDtype = "bfloat16"
    # Reduced draft vocabulary (EAGLE-3 / FR-Spec): the heads score only the K tokens the target produces most often
    # in the training answers (chat corpus only); None scores the whole vocabulary.
    draft_vocab_size: int | None = None
    medusa: MedusaSection | None = None
    eagle: EagleSection | None = None

    def __post_init__(self) -> None:
        if self.medusa is None and self.eagle is None:
            raise TrainConfigError("heads: neither medusa nor eagle is configured; nothing to train")
        _check_min("heads", self, {"draft_vocab_size": 2}, allow_none=("draft_vocab_size",))


@dataclass(frozen=True)
class TrainConfig:
    corpus: CorpusSection = field(default_factory=CorpusSection)
    target: TargetSection | None = None
    heads: HeadsSection | None = None
    source: str = field(default="config", metadata={"yaml": False})


def load_train_config(path: str | Path) -> TrainConfig:
    """Read and type-check a training YAML; relative paths resolve from its directory."""
    data, base_dir = read_yaml(path, TrainConfigError)
    return parse_train_config(data, base_dir=base_dir, source=str(path))


def parse_train_config(data: Any, base_dir: str | Path = ".", source: str = "config") -> TrainConfig:
    try:
        config = from_mapping(TrainConfig, data, "", Path(base_dir).resolve(), source)
    except TrainConfigError:
        raise
    except BuildConfigError as exc:
        raise TrainConfigError(str(exc)) from exc
    return dataclasses.replace(config, source=source)


__all__ = [
    "CorpusSection",
    "EagleSection",
    "HeadsSection",
    "MedusaSection",
    "OptimSection",
    "TargetSection",
    "TrainConfig",
    "TrainConfigError",
    "load_train_config",
    "parse_train_config",
]
