"""`python -m perf serve`: NVIDIA's perf_analyzer against a served model repository, one concurrency at a time.

For each concurrency level C, perf_analyzer runs over gRPC with `--async --streaming` (what a decoupled LLM model
needs; reference-facts section 8) on input data generated from the prompt sets
    {"data": [{"text_input": ["..."], "max_tokens": [N], "stream": [true],
               "sampling_parameters": ["{\\"ignore_eos\\": true, \\"temperature\\": 0}"]}, ...]}
for exactly `max(requests, 2 C)` requests (`--request-count`), after `warmup` untimed requests before the first
level. Its CSV (-f) and profile export (--profile-export-file: every request's send time, every streamed
response's time and outputs) are kept in the output directory and parsed into, per level:
    requests/s           requests / (last response - first request), from the profile export
    output tokens/s      all output tokens / the same span
    TTFT                 first response - request sent (p50 / p90 / p99 / mean)
    ITL                  (last response - first response) / (output tokens - 1), per request
    request latency      last response - request sent
Output tokens are counted from the `output_ids` each response carries (spectree's models return them); for a
model without them, `--tokenizer DIR` re-tokenizes the concatenated text_output deltas (genai-perf's method).
perf_analyzer's own requests/s (its CSV) is recorded too; with --request-count it divides by whole measurement
windows, so it reads low when the requests finish early, which is why the span above is the headline number.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perf import stats
from perf.analyzer import PerfAnalyzer, locate
from perf.machine import report_header, settings_dict
from perf.prompt_sets import Prompt, load_prompts
from runtime import schema
from runtime.errors import ConfigError, SpectreeError
from runtime.files import read_json_object
from runtime.schema import setting

REPORT_FORMAT = "spectree-serve"
REPORT_VERSION = 1


class PerfAnalyzerFailed(SpectreeError, RuntimeError):
    """perf_analyzer ran but failed (server unreachable, model missing, request errors); its output is quoted."""


class ProfileExportError(SpectreeError, ValueError):
    """A perf_analyzer CSV or profile export does not have the expected structure."""


def parse_concurrency(text: str) -> tuple[int, ...]:
    """"1:8" (1..8), "1:8:2" (1, 3, 5, 7), "1,2,4,8" or "4" -> the concurrency levels, increasing."""
    raw = str(text).strip()
    try:
        if ":" in raw:
            parts = [int(p) for p in raw.split(":")]
            if len(parts) not in (2, 3):
                raise ValueError
            start, end, step = parts[0], parts[1], parts[2] if len(parts) == 3 else 1
            if step < 1 or end < start:
                raise ValueError
            levels = tuple(range(start, end + 1, step))
        else:
            levels = tuple(int(p) for p in raw.split(","))
    except ValueError:
        raise ConfigError(f"--concurrency: got {text!r}, expected START:END[:STEP] (e.g. 1:8) or a list "
                               "such as 1,2,4,8") from None
    if not levels or min(levels) < 1 or list(levels) != sorted(set(levels)):
        raise ConfigError(f"--concurrency: got {text!r}, expected distinct increasing levels >= 1")
    return levels


@dataclass(frozen=True)
class ServeConfig:
    """Everything `python -m perf serve` takes (its flags' defaults come from here)."""

    url: str  # gRPC endpoint HOST:PORT
    model: str  # model name in the repository (ensemble, spec_decode, ...)
    concurrency: tuple[int, ...] = setting((1, 2, 3, 4, 5, 6, 7, 8), nonempty=True)
    prompts: tuple[Path, ...] = ()  # prompt files; empty: perf/prompts/{code,prose}.jsonl
    prompts_per_set: int | None = setting(None, ge=1)
    max_tokens: int = setting(64, ge=1)
    ignore_eos: bool = True  # sampling_parameters {"ignore_eos": true}: every request generates max_tokens
    requests: int = setting(16, ge=1)  # requests measured per level (at least 2 x the concurrency)
    warmup: int = setting(2, ge=0)  # untimed requests before the first level
    tokenizer: Path | None = None  # re-tokenize text_output when the model returns no output_ids
    perf_analyzer: str | None = None  # explicit binary; None: PATH, then this interpreter's bin/
    timeout_s: float = setting(1800.0, gt=0)  # per perf_analyzer run (seconds)
    out: str = "out/perf/{date}-{machine}"  # output directory (shared with bench); {date}, {machine} filled in

    def __post_init__(self) -> None:
        host, sep, port = self.url.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"url: got {self.url!r}, expected HOST:PORT of the gRPC endpoint (e.g. "
                                   "127.0.0.1:8001)")
        if not self.model or "/" in self.model:
            raise ConfigError(f"model: got {self.model!r}, expected a model name of the repository")
        schema.check(self, ConfigError)
        if min(self.concurrency) < 1:
            raise ConfigError(f"concurrency: got {self.concurrency!r}, expected levels >= 1")
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ConfigError(f"tokenizer: {str(self.tokenizer)!r} has no tokenizer.json")

    def requests_at(self, concurrency: int) -> int:
        return max(self.requests, 2 * concurrency)

    def to_dict(self) -> dict[str, Any]:
        return settings_dict(self)


def input_data(prompts: Sequence[Prompt], max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """perf_analyzer's --input-data JSON: one entry per prompt, cycled through by perf_analyzer."""
    entry: dict[str, Any] = {"max_tokens": [max_tokens], "stream": [True]}
    if ignore_eos:
        # greedy as the other requests (a sampling_parameters request without a temperature gets vLLM's 1.0)
        entry["sampling_parameters"] = [json.dumps({"ignore_eos": True, "temperature": 0})]
    return {"data": [{"text_input": [p.text], **entry} for p in prompts]}


def command(pa: PerfAnalyzer, config: ServeConfig, concurrency: int, requests: int, data: Path, csv_path: Path,
            export: Path) -> list[str]:
    return [str(pa.binary), "-m", config.model, "-u", config.url, "-i", "grpc", "--async", "--streaming",
            "--input-data", str(data), "--concurrency-range", str(concurrency), "--request-count", str(requests),
            "-f", str(csv_path), "--profile-export-file", str(export)]


EXPORT_ATTEMPTS = 5  # runs of one level while perf_analyzer leaves its profile export unreadable (twice in a row seen)


def run_perf_analyzer(pa: PerfAnalyzer, cmd: list[str], timeout_s: float, log: Path) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=pa.env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise PerfAnalyzerFailed(f"perf_analyzer did not finish within {timeout_s:.0f} s: {' '.join(cmd)}") from exc
    log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}", encoding="utf-8")
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-1500:]
        raise PerfAnalyzerFailed(f"perf_analyzer exited with status {proc.returncode} (full log: {log}):\n{tail}")


# ---- parsing perf_analyzer's outputs ---------------------------------------------------------------------


def read_csv(text: str, where: str) -> dict[int, dict[str, str]]:
    """perf_analyzer's -f CSV -> {concurrency: row}; the first block only (later blocks are server metrics)."""
    block = text.split("\n\n")[0]
    rows = list(csv.DictReader(io.StringIO(block)))
    if not rows or "Concurrency" not in rows[0] or "Inferences/Second" not in rows[0]:
        raise ProfileExportError(f"{where}: expected a perf_analyzer CSV with Concurrency and Inferences/Second "
                                 f"columns, got header {list(rows[0]) if rows else '(empty)'}")
    try:
        return {int(r["Concurrency"]): r for r in rows}
    except ValueError as exc:
        raise ProfileExportError(f"{where}: Concurrency column is not an integer ({exc})") from exc


def _count_ids(value: Any) -> int:
    """perf_analyzer exports a one-element output as a scalar and a longer one as a list."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    raise ProfileExportError(f"output_ids: got {value!r}, expected an integer or a list of integers")


TokenCounter = Callable[[str], int]


def request_tokens(outputs: Sequence[dict[str, Any]], count_text: TokenCounter | None) -> tuple[int, str]:
    """Output tokens of one request, and how they were counted."""
    if outputs and all("output_ids" in o for o in outputs):
        return sum(_count_ids(o["output_ids"]) for o in outputs), "output_ids"
    if count_text is None:
        raise ProfileExportError("the model's responses carry no output_ids; pass --tokenizer DIR (the served "
                                 "model's tokenizer.json) to count tokens by re-tokenizing text_output")
    text = "".join(o.get("text_output", "") for o in outputs if isinstance(o.get("text_output", ""), str))
    return count_text(text), "text_output"


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": stats.mean(values), "p50": stats.percentile(values, 50), "p90": stats.percentile(values, 90),
            "p99": stats.percentile(values, 99)}


def level_metrics(export: dict[str, Any], concurrency: int, count_text: TokenCounter | None,
                  where: str) -> dict[str, Any]:
    """The experiment of a profile export at `concurrency` -> the level's metrics (times in ms)."""
    try:
        exps = [e for e in export["experiments"]
                if e["experiment"]["mode"] == "concurrency" and e["experiment"]["value"] == concurrency]
    except (KeyError, TypeError) as exc:
        raise ProfileExportError(f"{where}: not a perf_analyzer profile export (missing {exc})") from exc
    if len(exps) != 1:
        raise ProfileExportError(f"{where}: expected one experiment at concurrency {concurrency}, found {len(exps)}")
    requests = exps[0].get("requests") or []
    ttft, itl, latency, tokens, responses, taus = [], [], [], [], [], []
    sources = set()
    starts, ends = [], []
    for i, r in enumerate(requests):
        try:
            sent, times, outputs = r["timestamp"], r["response_timestamps"], r["response_outputs"]
        except KeyError as exc:
            raise ProfileExportError(f"{where}: request {i} lacks {exc}") from exc
        if not times:
            raise ProfileExportError(f"{where}: request {i} got no response")
        n, source = request_tokens(outputs, count_text)
        sources.add(source)
        starts.append(sent)
        ends.append(times[-1])
        ttft.append((times[0] - sent) / 1e6)
        latency.append((times[-1] - sent) / 1e6)
        if n > 1:
            itl.append((times[-1] - times[0]) / 1e6 / (n - 1))
        tokens.append(n)
        responses.append(len(times))
        final = outputs[-1] if outputs else {}
        if final.get("finish_reason") and isinstance(final.get("tau"), (int, float)):
            taus.append(float(final["tau"]))
    if not requests:
        raise ProfileExportError(f"{where}: no requests recorded at concurrency {concurrency}")
    span_s = (max(ends) - min(starts)) / 1e9
    return {
        "concurrency": concurrency,
        "requests": len(requests),
        "span_s": span_s,
        "requests_per_s": len(requests) / span_s,
        "output_tokens": sum(tokens),
        "output_tokens_per_s": sum(tokens) / span_s,
        "mean_output_tokens": stats.mean(tokens),
        "min_output_tokens": min(tokens),
        "mean_responses": stats.mean(responses),
        "ttft_ms": _dist(ttft),
        "itl_ms": _dist(itl),
        "request_latency_ms": _dist(latency),
        "server_tau": stats.mean(taus) if taus else None,
        "token_source": "/".join(sorted(sources)),
    }


# ---- the run -------------------------------------------------------------------------------------------------


def _text_counter(tokenizer_dir: Path | None) -> TokenCounter | None:
    if tokenizer_dir is None:
        return None
    from runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    return lambda text: len(tok.encode(text, add_bos=False)) if text else 0


def run_serve(config: ServeConfig, out: Path, on_level: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every concurrency level; raw perf_analyzer files go to `out`. Returns the report (JSON-ready)."""
    pa = locate(config.perf_analyzer)
    prompts = load_prompts(config.prompts or None, config.prompts_per_set)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "perf_analyzer"
    if raw.is_dir():
        # A re-run into the same results directory replaces the previous raw files (perf_analyzer refuses to
        # write a --profile-export-file that already exists).
        shutil.rmtree(raw)
    raw.mkdir()
    data = raw / "input_data.json"
    data.write_text(json.dumps(input_data(prompts, config.max_tokens, config.ignore_eos), indent=1) + "\n",
                    encoding="utf-8")
    count_text = _text_counter(config.tokenizer)
    started = time.perf_counter()
    if config.warmup:
        if on_level:
            on_level(f"warm-up: {config.warmup} request(s)")
        run_perf_analyzer(pa, command(pa, config, 1, config.warmup, data, raw / "warmup.csv",
                                      raw / "warmup.profile.json"), config.timeout_s, raw / "warmup.log")
    levels = []
    for c in config.concurrency:
        n = config.requests_at(c)
        if on_level:
            on_level(f"concurrency {c}: {n} requests")
        csv_path, export_path = raw / f"c{c}.csv", raw / f"c{c}.profile.json"
        for attempt in range(1, EXPORT_ATTEMPTS + 1):
            run_perf_analyzer(pa, command(pa, config, c, n, data, csv_path, export_path), config.timeout_s,
                              raw / f"c{c}.log")
            try:
                export = read_json_object(export_path, ProfileExportError)
                break
            except ProfileExportError as exc:
                # perf_analyzer 2.51 now and then exits 0 leaving its profile export empty or cut off at 64 KiB (seen
                # at concurrency 1, 8 and 16, its CSV and log complete): the level runs again rather than the run failing.
                if attempt == EXPORT_ATTEMPTS:
                    raise
                if on_level:
                    on_level(f"concurrency {c}: perf_analyzer left an unreadable profile export ({exc}); "
                             "running the level again")
                export_path.unlink()
        metrics = level_metrics(export, c, count_text, str(export_path))
        row = read_csv(csv_path.read_text(encoding="utf-8"), str(csv_path)).get(c)
        metrics["pa_requests_per_s"] = float(row["Inferences/Second"]) if row else None
        metrics["pa_responses_per_s"] = float(row["Response Throughput"]) if row and "Response Throughput" in row \
            else None
        levels.append(metrics)
    sources = sorted({lv["token_source"] for lv in levels})
    short = [lv["concurrency"] for lv in levels if config.ignore_eos and lv["min_output_tokens"] < config.max_tokens]
    return {
        **report_header(REPORT_FORMAT, REPORT_VERSION, config.to_dict()),
        "url": config.url,
        "model": config.model,
        "perf_analyzer": pa.describe(),
        "num_prompts": len(prompts),
        "token_source": ("the output_ids of every response" if sources == ["output_ids"]
                         else f"re-tokenized text_output ({config.tokenizer})"),
        "short_outputs_at": short,  # levels where a request returned fewer than max_tokens despite ignore_eos
        "measure_seconds": time.perf_counter() - started,
        "concurrency": levels,
    }


__all__ = [
    "PerfAnalyzerFailed",
    "ProfileExportError",
    "ServeConfig",
    "command",
    "input_data",
    "level_metrics",
    "parse_concurrency",
    "read_csv",
    "request_tokens",
    "run_serve",
]
