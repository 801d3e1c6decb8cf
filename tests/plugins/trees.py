"""Random trees for the tree-attention tests (independent of runtime/tree.py: the plugin sits below runtime)."""

from __future__ import annotations

import torch


def random_parents(n: int, generator: torch.Generator) -> list[int]:
    """Parents of a random rooted tree in topological order: node 0 is the root (-1), parent[i] < i."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:  # [n, n] bool
    """mask[i, j] = j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


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
