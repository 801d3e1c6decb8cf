"""PNG plots of bench and serve reports (matplotlib, Agg backend: no display needed).

    speedup_by_tree_size.png   speedup against plain decoding, transformers' greedy generate and (when measured)
                               the best of transformers' speculative variants and llama.cpp's plain decoding at our
                               dtype's precision, by mean tree size; transformers' speculative variants and the
                               llama.cpp variants (no tree size) as horizontal lines
    acceptance_by_depth.png    P(accepted length >= d) per speculative variant
    time_split.png             where each runtime variant's time goes (prefill / draft / verify / other)
    serve_latency.png          perf serve: throughput, output tokens/s, TTFT and inter-token latency by concurrency
    verify_cost.png            perf verify-cost: verify(N) / verify(1) and ms per forward, by N, per dtype and mask
    batch_throughput.png       perf batch: tokens/s of N concurrent requests, batched vs sequential; TTFT and ITL
    gpu_check.png              perf gpu-check: verify(N) / verify(1) by N; the kernel's time against its bytes' floor
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perf.report import label, measured_dtypes

KIND_MARKERS = ("o", "^", "s", "D", "v", "P", "*")  # our drafter kinds', in registry order
TRANSFORMERS_MARKER = "x"
PEER_COLORS = ("tab:red", "tab:purple", "tab:brown")  # transformers' speculative variants (horizontal lines)
LLAMA_COLORS = ("tab:green", "tab:olive", "tab:cyan", "tab:pink")  # llama.cpp's variants (horizontal lines)
OTHER_ENGINES = ("transformers", "llama.cpp")


def marker(drafter: str) -> str:
    """A report's drafter ("transformers", or one of our kinds) -> its plot marker."""
    from runtime.draft_spec import kind_names

    names = kind_names()
    if drafter in names:
        return KIND_MARKERS[names.index(drafter) % len(KIND_MARKERS)]
    return TRANSFORMERS_MARKER if drafter == "transformers" else KIND_MARKERS[0]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    """Every plot's last step: lay out, write the PNG, free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _title(report: dict[str, Any]) -> str:
    t, m = report["target"], report["machine"]
    return (f"{t['architecture']} {t['parameters'] / 1e6:.1f}M params, {t['dtype']} | {m['cpu_model']}, "
            f"{report['settings']['threads']} thread(s) | {report['settings']['max_tokens']} tokens")


def speedup_by_tree_size(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    variants = report["variants"]
    spec = [v for v in variants if v["kind"] == "speculative" and v["drafter"] not in OTHER_ENGINES]
    peers = [v for v in variants if v["kind"] == "speculative" and v["drafter"] == "transformers"]
    llama = [v for v in variants if v["drafter"] == "llama.cpp"]
    panels = [("speedup_vs_plain", "plain decoding (our runtime)"), ("speedup_vs_hf", "transformers generate (greedy)")]
    if report.get("best_hf"):
        panels.append(("speedup_vs_best_hf", f"the best transformers speculative variant ({report['best_hf']})"))
    if (report.get("llama_cpp") or {}).get("reference"):
        panels.append(("speedup_vs_llama_cpp", report["llama_cpp"]["reference"]))
    # a panel only for a baseline that was measured (without --no-hf's transformers, no "vs hf" panel)
    panels = [(key, baseline) for key, baseline in panels if any(v.get(key) is not None for v in variants)] or panels[:1]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, (key, baseline) in zip(axes, panels):
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        for i, v in enumerate(p for p in peers if p.get(key) is not None):
            color = PEER_COLORS[i % len(PEER_COLORS)]
            ax.axhline(v[key], color=color, lw=1.4, ls="-.", label=f"{v['name']} (transformers)")
            ax.annotate(v["name"], (1.0, v[key]), xycoords=("axes fraction", "data"), xytext=(-4, 3),
                        textcoords="offset points", ha="right", fontsize=7, color=color)
        ours = next((v for v in variants if v["name"] == "plain"), None)
        if key != "speedup_vs_plain" and ours is not None and ours.get(key) is not None:  # our plain decoding
            ax.axhline(ours[key], color="black", lw=1.2, ls="--", label="plain (ours)")
            ax.annotate("plain (ours)", (0.0, ours[key]), xycoords=("axes fraction", "data"), xytext=(4, 3),
                        textcoords="offset points", ha="left", fontsize=7)
        for i, v in enumerate(p for p in llama if p.get(key) is not None):
            color = LLAMA_COLORS[i % len(LLAMA_COLORS)]
            ax.axhline(v[key], color=color, lw=1.2, ls=":", label=v["name"])
            ax.annotate(v["name"], (0.0, v[key]), xycoords=("axes fraction", "data"), xytext=(4, 3),
                        textcoords="offset points", ha="left", fontsize=7, color=color)
        for kind in sorted({v["drafter"] for v in spec}):
            pts = [v for v in spec if v["drafter"] == kind and v.get(key) is not None and v.get("mean_tree_nodes")]
            if not pts:
                continue
            ax.scatter([v["mean_tree_nodes"] for v in pts], [v[key] for v in pts], marker=marker(kind),
                       s=48, label=kind)
            for v in pts:
                ax.annotate(label(v),
                            (v["mean_tree_nodes"], v[key]), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            fontweight="bold" if v.get("configured") else "normal")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree size: nodes per verification step (mean, root included)")
        ax.set_title(f"vs {baseline}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup (tokens/s ratio)")
    if spec or peers or llama:
        axes[0].legend(fontsize=7)
    fig.suptitle(_title(report), fontsize=9)
    return _save(plt, fig, path)


def acceptance_by_depth(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for v in report["variants"]:
        reach = v.get("acceptance_by_depth")
        if v["kind"] != "speculative" or not reach:
            continue
        ax.plot(range(1, len(reach) + 1), reach, marker=marker(v["drafter"]),
                label=f"{v['name']} (tau {v['tau']:.2f})")
    ax.set_xlabel("depth d (draft tokens into the tree)")
    ax.set_ylabel("P(accepted length >= d)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_title(report), fontsize=8)
    return _save(plt, fig, path)


def time_split(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    rows = [v for v in report["variants"] if v.get("time_split_s")]
    parts = ("prefill", "draft", "verify", "other")
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.6))
    left = [0.0] * len(rows)
    for part in parts:
        # milliseconds per generated token, so the bars compare directly across variants
        widths = [1e3 * v["time_split_s"][part] / v["generated_tokens"] for v in rows]
        ax.barh([v["name"] for v in rows], widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per generated token")
    ax.legend(fontsize=8, ncol=4, loc="lower right")
    ax.set_title(_title(report), fontsize=8)
    return _save(plt, fig, path)


def bench_plots(report: dict[str, Any], out: Path) -> list[Path]:
    return [speedup_by_tree_size(report, out / "speedup_by_tree_size.png"),
            acceptance_by_depth(report, out / "acceptance_by_depth.png"),
            time_split(report, out / "time_split.png")]


def serve_plot(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    rows = report["concurrency"]
    x = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    tps = [r["output_tokens_per_s"] for r in rows]
    axes[0].plot(x, tps, marker="o")
    for c, y, r in zip(x, tps, rows):
        axes[0].annotate(f"{r['requests_per_s']:.2f} req/s", (c, y), textcoords="offset points", xytext=(0, 6),
                         ha="center", fontsize=7)
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_ylim(0, 1.18 * max(tps))  # room for the labels
    axes[0].set_title("throughput (labels: requests/s)", fontsize=10)
    for ax, key, title in ((axes[1], "ttft_ms", "time to first token"), (axes[2], "itl_ms", "inter-token latency")):
        for stat, style in (("p50", "-o"), ("p90", "--s"), ("p99", ":^")):
            ax.plot(x, [r[key][stat] for r in rows], style, label=stat)
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)
        ax.set_xticks(x)
    m = report["machine"]
    fig.suptitle(f"perf_analyzer on {report['model']} ({report['url']}, gRPC streaming) | {m['cpu_model']}, "
                 f"{m['usable_cores']} cores | {report['settings']['max_tokens']} tokens per request", fontsize=9)
    return _save(plt, fig, path)


def verify_cost_plot(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    sizes = report["settings"]["sizes"]
    rows = report["results"]
    axes[0].axhline(1.0, color="grey", lw=1, ls="--", label="ideal: weights-bound (1.0)")
    for i, dtype in enumerate(measured_dtypes(report)):
        for mask, style in (("chain", "-o"), ("tree", "--^")):
            line = sorted((r for r in rows if r["dtype"] == dtype and r["mask"] == mask), key=lambda r: r["size"])
            label = f"{dtype}, {mask}"
            axes[0].plot([r["size"] for r in line], [r["ratio"] for r in line], style, color=f"C{i}", label=label)
            axes[1].plot([r["size"] for r in line], [r["median_ms"] for r in line], style, color=f"C{i}", label=label)
    for ax, ylabel, title in ((axes[0], "verify(N) / verify(1)", "cost of verifying N tokens, relative to one"),
                              (axes[1], "ms per forward (median)", "one target forward over N new tokens")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(n) for n in sizes])
        ax.set_xlabel("N: new tokens in one forward")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylim(bottom=0)
    t, m, s = report["target"], report["machine"], report["settings"]
    fig.suptitle(f"{t['architecture']} {t['parameters'] / 1e6:.1f}M params on {t['device']} | {m['cpu_model']}, "
                 f"{s['threads']} thread(s) | context {s['context']}, median of {s['repeats']}", fontsize=9)
    return _save(plt, fig, path)


def batch_plot(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    rows = sorted(report["levels"], key=lambda r: r["concurrency"])
    x = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, style in (("sequential", "--s"), ("batched", "-o")):
        axes[0].plot(x, [r[mode]["tokens_per_s"] for r in rows], style, label=mode)
    for c, r in zip(x, rows):
        axes[0].annotate(f"{r['speedup']:.2f}x", (c, r["batched"]["tokens_per_s"]), textcoords="offset points",
                         xytext=(0, 6), ha="center", fontsize=7)
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput (labels: batched / sequential)", fontsize=10)
    axes[0].set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    for stat, style in (("p50", "-o"), ("p90", "--s")):
        axes[1].plot(x, [r["batched"]["ttft_ms"][stat] for r in rows], style, color="C2", label=f"TTFT {stat}")
        itl = [r["batched"]["itl_ms"][stat] if r["batched"]["itl_ms"] else float("nan") for r in rows]
        axes[1].plot(x, itl, style, color="C3", label=f"inter-token {stat}")
    axes[1].set_ylabel("ms")
    axes[1].set_yscale("log")
    axes[1].set_title("batched requests' latency", fontsize=10)
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("concurrent requests (N)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([str(n) for n in x])
        ax.grid(alpha=0.3)
    t, m, d = report["target"], report["machine"], report["drafter"]
    fig.suptitle(f"in-flight batching | {t['architecture']} {t['parameters'] / 1e6:.1f}M params, {t['dtype']}, "
                 f"drafter {d['drafter']} | {m['cpu_model']}, {report['settings']['threads']} thread(s) | "
                 f"{report['settings']['max_tokens']} tokens per request", fontsize=9)
    return _save(plt, fig, path)


def gpu_check_plot(report: dict[str, Any], path: Path) -> Path:
    """Left: verify(N) / verify(1) by N (chain and tree masks); right: the tree-attention kernel's time over the
    floor its bytes set at the measured copy bandwidth, by tree size, per dtype and prefix length."""
    plt = _pyplot()
    s = report["sections"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    if "verify" in s:
        v = s["verify"]
        for mask, style in (("chain", "-o"), ("tree", "--^")):
            line = sorted((r for r in v["rows"] if r["mask"] == mask), key=lambda r: r["size"])
            axes[0].plot([r["size"] for r in line], [r["ratio"] for r in line], style, ms=3, label=mask)
        axes[0].axhline(1.0, color="grey", lw=1, ls="--")
        axes[0].set_xscale("log", base=2)
        axes[0].set_ylim(bottom=0)
        axes[0].set_xlabel("N: new tokens in one forward")
        axes[0].set_ylabel("verify(N) / verify(1)")
        model = v["model"]
        axes[0].set_title(f"{model['parameters'] / 1e9:.2f}B random Llama-shaped model, {model['dtype']}, "
                          f"context {model['context']}", fontsize=10)
        axes[0].legend(fontsize=8)
        axes[0].grid(alpha=0.3)
    if "bandwidth" in s:
        b = s["bandwidth"]
        groups = sorted({(r["dtype"], r["prefix"]) for r in b["rows"]})
        for i, (dtype, prefix) in enumerate(groups):
            line = sorted((r for r in b["rows"] if (r["dtype"], r["prefix"]) == (dtype, prefix)),
                          key=lambda r: r["tree"])
            axes[1].plot([r["tree"] for r in line], [r["kernel_ms"] / r["floor_ms"] for r in line],
                         "-o" if dtype == groups[0][0] else "--^", color=f"C{i % 10}", label=f"{dtype}, L {prefix}")
        axes[1].set_xscale("log", base=2)
        axes[1].set_yscale("log")
        axes[1].set_xlabel("N: tree tokens")
        axes[1].set_ylabel("kernel time / bytes-floor time")
        axes[1].set_title(f"tree-attention kernel vs its bytes at {b['copy_gbps']:.0f} GB/s (1 = at the floor)",
                          fontsize=10)
        axes[1].legend(fontsize=7)
        axes[1].grid(alpha=0.3)
    m = report["machine"]
    fig.suptitle(f"gpu-check | {m.get('gpu') or m.get('cpu_model')} | torch {m['torch']}"
                 f"{' | DRY RUN: not measurements' if report['dry_run'] else ''}", fontsize=9)
    return _save(plt, fig, path)


__all__ = ["acceptance_by_depth", "batch_plot", "bench_plots", "gpu_check_plot", "serve_plot", "speedup_by_tree_size",
           "time_split", "verify_cost_plot"]
