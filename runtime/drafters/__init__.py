"""Drafters: propose a tree of candidate tokens each step (the `Drafter` / `DraftSession` protocol).

    load_drafter(spec, model)      the drafter a `runtime.draft_spec.DraftSpec` describes, for the target `model`,
                                   by its kind's loader (`DrafterKind.load`); the built-in kinds:
        medusa   FasterDecoding Medusa-1 heads, static tree                              (medusa.py)
        eagle    EAGLE-1 head; static tree, or EAGLE-2's dynamic tree                    (eagle.py)
        eagle3   EAGLE-3 head (three target layers' features), eagle's trees             (eagle3.py)
        lookup   prompt lookup (n-gram copy), no weights                                 (lookup.py)
        none     root-only trees: plain autoregressive decoding                          (none.py)
    a weighted kind with lookup options: prompt-lookup continuations merged into each tree  (merged.py), and with
        lookup's datastore_tokens one from the datastore of the target's answers in the head directory (datastore.py)

Every drafter proposes top-k / fixed candidates (Proposal.DETERMINISTIC) and returns Draft.tokens as a CPU int64
tensor (node 0 = the root); sessions never return more than the `max_nodes` given to `Drafter.start`. A loaded
drafter's `spec` says what it drafts, every default resolved (its tree, its options).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runtime.draft_spec import DraftSpec

if TYPE_CHECKING:
    from runtime.protocol import Drafter


def load_drafter(spec: DraftSpec, model: Any) -> Drafter:
    """Build the drafter `spec` describes for the target `model` (a `runtime.model.TargetModel`): its kind's loader
    fills in what the spec leaves unset (each kind's module says how), and a weighted kind with `spec.lookup` merges
    prompt lookup into its trees (`MergedDrafter`). spec.max_draft_len is not the drafter's: the decoder bounds each
    step's tree with it."""
    spec.require_weights()
    if spec.merges_lookup:
        from runtime.drafters.lookup import LookupDrafter
        from runtime.drafters.merged import MergedDrafter

        lookup = LookupDrafter.merged(spec.lookup, spec.path, model.config.vocab_size)
        return MergedDrafter(load_drafter(spec.model_only, model), lookup)
    return spec.drafter_kind.load(spec, model)


__all__ = ["load_drafter"]
