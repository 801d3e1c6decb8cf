"""The 95% interval over prompts of every recorded benchmark's speedup over plain decoding, recomputed from the runs
each bench.json stores (its per-prompt walls and token counts) with `perf.bench.speedup_interval`, the function that
`python -m perf bench` now reports it with. Run from the repository root:
    python perf/results/2026-12-05-cpu-intel-xeon-2c-intervals/intervals.py > perf/results/2026-12-05-cpu-intel-xeon-2c-intervals/intervals.md
"""

from __future__ import annotations

import json
from pathlib import Path

from perf.bench import Run, speedup_interval

RESULTS = Path(__file__).resolve().parent.parent
FIELDS = {"variant", "prompt", "repeat", "prompt_tokens", "wall_s", "target_forwards"}


def runs_of(report: dict) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for r in report["runs"]:
        run = Run(**{k: r[k] for k in FIELDS}, token_ids=(0,) * r["generated_tokens"])
        out.setdefault(r["variant"], []).append(run)
    return out


def main() -> None:
    print("| results | prompts | variant | tau | vs plain | 95% interval over prompts |")
    print("|---|---:|---|---:|---:|---|")
    for bench in sorted(RESULTS.glob("*/bench.json")):
        report = json.loads(bench.read_text())
        runs = runs_of(report)
        if "plain" not in runs:
            continue
        for v in report["variants"]:
            if v["drafter"] in ("none", "transformers"):
                continue
            lo, hi = speedup_interval(runs[v["name"]], runs["plain"])
            tau = f"{v['tau']:.2f}" if v.get("tau") else "—"
            print(f"| {bench.parent.name} | {len(report['prompts'])} | {v['name']} | {tau} "
                  f"| {v['speedup_vs_plain']:.2f}x | {lo:.2f}-{hi:.2f} |")


if __name__ == "__main__":
    main()
