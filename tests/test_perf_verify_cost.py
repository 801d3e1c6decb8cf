"""`python -m perf verify-cost`: the real CLI on a tiny checkpoint (numbers not asserted; structure and the N = 1
normalisation are), the forwards' inputs (chain and tree masks, positions), and the pure timing logic with a fake
clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from perf.__main__ import main
from perf.verify_cost import (
    Case,
    VerifyCostConfig,
    schedule,
    summarize,
    time_cases,
    verify_input,
)
from plugins.tree_attention.mask import ancestor_mask, unpack_mask
from runtime.errors import ConfigError
from tests.cli import PNG, exit_status
from tests.tiny import make_checkpoint


def run_main(args: list[str]) -> int:
    return exit_status(main, args)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("verify_cost") / "target", "llama2")


def test_verify_cost_cli_writes_json_markdown_and_plot(ckpt, tmp_path):
    out = tmp_path / "out"
    code = main(["verify-cost", "--checkpoint", str(ckpt), "--dtypes", "float32,float16", "--sizes", "1,4",
                 "--context", "24", "--repeats", "2", "--threads", "1", "--profile", "1,4", "--out", str(out),
                 "--quiet"])
    assert code == 0
    report = json.loads((out / "verify_cost.json").read_text())
    assert report["format"] == "spectree-verify-cost" and report["settings"]["threads"] == 1
    rows = {(r["dtype"], r["mask"], r["size"]): r for r in report["results"]}
    assert set(rows) == {(d, m, n) for d in ("float32", "float16") for m in ("chain", "tree") for n in (1, 4)}
    for (dtype, mask, n), r in rows.items():
        assert len(r["samples_ms"]) == 2 and r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"]
        assert r["ratio"] == pytest.approx(r["median_ms"] / rows[(dtype, mask, 1)]["median_ms"])
        if n == 1:
            assert r["ratio"] == 1.0
    assert report["trees"]["1"] == {"depth": 0, "parents": [-1]} and len(report["trees"]["4"]["parents"]) == 4
    md = (out / "verify_cost.md").read_text()
    assert "| dtype | mask | N=1 | N=4 |" in md and "| float16 | tree | " in md and "(1.00x)" in md
    assert "](verify_cost.png)" in md
    profiles = {(p["dtype"], p["size"]): p for p in report["profile"]}
    assert set(profiles) == {(d, n) for d in ("float32", "float16") for n in (1, 4)}
    for p in profiles.values():
        assert p["ms_per_forward"] > 0 and abs(sum(p["share"].values()) - 1.0) < 1e-9 and p["share"]["matmul"] > 0
        assert p["share"]["attention"] > 0  # bf16 attends through the row-invariant kernel, inside the op
    assert "| dtype | N | ms / forward | matmul | attention | native layer | other |" in md
    reads = report["bandwidth"]  # the one-token forward's weight reads against the machine's stream
    assert reads["stream_gbps"] > 0 and set(reads["by_dtype"]) == {"float32", "float16"}
    for b in reads["by_dtype"].values():
        assert b["weight_bytes"] > 0 and b["fraction_of_stream"] == pytest.approx(b["gbps"] / reads["stream_gbps"])
    assert "| dtype | weights read | one-token forward | GB/s | fraction of the machine's |" in md
    png = (out / "verify_cost.png").read_bytes()
    assert png.startswith(PNG) and len(png) > 5000
    # perf report regenerates the same Markdown from the JSON
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "verify_cost.json").write_bytes((out / "verify_cost.json").read_bytes())
    assert main(["report", str(copy)]) == 0
    assert (copy / "verify_cost.md").read_text() == md and (copy / "verify_cost.png").is_file()


def test_op_breakdown_classes():
    from perf.verify_cost import op_breakdown

    b = op_breakdown({"aten::mm": 600.0, "aten::_scaled_dot_product_flash_attention_for_cpu": 200.0,
                      "aten::copy_": 150.0, "aten::add": 50.0}, calls=2)
    assert b["ms_per_forward"] == pytest.approx(0.5)
    assert b["share"] == pytest.approx({"matmul": 0.6, "attention": 0.2, "native_layer": 0.0, "other": 0.2})
    assert [o["op"] for o in b["top_other"]] == ["aten::copy_", "aten::add"]
    kernel = op_breakdown({"mkldnn::_linear_pointwise": 700.0, "spectree::tree_attention": 300.0}, calls=1)
    assert kernel["share"] == pytest.approx({"matmul": 0.7, "attention": 0.3, "native_layer": 0.0, "other": 0.0})
    native = op_breakdown({"spectree::stream_linear": 100.0, "spectree::decoder_layer": 300.0}, calls=1)
    assert native["share"] == pytest.approx({"matmul": 0.25, "attention": 0.0, "native_layer": 0.75, "other": 0.0})
    with pytest.raises(ConfigError, match=r"profile: got \[16\], expected sizes among --sizes"):
        VerifyCostConfig(checkpoint=Path("x"), sizes=(1, 4), profile=(16,))


def test_verify_cost_from_a_builder_config(ckpt, tmp_path):
    cfg = tmp_path / "build.yaml"
    cfg.write_text(f"model: {{checkpoint: {ckpt}}}\n"
                   "build: {dtype: float32, output: engine, onnx: false, tensorrt: false}\n")
    code = main(["verify-cost", "--config", str(cfg), "--dtypes", "float32", "--sizes", "1,2", "--context", "8",
                 "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 0
    report = json.loads((tmp_path / "out" / "verify_cost.json").read_text())
    assert report["target"]["path"].endswith("target") and len(report["results"]) == 4


@pytest.mark.parametrize("args,message", [
    (["--sizes", "2,4"], "sizes: got [2, 4], expected a list including 1"),
    (["--sizes", "1,x"], "--sizes: got '1,x'"),
    (["--dtypes", "float64"], "dtypes: got ['float64']"),
    (["--context", "0"], "context: got 0, expected an integer >= 1"),
    (["--context", "500", "--sizes", "1,64"], "context 500 + the largest size 64 = 564 exceeds the model's context"),
    (["--device", "tpu"], "device: got 'tpu'"),
    (["--target-quantization", "q3"], "target_quantizations: got ['q3'], expected distinct names among"),
])
def test_verify_cost_bad_input_exits_2_naming_the_setting(ckpt, tmp_path, capsys, args, message):
    code = run_main(["verify-cost", "--checkpoint", str(ckpt), "--repeats", "1", "--warmup", "0",
                     "--out", str(tmp_path), "--quiet", *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_config_needs_exactly_one_source():
    with pytest.raises(ConfigError, match="exactly one of --config"):
        VerifyCostConfig()


# ---- the forwards' inputs ------------------------------------------------------------------------------------


def test_chain_and_tree_inputs():
    gen = torch.Generator().manual_seed(0)
    chain = verify_input("chain", 5, 100, 50, gen)
    assert chain.positions.tolist() == [[100, 101, 102, 103, 104]] and chain.depth == 4
    assert torch.equal(unpack_mask(chain.mask, 5)[0], torch.ones(5, 5, dtype=torch.bool).tril())
    tree = verify_input("tree", 40, 100, 50, gen)  # 40 nodes: two packed words per row
    ancestors = ancestor_mask(list(tree.parents))
    assert tuple(tree.mask.shape) == (1, 40, 2) and torch.equal(unpack_mask(tree.mask, 40)[0], ancestors)
    assert tree.positions[0].tolist() == [100 + int(row.sum()) - 1 for row in ancestors]
    assert tree.tokens.shape == (1, 40) and 0 <= int(tree.tokens.min()) and int(tree.tokens.max()) < 50


# ---- timing logic with a fake clock --------------------------------------------------------------------------


def test_schedule_times_every_case_once_per_pass_in_shuffled_orders():
    cases = [Case(d, m, n) for d in ("float32", "bfloat16") for m in ("chain", "tree") for n in (1, 2, 4)]
    passes = schedule(cases, 5, seed=3)
    assert len(passes) == 5 and all(sorted(p, key=repr) == sorted(cases, key=repr) for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # the order changes from pass to pass
    assert passes == schedule(cases, 5, seed=3)  # and is reproducible


def test_time_cases_and_summary_with_a_fake_clock():
    cost = {1: 2.0, 2: 3.0, 4: 5.0}  # seconds a forward of N tokens takes on the fake clock (bfloat16: twice)
    now = [0.0]

    def call(case):
        now[0] += cost[case.size] * (2 if case.dtype == "bfloat16" else 1)

    cases = [Case(d, m, n) for d in ("float32", "bfloat16") for m in ("chain", "tree") for n in (1, 2, 4)]
    seen = []
    samples = time_cases(call, schedule(cases, 3, seed=0), lambda: now[0], progress=seen.append)
    assert len(seen) == 3 * len(cases) and all(len(s) == 3 for s in samples.values())
    rows = summarize(samples)
    assert [(r["dtype"], r["mask"], r["size"]) for r in rows] == [(c.dtype, c.mask, c.size) for c in cases]
    by = {(r["dtype"], r["mask"], r["size"]): r for r in rows}
    assert by[("float32", "chain", 1)]["median_ms"] == pytest.approx(2000.0)
    assert by[("bfloat16", "tree", 4)]["median_ms"] == pytest.approx(10000.0)
    assert by[("bfloat16", "tree", 4)]["ratio"] == pytest.approx(2.5)
    assert all(by[(d, m, 1)]["ratio"] == 1.0 for d in ("float32", "bfloat16") for m in ("chain", "tree"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_device_without_cuda_names_the_setting(ckpt, tmp_path, capsys):
    code = main(["verify-cost", "--checkpoint", str(ckpt), "--device", "cuda", "--out", str(tmp_path), "--quiet"])
    assert code == 2
    assert "device: got 'cuda', but torch sees no CUDA device here" in capsys.readouterr().err


def test_auto_is_measured_as_the_dtype_it_chose(ckpt, tmp_path):
    """`auto` is reported as the dtype it chose, once where it chose one already asked for."""
    from plugins.stream_linear import native as stream_linear

    out = tmp_path / "out"
    code = main(["verify-cost", "--checkpoint", str(ckpt), "--dtypes", "float32,auto", "--sizes",
                 "1,2", "--context", "8", "--repeats", "1", "--warmup", "0", "--threads", "1", "--out", str(out),
                 "--quiet"])
    assert code == 0
    report = json.loads((out / "verify_cost.json").read_text())
    auto = "bfloat16" if stream_linear.bf16_missing() is None else "float32"
    ran = [r["dtype"] for r in report["results"] if r["mask"] == "chain" and r["size"] == 1]
    assert sorted(ran) == sorted({"float32", auto})


def test_a_quantised_target_is_measured_beside_the_dense_one(ckpt, tmp_path):
    """--target-quantization q4: the target's weights block-quantised, a row of its own, its weight reads counted as
    the packed blocks (fewer bytes than the dense weights)."""
    out = tmp_path / "out"
    code = main(["verify-cost", "--checkpoint", str(ckpt), "--dtypes", "bfloat16", "--target-quantization", "q4",
                 "--sizes", "1,2", "--context", "8", "--repeats", "1", "--warmup", "0", "--threads", "1",
                 "--out", str(out), "--quiet"])
    assert code == 0
    report = json.loads((out / "verify_cost.json").read_text())
    assert {r["dtype"] for r in report["results"]} == {"bfloat16", "bfloat16 q4"}
    reads = report["bandwidth"]["by_dtype"]
    assert 0 < reads["bfloat16 q4"]["weight_bytes"] < reads["bfloat16"]["weight_bytes"]
    assert "| bfloat16 q4 | chain | " in (out / "verify_cost.md").read_text()
