"""Reading the small JSON files checkpoints carry (errors name the file), and how paths are recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.errors import SpectreeError


def read_json_object(path: Path, error: type[SpectreeError]) -> dict[str, Any]:
    """The JSON object in `path`; any read/parse failure or non-object content raises `error` naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def shown_path(path: str | Path) -> str:
    """A path as recorded in files that get committed (training summaries, benchmark reports): relative to the
    working directory when inside it (commands run from the repository root), so a record does not carry one
    machine's absolute layout; otherwise as given."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
