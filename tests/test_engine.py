"""runtime.load(engine_dir): same outputs as runtime.load(hf_dir), checksums, defaults, atomic builds, inspect."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import runtime
from builder.__main__ import main
from plugins import cpu, native_build
from plugins.stream_linear import native as stream_linear
from builder.build import BuildError, build_engine
from builder.config import parse_config
from builder.inspect import inspect_engine
from runtime.draft_spec import DraftSpec, DynamicTreeOptions
from runtime.engine import EngineChecksumError, open_engine, sha256_file
from runtime.errors import ConfigError
from runtime.sampling import SamplingParams
from tests.heads import write_eagle_head, write_medusa_head
from tests.tiny import make_checkpoint, vocab_size

PROMPT = "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox"
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
GREEDY = SamplingParams(max_tokens=24)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    llama = make_checkpoint(root / "llama3", "llama3")
    qwen = make_checkpoint(root / "qwen2", "qwen2", tie=True)
    return {
        "root": root,
        "llama": llama,
        "qwen": qwen,
        "medusa": write_medusa_head(root / "medusa", 64, vocab_size(), num_heads=3),
        "eagle": write_eagle_head(root / "eagle", llama, with_embedding=True),
    }


def config(src, name, model="llama", draft=None, **b):
    data = {"model": {"checkpoint": str(src[model])}, "draft": draft or {"method": "none"},
            "build": {"output": str(src["root"] / "engines" / name), "onnx": False, "max_draft_len": 16, **b}}
    return parse_config(data, src["root"], f"{name}.yaml")


@pytest.fixture(scope="module")
def engines(src):
    medusa = {"method": "medusa", "checkpoint": str(src["medusa"]), "tree": {"choices": TREE}}
    eagle_dyn = {"method": "eagle", "checkpoint": str(src["eagle"]),
                 "tree": {"dynamic": {"total_tokens": 12, "depth": 3, "top_k": 3}}}
    eagle_static = {"method": "eagle", "checkpoint": str(src["eagle"]), "tree": {"preset": "chain-3"}}
    lookup = {"method": "lookup", "lookup": {"num_draft_tokens": 6, "max_ngram": 2}}
    out = {}
    for name, cfg in {
        "medusa": config(src, "medusa", draft=medusa),
        "medusa_tp2": config(src, "medusa_tp2", draft=medusa, tp_size=2),
        "eagle_dynamic": config(src, "eagle_dynamic", draft=eagle_dyn, tp_size=2),
        "eagle_static": config(src, "eagle_static", draft=eagle_static),
        "lookup": config(src, "lookup", draft=lookup),
        "qwen_bf16": config(src, "qwen_bf16", model="qwen", dtype="bfloat16"),
        "medusa_bf16": config(src, "medusa_bf16", draft=medusa, dtype="bfloat16"),
    }.items():
        out[name] = build_engine(cfg).output
    return out


def same_outputs(a, b, prompt=PROMPT) -> None:
    for params in (GREEDY, SAMPLED):
        ra, rb = a.generate(prompt, params), b.generate(prompt, params)
        assert ra.token_ids == rb.token_ids
        assert ra.text == rb.text
        assert ra.stats.accepted_per_step == rb.stats.accepted_per_step


@pytest.mark.parametrize("name", ["medusa", "medusa_tp2"])
def test_medusa_engine_matches_hf(src, engines, name):
    eng = runtime.load(engines[name])
    ref = runtime.load(src["llama"], draft="medusa", draft_model=src["medusa"], tree=json.dumps(TREE), max_draft_len=16)
    same_outputs(eng, ref)
    assert eng.drafter.tree == ref.drafter.tree
    for p in ("res_weight", "res_bias", "lm_weight"):
        assert torch.equal(getattr(eng.drafter.heads, p), getattr(ref.drafter.heads, p))
    for (n, a), (_, b) in zip(eng.model.state_dict().items(), ref.model.state_dict().items()):
        assert torch.equal(a, b), n
    assert eng.max_tree_nodes == 17


def test_eagle_engines_match_hf(src, engines):
    eng = runtime.load(engines["eagle_dynamic"])
    ref = runtime.load(src["llama"], draft="eagle", draft_model=src["eagle"], total_tokens=12, depth=3, top_k=3,
                       max_draft_len=16)
    assert eng.drafter.dynamic == ref.drafter.dynamic and eng.drafter.tree is None
    same_outputs(eng, ref)
    assert eng.drafter.head.embed_tokens is not None  # the head's own embedding travelled in draft/
    eng = runtime.load(engines["eagle_static"])
    ref = runtime.load(src["llama"], draft="eagle", draft_model=src["eagle"], tree="chain-3", max_draft_len=16)
    same_outputs(eng, ref)


def test_lookup_and_plain_bf16_engines_match_hf(src, engines):
    eng = runtime.load(engines["lookup"])
    ref = runtime.load(src["llama"], draft="lookup", num_draft_tokens=6, max_ngram=2, max_draft_len=16)
    assert eng.drafter.options == ref.drafter.options
    same_outputs(eng, ref)
    eng = runtime.load(engines["qwen_bf16"])  # a bfloat16 engine: float32 only where bf16 cannot run fast
    assert eng.model.dtype == (torch.bfloat16 if stream_linear.bf16_missing() is None else torch.float32)
    ref = runtime.load(src["qwen"], dtype=eng.model.config.dtype, max_draft_len=16)
    assert eng.model.config.tie_word_embeddings
    same_outputs(eng, ref)


def test_explicit_arguments_override_engine_defaults(src, engines):
    assert runtime.load(engines["medusa"], draft="none").drafter.name == "none"
    assert runtime.load(engines["medusa"], tree="chain-2").drafter.tree.choices == ((0,), (0, 0))
    dec = runtime.load(engines["eagle_dynamic"], total_tokens=5)
    assert (dec.drafter.dynamic.total_tokens, dec.drafter.dynamic.top_k) == (5, 3)  # key by key
    dec = runtime.load(engines["eagle_dynamic"], tree="chain-2")
    assert dec.drafter.dynamic is None and dec.drafter.tree.num_nodes == 3
    other = write_medusa_head(src["root"] / "medusa_other", 64, vocab_size(), num_heads=2, seed=5)
    dec = runtime.load(engines["medusa"], draft_model=other)  # another head: kind inferred, engine tree dropped
    assert dec.drafter.heads.config.num_heads == 2 and dec.drafter.tree.choices == ((0,), (0, 0))
    # The engine's max_draft_len is a limit: a larger request is capped, a smaller one honoured.
    assert runtime.load(engines["medusa"], max_draft_len=100).max_tree_nodes == 17
    assert runtime.load(engines["medusa"], max_draft_len=3).max_tree_nodes == 4
    if stream_linear.bf16_missing() is None:
        assert runtime.load(engines["medusa"], dtype="bfloat16").model.dtype == torch.bfloat16
    else:
        with pytest.raises(ConfigError, match="dtype 'bfloat16' needs a CPU that multiplies bf16 natively"):
            runtime.load(engines["medusa"], dtype="bfloat16")


@pytest.mark.parametrize("machine", ["native-bf16", "avx2", "avx2-no-compiler"])
def test_an_auto_engine_chooses_again_on_the_machine_that_loads_it(src, tmp_path, monkeypatch, machine):
    """dtype auto: the build records what it chose and why; the runtime chooses again for its own CPU (bfloat16
    wherever the weight-streaming kernel builds or bf16 is native, float32 elsewhere)."""
    built = build_engine(config(src, f"auto_{machine}", dtype="auto")).output
    m = json.loads((built / "engine.json").read_text())
    fast_here = stream_linear.bf16_missing() is None
    assert m["dtype_requested"] == "auto" and m["dtype"] == ("bfloat16" if fast_here else "float32")
    assert m["dtype_reason"].startswith("auto: ")
    native = machine == "native-bf16"
    flags = {"avx2", "fma"} | ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} if native else set())
    monkeypatch.setattr(cpu, "features", lambda: cpu.CpuFeatures(frozenset(flags), "x86_64", None))
    if machine == "avx2-no-compiler":
        monkeypatch.setenv("CC", "/nonexistent/cc")
        monkeypatch.setattr(stream_linear, "_library", native_build.Lazy(stream_linear._build))
    elif not fast_here:
        pytest.skip(f"the weight-streaming kernel does not build here: {stream_linear.unavailable()}")
    eng = open_engine(built)
    choice = eng.dtype_choice()
    assert (choice.dtype, choice.requested) == ("float32" if machine == "avx2-no-compiler" else "bfloat16", "auto")
    assert eng.dtype_choice("float32").dtype == "float32"

def copy_engine(engines, name, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(engines[name], dst)
    return dst


# A float32 engine's runtime weights are target/ (its TensorRT-LLM checkpoint is float16); a bfloat16 engine's are
# its TensorRT-LLM rank files.
@pytest.mark.parametrize("name, victim", [
    ("medusa_tp2", "target/model.safetensors"), ("medusa_tp2", "tokenizer.json"), ("medusa_tp2", "config.json"),
    ("medusa_tp2", "draft/medusa_lm_head.safetensors"), ("qwen_bf16", "trtllm_checkpoint/config.json"),
    ("qwen_bf16", "trtllm_checkpoint/rank0.safetensors")])
def test_tampered_file_is_caught_at_load(engines, tmp_path, name, victim):
    eng = copy_engine(engines, name, tmp_path)
    data = bytearray((eng / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (eng / victim).write_bytes(bytes(data))
    with pytest.raises(EngineChecksumError, match=victim.replace(".", r"\.") + r": sha256"):
        runtime.load(eng)


def test_missing_or_truncated_file_is_caught(engines, tmp_path):
    eng = copy_engine(engines, "medusa_bf16", tmp_path)
    (eng / "trtllm_checkpoint" / "rank0.safetensors").unlink()
    with pytest.raises(EngineChecksumError, match="rank0.safetensors: listed in engine.json but missing"):
        runtime.load(eng)
    eng = copy_engine(engines, "lookup", tmp_path / "b")
    path = eng / "target" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(EngineChecksumError, match="size"):
        runtime.load(eng)


@pytest.mark.parametrize("name, rel, tensor, dtype", [
    ("medusa_bf16", "trtllm_checkpoint/rank0.safetensors", "lm_head.weight", "bfloat16"),  # in the runtime dtype
    ("medusa", "target/model.safetensors", "lm_head.weight", "float32"),  # float32: TensorRT-LLM gets float16
])
def test_weights_are_read_from_the_recorded_file(src, engines, tmp_path, name, rel, tensor, dtype):
    """Edit a weight of the runtime's weight file (and re-record its checksum): the served model changes."""
    original = runtime.load(engines[name]).generate(PROMPT, GREEDY).token_ids
    eng = copy_engine(engines, name, tmp_path)
    path = eng / rel
    state = load_file(str(path))
    state[tensor][5] = 0.5
    save_file(state, str(path), metadata={"format": "pt"})
    manifest = json.loads((eng / "engine.json").read_text())
    manifest["files"][rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    (eng / "engine.json").write_text(json.dumps(manifest))
    dec = runtime.load(eng)
    # a bfloat16 engine runs as float32 only where bf16 cannot run fast (its weights' values exactly)
    assert dec.model.config.dtype == (dtype if dtype == "float32" or stream_linear.bf16_missing() is None
                                      else "float32")
    ref = runtime.load(src["llama"], draft="medusa", draft_model=src["medusa"], tree=json.dumps(TREE), max_draft_len=16,
                       dtype=dec.model.config.dtype)
    ref.model.lm_head_weight[5] = 0.5  # the same edit, made on the HF-loaded model
    same_outputs(dec, ref)
    assert dec.generate(PROMPT, GREEDY).token_ids != original


def test_engine_json_records_the_build(src, engines):
    m = json.loads((engines["eagle_dynamic"] / "engine.json").read_text())
    assert (m["format"], m["format_version"]) == ("spectree-engine", 2)
    assert m["dtype"] == "float32" and m["model"]["architecture"] == "LlamaForCausalLM"
    assert m["draft"]["method"] == "eagle" and m["draft"]["path"] == "draft"
    assert m["draft"]["tree"] == {"kind": "dynamic", "total_tokens": 12, "depth": 3, "top_k": 3}
    assert m["limits"] == {"max_seq_len": 1024, "max_draft_len": 16, "max_batch_size": 8, "tp_size": 2}
    assert m["trtllm"]["architecture"] == "EagleForCausalLM"
    assert "--eagle_use_dynamic_tree" in m["trtllm"]["run_args"]
    p = m["provenance"]
    assert p["tool"] == "spectree-builder" and len(p["config_hash"]) == 64 and p["built_at"]
    assert p["config"]["draft"]["checkpoint"] == str(src["eagle"])
    files = set(m["files"])
    assert {"config.json", "tokenizer.json", "trtllm_checkpoint/config.json", "trtllm_checkpoint/rank0.safetensors",
            "trtllm_checkpoint/rank1.safetensors", "draft/config.json", "draft/model.safetensors",
            "trtllm-build.sh"} <= files
    assert "engine.json" not in files
    for rel, entry in m["files"].items():
        assert sha256_file(engines["eagle_dynamic"] / rel) == entry["sha256"]
    assert m["onnx"]["status"] == "skipped" and "build.onnx is false" in m["onnx"]["reason"]
    eng = open_engine(engines["eagle_dynamic"])
    assert eng.model_config().max_context == 1024
    # engine.json's "draft" is a DraftSpec record; the engine's limit is its max_draft_len
    assert eng.draft == DraftSpec("eagle", path="draft", dynamic=DynamicTreeOptions(12, 3, 3), max_draft_len=16)
    assert eng.own_draft().path == str(engines["eagle_dynamic"] / "draft")


# ---- atomic builds -------------------------------------------------------------------------------------------


class InterruptAt:
    """A progress reporter that raises when a given stage starts (what Ctrl-C half-way does)."""

    def __init__(self, stage: str, exc: BaseException) -> None:
        self.target, self.exc, self.seen = stage, exc, []

    @contextmanager
    def stage(self, name, total=None, unit=""):
        self.seen.append(name)
        if name == self.target:
            raise self.exc
        yield lambda n: None

    def note(self, message):
        pass


def leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("disk full")])
def test_interrupted_build_leaves_nothing(src, tmp_path, exc):
    cfg = config(src, "x", draft={"method": "medusa", "checkpoint": str(src["medusa"])}, output=str(tmp_path / "eng"))
    progress = InterruptAt("draft weights", exc)
    with pytest.raises(type(exc)):
        build_engine(cfg, progress=progress)
    assert "TensorRT-LLM checkpoint" in progress.seen  # it got half-way: files had been written
    assert not (tmp_path / "eng").exists()
    assert leftovers(tmp_path, "eng") == []


def test_failed_rebuild_keeps_the_old_engine(src, engines, tmp_path):
    eng = copy_engine(engines, "lookup", tmp_path)
    before = {p.relative_to(eng): p.read_bytes() for p in eng.rglob("*") if p.is_file()}
    cfg = config(src, "x", draft={"method": "medusa", "checkpoint": str(src["medusa"])}, output=str(eng))
    with pytest.raises(KeyboardInterrupt):
        build_engine(cfg, force=True, progress=InterruptAt("checksums", KeyboardInterrupt()))
    after = {p.relative_to(eng): p.read_bytes() for p in eng.rglob("*") if p.is_file()}
    assert after == before and leftovers(tmp_path, eng.name) == []
    assert inspect_engine(eng).ok
    # Without --force an existing engine is refused before any work; with it, replaced whole.
    with pytest.raises(BuildError, match="already exists; pass --force"):
        build_engine(cfg)
    result = build_engine(cfg, force=True)
    assert open_engine(eng).draft.kind == "medusa" and leftovers(tmp_path, eng.name) == []
    assert not (eng / "lookup").exists() and result.output == eng


def test_force_refuses_to_replace_a_non_engine_directory(src, tmp_path):
    target = tmp_path / "home"
    target.mkdir()
    (target / "notes.txt").write_text("precious")
    with pytest.raises(BuildError, match="not an engine directory"):
        build_engine(config(src, "x", output=str(target)), force=True)
    assert (target / "notes.txt").read_text() == "precious"


# ---- inspect and the CLI ---------------------------------------------------------------------------------


def test_inspect_reports_damage(engines, tmp_path, capsys):
    eng = copy_engine(engines, "medusa", tmp_path)
    report = inspect_engine(eng)
    assert report.ok and report.unlisted == ()
    assert {f.status for f in report.files} == {"ok"}
    assert main(["inspect", str(eng)]) == 0
    out = capsys.readouterr().out
    assert "MedusaForCausalLM" in out and "rank0.safetensors" in out and "skipped" in out
    (eng / "draft" / "config.json").write_text('{"medusa_num_heads": 9}')
    (eng / "stray.txt").write_text("x")
    report = inspect_engine(eng)
    assert [(f.path, f.status) for f in report.problems] == [("draft/config.json", "size mismatch")]
    assert report.unlisted == ("stray.txt",)
    assert main(["inspect", str(eng), "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["files"]["draft/config.json"]["status"] == "size mismatch" and not summary["ok"]


def test_cli_build_prints_a_summary(src, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{checkpoint: {src['llama']}}}\n"
                   f"draft: {{method: medusa, checkpoint: {src['medusa']}, tree: {{preset: chain-2}}}}\n"
                   "build: {onnx: false, max_draft_len: 4}\n")
    out_dir = tmp_path / "out"
    assert main(["build", "--config", str(cfg), "--output", str(out_dir)]) == 0
    captured = capsys.readouterr()
    for part in ("static: 3 nodes", "rank0.safetensors", "total", "skipped", "build.onnx is false", "KiB"):
        assert part in captured.out, part
    for stage in ("validate config", "TensorRT-LLM checkpoint", "draft weights", "checksums"):  # progress, stderr
        assert f"done {stage}" in captured.err, stage
    assert main(["build", "--config", str(cfg), "--output", str(out_dir), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert runtime.load(out_dir).drafter.tree.num_nodes == 3
    assert os.access(out_dir / "trtllm-build.sh", os.X_OK)


def test_runtime_cli_serves_an_engine_directory(src, engines, capsys):
    from runtime.__main__ import main as runtime_main

    assert runtime_main(["generate", "--model", str(engines["medusa"]), "--prompt", PROMPT, "--max-tokens", "8",
                         "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = runtime.load(src["llama"], draft="medusa", draft_model=src["medusa"], tree=json.dumps(TREE), max_draft_len=16)
    assert out["token_ids"] == list(ref.generate(PROMPT, SamplingParams(max_tokens=8)).token_ids)
    assert out["stats"]["drafter"] == "medusa"
