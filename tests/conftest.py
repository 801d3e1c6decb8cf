"""Shared pytest configuration. Tiny checkpoint factories live in tests/tiny.py."""

import os

# Two cores are shared by everything on CI; torch's intra-op pool only adds contention at these sizes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def extra_serve_args() -> list[str]:
    """More `python -m deploy serve` flags for a test module's server (tests/test_serving.py's `served` fixture);
    a module that needs some (e.g. --openai-port) overrides this fixture."""
    return []
