"""`python -m builder convert-head` (builder/convert_head.py) and the int8 head layout runtime.checkpoint reads back:
the weights within half a step of the stored ones, half the bytes of bfloat16, the same bytes from the same input,
the loaders' dtype (a CPU without native bf16 runs the head in float32), greedy output unchanged, and a broken file
refused naming the tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import runtime
from builder.__main__ import main as builder_main
from builder.config import BuildConfigError
from builder.convert_head import convert_head
from runtime.checkpoint import INT8_SCALE_SUFFIX, read_head_state
from runtime.draft_spec import drafter_kind
from runtime.drafters.medusa import load_medusa_heads
from runtime.engine import sha256_file
from runtime.errors import CheckpointError
from tests.heads import write_eagle_head, write_medusa_head
from tests.tiny import make_checkpoint, vocab_size

H, V = 32, 96
MEDUSA = "medusa_lm_head.safetensors"


def test_int8_medusa_head_reads_back_within_half_a_step(tmp_path):
    src = write_medusa_head(tmp_path / "bf16", H, V, num_heads=3, dtype=torch.bfloat16, seed=5)
    r = convert_head(src, tmp_path / "int8", "int8")
    assert (r.kind, r.converted) == ("medusa", 6)  # per head: the ResBlock's linear and the lm head
    stored = load_file(str(r.weights_file))
    assert stored["0.1.weight"].dtype == torch.int8 and stored["0.1.weight" + INT8_SCALE_SUFFIX].shape == (V,)
    assert stored["0.0.linear.bias"].dtype == torch.bfloat16  # 1-D tensors kept as they are
    assert r.weights_file.stat().st_size < 0.6 * (src / MEDUSA).stat().st_size
    assert (r.output / "config.json").read_bytes() == (src / "config.json").read_bytes()

    before, after = load_medusa_heads(src, dtype=torch.float32), load_medusa_heads(r.output, dtype=torch.float32)
    for name in ("lm_weight", "res_weight"):
        w, q = getattr(before, name), getattr(after, name)  # [heads, (layers,) out, in]
        step = w.abs().amax(dim=-1, keepdim=True) / 127
        assert ((q - w).abs() <= 0.5 * step * 1.02).all(), name
        assert not torch.equal(q, w)
    assert torch.equal(after.res_bias, before.res_bias)
    assert load_medusa_heads(r.output).lm_weight.dtype == torch.float32  # no dtype asked: read back in float32
    # a CPU without native bf16 runs the target, and so the head, in float32; one with it in bfloat16
    assert load_medusa_heads(r.output, dtype=torch.bfloat16).lm_weight.dtype == torch.bfloat16


def test_conversion_is_reproducible_and_reversible(tmp_path):
    src = write_medusa_head(tmp_path / "bf16", H, V, num_heads=2, dtype=torch.bfloat16, seed=1)
    a = convert_head(src, tmp_path / "a", "int8")
    b = convert_head(src, tmp_path / "b", "int8")
    assert sha256_file(a.weights_file) == sha256_file(b.weights_file)
    back = convert_head(a.output, tmp_path / "back", "bfloat16")
    assert load_file(str(back.weights_file))["0.1.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(load_medusa_heads(back.output, dtype=torch.float32).lm_weight,
                               load_medusa_heads(a.output, dtype=torch.float32).lm_weight, rtol=1e-2, atol=0)
    with pytest.raises(BuildConfigError, match="exists"):
        convert_head(src, a.output, "int8")
    convert_head(a.output, a.output, "int8", force=True)  # in place


def test_cli_and_eagle_heads(tmp_path):
    """An EAGLE head (a torch state dict, pytorch_model.bin) the same way, through the command line."""
    target = make_checkpoint(tmp_path / "target", "llama2", max_position_embeddings=128)
    src = write_eagle_head(tmp_path / "eagle", target)
    assert builder_main(["convert-head", "--head", str(src), "--storage", "int8", "--output",
                         str(tmp_path / "e8")]) == 0
    files = drafter_kind("eagle").weight_files
    (_, before), (file, after) = read_head_state(src, files, "EAGLE"), read_head_state(tmp_path / "e8", files, "EAGLE")
    assert file.name == "pytorch_model.bin" and before.keys() == after.keys()
    for name, w in before.items():
        if w.ndim == 2:
            assert ((after[name] - w.float()).abs() <= 0.51 * w.float().abs().amax(dim=1, keepdim=True) / 127).all()
        else:
            assert torch.equal(after[name], w), name
    assert builder_main(["convert-head", "--head", str(tmp_path / "nothing"), "--storage", "int8",
                         "--output", str(tmp_path / "x")]) == 2


def test_greedy_output_is_unchanged_with_an_int8_head(tmp_path):
    ckpt = make_checkpoint(tmp_path / "target", "llama2", max_position_embeddings=128)
    hidden = 64  # tests.tiny's llama2 hidden size
    head = convert_head(write_medusa_head(tmp_path / "m", hidden, vocab_size(), num_heads=3), tmp_path / "m8",
                        "int8").output
    plain = runtime.load(ckpt, draft="none", dtype="float32").generate("The quick brown fox", max_tokens=24,
                                                                       ignore_eos=True)
    spec = runtime.load(ckpt, draft_model=head, tree="[[0], [1], [0, 0], [0, 0, 0]]", dtype="float32")
    out = spec.generate("The quick brown fox", max_tokens=24, ignore_eos=True)
    assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("edit, message", [
    (lambda s: {k: v for k, v in s.items() if not k.endswith(INT8_SCALE_SUFFIX)}, "int8 without scales"),
    (lambda s: {**s, "0.1.weight" + INT8_SCALE_SUFFIX: torch.ones(3)}, r"0\.1\.weight\.int8_scale \(3,\) scales"),
    (lambda s: {**s, "9.9.weight" + INT8_SCALE_SUFFIX: torch.ones(3)}, "scales nothing under 9.9.weight"),
])
def test_broken_int8_files_are_refused_naming_the_tensor(tmp_path, edit, message):
    r = convert_head(write_medusa_head(tmp_path / "m", H, V, num_heads=2), tmp_path / "m8", "int8")
    save_file(edit(load_file(str(r.weights_file))), str(r.weights_file))
    with pytest.raises(CheckpointError, match=message):
        load_medusa_heads(r.output)
