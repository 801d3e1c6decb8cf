"""`python -m perf serve`: the real perf_analyzer against a real tritonserver serving a tiny checkpoint (numbers not
asserted; structure, token accounting and error reporting are), plus the parsing of perf_analyzer's outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from perf.__main__ import main
from perf.analyzer import PerfAnalyzerMissing, find_binary, locate, missing_libraries, provider
from perf.prompt_sets import Prompt
from perf.serve import (
    ProfileExportError,
    ServeConfig,
    input_data,
    level_metrics,
    parse_concurrency,
    read_csv,
    request_tokens,
)
from runtime.errors import ConfigError
from tests.cli import PNG, exit_status
from tests.tiny import make_checkpoint


def run_main(args: list[str]) -> int:
    return exit_status(main, args)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """tritonserver (the serving engineer's deploy.server) on a rendered repository of a tiny checkpoint."""
    from deploy.server import ServerConfig, TritonServer, free_ports
    from model_repo.render import RepoOptions, render

    root = tmp_path_factory.mktemp("perf_serve")
    ckpt = make_checkpoint(root / "target", "llama2")
    repo = render(RepoOptions(engine=str(ckpt), output=str(root / "repo"), draft="lookup", torch_threads=1)).path
    http, grpc, metrics = free_ports(3)
    srv = TritonServer(ServerConfig(repo=str(repo), http_port=http, grpc_port=grpc, metrics_port=metrics,
                                    ready_timeout_s=180, exit_timeout_s=5))
    with srv:
        yield srv.config.grpc_url, ckpt


def test_serve_cli_against_a_real_server(server, tmp_path):
    url, _ = server
    out = tmp_path / "serve"
    code = run_main(["serve", "--url", url, "--model", "ensemble", "--concurrency", "1:2", "--requests", "3",
                     "--max-tokens", "6", "--prompts-per-set", "1", "--warmup", "1", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "serve.json").read_text())
    assert report["model"] == "ensemble" and report["url"] == url and report["num_prompts"] == 2
    assert report["perf_analyzer"]["version"].startswith("Perf Analyzer Version")
    assert report["token_source"] == "the output_ids of every response" and report["short_outputs_at"] == []
    levels = report["concurrency"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    assert [lv["requests"] for lv in levels] == [3, 4]  # max(requests, 2 x concurrency)
    for lv in levels:
        # ignore_eos: every request streams exactly max_tokens tokens, counted from the output_ids it returned
        assert lv["output_tokens"] == 6 * lv["requests"] and lv["min_output_tokens"] == 6
        assert 1 <= lv["mean_responses"] <= 6
        assert 0 < lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p90"] <= lv["ttft_ms"]["p99"]
        assert lv["itl_ms"]["p50"] > 0 and lv["request_latency_ms"]["p50"] >= lv["ttft_ms"]["p50"]
        assert lv["requests_per_s"] > 0 and lv["pa_requests_per_s"] > 0
        assert lv["output_tokens_per_s"] == pytest.approx(lv["requests_per_s"] * 6)
        assert lv["server_tau"] >= 1.0  # the lookup drafter's tau, from the final responses
    data = json.loads((out / "perf_analyzer" / "input_data.json").read_text())
    assert [d["text_input"][0][:8] for d in data["data"]] == ["def fibo", "It is a "]
    for name in ("c1.csv", "c1.profile.json", "c2.csv", "c2.profile.json", "warmup.log"):
        assert (out / "perf_analyzer" / name).is_file()
    assert (out / "serve_latency.png").read_bytes().startswith(PNG)
    md = (out / "serve.md").read_text()
    assert "| 1 | 3 |" in md and "| 2 | 4 |" in md and "](serve_latency.png)" in md


@pytest.mark.parametrize("keep", [0, 100], ids=["empty", "cut-off"])
def test_an_unreadable_profile_export_runs_the_level_again(server, tmp_path, monkeypatch, capsys, keep):
    """perf_analyzer 2.51 now and then exits 0 leaving its profile export empty or cut off: that level runs again
    (the real perf_analyzer; its first export of concurrency 2 is cut to `keep` bytes as 2.51 leaves it)."""
    import perf.serve as serve_mod

    url, _ = server
    real, runs = serve_mod.run_perf_analyzer, []

    def flaky(pa, cmd, timeout_s, log):
        real(pa, cmd, timeout_s, log)
        export = cmd[cmd.index("--profile-export-file") + 1]
        runs.append(os.path.basename(export))
        if runs.count("c2.profile.json") == 1 and export.endswith("c2.profile.json"):
            with open(export, "r+b") as fh:
                fh.truncate(keep)

    monkeypatch.setattr(serve_mod, "run_perf_analyzer", flaky)
    out = tmp_path / "serve"
    assert run_main(["serve", "--url", url, "--model", "ensemble", "--concurrency", "1:2", "--requests", "2",
                     "--max-tokens", "4", "--prompts-per-set", "1", "--warmup", "0", "--out", str(out)]) == 0
    # c1 first (more than once when perf_analyzer 2.51 itself leaves that export unreadable, as it does now and then),
    # then c2, whose first export was cut: it must run again
    c2 = runs.index("c2.profile.json")
    assert c2 >= 1 and set(runs[:c2]) == {"c1.profile.json"}
    assert runs[c2:] == ["c2.profile.json"] * len(runs[c2:]) and len(runs[c2:]) >= 2
    assert "perf_analyzer left an unreadable profile export" in capsys.readouterr().err
    levels = json.loads((out / "serve.json").read_text())["concurrency"]
    assert [lv["output_tokens"] for lv in levels] == [4 * 2, 4 * 4]


@pytest.mark.parametrize("model,args,message", [
    ("nosuch", [], "unknown model"),
    ("ensemble", ["--max-tokens", "100000"], "above this server's limit"),
])
def test_perf_analyzer_errors_are_reported(server, tmp_path, capsys, model, args, message):
    url, _ = server
    code = run_main(["serve", "--url", url, "--model", model, "--concurrency", "1", "--requests", "1",
                     "--warmup", "0", "--prompts-per-set", "1", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert code == 1 and "perf_analyzer exited with status" in err and message in err


def test_unreachable_server(tmp_path, capsys):
    from deploy.server import free_ports

    (port,) = free_ports(1)
    code = run_main(["serve", "--url", f"127.0.0.1:{port}", "--model", "ensemble", "--concurrency", "1",
                     "--warmup", "0", "--prompts-per-set", "1", "--out", str(tmp_path)])
    assert code == 1 and "failed to connect" in capsys.readouterr().err


# ---- perf_analyzer's installation -------------------------------------------------------------------------


def test_locate_makes_perf_analyzer_runnable(tmp_path):
    pa = locate(cache_dir=tmp_path / "libs")
    assert pa.version.startswith("Perf Analyzer Version 2.51")
    assert missing_libraries(pa.binary, pa.env) == []
    for link in pa.linked:  # whatever the system lacked now resolves to a real file in the cache directory
        soname = link.split(" -> ")[0]
        assert (tmp_path / "libs" / soname).resolve().is_file()
    assert "LD_LIBRARY_PATH" not in os.environ or str(tmp_path) not in os.environ["LD_LIBRARY_PATH"]


def test_locate_sees_through_a_wrapper_on_path(tmp_path, monkeypatch):
    """A wrapper script first on PATH (a pyenv shim execs the interpreter's binary) hides the binary from ldd: the
    libraries the loader then reports are provided all the same (negative control: the wrapper alone, without the
    environment locate returns, fails wherever the system lacks one of them)."""
    real = Path(sys.executable).parent / "perf_analyzer"
    wrapper = tmp_path / "bin" / "perf_analyzer"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert missing_libraries(wrapper, dict(os.environ)) == []  # ldd cannot look inside a script
    pa = locate(cache_dir=tmp_path / "libs")
    assert pa.binary == wrapper and pa.version.startswith("Perf Analyzer Version 2.51")
    lacking = missing_libraries(real, dict(os.environ))
    assert sorted(link.split(" -> ")[0] for link in pa.linked) == sorted(lacking)
    if lacking:
        bare = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True, check=False)
        assert bare.returncode != 0 and "error while loading shared libraries" in bare.stderr


def test_bundled_libraries_are_found():
    assert provider("libb64.so.0d") is not None and provider("libb64.so.0d").is_file()
    assert provider("libcudart.so.12") is not None
    assert provider("libnothing.so.1") is None


def test_missing_perf_analyzer_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(PerfAnalyzerMissing, match=r'pip install "tritonclient\[grpc,http\]==2.51.0"'):
        find_binary()
    with pytest.raises(PerfAnalyzerMissing, match="is not an executable file"):
        find_binary(tmp_path / "perf_analyzer")


def test_missing_perf_analyzer_exits_3(tmp_path, monkeypatch, capsys):
    code = run_main(["serve", "--url", "127.0.0.1:1", "--model", "m", "--perf-analyzer", str(tmp_path / "nope"),
                     "--out", str(tmp_path)])
    assert code == 3 and "is not an executable file" in capsys.readouterr().err


# ---- settings ------------------------------------------------------------------------------------------------


def test_concurrency_levels():
    assert parse_concurrency("1:8") == tuple(range(1, 9))
    assert parse_concurrency("1:8:3") == (1, 4, 7)
    assert parse_concurrency("1,2,4,8") == (1, 2, 4, 8)
    assert parse_concurrency("4") == (4,)
    for bad in ("0:2", "4:1", "1:2:0", "a", "2,1", "1,1", "1:2:3:4", ""):
        with pytest.raises(ConfigError, match="--concurrency"):
            parse_concurrency(bad)


@pytest.mark.parametrize("kwargs,message", [
    ({"url": "localhost"}, "url: got 'localhost', expected HOST:PORT"),
    ({"url": "h:99999"}, "expected HOST:PORT"),
    ({"model": ""}, "model: got ''"),
    ({"max_tokens": 0}, "max_tokens: got 0"),
    ({"requests": 0}, "requests: got 0"),
    ({"concurrency": (0, 2)}, "concurrency: got (0, 2), expected levels >= 1"),
    ({"concurrency": (True,)}, "concurrency[0]: got True, expected an integer"),
    ({"prompts_per_set": 0}, "prompts_per_set: got 0, expected an integer >= 1"),
    ({"timeout_s": 0}, "timeout_s: got 0, expected a number > 0"),
    ({"tokenizer": "/nonexistent"}, "has no tokenizer.json"),
])
def test_serve_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as info:
        ServeConfig(**{"url": "127.0.0.1:8001", "model": "ensemble", **kwargs})
    assert message in str(info.value)


def test_input_data_follows_the_llm_conventions():
    prompts = [Prompt("code", "a", "def f():"), Prompt("prose", "b", "Once")]
    data = input_data(prompts, 32, ignore_eos=True)
    assert data["data"][0] == {"text_input": ["def f():"], "max_tokens": [32], "stream": [True],
                               "sampling_parameters": ['{"ignore_eos": true, "temperature": 0}']}
    assert "sampling_parameters" not in input_data(prompts, 32, ignore_eos=False)["data"][1]


# ---- parsing perf_analyzer's outputs (hand-made exports with known answers) --------------------------------------


def _request(sent_ms, response_ms, ids_per_response, final_tau=1.5):
    outputs = [{"text_output": "x" * len(ids) if isinstance(ids, list) else "x", "output_ids": ids}
               for ids in ids_per_response]
    outputs[-1].update(finish_reason="length", tau=final_tau)
    return {"timestamp": int(sent_ms * 1e6), "response_timestamps": [int(t * 1e6) for t in response_ms],
            "response_outputs": outputs}


def test_level_metrics_known_values():
    export = {"experiments": [
        {"experiment": {"mode": "concurrency", "value": 1}, "requests": [
            # 5 tokens in 3 responses (perf_analyzer writes a one-element output as a scalar)
            _request(0, [10, 20, 50], [7, [8, 9], [10, 11]]),
            # 5 tokens in 2 responses
            _request(100, [130, 150], [[1, 2, 3], [4, 5]], final_tau=2.5),
        ]},
        {"experiment": {"mode": "concurrency", "value": 2}, "requests": [_request(0, [1], [1])]},
    ]}
    m = level_metrics(export, 1, None, "export.json")
    assert m["requests"] == 2 and m["output_tokens"] == 10 and m["mean_output_tokens"] == 5
    assert m["span_s"] == pytest.approx(0.150)
    assert m["requests_per_s"] == pytest.approx(2 / 0.150) and m["output_tokens_per_s"] == pytest.approx(10 / 0.150)
    assert m["ttft_ms"]["mean"] == pytest.approx(20) and m["ttft_ms"]["p50"] == pytest.approx(20)
    assert m["itl_ms"]["mean"] == pytest.approx((40 / 4 + 20 / 4) / 2)
    assert m["request_latency_ms"]["p50"] == pytest.approx(50)
    assert m["mean_responses"] == 2.5 and m["server_tau"] == pytest.approx(2.0)
    assert m["token_source"] == "output_ids"
    with pytest.raises(ProfileExportError, match="one experiment at concurrency 3"):
        level_metrics(export, 3, None, "export.json")
    with pytest.raises(ProfileExportError, match="not a perf_analyzer profile export"):
        level_metrics({"runs": []}, 1, None, "export.json")


def test_tokens_without_output_ids_need_a_tokenizer():
    outputs = [{"text_output": "hello"}, {"text_output": " world"}]
    with pytest.raises(ProfileExportError, match="pass --tokenizer DIR"):
        request_tokens(outputs, None)
    assert request_tokens(outputs, lambda text: len(text.split())) == (2, "text_output")
    with pytest.raises(ProfileExportError, match="output_ids: got 'x'"):
        request_tokens([{"output_ids": "x"}], None)


def test_csv_reader():
    text = ("Concurrency,Inferences/Second,Response Throughput,p50 latency\n2,5.5,40.1,9000\n1,3.25,20.0,8000\n\n"
            "Server metrics\nfoo,bar\n")
    rows = read_csv(text, "c.csv")
    assert rows[1]["Inferences/Second"] == "3.25" and set(rows) == {1, 2}
    with pytest.raises(ProfileExportError, match="c.csv: expected a perf_analyzer CSV"):
        read_csv("a,b\n1,2\n", "c.csv")
