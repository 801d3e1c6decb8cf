"""Sequoia's dynamic programme: the static draft tree that maximises expected accepted tokens (pure numpy).

Acceptance model (rank-only, Sequoia): p[k] = probability that the k-th ranked child of an accepted node is the
one the target accepts (k = 0 best; at most one child is accepted). A tree's expected number of tokens per step is
    F(T) = sum over nodes of prod_{edges on the root path} p[rank]          (the root counts 1)
which is tau when the bonus token is counted (every step emits the accepted path plus one token).

DP over subtrees (reference-facts section 4; ranks 1-based there, 0-based here):
    T[1][l][0] = 1
    T[m][l][b] = max_{1<=y<m} T[y][l][b-1] + p[b-1] * max_b' T[m-y][l-1][b']      (b >= 1: add the last child)
    G(m, l)    = max_b T[m][l][b]          (m nodes, root included; at most l levels, root included)
The b-th child's subtree takes m - y nodes and one level less; the other y nodes form the root with b - 1 children.

Generalisation used for tuning: acceptance by depth AND rank, P[d][k] for the children at depth d + 1 (Medusa's
head d + 1, an EAGLE step's d-th feature re-use: acceptance falls with depth). The recursion is the same with the
level index read as a depth; with identical rows it is exactly Sequoia's (the tests check both against brute force).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime.errors import ConfigError

NEG = -np.inf


def _check_p(p: np.ndarray, name: str) -> None:
    if p.size == 0 or not np.all(np.isfinite(p)) or np.any(p < 0) or np.any(p > 1):
        raise ConfigError(f"{name} must be non-empty probabilities in [0, 1], got {p.tolist()}")
    if p.ndim == 1 and p.sum() > 1 + 1e-6:
        raise ConfigError(f"{name} sums to {p.sum():.4f} > 1: at most one child is accepted per node")
    if p.ndim == 2 and np.any(p.sum(1) > 1 + 1e-6):
        raise ConfigError(f"{name} rows must sum to <= 1 (one accepted child per node), got {p.sum(1).tolist()}")


def _check_budget(max_nodes: int, max_levels: int) -> None:
    for name, v in (("max_nodes", max_nodes), ("max_levels", max_levels)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")


def _scaled(p: float, values: np.ndarray) -> np.ndarray:
    """p * values, keeping impossible subtrees (-inf) impossible even when p == 0 (0 * -inf is nan)."""
    return np.where(np.isneginf(values), NEG, p * np.where(np.isneginf(values), 0.0, values))


def sequoia_table(p: Sequence[float], max_nodes: int, max_levels: int) -> np.ndarray:
    """G(m, l) of the rank-only model for m <= max_nodes, l <= max_levels. # [max_nodes + 1, max_levels + 1]
    (row 0 and column 0 are -inf: no tree has 0 nodes or 0 levels)."""
    p = np.asarray(p, dtype=np.float64)  # [K]
    _check_p(p, "p")
    _check_budget(max_nodes, max_levels)
    k, mm, ll = p.shape[0], max_nodes, max_levels
    # T[m, l, b]; G[m, l] = max_b T[m, l, b]
    T = np.full((mm + 1, ll + 1, k + 1), NEG)
    G = np.full((mm + 1, ll + 1), NEG)
    for l in range(1, ll + 1):
        T[1, l, 0] = 1.0
        G[1, l] = 1.0
        for m in range(2, mm + 1):
            if l == 1:
                break  # one level holds only the root
            for b in range(1, min(k, m - 1) + 1):
                y = np.arange(1, m)  # nodes kept by the root and its first b - 1 children
                cand = T[y, l, b - 1] + _scaled(p[b - 1], G[m - y, l - 1])
                T[m, l, b] = cand.max()
            G[m, l] = T[m, l].max()
    return G


@dataclass(frozen=True)
class SearchedTree:
    """The best tree for one (num_nodes, max_levels) budget."""

    num_nodes: int  # root included
    max_levels: int  # root included (the tree is at most max_levels - 1 deep)
    expected: float  # F(T): expected tokens per step (accepted + bonus)
    choices: tuple[tuple[int, ...], ...]  # Medusa-style choice paths, canonical order


def _depth_tables(P: np.ndarray, max_nodes: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Tables T_d[m, b] and arg-y for roots at depth d = D .. 0 where D = len(P) (children of depth d use P[d])."""
    D, k = P.shape
    T = [np.full((max_nodes + 1, k + 1), NEG) for _ in range(D + 1)]
    Y = [np.zeros((max_nodes + 1, k + 1), dtype=np.int64) for _ in range(D + 1)]
    T[D][1, 0] = 1.0  # deepest level: leaves only
    for d in range(D - 1, -1, -1):
        below = T[d + 1].max(1)  # [M + 1]: best subtree of each size rooted at depth d + 1
        T[d][1, 0] = 1.0
        for m in range(2, max_nodes + 1):
            for b in range(1, min(k, m - 1) + 1):
                y = np.arange(1, m)
                cand = T[d][y, b - 1] + _scaled(P[d, b - 1], below[m - y])
                j = int(np.argmax(cand))
                T[d][m, b] = cand[j]
                Y[d][m, b] = y[j]
    return T, Y


def best_tree(P: Sequence[Sequence[float]] | Sequence[float], num_nodes: int, max_levels: int) -> SearchedTree:
    """The tree of at most num_nodes nodes and max_levels levels maximising F under acceptance P.

    P: rank-only p # [K], or by depth # [D, K] (row d: children at depth d + 1; depths beyond D reuse row D - 1).
    Fewer nodes are used only when more cannot help (F is non-decreasing in the budget).
    """
    P = np.asarray(P, dtype=np.float64)
    _check_budget(num_nodes, max_levels)
    if P.ndim == 1:
        P = P[None]
    if P.ndim != 2:
        raise ConfigError(f"P must be [K] or [depth, K], got shape {P.shape}")
    _check_p(P, "P")
    depth = max_levels - 1
    rows = np.concatenate([P, np.repeat(P[-1:], max(depth - P.shape[0], 0), axis=0)])[:depth]  # [depth, K]
    if depth == 0 or num_nodes == 1:
        return SearchedTree(1, max_levels, 1.0, ())
    T, Y = _depth_tables(rows, num_nodes)
    best = T[0].max(1)  # [M + 1]
    m = int(np.argmax(best[: num_nodes + 1]))  # smallest size reaching the best value
    paths: list[tuple[int, ...]] = []

    def build(d: int, size: int, b: int, prefix: tuple[int, ...]) -> None:
        # The root at `prefix` (depth d) with `size` nodes and children of ranks 0 .. b - 1.
        while b > 0:
            y = int(Y[d][size, b])
            child_size = size - y
            child = prefix + (b - 1,)
            paths.append(child)
            build(d + 1, child_size, int(np.argmax(T[d + 1][child_size])), child)
            size, b = y, b - 1

    build(0, m, int(np.argmax(T[0][m])), ())
    paths.sort(key=lambda q: (len(q), q))
    return SearchedTree(m, max_levels, float(best[m]), tuple(paths))


def expected_tokens(choices: Sequence[Sequence[int]], P: Sequence[Sequence[float]] | Sequence[float]) -> float:
    """F(T) of an explicit tree (choice paths) under P # [K] or [D, K]; ranks beyond K count 0."""
    P = np.asarray(P, dtype=np.float64)
    if P.ndim == 1:
        P = P[None]
    total = 1.0
    for path in choices:
        prob = 1.0
        for d, r in enumerate(path):
            row = P[min(d, P.shape[0] - 1)]
            prob *= row[r] if r < row.shape[0] else 0.0
        total += prob
    return total


def throughput_choice(
    expected: np.ndarray,  # [M + 1, L + 1] expected tokens per step of the best tree per (nodes, levels)
    step_cost: np.ndarray,  # [M + 1, L + 1] seconds per step (draft + verify) of that tree
) -> tuple[int, int, float]:
    """Sequoia's hardware-aware choice: (m, l) maximising expected / cost. Returns (m, l, tokens per second)."""
    if expected.shape != step_cost.shape:
        raise ConfigError(f"expected {expected.shape} and step_cost {step_cost.shape} must have the same shape")
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(np.isfinite(expected) & (step_cost > 0), expected / step_cost, -np.inf)
    m, l = np.unravel_index(int(np.argmax(rate)), rate.shape)
    return int(m), int(l), float(rate[m, l])


__all__ = ["SearchedTree", "best_tree", "expected_tokens", "sequoia_table", "throughput_choice"]
