"""SamplingParams validation, target_probs against transformers' logits warpers, and sample()."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from runtime.errors import RequestError
from runtime.sampling import SamplingParams, greedy_tokens, sample, target_probs


def test_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_tokens) == (0.0, 0, 1.0, None, 64)
    assert p.stop == () and p.stop_token_ids == () and p.ignore_eos is False
    assert p.greedy and not SamplingParams(temperature=0.5).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]


def test_normalisation():
    p = SamplingParams(temperature=1, top_p=1, stop=["a", "bc"], stop_token_ids=[2, 3], seed=2**64 - 1)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (2, 3)
    assert SamplingParams(stop="END").stop == ("END",)
    assert hash(p) == hash(SamplingParams(temperature=1.0, stop=("a", "bc"), stop_token_ids=(2, 3), seed=2**64 - 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0.*-0.1"),
        ({"temperature": float("nan")}, "temperature .* got nan"),
        ({"temperature": float("inf")}, "temperature .* got inf"),
        ({"temperature": "1"}, "temperature .* got '1'"),
        ({"top_k": -1}, "top_k must be an integer >= 0.*-1"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"top_k": True}, "top_k must be an integer"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\].*0.0"),
        ({"top_p": 1.5}, r"top_p .* 1.5"),
        ({"top_p": float("nan")}, "top_p"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"seed": -1}, r"seed must be None or an integer in \[0, 2\*\*64 - 1\], got -1"),
        ({"seed": 2**64}, "seed .* got 18446744073709551616"),
        ({"seed": 1.0}, "seed"),
        ({"stop": ["ok", ""]}, "stop must be a list of non-empty strings"),
        ({"stop": [1]}, "stop must be"),
        ({"stop_token_ids": [3, -2]}, "stop_token_ids must be a list of integers >= 0"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ],
)
def test_validation(kwargs, message):
    with pytest.raises(RequestError, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    # The field, the expectation and the value, for front ends that restate the error in their own input names.
    field = next(iter(kwargs))
    assert (info.value.field, info.value.value) == (field, kwargs[field])
    assert str(info.value) == f"{field} must be {info.value.expected}, got {info.value.value!r}"


def _hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' sampling pipeline: temperature, then top-k, then top-p warpers, then softmax."""
    x = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return x.softmax(-1)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.8])
@pytest.mark.parametrize(
    ("top_k", "top_p"), [(0, 1.0), (5, 1.0), (0, 0.8), (10, 0.5), (3, 0.95), (0, 0.01), (500, 0.9)]
)
def test_target_probs_match_transformers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(8, 100, generator=gen) * 3.0
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = target_probs(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    ref = _hf_probs(logits, temperature, top_k, top_p)
    assert torch.allclose(probs, ref, atol=1e-6)
    assert torch.equal(probs > 0, ref > 0)  # same support, not just close numbers


def test_top_p_keeps_smallest_set_with_mass_at_least_p():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1]))
    cases = {0.39: {1}, 0.41: {1, 2}, 0.64: {1, 2}, 0.66: {1, 2, 3}, 0.9: {1, 2, 3, 4}, 0.96: {0, 1, 2, 3, 4}}
    for top_p, support in cases.items():
        probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert set(probs.nonzero().flatten().tolist()) == support, top_p
        kept = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])[sorted(support)]
        assert torch.allclose(probs[sorted(support)], kept / kept.sum())
    # always at least one token, however small top_p is
    tiny = target_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert tiny.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_top_k_keeps_ties_and_respects_vocab():
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert set(probs.nonzero().flatten().tolist()) == {1, 2, 3}  # the tie at the 2nd-largest value stays
    wide = target_probs(logits, SamplingParams(temperature=1.0, top_k=50))
    assert torch.allclose(wide, logits.softmax(-1))


def test_greedy_probs_are_one_hot_first_max():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [9.0, 0.0, 0.0, 0.0]])
    probs = target_probs(logits, SamplingParams(top_k=1, top_p=0.5))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 49152), (torch.bfloat16, 49152), (torch.float64, 49152),
                                         (torch.float32, 49155), (torch.float32, 151936)])
def test_greedy_tokens_is_argmax_with_its_tie_rule(dtype, vocab):
    """Rows as wide as a real vocabulary (vectorised kernels split them into lanes and blocks), with exact ties placed
    in different lanes, blocks and orders: the first maximal index wins, as torch.argmax's."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, vocab, generator=gen).to(dtype)
    ties = torch.randint(0, vocab, (64, 3), generator=gen)
    for row in range(48):  # the last 16 rows keep their (almost surely unique) maximum
        logits[row, ties[row, : 1 + row % 3]] = 100.0
    logits[60, :] = 7.0  # a constant row: index 0
    logits[61, 5] = float("nan")  # NaN propagates as the maximum, like argmax
    logits[62, 70] = logits[62, 900] = float("nan")  # the first NaN
    logits[63, :] = float("-inf")
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and got.tolist() == logits.argmax(-1).tolist()
    assert got[:48].tolist() == [int(ties[r, : 1 + r % 3].min()) for r in range(48)]
    assert got[60] == 0 and got[61] == 5 and got[62] == 70 and got[63] == 0
    assert greedy_tokens(logits.view(4, 16, vocab)).tolist() == got.view(4, 16).tolist()
    assert greedy_tokens(logits[7]).ndim == 0 and int(greedy_tokens(logits[7])) == int(got[7])
    assert int(greedy_tokens(logits[7, 3])) == 0  # a lone logit, as max(dim=-1) takes it


def test_target_probs_accepts_half_precision_and_minus_inf():
    logits = torch.tensor([0.0, float("-inf"), 1.0], dtype=torch.bfloat16)
    probs = target_probs(logits, SamplingParams(temperature=0.5))
    assert probs.dtype == torch.float32 and probs[1] == 0.0
    assert torch.allclose(probs, torch.tensor([0.0, float("-inf"), 2.0]).softmax(-1))


def test_sample_follows_probs():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    gen = torch.Generator().manual_seed(7)
    n = 6000
    counts = torch.bincount(torch.tensor([sample(probs, gen) for _ in range(n)]), minlength=5).double()
    assert counts[1] == 0 and counts[4] == 0
    expected = probs.double() * n
    support = expected > 0
    chi2 = (((counts - expected) ** 2)[support] / expected[support]).sum()
    assert float(torch.special.gammaincc(torch.tensor(1.0, dtype=torch.float64), chi2 / 2)) > 1e-6  # df = 2
    # unnormalised weights are fine: the residual distributions passed by verify are not renormalised
    assert sample(torch.tensor([0.0, 0.0, 3.0]), gen) == 2


def test_seeded_generators_reproduce():
    params = SamplingParams(temperature=1.0, seed=123)
    probs = torch.full((50,), 0.02)
    a = [sample(probs, g) for g in [params.new_generator()] for _ in range(20)]
    b = [sample(probs, g) for g in [params.new_generator()] for _ in range(20)]
    assert a == b and len(set(a)) > 5
    unseeded = SamplingParams(temperature=1.0)
    c = [sample(probs, g) for g in [unseeded.new_generator()] for _ in range(20)]
    d = [sample(probs, g) for g in [unseeded.new_generator()] for _ in range(20)]
    assert c != d  # fresh OS entropy each time (collision chance 50**-20)
