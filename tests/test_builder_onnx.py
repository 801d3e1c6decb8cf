"""model.onnx in an engine directory: checker-valid, one plugin node per attention, and (decomposed into standard
ops) the same tree-step logits in onnxruntime as the torch runtime."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

import runtime
from builder.build import build_engine
from builder.config import parse_config
from builder.onnx_stage import past_names
from plugins.tree_attention.onnx_decompose import onnx_decompose
from plugins.tree_attention.onnx_export import register_plugin_schema
from plugins.tree_attention.spec import PLUGIN_NAME, PLUGIN_NAMESPACE
from runtime.engine import open_engine
from runtime.model import causal_mask
from runtime.tree import Tree
from tests.heads import write_medusa_head
from tests.tiny import make_checkpoint, vocab_size

ort = pytest.importorskip("onnxruntime")

TREE = Tree.preset("mc_sim_7b_63")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    # Qwen2: q/k/v biases, GQA (4 query heads on 2 kv heads); tied embeddings exercise the shared lm_head.
    ck = make_checkpoint(root / "qwen2", "qwen2", tie=True)
    heads = write_medusa_head(root / "heads", 64, vocab_size(), num_heads=4)
    data = {"model": {"checkpoint": str(ck)},
            "draft": {"method": "medusa", "checkpoint": str(heads), "tree": {"preset": "mc_sim_7b_63"}},
            "build": {"output": str(root / "engine"), "dtype": "float32", "max_seq_len": 256}}
    result = build_engine(parse_config(data, root, "onnx.yaml"))
    return result


def test_model_onnx_passes_the_checker_with_full_shape_inference(built):
    path = built.output / "model.onnx"
    register_plugin_schema()
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    plugin_out = {n.output[0] for n in model.graph.node if n.op_type == PLUGIN_NAME}
    shapes = {v.name: v for v in inferred.graph.value_info}
    for name in plugin_out:  # every plugin output has a typed 4-D shape [batch, Hq, num_tokens, D]
        dims = shapes[name].type.tensor_type.shape.dim
        assert [d.dim_param or d.dim_value for d in dims] == ["batch", 4, "num_tokens", 16]


def test_every_attention_is_one_plugin_node(built):
    model = onnx.load(str(built.output / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == PLUGIN_NAME]
    assert len(nodes) == 2  # one per layer
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == PLUGIN_NAMESPACE.encode()
        assert attrs["scale"] == pytest.approx(16 ** -0.5)
        assert len(node.input) == 4 and len(node.output) == 1
    assert not [n for n in model.graph.node if n.op_type in ("Softmax", "Exp")]  # no attention math outside
    assert [i.name for i in model.graph.input] == ["input_ids", "position_ids", "tree_mask", *past_names(2)]
    assert [o.name for o in model.graph.output][:2] == ["logits", "hidden_states"]


def test_decomposed_graph_matches_torch_on_a_tree_step(built):
    """Prefill a prompt with the torch runtime, then run one mc_sim_7b_63 tree step both ways."""
    decoder = runtime.load(built.output)
    assert decoder.max_context == 256  # the engine's max_seq_len caps the model's 512 positions
    model = decoder.model
    prompt = torch.tensor([decoder.encode_prompt("Speculative decoding drafts several tokens and the target")])
    cache = model.new_cache(128)
    model.prefill(prompt, cache)
    past_len = cache.length
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (1, TREE.num_nodes), generator=gen)
    positions = (past_len + TREE.depth)[None]
    mask = TREE.packed_mask[None]  # [1, 64, 2]: two mask words
    feeds = {"input_ids": tokens.numpy(), "position_ids": positions.numpy(), "tree_mask": mask.numpy()}
    for i in range(model.config.num_hidden_layers):
        feeds[f"past_key_values.{i}.key"] = cache.k[i, :, :, :past_len].numpy()
        feeds[f"past_key_values.{i}.value"] = cache.v[i, :, :, :past_len].numpy()
    logits, hidden = model.forward(tokens, positions, cache, mask)

    decomposed = onnx_decompose(onnx.load(str(built.output / "model.onnx")))
    assert not [n for n in decomposed.graph.node if n.op_type == PLUGIN_NAME]
    session = ort.InferenceSession(decomposed.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, feeds)))
    np.testing.assert_allclose(out["logits"], logits.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["hidden_states"], hidden.numpy(), rtol=1e-4, atol=1e-4)
    end = past_len + TREE.num_nodes
    for i in range(model.config.num_hidden_layers):  # present = past + the tree's K/V, as the cache holds them
        np.testing.assert_allclose(out[f"present.{i}.key"], cache.k[i, :, :, :end].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[f"present.{i}.value"], cache.v[i, :, :, :end].numpy(), rtol=1e-5, atol=1e-5)
    # The tree mask matters: a causal mask over the same tokens gives different logits.
    causal = {**feeds, "tree_mask": causal_mask(TREE.num_nodes).numpy()}
    assert not np.allclose(session.run(["logits"], causal)[0], out["logits"], atol=1e-3)


def test_engine_json_records_onnx_and_the_skipped_tensorrt_stage(built):
    m = json.loads((built.output / "engine.json").read_text())
    assert m["onnx"]["status"] == "built" and m["onnx"]["path"] == "model.onnx"
    assert m["onnx"]["plugin"] == {"op_type": PLUGIN_NAME, "namespace": PLUGIN_NAMESPACE, "version": "1", "nodes": 2}
    assert m["onnx"]["inputs"]["tree_mask"] == ["batch", "num_tokens", "mask_words"]
    assert m["onnx"]["inputs"]["past_key_values.0.key"] == ["batch", 2, "past_len", 16]
    assert {"model.onnx", *m["onnx"]["external_data"]} <= set(m["files"])
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert m["tensorrt"]["status"] == "skipped"
        assert "tensorrt" in m["tensorrt"]["reason"] and "not installed" in m["tensorrt"]["reason"]
        assert [s.name for s in built.skipped] == ["tensorrt"]
    # The files still verify, and the directory serves with the torch backend.
    eng = open_engine(built.output)
    eng.path("model.onnx")
    for name in m["onnx"]["external_data"]:
        eng.path(name)


def test_bfloat16_build_exports_a_valid_graph(tmp_path):
    """A bfloat16 engine exports too: the eager runtime's batch-invariant matmul blocks (runtime.model.linear)
    stay out of traced graphs, whose data-dependent split would be a bf16 SplitToSequence the checker rejects."""
    ck = make_checkpoint(tmp_path / "llama3", "llama3")
    heads = write_medusa_head(tmp_path / "heads", 64, vocab_size(), num_heads=2)
    data = {"model": {"checkpoint": str(ck)},
            "draft": {"method": "medusa", "checkpoint": str(heads), "tree": {"preset": "chain-2"}},
            "build": {"output": str(tmp_path / "engine"), "dtype": "bfloat16", "max_seq_len": 128}}
    result = build_engine(parse_config(data, tmp_path, "bf16.yaml"))
    register_plugin_schema()
    onnx.checker.check_model(str(result.output / "model.onnx"), full_check=True)
    model = onnx.load(str(result.output / "model.onnx"), load_external_data=False)
    assert not [n for n in model.graph.node if n.op_type == "SplitToSequence"]
