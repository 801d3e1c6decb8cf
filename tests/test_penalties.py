"""Penalties (repetition / presence / frequency), min_tokens, bad words and log-probabilities in the decode loop.

Losslessness is defined against the PENALISED target: at every position p = target_probs(penalised logits), the
penalty computed from that position's own context. Oracles here recompute every position from scratch (a fresh
prefill per prefix, transformers' RepetitionPenaltyLogitsProcessor for the repetition penalty) and compare the
speculative loop with them: greedy token for token, sampled by a chi-square test with a negative control (a
penalty that ignores the draft path, the bug a tree makes easy).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from runtime.decode import SpecDecoder
from runtime.errors import RequestError
from runtime.model import TargetModel
from runtime.sampling import Penalties, SamplingParams, target_probs
from runtime.tree import Tree
from tests.test_decode import PROMPTS, RankedDrafter, chi2_stat, chi2_threshold, sample_counts
from tests.tiny import make_checkpoint

PENALTY_CASES = [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5, presence_penalty=0.7),
    dict(repetition_penalty=1.3, frequency_penalty=-0.8, presence_penalty=1.2),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return TargetModel.from_pretrained(make_checkpoint(tmp_path_factory.mktemp("pen") / "llama3", "llama3"))


def reference_penalised(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                        end_ids: set[int]) -> torch.Tensor:
    """logits # [V] after `prompt + output`, penalised the plain way (one context, no tree)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    x = logits.float().clone()
    if params.repetition_penalty != 1.0:
        proc = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        x = proc(torch.tensor([prompt + output]), x[None])[0]
    for tok, n in Counter(output).items():
        x[tok] -= params.frequency_penalty * n + params.presence_penalty
    if len(output) < params.min_tokens:
        for t in end_ids:
            x[t] = -math.inf
    context = prompt + output
    for word in params.bad_words:
        if len(word) == 1 or tuple(context[-(len(word) - 1):]) == word[:-1]:
            x[word[-1]] = -math.inf
    return x


def reference_logits(model: TargetModel, seq: list[int]) -> torch.Tensor:
    logits, _ = model.prefill(torch.tensor([seq]), model.new_cache(len(seq)))
    return logits[0, -1]


def reference_greedy(model, prompt, params, n, end_ids=frozenset()) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        x = reference_penalised(reference_logits(model, prompt + out), prompt, out, params, set(end_ids))
        out.append(int(x.argmax()))
    return out


def exact_penalised_joint(model, prompt, params, n) -> dict[tuple, float]:
    dist: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in dist.items():
            x = reference_penalised(reference_logits(model, prompt + list(prefix)), prompt, list(prefix), params,
                                    set())
            p = target_probs(x, params)
            for tok in torch.nonzero(p > 0).flatten().tolist():
                nxt[prefix + (tok,)] = pr * float(p[tok])
        dist = nxt
    return dist


class PenalisedRanked(RankedDrafter):
    """RankedDrafter over the penalised target (rank 1 = the penalised argmax), so deep paths get accepted
    while penalties are in force."""

    def __init__(self, model, tree, prompt, params):
        super().__init__(model, tree)
        self.prompt, self.params = list(prompt), params

    def ranked(self, seq):
        if seq not in self._ranked:
            seq_l = list(seq)
            x = reference_penalised(reference_logits(self.model, seq_l), self.prompt, seq_l[len(self.prompt):],
                                    self.params, set())
            self._ranked[seq] = x.argsort(descending=True, stable=True)
        return self._ranked[seq]


DEEP_TREE = [[0], [1], [2], [1, 0], [1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1, 1]]


# ---- Penalties.apply on a tree == the plain per-context computation, row by row -----------------------------


@pytest.mark.parametrize("case", [*PENALTY_CASES, dict(min_tokens=4), dict(bad_words=((7,), (5, 9), (3, 4, 11)))])
def test_tree_rows_are_penalised_against_their_own_path(case):
    torch.manual_seed(0)
    vocab = 16
    params = SamplingParams(max_tokens=32, **case)
    prompt, output = [3, 4, 5, 9, 9], [2, 3, 4]
    tree = Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]])
    tokens = torch.tensor([output[-1], 5, 3, 9, 4, 11, 4, 7])  # node 0 = the root = the last emitted token
    logits = torch.randn(tree.num_nodes, vocab) * 3
    pen = Penalties(params, prompt, vocab, {0, 1})
    pen.add(output)
    got = pen.apply(logits, tokens, tree.mask, tree.depth)
    for i in range(tree.num_nodes):
        path = [int(tokens[j]) for j in tree.path(i)[1:]]
        want = reference_penalised(logits[i], prompt, output + path, params, {0, 1})
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        fin = torch.isfinite(want)
        assert torch.allclose(got[i][fin], want[fin], atol=1e-5), i


def test_unpenalised_requests_skip_the_work():
    params = SamplingParams()
    logits = torch.randn(3, 8)
    assert Penalties(params, [1, 2], 8, {0}).apply(logits, torch.tensor([1, 2, 3]), torch.eye(3, dtype=torch.bool),
                                                   torch.tensor([0, 1, 1])) is logits


# ---- greedy: speculative == plain penalised greedy -----------------------------------------------------------


@pytest.mark.parametrize("case", [*PENALTY_CASES, dict(bad_words=((9,), (33, 7)), repetition_penalty=1.2)])
def test_greedy_penalised_identity_with_deep_acceptance(model, case):
    tree = Tree.from_choices(DEEP_TREE)
    for prompt in PROMPTS[:3]:
        params = SamplingParams(max_tokens=16, ignore_eos=True, **case)
        dec = SpecDecoder(model, None, PenalisedRanked(model, tree, prompt, params), tree.num_nodes)
        out = dec.generate(prompt, params)
        assert list(out.token_ids) == reference_greedy(model, prompt, params, 16)
        assert max(out.stats.accepted_per_step) >= 2  # multi-token paths were accepted under the penalty
    plain = SpecDecoder(model, None, RankedDrafter(model, tree), tree.num_nodes).generate(
        PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True))
    assert list(plain.token_ids) != reference_greedy(model, PROMPTS[0], SamplingParams(
        max_tokens=16, ignore_eos=True, **PENALTY_CASES[0]), 16)  # the penalty changes this output


def test_min_tokens_suppresses_end_tokens(model):
    tree = Tree.from_choices(DEEP_TREE)
    free = SpecDecoder(model, None, RankedDrafter(model, tree), tree.num_nodes).generate(
        PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True))
    end = free.token_ids[1]  # stop at the 2nd token ... unless min_tokens forbids it
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(end,), min_tokens=6)
    dec = SpecDecoder(model, None, PenalisedRanked(model, tree, PROMPTS[1], params), tree.num_nodes)
    out = dec.generate(PROMPTS[1], params)
    assert end not in out.token_ids[:6]
    ref = reference_greedy(model, PROMPTS[1], params, 12, end_ids={end})
    cut = ref.index(end) + 1 if end in ref else len(ref)
    assert list(out.token_ids) == ref[:cut]


# ---- sampled: distributed exactly as the penalised target ----------------------------------------------------


def _sampled_case(model, kw):
    tree = Tree.from_choices(DEEP_TREE)
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=3, ignore_eos=True, **kw)
    dec = SpecDecoder(model, None, PenalisedRanked(model, tree, prompt, params), tree.num_nodes)
    return dec, prompt, exact_penalised_joint(model, prompt, params, 3)


SUPPRESS = dict(temperature=1.0, top_k=5, repetition_penalty=2.5, frequency_penalty=2.0, presence_penalty=1.0)
# Negative penalties favour repeating a token: the token just accepted on a draft path then matters a lot.
ENCOURAGE = dict(temperature=1.0, top_k=5, repetition_penalty=0.6, frequency_penalty=-2.0, presence_penalty=-1.0)


@pytest.mark.parametrize("kw", [SUPPRESS, ENCOURAGE], ids=["suppress", "encourage"])
def test_sampled_penalised_distribution_matches_target(model, kw):
    dec, prompt, exact = _sampled_case(model, kw)
    trials = 1500
    counts = sample_counts(dec, prompt, kw, 3, trials)
    stat, df = chi2_stat(counts, exact, trials)
    assert stat < chi2_threshold(df), (stat, df)


def test_distribution_test_catches_a_penalty_that_ignores_the_draft_path(model, monkeypatch):
    """Negative control: penalising every tree row with the committed context only (the draft path left out)
    is lossy, and the same statistic must reject it."""
    real = Penalties.apply

    def path_blind(self, logits, tokens, ancestors, depth):
        root_only = torch.zeros_like(ancestors)
        root_only[:, 0] = True
        return real(self, logits, tokens, root_only, torch.zeros_like(depth))

    monkeypatch.setattr(Penalties, "apply", path_blind)
    dec, prompt, exact = _sampled_case(model, ENCOURAGE)
    counts = sample_counts(dec, prompt, ENCOURAGE, 3, 1500)
    stat, df = chi2_stat(counts, exact, 1500)
    assert stat > chi2_threshold(df), (stat, df)


# ---- log-probabilities of the emitted tokens -----------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, top_k=6, seed=3), dict(repetition_penalty=1.5)])
def test_logprobs_are_those_of_the_distribution_each_token_came_from(model, kw):
    tree = Tree.from_choices(DEEP_TREE)
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, **kw)
    dec = SpecDecoder(model, None, PenalisedRanked(model, tree, prompt, params), tree.num_nodes)
    deltas = list(dec.stream(prompt, params))
    ids = [t for d in deltas for t in d.token_ids]
    lps = [x for d in deltas for x in d.logprobs]
    tops = [x for d in deltas for x in d.top_logprobs]
    assert len(ids) == len(lps) == len(tops) == 10
    assert max(deltas[-1].stats.accepted_per_step) >= 1
    for k, tok in enumerate(ids):
        x = reference_penalised(reference_logits(model, prompt + ids[:k]), prompt, ids[:k], params, set())
        ref = torch.log_softmax(x, -1) if params.greedy else torch.log(target_probs(x, params))
        assert lps[k] == pytest.approx(float(ref[tok]), abs=1e-4)
        assert [t for t, _ in tops[k]] == ref.topk(3).indices.tolist()[: len(tops[k])]
        assert tops[k][0][1] >= lps[k] - 1e-6


def test_no_logprobs_unless_asked(model):
    dec = SpecDecoder(model, None, RankedDrafter(model, Tree.from_choices(DEEP_TREE)), 9)
    assert all(d.logprobs is None for d in dec.stream(PROMPTS[0], SamplingParams(max_tokens=4)))


# ---- validation and statistics -------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(min_tokens=9, max_tokens=8), r"min_tokens must be an integer in \[0, max_tokens=8\]"),
    (dict(bad_words=((),)), "bad_words must be a list of non-empty token-id lists"),
    (dict(logprobs=21), r"logprobs must be None or an integer in \[0, 20\]"),
])
def test_bad_settings_name_the_field(kw, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kw)


def test_acceptance_rate_is_per_draft_position(model):
    tree = Tree.from_choices(DEEP_TREE)  # depth 4, 9 nodes
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    s = SpecDecoder(model, None, PenalisedRanked(model, tree, PROMPTS[0], params), tree.num_nodes).generate(
        PROMPTS[0], params).stats
    assert s.draft_positions <= 4 * s.steps and s.draft_positions >= s.steps
    assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.draft_positions)
    assert s.acceptance_rate > s.accepted_tokens / s.drafted_tokens  # per position, not per tree node
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.steps)
    per_pos = s.accepted_per_position
    assert per_pos[0] == sum(1 for a in s.accepted_per_step if a >= 1) and sum(per_pos) == s.accepted_tokens
    assert list(per_pos) == sorted(per_pos, reverse=True)
