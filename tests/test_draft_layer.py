"""The native EAGLE draft layer (plugins/draft_layer): one call per head forward on int8 weights. Checked against the
torch route over the same int8 copies (the catch-up forward over a KVCache with a causal mask, level forwards over a
DraftTreeCache with tree masks, with and without q/k/v biases, heads 16 and 20 wide (the vector and the scalar
attention), float32 and bfloat16), the keys and values it writes into the head's cache, its int8 matmul against
torch's int8 kernel, the heads it cannot run (which keep the torch route), the other routes' builds (AVX2, portable)
against this CPU's, and greedy output through it: plain decoding's, static and EAGLE-2 trees."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import runtime
from plugins import native_build
from plugins.draft_layer import native as native_layer
from runtime.drafters.eagle import DraftTreeCache, EagleDrafter, load_eagle_head
from runtime.drafters.eagle3 import Eagle3Drafter, load_eagle3_head
from runtime.model import TargetModel, causal_mask
from runtime.tree import Tree
from tests.heads import write_eagle3_head, write_eagle_head
from tests.tiny import make_checkpoint
from tests.cpu_marks import needs_fast_bf16

pytestmark = pytest.mark.skipif(native_layer.load() is None, reason=f"no native layer: {native_layer.unavailable()}")

TREE = Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("native") / "llama3", "llama3")


def _qkv_biases(state: dict[str, torch.Tensor], prefix: str = "layers.0.") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    for name in ("q", "k", "v"):
        rows = state[f"{prefix}self_attn.{name}_proj.weight"].shape[0]
        state[f"{prefix}self_attn.{name}_proj.bias"] = 0.3 * torch.randn(rows, generator=gen)
    return state


@pytest.fixture(scope="module")
def target3_dir(tmp_path_factory):
    """A target deep enough for an EAGLE-3 head's default feature layers."""
    return make_checkpoint(tmp_path_factory.mktemp("native3") / "llama3", "llama3", num_hidden_layers=8)


def _eagle3_drafters(target_dir, tmp_path, dtype, qkv_bias=False, norm_before_residual=False):
    """As `_drafters`, for an EAGLE-3 head (its midlayer: attention over the normed [embeddings | features])."""
    model = TargetModel.from_pretrained(target_dir, dtype=dtype)
    heads = write_eagle3_head(tmp_path / "eagle3", target_dir, seed=3,
                              config_overrides={"attention_bias": qkv_bias or None,
                                                "norm_before_residual": norm_before_residual or None},
                              state_hook=(lambda st: _qkv_biases(st, "midlayer.")) if qkv_bias else None)
    native, plain = (Eagle3Drafter(load_eagle3_head(heads, model), model, tree=TREE, quantization="int8")
                     for _ in range(2))
    plain.head.native, plain.lm_native = None, None
    return model, native, plain


def _drafters(target_dir, tmp_path, dtype, qkv_bias=False, **head_kw):
    """(a drafter on the native layer, one on the torch route), over the same int8 copies of one head."""
    model = TargetModel.from_pretrained(target_dir, dtype=dtype)
    heads = write_eagle_head(tmp_path / "eagle", target_dir, seed=3, config_overrides={"qkv_bias": qkv_bias or None},
                             state_hook=_qkv_biases if qkv_bias else None, **head_kw)
    native, plain = (EagleDrafter(load_eagle_head(heads, model), model, tree=TREE, quantization="int8")
                     for _ in range(2))
    plain.head.native, plain.lm_native = None, None
    return model, native, plain


def _prefilled(drafter, model, length):
    """A head cache holding `length` committed slots (the torch route's prefill, as decoding runs it)."""
    gen = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, model.config.vocab_size, (length,), generator=gen)
    feats = torch.randn(1, length, model.config.hidden_size, generator=gen).to(model.dtype)
    cache = drafter.head.new_cache(256)
    drafter.head(model.embed(tokens[None]), feats, torch.arange(length)[None], cache, causal_mask(length))
    cache.advance(length)
    return cache


def _inputs(model, n, seed):
    gen = torch.Generator().manual_seed(seed)
    embeds = model.embed(torch.randint(0, model.config.vocab_size, (1, n), generator=gen))
    feats = torch.randn(1, n, model.config.hidden_size, generator=gen).to(model.dtype)
    return embeds, feats


def _close(got, want, dtype):
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-5), rel


@pytest.fixture(scope="module")
def odd_head_dir(tmp_path_factory):
    """A target whose EAGLE head has 20-wide heads (160 / 8): attention off every vector route (8 and 16 lanes), RoPE
    over 10 pairs."""
    return make_checkpoint(tmp_path_factory.mktemp("native20") / "llama2", "llama2", hidden_size=160,
                           num_attention_heads=8)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_fast_bf16)])
@pytest.mark.parametrize("qkv_bias,head_size", [(False, 16), (True, 16), (False, 20)])
def test_catch_up_forward_matches_the_torch_route(target_dir, odd_head_dir, tmp_path, dtype, qkv_bias, head_size):
    model, native, plain = _drafters(target_dir if head_size == 16 else odd_head_dir, tmp_path, dtype, qkv_bias)
    assert native.head.native.head_dim == head_size
    assert native.head.native is not None and plain.head.native is None
    _compare_catch_up(model, native, plain, dtype)


def _compare_catch_up(model, native, plain, dtype, logits=False):
    """Catch-up forwards of n rows over a prefilled cache through both drafters: the outputs, the keys and values
    they write (and, `logits`, the draft logits of those outputs) agree."""
    for n in (1, 2, 3, 5, 9):  # the row blocks of the matmuls: 1, 2, 3, 4 + 1, 4 + 4 + 1
        caches = [_prefilled(d, model, 20) for d in (native, plain)]
        embeds, feats = _inputs(model, n, n)
        positions = torch.arange(20, 20 + n)[None]
        got, want = (d.head(embeds, feats, positions, c, causal_mask(n)) for d, c in zip((native, plain), caches))
        assert got.shape == want.shape == (1, n, model.config.hidden_size) and got.dtype == want.dtype == dtype
        _close(got, want, dtype)
        if logits:
            _close(native.draft_logits(got[0]), plain.draft_logits(want[0]), dtype)
        for k in ("k", "v"):  # the new keys and values land where the torch route writes them
            new = [getattr(c, k)[0, 0, :, 20:20 + n] for c in caches]
            _close(new[0], new[1], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_fast_bf16)])
@pytest.mark.parametrize("qkv_bias,norm_before_residual", [(False, False), (True, False), (False, True)])
def test_an_eagle3_midlayer_matches_its_torch_route(target3_dir, tmp_path, dtype, qkv_bias, norm_before_residual):
    """EAGLE-3's midlayer through the native call: the catch-up forward, its keys and values, and the level forwards
    over a draft tree, against the torch route over the same int8 copies; its draft logits through the native
    matmul against the torch route's."""
    model, native, plain = _eagle3_drafters(target3_dir, tmp_path, dtype, qkv_bias, norm_before_residual)
    assert native.head.native is not None and native.head.native.fc is None and native.lm_native is not None
    assert native.head.native.norm_before_residual == norm_before_residual
    _compare_catch_up(model, native, plain, dtype, logits=True)
    for got, want in zip(_levels(native, model, LEVEL_2), _levels(plain, model, LEVEL_2)):
        _close(got, want, dtype)


def test_eagle3_negative_control_the_residual_is_seen(target3_dir, tmp_path):
    """The comparison above sees which residual the layer adds: a native layer told the other one differs."""
    model, native, plain = _eagle3_drafters(target3_dir, tmp_path, torch.float32)
    embeds, feats = _inputs(model, 3, 3)
    positions = torch.arange(20, 23)[None]
    want = plain.head(embeds, feats, positions, _prefilled(plain, model, 20), causal_mask(3))
    native.head.native = dataclasses.replace(native.head.native, norm_before_residual=True)
    got = native.head(embeds, feats, positions, _prefilled(native, model, 20), causal_mask(3))
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)


# a static tree's levels: two nodes that see themselves only, then three under them (node 2 and 3 under 0, 4 under 1)
LEVEL_1 = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)  # [2, 2]
LEVEL_2 = torch.tensor([[1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [0, 1, 0, 0, 1]], dtype=torch.bool)  # [3, 5]


def _levels(drafter, model, level_2):
    """Both level forwards of one drafting step over a DraftTreeCache: (level 1's features, level 2's)."""
    tree = DraftTreeCache(drafter.head, _prefilled(drafter, model, 30))
    (e1, f1), (e2, f2) = _inputs(model, 2, 41), _inputs(model, 3, 42)
    first = tree.forward(e1[0], f1[0], torch.full((2,), 31), LEVEL_1)
    return first, tree.forward(e2[0], f2[0], torch.full((3,), 32), level_2)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_fast_bf16)])
def test_level_forwards_over_a_draft_tree_match_the_torch_route(target_dir, tmp_path, dtype):
    model, native, plain = _drafters(target_dir, tmp_path, dtype)
    for got, want in zip(_levels(native, model, LEVEL_2), _levels(plain, model, LEVEL_2)):
        _close(got, want, dtype)
    # negative control: each node seeing the other parent instead gives other features
    crossed = torch.tensor([[0, 1, 1, 0, 0], [0, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    assert not torch.allclose(_levels(native, model, crossed)[1].float(), _levels(native, model, LEVEL_2)[1].float(),
                              rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 16])
def test_matmul_matches_torchs_int8_kernel(rows):
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (200, 96), dtype=torch.int8, generator=gen)  # [out, in]
    scale, bias = torch.rand(200, generator=gen) * 0.01, torch.randn(200, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    want = torch.ops.aten._weight_int8pack_mm(x, q, scale) + bias
    got = native_layer.matmul(native_layer.Int8Matrix.of(q, scale, bias), x)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    with pytest.raises(ValueError, match=r"x must be \[rows, 96\]"):
        native_layer.matmul(native_layer.Int8Matrix.of(q, scale), torch.randn(rows, 64))


# The routes a CPU may run besides its own: AVX2 + FMA (what a CPU without AVX-512 runs) and the portable loops.
OTHER_ROUTES = {"avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


@pytest.fixture(scope="module", params=sorted(OTHER_ROUTES))
def portable(request):
    """The kernels built for another route than this CPU's best (skipped where the compiler refuses)."""
    try:
        lib, _, _ = native_build.build(native_layer.SOURCE, f"eagle_layer_{request.param}", OTHER_ROUTES[request.param])
    except native_build.BUILD_ERRORS as exc:
        pytest.skip(f"no {request.param} build here: {exc}")
    return native_layer.bind(lib)


def test_the_portable_build_computes_what_this_cpus_does(portable, target_dir, tmp_path):
    gen = torch.Generator().manual_seed(0)
    weight = native_layer.Int8Matrix.of(torch.randint(-127, 128, (70, 64), dtype=torch.int8, generator=gen),
                                        torch.rand(70, generator=gen))
    for rows in (1, 2, 3, 4, 7):
        x = torch.randn(rows, 64, generator=gen)
        _close(native_layer.matmul(weight, x, portable), native_layer.matmul(weight, x), torch.float32)
    model, drafter, _ = _drafters(target_dir, tmp_path, torch.float32)
    embeds, feats = _inputs(model, 3, 0)
    x = torch.cat([embeds[0], feats[0]], dim=-1)
    outs = []
    for kernels in (portable, None):
        cache = _prefilled(drafter, model, 20)
        cache.open(3)
        out = native_layer.eagle_layer(drafter.head.native, x, torch.arange(20, 23), cache.k[0, 0], cache.v[0, 0], 20,
                                       20, torch.ones(3, 3, dtype=torch.bool).tril(), kernels)
        outs.append((out, cache.k[0, 0, :, :23].clone()))
    _close(outs[0][0], outs[1][0], torch.float32)
    _close(outs[0][1], outs[1][1], torch.float32)


def test_heads_it_cannot_run_keep_the_torch_route(target_dir, tmp_path):
    model = TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    heads = write_eagle_head(tmp_path / "eagle", target_dir, seed=3)
    assert EagleDrafter(load_eagle_head(heads, model), model, tree=TREE, quantization="int8").head.native is not None
    for quantization in (None, "int4"):  # the kernel reads int8 weights only
        drafter = EagleDrafter(load_eagle_head(heads, model), model, tree=TREE, quantization=quantization)
        assert drafter.head.native is None and drafter.lm_native is None
    two = write_eagle_head(tmp_path / "two", target_dir, seed=3, num_layers=2)
    drafter = EagleDrafter(load_eagle_head(two, model), model, tree=TREE, quantization="int8")
    assert drafter.head.native is None  # one layer only
    odd_dir = make_checkpoint(tmp_path / "odd", "llama3", intermediate_size=120)  # not a multiple of 32
    odd = TargetModel.from_pretrained(odd_dir, dtype=torch.float32)
    drafter = EagleDrafter(load_eagle_head(write_eagle_head(tmp_path / "oddh", odd_dir), odd), odd, tree=TREE,
                           quantization="int8")
    assert drafter.head.native is None
    head = EagleDrafter(load_eagle_head(heads, model), model, tree=TREE, quantization="int8").head
    head.load_state_dict(head.state_dict())  # new weights: the copies describe the old ones
    assert head.native is None and head.fc_quantized is None


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_fast_bf16)])
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_greedy_output_through_the_native_layer_is_plain_decodings(target_dir, tmp_path, dtype, tree):
    heads = write_eagle_head(tmp_path / "eagle", target_dir, seed=3)
    prompt = [0, 5, 9, 33, 7, 5, 9, 33, 12, 40]
    plain = runtime.load(str(target_dir), draft="none", dtype=dtype).generate(prompt, max_tokens=40, ignore_eos=True)
    dec = runtime.load(str(target_dir), draft="eagle", draft_model=str(heads), dtype=dtype,
                       tree="[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]" if tree == "static" else None,
                       draft_quantization="int8")
    assert dec.drafter.head.native is not None and dec.drafter.lm_native is not None
    out = dec.generate(prompt, max_tokens=40, ignore_eos=True)
    assert out.token_ids == plain.token_ids and out.stats.drafted_tokens > 0
