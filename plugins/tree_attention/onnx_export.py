"""ONNX export of the tree-attention op as the TensorRT plugin node.

torch 2.13 exports with the torch.export-based exporter (`torch.onnx.export(..., dynamo=True)`, the default);
custom ops are lowered through `custom_translation_table`, whose functions build ONNX with onnxscript. The
node emitted for `torch.ops.spectree.tree_attention` is

    SpectreeTreeAttention(q, k, v, tree_mask) -> out    domain "spectree"
        attributes: scale (float), plugin_namespace = "spectree", plugin_version = "1"

which TensorRT's ONNX parser binds to the plugin registered as "spectree::SpectreeTreeAttention"
(plugins/tree_attention/trt_plugin.py). `plugins/tree_attention/onnx_decompose.py` turns it back into
standard ONNX ops for onnxruntime.
"""

from __future__ import annotations

from typing import Any, Callable

import onnx
import torch

import plugins.tree_attention.op  # noqa: F401  (registers torch.ops.spectree.tree_attention)
from plugins.tree_attention.spec import ONNX_DOMAIN, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION


def plugin_schema() -> onnx.defs.OpSchema:
    """The ONNX schema of the plugin node (onnxscript refuses to emit an op without one)."""
    schema = onnx.defs.OpSchema
    return schema(
        PLUGIN_NAME,
        ONNX_DOMAIN,
        int(PLUGIN_VERSION),
        "Tree attention: N tree tokens attend to a fully visible prefix plus the tree under a packed mask.",
        inputs=[
            schema.FormalParameter("q", "T", "[B, Hq, N, D]"),
            schema.FormalParameter("k", "T", "[B, Hkv, L + N, D]"),
            schema.FormalParameter("v", "T", "[B, Hkv, L + N, D]"),
            schema.FormalParameter("tree_mask", "tensor(int32)", "[B, N, ceil(N / 32)] packed bits"),
        ],
        outputs=[schema.FormalParameter("out", "T", "[B, Hq, N, D]")],
        type_constraints=[("T", ["tensor(float16)", "tensor(bfloat16)", "tensor(float)"], "q/k/v/out dtype")],
        attributes=[
            schema.Attribute("scale", schema.AttrType.FLOAT, "softmax scale, usually 1/sqrt(D)"),
            schema.Attribute("plugin_namespace", schema.AttrType.STRING, "TensorRT plugin namespace"),
            schema.Attribute("plugin_version", schema.AttrType.STRING, "TensorRT plugin version"),
        ],
    )


def register_plugin_schema() -> None:
    """Register the plugin node's schema with onnx (idempotent; process-wide, like any onnx schema)."""
    if not onnx.defs.has(PLUGIN_NAME, ONNX_DOMAIN):
        onnx.defs.register_schema(plugin_schema())


def onnx_translation_table() -> dict[Callable, Callable]:
    """`custom_translation_table` for torch.onnx.export(dynamo=True) that emits the plugin node."""
    try:
        import onnxscript
    except ImportError as exc:
        raise ImportError(
            "exporting the tree-attention op to ONNX needs the `onnxscript` package (torch's ONNX exporter "
            "translates custom ops with it): pip install onnxscript"
        ) from exc
    register_plugin_schema()
    opset = onnxscript.values.Opset(domain=ONNX_DOMAIN, version=int(PLUGIN_VERSION))

    def tree_attention_to_onnx(q, k, v, tree_mask, scale: float):
        return opset.SpectreeTreeAttention(
            q, k, v, tree_mask, scale=float(scale), plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION
        )

    return {torch.ops.spectree.tree_attention.default: tree_attention_to_onnx}


def export_onnx(model: torch.nn.Module, args: tuple, path: Any = None, **kwargs: Any) -> Any:
    """torch.onnx.export (dynamo) with the plugin translation merged into any `custom_translation_table`.

    Returns the ONNXProgram; `.model_proto` is the onnx.ModelProto. Other kwargs go to torch.onnx.export."""
    table = dict(kwargs.pop("custom_translation_table", None) or {})
    table.update(onnx_translation_table())
    return torch.onnx.export(model, args, path, dynamo=True, custom_translation_table=table, **kwargs)
