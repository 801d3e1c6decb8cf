"""The decode loop end to end: greedy speculative output == greedy autoregressive output == transformers,
sampled output distributed exactly as the target, stop conditions, limits and stats."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

import runtime
import runtime.decode
from runtime.decode import SpecDecoder, StopChecker
from runtime.draft_spec import DraftSpec
from runtime.drafters import load_drafter
from runtime.errors import RequestError
from runtime.model import TargetModel
from runtime.protocol import Draft, Proposal, Verdict
from runtime.sampling import SamplingParams, target_probs
from runtime.tokenizer import Tokenizer
from runtime.tree import Tree
from tests.heads import draft_paths
from tests.tiny import EOS_ID, make_checkpoint
from tests.cpu_marks import needs_fast_bf16

PROMPTS = [
    [0, 5, 9, 33, 7, 5, 9, 33],
    [0, 100, 101, 102],
    [0, 17],
    [0, 300, 12, 12, 12, 12, 12, 12, 40, 41, 300, 12, 12],
    list(range(3, 60, 2)),
]
TREES = ["chain-1", "chain-4", '[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]', "mc_sim_7b_63"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode")
    return {v: make_checkpoint(root / v, v) for v in ("llama2", "llama3", "mistral", "qwen2")}


def greedy_reference(model: TargetModel, prompt: list[int], n: int) -> list[int]:
    """Plain autoregressive greedy decoding with a fresh full-sequence pass per token (no cache reuse)."""
    seq = list(prompt)
    for _ in range(n):
        logits, _ = model.prefill(torch.tensor([seq]), model.new_cache(len(seq)))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


class TeacherDrafter:
    """A test drafter with controllable quality, so that the loop's multi-token acceptance and KV compaction are
    exercised hard (random-weight heads almost never get accepted).

    Each step it hides the target's true greedy continuation on one random root-to-leaf path of `tree`, corrupts
    it at a random depth with probability `corrupt`, and fills every other node with random tokens.
    """

    name = "teacher"

    def __init__(self, model: TargetModel, tree: Tree, seed: int, corrupt: float = 0.3) -> None:
        self.model, self.tree, self.rng, self.corrupt = model, tree, random.Random(seed), corrupt

    def start(self, prompt, hidden, max_nodes):
        assert hidden.shape == (prompt.shape[0], self.model.config.hidden_size)
        return _TeacherSession(self, prompt.tolist())


class _TeacherSession:
    def __init__(self, owner: TeacherDrafter, seq: list[int]) -> None:
        self.o, self.seq = owner, seq

    def draft(self, root, params, generator, max_nodes=None):
        o, tree = self.o, self.o.tree
        vocab = o.model.config.vocab_size
        tokens = [root] + [o.rng.randrange(vocab) for _ in range(tree.num_nodes - 1)]
        truth = greedy_reference(o.model, self.seq + [root], tree.max_depth)
        leaf_path = [int(i) for i in o.rng.choice(tree.retrieve_paths.tolist()) if i >= 0]
        bad_depth = o.rng.randrange(1, len(leaf_path)) if o.rng.random() < o.corrupt and len(leaf_path) > 1 else None
        for depth, node in enumerate(leaf_path[1:], start=1):
            tokens[node] = truth[depth - 1] if depth != bad_depth else (truth[depth - 1] + 1) % vocab
        return Draft(tree, torch.tensor(tokens), Proposal.DETERMINISTIC)

    def advance(self, tokens, hidden):
        assert hidden.shape == (tokens.shape[0], self.o.model.config.hidden_size)
        self.seq += tokens.tolist()


def decoder(ckpt, drafter_kind="none", tree=None, **opts) -> SpecDecoder:
    return runtime.load(ckpt, draft=drafter_kind, tree=tree, **opts)


# ---- greedy identity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["llama2", "llama3", "mistral", "qwen2"])
def test_greedy_plain_equals_transformers(ckpts, variant):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpts[variant])
    dec = decoder(ckpts[variant])
    for prompt in PROMPTS[:3]:
        out = dec.generate(prompt, max_tokens=24, ignore_eos=True)
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert list(out.token_ids) == ref[0, len(prompt) :].tolist()
        assert out.stats.tau == 1.0 and out.stats.steps == 23


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("variant", ["llama3", "qwen2"])
def test_greedy_teacher_identity_with_acceptance(ckpts, variant, tree):
    """Spec output == autoregressive output while most draft tokens are accepted (compaction exercised)."""
    model = TargetModel.from_pretrained(ckpts[variant])
    t = Tree.parse(tree)
    for i, prompt in enumerate(PROMPTS):
        dec = SpecDecoder(model, None, TeacherDrafter(model, t, seed=i), max_tree_nodes=t.num_nodes)
        out = dec.generate(prompt, max_tokens=20, ignore_eos=True)
        assert list(out.token_ids) == greedy_reference(model, prompt, 20)
        s = out.stats
        assert s.generated_tokens == 20 and sum(s.accepted_per_step) + s.steps == 19
        if t.max_depth > 1:
            assert s.tau > 1.5, s.accepted_per_step


@pytest.mark.parametrize("predictor", ["exact", "adversarial"])
def test_greedy_steps_run_the_lm_head_on_the_likely_path(ckpts, monkeypatch, predictor):
    """A greedy tree step runs the lm_head on the nodes verification will likely read (runtime.verify.likely_path),
    not on every node, and on any other node the walk asks for: the output stays greedy decoding's. With the target's
    own child logits one pass suffices; with a predictor that picks each node's worst child the walk asks for more."""
    import runtime.decode as decode_module
    import runtime.verify as verify_module

    model = TargetModel.from_pretrained(ckpts["llama3"])
    t = Tree.parse("mc_sim_7b_63")
    if predictor == "adversarial":
        likely = decode_module.likely_path
        monkeypatch.setattr(decode_module, "likely_path", lambda draft, child_logits: likely(draft, -child_logits))
    forward, walk, rows, asked = model.forward_segments, verify_module.greedy_walk, [], []

    def counted_forward(segments, check=True):
        out = forward(segments, check)
        rows.append(out[0][0].shape[0])
        return out

    def counted_walk(draft, argmax):
        verdict = walk(draft, argmax)
        asked.append(isinstance(verdict, list))  # a second lm_head pass
        return verdict

    monkeypatch.setattr(model, "forward_segments", counted_forward)
    monkeypatch.setattr(verify_module, "greedy_walk", counted_walk)
    for i, prompt in enumerate(PROMPTS):
        want = greedy_reference(model, prompt, 20)
        rows.clear()
        asked.clear()
        dec = SpecDecoder(model, None, TeacherDrafter(model, t, seed=i), max_tree_nodes=t.num_nodes)
        out = dec.generate(prompt, max_tokens=20, ignore_eos=True)
        assert list(out.token_ids) == want
        s = out.stats
        assert s.tau > 1.5 and len(rows) == s.target_forwards
        assert sum(rows[1:]) <= s.steps * (t.max_depth + 1), rows  # the likely path: about one node per level
        assert any(asked) is (predictor == "adversarial"), asked


@pytest.mark.parametrize("variant", ["llama2", "mistral"])
def test_greedy_lookup_identity(ckpts, variant):
    plain = decoder(ckpts[variant])
    look = decoder(ckpts[variant], "lookup")
    for prompt in PROMPTS:
        a = plain.generate(prompt, max_tokens=40, ignore_eos=True)
        b = look.generate(prompt, max_tokens=40, ignore_eos=True)
        assert a.token_ids == b.token_ids
        assert b.stats.drafter == "lookup"


@pytest.fixture(scope="module")
def heads(ckpts, tmp_path_factory):
    from runtime.config import ModelConfig
    from tests.heads import write_eagle_head, write_medusa_head

    root = tmp_path_factory.mktemp("heads")
    out = {}
    for variant in ("llama3", "qwen2"):
        cfg = ModelConfig.from_hf(ckpts[variant])
        out[variant, "medusa"] = write_medusa_head(root / f"{variant}-medusa", cfg.hidden_size, cfg.vocab_size, 4)
        out[variant, "eagle"] = write_eagle_head(root / f"{variant}-eagle", ckpts[variant])
    return out


@pytest.mark.parametrize(
    "kind,tree,opts",
    [
        ("medusa", "mc_sim_7b_63", {}),
        ("medusa", "chain-3", {}),
        ("eagle", None, {}),
        ("eagle", None, {"total_tokens": 12, "depth": 3, "top_k": 4}),
        ("eagle", '[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]', {}),
        ("eagle", '[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]', {"min_path_prob": 0.1}),
        ("eagle", None, {"total_tokens": 12, "depth": 3, "top_k": 4, "min_path_prob": 0.05}),
    ],
)
@pytest.mark.parametrize("variant", ["llama3", "qwen2"])
def test_greedy_head_drafters_identity(ckpts, heads, variant, kind, tree, opts):
    plain = decoder(ckpts[variant])
    spec = runtime.load(ckpts[variant], draft_model=heads[variant, kind], tree=tree, **opts)
    assert spec.drafter.name == kind
    for prompt in PROMPTS[:4]:
        a = plain.generate(prompt, max_tokens=16, ignore_eos=True)
        b = spec.generate(prompt, max_tokens=16, ignore_eos=True)
        assert a.token_ids == b.token_ids
        assert b.stats.drafted_tokens > 0


@needs_fast_bf16
def test_greedy_identity_bf16_path_runs(ckpts):
    """Reduced precision runs end to end and speculation keeps identity against its own plain decoding."""
    model = TargetModel.from_pretrained(ckpts["llama2"], dtype="bfloat16")
    t = Tree.parse("chain-3")
    plain = SpecDecoder(model, None, load_drafter(DraftSpec("none"), model), 1)
    spec = SpecDecoder(model, None, TeacherDrafter(model, t, seed=0, corrupt=0.0), t.num_nodes)
    a = plain.generate(PROMPTS[0], max_tokens=12, ignore_eos=True)
    b = spec.generate(PROMPTS[0], max_tokens=12, ignore_eos=True)
    # bf16 tree batches may round differently from single-token steps; require agreement on most tokens.
    agree = sum(x == y for x, y in zip(a.token_ids, b.token_ids))
    assert agree >= 6 and b.stats.tau > 1.0


# ---- sampling: distribution of the first tokens ------------------------------------------------------------


def chi2_threshold(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.719 <-> p = 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def exact_joint(model: TargetModel, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple, float]:
    """Exact probabilities of every n-token continuation under the processed target distribution."""
    out: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in out.items():
            seq = prompt + list(prefix)
            logits, _ = model.prefill(torch.tensor([seq]), model.new_cache(len(seq)))
            p = target_probs(logits[0, -1], params)
            for tok in torch.nonzero(p > 0).flatten().tolist():
                nxt[prefix + (tok,)] = pr * float(p[tok])
        out = nxt
    return out


class RankedDrafter:
    """Proposes, at every node of `tree`, target-ranked candidates in a scrambled order (rank 0 = the target's
    2nd choice, rank 1 = its 1st, rank 2 = its 3rd), so both acceptance and rejection paths are taken."""

    name = "ranked"
    ORDER = (1, 0, 2)

    def __init__(self, model: TargetModel, tree: Tree) -> None:
        self.model, self.tree = model, tree
        self._ranked: dict[tuple[int, ...], torch.Tensor] = {}  # trials share prefixes: memoise

    def ranked(self, seq: tuple[int, ...]) -> torch.Tensor:
        """Vocabulary ranked by the target's logits after seq."""
        if seq not in self._ranked:
            logits, _ = self.model.prefill(torch.tensor([seq]), self.model.new_cache(len(seq)))
            self._ranked[seq] = logits[0, -1].argsort(descending=True)
        return self._ranked[seq]

    def start(self, prompt, hidden, max_nodes):
        outer = self

        class S:
            seq = prompt.tolist()

            def draft(self, root, params, generator, max_nodes=None):
                tree = outer.tree
                tokens = [root] + [0] * (tree.num_nodes - 1)
                for node in range(1, tree.num_nodes):
                    path = []
                    j = int(tree.parents[node])
                    while j > 0:
                        path.append(tokens[j])
                        j = int(tree.parents[j])
                    ranked = outer.ranked(tuple(self.seq + [root] + path[::-1]))
                    tokens[node] = int(ranked[outer.ORDER[int(tree.ranks[node])]])
                return Draft(tree, torch.tensor(tokens), Proposal.DETERMINISTIC)

            def advance(self, tokens, hidden):
                self.seq += tokens.tolist()

        return S()


def sample_counts(dec: SpecDecoder, prompt, params_kw, n_tok: int, trials: int) -> Counter:
    counts: Counter = Counter()
    for seed in range(trials):
        out = dec.generate(prompt, SamplingParams(max_tokens=n_tok, ignore_eos=True, seed=seed, **params_kw))
        counts[out.token_ids] += 1
    return counts


def chi2_stat(counts: Counter, exact: dict[tuple, float], trials: int) -> tuple[float, int]:
    """Pearson statistic over cells with expected count >= 5 (the rest pooled into one cell)."""
    stat, df, pool_e, pool_o = 0.0, 0, 0.0, 0
    for key, pr in exact.items():
        e = pr * trials
        if e >= 5:
            stat += (counts.get(key, 0) - e) ** 2 / e
            df += 1
        else:
            pool_e += e
            pool_o += counts.get(key, 0)
    unexpected = sum(c for k, c in counts.items() if k not in exact)
    pool_o += unexpected
    if pool_e >= 5:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    elif unexpected:
        stat = math.inf  # a sequence the target gives probability 0
    return stat, max(df - 1, 1)


def distribution_stat(dec: SpecDecoder, model: TargetModel, prompt, kw, n_tok: int = 3,
                      trials: int = 1500) -> tuple[float, int, Counter]:
    """`trials` seeded n_tok-token samples from `dec` against the target's exact joint law of that many tokens:
    (Pearson statistic, degrees of freedom, the samples' counts)."""
    exact = exact_joint(model, prompt, SamplingParams(**kw), n_tok)
    counts = sample_counts(dec, prompt, kw, n_tok, trials)
    stat, df = chi2_stat(counts, exact, trials)
    return stat, df, counts


SAMPLING_CASES = [
    dict(temperature=1.0, top_k=4),
    dict(temperature=0.7, top_k=6, top_p=0.9),
]


@pytest.mark.parametrize("kw", SAMPLING_CASES)
def test_sampled_first_tokens_match_target(ckpts, kw):
    model = TargetModel.from_pretrained(ckpts["llama3"])
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    dec = SpecDecoder(model, None, RankedDrafter(model, tree), tree.num_nodes)
    prompt = PROMPTS[1]
    stat, df, _ = distribution_stat(dec, model, prompt, kw)
    assert stat < chi2_threshold(df), (stat, df)


def lossy_verify(draft, logits, params, gen):
    """A lossy stand-in for runtime.decode.verify (accept any child the target gives >= 10%, as typical acceptance
    does), for the negative controls of the distribution tests."""
    tree, p_path, node = draft.tree, [0], 0
    toks: list[int] = []
    while True:
        p = target_probs(logits[node], params)
        nxt = next((c for c in tree.children(node) if p[draft.tokens[c]] >= 0.1), None)
        if nxt is None:
            toks.append(int(torch.multinomial(p, 1, generator=gen)))
            return Verdict(torch.tensor(p_path), torch.tensor(toks), not tree.children(node))
        p_path.append(nxt)
        toks.append(int(draft.tokens[nxt]))
        node = nxt


def test_sampled_distribution_test_catches_lossy_acceptance(ckpts, monkeypatch):
    """Negative control at the loop level: a lossy rule (accept any child the target gives >= 10%, as typical
    acceptance does) must fail the same statistic."""
    import runtime.decode as decode_mod

    monkeypatch.setattr(decode_mod, "verify", lossy_verify)
    model = TargetModel.from_pretrained(ckpts["llama3"])
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    dec = SpecDecoder(model, None, RankedDrafter(model, tree), tree.num_nodes)
    kw = SAMPLING_CASES[0]
    stat, df, _ = distribution_stat(dec, model, PROMPTS[1], kw)
    assert stat > chi2_threshold(df), (stat, df)


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=4), dict(temperature=0.7, top_k=5, top_p=0.95)],
                         ids=["T1.0", "T0.7"])
def test_sampled_distribution_with_reduced_draft_vocabulary(ckpts, tmp_path, kw):
    """A head that drafts from a reduced vocabulary (EAGLE-3 / FR-Spec d2t) leaves the output distribution exact.
    The vocabulary holds the target's 1st and 3rd choices after the prompt but not its 2nd and 4th, so both
    accepted in-vocabulary drafts and out-of-vocabulary target tokens (residual / bonus draws) occur."""
    from runtime.drafters.draft_vocab import DraftVocab
    from tests.heads import write_eagle_head

    model = TargetModel.from_pretrained(ckpts["llama3"])
    prompt = PROMPTS[1]
    logits, _ = model.prefill(torch.tensor([prompt]), model.new_cache(len(prompt)))
    ranked = logits[0, -1].argsort(descending=True).tolist()
    keep = sorted(set(ranked[::2][:20]) - set(ranked[1:4:2]))  # 1st, 3rd, 5th, ...: never the 2nd or 4th
    vocab = DraftVocab(torch.tensor(keep), model.config.vocab_size)
    head = write_eagle_head(tmp_path / "eagle", ckpts["llama3"], seed=3, state_hook=lambda st: {**st, **vocab.state()})
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    drafter = load_drafter(DraftSpec.create("eagle", path=head, tree=tree), model)
    assert drafter.head.vocab.target_ids.tolist() == keep
    dec = SpecDecoder(model, None, drafter, tree.num_nodes)
    stat, df, counts = distribution_stat(dec, model, prompt, kw)
    assert stat < chi2_threshold(df), (stat, df)
    # The draft really is confined to the vocabulary, and tokens outside it are still emitted (from the target).
    out = dec.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True, seed=0, **kw))
    assert out.stats.drafted_tokens > 0
    assert any(set(seq) - set(keep) for seq in counts)


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=4), dict(temperature=0.7, top_k=5, top_p=0.95)],
                         ids=["T1.0", "T0.7"])
def test_sampled_distribution_with_pruned_trees(ckpts, tmp_path, monkeypatch, kw):
    """Pruning by path probability (min_path_prob) with a reduced draft vocabulary, as the default configuration
    drafts: each step's tree is whatever part of the static tree the head finds likely (a function of the drafter's
    state, never of the target), and the output distribution stays exact. The steps' trees are recorded: both pruned
    and whole trees occur."""
    from runtime.drafters import eagle
    from runtime.drafters.draft_vocab import DraftVocab
    from tests.heads import write_eagle_head

    model = TargetModel.from_pretrained(ckpts["llama3"])
    prompt = PROMPTS[1]
    logits, _ = model.prefill(torch.tensor([prompt]), model.new_cache(len(prompt)))
    keep = sorted(logits[0, -1].argsort(descending=True)[:24].tolist())
    vocab = DraftVocab(torch.tensor(keep), model.config.vocab_size)
    head = write_eagle_head(tmp_path / "eagle", ckpts["llama3"], seed=3, state_hook=lambda st: {**st, **vocab.state()})
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    spec = DraftSpec.create("eagle", path=head, tree=tree, options={"min_path_prob": 0.1})
    drafter = load_drafter(spec, model)
    sizes: list[int] = []
    draft_static = eagle.EagleSession._draft_static

    def recording(self, *args, **kwargs):
        draft = draft_static(self, *args, **kwargs)
        sizes.append(draft.tree.num_nodes)
        return draft

    monkeypatch.setattr(eagle.EagleSession, "_draft_static", recording)
    dec = SpecDecoder(model, None, drafter, tree.num_nodes)
    stat, df, _ = distribution_stat(dec, model, prompt, kw)
    assert stat < chi2_threshold(df), (stat, df)
    assert min(sizes) < tree.num_nodes and max(sizes) > 1, (min(sizes), max(sizes))


def _echo_prompt(model: TargetModel) -> list[int]:
    """PROMPTS[1], the target's greedy continuation of it, then PROMPTS[1] again: what follows repeats what followed
    the first time often enough that prompt lookup proposes likely tokens."""
    base = PROMPTS[1]
    return base + greedy_reference(model, base, 6) + base


def _merged_lookup_spec(ckpt, tmp_path, model: TargetModel | None = None, scored: bool = False) -> DraftSpec:
    """A random EAGLE head's 6-node tree with up to 5 prompt-lookup nodes (two continuations) merged in; given the
    model, also up to 3 nodes from a datastore (runtime/drafters/datastore.py) of the target's greedy answers to
    the echo prompt and to its other prompts, matched from one token on, so that it proposes at most steps.
    scored: an EAGLE-2 dynamic tree of 6 nodes instead (scored nodes: lookup's compete with the head's for a
    budget, `SCORED_BUDGET`)."""
    from runtime.drafters.datastore import DATASTORE_FILE, Datastore
    from tests.heads import write_eagle_head

    head = write_eagle_head(tmp_path / "eagle", ckpt, seed=3)
    options = dict(num_draft_tokens=5, max_branches=2)
    if model is not None:
        answers = [greedy_reference(model, p, 8) for p in (_echo_prompt(model), *PROMPTS)]
        Datastore.from_answers(answers, min_ngram=1).save(head / DATASTORE_FILE)
        options.update(datastore_tokens=3, datastore_min_ngram=1, datastore_max_ngram=3, datastore_min_share=0.0)
    if scored:
        return DraftSpec.create("eagle", path=head, tree="dynamic",
                                options=dict(options, total_tokens=6, top_k=3, depth=2))
    return DraftSpec.create("eagle", path=head, tree=Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0]]),
                            options=options)


SCORED_BUDGET = 6  # nodes per step, root included, for the scored merge: the head's 6 and lookup's compete for it


@pytest.mark.parametrize("scored", [False, True], ids=["static", "scored"])
@pytest.mark.parametrize("datastore", [False, True], ids=["prompt", "datastore"])
@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=4), dict(temperature=0.7, top_k=5, top_p=0.95)],
                         ids=["T1.0", "T0.7"])
def test_sampled_distribution_with_merged_prompt_lookup(ckpts, tmp_path, kw, datastore, scored):
    """An EAGLE tree with prompt-lookup continuations merged in (runtime/drafters/merged.py), and with a datastore's
    continuation too, leaves the output distribution exact. The prompt echoes itself (`_echo_prompt`) and the
    datastore holds the target's answers, so the merged trees really are larger than the head's own (checked) and
    their lookup branches are accepted and rejected in turn. scored: an EAGLE-2 tree whose nodes compete with
    lookup's for a 6-node budget by score (some of the head's nodes give way to lookup's: checked)."""
    model = TargetModel.from_pretrained(ckpts["llama3"])
    prompt = _echo_prompt(model)
    spec = _merged_lookup_spec(ckpts["llama3"], tmp_path, model if datastore else None, scored)
    budget = SCORED_BUDGET if scored else spec.draft_nodes + 1
    drafter = load_drafter(spec, model)
    assert drafter.spec == dataclasses.replace(spec, path=None)
    hidden = model.prefill(torch.tensor([prompt]), model.new_cache(len(prompt)))[1][0]
    session = drafter.start(torch.tensor(prompt), hidden, budget)
    echoed = prompt[len(PROMPTS[1])]  # the token that followed PROMPTS[1] the first time
    merged = session.draft(echoed, None, None)
    if scored:
        own = session.primary.draft(echoed, None, None)
        assert merged.tree.num_nodes == own.tree.num_nodes == budget
        assert draft_paths(merged) - draft_paths(own) and draft_paths(own) - draft_paths(merged)
    else:
        assert merged.tree.num_nodes > spec.static_tree.num_nodes
    if datastore:  # the stored answer to the echo prompt begins with its greedy token: a chain of 3 from the root
        first = greedy_reference(model, prompt, 1)[0]
        assert len(session.lookup.stored_continuation(first)) == 3
    dec = SpecDecoder(model, None, drafter, budget)
    stat, df, _ = distribution_stat(dec, model, prompt, kw)
    assert stat < chi2_threshold(df), (stat, df)


@pytest.mark.parametrize("scored", [False, True], ids=["static", "scored"])
@pytest.mark.parametrize("datastore", [False, True], ids=["prompt", "datastore"])
def test_merged_lookup_distribution_test_catches_lossy_acceptance(ckpts, tmp_path, monkeypatch, datastore, scored):
    """Negative control: the same merged drafter and prompt under a lossy acceptance rule fail the statistic."""
    import runtime.decode as decode_mod

    monkeypatch.setattr(decode_mod, "verify", lossy_verify)
    model = TargetModel.from_pretrained(ckpts["llama3"])
    prompt = _echo_prompt(model)
    spec = _merged_lookup_spec(ckpts["llama3"], tmp_path, model if datastore else None, scored)
    dec = SpecDecoder(model, None, load_drafter(spec, model), SCORED_BUDGET if scored else spec.draft_nodes + 1)
    kw = dict(temperature=1.0, top_k=4)
    stat, df, _ = distribution_stat(dec, model, prompt, kw)
    assert stat > chi2_threshold(df), (stat, df)


def test_reduced_vocabulary_distribution_test_catches_a_restricted_target(ckpts, tmp_path, monkeypatch):
    """Negative control: verifying against the target's distribution renormalised over the draft vocabulary (the
    tempting shortcut that makes every residual draw an in-vocabulary token) must fail the same statistic."""
    import runtime.decode as decode_mod
    import runtime.verify as verify_mod
    from runtime.drafters.draft_vocab import DraftVocab
    from tests.heads import write_eagle_head

    model = TargetModel.from_pretrained(ckpts["llama3"])
    prompt = PROMPTS[1]
    logits, _ = model.prefill(torch.tensor([prompt]), model.new_cache(len(prompt)))
    ranked = logits[0, -1].argsort(descending=True).tolist()
    keep = sorted(set(ranked[::2][:20]) - set(ranked[1:4:2]))
    mask = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    mask[keep] = True

    def restricted(logits, params):
        p = target_probs(logits, params) * mask
        return p / p.sum() if float(p.sum()) > 0 else target_probs(logits, params)

    monkeypatch.setattr(verify_mod, "target_probs", restricted)
    monkeypatch.setattr(decode_mod, "target_probs", restricted)
    vocab = DraftVocab(torch.tensor(keep), model.config.vocab_size)
    head = write_eagle_head(tmp_path / "eagle", ckpts["llama3"], seed=3, state_hook=lambda st: {**st, **vocab.state()})
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    dec = SpecDecoder(model, None, load_drafter(DraftSpec.create("eagle", path=head, tree=tree), model),
                      tree.num_nodes)
    kw = dict(temperature=1.0, top_k=4)
    stat, df, _ = distribution_stat(dec, model, prompt, kw)
    assert stat > chi2_threshold(df), (stat, df)


def test_seeded_sampling_is_reproducible_and_drafter_independent_in_law(ckpts):
    dec = decoder(ckpts["qwen2"], "lookup")
    a = dec.generate(PROMPTS[0], max_tokens=16, temperature=0.9, seed=7)
    b = dec.generate(PROMPTS[0], max_tokens=16, temperature=0.9, seed=7)
    c = dec.generate(PROMPTS[0], max_tokens=16, temperature=0.9, seed=8)
    assert a.token_ids == b.token_ids
    assert a.stats.verification == "rejection_sampling/deterministic"
    assert len(c.token_ids) == 16


# ---- stop conditions, limits, streaming ------------------------------------------------------------------


def test_stream_deltas_concatenate_to_text(ckpts):
    dec = decoder(ckpts["llama2"], "lookup")
    tok = Tokenizer.from_dir(ckpts["llama2"])
    deltas = list(dec.stream("The quick brown fox", max_tokens=30, ignore_eos=True, temperature=0.8, seed=1))
    ids = [t for d in deltas for t in d.token_ids]
    assert "".join(d.text for d in deltas) == tok.decode(ids, skip_special_tokens=True)
    assert deltas[-1].finished and deltas[-1].stats is not None
    assert all(not d.finished for d in deltas[:-1])


def test_stops_on_eos_and_stop_token_ids(ckpts):
    dec = decoder(ckpts["llama2"])
    free = dec.generate(PROMPTS[0], max_tokens=20, ignore_eos=True)
    target = free.token_ids[5]
    out = dec.generate(PROMPTS[0], max_tokens=20, stop_token_ids=[target], ignore_eos=True)
    first = free.token_ids.index(target)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    # EOS: make it the token that would come 4th
    model = TargetModel.from_pretrained(ckpts["llama2"])
    eos_dec = SpecDecoder(model, None, load_drafter(DraftSpec("none"), model), 1)
    object.__setattr__(eos_dec, "eos_token_ids", frozenset({free.token_ids[3]}))
    out = eos_dec.generate(PROMPTS[0], max_tokens=20)
    stop_at = free.token_ids.index(free.token_ids[3])
    assert out.token_ids == free.token_ids[: stop_at + 1] and out.finish_reason == "stop"
    assert EOS_ID in dec.eos_token_ids


def test_stop_string_cuts_text_and_keeps_deltas_consistent(ckpts):
    dec = decoder(ckpts["llama2"], "lookup")
    free = dec.generate("Once upon a time", max_tokens=40, ignore_eos=True)
    assert len(free.text) > 12
    stop = free.text[8:11]
    deltas = list(dec.stream("Once upon a time", max_tokens=40, ignore_eos=True, stop=[stop]))
    text = "".join(d.text for d in deltas)
    assert text == free.text[: free.text.index(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_stop_checker_holds_back_partial_matches():
    sc = StopChecker(("STOP",))
    assert sc.feed("abcST") == ("abc", False)
    assert sc.feed("x") == ("STx", False)
    assert sc.feed("yS") == ("y", False)
    assert sc.feed("TOPzzz") == ("", True)
    assert sc.text == "abcSTxy"


def test_max_tokens_and_context_limit(ckpts, tmp_path):
    dec = decoder(ckpts["llama2"], "lookup")
    assert len(dec.generate(PROMPTS[0], max_tokens=7, ignore_eos=True).token_ids) == 7
    ctx = make_checkpoint(tmp_path / "short", "llama2", max_position_embeddings=24)
    short = runtime.load(ctx, draft="lookup")
    assert short.max_context == 24
    out = short.generate(list(range(3, 23)), max_tokens=50, ignore_eos=True)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    with pytest.raises(RequestError, match="context limit is 24"):
        short.generate(list(range(3, 27)), max_tokens=5)
    with pytest.raises(RequestError, match="at most 23"):
        short.generate(list(range(24)), max_tokens=5)


def test_bad_requests_name_the_problem(ckpts):
    dec = decoder(ckpts["llama2"])
    with pytest.raises(RequestError, match="empty"):
        dec.generate("", max_tokens=4)
    with pytest.raises(RequestError, match=r"token ids must be ints in \[0, "):
        dec.generate([1, 10**6], max_tokens=4)
    with pytest.raises(RequestError, match="temperature"):
        dec.generate("hi", temperature=-1.0)
    with pytest.raises(RequestError, match="unknown sampling setting"):
        dec.generate("hi", temprature=0.5)
    with pytest.raises(RequestError, match="max_tokens"):
        dec.stream("hi", max_tokens=0)


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=4), dict(temperature=0.7, top_k=5, top_p=0.95)],
                         ids=["T1.0", "T0.7"])
def test_sampled_distribution_with_trees_cut_by_verify_cost(ckpts, tmp_path, monkeypatch, kw):
    """Trees cut by a verify-cost curve (`PruneOptions.by_cost`, `runtime.tree.cost_budget`): each step verifies the
    node count the drafter's scores and the curve favour, a function of the drafter's state alone, and the output
    distribution stays exact. Each node costs 6% of a forward more: the random head's likelier steps keep a few nodes,
    its flatter ones the root and one; the steps' verified sizes are recorded, and both occur."""
    from tests.heads import write_eagle_head

    model = TargetModel.from_pretrained(ckpts["llama3"])
    head = write_eagle_head(tmp_path / "eagle", ckpts["llama3"], seed=3)
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    spec = DraftSpec.create("eagle", path=head, tree=tree, options={"min_path_prob": 0.0001, "by_cost": True})
    curve = tuple(1.0 + 0.06 * n for n in range(tree.num_nodes))
    dec = SpecDecoder(model, None, load_drafter(spec, model), tree.num_nodes, verify_cost=curve)
    sizes: list[int] = []
    prune = runtime.decode.prune_draft
    monkeypatch.setattr(runtime.decode, "prune_draft",
                        lambda draft, **k: (lambda d: sizes.append(d.tree.num_nodes) or d)(prune(draft, **k)))
    stat, df, _ = distribution_stat(dec, model, PROMPTS[1], kw)
    assert stat < chi2_threshold(df), (stat, df)
    assert min(sizes) < max(sizes) < tree.num_nodes and max(sizes) > 1, (min(sizes), max(sizes))


def test_greedy_output_with_trees_cut_by_verify_cost_is_plain_decodings(ckpts, tmp_path):
    from tests.heads import write_eagle_head

    model = TargetModel.from_pretrained(ckpts["llama3"])
    head = write_eagle_head(tmp_path / "eagle", ckpts["llama3"], seed=3)
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    spec = DraftSpec.create("eagle", path=head, tree=tree, options={"by_cost": True})
    for curve in [tuple(1.0 + 0.3 * n for n in range(8)), (1.0,) * 8]:
        dec = SpecDecoder(model, None, load_drafter(spec, model), tree.num_nodes, verify_cost=curve)
        for prompt in PROMPTS:
            assert list(dec.generate(prompt, max_tokens=20, ignore_eos=True).token_ids) == greedy_reference(model, prompt,
                                                                                                         20)
