"""OpenAI Triton tree-attention kernel (flash-attention style online softmax) and its two launchers:
`tree_attention_triton` (torch tensors, CUDA, or CPU under TRITON_INTERPRET=1) and `compile_aot` (PTX for the
TensorRT plugin's ahead-of-time implementation).

Math, per query row (one query head h, one tree token i; softmax in base 2 with log2(e) folded into the scale):
    s_j = (q . k_j) * scale * log2(e)  for visible keys j: every prefix key, and tree key L + j' when bit j' of
    tree_mask[b, i] is set;  out = sum_j 2^(s_j - m) v_j / sum_j 2^(s_j - m), m = max_j s_j.
The running max m, running sum l and the unnormalised accumulator are carried over key tiles; a split writes
(m, l, acc) and the combine kernel merges splits with weights 2^(m_split - max m).
The launch geometry (rows, splits, tile sizes) is in plugins/tree_attention/launch.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plugins.tree_attention.launch import (
    AOT_TACTIC_BLOCK_M,
    HEAD_DIM_MULTIPLE_ARGS,
    SCALAR_ARGS,
    LaunchConfigError,
    TileConfig,
    aot_tile_candidates,
    next_power_of_2,
    plan_launch,
)
from plugins.tree_attention.spec import (
    KERNEL_DTYPES,
    TreeAttentionDeviceError,
    TreeAttentionDtypeError,
    TreeAttentionShapeError,
    check_inputs,
)

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, QK_SCALE: tl.constexpr, IEEE: tl.constexpr):
    # q [BLOCK_M, BLOCK_D], k [BLOCK_D, BLOCK_N] (already transposed), v [BLOCK_N, BLOCK_D],
    # visible [BLOCK_M, BLOCK_N] bool, m_i / l_i [BLOCK_M] fp32, acc [BLOCK_M, BLOCK_D] fp32.
    if IEEE:  # fp32 inputs: exact fp32 products instead of tf32
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = tl.where(visible, s * QK_SCALE, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; exponentiate against 0 there so that 2^(-inf - m) is 0,
    # not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _attend(
    Q, K, V, MASK,
    prefix_len, num_tree, group, num_kv_heads, split_len,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mn,
    QK_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    """(m, l, acc) of this program's rows over its KV split; see launch.py for the decomposition."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    hkv = (pid_bh % num_kv_heads).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = g * N + i
    row_ok = rows < group * num_tree
    i = rows % num_tree  # tree token
    h = hkv * group + rows // num_tree  # query head [BLOCK_M] int64
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q = tl.load(
        Q + b * stride_qb + h[:, None] * stride_qh + i[:, None] * stride_qn + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Prefix keys of this split: all visible.
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, prefix_len)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None], mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        visible = row_ok[:, None] & col_ok[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, QK_SCALE, IEEE)

    # Tree keys L + j, visible when bit j of the row's packed mask is set (word j // 32, bit j % 32; the
    # arithmetic shift of a negative word still leaves bit 31 in bit 0). The last split does them.
    if pid_s == tl.num_programs(2) - 1:
        mask_row = MASK + b * stride_mb + i * stride_mn  # [BLOCK_M] pointers
        for start in range(0, num_tree, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < num_tree
            words = tl.load(mask_row[:, None] + (j // 32)[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0)
            visible = ((words >> (j % 32)[None, :]) & 1) != 0
            cols = prefix_len + j
            k = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, QK_SCALE, IEEE)
    return m_i, l_i, acc, b, h, i, row_ok, offs_d, d_ok


@triton.jit
def tree_attention_kernel(
    Q, K, V, MASK,
    prefix_len, num_tree, group, num_kv_heads, split_len,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mn,
    stride_ob, stride_oh, stride_on,
    OUT,
    QK_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    """Single-split launch, writes OUT directly. Argument order = TensorRT's: inputs, int scalars, output."""
    m_i, l_i, acc, b, h, i, row_ok, offs_d, d_ok = _attend(
        Q, K, V, MASK, prefix_len, num_tree, group, num_kv_heads, split_len,
        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_mb, stride_mn, QK_SCALE, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, IEEE,
    )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows with nothing visible -> 0, as the reference
    tl.store(
        OUT + b * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_on + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def tree_attention_split_kernel(
    Q, K, V, MASK,
    prefix_len, num_tree, group, num_kv_heads, split_len,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mn,
    stride_ob, stride_oh, stride_on,
    M_PART, L_PART, ACC_PART,
    QK_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    """One KV split; writes fp32 partials M_PART / L_PART [B, Hq, N, S] and ACC_PART [B, Hq, N, S, HEAD_DIM]."""
    m_i, l_i, acc, b, h, i, row_ok, offs_d, d_ok = _attend(
        Q, K, V, MASK, prefix_len, num_tree, group, num_kv_heads, split_len,
        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_mb, stride_mn, QK_SCALE, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, IEEE,
    )
    num_splits = tl.num_programs(2)
    part = ((b * (num_kv_heads * group) + h) * num_tree + i) * num_splits + tl.program_id(2)  # [BLOCK_M]
    tl.store(M_PART + part, m_i, mask=row_ok)
    tl.store(L_PART + part, l_i, mask=row_ok)
    tl.store(ACC_PART + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def tree_attention_combine_kernel(
    M_PART, L_PART, ACC_PART,
    q_heads, num_tree, num_splits,
    stride_ob, stride_oh, stride_on,
    OUT,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the splits of one row (b, h, i) = program id ((b * Hq + h) * N + i)."""
    row = tl.program_id(0).to(tl.int64)
    i = row % num_tree
    h = (row // num_tree) % q_heads
    b = row // (num_tree * q_heads)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    part = row * num_splits + s
    m = tl.load(M_PART + part, mask=s_ok, other=float("-inf"))
    l = tl.load(L_PART + part, mask=s_ok, other=0.0)
    acc = tl.load(ACC_PART + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits (m = -inf) weigh 0
    total = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + b * stride_ob + h * stride_oh + i * stride_on + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernel indexes the last dim with unit stride; every other stride is passed through, so views into a
    # KV cache ([B, Hkv, max_len, D] sliced on dim 2) need no copy.
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def tree_attention_triton(
    q: torch.Tensor,  # [B, Hq, N, D] fp16 / bf16 / fp32
    k: torch.Tensor,  # [B, Hkv, L + N, D]
    v: torch.Tensor,  # [B, Hkv, L + N, D]
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32 packed
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [B, Hq, N, D], dtype of q; written in place when given
    num_splits: int | None = None,  # force the KV split count (default: chosen from the SM count on CUDA)
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # split partials, see below
) -> torch.Tensor:  # [B, Hq, N, D]
    """Launch the Triton kernel(s). Tensors must be on CUDA, or on CPU with kernels built under TRITON_INTERPRET=1.

    `workspace`, when given and more than one split runs, is (m, l, acc) fp32 tensors of shapes [B, Hq, N, S],
    [B, Hq, N, S] and [B, Hq, N, S, D], contiguous; otherwise they are allocated.
    """
    dims = check_inputs(q, k, v, tree_mask)
    if q.dtype not in KERNEL_DTYPES:
        raise TreeAttentionDtypeError(f"the Triton kernel takes fp16, bf16 or fp32, got {q.dtype}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise TreeAttentionShapeError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    elif out.stride(-1) != 1:
        raise TreeAttentionShapeError(f"out must have a unit last-dim stride, got strides {out.stride()}")
    if q.numel() == 0:
        return out
    if not q.is_cuda and isinstance(tree_attention_kernel, triton.runtime.JITFunction):
        raise TreeAttentionDeviceError(f"the compiled Triton kernel needs CUDA tensors, got {q.device}")
    q, k, v, tree_mask = (_last_dim_contiguous(t) for t in (q, k, v, tree_mask))
    sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else None
    plan = plan_launch(
        batch=dims.batch,
        q_heads=dims.q_heads,
        kv_heads=dims.kv_heads,
        num_tree=dims.num_tree,
        prefix_len=dims.prefix_len,
        head_dim=dims.head_dim,
        elem_bytes=q.element_size(),
        sm_count=sm_count,
        num_splits=num_splits,
    )
    scalars = (
        dims.prefix_len, dims.num_tree, dims.group, dims.kv_heads, plan.split_len,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *tree_mask.stride()[:2], *out.stride()[:3],
    )
    meta = _meta(plan.tiles, scale, dims.head_dim, q.dtype)
    if plan.num_splits == 1:
        tree_attention_kernel[plan.grid](q, k, v, tree_mask, *scalars, out, **meta)
        return out
    parts = _split_workspace(dims.batch, dims.q_heads, dims.num_tree, plan.num_splits, dims.head_dim, q.device, workspace)
    tree_attention_split_kernel[plan.grid](q, k, v, tree_mask, *scalars, *parts, **meta)
    tree_attention_combine_kernel[(dims.batch * dims.q_heads * dims.num_tree,)](
        *parts, dims.q_heads, dims.num_tree, plan.num_splits, *out.stride()[:3], out,
        HEAD_DIM=dims.head_dim, BLOCK_S=next_power_of_2(plan.num_splits), BLOCK_D=plan.tiles.block_d,
    )
    return out


def _meta(tiles: TileConfig, scale: float, head_dim: int, dtype: torch.dtype) -> dict:
    return dict(
        QK_SCALE=float(scale) * LOG2E,
        HEAD_DIM=head_dim,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=tiles.block_d,
        IEEE=dtype == torch.float32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _split_workspace(b, hq, n, splits, d, device, workspace):
    shapes = ((b, hq, n, splits), (b, hq, n, splits), (b, hq, n, splits, d))
    if workspace is None:
        return tuple(torch.empty(s, dtype=torch.float32, device=device) for s in shapes)
    for name, t, shape in zip(("m", "l", "acc"), workspace, shapes):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != device or not t.is_contiguous():
            raise TreeAttentionShapeError(
                f"workspace {name} must be a contiguous fp32 tensor {shape} on {device}, "
                f"got {tuple(t.shape)} {t.dtype} on {t.device}"
            )
    return tuple(workspace)


# ----------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation (TensorRT plugin). Pure Triton: runs without a GPU and without TensorRT.

_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
MAX_STATIC_SHARED = 48 * 1024  # bytes a launch may use without cuFuncSetAttribute, which TensorRT does not call


@dataclass(frozen=True)
class AotKernel:
    name: str  # PTX entry point
    ptx: str
    tiles: TileConfig
    num_warps: int  # threads per block = 32 * num_warps
    shared_mem: int  # dynamic shared memory bytes
    arch: int  # e.g. 90 for sm_90
    num_params: int  # PTX .param entries, Triton's hidden scratch pointers included


def compile_aot(
    dtype: torch.dtype,
    head_dim: int,
    scale: float,
    *,
    arch: int,
    block_m: int = AOT_TACTIC_BLOCK_M[3],
    ptx_version: int | None = None,
) -> AotKernel:
    """PTX of `tree_attention_kernel` (single split) for one dtype / head dim / scale / BLOCK_M on sm_{arch}.

    The scale is baked in as a constant: TensorRT passes only int scalars to ahead-of-time kernels and does
    not serialise plugin attributes into the engine. Triton >= 3.3 appends hidden global/profile scratch
    pointers to every kernel; TensorRT passes null for parameters it was not given, which is only safe while
    the kernel uses no scratch, so that is checked here.
    """
    if dtype not in _TRITON_TYPES:
        raise TreeAttentionDtypeError(f"ahead-of-time kernel dtype must be fp16, bf16 or fp32, got {dtype}")
    if not math.isfinite(scale):
        raise LaunchConfigError(f"scale must be finite, got {scale}")
    elem = torch.empty((), dtype=dtype).element_size()
    ptr = "*" + _TRITON_TYPES[dtype]
    signature = {"Q": ptr, "K": ptr, "V": ptr, "MASK": "*i32", **{name: "i32" for name in SCALAR_ARGS}, "OUT": ptr}
    # TensorRT buffers are 256-byte aligned; strides of contiguous q/k/v/out are multiples of the head dim.
    arg_names = tree_attention_kernel.arg_names
    divisible = {"Q", "K", "V", "MASK", "OUT"}
    if head_dim % 16 == 0:
        divisible |= HEAD_DIM_MULTIPLE_ARGS
    attrs = {(arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    target = triton.backends.compiler.GPUTarget("cuda", arch, 32)
    tried = []
    for tiles in aot_tile_candidates(head_dim, elem, block_m):
        meta = _meta(tiles, scale, head_dim, dtype)
        options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
        if ptx_version is not None:
            options["ptx_version"] = ptx_version
        source = triton.compiler.ASTSource(
            fn=tree_attention_kernel,
            signature={**signature, **{name: "constexpr" for name in meta}},
            constexprs=meta,
            attrs=attrs,
        )
        compiled = triton.compile(source, target=target, options=options)
        if compiled.metadata.shared <= MAX_STATIC_SHARED:
            break
        tried.append(f"BLOCK_N {tiles.block_n} x {tiles.num_stages} stages: {compiled.metadata.shared} bytes")
    else:
        raise RuntimeError(
            f"no tile config of tree_attention_kernel for {dtype}, head_dim {head_dim}, BLOCK_M {block_m} fits "
            f"{MAX_STATIC_SHARED} bytes of shared memory: " + "; ".join(tried)
        )
    md = compiled.metadata
    problems = []
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        problems.append(f"scratch memory (global {md.global_scratch_size}, profile {md.profile_scratch_size} bytes)")
    if getattr(md, "num_ctas", 1) != 1:
        problems.append(f"num_ctas={md.num_ctas}")
    if getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        problems.append("a cooperative / programmatic-dependent launch")
    if problems:
        raise RuntimeError(f"{md.name} for {dtype}, head_dim {head_dim}, sm_{arch} needs " + "; ".join(problems))
    ptx = compiled.asm["ptx"]
    return AotKernel(
        name=md.name,
        ptx=ptx,
        tiles=tiles,
        num_warps=md.num_warps,
        shared_mem=md.shared,
        arch=arch,
        num_params=count_ptx_params(ptx, md.name),
    )


def count_ptx_params(ptx: str, entry: str) -> int:
    """Number of .param entries of `.entry <entry>(...)` in PTX text."""
    match = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)", ptx, re.S)
    if match is None:
        raise RuntimeError(f"no .entry {entry} in the PTX")
    return len(re.findall(r"\.param\b", match.group(1)))
