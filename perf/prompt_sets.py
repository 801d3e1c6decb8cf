"""Prompt sets shipped in perf/prompts/ (the file format and its reader: `runtime.prompts`).

    perf/prompts/code.jsonl    Python code completion (the demo model is trained on Python source)
    perf/prompts/prose.jsonl   English prose: public-domain novel openings and project-written paragraphs
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from runtime.errors import ConfigError
from runtime.prompts import Prompt, load_prompt_file

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
DEFAULT_SETS = ("code", "prose")


def default_prompt_files() -> tuple[Path, ...]:
    return tuple(PROMPTS_DIR / f"{name}.jsonl" for name in DEFAULT_SETS)


def load_prompts(files: Sequence[str | Path] | None = None, limit: int | None = None) -> tuple[Prompt, ...]:
    """The prompts of several files (default: the shipped sets), at most `limit` from each file."""
    paths = [Path(f) for f in files] if files else list(default_prompt_files())
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"prompt limit: got {limit!r}, expected an integer >= 1 (prompts per file)")
    out: list[Prompt] = []
    names: dict[str, Path] = {}
    for p in paths:
        if p.stem in names:
            raise ConfigError(f"prompt files {names[p.stem]} and {p} have the same set name {p.stem!r} "
                                  "(the file stem); rename one")
        names[p.stem] = p
        out.extend(load_prompt_file(p)[:limit])
    return tuple(out)


__all__ = [
    "DEFAULT_SETS",
    "PROMPTS_DIR",
    "Prompt",
    "default_prompt_files",
    "load_prompt_file",
    "load_prompts",
]
