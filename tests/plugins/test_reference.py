"""The torch reference against an independent oracle: per-branch causal attention.

Tree token i sees the prefix and exactly the tree tokens on its root path, in order, so its output must equal
ordinary attention of one query over the sequence prefix + path(i) (torch SDPA, no mask), in fp64.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from plugins.tree_attention import pack_mask, tree_attention_reference
from plugins.tree_attention.spec import (
    TreeAttentionDeviceError,
    TreeAttentionDtypeError,
    TreeAttentionShapeError,
)
from tests.plugins.trees import path_to_root, random_tree_masks


def branch_oracle(q, k, v, parents, scale):
    """out[b, h, i] = SDPA(q[b, h, i], k/v[b, h // G, prefix + path(i)])."""
    b_, hq, n, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    prefix = s - n
    out = torch.empty_like(q)
    for b in range(b_):
        for i in range(n):
            keys = list(range(prefix)) + [prefix + j for j in path_to_root(parents[b], i)]
            for h in range(hq):
                kv_h = h // (hq // hkv)
                out[b, h, i] = F.scaled_dot_product_attention(
                    q[b, h, i][None, None], k[b, kv_h, keys][None], v[b, kv_h, keys][None], scale=scale
                )[0, 0]
    return out


@pytest.mark.parametrize(
    "batch,q_heads,kv_heads,n,prefix,d",
    [(1, 1, 1, 1, 0, 4), (2, 4, 2, 7, 5, 8), (1, 6, 2, 35, 0, 3), (2, 8, 1, 13, 40, 16), (1, 2, 2, 33, 9, 5)],
)
def test_reference_matches_branch_oracle(batch, q_heads, kv_heads, n, prefix, d):
    g = torch.Generator().manual_seed(batch * 1000 + n * 10 + prefix)
    parents, tree = random_tree_masks(batch, n, g)
    q = torch.randn(batch, q_heads, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, prefix + n, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, prefix + n, d, generator=g, dtype=torch.float64)
    scale = 1 / math.sqrt(d)
    expected = branch_oracle(q, k, v, parents, scale)
    packed = tree_attention_reference(q, k, v, pack_mask(tree), scale)
    as_bool = tree_attention_reference(q, k, v, tree, scale)
    torch.testing.assert_close(packed, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(packed, as_bool)


def test_reference_sees_the_mask():
    """A chain and a star over the same tokens must give different outputs (the mask is not ignored)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    chain = torch.tril(torch.ones(1, 6, 6, dtype=torch.bool))
    star = torch.eye(6, dtype=torch.bool)[None].clone()
    star[0, :, 0] = True
    a = tree_attention_reference(q, k, v, pack_mask(chain), 0.3)
    b = tree_attention_reference(q, k, v, pack_mask(star), 0.3)
    assert torch.equal(a[:, :, :2], b[:, :, :2])  # rows 0, 1 have the same ancestors in both
    assert not torch.allclose(a[:, :, 2:], b[:, :, 2:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs_are_computed_in_fp32(dtype):
    g = torch.Generator().manual_seed(1)
    _, tree = random_tree_masks(2, 9, g)
    q = torch.randn(2, 4, 9, 16, generator=g).to(dtype)
    k = torch.randn(2, 2, 20, 16, generator=g).to(dtype)
    v = torch.randn(2, 2, 20, 16, generator=g).to(dtype)
    out = tree_attention_reference(q, k, v, pack_mask(tree), 0.25)
    exact = tree_attention_reference(q.double(), k.double(), v.double(), pack_mask(tree), 0.25)
    assert out.dtype == dtype
    # Computed in fp32: within one unit of `dtype`'s last place of the exact result (an fp16/bf16 computation
    # would be off by tens of units).
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    torch.testing.assert_close(out.double(), exact, rtol=eps, atol=eps * exact.abs().max().item())


def test_row_with_nothing_visible_is_zero_not_nan():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4)
    tree = torch.tensor([[[True, False], [False, False]]])
    out = tree_attention_reference(q, k, v, tree, 0.5)
    assert torch.equal(out[0, 0, 1], torch.zeros(4))
    assert torch.isfinite(out).all()


def test_bad_inputs_raise_specific_errors():
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = pack_mask(torch.ones(1, 3, 3, dtype=torch.bool))
    with pytest.raises(TreeAttentionShapeError, match="multiple of kv heads"):
        tree_attention_reference(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), mask, 1.0)
    with pytest.raises(TreeAttentionShapeError, match="fewer than the 3 tree tokens"):
        tree_attention_reference(q, k[:, :, :2], v[:, :, :2], mask, 1.0)
    with pytest.raises(TreeAttentionShapeError, match=r"tree_mask has shape \(1, 3, 2\)"):
        tree_attention_reference(q, k, v, torch.zeros(1, 3, 2, dtype=torch.int32), 1.0)
    with pytest.raises(TreeAttentionDtypeError, match="tree_mask must be int32"):
        tree_attention_reference(q, k, v, mask.to(torch.int64), 1.0)
    with pytest.raises(TreeAttentionDtypeError, match="share one dtype"):
        tree_attention_reference(q, k.half(), v, mask, 1.0)
    with pytest.raises(TreeAttentionShapeError, match="must be 4-D"):
        tree_attention_reference(q[0], k, v, mask, 1.0)
    with pytest.raises(TreeAttentionDeviceError, match="one device"):
        tree_attention_reference(q, k, v, mask.to("meta"), 1.0)
