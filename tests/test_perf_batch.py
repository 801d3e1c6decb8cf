"""`python -m perf batch`: the real CLI on a tiny checkpoint (numbers not asserted: structure, files, greedy
identity), and its summary on hand-made samples (a batched output that differs is reported and fails the run)."""

from __future__ import annotations

import json

import pytest

from perf.__main__ import main
from perf.batch import BatchBenchConfig, Sample, level_requests, summarize
from perf.bench import BenchConfigError
from tests.cli import PNG
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("perf_batch")
    make_checkpoint(root / "target", "llama2")
    cfg = root / "bench.yaml"
    cfg.write_text("model: {checkpoint: target}\n"
                   "draft: {method: lookup}\n"
                   "build: {dtype: float32, max_draft_len: 12, output: engine, onnx: false, tensorrt: false}\n")
    return root, cfg


def test_batch_cli_writes_json_markdown_and_plot(tiny):
    root, cfg = tiny
    out = root / "results"
    code = main(["batch", "--config", str(cfg), "--concurrency", "1,3", "--prompts-per-set", "1", "--max-tokens", "6",
                 "--warmup", "0", "--threads", "1", "--prefill-chunk", "4", "--tree-budget", "6", "--out", str(out),
                 "--quiet"])
    assert code == 0
    report = json.loads((out / "batch.json").read_text())
    assert report["format"] == "spectree-batch" and report["greedy_identical"] is True
    assert report["drafter"]["drafter"] == "lookup" and report["settings"]["prefill_chunk"] == 4
    assert report["settings"]["tree_budget"] == 6
    assert [r["concurrency"] for r in report["levels"]] == [1, 3]
    for r in report["levels"]:
        assert r["tokens"] == 6 * r["concurrency"]
        assert r["sequential"]["tokens_per_s"] > 0 and r["batched"]["tokens_per_s"] > 0
        assert 1.0 <= r["batched"]["mean_batch"] <= r["concurrency"]
        assert 1.0 <= r["batched"]["mean_rows"]  # prompt chunks (<= 4 tokens each) and trees within the budget
        assert r["batched"]["ttft_ms"]["p50"] > 0 and r["batched"]["itl_ms"]["p50"] > 0
    md = (out / "batch.md").read_text()
    assert "| 3 |" in md and "batch_throughput.png" in md and "tree_budget=6" in md
    assert (out / "batch_throughput.png").read_bytes().startswith(PNG)
    # the plain decoder, and `report` regenerating the Markdown from the JSON
    code = main(["batch", "--config", str(cfg), "--drafter", "plain", "--concurrency", "2", "--prompts-per-set", "1",
                 "--max-tokens", "4", "--warmup", "0", "--threads", "1", "--out", str(root / "plain"), "--quiet"])
    assert code == 0
    assert json.loads((root / "plain" / "batch.json").read_text())["drafter"]["drafter"] == "none"
    (out / "batch.md").unlink()
    assert main(["report", str(out)]) == 0 and (out / "batch.md").read_text() == md


def test_summary_reports_a_differing_batched_output():
    seq = Sample(2, "sequential", 2.0, ((1, 2, 3), (4, 5, 6)))
    good = Sample(2, "batched", 1.0, ((1, 2, 3), (4, 5, 6)), (0.1, 0.2), (0.01, 0.02), 2.0)
    bad = Sample(2, "batched", 1.5, ((1, 2, 3), (4, 9, 6)), (0.1, 0.3), (0.01, 0.03), 1.5)
    (row,) = summarize([seq, good, bad], 3)
    assert row["sequential"]["tokens_per_s"] == 3.0 and row["batched"]["wall_s"] == 1.25
    assert row["speedup"] == pytest.approx(1.6) and row["batched"]["mean_batch"] == 1.75
    assert row["greedy_identical"] is False and row["differences"] == [{"request": 1, "index": 1}]
    (ok,) = summarize([seq, good], 3)
    assert ok["greedy_identical"] is True and ok["batched"]["ttft_ms"]["p50"] == pytest.approx(150.0)


def test_settings_errors_name_the_setting(tiny):
    _, cfg = tiny
    assert level_requests([[1], [2]], 5) == [[1], [2], [1], [2], [1]]
    with pytest.raises(BenchConfigError, match="exactly one of --config"):
        BatchBenchConfig()
    with pytest.raises(BenchConfigError, match=r"concurrency: got \[1, 1\]"):
        BatchBenchConfig(config=cfg, concurrency=(1, 1))
    with pytest.raises(BenchConfigError, match="max_tokens"):
        BatchBenchConfig(config=cfg, max_tokens=0)
    with pytest.raises(BenchConfigError, match="kind 'nope'"):
        BatchBenchConfig(config=cfg, drafter="nope")
    assert main(["batch", "--config", str(cfg), "--concurrency", "0"]) == 2
