"""Replace every tree-attention plugin node of an ONNX model with standard ONNX ops (opset >= 18).

TensorRT runs the plugin node itself; everything else (onnxruntime checks of an exported engine graph, the
builder's CPU runs) runs this decomposition. Pure onnx + numpy. Per node, with G = Hq / Hkv and L = S - N:

    q5 = reshape(float(q), [B, Hkv, G, N, D]);  k5, v5 = unsqueeze(float(k), float(v), axis 2)  # [B,Hkv,1,S,D]
    bits[b, i, j] = tree_mask[b, i, j // 32] & (1 << (j % 32)) != 0                            # [B, N, N]
    bias = pad(where(bits, 0, -inf), L zeros in front of the key axis)                         # [B, N, S]
    out = cast_like(reshape(softmax(q5 @ k5^T * scale + bias[:, None, None]) @ v5, [B, Hq, N, D]), q)

All sizes are read with Shape at run time, so dynamic batch / tree / prefix sizes stay dynamic. Like the
reference it computes in fp32; a row with nothing visible (invalid tree) gives NaN here, zeros there.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from plugins.tree_attention.spec import ONNX_DOMAIN, PLUGIN_NAME

MIN_OPSET = 18  # BitwiseAnd appears in opset 18


class OnnxDecomposeError(ValueError):
    """The model cannot be decomposed (opset too old, malformed plugin node)."""


def is_plugin_node(node: onnx.NodeProto) -> bool:
    # TensorRT matches on op_type alone; so does this, whatever the domain says.
    return node.op_type == PLUGIN_NAME


def onnx_decompose(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with each SpectreeTreeAttention node (main graph and subgraphs) expanded."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < MIN_OPSET:
        raise OnnxDecomposeError(f"model default-domain opset is {opset}, the decomposition needs >= {MIN_OPSET}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    counter = [0]
    _rewrite_graph(out.graph, counter)
    if counter[0] and not _uses_domain(out.graph, ONNX_DOMAIN):
        kept = [o for o in out.opset_import if o.domain != ONNX_DOMAIN]
        del out.opset_import[:]
        out.opset_import.extend(kept)
    return out


def _uses_domain(graph: onnx.GraphProto, domain: str) -> bool:
    for node in graph.node:
        if node.domain == domain:
            return True
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            if any(_uses_domain(g, domain) for g in subgraphs):
                return True
    return False


def _rewrite_graph(graph: onnx.GraphProto, counter: list[int]) -> None:
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _rewrite_graph(attr.g, counter)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _rewrite_graph(g, counter)
        if is_plugin_node(node):
            nodes.extend(_expand(node, f"{node.name or PLUGIN_NAME}__decomposed{counter[0]}/"))
            counter[0] += 1
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _expand(node: onnx.NodeProto, prefix: str) -> list[onnx.NodeProto]:
    if len(node.input) != 4 or len(node.output) != 1:
        raise OnnxDecomposeError(
            f"{node.op_type} node {node.name!r} has {len(node.input)} inputs / {len(node.output)} outputs, expected 4 / 1"
        )
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if "scale" not in attrs:
        raise OnnxDecomposeError(f"{node.op_type} node {node.name!r} has no `scale` attribute")
    q, k, v, mask = node.input
    (result,) = node.output
    nodes: list[onnx.NodeProto] = []

    def name(tag: str) -> str:
        return prefix + tag

    def add(op: str, inputs: list[str], tag: str, **kwargs) -> str:
        nodes.append(helper.make_node(op, inputs, [name(tag)], name=name(tag + "_" + op), **kwargs))
        return name(tag)

    def const(tag: str, array: np.ndarray) -> str:
        return add("Constant", [], tag, value=numpy_helper.from_array(array, name(tag)))

    i64 = lambda *xs: np.array(xs, dtype=np.int64)  # noqa: E731

    # Sizes.
    shape_q = add("Shape", [q], "shape_q")  # [B, Hq, N, D]
    shape_k = add("Shape", [k], "shape_k")  # [B, Hkv, S, D]
    c0, c1, c2, c3, c4 = (const(f"c{i}", i64(i)) for i in range(5))
    batch = add("Slice", [shape_q, c0, c1], "batch")
    q_heads = add("Slice", [shape_q, c1, c2], "q_heads")
    num_tree = add("Slice", [shape_q, c2, c3], "num_tree")
    head_dim = add("Slice", [shape_q, c3, c4], "head_dim")
    kv_heads = add("Slice", [shape_k, c1, c2], "kv_heads")
    seq = add("Slice", [shape_k, c2, c3], "seq")
    group = add("Div", [q_heads, kv_heads], "group")
    prefix_len = add("Sub", [seq, num_tree], "prefix_len")

    # Scores [B, Hkv, G, N, S] in fp32.
    qf = add("Cast", [q], "qf", to=TensorProto.FLOAT)
    kf = add("Cast", [k], "kf", to=TensorProto.FLOAT)
    vf = add("Cast", [v], "vf", to=TensorProto.FLOAT)
    q5_shape = add("Concat", [batch, kv_heads, group, num_tree, head_dim], "q5_shape", axis=0)
    q5 = add("Reshape", [qf, q5_shape], "q5")
    axis2 = const("axis2", i64(2))
    k5 = add("Unsqueeze", [kf, axis2], "k5")  # [B, Hkv, 1, S, D]
    v5 = add("Unsqueeze", [vf, axis2], "v5")
    k5t = add("Transpose", [k5], "k5t", perm=[0, 1, 2, 4, 3])  # [B, Hkv, 1, D, S]
    scores = add("MatMul", [q5, k5t], "scores")
    scale = const("scale", np.array(attrs["scale"], dtype=np.float32))
    scores = add("Mul", [scores, scale], "scaled")

    # Tree mask bits [B, N, N]: word w bit t (least significant first) is key 32 w + t.
    bit_values = np.array([1 << t for t in range(32)], dtype=np.int64)
    bit_values = np.where(bit_values >= 2**31, bit_values - 2**32, bit_values).astype(np.int32)  # bit 31 < 0
    bits_const = const("bit_values", bit_values)
    words = add("Unsqueeze", [mask, const("axis_last", i64(-1))], "words")  # [B, N, W, 1]
    anded = add("BitwiseAnd", [words, bits_const], "anded")  # [B, N, W, 32]
    is_zero = add("Equal", [anded, const("zero_i32", np.array(0, dtype=np.int32))], "is_zero")
    bits = add("Not", [is_zero], "bits")
    flat = add("Reshape", [bits, const("flat_shape", i64(0, 0, -1))], "flat")  # [B, N, 32 W]
    tree = add("Slice", [flat, const("zero_1", i64(0)), num_tree, axis2], "tree")  # [B, N, N]

    # Additive bias [B, 1, 1, N, S]: prefix keys 0, tree keys 0 / -inf.
    zero_f = const("zero_f", np.array(0.0, dtype=np.float32))
    ninf_f = const("ninf_f", np.array(-np.inf, dtype=np.float32))
    tree_bias = add("Where", [tree, zero_f, ninf_f], "tree_bias")
    pads = add("Concat", [const("pads_head", i64(0, 0)), prefix_len, const("pads_tail", i64(0, 0, 0))], "pads", axis=0)
    bias = add("Pad", [tree_bias, pads, zero_f], "bias", mode="constant")  # [B, N, S]
    bias5 = add("Unsqueeze", [bias, const("axes12", i64(1, 2))], "bias5")
    logits = add("Add", [scores, bias5], "logits")
    probs = add("Softmax", [logits], "probs", axis=-1)
    out5 = add("MatMul", [probs, v5], "out5")  # [B, Hkv, G, N, D]
    out4 = add("Reshape", [out5, shape_q], "out4")
    nodes.append(helper.make_node("CastLike", [out4, q], [result], name=name("out_CastLike")))
    return nodes
