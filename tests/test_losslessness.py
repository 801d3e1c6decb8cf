"""The losslessness oracle: tree speculative sampling must emit tokens distributed exactly like sampling from p.

Setup: a toy language model over a 6-token vocabulary (target logits and draft logits are fixed random functions
of the token prefix), a fixed tree (root with 3 children, two of them with children, depth 3), and the real
`verify`. Each trial drafts a tree (deterministic top-k, i.i.d. or without-replacement children from the draft
q), verifies it, and records the first two emitted tokens; when a step emits only one token the second comes
from a second draft + verify step rooted at it, as in the decode loop. The empirical distributions of the first
token and of the pair are compared with the exact target probabilities p(x1) and p(x1) p(x2 | x1) by a
chi-square test; a correct implementation passes at ALPHA = 1e-6 (and the seeds are fixed, so the outcome is
deterministic).

Negative controls: the two wrong rules of reference-facts section 3 are implemented below and must be rejected
by the very same statistic. The root distributions are chosen so that the subtle one ("without replacement but
residual against the original q", TV ~0.058 on the first token here, 0.046 in the reference simulation) has a
chi-square noncentrality of ~140 at N_TRIALS (5 degrees of freedom: the statistic then lands near 145 +- 24),
far beyond the ALPHA threshold (~36). The proposal x temperature x filter matrix runs two configurations per
proposal by default and the other two with the slow marker.
"""

from __future__ import annotations

import math

import pytest
import torch

from runtime.protocol import Draft, Proposal, Verdict
from runtime.sampling import SamplingParams, sample, target_probs
from runtime.tree import Tree
from runtime.verify import verify

VOCAB = 6
TREE = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
MAX_PREFIX = 1 + TREE.max_depth  # a second step is rooted one token deeper
# Root distributions (see the module docstring): q puts most mass where p has little, so rejections chain.
ROOT_P = [0.05, 0.30, 0.06, 0.29, 0.25, 0.05]
ROOT_Q = [0.80, 0.12, 0.04, 0.02, 0.01, 0.01]
N_TRIALS = 4000
ALPHA = 1e-6


def _code(prefix: tuple[int, ...]) -> int:
    """Bijective base-(VOCAB + 1) code of a token prefix; () -> 0, (x,) -> x + 1."""
    c = 0
    for t in prefix:
        c = c * (VOCAB + 1) + t + 1
    return c


class ToyLM:
    """Target and draft next-token logits for every prefix of up to MAX_PREFIX tokens, as lookup tables."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        rows = (VOCAB + 1) ** MAX_PREFIX
        self.target = torch.randn(rows, VOCAB, generator=gen) * 1.5  # [rows, V]
        self.draft = 0.5 * self.target + torch.randn(rows, VOCAB, generator=gen)  # [rows, V]: related, not equal
        self.target[0] = torch.log(torch.tensor(ROOT_P))
        self.draft[0] = torch.log(torch.tensor(ROOT_Q))

    def drafts(self, root_codes: torch.Tensor, proposal: Proposal, gen: torch.Generator, duplicate: bool = False):
        """Draft TREE below each root prefix (vectorised over trials).

        root_codes  # [n] int64
        Returns tokens # [n, N] int64, target_logits # [n, N, V], draft_probs # [n, N, V].
        duplicate: (deterministic only) the root's third child repeats the first child's token, as when two
        candidate sources propose the same token.
        """
        n, num_nodes = root_codes.shape[0], TREE.num_nodes
        tokens = torch.zeros(n, num_nodes, dtype=torch.int64)
        codes = torch.zeros(n, num_nodes, dtype=torch.int64)
        codes[:, 0] = root_codes
        for i in range(num_nodes):
            kids = TREE.children(i)
            if not kids:
                continue
            q = torch.softmax(self.draft[codes[:, i]], dim=-1)  # [n, V]
            m = len(kids)
            if proposal is Proposal.DETERMINISTIC:
                toks = torch.argsort(q, dim=-1, descending=True, stable=True)[:, :m]
                if duplicate and i == 0:
                    toks[:, 2] = toks[:, 0]
            else:
                toks = torch.multinomial(q, m, replacement=proposal is Proposal.IID, generator=gen)
            sl = slice(kids[0], kids[-1] + 1)  # siblings are contiguous node indices
            tokens[:, sl] = toks
            codes[:, sl] = codes[:, i : i + 1] * (VOCAB + 1) + toks + 1
        return tokens, self.target[codes], torch.softmax(self.draft[codes], dim=-1)

    def exact(self, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """p(x1)  # [V]  and  p(x1, x2) = p(x1) p(x2 | x1)  # [V, V], float64."""
        first = target_probs(self.target[0], params).double()
        second = target_probs(self.target[1 : VOCAB + 1], params).double()  # row x = prefix (x,)
        return first, first[:, None] * second


def run_trials(lm: ToyLM, verifier, proposal: Proposal, params: SamplingParams, n: int, seed: int, duplicate=False):
    """Counts of the first emitted token  # [V]  and of the first two  # [V, V]  over n independent trials."""
    draft_gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 1)

    def step(tokens, logits, probs) -> list[int]:
        draft = Draft(TREE, tokens, proposal, probs)  # probs also given to deterministic drafts (negative control 1)
        v = verifier(draft, logits, params, verify_gen)
        return v.tokens.tolist()

    tokens, logits, probs = lm.drafts(torch.zeros(n, dtype=torch.int64), proposal, draft_gen, duplicate)
    first = torch.zeros(n, dtype=torch.int64)
    second = torch.full((n,), -1, dtype=torch.int64)
    for t in range(n):
        out = step(tokens[t], logits[t], probs[t])
        first[t] = out[0]
        if len(out) > 1:
            second[t] = out[1]
    again = (second < 0).nonzero().flatten()  # only one token emitted: the next step's first token is the second
    tokens, logits, probs = lm.drafts(first[again] + 1, proposal, draft_gen, duplicate)
    for j, t in enumerate(again.tolist()):
        second[t] = step(tokens[j], logits[j], probs[j])[0]
    firsts = torch.bincount(first, minlength=VOCAB).double()
    pairs = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB).double().reshape(VOCAB, VOCAB)
    return firsts, pairs


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled. Impossible outcomes -> 0."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = float(counts.sum())
    if float(counts[probs <= 0].sum()) > 0:
        return 0.0
    expected = probs * n
    order = torch.argsort(expected).tolist()  # ascending
    pooled_o = pooled_e = 0.0
    k = 0
    while k < len(order) and (expected[order[k]] < 5.0 or 0.0 < pooled_e < 5.0):
        pooled_o, pooled_e = pooled_o + float(counts[order[k]]), pooled_e + float(expected[order[k]])
        k += 1
    cells = [(float(counts[i]), float(expected[i])) for i in order[k:]]
    if pooled_e > 0.0:
        cells.append((pooled_o, pooled_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    half_df, half_stat = torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(half_df, half_stat))  # chi-square survival function


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts.flatten() / counts.sum() - probs.flatten()).abs().sum())


# ---- the two wrong rules of reference-facts section 3 (negative controls) -----------------------------------


def _wrong_verify(draft: Draft, target_logits: torch.Tensor, params: SamplingParams, gen, *, bug: str) -> Verdict:
    """Tree rejection sampling with a deliberately wrong rule.

    "ratio_for_deterministic": deterministic (top-k) children verified with min(1, p/q) and residual max(0, p - q)
        as if they had been sampled from q.
    "wor_residual_original_q": without-replacement children, acceptance with the updated q_i but the residual
        taken against the original q.
    """
    tokens = draft.tokens.tolist()
    node, path, out = 0, [0], []
    while True:
        p = target_probs(target_logits[node], params)
        kids = draft.tree.children(node)
        if not kids:
            out.append(sample(p, gen))
            return Verdict(torch.tensor(path), torch.tensor(out), True)
        q0 = draft.draft_probs[node]
        q = q0.clone()
        for c in kids:
            x = tokens[c]
            if float(torch.rand((), generator=gen, dtype=torch.float64)) < min(1.0, float(p[x] / q[x])):
                path.append(c)
                out.append(x)
                node = c
                break
            r = (p - q0).clamp_min(0.0)
            if float(r.sum()) > 0:
                p = r / r.sum()
            if bug == "wor_residual_original_q":
                q[x] = 0.0
                q = q / q.sum()
        else:
            out.append(sample(p, gen))
            return Verdict(torch.tensor(path), torch.tensor(out), False)


# ---- tests --------------------------------------------------------------------------------------------------

LM = ToyLM(seed=0)
FILTERS = {"none": {}, "topk4-topp0.8": {"top_k": 4, "top_p": 0.8}}


MATRIX = [
    pytest.param(proposal, temperature, filters, id=f"{proposal.value}-T{temperature}-{filters}", marks=marks)
    for proposal in Proposal
    for temperature, filters, marks in [
        (1.0, "none", ()),
        (0.7, "topk4-topp0.8", ()),
        (0.7, "none", pytest.mark.slow),
        (1.0, "topk4-topp0.8", pytest.mark.slow),
    ]
]


@pytest.mark.parametrize(("proposal", "temperature", "filters"), MATRIX)
def test_verify_is_lossless(proposal, temperature, filters):
    params = SamplingParams(temperature=temperature, **FILTERS[filters])
    seed = 1000 * list(Proposal).index(proposal) + int(temperature * 10) + 7 * list(FILTERS).index(filters)
    firsts, pairs = run_trials(LM, verify, proposal, params, N_TRIALS, seed)
    p1, p2 = LM.exact(params)
    pv1, pv2 = chi2_pvalue(firsts, p1), chi2_pvalue(pairs, p2)
    tv1, tv2 = total_variation(firsts, p1), total_variation(pairs, p2)
    detail = f"TV first {tv1:.4f} pair {tv2:.4f}; p-values {pv1:.3g} {pv2:.3g}"
    assert pv1 > ALPHA and pv2 > ALPHA, detail


def test_filters_bite_at_the_root():
    """The filtered configurations really remove tokens the draft proposes (so the tests above cover that)."""
    p1, _ = LM.exact(SamplingParams(temperature=1.0, **FILTERS["topk4-topp0.8"]))
    assert set(p1.nonzero().flatten().tolist()) == {1, 3, 4}  # top-k drops 0 and 5, top-p drops 2
    assert ROOT_Q.index(max(ROOT_Q)) == 0  # ... while the draft's favourite is token 0


def test_deterministic_duplicate_siblings_are_lossless():
    params = SamplingParams(temperature=1.0)
    firsts, pairs = run_trials(LM, verify, Proposal.DETERMINISTIC, params, N_TRIALS, seed=99, duplicate=True)
    p1, p2 = LM.exact(params)
    assert chi2_pvalue(firsts, p1) > ALPHA and chi2_pvalue(pairs, p2) > ALPHA


@pytest.mark.parametrize(
    ("bug", "proposal"),
    [("ratio_for_deterministic", Proposal.DETERMINISTIC), ("wor_residual_original_q", Proposal.WITHOUT_REPLACEMENT)],
)
def test_statistic_rejects_wrong_rules(bug, proposal):
    params = SamplingParams(temperature=1.0)

    def wrong(draft, logits, params, gen):
        return _wrong_verify(draft, logits, params, gen, bug=bug)

    firsts, pairs = run_trials(LM, wrong, proposal, params, N_TRIALS, seed=4242)
    p1, p2 = LM.exact(params)
    pv1, pv2 = chi2_pvalue(firsts, p1), chi2_pvalue(pairs, p2)
    tv = total_variation(firsts, p1)
    assert pv1 < ALPHA and pv2 < ALPHA, f"{bug}: TV {tv:.4f}, p-values {pv1:.3g} {pv2:.3g}"
    assert tv > (0.4 if bug == "ratio_for_deterministic" else 0.03)


def test_chi2_pvalue_calibration():
    """The statistic itself: exact-fit counts pass, a 2-sigma wobble passes, impossible outcomes fail."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    assert chi2_pvalue(torch.tensor([500.0, 300.0, 200.0, 0.0]), probs) > 0.99
    assert chi2_pvalue(torch.tensor([530.0, 290.0, 180.0, 0.0]), probs) > 0.01
    assert chi2_pvalue(torch.tensor([600.0, 250.0, 150.0, 0.0]), probs) < 1e-6
    assert chi2_pvalue(torch.tensor([500.0, 300.0, 199.0, 1.0]), probs) == 0.0
    # chi-square(2 df) survival is exp(-x/2): check the gamma-function p-value against the closed form
    counts = torch.tensor([520.0, 300.0, 180.0])
    stat = 20**2 / 500 + 0 + 20**2 / 200
    assert math.isclose(chi2_pvalue(counts, probs[:3]), math.exp(-stat / 2), rel_tol=1e-9)


@pytest.mark.parametrize("proposal", list(Proposal), ids=lambda p: p.value)
def test_pruned_trees_are_lossless(proposal):
    """Drafts pruned before verification (runtime.decode.prune_draft: what the scheduler's tree budget and the token /
    cache limits do), to a different node budget and depth each step, stay exact."""
    from runtime.decode import prune_draft

    budgets = torch.Generator().manual_seed(5)

    def pruned_verify(draft, logits, params, gen):
        max_nodes = int(torch.randint(1, TREE.num_nodes + 1, (1,), generator=budgets))
        max_depth = int(torch.randint(0, TREE.max_depth + 1, (1,), generator=budgets))
        small = prune_draft(draft, max_depth=max_depth, max_nodes=max_nodes)
        keep = torch.tensor(TREE.best_nodes(max_nodes, max_depth))
        assert small.tree.num_nodes == keep.shape[0] and torch.equal(small.tokens, draft.tokens[keep])
        return verify(small, logits[keep], params, gen)

    params = SamplingParams(temperature=1.0)
    firsts, pairs = run_trials(LM, pruned_verify, proposal, params, N_TRIALS, seed=77 + list(Proposal).index(proposal))
    p1, p2 = LM.exact(params)
    pv1, pv2 = chi2_pvalue(firsts, p1), chi2_pvalue(pairs, p2)
    assert pv1 > ALPHA and pv2 > ALPHA, f"p-values {pv1:.3g} {pv2:.3g}"
