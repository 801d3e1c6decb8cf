"""The weight-streaming matmul (plugins/stream_linear): every weight format against a float64 reference, batch
invariance by construction (with a negative control that shows the check can fail), the block formats' layouts, and
every case it does not take left to torch."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from plugins import native_build
from plugins.stream_linear import native as stream
from plugins.stream_linear.native import BlockWeight


@pytest.fixture(scope="module")
def library():
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler on this machine: the runtime keeps torch's linear (tested below)")
    built = stream.load()
    assert built is not None, stream.unavailable()  # a compiler that cannot build it is a failure
    return built


@pytest.fixture
def without_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(stream, "_library", native_build.Lazy(stream._build))


def _weight(fmt: str, w: torch.Tensor):  # fmt: a dtype's name or a block format's -> (weight, the inputs' dtype)
    if fmt in stream.QUANT_FORMATS:
        return stream.QUANT_FORMATS[fmt](w), torch.float32
    dtype = getattr(torch, fmt)
    return w.to(dtype), dtype


def _reference(x, dense, bias=None):  # float64: x [rows, in], dense [out, in] -> [rows, out]
    out = x.double() @ dense.double().T
    return out if bias is None else out + bias.double()


# (out, in): model-like shapes, widths that are no multiple of any vector (odd tails), one output, one input
DENSE_SHAPES = [(96, 64), (37, 45), (1, 19), (130, 1), (65, 200)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", DENSE_SHAPES)
def test_dense_matches_float64(library, dtype, shape):
    g = torch.Generator().manual_seed(1)
    out_f, in_f = shape
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    x = torch.randn(2, 7, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    y = stream.linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (2, 7, out_f)
    ref = _reference(x.reshape(-1, in_f), w, bias).reshape(2, 7, out_f)
    # float32 sums: ~1e-6 relative; a bfloat16 result is additionally rounded once (2^-8 relative)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    scale = ref.abs().clamp(min=1.0)
    assert ((y.double() - ref).abs() / scale).max() <= tol * max(1, in_f) ** 0.5


@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("shape", [(96, 64), (33, 160), (1, 32)])
def test_block_formats_match_their_dense_values(library, kind, shape):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(*shape, generator=g)
    bw = stream.QUANT_FORMATS[kind](w)
    dense = bw.dense()
    assert bw.shape == w.shape and bw.name == kind
    # the quantisation error is that of the format: half a step of the block's scale
    step = (dense - w).abs().max()
    assert 0 < step <= (w.abs().max() / (127 if kind == "q8" else 7.5))
    x = torch.randn(5, shape[1], generator=g)
    y = stream.linear(x, bw)
    # Q4 multiplies int8-quantised activations (llama.cpp's Q4_1 x Q8_1): the dense values times theirs
    ref = _reference(stream.quantized_activations(x) if kind == "q4" else x, dense)
    assert ((y.double() - ref).abs() / ref.abs().clamp(min=1.0)).max() < 1e-5
    torch.testing.assert_close(bw.torch_linear(x), y, rtol=1e-5, atol=1e-5)  # the torch route: the same values
    if kind == "q4":  # and the quantised activations are what it multiplies (the check above can fail)
        assert ((y.double() - _reference(x, dense)).abs() / ref.abs().clamp(min=1.0)).max() > 1e-4
    # and the bytes are what the format promises (int8, or two 4-bit values a byte)
    assert bw.data.numel() == (w.numel() if kind == "q8" else w.numel() // 2)


def test_q4_activations_follow_gguf_q8_rule():
    """Per block of 32: dx = amax / 127, x / dx rounded to nearest even, times dx; an all-zero block stays zero."""
    x = torch.zeros(2, 64)
    x[0, :8] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.4, -0.6, 126.5, 1.0])  # dx = 1: ties go to the even integer
    x[1, 32:] = torch.linspace(-3, 3, 32)
    got = stream.quantized_activations(x)
    assert got[0, :8].tolist() == [127.0, 2.0, 4.0, -2.0, 0.0, -1.0, 126.0, 1.0]
    assert torch.equal(got[0, 8:], torch.zeros(56)) and torch.equal(got[1, :32], torch.zeros(32))
    q = got[1, 32:] / (3.0 / 127)
    assert torch.allclose(q, q.round(), atol=1e-4) and q.abs().max().round() == 127


def test_q4_layout_is_gguf_q4_1():
    """Input j of a block in the low nibble of byte j, input j + 16 in the high nibble; w = d * q + m."""
    q = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    d, m = torch.tensor([[0.5, 2.0]]), torch.tensor([[-1.0, 3.0]])
    bw = BlockWeight.from_q4(q, d, m)
    assert bw.data[0, 0] == q[0, 0] | (q[0, 16] << 4) and bw.data[0, 17] == q[0, 33] | (q[0, 49] << 4)
    expected = torch.cat([q[0, :32] * 0.5 - 1.0, q[0, 32:] * 2.0 + 3.0]).float()
    assert torch.equal(bw.dense()[0], expected)


def test_block_formats_refuse_ragged_rows():
    with pytest.raises(ValueError, match="multiple of 32"):
        BlockWeight.q8(torch.randn(4, 40))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q8", "q4"])
def test_each_row_is_its_lone_result_at_every_row_count(library, fmt):
    """Batch invariance by construction: rows 1..70 at once give each row the bits it gets alone (tiles of several
    rows and outputs, row blocks, the odd tail), so a tree step reproduces plain decoding's one-token steps."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 96, generator=g)
    weight, dtype = _weight(fmt, w)
    x = torch.randn(70, 96, generator=g).to(dtype)
    alone = torch.cat([stream.linear(x[r:r + 1], weight) for r in range(70)])
    for n in (2, 3, 4, 5, 7, 16, 64, 65, 70):
        assert torch.equal(stream.linear(x[:n], weight), alone[:n]), n
    # strided rows (a view) give the same bits as contiguous ones
    wide = torch.zeros(70, 128, dtype=dtype)
    wide[:, :96] = x
    assert torch.equal(stream.linear(wide[:, :96], weight), alone)


def test_negative_control_a_different_summation_order_changes_bits(library):
    """The invariance checks above can fail: the same sums in another order (the inputs permuted) differ in the last
    bits for some elements, which torch.equal sees."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 96, generator=g)
    x = torch.randn(16, 96, generator=g)
    perm = torch.randperm(96, generator=g)
    assert not torch.equal(stream.linear(x, w), stream.linear(x[:, perm], w[:, perm].contiguous()))


def test_leaves_what_it_does_not_take_to_torch(library):
    w = torch.randn(8, 16)
    assert stream.linear(torch.randn(2, 16, dtype=torch.float64), w.double()) is None  # dtype
    assert stream.linear(torch.randn(2, 16), w.t().contiguous().t()) is None  # a transposed weight
    assert stream.linear(torch.randn(2, 15), w) is None  # a width that does not match
    trained = w.clone().requires_grad_()
    assert stream.linear(torch.randn(2, 16), trained) is None  # autograd records: torch's route
    with torch.no_grad():
        assert stream.linear(torch.randn(2, 16), trained) is not None
    assert stream.linear(torch.randn(0, 16), w).shape == (0, 8)


def test_without_a_compiler_the_torch_route_runs(without_library):
    from runtime.model import linear

    w = torch.randn(8, 32)
    x = torch.randn(3, 32)
    assert stream.linear(x, w) is None and "no-such-cc" in (stream.unavailable() or "")
    assert torch.allclose(linear(x, w), F.linear(x, w))
    bw = BlockWeight.q8(w)
    assert torch.allclose(linear(x, bw), F.linear(x, bw.dense()))


def test_a_library_is_keyed_by_the_headers_its_source_includes(tmp_path):
    """plugins/bf16.h is part of what each kernel is built from (an edit to it rebuilds them); an include that is not
    beside the source (an -I folder's, such as llama.h) is not followed."""
    assert native_build.sources_of(stream.SOURCE)[1].name == "bf16.h"
    src = tmp_path / "k.c"
    (tmp_path / "h.h").write_text('#include "h2.h"\n')
    (tmp_path / "h2.h").write_text("")
    src.write_text('#include "h.h"\n#include "llama.h"\n#include <math.h>\n')
    assert [p.name for p in native_build.sources_of(src)] == ["k.c", "h.h", "h2.h"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_is_packed_once_and_again_after_an_in_place_edit(library, dtype):
    """The kernel reads a packed copy (`operands`): made on first use, reused while the weight is unchanged, made
    again when it is edited in place, and dropped with the weight."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 33, generator=g).to(dtype)
    x = torch.randn(3, 33, generator=g).to(dtype)
    first = stream.operands(w)
    assert stream.operands(w) is first
    before = stream.linear(x, w)
    with torch.no_grad():
        w[7, 5] += 1.0
    assert stream.operands(w) is not first
    after = stream.linear(x, w)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after.double(), _reference(x, w), rtol=1e-2, atol=1e-2)
    key = id(w)
    del w
    assert key not in stream._PACKED


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_packed_block_panels_round_trip_their_values(library, kind):
    """Through an identity input, each output of a block weight is its dense row: the panel packing puts every value,
    scale and minimum where the kernel reads it, outputs past a whole panel included."""
    g = torch.Generator().manual_seed(5)
    bw = stream.QUANT_FORMATS[kind](torch.randn(2 * library.panel + 3, 64, generator=g))
    eye = torch.eye(64)
    # exact for Q8; Q4's one-hot activation is 127 * (1 / 127), within a float32 rounding of 1
    exact = 0 if kind == "q8" else 1e-6
    torch.testing.assert_close(stream.linear(eye, bw), bw.dense().T, rtol=exact, atol=exact)


def _call(lib: stream.Library, x: torch.Tensor, weight) -> torch.Tensor:  # x [rows, in] float32 / bf16 -> [rows, out]
    """`lib` run directly (not through `linear`, whose packing cache holds this process's library's panels)."""
    if isinstance(weight, BlockWeight):
        fmt, src, scale, minimum = weight.fmt, weight.data, weight.scale, weight.minimum
    else:
        fmt, src, scale, minimum = stream._FORMATS[weight.dtype], weight, None, None
    out, inp = weight.shape
    packed = stream._pack(lib, fmt, src, scale, minimum, out, inp)
    xfmt = stream._FORMATS[x.dtype]
    y = torch.empty(x.shape[0], out, dtype=x.dtype)
    assert lib.linear(x.data_ptr(), xfmt, x.shape[0], inp, x.stride(0), fmt, packed.data, packed.scale or None, out,
                      None, y.data_ptr(), xfmt) == 0
    return y


@pytest.fixture(scope="module")
def other_width(library):
    """The kernel built for the other vector width: AVX-512 (emulated, SPECTREE_EMULATE) where this build is AVX2,
    the forced AVX2 level (SPECTREE_CPU_ISA) where it is AVX-512, the CPU's own where this build is emulated."""
    from plugins import cpu

    with pytest.MonkeyPatch.context() as mp:
        if native_build.emulation() is not None:
            mp.delenv(native_build.EMULATE_ENV)
        elif library.lanes == 8:
            mp.setenv(native_build.EMULATE_ENV, "avx512")
        else:
            mp.setenv(cpu.ISA_ENV, "avx2")
        cpu.features.cache_clear()
        try:
            other = stream._build()
        finally:
            cpu.features.cache_clear()
    if other.lanes == library.lanes:
        pytest.skip(f"no other vector width builds here (both {library.lanes} lanes)")
    return other


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q8", "q4"])
def test_avx2_and_avx512_routes_give_the_same_bits(library, other_width, fmt):
    """A (row, output) pair is one lane summing its inputs in order whatever the vector width (stream_linear.c), so
    the 8-lane and 16-lane builds (tiles of up to 6 and 8 rows, panels of 16 and 32 outputs) agree bit for bit: a
    model gives the same tokens on both kinds of machine. Outputs past a whole panel, every row count a tile plan
    meets."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(2 * 32 + 5, 96, generator=g)
    weight, dtype = _weight(fmt, w)
    for rows in (1, 2, 3, 5, 7, 8, 9, 16, 17, 70):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        assert torch.equal(_call(library, x, weight), _call(other_width, x, weight)), rows


@pytest.fixture(scope="module")
def portable(library):
    """The kernel's portable route (no AVX2, no FMA, no AVX-512: GCC vector extensions, each product rounded before
    it is added), built on this machine whatever it has, so the fallback for CPUs without them is tested everywhere."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(native_build.EMULATE_ENV, raising=False)  # the emulation would define the AVX-512 route again
        lib, path, _ = native_build.build(stream.SOURCE, "stream_linear_portable",
                                          stream.EXTRA_FLAGS + ("-mno-avx512f", "-mno-avx2", "-mno-fma"))
    return stream.bind(lib, path)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q8", "q4"])
def test_the_portable_route_computes_the_same_values(library, portable, fmt):
    """Against the fast route: the same values to float32 rounding (not the same bits: separate multiply and add),
    every row its lone result, outputs past a whole panel."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(2 * 32 + 5, 96, generator=g)
    weight, dtype = _weight(fmt, w)
    x = torch.randn(9, 96, generator=g).to(dtype)
    y = _call(portable, x, weight)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    fast = _call(library, x, weight)
    torch.testing.assert_close(y.float(), fast.float(), rtol=tol, atol=tol)
    assert torch.equal(torch.cat([_call(portable, x[r:r + 1], weight) for r in range(9)]), y)
    if fmt == "float32":  # and it is another route: products rounded before they are added
        assert not torch.equal(y, fast)
