"""Prompt sets: JSON Lines files, one prompt per line, shipped in perf/prompts/.

    {"id": "code-fib", "source": "spectree project", "prompt": "def fibonacci(n):\\n ..."}

`prompt` (non-empty text) is required; `id` (unique within a file) defaults to "line-N" (its line number), so
plain `{"prompt": ...}` files (what `builder tune-tree` reads, e.g. demo/prompts/*.jsonl) work too; `source` says
where the text comes from (written by the project, or a public-domain work). Blank lines are skipped. The set's
name is the file's stem.

    perf/prompts/code.jsonl    Python code completion (the demo model is trained on Python source)
    perf/prompts/prose.jsonl   English prose: public-domain novel openings and project-written paragraphs
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import ConfigError

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
DEFAULT_SETS = ("code", "prose")


class PromptFileError(ConfigError):
    """A prompt file is missing, not JSON Lines, or has a malformed record (the message names file and line)."""


@dataclass(frozen=True)
class Prompt:
    set: str  # the prompt set's name (file stem)
    id: str  # unique within its set
    text: str
    source: str = ""

    @property
    def key(self) -> str:
        """Unique across sets: "<set>/<id>"."""
        return f"{self.set}/{self.id}"


def default_prompt_files() -> tuple[Path, ...]:
    return tuple(PROMPTS_DIR / f"{name}.jsonl" for name in DEFAULT_SETS)


def load_prompt_file(path: str | Path) -> tuple[Prompt, ...]:
    """Read one JSON Lines prompt file; PromptFileError names the file, the line and what was wrong."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as exc:
        raise PromptFileError(f"prompt file {path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"prompt file {path}: cannot read as UTF-8 text ({exc})") from exc
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{where}: not a JSON object ({exc.msg}); expected "
                                  '{"id": "...", "prompt": "..."} on each line') from exc
        if not isinstance(record, dict):
            raise PromptFileError(f"{where}: got a JSON {type(record).__name__}, expected an object with id and prompt")
        unknown = sorted(set(record) - {"id", "prompt", "source"})
        if unknown:
            raise PromptFileError(f"{where}: unknown key(s) {unknown}; expected id, prompt and optionally source")
        pid, text, source = record.get("id", f"line-{lineno}"), record.get("prompt"), record.get("source", "")
        if not isinstance(pid, str) or not pid or "/" in pid:
            raise PromptFileError(f"{where}: id: got {pid!r}, expected a non-empty string without '/'")
        if not isinstance(text, str) or not text.strip():
            raise PromptFileError(f"{where}: prompt: got {text!r}, expected non-empty text")
        if not isinstance(source, str):
            raise PromptFileError(f"{where}: source: got {source!r}, expected a string")
        if pid in seen:
            raise PromptFileError(f"{where}: id {pid!r} repeats the id on line {seen[pid]}")
        seen[pid] = lineno
        prompts.append(Prompt(set=path.stem, id=pid, text=text, source=source))
    if not prompts:
        raise PromptFileError(f"prompt file {path} holds no prompts")
    return tuple(prompts)


def load_prompts(files: Sequence[str | Path] | None = None, limit: int | None = None) -> tuple[Prompt, ...]:
    """The prompts of several files (default: the shipped sets), at most `limit` from each file."""
    paths = [Path(f) for f in files] if files else list(default_prompt_files())
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise PromptFileError(f"prompt limit: got {limit!r}, expected an integer >= 1 (prompts per file)")
    out: list[Prompt] = []
    names: dict[str, Path] = {}
    for p in paths:
        if p.stem in names:
            raise PromptFileError(f"prompt files {names[p.stem]} and {p} have the same set name {p.stem!r} "
                                  "(the file stem); rename one")
        names[p.stem] = p
        out.extend(load_prompt_file(p)[:limit])
    return tuple(out)


__all__ = [
    "DEFAULT_SETS",
    "PROMPTS_DIR",
    "Prompt",
    "PromptFileError",
    "default_prompt_files",
    "load_prompt_file",
    "load_prompts",
]
