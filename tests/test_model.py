"""TargetModel against transformers (the oracle), tree steps against per-branch runs, KV-cache compaction."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from plugins.stream_linear import native as stream_linear
from plugins.tree_attention.mask import ancestor_mask, pack_mask, random_parents
import runtime.model
from runtime.config import ModelConfig
from runtime.checkpoint import load_checkpoint
from runtime.errors import CacheError, RequestError
from runtime.kv_cache import KVCache
from runtime.model import DecoderLayer, TargetModel, causal_mask
from tests.tiny import VARIANTS, make_checkpoint
from tests.cpu_marks import needs_fast_bf16

transformers = pytest.importorskip("transformers")


# ---- helpers ---------------------------------------------------------------------------------------------


def hf_model(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@torch.no_grad()
def hf_logits(ref, ids) -> torch.Tensor:
    """transformers' logits: ids [T] or [B, T] (lists) -> [B, T, V] float32."""
    t = torch.as_tensor(ids)
    return ref(t[None] if t.ndim == 1 else t).logits.float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """max |ours - ref| <= rel * logit scale (max |ref|, at least 1)."""
    scale = max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max logit error {err:.3e} > {rel:g} * scale {scale:.2f}"


def random_tokens(n: int, vocab: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))  # skip specials


def random_tree(n: int, seed: int) -> list[int]:
    """parents of a random n-node tree in topological order (root 0 has parent -1)."""
    return random_parents(n, torch.Generator().manual_seed(seed))


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Root-to-node path (node indices, root first) of every node."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append([i] if p < 0 else paths[p] + [i])
    return paths


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Lazily built checkpoints keyed by (variant, tie, sharded, dtype)."""
    built = {}

    def get(variant, tie=False, sharded=False, dtype="float32", **overrides):
        key = (variant, tie, sharded, dtype, repr(sorted(overrides.items())))
        if key not in built:
            d = tmp_path_factory.mktemp(f"{variant}-{'tied' if tie else 'untied'}")
            built[key] = make_checkpoint(
                d, variant, dtype=dtype, tie=tie, sharded=sharded, seed=len(built), **overrides
            )
        return built[key]

    return get


# ---- full causal pass == transformers --------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(ckpts, variant, tie):
    path = ckpts(variant, tie=tie)
    model = TargetModel.from_pretrained(path)
    assert model.config.tie_word_embeddings is tie
    assert (model.output is None) is tie
    tokens = random_tokens(80, model.config.vocab_size, seed=1, batch=2)
    logits, hidden = model.prefill(tokens, model.new_cache(96, batch=2))
    ref = hf_model(path)
    expected = hf_logits(ref, tokens.tolist())
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    assert_logits_close(logits, expected)
    # hidden is the lm_head input
    assert_logits_close(model.lm_head(hidden), logits, rel=0)
    # The test can fail: logits are far from uniform and rows differ.
    assert expected.std(-1).min() > 0.5


def test_sharded_checkpoint(ckpts):
    path = ckpts("llama2", sharded=True)
    assert len(list(path.glob("model-*.safetensors"))) >= 2 and (path / "model.safetensors.index.json").is_file()
    model = TargetModel.from_pretrained(path)
    tokens = random_tokens(40, model.config.vocab_size, seed=2)
    logits, _ = model.prefill(tokens, model.new_cache(40))
    assert_logits_close(logits, hf_logits(hf_model(path), tokens.tolist()))


def test_llama3_rope_scaling_matters(ckpts):
    path = ckpts("llama3")
    model = TargetModel.from_pretrained(path)
    assert model.config.rope_scaling is not None and model.config.rope_scaling.rope_type == "llama3"
    tokens = random_tokens(300, model.config.vocab_size, seed=3)
    logits, _ = model.prefill(tokens, model.new_cache(300))
    expected = hf_logits(hf_model(path), tokens.tolist())
    assert_logits_close(logits, expected)
    # Negative control: the same weights with plain RoPE are far off, so the check above sees the scaling.
    config, tensors = load_checkpoint(path)
    plain = TargetModel.from_state(dataclasses.replace(config, rope_scaling=None), tensors)
    plain_logits, _ = plain.prefill(tokens, plain.new_cache(300))
    assert (plain_logits - expected).abs().max() > 100 * 1e-5 * expected.abs().max()


def test_linear_rope_scaling(ckpts):
    path = ckpts("llama2", rope_scaling={"rope_type": "linear", "factor": 4.0})
    model = TargetModel.from_pretrained(path)
    assert model.config.rope_scaling.rope_type == "linear"
    tokens = random_tokens(100, model.config.vocab_size, seed=4)
    logits, _ = model.prefill(tokens, model.new_cache(100))
    assert_logits_close(logits, hf_logits(hf_model(path), tokens.tolist()))


# ---- chunked and tree steps ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["llama3", "qwen2"])
def test_chunked_prefill_equals_single_pass(ckpts, variant):
    model = TargetModel.from_pretrained(ckpts(variant))
    tokens = random_tokens(70, model.config.vocab_size, seed=5, batch=2)
    full, full_hidden = model.prefill(tokens, model.new_cache(70, batch=2))
    cache = model.new_cache(70, batch=2)
    pieces, hiddens, start = [], [], 0
    for size in (30, 1, 7, 32):  # 32 and 7 exercise full and partial mask words
        chunk = tokens[:, start : start + size]
        positions = torch.arange(start, start + size).expand(2, size)
        logits, hidden = model(chunk, positions, cache, causal_mask(size, batch=2))
        assert cache.length == start  # forward does not advance
        cache.advance(size)
        pieces.append(logits)
        hiddens.append(hidden)
        start += size
    assert_logits_close(torch.cat(pieces, 1), full)
    assert_logits_close(torch.cat(hiddens, 1), full_hidden)


@pytest.mark.parametrize("variant,num_nodes", [("llama2", 12), ("mistral", 12), ("llama3", 40)])
def test_tree_step_matches_per_branch_oracle(ckpts, variant, num_nodes):
    """Every node of a tree step gets the logits transformers gives on prefix + that node's ancestor path."""
    path = ckpts(variant)
    model = TargetModel.from_pretrained(path)
    ref = hf_model(path)
    v = model.config.vocab_size
    batch, prefix_len = 2, 20
    prefix = random_tokens(prefix_len, v, seed=6, batch=batch)
    trees = [random_tree(num_nodes, seed=10 + b) for b in range(batch)]  # a different tree per row
    node_tokens = random_tokens(num_nodes, v, seed=7, batch=batch)
    depths = torch.tensor([[len(p) - 1 for p in tree_paths(t)] for t in trees])
    masks = torch.stack([ancestor_mask(t) for t in trees])

    cache = model.new_cache(prefix_len + num_nodes, batch=batch)
    model.prefill(prefix, cache)
    logits, _ = model(node_tokens, prefix_len + depths, cache, pack_mask(masks))
    assert cache.length == prefix_len

    for b, parents in enumerate(trees):
        paths = tree_paths(parents)
        for node, nodes in enumerate(paths):
            seq = prefix[b].tolist() + node_tokens[b, nodes].tolist()
            expected = hf_logits(ref, seq)[0, -1]
            assert_logits_close(logits[b, node], expected)
    # Negative control: ignoring the tree (causal mask over the flat node list) gives different logits.
    cache.truncate(prefix_len)
    flat, _ = model(node_tokens, prefix_len + depths, cache, causal_mask(num_nodes, batch))
    assert (flat - logits).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["llama2", "qwen2"])
def test_commit_path_then_continue_equals_full_sequence(ckpts, variant):
    path = ckpts(variant)
    model = TargetModel.from_pretrained(path)
    ref = hf_model(path)
    v = model.config.vocab_size
    prefix = random_tokens(15, v, seed=8)
    parents = [-1, 0, 0, 1, 1, 2, 4, 4, 6, 3]
    keep_path = tree_paths(parents)[8]  # [0, 1, 4, 6, 8]: not a prefix of the node order, so slots move
    node_tokens = random_tokens(len(parents), v, seed=9)
    depths = torch.tensor([[len(p) - 1 for p in tree_paths(parents)]])

    cache = model.new_cache(40)
    model.prefill(prefix, cache)
    model(node_tokens, 15 + depths, cache, pack_mask(ancestor_mask(parents)[None]))
    cache.commit(len(parents), torch.tensor(keep_path))
    assert cache.length == 15 + len(keep_path)

    accepted = prefix[0].tolist() + node_tokens[0, keep_path].tolist()
    # The compacted cache equals the cache of a plain causal pass over the accepted sequence.
    fresh = model.new_cache(40)
    model.prefill(torch.tensor([accepted]), fresh)
    n = len(accepted)
    torch.testing.assert_close(cache.k[:, :, :, :n], fresh.k[:, :, :, :n], rtol=0, atol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :, :n], fresh.v[:, :, :, :n], rtol=0, atol=1e-5)

    # Keep decoding on the compacted cache (single tokens, then a chunk): logits match transformers run on
    # the whole accepted sequence.
    seq = list(accepted)
    more = random_tokens(7, v, seed=10)[0].tolist()
    for chunk in ([more[0]], [more[1]], [more[2]], more[3:]):
        k = len(chunk)
        positions = torch.arange(cache.length, cache.length + k)[None]
        logits, _ = model(torch.tensor([chunk]), positions, cache, causal_mask(k))
        cache.advance(k)
        seq += chunk
        assert_logits_close(logits[0], hf_logits(ref, seq)[0, -k:])


# ---- dtypes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,rel", [pytest.param("bfloat16", 0.05, marks=needs_fast_bf16), ("float16", 0.01)])
def test_half_precision(ckpts, dtype, rel):
    path = ckpts("llama3")
    tokens = random_tokens(50, 420, seed=11)
    full, _ = TargetModel.from_pretrained(path).prefill(tokens, TargetModel.from_pretrained(path).new_cache(50))
    model = TargetModel.from_pretrained(path, dtype=dtype)
    assert model.dtype == getattr(torch, dtype) and model.config.dtype == dtype
    cache = model.new_cache(50)
    # bf16: the row-invariant kernel attends over it, in bf16 where it multiplies bf16 natively, else in float32
    assert cache.dtype == model.kv_dtype == runtime.model.kv_dtype(getattr(torch, dtype), torch.device("cpu"),
                                                                    model.config.head_dim)
    assert cache.dtype in (getattr(torch, dtype), torch.float32)
    logits, hidden = model.prefill(tokens, cache)
    assert logits.dtype == torch.float32 and hidden.dtype == getattr(torch, dtype)
    assert torch.isfinite(logits).all()
    assert_logits_close(logits, full, rel=rel)
    assert (logits.argmax(-1) == full.argmax(-1)).float().mean() > 0.9


def test_dtype_defaults_to_config(ckpts):
    """A bfloat16 checkpoint runs in bfloat16 where bf16 runs fast (the weight-streaming kernel, or native bf16), else
    in float32 (said once)."""
    path = ckpts("qwen2", dtype="bfloat16")
    native = stream_linear.bf16_missing() is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = TargetModel.from_pretrained(path)
    dtype = torch.bfloat16 if native else torch.float32
    assert model.config.dtype == str(dtype).removeprefix("torch.") and model.dtype == dtype
    demoted = [w for w in caught if "the checkpoint's bfloat16 runs as float32" in str(w.message)]
    assert len(demoted) == (0 if native else 1)
    tokens = random_tokens(20, model.config.vocab_size, seed=12)
    logits, _ = model.prefill(tokens, model.new_cache(20))
    ref = hf_model(path, dtype=dtype)
    assert_logits_close(logits, hf_logits(ref, tokens.tolist()), rel=0.05)
    assert TargetModel.from_pretrained(path, dtype=torch.float32).dtype == torch.float32


# ---- API details and errors ------------------------------------------------------------------------------


def test_mistral_context_capped_by_sliding_window(ckpts):
    model = TargetModel.from_pretrained(ckpts("mistral"))
    assert model.config.sliding_window == 256 and model.config.max_context == 256
    assert model.config.head_dim == 32  # explicit head_dim != hidden / heads
    model.new_cache(256)
    with pytest.raises(CacheError, match="max_context"):
        model.new_cache(257)


def test_forward_errors(ckpts):
    model = TargetModel.from_pretrained(ckpts("llama2"))
    cache = model.new_cache(8)
    tokens = torch.tensor([[5, 6, 7]])
    pos = torch.arange(3)[None]
    with pytest.raises(RequestError, match="tree_mask"):
        model(tokens, pos, cache, torch.ones(1, 3, 3, dtype=torch.int32))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        model(torch.tensor([[5, 420, 7]]), pos, cache, causal_mask(3))
    with pytest.raises(RequestError, match="positions"):
        model(tokens, pos[:, :2], cache, causal_mask(3))
    with pytest.raises(CacheError, match="batch"):
        model(tokens.expand(2, 3), pos.expand(2, 3), cache, causal_mask(3, 2))
    model.prefill(torch.tensor([[1, 2, 3, 4, 5, 6]]), cache)
    with pytest.raises(CacheError, match="overflow: 6 committed \\+ 3 new tokens exceeds max_len 8"):
        model(tokens, 6 + pos, cache, causal_mask(3))
    assert cache.length == 6


def test_decoder_layer_standalone(ckpts):
    """A DecoderLayer with its own one-layer cache reproduces the model's layer 0; input_norm=False skips the norm."""
    model = TargetModel.from_pretrained(ckpts("llama2"))
    cfg = model.config
    x = model.embed(random_tokens(10, cfg.vocab_size, seed=13))  # [1, 10, H]
    pos = torch.arange(10)[None]
    mask = causal_mask(10)
    own = DecoderLayer(cfg, 0)
    own.load_state_dict(model.model.layers[0].state_dict())
    cache = KVCache(1, cfg.num_key_value_heads, cfg.head_dim, 16)
    big = model.new_cache(16)
    with torch.no_grad():  # as the runtime runs (a layer recording gradients takes torch's RMSNorm, not the native one)
        expected = model.model.layers[0](x, pos, big, 0, mask)
        torch.testing.assert_close(own(x, pos, cache, 0, mask), expected, rtol=0, atol=0)

    bare = DecoderLayer(cfg, 0, input_norm=False)
    assert bare.input_layernorm is None and not any("input_layernorm" in k for k in bare.state_dict())
    state = {k: t for k, t in own.state_dict().items() if not k.startswith("input_layernorm")}
    bare.load_state_dict(state)
    # Feeding the normed input to the bare layer reproduces the normed layer's attention branch.
    normed = own.input_layernorm(x)
    cos_sin = own.rotary(pos)
    attn = own.self_attn(normed, *cos_sin, KVCache(1, cfg.num_key_value_heads, cfg.head_dim, 16), 0, mask)
    h = normed + attn
    manual = h + own.mlp(own.post_attention_layernorm(h))
    got = bare(normed, pos, KVCache(1, cfg.num_key_value_heads, cfg.head_dim, 16), 0, mask)
    torch.testing.assert_close(got, manual, rtol=0, atol=1e-6)
    assert (got - own(x, pos, KVCache(1, cfg.num_key_value_heads, cfg.head_dim, 16), 0, mask)).abs().max() > 1e-3


def test_from_state_and_config_roundtrip(ckpts):
    path = ckpts("qwen2", tie=True)
    config, tensors = load_checkpoint(path)
    model = TargetModel.from_state(config, tensors)
    assert model.lm_head_weight is model.model.embed_tokens.weight  # tied: one tensor
    assert isinstance(model.config, ModelConfig) and model.config == ModelConfig.from_hf(path)
    assert not any(p.requires_grad for p in model.parameters())


# ---- KVCache unit tests ----------------------------------------------------------------------------------


def _filled_cache(max_len=10, written=6):
    cache = KVCache(2, 1, 2, max_len)
    vals = torch.arange(written, dtype=torch.float32)[None, None, :, None].expand(1, 1, written, 2)
    for layer in range(2):
        cache.write(layer, vals + 100 * layer, -vals)
    return cache


def test_kv_commit_moves_kept_slots():
    cache = _filled_cache()
    cache.advance(2)  # slots 0, 1 committed
    new = torch.tensor([10.0, 11, 12, 13])[None, None, :, None].expand(1, 1, 4, 2)
    cache.write(0, new, new)
    cache.write(1, new, new)
    cache.commit(4, torch.tensor([1, 3]))
    assert cache.length == 4
    assert cache.k[0, 0, 0, :4, 0].tolist() == [0.0, 1.0, 11.0, 13.0]
    assert cache.v[1, 0, 0, :4, 1].tolist() == [0.0, -1.0, 11.0, 13.0]


def test_kv_cache_errors():
    cache = _filled_cache()
    with pytest.raises(CacheError, match="strictly increasing"):
        cache.commit(6, torch.tensor([2, 1]))
    with pytest.raises(CacheError, match="strictly increasing"):
        cache.commit(6, torch.tensor([0, 6]))
    with pytest.raises(CacheError, match="7.*6 slots were written"):
        cache.commit(7, torch.tensor([0]))
    with pytest.raises(CacheError, match="1-D"):
        cache.commit(6, torch.tensor([[0]]))
    cache.advance(6)
    with pytest.raises(CacheError, match="overflow: 6 committed \\+ 5 new tokens exceeds max_len 10"):
        cache.write(0, torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2))
    with pytest.raises(CacheError, match="truncate"):
        cache.truncate(7)
    cache.truncate(3)
    assert cache.length == 3
    with pytest.raises(CacheError, match="0 slots were written"):
        cache.commit(1, torch.tensor([0]))
    with pytest.raises(CacheError, match="advance num_new=1, but 0 slots were written"):
        cache.advance(1)
    cache.write(0, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    for bad in (3, -1, True, 1.0):
        with pytest.raises(CacheError, match=f"advance num_new={bad!r}, but 2 slots were written"):
            cache.advance(bad)
    cache.advance(2)
    assert cache.length == 5
    with pytest.raises(CacheError, match="max_len"):
        KVCache(1, 1, 2, 0)


def test_fused_projections_share_storage_and_follow_loads_and_moves(ckpts):
    """q/k/v and gate/up run as one matmul each over a stacked weight whose row blocks ARE the named parameters:
    no weight is held twice, state-dict names stay Hugging Face's, and new weights (load_state_dict) or a dtype
    move (.to) are picked up by the fused path."""
    model = TargetModel.from_pretrained(ckpts("qwen2"))  # q/k/v biases fuse too
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for mod, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
        ptr = mod.fused_weight.untyped_storage().data_ptr()
        assert all(getattr(mod, n).weight.untyped_storage().data_ptr() == ptr for n in names)
    assert attn.fused_bias is not None and "model.layers.0.self_attn.fused_weight" not in model.state_dict()
    x = torch.randn(1, 3, model.config.hidden_size)
    q, k, v = attn.fused(x)
    torch.testing.assert_close(q, attn.q_proj(x))
    torch.testing.assert_close(v, attn.v_proj(x))
    # A load replaces the parameters: the fused weight follows.
    state = {k2: v2.clone() for k2, v2 in model.state_dict().items()}
    state["model.layers.0.mlp.up_proj.weight"] = torch.randn_like(state["model.layers.0.mlp.up_proj.weight"])
    model.load_state_dict(state, strict=True, assign=True)
    gate, up = mlp.fused(x)
    torch.testing.assert_close(up, x @ state["model.layers.0.mlp.up_proj.weight"].T)
    # A dtype move converts and re-fuses.
    model.to(torch.bfloat16)
    assert mlp.fused_weight.dtype == torch.bfloat16 == mlp.up_proj.weight.dtype
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.fused_weight.untyped_storage().data_ptr()
