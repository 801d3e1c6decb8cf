"""The native RMSNorm and RoPE (plugins/rowwise): RoPE bit for bit the torch expression, RMSNorm within the last bit
of its float32 mean of squares and row-invariant, and every case they do not take left to torch."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from plugins import native_build
from plugins.rowwise import native as rowwise
from runtime.checkpoint import load_checkpoint
from runtime.model import RMSNorm, TargetModel
from runtime.rope import apply_rope, rotate_half
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def library():
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler on this machine: the runtime keeps torch's ops (tested below)")
    built = rowwise.load()
    assert built is not None, rowwise.unavailable()  # a compiler that cannot build it is a failure
    return built


@pytest.fixture
def without_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(rowwise, "_library", native_build.Lazy(rowwise._build))


def _torch_rms_norm(x, weight, eps):  # runtime/model.py RMSNorm's torch route (HF Llama's order of operations)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _layout(t):  # [B, H, N, D]: laid out heads-major, token-major (strides of size-1 dimensions do not matter)
    return t.is_contiguous(), t.transpose(1, 2).is_contiguous()


def _torch_rope(x, cos, sin):  # runtime/rope.py apply_rope's torch route
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,n,hq,hkv,d", [(1, 1, 9, 3, 64), (1, 13, 9, 3, 64), (2, 5, 4, 2, 32), (1, 70, 8, 8, 128),
                                          (3, 2, 2, 1, 6)])
def test_rope_is_bit_identical_to_the_torch_expression(library, dtype, b, n, hq, hkv, d):
    g = torch.Generator().manual_seed(b * 1000 + n * 10 + d)
    qkv = (torch.randn(b, n, (hq + 2 * hkv) * d, generator=g) * 4).to(dtype)
    x = qkv[..., : (hq + hkv) * d].view(b, n, hq + hkv, d).transpose(1, 2)  # as Attention passes it: strided
    angles = torch.randn(b, n, d // 2, generator=g) * 50
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    out = rowwise.rope(x, cos, sin)
    expected = _torch_rope(x, cos, sin)
    assert out.shape == expected.shape and out.dtype == dtype
    assert torch.equal(out, expected) and _layout(out) == _layout(expected)
    assert torch.equal(apply_rope(x, cos, sin), expected)  # the runtime's entry point takes it
    heads_major = x.contiguous()
    out = rowwise.rope(heads_major, cos, sin)
    assert torch.equal(out, expected) and _layout(out) == _layout(_torch_rope(heads_major, cos, sin))


def test_rope_negative_control_a_fused_multiply_add_is_not_bit_identical(library):
    """What -ffp-contract=off guards against: one rounding for x*cos + rot*sin instead of three differs in bf16."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 16, 64, generator=g).to(torch.bfloat16)
    angles = torch.randn(1, 16, 64, generator=g) * 50
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    once = (x.float() * cos[:, None].float() + rotate_half(x).float() * sin[:, None].float()).to(torch.bfloat16)
    assert not torch.equal(once, _torch_rope(x, cos, sin))
    assert torch.equal(rowwise.rope(x, cos, sin), _torch_rope(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
def test_rms_norm_matches_the_torch_expression(library, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(2, rows, 576, generator=g) * torch.rand(2, rows, 1, generator=g) * 8).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    out = rowwise.rms_norm(x, weight, 1e-5)
    expected = _torch_rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    else:
        # the mean of squares may differ in its last float32 bit: that moves the normalised value's bf16 rounding one
        # step at most, and the product with the weight then by at most two steps of its own
        e = expected.float()
        ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(e.abs().clamp(min=1e-30))))
        assert ((out.float() - e).abs() / ulp).max().item() <= 2.0
        assert (out != expected).float().mean().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_row_invariant_and_takes_strided_rows(library, dtype):
    g = torch.Generator().manual_seed(7)
    wide = (torch.randn(100, 2 * 576, generator=g) * 3).to(dtype)
    x = wide[:, :576]  # rows 2H apart
    weight = torch.randn(576, generator=g).to(dtype)
    together = rowwise.rms_norm(x, weight, 1e-6)  # 100 rows: threaded
    for r in (0, 1, 63, 64, 99):
        assert torch.equal(together[r], rowwise.rms_norm(x[r:r + 1], weight, 1e-6)[0])
    assert torch.equal(together, rowwise.rms_norm(x.contiguous(), weight, 1e-6))


def test_rms_norm_module_takes_the_native_route_and_keeps_torch_for_autograd(library):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(3, 5, 64, requires_grad=True)
    out = norm(x)  # the weight records gradients: torch's ops, differentiable
    assert out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        assert torch.equal(norm(x), rowwise.rms_norm(x, norm.weight, 1e-5))


def test_what_it_does_not_take_goes_back_to_torch(library):
    x = torch.randn(2, 64)
    weight = torch.randn(64)
    assert rowwise.rms_norm(x.half(), weight.half(), 1e-5) is None  # dtype
    assert rowwise.rms_norm(x, weight.to(torch.bfloat16), 1e-5) is None  # mixed dtypes
    assert rowwise.rms_norm(x.to("meta"), weight.to("meta"), 1e-5) is None  # off the CPU
    assert rowwise.rms_norm(x, torch.randn(32), 1e-5) is None  # weight of another width
    with torch.enable_grad():
        assert rowwise.rms_norm(x.requires_grad_(), weight, 1e-5) is None  # autograd
    q = torch.randn(1, 2, 3, 8)
    cs = torch.randn(1, 3, 8)
    assert rowwise.rope(q.half(), cs.half(), cs.half()) is None
    assert rowwise.rope(q, cs[..., :4], cs[..., :4]) is None  # cos / sin of another head size
    assert rowwise.rope(torch.randn(1, 2, 3, 7), torch.randn(1, 3, 7), torch.randn(1, 3, 7)) is None  # odd size


def test_without_a_compiler_it_says_why_and_the_runtime_keeps_torch(without_library):
    assert rowwise.load() is None
    assert "no C compiler" in rowwise.unavailable() and "no-such-cc" in rowwise.unavailable()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 3, 16, generator=g).to(torch.bfloat16)
    cos, sin = torch.randn(1, 3, 16, generator=g).to(torch.bfloat16), torch.randn(1, 3, 16, generator=g)
    assert rowwise.rope(x, cos, sin.to(torch.bfloat16)) is None
    assert torch.equal(apply_rope(x, cos, sin), _torch_rope(x, cos, sin.to(torch.bfloat16)))
    norm = RMSNorm(16, 1e-5).to(torch.bfloat16)
    h = torch.randn(2, 16, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm(h), _torch_rms_norm(h, norm.weight, 1e-5))


def test_a_cpu_model_builds_the_kernels_when_it_loads(tmp_path, monkeypatch):
    """The kernels are built (or read from the cache) while the model loads, not inside its first request."""
    made = []

    def make():
        made.append(True)
        return rowwise._build()

    monkeypatch.setattr(rowwise, "_library", native_build.Lazy(make))
    config, tensors = load_checkpoint(make_checkpoint(tmp_path, "llama3"))
    model = TargetModel.from_state(config, tensors)
    assert made == [True]
    assert rowwise.covers(model.dtype, model.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_torchs_within_rounding_and_row_invariant(library, dtype):
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(9, 2 * 45, generator=g) * 6).to(dtype)  # 45: no multiple of the 8 lanes (a padded tail)
    gate, up = gate_up.split(45, dim=-1)
    got = rowwise.silu_mul(gate_up)
    want = torch.nn.functional.silu(gate) * up  # torch's route, rounded per op in the dtype
    ulp = 2**-23 if dtype == torch.float32 else 2**-7  # exp differs in the last float bits; bf16 may round once over
    assert got.dtype == dtype and got.shape == (9, 45)
    assert ((got.float() - want.float()).abs() <= 4 * ulp * want.float().abs() + 1e-30).all()
    alone = torch.cat([rowwise.silu_mul(gate_up[r:r + 1]) for r in range(9)])
    assert torch.equal(got, alone)
    special = torch.tensor([[float("nan"), -200.0, 200.0, 0.0, 1.0, 1.0, 1.0, float("nan")]], dtype=dtype)
    out = rowwise.silu_mul(special)
    assert out[0, 0].isnan() and out[0, 3].isnan() and abs(float(out[0, 1])) < 1e-30 and out[0, 2] == 200


def test_silu_mul_leaves_other_dtypes_to_torch(library):
    assert rowwise.silu_mul(torch.randn(2, 8, dtype=torch.float64)) is None
    assert rowwise.silu_mul(torch.randn(2, 7)) is None  # no gate | up halves
