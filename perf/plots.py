"""PNG plots of bench and serve reports (matplotlib, Agg backend: no display needed).

    speedup_by_tree_size.png   speedup against plain decoding and against transformers, by mean tree size
    acceptance_by_depth.png    P(accepted length >= d) per speculative variant
    time_split.png             where each runtime variant's time goes (prefill / draft / verify / other)
    serve_latency.png          perf serve: throughput, output tokens/s, TTFT and inter-token latency by concurrency
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MARKERS = {"lookup": "s", "medusa": "o", "eagle": "^", "none": "D", "transformers": "x"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _title(report: dict[str, Any]) -> str:
    t, m = report["target"], report["machine"]
    return (f"{t['architecture']} {t['parameters'] / 1e6:.1f}M params, {t['dtype']} | {m['cpu_model']}, "
            f"{report['settings']['threads']} thread(s) | {report['settings']['max_tokens']} tokens")


def speedup_by_tree_size(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    spec = [v for v in report["variants"] if v["kind"] == "speculative"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for ax, key, baseline in ((axes[0], "speedup_vs_plain", "plain decoding (our runtime)"),
                              (axes[1], "speedup_vs_hf", "transformers generate (greedy)")):
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        for kind in sorted({v["drafter"] for v in spec}):
            pts = [v for v in spec if v["drafter"] == kind and v.get(key) is not None and v.get("mean_tree_nodes")]
            if not pts:
                continue
            ax.scatter([v["mean_tree_nodes"] for v in pts], [v[key] for v in pts], marker=MARKERS.get(kind, "o"),
                       s=48, label=kind)
            for v in pts:
                ax.annotate(v["name"] + (" (configured)" if v.get("configured") else ""),
                            (v["mean_tree_nodes"], v[key]), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            fontweight="bold" if v.get("configured") else "normal")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree size: nodes per verification step (mean, root included)")
        ax.set_title(f"vs {baseline}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup (tokens/s ratio)")
    if spec:
        axes[0].legend(fontsize=8)
    fig.suptitle(_title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance_by_depth(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for v in report["variants"]:
        reach = v.get("acceptance_by_depth")
        if v["kind"] != "speculative" or not reach:
            continue
        ax.plot(range(1, len(reach) + 1), reach, marker=MARKERS.get(v["drafter"], "o"),
                label=f"{v['name']} (tau {v['tau']:.2f})")
    ax.set_xlabel("depth d (draft tokens into the tree)")
    ax.set_ylabel("P(accepted length >= d)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_title(report), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["acceptance_by_depth", "bench_plots", "serve_plot", "speedup_by_tree_size", "time_split"]
