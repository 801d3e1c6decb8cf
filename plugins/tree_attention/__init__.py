"""Tree attention: N tree tokens attend to a fully visible KV prefix of length L plus the N tree tokens
under a tree mask. One op, three hosts:

- PyTorch: `torch.ops.spectree.tree_attention(q, k, v, tree_mask, scale)` (op.py; registered when this package
  is imported): CPU -> the row-invariant C kernel for bf16 (native.py, invariant.c; built on first use) and fused
  SDPA under the unpacked mask otherwise (cpu.py), CUDA -> OpenAI Triton kernel (kernel.py), other devices -> the
  torch reference (reference.py, the oracle);
- ONNX: exported as the plugin node SpectreeTreeAttention (onnx_export.py), expandable to standard ops for
  onnxruntime (onnx_decompose.py);
- TensorRT: the plugin "spectree::SpectreeTreeAttention" (trt_plugin.py, needs TensorRT >= 10.9).

Shapes (used by every host of the op):
    q          # [B, Hq, N, D]
    k, v       # [B, Hkv, L + N, D]   prefix keys first, then the N tree tokens; Hq % Hkv == 0 (GQA)
    tree_mask  # [B, N, ceil(N / 32)] int32, TensorRT-LLM's packed layout: bit j of row i (word j // 32,
               #  bit j % 32, least-significant first) set <=> tree token i may attend tree token j
    out        # [B, Hq, N, D], dtype of q
"""

from plugins.tree_attention import op as _op  # noqa: F401  (registers torch.ops.spectree.tree_attention)
from plugins.tree_attention.mask import mask_words, pack_mask, unpack_mask
from plugins.tree_attention.reference import tree_attention_reference
from plugins.tree_attention.spec import (
    PLUGIN_ID,
    PLUGIN_NAME,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TreeAttentionDeviceError,
    TreeAttentionDims,
    TreeAttentionDtypeError,
    TreeAttentionError,
    TreeAttentionShapeError,
    check_inputs,
)

__all__ = [
    "PLUGIN_ID",
    "PLUGIN_NAME",
    "PLUGIN_NAMESPACE",
    "PLUGIN_VERSION",
    "TreeAttentionDeviceError",
    "TreeAttentionDims",
    "TreeAttentionDtypeError",
    "TreeAttentionError",
    "TreeAttentionShapeError",
    "check_inputs",
    "mask_words",
    "pack_mask",
    "tree_attention_reference",
    "unpack_mask",
]
