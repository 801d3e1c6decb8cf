"""`inspect_engine(dir)`: what an engine directory holds, and whether every file still matches engine.json."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.engine import MANIFEST, iter_files, open_engine, sha256_file


@dataclass(frozen=True)
class FileStatus:
    path: str
    size: int  # recorded size
    status: str  # "ok" | "missing" | "size mismatch" | "sha256 mismatch" | "unverified"


@dataclass(frozen=True)
class EngineReport:
    root: Path
    manifest: dict[str, Any]
    files: tuple[FileStatus, ...]
    unlisted: tuple[str, ...]  # files present but not in engine.json (ignored by the runtime)

    @property
    def ok(self) -> bool:
        return all(f.status in ("ok", "unverified") for f in self.files)

    @property
    def problems(self) -> tuple[FileStatus, ...]:
        return tuple(f for f in self.files if f.status not in ("ok", "unverified"))

    def summary(self) -> dict[str, Any]:
        """JSON-ready overview (the CLI's --json output)."""
        m = self.manifest
        draft = m["draft"]
        return {
            "engine": str(self.root),
            "format_version": m["format_version"],
            "model": {k: m["model"][k] for k in ("architecture", "num_hidden_layers", "hidden_size", "vocab_size")},
            "dtype": m["dtype"],
            "draft": {"method": draft["method"], "tree": draft.get("tree"), "options": draft.get("options")},
            "limits": m["limits"],
            "trtllm": {k: m["trtllm"].get(k) for k in ("architecture", "tp_size", "choices")},
            "onnx": m["onnx"].get("status"),
            "tensorrt": {"status": m["tensorrt"].get("status"), "reason": m["tensorrt"].get("reason")},
            "provenance": {k: m["provenance"].get(k) for k in ("tool", "version", "built_at", "config_hash")},
            "files": {f.path: {"size": f.size, "status": f.status} for f in self.files},
            "unlisted": list(self.unlisted),
            "ok": self.ok,
        }


def inspect_engine(
    root: str | Path, verify: bool = True, on_bytes: Callable[[int], None] | None = None
) -> EngineReport:
    """Read engine.json and, with verify, check every listed file's size and sha256 (on_bytes: progress)."""
    engine = open_engine(root)
    files = []
    for rel, entry in sorted(engine.manifest["files"].items()):
        path = engine.root / rel
        if not path.is_file():
            status = "missing"
        elif path.stat().st_size != entry["size"]:
            status = "size mismatch"
        elif not verify:
            status = "unverified"
        else:
            status = "ok" if sha256_file(path, on_bytes) == entry["sha256"] else "sha256 mismatch"
        files.append(FileStatus(rel, int(entry["size"]), status))
    listed = set(engine.manifest["files"]) | {MANIFEST}
    unlisted = tuple(rel for rel in iter_files(engine.root) if rel not in listed)
    return EngineReport(root=engine.root, manifest=engine.manifest, files=tuple(files), unlisted=unlisted)


__all__ = ["inspect_engine", "EngineReport", "FileStatus"]
