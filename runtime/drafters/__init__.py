"""Drafters: propose a tree of candidate tokens each step (the `Drafter` / `DraftSession` protocol).

    load_drafter(spec, model)      the drafter a `runtime.draft_spec.DraftSpec` describes, for the target `model`:
        medusa   FasterDecoding Medusa-1 heads, static tree                              (medusa.py)
        eagle    EAGLE-1 head; static tree, or EAGLE-2's dynamic tree                    (eagle.py)
        lookup   prompt lookup (n-gram copy), no weights                                 (lookup.py)
        none     root-only trees: plain autoregressive decoding                          (none.py)
    medusa / eagle with lookup options: prompt-lookup continuations merged into each tree  (merged.py), and with
        lookup's datastore_tokens one from the datastore of the target's answers in the head directory (datastore.py)

Every drafter proposes top-k / fixed candidates (Proposal.DETERMINISTIC) and returns Draft.tokens as a CPU int64
tensor (node 0 = the root); sessions never return more than the `max_nodes` given to `Drafter.start`. A loaded
drafter's `spec` says what it drafts, every default resolved (its tree, its options).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.draft_spec import DraftSpec, DynamicTreeOptions, LookupOptions
from runtime.tree import Tree

if TYPE_CHECKING:
    from runtime.protocol import Drafter

MEDUSA_DEFAULT_TREE = "mc_sim_7b_63"  # Medusa's default tree, for heads at least as many as its depth


def load_drafter(spec: DraftSpec, model: Any) -> Drafter:
    """Build the drafter `spec` describes for the target `model` (a `runtime.model.TargetModel`).

    Defaults for what the spec leaves unset: Medusa's tree is mc_sim_7b_63 when it has at least as many heads as
    that tree is deep, else a chain as deep as its heads; EAGLE without a static tree drafts the dynamic (EAGLE-2)
    tree with `spec.dynamic` or the default options; lookup uses `spec.lookup` or the default options; medusa /
    eagle with `spec.lookup` merge prompt lookup into their trees (`MergedDrafter`).
    spec.max_draft_len is not the drafter's: the decoder bounds each step's tree with it.
    """
    spec.require_weights()
    if spec.merges_lookup:
        from runtime.drafters.lookup import LookupDrafter
        from runtime.drafters.merged import MergedDrafter

        lk, datastore = spec.lookup, None
        if lk.datastore_tokens:
            from runtime.drafters.datastore import DATASTORE_FILE, Datastore

            datastore = Datastore.load(Path(spec.path) / DATASTORE_FILE, model.config.vocab_size,
                                       lk.datastore_min_ngram, lk.datastore_max_ngram)
        return MergedDrafter(load_drafter(spec.model_only, model), LookupDrafter(lk, datastore))
    if spec.kind == "none":
        from runtime.drafters.none import NoneDrafter

        return NoneDrafter()

    if spec.kind == "lookup":
        from runtime.drafters.lookup import LookupDrafter

        return LookupDrafter(spec.lookup if spec.lookup is not None else LookupOptions())

    config = model.config
    static = spec.static_tree
    if spec.kind == "medusa":
        from runtime.drafters.medusa import MedusaDrafter, check_against_target, load_medusa_heads

        heads = load_medusa_heads(spec.path, dtype=model.dtype)
        check_against_target(heads, config.hidden_size, config.vocab_size, spec.path)
        heads = heads.to(model.device)
        if static is None:
            n, default = heads.config.num_heads, Tree.preset(MEDUSA_DEFAULT_TREE)
            static = default if n >= default.max_depth else Tree.chain(n)
        return MedusaDrafter(heads, static, source=spec.path)

    from runtime.drafters.eagle import EagleDrafter, load_eagle_head

    head = load_eagle_head(spec.path, model)
    dynamic = None if static is not None else spec.dynamic if spec.dynamic is not None else DynamicTreeOptions()
    return EagleDrafter(head, model, tree=static, dynamic=dynamic, quantization=spec.quantization, pruning=spec.pruning)


__all__ = ["load_drafter"]
