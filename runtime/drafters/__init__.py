"""Drafters: propose a tree of candidate tokens each step (the `Drafter` / `DraftSession` protocol).

    load_drafter("medusa", model, path, tree=None)          FasterDecoding Medusa-1 heads, static tree
    load_drafter("eagle", model, path, tree=None, **opts)   EAGLE-1 head; static tree, or EAGLE-2 dynamic tree
                                                            (total_tokens, depth, top_k) when tree is None
    load_drafter("lookup", model, **opts)                   prompt lookup (n-gram copy), no weights
    load_drafter("none", model)                             root-only trees: plain autoregressive decoding

Every drafter proposes top-k / fixed candidates (Proposal.DETERMINISTIC) and returns Draft.tokens as a CPU int64
tensor (node 0 = the root); sessions never return more than the `max_nodes` given to `Drafter.start`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.errors import ConfigError
from runtime.tree import Tree

if TYPE_CHECKING:
    from runtime.protocol import Drafter

KINDS = ("medusa", "eagle", "lookup", "none")


def as_tree(tree: Tree | str | Sequence[Sequence[int]] | None) -> Tree | None:
    """A Tree, a preset name / JSON list of paths (see `Tree.parse`), or a list of choice paths."""
    if tree is None or isinstance(tree, Tree):
        return tree
    if isinstance(tree, str):
        return Tree.parse(tree)
    if isinstance(tree, Sequence):
        return Tree.from_choices(tree) if len(tree) else Tree.root_only()
    raise ConfigError(f"tree must be a Tree, a preset name or a list of choice paths, got {type(tree).__name__}")


def _reject_options(kind: str, options: dict[str, Any], allowed: Sequence[str]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown} for drafter {kind!r}; accepted: {sorted(allowed) if allowed else 'none'}"
        )


def load_drafter(
    kind: str,
    model: Any,
    path: str | Path | None = None,
    tree: Tree | str | Sequence[Sequence[int]] | None = None,
    **options: Any,
) -> Drafter:
    """Build the drafter `kind` for the target `model` (a `runtime.model.TargetModel`).

    path     head checkpoint directory (medusa, eagle); must be None for lookup / none.
    tree     static tree (Tree, preset name such as "mc_sim_7b_63" / "chain-4", or choice paths). Medusa
             defaults to mc_sim_7b_63 when it has >= 4 heads, else a chain as deep as its heads; EAGLE uses its
             dynamic (EAGLE-2) tree when tree is None.
    options  eagle: total_tokens, depth, top_k (dynamic tree only).
             lookup: max_ngram, min_ngram, num_draft_tokens, max_depth, max_branches.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown drafter kind {kind!r}; expected one of {', '.join(KINDS)}")
    static = as_tree(tree)
    if kind in ("medusa", "eagle"):
        if path is None:
            raise ConfigError(f"drafter {kind!r} needs path= (its head checkpoint directory)")
    elif path is not None:
        raise ConfigError(f"drafter {kind!r} has no weights; got path={str(path)!r}")

    if kind == "none":
        _reject_options(kind, options, ())
        if static is not None and static.num_nodes != 1:
            raise ConfigError(f"drafter 'none' drafts root-only trees; got a tree with {static.num_nodes} nodes")
        from runtime.drafters.none import NoneDrafter

        return NoneDrafter()

    if kind == "lookup":
        from runtime.drafters.lookup import LookupDrafter, LookupOptions

        _reject_options(kind, options, ("max_ngram", "min_ngram", "num_draft_tokens", "max_depth", "max_branches"))
        if static is not None:
            raise ConfigError("drafter 'lookup' builds its own trees from matches; do not pass tree=")
        return LookupDrafter(LookupOptions(**options))

    config = model.config
    if kind == "medusa":
        from runtime.drafters.medusa import MedusaDrafter, check_against_target, load_medusa_heads

        _reject_options(kind, options, ())
        heads = load_medusa_heads(path, dtype=model.dtype)
        check_against_target(heads, config.hidden_size, config.vocab_size, str(path))
        heads = heads.to(model.device)
        if static is None:
            n = heads.config.num_heads
            static = Tree.preset("mc_sim_7b_63") if n >= Tree.preset("mc_sim_7b_63").max_depth else Tree.chain(n)
        return MedusaDrafter(heads, static, source=str(path))

    from runtime.drafters.eagle import DynamicTreeOptions, EagleDrafter, load_eagle_head

    _reject_options(kind, options, ("total_tokens", "depth", "top_k"))
    if static is not None and options:
        raise ConfigError(f"options {sorted(options)} apply to the dynamic EAGLE-2 tree only; got a static tree too")
    head = load_eagle_head(path, model)
    return EagleDrafter(head, model, tree=static, dynamic=DynamicTreeOptions(**options) if static is None else None)


__all__ = ["KINDS", "as_tree", "load_drafter"]
