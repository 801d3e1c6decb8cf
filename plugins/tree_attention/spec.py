"""What every host of the tree-attention op agrees on: plugin naming, input validation, error types.

Pure torch; imported by the reference, the Triton wrapper, the torch op, the ONNX exporter and the TensorRT
plugin so that they reject bad input with the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugins.tree_attention.mask import mask_words

# The ONNX node is named after the TensorRT plugin: TensorRT's ONNX parser maps an unknown op_type to the plugin
# registered under that exact name, in the namespace given by the node's `plugin_namespace` attribute.
PLUGIN_NAME = "SpectreeTreeAttention"
PLUGIN_NAMESPACE = "spectree"
PLUGIN_VERSION = "1"
ONNX_DOMAIN = "spectree"  # TensorRT ignores a node's domain; onnxruntime and the checker need one.
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"

# Dtypes the Triton kernel (and so the CUDA op and the TensorRT plugin) computes in.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TreeAttentionError(ValueError):
    """Base class for invalid tree-attention input."""


class TreeAttentionShapeError(TreeAttentionError):
    """q / k / v / tree_mask shapes are inconsistent."""


class TreeAttentionDtypeError(TreeAttentionError):
    """An input has a dtype the op (or the chosen host) does not take."""


class TreeAttentionDeviceError(TreeAttentionError):
    """Inputs live on different devices, or on a device the chosen host cannot run on."""


@dataclass(frozen=True)
class TreeAttentionDims:
    """Sizes of one tree-attention call."""

    batch: int
    q_heads: int
    kv_heads: int
    num_tree: int  # N: tree tokens (queries)
    prefix_len: int  # L: fully visible prefix keys before the tree keys
    head_dim: int  # D

    @property
    def group(self) -> int:
        """Query heads sharing one kv head (GQA)."""
        return self.q_heads // self.kv_heads

    @property
    def mask_words(self) -> int:
        return mask_words(self.num_tree)


def check_inputs(
    q: torch.Tensor,  # [B, Hq, N, D]
    k: torch.Tensor,  # [B, Hkv, L + N, D]
    v: torch.Tensor,  # [B, Hkv, L + N, D]
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32 packed, or [B, N, N] bool when allow_bool
    *,
    allow_bool: bool = False,
) -> TreeAttentionDims:
    """Validate shapes, dtypes and devices; return the sizes. Works on fake tensors (export, torch.compile)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise TreeAttentionShapeError(f"{name} must be 4-D [B, H, T, D], got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TreeAttentionDtypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TreeAttentionDtypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    b, hq, n, d = q.shape
    if k.shape != v.shape:
        raise TreeAttentionShapeError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != b or k.shape[3] != d:
        raise TreeAttentionShapeError(
            f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)}: expected [{b}, Hkv, L + {n}, {d}]"
        )
    hkv, s = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise TreeAttentionShapeError(f"q heads ({hq}) must be a positive multiple of kv heads ({hkv})")
    if s < n:
        raise TreeAttentionShapeError(f"k/v have {s} positions, fewer than the {n} tree tokens of q")
    if tree_mask.dtype == torch.bool and allow_bool:
        expected = (b, n, n)
    elif tree_mask.dtype == torch.int32:
        expected = (b, n, mask_words(n))
    else:
        allowed = "int32 (packed) or bool" if allow_bool else "int32 (packed)"
        raise TreeAttentionDtypeError(f"tree_mask must be {allowed}, got {tree_mask.dtype}")
    if tuple(tree_mask.shape) != expected:
        raise TreeAttentionShapeError(f"tree_mask has shape {tuple(tree_mask.shape)}, expected {expected}")
    devices = {t.device for t in (q, k, v, tree_mask)}
    if len(devices) != 1:
        raise TreeAttentionDeviceError(f"q, k, v, tree_mask must be on one device, got {sorted(map(str, devices))}")
    return TreeAttentionDims(batch=b, q_heads=hq, kv_heads=hkv, num_tree=n, prefix_len=s - n, head_dim=d)
