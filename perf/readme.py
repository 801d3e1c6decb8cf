"""Keep perf/README.md showing the latest committed results (`python -m perf readme`).

The README's section between the two markers below is replaced by the newest results directory's bench.md
(and serve.md when present), with image links rewritten relative to the README. Results directories are
named <YYYY-MM-DD>-<machine>; the newest is the one whose bench.json was created last (`latest_results`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from perf.report import bench_markdown, serve_markdown
from runtime.errors import ConfigError
from runtime.files import read_json_object

START = "<!-- latest-results:start (python -m perf readme) -->"
END = "<!-- latest-results:end -->"
PERF_DIR = Path(__file__).resolve().parent
BENCH_IMAGES = ("speedup_by_tree_size.png", "acceptance_by_depth.png", "time_split.png")
SERVE_IMAGES = ("serve_latency.png",)


def latest_results(results: Path) -> Path:
    """The results directory whose bench.json was created last (its "created" time; two machines' runs can share a
    date), the directory name breaking ties."""
    dirs = [d for d in results.iterdir() if d.is_dir() and (d / "bench.json").is_file()] if results.is_dir() else []
    if not dirs:
        raise ConfigError(f"no results directory with a bench.json under {results}")
    return max(dirs, key=lambda d: (_created(d / "bench.json"), d.name))


def _created(bench_json: Path) -> str:
    try:
        created = read_json_object(bench_json, ConfigError).get("created", "")
    except ConfigError:
        return ""
    return created if isinstance(created, str) else ""


def _demote(markdown: str) -> str:
    """The report's own '# title' becomes a '###' heading inside the README section."""
    return re.sub(r"^# ", "### ", markdown, count=1, flags=re.MULTILINE)


def section(results_dir: Path, readme_dir: Path) -> str:
    rel = Path(os.path.relpath(results_dir.resolve(), readme_dir.resolve()))
    bench = read_json_object(results_dir / "bench.json", ConfigError)
    parts = [(f"Latest: [`{rel.as_posix()}/`]({rel.as_posix()}/) (regenerate this section with "
             "`python -m perf readme`)."), "",
             _demote(bench_markdown(bench, [f"{rel.as_posix()}/{name}" for name in BENCH_IMAGES
                                            if (results_dir / name).is_file()]))]
    if (results_dir / "serve.json").is_file():
        serve = read_json_object(results_dir / "serve.json", ConfigError)
        parts.append(_demote(serve_markdown(serve, [f"{rel.as_posix()}/{name}" for name in SERVE_IMAGES
                                                    if (results_dir / name).is_file()])))
    return "\n".join(parts)


def update_readme(readme: Path = PERF_DIR / "README.md", results: Path = PERF_DIR / "results") -> Path:
    """Rewrite the marked section of `readme` from the newest results directory; returns that directory."""
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text or text.index(START) > text.index(END):
        raise ConfigError(f"{readme}: expected the markers {START!r} and {END!r} around the results section")
    latest = latest_results(results)
    body = section(latest, readme.parent)
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{body}\n{END}{tail}", encoding="utf-8")
    return latest


__all__ = ["END", "START", "latest_results", "section", "update_readme"]
