"""The one-call decoder layer (plugins/decoder_layer): the same bits as the layer's torch route, logits, hidden states
and the keys and values it writes into the cache, for prompt chunks and draft trees, grouped and multi-head attention,
projection biases and a block-quantised target; and the cases it leaves to the torch route."""

from __future__ import annotations

import pytest
import torch

import runtime.model
from plugins.decoder_layer import native as decoder_layer
from plugins.tree_attention.mask import ancestor_mask, pack_mask, random_parents
from runtime.model import DecoderLayer, TargetModel, causal_mask
from tests.cpu_marks import needs_fast_bf16
from tests.tiny import make_checkpoint

pytestmark = [needs_fast_bf16, pytest.mark.skipif(decoder_layer.load() is None,
                                                  reason=f"decoder layer kernel: {decoder_layer.unavailable()}")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layer")
    return {
        "llama3": make_checkpoint(root / "llama3", "llama3", seed=5),  # grouped-query attention
        "qwen2": make_checkpoint(root / "qwen2", "qwen2", seed=5, num_key_value_heads=4),  # q/k/v biases, MHA
    }


def count_native_calls(monkeypatch) -> list:
    """A list that grows by one at every native call of a run of layers (`stack_forward`: one layer, or many)."""
    calls = []
    real = decoder_layer.stack_forward
    monkeypatch.setattr(decoder_layer, "stack_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _step(model: TargetModel, prefix: int, nodes: int, seed: int, native: bool, monkeypatch, stack: bool = True):
    """Logits and hidden states of a prompt chunk then a random tree step, and the cache's keys / values after;
    native=False: the torch route; stack=False: the one-call layers one by one rather than the stack's one call."""
    if not native:
        monkeypatch.setattr(runtime.model, "native_ready", lambda *args, **kwargs: False)
    if not stack:
        monkeypatch.setattr(TargetModel, "_native_run", lambda *args, **kwargs: None)
    calls = count_native_calls(monkeypatch)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    cache = model.new_cache(prefix + nodes + 4)
    tokens = torch.randint(3, vocab, (1, prefix), generator=g)
    prompt_logits, _ = model.prefill(tokens, cache)
    parents = random_parents(nodes, g)
    depth = [0] * nodes
    for i, p in enumerate(parents[1:], start=1):
        depth[i] = depth[p] + 1
    tree = torch.randint(3, vocab, (1, nodes), generator=g)
    positions = (prefix + torch.tensor(depth))[None]
    logits, hidden = model.run(tree, positions, cache, pack_mask(ancestor_mask(parents))[None])
    end = prefix + nodes
    monkeypatch.undo()
    assert bool(calls) == native
    return prompt_logits, logits, hidden, cache.k[:, :, :, :end].clone(), cache.v[:, :, :, :end].clone()


@pytest.mark.parametrize("quantization", [None, "q8", "q4"])
@pytest.mark.parametrize("variant", ["llama3", "qwen2"])
def test_the_native_layer_gives_the_torch_routes_bits(ckpts, variant, quantization, monkeypatch):
    model = TargetModel.from_pretrained(ckpts[variant], dtype="bfloat16")
    if quantization:
        model.quantize_weights(quantization)
    for seed, (prefix, nodes) in enumerate([(1, 1), (23, 9), (70, 33)]):
        native = _step(model, prefix, nodes, seed, True, monkeypatch)
        torch_route = _step(model, prefix, nodes, seed, False, monkeypatch)
        for got, want in zip(native, torch_route):
            assert torch.equal(got, want), (prefix, nodes)


@pytest.mark.parametrize("quantization", [None, "q4"])
def test_negative_control_the_comparison_sees_one_changed_bit(ckpts, quantization, monkeypatch):
    """The equality above can fail: one weight moved by one bf16 step (q4: one block's scale, in place) changes the
    compared outputs. So an in-place edit after a forward reaches the next one (the layer's prepared arguments are
    made again: `Prepared.current`), and gives what a model made with the edit gives."""
    model = TargetModel.from_pretrained(ckpts["llama3"], dtype="bfloat16")
    if quantization:
        model.quantize_weights(quantization)
    before = _step(model, 23, 9, 0, True, monkeypatch)
    with torch.no_grad():
        if quantization:
            model.model.layers[1].mlp.blocks[1].scale[3, 0] *= 1.25
        else:
            w = model.model.layers[1].mlp.down_proj.weight
            w[3, 5] = torch.nextafter(w[3, 5].float(), torch.tensor(10.0)).bfloat16() + w[3, 5] * 2**-7
    after = _step(model, 23, 9, 0, True, monkeypatch)
    assert not torch.equal(before[1], after[1])
    for layer in model.model.layers:
        layer._prepared = None
    assert torch.equal(after[1], _step(model, 23, 9, 0, True, monkeypatch)[1])


@pytest.mark.parametrize("variant", ["llama3", "qwen2"])
def test_the_stacks_one_call_gives_the_layer_by_layer_bits(ckpts, variant, monkeypatch):
    """All layers in one native call (`stack_forward`) against the same layers called one by one."""
    model = TargetModel.from_pretrained(ckpts[variant], dtype="bfloat16")
    for seed, (prefix, nodes) in enumerate([(1, 1), (23, 9), (70, 33)]):
        stacked = _step(model, prefix, nodes, seed, True, monkeypatch)
        layered = _step(model, prefix, nodes, seed, True, monkeypatch, stack=False)
        for got, want in zip(stacked, layered):
            assert torch.equal(got, want), (prefix, nodes)


def test_feature_layers_split_the_stack_and_see_the_torch_routes_states(ckpts, monkeypatch):
    """With feature layers (an EAGLE-3 drafter's), the stack runs as one call per run of layers between them, and the
    features are the states the torch route sees at those layers."""
    model = TargetModel.from_pretrained(ckpts["llama3"], dtype="bfloat16")
    layers = len(model.model.layers)
    tokens = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(12)[None]

    def stack(native: bool):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(runtime.model, "native_ready", lambda *args, **kwargs: False)
            calls = count_native_calls(m)
            hidden, features = model._stack(tokens, positions, model.new_cache(16), causal_mask(12),
                                            feature_layers=(0, 1, layers))
        return hidden, features, len(calls)

    (h_native, f_native, calls), (h_torch, f_torch, none) = stack(True), stack(False)
    assert calls == 2 and none == 0  # layers [0, 1) and [1, layers)
    assert torch.equal(h_native, h_torch) and len(f_native) == len(f_torch) == 3
    assert all(torch.equal(a, b) for a, b in zip(f_native, f_torch))


def test_what_it_leaves_to_the_torch_route(ckpts, monkeypatch):
    calls = count_native_calls(monkeypatch)
    f32 = TargetModel.from_pretrained(ckpts["llama3"], dtype="float32")  # float32 attends through SDPA
    f32.prefill(torch.tensor([[5, 6, 7]]), f32.new_cache(8))
    assert not calls
    bf16 = TargetModel.from_pretrained(ckpts["llama3"], dtype="bfloat16")
    cache = bf16.new_cache(8, batch=2)  # a batch of two sequences in one cache
    bf16.forward(torch.tensor([[5, 6], [7, 8]]), torch.tensor([[0, 1], [0, 1]]), cache, causal_mask(2, 2))
    assert not calls
    bf16.prefill(torch.tensor([[5, 6, 7]]), bf16.new_cache(8))
    assert calls
