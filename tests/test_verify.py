"""verify(): greedy exactness against autoregressive greedy decoding, verdict structure, input errors.

The distributional (losslessness) tests of the sampling rules live in tests/test_losslessness.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from plugins.tree_attention.mask import random_parents
from runtime.errors import ConfigError
from runtime.protocol import Draft, Proposal
from runtime.sampling import SamplingParams, target_probs
from runtime.tree import Tree
from runtime.verify import (
    _try_deterministic, greedy_walk, greedy_walk_computing, likely_path, verify, verify_greedy, verify_sampling,
)

GREEDY = SamplingParams()
# nodes: [0]=1 [1]=2 [0,0]=3 [0,1]=4 [1,0]=5 [0,0,0]=6
GOLDEN = Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def _logits_with_argmax(argmax: list[int], vocab: int = 10) -> torch.Tensor:
    """[len(argmax), vocab] logits whose row i has its maximum at argmax[i] (other entries random, lower)."""
    gen = torch.Generator().manual_seed(len(argmax))
    logits = torch.rand(len(argmax), vocab, generator=gen)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 2.0
    return logits


@pytest.mark.parametrize(
    ("argmax", "path", "tokens", "bonus"),
    [
        ([1, 4, 0, 0, 7, 0, 0], [0, 1, 4], [1, 4, 7], True),  # leaf [0,1] accepted: bonus from node 4
        ([1, 3, 0, 6, 0, 0, 5], [0, 1, 3, 6], [1, 3, 6, 5], True),  # deepest leaf
        ([1, 9, 0, 0, 0, 0, 0], [0, 1], [1, 9], False),  # node 1 accepted, its children rejected
        ([8, 0, 0, 0, 0, 0, 0], [0], [8], False),  # everything rejected: one corrected token
        ([2, 0, 5, 0, 0, 3, 0], [0, 2, 5], [2, 5, 3], True),
    ],
)
def test_greedy_on_synthetic_logits(argmax, path, tokens, bonus):
    draft = Draft(GOLDEN, torch.tensor([9, 1, 2, 3, 4, 5, 6]))
    verdict = verify(draft, _logits_with_argmax(argmax), GREEDY)
    assert verdict.path.tolist() == path and verdict.tokens.tolist() == tokens and verdict.bonus is bonus
    assert verdict.num_accepted == len(path) - 1
    assert verdict.path.dtype == verdict.tokens.dtype == torch.int64


def test_greedy_prefers_deeper_branch_among_duplicate_siblings():
    tree = Tree.from_choices([[0], [1], [1, 0]])
    draft = Draft(tree, torch.tensor([0, 5, 5, 6]))  # both depth-1 candidates are token 5; only the second continues
    verdict = verify(draft, _logits_with_argmax([5, 0, 6, 2]), GREEDY)
    assert verdict.path.tolist() == [0, 2, 3] and verdict.tokens.tolist() == [5, 6, 2] and verdict.bonus


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_greedy_path_is_the_deepest_lowest_index_match_on_random_trees(num_nodes, seed):
    """Against a brute force over every node: random trees with few distinct tokens (many duplicate siblings)."""
    g = torch.Generator().manual_seed(seed)
    paths: list[tuple[int, ...]] = [()]
    kids = [0] * num_nodes
    for parent in random_parents(num_nodes, g)[1:]:
        paths.append(paths[parent] + (kids[parent],))
        kids[parent] += 1
    tree = Tree.from_choices([list(p) for p in paths[1:]])
    tokens = torch.randint(0, 3, (tree.num_nodes,), generator=g)
    argmax = torch.randint(0, 3, (tree.num_nodes,), generator=g).tolist()
    matching = [i for i in range(tree.num_nodes)
                if all(int(tokens[c]) == argmax[p] for p, c in zip(tree.path(i), tree.path(i)[1:]))]
    best = max(matching, key=lambda i: (len(tree.path(i)), -i))
    verdict = verify_greedy(Draft(tree, tokens), _logits_with_argmax(argmax, vocab=3))
    assert verdict.path.tolist() == list(tree.path(best))
    assert verdict.tokens.tolist() == tokens[list(tree.path(best))[1:]].tolist() + [argmax[best]]
    assert verdict.bonus is tree.is_leaf(best)


class PrefixModel:
    """A deterministic toy 'model': logits for the next token are a fixed random function of the token prefix."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed, self.cache = vocab, seed, {}

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:  # [vocab]
        if prefix not in self.cache:
            code = 0
            for t in prefix:
                code = code * (self.vocab + 1) + t + 1
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + code)
            self.cache[prefix] = torch.randn(self.vocab, generator=gen) * 2.0
        return self.cache[prefix]

    def tree_logits(self, tree: Tree, tokens: list[int]) -> torch.Tensor:  # [num_nodes, vocab]
        return torch.stack([self.logits(tuple(tokens[j] for j in tree.path(i)[1:])) for i in range(tree.num_nodes)])


@st.composite
def drafted_trees(draw, vocab: int = 4, max_nodes: int = 25):
    n = draw(st.integers(0, max_nodes))
    paths: list[tuple[int, ...]] = []
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        parent = draw(st.sampled_from([()] + paths))
        paths.append(parent + (counts.get(parent, 0),))
        counts[parent] = counts.get(parent, 0) + 1
    tree = Tree.from_choices(paths) if paths else Tree.root_only()
    tokens = [0] + [draw(st.integers(0, vocab - 1)) for _ in range(tree.num_nodes - 1)]
    return tree, tokens


def _walk_filling(draft: Draft, logits: torch.Tensor, known: list[int]) -> tuple:
    """greedy_walk_computing from the argmax of `known` nodes: (verdict, nodes computed, known ones first)."""
    full = logits.argmax(-1).tolist()
    argmax = [full[i] if i in known else None for i in range(len(full))]
    computed = list(known)

    def argmax_of(nodes):
        assert nodes and all(argmax[i] is None for i in nodes)  # only what is not known yet
        computed.extend(nodes)
        return [full[i] for i in nodes]

    return greedy_walk_computing(draft, argmax, argmax_of), computed


@settings(max_examples=150, deadline=None)
@given(drafted_trees(), st.integers(0, 10_000))
def test_greedy_walk_from_the_likely_path(drafted, seed):
    """The lazy lm_head of a greedy step (runtime/decode.py): with the target's own child logits, `likely_path` holds
    every node the walk reads (one lm_head pass); from any child logits, walking and computing what it asks for
    ends in verify_greedy's verdict."""
    tree, tokens = drafted
    model = PrefixModel(vocab=4, seed=seed)
    draft = Draft(tree, torch.tensor(tokens))
    logits = model.tree_logits(tree, tokens)  # [N, V]
    want = verify_greedy(draft, logits)
    parents = list(tree.parent_list[1:])
    exact = logits[parents, tokens[1:]] if tree.num_nodes > 1 else torch.zeros(0)  # [N - 1]
    rows = likely_path(draft, exact)
    verdict, computed = _walk_filling(draft, logits, rows)
    assert computed == rows  # no second pass
    assert set(want.path.tolist()) <= set(rows)
    g = torch.Generator().manual_seed(seed)
    for guess in (torch.randn(tree.num_nodes - 1, generator=g), -exact):  # poor and adversarial predictors
        verdict, _ = _walk_filling(draft, logits, likely_path(draft, guess))
        assert verdict.path.tolist() == want.path.tolist() and verdict.tokens.tolist() == want.tokens.tolist()
        assert verdict.bonus is want.bonus
    assert greedy_walk(draft, [None] * tree.num_nodes) == [0]


@settings(max_examples=150, deadline=None)
@given(drafted_trees(), st.integers(0, 10_000))
def test_greedy_equals_autoregressive_greedy(drafted, seed):
    tree, tokens = drafted
    model = PrefixModel(vocab=4, seed=seed)
    # autoregressive greedy continuation of the root, long enough to cover the tree
    ar: list[int] = []
    for _ in range(tree.max_depth + 1):
        ar.append(int(model.logits(tuple(ar)).argmax()))
    verdict = verify(Draft(tree, torch.tensor(tokens)), model.tree_logits(tree, tokens), GREEDY)
    emitted = verdict.tokens.tolist()
    assert emitted == ar[: len(emitted)]
    # maximal: no node of the tree matches a longer prefix of the greedy continuation
    matching = [i for i in range(tree.num_nodes) if [tokens[j] for j in tree.path(i)[1:]] == ar[: tree.depth[i]]]
    assert verdict.num_accepted == max(int(tree.depth[i]) for i in matching)
    assert verdict.path.tolist() == list(tree.path(int(verdict.path[-1])))
    assert verdict.bonus == tree.is_leaf(int(verdict.path[-1]))


@settings(max_examples=60, deadline=None)
@given(drafted_trees(vocab=6), st.integers(0, 10_000), st.sampled_from(list(Proposal)))
def test_sampling_verdict_structure(drafted, seed, proposal):
    tree, tokens = drafted
    model = PrefixModel(vocab=6, seed=seed)
    logits = model.tree_logits(tree, tokens)
    draft_probs = None
    if proposal is not Proposal.DETERMINISTIC:
        # q with full support, so that any drafted token has q > 0
        draft_probs = torch.softmax(torch.randn(tree.num_nodes, 6, generator=torch.Generator().manual_seed(seed)), -1)
    if proposal is Proposal.WITHOUT_REPLACEMENT:  # siblings drawn without replacement are distinct
        assume(all(len(tree.children(i)) <= 6 for i in range(tree.num_nodes)))  # at most vocab of them
        tokens = list(tokens)
        for i in range(tree.num_nodes):
            for r, c in enumerate(tree.children(i)):
                tokens[c] = r
    draft = Draft(tree, torch.tensor(tokens), proposal, draft_probs)
    gen = torch.Generator().manual_seed(seed)
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=3, top_p=0.9)):
        v = verify(draft, logits, params, gen)
        path = v.path.tolist()
        assert path == list(tree.path(path[-1]))
        assert v.tokens[:-1].tolist() == [tokens[i] for i in path[1:]]
        assert v.bonus == tree.is_leaf(path[-1])
        last = int(v.tokens[-1])
        if v.bonus:  # the bonus token comes from p at the leaf: never a token p excludes
            assert target_probs(logits[path[-1]], params)[last] > 0


def test_sampling_with_top_k_1_is_greedy():
    # top_k = 1 makes p one-hot at the argmax: the sampling rules must then reproduce greedy verification exactly.
    vocab = 12
    model = PrefixModel(vocab=vocab, seed=3)
    tree = Tree.preset("mc_sim_7b_63")
    gen = torch.Generator().manual_seed(0)
    accepted = []
    for trial in range(20):
        tokens = [0] * tree.num_nodes
        for i in range(tree.num_nodes):  # distinct sibling tokens, like top-k candidates
            for c, t in zip(tree.children(i), torch.randperm(vocab, generator=gen).tolist()):
                tokens[c] = t
        draft = Draft(tree, torch.tensor(tokens))
        logits = model.tree_logits(tree, tokens)
        params = SamplingParams(temperature=1.3, top_k=1, seed=trial)
        g = verify_greedy(draft, logits)
        s = verify_sampling(draft, logits, params, params.new_generator())
        assert s.path.tolist() == g.path.tolist() and s.tokens.tolist() == g.tokens.tolist() and s.bonus == g.bonus
        accepted.append(g.num_accepted)
    assert max(accepted) >= 2  # the comparison covered multi-token acceptances


def test_deterministic_duplicate_sibling_is_never_accepted():
    # root children: token 2 (rank 0), token 2 again (rank 1, has a child), token 4
    tree = Tree.from_choices([[0], [1], [2], [1, 0]])
    draft = Draft(tree, torch.tensor([0, 2, 2, 4, 1]))
    logits = torch.log(torch.tensor([[0.1, 0.1, 0.5, 0.1, 0.2]] * 5))
    gen = torch.Generator().manual_seed(5)
    firsts = []
    for _ in range(600):
        v = verify(draft, logits, SamplingParams(temperature=1.0), gen)
        assert 2 not in v.path.tolist()
        firsts.append(int(v.tokens[0]))
    # token 2 still appears, at about its target rate 0.5 (via node 1)
    assert 0.4 < firsts.count(2) / len(firsts) < 0.6


def test_seeded_sampling_is_reproducible():
    model = PrefixModel(vocab=6, seed=11)
    tree = Tree.preset("mc_sim_7b_63")
    tokens = [0] + [r % 6 for r in tree.ranks[1:].tolist()]
    draft = Draft(tree, torch.tensor(tokens))
    logits = model.tree_logits(tree, tokens)
    params = SamplingParams(temperature=0.9, seed=42)
    runs = []
    for _ in range(2):
        gen = params.new_generator()
        runs.append([verify(draft, logits, params, gen).tokens.tolist() for _ in range(30)])
    assert runs[0] == runs[1] and len({tuple(r) for r in runs[0]}) > 1


def test_identical_draft_and_target_accepts_everything():
    tree = Tree.from_choices([[0], [1], [0, 0]])
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.7)
    q = target_probs(logits, params)  # q == p exactly: p/q = 1, acceptance is certain
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens = [0, int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[0], 1, generator=gen)), 0]
        tokens[3] = int(torch.multinomial(q[1], 1, generator=gen))
        v = verify(Draft(tree, torch.tensor(tokens), Proposal.IID, q), logits, params, gen)
        assert v.path.tolist() == [0, 1, 3] and v.bonus


def test_zero_mass_residual_guard():
    # p = {0: .5, 1: .5}; both children rejected is impossible in exact arithmetic (the 2nd has ratio 1), so it
    # can only follow from rounding; u = 1.0 forces it. The guard must return a usable distribution.
    p = torch.tensor([0.5, 0.5, 0.0])
    child, residual = _try_deterministic(p, (1, 2), [9, 0, 1], torch.tensor([9, 0, 1]), [0.9, 1.0])
    assert child == -1 and torch.equal(residual, p)
    child, residual = _try_deterministic(p, (1, 2), [9, 0, 1], torch.tensor([9, 0, 1]), [0.9, 0.99])
    assert child == 2 and residual is None


def test_input_errors():
    tree = GOLDEN
    tokens = torch.tensor([0, 1, 2, 3, 4, 5, 6])
    logits = torch.zeros(7, 10)
    with pytest.raises(ConfigError, match=r"target_logits must be \[num_nodes=7, vocab\], got \(6, 10\)"):
        verify(Draft(tree, tokens), logits[:6], GREEDY)
    with pytest.raises(ConfigError, match=r"outside the target vocabulary \[0, 5\)"):
        verify(Draft(tree, tokens), torch.zeros(7, 5), SamplingParams(temperature=1.0))
    with pytest.raises(ConfigError, match=r"draft_probs must be \[num_nodes=7, vocab=10\].*\(7, 9\)"):
        verify(Draft(tree, tokens, Proposal.IID, torch.full((7, 9), 1 / 9)), logits, SamplingParams(temperature=1.0))
    q = torch.full((7, 10), 0.1)
    q[0, 1] = 0.0  # node 1's token has q = 0 at the root: it cannot have been sampled from q
    with pytest.raises(ConfigError, match=r"draft node 1 \(token 1\) has draft probability 0.0 at its parent node 0"):
        verify(Draft(tree, tokens, Proposal.IID, q), -torch.arange(10.0).expand(7, 10), SamplingParams(temperature=1.0))


def test_root_only_draft():
    draft = Draft(Tree.root_only(), torch.tensor([3]))
    logits = torch.tensor([[0.0, 1.0, 5.0]])
    v = verify(draft, logits, GREEDY)
    assert v.path.tolist() == [0] and v.tokens.tolist() == [2] and v.bonus
    v = verify(draft, logits, SamplingParams(temperature=1.0, top_k=1), torch.Generator().manual_seed(0))
    assert v.tokens.tolist() == [2] and v.bonus
