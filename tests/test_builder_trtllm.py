"""The TensorRT-LLM checkpoint in an engine directory, checked tensor by tensor against the Hugging Face weights,
and the export's fidelity rules, each stated with the TensorRT-LLM source it comes from.

Expected names, fusions and shardings are written out here from reference-facts section 6 (and TensorRT-LLM's
converters), independently of runtime/engine.py; both sides are read with safetensors directly. The command-line
rules are checked by parsing our trtllm-build / run.py lines with argparse parsers written out here from
TensorRT-LLM's own (files and commits named on each), not from builder/trtllm.py.
"""

from __future__ import annotations

import argparse
import ast
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from builder.build import build_engine
from builder.config import parse_config
from builder.trtllm import max_non_leaves_per_layer
from builder.trtllm_layout import shard
from runtime.engine import EngineError, QKVLayout, TPLayout, open_engine, unshard
from runtime.errors import ConfigError
from runtime.tree import Tree
from tests.heads import write_eagle_head, write_medusa_head
from tests.tiny import make_checkpoint

VOCAB = 421  # odd: a 2-way vocab-parallel lm_head needs one padding row
H, I, HEADS, KV, D, LAYERS = 64, 128, 4, 2, 16, 2
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
# The tiny checkpoints are float32: the TensorRT-LLM export of a float32 build is float16 (the dtype rule, below).
EXPORT = torch.float16


def export(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(EXPORT) for n, t in tensors.items()}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("trt")
    ck = make_checkpoint(root / "llama", "llama2", vocab_size=VOCAB)
    return {
        "root": root,
        "ck": ck,
        "medusa": write_medusa_head(root / "medusa", H, VOCAB, num_heads=3, num_layers=2),
        "eagle": write_eagle_head(root / "eagle", ck),
        "hf": export(load_file(str(ck / "model.safetensors"))),
        "hf_float32": load_file(str(ck / "model.safetensors")),
    }


def build(src, name, draft, **b):
    data = {"model": {"checkpoint": str(src["ck"])}, "draft": draft,
            "build": {"output": str(src["root"] / name), "onnx": False, "max_draft_len": 10, **b}}
    return build_engine(parse_config(data, src["root"], f"{name}.yaml")).output


@pytest.fixture(scope="module")
def medusa_engines(src):
    draft = {"method": "medusa", "checkpoint": str(src["medusa"]), "tree": {"choices": TREE}}
    return {tp: build(src, f"medusa_tp{tp}", draft, tp_size=tp) for tp in (1, 2, 4)}


def rank(engine: Path, r: int) -> dict[str, torch.Tensor]:
    return load_file(str(engine / "trtllm_checkpoint" / f"rank{r}.safetensors"))


def trt_config(engine: Path) -> dict:
    return json.loads((engine / "trtllm_checkpoint" / "config.json").read_text())


def medusa_hf(src) -> dict[str, torch.Tensor]:
    return export(load_file(str(src["medusa"] / "medusa_lm_head.safetensors")))


def expected_full(src) -> dict[str, torch.Tensor]:
    """Section 6, written out: TensorRT-LLM name -> the HF tensor(s) it holds (unsharded)."""
    hf, out = src["hf"], {}
    out["transformer.vocab_embedding.weight"] = hf["model.embed_tokens.weight"]
    out["transformer.ln_f.weight"] = hf["model.norm.weight"]
    out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(LAYERS):
        p, t = f"model.layers.{i}.", f"transformer.layers.{i}."
        out[t + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[t + "attention.qkv.weight"] = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[t + "attention.dense.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[t + "post_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[t + "mlp.fc.weight"] = hf[p + "mlp.gate_proj.weight"]  # the trap: fc = gate_proj ...
        out[t + "mlp.gate.weight"] = hf[p + "mlp.up_proj.weight"]  # ... and gate = up_proj
        out[t + "mlp.proj.weight"] = hf[p + "mlp.down_proj.weight"]
    m = medusa_hf(src)
    for h in range(3):
        for layer in range(2):
            out[f"medusa_heads.{h}.medusa_layers.{layer}.linear.weight"] = m[f"{h}.{layer}.linear.weight"]
            out[f"medusa_heads.{h}.medusa_layers.{layer}.linear.bias"] = m[f"{h}.{layer}.linear.bias"]
        out[f"medusa_heads.{h}.lm_head.weight"] = m[f"{h}.2.weight"]
    return out


def test_config_json_fields(src, medusa_engines):
    cfg = trt_config(medusa_engines[2])
    expected = {
        "architecture": "MedusaForCausalLM", "dtype": "float16", "logits_dtype": "float32", "vocab_size": VOCAB,
        "hidden_size": H, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "intermediate_size": I, "hidden_act": "silu", "max_position_embeddings": 512, "norm_epsilon": 1e-5,
        "position_embedding_type": "rope_gpt_neox", "rotary_base": 10000.0, "rotary_scaling": None, "head_size": D,
        "tie_word_embeddings": False, "attn_bias": False,
        "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1},
        "num_medusa_heads": 3, "num_medusa_layers": 2, "max_draft_len": 10,
    }
    for key, value in expected.items():
        assert cfg[key] == value, key
    assert cfg["quantization"]["quant_algo"] is None


def test_tp1_names_and_tensors_match_hf(src, medusa_engines):
    got = rank(medusa_engines[1], 0)
    want = expected_full(src)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name
    # The naming trap is real here: gate_proj and up_proj differ, and fc holds gate_proj.
    hf = src["hf"]
    assert not torch.equal(hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"])
    assert not torch.equal(got["transformer.layers.0.mlp.fc.weight"], hf["model.layers.0.mlp.up_proj.weight"])


def test_tp2_shards_follow_section_6(src, medusa_engines):
    want = expected_full(src)
    hf = src["hf"]
    ranks = [rank(medusa_engines[2], r) for r in range(2)]
    for r, got in enumerate(ranks):
        assert set(got) == set(want)
        half = lambda t, dim: t.chunk(2, dim=dim)[r]  # noqa: E731
        for i in range(LAYERS):
            p, t = f"model.layers.{i}.", f"transformer.layers.{i}."
            # q, k, v each split on dim 0, then concatenated per rank: [q_r; k_r; v_r]
            qkv = torch.cat([half(hf[p + f"self_attn.{x}_proj.weight"], 0) for x in "qkv"])
            assert got[t + "attention.qkv.weight"].shape == ((HEADS // 2 + 2 * KV // 2) * D, H)
            assert torch.equal(got[t + "attention.qkv.weight"], qkv)
            assert torch.equal(got[t + "attention.dense.weight"], half(hf[p + "self_attn.o_proj.weight"], 1))
            assert torch.equal(got[t + "mlp.fc.weight"], half(hf[p + "mlp.gate_proj.weight"], 0))
            assert torch.equal(got[t + "mlp.gate.weight"], half(hf[p + "mlp.up_proj.weight"], 0))
            assert torch.equal(got[t + "mlp.proj.weight"], half(hf[p + "mlp.down_proj.weight"], 1))
            assert torch.equal(got[t + "input_layernorm.weight"], hf[p + "input_layernorm.weight"])
            assert torch.equal(got[t + "post_layernorm.weight"], hf[p + "post_attention_layernorm.weight"])
        assert torch.equal(got["transformer.vocab_embedding.weight"], hf["model.embed_tokens.weight"])
        assert torch.equal(got["transformer.ln_f.weight"], hf["model.norm.weight"])
        # Vocabulary padded 421 -> 422 rows, then split on dim 0; the padding row is zero.
        padded = torch.cat([hf["lm_head.weight"], torch.zeros(1, H, dtype=EXPORT)])
        assert got["lm_head.weight"].shape == (211, H)
        assert torch.equal(got["lm_head.weight"], half(padded, 0))
        m = medusa_hf(src)
        for h in range(3):
            for layer in range(2):
                pre = f"medusa_heads.{h}.medusa_layers.{layer}.linear."
                assert torch.equal(got[pre + "weight"], half(m[f"{h}.{layer}.linear.weight"], 0))
                assert torch.equal(got[pre + "bias"], half(m[f"{h}.{layer}.linear.bias"], 0))
            lm = torch.cat([m[f"{h}.2.weight"], torch.zeros(1, H, dtype=EXPORT)])
            assert torch.equal(got[f"medusa_heads.{h}.lm_head.weight"], half(lm, 0))
    assert torch.all(ranks[1]["lm_head.weight"][-1] == 0)


def test_tp4_duplicates_kv_heads(src, medusa_engines):
    hf = src["hf"]
    for r in range(4):
        got = rank(medusa_engines[4], r)["transformer.layers.1.attention.qkv.weight"]
        q = hf["model.layers.1.self_attn.q_proj.weight"][r * D:(r + 1) * D]  # one q head per rank
        kv_head = r // 2  # 2 kv heads over 4 ranks: each held by two ranks
        k = hf["model.layers.1.self_attn.k_proj.weight"][kv_head * D:(kv_head + 1) * D]
        v = hf["model.layers.1.self_attn.v_proj.weight"][kv_head * D:(kv_head + 1) * D]
        assert torch.equal(got, torch.cat([q, k, v]))
    # 421 rows padded to 424 over 4 ranks.
    assert rank(medusa_engines[4], 3)["lm_head.weight"].shape == (106, H)


def test_shards_reassemble_bit_exactly(src, medusa_engines):
    want = expected_full(src)
    layout = TPLayout(VOCAB, QKVLayout(HEADS, KV, D))
    for tp in (2, 4):
        full = unshard([rank(medusa_engines[tp], r) for r in range(tp)], layout)
        assert set(full) == set(want)
        for name, t in want.items():
            assert torch.equal(full[name], t), (tp, name)
    # bf16 and biases too, through the same pair of functions.
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "transformer.layers.0.attention.qkv.weight": torch.randn(128, 64, generator=gen).bfloat16(),
        "transformer.layers.0.attention.qkv.bias": torch.randn(128, generator=gen).bfloat16(),
        "transformer.layers.0.attention.dense.bias": torch.randn(64, generator=gen).bfloat16(),
        "transformer.layers.0.mlp.fc.bias": torch.randn(128, generator=gen).bfloat16(),
        "lm_head.weight": torch.randn(VOCAB, 64, generator=gen).bfloat16(),
    }
    for tp in (1, 2, 4):
        back = unshard(shard(tensors, layout, tp), layout)
        assert all(torch.equal(back[n], t) and back[n].dtype == t.dtype for n, t in tensors.items())


def test_unshard_rejects_inconsistent_ranks(src, medusa_engines):
    layout = TPLayout(VOCAB, QKVLayout(HEADS, KV, D))
    ranks = [rank(medusa_engines[4], r) for r in range(4)]
    bad = [dict(r) for r in ranks]
    bad[1]["transformer.ln_f.weight"] = bad[1]["transformer.ln_f.weight"] + 1
    with pytest.raises(EngineError, match="ln_f.weight: replicated tensor differs"):
        unshard(bad, layout)
    bad = [dict(r) for r in ranks]
    qkv = bad[1]["transformer.layers.0.attention.qkv.weight"].clone()
    qkv[D] += 1  # first row of rank 1's copy of kv head 0
    bad[1]["transformer.layers.0.attention.qkv.weight"] = qkv
    with pytest.raises(EngineError, match="duplicated k head 0"):
        unshard(bad, layout)
    bad = [dict(r) for r in ranks]
    lm = bad[3]["lm_head.weight"].clone()
    lm[-1] = 1.0
    bad[3]["lm_head.weight"] = lm
    with pytest.raises(EngineError, match="padding rows"):
        unshard(bad, layout)


def test_eagle_checkpoint(src):
    tree = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    engine = build(src, "eagle_tp2", {"method": "eagle", "checkpoint": str(src["eagle"]), "tree": {"choices": tree}},
                   tp_size=2)
    cfg = trt_config(engine)
    assert cfg["architecture"] == "EagleForCausalLM"
    assert cfg["num_eagle_layers"] == 3  # the deepest choice path
    assert cfg["max_draft_len"] == 10
    assert cfg["max_non_leaves_per_layer"] == 2  # depth 1: [0] and [1] have children
    net = cfg["eagle_net_config"]
    assert net["architecture"] == "LlamaForCausalLM" and net["num_hidden_layers"] == 1
    assert (net["hidden_size"], net["num_attention_heads"], net["vocab_size"]) == (H, HEADS, VOCAB)
    assert net["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    head = export(torch.load(src["eagle"] / "pytorch_model.bin", weights_only=True))
    hf = src["hf"]
    full = open_engine(engine).read_trtllm_tensors()  # both ranks, re-assembled (EAGLE layout from config.json)
    for d in range(3):
        p = f"eagle_nets.{d}."
        assert torch.equal(full[p + "drafter.fc.weight"], head["fc.weight"])
        assert torch.equal(full[p + "drafter.fc.bias"], head["fc.bias"])
        assert torch.equal(full[p + "drafter.layers.0.attention.qkv.weight"],
                           torch.cat([head[f"layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]))
        assert torch.equal(full[p + "drafter.layers.0.mlp.fc.weight"], head["layers.0.mlp.gate_proj.weight"])
        assert torch.equal(full[p + "drafter.layers.0.mlp.gate.weight"], head["layers.0.mlp.up_proj.weight"])
        assert torch.equal(full[p + "drafter.layers.0.post_layernorm.weight"],
                           head["layers.0.post_attention_layernorm.weight"])
        assert p + "drafter.layers.0.input_layernorm.weight" not in full  # EAGLE-1: no input norm in layer 0
        assert torch.equal(full[p + "drafter.vocab_embedding.weight"], hf["model.embed_tokens.weight"])
        assert torch.equal(full[p + "lm_head.weight"], hf["lm_head.weight"])
    # fc is split over ranks on dim 0 (ColumnLinear).
    assert torch.equal(rank(engine, 1)["eagle_nets.0.drafter.fc.weight"], head["fc.weight"].chunk(2)[1])


def test_max_non_leaves_per_layer_of_mc_sim_7b_63():
    # TensorRT-LLM's EAGLE README: the minimum max_non_leaves_per_layer for mc_sim_7b_63 is 10.
    assert max_non_leaves_per_layer(Tree.preset("mc_sim_7b_63")) == 10


def test_build_scripts(src, medusa_engines):
    script = (medusa_engines[2] / "trtllm-build.sh").read_text()
    assert "trtllm-build" in script
    for flag in ('--checkpoint_dir "$CKPT"', "--speculative_decoding_mode medusa", "--max_draft_len 10",
                 "--workers 2", "--max_seq_len 512", "mpirun -n 2"):
        assert flag in script, flag
    manifest = json.loads((medusa_engines[2] / "engine.json").read_text())
    assert ast.literal_eval(manifest["trtllm"]["choices"]) == [list(p) for p in Tree.from_choices(TREE).choices]
    assert any(a.startswith("--medusa_choices=") for a in manifest["trtllm"]["run_args"])
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(medusa_engines[2] / "trtllm-build.sh")], check=True)
    lookup = build(src, "lookup", {"method": "lookup", "lookup": {"num_draft_tokens": 6}})
    script = (lookup / "trtllm-build.sh").read_text()
    assert "--speculative_decoding_mode draft_tokens_external" in script and "--max_draft_len 10" in script
    assert trt_config(lookup)["architecture"] == "LlamaForCausalLM"
    plain = build(src, "plain", {"method": "none"})
    assert "--speculative_decoding_mode" not in (plain / "trtllm-build.sh").read_text()


# ---- fidelity rules, each with its TensorRT-LLM source -----------------------------------------------------------


def test_export_dtype_rule(src, medusa_engines):
    """TensorRT-LLM's support matrices list FP16 / BF16 for Medusa (examples/medusa/README.md @0f041b7), EAGLE
    (examples/eagle/README.md @585c756, 1.x) and NGram (examples/ngram/README.md @585c756), never FP32: a float32
    build exports float16, says so, and the runtime keeps its exact float32 weights in target/."""
    engine = medusa_engines[2]
    manifest = json.loads((engine / "engine.json").read_text())
    assert manifest["dtype"] == "float32"
    assert manifest["trtllm"]["dtype"] == "float16" == trt_config(engine)["dtype"]
    assert "float16" in manifest["trtllm"]["dtype_note"] and "float32" in manifest["trtllm"]["dtype_note"]
    assert manifest["trtllm"]["dtype_note"] in (engine / "trtllm-build.sh").read_text()
    for r in range(2):
        assert {t.dtype for t in rank(engine, r).values()} == {torch.float16}
    runtime_weights = load_file(str(engine / "target" / "model.safetensors"))
    assert set(runtime_weights) == set(src["hf_float32"])
    assert all(torch.equal(runtime_weights[n], t) for n, t in src["hf_float32"].items())
    # A bfloat16 build exports bfloat16 (supported) and needs no second copy of the weights.
    bf16 = build(src, "medusa_bf16", {"method": "medusa", "checkpoint": str(src["medusa"]), "tree": {"choices": TREE}},
                 dtype="bfloat16")
    assert trt_config(bf16)["dtype"] == "bfloat16" and not (bf16 / "target").exists()
    assert {t.dtype for t in rank(bf16, 0).values()} == {torch.bfloat16}
    eagle = build(src, "eagle_f32", {"method": "eagle", "checkpoint": str(src["eagle"]), "tree": {"preset": "chain-2"}})
    assert trt_config(eagle)["eagle_net_config"]["dtype"] == "float16"


def test_export_refuses_weights_beyond_float16(src, tmp_path):
    ck = tmp_path / "big"
    shutil.copytree(src["ck"], ck)
    tensors = load_file(str(ck / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = 1e6
    from safetensors.torch import save_file

    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})
    data = {"model": {"checkpoint": str(ck)}, "draft": {"method": "none"},
            "build": {"output": str(tmp_path / "out"), "onnx": False, "max_draft_len": 0}}
    with pytest.raises(ConfigError, match=r"transformer\.layers\.1\.mlp\.proj\.weight .*float16.*bfloat16"):
        build_engine(parse_config(data, tmp_path, "big.yaml"))
    assert not (tmp_path / "out").exists()


def test_qwen2_checkpoints_carry_seq_length(tmp_path):
    """QWenConfig.from_hugging_face (tensorrt_llm/models/qwen/config.py @0428c18) writes seq_length (the HF config's,
    else 8192); a Qwen checkpoint without it fails trtllm-build with "'QWenConfig' object has no attribute
    'seq_length'" (NVIDIA/TensorRT-LLM issue #3105). MedusaConfig (tensorrt_llm/models/medusa/config.py @a4817fb)
    builds its base from QWenConfig when "qwen" is in model_type, so the Medusa export needs it too."""
    qwen = make_checkpoint(tmp_path / "qwen2", "qwen2", vocab_size=VOCAB, tie=True)
    medusa = write_medusa_head(tmp_path / "heads", H, VOCAB, num_heads=2, num_layers=1)
    drafts = {"plain": {"method": "none"}, "lookup": {"method": "lookup", "lookup": {"num_draft_tokens": 4}},
              "medusa": {"method": "medusa", "checkpoint": str(medusa), "tree": {"preset": "chain-2"}}}
    for name, draft in drafts.items():
        data = {"model": {"checkpoint": str(qwen)}, "draft": draft,
                "build": {"output": str(tmp_path / "engines" / name), "onnx": False, "max_draft_len": 8}}
        cfg = trt_config(build_engine(parse_config(data, tmp_path, f"{name}.yaml")).output)
        assert cfg["seq_length"] == 8192, name
        assert (cfg["qwen_type"], cfg["model_type"]) == ("qwen2", "qwen2"), name
        assert cfg["tie_word_embeddings"] is True and cfg["attn_bias"] is True, name


def trtllm_build_parser() -> argparse.ArgumentParser:
    """The trtllm-build flags we emit, as TensorRT-LLM declares them: tensorrt_llm/commands/build.py @65f1d15
    parse_arguments, and add_plugin_argument of tensorrt_llm/plugin/plugin.py @035b99e (str plugins take
    float16 / float32 / bfloat16 / disable, bool features enable / disable)."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--checkpoint_dir", "--output_dir"):
        p.add_argument(flag, type=str, required=True)
    for flag in ("--max_batch_size", "--max_input_len", "--max_seq_len", "--workers", "--max_draft_len"):
        p.add_argument(flag, type=int)
    p.add_argument("--speculative_decoding_mode", default=None, choices=[
        "draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle"])
    p.add_argument("--gemm_plugin", type=str, choices=["float16", "float32", "bfloat16", "disable"])
    p.add_argument("--use_paged_context_fmha", type=str, default="disable", choices=["enable", "disable"])
    return p


def run_py_parser() -> argparse.ArgumentParser:
    """The examples/run.py flags we emit, as TensorRT-LLM 1.x declares them: parse_arguments of examples/run.py
    @640403b and add_common_args of examples/utils.py @1b17f9d (1.x: --ngram_config; --prompt_lookup_config is
    gone)."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--max_output_len", type=int, required=True)
    p.add_argument("--engine_dir", type=str, default="engine_outputs")
    p.add_argument("--tokenizer_dir", default=None)
    p.add_argument("--num_beams", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=1)
    p.add_argument("--use_py_session", default=False, action="store_true")
    p.add_argument("--ngram_config", type=str, default=None)
    p.add_argument("--medusa_choices", type=str, default=None)
    p.add_argument("--eagle_choices", type=str, default=None)
    p.add_argument("--eagle_use_dynamic_tree", action="store_true")
    p.add_argument("--eagle_dynamic_tree_max_top_k", default=None, type=int)
    p.add_argument("--kv_cache_enable_block_reuse", default=True, action=argparse.BooleanOptionalAction)
    return p


def run_py_checks(args: argparse.Namespace, tp: int) -> None:
    """examples/run.py @640403b main()'s own assertions for these modes, and examples/ngram/README.md @585c756's
    device-list rule (one GPU per target rank)."""
    if args.medusa_choices is not None:
        ast.literal_eval(args.medusa_choices)
        assert args.temperature == 1.0, "Medusa should use temperature == 1.0"
        assert args.num_beams == 1
    if args.eagle_choices is not None or args.eagle_use_dynamic_tree:
        assert not args.use_py_session, "Eagle does not support py session"
        if args.eagle_use_dynamic_tree:
            assert args.eagle_dynamic_tree_max_top_k is not None and args.eagle_dynamic_tree_max_top_k > 0
            assert args.eagle_choices is None
    if args.ngram_config is not None:
        assert args.kv_cache_enable_block_reuse and not args.use_py_session
        max_draft_len, max_ngram, devices = ast.literal_eval(args.ngram_config)
        assert max_draft_len >= 1 and max_ngram >= 1 and devices == list(range(tp))


def script_lines(engine: Path) -> tuple[list[str], list[str]]:
    """(trtllm-build arguments, run.py arguments) of an engine's trtllm-build.sh, shell-parsed."""
    text = (engine / "trtllm-build.sh").read_text()
    env = {"$CKPT": "/ckpt", "$OUT": "/out", "$HERE": "/here"}
    build = text.split("trtllm-build \\\n", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    run = text.split("examples/run.py", 1)[1].split("\n", 1)[0]
    return ([env.get(a, a) for a in shlex.split(build)], [env.get(a, a) for a in shlex.split(run)])


def test_build_and_run_lines_parse_with_trtllm_argparse(src, medusa_engines, tmp_path):
    """Every trtllm-build.sh line parses with TensorRT-LLM 1.2's argparse (flag names and allowed values) and
    passes run.py's mode checks: Medusa at temperature 1.0 with top-k 1 (greedy), EAGLE without the Python
    session, NGram through --ngram_config with one device per rank and KV-cache block reuse."""
    lookup_tp2 = build(src, "lookup_tp2", {"method": "lookup", "lookup": {"num_draft_tokens": 6, "max_ngram": 3}},
                       tp_size=2)
    engines = {
        "medusa": medusa_engines[2],
        "eagle": build(src, "eagle_lines", {"method": "eagle", "checkpoint": str(src["eagle"]),
                                            "tree": {"preset": "chain-3"}}),
        "eagle2": build(src, "eagle2_lines", {"method": "eagle", "checkpoint": str(src["eagle"]),
                                              "tree": {"dynamic": {"total_tokens": 8, "depth": 3, "top_k": 2}}}),
        "lookup": lookup_tp2,
        "plain": build(src, "plain_lines", {"method": "none"}),
    }
    modes = {"medusa": "medusa", "eagle": "eagle", "eagle2": "eagle", "lookup": "draft_tokens_external", "plain": None}
    for name, engine in engines.items():
        build_argv, run_argv = script_lines(engine)
        b = trtllm_build_parser().parse_args(build_argv)
        assert b.speculative_decoding_mode == modes[name], name
        assert b.gemm_plugin == "float16", name  # the export dtype (float32 build)
        if modes[name] in ("eagle", "draft_tokens_external"):  # both READMEs: paged context FMHA on
            assert b.use_paged_context_fmha == "enable", name
        r = run_py_parser().parse_args(run_argv)
        run_py_checks(r, json.loads((engine / "engine.json").read_text())["limits"]["tp_size"])
        manifest_run = json.loads((engine / "engine.json").read_text())["trtllm"]["run_args"]
        assert run_py_parser().parse_args(["--max_output_len=1", *manifest_run]) is not None
    medusa_run = run_py_parser().parse_args(script_lines(engines["medusa"])[1])
    assert (medusa_run.temperature, medusa_run.top_k) == (1.0, 1)
    assert ast.literal_eval(run_py_parser().parse_args(script_lines(lookup_tp2)[1]).ngram_config) == [6, 3, [0, 1]]
    assert "mpirun" not in (lookup_tp2 / "trtllm-build.sh").read_text()  # NGram's run.py path is orchestrator mode
    assert "--prompt_lookup_config" not in (lookup_tp2 / "trtllm-build.sh").read_text()
    # The pre-fix lines fail these checks (the rules can fail).
    with pytest.raises(AssertionError, match="temperature == 1.0"):
        run_py_checks(run_py_parser().parse_args(["--max_output_len=1", "--medusa_choices=[[0]]",
                                                  "--temperature=0.0"]), 1)
    with pytest.raises(SystemExit):
        run_py_parser().parse_args(["--max_output_len=1", "--prompt_lookup_config=[6,3,[0]]"])
    with pytest.raises(SystemExit):
        trtllm_build_parser().parse_args(["--checkpoint_dir", "c", "--output_dir", "o", "--gemm_plugin", "auto"])
