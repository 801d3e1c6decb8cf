"""python -m perf.soak: concurrent streaming gRPC clients against a served repository for a fixed time.

    python -m perf.soak --url 127.0.0.1:8001 --engine ENGINE_DIR [--clients 16,64] [--seconds 60]
                        [--model ensemble] [--max-tokens 48] [--prompts FILE ...] [--server-pid PID]
                        [--metrics-url http://127.0.0.1:8002/metrics] [--out perf/results/{date}-{machine}]

Each client sends requests back to back, for `seconds`, alternating greedy and sampled (temperature 0.8, top-p
0.95, a fixed seed per prompt). Every completed stream's token ids must equal the offline runtime's on the same
engine (loaded here; same prompt, same settings): greedy output is plain decoding's, and the same seed gives the
same output whatever else the server is doing. A request refused with UNAVAILABLE (the server is full: "overloaded:
...", the documented queue-full rejection) is counted apart and retried after RETRY_S; any other error, and any
mismatch, is a failure (exit status 1). With --server-pid, the resident memory of the server and its
python stubs is sampled every second (RSS flat: its growth between the second and the last quarter of the run),
in total and per process (stubs by their Triton instance name, e.g. spec_decode_0_0), so a growth is traced to
its process. With --metrics-url, the server's metrics are scraped every second: the refusals it counted itself
(spectree_requests_total{outcome="overloaded"}, by the model that refused: every refusal once) beside the ones
the clients saw, and the fewest free request slots (spectree_free_request_slots) per model.
Writes soak.json and soak.md into --out ({date} and {machine} filled in).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from perf import stats
from runtime import schema
from runtime.errors import ConfigError, SpectreeError
from runtime.schema import setting

RETRY_S = 0.2  # a refused client waits this long before its next request
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
SEED_BASE = 1000  # prompt i's sampled requests use seed SEED_BASE + i
DEFAULT_PROMPTS = ("perf/prompts/prose.jsonl", "perf/prompts/code.jsonl")
RSS_EVERY_S = 1.0
METRICS_EVERY_S = 1.0
METRICS_SETTLE_S = 1.0


@dataclass(frozen=True)
class SoakConfig:
    url: str  # gRPC HOST:PORT
    clients: int = setting(16, ge=1)
    # clients start requests for this long; the ones in flight then finish
    seconds: float = setting(60.0, gt=0, what="a duration > 0 (seconds)")
    model: str = "ensemble"
    max_tokens: int = setting(48, ge=1)
    timeout_s: float = 120.0  # per response
    metrics_url: str | None = None  # Triton's metrics (http://HOST:PORT/metrics): the server's own count of refusals

    def __post_init__(self) -> None:
        schema.check(self, ConfigError)


@dataclass(frozen=True)
class Case:
    """One (prompt, sampling) combination a client may send; its offline token ids are the reference."""

    key: str
    prompt: Any  # text, or chat messages
    sampling: dict[str, Any]  # generate_stream options
    reference: tuple[int, ...]


@dataclass
class SoakResult:
    clients: int
    seconds: float  # wall time from the first request to the last response
    requests: int = 0
    completed: int = 0
    overloaded: int = 0  # refused with UNAVAILABLE (queue full, documented), retried
    errors: list[str] = field(default_factory=list)  # any other error
    mismatches: list[str] = field(default_factory=list)  # completed, but not the offline output
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)  # request sent -> first tokens
    itl_s: list[float] = field(default_factory=list)  # between responses, per token of the later one
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)
    rss_by_process: list[dict[str, float]] = field(default_factory=list)  # per sample of rss_mb: MiB by process
    # scraped from the server's metrics (SoakConfig.metrics_url) during the run: outcome -> model -> requests
    # finished so (spectree_requests_total) since the start, and model -> the fewest free request slots seen
    server_outcomes: dict[str, dict[str, float]] = field(default_factory=dict)
    free_slots_min: dict[str, float] = field(default_factory=dict)
    scrapes: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors and not self.mismatches and self.completed > 0

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float | None:
            return None if not xs else float(np.percentile(xs, q))

        rss = [m for _, m in self.rss_mb]
        names = sorted({name for sample in self.rss_by_process for name in sample})
        by_process = {}
        for name in names:
            series = [sample[name] for sample in self.rss_by_process if name in sample]
            growth = _growth(series)
            by_process[name] = {"start": round(series[0], 1), "end": round(series[-1], 1),
                                "growth": None if growth is None else round(growth, 1)}
        growth = _growth(rss)
        return {
            "clients": self.clients, "seconds": round(self.seconds, 1), "requests": self.requests,
            "completed": self.completed, "overloaded": self.overloaded, "errors": len(self.errors),
            "mismatches": len(self.mismatches), "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.output_tokens / self.seconds, 1) if self.seconds else None,
            "ttft_ms": {f"p{q}": None if pct(self.ttft_s, q) is None else round(1000 * pct(self.ttft_s, q), 1)
                        for q in (50, 90, 99)},
            "itl_ms": {f"p{q}": None if pct(self.itl_s, q) is None else round(1000 * pct(self.itl_s, q), 2)
                       for q in (50, 90, 99)},
            "rss_mib": None if not rss else {"start": round(rss[0], 1), "end": round(rss[-1], 1),
                                             "max": round(max(rss), 1),
                                             "growth": None if growth is None else round(growth, 1)},
            "rss_by_process_mib": by_process,
            "server_metrics": None if not self.scrapes else {
                "scrapes": self.scrapes, "outcomes": self.server_outcomes,
                "overloaded": sum(self.server_outcomes.get("overloaded", {}).values()),
                "free_request_slots_min": self.free_slots_min},
            "first_errors": self.errors[:5], "first_mismatches": self.mismatches[:5], "ok": self.ok,
        }


def _growth(rss: Sequence[float]) -> float | None:
    """Median of the last quarter minus median of the second quarter (the first is warm-up); None under 8 samples."""
    if len(rss) < 8:
        return None
    quarter = len(rss) // 4
    return statistics.median(rss[-quarter:]) - statistics.median(rss[quarter:2 * quarter])


_LOAD_SERIES = re.compile(r'^(spectree_requests_total|spectree_free_request_slots)\{([^}]*)\} (\S+)$')


def server_load(url: str) -> dict[tuple[str, str, str], float]:
    """One scrape of the metrics that show load shedding: ("requests", model, outcome) -> requests finished so, and
    ("free", model, instance) -> free request slots now."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode("utf-8")
    out: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        m = _LOAD_SERIES.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = (("requests", labels.get("model", ""), labels.get("outcome", "")) if m.group(1).endswith("total")
                   else ("free", labels.get("model", ""), labels.get("instance", "")))
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def reference_cases(decoder: Any, prompts: Sequence[Any], max_tokens: int) -> list[Case]:
    """Greedy and seeded-sampled cases of every prompt, with the offline runtime's token ids as the reference.

    Text prompts are encoded as the server encodes them (special-token text literal); FP32 inputs are rounded as
    the server receives them."""
    from runtime.sampling import SamplingParams

    cases = []
    for i, prompt in enumerate(prompts):
        ids = prompt if not isinstance(prompt, str) else decoder.tokenizer.encode(prompt, parse_special=False)
        for mode, sampling in (("greedy", {}), ("sampled", {**SAMPLED, "seed": SEED_BASE + i})):
            offline = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in sampling.items()}
            ref = decoder.generate(ids, SamplingParams(max_tokens=max_tokens, **offline))
            cases.append(Case(f"{i}/{mode}", prompt, sampling, tuple(ref.token_ids)))
    return cases


def process_rss_by_name(pids: Sequence[int]) -> dict[str, float]:
    """Resident MiB of each live process among pids: python backend stubs by their Triton instance name, the others
    by their command name (tritonserver), made unique with the pid when two share one."""
    from deploy.server import python_stubs

    stubs = python_stubs(pids)
    out: dict[str, float] = {}
    for pid in pids:
        try:
            kib = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS:"))
            name = stubs[pid].instance if pid in stubs else Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, StopIteration):
            continue
        out[f"{name} ({pid})" if name in out else name] = kib / 1024
    return out


def run_soak(config: SoakConfig, cases: Sequence[Case], pids: Callable[[], list[int]] | None = None) -> SoakResult:
    """`config.clients` threads streaming `cases` round-robin (each starting at its own offset) until
    `config.seconds` have passed."""
    from deploy.client import ClientError, generate_stream

    if not cases:
        raise ConfigError("run_soak: no cases to send")
    result = SoakResult(clients=config.clients, seconds=0.0)
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + config.seconds
    stop_rss = threading.Event()

    def sample_rss() -> None:
        while not stop_rss.is_set():
            by_name = process_rss_by_name(pids())
            with lock:
                result.rss_mb.append((time.monotonic() - start, sum(by_name.values())))
                result.rss_by_process.append(by_name)
            stop_rss.wait(RSS_EVERY_S)

    first = server_load(config.metrics_url) if config.metrics_url else None

    def absorb(load: dict[tuple[str, str, str], float]) -> None:
        """A scrape into the result: outcomes since the first scrape, the fewest free slots per model so far."""
        assert first is not None
        with lock:
            result.scrapes += 1
            outcomes: dict[str, dict[str, float]] = {}
            for (kind, model, label), value in load.items():
                if kind == "requests" and value - first.get((kind, model, label), 0.0):
                    outcomes.setdefault(label, {})[model] = value - first.get((kind, model, label), 0.0)
            result.server_outcomes = outcomes
            free: dict[str, float] = {}
            for (kind, model, _), value in load.items():
                if kind == "free":
                    free[model] = free.get(model, 0.0) + value
            for model, value in free.items():
                result.free_slots_min[model] = min(value, result.free_slots_min.get(model, value))

    def sample_metrics() -> None:
        while not stop_rss.wait(METRICS_EVERY_S):
            absorb(server_load(config.metrics_url))

    def client(index: int) -> None:
        n = index
        while time.monotonic() < deadline:
            case = cases[n % len(cases)]
            n += 1
            t0 = last = time.monotonic()
            ids: list[int] = []
            ttft, gaps = None, []
            try:
                for event in generate_stream(config.url, config.model, case.prompt, config.max_tokens,
                                             timeout_s=config.timeout_s, **case.sampling):
                    now = time.monotonic()
                    if event.token_ids:
                        if ttft is None:
                            ttft = now - t0
                        else:
                            gaps.append((now - last) / len(event.token_ids))
                        last = now
                    ids.extend(event.token_ids)
            except ClientError as exc:
                with lock:
                    result.requests += 1
                    if exc.unavailable:
                        result.overloaded += 1
                    else:
                        result.errors.append(f"{case.key}: {exc}")
                if exc.unavailable:
                    time.sleep(RETRY_S)
                continue
            with lock:
                result.requests += 1
                result.completed += 1
                result.output_tokens += len(ids)
                if ttft is not None:
                    result.ttft_s.append(ttft)
                result.itl_s.extend(gaps)
                if tuple(ids) != case.reference:
                    result.mismatches.append(f"{case.key}: {len(ids)} tokens, offline {len(case.reference)}; first "
                                             f"difference at {stats.first_difference(ids, case.reference)}")

    wanted = ((sample_rss, pids is not None), (sample_metrics, first is not None))
    samplers = [threading.Thread(target=f, daemon=True) for f, on in wanted if on]
    for t in samplers:
        t.start()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(config.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.monotonic() - start
    stop_rss.set()
    for t in samplers:
        t.join()
    if first is not None:
        time.sleep(METRICS_SETTLE_S)  # a refusal is counted just after the client hears it
        absorb(server_load(config.metrics_url))
    return result


def server_pids(server_pid: int) -> Callable[[], list[int]]:
    """The server and its children (the python stubs), looked up at each call."""
    from deploy.server import child_pids

    return lambda: [server_pid, *child_pids(server_pid)]


def report_markdown(runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Soak: {meta['model']} at {meta['url']}, {meta['seconds']:.0f} s per level", "",
             f"engine `{meta['engine']}`, max_tokens {meta['max_tokens']}, {meta['cases']} cases (greedy and "
             f"seeded sampling), {meta['machine']}", "",
             "| clients | requests | completed | overloaded (documented) | errors | mismatches | output tok/s | "
             "TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | RSS start / end / growth MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rss = r["rss_mib"] or {}
        lines.append(
            f"| {r['clients']} | {r['requests']} | {r['completed']} | {r['overloaded']} | {r['errors']} | "
            f"{r['mismatches']} | {r['output_tokens_per_s']} | "
            f"{' / '.join(str(r['ttft_ms'][k]) for k in ('p50', 'p90', 'p99'))} | "
            f"{' / '.join(str(r['itl_ms'][k]) for k in ('p50', 'p90', 'p99'))} | "
            f"{rss.get('start')} / {rss.get('end')} / {rss.get('growth')} |")
    for r in runs:
        sm = r.get("server_metrics")
        if sm:
            by_model = ", ".join(f"{m} {v:.0f}" for m, v in sorted(sm["outcomes"].get("overloaded", {}).items()))
            lines.append(
                f"- {r['clients']} clients, the server's metrics ({sm['scrapes']} scrapes): {sm['overloaded']:.0f} "
                f"requests refused as overloaded (spectree_requests_total{{outcome=\"overloaded\"}}: "
                f"{by_model or 'none'}; the clients saw {r['overloaded']}), fewest free request slots seen "
                "(spectree_free_request_slots): "
                + ", ".join(f"{m} {v:.0f}" for m, v in sorted(sm["free_request_slots_min"].items())))
    for r in runs:
        if r.get("rss_by_process_mib"):
            lines.append(f"- {r['clients']} clients, RSS by process (start / end / growth MiB): " + "; ".join(
                f"{name} {m['start']} / {m['end']} / {m['growth']}" for name, m in r["rss_by_process_mib"].items()))
    for r in runs:
        for kind in ("first_errors", "first_mismatches"):
            for line in r[kind]:
                lines.append(f"- {r['clients']} clients, {kind.removeprefix('first_')}: {line}")
    return "\n".join(lines) + "\n"


def _load_prompts(files: Sequence[str]) -> list[Any]:
    from runtime.prompts import load_prompt_file

    return [p.as_input() for f in files for p in load_prompt_file(f)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--url", required=True, help="gRPC endpoint HOST:PORT")
    p.add_argument("--engine", required=True, type=Path, help="the served engine (for the offline references)")
    p.add_argument("--model", default=SoakConfig.model)
    p.add_argument("--clients", default="16,64", help="comma-separated client counts, one run each (default 16,64)")
    p.add_argument("--seconds", type=float, default=SoakConfig.seconds)
    p.add_argument("--max-tokens", type=int, default=SoakConfig.max_tokens)
    p.add_argument("--prompts", action="append", default=[], metavar="FILE",
                   help=f"prompt file, JSON Lines (repeatable; default {', '.join(DEFAULT_PROMPTS)})")
    p.add_argument("--server-pid", type=int, help="tritonserver's pid (samples its RSS and its stubs')")
    p.add_argument("--metrics-url", help="Triton's metrics, http://HOST:PORT/metrics: the server's own count of "
                                         "refused requests and its free request slots, scraped during each run")
    p.add_argument("--out", default="perf/results/{date}-{machine}", help="output directory (default %(default)s)")
    ns = p.parse_args(argv)
    try:
        import runtime
        from perf.machine import expand_out, machine_info, machine_slug

        levels = [int(c) for c in ns.clients.split(",") if c.strip()]
        configs = [SoakConfig(url=ns.url, clients=c, seconds=ns.seconds, model=ns.model, max_tokens=ns.max_tokens,
                              metrics_url=ns.metrics_url) for c in levels]
        decoder = runtime.load(ns.engine)
        print(f"offline references for {ns.engine} ...", file=sys.stderr, flush=True)
        cases = reference_cases(decoder, _load_prompts(ns.prompts or DEFAULT_PROMPTS), ns.max_tokens)
        del decoder
        runs = []
        for config in configs:
            print(f"{config.clients} clients for {config.seconds:.0f} s ...", file=sys.stderr, flush=True)
            result = run_soak(config, cases, server_pids(ns.server_pid) if ns.server_pid else None)
            runs.append(result.summary())
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        info = machine_info()
        meta = {"url": ns.url, "model": ns.model, "engine": str(ns.engine), "seconds": ns.seconds,
                "max_tokens": ns.max_tokens, "cases": len(cases), "machine": machine_slug(info),
                "config": [asdict(c) for c in configs]}
        out = expand_out(ns.out, info)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps({"meta": meta, "machine": info, "runs": runs}, indent=2) + "\n")
        (out / "soak.md").write_text(report_markdown(runs, meta))
        print(f"wrote {out / 'soak.json'} and {out / 'soak.md'}", file=sys.stderr)
    except (SpectreeError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
