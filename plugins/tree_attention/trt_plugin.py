"""The TensorRT plugin "spectree::SpectreeTreeAttention" (tensorrt.plugin, TensorRT >= 10.9).

Importing this module imports neither tensorrt nor triton; `register_trt_plugin()` does, and raises
`TensorRTUnavailableError` naming what is missing. Registered pieces:
- shape/type function: out is q.like() ([B, Hq, N, D], dtype of q);
- autotune: q/k/v/out all fp16, all bf16 or all fp32, tree_mask int32, LINEAR; one tactic per BLOCK_M
  (launch.AOT_TACTIC_BLOCK_M), since the row count group * N is only known at run time;
- ahead-of-time implementation: the Triton kernel compiled to PTX (kernel.compile_aot) with the scale baked
  in, a grid of symbolic shape expressions and the kernel's int scalars as SymInt32 expressions, so built
  engines run without Python. The formulas live in launch.py and are tested there without TensorRT.
The ONNX parser maps the exported node (onnx_export.py) to this plugin by op_type and `plugin_namespace`.
"""

from __future__ import annotations

import threading
from typing import Any

from plugins.tree_attention.launch import (
    AOT_TACTIC_BLOCK_M,
    LaunchConfigError,
    autotune_io_types,
    cdiv,
    contiguous_scalar_args,
)
from plugins.tree_attention.spec import PLUGIN_ID

MIN_TENSORRT = "10.9"
_lock = threading.Lock()
_registered_arch: int | None = None


class TensorRTUnavailableError(ImportError):
    """TensorRT's Python package (with tensorrt.plugin ahead-of-time support) is not importable."""


def import_tensorrt() -> tuple[Any, Any]:
    """(tensorrt, tensorrt.plugin), or TensorRTUnavailableError saying what is missing."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise TensorRTUnavailableError(
            f"the TensorRT tree-attention plugin needs the `tensorrt` Python package (>= {MIN_TENSORRT}, with "
            f"tensorrt.plugin); it is not installed here ({exc})"
        ) from exc
    try:
        import tensorrt.plugin as trtp
    except ImportError as exc:
        raise TensorRTUnavailableError(
            f"tensorrt {getattr(trt, '__version__', '?')} has no tensorrt.plugin module; need >= {MIN_TENSORRT}"
        ) from exc
    missing = [name for name in ("register", "autotune", "aot_impl", "KernelLaunchParams", "SymInt32") if not hasattr(trtp, name)]
    if missing:
        raise TensorRTUnavailableError(
            f"tensorrt {getattr(trt, '__version__', '?')} tensorrt.plugin lacks {missing} (ahead-of-time plugins "
            f"need TensorRT >= {MIN_TENSORRT})"
        )
    return trt, trtp


def aot_grid(q_shape: Any, k_shape: Any, block_m: int) -> tuple[Any, Any, int]:
    """Launch grid (row blocks, B * Hkv, 1 split) for q [B,Hq,N,D], k [B,Hkv,S,D]; ints or ShapeExprs."""
    b, hq, n, _ = q_shape
    hkv = k_shape[1]
    rows = (hq // hkv) * n
    return cdiv(rows, block_m), b * hkv, 1


def constant_head_dim(head_dim: Any) -> int:
    """The head dim as an int: the PTX is specialised on it, so it must be a build-time constant."""
    if isinstance(head_dim, int):
        return head_dim
    if getattr(head_dim, "is_fake", False) or not head_dim.is_constant:
        raise LaunchConfigError("the tree-attention plugin needs a static head dim (q.shape[3]); it is dynamic here")
    return int(head_dim.constant_value())


def register_trt_plugin(arch: int | None = None) -> str:
    """Register the plugin with tensorrt.plugin (once per process) and return its id "spectree::SpectreeTreeAttention".

    `arch` is the SM version the PTX targets (e.g. 90); default: the current CUDA device's."""
    global _registered_arch
    trt, trtp = import_tensorrt()
    if arch is None:
        import torch

        if not torch.cuda.is_available():
            raise TensorRTUnavailableError("building the tree-attention plugin's PTX needs a CUDA device, or pass arch=")
        major, minor = torch.cuda.get_device_capability()
        arch = major * 10 + minor
    with _lock:
        if _registered_arch is not None:
            if _registered_arch != arch:
                raise LaunchConfigError(f"plugin already registered for sm_{_registered_arch}, not sm_{arch}")
            return PLUGIN_ID
        _define(trt, trtp, arch)
        _registered_arch = arch
    return PLUGIN_ID


def _define(trt: Any, trtp: Any, arch: int) -> None:
    import torch

    from plugins.tree_attention.kernel import compile_aot

    torch_dtypes = {trt.float16: torch.float16, trt.bfloat16: torch.bfloat16, trt.float32: torch.float32}

    @trtp.register(PLUGIN_ID)
    def _shape_and_type(
        q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, tree_mask: trtp.TensorDesc, scale: float
    ) -> trtp.TensorDesc:
        return q.like()

    @trtp.autotune(PLUGIN_ID)
    def _autotune(q, k, v, tree_mask, outputs) -> list:
        return [trtp.AutoTuneCombination(autotune_io_types(), "LINEAR", list(AOT_TACTIC_BLOCK_M))]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot_impl(q, k, v, tree_mask, scale: float, outputs, tactic: int):
        if q.dtype not in torch_dtypes:
            raise LaunchConfigError(f"tree-attention plugin: unsupported dtype {q.dtype}")
        kernel = compile_aot(
            torch_dtypes[q.dtype],
            constant_head_dim(q.shape_expr[3]),
            scale,
            arch=arch,
            block_m=AOT_TACTIC_BLOCK_M[tactic],
        )
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y, params.grid_z = aot_grid(q.shape_expr, k.shape_expr, kernel.tiles.block_m)
        params.block_x = kernel.num_warps * 32
        params.shared_mem = kernel.shared_mem
        scalars = contiguous_scalar_args(q.shape_expr, k.shape_expr, tree_mask.shape_expr)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in scalars])
        return kernel.name, kernel.ptx, params, extra
