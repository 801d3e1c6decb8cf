"""model.plan: a serialized TensorRT engine built from model.onnx with the tree-attention plugin.

Runs only where `tensorrt` (>= 10.9, with tensorrt.plugin) is importable and a CUDA device is present; otherwise
`build_plan` returns a skip with the reason, and the engine directory still serves with the torch backend.
The network is strongly typed (every tensor keeps the ONNX graph's dtype); one optimization profile covers
batch 1..max_batch_size, 1..max_draft_len + 1 tree tokens (opt) up to max_seq_len tokens (a prefill chunk), and
a past of 0..max_seq_len - 1 positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.config import BuildError, BuildPlan
from builder.onnx_stage import INPUT_IDS, POSITION_IDS, TREE_MASK, past_names
from plugins.tree_attention.mask import mask_words


@dataclass(frozen=True)
class TensorRTResult:
    built: bool
    reason: str  # why it was skipped, or the TensorRT version that built it
    path: Path | None = None
    profile: dict[str, list[list[int]]] | None = None  # input -> [min, opt, max] shapes


def profile_shapes(plan: BuildPlan) -> dict[str, list[list[int]]]:
    """Input name -> [min, opt, max] shape of the optimization profile."""
    m = plan.model
    b = plan.config.build
    tree = max(1, plan.draft.draft_nodes + 1)
    max_tokens = plan.max_seq_len
    past_opt = max(0, plan.max_seq_len // 2)
    shapes: dict[str, list[list[int]]] = {}
    for name in (INPUT_IDS, POSITION_IDS):
        shapes[name] = [[1, 1], [1, tree], [b.max_batch_size, max_tokens]]
    shapes[TREE_MASK] = [[1, 1, 1], [1, tree, mask_words(tree)], [b.max_batch_size, max_tokens, mask_words(max_tokens)]]
    kv, d = m.num_key_value_heads, m.head_dim
    for name in past_names(m.num_hidden_layers):
        shapes[name] = [[1, kv, 0, d], [1, kv, past_opt, d], [b.max_batch_size, kv, plan.max_seq_len - 1, d]]
    return shapes


def unavailable_reason() -> str | None:
    """Why no TensorRT engine can be built here (TensorRT, tensorrt.plugin or CUDA missing), or None.

    Registers the tree-attention plugin when everything is present.
    """
    from plugins.tree_attention.trt_plugin import (
        TensorRTUnavailableError,
        import_tensorrt,
        register_trt_plugin,
    )

    try:
        import_tensorrt()
        register_trt_plugin()
    except TensorRTUnavailableError as exc:
        return str(exc)
    return None


def build_plan(onnx_path: Path, out_path: Path, plan: BuildPlan) -> TensorRTResult:
    """Build model.plan from model.onnx, or return why it was skipped (TensorRT or CUDA absent)."""
    from plugins.tree_attention.trt_plugin import import_tensorrt

    reason = unavailable_reason()
    if reason is not None:
        return TensorRTResult(built=False, reason=reason)
    trt, _ = import_tensorrt()

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    shapes = profile_shapes(plan)
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError(f"TensorRT could not build an engine from {onnx_path} (see the log above)")
    out_path.write_bytes(_as_bytes(serialized))
    return TensorRTResult(built=True, reason=f"TensorRT {trt.__version__}", path=out_path, profile=shapes)


def _as_bytes(serialized: Any) -> bytes:
    return bytes(memoryview(serialized))


__all__ = ["TensorRTResult", "build_plan", "profile_shapes", "unavailable_reason"]
