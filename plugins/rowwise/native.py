"""RMSNorm, rotary embeddings and the MLP's silu(gate) * up for the eager CPU runtime, one native call each
(rowwise.c), built like every plugin kernel (`plugins/native_build.py`).

Why: at one token per step a decoder layer's small ops cost about as much to dispatch as to run. Measured on
SmolLM2-135M in bf16 on 2 AMD EPYC cores (a one-token forward over 256 cached tokens, 30.8 ms): replacing the 61
RMSNorms' 8 torch ops each by one op took 3.1 ms off, the 30 layers' RoPE (7 ops each) 1.4 ms. These kernels do the
same arithmetic in one call (rowwise.c says how it matches torch's: RoPE bit for bit, RMSNorm up to the last bit of
its float32 mean of squares).

`rms_norm` and `rope` return None where the caller's torch expression must run instead: a dtype other than float32
/ bfloat16, a tensor off the CPU, autograd recording (training), a graph being compiled or exported (the ONNX model
keeps standard ops), or no C compiler (`unavailable()` says why).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from plugins import native_build

SOURCE = Path(__file__).with_name("rowwise.c")
DTYPES = (torch.float32, torch.bfloat16)
# fused multiply-adds would round once where torch rounds twice
EXTRA_FLAGS = ("-ffp-contract=off",)


@dataclass(frozen=True)
class Rowwise:
    """The loaded library's functions, argument types set; `path` the library."""

    rms_norm: ctypes._CFuncPtr
    rope: ctypes._CFuncPtr
    silu_mul: ctypes._CFuncPtr
    path: Path


def _build() -> Rowwise:
    lib, path, _ = native_build.build(SOURCE, "rowwise", EXTRA_FLAGS)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    norm = lib.spectree_rms_norm
    norm.restype = None
    norm.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, ctypes.c_int]
    rope = lib.spectree_rope
    rope.restype = None
    rope.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, ptr, i64, i64, i64, ctypes.c_int]
    silu_mul = lib.spectree_silu_mul
    silu_mul.restype = None
    silu_mul.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
    return Rowwise(norm, rope, silu_mul, path)


_library = native_build.Lazy(_build)


def load() -> Rowwise | None:
    """The library, built on first call; None where it cannot be built (see `unavailable`)."""
    return _library.get()


def unavailable() -> str | None:
    """Why `load()` gave None (None while it has not been tried or when it worked)."""
    return _library.failure


def covers(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether tensors of `dtype` on `device` can go to the kernels (a model there loads them when it loads)."""
    return dtype in DTYPES and device.type == "cpu"


def _usable(*tensors: torch.Tensor) -> Rowwise | None:
    """The library when these tensors can go to it (see the module doc), else None."""
    dtype = tensors[0].dtype
    if torch.compiler.is_compiling():
        return None
    for t in tensors:
        if t.dtype != dtype or not covers(t.dtype, t.device) or (t.requires_grad and torch.is_grad_enabled()):
            return None
    return load()


def rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H], x's dtype
    eps: float,
) -> torch.Tensor | None:  # [..., H]: weight * to_dtype(x * rsqrt(mean(x^2) + eps)) in float32; None: not here
    lib = _usable(x, weight)
    if lib is None:
        return None
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or not weight.is_contiguous():
        return None
    rows = x.reshape(-1, hidden)  # a view wherever the rows are evenly strided
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.rms_norm(rows.data_ptr(), rows.shape[0], hidden, rows.stride(0), weight.data_ptr(), eps, out.data_ptr(),
                 int(x.dtype == torch.bfloat16))
    return out


def rope(
    x: torch.Tensor,  # [B, H, N, D]
    cos: torch.Tensor,  # [B, N, D], x's dtype
    sin: torch.Tensor,  # [B, N, D], x's dtype
) -> torch.Tensor | None:  # [B, H, N, D]: x * cos + rotate_half(x) * sin; None: not here
    lib = _usable(x, cos, sin)
    if lib is None:
        return None
    b, h, n, d = x.shape
    if d % 2 or cos.shape != (b, n, d) or sin.shape != cos.shape or sin.stride() != cos.stride():
        return None
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    # laid out as torch lays out an elementwise result: [B, N, H, D] in memory for a head-transposed projection (what
    # Attention passes), [B, H, N, D] for a contiguous x
    if x.stride(1) < x.stride(2):
        out = torch.empty(b, n, h, d, dtype=x.dtype).transpose(1, 2)
    else:
        out = torch.empty(b, h, n, d, dtype=x.dtype)
    lib.rope(x.data_ptr(), b, n, h, d, x.stride(0), x.stride(2), x.stride(1), cos.data_ptr(), sin.data_ptr(),
             cos.stride(0), cos.stride(1), out.data_ptr(), out.stride(0), out.stride(2), out.stride(1),
             int(x.dtype == torch.bfloat16))
    return out


def silu_mul(
    gate_up: torch.Tensor,  # [..., 2 * I]: gate | up
) -> torch.Tensor | None:  # [..., I]: silu(gate) * up, each rounded to the dtype; None: not here
    lib = _usable(gate_up)
    if lib is None or gate_up.shape[-1] % 2:
        return None
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    lib.silu_mul(rows.data_ptr(), rows.shape[0], inter, rows.stride(0), out.data_ptr(),
                 int(gate_up.dtype == torch.bfloat16))
    return out


__all__ = ["DTYPES", "Rowwise", "SOURCE", "covers", "load", "rms_norm", "rope", "silu_mul", "unavailable"]
