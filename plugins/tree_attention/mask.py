"""Bit-packed tree masks in TensorRT-LLM's attention-plugin layout.

A bool mask  # [..., N, N]  packs into int32 words  # [..., N, ceil(N / 32)]: bit j of row i lives in word
j // 32 at bit j % 32, least-significant bit first. Bit 31 set makes the int32 negative; that is expected.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def mask_words(n: int) -> int:
    """Number of int32 words per packed row for n tree tokens."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return (n + 31) // 32


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., N, M] -> int32 [..., N, ceil(M / 32)]."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    m = mask.shape[-1]
    words = mask_words(m)
    pad = words * 32 - m
    bits = torch.nn.functional.pad(mask.to(torch.int64), (0, pad))  # [..., N, words*32]
    bits = bits.reshape(*mask.shape[:-1], words, 32)
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=mask.device),
                                      torch.arange(32, device=mask.device))
    packed = (bits * weights).sum(-1)  # [..., N, words] values in [0, 2^32)
    # Reinterpret as signed int32 (two's complement) without overflow errors.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_mask(packed: torch.Tensor, m: int) -> torch.Tensor:
    """int32 [..., N, W] -> bool [..., N, m]; inverse of pack_mask."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed mask must be int32, got {packed.dtype}")
    if packed.shape[-1] != mask_words(m):
        raise ValueError(f"packed mask has {packed.shape[-1]} words per row, expected {mask_words(m)} for m={m}")
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = torch.bitwise_and(torch.bitwise_right_shift(packed.unsqueeze(-1), shifts), 1)  # [..., N, W, 32]
    return bits.reshape(*packed.shape[:-1], -1)[..., :m].to(torch.bool)


def random_parents(n: int, generator: torch.Generator) -> list[int]:
    """Parents of a random rooted tree of n nodes in topological order: node 0 is the root (-1), parent[i] < i.
    For kernel checks and benchmarks (tests, perf), which need arbitrary trees, not drafted ones."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:  # [n, n] bool
    """Ancestor-or-self mask of a tree given by its parent list in topological order (parents[i] < i, -1 for a
    node whose parent is outside the list): mask[i, j] = j is i or an ancestor of i."""
    n = len(parents)
    # Rows in numpy: one row copy per node, no per-node torch dispatch (`runtime.tree.Tree` builds its mask here,
    # for every drafted tree of every decode step).
    mask = np.zeros((n, n), dtype=np.bool_)
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise ValueError(f"parents must be in topological order (parents[i] < i), got parents[{i}] = {p}")
            mask[i] = mask[p]  # the parent's row is complete already
        mask[i, i] = True
    return torch.from_numpy(mask)
