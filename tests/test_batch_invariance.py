"""Batch invariance of the target's forward: a tree step reproduces, bit for bit, the token-by-token pass that
plain decoding makes. Greedy speculative output is identical to plain greedy output only if this holds; in
bfloat16 on CPU it holds because attention runs through the row-invariant kernel (plugins/tree_attention/native.py),
or in float64 where that kernel cannot be built (runtime/model.py `kv_dtype`)."""

from __future__ import annotations

import pytest
import torch

import plugins.tree_attention.native
import runtime.model
from runtime.model import INVARIANT_ROWS, PADDED_ROWS, PackedWeight, RowPlan, linear, row_plan
from plugins.tree_attention.mask import ancestor_mask, pack_mask, random_parents
from runtime.model import TargetModel, causal_mask
from tests.test_model import tree_paths
from tests.tiny import make_checkpoint
from tests.cpu_marks import needs_fast_bf16, needs_native_bf16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    built = {}

    def get(variant, **overrides):
        key = (variant, repr(sorted(overrides.items())))
        if key not in built:
            built[key] = make_checkpoint(tmp_path_factory.mktemp(variant), variant, seed=3, **overrides)
        return built[key]

    return get


@torch.no_grad()
def _mismatches(model: TargetModel, prefix_len: int, num_nodes: int, seed: int) -> int:
    """Tree nodes whose logits differ (in any bit) from feeding their root-to-node path one token at a time."""
    g = torch.Generator().manual_seed(seed)
    v = model.config.vocab_size
    prefix = torch.randint(3, v, (1, prefix_len), generator=g)
    parents = random_parents(num_nodes, g)
    tokens = torch.randint(3, v, (1, num_nodes), generator=g)
    paths = tree_paths(parents)
    depth = torch.tensor([[len(p) - 1 for p in paths]])

    cache = model.new_cache(prefix_len + num_nodes)
    model.prefill(prefix, cache)
    tree_logits, _ = model(tokens, prefix_len + depth, cache, pack_mask(ancestor_mask(parents)[None]))

    bad = 0
    for node, path in enumerate(paths):
        seq = model.new_cache(prefix_len + num_nodes)
        model.prefill(prefix, seq)
        for t in tokens[0, path].tolist():
            logits, _ = model(torch.tensor([[t]]), torch.tensor([[seq.length]]), seq, causal_mask(1))
            seq.advance(1)
        bad += not torch.equal(logits[0, 0], tree_logits[0, node])
    return bad


CASES = [(40, 12), (97, 16), (130, 9), (30, 40), (60, 70)]  # (prefix, nodes); 40 and 70 nodes: more rows than
# one invariant matmul block (runtime.model.INVARIANT_ROWS)


@pytest.fixture
def without_native_kernel(monkeypatch):
    """The process as it is where the row-invariant kernel cannot be built."""
    monkeypatch.setattr(plugins.tree_attention.native, "load", lambda: None)
    monkeypatch.setattr(plugins.tree_attention.native, "unavailable", lambda: "no C compiler (test)")


@needs_fast_bf16
@pytest.mark.parametrize(
    "variant,overrides", [("llama3", {}), ("qwen2", {"num_key_value_heads": 4})], ids=["gqa", "mha"]
)
@pytest.mark.parametrize("cache", ["bfloat16", "float32"])
def test_bf16_tree_step_is_bit_identical_to_token_by_token(ckpts, variant, overrides, cache, monkeypatch):
    """Both caches a bf16 model keeps on CPU (`kv_dtype`): bf16 where the kernel multiplies bf16 natively (AVX512-BF16;
    elsewhere it widens), float32 elsewhere; each attended through the row-invariant kernel, on every machine."""
    monkeypatch.setattr(runtime.model, "kv_dtype", lambda dtype, device, head_dim: getattr(torch, cache))
    model = TargetModel.from_pretrained(ckpts(variant, **overrides), dtype="bfloat16")
    assert plugins.tree_attention.native.load() is not None, plugins.tree_attention.native.unavailable()
    assert model.kv_dtype == getattr(torch, cache)
    for seed, (prefix_len, num_nodes) in enumerate(CASES):
        assert _mismatches(model, prefix_len, num_nodes, seed) == 0


@needs_fast_bf16
def test_without_the_kernel_bf16_attends_in_float64_and_stays_bit_identical(ckpts, without_native_kernel):
    with pytest.warns(RuntimeWarning, match=r"row-invariant attention kernel is unavailable \(no C compiler \(test\)\)"):
        model = TargetModel.from_pretrained(ckpts("llama3"), dtype="bfloat16")
    assert model.kv_dtype == torch.float64
    for seed, (prefix_len, num_nodes) in enumerate(CASES[:3]):
        assert _mismatches(model, prefix_len, num_nodes, seed) == 0


@needs_fast_bf16
def test_negative_control_attention_in_half_precision_is_not_invariant(ckpts, monkeypatch, without_native_kernel):
    """Attending in the weights' bf16 through SDPA (fused kernels reduce in shape-dependent order) breaks bit
    identity: the test above can fail."""
    monkeypatch.setattr(runtime.model, "kv_dtype", lambda dtype, device, head_dim: dtype)
    with pytest.warns(RuntimeWarning, match="attention kernel is unavailable"):
        model = TargetModel.from_pretrained(ckpts("llama3"), dtype="bfloat16")
    assert model.kv_dtype == torch.bfloat16
    assert sum(_mismatches(model, 40 + 30 * s, 16, s) for s in range(4)) > 0


def test_kv_dtype_follows_the_kernel():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native = runtime.model.native_attention.load()
    for d in (64, 80, 128):
        # bf16 where the row-invariant kernel multiplies bf16 itself (AVX512-BF16), else float32 (it would widen)
        expect = torch.bfloat16 if native.rounds_weights(d, torch.bfloat16) else torch.float32
        assert runtime.model.kv_dtype(torch.bfloat16, cpu, d) == expect, d
    assert runtime.model.kv_dtype(torch.float16, cpu, 64) == torch.float16  # its CPU matmuls are not row-invariant
    assert runtime.model.kv_dtype(torch.float32, cpu, 64) == torch.float32
    # CUDA: 16-bit weights run batch-invariant by padding their matmuls and attend in float64
    assert runtime.model.batch_invariant(torch.bfloat16, cuda) and runtime.model.batch_invariant(torch.float16, cuda)
    assert runtime.model.pads_rows(cuda) and not runtime.model.pads_rows(cpu)
    assert runtime.model.kv_dtype(torch.bfloat16, cuda, 64) == torch.float64
    assert runtime.model.kv_dtype(torch.float16, cuda, 64) == torch.float64
    assert runtime.model.kv_dtype(torch.float32, cuda, 64) == torch.float32


def test_kv_dtype_without_the_kernel_is_float64_for_bf16_on_cpu(without_native_kernel):
    assert runtime.model.kv_dtype(torch.bfloat16, torch.device("cpu"), 64) == torch.float64
    assert runtime.model.kv_dtype(torch.float32, torch.device("cpu"), 64) == torch.float32


@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (576, 2048), (1536, 1536)],
                         ids=["in576", "in1536", "in2048", "square1536"])
def test_linear_blocks_give_every_row_its_one_row_result(shape, torch_route):
    """Inputs of 1536+ features are where one CPU's one-row (GEMV) kernel rounds differently from its GEMM (AMD
    EPYC, AVX512-BF16): there `linear` runs a lone row, also a lone last block, as a 2-row GEMM. 3 blocks + 1 row."""
    g = torch.Generator().manual_seed(0)
    out_f, in_f = shape
    w = (torch.randn(out_f, in_f, generator=g) * in_f**-0.5).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16()
    x = torch.randn(3 * INVARIANT_ROWS + 1, in_f, generator=g).bfloat16()
    alone = torch.cat([linear(row[None], w, b) for row in x])
    assert torch.equal(linear(x, w, b), alone)
    assert torch.equal(linear(x.view(1, -1, in_f), w, b)[0], alone)
    for n in range(2, INVARIANT_ROWS + 1):
        assert torch.equal(linear(x[:n], w, b), alone[:n]), n


@pytest.mark.parametrize("shape", [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)])
def test_this_machine_passes_the_row_invariance_check_at_smollm2_shapes(shape):
    plan = row_plan(shape, torch.bfloat16, torch.device("cpu"))
    assert plan.error is None
    # The plan says what the kernels do: a lone row's GEMV result differs from its 2-row GEMM one exactly when the
    # plan routes lone rows through the GEMM (checked on other random rows than the plan's own).
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(*shape, generator=g) * shape[1] ** -0.5).bfloat16()
    x = torch.randn(64, shape[1], generator=g).bfloat16()
    gemv = torch.cat([torch.nn.functional.linear(r[None], w) for r in x])
    gemm = torch.cat([torch.nn.functional.linear(r[None].repeat(2, 1), w)[:1] for r in x])
    if not plan.gemm_lone_row:
        assert torch.equal(gemv, gemm)


def _float32_matmul(x, w, b):
    """`runtime.model._matmul` rounded otherwise: in float32 (a PackedWeight by its plain weight), cast back."""
    plain = w.weight if isinstance(w, PackedWeight) else w
    return torch.nn.functional.linear(x.float(), plain.float(), None if b is None else b.float()).to(x.dtype)


def test_negative_control_row_plan_catches_a_row_count_dependent_kernel(monkeypatch):
    """A matmul whose rounding depends on how many rows it runs (here: a float32 pass above 4 rows) is caught."""
    real = runtime.model._matmul

    def fickle(x, w, b=None):
        return _float32_matmul(x, w, b) if x.shape[0] > 4 else real(x, w, b)

    monkeypatch.setattr(runtime.model, "_matmul", fickle)
    monkeypatch.setattr(runtime.model, "_ROW_PLANS", {})
    error = row_plan((576, 1536), torch.bfloat16, torch.device("cpu")).error
    assert error is not None and "x [1536, 576] bfloat16 matmul gives row(s)" in error


def test_negative_control_row_plan_routes_a_differing_lone_row_through_the_gemm(monkeypatch, torch_route):
    """A GEMV that rounds otherwise than the GEMM (here: float32 for one row) makes lone rows run as 2-row GEMMs, and
    `linear` then gives a lone row the GEMM's result."""
    real = runtime.model._matmul

    def odd_gemv(x, w, b=None):
        return _float32_matmul(x, w, b) if x.shape[0] == 1 else real(x, w, b)

    monkeypatch.setattr(runtime.model, "_matmul", odd_gemv)
    monkeypatch.setattr(runtime.model, "_ROW_PLANS", {})
    plan = row_plan((576, 1536), torch.bfloat16, torch.device("cpu"))
    assert plan.gemm_lone_row and plan.error is None
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(576, 1536, generator=g) * 1536**-0.5).bfloat16()
    x = torch.randn(8, 1536, generator=g).bfloat16()
    assert all(torch.equal(linear(x[i:i + 1], w), real(x[:8], w, None)[i:i + 1]) for i in range(8))


@needs_native_bf16
def test_a_machine_failing_the_check_runs_the_model_in_float32(ckpts, monkeypatch, torch_route):
    monkeypatch.setattr(runtime.model, "row_plan", lambda shape, dtype, device: RowPlan(False, "row 3 differs"))
    with pytest.warns(RuntimeWarning, match="not row-invariant .row 3 differs.*runs in float32"):
        model = TargetModel.from_pretrained(ckpts("llama3"), dtype="bfloat16")
    assert model.dtype == torch.float32 and model.config.dtype == "float32" and model.kv_dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_packed_weights_give_the_plain_weights_values(ckpts, torch_route):
    """A bf16 model on CPU multiplies by oneDNN-packed copies of its weights: the logits of the plain weights, bit for
    bit, at every row count (a lone row, a tree step, several blocks), and no copy is left once the weights move."""
    if not PackedWeight.supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN weight packing")
    model = TargetModel.from_pretrained(ckpts("llama3"), dtype="bfloat16")
    layers = model.model.layers
    assert model._packed_lm_head is not None and all(l.mlp.packed and l.self_attn.packed for l in layers)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, model.config.vocab_size, (1, 50), generator=g)
    tokens = torch.randint(3, model.config.vocab_size, (1, 40), generator=g)

    def logits(n):
        cache = model.new_cache(100)
        model.prefill(prefix, cache)
        return model(tokens[:, :n], 50 + torch.arange(n)[None], cache, causal_mask(n))[0]

    def drop_copies():
        model._packed_lm_head = None
        for layer in layers:
            layer.self_attn.packed = layer.mlp.packed = None

    packed = {n: logits(n) for n in (1, 7, 40)}
    drop_copies()
    for n, got in packed.items():
        assert torch.equal(got, logits(n)), n
    model.pack_weights()
    with torch.no_grad():  # an in-place edit of a weight: its packed copy is stale, the edit counts
        model.lm_head_weight[5] = 0.5
        layers[0].self_attn.q_proj.weight[0] = 0.25  # a view of the fused weight
    assert model._packed_lm_head.stale and layers[0].self_attn.packed[0].stale
    edited = logits(7)
    drop_copies()
    assert torch.equal(edited, logits(7)) and not torch.equal(edited, packed[7])
    model.pack_weights()
    assert torch.equal(logits(7), edited)
    model.float()
    assert model._packed_lm_head is None and not any(l.mlp.packed or l.self_attn.packed for l in layers)


def test_a_model_loaded_in_inference_mode_packs_and_runs(ckpts, torch_route):
    """Inference-mode tensors have no version counter: their packed copies are not tracked for in-place edits."""
    if not PackedWeight.supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN weight packing")
    with torch.inference_mode():
        model = TargetModel.from_pretrained(ckpts("llama3"), dtype="bfloat16")
        cache = model.new_cache(16)
        logits, _ = model.prefill(torch.tensor([[5, 6, 7]]), cache)
    assert model._packed_lm_head is not None and not model._packed_lm_head.stale
    reference = TargetModel.from_pretrained(ckpts("llama3"), dtype="bfloat16")
    assert torch.equal(logits, reference.prefill(torch.tensor([[5, 6, 7]]), reference.new_cache(16))[0])


@needs_fast_bf16
def test_16_bit_weights_without_invariance_warn_that_greedy_output_may_change(ckpts, monkeypatch, recwarn):
    with pytest.warns(RuntimeWarning, match="float16 weights on cpu do not run batch-invariant"):
        TargetModel.from_pretrained(ckpts("llama3"), dtype="float16")
    monkeypatch.setattr(runtime.model, "batch_invariant", lambda dtype, device: False)  # bf16 where none is built
    with pytest.warns(RuntimeWarning, match="bfloat16 weights on cpu do not run batch-invariant.*greedy speculative"):
        TargetModel.from_pretrained(ckpts("llama3"), dtype="bfloat16")
    recwarn.clear()
    TargetModel.from_pretrained(ckpts("llama3"), dtype="float32")
    assert not [w for w in recwarn if "batch-invariant" in str(w.message)]


# ---- the padded route (CUDA's), run on the CPU ------------------------------------------------------------------
# No GPU here: these run CUDA's route (runtime.model.pads_rows) on the CPU's kernels. oneDNN's GEMM at a fixed row
# count keeps rows apart as cuBLAS's does, so the route's logic (padding, blocks, float64 attention and norms, the
# load-time check) is tested end to end; what cuBLAS does is measured where it runs (`row_plan` when a model loads;
# `python -m perf gpu-check`, e2e).


@pytest.fixture
def padded_route(monkeypatch):
    monkeypatch.setattr(runtime.model, "_PADDED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(runtime.model, "_ROW_PLANS", {})


@needs_fast_bf16
def test_padded_route_bf16_tree_step_is_bit_identical_to_token_by_token(ckpts, padded_route, recwarn):
    model = TargetModel.from_pretrained(ckpts("llama3"), dtype="bfloat16")
    assert not [w for w in recwarn if "row-invariant" in str(w.message)]  # the load-time check passed
    assert model.dtype == torch.bfloat16 and model.kv_dtype == torch.float64
    for seed, (prefix_len, num_nodes) in enumerate(CASES):  # 70 nodes: two padded blocks
        assert _mismatches(model, prefix_len, num_nodes, seed) == 0


def test_padded_route_float16_runs_batch_invariant(ckpts, padded_route, recwarn):
    model = TargetModel.from_pretrained(ckpts("llama3"), dtype="float16")
    if model.dtype == torch.float32:  # this CPU's float16 GEMM mixes rows: the check sent the model to float32
        assert [w for w in recwarn if "float16 matmuls on this cpu are not row-invariant" in str(w.message)]
        return
    assert not [w for w in recwarn if "batch-invariant" in str(w.message)]
    assert model.kv_dtype == torch.float64
    for seed, (prefix_len, num_nodes) in enumerate(CASES[:2]):
        assert _mismatches(model, prefix_len, num_nodes, seed) == 0


@pytest.mark.parametrize("rows", [1, 2, PADDED_ROWS - 1, PADDED_ROWS, PADDED_ROWS + 1, 2 * PADDED_ROWS + 3])
def test_padded_linear_gives_every_row_its_matmul_value_and_shape(padded_route, monkeypatch, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 40, generator=g).double()
    b = torch.randn(48, generator=g).double()
    x = torch.randn(2, rows, 40, generator=g).double()  # float64: exact enough to compare with one GEMM
    calls = []
    real = runtime.model._matmul

    def counting(xx, ww, bb):
        calls.append(xx.shape[0])
        return real(xx, ww, bb)

    monkeypatch.setattr(runtime.model, "_matmul", counting)
    got = runtime.model._padded_linear(x, w, b)
    assert got.shape == (2, rows, 48)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-12, atol=1e-12)
    assert calls == [PADDED_ROWS] * -(-2 * rows // PADDED_ROWS)  # every matmul exactly PADDED_ROWS rows


def test_padded_route_rms_norm_sums_in_float64(padded_route):
    """The padded route's RMSNorm: HF's arithmetic but for the sum of squares (float64, then float32), so its
    output is HF's up to one rounding of the last bit."""
    g = torch.Generator().manual_seed(0)
    norm = runtime.model.RMSNorm(576, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    x = (3 * torch.randn(70, 576, generator=g)).bfloat16()
    got = norm(x)
    xf = x.float()
    expected = norm.weight * (xf * torch.rsqrt(xf.double().pow(2).mean(-1, keepdim=True).float() + 1e-5)).bfloat16()
    assert torch.equal(got, expected)
    alone = torch.cat([norm(row[None]) for row in x])
    assert torch.equal(got, alone)


def test_negative_control_padded_row_plan_catches_rows_that_mix(padded_route, monkeypatch):
    """A matmul whose rounding depends on the other rows of its block (here: a float32 pass when the block holds
    more than 4 nonzero rows) is caught by the check, and the model then runs in float32."""
    real = runtime.model._matmul

    def mixing(x, w, b=None):
        busy = int((x != 0).any(dim=-1).sum()) > 4
        return _float32_matmul(x, w, b) if busy else real(x, w, b)

    monkeypatch.setattr(runtime.model, "_matmul", mixing)
    error = row_plan((576, 1536), torch.bfloat16, torch.device("cpu")).error
    assert error is not None and "x [1536, 576] bfloat16 matmul gives row(s)" in error
