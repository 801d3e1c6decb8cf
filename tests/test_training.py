"""Training at toy size: the target loop (loss falls, resumable, checkpoint loads in the runtime) and the draft
heads (loss falls, public formats load back through runtime.drafters and the reference module structures, the
runtime computes exactly what was trained)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from builder.config import BuildConfigError
from builder.drafters.eagle import EagleTrainHead, eagle_layer_config
from builder.train_heads import (
    load_frozen_target,
    target_outputs,
    train_heads,
)
from builder.train_target import train_target
from builder.training.config import parse_train_config
from builder.training.corpus import (
    held_out_prompts,
    is_held_out,
    split_corpus,
)
from builder.training.loop import ResumeError
from runtime.drafters.eagle import load_eagle_head
from runtime.drafters.medusa import load_medusa_heads
from runtime.errors import ConfigError
from runtime.model import TargetModel, causal_mask
from runtime.tokenizer import Tokenizer
from tests import heads as ref_heads

WORDS = ("alpha", "beta", "gamma", "delta", "value", "index", "result", "items", "count", "name")


def _write_corpus(root: Path, files: int = 24) -> Path:
    """Small deterministic Python-like files: enough structure for a toy model to learn quickly."""
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for f in range(files):
        lines = []
        for i in range(40):
            a, b = (WORDS[int(j)] for j in torch.randint(0, len(WORDS), (2,), generator=g))
            lines.append(f"def {a}_{i}({b}):\n    return {b} + {i % 7}\n")
        (root / f"mod{f:02d}.py").write_text("".join(lines), encoding="utf-8")
    return root


def _train(**over):
    d = {"max_steps": 30, "batch_size": 4, "seq_len": 32, "eval_every": 10, "eval_batches": 2, "warmup_steps": 2,
         "lr": 1e-2, "checkpoint_every": 10, "threads": 1}
    d.update(over)
    return d


def _events(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == kind]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


def _target_cfg(corpus: Path, out: Path, **train) -> dict:
    return {
        "corpus": {"source": "files", "path": str(corpus), "pattern": "*.py", "held_out": 0.25},
        "target": {"output": str(out / "target"), "work_dir": str(out / "work"), "vocab_size": 300,
                   "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "max_position_embeddings": 64, "save_dtype": "float32",
                   "train": _train(**train)},
    }


def test_split_is_fixed_per_file(corpus):
    split = split_corpus(parse_train_config(_target_cfg(corpus, corpus.parent)).corpus)
    assert split.train and split.held_out
    assert {f.rel for f in split.held_out} == {f.rel for f in split.train + split.held_out if is_held_out(f.rel, 0.25)}
    assert not {f.rel for f in split.train} & {f.rel for f in split.held_out}


def test_held_out_prompts_are_disjoint_code_snippets(corpus):
    split = split_corpus(parse_train_config(_target_cfg(corpus, corpus.parent)).corpus)
    cal, ev = held_out_prompts(split, "calibration"), held_out_prompts(split, "evaluation")
    assert len(cal) == len(ev) == len(split.held_out) and not set(cal) & set(ev)
    held = "".join(f.path.read_text() for f in split.held_out)
    assert all(p.startswith("def ") and p in held and len(p) <= 320 for p in cal + ev)
    with pytest.raises(ConfigError, match="part must be"):
        held_out_prompts(split, "train")


def test_target_trains_resumes_and_loads_in_the_runtime(corpus, tmp_path):
    cfg = parse_train_config(_target_cfg(corpus, tmp_path))
    result = train_target(cfg, quiet=True)
    log = tmp_path / "work" / "training_log.jsonl"
    evals = [e["held_out_loss"] for e in _events(log, "eval")]
    assert len(evals) == 3
    assert evals[-1] < evals[0] - 0.5 and result.held_out_loss < math.log(300) - 1.5
    steps = _events(log, "step")
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0

    # The checkpoint is a real HF checkpoint the runtime loads; its logits equal transformers'.
    from transformers import LlamaForCausalLM

    out = tmp_path / "target"
    model = TargetModel.from_pretrained(out)
    tok = Tokenizer.from_dir(out)
    text = "def alpha_3(beta):\n    return beta + 3\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 0 and tok.decode(ids[1:]) == text
    x = torch.tensor([ids])
    ours, _ = model.prefill(x, model.new_cache(len(ids)))
    ref = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    torch.testing.assert_close(ours, ref(input_ids=x).logits, atol=1e-4, rtol=1e-4)
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 30 and (out / "training_log.jsonl").is_file()
    assert Path(summary["output"]).resolve() == out.resolve()  # outside the working directory: absolute
    assert summary["held_out_windows_full"] >= 1 and abs(summary["held_out_loss_full"] - result.held_out_loss) < 1.0

    # Resume: a larger step budget continues from the saved state instead of starting over.
    cfg2 = parse_train_config(_target_cfg(corpus, tmp_path, max_steps=40))
    assert train_target(cfg2, quiet=True).steps == 40
    assert [e["step"] for e in _events(log, "resume")] == [30]
    # A different model shape must not silently resume the old state.
    bad = _target_cfg(corpus, tmp_path)
    bad["target"]["hidden_size"] = 64
    with pytest.raises(ResumeError, match="different configuration"):
        train_target(parse_train_config(bad), quiet=True)


def test_shown_path_is_relative_inside_the_working_directory(tmp_path, monkeypatch):
    """Committed summaries and reports record repository paths relatively, not one machine's absolute layout."""
    from runtime.files import shown_path

    (tmp_path / "demo" / "target").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert shown_path(tmp_path / "demo" / "target") == str(Path("demo") / "target")
    assert shown_path("demo/target") == str(Path("demo") / "target")
    outside = tmp_path.parent / "elsewhere"
    assert shown_path(outside) == str(outside)


def test_bad_training_configs_name_the_key(corpus, tmp_path):
    base = _target_cfg(corpus, tmp_path)
    with pytest.raises(BuildConfigError, match=r"corpus.held_out: got 1.5"):
        parse_train_config({**base, "corpus": {**base["corpus"], "held_out": 1.5}})
    with pytest.raises(BuildConfigError, match=r"target.train.seq_len: got 128"):
        parse_train_config({**base, "target": {**base["target"], "train": _train(seq_len=128)}})
    with pytest.raises(BuildConfigError, match=r"target.num_key_value_heads"):
        parse_train_config({**base, "target": {**base["target"], "num_key_value_heads": 3}})
    with pytest.raises(BuildConfigError, match=r"target.train.lrr: unknown key"):
        parse_train_config({**base, "target": {**base["target"], "train": {"lrr": 1.0}}})
    # bounds are declared on the fields: the error names the whole key path (heads.medusa.train, not train)
    with pytest.raises(BuildConfigError, match=r"target.train.min_lr_ratio: got 1.5, expected a number in \[0, 1\]"):
        parse_train_config({**base, "target": {**base["target"], "train": _train(min_lr_ratio=1.5)}})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="0 training and 0 held-out"):
        split_corpus(parse_train_config({**base, "corpus": {**base["corpus"], "path": str(empty)}}).corpus)


@pytest.fixture(scope="module")
def tiny_target(corpus, tmp_path_factory) -> Path:
    """A toy target trained on the corpus (heads can only learn to agree with a target that has structure)."""
    out = tmp_path_factory.mktemp("toy")
    train_target(parse_train_config(_target_cfg(corpus, out, max_steps=60)), quiet=True)
    return out / "target"


def _heads_cfg(corpus: Path, target: Path, out: Path, labels: str = "target", dtype: str = "float32") -> dict:
    return {
        "corpus": {"source": "files", "path": str(corpus), "pattern": "*.py", "held_out": 0.25},
        "heads": {"target": str(target), "work_dir": str(out / "work"), "labels": labels, "save_dtype": dtype,
                  "medusa": {"output": str(out / "medusa"), "num_heads": 3, "num_layers": 1,
                             "train": _train(max_steps=60, lr=1e-2)},
                  "eagle": {"output": str(out / "eagle"), "feature_noise": 0.01,
                            "train": _train(max_steps=40, lr=3e-3)}},
    }


def test_heads_train_and_load_back_in_public_formats(corpus, tiny_target, tmp_path):
    results = {r.kind: r for r in train_heads(parse_train_config(_heads_cfg(corpus, tiny_target, tmp_path)),
                                              quiet=True)}
    assert set(results) == {"medusa", "eagle"}
    for kind in ("medusa", "eagle"):
        steps = _events(tmp_path / "work" / f"{kind}_log.jsonl", "step")
        assert steps[-1]["loss"] < 0.9 * steps[0]["loss"], (kind, steps[0], steps[-1])
        assert len(results[kind].metrics["top1"]) == (3 if kind == "medusa" else 4)
        assert (tmp_path / kind / "training_log.jsonl").is_file()
    # Training gets depth-1 agreement with the target far above chance (vocab 300).
    assert results["medusa"].metrics["top1"][0] > 0.25 and results["eagle"].metrics["top1"][0] > 0.4

    model = TargetModel.from_pretrained(tiny_target)
    ids = torch.tensor([[0] + Tokenizer.from_dir(tiny_target).encode("def beta_4(gamma):\n    return gamma", False)])
    n = ids.shape[1]
    target = load_frozen_target(tiny_target)
    hidden, _ = target_outputs(target, ids)
    # The features the heads were trained on are the runtime's hidden states (final-norm output).
    _, rt_hidden = model.prefill(ids, model.new_cache(n))
    torch.testing.assert_close(rt_hidden, hidden, atol=1e-4, rtol=1e-4)

    # Medusa: FasterDecoding's own module structure loads the file strictly, and the runtime agrees with it.
    medusa_dir = tmp_path / "medusa"
    cfg = json.loads((medusa_dir / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, 1)
    reference = ref_heads.load_medusa_reference(medusa_dir)
    runtime_heads = load_medusa_heads(medusa_dir)
    got = runtime_heads(hidden[0])  # [3, n, V]
    for i, head in enumerate(reference):
        torch.testing.assert_close(got[i], head(hidden[0]), atol=1e-4, rtol=1e-4)

    # EAGLE: same keys as an EAGLE-1 checkpoint for this target; the runtime head computes the trained function.
    eagle_dir = tmp_path / "eagle"
    state = torch.load(eagle_dir / "pytorch_model.bin", weights_only=True)
    ref_dir = ref_heads.write_eagle_head(tmp_path / "ref_eagle", tiny_target)
    assert set(state) == set(torch.load(ref_dir / "pytorch_model.bin", weights_only=True))
    head_rt = load_eagle_head(eagle_dir, model)
    trained = EagleTrainHead(eagle_layer_config(target.config))
    trained.load_state_dict(state, strict=False)
    assert set(trained.eagle_state_dict()) == set(state)
    embeds = model.embed(ids[:, 1:])  # x_{t+1}
    with torch.no_grad():
        want = trained(embeds, hidden[:, :-1])
    cache = head_rt.new_cache(n)
    got = head_rt(embeds, hidden[:, :-1], torch.arange(n - 1)[None], cache, causal_mask(n - 1))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_eagle_training_time_test_sees_what_tree_drafting_sees(tiny_target):
    """Oracle: run s of `unrolled` at time j equals the plain causal head run over the branch a depth-(s+1) tree
    node sits on: exact features at times <= j - s, then the nodes of runs 1..s, each fed its parent's prediction."""
    torch.manual_seed(0)
    head = EagleTrainHead(eagle_layer_config(load_frozen_target(tiny_target).config)).eval()
    hsz = head.fc.out_features
    embeds, feats = torch.randn(2, 12, hsz), torch.randn(2, 12, hsz)
    with torch.no_grad():
        runs = head.unrolled(embeds, feats, 3)
        torch.testing.assert_close(runs[0], head(embeds, feats), atol=1e-5, rtol=1e-5)
        for s in (1, 2):
            for j in range(s, 12):
                branch = [runs[r - 1][:, j - s + r - 1:j - s + r] for r in range(1, s + 1)]
                want = head(embeds[:, :j + 1], torch.cat([feats[:, :j - s + 1], *branch], dim=1))[:, -1]
                torch.testing.assert_close(runs[s][:, j], want, atol=1e-5, rtol=1e-5)
        # Negative control: the naive unroll (every earlier position on predicted features too) differs.
        naive = head(embeds, torch.cat([feats[:, :1], runs[0][:, :-1]], dim=1))
        assert not torch.allclose(naive[:, 3:], runs[1][:, 3:], atol=1e-3)


def test_eagle_training_time_test_trains_and_resumes(corpus, tiny_target, tmp_path):
    cfg = _heads_cfg(corpus, tiny_target, tmp_path)
    cfg["heads"]["eagle"]["train"] = _train(max_steps=20, lr=3e-3)
    (first,) = train_heads(parse_train_config(cfg), only="eagle", quiet=True)
    # Switching the training-time test on extends the run: the state resumes (same fingerprint) and steps 20..
    # train three runs per window.
    cfg["heads"]["eagle"].update(unroll=3, unroll_from=20)
    cfg["heads"]["eagle"]["train"] = _train(max_steps=40, lr=3e-3)
    (second,) = train_heads(parse_train_config(cfg), only="eagle", quiet=True)
    steps = _events(tmp_path / "work" / "eagle_log.jsonl", "step")
    assert second.steps == 40 and first.steps == 20
    assert all("ce_3" not in e for e in steps if e["step"] <= 20) and all("ce_3" in e for e in steps if e["step"] > 20)
    assert all(math.isfinite(e["ce_3"]) and math.isfinite(e["regression_3"]) for e in steps if e["step"] > 20)
    assert len(second.metrics["top1"]) == 4 and second.metrics["top1"][0] > 0.4
    with pytest.raises(BuildConfigError, match="heads.eagle.unroll"):
        parse_train_config({**cfg, "heads": {**cfg["heads"], "eagle": {**cfg["heads"]["eagle"], "unroll": 0}}})


def test_heads_bf16_and_data_labels(corpus, tiny_target, tmp_path):
    cfg = _heads_cfg(corpus, tiny_target, tmp_path, labels="data", dtype="bfloat16")
    cfg["heads"]["medusa"]["train"] = _train(max_steps=5)
    (result,) = train_heads(parse_train_config(cfg), only="medusa", quiet=True)
    heads = load_medusa_heads(tmp_path / "medusa")
    assert result.kind == "medusa" and heads.lm_weight.dtype == torch.bfloat16
    with pytest.raises(BuildConfigError, match="heads: none of medusa, eagle, eagle3 is configured"):
        parse_train_config({**cfg, "heads": {k: v for k, v in cfg["heads"].items() if k not in ("medusa", "eagle")}})



def test_head_state_does_not_resume_against_a_retrained_target(corpus, tiny_target, tmp_path):
    """A head run's saved state belongs to one target's weights: after the target changes, resuming must refuse
    (pass --fresh) rather than continue heads fitted to the old target's features."""
    import shutil

    from safetensors.torch import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = _heads_cfg(corpus, target, tmp_path)
    cfg["heads"]["medusa"]["train"] = _train(max_steps=3)
    train_heads(parse_train_config(cfg), only="medusa", quiet=True)
    cfg["heads"]["medusa"]["train"] = _train(max_steps=5)
    assert train_heads(parse_train_config(cfg), only="medusa", quiet=True)[0].steps == 5  # same target: resumes

    weights = target / "model.safetensors"
    state = load_file(weights)
    name = next(k for k in state if k.endswith("mlp.down_proj.weight"))
    state[name] = state[name] * 1.01
    save_file(state, weights, metadata={"format": "pt"})
    cfg["heads"]["medusa"]["train"] = _train(max_steps=8)
    with pytest.raises(ResumeError, match="different configuration"):
        train_heads(parse_train_config(cfg), only="medusa", quiet=True)
    assert train_heads(parse_train_config(cfg), only="medusa", fresh=True, quiet=True)[0].steps == 8

def test_cli_train_target_and_heads(corpus, tmp_path):
    import yaml

    from builder.__main__ import main as builder_main

    cfg = _target_cfg(corpus, tmp_path, max_steps=20)
    cfg["heads"] = _heads_cfg(corpus, tmp_path / "target", tmp_path)["heads"]
    for kind in ("medusa", "eagle"):
        cfg["heads"][kind]["train"] = _train(max_steps=5)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert builder_main(["train-target", "--config", str(path), "--quiet"]) == 0
    assert builder_main(["train-heads", "--config", str(path), "--only", "eagle", "--quiet"]) == 0
    assert (tmp_path / "eagle" / "pytorch_model.bin").is_file() and not (tmp_path / "medusa").exists()
    assert builder_main(["train-heads", "--config", str(tmp_path / "missing.yaml")]) == 2
