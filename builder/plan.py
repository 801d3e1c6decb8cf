"""`plan_build(config)`: a build config checked against the checkpoints it names, every default resolved, as a
`builder.config.BuildPlan` (what `python -m builder validate` runs, and every build first). The drafter's own checks
are its builder kind's (`builder.drafters`): the runtime's loader validates its head, the kind what the export needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from builder.config import BuildConfig, BuildConfigError, BuildPlan
from builder.drafters import builder_kind
from runtime.config import ModelConfig, choose_dtype
from runtime.draft_spec import FIELD_NAMES, DraftSpec
from runtime.drafters import load_drafter
from runtime.engine import QKVLayout
from runtime.errors import CheckpointError, ConfigError, SpectreeError


@contextmanager
def at_key(source: str, key: str) -> Iterator[None]:
    """Re-raise any spectree error inside as a BuildConfigError naming the config key it concerns."""
    try:
        yield
    except BuildConfigError:
        raise
    except SpectreeError as exc:
        raise BuildConfigError(f"{source}: {key}: {exc}") from exc


def check_tokenizer(checkpoint: Path, model: ModelConfig) -> None:
    """A checkpoint's tokenizer.json (when it has one: an engine without it serves token ids only) must load the
    way the runtime loads it, and every id it can produce must be one the model embeds."""
    if not (checkpoint / "tokenizer.json").is_file():
        return
    from runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(checkpoint)  # TokenizerError names the file and what is wrong
    if tokenizer.vocab_size > model.vocab_size:
        raise BuildConfigError(
            f"{checkpoint / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, but the model embeds only vocab_size "
            f"{model.vocab_size}; expected a tokenizer of at most that many"
        )


def meta_target(config: ModelConfig):
    """A weightless TargetModel (meta device) of `config`: enough for the drafters' loaders to validate heads."""
    from runtime.model import TargetModel

    with torch.device("meta"):
        model = TargetModel(config)
    return model.to(config.torch_dtype)


def make_drafter(config: BuildConfig, model: Any, source: str = "config"):
    """The runtime drafter for this config and `model` (a TargetModel, real or meta), via `load_drafter`.

    The drafters' loaders do all head validation (files, hidden / vocab sizes, tree depth vs Medusa heads).
    """
    d = config.draft
    try:
        return load_drafter(d.spec(), model)
    except CheckpointError as exc:  # head files: missing, corrupt, or not matching the target
        raise BuildConfigError(f"{source}: draft.checkpoint: {exc}") from exc
    except ConfigError as exc:  # e.g. a tree deeper than the Medusa heads
        raise BuildConfigError(f"{source}: {'draft.tree' if d.tree is not None else 'draft'}: {exc}") from exc


def plan_build(config: BuildConfig, require_output: bool = True) -> BuildPlan:
    """Check `config` against the checkpoints it names (reads configs and head weights, not the target's weights).

    require_output=False lets `validate` check a config whose output comes from the command line later.
    """
    source = config.source
    b = config.build
    with at_key(source, "model.checkpoint"):
        model = ModelConfig.from_hf(config.model.checkpoint)
        check_tokenizer(Path(config.model.checkpoint), model)
    dtype_choice = choose_dtype(b.dtype, model.dtype, runs_here=False)
    model = model.with_dtype(dtype_choice.dtype)
    if b.max_seq_len is not None and b.max_seq_len > model.max_context:
        capped = ", capped by sliding_window" if model.sliding_window else ""
        raise BuildConfigError(f"{source}: build.max_seq_len: got {b.max_seq_len}, expected at most "
                               f"{model.max_context} (the model's context: max_position_embeddings{capped})")
    with at_key(source, "build.tp_size"):
        QKVLayout.of(model).check_tp(b.tp_size, "target attention")
    for name in ("intermediate_size", "hidden_size"):
        if getattr(model, name) % b.tp_size:
            raise BuildConfigError(
                f"{source}: build.tp_size: got {b.tp_size}, expected a divisor of the model's {name} "
                f"{getattr(model, name)}"
            )
    wanted = config.draft.spec()
    kind = builder_kind(wanted.kind)
    try:
        kind.check_target(model)
    except ConfigError as exc:
        raise BuildConfigError(f"{source}: {FIELD_NAMES['kind'].yaml}: {exc}") from exc

    drafter = make_drafter(config, meta_target(model), source)
    draft = dataclasses.replace(drafter.spec, path=wanted.path, max_draft_len=b.max_draft_len)
    try:
        kind.check_drafter(model, drafter, b)
    except ConfigError as exc:
        raise BuildConfigError(f"{source}: {exc}") from exc
    plan = BuildPlan(
        config=config,
        model=model,
        dtype_choice=dtype_choice,
        draft=draft,
        output=b.output,
        max_seq_len=b.max_seq_len if b.max_seq_len is not None else model.max_context,
    )
    if b.max_draft_len + 1 > plan.max_seq_len:
        raise BuildConfigError(f"{source}: build.max_draft_len: got {b.max_draft_len}, expected at most "
                               f"{plan.max_seq_len - 1} (max_seq_len - 1)")
    if draft.draft_nodes > b.max_draft_len:
        what = _sized_by(draft)
        default = (f" (the drafter's default; set {FIELD_NAMES['tree'].yaml})"
                   if draft.drafter_kind.weighted and config.draft.tree is None else "")
        raise BuildConfigError(
            f"{source}: {what}: {draft.draft_nodes} draft nodes per step (root excluded){default}, expected at most "
            f"build.max_draft_len = {b.max_draft_len}"
        )
    if b.output is None and require_output:
        raise BuildConfigError(f"{source}: build.output: missing; set it in the config or pass --output")
    return plan




def _sized_by(draft: DraftSpec) -> str:
    """The YAML keys that set how many nodes a step drafts."""
    keys = [draft.drafter_kind.sized_by] + (["lookup.num_draft_tokens"] if draft.merges_lookup else [])
    return " + ".join(FIELD_NAMES[k.partition(".")[0]].yaml + k[len(k.partition(".")[0]):] for k in keys)


__all__ = ["at_key", "check_tokenizer", "make_drafter", "meta_target", "plan_build"]
