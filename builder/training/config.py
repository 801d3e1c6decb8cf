"""The training configuration: one YAML file -> frozen dataclasses (checked like the build config).

    corpus:                      # the text the target and its heads learn from
      source: stdlib             # stdlib (this Python's own Lib/, test folders excluded) | files | chat
      path: null                 # root directory when source is files
      prompts: null              # chat: JSON Lines prompts the frozen target answers (self-distillation data;
                                 # builder.training.distill), held_out by prompt id
      pattern: "**/*.py"
      held_out: 0.05             # fraction of FILES kept apart, chosen by sha256 of the relative path
    target:                      # python -m builder train-target
      output: ../models/target   # the Hugging Face checkpoint written at the end
      work_dir: ../out/train/target   # tokens, resumable training state
      vocab_size: 4096           # byte-level BPE trained on the training split
      hidden_size: 256 ...       # Llama shape
      train: {lr: 3.0e-3, max_steps: 3000, max_minutes: 22, batch_size: 8, seq_len: 512, ...}
    heads:                       # python -m builder train-heads
      target: ../models/target   # frozen target checkpoint (HF directory with tokenizer.json)
      work_dir: ../out/train/heads
      medusa: {output: ../heads/medusa, num_heads: 4, num_layers: 1, train: {...}}
      eagle: {output: ../heads/eagle, init: null, train: {...}}   # init: a head to fine-tune
      eagle3: {output: ../heads/eagle3, unroll: 7, feature_layers: null, train: {...}}

Relative paths resolve from the config file's directory; errors name the key path, the value and what was
expected (the parser is runtime.schema's, the bounds are declared on the fields).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from builder.config import BuildConfigError, from_mapping, read_yaml
from runtime import schema
from runtime.schema import setting

SaveDtype = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class CorpusSection:
    source: Literal["stdlib", "files", "chat"] = "stdlib"
    path: Path | None = None  # root directory (source: files)
    prompts: Path | None = None  # chat prompts (source: chat), answered by the frozen target
    max_new_tokens: int = setting(256, ge=1)  # chat: answer length cap
    generate_batch: int = setting(32, ge=1)  # chat: prompts answered per batched generate call
    answers: int = setting(1, ge=1)  # chat: answers per prompt, the greedy one then sampled ones
    answer_temperature: float = setting(0.8, ge=1e-6)  # chat: temperature of the sampled answers
    pattern: str = "**/*.py"  # glob under the root
    # Path components that drop a file (test folders, installed third-party packages, caches).
    exclude_dirs: tuple[str, ...] = ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__")
    held_out: float = setting(0.05, gt=0.0, lt=1.0)  # fraction of files kept apart
    max_file_bytes: int = setting(1_000_000, ge=1)  # larger files (generated tables) are skipped

    def __post_init__(self) -> None:
        if self.source == "files" and self.path is None:
            raise BuildConfigError("corpus.path: missing; source 'files' needs the corpus root directory")
        if self.source != "files" and self.path is not None:
            raise BuildConfigError(f"corpus.path: got {str(self.path)!r}, expected none for source {self.source!r}")
        if (self.source == "chat") != (self.prompts is not None):
            raise BuildConfigError(f"corpus.prompts: got {self.prompts!r}, expected a prompts file exactly when "
                                   f"source is 'chat' (source is {self.source!r})")
        schema.check(self, BuildConfigError, "corpus")


@dataclass(frozen=True)
class OptimSection:
    """AdamW with linear warm-up then cosine decay to min_lr_ratio * lr, over whichever budget ends first."""

    lr: float = setting(3e-3, ge=0.0)
    min_lr_ratio: float = setting(0.1, ge=0.0, le=1.0)
    weight_decay: float = setting(0.1, ge=0.0)
    warmup_steps: int = setting(100, ge=0)
    max_steps: int = setting(1000, ge=1)
    max_minutes: float | None = setting(None, ge=0.0)  # wall-clock budget (resumed runs count their earlier time)
    batch_size: int = setting(8, ge=1)
    seq_len: int = setting(512, ge=2)
    grad_clip: float = setting(1.0, ge=0.0)
    eval_every: int = setting(100, ge=1)  # steps between held-out evaluations
    eval_batches: int = setting(8, ge=1)  # fixed held-out windows per evaluation
    checkpoint_every: int = setting(100, ge=1)  # steps between resumable checkpoints
    seed: int = setting(0, ge=0)
    threads: int | None = setting(None, ge=1)  # torch intra-op threads (None: torch's default)

    def __post_init__(self) -> None:
        schema.check(self, BuildConfigError, "train")


@dataclass(frozen=True)
class TargetSection:
    output: Path  # Hugging Face checkpoint directory written at the end
    work_dir: Path  # tokenizer + token cache + resumable state
    vocab_size: int = setting(4096, ge=260)
    hidden_size: int = setting(256, ge=8)
    intermediate_size: int = setting(768, ge=1)
    num_hidden_layers: int = setting(4, ge=1)
    num_attention_heads: int = setting(8, ge=1)
    num_key_value_heads: int = setting(4, ge=1)
    max_position_embeddings: int = setting(2048, ge=2)
    rope_theta: float = setting(10000.0, ge=1.0)
    rms_norm_eps: float = 1e-5
    save_dtype: SaveDtype = "bfloat16"
    train: OptimSection = field(default_factory=OptimSection)

    def __post_init__(self) -> None:
        schema.check(self, BuildConfigError, "target")
        if self.hidden_size % self.num_attention_heads:
            raise BuildConfigError(f"target.num_attention_heads: got {self.num_attention_heads}, expected a divisor "
                                   f"of hidden_size {self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise BuildConfigError(f"target.num_key_value_heads: got {self.num_key_value_heads}, expected a divisor "
                                   f"of num_attention_heads {self.num_attention_heads}")
        if self.train.seq_len > self.max_position_embeddings:
            raise BuildConfigError(f"target.train.seq_len: got {self.train.seq_len}, expected at most "
                                   f"max_position_embeddings {self.max_position_embeddings}")


@dataclass(frozen=True)
class MedusaSection:
    output: Path  # FasterDecoding head directory
    num_heads: int = setting(4, ge=1)  # head i predicts the token i + 2 positions ahead
    num_layers: int = setting(1, ge=0)  # ResBlocks per head
    train: OptimSection = field(default_factory=OptimSection)

    def __post_init__(self) -> None:
        schema.check(self, BuildConfigError, "heads.medusa")


@dataclass(frozen=True)
class EagleSection:
    output: Path  # EAGLE-1 head directory (config.json + pytorch_model.bin)
    # Fine-tuning: an EAGLE-1 head directory (this layout; e.g. an earlier output) whose weights the run starts from
    # when it has no resumable state; its reduced draft vocabulary, if any, is kept (the lm_head rows it learnt for).
    init: Path | None = None
    # loss = SmoothL1(features) + ce_weight * CE(tokens); EAGLE uses 0.1
    ce_weight: float = setting(0.1, ge=0.0)
    # uniform noise +-feature_noise on the input features (robustness to drift)
    feature_noise: float = setting(0.0, ge=0.0)
    # Training-time test (HASS / EAGLE-3): from step unroll_from on, the head also runs unroll - 1 more times in each
    # window, each run reading the previous run's predicted features under the attention mask of tree drafting
    # (exact target features up to the tree's root, the head's own predictions along the branch), so depth d > 1 is
    # trained on what drafting at depth d sees. Run s (0-based) is weighted unroll_decay^s. 1: EAGLE-1 only.
    unroll: int = setting(1, ge=1, le=8)
    unroll_decay: float = setting(0.8, gt=0.0, le=1.0)
    unroll_from: int = setting(0, ge=0)
    train: OptimSection = field(default_factory=OptimSection)

    def __post_init__(self) -> None:
        schema.check(self, BuildConfigError, "heads.eagle")


@dataclass(frozen=True)
class Eagle3Section:
    output: Path  # EAGLE-3 head directory, the published layout (config.json + model.safetensors)
    # The target layers whose input streams the head reads (ascending); None: the engines' default (2, L // 2, L - 3)
    feature_layers: tuple[int, ...] | None = None
    # Training-time test: the head runs `unroll` times per window, run s reading run s-1's outputs under the mask of
    # tree drafting, a token loss at each run weighted unroll_decay^s (EAGLE-3 trains 7 steps, 0.8^s)
    unroll: int = setting(7, ge=1, le=16)
    unroll_decay: float = setting(0.8, gt=0.0, le=1.0)
    train: OptimSection = field(default_factory=OptimSection)

    def __post_init__(self) -> None:
        schema.check(self, BuildConfigError, "heads.eagle3")


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
    draft_vocab_size: int | None = setting(None, ge=2)
    medusa: MedusaSection | None = None
    eagle: EagleSection | None = None
    eagle3: Eagle3Section | None = None

    def __post_init__(self) -> None:
        if self.medusa is None and self.eagle is None and self.eagle3 is None:
            raise BuildConfigError("heads: none of medusa, eagle, eagle3 is configured; nothing to train")
        schema.check(self, BuildConfigError, "heads")


@dataclass(frozen=True)
class TrainConfig:
    corpus: CorpusSection = field(default_factory=CorpusSection)
    target: TargetSection | None = None
    heads: HeadsSection | None = None
    source: str = setting("config", parsed=False)


def load_train_config(path: str | Path) -> TrainConfig:
    """Read and type-check a training YAML; relative paths resolve from its directory."""
    data, base_dir = read_yaml(path, BuildConfigError)
    return parse_train_config(data, base_dir=base_dir, source=str(path))


def parse_train_config(data: Any, base_dir: str | Path = ".", source: str = "config") -> TrainConfig:
    config = from_mapping(TrainConfig, data, "", Path(base_dir).resolve(), source, BuildConfigError)
    return dataclasses.replace(config, source=source)


__all__ = [
    "CorpusSection",
    "Eagle3Section",
    "EagleSection",
    "HeadsSection",
    "MedusaSection",
    "OptimSection",
    "TargetSection",
    "TrainConfig",
    "load_train_config",
    "parse_train_config",
]
