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


@pytest.fixture
def torch_route(monkeypatch):
    """The process as it is where the weight-streaming and decoder-layer kernels cannot be built: torch's linear in
    row blocks, packed oneDNN weights, the measured row plan (runtime/model.py)."""
    import runtime.model
    from plugins import native_build
    from plugins.decoder_layer import native as decoder_layer
    from plugins.stream_linear import native as stream_linear

    monkeypatch.setenv("CC", "/nonexistent/cc")
    for module in (stream_linear, decoder_layer):
        monkeypatch.setattr(module, "_library", native_build.Lazy(module._build))
    monkeypatch.setattr(runtime.model, "_ROW_PLANS", {})
