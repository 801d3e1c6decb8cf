"""A whole decoder layer of the CPU target forward in one native call (layer.c), built like every plugin kernel
(`plugins/native_build.py`).

Why: SmolLM2-135M's one-token step reads ~270 MB of bf16 weights (~9 ms at this class of machine's bandwidth), but its
30 layers' ~25 torch ops and 5 matmul calls each cost ~20 ms more in dispatch, allocation and thread wake-ups
(measured on 2 AMD EPYC cores; llama.cpp, which runs its whole graph natively, decodes the same weights in ~13 ms).
This call runs the layer's kernels back to back. They are the very kernels of the torch route (rowwise.c,
stream_linear.c, the tree-attention kernel), passed in as function pointers, so both routes give the same bits and
every path of the runtime (one sequence, packed batches, drafter features) keeps greedy identity whichever it takes.

`prepare` builds a layer's argument block once for its weights (None where the torch route must run: a weight the
call does not take, or a library that did not build: `unavailable()` says why); `stack_forward` runs a run of layers
(one, or a forward's whole stack) on a step's inputs. One argument block per layer: the calls of one process never
overlap on a layer (a decode step runs its layers in turn).
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from plugins import native_build
from plugins.rowwise import native as rowwise
from plugins.stream_linear import native as stream_linear
from plugins.stream_linear.native import BlockWeight
from plugins.tree_attention import native as attention

SOURCE = Path(__file__).with_name("layer.c")
DTYPES = (torch.bfloat16,)  # the dtype whose torch route attends through the row-invariant kernel
_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Matrix(ctypes.Structure):
    _fields_ = [("fmt", _i32), ("pad", _i32), ("data", _ptr), ("scale", _ptr), ("bias", _ptr),
                ("out", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("rows", _i64), ("hidden", _i64), ("hq", _i64), ("hkv", _i64), ("head_dim", _i64), ("inter", _i64),
                ("bf16", _i32), ("cache_bf16", _i32), ("eps", _f32), ("scale", _f32), ("x", _ptr), ("out", _ptr),
                ("input_norm", _ptr), ("post_norm", _ptr), ("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix),
                ("down", _Matrix), ("cos", _ptr), ("sin", _ptr), ("k_cache", _ptr), ("v_cache", _ptr),
                ("capacity", _i64), ("length", _i64), ("mask", _ptr), ("words", _i64), ("rms_norm", _ptr),
                ("rope", _ptr), ("silu_mul", _ptr), ("linear", _ptr), ("attention", _ptr)]


@dataclass(frozen=True)
class Library:
    stack: ctypes._CFuncPtr  # spectree_decoder_stack
    kernels: tuple[int, int, int, int, int]  # addresses: rms_norm, rope, silu_mul, linear, attention
    path: Path


def _address(fn: ctypes._CFuncPtr) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _build() -> Library:
    kernels = {"rowwise": rowwise, "stream_linear": stream_linear, "tree_attention": attention}
    missing = [f"{name}: {module.unavailable()}" for name, module in kernels.items() if module.load() is None]
    if missing:
        raise RuntimeError("; ".join(missing))
    lib, path, _ = native_build.build(SOURCE, "decoder_layer")
    stack = lib.spectree_decoder_stack
    stack.restype = ctypes.c_int
    stack.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int, _ptr, _i64]
    r, s, a = rowwise.load(), stream_linear.load(), attention.load()
    return Library(stack, (_address(r.rms_norm), _address(r.rope), _address(r.silu_mul), _address(s.linear),
                        _address(a.fn)), path)


_library = native_build.Lazy(_build)


def load() -> Library | None:
    """The library (and the kernels it calls), built on first call; None where one cannot be built."""
    return _library.get()


def unavailable() -> str | None:
    """Why `load()` gave None (None while it has not been tried or when it worked)."""
    return _library.failure


def _matrix(weight: torch.Tensor | BlockWeight, bias: torch.Tensor | None, keep: list) -> _Matrix | None:
    w = stream_linear.operands(weight)
    if w is None:
        return None
    keep.extend(w.keep)  # the packed copy the block points into
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
        keep.append(bias)
    return _Matrix(w.fmt, 0, w.data, w.scale or None, None if bias is None else bias.data_ptr(),
                   w.out_features)


@dataclass(frozen=True)
class Prepared:
    """A layer's weights as the call reads them (`prepare`): the argument block with its static fields filled, what
    it points into kept alive, and what makes it stale (`current`)."""

    args: _Layer
    keep: tuple
    made_from: tuple  # the weight objects it was made from (tensors, BlockWeights), in the caller's order
    leaves: tuple[torch.Tensor, ...]  # their tensors with version counters (`stream_linear.version_leaves`)
    versions: list[int]  # those counters when it was made

    def current(self, tensors: tuple) -> bool:
        """Whether these are the objects it was made from, none edited in place since. Checked for every layer of
        every forward: identity and version counters compared directly (~1 us a layer)."""
        made = self.made_from
        return (len(tensors) == len(made) and all(map(operator.is_, tensors, made))
                and [t._version for t in self.leaves] == self.versions)


def prepare(
    norms: tuple[torch.Tensor, torch.Tensor],  # input and post-attention RMSNorm weights, each [H] bfloat16
    eps: float,
    matrices: tuple,  # (weight, bias) for qkv [(Hq + 2 Hkv) D, H], o [H, Hq D], gate_up [2 I, H], down [H, I]
    heads: tuple[int, int, int],  # Hq, Hkv, D
    scale: float,
) -> Prepared | None:  # None: a weight the call does not take, or no library
    """The argument block of a layer's calls, built once for its weights (each call then sets only its inputs)."""
    lib = _library.get()
    if lib is None:
        return None
    keep: list = []
    mats = [_matrix(w, b, keep) for w, b in matrices]
    if any(m is None for m in mats):
        return None
    hq, hkv, d = heads
    h, inter = norms[0].shape[0], matrices[3][0].shape[1]
    args = _Layer(0, h, hq, hkv, d, inter, 1, 0, eps, scale, None, None, norms[0].data_ptr(), norms[1].data_ptr(),
                  *mats, None, None, None, None, 0, 0, None, 0, *lib.kernels)
    tensors = (*norms, *(t for pair in matrices for t in pair if t is not None))
    leaves = tuple(leaf for t in tensors for leaf in stream_linear.version_leaves(t))
    return Prepared(args, (*keep, *tensors), tensors, leaves, [t._version for t in leaves])


def stack_forward(
    layers: Sequence[Prepared],  # consecutive layers, the first one's cache at k_cache[0]
    x: torch.Tensor,  # [N, H] bfloat16, contiguous
    cos: torch.Tensor,  # [N, D] bfloat16, contiguous
    sin: torch.Tensor,  # [N, D]
    k_cache: torch.Tensor,  # [layers, Hkv, capacity, D] bfloat16 or float32, the layers' (slots [length, +N) written)
    v_cache: torch.Tensor,  # [layers, Hkv, capacity, D], k_cache's dtype, strided as k_cache
    length: int,
    tree_mask: torch.Tensor,  # [N, words] int32, contiguous
) -> torch.Tensor:  # [N, H]: the last layer's output
    """The layers in turn on a step's inputs, in one native call (no Python between the layers): layer i reads layer
    i - 1's output and its cache at k_cache[i] / v_cache[i]."""
    lib = _library.get()
    out = torch.empty_like(x)
    blocks = (ctypes.c_void_p * len(layers))(*(ctypes.addressof(p.args) for p in layers))
    if lib.stack(blocks, len(layers), x.shape[0], x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                 k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0) * k_cache.element_size(), k_cache.shape[2],
                 length, int(k_cache.dtype == torch.bfloat16), tree_mask.data_ptr(), tree_mask.shape[-1]) != 0:
        raise MemoryError(f"decoder_layer: no memory for a {x.shape[0]}-row layer's scratch buffers")
    return out


__all__ = ["DTYPES", "Library", "Prepared", "SOURCE", "load", "prepare", "stack_forward", "unavailable"]
