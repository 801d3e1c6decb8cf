"""Prompt-lookup drafter: n-gram matching, tree building, bounds, incremental index."""

from __future__ import annotations

import math
import time

import pytest
import torch

from runtime.draft_spec import LookupOptions
from runtime.drafters.lookup import LookupDrafter
from runtime.errors import ConfigError
from runtime.protocol import Proposal


def t(xs):
    return torch.tensor(xs, dtype=torch.int64)


def paths_of(draft):
    """Every root-to-leaf token sequence of a draft (root excluded), as tuples."""
    tree, toks = draft.tree, draft.tokens.tolist()
    return {tuple(toks[i] for i in tree.path(leaf)[1:]) for leaf in tree.leaves if leaf != 0}


def check_tree(draft):
    tree = draft.tree
    assert draft.proposal is Proposal.DETERMINISTIC
    assert draft.tokens.dtype == torch.int64 and draft.tokens.shape == (tree.num_nodes,)
    # Siblings carry distinct tokens (a trie): duplicates would waste nodes.
    for i in range(tree.num_nodes):
        kids = [int(draft.tokens[c]) for c in tree.children(i)]
        assert len(kids) == len(set(kids))


def test_chain_copies_what_followed_the_suffix():
    # ... 5 6 7 8 9 ... then the suffix "5 6" (6 is the root): the draft continues 7 8 9 10.
    prompt = t([1, 2, 5, 6, 7, 8, 9, 10, 3, 4, 5])
    session = LookupDrafter(LookupOptions(max_branches=1, num_draft_tokens=4, max_depth=None)).start(prompt, None, 64)
    draft = session.draft(6)
    check_tree(draft)
    assert draft.tokens.tolist() == [6, 7, 8, 9, 10]
    assert draft.tree.num_nodes == 5 and draft.tree.max_depth == 4


def test_longest_ngram_wins_over_more_recent_shorter_match():
    # Suffix (3, 4, root=5). "3 4 5" occurred once (followed by 100); "5" alone occurs later (followed by 200).
    prompt = t([3, 4, 5, 100, 101, 9, 5, 200, 201, 3, 4])
    session = LookupDrafter(LookupOptions(max_branches=1, num_draft_tokens=2, max_depth=None)).start(prompt, None, 64)
    assert session.draft(5).tokens.tolist() == [5, 100, 101]


def node_scores(draft):
    """{token path: score} of a draft's nodes below its root."""
    tree, toks = draft.tree, draft.tokens.tolist()
    return {tuple(toks[i] for i in tree.path(n)[1:]): float(draft.scores[n]) for n in range(1, tree.num_nodes)}


def test_scores_count_each_node_by_the_length_of_its_match():
    # Suffix (3, 4, root=5) matches "3 4 5" (followed by 100 101) as a 3-gram; "5" alone matches again later
    # (followed by 200 201) as a 1-gram. Scores: per node, token_prob[n - 1] of the continuation that made it.
    prompt = t([3, 4, 5, 100, 101, 9, 5, 200, 201, 3, 4])
    opts = LookupOptions(num_draft_tokens=4, max_depth=2, max_branches=2, token_prob=(0.2, 0.5, 0.9))
    scores = node_scores(LookupDrafter(opts).start(prompt, None, 64).draft(5))
    log = math.log
    assert scores == pytest.approx({(100,): log(0.9), (100, 101): 2 * log(0.9),
                                    (200,): log(0.2), (200, 201): 2 * log(0.2)})
    # matches longer than the list is long count as its last entry; a shared node keeps the likelier (first) one
    # ("2 3 4 5" matches as a 4-gram: 100 101; "4 5" as a 2-gram, most recently: 100 7, its 100 shared)
    prompt = t([2, 3, 4, 5, 100, 101, 9, 4, 5, 100, 7, 2, 3, 4])
    opts = LookupOptions(max_ngram=4, num_draft_tokens=4, max_depth=2, max_branches=2, token_prob=(0.4, 0.6, 0.8))
    scores = node_scores(LookupDrafter(opts).start(prompt, None, 64).draft(5))
    assert scores == pytest.approx({(100,): log(0.8), (100, 101): 2 * log(0.8), (100, 7): log(0.8) + log(0.6)})


def test_most_recent_occurrence_first_and_distinct_branches():
    # "7" is followed by 1 1, then by 2 2, then (most recent) by 3 3; root = 7 matches as a 1-gram.
    prompt = t([7, 1, 1, 0, 7, 2, 2, 0, 7, 3, 3, 0])
    opts = LookupOptions(max_ngram=1, min_ngram=1, num_draft_tokens=6, max_depth=2, max_branches=3)
    draft = LookupDrafter(opts).start(prompt, None, 64).draft(7)
    check_tree(draft)
    assert paths_of(draft) == {(3, 3), (2, 2), (1, 1)}
    # Rank order among the root's children = recency order.
    first = [int(draft.tokens[c]) for c in draft.tree.children(0)]
    assert first == [3, 2, 1]


def test_shared_prefixes_merge_into_a_trie():
    # "9" is followed by 4 5 and, more recently, by 4 6: one node for 4, two children 6 then 5.
    prompt = t([9, 4, 5, 0, 9, 4, 6, 0])
    opts = LookupOptions(max_ngram=1, num_draft_tokens=10, max_depth=2, max_branches=4)
    draft = LookupDrafter(opts).start(prompt, None, 64).draft(9)
    check_tree(draft)
    assert draft.tree.num_nodes == 4
    assert paths_of(draft) == {(4, 6), (4, 5)}
    node4 = draft.tree.children(0)[0]
    assert [int(draft.tokens[c]) for c in draft.tree.children(node4)] == [6, 5]


def test_continuation_near_the_end_continues_the_repetition():
    # The most recent occurrence of the suffix (x, y, root) ends 3 tokens before the sequence end, so what
    # follows it is the period-3 repetition x y root x y root ..., the root included.
    prompt = t([0, 1, 2, 3, 1, 2, 3, 1, 2])
    opts = LookupOptions(max_branches=1, num_draft_tokens=5, max_depth=None)
    draft = LookupDrafter(opts).start(prompt, None, 64).draft(3)
    assert draft.tokens.tolist() == [3, 1, 2, 3, 1, 2]
    draft = LookupDrafter(opts).start(t([5, 5, 5, 5]), None, 64).draft(5)
    assert draft.tokens.tolist() == [5] * 6


def test_no_match_gives_root_only():
    session = LookupDrafter().start(t([1, 2, 3]), None, 64)
    draft = session.draft(42)
    assert draft.tree.num_nodes == 1 and draft.tokens.tolist() == [42]


def test_generated_tokens_are_indexed_by_advance():
    opts = LookupOptions(max_branches=1, max_depth=None, num_draft_tokens=3)
    session = LookupDrafter(opts).start(t([1, 2]), None, 64)
    assert session.draft(3).tree.num_nodes == 1
    session.advance(t([3, 8, 9, 4]), torch.zeros(4, 8))  # committed: 1 2 3 8 9 4
    assert session.draft(3).tokens.tolist() == [3, 8, 9, 4]


@pytest.mark.parametrize("max_nodes", [1, 2, 3, 5])
def test_respects_max_nodes(max_nodes):
    prompt = t([7, 1, 1, 1, 0, 7, 2, 2, 2, 0, 7, 3, 3, 3, 0])
    opts = LookupOptions(max_ngram=1, num_draft_tokens=20, max_depth=3, max_branches=3)
    draft = LookupDrafter(opts).start(prompt, None, max_nodes).draft(7)
    assert draft.tree.num_nodes == min(max_nodes, 10)


def test_respects_num_draft_tokens_and_max_depth():
    prompt = t(list(range(10, 40)) + [10])
    draft = LookupDrafter(LookupOptions(num_draft_tokens=5, max_depth=3)).start(prompt, None, 64).draft(11)
    assert draft.tree.max_depth == 3
    assert draft.tokens.tolist()[:4] == [11, 12, 13, 14]
    draft = LookupDrafter(LookupOptions(num_draft_tokens=2, max_depth=None)).start(prompt, None, 64).draft(11)
    assert draft.tokens.tolist() == [11, 12, 13]


def test_drafted_paths_are_real_continuations_random():
    # Property: every node's root path is the (prefix of a) continuation of an occurrence of the suffix.
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        committed = torch.randint(0, 6, (60,), generator=gen).tolist()
        root = int(torch.randint(0, 6, (1,), generator=gen))
        seq = committed + [root]
        opts = LookupOptions(max_ngram=3, min_ngram=2, num_draft_tokens=12, max_depth=4, max_branches=4)
        draft = LookupDrafter(opts).start(t(committed), None, 64).draft(root)
        check_tree(draft)
        assert draft.tree.num_nodes <= 13 and draft.tree.max_depth <= 4
        occurrences = [
            e
            for n in (2, 3)
            for e in range(n, len(committed) + 1)
            if committed[e - n : e] == seq[len(seq) - n :]
        ]
        assert (draft.tree.num_nodes > 1) == bool(occurrences)
        for path in paths_of(draft):
            # Past the end of the sequence the continuation repeats with period len(seq) - e.
            assert any(
                tuple(seq[e + i % (len(seq) - e)] for i in range(len(path))) == path for e in occurrences
            ), path


def test_fast_on_long_sequences():
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 50, (4000,), generator=gen)
    start = time.perf_counter()
    session = LookupDrafter().start(seq, None, 64)
    for i in range(200):
        session.draft(int(seq[i]))
        session.advance(seq[i : i + 2], torch.zeros(2, 4))
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_ngram": 0}, "max_ngram"),
        ({"min_ngram": 0}, "min_ngram"),
        ({"min_ngram": 4, "max_ngram": 3}, "min_ngram"),
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"max_depth": 0}, "max_depth"),
        ({"max_branches": -1}, "max_branches"),
        ({"max_ngram": 2.5}, "max_ngram"),
    ],
)
def test_bad_options(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LookupOptions(**kwargs)


def test_bad_max_nodes_and_prompt():
    with pytest.raises(ConfigError, match="max_nodes"):
        LookupDrafter().start(t([1, 2]), None, 0)
    with pytest.raises(ConfigError, match="prompt"):
        LookupDrafter().start(torch.zeros(2, 2, dtype=torch.int64), None, 4)
