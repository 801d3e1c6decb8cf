"""Random trees for the tree-attention tests (independent of runtime/tree.py: the plugin sits below runtime)."""

from __future__ import annotations

import torch

from plugins.tree_attention.mask import ancestor_mask, random_parents

__all__ = ["ancestor_mask", "path_to_root", "random_parents", "random_tree_masks"]


def path_to_root(parents: list[int], i: int) -> list[int]:
    """Nodes from the root down to i."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def random_tree_masks(batch: int, n: int, generator: torch.Generator) -> tuple[list[list[int]], torch.Tensor]:
    """One random tree per batch row: (parents per row, bool masks [batch, n, n])."""
    parents = [random_parents(n, generator) for _ in range(batch)]
    return parents, torch.stack([ancestor_mask(p) for p in parents])
