"""`python -m perf batch`: output tokens/s of N concurrent requests through the in-flight batching scheduler
(`runtime.batching.Scheduler`) against the same N requests decoded one after another (the batch-1 loop).

One run loads the target ONCE and builds one decoder (a drafter spec in bench's grammar, default the config's /
engine's own drafter; `plain` for plain decoding). For each concurrency N in `concurrency`, N requests take the
prompts in order (cycling when N exceeds them), each generating exactly max_tokens tokens (greedy, EOS ignored):
    sequential  `SpecDecoder.generate` on each request in turn
    batched     all N submitted at once to a `Scheduler` (max_concurrent_requests N); wall time from the first submit
                to the last final delta
tokens/s = N x max_tokens / wall time. Per batched request: TTFT (submit -> first delta) and inter-token latency
((last delta - first delta) / (tokens - 1)), the deltas' arrival times taken on the scheduler's thread (the delta
callback). The scheduler's mean batch (request segments per target forward) is recorded.

Greedy identity: every batched output must equal the sequential output of the same request (the scheduler's
promise; a packed forward rounds the last bits of a matmul differently, so an exact near-tie could legitimately
differ: it is reported with its position); any difference makes the command exit 1.

Timing: torch's intra-op threads are set once (`threads`); `warmup` untimed rounds first; then `repeats` rounds,
each running every level in both modes, the mode order alternating per round; a (level, mode) time is the median
over rounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perf import stats
from perf.bench import (BenchConfig, BenchConfigError, VariantSpec, build_decoder, check_one_target, encode_prompts,
                        load_target, resolve)
from perf.machine import machine_info, report_header, settings_dict, torch_threads, usable_cores
from perf.prompt_sets import load_prompts
from runtime import schema
from runtime.batching import SchedulerConfig
from runtime.draft_spec import DraftSpec
from runtime.files import shown_path
from runtime.schema import setting

REPORT_FORMAT = "spectree-batch"
REPORT_VERSION = 1
MODES = ("sequential", "batched")


@dataclass(frozen=True)
class BatchBenchConfig:
    """Everything `python -m perf batch` takes (its flags' defaults come from here)."""

    config: Path | None = None  # builder YAML; exactly one of config / engine
    engine: Path | None = None  # engine directory
    drafter: str | None = None  # a bench drafter spec (lookup, medusa:chain-3, eagle, ...) or "plain"; None: configured
    draft_models: tuple[tuple[str, Path], ...] = ()  # (medusa | eagle, head directory) beyond the configured one
    prompts: tuple[Path, ...] = ()  # prompt files; empty: perf/prompts/{code,prose}.jsonl
    prompts_per_set: int | None = setting(None, ge=1)
    concurrency: tuple[int, ...] = setting((1, 2, 4, 8), nonempty=True)
    max_tokens: int = setting(64, ge=1)  # tokens per request, exactly (EOS ignored)
    warmup: int = setting(1, ge=0)  # untimed rounds first
    repeats: int = setting(1, ge=1)  # timed rounds; the median counts
    threads: int | None = setting(None, ge=1)  # torch intra-op threads; None: every usable core
    dtype: str | None = None  # auto | float32 | bfloat16 | float16; None: the config's / engine's
    # the scheduler's prompt tokens per request per step
    prefill_chunk: int = setting(SchedulerConfig.prefill_chunk, ge=1)
    tree_budget: int | None = setting(SchedulerConfig.tree_budget, ge=1)  # the scheduler's (batched mode only)
    out: str = setting("out/perf/{date}-{machine}", nonempty=True, what="an output directory")

    def __post_init__(self) -> None:
        check_one_target(self.config, self.engine)
        schema.check(self, BenchConfigError)
        if min(self.concurrency) < 1 or len(set(self.concurrency)) != len(self.concurrency):
            raise BenchConfigError(f"concurrency: got {list(self.concurrency)}, expected distinct integers >= 1")
        if self.drafter is not None:
            try:
                VariantSpec.parse(self.drafter)
            except BenchConfigError as exc:
                raise BenchConfigError(f"drafter: {exc} (or plain)") from exc

    def resolved_threads(self) -> int:
        return self.threads if self.threads is not None else usable_cores()

    def to_dict(self) -> dict[str, Any]:
        d = settings_dict(self)
        d["draft_models"] = {k: str(v) for k, v in self.draft_models}
        return d


# ---- one round of one level ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One timed run of N requests in one mode."""

    concurrency: int
    mode: str  # sequential | batched
    wall_s: float
    outputs: tuple[tuple[int, ...], ...]  # per request, in request order
    ttft_s: tuple[float, ...] = ()  # batched only
    itl_s: tuple[float, ...] = ()  # batched only (requests of at least 2 tokens)
    mean_batch: float | None = None  # batched only
    mean_rows: float | None = None  # batched only: tokens (prompt chunks and tree nodes) per target forward

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def run_sequential(decoder: Any, requests: Sequence[list[int]], max_tokens: int) -> Sample:
    t0 = time.perf_counter()
    outs = tuple(decoder.generate(ids, max_tokens=max_tokens, ignore_eos=True).token_ids for ids in requests)
    return Sample(len(requests), "sequential", time.perf_counter() - t0, outs)


def run_batched(decoder: Any, requests: Sequence[list[int]], max_tokens: int, prefill_chunk: int,
                tree_budget: int | None = None) -> Sample:
    """All requests submitted at once to a fresh Scheduler (max_concurrent_requests = their number)."""
    from runtime.batching import Scheduler
    from runtime.sampling import SamplingParams

    n = len(requests)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    arrivals: list[list[float]] = [[] for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def on_delta(i: int) -> Callable[[Any, Any], None]:
        def record(handle: Any, item: Any) -> None:
            now = time.perf_counter()
            with lock:
                if isinstance(item, BaseException):
                    errors.append(item)
                    return
                arrivals[i].append(now)
                ids[i].extend(item.token_ids)
        return record

    config = SchedulerConfig(max_concurrent_requests=n, max_queue_size=0, prefill_chunk=prefill_chunk,
                             tree_budget=tree_budget)
    with Scheduler(decoder, config) as sched:
        t0 = time.perf_counter()
        handles = [sched.submit(r, params, on_delta=on_delta(i)) for i, r in enumerate(requests)]
        for h in handles:
            h.wait()
        wall = time.perf_counter() - t0
        st = sched.stats()
    if errors:
        raise errors[0]
    ttft = tuple(a[0] - t0 for a in arrivals)
    itl = tuple((a[-1] - a[0]) / (len(o) - 1) for a, o in zip(arrivals, ids) if len(o) > 1)
    return Sample(n, "batched", wall, tuple(tuple(o) for o in ids), ttft, itl, st.mean_batch,
                  st.rows / st.steps if st.steps else None)


def level_requests(encoded: Sequence[list[int]], n: int) -> list[list[int]]:
    """The first n prompts' ids, cycling through them when n exceeds their number."""
    return [encoded[i % len(encoded)] for i in range(n)]


def summarize(samples: Sequence[Sample], max_tokens: int) -> list[dict[str, Any]]:
    """Per level: tokens/s of each mode (median wall over rounds), the speedup, latency percentiles of the batched
    requests (all rounds pooled) and greedy identity (every batched round against the first sequential round)."""
    levels = sorted({s.concurrency for s in samples})
    rows = []
    for n in levels:
        by = {m: [s for s in samples if s.concurrency == n and s.mode == m] for m in MODES}
        row: dict[str, Any] = {"concurrency": n, "tokens": n * max_tokens}
        for mode, runs in by.items():
            wall = stats.median([r.wall_s for r in runs])
            row[mode] = {"wall_s": wall, "tokens_per_s": runs[0].tokens / wall if wall > 0 else None,
                         "samples_s": [r.wall_s for r in runs]}
        b = by["batched"]
        ttft = [t for r in b for t in r.ttft_s]
        itl = [t for r in b for t in r.itl_s]
        per_forward = [r.mean_rows for r in b if r.mean_rows is not None]
        row["batched"].update({
            "mean_batch": stats.mean([r.mean_batch for r in b]),
            "mean_rows": stats.mean(per_forward) if per_forward else None,
            "ttft_ms": {f"p{q}": 1e3 * stats.percentile(ttft, q) for q in (50, 90, 99)},
            "itl_ms": {f"p{q}": 1e3 * stats.percentile(itl, q) for q in (50, 90, 99)} if itl else None,
        })
        row["speedup"] = stats.ratio(row["batched"]["tokens_per_s"], row["sequential"]["tokens_per_s"])
        reference = by["sequential"][0].outputs
        differences = []
        for r in b:
            for i, (want, got) in enumerate(zip(reference, r.outputs)):
                at = stats.first_difference(want, got)
                if at is not None:
                    differences.append({"request": i, "index": at})
        row["greedy_identical"] = not differences
        row["differences"] = differences
        rows.append(row)
    return rows


# ---- the measurement ----------------------------------------------------------------------------------------------


def run_batch_bench(config: BatchBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load, measure and summarise; returns the report (JSON-ready). Sets torch's threads for the duration."""
    with torch_threads(config.resolved_threads()):
        prompts = load_prompts(config.prompts or None, config.prompts_per_set)
        target = load_target(BenchConfig(config=config.config, engine=config.engine, dtype=config.dtype))
        encoded = encode_prompts(prompts, target, config.max_tokens, BenchConfigError)
        spec = VariantSpec.parse(config.drafter) if config.drafter else VariantSpec(DraftSpec(target.drafter.kind))
        if spec.draft.plain:
            decoder, info = build_decoder(target, None)
        else:
            resolved = resolve(spec, target, dict(config.draft_models))
            decoder, info = build_decoder(target, resolved, spec.name)
            info["path"] = None if resolved.path is None else shown_path(resolved.path)
        info["drafter"] = decoder.drafter.name
        levels = sorted(config.concurrency)

        def one_round(n: int, order: Sequence[str]) -> list[Sample]:
            requests = level_requests(encoded, n)
            out = []
            for mode in order:
                if mode == "sequential":
                    out.append(run_sequential(decoder, requests, config.max_tokens))
                else:
                    out.append(run_batched(decoder, requests, config.max_tokens, config.prefill_chunk,
                                           config.tree_budget))
                if progress:
                    progress(f"N={n} {mode}: {out[-1].tokens / out[-1].wall_s:.1f} tokens/s")
            return out

        for _ in range(config.warmup):
            for n in levels:
                one_round(n, MODES)
        started = time.perf_counter()
        samples: list[Sample] = []
        for r in range(config.repeats):
            for n in levels:
                samples += one_round(n, MODES if r % 2 == 0 else MODES[::-1])
        elapsed = time.perf_counter() - started
        machine = machine_info()
    rows = summarize(samples, config.max_tokens)
    return {
        **report_header(REPORT_FORMAT, REPORT_VERSION, config.to_dict(), machine),
        "target": target.describe(),
        "drafter": info,
        "prompts": [{"key": p.key, "prompt_tokens": len(ids)} for p, ids in zip(prompts, encoded)],
        "measure_seconds": elapsed,
        "greedy_identical": all(r["greedy_identical"] for r in rows),
        "levels": rows,
    }


__all__ = [
    "BatchBenchConfig",
    "MODES",
    "Sample",
    "level_requests",
    "run_batch_bench",
    "run_batched",
    "run_sequential",
    "summarize",
]
