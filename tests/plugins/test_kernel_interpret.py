"""The Triton kernel, run by Triton's CPU interpreter, against the torch reference.

Every output (and every split partial) is poisoned with NaN before the launch, so an element the kernel fails
to write shows up as a mismatch.
"""

import math

import pytest
import torch

from plugins.tree_attention import pack_mask, tree_attention_reference
from plugins.tree_attention.launch import AOT_TACTIC_BLOCK_M, contiguous_scalar_args, plan_launch, tile_config
from plugins.tree_attention.spec import TreeAttentionDtypeError, TreeAttentionShapeError
from plugins.tree_attention.trt_plugin import aot_grid
from tests.plugins.trees import random_tree_masks

# Largest error of the kernel vs the reference (both see the same rounded inputs), relative to max |out|.
# fp32 runs ieee dots; fp16/bf16 round p to the input dtype before the p @ v dot, as flash attention does.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_inputs(batch, q_heads, kv_heads, n, prefix, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    _, tree = random_tree_masks(batch, n, g)
    q = torch.randn(batch, q_heads, n, d, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, prefix + n, d, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, prefix + n, d, generator=g).to(dtype)
    return q, k, v, pack_mask(tree)


def assert_matches_reference(out, q, k, v, mask, scale):
    expected = tree_attention_reference(q, k, v, mask, scale).float()
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not out.isnan().any(), "some outputs were never written (still NaN-poisoned)"
    err = (out.float() - expected).abs().max().item()
    assert err <= TOLERANCE[q.dtype] * expected.abs().max().item(), f"max abs error {err}"


def poisoned_workspace(batch, q_heads, n, splits, d):
    nan = float("nan")
    return (
        torch.full((batch, q_heads, n, splits), nan),
        torch.full((batch, q_heads, n, splits), nan),
        torch.full((batch, q_heads, n, splits, d), nan),
    )


# (batch, q_heads, kv_heads, N, L, D, splits): L = 0, N = 1, N not a power of two, N > 32 (two mask words),
# L not a multiple of the key tile, GQA ratios 1 / 2 / 4 / 8, odd head sizes, 64 and 128, split counts.
SHAPES = [
    (1, 1, 1, 1, 0, 16, None),
    (1, 2, 1, 1, 37, 8, None),
    (2, 4, 2, 5, 70, 5, None),
    (1, 8, 1, 3, 19, 64, None),
    (2, 2, 2, 35, 0, 3, None),
    (1, 4, 4, 33, 150, 7, 3),
    (2, 4, 1, 6, 130, 128, 2),
    (1, 2, 1, 17, 300, 12, 5),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("batch,q_heads,kv_heads,n,prefix,d,splits", SHAPES)
def test_kernel_matches_reference(interpreted_kernel, batch, q_heads, kv_heads, n, prefix, d, splits, dtype):
    q, k, v, mask = make_inputs(batch, q_heads, kv_heads, n, prefix, d, dtype, seed=n * 100 + prefix)
    scale = 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    workspace = None
    if splits:
        plan = plan_launch(
            batch=batch, q_heads=q_heads, kv_heads=kv_heads, num_tree=n, prefix_len=prefix, head_dim=d,
            elem_bytes=q.element_size(), num_splits=splits,
        )
        assert plan.num_splits == splits, "the shape should really run the requested number of splits"
        workspace = poisoned_workspace(batch, q_heads, n, splits, d)
    result = interpreted_kernel.tree_attention_triton(q, k, v, mask, scale, out=out, num_splits=splits, workspace=workspace)
    assert result is out
    assert_matches_reference(out, q, k, v, mask, scale)
    if splits:
        assert not any(t.isnan().any() for t in workspace), "some split partials were never written"


def test_kv_cache_views_need_no_copy(interpreted_kernel):
    """k/v as slices of a longer cache [B, Hkv, max_len, D] (non-contiguous) and q as a transposed view."""
    g = torch.Generator().manual_seed(7)
    batch, q_heads, kv_heads, n, prefix, d = 2, 4, 2, 6, 45, 16
    cache_k = torch.randn(batch, kv_heads, 128, d, generator=g)
    cache_v = torch.randn(batch, kv_heads, 128, d, generator=g)
    k, v = cache_k[:, :, : prefix + n], cache_v[:, :, : prefix + n]
    q = torch.randn(batch, n, q_heads, d, generator=g).transpose(1, 2)  # [B, Hq, N, D], strided
    _, tree = random_tree_masks(batch, n, g)
    mask = pack_mask(tree)
    out = torch.full((batch, q_heads, n, d), float("nan"))
    interpreted_kernel.tree_attention_triton(q, k, v, mask, 0.25, out=out)
    assert_matches_reference(out, q, k, v, mask, 0.25)


@pytest.mark.parametrize("tactic", sorted(AOT_TACTIC_BLOCK_M))
def test_tensorrt_launch_contract(interpreted_kernel, tactic):
    """Launch the single-split kernel exactly as the TensorRT plugin does: grid from aot_grid, int scalars
    from contiguous_scalar_args (shape-derived strides), BLOCK_M from the tactic."""
    k_ = interpreted_kernel
    batch, q_heads, kv_heads, n, prefix, d = 2, 6, 2, 11, 29, 16
    q, k, v, mask = make_inputs(batch, q_heads, kv_heads, n, prefix, d, torch.float16, seed=tactic)
    tiles = tile_config(q_heads // kv_heads * n, d, 2, block_m=AOT_TACTIC_BLOCK_M[tactic])
    out = torch.full_like(q, float("nan"))
    scalars = contiguous_scalar_args(q.shape, k.shape, mask.shape)
    k_.tree_attention_kernel[aot_grid(q.shape, k.shape, tiles.block_m)](
        q, k, v, mask, *scalars, out, **k_._meta(tiles, 0.25, d, q.dtype)
    )
    assert_matches_reference(out, q, k, v, mask, 0.25)


def test_empty_batch_returns_empty(interpreted_kernel):
    q, k, v = torch.randn(0, 2, 3, 8), torch.randn(0, 2, 5, 8), torch.randn(0, 2, 5, 8)
    out = interpreted_kernel.tree_attention_triton(q, k, v, torch.zeros(0, 3, 1, dtype=torch.int32), 1.0)
    assert out.shape == (0, 2, 3, 8)


def test_wrapper_rejects_bad_arguments(interpreted_kernel):
    q, k, v, mask = make_inputs(1, 2, 1, 3, 200, 8, torch.float32, seed=0)  # long enough for 2 splits
    with pytest.raises(TreeAttentionDtypeError, match="fp16, bf16 or fp32"):
        interpreted_kernel.tree_attention_triton(q.double(), k.double(), v.double(), mask, 1.0)
    with pytest.raises(TreeAttentionShapeError, match="out must be"):
        interpreted_kernel.tree_attention_triton(q, k, v, mask, 1.0, out=torch.empty(1, 2, 3, 4))
    with pytest.raises(TreeAttentionShapeError, match="workspace m must be"):
        interpreted_kernel.tree_attention_triton(
            q, k, v, mask, 1.0, num_splits=2, workspace=(torch.empty(1), torch.empty(1), torch.empty(1))
        )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("seed", range(6))
def test_kernel_random_shapes(interpreted_kernel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    kv_heads = int(torch.randint(1, 4, (1,), generator=g))
    q_heads = kv_heads * int(torch.randint(1, 5, (1,), generator=g))
    n = int(torch.randint(1, 70, (1,), generator=g))
    prefix = int(torch.randint(0, 300, (1,), generator=g))
    d = [3, 16, 24, 64, 128][seed % 5]
    splits = int(torch.randint(1, 5, (1,), generator=g))
    q, k, v, mask = make_inputs(2, q_heads, kv_heads, n, prefix, d, dtype, seed=seed)
    out = torch.full_like(q, float("nan"))
    interpreted_kernel.tree_attention_triton(q, k, v, mask, 0.2, out=out, num_splits=splits)
    assert_matches_reference(out, q, k, v, mask, 0.2)
