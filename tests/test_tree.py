"""Tree topology, buffers (golden vectors from reference-facts section 1) and EAGLE-2 dynamic selection."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plugins.tree_attention.mask import unpack_mask
from runtime.errors import ConfigError
from runtime.tree import Tree, expand_frontier, pool_above, select_dynamic_pool, select_dynamic_tree

GOLDEN_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


# ---- golden vectors -----------------------------------------------------------------------------------------


def test_medusa_golden_vector():
    tree = Tree.from_choices(GOLDEN_CHOICES)
    assert tree.num_nodes == 7
    assert tree.medusa_tree_indices(10).tolist() == [0, 1, 2, 11, 12, 11, 21]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.retrieve_paths.tolist() == [[0, 1, 3, 6], [0, 2, 5, -1], [0, 1, 4, -1]]
    assert tree.leaves == (6, 5, 4)
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert tree.children(0) == (1, 2) and tree.children(1) == (3, 4) and tree.children(6) == ()


def test_mc_sim_7b_63_profile():
    tree = Tree.preset("mc_sim_7b_63")
    assert tree.num_nodes == 64
    assert dict(Counter(tree.depth[1:].tolist())) == {1: 10, 2: 28, 3: 23, 4: 2}
    assert len(tree.leaves) == 42
    assert tuple(tree.retrieve_paths.shape) == (42, 5)
    assert tree.max_depth == 4
    assert tree.max_rank_per_depth() == (10, 10, 10, 2)
    assert tree.packed_mask.shape == (64, 2)
    # Medusa's candidate layout with top-10 heads: depth d, rank r -> 1 + 10 (d - 1) + r, all within 4 heads.
    idx = tree.medusa_tree_indices(10)
    assert idx[0] == 0 and int(idx.max()) <= 40 and len(set(idx.tolist())) < 64  # shared candidates across parents


def test_canonical_order_equality_and_hash():
    a = Tree.from_choices(GOLDEN_CHOICES)
    b = Tree.from_choices(list(reversed(GOLDEN_CHOICES)))
    assert a == b and hash(a) == hash(b)
    assert a.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert a != Tree.chain(3)
    assert len({a, b, Tree.chain(3)}) == 2


def test_mask_and_packed_mask():
    tree = Tree.from_choices(GOLDEN_CHOICES)
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for i in range(7):
        for j in tree.path(i):
            expected[i, j] = True
    assert torch.equal(tree.mask, expected)
    assert tree.packed_mask.dtype == torch.int32 and tree.packed_mask.shape == (7, 1)
    assert tree.packed_mask[:, 0].tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101, 0b1001011]
    big = Tree.chain(40)  # row 40 sets bits 0..40: the first word is all ones (-1 as int32)
    assert big.packed_mask[40].tolist() == [-1, 0b111111111]
    assert torch.equal(unpack_mask(big.packed_mask, 41), big.mask)


def test_tensor_properties_are_copies():
    tree = Tree.from_choices(GOLDEN_CHOICES)
    m = tree.mask
    m[:] = False
    d = tree.depth
    d[:] = 9
    p = tree.packed_mask
    p[:] = 0
    assert bool(tree.mask[0, 0]) and tree.depth[0] == 0 and int(tree.packed_mask[0, 0]) == 1


def test_equal_choices_share_one_built_tree():
    """from_choices builds each distinct tree once (decoding asks for the same shapes every step); the shared tree
    is never written through what it hands out (above), so what one caller does to it no other caller sees."""
    first = Tree.from_choices(GOLDEN_CHOICES)
    first.mask[:] = False
    again = Tree.from_choices(list(reversed(GOLDEN_CHOICES)))
    assert again is first and torch.equal(again.mask, Tree(first.choices).mask)
    assert Tree.from_choices([[0], [1]]) is not Tree.from_choices([[0], [0, 0]])


def test_chain_root_only_and_presets():
    c = Tree.chain(3)
    assert c.parents.tolist() == [-1, 0, 1, 2]
    assert c.retrieve_paths.tolist() == [[0, 1, 2, 3]]
    assert Tree.preset("chain-3") == c
    r = Tree.root_only()
    assert r.num_nodes == 1 and r.max_depth == 0 and r.leaves == (0,)
    assert r.retrieve_paths.tolist() == [[0]] and r.mask.tolist() == [[True]]
    assert r.packed_mask.tolist() == [[1]]
    assert Tree.chain(0) == r == Tree.preset("chain-0")
    assert "mc_sim_7b_63" in Tree.presets() and "chain-K" in Tree.presets()


def test_parse_and_json_round_trip():
    tree = Tree.from_choices(GOLDEN_CHOICES)
    assert Tree.from_json(tree.to_json()) == tree
    assert Tree.parse(tree.to_json()) == tree
    assert Tree.parse("  [[0],[0,0]] ") == Tree.chain(2)
    assert Tree.parse("mc_sim_7b_63") == Tree.preset("mc_sim_7b_63")
    assert Tree.parse("chain-5").num_nodes == 6
    assert Tree.parse(tree) is tree
    assert Tree.from_json(Tree.root_only().to_json()) == Tree.root_only()
    with pytest.raises(ConfigError, match="unknown tree preset 'mc_sim_7b_64'.*mc_sim_7b_63"):
        Tree.parse("mc_sim_7b_64")
    with pytest.raises(ConfigError, match="does not parse"):
        Tree.parse("[[0],[1]")
    with pytest.raises(ConfigError, match="tree spec"):
        Tree.parse(3)


@pytest.mark.parametrize(
    ("paths", "kwargs", "message"),
    [
        ([], {}, "non-empty"),
        ("[[0]]", {}, "must be a list of paths"),
        ([[0], []], {}, "choice #1 is an empty path"),
        ([[0], [-1]], {}, r"\[-1\]: ranks must be >= 0"),
        ([[0], [0.5]], {}, "ranks must be ints"),
        ([[True]], {}, "ranks must be ints"),
        ([[0], 1], {}, "choice #1 must be a list of ints"),
        ([[0], [1, 0]], {}, r"choice \[1, 0\] has no parent: its prefix \[1\] is not listed"),
        ([[0], [0, 0], [0]], {}, r"choice \[0\] is listed more than once"),
        ([[0], [0, 0], [0, 0, 0]], {"max_depth": 2}, r"\[0, 0, 0\] has depth 3, more than max_depth=2"),
        ([[0], [1], [2]], {"max_nodes": 3}, "4 nodes .* more than max_nodes=3"),
    ],
)
def test_invalid_choices(paths, kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        Tree.from_choices(paths, **kwargs)
    assert isinstance(info.value, ValueError)


def test_numpy_and_tuple_inputs():
    import numpy as np

    assert Tree.from_choices(np.array([[0], [1]]).tolist()) == Tree.from_choices([(np.int64(0),), (np.int32(1),)])
    assert Tree.from_choices(((0,), (0, 0))).choices == ((0,), (0, 0))
    assert all(type(r) is int for p in Tree.from_choices([(np.int64(2),)]).choices for r in p)


def test_ranks_need_not_be_dense():
    tree = Tree.from_choices([[0], [0, 1], [2]])
    assert tree.children(0) == (1, 2) and tree.children(1) == (3,)
    assert tree.max_rank_per_depth() == (3, 2)


def test_direct_construction_must_be_canonical():
    with pytest.raises(ConfigError, match="canonical"):
        Tree(((0, 0), (0,)))
    with pytest.raises(ConfigError, match="from_choices"):
        Tree([[0]])
    assert Tree(((0,), (0, 0))) == Tree.chain(2)


def test_medusa_tree_indices_needs_enough_topk():
    with pytest.raises(ConfigError, match="topk must be an int >= 10"):
        Tree.preset("mc_sim_7b_63").medusa_tree_indices(9)


# ---- property tests -----------------------------------------------------------------------------------------


@st.composite
def choice_sets(draw, max_nodes: int = 40):
    """Random valid choice sets (shuffled), with non-dense ranks now and then."""
    n = draw(st.integers(1, max_nodes))
    paths: list[tuple[int, ...]] = []
    next_rank: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        parent = draw(st.sampled_from([()] + paths))
        rank = next_rank.get(parent, 0) + draw(st.sampled_from([0, 0, 0, 1, 3]))
        next_rank[parent] = rank + 1
        paths.append(parent + (rank,))
    return [list(p) for p in draw(st.permutations(paths))]


@settings(max_examples=150, deadline=None)
@given(choice_sets())
def test_tree_structure_is_consistent(paths):
    tree = Tree.from_choices(paths)
    n = tree.num_nodes
    parents, depth, ranks, mask = tree.parents.tolist(), tree.depth.tolist(), tree.ranks.tolist(), tree.mask
    assert n == len(paths) + 1 and parents[0] == -1 and depth[0] == 0
    assert sorted(tree.choices) == sorted(tuple(p) for p in paths)
    for i in range(1, n):
        path = tree.choices[i - 1]
        assert 0 <= parents[i] < i
        assert depth[i] == depth[parents[i]] + 1 == len(path)
        assert ranks[i] == path[-1]
        assert tree.index(path) == i and tree.index(path[:-1]) == parents[i]
    for i in range(n):
        kids = tree.children(i)
        assert list(kids) == [j for j in range(n) if parents[j] == i]
        assert [ranks[k] for k in kids] == sorted(ranks[k] for k in kids)
        assert list(kids) == list(range(kids[0], kids[-1] + 1)) if kids else True  # siblings are contiguous
        ancestors = set(tree.path(i))
        assert mask[i].nonzero().flatten().tolist() == sorted(ancestors)
    assert torch.equal(unpack_mask(tree.packed_mask, n), mask)
    # retrieve paths: root-to-leaf chains, -1 padding at the end only, longest first, covering every node
    rp = tree.retrieve_paths
    assert rp.shape == (len(tree.leaves), tree.max_depth + 1)
    lengths = []
    covered = set()
    for row, leaf in zip(rp.tolist(), tree.leaves):
        body = [v for v in row if v >= 0]
        assert row == body + [-1] * (len(row) - len(body))
        assert body[0] == 0 and body[-1] == leaf and tree.is_leaf(leaf)
        assert all(parents[b] == a for a, b in zip(body, body[1:]))
        lengths.append(len(body))
        covered.update(body)
    assert lengths == sorted(lengths, reverse=True)
    assert covered == set(range(n))
    assert set(tree.leaves) == {i for i in range(n) if not tree.children(i)}
    mrpd = tree.max_rank_per_depth()
    assert len(mrpd) == tree.max_depth
    for d in range(1, tree.max_depth + 1):
        assert mrpd[d - 1] == 1 + max(r for r, dd in zip(ranks, depth) if dd == d)
    assert Tree.from_json(tree.to_json()) == tree and hash(Tree.from_choices(paths)) == hash(tree)


@settings(max_examples=100, deadline=None)
@given(choice_sets(), st.data())
def test_invalid_sets_are_rejected(paths, data):
    inner = [p for p in paths if any(len(q) > len(p) and q[: len(p)] == p for q in paths)]
    if inner:  # drop a node that has descendants: some path loses its prefix
        victim = data.draw(st.sampled_from(inner))
        broken = [p for p in paths if p != victim]
        with pytest.raises(ConfigError, match="has no parent"):
            Tree.from_choices(broken)
    dup = data.draw(st.sampled_from(paths))
    with pytest.raises(ConfigError, match=re.escape(f"choice {dup} is listed more than once")):
        Tree.from_choices(paths + [dup])
    tree = Tree.from_choices(paths)
    if tree.max_depth > 1:
        with pytest.raises(ConfigError, match="more than max_depth"):
            Tree.from_choices(paths, max_depth=tree.max_depth - 1)
    with pytest.raises(ConfigError, match="more than max_nodes"):
        Tree.from_choices(paths, max_nodes=tree.num_nodes - 1)
    assert Tree.from_choices(paths, max_depth=tree.max_depth, max_nodes=tree.num_nodes) == tree


# ---- dynamic trees ------------------------------------------------------------------------------------------


def _check_dynamic_result(parents, tokens, scores, total, tree, node_tokens, pool_index):
    """Common invariants of a dynamic selection."""
    p = parents.tolist()
    keep = pool_index[1:].tolist()
    assert tree.num_nodes == min(total, len(p) + 1)
    assert pool_index[0] == -1 and len(set(keep)) == len(keep)
    tree_parents = tree.parents.tolist()
    for node in range(1, tree.num_nodes):
        i = keep[node - 1]
        par = tree_parents[node]
        # ancestor closure, expressed on the pool: the tree parent is the pool parent
        assert p[i] == (pool_index[par].item() if par > 0 else -1)
        assert node_tokens[node] == tokens[i]
    for node in range(tree.num_nodes):  # sibling ranks are dense 0..c-1
        assert [tree.ranks[k].item() for k in tree.children(node)] == list(range(len(tree.children(node))))


def test_dynamic_tree_matches_plain_topk_for_monotone_scores():
    # pool in creation order: depth-1 a,b,c then children of a (d,e) and of b (f), then child of d (g)
    parents = torch.tensor([-1, -1, -1, 0, 0, 1, 3])
    tokens = torch.tensor([10, 11, 12, 13, 14, 15, 16])
    scores = torch.tensor([-0.1, -0.5, -2.0, -0.3, -1.5, -0.9, -0.6])
    tree, node_tokens, node_scores = select_dynamic_tree(parents, tokens, scores, total_tokens=6, root_token=99)
    # best 5 by score: a(-0.1) d(-0.3) b(-0.5) g(-0.6) f(-0.9)
    assert tree.num_nodes == 6
    assert tree.choices == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
    assert node_tokens.tolist() == [99, 10, 11, 13, 15, 16]
    assert node_scores.tolist() == pytest.approx([0.0, -0.1, -0.5, -0.3, -0.9, -0.6])
    _, pool_index = select_dynamic_pool(parents, scores, 6)
    assert pool_index.tolist() == [-1, 0, 1, 3, 5, 6]
    assert select_dynamic_tree(parents, tokens, scores, 1)[0] == Tree.root_only()
    assert select_dynamic_tree(parents, tokens, scores, 100)[0].num_nodes == 8


def test_dynamic_tree_sibling_ranks_follow_scores():
    parents = torch.tensor([-1, -1, -1])
    tokens = torch.tensor([5, 6, 7])
    scores = torch.tensor([-2.0, -0.5, -1.0])
    tree, node_tokens, _ = select_dynamic_tree(parents, tokens, scores, 4, root_token=1)
    assert node_tokens.tolist() == [1, 6, 7, 5]  # rank 0 = best score


def test_dynamic_tree_closure_with_child_above_parent_and_nan():
    # child (idx 2) scores above its parent (idx 1, NaN): plain top-2 would pick {0, 2} without 2's parent.
    parents = torch.tensor([-1, -1, 1])
    tokens = torch.tensor([3, 4, 5])
    scores = torch.tensor([-1.0, float("nan"), 0.0])
    tree, node_tokens, _ = select_dynamic_tree(parents, tokens, scores, 3, root_token=0)
    assert tree.choices == ((0,), (1,)) and node_tokens.tolist() == [0, 3, 4]
    tree, node_tokens, node_scores = select_dynamic_tree(parents, tokens, scores, 4, root_token=0)
    assert tree.num_nodes == 4 and sorted(node_tokens.tolist()) == [0, 3, 4, 5]
    # the child scored above its NaN parent counts as its path does: -inf, like the parent
    assert sorted(node_scores.tolist(), reverse=True) == [0.0, -1.0, -math.inf, -math.inf]


@st.composite
def pools(draw):
    size = draw(st.integers(0, 40))
    parents = [draw(st.integers(-1, i - 1)) for i in range(size)]
    values = st.sampled_from([0.0, -1.0, -1.0, -2.5, float("nan"), float("-inf"), float("inf"), -0.25])
    scores = [draw(values | st.floats(-10, 1)) for _ in range(size)]
    tokens = [draw(st.integers(0, 7)) for _ in range(size)]
    total = draw(st.integers(1, size + 3))
    return (
        torch.tensor(parents, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(scores, dtype=torch.float32),
        total,
    )


@settings(max_examples=120, deadline=None)
@given(pools())
def test_dynamic_tree_always_ancestor_closed(pool):
    parents, tokens, scores, total = pool
    tree, pool_index = select_dynamic_pool(parents, scores, total)
    tree2, node_tokens, node_scores = select_dynamic_tree(parents, tokens, scores, total, root_token=-7)
    assert tree2 == tree and node_tokens[0] == -7
    _check_dynamic_result(parents, tokens, scores, total, tree, node_tokens, pool_index)
    # node_scores: the lowest score along the node's pool path (NaN as -inf), never above the root's 0
    raw = [-math.inf if math.isnan(x) else x for x in scores.tolist()]
    assert node_scores[0] == 0.0
    for node in range(1, tree.num_nodes):
        i, low = int(pool_index[node]), 0.0
        while i >= 0:
            low, i = min(low, raw[i]), int(parents[i])
        assert node_scores[node] == pytest.approx(low)
        assert node_scores[node] <= node_scores[tree.parent_list[node]]


@settings(max_examples=100, deadline=None)
@given(pools())
def test_dynamic_tree_is_plain_topk_when_scores_are_monotone(pool):
    parents, tokens, _, total = pool
    # log-prob increments < 0 make every child strictly worse than its parent; -(1 + 2^-(i+1)) also makes every
    # path's sum distinct and exact in float64 (no ties for the top-k to break either way: 0.37 * i % 1 steps tied)
    steps = -(1.0 + 0.5 ** (torch.arange(parents.shape[0], dtype=torch.float64) + 1))
    scores = torch.zeros(parents.shape[0], dtype=torch.float64)
    for i, p in enumerate(parents.tolist()):
        scores[i] = (scores[p] if p >= 0 else 0.0) + steps[i]
    _, pool_index = select_dynamic_pool(parents, scores, total)
    k = min(total - 1, parents.shape[0])
    expected = set(torch.argsort(scores, descending=True)[:k].tolist())
    assert set(pool_index[1:].tolist()) == expected


def test_dynamic_pool_validation():
    with pytest.raises(ConfigError, match=r"parents\[1\] = 1"):
        select_dynamic_pool(torch.tensor([-1, 1]), torch.tensor([0.0, 0.0]), 3)
    with pytest.raises(ConfigError, match=r"parents\[0\] = -2"):
        select_dynamic_pool(torch.tensor([-2]), torch.tensor([0.0]), 3)
    with pytest.raises(ConfigError, match="shaped like parents"):
        select_dynamic_pool(torch.tensor([-1, 0]), torch.tensor([0.0]), 3)
    with pytest.raises(ConfigError, match="total_tokens"):
        select_dynamic_pool(torch.tensor([-1]), torch.tensor([0.0]), 0)
    with pytest.raises(ConfigError, match="tokens must be shaped"):
        select_dynamic_tree(torch.tensor([-1]), torch.tensor([1, 2]), torch.tensor([0.0]), 2)


def test_expand_frontier():
    frontier = torch.tensor([-0.5, -1.0])
    logprobs = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.1, 0.7]]))
    ex = expand_frontier(frontier, logprobs, top_k=2)
    assert ex.parent.tolist() == [0, 0, 1, 1]
    assert ex.tokens.tolist() == [0, 1, 2, 0]
    expected = torch.tensor([-0.5 + math.log(0.6), -0.5 + math.log(0.3), -1.0 + math.log(0.7), -1.0 + math.log(0.2)])
    assert torch.allclose(ex.scores, expected)
    assert ex.frontier.tolist() == [0, 2]  # -1.01 and -1.36 beat -1.70
    nan_lp = logprobs.clone()
    nan_lp[0, 2] = float("nan")
    assert 2 not in expand_frontier(frontier, nan_lp, top_k=2).tokens[:2].tolist()
    with pytest.raises(ConfigError, match="top_k"):
        expand_frontier(frontier, logprobs, top_k=0)


# ---- pruning (Tree.best_nodes) -----------------------------------------------------------------------------------

CONFIGURED_LIKE = [[0], [1], [2], [3], [4], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]]


def test_best_nodes_keeps_the_top1_chain_first():
    tree = Tree.from_choices(CONFIGURED_LIKE)
    chosen = lambda ids: [list(tree.choices[i - 1]) for i in ids[1:]]  # noqa: E731
    assert chosen(tree.best_nodes(4)) == [[0], [0, 0], [0, 0, 0]]  # rank sum 0: the top-1 chain
    assert tree.subtree(tree.best_nodes(4)).choices == ((0,), (0, 0), (0, 0, 0))
    assert tree.subtree((0,)) == Tree.root_only() and tree.subtree(range(12)) == tree
    # rank sum 1, shallowest first: [1], then [0, 1], then [1, 0] / [0, 0, 1]
    assert chosen(tree.best_nodes(6)) == [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    assert tree.best_nodes(1) == (0,)
    assert tree.best_nodes(100) == tree.best_nodes(12) == tuple(range(12))
    assert chosen(tree.best_nodes(100, max_depth=1)) == [[0], [1], [2], [3], [4]]
    assert chosen(tree.best_nodes(3, max_depth=2)) == [[0], [0, 0]]
    assert tree.best_nodes(5, max_depth=0) == (0,)
    for bad in (0, -1, True, 2.0, None):
        with pytest.raises(ConfigError, match="max_nodes"):
            tree.best_nodes(bad)


def test_best_nodes_by_scores():
    tree = Tree.from_choices(CONFIGURED_LIKE)
    chosen = lambda ids: [list(tree.choices[i - 1]) for i in ids[1:]]  # noqa: E731
    # a drafter's path log-probs: [2] and [1, 0] likelier than the top-1 chain's deeper nodes
    by_path = {(0,): -0.1, (1,): -1.0, (2,): -0.3, (3,): -4.0, (4,): -5.0, (0, 0): -0.9, (0, 1): -3.0,
               (1, 0): -1.1, (0, 0, 0): -2.0, (0, 0, 1): -2.5, (0, 1, 0): -3.5}
    scores = [0.0] + [by_path[p] for p in tree.choices]
    assert chosen(tree.best_nodes(5, scores=scores)) == [[0], [1], [2], [0, 0]]
    assert chosen(tree.best_nodes(6, scores=scores)) == [[0], [1], [2], [0, 0], [1, 0]]
    assert chosen(tree.best_nodes(4, max_depth=1, scores=scores)) == [[0], [1], [2]]
    # a child scored above its parent counts as its parent does (ties: the rank-sum rule): never kept without it
    scores[tree.index((0, 1, 0))] = 0.0
    assert chosen(tree.best_nodes(3, scores=scores)) == [[0], [2]]
    assert tree.best_nodes(100, scores=scores) == tuple(range(12))


@settings(max_examples=150, deadline=None)
@given(choice_sets(), st.integers(1, 45), st.one_of(st.none(), st.integers(0, 6)))
def test_best_nodes_is_an_ancestor_closed_nested_sibling_prefix(paths, max_nodes, max_depth):
    tree = Tree.from_choices(paths)
    depth, parents = tree.depth.tolist(), tree.parent_list
    keep = tree.best_nodes(max_nodes, max_depth)
    allowed = [i for i in range(tree.num_nodes) if max_depth is None or depth[i] <= max_depth]
    assert list(keep) == sorted(keep) and keep[0] == 0
    assert len(keep) == min(max_nodes, len(allowed)) and set(keep) <= set(allowed)
    kept = set(keep)
    for i in keep[1:]:
        assert parents[i] in kept  # ancestor-closed: the pruned tree is a tree
    for i in keep:  # the kept children of a node are its first children in rank order
        kids = tree.children(i)
        n = sum(k in kept for k in kids)
        assert set(kids[:n]) <= kept
    # one priority order: a smaller budget keeps a subset of what a larger one keeps
    if max_nodes > 1:
        assert set(tree.best_nodes(max_nodes - 1, max_depth)) <= kept


def test_pool_above_keeps_the_ancestor_closed_entries_that_reach_the_floor():
    # 0 (-0.5) -> 2 (-1.0) -> 4 (-3.0); 1 (-2.5) -> 3 (-0.1: above the floor, its parent is not); 5 (NaN) under 0
    parents = torch.tensor([-1, -1, 0, 1, 2, 0])
    scores = torch.tensor([-0.5, -2.5, -1.0, -0.1, -3.0, float("nan")])
    index, kept_parents = pool_above(parents, scores, -2.0)
    assert index.tolist() == [0, 2] and kept_parents.tolist() == [-1, 0]
    index, kept_parents = pool_above(parents, scores, -3.0)
    assert index.tolist() == [0, 1, 2, 3, 4] and kept_parents.tolist() == [-1, -1, 0, 1, 2]
    index, kept_parents = pool_above(parents, scores, 0.0)
    assert index.tolist() == [] and kept_parents.tolist() == []
    with pytest.raises(ConfigError, match="pool parents"):
        pool_above(torch.tensor([-1, 3]), torch.tensor([-0.1, -0.2]), -1.0)
