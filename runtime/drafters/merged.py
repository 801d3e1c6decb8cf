"""A model drafter (Medusa / EAGLE) with prompt-lookup continuations merged into each step's tree.

The two miss in different places: a head guesses well a few tokens ahead anywhere, prompt lookup copies long runs
exactly where the text repeats itself (code echoed from the prompt, a list's repeated phrasing). Each step the model
drafter proposes its tree, prompt lookup its continuations, and the continuations are grafted onto the tree as a
trie over tokens (`merge_drafts`): a lookup node whose token path from the root is already in the tree is shared,
the rest are added as new branches, within the step's node budget. Verification is unchanged: both propose fixed
candidates (Proposal.DETERMINISTIC) and siblings stay distinct, so the merged tree is just another candidate tree
and the output is what the target alone would say.

When the model drafter scores its nodes (EAGLE: the head's path log-probs, `Draft.scores`), the budget goes to the
best candidates of both, EAGLE-2's rule over the union (`merge_pools`): a lookup node counts as a probability per
token by the length of the n-gram its continuation matched (`LookupOptions.token_prob`; a datastore node as
`datastore_token_prob`), a node's score is its parent's plus the likelier of its sources' steps to it, and the merged
tree keeps the highest-scoring nodes (`select_dynamic_tree`). An EAGLE-2 session offers its whole candidate pool
(`CandidatePool`, `EagleSession.candidates`), not its own best few, so a head candidate below a lookup node competes
too. Measured with SmolLM2 and its head, trees of 16 nodes: the head's weakest nodes were on the target's path less
often than a lookup continuation's first few, and ranking both by probability took tau from 3.09 (the head's tree
first, lookup in what budget is left) to 3.18 on training-held-out prompts; scoring lookup nodes by their match
length, merging the head's whole pool and three lookup continuations took it further (demo/smollm2/README.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from runtime.draft_spec import DraftSpec
from runtime.drafters.lookup import LookupDrafter, LookupSession
from runtime.errors import ConfigError
from runtime.protocol import Draft, DraftSession, Proposal
from runtime.tree import CandidatePool, Tree, select_dynamic_tree_lists


def merge_drafts(primary: Draft, extra: Draft, max_nodes: int) -> Draft:
    """`primary`'s tree with `extra`'s nodes grafted on by token: a node of `extra` whose token path exists in the
    merged tree is shared, a new one becomes the next sibling rank under its (merged) parent. Nodes are taken in
    `extra`'s order (parents first) while the tree has fewer than max_nodes nodes. Returns `primary` itself when
    nothing is added. Both must propose fixed candidates (DETERMINISTIC) and share the root. When both carry scores
    (`Draft.scores`), the max_nodes best nodes of the union instead (`_merge_scored`; the module doc)."""
    if primary.proposal is not Proposal.DETERMINISTIC or extra.proposal is not Proposal.DETERMINISTIC:
        raise ConfigError("merge_drafts merges fixed-candidate (DETERMINISTIC) drafts only, got "
                          f"{primary.proposal.value} and {extra.proposal.value}")
    p_tokens, e_tokens = primary.tokens.tolist(), extra.tokens.tolist()  # [num_nodes] each
    if p_tokens[0] != e_tokens[0]:
        raise ConfigError(f"merge_drafts: roots differ ({p_tokens[0]} and {e_tokens[0]})")
    if primary.scores is not None and extra.scores is not None:
        return merge_pools([draft_pool(primary), draft_pool(extra)], p_tokens[0], max_nodes)
    paths: list[tuple[int, ...]] = [()] + list(primary.tree.choices)  # node -> rank path
    # children[path] = {token: child rank path} of the merged tree
    children: dict[tuple[int, ...], dict[int, tuple[int, ...]]] = {path: {} for path in paths}
    for path, tok in zip(paths[1:], p_tokens[1:]):
        children[path[:-1]][tok] = path
    token_of = dict(zip(paths, p_tokens))
    merged_of: dict[int, tuple[int, ...]] = {0: ()}  # extra node -> its merged path (absent: not taken)
    added = 0
    e_parents = extra.tree.parent_list
    for node in range(1, extra.tree.num_nodes):
        parent = merged_of.get(e_parents[node])
        if parent is None:
            continue
        tok = e_tokens[node]
        path = children[parent].get(tok)
        if path is None:
            if len(token_of) >= max_nodes:
                continue
            path = parent + (len(children[parent]),)
            children[parent][tok] = path
            children[path] = {}
            token_of[path] = tok
            added += 1
        merged_of[node] = path
    if not added:
        return primary
    tree = Tree.from_choices([p for p in token_of if p])
    tokens = [p_tokens[0]] + [token_of[p] for p in tree.choices]
    return Draft(tree, torch.tensor(tokens, dtype=torch.int64), Proposal.DETERMINISTIC)


def draft_pool(draft: Draft) -> CandidatePool:
    """A scored draft's nodes below its root as a candidate pool (canonical order: parents first)."""
    parents = torch.tensor(draft.tree.parent_list[1:], dtype=torch.int64) - 1  # node i -> pool entry i - 1
    return CandidatePool(parents, draft.tokens[1:], draft.scores[1:])


def merge_pools(pools: list[CandidatePool], root: int, max_nodes: int) -> Draft:
    """The union of scored candidates as a trie over tokens, cut to its max_nodes best nodes by EAGLE-2's rule
    (`select_dynamic_tree`); the result carries the scores it ranked by. root: the root token all pools hang from.

    A node's score in the union is its parent's plus the likelier of its sources' conditional log-probabilities
    (a source's score minus that of the node's parent in it): a head candidate below a lookup node the head
    itself found unlikely is ranked by what the head says of it given that node, not by the head's doubt about
    the node, which the lookup has overruled."""
    pool_parent: list[int] = []  # the union in creation order (parents first): parent pool index (-1: the root),
    pool_tokens: list[int] = []  # token
    pool_cond: list[float] = []  # the best conditional log-probability given the parent
    index_of: dict[tuple[int, int], int] = {}  # (parent pool index, token) -> pool index
    for pool in pools:
        where: list[int] = []  # this pool's entry -> union index (a parent before its children)
        scores = pool.scores.tolist()
        for parent, tok, score in zip(pool.parents.tolist(), pool.tokens.tolist(), scores):
            key = (where[parent] if parent >= 0 else -1, tok)
            cond = score - (scores[parent] if parent >= 0 else 0.0)
            cond = -math.inf if math.isnan(cond) else cond  # as select_dynamic_tree ranks NaN
            i = index_of.get(key)
            if i is None:
                i = index_of[key] = len(pool_parent)
                pool_parent.append(key[0])
                pool_tokens.append(tok)
                pool_cond.append(cond)
            else:
                pool_cond[i] = max(pool_cond[i], cond)
            where.append(i)
    if not pool_parent:
        return Draft(Tree.root_only(), torch.tensor([root], dtype=torch.int64), Proposal.DETERMINISTIC,
                     scores=torch.zeros(1))
    pool_scores: list[float] = []
    for parent, cond in zip(pool_parent, pool_cond):
        pool_scores.append((pool_scores[parent] if parent >= 0 else 0.0) + cond)
    # ranked in float32, as a drafter's scores are handed over
    scores32 = np.asarray(pool_scores, dtype=np.float32).tolist()
    tree, tokens, scores = select_dynamic_tree_lists(pool_parent, pool_tokens, scores32, max_nodes, root_token=root)
    return Draft(tree, tokens, Proposal.DETERMINISTIC, scores=scores)


class MergedDrafter:
    """`primary` (medusa / eagle) drafting the tree, `lookup` merging its continuations in (see the module doc)."""

    def __init__(self, primary: Any, lookup: LookupDrafter) -> None:
        self.primary = primary
        self.lookup = lookup
        self.name = primary.name

    def __getattr__(self, name: str) -> Any:
        # The model drafter's own attributes (its head / heads, tree, ...) stay reachable: tools that inspect the
        # loaded drafter see the model drafter, merged or not.
        if name in ("primary", "lookup"):
            raise AttributeError(name)
        return getattr(self.primary, name)

    @property
    def spec(self) -> DraftSpec:
        return dataclasses.replace(self.primary.spec, lookup=self.lookup.options)

    def node_budget(self, max_nodes: int) -> int:
        """The most nodes (root included) of a merged tree when the caller verifies at most max_nodes: the merged
        spec's own bound (`DraftSpec.draft_nodes`, the one statement of it: EAGLE-2's total_tokens is the size of
        its tree with whatever lookup adds, since the merge keeps the best nodes of the union; a static tree takes
        lookup's nodes on top of its own)."""
        return min(max_nodes, self.spec.draft_nodes + 1)

    def start(self, prompt: torch.Tensor, hidden: torch.Tensor, max_nodes: int) -> MergedSession:
        """prompt # [P] int64; hidden # [P, H] (the model drafter's; prompt lookup reads only the tokens)."""
        budget = self.node_budget(max_nodes)
        return self.join(self.primary.start(prompt, hidden, budget), prompt, budget)

    def join(self, primary: DraftSession, prompt: torch.Tensor, budget: int) -> MergedSession:
        """A merged session over a session of the model drafter (or anything drafting like one) started for
        `prompt` # [P] int64, with merged trees of at most `budget` nodes (`node_budget`)."""
        return MergedSession(primary, self.lookup.start(prompt, None, budget), budget)


class MergedSession:
    def __init__(self, primary: DraftSession, lookup: LookupSession, max_nodes: int) -> None:
        self.primary = primary
        self.lookup = lookup
        self.max_nodes = max_nodes

    def draft(self, root: int, params: object = None, generator: torch.Generator | None = None,
              max_nodes: int | None = None) -> Draft:
        budget = self.max_nodes if max_nodes is None else min(self.max_nodes, max_nodes)
        candidates = getattr(self.primary, "candidates", None)
        pool = None if candidates is None else candidates(root, params, generator, max_nodes)
        if pool is not None:
            # the model drafter's whole pool, not its own best few: a lookup node's place in the budget may go to a
            # head candidate its own cut left out (and back)
            extra = self.lookup.draft(root)
            return merge_pools([pool] + ([draft_pool(extra)] if extra.tree.num_nodes > 1 else []), int(root), budget)
        base = self.primary.draft(root, params, generator, max_nodes)
        if base.tree.num_nodes >= budget and base.scores is None:
            return base
        extra = self.lookup.draft(root)
        return base if extra.tree.num_nodes == 1 else merge_drafts(base, extra, budget)

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """tokens # [a] int64; hidden # [a, H]."""
        self.primary.advance(tokens, hidden)
        self.lookup.advance(tokens)


__all__ = ["MergedDrafter", "MergedSession", "draft_pool", "merge_drafts", "merge_pools"]
