"""runtime.files: the one reader of JSON side files (engine.json, config.json, index files, repository manifests,
results), and that nothing else reads such a file itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runtime.errors import CheckpointError, ConfigError
from runtime.files import read_json_object

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "builder", "model_repo", "deploy", "perf", "plugins")


def test_read_json_object_names_the_file(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text('{"format": "x"}', encoding="utf-8")
    assert read_json_object(path, ConfigError) == {"format": "x"}
    with pytest.raises(CheckpointError, match=rf"cannot read {re.escape(str(tmp_path / 'missing.json'))}"):
        read_json_object(tmp_path / "missing.json", CheckpointError)
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"cannot read {re.escape(str(path))}: Expecting property name"):
        read_json_object(path, ConfigError)
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ConfigError, match="engine.json must hold a JSON object, got list"):
        read_json_object(path, ConfigError)


def test_json_files_are_read_through_the_one_reader():
    """A file's text parsed as JSON in place (json.loads(... read_text ...), json.load(f)) bypasses the reader."""
    pattern = re.compile(r"json\.loads?\([^)]*(read_text|read_bytes|open\()|json\.load\(")
    offenders = [f"{path.relative_to(ROOT)}:{n}"
                 for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
                 for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if pattern.search(line) and path != ROOT / "runtime" / "files.py"]
    assert offenders == []
