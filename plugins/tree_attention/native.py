"""The row-invariant CPU kernel (invariant.c): compiled for this CPU on first use, called through ctypes.

Why: a bfloat16 model on CPU must give a token the same logits whether it is verified in a tree or decoded alone
(runtime/model.py, "batch invariance"). torch's SDPA does not: its reductions run in orders that depend on the number
of query rows and on where the masked keys sit, so the runtime used to attend in float64 to push those differences
below a bf16 rounding step. This kernel is row-invariant by construction (invariant.c says how) and accumulates in
float32 over bf16 or float32 K/V: 2-3x faster than float64 SDPA at 16 rows, and a quarter of its cache memory in bf16.
On CPUs with AVX512-BF16, bf16 inputs with a head size that is a multiple of 32 take a route built on bf16 pair dot
products, with 16 (row, head) pairs per vector, which multiplies the values by softmax weights rounded to bf16 (as GPU
flash attention does): ~1.5x faster again at 8-24 rows (`Native.rounds_weights`).

Build: `plugins/native_build.py` (the system C compiler, `-O3 -march=native` with OpenMP, cached per source, flags,
compiler and CPU). Where no compiler works, `load()` returns None, `unavailable()` says why, and callers keep the
float64 route.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from plugins import native_build
from plugins.tree_attention.spec import check_inputs

SOURCE = Path(__file__).with_name("invariant.c")
# the compiler must fuse multiply-adds the same way in every inlined tile shape: not at all (invariant.c)
EXTRA_FLAGS = ("-ffp-contract=off",)
# the dtypes it takes: q, k and v share one of them; the output is float32
DTYPES = (torch.float32, torch.bfloat16)
# the dtype the op routes to it on CPU (plugins/tree_attention/op.py); float32 keeps SDPA, which is as fast or faster
# at long prefixes and many rows, and float32 models need no row invariance (runtime/model.py)
INVARIANT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Native:
    """The loaded kernel: `fn` is `spectree_tree_attention` with its argument types set; `path` the library."""

    fn: ctypes._CFuncPtr
    path: Path
    threaded: bool  # built with OpenMP
    rounds_weights_fn: ctypes._CFuncPtr  # spectree_rounds_weights

    def rounds_weights(self, head_size: int, dtype: torch.dtype) -> bool:
        """Whether inputs of this head size and dtype take the kernel's bf16 route (this CPU has AVX512-BF16, bf16,
        head size a multiple of 32), which multiplies the values by softmax weights rounded to bf16 (invariant.c)."""
        return bool(self.rounds_weights_fn(head_size, int(dtype == torch.bfloat16)))


def _build() -> Native:
    lib, path, threaded = native_build.build(SOURCE, "tree_attention", EXTRA_FLAGS)
    fn = lib.spectree_tree_attention
    fn.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64,
                   ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    rounds = lib.spectree_rounds_weights
    rounds.restype = ctypes.c_int
    rounds.argtypes = [i64, ctypes.c_int]
    return Native(fn, path, threaded, rounds)


_library = native_build.Lazy(_build)


def load() -> Native | None:
    """The kernel, built on first call (about a second); None where it cannot be built (see `unavailable`)."""
    return _library.get()


def unavailable() -> str | None:
    """Why `load()` gave None (None while it has not been tried or when it worked)."""
    return _library.failure


def tree_attention_native(
    q: torch.Tensor,  # [B, Hq, N, D] float32 or bfloat16, last dim contiguous
    k: torch.Tensor,  # [B, Hkv, L + N, D] q's dtype, last dim contiguous
    v: torch.Tensor,  # [B, Hkv, L + N, D] q's dtype, last dim contiguous
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32 packed
    scale: float,
    *,
    checked: bool = False,
) -> torch.Tensor:  # [B, Hq, N, D] float32
    """The kernel; raises if it is unavailable. Inputs are validated (plugins/tree_attention/spec.py `check_inputs`:
    the kernel trusts every shape it is given) unless the caller has done so (`checked`, the op's CPU path)."""
    native = load()
    if native is None:
        raise RuntimeError(f"the row-invariant tree-attention kernel is unavailable: {unavailable()}")
    if not checked:
        check_inputs(q, k, v, tree_mask)
    if q.dtype not in DTYPES:
        raise TypeError(f"tree_attention_native takes {[str(d) for d in DTYPES]}, got {q.dtype}")
    if any(t.device.type != "cpu" for t in (q, k, v, tree_mask)):
        raise ValueError("tree_attention_native runs on CPU tensors only")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = tree_mask.contiguous()
    b, hq, n, d = q.shape
    out = torch.empty(b, hq, n, d, dtype=torch.float32)
    rc = native.fn(q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3],
                   mask.data_ptr(), mask.shape[-1], out.data_ptr(), b, hq, k.shape[1], n, k.shape[2], d, scale,
                   int(q.dtype == torch.bfloat16))
    if rc != 0:
        raise MemoryError("tree_attention_native: the kernel could not allocate its scratch memory")
    return out


__all__ = ["DTYPES", "INVARIANT_DTYPE", "Native", "SOURCE", "load", "tree_attention_native", "unavailable"]
