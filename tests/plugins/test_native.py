"""The row-invariant CPU kernel (plugins/tree_attention/native.py, invariant.c): built and cached, close to the
reference, and row-invariant: a tree row's output is bit for bit that of decoding its root-to-node path alone, at
every head size, GQA group, tree shape and thread count (with a negative control showing SDPA is not)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from plugins import native_build
from plugins.tree_attention import native
from plugins.tree_attention.cpu import tree_attention_sdpa
from plugins.tree_attention.mask import ancestor_mask, pack_mask, random_parents
from plugins.tree_attention.reference import tree_attention_reference
from runtime.model import causal_mask


@pytest.fixture(scope="module")
def kernel():
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler on this machine: the runtime attends in float64 instead (tested in "
                    "tests/test_batch_invariance.py)")
    built = native.load()
    assert built is not None, native.unavailable()  # a compiler that cannot build the kernel is a failure
    return built


def _tree(n, generator):
    parents = random_parents(n, generator)
    return parents, ancestor_mask(list(parents))  # [N, N]


def _inputs(b, hq, hkv, n, prefix, d, dtype, generator, capacity_extra=0):
    """q as a transposed view (last dim contiguous), k / v as the first L + N slots of a larger cache."""
    q = torch.randn(b, n, hq, d, generator=generator).to(dtype).transpose(1, 2)  # [B, Hq, N, D], strided
    s = prefix + n
    k = torch.randn(b, hkv, s + capacity_extra, d, generator=generator).to(dtype)[:, :, :s]
    v = torch.randn(b, hkv, s + capacity_extra, d, generator=generator).to(dtype)[:, :, :s]
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 8, 2), (80, 4, 4), (16, 8, 1), (200, 2, 1)])
@pytest.mark.parametrize("n,prefix", [(1, 0), (1, 100), (7, 5), (40, 33)])
def test_matches_the_reference(kernel, dtype, d, hq, hkv, n, prefix):
    g = torch.Generator().manual_seed(n * 1000 + prefix + d)
    q, k, v = _inputs(2, hq, hkv, n, prefix, d, dtype, g, capacity_extra=5)
    masks = torch.stack([ancestor_mask(list(random_parents(n, g))) for _ in range(2)])  # [2, N, N]
    packed = pack_mask(masks)
    out = native.tree_attention_native(q, k, v, packed, 0.3)
    assert out.dtype == torch.float32 and out.shape == q.shape
    ref = tree_attention_reference(q.double(), k.double(), v.double(), packed, 0.3)
    if not kernel.rounds_weights(d, dtype):
        torch.testing.assert_close(out.double(), ref, atol=3e-6, rtol=3e-6)
        return
    # the bf16 route multiplies the values by softmax weights rounded to bf16: what it computes, in float64 (a weight
    # whose float32 exp lies within an ulp of a bf16 rounding boundary may round the other way: rare), ...
    off = (out.double() - _rounded_weights_reference(q, k, v, masks, 0.3)).abs() > 2e-5
    assert off.double().mean() < 1e-3, int(off.sum())
    # ... and how far that is from exact attention: each weight within 2^-9 of itself, so each output within 2^-8 of
    # the largest value
    assert (out.double() - ref).abs().max() <= 2**-8 * v.double().abs().max()


def _rounded_weights_reference(q, k, v, masks, scale):
    """Attention in float64 whose weights exp(score - max) are rounded to bf16 (to nearest even, via float32) before
    they multiply the values and are summed into the normaliser. masks [B, N, N] bool; returns [B, Hq, N, D]."""
    b, hq, n, d = q.shape
    hkv, prefix = k.shape[1], k.shape[2] - n
    group = hq // hkv
    keys = k.double().repeat_interleave(group, 1)  # [B, Hq, L + N, D]
    values = v.double().repeat_interleave(group, 1)
    scores = q.double() @ keys.transpose(-1, -2) * scale  # [B, Hq, N, L + N]
    seen = torch.cat([torch.ones(b, n, prefix, dtype=torch.bool), masks], -1)[:, None]  # [B, 1, N, L + N]
    scores = scores.masked_fill(~seen, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp().float().to(torch.bfloat16).double()
    return (weights @ values) / weights.sum(-1, keepdim=True)


def _path_alone(q, k, v, row, path, prefix, scale):
    """Row `row` decoded as plain decoding does: its path's K/V contiguous after the prefix, one query, no mask."""
    slots = list(range(prefix)) + [prefix + j for j in path]
    one = pack_mask(torch.ones(1, 1, 1, dtype=torch.bool))
    return native.tree_attention_native(q[:, :, row:row + 1].contiguous(), k[:, :, slots].contiguous(),
                                        v[:, :, slots].contiguous(), one.expand(q.shape[0], 1, 1), scale)[:, :, 0]


def _path_as_chunk(q, k, v, path, prefix, scale):
    """The path's last node as the last query of a causal chunk over the path (a prompt chunk, or a chain)."""
    slots = list(range(prefix)) + [prefix + j for j in path]
    chunk = causal_mask(len(path), q.shape[0])
    return native.tree_attention_native(q[:, :, path].contiguous(), k[:, :, slots].contiguous(),
                                        v[:, :, slots].contiguous(), chunk, scale)[:, :, -1]


def _mismatched_rows(attend, d, hq, hkv, n, prefix, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = _inputs(1, hq, hkv, n, prefix, d, dtype, g, capacity_extra=3)
    _, anc = _tree(n, g)
    out = attend(q, k, v, pack_mask(anc)[None], 0.125)
    bad = 0
    for row in range(n):
        path = [j for j in range(n) if anc[row, j]]
        alone = _path_alone(q, k, v, row, path, prefix, 0.125)
        bad += not torch.equal(out[:, :, row].float(), alone.float())
        if attend is native.tree_attention_native:
            assert torch.equal(alone, _path_as_chunk(q, k, v, path, prefix, 0.125))
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (64, 8, 8), (64, 14, 2), (128, 32, 8), (128, 7, 1), (80, 6, 2),
                                     (48, 4, 1)])
def test_every_tree_row_is_its_path_decoded_alone_bit_for_bit(kernel, dtype, d, hq, hkv):
    """Tiles of (row, head) pairs differ between a tree step (many rows) and plain decoding (one): each pair's
    arithmetic must not depend on that, nor on where its ancestors sit among masked slots."""
    for seed, (n, prefix) in enumerate([(2, 0), (16, 37), (33, 300), (9, 15), (40, 129)]):
        assert _mismatched_rows(native.tree_attention_native, d, hq, hkv, n, prefix, dtype, seed) == 0, (n, prefix)


def _rows_unlike_alone(d, hq, hkv, parents, prefix, dtype, seed):
    """Rows of the tree `parents` (-1: a root; several roots make a forest) whose output differs from its path decoded
    alone."""
    g = torch.Generator().manual_seed(seed)
    n = len(parents)
    q, k, v = _inputs(1, hq, hkv, n, prefix, d, dtype, g, capacity_extra=3)
    anc = ancestor_mask(list(parents))
    out = native.tree_attention_native(q, k, v, pack_mask(anc)[None], 0.125)
    return [row for row in range(n) if not torch.equal(
        out[:, :, row], _path_alone(q, k, v, row, [j for j in range(n) if anc[row, j]], prefix, 0.125))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 8, 2), (80, 6, 2), (64, 4, 4)])
def test_rows_that_share_a_run_of_keys_are_each_their_path_alone(kernel, dtype, d, hq, hkv):
    """Keys every row of a work item takes in slot order (the prefix, a causal chunk's rows, a tree's trunk) are loaded
    once for all of its rows, and each row masks those past its own end: a prompt chunk's every row, a chain, a tree
    with a trunk and a forest (no key shared past the prefix) must each give every row its path decoded alone."""
    chain = [-1] + list(range(39))  # a prompt chunk: row r sees slots [0, prefix + r]
    trunk = [-1, 0, 1, 2, 3, 4, 4, 4, 5, 6, 6, 8, 7, 9, 3, 14, 15, 2]  # a chain of 5, then branches (one from depth 2)
    forest = [-1, 0, -1, 2, 0, 1, 2, -1, 7, 4]
    for seed, (parents, prefix) in enumerate([(chain, 0), (chain, 45), (trunk, 0), (trunk, 33), (forest, 20)]):
        assert _rows_unlike_alone(d, hq, hkv, parents, prefix, dtype, seed) == [], (seed, prefix)


def test_negative_control_a_chunk_row_that_attends_past_its_end_is_caught(kernel):
    """The check above fails on a row given one key past its end (what an unmasked shared key would do)."""
    g = torch.Generator().manual_seed(11)
    n, prefix = 12, 30
    q, k, v = _inputs(1, 9, 3, n, prefix, 64, torch.bfloat16, g)
    anc = ancestor_mask([-1] + list(range(n - 1)))
    anc[4, 5] = True  # row 4 also sees slot 5
    out = native.tree_attention_native(q, k, v, pack_mask(anc)[None], 0.125)
    assert not torch.equal(out[:, :, 4], _path_alone(q, k, v, 4, list(range(5)), prefix, 0.125))
    assert torch.equal(out[:, :, 3], _path_alone(q, k, v, 3, list(range(4)), prefix, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_control_sdpa_rows_depend_on_the_tree(kernel, dtype):
    """The same check on torch's SDPA (same dtype) finds rows that differ: it can fail."""
    bad = sum(_mismatched_rows(tree_attention_sdpa, 64, 9, 3, 24, 200 + 13 * seed, dtype, seed) for seed in range(4))
    assert bad > 0


def test_results_do_not_depend_on_the_thread_count(kernel):
    g = torch.Generator().manual_seed(7)
    q, k, v = _inputs(2, 9, 3, 16, 90, 64, torch.bfloat16, g)
    mask = pack_mask(torch.stack([ancestor_mask(list(random_parents(16, g))) for _ in range(2)]))
    threads = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            runs.append(native.tree_attention_native(q, k, v, mask, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_a_row_that_sees_nothing_gives_zeros_as_the_reference_does(kernel):
    g = torch.Generator().manual_seed(2)
    q, k, v = _inputs(1, 4, 2, 3, 0, 64, torch.float32, g)
    mask = pack_mask(torch.tensor([[[True, False, False], [False, False, False], [True, False, True]]]))
    out = native.tree_attention_native(q, k, v, mask, 0.3)
    assert torch.equal(out[0, :, 1], torch.zeros(4, 64))
    torch.testing.assert_close(out, tree_attention_reference(q, k, v, mask, 0.3), atol=3e-6, rtol=3e-6)


def test_the_op_routes_bf16_on_cpu_to_the_kernel(kernel):
    g = torch.Generator().manual_seed(3)
    q, k, v = _inputs(1, 9, 3, 5, 20, 64, torch.bfloat16, g)
    mask = pack_mask(ancestor_mask([-1, 0, 0, 1, 3]))[None]
    with torch.inference_mode():
        out = torch.ops.spectree.tree_attention(q, k, v, mask, 0.125)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, native.tree_attention_native(q, k, v, mask, 0.125).to(torch.bfloat16))


def test_a_last_dimension_with_a_stride_is_made_contiguous(kernel):
    g = torch.Generator().manual_seed(4)
    q, k, v = _inputs(1, 4, 2, 3, 10, 64, torch.float32, g)
    mask = pack_mask(ancestor_mask([-1, 0, 1]))[None]
    wide = torch.randn(1, 2, 13, 128, generator=g)
    k_strided = wide[..., ::2]  # stride 2 on the last dimension
    out = native.tree_attention_native(q, k_strided, v, mask, 0.3)
    torch.testing.assert_close(out, native.tree_attention_native(q, k_strided.contiguous(), v, mask, 0.3), atol=0,
                               rtol=0)


def _fresh_library(monkeypatch):
    """The kernel not loaded yet in this process (restored after the test)."""
    monkeypatch.setattr(native, "_library", native_build.Lazy(native._build))


def test_built_once_into_the_cache_folder_then_reused(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path))
    _fresh_library(monkeypatch)
    first = native.load()
    assert first is not None and first.path.parent == tmp_path and first.path.name.startswith("tree_attention_")
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temporary file left behind
    _fresh_library(monkeypatch)

    def no_compile(*args):
        raise AssertionError("compiled again although the library was cached")

    monkeypatch.setattr(native_build, "_compile", no_compile)
    assert native.load().path == first.path


def test_without_a_compiler_it_says_why_and_the_op_falls_back_to_sdpa(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache"))
    _fresh_library(monkeypatch)
    assert native.load() is None
    assert "no C compiler" in native.unavailable() and "no-such-cc" in native.unavailable()
    with pytest.raises(RuntimeError, match="kernel is unavailable: no C compiler"):
        native.tree_attention_native(*_inputs(1, 2, 1, 1, 3, 16, torch.float32, torch.Generator()),
                                     pack_mask(torch.ones(1, 1, 1, dtype=torch.bool)), 1.0)
    g = torch.Generator().manual_seed(5)
    q, k, v = _inputs(1, 4, 2, 3, 10, 64, torch.bfloat16, g)
    mask = pack_mask(ancestor_mask([-1, 0, 1]))[None]
    assert torch.equal(torch.ops.spectree.tree_attention(q, k, v, mask, 0.3), tree_attention_sdpa(q, k, v, mask, 0.3))


def test_a_compiler_that_fails_is_reported_with_its_message(tmp_path, monkeypatch):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'boom: no such flag' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache"))
    _fresh_library(monkeypatch)
    assert native.load() is None
    assert "exited 3" in native.unavailable() and "boom: no such flag" in native.unavailable()
    assert not any((tmp_path / "cache").iterdir())  # no half-written library left


def test_an_unwritable_cache_folder_falls_back_to_a_private_temp_folder(kernel, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(native_build.CACHE_ENV, str(blocker / "cache"))
    monkeypatch.setattr(native_build.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    _fresh_library(monkeypatch)
    built = native.load()
    assert built is not None, native.unavailable()
    assert built.path.parent == tmp_path / "tmp" / f"spectree-{os.getuid()}"
    assert built.path.parent.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("b,n,prefix", [(1, 0, 0), (1, 0, 7), (0, 3, 5)])
def test_empty_inputs_give_empty_outputs(kernel, b, n, prefix):
    q = torch.randn(b, 4, n, 64)
    k = torch.randn(b, 2, prefix + n, 64)
    mask = torch.zeros(b, n, (n + 31) // 32, dtype=torch.int32)
    out = native.tree_attention_native(q, k, k, mask, 0.3)
    assert out.shape == (b, 4, n, 64)


def test_bad_inputs_are_refused_before_the_kernel_reads_them(kernel):
    from plugins.tree_attention.spec import TreeAttentionDtypeError, TreeAttentionShapeError

    q, k, v = _inputs(1, 4, 2, 5, 10, 64, torch.float32, torch.Generator().manual_seed(6))
    mask = pack_mask(ancestor_mask([-1, 0, 1, 1, 0]))[None]
    with pytest.raises(TreeAttentionShapeError, match="tree_mask has shape"):
        native.tree_attention_native(q, k, v, mask[:, :3], 0.3)  # fewer mask rows than queries
    with pytest.raises(TreeAttentionDtypeError, match="tree_mask must be int32"):
        native.tree_attention_native(q, k, v, mask.bool(), 0.3)
    with pytest.raises(TreeAttentionShapeError, match="positions"):
        native.tree_attention_native(q, k[:, :, :3], v[:, :, :3], mask, 0.3)  # fewer keys than tree tokens
