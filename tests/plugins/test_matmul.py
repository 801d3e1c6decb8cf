"""plugins/matmul: the weight-streaming linear against torch, its row invariance, its portable build, and when the
runtime takes it."""

import ctypes

import pytest
import torch
import torch.nn.functional as F

from plugins import native_build
from plugins.matmul import native as stream


@pytest.fixture(scope="module")
def kernel():
    lib = stream.load()
    if lib is None:
        pytest.skip(f"no C compiler here: {stream.unavailable()}")
    return lib


@pytest.fixture(scope="module")
def portable():
    """The build an AVX2-only CPU runs (8 lanes, x86-64-v3), where the compiler can target it."""
    try:
        lib, _, _ = native_build.build(stream.SOURCE, "stream_portable", ("-march=x86-64-v3",))
    except native_build.BUILD_ERRORS as exc:
        pytest.skip(f"no x86-64-v3 build here: {exc}")
    fn = lib.spectree_linear
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int, i64, ptr, ptr, i64]
    fn.restype = None
    lanes = lib.spectree_linear_lanes
    lanes.restype = ctypes.c_int
    return stream.Stream(fn, int(lanes()), stream.SOURCE)


def call(lib, x, w, bias=None):
    """The library's spectree_linear on x [rows, in] (any row stride) and w [out, in] float32 or bfloat16."""
    y = torch.empty(x.shape[0], w.shape[0])
    lib.fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), w.data_ptr(), int(w.dtype == torch.bfloat16),
           w.shape[0], None if bias is None else bias.data_ptr(), y.data_ptr(), w.shape[0])
    return y


def reference(x, w, bias=None):  # float64, then float32
    out = x.double() @ w.double().T
    return (out if bias is None else out + bias.double()).float()


SHAPES = [(1, 16, 8), (3, 37, 5), (5, 100, 129), (9, 576, 960), (17, 1536, 64), (64, 48, 300)]  # rows, in, out


@pytest.mark.parametrize("rows,inp,out", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_at_every_width(kernel, rows, inp, out, bias):
    g = torch.Generator().manual_seed(rows * 1000 + inp)
    x, w = torch.randn(rows, inp, generator=g), torch.randn(out, inp, generator=g) * inp**-0.5
    b = torch.randn(out, generator=g) if bias else None
    got = stream.linear(x, w, b)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_are_widened_exactly(kernel):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 70, generator=g), torch.randn(33, 70, generator=g).bfloat16()
    torch.testing.assert_close(call(kernel, x, w), reference(x, w.float()), rtol=1e-5, atol=1e-5)
    assert torch.equal(call(kernel, x, w), call(kernel, x, w.float()))  # the same values, the same sums


def test_strided_rows_and_leading_dimensions(kernel):
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(6, 2, 40, generator=g)
    x, w = wide[:, 0], torch.randn(11, 40, generator=g)  # rows 80 apart
    assert torch.equal(call(kernel, x, w), call(kernel, x.contiguous(), w))
    batched = torch.randn(2, 3, 40, generator=g)
    assert torch.equal(stream.linear(batched, w), stream.linear(batched.reshape(6, 40), w).view(2, 3, 11))


def _rows_alone(lib, x, w, bias=None):
    return torch.cat([call(lib, x[i:i + 1], w, bias) for i in range(x.shape[0])])


@pytest.mark.parametrize("inp", [576, 100, 7])
def test_each_row_is_bit_identical_to_that_row_alone(kernel, portable, inp):
    g = torch.Generator().manual_seed(inp)
    x, w, b = torch.randn(stream.MAX_ROWS, inp, generator=g), torch.randn(257, inp, generator=g), torch.randn(257)
    for lib in (kernel, portable):
        alone = _rows_alone(lib, x, w, b)
        for n in (2, 3, 4, 5, 8, 9, 16, 33, stream.MAX_ROWS):
            assert torch.equal(call(lib, x[:n], w, b), alone[:n]), (lib.lanes, n)
            assert torch.equal(call(lib, x[n - 2:n], w, b), alone[n - 2:n])  # at any offset in a block


def test_negative_control_a_reassociated_sum_is_caught(kernel):
    """The identity above is a bit-level check: the same products summed in another order (inputs permuted) differ
    somewhere, so a kernel whose order depended on the rows would fail it."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 576, generator=g), torch.randn(512, 576, generator=g)
    perm = torch.randperm(576, generator=g)
    assert not torch.equal(call(kernel, x, w), call(kernel, x[:, perm].contiguous(), w[:, perm].contiguous()))


def test_the_portable_build_computes_what_this_cpus_does(kernel, portable):
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(12, 300, generator=g), torch.randn(70, 300, generator=g)
    assert portable.lanes == 8 and kernel.lanes in (8, 16)
    torch.testing.assert_close(call(portable, x, w), call(kernel, x, w), rtol=1e-5, atol=1e-5)


def test_what_does_not_go_to_the_kernel(kernel):
    w = torch.randn(8, 16)
    assert stream.linear(torch.randn(stream.MAX_ROWS + 1, 16), w) is None  # a prompt chunk: torch's GEMM
    assert stream.linear(torch.randn(2, 16).bfloat16(), w.bfloat16()) is None
    assert stream.linear(torch.randn(2, 16, dtype=torch.float64), w) is None
    assert stream.linear(torch.randn(2, 16), w, torch.randn(8).double()) is None
    assert stream.linear(torch.randn(2, 16, requires_grad=True), w) is None  # autograd keeps torch
    with torch.no_grad():
        assert stream.linear(torch.randn(2, 16, requires_grad=True), w) is not None
    with stream.disabled():
        assert stream.linear(torch.randn(2, 16), w) is None
    assert stream.linear(torch.randn(2, 16), w) is not None


def test_float32_models_run_their_linears_through_it(kernel, monkeypatch):
    from runtime.model import linear

    calls = []
    real = stream.linear
    monkeypatch.setattr(stream, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    x, w = torch.randn(1, 5, 16), torch.randn(8, 16)
    assert torch.equal(linear(x, w), real(x, w)) and calls == [(1, 5, 16)]
