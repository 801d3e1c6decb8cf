"""`python -m perf serve --tool genai-perf`: NVIDIA's genai-perf against a served repository's Triton endpoint
(gRPC, the `ensemble` with tensorrtllm_backend's tensors: `--backend tensorrtllm --endpoint-type kserve`) and, when
given, its OpenAI-compatible endpoint (`--endpoint-type completions` or `chat`), one concurrency at a time, with
the server's speculative-decoding statistics for the same requests beside genai-perf's numbers.

Why genai-perf (0.0.16, `pip install genai-perf`, installed by scripts/setup.sh) and not aiperf (0.13): both install
and run here without a GPU, but aiperf speaks HTTP only (OpenAI-style, template and raw endpoints), so it cannot
drive Triton's gRPC stream; genai-perf drives both endpoints, through the same perf_analyzer 2.51 binary
`perf serve` already uses (perf/analyzer.py makes it runnable here). Measured with perf_analyzer 2.51: a
--warmup-request-count below the concurrency hangs it (at concurrency 2 with 1 warm-up request, on both the gRPC
and the OpenAI service kinds), so each level warms up with as many requests as its concurrency.

Every request asks for exactly `max_tokens` output tokens (max_tokens and min_tokens, tensorrtllm_backend's
name for the Triton endpoint and vLLM's extra field for the OpenAI one), greedy (temperature 0), on the prompt
sets (genai-perf's --input-file, JSON Lines of {"text"}). genai-perf counts tokens by re-tokenizing the text with
the engine's tokenizer (--tokenizer). Its own exports (profile_export_genai_perf.json / .csv, its inputs and the
raw perf_analyzer profile) stay under OUT/genai_perf/<endpoint>-c<N>/; the report keeps, per endpoint and level:
TTFT, inter-token latency, request latency, ISL and OSL (avg, p50, p90, p99), output tokens/s and requests/s, and
from Triton's metrics port (before / after the level): drafts (verification steps), draft tokens (positions),
accepted tokens, acceptance rate and mean accepted length, in vLLM's meanings (runtime/decode.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perf.analyzer import locate
from perf.machine import report_header, settings_dict
from perf.prompt_sets import load_prompts
from runtime import schema
from runtime.errors import ConfigError, SpectreeError
from runtime.files import read_json_object
from runtime.schema import setting

REPORT_FORMAT = "spectree-genai-perf"
REPORT_VERSION = 1
GENAI_PERF_PIN = "genai-perf==0.0.16"
ENDPOINT_TYPES = ("completions", "chat")
# genai-perf's metrics (profile_export_genai_perf.json keys) the report keeps, and the statistics of each.
METRICS = ("time_to_first_token", "inter_token_latency", "request_latency", "input_sequence_length",
           "output_sequence_length")
STATS = ("avg", "p50", "p90", "p99")
# Triton metrics (counters, summed over their label sets) behind the speculation statistics.
SPEC_COUNTERS = {"steps": "spectree_verify_steps_total", "draft_tokens": "spectree_draft_tokens_total",
                 "accepted_tokens": "spectree_accepted_tokens_total",
                 "generated_tokens": "spectree_generated_tokens_total"}


class GenaiPerfMissing(SpectreeError, RuntimeError):
    """genai-perf is not installed (the message says how to install it)."""


class GenaiPerfFailed(SpectreeError, RuntimeError):
    """genai-perf ran but failed; its output is quoted."""


def _host_port(value: str, name: str) -> str:
    host, sep, port = value.removeprefix("http://").rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}: got {value!r}, expected HOST:PORT")
    return f"{host}:{port}"


@dataclass(frozen=True)
class GenaiPerfConfig:
    """`perf serve --tool genai-perf` (the flags shared with perf_analyzer's run keep their meanings)."""

    url: str  # Triton gRPC endpoint HOST:PORT
    model: str  # the Triton model (ensemble: tensorrtllm_backend's tensors)
    tokenizer: Path  # the engine directory (tokenizer.json, tokenizer_config.json): genai-perf re-tokenizes text
    openai_url: str | None = None  # the OpenAI-compatible API, HOST:PORT (python -m deploy serve --openai-port)
    openai_model: str | None = None  # its model id (GET /v1/models)
    # completions | chat (chat needs the engine's chat template)
    openai_endpoint_type: str = setting("completions", choices=ENDPOINT_TYPES)
    metrics_url: str | None = None  # Triton's metrics endpoint (http://HOST:PORT/metrics), for the speculation stats
    concurrency: tuple[int, ...] = setting((1, 2, 4, 8, 16), nonempty=True)
    prompts: tuple[Path, ...] = ()
    prompts_per_set: int | None = None
    max_tokens: int = setting(64, ge=1)  # output tokens per request, exactly
    requests: int = setting(16, ge=1)  # requests measured per level (at least 2 x the level)
    genai_perf: str | None = None  # the genai-perf executable; None: PATH, then this interpreter's bin/
    perf_analyzer: str | None = None
    timeout_s: float = 1800.0  # per genai-perf run
    out: str = "out/perf/{date}-{machine}"

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", _host_port(self.url, "url"))
        if self.openai_url is not None:
            object.__setattr__(self, "openai_url", _host_port(self.openai_url, "openai_url"))
            if not self.openai_model:
                raise ConfigError("openai_model: needed with openai_url (the model id GET /v1/models lists)")
        schema.check(self, ConfigError)
        if not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ConfigError(f"tokenizer: {str(self.tokenizer)!r} has no tokenizer.json (genai-perf counts tokens "
                              "with it: pass the engine directory)")
        if min(self.concurrency) < 1:
            raise ConfigError(f"concurrency: got {self.concurrency!r}, expected levels >= 1")

    def to_dict(self) -> dict[str, Any]:
        return settings_dict(self)


@dataclass(frozen=True)
class Endpoint:
    name: str  # "triton" | "openai"
    args: tuple[str, ...]  # genai-perf's endpoint arguments


def endpoints(config: GenaiPerfConfig) -> list[Endpoint]:
    n = str(config.max_tokens)
    out = [Endpoint("triton", ("-m", config.model, "--backend", "tensorrtllm", "--endpoint-type", "kserve",
                               "-u", config.url, "--extra-inputs", f"min_tokens:{n}"))]
    if config.openai_url is not None:
        out.append(Endpoint("openai", ("-m", config.openai_model, "--endpoint-type", config.openai_endpoint_type,
                                       "-u", config.openai_url, "--extra-inputs", f"min_tokens:{n}",
                                       "--extra-inputs", "temperature:0")))
    return out


def command(binary: Path, config: GenaiPerfConfig, endpoint: Endpoint, concurrency: int, inputs: Path,
            artifacts: Path) -> list[str]:
    requests = max(config.requests, 2 * concurrency)
    return [str(binary), "profile", *endpoint.args, "--streaming", "--tokenizer", str(config.tokenizer),
            "--input-file", str(inputs), "--output-tokens-mean", str(config.max_tokens),
            "--concurrency", str(concurrency), "--request-count", str(requests),
            # perf_analyzer 2.51 hangs when fewer warm-up requests than the concurrency are asked for
            "--warmup-request-count", str(concurrency),
            "--artifact-dir", str(artifacts), "--profile-export-file", "profile_export.json"]


def find_genai_perf(explicit: str | None = None) -> Path:
    candidates = [Path(explicit)] if explicit else []
    if not explicit:
        on_path = shutil.which("genai-perf")
        candidates += [Path(on_path)] if on_path else []
        candidates.append(Path(sys.executable).parent / "genai-perf")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    where = f"--genai-perf {explicit}" if explicit else f"not on PATH nor in {Path(sys.executable).parent}"
    raise GenaiPerfMissing(f"genai-perf not found ({where}); install it with `{sys.executable} -m pip install "
                           f"\"{GENAI_PERF_PIN}\"` (scripts/setup.sh does)")


# ---- genai-perf runnable as installed -------------------------------------------------------------------------

WRAPPER_MARK = "# spectree: genai-perf with what its perf_analyzer needs"


def entry_point_wrapper(python: Path, target: str, perf_analyzer_dir: Path, lib_dir: Path | None) -> str:
    """A shell script that runs the console-script `target` ("module:function") with `python`, perf_analyzer's
    folder first on PATH (genai-perf starts it by name) and the folder of the libraries it lacks here
    (perf.analyzer.locate) first on LD_LIBRARY_PATH."""
    import shlex

    module, function = target.split(":")
    code = f'import sys; from {module} import {function}; sys.argv[0] = "genai-perf"; sys.exit({function}())'
    lines = ["#!/bin/sh", WRAPPER_MARK + " (perf/genai.py install_entry_point, run by scripts/setup.sh)",
             f"PATH={shlex.quote(str(perf_analyzer_dir))}:\"$PATH\"", "export PATH"]
    if lib_dir is not None:
        lines += [f"LD_LIBRARY_PATH={shlex.quote(str(lib_dir))}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}",
                  "export LD_LIBRARY_PATH"]
    lines.append(f"exec {shlex.quote(str(python))} -c {shlex.quote(code)} \"$@\"")
    return "\n".join(lines) + "\n"


def install_entry_point(perf_analyzer: str | None = None) -> Path:
    """Make this environment's `genai-perf` command runnable as installed, without activating the environment or
    installing system packages: pip's console script is replaced by `entry_point_wrapper` (same entry point, the
    perf_analyzer it needs reachable). Returns the script's path; GenaiPerfMissing / PerfAnalyzerMissing when either
    tool is absent."""
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="console_scripts") if e.name == "genai-perf"]
    if not found:
        raise GenaiPerfMissing(f"genai-perf is not installed; `{sys.executable} -m pip install \"{GENAI_PERF_PIN}\"`")
    pa = locate(perf_analyzer)
    script = Path(sys.executable).parent / "genai-perf"
    tmp = script.with_name(f".genai-perf.{os.getpid()}")
    tmp.write_text(entry_point_wrapper(Path(sys.executable), found[0].value, pa.binary.parent, pa.lib_dir),
                   encoding="utf-8")
    tmp.chmod(0o755)
    os.replace(tmp, script)
    return script


# ---- Triton's metrics ----------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)$")


def counter_sums(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: sum over its label sets}."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(2))
    return sums


def scrape(url: str | None) -> dict[str, float] | None:
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return counter_sums(r.read().decode("utf-8"))
    except OSError as exc:
        raise GenaiPerfFailed(f"metrics_url {url}: cannot read Triton's metrics ({exc})") from exc


def spec_stats(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """The speculation statistics of the requests between two scrapes (vLLM's meanings)."""
    if before is None or after is None:
        return None
    d = {key: after.get(name, 0.0) - before.get(name, 0.0) for key, name in SPEC_COUNTERS.items()}
    steps, positions, accepted = d["steps"], d["draft_tokens"], d["accepted_tokens"]
    return {**{k: int(v) for k, v in d.items()},
            "acceptance_rate": accepted / positions if positions else None,
            "mean_accepted_length": 1.0 + accepted / steps if steps else None}


# ---- the run -------------------------------------------------------------------------------------------------


def level_report(export: dict[str, Any], where: str) -> dict[str, Any]:
    """genai-perf's profile_export_genai_perf.json -> the metrics the report keeps."""
    out: dict[str, Any] = {}
    try:
        for name in METRICS:
            out[name] = {s: export[name].get(s) for s in STATS} | {"unit": export[name]["unit"]}
        out["output_token_throughput"] = export["output_token_throughput"]["avg"]
        out["request_throughput"] = export["request_throughput"]["avg"]
        out["request_count"] = int(export["request_count"]["avg"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise GenaiPerfFailed(f"{where}: not a genai-perf export with {list(METRICS)} (missing {exc})") from exc
    return out


# perf_analyzer 2.51 sometimes leaves its profile export cut at a 128 KiB buffer boundary (seen once in ten levels
# on this machine; genai-perf then fails parsing it): such a level is measured again, at most this many times.
TRUNCATED_EXPORT = "JSONDecodeError: unexpected end of data"
TRUNCATED_EXPORT_RETRIES = 1


def run_genai_perf(config: GenaiPerfConfig, out: Path, on_level: Callable[[str], None] | None = None,
                   ) -> dict[str, Any]:
    """Measure every endpoint at every concurrency level; genai-perf's artifacts go to OUT/genai_perf/."""
    binary = find_genai_perf(config.genai_perf)
    pa = locate(config.perf_analyzer)
    env = {**pa.env, "PATH": f"{pa.binary.parent}{os.pathsep}{pa.env.get('PATH', os.environ.get('PATH', ''))}"}
    prompts = load_prompts(config.prompts or None, config.prompts_per_set)
    raw = out / "genai_perf"
    if raw.is_dir():
        shutil.rmtree(raw)  # a re-run replaces the previous artifacts
    raw.mkdir(parents=True)
    inputs = raw / "prompts.jsonl"
    inputs.write_text("".join(json.dumps({"text": p.text}) + "\n" for p in prompts), encoding="utf-8")
    started = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    for endpoint in endpoints(config):
        levels = []
        for c in config.concurrency:
            if on_level:
                on_level(f"{endpoint.name}: concurrency {c}")
            artifacts = raw / f"{endpoint.name}-c{c}"
            cmd = command(binary, config, endpoint, c, inputs, artifacts)
            for attempt in range(1 + TRUNCATED_EXPORT_RETRIES):
                if artifacts.is_dir():
                    shutil.rmtree(artifacts)
                before = scrape(config.metrics_url)
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=config.timeout_s,
                                          check=False)
                except subprocess.TimeoutExpired as exc:
                    raise GenaiPerfFailed(f"genai-perf did not finish within {config.timeout_s:.0f} s: "
                                          f"{' '.join(cmd)}") from exc
                artifacts.mkdir(parents=True, exist_ok=True)
                (artifacts / "genai-perf.log").write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}",
                                                         encoding="utf-8")
                if proc.returncode == 0 or TRUNCATED_EXPORT not in proc.stderr + proc.stdout:
                    break
                if on_level:
                    on_level(f"{endpoint.name}: concurrency {c}: perf_analyzer's profile export was cut short; again")
            exports = sorted(artifacts.rglob("profile_export_genai_perf.json"))
            if proc.returncode != 0 or len(exports) != 1:
                tail = (proc.stdout + proc.stderr).strip()[-1500:]
                raise GenaiPerfFailed(f"genai-perf ({endpoint.name}, concurrency {c}) exited with status "
                                      f"{proc.returncode} (log: {artifacts / 'genai-perf.log'}):\n{tail}")
            level = level_report(read_json_object(exports[0], GenaiPerfFailed), str(exports[0]))
            level["concurrency"] = c
            level["spec_decode"] = spec_stats(before, scrape(config.metrics_url))
            level["artifacts"] = str(exports[0].parent.relative_to(out))
            levels.append(level)
        results[endpoint.name] = levels
    return {
        **report_header(REPORT_FORMAT, REPORT_VERSION, config.to_dict()),
        "genai_perf": {"binary": str(binary), "version": _version(binary, env)},
        "perf_analyzer": pa.describe(),
        "num_prompts": len(prompts),
        "measure_seconds": time.perf_counter() - started,
        "endpoints": results,
    }


def _version(binary: Path, env: dict[str, str]) -> str:
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, env=env, check=False)
    return (proc.stdout or proc.stderr).strip().splitlines()[-1] if (proc.stdout or proc.stderr).strip() else "?"


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: one table per endpoint, genai-perf's metrics then the server's speculation."""
    s = report["settings"]
    lines = [f"# genai-perf: {s['model']} (Triton gRPC)" + (f" and {s['openai_model']} (OpenAI API)"
                                                           if s.get("openai_url") else ""),
             "",
             f"{report['genai_perf']['version']} over perf_analyzer {report['perf_analyzer']['version']}; "
             f"{report['num_prompts']} prompts, {s['max_tokens']} output tokens per request (greedy), "
             f"{s['requests']}+ requests per level; {report['created']}.",
             "Times in ms (avg / p50 / p90 / p99). Acceptance rate = accepted draft tokens / draft positions "
             "(steps x tree depth); mean accepted length = 1 + accepted / steps (vLLM's meanings).", ""]
    for name, levels in report["endpoints"].items():
        lines += [f"## {name}", "",
                  "| conc. | req/s | out tok/s | TTFT | ITL | request latency | ISL avg | OSL avg | accept. rate | "
                  "mean acc. len |",
                  "| ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |"]
        for lv in levels:
            def d(metric: str) -> str:
                m = lv[metric]
                return " / ".join(_fmt(m.get(k)) for k in STATS)
            spec = lv.get("spec_decode") or {}
            lines.append(f"| {lv['concurrency']} | {_fmt(lv['request_throughput'], 2)} | "
                         f"{_fmt(lv['output_token_throughput'])} | {d('time_to_first_token')} | "
                         f"{d('inter_token_latency')} | {d('request_latency')} | "
                         f"{_fmt(lv['input_sequence_length']['avg'])} | {_fmt(lv['output_sequence_length']['avg'])} | "
                         f"{_fmt(spec.get('acceptance_rate'), 3)} | {_fmt(spec.get('mean_accepted_length'), 2)} |")
        lines.append("")
    return "\n".join(lines)


__all__ = [
    "entry_point_wrapper",
    "install_entry_point",
    "GenaiPerfConfig",
    "GenaiPerfFailed",
    "GenaiPerfMissing",
    "command",
    "counter_sums",
    "endpoints",
    "level_report",
    "markdown",
    "run_genai_perf",
    "spec_stats",
]
