"""spectree runtime: lossless tree speculative decoding for Llama-family models.

    import runtime
    dec = runtime.load("path/to/hf_dir", draft="medusa", draft_model="path/to/heads", tree="mc_sim_7b_63")
    out = dec.generate("def fib(n):", SamplingParams(max_tokens=64))      # or dec.stream(...)

Submodules are imported lazily so `import runtime` stays cheap and side-effect free.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load", "LoadConfig", "SamplingParams", "SpecDecoder", "Tree"]

_LAZY = {
    "load": "runtime.api",
    "LoadConfig": "runtime.api",
    "SamplingParams": "runtime.sampling",
    "SpecDecoder": "runtime.decode",
    "Tree": "runtime.tree",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
