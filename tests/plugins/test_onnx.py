"""ONNX export of the op as the TensorRT plugin node, and the standard-ops decomposition run in onnxruntime."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from plugins.tree_attention import pack_mask, tree_attention_reference
from plugins.tree_attention.onnx_decompose import OnnxDecomposeError, onnx_decompose
from plugins.tree_attention.onnx_export import export_onnx
from plugins.tree_attention.spec import ONNX_DOMAIN, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from tests.plugins.trees import random_tree_masks

Q_HEADS, KV_HEADS, D = 4, 2, 8


class TwoLayers(torch.nn.Module):
    """Two plugin nodes with different scales, fed through ordinary ops."""

    def forward(self, q, k, v, tree_mask):
        a = torch.ops.spectree.tree_attention(q, k, v, tree_mask, 0.35)
        b = torch.ops.spectree.tree_attention(a * 0.5, k, v, tree_mask, 0.125)
        return a + b


def reference(q, k, v, mask):
    a = tree_attention_reference(q, k, v, mask, 0.35)
    return a + tree_attention_reference(a * 0.5, k, v, mask, 0.125)


def inputs(batch, n, prefix, seed):
    g = torch.Generator().manual_seed(seed)
    _, tree = random_tree_masks(batch, n, g)
    q = torch.randn(batch, Q_HEADS, n, D, generator=g)
    k = torch.randn(batch, KV_HEADS, prefix + n, D, generator=g)
    v = torch.randn(batch, KV_HEADS, prefix + n, D, generator=g)
    return q, k, v, pack_mask(tree)


@pytest.fixture(scope="module")
def exported() -> onnx.ModelProto:
    b, n, s, w = (torch.export.Dim(name, min=1, max=4096) for name in ("b", "n", "s", "w"))
    program = export_onnx(
        TwoLayers(),
        inputs(2, 5, 7, seed=0),
        input_names=["q", "k", "v", "tree_mask"],
        dynamic_shapes=({0: b, 2: n}, {0: b, 2: s}, {0: b, 2: s}, {0: b, 1: n, 2: w}),
    )
    return program.model_proto


def test_export_emits_the_plugin_node(exported):
    nodes = [node for node in exported.graph.node if node.op_type == PLUGIN_NAME]
    assert len(nodes) == 2
    for node, scale in zip(nodes, (0.35, 0.125)):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.domain == ONNX_DOMAIN and len(node.input) == 4 and len(node.output) == 1
        assert attrs["plugin_namespace"] == PLUGIN_NAMESPACE.encode()
        assert attrs["plugin_version"] == PLUGIN_VERSION.encode()
        assert attrs["scale"] == pytest.approx(scale)
    assert list(nodes[0].input) == ["q", "k", "v", "tree_mask"]
    assert any(o.domain == ONNX_DOMAIN for o in exported.opset_import)


@pytest.mark.parametrize("batch,n,prefix", [(2, 5, 7), (1, 1, 0), (3, 40, 0), (1, 33, 100)])
def test_decomposed_graph_matches_reference_in_onnxruntime(exported, batch, n, prefix):
    model = onnx_decompose(exported)
    onnx.checker.check_model(model, full_check=True)
    assert not any(node.op_type == PLUGIN_NAME for node in model.graph.node)
    assert all(o.domain != ONNX_DOMAIN for o in model.opset_import)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    q, k, v, mask = inputs(batch, n, prefix, seed=n + prefix)
    (got,) = session.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "tree_mask": mask.numpy()})
    np.testing.assert_allclose(got, reference(q, k, v, mask).numpy(), rtol=1e-5, atol=1e-5)


def test_decompose_leaves_the_input_model_alone(exported):
    before = exported.SerializeToString()
    onnx_decompose(exported)
    assert exported.SerializeToString() == before


def test_decompose_rejects_old_opsets(exported):
    old = onnx.ModelProto()
    old.CopyFrom(exported)
    for o in old.opset_import:
        if o.domain == "":
            o.version = 17
    with pytest.raises(OnnxDecomposeError, match="needs >= 18"):
        onnx_decompose(old)
