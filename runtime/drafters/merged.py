"""A model drafter (Medusa / EAGLE) with prompt-lookup continuations merged into each step's tree.

The two miss in different places: a head guesses well a few tokens ahead anywhere, prompt lookup copies long runs
exactly where the text repeats itself (code echoed from the prompt, a list's repeated phrasing). Each step the model
drafter proposes its tree, prompt lookup its continuations, and the continuations are grafted onto the tree as a
trie over tokens (`merge_drafts`): a lookup node whose token path from the root is already in the tree is shared,
the rest are added as new branches, within the step's node budget. Verification is unchanged: both propose fixed
candidates (Proposal.DETERMINISTIC) and siblings stay distinct, so the merged tree is just another candidate tree
and the output is what the target alone would say.

When the model drafter scores its nodes (EAGLE: the head's path log-probs, `Draft.scores`), the budget goes to the
best candidates of both, EAGLE-2's rule over the union: a lookup node counts as `token_prob` per token of its path
(`LookupOptions`), a node both propose as the likelier, and the merged tree keeps the highest-scoring nodes
(`select_dynamic_tree`). Measured on training-held-out prompts with SmolLM2 and its head, trees of 16 nodes: the
head's weakest nodes were on the target's path less often than a lookup continuation's first few, and, replayed
over the same candidates, ranking both by probability took tau from 3.09 (the head's tree first, lookup in what
budget is left) to 3.18 (demo/smollm2/README.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from runtime.draft_spec import DraftSpec
from runtime.drafters.lookup import LookupDrafter, LookupSession
from runtime.errors import ConfigError
from runtime.protocol import Draft, DraftSession, Proposal
from runtime.tree import Tree, select_dynamic_tree


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
        return _merge_scored((primary, extra), max_nodes)
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


def _merge_scored(drafts: tuple[Draft, ...], max_nodes: int) -> Draft:
    """The union of scored drafts as a trie over tokens (a node several propose keeps its best score), cut to its
    max_nodes best nodes by EAGLE-2's rule (`select_dynamic_tree`); the result carries the scores it ranked by."""
    pool_parent: list[int] = []  # the union in creation order (parents first): parent pool index (-1: the root),
    pool_tokens: list[int] = []  # token
    pool_scores: list[float] = []  # best score
    index_of: dict[tuple[int, int], int] = {}  # (parent pool index, token) -> pool index
    for draft in drafts:
        tokens, scores, parents = draft.tokens.tolist(), draft.scores.tolist(), draft.tree.parent_list
        where = {0: -1}  # draft node -> pool index (canonical order: a parent before its children)
        for node in range(1, draft.tree.num_nodes):
            key = (where[parents[node]], tokens[node])
            i = index_of.get(key)
            if i is None:
                i = index_of[key] = len(pool_parent)
                pool_parent.append(key[0])
                pool_tokens.append(key[1])
                pool_scores.append(scores[node])
            else:
                pool_scores[i] = max(pool_scores[i], scores[node])
            where[node] = i
    root = int(drafts[0].tokens[0])
    if not pool_parent:
        return Draft(Tree.root_only(), torch.tensor([root], dtype=torch.int64), Proposal.DETERMINISTIC,
                     scores=torch.zeros(1))
    tree, tokens, scores = select_dynamic_tree(
        torch.tensor(pool_parent), torch.tensor(pool_tokens, dtype=torch.int64),
        torch.tensor(pool_scores, dtype=torch.float32), max_nodes, root_token=root)
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

    def start(self, prompt: torch.Tensor, hidden: torch.Tensor, max_nodes: int) -> MergedSession:
        """prompt # [P] int64; hidden # [P, H] (the model drafter's; prompt lookup reads only the tokens)."""
        return MergedSession(self.primary.start(prompt, hidden, max_nodes), self.lookup.start(prompt, None, max_nodes),
                             max_nodes)


class MergedSession:
    def __init__(self, primary: DraftSession, lookup: LookupSession, max_nodes: int) -> None:
        self.primary = primary
        self.lookup = lookup
        self.max_nodes = max_nodes

    def draft(self, root: int, params: object = None, generator: torch.Generator | None = None,
              max_nodes: int | None = None) -> Draft:
        base = self.primary.draft(root, params, generator, max_nodes)
        budget = self.max_nodes if max_nodes is None else min(self.max_nodes, max_nodes)
        if base.tree.num_nodes >= budget and base.scores is None:
            return base
        extra = self.lookup.draft(root)
        return base if extra.tree.num_nodes == 1 else merge_drafts(base, extra, budget)

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """tokens # [a] int64; hidden # [a, H]."""
        self.primary.advance(tokens, hidden)
        self.lookup.advance(tokens)


__all__ = ["MergedDrafter", "MergedSession", "merge_drafts"]
