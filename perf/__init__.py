"""Benchmarks and GPU checks (run on a CUDA machine; see each module's docstring)."""
