"""Reading the small JSON side files of checkpoints, engine directories, model repositories and results
(`read_json_object`: the one reader, so every such error reads alike and names the file), how paths are recorded,
and the temporary siblings an output directory is built in."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
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


def work_dir(output: Path, tag: str) -> Path:
    """A fresh temporary sibling of `output` to build it in: .NAME.TAG-PID-RANDOM (not created here). The pid lets a
    later run tell the leftovers of a killed run (`remove_stale_work_dirs`) from the work of one still running."""
    return output.parent / f".{output.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_work_dirs(output: Path, tag: str) -> list[Path]:
    """Remove the `work_dir`s of `output` with this tag whose process is gone (a build or render killed before it
    could clean up after itself); returns what was removed."""
    pattern = re.compile(rf"^\.{re.escape(output.name)}\.{re.escape(tag)}-(\d+)-[0-9a-f]+$")
    removed = []
    if not output.parent.is_dir():
        return removed
    for path in output.parent.iterdir():
        m = pattern.match(path.name)
        if m and path.is_dir() and not _pid_running(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
