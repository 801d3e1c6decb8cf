"""`python -m perf results`: one record per machine kind (perf/results/index.json, perf/results/<kind>/) and the README
table generated from them; the committed README's table is the committed records' (a stale one fails here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from perf import records
from perf.__main__ import main
from runtime.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "perf" / "results"


def test_committed_readme_table_is_the_committed_records(capsys):
    assert records.readme_table(ROOT / "README.md") == records.table(RESULTS, ROOT)
    assert main(["results", "--check"]) == 0
    assert "is current" in capsys.readouterr().out


def test_committed_index_has_one_record_per_recorded_kind():
    index = records.load_index(RESULTS)
    kinds = {k.kind: k for k in index.kinds}
    assert {"cpu-intel-xeon-amx", "cpu-amd-epyc-avx512", "cpu-avx2", "gpu-nvidia-h200"} <= set(kinds)
    for k in index.kinds:
        if k.source is not None:
            assert records.record_rows(RESULTS / k.kind), k.kind
    # the record directories are the index's kinds and nothing else is tracked beside them
    dirs = {p.name for p in RESULTS.iterdir()
            if p.is_dir() and not p.name[:1].isdigit() and not p.name.startswith(records.SERVING_PREFIX)}
    assert dirs == {k.kind for k in index.kinds if k.source is not None}


@pytest.fixture
def results(tmp_path):
    """An empty index with one kind, plus two runs copied from the committed records: a bench and a gpu-check one
    (with its float32 sub-run)."""
    res = tmp_path / "results"
    res.mkdir()
    records.write_index(records.Index((records.Kind("cpu-test-a", "CPU: test A"),)), res)
    bench_run = tmp_path / "runs" / "bench"
    bench_run.mkdir(parents=True)
    shutil.copyfile(RESULTS / "cpu-amd-epyc-avx512" / "bench.json", bench_run / "bench.json")
    gpu_run = tmp_path / "runs" / "gpu"
    shutil.copytree(RESULTS / "gpu-nvidia-h200", gpu_run)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nintro\n\n{records.START}\nold\n{records.END}\n\nafter\n")
    return {"res": res, "bench": bench_run, "gpu": gpu_run, "readme": readme}


def test_record_table_and_readme(results):
    res, readme = results["res"], results["readme"]
    assert records.table(res, readme.parent).count("not recorded yet") == 1
    records.record(results["bench"], "cpu-test-a", results=res)
    assert (res / "cpu-test-a" / "bench.md").is_file()
    assert (res / "cpu-test-a" / "bench.json").read_bytes() == (results["bench"] / "bench.json").read_bytes()
    with pytest.raises(ConfigError, match="new machine kind: give it a --label"):
        records.record(results["gpu"], "gpu-test", results=res)
    records.record(results["gpu"], "gpu-test", "GPU: test", res)
    assert (res / "gpu-test" / "float32" / "gpu_check.json").is_file()
    index = records.load_index(res)
    assert [k.kind for k in index.kinds] == ["cpu-test-a", "gpu-test"]
    assert index.get("cpu-test-a").source.endswith("bench")

    text = records.table(res, readme.parent)
    bench = json.loads((results["bench"] / "bench.json").read_text())
    spec = next(v for v in bench["variants"] if v.get("configured"))
    plain = next(v for v in bench["variants"] if v["name"] == "plain")
    lo, hi = spec["speedup_vs_plain_ci95"]
    row = next(line for line in text.splitlines() if "CPU: test A" in line)
    assert f"| {plain['tokens_per_s']:.1f} | {spec['tokens_per_s']:.1f} | {spec['tau']:.2f} |" in row
    assert f"**{spec['speedup_vs_plain']:.2f}x** ({lo:.2f}-{hi:.2f})" in row and "](results/cpu-test-a/)" in row
    gpu_rows = [line for line in text.splitlines() if "GPU: test" in line]
    assert len(gpu_rows) == 2 and "| bfloat16 |" in gpu_rows[0] and "| float32 |" in gpu_rows[1]
    e2e = json.loads((results["gpu"] / "gpu_check.json").read_text())["sections"]["e2e"]
    assert f"**{e2e['speedup']:.2f}x**" in gpu_rows[0]  # the same total as gpu-check's own

    assert not records.check_readme(readme, res)
    assert records.update_readme(readme, res) and records.check_readme(readme, res)
    assert not records.update_readme(readme, res)  # already current
    body = readme.read_text()
    assert body.startswith("# x\n\nintro\n\n") and body.endswith("\n\nafter\n") and "old" not in body
    # a changed record makes the README stale (the committed-README test can fail)
    data = json.loads((res / "cpu-test-a" / "bench.json").read_text())
    next(v for v in data["variants"] if v.get("configured"))["tokens_per_s"] += 1.0
    (res / "cpu-test-a" / "bench.json").write_text(json.dumps(data))
    assert not records.check_readme(readme, res)


def test_refusals(results, tmp_path):
    res = results["res"]
    with pytest.raises(ConfigError, match="expected cpu-... or gpu-..."):
        records.record(results["bench"], "Intel Xeon", "x", res)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="neither bench.json nor gpu_check.json"):
        records.record(empty, "cpu-test-a", results=res)
    assert not (res / "cpu-test-a").exists()  # nothing half-written
    no_configured = tmp_path / "no-configured"
    no_configured.mkdir()
    data = json.loads((results["bench"] / "bench.json").read_text())
    for v in data["variants"]:
        v["configured"] = False
    (no_configured / "bench.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="configured drafter"):
        records.record(no_configured, "cpu-test-a", results=res)
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(ConfigError, match="expected the markers"):
        records.update_readme(tmp_path / "plain.md", res)
    (res / "cpu-test-a").mkdir()  # a directory the index does not say is recorded
    with pytest.raises(ConfigError, match="has a directory but no source"):
        records.load_index(res)


def test_cli(results, capsys):
    res, readme = results["res"], results["readme"]
    args = ["--results", str(res), "--readme", str(readme)]
    assert main(["results", "--record", str(results["bench"]), "--kind", "cpu-test-a", *args]) == 0
    assert "is now the record of cpu-test-a" in capsys.readouterr().out
    assert records.check_readme(readme, res)  # --record updated the table
    assert main(["results", "--check", *args]) == 0
    readme.write_text(readme.read_text().replace("CPU: test A", "CPU: edited"))
    assert main(["results", "--check", *args]) == 1
    assert "not the records'" in capsys.readouterr().err
    assert main(["results", "--update", *args]) == 0 and records.check_readme(readme, res)
    assert main(["results", "--table", *args]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("| [CPU: test A](results/cpu-test-a/)")
    assert main(["results", *args]) == 0
    assert "cpu-test-a" in capsys.readouterr().out
    assert main(["results", "--record", str(results["bench"]), *args]) == 2
    assert "--record needs --kind" in capsys.readouterr().err
    assert main(["results", "--record", str(results["bench"]), "--kind", "bad kind", *args]) == 2
