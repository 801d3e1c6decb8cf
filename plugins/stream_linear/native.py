"""The CPU target forward's weight matmuls, one native call each (stream_linear.c), built like every plugin kernel
(`plugins/native_build.py`).

Why: decoding reads every weight once per step, so a step's floor is the weights' bytes over the machine's memory
bandwidth, whatever the number of rows (one token, or a tree of 16). torch's CPU linear reaches neither: its one-row
and many-row kernels read the weights far below the bandwidth, switch kernels between 1 and 2 rows (a one-row step
and a tree step round differently: batch invariance needed 32-row blocks and a measured row plan), and bfloat16 is
~10x slower than float32 where the CPU has no native bf16 (AVX2). This kernel streams each weight row once for all
rows of a call, widens bfloat16 by a shift on any x86 vector unit, reads int8 and 4-bit blocks (GGUF's Q8_0 / Q4_1
layouts; 4-bit blocks multiply int8-quantised activations in integer products, as llama.cpp does), and is
batch-invariant by construction: a row's outputs do not depend on the other rows (stream_linear.c
says how), so greedy speculative output equals plain decoding with no blocks and no measurement.

`linear` returns None where the caller's torch route must run: a weight or input it does not take (dtype, device,
layout), autograd recording, a graph being compiled or exported, or no C compiler (`unavailable()` says why).
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from plugins import cpu, native_build

SOURCE = Path(__file__).with_name("stream_linear.c")
# the compiler must not fuse multiply-adds differently in different tile shapes (stream_linear.c)
EXTRA_FLAGS = ("-ffp-contract=off",)
DTYPES = (torch.float32, torch.bfloat16)
FMT_F32, FMT_BF16, FMT_Q8, FMT_Q4 = 0, 1, 2, 3
Q_BLOCK = 32  # inputs per quantisation block (Q8 / Q4)
_FORMATS = {torch.float32: FMT_F32, torch.bfloat16: FMT_BF16}


@dataclass(frozen=True)
class Library:
    """The loaded library's functions, argument types set; `lanes` its vector width in float32; `path` the file."""

    linear: ctypes._CFuncPtr
    pack: ctypes._CFuncPtr
    packed_size: ctypes._CFuncPtr
    lanes: int
    panel: int  # outputs per packed panel
    path: Path


def _build() -> Library:
    lib, path, _ = native_build.build(SOURCE, "stream_linear", EXTRA_FLAGS)
    return bind(lib, path)


def bind(lib: ctypes.CDLL, path: Path) -> Library:
    """The functions of a library built from SOURCE (by `_build`, or by a test for another route), argument types
    set."""
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn = lib.spectree_stream_linear
    fn.restype = i32
    fn.argtypes = [ptr, i32, i64, i64, i64, i32, ptr, ptr, i64, ptr, ptr, i32]
    pack = lib.spectree_stream_pack
    pack.restype = None
    pack.argtypes = [i32, ptr, ptr, ptr, i64, i64, ptr, ptr]
    size = lib.spectree_stream_packed_size
    size.restype = None
    size.argtypes = [i32, i64, i64, ctypes.POINTER(i64), ctypes.POINTER(i64)]
    lib.spectree_stream_lanes.restype = i32
    lib.spectree_stream_panel.restype = i32
    return Library(fn, pack, size, int(lib.spectree_stream_lanes()), int(lib.spectree_stream_panel()), path)


_library = native_build.Lazy(_build)


def load() -> Library | None:
    """The library, built on first call; None where it cannot be built (see `unavailable`)."""
    return _library.get()


def unavailable() -> str | None:
    """Why `load()` gave None (None while it has not been tried or when it worked)."""
    return _library.failure


def covers(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` can go to the kernel."""
    return dtype in DTYPES and device.type == "cpu"


def bf16_missing() -> str | None:
    """Why bfloat16 weights cannot run fast on this CPU, in one line; None where they can: this kernel widens them in
    registers on any x86 vector unit, and failing it, the CPU multiplies bf16 in hardware (plugins/cpu/ `native_bf16`:
    AVX512_BF16 or AMX-BF16; elsewhere torch emulates bf16 matmuls at ~10-20x float32's time). Builds the kernel on
    first call. The rule `dtype: auto` follows (runtime/config.py `choose_dtype`)."""
    features = cpu.features()
    if load() is not None or features.native_bf16:
        return None
    return f"the weight-streaming kernel did not build ({unavailable()}) and {features.missing_bf16()}"


def bf16_route() -> str:
    """How bfloat16 weights run on this CPU, in words (where `bf16_missing` is None)."""
    if load() is not None:
        return f"bf16 weights run through the weight-streaming kernel ({cpu.features().row})"
    return f"{cpu.features().row} multiplies bf16 natively"


def quantized_activations(x: torch.Tensor) -> torch.Tensor:  # x [..., in] float32, in a multiple of Q_BLOCK
    """x as a Q4 weight's product sees it (stream_linear.c): per block of Q_BLOCK inputs, dx = amax / 127 and
    round(x / dx) to nearest even, times dx; float32, x's shape. GGUF's rule for the activations of Q4_1 matmuls."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // Q_BLOCK, Q_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(blocks))
    return (q.clamp(-127, 127) * d).reshape(x.shape)


@dataclass(frozen=True)
class BlockWeight:
    """A target weight held quantised in blocks of Q_BLOCK inputs along each row (GGUF's Q8_0 / Q4_1 layouts with
    float32 scales): what the forward multiplies by, and what losslessness is defined against. `dense()` gives the
    exact values it stands for (for exports and state dicts); a Q4 weight also quantises the activations it multiplies
    (`quantized_activations`, llama.cpp's arithmetic); `torch_linear` is the product in torch ops."""

    fmt: int  # FMT_Q8 or FMT_Q4
    data: torch.Tensor  # Q8: [out, in] int8; Q4: [out, in / 2] uint8 (input j low nibble, j + 16 high, per block)
    scale: torch.Tensor  # [out, in / Q_BLOCK] float32
    minimum: torch.Tensor | None  # Q4: [out, in / Q_BLOCK] float32
    in_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.in_features))

    @property
    def name(self) -> str:
        return "q8" if self.fmt == FMT_Q8 else "q4"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.minimum) if t is not None)

    def dense(self) -> torch.Tensor:  # [out, in] float32: the exact values
        out, blocks = self.scale.shape
        if self.fmt == FMT_Q8:
            q = self.data.to(torch.float32).view(out, blocks, Q_BLOCK)
            return (q * self.scale[..., None]).view(out, self.in_features)
        packed = self.data.view(out, blocks, Q_BLOCK // 2)
        q = torch.cat([packed & 15, packed >> 4], dim=-1).to(torch.float32)  # [out, blocks, 32]
        return (q * self.scale[..., None] + self.minimum[..., None]).view(out, self.in_features)

    def torch_linear(
        self,
        x: torch.Tensor,  # [..., in]
        bias: torch.Tensor | None = None,  # [out]
    ) -> torch.Tensor:  # [..., out] in x's dtype
        """What the kernel computes, in torch ops (the torch route: compiled and exported graphs, no kernel): the same
        values up to float32 rounding, summed in another order. For Q4, sum_b (isum * d * dx + m * sx) is the dense
        weight times the quantised activations' values."""
        if self.fmt == FMT_Q4:
            x = quantized_activations(x.float()).to(x.dtype)
        return torch.nn.functional.linear(x, self.dense().to(x.dtype), bias)

    @classmethod
    def q8(cls, weight: torch.Tensor) -> BlockWeight:  # weight [out, in], in a multiple of Q_BLOCK
        """Symmetric int8 per block (GGUF Q8_0's rule: d = amax / 127, q = round(w / d))."""
        out, inp = _check_blocks(weight)
        w = weight.detach().to(torch.float32).reshape(out, inp // Q_BLOCK, Q_BLOCK)
        d = w.abs().amax(dim=-1) / 127  # [out, blocks]
        q = torch.where(d[..., None] > 0, torch.round(w / d.clamp(min=torch.finfo(torch.float32).tiny)[..., None]),
                        torch.zeros_like(w))
        return cls(FMT_Q8, q.clamp(-127, 127).to(torch.int8).reshape(out, inp).contiguous(), d.contiguous(), None, inp)

    @classmethod
    def q4(cls, weight: torch.Tensor) -> BlockWeight:  # weight [out, in], in a multiple of Q_BLOCK
        """Asymmetric 4-bit per block (GGUF Q4_1's rule: m = min, d = (max - min) / 15, q = round((w - m) / d))."""
        out, inp = _check_blocks(weight)
        w = weight.detach().to(torch.float32).reshape(out, inp // Q_BLOCK, Q_BLOCK)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, blocks]
        d = (hi - lo) / 15
        q = torch.where(d[..., None] > 0, torch.round((w - lo[..., None]) / d.clamp(
            min=torch.finfo(torch.float32).tiny)[..., None]), torch.zeros_like(w)).clamp(0, 15).to(torch.uint8)
        return cls.from_q4(q.reshape(out, inp), d, lo)

    @classmethod
    def from_q4(cls, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> BlockWeight:
        """From 4-bit values q # [out, in] uint8 in 0..15 and per-block scale, minimum # [out, in / Q_BLOCK]."""
        out, inp = q.shape
        blocks = q.view(out, inp // Q_BLOCK, Q_BLOCK)
        packed = (blocks[..., :Q_BLOCK // 2] | (blocks[..., Q_BLOCK // 2:] << 4)).reshape(out, inp // 2)
        return cls(FMT_Q4, packed.contiguous(), scale.to(torch.float32).contiguous(),
                   minimum.to(torch.float32).contiguous(), inp)

    @classmethod
    def from_q8(cls, q: torch.Tensor, scale: torch.Tensor) -> BlockWeight:
        """From int8 values q # [out, in] and per-block scale # [out, in / Q_BLOCK]."""
        return cls(FMT_Q8, q.to(torch.int8).contiguous(), scale.to(torch.float32).contiguous(), None, q.shape[1])


QUANT_FORMATS = {"q8": BlockWeight.q8, "q4": BlockWeight.q4}


def _check_blocks(weight: torch.Tensor) -> tuple[int, int]:
    out, inp = weight.shape
    if inp % Q_BLOCK:
        raise ValueError(f"a block-quantised weight needs rows a multiple of {Q_BLOCK} wide, got [{out}, {inp}]")
    return out, inp


@dataclass(frozen=True)
class Operands:
    """A weight as the kernel takes it, packed in panels (stream_linear.c's layouts): its format, the addresses of its
    packed data and Q8's packed scales (0: none; Q4 keeps its scales and minimums in its panels) and its shape; `keep`
    holds the packed tensors they point into."""

    fmt: int
    data: int
    scale: int
    out_features: int
    in_features: int
    keep: tuple[torch.Tensor, ...]


# id(weight) -> (weakref to it, its version when packed, its Operands). A weight is packed once, on first use, and
# again after an in-place edit (its version moves); the entry goes when the weight does. Packing copies the weight:
# the packed panels are what the kernel reads, the row-major tensor stays the model's parameter (state dicts,
# exports, the torch route).
_PACKED: dict[int, tuple[weakref.ref, int, Operands]] = {}


def version_leaves(weight: torch.Tensor | BlockWeight) -> tuple[torch.Tensor, ...]:
    """The tensors whose version counters an in-place edit of the weight moves (a BlockWeight's data, scale and
    minimum); an inference tensor has none, so it is left out."""
    tensors = (weight,) if isinstance(weight, torch.Tensor) else (
        (weight.data, weight.scale) if weight.minimum is None else (weight.data, weight.scale, weight.minimum))
    return tuple(t for t in tensors if not t.is_inference())


def version(weight: torch.Tensor | BlockWeight) -> int:
    """A count that an in-place edit of the weight moves (the summed version counters of its `version_leaves`): with
    the weight's identity, what makes a copy made from it stale."""
    return sum(t._version for t in version_leaves(weight))


def _pack(lib: Library, fmt: int, src: torch.Tensor, scale: torch.Tensor | None, minimum: torch.Tensor | None,
          out: int, inp: int) -> Operands:
    nbytes, nfloats = ctypes.c_int64(), ctypes.c_int64()
    lib.packed_size(fmt, out, inp, ctypes.byref(nbytes), ctypes.byref(nfloats))
    data = torch.empty(nbytes.value, dtype=torch.uint8)
    pscale = torch.empty(nfloats.value) if nfloats.value else None
    lib.pack(fmt, src.data_ptr(), None if scale is None else scale.data_ptr(),
             None if minimum is None else minimum.data_ptr(), out, inp, data.data_ptr(),
             None if pscale is None else pscale.data_ptr())
    return Operands(fmt, data.data_ptr(), 0 if pscale is None else pscale.data_ptr(), out, inp,
                    tuple(t for t in (data, pscale) if t is not None))


def operands(weight: torch.Tensor | BlockWeight) -> Operands | None:  # weight [out, in]; None: not taken
    """The kernel's view of `weight` (packed on first use, kept while the weight lives): a BlockWeight, or a
    contiguous 2-D float32 / bfloat16 CPU tensor that autograd does not record. None also where the library is not
    built."""
    hit = _PACKED.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1] == version(weight):
        return hit[2]
    if isinstance(weight, BlockWeight):
        fmt, src, scale, minimum = weight.fmt, weight.data, weight.scale, weight.minimum
    else:
        fmt = _FORMATS.get(weight.dtype)
        if (fmt is None or weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_contiguous()
                or (weight.requires_grad and torch.is_grad_enabled())):
            return None
        src, scale, minimum = weight, None, None
    lib = _library.get()
    if lib is None:
        return None
    out, inp = weight.shape
    with torch.no_grad():
        packed = _pack(lib, fmt, src.detach(), scale, minimum, out, inp)
    key = id(weight)
    _PACKED[key] = (weakref.ref(weight), version(weight), packed)
    weakref.finalize(weight, _forget, key, id(packed))  # by id: a repacked weight's old copy is freed at once
    return packed


def _forget(key: int, packed_id: int) -> None:
    hit = _PACKED.get(key)
    if hit is not None and id(hit[2]) == packed_id:
        del _PACKED[key]


def linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor | BlockWeight,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor | None:  # [..., out] in x's dtype; None: not here
    """x @ weight^T + bias through the kernel; None where the torch route must run (module doc). Called ~150 times a
    decode step, so the checks are few and cheap (a one-token call's work is ~10-20 us)."""
    xfmt = _FORMATS.get(x.dtype)
    if xfmt is None or x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    w = operands(weight)
    if w is None:
        return None
    lib = _library.get()
    out_f, in_f = w.out_features, w.in_features
    if x.shape[-1] != in_f or (x.requires_grad and torch.is_grad_enabled()):
        return None
    if bias is not None:
        if bias.shape != (out_f,) or bias.device.type != "cpu":
            return None
        bias = bias.detach().to(torch.float32).contiguous()
    rows = x.reshape(-1, in_f)  # a view wherever the rows are evenly strided
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[0]
    if n == 0:
        return x.new_empty(*x.shape[:-1], out_f)
    y = torch.empty(*x.shape[:-1], out_f, dtype=x.dtype)
    if lib.linear(rows.data_ptr(), xfmt, n, in_f, rows.stride(0), w.fmt, w.data, w.scale or None, out_f,
                  None if bias is None else bias.data_ptr(), y.data_ptr(), xfmt) != 0:
        raise MemoryError(f"stream_linear: no memory for a float32 copy of a [{n}, {in_f}] input")
    return y


__all__ = ["BlockWeight", "DTYPES", "FMT_BF16", "FMT_F32", "FMT_Q4", "FMT_Q8", "Library", "Operands", "QUANT_FORMATS",
           "Q_BLOCK", "bf16_missing", "bf16_route", "operands", "quantized_activations", "version", "version_leaves",
           "SOURCE", "bind", "covers", "linear", "load", "unavailable"]
