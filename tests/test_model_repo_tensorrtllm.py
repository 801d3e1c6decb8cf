"""`python -m model_repo render --backend tensorrtllm`: the tensorrtllm_backend inflight_batcher_llm layout for an
engine directory, checked against Triton's own ModelConfig protobuf and the public templates' keys
(tests/fixtures/tensorrtllm_templates.json, with its source commits), and the package code of its python stages
(tokenizer stages on the real tokenizer, the verification stage against runtime.verify).

No tensorrtllm backend and no GPU here: nothing in this file loads the repository in a server.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from builder.build import build_engine
from builder.config import parse_config
from model_repo.__main__ import main
from model_repo.tensorrtllm import (
    BLS,
    ENSEMBLE,
    MODELS,
    TEMPLATE_MODELS,
    TENSORRT_LLM,
    VERIFY,
    TrtllmRepoOptions,
    VerifySettings,
    bls_generate,
    check_sampling,
    parse_choices_parameter,
    postprocess_batch,
    preprocess_batch,
    render_tensorrtllm,
    tree_from_parents,
    verify_tree_logits,
    word_list,
)
from runtime.errors import ConfigError, RequestError
from runtime.protocol import Draft, Proposal
from runtime.sampling import SamplingParams
from runtime.tokenizer import Tokenizer
from runtime.tree import Tree
from runtime.verify import verify
from tests.heads import write_eagle_head, write_medusa_head
from tests.tiny import make_checkpoint, vocab_size

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "tensorrtllm_templates.json").read_text())
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("trtllm_repo")
    ck = make_checkpoint(root / "llama", "llama3")
    medusa = write_medusa_head(root / "medusa", 64, vocab_size(), num_heads=3)
    eagle = write_eagle_head(root / "eagle", ck)
    drafts = {
        "medusa": {"method": "medusa", "checkpoint": str(medusa), "tree": {"choices": TREE}},
        "eagle": {"method": "eagle", "checkpoint": str(eagle), "tree": {"preset": "chain-3"}},
        "eagle2": {"method": "eagle", "checkpoint": str(eagle),
                   "tree": {"dynamic": {"total_tokens": 8, "depth": 3, "top_k": 2}}},
        "plain": {"method": "none"},
    }
    out = {"root": root}
    for name, draft in drafts.items():
        data = {"model": {"checkpoint": str(ck)}, "draft": draft,
                "build": {"output": str(root / "engines" / name), "onnx": False, "max_draft_len": 12,
                          "max_batch_size": 4}}
        out[name] = build_engine(parse_config(data, root, f"{name}.yaml")).output
    return out


def render(engines, name, tmp_path, *extra) -> Path:
    out = tmp_path / f"repo_{name}"
    assert main(["render", "--backend", "tensorrtllm", "--engine", str(engines[name]), "--output", str(out),
                 *extra]) == 0
    return out


def triton_config(repo: Path, model: str) -> model_config_pb2.ModelConfig:
    """Parse with Triton's own ModelConfig protobuf (text_format fails on any unknown field or bad value)."""
    return text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def tensor_spec(t) -> dict:
    spec = {"data_type": model_config_pb2.DataType.Name(t.data_type), "dims": list(t.dims)}
    if getattr(t, "optional", False):
        spec["optional"] = True
    if hasattr(t, "reshape") and t.HasField("reshape"):
        spec["reshape"] = list(t.reshape.shape)
    if getattr(t, "allow_ragged_batch", False):
        spec["allow_ragged_batch"] = True
    return spec


@pytest.mark.parametrize("name", ["medusa", "eagle"])
def test_rendered_configs_parse_and_match_the_public_templates(engines, tmp_path, name):
    repo = render(engines, name, tmp_path)
    assert sorted(p.parent.name for p in repo.glob("*/config.pbtxt")) == sorted(MODELS)
    for model in MODELS:
        cfg = triton_config(repo, model)
        assert cfg.name == model
        if model not in TEMPLATE_MODELS:
            continue
        template = FIXTURE["models"][model]
        assert sorted(cfg.parameters) == template["parameters"], model
        assert cfg.max_batch_size == 4  # triton_max_batch_size: the engine's build.max_batch_size
        for kind, tensors in (("inputs", cfg.input), ("outputs", cfg.output)):
            for t in tensors:
                assert t.name in template[kind], (model, kind, t.name)
                assert tensor_spec(t) == template[kind][t.name], (model, kind, t.name)
        for required in (n for n, spec in template["inputs"].items() if not spec.get("optional")):
            assert required in [t.name for t in cfg.input], (model, required)
    trt = triton_config(repo, TENSORRT_LLM)
    assert trt.backend == "tensorrtllm" and trt.model_transaction_policy.decoupled
    p = {k: v.string_value for k, v in trt.parameters.items()}
    assert p["decoding_mode"] == name
    assert parse_choices_parameter(p[f"{name}_choices"]) == tuple(
        tuple(c) for c in json.loads((engines[name] / "engine.json").read_text())["draft"]["tree"]["choices"])
    other = "eagle" if name == "medusa" else "medusa"
    assert p[f"{other}_choices"] == "${" + f"{other}_choices" + "}"  # unset, as an unfilled template leaves it
    assert p["gpt_model_path"] == str((engines[name] / "trtllm_engine").resolve())
    assert p["gpt_model_type"] == "inflight_fused_batching" and p["max_beam_width"] == "1"
    assert p["tokenizer_dir"] == "${tokenizer_dir}"  # the C++ backend ignores it (guided decoding only)
    pre = {k: v.string_value for k, v in triton_config(repo, "preprocessing").parameters.items()}
    assert pre["tokenizer_dir"] == str(engines[name].resolve()) and pre["gpt_model_path"] == p["gpt_model_path"]
    bls = {k: v.string_value for k, v in triton_config(repo, BLS).parameters.items()}
    assert bls["tensorrt_llm_model_name"] == TENSORRT_LLM
    # A tree engine's ensemble takes no sampling inputs: TensorRT-LLM's Medusa / EAGLE sampling is not lossless.
    assert not {"temperature", "top_k", "top_p", "seed"} & {t.name for t in triton_config(repo, ENSEMBLE).input}
    for f in ("preprocessing", "postprocessing", BLS, VERIFY):
        source = (repo / f / "1" / "model.py").read_text()
        assert "from model_repo.triton_adapter import" in source and len(source.splitlines()) <= 6


def test_ensemble_steps_are_wired_to_existing_tensors(engines, tmp_path):
    repo = render(engines, "plain", tmp_path)
    ens = triton_config(repo, ENSEMBLE)
    available = {t.name for t in ens.input}
    assert {"temperature", "top_k", "top_p", "seed"} <= available  # plain decoding samples exactly
    for step in ens.ensemble_scheduling.step:
        model = triton_config(repo, step.model_name)
        inputs, outputs = {t.name for t in model.input}, {t.name for t in model.output}
        for model_input, tensor in step.input_map.items():
            assert model_input in inputs and tensor in available, (step.model_name, model_input, tensor)
        for model_output, tensor in step.output_map.items():
            assert model_output in outputs, (step.model_name, model_output)
            available.add(tensor)
        required = {t.name for t in model.input if not t.optional}
        assert required <= set(step.input_map), (step.model_name, required - set(step.input_map))
    assert {o.name for o in ens.output} <= available
    assert json.loads((repo / "spectree-repo.json").read_text())["backend"] == "tensorrtllm"


def test_render_refuses_what_the_backend_cannot_serve(engines, tmp_path, capsys):
    with pytest.raises(ConfigError, match="EAGLE-2 dynamic-tree engine"):
        render_tensorrtllm(TrtllmRepoOptions(engine=str(engines["eagle2"]), output=str(tmp_path / "r")))
    with pytest.raises(ConfigError, match="max_batch_size: 8 is above the engine's build.max_batch_size 4"):
        render_tensorrtllm(TrtllmRepoOptions(engine=str(engines["medusa"]), output=str(tmp_path / "r"),
                                             max_batch_size=8))
    with pytest.raises(ConfigError, match="kv_cache_free_gpu_mem_fraction"):
        TrtllmRepoOptions(engine="e", output="o", kv_cache_free_gpu_mem_fraction=1.5)
    with pytest.raises(ConfigError, match="not an engine directory"):
        render_tensorrtllm(TrtllmRepoOptions(engine=str(tmp_path), output=str(tmp_path / "r")))
    assert main(["render", "--backend", "tensorrtllm", "--engine", str(engines["medusa"]), "--output",
                 str(tmp_path / "r"), "--device", "cuda"]) == 2
    assert "--backend tensorrtllm does not take --device" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# ---- the python stages' package code ------------------------------------------------------------------------


def test_preprocessing_and_postprocessing_use_our_tokenizer(engines):
    tok = Tokenizer.from_dir(engines["plain"])
    queries = np.array([[b"The quick brown fox"], [b"jumps"]], dtype=object)
    out = preprocess_batch({"QUERY": queries, "REQUEST_OUTPUT_LEN": np.array([[16], [8]], dtype=np.int32),
                            "STOP_WORDS_DICT": np.array([[b" dog", b"."], [b"", b""]], dtype=object)}, tok, True, 1024)
    first, second = tok.encode("The quick brown fox"), tok.encode("jumps")
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(first)], [len(second)]]
    assert out["INPUT_ID"][0, : len(first)].tolist() == first and out["INPUT_ID"][1, : len(second)].tolist() == second
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[16], [8]]
    assert out["OUT_END_ID"].tolist() == [[tok.eos_token_ids[0]]] * 2
    dog, dot = tok.encode(" dog", add_bos=False), tok.encode(".", add_bos=False)
    stop = out["STOP_WORDS_IDS"]  # [batch, 2, n]: ids, then each word's end offset, -1 padded
    assert stop.shape[:2] == (2, 2)
    assert stop[0, 0, : len(dog) + len(dot)].tolist() == dog + dot
    assert stop[0, 1, :2].tolist() == [len(dog), len(dog) + len(dot)] and set(stop[0, 1, 2:].tolist()) <= {-1}
    assert stop[1, 1].tolist() == [-1] * stop.shape[2]  # no words
    assert word_list([]).tolist() == [[0], [-1]]
    with pytest.raises(RequestError, match=r"QUERY\[0\].*context of 4 tokens"):
        preprocess_batch({"QUERY": queries, "REQUEST_OUTPUT_LEN": np.array([[1], [1]])}, tok, True, 4)
    ids = np.array([[first + [0, 0]]], dtype=np.int32)  # [batch, beams, T], padded
    text = postprocess_batch({"TOKENS_BATCH": ids, "SEQUENCE_LENGTH": np.array([[len(first)]])}, tok, True)
    assert text["OUTPUT"][0, 0].decode() == tok.decode(first, skip_special_tokens=True)


def test_bls_refuses_sampled_requests_on_tree_engines():
    sampled = {"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[4]], dtype=np.int32),
               "temperature": np.array([[0.8]], dtype=np.float32)}
    for mode in ("medusa", "eagle"):
        with pytest.raises(RequestError, match=f"temperature 0.8: this {mode} engine"):
            check_sampling(sampled, mode)
        with pytest.raises(RequestError, match="spectree_verify"):
            next(bls_generate(sampled, mode, infer=None))  # refused before any model is called
        check_sampling({**sampled, "top_k": np.array([[1]], dtype=np.int32)}, mode)  # top-k 1 is greedy
        check_sampling({**sampled, "temperature": np.array([[0.0]], dtype=np.float32)}, mode)
    check_sampling(sampled, "top_k_top_p")  # plain decoding samples exactly


def random_draft(tree: Tree, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tree.num_nodes, vocab, generator=gen) * 3  # [num_nodes, vocab]
    tokens = torch.randint(0, vocab, (tree.num_nodes,), generator=gen)  # [num_nodes]
    # Make some children the target's likely picks, so paths get accepted.
    for child in range(1, tree.num_nodes):
        parent = int(tree.parents[child])
        if child % 2:
            tokens[child] = int(logits[parent].argmax())
    return logits, tokens


def test_verification_stage_is_runtime_verify():
    """The stage's verdict is runtime.verify's with the same tree, proposal rule and seeded generator, for greedy
    and sampled requests, static and per-request trees."""
    settings = VerifySettings(engine_dir="e", draft_method="medusa", tree_choices=tuple(tuple(c) for c in TREE))
    tree = Tree.from_choices(TREE)
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    for trial in range(60):
        logits, tokens = random_draft(tree, 50, gen)
        temperature = 0.0 if trial % 3 == 0 else 0.9
        inputs = {"tree_logits": logits.numpy(), "draft_tokens": tokens.numpy().astype(np.int32),
                  "temperature": np.array([temperature], dtype=np.float32),
                  "top_p": np.array([0.95], dtype=np.float32), "random_seed": np.array([trial], dtype=np.uint64)}
        got = verify_tree_logits(inputs, settings)
        params = SamplingParams(temperature=temperature, top_p=0.95, seed=trial)
        want = verify(Draft(tree, tokens, Proposal.DETERMINISTIC), logits, params, torch.Generator().manual_seed(trial))
        assert got["accepted_path"].tolist() == want.path.tolist()
        assert got["output_ids"].tolist() == want.tokens.tolist()
        assert bool(got["bonus"][0]) == want.bonus
        assert got["verification"][0] == (b"greedy" if temperature == 0 else b"rejection_sampling/deterministic")
        accepted += want.num_accepted
        parents = tree.parents.tolist()
        again = verify_tree_logits({**inputs, "tree_parents": np.array(parents, dtype=np.int32)}, settings)
        assert again["output_ids"].tolist() == got["output_ids"].tolist()
    assert accepted > 0  # the comparison covered accepted paths, not only rejections at the root


def test_verification_stage_rejects_bad_trees():
    settings = VerifySettings(engine_dir="e", draft_method="eagle", tree_choices=())
    logits = np.zeros((3, 10), dtype=np.float32)
    with pytest.raises(RequestError, match="tree_parents is required"):
        verify_tree_logits({"tree_logits": logits, "draft_tokens": np.zeros(3, dtype=np.int32)}, settings)
    with pytest.raises(RequestError, match="must both have the tree's 3 nodes"):
        verify_tree_logits({"tree_logits": logits[:2], "draft_tokens": np.zeros(3, dtype=np.int32),
                            "tree_parents": np.array([-1, 0, 0], dtype=np.int32)}, settings)
    with pytest.raises(RequestError, match="node 0 must be the root"):
        tree_from_parents([0, 0, 1])
    with pytest.raises(RequestError, match="canonical order"):
        tree_from_parents([-1, 0, 1, 0])  # depth 2 before a depth-1 sibling
    assert tree_from_parents([-1, 0, 0, 1]).choices == ((0,), (1,), (0, 0))
