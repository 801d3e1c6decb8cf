"""model_repo: the typed config.pbtxt writer/parser and `python -m model_repo render` (no server here; the
served repository is exercised in tests/test_serving.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from model_repo.__main__ import main
from model_repo.contract import MESSAGES
from model_repo.pbtxt import dumps, loads, parse
from model_repo.render import RepoOptions, read_repo, render
from model_repo.model_config import (
    DataType,
    EnsembleScheduling,
    EnsembleStep,
    InstanceGroup,
    Kind,
    ModelInput,
    ModelOutput,
    ModelParameter,
    TransactionPolicy,
    TritonModelConfig,
)
from model_repo.settings import SpecDecodeSettings
from runtime.errors import ConfigError
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("repo") / "llama2", "llama2")


def sample_config() -> TritonModelConfig:
    return TritonModelConfig(
        name="m",
        backend="python",
        max_batch_size=0,
        input=(ModelInput("a", DataType.TYPE_STRING, (1,)),
               ModelInput("b", DataType.TYPE_FP32, (-1, 2), optional=True)),
        output=(ModelOutput("c", DataType.TYPE_INT32, (-1,)),),
        instance_group=(InstanceGroup(kind=Kind.KIND_CPU, count=2),),
        model_transaction_policy=TransactionPolicy(decoupled=True),
        parameters={"path": ModelParameter('/x/"quoted"\\dir\nline2\ttab'), "n": ModelParameter("3")},
    )


# ---- pbtxt ----------------------------------------------------------------------------------------------


def test_round_trip_python_model():
    cfg = sample_config()
    text = dumps(cfg)
    assert loads(TritonModelConfig, text) == cfg
    assert "kind: KIND_CPU" in text and "data_type: TYPE_STRING" in text and "dims: [ -1, 2 ]" in text
    assert "decoupled: true" in text


def test_round_trip_ensemble():
    cfg = TritonModelConfig(
        name="e", platform="ensemble", max_batch_size=0,
        input=(ModelInput("x", DataType.TYPE_BOOL, (1,)),), output=(ModelOutput("y", DataType.TYPE_UINT64, (1,)),),
        ensemble_scheduling=EnsembleScheduling(step=(
            EnsembleStep("a", -1, {"in": "x"}, {"out": "_t"}),
            EnsembleStep("b", 2, {"in": "_t"}, {"out": "y"}),
        )),
    )
    assert loads(TritonModelConfig, dumps(cfg)) == cfg


def test_parser_reads_handwritten_triton_style():
    # The styles found in tensorrtllm_backend / Triton docs: comments, list and repeated-entry forms of repeated
    # fields, `name: { }`, single quotes, trailing commas between fields, adjacent string literals.
    text = """
    # comment
    name: 'tokenizer'   backend: "python"
    max_batch_size: 0
    input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
    input { name: "n", data_type: TYPE_INT32, dims: [ 1 ], optional: true }
    output: [ { name: "ids" data_type: TYPE_INT32 dims: [ -1 ] } ]
    instance_group [ { count: 1 kind: KIND_CPU } ]
    parameters: { key: "tokenizer_dir" value: { string_value: "/a/" "b" } }
    """
    cfg = loads(TritonModelConfig, text)
    assert cfg.name == "tokenizer" and [i.name for i in cfg.input] == ["text_input", "n"]
    assert cfg.input[1].optional and not cfg.input[0].optional
    assert cfg.parameter("tokenizer_dir") == "/a/b"
    assert cfg.instance_group == (InstanceGroup(Kind.KIND_CPU, 1),)


@pytest.mark.parametrize(
    "text,message",
    [
        ('name: "m" backend: "python" max_batch_size: 0 bogus: 1', "unknown field(s) ['bogus']"),
        ('name: "m" backend: "python" max_batch_size: 0 input [ { name: "a" data_type: TYPE_NOPE dims: [1] } ]',
         "must be one of TYPE_BOOL"),
        ('name: "m" name: "n" backend: "python" max_batch_size: 0', "appears 2 times"),
        ('backend: "python" max_batch_size: 0', "TritonModelConfig.name is required"),
        ('name: "m" backend: "python" max_batch_size: "0"', "must be an integer"),
        ('name: "m" backend: "python" max_batch_size: 0 instance_group [ { kind: KIND_CPU count: 1 extra: 2 } ]',
         "instance_group[0]: unknown field(s) ['extra']"),
        ('name: "m" backend: "python" max_batch_size: 0 model_transaction_policy { decoupled: yes }', "true or false"),
        ('name: "m" backend: "python" max_batch_size: 0 parameters { key: "a" }', "exactly one key and one value"),
        ('name: "m" backend: "python" max_batch_size: 0 input [ { name: "a" ', "end of text"),
        ('name: "m" platform: "ensemble" backend: "python" max_batch_size: 0', "exactly one of backend and platform"),
    ],
)
def test_parser_is_strict(text, message):
    with pytest.raises(ConfigError) as e:
        loads(TritonModelConfig, text)
    assert message in str(e.value)


def test_writer_refuses_unfilled_and_mistyped_values():
    @dataclass(frozen=True)
    class Msg:
        name: str | None
        count: int

    with pytest.raises(ConfigError, match="count must be an int"):
        dumps(Msg(name="a", count="3"))
    with pytest.raises(ConfigError, match="Msg.count is required but unset"):
        dumps(Msg(name="a", count=None))
    assert dumps(Msg(name=None, count=1)) == "count: 1\n"
    with pytest.raises(ConfigError, match="instance_group.count must be an int >= 1"):
        InstanceGroup(Kind.KIND_CPU, 0)


def test_string_escapes_round_trip_exactly():
    for s in ['plain', 'q"uote', "back\\slash", "new\nline", "tab\t", "ctl\x01\x7f", "ünïcödé 日本 🙂", ""]:
        cfg = TritonModelConfig(name=s or "x", backend="python", max_batch_size=0, input=(), output=(),
                          parameters={"p": ModelParameter(s)})
        assert loads(TritonModelConfig, dumps(cfg)).parameters["p"].string_value == s
    assert parse(r'a: "\x41\101"')["a"][0].text == "AA"


# ---- render ---------------------------------------------------------------------------------------------


def test_render_hf_checkpoint(ckpt, tmp_path):
    out = tmp_path / "repo"
    repo = render(RepoOptions(engine=str(ckpt), output=str(out), max_concurrent_requests=3, max_tokens_limit=100,
                              draft="lookup"))
    configs = read_repo(out)
    assert set(configs) == {"ensemble", "preprocessing", "spec_decode"} == set(repo.configs)
    for name, cfg in configs.items():
        assert cfg == repo.configs[name]  # what is on disk parses back to the dataclass it was rendered from
    for name, cls in (("spec_decode", "SpecDecodeModel"), ("preprocessing", "PreprocessingModel"),
                      ("ensemble", "EnsembleModel")):
        src = (out / name / "1" / "model.py").read_text()
        assert f"from model_repo.triton_adapter import {cls} as TritonPythonModel" in src

    spec = configs["spec_decode"]
    assert spec.decoupled and spec.backend == "python"
    assert spec.instance_group == (InstanceGroup(Kind.KIND_CPU, 1),)
    settings = SpecDecodeSettings.from_parameters({k: v.string_value for k, v in spec.parameters.items()})
    assert settings.engine_dir == str(ckpt.resolve())
    assert settings.load_options == {"draft": "lookup"}
    assert (settings.max_concurrent_requests, settings.max_tokens_limit) == (3, 100)
    assert spec.parameter("verification_at_temperature_0") == "greedy"
    assert spec.parameter("verification_above_temperature_0") == "rejection_sampling"
    pre = configs["preprocessing"]
    assert pre.parameter("max_context") == "512" and not pre.decoupled  # tiny llama2: 512 positions

    ens = configs["ensemble"]
    # The entry point is a decoupled python (BLS) model, not a Triton ensemble: 2.51's ensembles do not pass a
    # client's cancellation on to a running step.
    assert ens.backend == "python" and ens.platform is None and ens.decoupled and ens.ensemble_scheduling is None
    assert [i.name for i in ens.input][:2] == ["text_input", "max_tokens"]
    # All optional at the config level (Triton 2.51 drops required-input errors on gRPC streams); the models
    # enforce text_input and max_tokens themselves (tests/test_serving.py checks the messages).
    assert all(i.optional for i in ens.input)
    assert ens.parameter("preprocessing_model") == "preprocessing" and ens.parameter("spec_decode_model") == "spec_decode"
    assert ens.parameter("max_in_flight") == str(1 * (3 + RepoOptions.max_queue_size))  # instances * (slots + queue)
    # The prompt, as text or as chat messages (a JSON string), goes through the tokenizer stage and on.
    messages = MESSAGES
    assert messages.data_type is DataType.TYPE_STRING and messages.dims == (1,) and messages.optional
    assert messages in ens.input and messages in spec.input and messages in pre.input
    assert [i.name for i in pre.input] == ["text_input", "messages", "parse_special_tokens"]
    # Every input the entry point takes is one spec_decode takes (it passes them on with the tokenizer's ids).
    assert {i.name for i in ens.input} <= {i.name for i in spec.input}
    # Limits, from one place (RepoOptions' defaults), reach both stages.
    assert spec.parameter("max_queue_size") == str(RepoOptions.max_queue_size)
    assert spec.parameter("max_prompt_bytes") == pre.parameter("max_prompt_bytes") == str(16 * 512)
    assert spec.parameter("kv_memory_mb") == "0" and spec.parameter("tree_budget") == "0"  # 0: none (whole trees)
    manifest = json.loads((out / "spectree-repo.json").read_text())
    assert manifest["max_context"] == 512 and manifest["options"]["draft"] == "lookup"


def test_render_tree_budget_reaches_the_scheduler(ckpt, tmp_path):
    repo = render(RepoOptions(engine=str(ckpt), output=str(tmp_path / "r"), tree_budget=16))
    spec = repo.configs["spec_decode"]
    assert spec.parameter("tree_budget") == "16"
    params = {k: p.string_value for k, p in spec.parameters.items()}
    assert SpecDecodeSettings.from_parameters(params).scheduler_config(lambda: 2**30).tree_budget == 16
    with pytest.raises(ConfigError, match=r"tree_budget: got 0, expected an integer >= 1"):
        RepoOptions(engine=str(ckpt), output=str(tmp_path / "s"), tree_budget=0)


def test_render_gpu_instances(ckpt, tmp_path):
    repo = render(RepoOptions(engine=str(ckpt), output=str(tmp_path / "r"), device="cuda", instances=2,
                              engine_path_in_server="/engines/engine"))
    spec = repo.configs["spec_decode"]
    assert spec.instance_group == (InstanceGroup(Kind.KIND_GPU, 2),)
    assert spec.parameter("engine_dir") == "/engines/engine" and spec.parameter("device") == "cuda"
    assert repo.configs["preprocessing"].instance_group == (InstanceGroup(Kind.KIND_CPU, 1),)


def test_render_refuses_bad_options(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="max_tokens_limit: 600 is above the engine's context length 512"):
        render(RepoOptions(engine=str(ckpt), output=str(tmp_path / "a"), max_tokens_limit=600))
    with pytest.raises(ConfigError, match="device: got 'tpu', expected one of 'cpu', 'cuda'"):
        RepoOptions(engine=str(ckpt), output=str(tmp_path / "a"), device="tpu")
    with pytest.raises(ConfigError, match="max_concurrent_requests: got 0, expected an integer >= 1"):
        RepoOptions(engine=str(ckpt), output=str(tmp_path / "a"), max_concurrent_requests=0)
    with pytest.raises(ConfigError, match=r"options: bogus: unknown key \(value 1\); expected one of engine, output, "):
        RepoOptions.from_mapping({"engine": str(ckpt), "output": "x", "bogus": 1})
    with pytest.raises(ConfigError, match=r"options: output: missing \(required\)"):
        RepoOptions.from_mapping({"engine": str(ckpt)})
    with pytest.raises(ConfigError, match="is not a directory"):
        render(RepoOptions(engine=str(tmp_path / "nope"), output=str(tmp_path / "a")))
    no_tok = tmp_path / "no_tok"
    make_checkpoint(no_tok, "qwen2")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        render(RepoOptions(engine=str(no_tok), output=str(tmp_path / "a")))
    assert not (tmp_path / "a").exists()


def test_render_does_not_overwrite_without_force(ckpt, tmp_path):
    out = tmp_path / "repo"
    render(RepoOptions(engine=str(ckpt), output=str(out)))
    with pytest.raises(ConfigError, match="already exists"):
        render(RepoOptions(engine=str(ckpt), output=str(out), max_concurrent_requests=2))
    render(RepoOptions(engine=str(ckpt), output=str(out), max_concurrent_requests=2, force=True))
    assert read_repo(out)["spec_decode"].parameter("max_concurrent_requests") == "2"
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]  # no temporary directory left behind


def test_cli_render_and_check(ckpt, tmp_path, capsys):
    cfg = tmp_path / "opts.yaml"
    cfg.write_text(f"engine: {ckpt}\nmax_concurrent_requests: 5\ntorch_threads: 1\n")
    out = tmp_path / "repo"
    assert main(["render", "--config", str(cfg), "--output", str(out), "--max-concurrent-requests", "4"]) == 0
    spec = read_repo(out)["spec_decode"]
    assert spec.parameter("max_concurrent_requests") == "4"  # the flag overrides the file
    assert spec.parameter("torch_threads") == "1"
    assert main(["check", str(out)]) == 0
    assert "spec_decode: python, decoupled" in capsys.readouterr().out

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"engine: {ckpt}\nmax_concurent_requests: 5\n")
    assert main(["render", "--config", str(bad), "--output", str(tmp_path / "r2")]) == 2
    assert f"{bad}: max_concurent_requests: unknown key (value 5)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["render", "--engine", str(ckpt), "--output", str(tmp_path / "r3"), "--slots", "3"])
    assert e.value.code == 2
    assert main(["render", "--engine", str(ckpt), "--output", str(tmp_path / "r4"), "--dtype", "int8"]) == 2
    assert "command line: dtype: got 'int8', expected one of 'float32', 'bfloat16', 'float16'" in capsys.readouterr().err
