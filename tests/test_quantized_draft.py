"""Weight-only int8 / int4 draft weights (runtime.model.Int8Weight / Int4Weight): the kernels against a float matmul,
int4's range search against rounding over each group's whole range, the quantized switch of the fused projections
(undone by any change of the weights), and quantized EAGLE drafters: their drafts close to the float head's, greedy
output identical to plain decoding (only drafting reads quantized weights)."""

from __future__ import annotations

import pytest
import torch

import runtime
from runtime.draft_spec import QUANTIZATIONS
from runtime.drafters.eagle import EagleDrafter, load_eagle_head
from runtime.errors import ConfigError
from runtime.model import (INT4_GROUP, QUANT_MAX_ROWS, QUANTIZED_WEIGHTS, Int4Weight, Int8Weight, PackedWeight,
                           TargetModel, linear)
from tests.heads import write_eagle_config, write_eagle_head
from tests.tiny import make_checkpoint
from tests.cpu_marks import needs_fast_bf16, needs_native_bf16


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("int8") / "llama3", "llama3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul_matches_the_float_weights(dtype):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=gen) * 0.05).to(dtype)  # [out, in]
    x = torch.randn(2, 3, 64, generator=gen).to(dtype)  # [..., in]
    bias = torch.randn(96, generator=gen).to(dtype)
    q = Int8Weight.of(w)
    assert q.q.dtype == torch.int8 and q.scales.dtype == dtype and q.shape == w.shape
    # the quantised weight is within half a step of the original, row by row
    step = q.scales.float()[:, None]
    assert bool(((q.q.float() * step - w.float()).abs() <= step / 2 + 1e-6).all())
    got = linear(x, q, bias)  # [2, 3, 96]
    want = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    assert got.shape == (2, 3, 96) and got.dtype == dtype
    rel = (got.float() - want).norm() / want.norm()
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-2), rel
    assert Int8Weight.supported(torch.bfloat16, torch.device("cpu"))
    assert not Int8Weight.supported(torch.float16, torch.device("cpu"))
    assert Int8Weight.supported(torch.bfloat16, torch.device("cpu"), (8, 576))
    assert not Int8Weight.supported(torch.bfloat16, torch.device("cpu"), (8, 40))
    assert Int8Weight.supported(torch.float32, torch.device("cpu"), (8, 40))


def test_every_quantization_has_its_weight_class():
    assert tuple(QUANTIZED_WEIGHTS) == QUANTIZATIONS
    assert all(kind.name == name for name, kind in QUANTIZED_WEIGHTS.items())


def _full_range_int4(w: torch.Tensor) -> torch.Tensor:  # w [out, in] -> dequantised [out, in] float32
    """Round to nearest over each group's whole [min, max] (the scale and zero rounded to w's dtype, as the kernel
    reads them): what Int4Weight's range search must never do worse than."""
    g = w.float().reshape(w.shape[0], -1, INT4_GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((g - lo) / step).clamp(0, 15)
    deq = (q - 8) * step.to(w.dtype).float() + (lo + 8 * step).to(w.dtype).float()
    return deq.reshape(w.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matmul_matches_the_float_weights(dtype):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(100, 96, generator=gen) * 0.05).to(dtype)  # [out, in]: 100 rows, padded to 112 inside
    x = torch.randn(2, 3, 96, generator=gen).to(dtype)  # [..., in]
    bias = torch.randn(100, generator=gen).to(dtype)
    q = Int4Weight.of(w)
    assert q.shape == w.shape and q.scale_zeros.dtype == dtype and q.scale_zeros.shape == (96 // INT4_GROUP, 112, 2)
    # what the kernel multiplies by: its output for the identity, row by row
    eye = torch.eye(96, dtype=dtype)
    deq = torch.cat([q.matmul(eye[i:i + QUANT_MAX_ROWS]) for i in range(0, 96, QUANT_MAX_ROWS)]).float().T
    assert deq.shape == w.shape
    # the searched ranges win overall and, where the kernel's output is exact (float32), never lose a group
    err = (deq - w.float()).pow(2).reshape(100, -1, INT4_GROUP).sum(-1)  # [out, groups]
    full = (_full_range_int4(w) - w.float()).pow(2).reshape(100, -1, INT4_GROUP).sum(-1)
    assert float(err.sum()) < 0.97 * float(full.sum())
    if dtype == torch.float32:
        assert bool((err <= full * (1 + 1e-5) + 1e-12).all())
    got = linear(x, q, bias)  # [2, 3, 100]
    want = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    assert got.shape == (2, 3, 100) and got.dtype == dtype
    rel = (got.float() - want).norm() / want.norm()
    assert 1e-3 < rel < 0.1, rel  # int4 rounds much more coarsely than int8, but stays close
    cpu = torch.device("cpu")
    assert Int4Weight.supported(torch.bfloat16, cpu, (8192, 576)) and Int4Weight.supported(torch.float32, cpu, (7, 64))
    assert not Int4Weight.supported(torch.bfloat16, cpu, (64, 120)) and not Int4Weight.supported(torch.float16, cpu)


@pytest.mark.parametrize("kind", [Int8Weight, Int4Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_weights_run_only_few_rows_and_many_rows_read_the_source_weight(kind, dtype):
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(48, 32, generator=gen) * 0.05).to(dtype)  # [out, in]
    q = kind.of(w)
    for rows in (1, QUANT_MAX_ROWS, QUANT_MAX_ROWS + 1, 3 * QUANT_MAX_ROWS):
        x = torch.randn(rows, 32, generator=gen).to(dtype)  # [rows, in]
        exact = torch.nn.functional.linear(x, w)
        assert torch.equal(q.matmul(x), exact) == (rows > QUANT_MAX_ROWS), rows
        if rows <= QUANT_MAX_ROWS and kind is Int8Weight:
            assert torch.equal(q.matmul(x), torch.ops.aten._weight_int8pack_mm(x, q.q, q.scales))
        if rows <= QUANT_MAX_ROWS and kind is Int4Weight:
            kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, q.packed, INT4_GROUP, q.scale_zeros)
            assert torch.equal(q.matmul(x), kernel)


@pytest.mark.parametrize("kind,tolerance", [(Int8Weight, 2e-2), (Int4Weight, 0.15)])
def test_fused_projections_switch_to_quantized_copies_until_the_weights_change(target_dir, kind, tolerance):
    layer = TargetModel.from_pretrained(target_dir).model.layers[0]
    mlp, attn = layer.mlp, layer.self_attn
    x = torch.randn(3, mlp.down_proj.weight.shape[0], generator=torch.Generator().manual_seed(0))
    want = mlp(x)
    mlp.quantize(kind)
    assert all(isinstance(w, kind) for w in mlp.quantized)
    got = mlp(x)
    assert not torch.equal(got, want)  # it really runs the quantized copies
    assert (got - want).norm() / want.norm() < tolerance
    mlp.load_state_dict(mlp.state_dict())
    assert mlp.quantized is None and torch.equal(mlp(x), want)
    attn.quantize(kind)
    attn.to(torch.float64)
    assert attn.quantized is None


@pytest.mark.parametrize("quantization,tolerance", [("int8", 5e-2), ("int4", 0.2)])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_fast_bf16)])
def test_quantized_eagle_drafter(target_dir, tmp_path, dtype, quantization, tolerance):
    model = TargetModel.from_pretrained(target_dir, dtype=getattr(torch, dtype))
    heads = write_eagle_head(tmp_path / "eagle", target_dir, seed=2)
    tree = runtime.tree.Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    float_drafter = EagleDrafter(load_eagle_head(heads, model), model, tree=tree)
    quant_drafter = EagleDrafter(load_eagle_head(heads, model), model, tree=tree, quantization=quantization)
    kind = QUANTIZED_WEIGHTS[quantization]
    assert isinstance(quant_drafter.lm_quantized, kind) and isinstance(quant_drafter.head.fc_quantized, kind)
    prompt = [0, 5, 9, 33, 7, 5, 9, 33, 12, 40]
    logits, hidden = model.prefill(torch.tensor([prompt]), model.new_cache(len(prompt)))
    root = int(logits[0, -1].argmax())
    embeds, positions = model.embed(torch.tensor([prompt[1:] + [root]]))[0][None], torch.arange(len(prompt))[None]
    feats, feats_q = (d.head(embeds, hidden, positions, d.head.new_cache(32), runtime.model.causal_mask(len(prompt)))
                      for d in (float_drafter, quant_drafter))
    assert 0 < (feats_q.float() - feats.float()).norm() / feats.float().norm() < tolerance
    # greedy output through the quantized drafter is plain decoding's
    plain = runtime.load(str(target_dir), draft="none", dtype=dtype).generate(prompt, max_tokens=32, ignore_eos=True)
    dec = runtime.decode.SpecDecoder(model, None, quant_drafter, tree.num_nodes)
    out = dec.generate(prompt, runtime.sampling.SamplingParams(max_tokens=32, ignore_eos=True))
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted_tokens > 0


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_drafting_needs_a_cpu_kernel(target_dir, tmp_path, quantization):
    model = TargetModel.from_pretrained(target_dir, dtype=torch.float16)
    heads = write_eagle_head(tmp_path / "eagle", target_dir, seed=2)
    with pytest.raises(ConfigError, match=f"{quantization} draft weights run on CPU in bfloat16 / float32, not "
                                          "torch.float16"):
        EagleDrafter(load_eagle_head(heads, model), model, tree=runtime.tree.Tree.chain(2), quantization=quantization)
    with pytest.raises(ConfigError, match="quantization must be None or one of int8, int4, got 'int2'"):
        EagleDrafter(load_eagle_head(heads, model), model, tree=runtime.tree.Tree.chain(2), quantization="int2")


@needs_fast_bf16
def test_int8_refuses_widths_the_bf16_kernel_cannot_take(tmp_path):
    # torch's bf16 int8 kernel crashes the process on rows whose width is not a multiple of 16: refused up front,
    # naming the weight; float32 (any width) and the same head without quantization still draft.
    odd = make_checkpoint(tmp_path / "odd", "llama3", intermediate_size=120)
    heads = write_eagle_head(tmp_path / "eagle", odd, seed=2)
    tree = runtime.tree.Tree.chain(2)
    bf16 = TargetModel.from_pretrained(odd, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"torch.bfloat16 rows a multiple of 16 wide, but "
                                          r"layers.0.mlp.down_proj.weight reads 120; draft this head without"):
        EagleDrafter(load_eagle_head(heads, bf16), bf16, tree=tree, quantization="int8")
    EagleDrafter(load_eagle_head(heads, bf16), bf16, tree=tree)
    fp32 = TargetModel.from_pretrained(odd, dtype=torch.float32)
    EagleDrafter(load_eagle_head(heads, fp32), fp32, tree=tree, quantization="int8")
    # int4 groups 32 inputs: 120 is refused in every dtype
    with pytest.raises(ConfigError, match=r"quantization 'int4': torch's int4 kernel needs rows a multiple of 32 "
                                          r"wide, but layers.0.mlp.down_proj.weight reads 120"):
        EagleDrafter(load_eagle_head(heads, fp32), fp32, tree=tree, quantization="int4")
    # a build (which plans on meta tensors) refuses it too
    from builder.build import build_engine
    from builder.config import load_config

    cfg = write_eagle_config(tmp_path / "odd.yaml", odd, tmp_path / "eagle", build={"dtype": "bfloat16"},
                             draft={"tree": {"preset": "chain-3"}, "quantization": "int8"})
    with pytest.raises(ConfigError, match="but layers.0.mlp.down_proj.weight reads 120"):
        build_engine(load_config(cfg))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_drafting_from_every_front_end(target_dir, tmp_path, quantization):
    """runtime.load's draft_quantization, and the YAML's draft.quantization recorded in engine.json: the loaded
    EAGLE drafter runs quantized and says so in its spec; greedy output stays plain decoding's."""
    from builder.build import build_engine
    from builder.config import load_config

    heads = write_eagle_head(tmp_path / "eagle", target_dir, seed=2)
    prompt = [0, 5, 9, 33, 7, 5, 9, 33, 12, 40]
    plain = runtime.load(str(target_dir), draft="none").generate(prompt, max_tokens=24, ignore_eos=True)
    dec = runtime.load(str(target_dir), draft="eagle", draft_model=str(heads), tree="chain-3",
                       draft_quantization=quantization)
    kind = QUANTIZED_WEIGHTS[quantization]
    assert isinstance(dec.drafter.lm_quantized, kind) and dec.drafter.spec.quantization == quantization
    assert dec.generate(prompt, max_tokens=24, ignore_eos=True).token_ids == plain.token_ids
    def config(name, quant):
        return write_eagle_config(tmp_path / name, target_dir, heads,
                                  draft={"tree": {"preset": "chain-3"}, "quantization": quant})

    cfg = config("eagle.yaml", quantization)
    result = build_engine(load_config(cfg))
    assert result.manifest["draft"]["quantization"] == quantization
    engine = runtime.load(str(result.output))
    assert isinstance(engine.drafter.lm_quantized, kind)
    assert engine.generate(prompt, max_tokens=24, ignore_eos=True).token_ids == plain.token_ids
    bad = config("bad.yaml", "int2")
    with pytest.raises(ConfigError, match="draft.quantization: got 'int2', expected one of int8, int4"):
        load_config(bad)


@needs_native_bf16
def test_bf16_eagle_head_drafts_from_packed_copies(target_dir, tmp_path, torch_route):
    """Where the weight-streaming kernel cannot be built, a bf16 head without quantization on a CPU with native bf16
    multiplies by oneDNN-packed copies of its weights: the same values, so the same draft features and logits as the
    weights themselves; a head another drafter quantized is refused."""
    if not PackedWeight.supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN weight packing")
    model = TargetModel.from_pretrained(target_dir, dtype=torch.bfloat16)
    heads = write_eagle_head(tmp_path / "eagle", target_dir, seed=2)
    tree = runtime.tree.Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    packed = EagleDrafter(load_eagle_head(heads, model), model, tree=tree)
    assert packed.lm_packed is not None and packed.head.fc_packed is not None
    assert all(layer.mlp.packed is not None and layer.self_attn.packed is not None for layer in packed.head.layers)
    bare = EagleDrafter(load_eagle_head(heads, model), model, tree=tree)
    bare.lm_packed = None
    bare.head.fc_packed = None
    for layer in bare.head.layers:
        layer.mlp.packed = layer.self_attn.packed = None
    prompt = [0, 5, 9, 33, 7, 5, 9, 33, 12, 40]
    logits, hidden = model.prefill(torch.tensor([prompt]), model.new_cache(len(prompt)))
    root = int(logits[0, -1].argmax())
    feats = []
    for drafter in (packed, bare):
        f = drafter.head(model.embed(torch.tensor([prompt[1:] + [root]]))[0][None], hidden,
                         torch.arange(len(prompt))[None], drafter.head.new_cache(32),
                         runtime.model.causal_mask(len(prompt)))
        feats.append((f, drafter.draft_logits(f[0])))
    assert torch.equal(feats[0][0], feats[1][0]) and torch.equal(feats[0][1], feats[1][1])
    shared = load_eagle_head(heads, model)
    EagleDrafter(shared, model, tree=tree, quantization="int8")
    with pytest.raises(ConfigError, match="already drafts from int8 copies"):
        EagleDrafter(shared, model, tree=tree)
    with pytest.raises(ConfigError, match="already drafts from int8 copies for another drafter; load it again for a "
                                          "drafter with quantization 'int4'"):
        EagleDrafter(shared, model, tree=tree, quantization="int4")
    # greedy output through the packed drafter is plain decoding's
    plain = runtime.load(str(target_dir), draft="none", dtype="bfloat16").generate(prompt, max_tokens=32,
                                                                                   ignore_eos=True)
    out = runtime.decode.SpecDecoder(model, None, packed, tree.num_nodes).generate(
        prompt, runtime.sampling.SamplingParams(max_tokens=32, ignore_eos=True))
    assert out.token_ids == plain.token_ids and out.stats.drafted_tokens > 0
