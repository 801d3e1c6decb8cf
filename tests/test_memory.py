"""Memory of a long-running in-flight batching scheduler (runtime/batching.py, "Host memory"): requests leave
nothing behind, and the free pages of the C heap go back to the OS instead of staying resident.

The serving soak (perf/soak.py) showed resident memory growing under in-flight batching with no live object
left behind: glibc kept the freed per-step blocks resident inside its heaps (malloc_trim took it back). These
tests check both halves without timing anything: per-request objects and tensors return to their count before the
requests, and a heap made of freed holes between live blocks (the shape that stays resident) is released when the
scheduler's batch empties.
"""

from __future__ import annotations

import ctypes
import gc
import random
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import plugins.tree_attention.cpu as attention_cpu
import runtime
import runtime.model
from model_repo.generations import Generations
from model_repo.request import RequestLimits, parse_generate_request
from runtime.batching import RequestHandle, Scheduler, SchedulerConfig, _malloc_trim
from runtime.decode import RequestState
from runtime.drafters.eagle import EagleSession
from runtime.drafters.lookup import LookupSession
from runtime.drafters.medusa import MedusaSession
from runtime.drafters.none import NoneSession
from runtime.kv_cache import KVCache
from runtime.sampling import SamplingParams
from tests.test_decode import PROMPTS
from tests.tiny import make_checkpoint, vocab_size

WAIT = 60.0  # seconds any single wait may take before a test fails instead of hanging
# What one request owns while it runs; none of it may outlive the request.
PER_REQUEST = (RequestState, KVCache, EagleSession, MedusaSession, LookupSession, NoneSession, RequestHandle,
               torch.Generator)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("memory") / "llama3", "llama3")


@pytest.fixture(scope="module")
def eagle(ckpt, tmp_path_factory):
    from tests.heads import write_eagle_head

    head = write_eagle_head(tmp_path_factory.mktemp("memory-heads") / "eagle", ckpt)
    tree = "[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"
    return runtime.load(ckpt, draft="eagle", draft_model=head, tree=tree)


def live_objects() -> Counter:
    """Live per-request objects by type, and live tensors, after a full collection. The tree-attention op's mask
    memo and the causal-mask cache are bounded per-shape caches (64 entries each): emptied first, so that what is
    counted is only what requests left behind."""
    attention_cpu._visible = {}
    runtime.model._packed_tril.cache_clear()
    gc.collect()
    counts: Counter = Counter()
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, which some deprecated torch objects warn about
        if issubclass(kind, PER_REQUEST):
            counts[kind.__name__] += 1
        elif issubclass(kind, torch.Tensor):
            counts["tensor"] += 1
    return counts


def settles_to(expected: Counter, what=lambda counts: counts) -> Counter:
    """live_objects() once what(it) equals what(expected), or after WAIT seconds: a request's final delta or
    response reaches its client while the scheduler's thread may still be finishing that step (holding the
    request)."""
    deadline = time.monotonic() + WAIT
    while what(now := live_objects()) != what(expected) and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def requests_only(counts: Counter) -> Counter:
    return Counter({k: v for k, v in counts.items() if k != "tensor"})


def soak_round(sched: Scheduler, rng: random.Random, n: int = 12) -> Counter:
    """n requests of mixed prompts and budgets, greedy and seeded sampling, about a quarter cancelled after their
    first delta; returns how they ended."""
    ended: Counter = Counter()
    handles = []
    for k in range(n):
        sampling = {} if k % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1000)}
        params = SamplingParams(max_tokens=rng.randrange(4, 30), ignore_eos=True, **sampling)
        handles.append((sched.submit(rng.choice(PROMPTS), params), rng.random() < 0.25))
    for handle, cancel in handles:
        last = None
        for last in handle:
            if cancel:
                handle.cancel()
        ended[last.finish_reason] += 1
    return ended


def test_requests_leave_no_objects_or_tensors_behind(eagle):
    """Rounds of concurrent, ragged, greedy and sampled, finished and cancelled requests on an EAGLE drafter: after
    each round the scheduler is empty and every per-request object (state, KV caches, drafter session, generator,
    handle) and every tensor is gone again: nothing grows with the number of requests served."""
    rng = random.Random(0)
    with Scheduler(eagle, SchedulerConfig(max_concurrent_requests=5, max_queue_size=20)) as sched:
        before = live_objects()
        soak_round(sched, rng)  # first use: anything created once per process (tensors) exists from here on
        baseline = settles_to(before, requests_only)
        ended: Counter = Counter()
        for _ in range(4):
            ended += soak_round(sched, rng)
            assert settles_to(baseline) == baseline
        stats = sched.stats()
    assert ended["cancelled"] > 0 and ended["length"] > 0
    assert stats.active == stats.waiting == stats.kv_bytes == stats.kv_reserved_bytes == 0
    assert stats.failed == 0 and stats.finished + stats.cancelled == 5 * 12


class _Sink:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def send(self, outputs, final):
        if final:
            self.done.set()

    def fail(self, exc):
        self.error = exc
        self.done.set()

    def is_cancelled(self):
        return False


def test_served_requests_leave_nothing_behind(eagle):
    """The same through spec_decode's `Generations` (responses built and sent on the scheduler's thread): its
    table of live requests empties and no per-request object or tensor stays."""
    limits = RequestLimits(max_tokens=64, vocab_size=vocab_size())
    rng = random.Random(1)

    def serve(gens: Generations, n: int) -> None:
        sinks = []
        for k in range(n):
            inputs = {"input_ids": np.array(rng.choice(PROMPTS), dtype=np.int32),
                      "max_tokens": np.array([rng.randrange(4, 30)], dtype=np.int32), "stream": np.array([k % 3 > 0])}
            if k % 2:
                inputs.update(temperature=np.array([0.8], np.float32), random_seed=np.array([k], np.uint64))
            request = parse_generate_request(inputs, limits)
            sink = _Sink()
            gens.submit(request, [int(t) for t in inputs["input_ids"]], sink)
            sinks.append(sink)
        for sink in sinks:
            assert sink.done.wait(WAIT) and sink.error is None

    config = SchedulerConfig(max_concurrent_requests=4, max_queue_size=20, kv_budget_bytes=2**30)
    with Generations(eagle, config) as gens:
        before = live_objects()
        serve(gens, 8)
        baseline = settles_to(before, requests_only)
        for _ in range(3):
            serve(gens, 8)
            assert settles_to(baseline) == baseline
            assert not gens._live


# ---- the C heap ------------------------------------------------------------------------------------------------

HOLE = 48 * 1024  # below glibc's smallest mmap threshold (128 KiB): always carved from a heap
HOLES = 1024  # 48 MiB of holes


def _libc():
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = (ctypes.c_void_p,), None
    return libc


def _rss_anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(_malloc_trim() is None, reason="glibc's malloc_trim (Linux) only")
def test_idle_scheduler_hands_free_heap_pages_back(eagle):
    """A request's last delta callback (on the scheduler's thread, in its malloc arena) leaves 48 MiB of freed
    blocks, each between two live ones: the shape of a heap after many steps of short-lived blocks among
    long-lived ones, which glibc keeps resident. Once the batch is empty the scheduler hands those pages back
    (before the fix they stayed resident while the scheduler sat idle)."""
    libc = _libc()
    pins: list[int] = []
    resident: list[float] = []  # RssAnon with the holes made
    trims: list[int] = []  # the scheduler's trims by then

    def on_delta(handle, item):
        if isinstance(item, BaseException) or not item.finished:
            return
        blocks = []
        for _ in range(HOLES):
            block = libc.malloc(HOLE)
            ctypes.memset(block, 1, HOLE)  # resident
            blocks.append(block)
            # the same size, so carved right after the block (a small pin would come from a bin of small free
            # chunks, elsewhere): the freed block cannot merge with a neighbour or with the heap's top
            pins.append(libc.malloc(HOLE))
        for block in blocks:
            libc.free(block)
        resident.append(_rss_anon_mib())
        trims.append(sched.stats().memory_trims)

    try:
        with Scheduler(eagle, SchedulerConfig(max_concurrent_requests=2)) as sched:
            handle = sched.submit(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True), on_delta=on_delta)
            assert handle.wait(WAIT) and handle.finish_reason == "length"
            deadline = time.monotonic() + WAIT
            while sched.stats().memory_trims <= trims[0] and time.monotonic() < deadline:
                time.sleep(0.01)
            after = _rss_anon_mib()
            stats = sched.stats()
        assert stats.memory_trims > trims[0] and stats.active == stats.waiting == 0
        assert resident[0] - after > 0.75 * HOLE * HOLES / 2**20, (resident, after)
    finally:
        for pin in pins:
            libc.free(pin)


def test_trim_interval(eagle, monkeypatch):
    """trim_interval_s None leaves the C allocator alone; 0 trims after every step."""
    assert SchedulerConfig().trim_interval_s == 1.0
    with pytest.raises(runtime.errors.ConfigError, match="trim_interval_s"):
        SchedulerConfig(trim_interval_s=-1)
    calls = []
    monkeypatch.setattr("runtime.batching.release_free_memory", lambda: calls.append(1) or True)
    with Scheduler(eagle, SchedulerConfig(max_concurrent_requests=2, trim_interval_s=None)) as sched:
        sched.generate(PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True))
        assert sched.stats().memory_trims == 0
    assert calls == []
    with Scheduler(eagle, SchedulerConfig(max_concurrent_requests=2, trim_interval_s=0)) as sched:
        sched.generate(PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True))
        steps = sched.stats().steps
        deadline = time.monotonic() + WAIT
        while sched.stats().memory_trims < steps and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sched.stats().memory_trims == steps == len(calls) > 1
