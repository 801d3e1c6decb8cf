"""The 95% intervals over prompts of every recorded benchmark's speedups over plain decoding and taus, recomputed from
the runs each bench.json stores (per-prompt walls, token counts, accepted lengths) with `perf.bench.speedup_interval`
and `tau_interval`, the functions `python -m perf bench` now reports them with. Run from the repository root:
    python perf/results/2026-12-05-cpu-intel-xeon-2c-intervals/intervals.py > perf/results/2026-12-05-cpu-intel-xeon-2c-intervals/intervals.md
"""

from __future__ import annotations

from pathlib import Path

from perf.bench import Run, speedup_interval, tau_interval
from runtime.errors import ConfigError
from runtime.files import read_json_object

RESULTS = Path(__file__).resolve().parent.parent
FIELDS = {"variant", "prompt", "repeat", "prompt_tokens", "wall_s", "target_forwards"}


def runs_of(report: dict) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for r in report["runs"]:
        run = Run(**{k: r[k] for k in FIELDS}, token_ids=(0,) * r["generated_tokens"],
                  accepted_per_step=tuple(r.get("accepted_per_step") or ()))
        out.setdefault(r["variant"], []).append(run)
    return out


def main() -> None:
    print("| results | prompts | variant | tau | 95% interval | vs plain | 95% interval |")
    print("|---|---:|---|---:|---|---:|---|")
    for bench in sorted(RESULTS.glob("*/bench.json")):
        report = read_json_object(bench, ConfigError)
        runs = runs_of(report)
        if "plain" not in runs:
            continue
        for v in report["variants"]:
            if v["drafter"] in ("none", "transformers"):
                continue
            lo, hi = speedup_interval(runs[v["name"]], runs["plain"])
            tau_ci = tau_interval(runs[v["name"]])
            tau = f"{v['tau']:.2f} | {tau_ci[0]:.2f}-{tau_ci[1]:.2f}" if v.get("tau") and tau_ci else "— | —"
            print(f"| {bench.parent.name} | {len(report['prompts'])} | {v['name']} | {tau} "
                  f"| {v['speedup_vs_plain']:.2f}x | {lo:.2f}-{hi:.2f} |")


if __name__ == "__main__":
    main()
