"""Shared pytest configuration. Tiny checkpoint factories live in tests/tiny.py."""

import os

# Two cores are shared by everything on CI; torch's intra-op pool only adds contention at these sizes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
