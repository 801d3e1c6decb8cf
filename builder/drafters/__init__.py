"""The builder's share of each drafter kind: what `plan_build`, the engine directory, the TensorRT-LLM export, the
tensorrtllm-backend render and head training do for it, as the hooks of a `BuilderKind`. The runtime's share (rules,
loader) is the kind's `runtime.draft_spec.DrafterKind`; this is registered the same way, by name.

A kind module here (`builder/drafters/<kind>.py`) subclasses `BuilderKind` and names the instance `KIND`. The
registry (`builder_kind`) imports the built-in ones (`BUILTIN_KINDS`) by name on the first lookup; `register` adds
another. A kind registered in the runtime without a module here gets the defaults: nothing beyond the target is
written or exported (TensorRT-LLM then runs the target alone), nothing is trained, and a kind with head weights is
refused by the build (nothing here can write them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from builder.config import BuildConfigError, BuildPlan, BuildSection
from builder.training.config import HeadsSection
from runtime.config import ModelConfig
from runtime.draft_spec import DraftSpec, drafter_kind
from runtime.drafters.draft_vocab import DraftVocab
from runtime.engine import QKVLayout
from runtime.registry import Registry

BUILTIN_KINDS = ("builder.drafters.medusa", "builder.drafters.eagle3", "builder.drafters.eagle",
                 "builder.drafters.lookup")


@dataclass(frozen=True)
class TrainingTarget:
    """What a head's training reads from the frozen target, the same whether its features are computed per window
    (a text corpus) or read from a cache (self-distillation on chat answers)."""

    view: nn.Module  # .model.embed_tokens (the target's) and .lm_head (over the draft vocabulary)
    config: Any  # the target's transformers config: the shapes heads are built from
    lm_head_weight: torch.Tensor  # [K, H]: the target's lm_head rows of the K draft tokens (K = V when not reduced)


@dataclass(frozen=True)
class EvalBatch:
    """One held-out window as the metrics see it. Ids the heads output live in the draft vocabulary (the target's
    when it is not reduced); a target token outside a reduced draft vocabulary is -1 (never matched)."""

    ids: torch.Tensor  # [1, T] int64 target ids (the head's inputs)
    hidden: torch.Tensor  # [1, T, H] the target's final-norm hidden states (then its feature layers' streams, for a
    #                       kind with `BuilderKind.feature_layers`: [1, T, H * (1 + F)])
    greedy: torch.Tensor  # [1, T] int64 the target's greedy next token at each position, as a draft id
    data: torch.Tensor  # [1, T] int64 ids as draft ids


# a head training's initial state: its weights (the training module's keys, float32) and reduced draft vocabulary
HeadInit = tuple[dict[str, torch.Tensor], DraftVocab | None]


class BuilderKind:
    """The builder's hooks for one drafter kind; the defaults fit a kind without head weights."""

    name: str

    # ---- the plan (builder.plan.plan_build) -------------------------------------------------------------------

    def check_target(self, model: ModelConfig) -> None:
        """ConfigError when this kind cannot be built for the target at all (before its head is read)."""

    def check_drafter(self, model: ModelConfig, drafter: Any, build: BuildSection) -> None:
        """ConfigError "KEY: why" (a build-section key) when the loaded drafter cannot be built this way."""

    # ---- the engine directory (builder.build) -----------------------------------------------------------------

    def write_weights(self, out: Path, drafter: Any) -> str:
        """Write a weighted drafter's weights into `out` (the engine's draft/) in their public format; the file's
        name."""
        raise BuildConfigError(f"draft.method: drafter {self.name!r} has head weights, but no builder module to write "
                               "them into an engine")

    def draft_config(self, drafter: Any) -> dict[str, Any]:
        """engine.json's "draft" "config": the head's shapes."""
        return {}

    def deploy_files(self, plan: BuildPlan, drafter: Any) -> dict[str, str]:
        """Files that deploy the engine's drafter elsewhere (other engines' configs), {path relative to the engine
        directory: text}; checksummed with the rest."""
        return {}

    # ---- TensorRT-LLM 1.2 (builder.trtllm) and the tensorrtllm backend (model_repo.tensorrtllm) ---------------

    backend_decoding_mode: ClassVar[str] = "top_k_top_p"  # tensorrtllm_backend's decoding_mode parameter
    # TensorRT-LLM decodes this kind's static tree (the backend's "<name>_choices", examples/run.py's) itself
    trtllm_tree: ClassVar[bool] = False
    trtllm_mpirun: ClassVar[bool] = True  # examples/run.py runs under mpirun, one process per rank

    def trtllm_config(self, plan: BuildPlan, drafter: Any,
                      decoder_fields: Callable[[ModelConfig], dict[str, Any]]) -> dict[str, Any]:
        """What this kind sets in trtllm_checkpoint/config.json (its architecture, its keys); `decoder_fields` gives
        the PretrainedConfig fields of a Llama-family model config in the export's dtype and tp."""
        return {}

    def trtllm_tensors(self, plan: BuildPlan, drafter: Any, target: dict[str, torch.Tensor],
                       tensors: dict[str, torch.Tensor]) -> QKVLayout | None:
        """Add this kind's tensors to the full TensorRT-LLM tensors of the target (`target`: its HF tensors); the
        attention layout of a draft network to shard with them, if it has one."""
        return None

    def trtllm_build_args(self, plan: BuildPlan) -> list[str]:
        """trtllm-build's speculative-decoding arguments."""
        return []

    def trtllm_run_args(self, plan: BuildPlan) -> list[str]:
        """examples/run.py's arguments for this drafter."""
        return []

    def check_trtllm_backend(self, draft: DraftSpec) -> None:
        """ConfigError when the tensorrtllm backend cannot serve an engine built for `draft`."""

    # ---- head training (builder.train_heads: `python -m builder train-heads`, a heads.<name> section) ---------

    trains: ClassVar[bool] = False
    metrics_meaning: ClassVar[str] = ""  # what its held-out metrics' entries are
    metrics_rows: ClassVar[tuple[str, int]] = ("entry", 0)  # the report's row label and first index
    resume_ignores: ClassVar[tuple[str, ...]] = ()  # section keys a resumed run may change

    def feature_layers(self, section: Any, target_config: Any) -> tuple[int, ...]:
        """The target layers whose features (`runtime.model`) the head reads beside the final-norm state: its
        training rows are then [final-norm state, those layers' streams] (() for most kinds)."""
        return ()

    def init_head(self, section: Any, target_vocab: int) -> HeadInit | None:
        """The weights a run with no resumable state starts from (None: fresh ones)."""
        return None

    def train_module(self, section: Any, target: TrainingTarget, init: HeadInit | None) -> nn.Module:
        raise NotImplementedError

    def train_loss(self, module: nn.Module, section: Any, target: TrainingTarget, ids: torch.Tensor,
                   hidden: torch.Tensor, logits: torch.Tensor, labels: str,
                   step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """ids # [B, T] int64, hidden # [B, T, H], logits # [B, T, K] (the target's, over the draft vocabulary) ->
        the loss and what to log beside it."""
        raise NotImplementedError

    def train_metrics(self, module: nn.Module, target: TrainingTarget,
                      batches: Iterable[EvalBatch]) -> dict[str, list[float]]:
        raise NotImplementedError

    def save_head(self, module: nn.Module, section: Any, heads: HeadsSection, target_config: Any, log_file: Path,
                  vocab: DraftVocab | None) -> Path:
        """The head directory in its public format (section.output, its training log inside), loadable by the
        runtime's loader."""
        raise NotImplementedError


_KINDS: Registry[BuilderKind] = Registry("builder module of a drafter kind", BuilderKind, BUILTIN_KINDS)


class _Defaults(BuilderKind):
    """A kind with no builder module."""

    def __init__(self, name: str) -> None:
        self.name = name


@functools.cache
def _defaults(name: str) -> BuilderKind:
    return _Defaults(name)


def builder_kind(name: str) -> BuilderKind:
    """The builder's hooks for drafter kind `name` (a kind the runtime knows: DraftSpecError otherwise)."""
    drafter_kind(name)
    return _KINDS.get(name) or _defaults(name)


def builder_kinds() -> tuple[BuilderKind, ...]:
    """The builder modules' kinds: the built-in ones, then those `register`ed."""
    return _KINDS.all()


def trained_kinds() -> tuple[str, ...]:
    """The kinds `python -m builder train-heads` trains (each its heads.<name> section)."""
    return tuple(k.name for k in builder_kinds() if k.trains)


def register(kind: BuilderKind) -> BuilderKind:
    """Add the builder module of a kind from outside BUILTIN_KINDS; the same object again is a no-op."""
    return _KINDS.register(kind)


def unregister(name: str) -> None:
    _KINDS.unregister(name)


__all__ = [
    "BUILTIN_KINDS", "BuilderKind", "EvalBatch", "HeadInit", "TrainingTarget", "builder_kind", "builder_kinds",
    "register", "trained_kinds", "unregister",
]
