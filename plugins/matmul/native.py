"""Linear layers of the eager CPU runtime in one native call that streams each weight once (stream.c), built like
every plugin kernel (`plugins/native_build.py`).

Why: decoding reads every weight once per step, so a step's time is the weights' bytes over the memory bandwidth,
for one row (plain decoding) and for the 2-64 rows of a tree step alike, until the multiply-adds are the limit.
torch's CPU linear switches kernels with the number of rows (a one-row GEMV, then GEMMs that pack their inputs), and
each reads the weights far below the bandwidth at these sizes (issue #53's profile: ~7.5 GB/s at one row, ~3 GB/s at
two, on 2 AMD EPYC cores). stream.c multiplies every row of a call into each weight row while it sits in L1.

It is also row-invariant by construction (stream.c says how): a row's output does not depend on how many rows share
the call, so float32 tree steps reproduce plain decoding's logits bit for bit, not only to within ~1e-7.

`linear` returns None where the caller's torch expression must run instead: weights other than float32 on the CPU,
more than MAX_ROWS rows (a prompt chunk: a packed GEMM is faster there), autograd recording, a graph being compiled or
exported, the kernel switched off (`disabled`), or no C compiler (`unavailable()` says why).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from plugins import native_build

SOURCE = Path(__file__).with_name("stream.c")
MAX_ROWS = 64  # a tree step of up to 63 nodes + its root, or a batch of trees under the scheduler's tree budget
PROFILED_NAME = "spectree::stream_linear"  # what torch.profiler calls a kernel call


@dataclass(frozen=True)
class Stream:
    """The loaded library: `fn` is spectree_linear with its argument types set; `lanes` the width it sums in."""

    fn: ctypes._CFuncPtr
    lanes: int
    path: Path


def _build() -> Stream:
    lib, path, _ = native_build.build(SOURCE, "stream")
    fn = lib.spectree_linear
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int, i64, ptr, ptr, i64]
    fn.restype = None
    lanes = lib.spectree_linear_lanes
    lanes.restype = ctypes.c_int
    return Stream(fn, int(lanes()), path)


_library = native_build.Lazy(_build)
_state = threading.local()


def load() -> Stream | None:
    """The library, built on first call; None where it cannot be built (see `unavailable`)."""
    return _library.get()


def unavailable() -> str | None:
    """Why `load()` gave None (None while it has not been tried or when it worked)."""
    return _library.failure


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """torch's linear instead of the kernel in this thread for the block (side-by-side measurements)."""
    before = getattr(_state, "off", False)
    _state.off = True
    try:
        yield
    finally:
        _state.off = before


def covers(weight: torch.Tensor) -> bool:
    """Whether a weight like this one goes to the kernel (given few enough rows and the library)."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2


def linear(
    x: torch.Tensor,  # [..., in] float32
    weight: torch.Tensor,  # [out, in] float32
    bias: torch.Tensor | None = None,  # [out] float32
) -> torch.Tensor | None:  # [..., out] float32; None: not here
    if getattr(_state, "off", False) or torch.compiler.is_compiling() or not covers(weight):
        return None
    out_f, in_f = weight.shape
    rows = x.numel() // in_f if in_f else 0
    if (x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != in_f or not 0 < rows <= MAX_ROWS
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_f,)))):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return None
    lib = load()
    if lib is None:
        return None
    flat = x.reshape(rows, in_f)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    b = None if bias is None else bias.contiguous()
    y = torch.empty(rows, out_f, dtype=torch.float32)
    args = (flat.data_ptr(), rows, in_f, flat.stride(0), w.data_ptr(), 0, out_f, None if b is None else b.data_ptr(),
            y.data_ptr(), out_f)
    if torch.autograd._profiler_enabled():  # a named op in profiles (perf verify-cost's breakdown counts it)
        with torch.profiler.record_function(PROFILED_NAME):
            lib.fn(*args)
    else:
        lib.fn(*args)
    return y.view(*x.shape[:-1], out_f)


__all__ = ["MAX_ROWS", "PROFILED_NAME", "SOURCE", "Stream", "covers", "disabled", "linear", "load", "unavailable"]
