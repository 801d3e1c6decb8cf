"""Launch geometry of the Triton tree-attention kernel, shared by the torch wrapper and the TensorRT plugin.

Pure Python: no torch, triton or tensorrt import, so the TensorRT plugin's shape and launch-parameter logic is
tested without TensorRT. Functions that take shapes accept plain ints or TensorRT's symbolic `ShapeExpr`s
(which support `+ - * //` with the symbolic operand on the left), so the plugin evaluates the same formulas
symbolically at engine build time.

Work decomposition: one program handles one (batch, kv head) pair, a block of BLOCK_M "rows" and one KV split.
A row is one (query head of the kv head's GQA group, tree token) pair, row = g * N + i, so the K/V tiles a
program loads serve every query head that shares them. The prefix [0, L) is cut into `num_splits` chunks of
`split_len` positions (a multiple of BLOCK_N); the tree block [L, L + N) is done by the last split. With one
split the kernel writes the output directly (the only mode the TensorRT plugin uses: its ahead-of-time launch
has no workspace); with more it writes per-split softmax partials that a second kernel combines
(flash-decoding), which keeps the GPU busy when B * Hkv * row blocks is small and L is long.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

# Names of the kernel's int scalar arguments, in order. They sit between the input pointers (q, k, v,
# tree_mask) and the output pointer(s), which is the argument order TensorRT's ahead-of-time launch uses.
SCALAR_ARGS = (
    "prefix_len",
    "num_tree",
    "group",
    "num_kv_heads",
    "split_len",
    "stride_qb",
    "stride_qh",
    "stride_qn",
    "stride_kb",
    "stride_kh",
    "stride_ks",
    "stride_vb",
    "stride_vh",
    "stride_vs",
    "stride_mb",
    "stride_mn",
    "stride_ob",
    "stride_oh",
    "stride_on",
)
# Scalars that are always a multiple of the head dim for contiguous q/k/v/out (TensorRT's LINEAR format):
# when head_dim % 16 == 0 the ahead-of-time compile may promise 16-divisibility for them (vectorised loads).
HEAD_DIM_MULTIPLE_ARGS = frozenset(
    ("stride_qb", "stride_qh", "stride_qn", "stride_kb", "stride_kh", "stride_ks")
    + ("stride_vb", "stride_vh", "stride_vs", "stride_ob", "stride_oh", "stride_on")
)

MAX_SPLITS = 64
MIN_TILES_PER_SPLIT = 4  # a split shorter than this many BLOCK_N tiles costs more in combine than it saves


class LaunchConfigError(ValueError):
    """A launch request the kernel cannot serve (bad sizes, bad split count)."""


def next_power_of_2(x: int) -> int:
    if x < 1:
        return 1
    return 1 << (x - 1).bit_length()


def cdiv(a: Any, b: int) -> Any:
    """Ceil division for ints and TensorRT ShapeExprs alike (symbolic operand on the left)."""
    return (a + (b - 1)) // b


@dataclass(frozen=True)
class TileConfig:
    """Compile-time tile sizes of one kernel specialisation."""

    block_m: int  # rows (GQA group x tree tokens) per program
    block_n: int  # keys per inner-loop tile
    block_d: int  # head dim padded to a power of two (>= 16 for tl.dot)
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the host needs to launch the kernel(s) for one call."""

    tiles: TileConfig
    num_splits: int
    split_len: int  # prefix positions per split; a multiple of block_n (0 when the prefix is empty)
    grid: tuple[int, int, int]  # (row blocks, batch * kv_heads, splits)


# TensorRT tactics of the ahead-of-time plugin: the number of rows is only known at run time there, so the
# engine builder times one kernel per BLOCK_M and keeps the fastest for its optimisation profile.
AOT_TACTIC_BLOCK_M = {1: 16, 2: 32, 3: 64}
BLOCK_M_CHOICES = (16, 32, 64)


def tile_config(rows: int, head_dim: int, elem_bytes: int, *, block_m: int | None = None) -> TileConfig:
    """Tile sizes for `rows` = group * N rows per (batch, kv head) and a head dim.

    BLOCK_M covers all rows when they fit in 64 (then K/V are read once per kv head) unless forced; BLOCK_N
    shrinks for wide heads and fp32 to bound the shared memory of the pipelined K/V tiles.
    """
    if rows < 1 or head_dim < 1:
        raise LaunchConfigError(f"rows ({rows}) and head_dim ({head_dim}) must be >= 1")
    if elem_bytes not in (2, 4):
        raise LaunchConfigError(f"elem_bytes must be 2 (fp16/bf16) or 4 (fp32), got {elem_bytes}")
    block_d = max(16, next_power_of_2(head_dim))
    if block_d > 256:
        raise LaunchConfigError(f"head_dim {head_dim} is larger than the kernel's 256 maximum")
    if block_m is None:
        block_m = min(64, max(16, next_power_of_2(rows)))
    elif block_m not in BLOCK_M_CHOICES:
        raise LaunchConfigError(f"block_m must be one of {BLOCK_M_CHOICES}, got {block_m}")
    # K and V tiles of one stage: 2 * block_n * block_d * elem_bytes <= 16 KiB keeps two stages under 48 KiB.
    block_n = 64
    while block_n > 16 and 2 * block_n * block_d * elem_bytes > 16 * 1024:
        block_n //= 2
    num_warps = 4 if block_m * block_d <= 64 * 64 else 8
    return TileConfig(block_m=block_m, block_n=block_n, block_d=block_d, num_warps=num_warps, num_stages=2)


def aot_tile_candidates(head_dim: int, elem_bytes: int, block_m: int) -> list[TileConfig]:
    """Tile configs to try, best first, for an ahead-of-time kernel that must fit the 48 KiB of shared memory a
    launch gets without opting in (TensorRT's launch cannot opt in): the default, then one pipeline stage, then
    narrower key tiles."""
    base = tile_config(block_m, head_dim, elem_bytes, block_m=block_m)
    candidates = [base, replace(base, num_stages=1)]
    block_n = base.block_n // 2
    while block_n >= 16:
        candidates.append(replace(base, block_n=block_n, num_stages=1))
        block_n //= 2
    return candidates


def choose_num_splits(programs: int, prefix_len: int, block_n: int, sm_count: int | None) -> int:
    """KV splits so that about two waves of programs cover the GPU, each split at least a few tiles long."""
    if sm_count is None or prefix_len <= 0:
        return 1
    wanted = cdiv(2 * sm_count, max(programs, 1))
    longest = max(1, prefix_len // (block_n * MIN_TILES_PER_SPLIT))
    return max(1, min(wanted, longest, MAX_SPLITS))


def plan_launch(
    *,
    batch: int,
    q_heads: int,
    kv_heads: int,
    num_tree: int,
    prefix_len: int,
    head_dim: int,
    elem_bytes: int,
    sm_count: int | None = None,
    num_splits: int | None = None,
) -> LaunchPlan:
    """Launch plan for concrete sizes. `num_splits` forces a split count (tests); else it is chosen from
    `sm_count` (None -> a single split, as in the TensorRT plugin)."""
    for name, value in (("batch", batch), ("q_heads", q_heads), ("kv_heads", kv_heads), ("num_tree", num_tree)):
        if value < 1:
            raise LaunchConfigError(f"{name} must be >= 1, got {value}")
    if prefix_len < 0:
        raise LaunchConfigError(f"prefix_len must be >= 0, got {prefix_len}")
    if q_heads % kv_heads:
        raise LaunchConfigError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    rows = (q_heads // kv_heads) * num_tree
    tiles = tile_config(rows, head_dim, elem_bytes)
    row_blocks = cdiv(rows, tiles.block_m)
    if num_splits is None:
        num_splits = choose_num_splits(row_blocks * batch * kv_heads, prefix_len, tiles.block_n, sm_count)
    elif num_splits < 1:
        raise LaunchConfigError(f"num_splits must be >= 1, got {num_splits}")
    split_len = cdiv(cdiv(prefix_len, num_splits), tiles.block_n) * tiles.block_n
    # Rounding split_len up to whole tiles can leave trailing splits empty: drop them.
    num_splits = cdiv(prefix_len, split_len) if prefix_len > 0 else 1
    return LaunchPlan(tiles=tiles, num_splits=num_splits, split_len=split_len, grid=(row_blocks, batch * kv_heads, num_splits))


def contiguous_scalar_args(q_shape: Sequence[Any], k_shape: Sequence[Any], mask_shape: Sequence[Any]) -> list[Any]:
    """The kernel's int scalars (SCALAR_ARGS order) for contiguous q [B,Hq,N,D], k = v [B,Hkv,S,D],
    tree_mask [B,N,W] and out [B,Hq,N,D], with a single split (split_len = prefix_len).

    Entries are ints or ShapeExprs built from the given dims (TensorRT evaluates them per launch)."""
    _, hq, n, d = q_shape
    _, hkv, s, _ = k_shape
    w = mask_shape[2]
    prefix = s - n
    q_strides = [hq * n * d, n * d, d]
    kv_strides = [hkv * s * d, s * d, d]
    return [prefix, n, hq // hkv, hkv, prefix, *q_strides, *kv_strides, *kv_strides, n * w, w, *q_strides]


def autotune_io_types() -> str:
    """TensorRT AutoTuneCombination type string: q, k, v and out share fp16, bf16 or fp32; the mask is int32.

    '|' makes the choices dependent (position-wise): all-FP16, all-BF16 or all-FP32."""
    floats = "FP16|BF16|FP32"
    return ",".join([floats, floats, floats, "INT32|INT32|INT32", floats])
