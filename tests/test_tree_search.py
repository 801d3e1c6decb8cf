"""Sequoia's DP: the reference test vector, and brute force over every ancestor-closed tree on small budgets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from runtime.errors import ConfigError
from runtime.tree import Tree
from builder.tree_search import (
    best_tree,
    expected_tokens,
    sequoia_table,
    throughput_choice,
)

P_REF = (0.7, 0.15, 0.05)
G_REF = (1, 1.7, 2.19, 2.533, 2.683, 2.788, 2.893, 2.9665)  # reference-facts section 4, l <= 4


def test_reference_vector():
    G = sequoia_table(P_REF, 8, 4)
    np.testing.assert_allclose(G[1:, 4], G_REF, atol=1e-12)
    for m, g in enumerate(G_REF, start=1):
        t = best_tree(P_REF, m, 4)
        assert t.expected == pytest.approx(g, abs=1e-12)
        assert expected_tokens(t.choices, P_REF) == pytest.approx(g, abs=1e-12)
        tree = Tree.from_choices(t.choices) if t.choices else Tree.root_only()
        assert tree.num_nodes == t.num_nodes == m and tree.max_depth <= 3


def test_levels_limit_depth():
    # Two levels: root + children only, best children are the top ranks.
    t = best_tree(P_REF, 8, 2)
    assert t.choices == ((0,), (1,), (2,)) and t.expected == pytest.approx(1.9)
    G = sequoia_table(P_REF, 8, 1)  # G(m, l) is for exactly m nodes: one level holds only the root
    assert G[1, 1] == 1.0 and np.isneginf(G[2:, 1]).all()
    np.testing.assert_allclose(sequoia_table(P_REF, 5, 5)[5, 5], 1 + 0.7 + 0.49 + 0.343 + 0.2401)


def _closed_trees(k: int, depth: int, max_size: int):
    """Every ancestor-closed set of paths (ranks < k, length <= depth) with at most max_size - 1 paths."""
    universe = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    seen = {frozenset()}
    frontier = [frozenset()]
    for _ in range(max_size - 1):
        nxt = []
        for s in frontier:
            for p in universe:
                if p not in s and (len(p) == 1 or p[:-1] in s):
                    t = s | {p}
                    if t not in seen:
                        seen.add(t)
                        nxt.append(t)
        frontier = nxt
    return seen


@pytest.mark.parametrize("P", [
    P_REF,
    (0.5, 0.3, 0.1),
    ((0.8, 0.1, 0.05), (0.6, 0.2, 0.1), (0.3, 0.2, 0.2)),  # acceptance falling with depth
    ((0.4, 0.35, 0.2), (0.9, 0.05, 0.0), (0.5, 0.1, 0.1)),
])
def test_brute_force_small_budgets(P):
    k, levels, max_size = 3, 4, 7
    trees = _closed_trees(k, levels - 1, max_size)
    for m in range(1, max_size + 1):
        brute = max(expected_tokens(sorted(t), P) for t in trees if len(t) + 1 <= m)
        got = best_tree(P, m, levels)
        assert got.expected == pytest.approx(brute, abs=1e-12), (m, got)
        assert expected_tokens(got.choices, P) == pytest.approx(got.expected, abs=1e-12)
        assert len(got.choices) + 1 == got.num_nodes <= m
        if np.asarray(P).ndim == 1:
            assert sequoia_table(P, m, levels)[m, levels] == pytest.approx(brute, abs=1e-12)


def test_throughput_choice_prefers_cheaper_when_gain_is_small():
    G = sequoia_table(P_REF, 8, 4)
    flat = np.ones_like(G)  # equal cost everywhere: the biggest tree wins
    m, l, rate = throughput_choice(G, flat)
    assert G[m, l] == pytest.approx(G[8, 4]) and rate == pytest.approx(2.9665)
    # Each extra node costs half a plain step: 1, 1.7/1.5, 2.19/2, 2.533/2.5 ... -> two nodes are best.
    steep = np.fromfunction(lambda m, l: 1.0 + 0.5 * (m - 1), G.shape)
    m, l, rate = throughput_choice(G, steep)
    assert (m, l) == (2, 2) and rate == pytest.approx(1.7 / 1.5)


def test_bad_inputs():
    with pytest.raises(ConfigError, match=r"rows must sum to <= 1 .*got \[1.1\]"):
        best_tree((0.9, 0.2), 4, 3)
    with pytest.raises(ConfigError, match=r"probabilities in \[0, 1\]"):
        sequoia_table((0.5, -0.1), 4, 3)
    with pytest.raises(ConfigError, match="max_nodes must be an integer >= 1, got 0"):
        best_tree(P_REF, 0, 3)
    with pytest.raises(ConfigError, match="same shape"):
        throughput_choice(np.ones((3, 3)), np.ones((3, 4)))
