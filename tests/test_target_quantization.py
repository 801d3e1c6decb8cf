"""A block-quantised target (TargetModel.quantize_weights, `target_quantization`: GGUF Q8_0 / Q4_1 layouts through the
weight-streaming kernel): its logits are those of the dense model holding the quantised values (Q4 also quantising
the activations it multiplies, as llama.cpp does), and the torch route's of the same blocks; greedy speculative
output equals plain decoding of that quantised target, sampled output follows its distribution, and bad requests are
refused naming the field."""

from __future__ import annotations

import pytest
import torch

import runtime
from plugins.decoder_layer import native as native_layer
from plugins.stream_linear import native as stream
from runtime.errors import ConfigError
from runtime.config import TARGET_QUANTIZATIONS
from runtime.model import TargetModel
from runtime.tree import Tree
from tests.test_decode import (PROMPTS, RankedDrafter, SAMPLING_CASES, TeacherDrafter, chi2_threshold,
                               distribution_stat, greedy_reference)
from runtime.decode import SpecDecoder
from tests.tiny import make_checkpoint

pytestmark = pytest.mark.skipif(stream.load() is None, reason="no C compiler: the weight-streaming kernel is absent")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-target")
    return {v: make_checkpoint(root / v, v) for v in ("llama3", "qwen2")}


@pytest.mark.parametrize("kind", TARGET_QUANTIZATIONS)
@pytest.mark.parametrize("variant", ["llama3", "qwen2"])
def test_logits_are_the_dense_model_of_the_quantised_values(ckpts, variant, kind):
    quant = TargetModel.from_pretrained(ckpts[variant], dtype="float32")
    dense = TargetModel.from_pretrained(ckpts[variant], dtype="float32")
    quant.quantize_weights(kind)
    assert quant.weight_format == kind
    with torch.no_grad():  # the twin: each matmul's weight replaced by its blocks' exact values
        for q_layer, d_layer in zip(quant.model.layers, dense.model.layers):
            for q_mod, d_mod in ((q_layer.self_attn, d_layer.self_attn), (q_layer.mlp, d_layer.mlp)):
                d_mod.fused_weight.copy_(q_mod.blocks[0].dense())
                getattr(d_mod, d_mod._out_name).weight.copy_(q_mod.blocks[1].dense())
        head = quant._block_lm_head.dense()
    tokens = torch.tensor([PROMPTS[3]])
    q_logits, _ = quant.prefill(tokens, quant.new_cache(tokens.shape[1]))
    if kind == "q8":  # weight-only: the dense twin is the model
        # the embedding keeps its dense rows; the lm_head (tied or not) reads the blocks
        d_hidden = dense.prefill(tokens, dense.new_cache(tokens.shape[1]))[1]
        d_logits = d_hidden.float() @ head.T
        assert torch.allclose(q_logits, d_logits, atol=1e-4, rtol=1e-4)
    # the torch route of the same blocks (BlockWeight.torch_linear: Q4's activations quantised in torch ops), with the
    # kernels withheld
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "linear", lambda *args, **kwargs: None)
        mp.setattr(native_layer, "load", lambda: None)
        t_logits, _ = quant.prefill(tokens, quant.new_cache(tokens.shape[1]))
    assert torch.allclose(q_logits, t_logits, atol=1e-4, rtol=1e-4)
    if kind == "q4":  # and the activations' quantisation is part of it: the dense twin differs
        d_hidden = dense.prefill(tokens, dense.new_cache(tokens.shape[1]))[1]
        assert not torch.allclose(q_logits, d_hidden.float() @ head.T, atol=1e-4, rtol=1e-4)
    # and quantisation did change the model (the test compares something)
    plain_logits, _ = TargetModel.from_pretrained(ckpts[variant], dtype="float32").prefill(
        tokens, dense.new_cache(tokens.shape[1]))
    assert not torch.allclose(q_logits, plain_logits, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", TARGET_QUANTIZATIONS)
def test_greedy_speculation_equals_plain_decoding_of_the_quantised_target(ckpts, kind, dtype):
    model = TargetModel.from_pretrained(ckpts["llama3"], dtype=dtype)
    model.quantize_weights(kind)
    tree = Tree.parse('[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]')
    for i, prompt in enumerate(PROMPTS[:4]):
        dec = SpecDecoder(model, None, TeacherDrafter(model, tree, seed=i), max_tree_nodes=tree.num_nodes)
        out = dec.generate(prompt, max_tokens=16, ignore_eos=True)
        assert list(out.token_ids) == greedy_reference(model, prompt, 16)
        assert out.stats.tau > 1.0


def test_the_load_option_quantises_and_lookup_stays_identical(ckpts):
    plain = runtime.load(ckpts["qwen2"], target_quantization="q4")
    look = runtime.load(ckpts["qwen2"], draft="lookup", target_quantization="q4")
    assert plain.model.weight_format == "q4"
    for prompt in PROMPTS:
        assert (plain.generate(prompt, max_tokens=24, ignore_eos=True).token_ids
                == look.generate(prompt, max_tokens=24, ignore_eos=True).token_ids)


@pytest.mark.parametrize("dtype,kind,kw", [("float32", "q8", SAMPLING_CASES[0]),
                                            ("bfloat16", "q4", SAMPLING_CASES[1]),
                                            ("bfloat16", None, SAMPLING_CASES[0])])
def test_sampled_tokens_follow_the_target_through_the_native_routes(ckpts, dtype, kind, kw, monkeypatch):
    """Rejection sampling over the tree stays exact through the streaming matmuls, the one-call layers (bfloat16)
    and a quantised target: the samples' law is the target's own, exactly computed (negative control: test_decode's
    lossy acceptance, which the same statistic catches)."""
    from plugins.decoder_layer import native as decoder_layer

    model = TargetModel.from_pretrained(ckpts["llama3"], dtype=dtype)
    if kind:
        model.quantize_weights(kind)
    calls = []
    real = decoder_layer.stack_forward
    monkeypatch.setattr(decoder_layer, "stack_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    dec = SpecDecoder(model, None, RankedDrafter(model, tree), tree.num_nodes)
    stat, df, _ = distribution_stat(dec, model, PROMPTS[1], kw)
    assert stat < chi2_threshold(df), (stat, df)
    assert bool(calls) == (dtype == "bfloat16" and decoder_layer.load() is not None)


def test_bad_quantisation_requests_name_the_field(ckpts):
    with pytest.raises(ConfigError, match="target_quantization.*q8, q4.*'q3'"):
        runtime.load(ckpts["llama3"], target_quantization="q3")
    model = TargetModel.from_pretrained(ckpts["llama3"], dtype="float32")
    with pytest.raises(ConfigError, match="must be one of"):
        model.quantize_weights("int8")
    model = TargetModel.from_pretrained(ckpts["llama3"], dtype="float32").double()
    with pytest.raises(ConfigError, match="weight-streaming kernel"):
        model.quantize_weights("q8")


def test_a_weight_change_drops_the_blocks(ckpts):
    model = TargetModel.from_pretrained(ckpts["llama3"], dtype="float32")
    model.quantize_weights("q8")
    model.load_state_dict(model.state_dict())
    assert model.weight_format is None and model.model.layers[0].mlp.blocks is None
