"""A model drafter (Medusa / EAGLE) with prompt-lookup continuations merged into each step's tree.

The two miss in different places: a head guesses well a few tokens ahead anywhere, prompt lookup copies long runs
exactly where the text repeats itself (code echoed from the prompt, a list's repeated phrasing). Each step the model
drafter proposes its tree, prompt lookup its continuations, and the continuations are grafted onto the tree as a
trie over tokens (`merge_drafts`): a lookup node whose token path from the root is already in the tree is shared,
the rest are added as new branches, within the step's node budget. Verification is unchanged: both propose fixed
candidates (Proposal.DETERMINISTIC) and siblings stay distinct, so the merged tree is just another candidate tree
and the output is what the target alone would say.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from runtime.draft_spec import DraftSpec
from runtime.drafters.lookup import LookupDrafter, LookupSession
from runtime.errors import ConfigError
from runtime.protocol import Draft, DraftSession, Proposal
from runtime.tree import Tree


def merge_drafts(primary: Draft, extra: Draft, max_nodes: int) -> Draft:
    """`primary`'s tree with `extra`'s nodes grafted on by token: a node of `extra` whose token path exists in the
    merged tree is shared, a new one becomes the next sibling rank under its (merged) parent. Nodes are taken in
    `extra`'s order (parents first) while the tree has fewer than max_nodes nodes. Returns `primary` itself when
    nothing is added. Both must propose fixed candidates (DETERMINISTIC) and share the root."""
    if primary.proposal is not Proposal.DETERMINISTIC or extra.proposal is not Proposal.DETERMINISTIC:
        raise ConfigError("merge_drafts merges fixed-candidate (DETERMINISTIC) drafts only, got "
                          f"{primary.proposal.value} and {extra.proposal.value}")
    p_tokens, e_tokens = primary.tokens.tolist(), extra.tokens.tolist()  # [num_nodes] each
    if p_tokens[0] != e_tokens[0]:
        raise ConfigError(f"merge_drafts: roots differ ({p_tokens[0]} and {e_tokens[0]})")
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
        if base.tree.num_nodes >= self.max_nodes:
            return base
        extra = self.lookup.draft(root)
        return base if extra.tree.num_nodes == 1 else merge_drafts(base, extra, self.max_nodes)

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """tokens # [a] int64; hidden # [a, H]."""
        self.primary.advance(tokens, hidden)
        self.lookup.advance(tokens)


__all__ = ["MergedDrafter", "MergedSession", "merge_drafts"]
