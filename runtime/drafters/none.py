"""The "none" drafter: a root-only tree every step, so the decode loop runs plain autoregressive decoding
through the same draft -> verify -> commit path (tau = 1)."""

from __future__ import annotations

from typing import Any

import torch

from runtime.draft_spec import PLAIN, DraftSpec, DraftSpecError, DrafterKind
from runtime.errors import ConfigError
from runtime.protocol import Draft, Proposal
from runtime.tree import Tree


class NoneDrafter:
    name = PLAIN

    @property
    def spec(self) -> DraftSpec:
        """What it drafts: root-only trees."""
        return DraftSpec(PLAIN)

    def start(self, prompt: torch.Tensor, hidden: torch.Tensor | None, max_nodes: int) -> NoneSession:
        if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1:
            raise ConfigError(f"max_nodes must be an integer >= 1 (the root counts), got {max_nodes!r}")
        return NoneSession()


class NoneSession:
    def __init__(self) -> None:
        self._tree = Tree.root_only()

    def draft(self, root: int, params: object = None, generator: torch.Generator | None = None,
              max_nodes: int | None = None) -> Draft:
        return Draft(self._tree, torch.tensor([int(root)], dtype=torch.int64), Proposal.DETERMINISTIC)

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        return None


class NoneKind(DrafterKind):
    name = PLAIN
    title = "plain decoding"

    def check(self, spec: DraftSpec) -> None:
        if isinstance(spec.tree, Tree) and spec.tree.num_nodes != 1:
            raise DraftSpecError("tree", f"drafter {PLAIN!r} drafts root-only trees; got a tree with "
                                         f"{spec.tree.num_nodes} nodes")

    def load(self, spec: DraftSpec, model: Any) -> NoneDrafter:
        return NoneDrafter()


KIND = NoneKind()
