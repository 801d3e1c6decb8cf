"""In-flight batching (runtime/batching.py): every request in a batch decodes exactly as it would alone.

Oracles: plain greedy decoding (`SpecDecoder` with the "none" drafter, itself checked against transformers in
test_decode.py) for greedy identity; the exact target distribution (test_decode's `exact_joint`) for sampled
output of a request decoded inside a batch, with a lossy negative control; the same request run alone for the
same-seed property. Memory: the scheduler's allocated KV bytes against the tokens produced.
"""

from __future__ import annotations

import gc
import random
import threading
import weakref
from collections import Counter

import pytest
import torch

import runtime
from runtime.batching import Scheduler, SchedulerConfig
from runtime.decode import SpecDecoder
from runtime.draft_spec import DraftSpec
from runtime.drafters import load_drafter
from runtime.errors import CacheError, ConfigError, OverloadedError, RequestError, SchedulerStopped
from runtime.kv_cache import KVCache
from runtime.model import Segment, TargetModel, causal_mask
from runtime.sampling import SamplingParams
from runtime.tree import Tree
from tests.test_decode import (
    PROMPTS,
    RankedDrafter,
    TeacherDrafter,
    chi2_stat,
    chi2_threshold,
    exact_joint,
    lossy_verify,
)
from tests.tiny import make_checkpoint
from tests.cpu_marks import needs_fast_bf16

# Different prompt lengths and token budgets, so requests join and leave at different steps.
MAX_TOKENS = [24, 9, 17, 30, 12]
WAIT = 60.0  # seconds any single wait may take before a test fails instead of hanging


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("batching") / "llama3", "llama3")


@pytest.fixture(scope="module")
def model(ckpt):
    return TargetModel.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def plain(model):
    return SpecDecoder(model, None, load_drafter(DraftSpec("none"), model), 1)


@pytest.fixture(scope="module")
def references(plain):
    return [plain.generate(p, max_tokens=n, ignore_eos=True).token_ids for p, n in zip(PROMPTS, MAX_TOKENS)]


@pytest.fixture(scope="module")
def heads(ckpt, tmp_path_factory):
    from runtime.config import ModelConfig
    from tests.heads import write_eagle_head, write_medusa_head

    root = tmp_path_factory.mktemp("batching-heads")
    cfg = ModelConfig.from_hf(ckpt)
    return {"medusa": write_medusa_head(root / "medusa", cfg.hidden_size, cfg.vocab_size, 4),
            "eagle": write_eagle_head(root / "eagle", ckpt)}


def run_all(sched: Scheduler, prompts, params) -> list:
    handles = [sched.submit(p, q) for p, q in zip(prompts, params)]
    return [h.result() for h in handles]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


# ---- the ragged forward and the growing cache ----------------------------------------------------------------


def _segment(model: TargetModel, prompt_len: int, tree: Tree, gen: torch.Generator) -> Segment:
    cache = model.new_cache(prompt_len + 64, capacity=4)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen)
    model.forward_segments([Segment(cache, prompt, torch.arange(prompt_len), causal_mask(prompt_len)[0])])
    cache.advance(prompt_len)
    tokens = torch.randint(0, model.config.vocab_size, (tree.num_nodes,), generator=gen)
    return Segment(cache, tokens, prompt_len + tree.depth, tree.packed_mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_forward_segments_equals_each_sequence_alone(ckpt, dtype):
    """Ragged trees (different node counts, prefix lengths, masks) in one forward give each sequence the logits,
    hidden states and K/V of its own batch-1 forward: bit for bit in bfloat16 (it runs batch-invariant on CPU,
    runtime/model.py), else up to the last bits of a matmul over a different row count (measured here: ~3e-6 on
    float32 logits of magnitude ~5; ~1e-15 in float64, where a one-row matmul takes another kernel)."""
    model = TargetModel.from_pretrained(ckpt).to(dtype)
    gen = torch.Generator().manual_seed(0)
    trees = [Tree.parse("chain-4"), Tree.parse("mc_sim_7b_63"), Tree.root_only(), Tree.parse("[[0], [1], [0, 0]]")]
    segments = [_segment(model, p, t, gen) for p, t in zip((20, 7, 33, 3), trees)]
    packed = model.forward_segments(segments)
    atol = {torch.float32: 1e-4, torch.float64: 1e-12, torch.bfloat16: 0.0}[dtype]
    for seg, (logits, hidden) in zip(segments, packed):
        k_packed = seg.cache.k[:, :, :, : seg.cache.length + seg.size].clone()
        # the same tokens alone, through the classic batched forward (B = 1)
        ref_logits, ref_hidden = model(seg.tokens[None], seg.positions[None], seg.cache, seg.tree_mask[None])
        torch.testing.assert_close(logits, ref_logits[0], rtol=0, atol=atol)
        torch.testing.assert_close(hidden, ref_hidden[0], rtol=0, atol=atol)
        torch.testing.assert_close(k_packed, seg.cache.k[:, :, :, : seg.cache.length + seg.size], rtol=0, atol=atol)
        assert seg.cache.length in (20, 7, 33, 3)  # nothing committed by the forward


def test_forward_segments_logits_rows_and_errors(model):
    gen = torch.Generator().manual_seed(1)
    a = _segment(model, 5, Tree.parse("chain-2"), gen)
    b = _segment(model, 9, Tree.parse("chain-3"), gen)
    full = model.forward_segments([a, b])
    cut = model.forward_segments([a, Segment(b.cache, b.tokens, b.positions, b.tree_mask, logits_from=3)])
    assert cut[1][0].shape == (1, model.config.vocab_size) and cut[1][1].shape == (4, model.config.hidden_size)
    torch.testing.assert_close(cut[1][0], full[1][0][3:], rtol=0, atol=1e-5)
    with pytest.raises(RequestError, match="at least one segment"):
        model.forward_segments([])
    with pytest.raises(RequestError, match="logits_from"):
        model.forward_segments([Segment(a.cache, a.tokens, a.positions, a.tree_mask, logits_from=4)])
    with pytest.raises(RequestError, match="tokens \\[N\\]"):
        model.forward_segments([Segment(a.cache, a.tokens[None], a.positions, a.tree_mask)])


def test_kv_cache_grows_geometrically_keeping_contents():
    cache = KVCache(2, 1, 2, max_len=40, capacity=3)
    assert cache.capacity == 3 and cache.nbytes == 2 * 2 * 3 * 2 * 4
    assert KVCache.bytes_for(2, 1, 2, 40, torch.float32) == 2 * 2 * 40 * 2 * 4
    vals = torch.arange(5.0)[None, None, :, None].expand(1, 1, 5, 2)
    for layer in range(2):
        cache.write(layer, vals + layer, -vals)
    assert cache.capacity == 6  # max(5, 2 x 3)
    cache.advance(5)
    cache.reserve(13)
    assert cache.capacity == 13  # max(13, 2 x 6)
    assert cache.k[1, 0, 0, :5, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert cache.v[0, 0, 0, :5, 1].tolist() == [0.0, -1.0, -2.0, -3.0, -4.0]
    cache.reserve(27)
    assert cache.capacity == 27
    cache.reserve(30)
    assert cache.capacity == 40  # capped at max_len
    with pytest.raises(CacheError, match="exceeds max_len 40"):
        cache.reserve(41)
    with pytest.raises(CacheError, match="capacity"):
        KVCache(1, 1, 2, max_len=4, capacity=5)


# ---- greedy identity -------------------------------------------------------------------------------------------


DRAFTERS = [
    ("none", None, {}),
    ("lookup", None, {}),
    ("medusa", "mc_sim_7b_63", {}),
    ("eagle", None, {"total_tokens": 12, "depth": 3, "top_k": 4}),  # EAGLE-2 dynamic trees: ragged by nature
    ("eagle", "[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]", {}),
    # int8 head, prompt lookup merged into its trees (per-request tree sizes vary step by step)
    ("eagle", "[[0], [1], [0, 0]]", {"num_draft_tokens": 4, "max_branches": 2, "draft_quantization": "int8"}),
    # as the default configuration drafts: pruned by path probability (each request's tree shrinks step by step)
    ("eagle", "[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]",
     {"num_draft_tokens": 4, "max_branches": 2, "draft_quantization": "int8", "min_path_prob": 0.1}),
    # EAGLE-2's scored nodes and prompt lookup's competing for each request's node budget (the scored merge)
    ("eagle", None, {"total_tokens": 8, "depth": 3, "top_k": 4, "num_draft_tokens": 4, "max_branches": 2,
                     "max_draft_len": 7}),
]


@pytest.mark.parametrize("kind,tree,opts", DRAFTERS,
                         ids=["none", "lookup", "medusa", "eagle2", "eagle-static", "eagle-int8-merged-lookup",
                              "eagle-pruned", "eagle2-scored-lookup"])
def test_greedy_batch_equals_plain_decoding(ckpt, heads, references, kind, tree, opts):
    """Five requests with different prompt lengths and budgets through a batch of 3: requests join as others
    leave, and every output equals its plain greedy decoding."""
    path = heads.get(kind)
    dec = runtime.load(ckpt, draft=kind, draft_model=path, tree=tree, **opts)
    with Scheduler(dec, SchedulerConfig(max_concurrent_requests=3)) as sched:
        results = run_all(sched, PROMPTS, [greedy(n) for n in MAX_TOKENS])
        stats = sched.stats()
    assert [r.token_ids for r in results] == references
    assert all(r.finish_reason == "length" for r in results)
    assert stats.finished == 5 and stats.failed == 0 and stats.kv_bytes == 0 and stats.kv_reserved_bytes == 0
    assert 2.0 < stats.mean_batch <= 3.0  # batched, never beyond max_concurrent_requests
    if kind != "none":
        assert sum(r.stats.drafted_tokens for r in results) > 0


@pytest.mark.parametrize("tree", ["chain-4", "mc_sim_7b_63"])
def test_greedy_batch_with_high_acceptance_and_staggered_joins(model, references, tree):
    """A drafter that is mostly right (multi-token acceptance and cache compaction in every request of the batch);
    requests join while others are mid-flight, prompts prefilled in chunks of 3 tokens."""
    t = Tree.parse(tree)
    dec = SpecDecoder(model, None, TeacherDrafter(model, t, seed=0), max_tree_nodes=t.num_nodes)
    with Scheduler(dec, SchedulerConfig(max_concurrent_requests=4, prefill_chunk=3)) as sched:
        first = [sched.submit(p, greedy(n)) for p, n in zip(PROMPTS[:2], MAX_TOKENS[:2])]
        head = next(first[0])  # request 0 is decoding ...
        rest = [sched.submit(p, greedy(n)) for p, n in zip(PROMPTS[2:], MAX_TOKENS[2:])]  # ... when these join
        results = [h.result() for h in first + rest]
    assert [head.token_ids + results[0].token_ids] + [r.token_ids for r in results[1:]] == references
    for r, p in zip(results, PROMPTS):
        assert r.stats.target_forwards == r.stats.steps + -(-len(p) // 3)  # one forward per prompt chunk
    assert sum(sum(r.stats.accepted_per_step) for r in results) > 0.5 * sum(r.stats.steps for r in results)


# ---- the tree budget: speculation shrinks as the batch grows ------------------------------------------------------


def record_steps(monkeypatch, dec: SpecDecoder) -> list[list[tuple[bool, int | None, int]]]:
    """Per target forward of dec's scheduler: (decoding, max_nodes asked, segment size) of each request's segment."""
    import runtime.decode as decode_mod

    steps: list[list[tuple[bool, int | None, int]]] = [[]]
    next_segment = decode_mod.RequestState.next_segment

    def recording_next_segment(self, max_nodes=None):
        segment = next_segment(self, max_nodes)
        steps[-1].append((self.decoding, max_nodes, segment.size))
        return segment

    forward = dec.model.forward_segments

    def recording_forward(segments, check=True):
        steps.append([])
        return forward(segments, check=check)

    monkeypatch.setattr(decode_mod.RequestState, "next_segment", recording_next_segment)
    monkeypatch.setattr(dec.model, "forward_segments", recording_forward)
    return steps


@pytest.mark.parametrize("kind,tree,opts", DRAFTERS[2:],
                         ids=["medusa", "eagle2", "eagle-static", "eagle-int8-merged-lookup", "eagle-pruned",
                              "eagle2-scored-lookup"])
def test_tree_budget_splits_over_the_batch_and_keeps_greedy_output(ckpt, heads, references, monkeypatch, kind,
                                                                    tree, opts):
    """A budget of 5 nodes per step over a batch of up to 3: shares of 1 (plain steps, no drafting), 2 and 5 as
    requests join and leave; every output is still plain greedy decoding's."""
    dec = runtime.load(ckpt, draft=kind, draft_model=heads.get(kind), tree=tree, **opts)
    steps = record_steps(monkeypatch, dec)
    with Scheduler(dec, SchedulerConfig(max_concurrent_requests=3, tree_budget=5)) as sched:
        results = run_all(sched, PROMPTS, [greedy(n) for n in MAX_TOKENS])
    assert [r.token_ids for r in results] == references
    shares = Counter()
    for step in steps:
        decoding = [(cap, size) for is_decoding, cap, size in step if is_decoding]
        for cap, size in decoding:
            assert cap == max(1, 5 // len(decoding)) and size <= cap
        shares.update(cap for cap, _ in decoding)
        assert sum(size for _, size in decoding) <= max(5, len(decoding))
    assert {1, 2, 5} <= set(shares)  # every share happened
    drafted = sum(r.stats.drafted_tokens for r in results)
    assert drafted > 0
    with Scheduler(dec, SchedulerConfig(max_concurrent_requests=3)) as sched:  # no budget: whole trees, more drafted
        assert sum(r.stats.drafted_tokens for r in run_all(sched, PROMPTS, [greedy(n) for n in MAX_TOKENS])) > drafted


@needs_fast_bf16
def test_tree_budget_leaves_seeded_sampled_requests_whole(ckpt, monkeypatch):
    """Seeded sampled requests keep their trees under any budget (their draws follow the tree, and a seed must give
    the same output whatever the batch); greedy and unseeded ones in the same batch are pruned."""
    dec = runtime.load(ckpt, draft="lookup", dtype="bfloat16")
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, top_k=20, seed=10 + i)
              for i, n in enumerate(MAX_TOKENS)]
    alone = [dec.generate(p, q).token_ids for p, q in zip(PROMPTS, params)]
    steps = record_steps(monkeypatch, dec)
    others = [greedy(20), SamplingParams(max_tokens=20, temperature=1.2, ignore_eos=True)]
    with Scheduler(dec, SchedulerConfig(max_concurrent_requests=4, tree_budget=2)) as sched:
        mixed = run_all(sched, [PROMPTS[1], PROMPTS[4]] + PROMPTS, others + params)
    assert [r.token_ids for r in mixed[2:]] == alone
    caps = Counter(cap for step in steps for decoding, cap, _ in step if decoding)
    assert caps[None] > 0 and caps[1] > 0  # seeded sampled: no cap; the other two: pruned (shares of 2 // 3-4)


# ---- same seed, same output, whatever else is in the batch ------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", pytest.param("bfloat16", marks=needs_fast_bf16)])
def test_same_seed_same_output_alone_or_in_any_batch(ckpt, dtype):
    """Sampled requests (lookup drafter; a float64 target, where rounding cannot move a sampling threshold, or a
    bfloat16 one, batch-invariant on CPU) give the same tokens alone, together, and among other requests in a
    different order and batch size."""
    model = TargetModel.from_pretrained(ckpt).to(torch.float64) if dtype == "float64" else \
        TargetModel.from_pretrained(ckpt, dtype=dtype)
    dec = SpecDecoder(model, None, load_drafter(DraftSpec("lookup"), model), 16)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, top_k=20, seed=10 + i)
              for i, n in enumerate(MAX_TOKENS)]
    alone = [dec.generate(p, q).token_ids for p, q in zip(PROMPTS, params)]
    with Scheduler(dec, SchedulerConfig(max_concurrent_requests=5)) as sched:
        together = [r.token_ids for r in run_all(sched, PROMPTS, params)]
    noise = [SamplingParams(max_tokens=20, temperature=1.2, seed=99 + i, ignore_eos=True) for i in range(3)]
    order = [4, 2, 0, 3, 1]
    with Scheduler(dec, SchedulerConfig(max_concurrent_requests=3)) as sched:
        mixed = run_all(sched, [PROMPTS[1], PROMPTS[4], PROMPTS[0]] + [PROMPTS[i] for i in order],
                        noise + [params[i] for i in order])
    shuffled = {i: r.token_ids for i, r in zip(order, mixed[3:])}
    assert together == alone
    assert [shuffled[i] for i in range(5)] == alone
    assert len({t for t in alone}) == 5  # the seeds do produce different outputs


# ---- sampled output of a request inside a batch is distributed as the target -----------------------------------


TRIALS = 1500
KW = dict(temperature=1.0, top_k=4)


def batch_sample_counts(dec: SpecDecoder, prompt, trials: int) -> Counter:
    """Each trial is one request (seed = trial) decoded inside a batch of 6 with other trials and with noise
    requests on other prompts (different lengths, trees, sampling settings)."""
    counts: Counter = Counter()
    with Scheduler(dec, SchedulerConfig(max_concurrent_requests=6, max_queue_size=trials * 2)) as sched:
        handles = []
        for seed in range(trials):
            handles.append(sched.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True, seed=seed, **KW)))
            if seed % 10 == 0:
                other = PROMPTS[(0, 2, 3, 4)[(seed // 10) % 4]]
                sched.submit(other, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.7, seed=seed))
        for h in handles:
            counts[h.result().token_ids] += 1
        assert sched.stats().mean_batch > 4
    return counts


def test_sampled_request_in_a_batch_matches_target(model):
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    dec = SpecDecoder(model, None, RankedDrafter(model, tree), tree.num_nodes)
    exact = exact_joint(model, PROMPTS[1], SamplingParams(**KW), 3)
    counts = batch_sample_counts(dec, PROMPTS[1], TRIALS)
    stat, df = chi2_stat(counts, exact, TRIALS)
    assert stat < chi2_threshold(df), (stat, df)


def test_batch_distribution_test_catches_lossy_acceptance(model, monkeypatch):
    """Negative control: the same statistic, inside the batch, rejects a lossy acceptance rule (accept any child
    the target gives >= 10%)."""
    import runtime.decode as decode_mod

    monkeypatch.setattr(decode_mod, "verify", lossy_verify)
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    dec = SpecDecoder(model, None, RankedDrafter(model, tree), tree.num_nodes)
    exact = exact_joint(model, PROMPTS[1], SamplingParams(**KW), 3)
    counts = batch_sample_counts(dec, PROMPTS[1], TRIALS)
    stat, df = chi2_stat(counts, exact, TRIALS)
    assert stat > chi2_threshold(df), (stat, df)


# ---- memory ------------------------------------------------------------------------------------------------------


def test_kv_memory_grows_with_tokens_and_returns_to_zero(plain, model):
    """Seen from the delta callback (the scheduler's thread, right after each step): allocated bytes grow with the
    tokens produced, stay within the reservation and within twice what the sequence holds (geometric growth), and
    are zero once the request has finished."""
    seen = []
    prompt = PROMPTS[2]
    with Scheduler(plain, SchedulerConfig(max_concurrent_requests=2)) as sched:
        assert sched.stats().kv_bytes == 0

        def watch(handle, delta):
            seen.append((len(delta.token_ids), delta.finished, sched.stats()))

        handle = sched.submit(prompt, greedy(300), on_delta=watch)
        assert handle.wait(WAIT)
    per_token = model.cache_bytes(1)
    reserved = handle.kv_reserved_bytes
    assert reserved == model.cache_bytes(len(prompt) + 300 + 1)
    produced, sizes = 0, []
    for n, finished, stats in seen:
        produced += n
        if finished:
            assert stats.kv_bytes == 0 and stats.kv_reserved_bytes == 0 and stats.active == 0
            continue
        # committed: the prompt and every produced token but the last (the next root)
        assert stats.kv_bytes <= 2 * (len(prompt) + produced) * per_token
        assert stats.kv_reserved_bytes == reserved
        sizes.append(stats.kv_bytes)
    assert produced == 300 and seen[-1][1]
    assert sizes == sorted(sizes) and max(sizes) <= reserved
    assert len(set(sizes)) >= 4, sorted(set(sizes))
    assert sizes[0] < reserved / 10


def test_cancel_frees_memory_at_the_next_step_and_others_continue(plain, references):
    with Scheduler(plain, SchedulerConfig(max_concurrent_requests=4)) as sched:
        long = sched.submit(PROMPTS[0], greedy(400))
        others = [sched.submit(p, greedy(n)) for p, n in zip(PROMPTS[1:], MAX_TOKENS[1:])]
        for _ in range(3):
            next(long)
        with sched._cond:  # white-box: a weak reference to the running request's cache
            state_cache = weakref.ref(next(r for r in sched._active if r.handle is long).state.cache)
        long.cancel()
        deltas = list(long)
        results = [h.result() for h in others]
        stats = sched.stats()
    assert deltas[-1].finish_reason == "cancelled" and deltas[-1].stats is not None
    assert deltas[-1].stats.generated_tokens < 400
    assert [r.token_ids for r in results] == references[1:]
    assert stats.cancelled == 1 and stats.kv_bytes == 0 and stats.kv_reserved_bytes == 0
    gc.collect()
    assert state_cache() is None  # the cancelled request's cache is gone, not merely unaccounted


def test_cancel_while_waiting_and_close_of_a_handle(plain):
    gate = threading.Event()
    with Scheduler(plain, SchedulerConfig(max_concurrent_requests=1)) as sched:
        blocker = sched.submit(PROMPTS[0], greedy(5), on_delta=lambda h, d: gate.wait(WAIT))
        queued = sched.submit(PROMPTS[1], greedy(50))
        queued.cancel()
        closed = sched.submit(PROMPTS[2], greedy(50))
        closed.close()  # like closing SpecDecoder.stream's iterator
        gate.set()
        assert blocker.wait(WAIT) and queued.wait(WAIT) and closed.wait(WAIT)
        last = list(queued)[-1]
        assert last.finish_reason == "cancelled" and last.stats.generated_tokens == 0
        assert sched.stats().cancelled == 2


# ---- admission control and the queue -----------------------------------------------------------------------------


def test_admission_waits_for_memory_and_refuses_what_never_fits(plain, model, references):
    prompt = PROMPTS[4]
    per_request = model.cache_bytes(len(prompt) + 30 + 1)
    budget = 2 * per_request + per_request // 2  # room for two worst cases at a time
    active_seen = []
    with Scheduler(plain, SchedulerConfig(max_concurrent_requests=8, kv_budget_bytes=budget)) as sched:
        def watch(handle, delta):
            s = sched.stats()
            active_seen.append((s.active, s.kv_reserved_bytes, s.kv_bytes))

        handles = [sched.submit(prompt, greedy(30), on_delta=watch) for _ in range(5)]
        for h in handles:
            assert h.wait(WAIT)
        with pytest.raises(RequestError, match=r"kv_budget_bytes .*max_tokens may be at most (\d+)") as info:
            sched.submit(PROMPTS[0], greedy(10_000))
        most = int(info.value.args[0].rsplit(" ", 1)[1])
        assert sched.generate(PROMPTS[0], greedy(most)).finish_reason == "length"
        with pytest.raises(RequestError, match="kv_budget_bytes"):
            sched.submit(PROMPTS[0], greedy(most + 1))
    assert max(a for a, _, _ in active_seen) == 2
    assert all(r <= budget and b <= r for _, r, b in active_seen)
    assert [h.finish_reason for h in handles] == ["length"] * 5


def test_queue_full_is_a_distinct_overload_error(plain):
    gate = threading.Event()
    with Scheduler(plain, SchedulerConfig(max_concurrent_requests=1, max_queue_size=1)) as sched:
        first = sched.submit(PROMPTS[0], greedy(3), on_delta=lambda h, d: gate.wait(WAIT))
        second = sched.submit(PROMPTS[1], greedy(3))
        with pytest.raises(OverloadedError, match="max_concurrent_requests 1 \\+ max_queue_size 1"):
            sched.submit(PROMPTS[2], greedy(3))
        gate.set()
        assert first.wait(WAIT) and second.result().finish_reason == "length"
        assert sched.stats().rejected == 1
        assert sched.generate(PROMPTS[2], greedy(3)).finish_reason == "length"  # capacity is back


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"scheduler.max_concurrent_requests: got 0, expected an integer >= 1"):
        SchedulerConfig(max_concurrent_requests=0)
    with pytest.raises(ConfigError, match=r"scheduler.max_queue_size: got -1, expected an integer >= 0"):
        SchedulerConfig(max_queue_size=-1)
    with pytest.raises(ConfigError, match=r"scheduler.kv_budget_bytes: got 1.5, expected an integer"):
        SchedulerConfig(kv_budget_bytes=1.5)
    with pytest.raises(ConfigError, match=r"scheduler.tree_budget: got 0, expected an integer >= 1"):
        SchedulerConfig(tree_budget=0)


# ---- errors, health, shutdown, threads ---------------------------------------------------------------------------


class _FailingDrafter:
    """The "none" drafter, except that a request whose prompt starts with token 17 fails at its third draft."""

    name = "none"

    def __init__(self, model):
        self.inner = load_drafter(DraftSpec("none"), model)

    def start(self, prompt, hidden, max_nodes):
        session = self.inner.start(prompt, hidden, max_nodes)
        if int(prompt[0]) != 17:
            return session
        calls = [0]

        class Failing:
            def draft(self, root, params, generator, max_nodes=None):
                calls[0] += 1
                if calls[0] == 3:
                    raise ValueError("drafter exploded")
                return session.draft(root, params, generator, max_nodes)

            def advance(self, tokens, hidden):
                session.advance(tokens, hidden)

        return Failing()


def test_one_request_failing_does_not_stop_the_others(model, references):
    dec = SpecDecoder(model, None, _FailingDrafter(model), 1)
    bad_callback_calls = []

    def bad_callback(handle, delta):
        bad_callback_calls.append(delta)
        if len(bad_callback_calls) == 2:
            raise KeyError("client went away")

    with Scheduler(dec, SchedulerConfig(max_concurrent_requests=8)) as sched:
        good = [sched.submit(p, greedy(n)) for p, n in zip(PROMPTS, MAX_TOKENS)]
        bad = sched.submit([17, 5, 6], greedy(20))
        callback = sched.submit(PROMPTS[0], greedy(20), on_delta=bad_callback)
        with pytest.raises(ValueError, match="drafter exploded"):
            bad.result()
        assert [h.result().token_ids for h in good] == references
        assert callback.wait(WAIT) and isinstance(callback.error, KeyError)
        with pytest.raises(RuntimeError, match="on_delta callback"):
            next(callback)
        assert isinstance(bad_callback_calls[-1], KeyError)  # the callback is told how its request ended
        stats = sched.stats()
        assert stats.failed == 2 and stats.healthy and sched.error is None
        assert sched.generate(PROMPTS[1], greedy(4)).token_ids == references[1][:4]


def test_a_failing_forward_stops_the_scheduler_and_is_reported(plain, monkeypatch):
    calls = [0]
    original = plain.model.forward_segments
    all_submitted = threading.Event()

    def flaky(segments, check=True):
        calls[0] += 1
        if calls[0] == 4:
            all_submitted.wait(WAIT)  # fail only once every request is in (else a late submit races the failure)
            raise RuntimeError("device lost")
        return original(segments, check)

    monkeypatch.setattr(plain.model, "forward_segments", flaky)
    sched = Scheduler(plain, SchedulerConfig(max_concurrent_requests=2))
    handles = [sched.submit(p, greedy(50)) for p in PROMPTS]
    all_submitted.set()
    for h in handles:
        assert h.wait(WAIT)  # streams end, they do not hang
        with pytest.raises(SchedulerStopped, match="device lost") as info:
            h.result()
        assert isinstance(info.value.__cause__, RuntimeError)
    assert not sched.healthy and isinstance(sched.error, RuntimeError)
    assert sched.stats().failed == 5 and sched.stats().kv_bytes == 0
    with pytest.raises(SchedulerStopped, match="device lost"):
        sched.check()
    with pytest.raises(SchedulerStopped):
        sched.submit(PROMPTS[0], greedy(3))
    assert sched.close(WAIT)


def test_close_ends_requests_in_flight_and_refuses_new_ones(plain):
    sched = Scheduler(plain, SchedulerConfig(max_concurrent_requests=1))
    running = sched.submit(PROMPTS[0], greedy(400))
    waiting = sched.submit(PROMPTS[1], greedy(400))
    next(running)
    assert sched.close(WAIT) and not sched.healthy and sched.error is None
    for h in (running, waiting):
        with pytest.raises(SchedulerStopped, match="shut down"):
            list(h)
    with pytest.raises(SchedulerStopped, match="shut down"):
        sched.submit(PROMPTS[0], greedy(3))
    assert sched.stats().kv_bytes == 0


def test_bad_requests_are_refused_at_submit(plain):
    with Scheduler(plain) as sched:
        with pytest.raises(RequestError, match=r"token ids must be ints in \[0, "):
            sched.submit([1, 10**6], greedy(4))
        with pytest.raises(RequestError, match="unknown sampling setting"):
            sched.submit([1, 2], temprature=0.5)
        assert sched.stats().waiting == 0 and sched.healthy


def test_submits_from_many_threads(plain, references):
    results = {}

    def client(i):
        for j, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            if (i + j) % 2 == 0:
                results[i, j] = plain_sched.generate(p, greedy(n)).token_ids

    with Scheduler(plain, SchedulerConfig(max_concurrent_requests=6)) as plain_sched:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
    assert len(results) == 15
    assert all(ids == references[j] for (_, j), ids in results.items())


def test_concurrent_submits_and_cancels_leave_nothing_behind(plain):
    """Four client threads submit 40 requests (random prompts and budgets) and cancel about a third of them after a
    few deltas; every finished one equals plain greedy decoding, every cancelled one a prefix of it, and the
    scheduler ends empty."""
    full = {i: plain.generate(p, max_tokens=40, ignore_eos=True).token_ids for i, p in enumerate(PROMPTS)}
    outcomes = []
    lock = threading.Lock()

    def client(seed):
        rng = random.Random(seed)
        for _ in range(10):
            i, n = rng.randrange(len(PROMPTS)), rng.randrange(5, 41)
            handle = sched.submit(PROMPTS[i], greedy(n))
            cut = rng.randrange(1, 4) if rng.random() < 0.35 else None
            ids, last = [], None
            for k, delta in enumerate(handle):
                ids.extend(delta.token_ids)
                last = delta
                if cut is not None and k + 1 == cut:
                    handle.cancel()
            with lock:
                outcomes.append((i, n, tuple(ids), last.finish_reason))

    with Scheduler(plain, SchedulerConfig(max_concurrent_requests=5, max_queue_size=40)) as sched:
        threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        stats = sched.stats()
    assert len(outcomes) == 40
    reasons = Counter(r for *_, r in outcomes)
    assert reasons["cancelled"] + reasons["length"] == 40 and reasons["cancelled"] == stats.cancelled > 0
    for i, n, ids, reason in outcomes:
        if reason == "length":
            assert ids == full[i][:n]
        else:
            assert ids == full[i][: len(ids)] and len(ids) < n
    assert stats.active == stats.waiting == stats.kv_bytes == stats.kv_reserved_bytes == 0
    assert stats.finished + stats.cancelled == 40 and stats.failed == 0 and stats.healthy


def test_serving_defaults_have_one_source():
    """The render options and deploy's config take their scheduler defaults from SchedulerConfig; max_batch_size is
    Triton's batch dimension there, not the scheduler's concurrency."""
    from deploy.k8s import DeployConfig
    from model_repo.render import RepoOptions

    defaults, options = SchedulerConfig(), RepoOptions(engine="e", output="o")
    for name in ("max_concurrent_requests", "max_queue_size", "prefill_chunk", "tree_budget"):
        assert getattr(options, name) == getattr(defaults, name), name
    assert DeployConfig().max_concurrent_requests == defaults.max_concurrent_requests
    assert not hasattr(defaults, "max_batch_size")
