"""`python -m perf gpu-check --dry-run`: every section on the CPU with tiny shapes; the shapes of what it measures
and the files it writes (the GPU run itself needs a lent GPU: see perf/README.md)."""

from __future__ import annotations

import json

import pytest

from perf.__main__ import main
from perf.gpu_check import SECTION_NAMES, SECTIONS, GpuCheckConfig, Shapes, merge_reports, run_gpu_check
from runtime.errors import ConfigError
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_check")
    ck = make_checkpoint(root / "llama", "llama3", num_hidden_layers=8)  # EAGLE-3 default feature layers: 2, 4, 5
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": text}) for i, text in enumerate(
        ["The quick brown fox jumps over the lazy dog. The quick brown fox", "one two three one two three one"])) + "\n")
    # absent: the eagle3 section makes a random head (the default, demo/smollm2/eagle3, would not fit this target)
    return {"root": root, "ck": ck, "prompts": prompts, "no_head": root / "no-eagle3-head"}


def test_dry_run_writes_every_section(tiny, capsys):
    out = tiny["root"] / "results" / "{date}-{machine}"
    assert main(["gpu-check", "--dry-run", "--out", str(out), "--smollm2", str(tiny["ck"]), "--e2e-draft", "lookup",
                 "--prompts", str(tiny["prompts"]), "--eagle3-head", str(tiny["no_head"])]) == 0
    written = list((tiny["root"] / "results").glob("*/gpu_check.json"))
    assert len(written) == 1 and (written[0].parent / "gpu_check.md").is_file()
    assert written[0].parent.name.endswith("-cpu-" + written[0].parent.name.split("-cpu-")[-1])  # {machine} filled
    report = json.loads(written[0].read_text())
    assert report["dry_run"] and report["ok"] and report["within_budget"]
    s, shapes = report["sections"], Shapes.tiny()
    kernel = s["kernel"]
    assert kernel["failed"] == 0 and len(kernel["rows"]) == len(shapes.kernel_dtypes) * len(shapes.kernel_cases) * 2
    assert {tuple(r["shape"]) for r in kernel["rows"]} == {c[:6] for c in shapes.kernel_cases}
    bw = s["bandwidth"]
    assert bw["copy_gbps"] > 0 and len(bw["rows"]) == len(shapes.bench_prefix) * len(shapes.bench_tree)
    assert all(r["floor_ms"] > 0 and r["kernel_ms"] > 0 for r in bw["rows"])
    verify = s["verify"]
    assert sorted({r["size"] for r in verify["rows"]}) == list(shapes.verify_sizes)
    assert {r["mask"] for r in verify["rows"]} == {"chain", "tree"}
    assert all(r["ratio"] == 1.0 for r in verify["rows"] if r["size"] == 1)
    assert verify["model"]["dtype"] == "bfloat16" and verify["model"]["parameters"] > 0
    e2e = s["e2e"]
    assert e2e["drafter"] == "lookup" and e2e["identical"] and len(e2e["rows"]) == 2
    assert all(r["tokens"] > 0 for r in e2e["rows"]) and e2e["warmup_seconds"] > 0
    e3 = s["eagle3"]
    assert e3["drafter"] == "eagle3" and e3["head"] == "random (seed 0)" and e3["head_training"] is None
    assert e3["head_asked"] == f"{tiny['no_head']} (absent)" and len(e3["head_sha256"]) == 64
    assert e3["feature_layers"] == [2, 4, 5] and e3["identical"] and e3["warmup_seconds"] > 0
    assert [r["tree"] for r in e3["rows"]] == ["static", "dynamic"]
    for r in e3["rows"]:
        assert r["identical"] and r["tokens"] > 0 and r["tau"] >= 1 and len(r["prompts"]) == 2
        assert all(p["first_difference"] is None for p in r["prompts"])
        assert 0 <= min(r["acceptance_by_depth"]) <= max(r["acceptance_by_depth"]) <= 1
    assert len(e3["rows"][0]["acceptance_by_depth"]) == 3  # the config's static tree: depth 3
    assert e3["sampled"]["error"] is None and e3["sampled"]["tokens"] > 0
    assert e3["sampled"]["verification"].startswith("rejection_sampling")
    md = (written[0].parent / "gpu_check.md").read_text()
    assert "DRY RUN" in md and "verify(N) / verify(1)" in md and "greedy identical: yes" in md
    assert "EAGLE-3: head random (seed 0)" in md and "not a trained head" in md
    assert "wrote" in capsys.readouterr().out


def test_eagle3_section_runs_a_given_head(tiny):
    """A head directory given is the one run and named; a greedy mismatch there fails the report."""
    import torch

    from perf.gpu_check import _random_eagle3_head, eagle3_end_to_end
    from runtime.model import TargetModel

    model = TargetModel.from_pretrained(tiny["ck"], dtype="float32", device=torch.device("cpu"))
    head = _random_eagle3_head(3, tiny["ck"], model, tiny["root"] / "head3")
    config = GpuCheckConfig(dry_run=True, smollm2=tiny["ck"], prompts=tiny["prompts"], eagle3_head=head,
                            sections=("eagle3",), shapes=Shapes.tiny())
    report = run_gpu_check(config)
    e3 = report["sections"]["eagle3"]
    assert e3["head"] == str(head) and "head_asked" not in e3 and report["ok"]
    assert e3["head_sha256"] == __import__("hashlib").sha256((head / e3["head_weights"]).read_bytes()).hexdigest()
    assert len(e3["rows"]) == 2 and all(r["identical"] for r in e3["rows"])
    broken = {**e3, "identical": False}
    assert not merge_reports([{**report, "sections": {"eagle3": broken}}])["ok"]
    failed = {**e3, "sampled": {**e3["sampled"], "error": "RuntimeError: x"}}
    assert not merge_reports([{**report, "sections": {"eagle3": failed}}])["ok"]
    with pytest.raises(ConfigError, match="eagle3_head"):
        GpuCheckConfig(eagle3_head=head / "config.json")  # a file, not a head directory
    assert eagle3_end_to_end is SECTIONS["eagle3"] and tuple(SECTIONS) == SECTION_NAMES


def test_full_shapes_are_the_issue_s(tmp_path):
    full = Shapes.full()
    assert full.verify_sizes == tuple(range(1, 65)) and full.verify_dtype == "bfloat16"
    assert full.verify_model["hidden_size"] == 4096 and full.verify_model["num_hidden_layers"] == 32
    assert full.verify_model["num_key_value_heads"] == 8  # GQA, as Llama-3-8B
    assert any(c[1] != c[2] for c in full.kernel_cases) and max(c[4] for c in full.kernel_cases) >= 4096
    with pytest.raises(ConfigError, match="e2e_draft"):
        GpuCheckConfig(e2e_draft="beam")


def test_needs_cuda_outside_dry_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        run_gpu_check(GpuCheckConfig(out=str(tmp_path)))


def test_sections_subset(tiny):
    out = tiny["root"] / "subset"
    assert main(["gpu-check", "--dry-run", "--sections", "kernel,verify", "--out", str(out)]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    assert set(report["sections"]) == {"kernel", "verify"} and report["ok"]
    assert "End to end" not in (out / "gpu_check.md").read_text()
    assert (out / "gpu_check.png").stat().st_size > 0  # the verify curve
    assert main(["gpu-check", "--dry-run", "--sections", "kernel,beam", "--out", str(out)]) == 2


def test_e2e_dtype_overrides_the_config_s(tiny):
    out = tiny["root"] / "e2e-fp32"
    assert main(["gpu-check", "--dry-run", "--sections", "e2e", "--e2e-dtype", "float32", "--out", str(out),
                 "--smollm2", str(tiny["ck"]), "--e2e-draft", "lookup", "--prompts", str(tiny["prompts"])]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["sections"]["e2e"]["dtype"] == "float32" and report["settings"]["e2e_dtype"] == "float32"
    assert all(r["first_difference"] is None for r in report["sections"]["e2e"]["rows"])
    assert not (out / "gpu_check.png").exists()  # nothing to plot without verify / bandwidth
    with pytest.raises(ConfigError, match="e2e_dtype"):
        GpuCheckConfig(e2e_dtype="int4")


def test_merge_joins_runs_of_disjoint_sections(tiny, capsys):
    a, b, merged = (tiny["root"] / name for name in ("part-a", "part-b", "merged"))
    assert main(["gpu-check", "--dry-run", "--sections", "kernel", "--out", str(a)]) == 0
    assert main(["gpu-check", "--dry-run", "--sections", "verify,bandwidth", "--out", str(b)]) == 0
    assert main(["gpu-check", "--merge", str(a), str(b), "--out", str(merged)]) == 0
    report = json.loads((merged / "gpu_check.json").read_text())
    parts = [json.loads((d / "gpu_check.json").read_text()) for d in (a, b)]
    assert list(report["sections"]) == ["kernel", "bandwidth", "verify"]  # the run's order, whatever the parts'
    assert report["sections"]["kernel"] == parts[0]["sections"]["kernel"] and report["ok"]
    assert report["seconds"] == parts[0]["seconds"] + parts[1]["seconds"]
    assert [p["sections"] for p in report["parts"]] == [["kernel"], ["bandwidth", "verify"]]
    assert "Merged from 2 runs" in (merged / "gpu_check.md").read_text() and (merged / "gpu_check.png").is_file()
    assert main(["gpu-check", "--merge", str(a), str(a), "--out", str(merged)]) == 2
    assert "section 'kernel' is in parts 0 and 1" in capsys.readouterr().err
    other = {**parts[1], "machine": {**parts[1]["machine"], "gpu": "another GPU"}}
    with pytest.raises(ConfigError, match="machine.gpu differs"):
        merge_reports([parts[0], other])
    failed = {**parts[0], "sections": {"kernel": {**parts[0]["sections"]["kernel"], "failed": 1}}}
    assert not merge_reports([failed, parts[1]])["ok"]  # a part's failure stays a failure
    with pytest.raises(ConfigError, match="format"):
        merge_reports([{**parts[0], "format_version": 0}])
