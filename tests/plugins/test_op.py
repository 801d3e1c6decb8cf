"""torch.ops.spectree.tree_attention: registration, dispatch, fake implementation, torch.export."""

import pytest
import torch

import plugins.tree_attention.op  # noqa: F401  (registers the op)
from plugins.tree_attention import pack_mask, tree_attention_reference, unpack_mask
from plugins.tree_attention.spec import TreeAttentionDtypeError, TreeAttentionShapeError
from tests.plugins.trees import random_tree_masks


def inputs(batch=2, q_heads=4, kv_heads=2, n=5, prefix=9, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    _, tree = random_tree_masks(batch, n, g)
    q = torch.randn(batch, q_heads, n, d, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, prefix + n, d, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, prefix + n, d, generator=g).to(dtype)
    return q, k, v, pack_mask(tree)


class TreeBlock(torch.nn.Module):
    def forward(self, q, k, v, tree_mask):
        return torch.ops.spectree.tree_attention(q, k, v, tree_mask, 0.125) * 2.0


# Tolerances of the CPU path (fused SDPA in the input dtype; bf16: the row-invariant kernel in float32, rounded to
# bf16) against the fp32 reference rounded to that dtype.
CPU_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def test_cpu_dispatch_runs_sdpa_for_fp64():
    """fp64 is what bf16 models attend in on CPU (runtime.model.kv_dtype): the fused SDPA path, reference-exact
    to fp64 rounding."""
    q, k, v, mask = inputs(dtype=torch.float64)
    out = torch.ops.spectree.tree_attention(q, k, v, mask, 0.3)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, tree_attention_reference(q, k, v, mask, 0.3), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "shape",
    [dict(), dict(prefix=0), dict(n=1), dict(n=37, prefix=50), dict(q_heads=8, kv_heads=1), dict(q_heads=3, kv_heads=3)],
)
def test_cpu_dispatch_matches_the_reference(dtype, shape):
    q, k, v, mask = inputs(dtype=dtype, **shape)
    out = torch.ops.spectree.tree_attention(q, k, v, mask, 0.3)
    ref = tree_attention_reference(q, k, v, mask, 0.3)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=CPU_TOL[dtype], rtol=CPU_TOL[dtype])


def test_cpu_dispatch_respects_the_tree_mask():
    """Flipping one visible tree bit off changes exactly that row (the mask is really applied)."""
    q, k, v, mask = inputs(n=6, prefix=4)
    tree = unpack_mask(mask, 6)
    row = int(torch.nonzero(tree[0].sum(-1) > 1)[0])  # a row that sees another tree token besides itself
    col = int(torch.nonzero(tree[0, row])[0])
    cut = tree.clone()
    cut[0, row, col] = False
    a = torch.ops.spectree.tree_attention(q, k, v, mask, 0.3)
    b = torch.ops.spectree.tree_attention(q, k, v, pack_mask(cut), 0.3)
    changed = (a - b).abs().amax(dim=(1, 3))  # [B, N]
    assert changed[0, row] > 1e-3 and changed[0].clone().index_fill_(0, torch.tensor([row]), 0).max() == 0
    assert changed[1].max() == 0


def test_op_has_cuda_and_fake_kernels():
    name = "spectree::tree_attention"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")  # the Triton kernel
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")  # CPU: SDPA / reference
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")  # the fake implementation


def test_opcheck():
    """torch's own consistency checks: schema, fake vs real, no hidden mutation / aliasing."""
    torch.library.opcheck(torch.ops.spectree.tree_attention.default, (*inputs(), 0.3))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = inputs(dtype=torch.float16)
    with FakeTensorMode() as mode:
        q, k, v, mask = (mode.from_tensor(t) for t in real)
        out = torch.ops.spectree.tree_attention(q, k, v, mask, 0.3)
    assert out.shape == q.shape and out.dtype == torch.float16


def test_export_keeps_the_op_with_dynamic_shapes():
    args = inputs()
    n, s, b = torch.export.Dim("n", min=1, max=512), torch.export.Dim("s", min=1, max=65536), torch.export.Dim("b", max=64)
    program = torch.export.export(
        TreeBlock(), args, dynamic_shapes=({0: b, 2: n}, {0: b, 2: s}, {0: b, 2: s}, {0: b, 1: n})
    )
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert torch.ops.spectree.tree_attention.default in targets
    other = inputs(batch=3, n=7, prefix=20, seed=1)
    torch.testing.assert_close(program.module()(*other), TreeBlock()(*other))


def test_bad_input_errors_surface_through_the_op():
    q, k, v, mask = inputs()
    with pytest.raises(TreeAttentionShapeError, match="tree_mask has shape"):
        torch.ops.spectree.tree_attention(q, k, v, mask[:, :, :0], 1.0)
    with pytest.raises(TreeAttentionDtypeError, match="tree_mask must be int32"):
        torch.ops.spectree.tree_attention(q, k, v, mask.bool(), 1.0)


def test_cpu_single_token_fast_path_still_honours_a_cleared_self_bit():
    """N = 1 with its own bit set takes the unmasked path; with the bit cleared it must see only the prefix."""
    q, k, v, _ = inputs(n=1, prefix=6)
    on = pack_mask(torch.ones(2, 1, 1, dtype=torch.bool))
    off = pack_mask(torch.tensor([[[True]], [[False]]]))
    for mask in (on, off):
        out = torch.ops.spectree.tree_attention(q, k, v, mask, 0.3)
        torch.testing.assert_close(out, tree_attention_reference(q, k, v, mask, 0.3), atol=2e-6, rtol=2e-6)
    assert not torch.allclose(torch.ops.spectree.tree_attention(q, k, v, on, 0.3)[1],
                              torch.ops.spectree.tree_attention(q, k, v, off, 0.3)[1])


def test_cpu_mask_memo_follows_the_mask_object_and_its_writes():
    """The CPU path unpacks a packed mask once per forward (memo on the tensor and its version): reusing the
    object reuses the result, an in-place write or a different object recomputes it, and results stay exact."""
    from plugins.tree_attention import cpu
    from plugins.tree_attention.mask import ancestor_mask, pack_mask
    from plugins.tree_attention.reference import tree_attention_reference

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 8, generator=g)
    k = torch.randn(1, 2, 9, 8, generator=g)
    v = torch.randn(1, 2, 9, 8, generator=g)
    tree = pack_mask(ancestor_mask([-1, 0, 0, 1, 2]))[None]
    chain = pack_mask(torch.ones(5, 5, dtype=torch.bool).tril())[None]
    first = cpu.attn_mask(tree, 5, 9, torch.float32)
    assert cpu.attn_mask(tree, 5, 9, torch.float32) is first
    assert cpu.attn_mask(tree, 5, 9, torch.float64).dtype == torch.float64  # one entry per dtype
    for mask in (tree, chain):
        want = tree_attention_reference(q, k, v, mask, 0.3)
        torch.testing.assert_close(torch.ops.spectree.tree_attention(q, k, v, mask, 0.3), want)
    tree.copy_(chain)  # same object, new contents: the memo must not serve the old mask
    assert not torch.equal(cpu.attn_mask(tree, 5, 9, torch.float32), first)
    torch.testing.assert_close(torch.ops.spectree.tree_attention(q, k, v, tree, 0.3),
                               tree_attention_reference(q, k, v, chain, 0.3))
    one = pack_mask(torch.ones(1, 1, dtype=torch.bool))[None]
    assert cpu.attn_mask(one, 1, 9, torch.float32) is None  # plain decoding: unmasked SDPA


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpu_additive_mask_is_what_sdpa_makes_of_the_boolean_one(dtype):
    """The SDPA path hands SDPA an additive mask made once per forward; SDPA makes the same one from a boolean mask
    on every call, so the outputs are bit for bit those of the boolean mask (what float64 batch invariance relies
    on; bf16 runs the row-invariant kernel where it builds)."""
    import torch.nn.functional as F

    from plugins.tree_attention.cpu import tree_attention_sdpa
    from plugins.tree_attention.mask import ancestor_mask, pack_mask, unpack_mask

    g = torch.Generator().manual_seed(1)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 0, 9, 10, 4, 12]
    n, prefix = len(parents), 37
    q = torch.randn(1, 9, n, 64, generator=g).to(dtype)
    k = torch.randn(1, 3, prefix + n, 64, generator=g).to(dtype)
    v = torch.randn(1, 3, prefix + n, 64, generator=g).to(dtype)
    packed = pack_mask(ancestor_mask(parents))[None]
    visible = torch.cat([torch.ones(1, n, prefix, dtype=torch.bool), unpack_mask(packed, n)], dim=-1)[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.125, enable_gqa=True)
    assert torch.equal(tree_attention_sdpa(q, k, v, packed, 0.125), want)
