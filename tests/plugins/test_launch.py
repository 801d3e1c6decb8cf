"""Launch geometry and the TensorRT plugin's shape / launch-parameter formulas, without TensorRT or a GPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from plugins.tree_attention.launch import (
    AOT_TACTIC_BLOCK_M,
    SCALAR_ARGS,
    LaunchConfigError,
    aot_tile_candidates,
    autotune_io_types,
    cdiv,
    choose_num_splits,
    contiguous_scalar_args,
    plan_launch,
    tile_config,
)
from plugins.tree_attention.trt_plugin import aot_grid, constant_head_dim


class LeftOnlyExpr:
    """Stands in for TensorRT's ShapeExpr where that matters here: it supports + - * // only with itself on the
    left (ShapeExpr has no reflected operators) and evaluates to the int it was built from."""

    def __init__(self, value: int):
        self.value = value

    def _other(self, other):
        return other.value if isinstance(other, LeftOnlyExpr) else other

    def __add__(self, other):
        return LeftOnlyExpr(self.value + self._other(other))

    def __sub__(self, other):
        return LeftOnlyExpr(self.value - self._other(other))

    def __mul__(self, other):
        return LeftOnlyExpr(self.value * self._other(other))

    def __floordiv__(self, other):
        return LeftOnlyExpr(self.value // self._other(other))


def evaluate(x):
    return x.value if isinstance(x, LeftOnlyExpr) else x


CASES = [(1, 1, 1, 1, 0, 64), (2, 32, 8, 16, 4096, 128), (3, 6, 2, 63, 517, 5), (1, 28, 4, 64, 16384, 128)]


@pytest.mark.parametrize("batch,q_heads,kv_heads,n,prefix,d", CASES)
def test_scalar_args_are_the_strides_of_contiguous_tensors(batch, q_heads, kv_heads, n, prefix, d):
    q = torch.empty(batch, q_heads, n, d, device="meta")
    k = torch.empty(batch, kv_heads, prefix + n, d, device="meta")
    mask = torch.empty(batch, n, (n + 31) // 32, dtype=torch.int32, device="meta")
    expected = [prefix, n, q_heads // kv_heads, kv_heads, prefix, *q.stride()[:3], *k.stride()[:3], *k.stride()[:3],
                *mask.stride()[:2], *q.stride()[:3]]
    assert len(expected) == len(SCALAR_ARGS)
    assert contiguous_scalar_args(q.shape, k.shape, mask.shape) == expected
    symbolic = contiguous_scalar_args(*[[LeftOnlyExpr(x) for x in t.shape] for t in (q, k, mask)])
    assert [evaluate(x) for x in symbolic] == expected


@pytest.mark.parametrize("batch,q_heads,kv_heads,n,prefix,d", CASES)
@pytest.mark.parametrize("tactic", sorted(AOT_TACTIC_BLOCK_M))
def test_aot_grid_covers_every_row_once(batch, q_heads, kv_heads, n, prefix, d, tactic):
    block_m = AOT_TACTIC_BLOCK_M[tactic]
    q_shape, k_shape = (batch, q_heads, n, d), (batch, kv_heads, prefix + n, d)
    grid = aot_grid(q_shape, k_shape, block_m)
    rows = q_heads // kv_heads * n
    assert grid == (cdiv(rows, block_m), batch * kv_heads, 1)
    assert (grid[0] - 1) * block_m < rows <= grid[0] * block_m
    symbolic = aot_grid([LeftOnlyExpr(x) for x in q_shape], [LeftOnlyExpr(x) for x in k_shape], block_m)
    assert tuple(evaluate(x) for x in symbolic) == grid


@pytest.mark.parametrize("prefix", [0, 1, 63, 64, 65, 1000, 16384])
@pytest.mark.parametrize("splits", [None, 1, 2, 3, 7, 64])
def test_splits_partition_the_prefix(prefix, splits):
    plan = plan_launch(batch=1, q_heads=8, kv_heads=8, num_tree=4, prefix_len=prefix, head_dim=128, elem_bytes=2,
                       sm_count=132, num_splits=splits)
    bn = plan.tiles.block_n
    assert plan.split_len % bn == 0
    assert plan.grid[2] == plan.num_splits >= 1
    ranges = [(s * plan.split_len, min(prefix, (s + 1) * plan.split_len)) for s in range(plan.num_splits)]
    covered = [i for lo, hi in ranges for i in range(lo, hi)]
    assert covered == list(range(prefix)), "every prefix key in exactly one split, in order"
    if prefix:
        assert all(hi > lo for lo, hi in ranges), "no empty split"
    if splits is not None:
        assert plan.num_splits <= splits


def test_auto_splits_fill_the_gpu_only_when_work_is_scarce():
    few = plan_launch(batch=1, q_heads=8, kv_heads=8, num_tree=1, prefix_len=16384, head_dim=128, elem_bytes=2, sm_count=132)
    many = plan_launch(batch=64, q_heads=32, kv_heads=8, num_tree=64, prefix_len=16384, head_dim=128, elem_bytes=2, sm_count=132)
    short = plan_launch(batch=1, q_heads=8, kv_heads=8, num_tree=1, prefix_len=100, head_dim=128, elem_bytes=2, sm_count=132)
    no_gpu = plan_launch(batch=1, q_heads=8, kv_heads=8, num_tree=1, prefix_len=16384, head_dim=128, elem_bytes=2)
    assert few.num_splits > 8 and few.grid[0] * few.grid[1] * few.grid[2] >= 132
    assert many.num_splits == 1 and short.num_splits == 1 and no_gpu.num_splits == 1
    assert choose_num_splits(programs=1, prefix_len=10**6, block_n=64, sm_count=10**4) == 64  # capped


@pytest.mark.parametrize("rows,d,elem", list(itertools.product([1, 8, 17, 64, 200], [3, 64, 100, 128, 256], [2, 4])))
def test_tile_config(rows, d, elem):
    t = tile_config(rows, d, elem)
    assert t.block_d >= max(16, d) and t.block_d & (t.block_d - 1) == 0
    assert t.block_m in (16, 32, 64) and (t.block_m >= rows or t.block_m == 64)
    assert 16 <= t.block_n <= 64
    assert 2 * t.block_n * t.block_d * elem <= 16 * 1024 or t.block_n == 16


def test_aot_tile_candidates_shrink_shared_memory():
    candidates = aot_tile_candidates(128, 4, 64)
    footprint = [c.num_stages * c.block_n for c in candidates]
    assert footprint == sorted(footprint, reverse=True) and candidates[-1].block_n == 16
    assert all(c.block_m == 64 and c.block_d == 128 for c in candidates)


def test_bad_launch_requests():
    with pytest.raises(LaunchConfigError, match="multiple of kv_heads"):
        plan_launch(batch=1, q_heads=6, kv_heads=4, num_tree=1, prefix_len=0, head_dim=8, elem_bytes=2)
    with pytest.raises(LaunchConfigError, match="num_tree must be >= 1"):
        plan_launch(batch=1, q_heads=4, kv_heads=4, num_tree=0, prefix_len=0, head_dim=8, elem_bytes=2)
    with pytest.raises(LaunchConfigError, match="256 maximum"):
        tile_config(1, 300, 2)
    with pytest.raises(LaunchConfigError, match="block_m must be one of"):
        tile_config(1, 64, 2, block_m=128)
    with pytest.raises(LaunchConfigError, match="elem_bytes"):
        tile_config(1, 64, 8)


def test_autotune_types_pair_position_by_position():
    fields = [f.split("|") for f in autotune_io_types().split(",")]
    assert len(fields) == 5  # q, k, v, tree_mask, out
    combos = list(zip(*fields))  # '|' is dependent: the i-th choice of every position goes together
    assert combos == [("FP16",) * 3 + ("INT32", "FP16"), ("BF16",) * 3 + ("INT32", "BF16"), ("FP32",) * 3 + ("INT32", "FP32")]


def test_constant_head_dim():
    class Expr:
        is_fake = False

        def __init__(self, constant):
            self.is_constant = constant is not None
            self._value = constant

        def constant_value(self):
            return self._value

    assert constant_head_dim(128) == 128
    assert constant_head_dim(Expr(64)) == 64
    with pytest.raises(LaunchConfigError, match="static head dim"):
        constant_head_dim(Expr(None))
