"""A drafter kind added by this one module (no other file changes): "echo" drafts a fixed-length chain, the tokens
that followed the root's latest earlier occurrence in the committed sequence (the root repeated where it has none).
No weights, no options; its tree is a chain, DEPTH deep unless the spec gives a shorter one. Importing this module
registers the kind (`runtime.draft_spec.register`); nothing else in the project names it."""

from __future__ import annotations

from typing import Any

import torch

from runtime.draft_spec import DraftSpec, DraftSpecError, DrafterKind, register
from runtime.errors import ConfigError
from runtime.protocol import Draft, Proposal
from runtime.tree import Tree

NAME = "echo"
DEPTH = 3


class EchoDrafter:
    name = NAME

    def __init__(self, tree: Tree) -> None:
        self.tree = tree

    @property
    def spec(self) -> DraftSpec:
        return DraftSpec(NAME, tree=self.tree)

    def start(self, prompt: torch.Tensor, hidden: torch.Tensor | None, max_nodes: int) -> EchoSession:
        """prompt # [P] int64; hidden is not read."""
        if max_nodes < 1:
            raise ConfigError(f"max_nodes must be >= 1, got {max_nodes}")
        return EchoSession(prompt.tolist(), min(self.tree.max_depth, max_nodes - 1))


class EchoSession:
    def __init__(self, committed: list[int], depth: int) -> None:
        self.committed = committed
        self.depth = depth

    def draft(self, root: int, params: object = None, generator: torch.Generator | None = None,
              max_nodes: int | None = None) -> Draft:
        depth = self.depth if max_nodes is None else min(self.depth, max_nodes - 1)
        seq = self.committed
        starts = [i + 1 for i in range(len(seq) - 1, -1, -1) if seq[i] == root]
        chain = seq[starts[0]:starts[0] + depth] if starts else []
        chain += [root] * (depth - len(chain))
        return Draft(Tree.chain(depth), torch.tensor([root, *chain], dtype=torch.int64), Proposal.DETERMINISTIC)

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """tokens # [a] int64: the root and the accepted tokens, now committed."""
        self.committed.extend(tokens.tolist())


class EchoKind(DrafterKind):
    name = NAME
    title = "echo"

    def check(self, spec: DraftSpec) -> None:
        tree = spec.static_tree
        if tree is not None and tree != Tree.chain(tree.max_depth):
            raise DraftSpecError("tree", f"drafter {NAME!r} drafts chains; got a tree with {tree.num_nodes} nodes")

    def shape(self, spec: DraftSpec) -> tuple[int, int]:
        return DEPTH + 1, DEPTH

    def load(self, spec: DraftSpec, model: Any) -> EchoDrafter:
        return EchoDrafter(spec.static_tree or Tree.chain(DEPTH))


KIND = register(EchoKind())
