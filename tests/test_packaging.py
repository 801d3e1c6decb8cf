"""Packaging: the distribution name (ours, not the unrelated "spectree" on the package index) and one console
script per CLI, each resolving to its package's `__main__.main` (which `python -m <package>` also runs), and every
native kernel's C source in the package data."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
CLIS = {"spectree-run": "runtime", "spectree-build": "builder", "spectree-repo": "model_repo",
        "spectree-deploy": "deploy", "spectree-perf": "perf"}


def test_distribution_name_is_ours():
    from builder.build import DISTRIBUTION

    assert PROJECT["name"] == DISTRIBUTION == "spectree-llm"
    assert "pip install -q -e" in (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    assert "spectree-llm" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_console_scripts_are_the_five_clis():
    assert PROJECT["scripts"] == {name: f"{package}.__main__:main" for name, package in CLIS.items()}


@pytest.mark.parametrize("script", sorted(CLIS))
def test_console_script_resolves_to_a_callable_main(script, capsys):
    module_name, _, attr = PROJECT["scripts"][script].partition(":")
    main = getattr(importlib.import_module(module_name), attr)
    assert callable(main) and list(inspect.signature(main).parameters) == ["argv"]
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out
    # `python -m <package>` runs the same main.
    source = (ROOT / module_name.replace(".", "/")).with_suffix(".py").read_text(encoding="utf-8")
    assert 'if __name__ == "__main__":' in source and "main()" in source.split('if __name__ == "__main__":')[1]


def test_installed_entry_points_match_pyproject():
    """Once scripts/setup.sh has installed this checkout (editable), its metadata carries the same scripts."""
    try:
        dist = importlib.metadata.distribution(PROJECT["name"])
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{PROJECT['name']} is not installed here (run scripts/setup.sh)")
    installed = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert installed == PROJECT["scripts"]


def test_every_native_kernel_source_ships_in_the_package():
    """Each plugin's C source is compiled on first use from the installed package: a wheel without it loses the kernel
    (the runtime falls back to slower torch routes), so every .c under plugins/ must match a package-data pattern."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"][
        "package-data"]["plugins"]
    sources = sorted(p.relative_to(ROOT / "plugins") for p in (ROOT / "plugins").rglob("*.c"))
    assert sources
    assert [str(s) for s in sources if not any(s.match(pattern) for pattern in patterns)] == []
