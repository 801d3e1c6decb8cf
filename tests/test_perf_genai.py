"""`python -m perf serve --tool genai-perf` without a server: settings, the genai-perf command lines, Prometheus
counter deltas into speculation statistics, and genai-perf's export format. (A real run against tritonserver
and the OpenAI API: tests/test_openai_api.py::test_genai_perf_against_both_endpoints, marked slow.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from perf.genai import (
    WRAPPER_MARK,
    GenaiPerfConfig,
    GenaiPerfFailed,
    command,
    entry_point_wrapper,
    counter_sums,
    endpoints,
    level_report,
    markdown,
    spec_stats,
)
from runtime.errors import ConfigError
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("genai") / "tiny", "llama2")


def test_config_is_validated(tokenizer_dir):
    with pytest.raises(ConfigError, match="url: got 'nohost', expected HOST:PORT"):
        GenaiPerfConfig(url="nohost", model="ensemble", tokenizer=tokenizer_dir)
    with pytest.raises(ConfigError, match="openai_model: needed with openai_url"):
        GenaiPerfConfig(url="127.0.0.1:1", model="ensemble", tokenizer=tokenizer_dir, openai_url="127.0.0.1:2")
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        GenaiPerfConfig(url="127.0.0.1:1", model="ensemble", tokenizer=Path("/nonexistent"))
    with pytest.raises(ConfigError, match="openai_endpoint_type"):
        GenaiPerfConfig(url="127.0.0.1:1", model="e", tokenizer=tokenizer_dir, openai_endpoint_type="embeddings")
    cfg = GenaiPerfConfig(url="127.0.0.1:1", model="e", tokenizer=tokenizer_dir, openai_url="http://h:2/",
                          openai_model="m")
    assert cfg.openai_url == "h:2"


def test_command_lines(tokenizer_dir, tmp_path):
    cfg = GenaiPerfConfig(url="127.0.0.1:8001", model="ensemble", tokenizer=tokenizer_dir, openai_url="h:9",
                          openai_model="demo", max_tokens=32, requests=4)
    triton, openai = endpoints(cfg)
    cmd = command(Path("/bin/genai-perf"), cfg, triton, 8, tmp_path / "p.jsonl", tmp_path / "a")
    joined = " ".join(cmd)
    assert cmd[:2] == ["/bin/genai-perf", "profile"]
    assert "--backend tensorrtllm --endpoint-type kserve -u 127.0.0.1:8001" in joined
    assert "--extra-inputs min_tokens:32" in joined and "--output-tokens-mean 32" in joined
    assert "--concurrency 8 --request-count 16" in joined  # at least 2 x the concurrency
    assert "--warmup-request-count 8" in joined  # perf_analyzer 2.51 hangs with fewer than the concurrency
    assert "--streaming" in cmd and f"--tokenizer {tokenizer_dir}" in joined
    joined = " ".join(command(Path("g"), cfg, openai, 1, tmp_path / "p.jsonl", tmp_path / "a"))
    assert "-m demo --endpoint-type completions -u h:9" in joined and "temperature:0" in joined


METRICS_BEFORE = """# HELP spectree_verify_steps_total Drafts
spectree_verify_steps_total{model="spec_decode",verification="greedy"} 10
spectree_verify_steps_total{model="spec_decode",verification="rejection_sampling"} 5
spectree_draft_tokens_total{model="spec_decode",verification="greedy"} 30
spectree_accepted_tokens_total{model="spec_decode",verification="greedy"} 12
spectree_generated_tokens_total{model="spec_decode"} 40
"""
METRICS_AFTER = """spectree_verify_steps_total{model="spec_decode",verification="greedy"} 30
spectree_verify_steps_total{model="spec_decode",verification="rejection_sampling"} 5
spectree_draft_tokens_total{model="spec_decode",verification="greedy"} 90
spectree_accepted_tokens_total{model="spec_decode",verification="greedy"} 42
spectree_generated_tokens_total{model="spec_decode"} 100
"""


def test_speculation_statistics_from_counter_deltas():
    before, after = counter_sums(METRICS_BEFORE), counter_sums(METRICS_AFTER)
    assert before["spectree_verify_steps_total"] == 15
    st = spec_stats(before, after)
    assert st["steps"] == 20 and st["accepted_tokens"] == 30
    assert st["draft_tokens"] == 60 and st["generated_tokens"] == 60
    assert st["acceptance_rate"] == pytest.approx(30 / 60)
    assert st["mean_accepted_length"] == pytest.approx(1 + 30 / 20)
    assert spec_stats(None, after) is None


def _metric(avg: float) -> dict:
    return {"unit": "ms", "avg": avg, "p50": avg, "p90": avg * 1.1, "p99": avg * 1.2, "min": 1, "max": 9}


def test_genai_perf_export_is_read_and_written_as_markdown():
    export = {name: _metric(v) for name, v in (("time_to_first_token", 20.0), ("inter_token_latency", 3.0),
                                               ("request_latency", 200.0), ("input_sequence_length", 40.0),
                                               ("output_sequence_length", 64.0))}
    export |= {"output_token_throughput": {"avg": 300.0}, "request_throughput": {"avg": 4.7},
               "request_count": {"avg": 16}}
    lv = level_report(export, "x.json")
    assert lv["time_to_first_token"]["p90"] == pytest.approx(22.0) and lv["request_count"] == 16
    with pytest.raises(GenaiPerfFailed, match="missing 'inter_token_latency'"):
        level_report({k: v for k, v in export.items() if k != "inter_token_latency"}, "x.json")
    lv |= {"concurrency": 2, "spec_decode": {"acceptance_rate": 0.5, "mean_accepted_length": 1.7}}
    report = {"settings": {"model": "ensemble", "openai_url": None, "max_tokens": 64, "requests": 16},
              "genai_perf": {"version": "genai-perf 0.0.16"}, "perf_analyzer": {"version": "2.51.0"},
              "num_prompts": 8, "created": "now", "endpoints": {"triton": [lv]}}
    md = markdown(report)
    assert "| 2 | 4.70 | 300.0 | 20.0 / 20.0 / 22.0 / 24.0 |" in md and "| 0.500 | 1.70 |" in md


def test_the_genai_perf_wrapper_reaches_perf_analyzer(tmp_path):
    """genai-perf starts `perf_analyzer` by name; installed, neither is on a bare PATH, and the wheel's binary lacks
    two libraries here. The wrapper scripts/setup.sh installs as the genai-perf command gives it both: its
    environment lines, run in a bare environment, start perf_analyzer (negative control: a bare shell cannot)."""
    from perf.analyzer import PerfAnalyzerMissing, locate

    try:
        pa = locate()
    except PerfAnalyzerMissing as exc:
        pytest.skip(f"no runnable perf_analyzer here: {exc}")
    script = entry_point_wrapper(Path(sys.executable), "genai_perf.main:main", pa.binary.parent, pa.lib_dir)
    assert script.startswith("#!/bin/sh\n") and WRAPPER_MARK in script and "from genai_perf.main import main" in script
    probe = tmp_path / "probe.sh"
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    probe.write_text(script.rsplit("\nexec ", 1)[0] + "\nexec perf_analyzer --version\n")
    run = subprocess.run(["sh", str(probe)], capture_output=True, text=True, env=bare, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    bare_run = subprocess.run(["sh", "-c", "exec perf_analyzer --version"], capture_output=True, text=True, env=bare,
                              timeout=60, check=False)
    assert bare_run.returncode != 0
    installed = Path(sys.executable).parent / "genai-perf"
    if installed.is_file() and WRAPPER_MARK in installed.read_text(errors="replace"):  # scripts/setup.sh has run
        help_run = subprocess.run([str(installed), "--help"], capture_output=True, text=True, env=bare, timeout=120,
                                  check=False)
        assert help_run.returncode == 0 and "profile" in help_run.stdout, help_run.stderr
