"""model.onnx: the target's verification step, every attention ONE tree-attention plugin node.

Graph (dims named as in the file; past_len may be 0, so the same graph also runs a prefill chunk):
    inputs   input_ids                  [batch, num_tokens] int64     (a draft tree, root first, or a chunk)
             position_ids               [batch, num_tokens] int64     (past_len + depth for a tree)
             tree_mask                  [batch, num_tokens, mask_words] int32, packed (plugins/tree_attention)
             past_key_values.{i}.key    [batch, kv_heads, past_len, head_dim]   (.value alike), i < layers
    outputs  logits                     [batch, num_tokens, vocab] float32
             hidden_states              [batch, num_tokens, hidden]   (final-norm output, what drafters read)
             present.{i}.key            [batch, kv_heads, past_len + num_tokens, head_dim]   (.value alike)

The export traces the runtime's own modules (runtime.model: embedding, DecoderLayer, RMSNorm, lm_head), whose
attention calls torch.ops.spectree.tree_attention; plugins/tree_attention/onnx_export.py lowers that op to the
SpectreeTreeAttention node (attribute plugin_namespace) that TensorRT's ONNX parser binds to the plugin.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from builder.config import BuildError
from runtime.config import ModelConfig

INPUT_IDS, POSITION_IDS, TREE_MASK = "input_ids", "position_ids", "tree_mask"
LOGITS, HIDDEN = "logits", "hidden_states"


def past_names(num_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


class _ConcatCache:
    """The slice of the KVCache interface DecoderLayer uses (`write`), as concatenation: past + new -> present."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.past = past
        self.present: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(past)  # type: ignore[list-item]

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k_new, v_new  # [B, Hkv, N, D] -> present  # [B, Hkv, L + N, D]
        k = torch.cat([self.past[layer][0], k_new], dim=2)
        v = torch.cat([self.past[layer][1], v_new], dim=2)
        self.present[layer] = (k, v)
        return k, v


class VerifyStep(nn.Module):
    """TargetModel.forward with the cache as explicit tensors in and out (what a graph compiler needs).

    It calls TargetModel.run (forward without the data-dependent, untraceable input checks) over a cache that
    concatenates past and new K/V instead of writing in place.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, N] int64
        position_ids: torch.Tensor,  # [B, N] int64
        tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32
        past_key_values: list[tuple[torch.Tensor, torch.Tensor]],  # per layer ([B, Hkv, L, D], [B, Hkv, L, D])
    ) -> tuple[torch.Tensor, ...]:  # logits [B, N, V] f32, hidden [B, N, H], then per layer present k, v
        cache = _ConcatCache(list(past_key_values))
        logits, hidden = self.model.run(input_ids, position_ids, cache, tree_mask)
        return (logits, hidden, *[t for kv in cache.present for t in kv])


def example_inputs(config: ModelConfig, batch: int = 2, num_tokens: int = 40, past_len: int = 3, seed: int = 0):
    """Random inputs for tracing / checks: (input_ids, position_ids, tree_mask, past_key_values).

    The defaults avoid sizes 0 and 1 (the exporter would specialise them) and give 2 mask words.
    """
    from runtime.model import causal_mask

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, num_tokens), generator=gen)
    pos = torch.arange(past_len, past_len + num_tokens).expand(batch, num_tokens).contiguous()
    mask = causal_mask(num_tokens, batch)
    shape = (batch, config.num_key_value_heads, past_len, config.head_dim)
    past = [
        (torch.randn(shape, generator=gen).to(config.torch_dtype), torch.randn(shape, generator=gen).to(config.torch_dtype))
        for _ in range(config.num_hidden_layers)
    ]
    return ids, pos, mask, past


@dataclass(frozen=True)
class OnnxResult:
    path: Path
    files: tuple[Path, ...]  # model.onnx and its external data
    plugin_nodes: int
    inputs: dict[str, list[Any]]  # name -> dims (int or symbolic name)
    outputs: dict[str, list[Any]]


def export_verify_step(model: Any, path: Path) -> OnnxResult:
    """Export `model` (a TargetModel) to `path` with external data, then check it (`check_onnx`)."""
    from torch.export import Dim

    from plugins.tree_attention.onnx_export import export_onnx

    config: ModelConfig = model.config
    n_layers = config.num_hidden_layers
    batch, tokens = Dim("batch", min=1), Dim("num_tokens", min=1)
    past_len, words = Dim("past_len", min=0), Dim("mask_words", min=1)
    kv = {0: batch, 2: past_len}
    dynamic = {
        "input_ids": {0: batch, 1: tokens},
        "position_ids": {0: batch, 1: tokens},
        "tree_mask": {0: batch, 1: tokens, 2: words},
        "past_key_values": [(kv, kv) for _ in range(n_layers)],
    }
    ids, pos, mask, past = example_inputs(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = io.StringIO()
    onnx_logger = logging.getLogger("torch.onnx")
    level = onnx_logger.level
    onnx_logger.setLevel(logging.ERROR)  # e.g. "torchvision is not installed" for ops this graph never uses
    try:
        # The exporter narrates each pass on stdout; the builder shows its own progress instead.
        with contextlib.redirect_stdout(log), torch.no_grad():
            export_onnx(
                VerifyStep(model).eval(),
                (ids, pos, mask, past),
                str(path),
                dynamic_shapes=dynamic,
                input_names=[INPUT_IDS, POSITION_IDS, TREE_MASK, *past_names(n_layers)],
                output_names=[LOGITS, HIDDEN, *present_names(n_layers)],
                external_data=True,
            )
    except (RuntimeError, ValueError, TypeError, ImportError) as exc:
        raise BuildError(f"ONNX export of the verification step failed: {exc}\n{log.getvalue()[-2000:]}") from exc
    finally:
        onnx_logger.setLevel(level)
    return check_onnx(path, config)


def check_onnx(path: Path, config: ModelConfig) -> OnnxResult:
    """onnx.checker with full shape inference, plus: exactly one plugin node per layer, each with its
    plugin_namespace, and no other attention (no Softmax) left in the graph."""
    import onnx

    from plugins.tree_attention.onnx_export import register_plugin_schema
    from plugins.tree_attention.spec import PLUGIN_NAME, PLUGIN_NAMESPACE

    register_plugin_schema()
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise BuildError(f"{path}: onnx.checker failed: {exc}") from exc
    proto = onnx.load(str(path), load_external_data=False)
    plugin = [n for n in proto.graph.node if n.op_type == PLUGIN_NAME]
    if len(plugin) != config.num_hidden_layers:
        raise BuildError(
            f"{path}: {len(plugin)} {PLUGIN_NAME} nodes, expected one per layer ({config.num_hidden_layers})"
        )
    for node in plugin:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("plugin_namespace") != PLUGIN_NAMESPACE.encode():
            raise BuildError(f"{path}: node {node.name} has plugin_namespace {attrs.get('plugin_namespace')!r}, "
                                 f"expected {PLUGIN_NAMESPACE!r}")
    softmax = [n.name for n in proto.graph.node if n.op_type == "Softmax"]
    if softmax:
        raise BuildError(f"{path}: attention outside the plugin node: Softmax nodes {softmax[:4]}")
    data_files = sorted(
        {
            e.value
            for t in proto.graph.initializer
            for e in t.external_data
            if e.key == "location"
        }
    )
    return OnnxResult(
        path=path,
        files=(path, *(path.parent / f for f in data_files)),
        plugin_nodes=len(plugin),
        inputs={i.name: _dims(i) for i in proto.graph.input},
        outputs={o.name: _dims(o) for o in proto.graph.output},
    )


def _dims(value_info: Any) -> list[Any]:
    return [d.dim_param if d.dim_param else d.dim_value for d in value_info.type.tensor_type.shape.dim]


__all__ = [
    "VerifyStep", "OnnxResult", "export_verify_step", "check_onnx", "example_inputs",
    "past_names", "present_names", "INPUT_IDS", "POSITION_IDS", "TREE_MASK", "LOGITS", "HIDDEN",
]
