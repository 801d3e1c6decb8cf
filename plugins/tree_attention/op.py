"""The one tree-attention op every caller uses: `torch.ops.spectree.tree_attention(q, k, v, tree_mask, scale)`.

Registered with torch.library when this module is imported:
- CUDA runs the Triton kernel (plugins/tree_attention/kernel.py, imported on first CUDA call) for fp16, bf16
  and fp32, and the torch reference for other floating dtypes (fp64 checks);
- the CPU runs bf16 through the row-invariant kernel (plugins/tree_attention/native.py: what bf16 models attend
  with on CPU, runtime/model.py `kv_dtype`) where it builds, and torch's fused SDPA under the unpacked mask
  (plugins/tree_attention/cpu.py) for fp16, fp32, fp64 (bf16 models' KV dtype where the kernel does not build)
  and bf16 without the kernel; the reference for other dtypes; every other device runs the torch reference
  (CompositeExplicitAutograd);
- the fake implementation gives torch.export / torch.compile the output's shape and dtype, so the op survives
  export and the ONNX exporter turns it into the plugin node (plugins/tree_attention/onnx_export.py).
The op is inference-only (no autograd formula). It is defined with the low-level `torch.library.Library` API
rather than the `@custom_op` decorator: same schema, dispatch keys, fake kernel and export behaviour, but the
decorator's Python autograd/redispatch wrapper cost ~50 us per call on this CPU, i.e. ~4% of a decode step of the
demo model (4 attention calls per step). Shapes are documented in plugins/tree_attention/__init__.py.
"""

from __future__ import annotations

import torch

from plugins.tree_attention import native
from plugins.tree_attention.cpu import SDPA_DTYPES, tree_attention_sdpa
from plugins.tree_attention.reference import tree_attention_reference
from plugins.tree_attention.spec import KERNEL_DTYPES, TreeAttentionDtypeError, TreeAttentionShapeError, check_inputs


_LIB = torch.library.Library("spectree", "DEF")  # keeps the registrations alive for the process
_LIB.define("tree_attention(Tensor q, Tensor k, Tensor v, Tensor tree_mask, float scale) -> Tensor")


def _tree_attention_any(
    q: torch.Tensor,  # [B, Hq, N, D]
    k: torch.Tensor,  # [B, Hkv, L + N, D]
    v: torch.Tensor,  # [B, Hkv, L + N, D]
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32 packed
    scale: float,
) -> torch.Tensor:  # [B, Hq, N, D]
    """The checked torch reference: every device, and dtypes outside KERNEL_DTYPES (fp64 checks) on CPU / CUDA."""
    check_inputs(q, k, v, tree_mask)  # the reference alone would also take a bool mask
    return tree_attention_reference(q, k, v, tree_mask, scale)


def _tree_attention_cpu(q, k, v, tree_mask, scale):
    if q.dtype not in SDPA_DTYPES:
        return _tree_attention_any(q, k, v, tree_mask, scale)
    check_inputs(q, k, v, tree_mask)
    if q.dtype == native.INVARIANT_DTYPE and native.load() is not None:
        return native.tree_attention_native(q, k, v, tree_mask, scale, checked=True).to(q.dtype)
    return tree_attention_sdpa(q, k, v, tree_mask, scale)


def _tree_attention_cuda(q, k, v, tree_mask, scale):
    if q.dtype not in KERNEL_DTYPES:
        return _tree_attention_any(q, k, v, tree_mask, scale)
    from plugins.tree_attention.kernel import tree_attention_triton

    return tree_attention_triton(q, k, v, tree_mask, scale)


@torch.library.register_fake("spectree::tree_attention", lib=_LIB)
def _tree_attention_fake(q, k, v, tree_mask, scale):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or tree_mask.dim() != 3:
        raise TreeAttentionShapeError(
            f"tree_attention takes 4-D q/k/v and a 3-D tree_mask, got {q.dim()}/{k.dim()}/{v.dim()}/{tree_mask.dim()}-D"
        )
    if tree_mask.dtype != torch.int32:
        raise TreeAttentionDtypeError(f"tree_mask must be int32 (packed), got {tree_mask.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TreeAttentionDtypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    # Size relations (Hq % Hkv, L + N >= N, ...) are checked by the real kernels: asserting them here on
    # symbolic sizes would add export guards between independent dynamic dims.
    return q.new_empty(q.shape)


_LIB.impl("tree_attention", _tree_attention_cpu, "CPU")
_LIB.impl("tree_attention", _tree_attention_cuda, "CUDA")
_LIB.impl("tree_attention", _tree_attention_any, "CompositeExplicitAutograd")
