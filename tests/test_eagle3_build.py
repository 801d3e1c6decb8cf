"""EAGLE-3 in the builder (builder/drafters/eagle3.py): an engine keeps the head in the published layout and writes
the configs that serve it on TensorRT-LLM's PyTorch backend / LLM API, Triton's LLM-API backend, vLLM and SGLang,
checked against the fields and rules of their public sources (below); and `train-heads` trains an EAGLE-3 head on
the target's own answers (three layers' features, training-time test), resumes, and saves a head the runtime loads.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest
import torch
import yaml

import runtime
from builder.build import build_engine
from builder.config import parse_config
from builder.drafters import builder_kind
from runtime.errors import ConfigError
from tests.heads import write_eagle3_head
from tests.test_decode import PROMPTS
from tests.tiny import make_checkpoint

# (repository, commit, path): the fields each export is checked against. Facts, not code.
SOURCES = {
    "trtllm_llm_args": ("NVIDIA/TensorRT-LLM", "0004396720054fd8e205cbf616f21f0b57c6b412",
                        "tensorrt_llm/llmapi/llm_args.py",
                        "Eagle3DecodingConfig(EagleDecodingConfig): decoding_type 'Eagle3'; eagle_choices, "
                        "use_dynamic_tree, dynamic_tree_max_topK, eagle3_layers_to_capture (default {1, L//2-1, "
                        "L-4}: layer outputs); max_draft_len > 0; eagle_choices excludes use_dynamic_tree; the dynamic "
                        "tree needs dynamic_tree_max_topK > 0 and max_draft_len <= max_total_draft_tokens <= "
                        "dynamic_tree_max_topK * max_draft_len; choices connected, max_draft_len = their depth"),
    "trtllm_alias": ("NVIDIA/TensorRT-LLM", "(stored tests, read through the code search)",
                     "tests/unittest/llmapi/test_llm_args.py",
                     "DecodingBaseConfig.from_dict(decoding_type='Eagle3', max_draft_len, speculative_model_dir) -> "
                     "Eagle3DecodingConfig; speculative_model_dir is an alias of speculative_model"),
    "triton_llmapi": ("NVIDIA/TensorRT-LLM", "0ebb1536ac12bbe27201185de960df3ab00bcecc",
                      "triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml",
                      "LLM arguments at the top level (model, backend, tensor_parallel_size, pipeline_parallel_size) "
                      "and triton_config {max_batch_size, decoupled}"),
    "triton_llmapi_model": ("triton-inference-server/tensorrtllm_backend", "dbae4e889f8fab69963fb2223bb4269aa71aa7d0",
                            "all_models/llmapi/tensorrt_llm/1/model.py",
                            "model.yaml (or $LLM_CONFIG_PATH) minus triton_config becomes the LLM's arguments "
                            "(update_llm_args_with_extra_dict); triton_config's decoupled and max_batch_size configure "
                            "the model"),
    "sglang_args": ("sgl-project/sglang", "001067fffe33427bee0ed2f007fb7551a1d76b44", "python/sglang/srt/server_args.py",
                    "ServerArgs fields speculative_algorithm, speculative_draft_model_path, speculative_num_steps, "
                    "speculative_eagle_topk, speculative_num_draft_tokens, tp_size, model_path (flags: --field-name)"),
    "vllm_method": ("vllm-project/vllm", "00bd1493b3e82d6c13c68ee8a0e1c5a96707e190",
                    "vllm/model_executor/models/llama_eagle3.py",
                    "the eagle3 draft model (speculative config method 'eagle3', model = the head directory, "
                    "num_speculative_tokens = draft steps)"),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target3b"), "llama3", seed=5, num_hidden_layers=8)


def trtllm_check(spec: dict) -> None:
    """Eagle3DecodingConfig's validation (llm_args.py at the recorded commit), as far as these fields go."""
    allowed = {"decoding_type", "max_draft_len", "speculative_model_dir", "speculative_model", "eagle_choices",
               "use_dynamic_tree", "dynamic_tree_max_topK", "max_total_draft_tokens", "eagle3_layers_to_capture",
               "eagle3_one_model", "max_non_leaves_per_layer", "greedy_sampling", "posterior_threshold"}
    assert set(spec) <= allowed, set(spec) - allowed
    assert spec["decoding_type"] == "Eagle3" and spec["max_draft_len"] > 0
    assert spec.get("speculative_model_dir") or spec.get("speculative_model")
    choices = spec.get("eagle_choices")
    if choices is not None:
        assert not spec.get("use_dynamic_tree")
        assert all(c[:-1] in choices for c in choices if len(c) > 1)
        assert max(map(len, choices)) == spec["max_draft_len"]
    if spec.get("use_dynamic_tree"):
        assert choices is None and spec["dynamic_tree_max_topK"] > 0
        assert spec["max_draft_len"] <= spec["max_total_draft_tokens"] <= spec["dynamic_tree_max_topK"] * \
            spec["max_draft_len"]


def sglang_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang.launch_server")
    for flag in ("--model-path", "--speculative-algorithm", "--speculative-draft-model-path"):
        p.add_argument(flag, required=True)
    for flag in ("--tp-size", "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"):
        p.add_argument(flag, type=int, required=True)
    return p


def _exec_line(script: str) -> list[str]:
    line = next(x for x in script.splitlines() if x.startswith("exec "))
    return shlex.split(line)[1:-1]  # without exec and "$@"


@pytest.mark.parametrize("tree", [{"dynamic": {"total_tokens": 16, "depth": 4, "top_k": 4}},
                                  {"choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]},
                                  {"preset": "chain-3"}], ids=["dynamic", "static", "chain"])
def test_engine_exports_the_head_and_its_serving_configs(tmp_path, target_dir, tree):
    head = write_eagle3_head(tmp_path / "h", target_dir, seed=1, layer_prefix="layers.0.")
    out = tmp_path / "engine"
    cfg = parse_config({"model": {"checkpoint": str(target_dir)},
                        "draft": {"method": "eagle3", "checkpoint": str(head), "tree": tree},
                        "build": {"output": str(out), "dtype": "float32", "onnx": False, "max_draft_len": 16}},
                       tmp_path, "eagle3.yaml")
    result = build_engine(cfg)
    assert result.manifest["draft"]["config"]["feature_layers"] == [2, 4, 5]
    # the head in the published layout: its own key names, LlamaForCausalLMEagle3, loadable here
    from safetensors.torch import load_file

    keys = set(load_file(str(out / "draft" / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight"} <= keys and not any(k.startswith("layers.") for k in keys)
    assert json.loads((out / "draft" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    plain = runtime.load(target_dir)
    served = runtime.load(out)
    assert served.drafter.name == "eagle3"
    assert served.generate(PROMPTS[3], max_tokens=16, ignore_eos=True).token_ids == \
        plain.generate(PROMPTS[3], max_tokens=16, ignore_eos=True).token_ids

    spec = yaml.safe_load((out / "serving" / "trtllm-extra-options.yaml").read_text())["speculative_config"]
    trtllm_check(spec)
    assert spec["speculative_model_dir"] == str((out / "draft").resolve())
    llmapi = yaml.safe_load((out / "serving/triton-llmapi/tensorrt_llm/1/model.yaml").read_text())
    assert set(llmapi) == {"model", "backend", "tensor_parallel_size", "pipeline_parallel_size", "speculative_config",
                           "triton_config"}
    assert set(llmapi["triton_config"]) == {"max_batch_size", "decoupled"} and llmapi["speculative_config"] == spec
    vllm = _exec_line((out / "serving" / "vllm-serve.sh").read_text())
    assert vllm[:3] == ["vllm", "serve", str(target_dir.resolve())]
    vspec = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert vspec == {"method": "eagle3", "model": str((out / "draft").resolve()),
                     "num_speculative_tokens": spec["max_draft_len"]}
    sg = sglang_parser().parse_args(_exec_line((out / "serving" / "sglang-serve.sh").read_text())[3:])
    assert sg.speculative_algorithm == "EAGLE3" and sg.speculative_num_steps == spec["max_draft_len"]
    if "preset" in tree:
        assert sg.speculative_eagle_topk == 1 and sg.speculative_num_draft_tokens == 4 and "eagle_choices" not in spec
    assert (out / "serving" / "vllm-serve.sh").stat().st_mode & 0o111


def test_trtllm_check_rejects_what_tensorrt_llm_rejects():
    """Negative controls of the field check: each rule read from llm_args.py fails a config that breaks it."""
    good = {"decoding_type": "Eagle3", "max_draft_len": 4, "speculative_model_dir": "/h", "use_dynamic_tree": True,
            "dynamic_tree_max_topK": 4, "max_total_draft_tokens": 12}
    trtllm_check(good)
    for bad in ({**good, "max_total_draft_tokens": 17}, {**good, "max_total_draft_tokens": 3},
                {**good, "decoding_type": "Eagle"}, {**good, "eagle_choices": [[0]]}, {**good, "num_eagle_layer": 4}):
        with pytest.raises(AssertionError):
            trtllm_check(bad)


def test_the_tensorrtllm_engine_backend_refuses_eagle3():
    with pytest.raises(ConfigError, match="TensorRT-LLM's engine backend has no EAGLE-3"):
        builder_kind("eagle3").check_trtllm_backend(None)


# ---- training ---------------------------------------------------------------------------------------------------

CHATML = ("{% for m in messages %}{{ '<|eot_id|>' + m['role'] + '\\n' + m['content'] + '</s>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|eot_id|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    out = make_checkpoint(tmp_path_factory.mktemp("chat3"), "llama2", num_hidden_layers=8)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def _config(target: Path, tmp: Path, max_steps: int) -> dict:
    p = tmp / "prompts.jsonl"
    words = ("add two numbers", "sort a list", "print hello", "reverse text")
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Write code to {words[i % 4]} ({i}).", "chat": True})
                         + "\n" for i in range(12)))
    train = {"max_steps": max_steps, "batch_size": 4, "seq_len": 24, "eval_every": 10, "eval_batches": 2,
             "warmup_steps": 1, "lr": 5e-3, "checkpoint_every": 5, "threads": 1}
    return {"corpus": {"source": "chat", "prompts": str(p), "held_out": 0.25, "max_new_tokens": 20,
                       "generate_batch": 6},
            "heads": {"target": str(target), "work_dir": str(tmp / "work"), "save_dtype": "float32",
                      "draft_vocab_size": 48, "eagle3": {"output": str(tmp / "eagle3"), "unroll": 3, "train": train}}}


def test_train_heads_eagle3_learns_resumes_and_loads(chat_target, tmp_path):
    from builder.train_heads import train_heads
    from builder.training.config import parse_train_config
    from builder.training.distill import conversations, features_file

    (first,) = train_heads(parse_train_config(_config(chat_target, tmp_path, 30)), quiet=True)
    assert first.kind == "eagle3" and first.steps == 30
    log = [json.loads(x) for x in (tmp_path / "work" / "eagle3_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if r["event"] == "step"]
    assert {"ce_1", "ce_2", "ce_3"} <= set(next(r for r in log if r["event"] == "step"))  # a loss at every run
    evals = [r["top1"] for r in log if r["event"] == "eval"]
    assert losses[-1] < 0.9 * losses[0] and sum(evals[-1]) > sum(evals[0]), (losses, evals)  # it learns

    # the cached features are the streams entering layers (2, 4, 5), as transformers reports them
    data_dir = tmp_path / "work" / "distill"
    feats = torch.load(data_dir / features_file((2, 4, 5)), weights_only=True)
    conv = conversations(data_dir)[0]
    ids = conv["prompt_ids"] + conv["response_ids"]
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(chat_target), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hs = ref.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats[:len(ids)].float(), torch.cat([hs[j][0] for j in (2, 4, 5)], -1).float(),
                               atol=2e-2, rtol=2e-2)

    # a longer budget resumes from the checkpoint (no restart)
    (second,) = train_heads(parse_train_config(_config(chat_target, tmp_path, 36)), quiet=True)
    log = [json.loads(x) for x in (tmp_path / "work" / "eagle3_log.jsonl").read_text().splitlines()]
    assert second.steps == 36 and any(r["event"] == "resume" and r["step"] == 30 for r in log)

    # the head directory is the published layout and the runtime drafts with it, output unchanged
    cfg = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 48
    prompt = [{"role": "user", "content": "Write code to sort a list (99)."}]
    plain = runtime.load(chat_target).generate(prompt, max_tokens=20, ignore_eos=True)
    dec = runtime.load(chat_target, draft_model=tmp_path / "eagle3", total_tokens=8, depth=3, top_k=3)
    assert dec.drafter.name == "eagle3" and dec.drafter.head.vocab.size == 48
    got = dec.generate(prompt, max_tokens=20, ignore_eos=True)
    assert got.token_ids == plain.token_ids and got.stats.drafted_tokens > 0
