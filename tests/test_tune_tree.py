"""tune-tree: acceptance counting by depth and rank, and an end-to-end run whose written config builds and decodes
exactly like plain greedy decoding."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import builder.tune_tree
import runtime
from builder.__main__ import main as builder_main
from builder.build import build_engine
from builder.config import BuildConfigError, load_config
from builder.plan import plan_build
from builder.train_heads import train_heads
from builder.train_target import train_target
from builder.training.config import parse_train_config
from builder.tune_tree import (
    AcceptanceCounts,
    TuneSettings,
    comb_tree,
    read_prompts,
    tune,
    write_choices,
)
from runtime.errors import ConfigError
from runtime.protocol import Draft
from runtime.tree import Tree
from tests.test_training import _heads_cfg, _target_cfg, _write_corpus


def test_comb_tree_shape():
    t = comb_tree(3, 2)
    assert t.num_nodes == 7 and t.max_depth == 2
    assert set(t.choices) == {(0,), (1,), (2,), (0, 0), (0, 1), (0, 2)}


def test_acceptance_counts():
    tree = comb_tree(3, 2)  # canonical order: root, (0,), (1,), (2,), (0,0), (0,1), (0,2)
    tokens = torch.tensor([9, 10, 11, 12, 20, 21, 22])
    c = AcceptanceCounts(3, 2)
    c.record(Draft(tree, tokens), [9, 10, 21])  # rank 0 at depth 1, rank 1 at depth 2 (a leaf: nothing below)
    c.record(Draft(tree, tokens), [9, 12])  # rank 2 at depth 1, a leaf
    c.record(Draft(tree, tokens), [9])  # nothing accepted at depth 1
    c.record(Draft(tree, tokens), [9, 10])  # depth-1 rank 0, then none of its children
    np.testing.assert_array_equal(c.trials, [4, 2])
    np.testing.assert_array_equal(c.hits, [[2, 0, 1], [0, 1, 0]])
    np.testing.assert_allclose(c.table(), [[0.5, 0, 0.25], [0, 0.5, 0]])


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A toy target and heads trained by the real tools (random heads would never be accepted)."""
    root = tmp_path_factory.mktemp("tune")
    corpus = _write_corpus(root / "corpus")
    train_target(parse_train_config(_target_cfg(corpus, root, max_steps=60)), quiet=True)
    cfg = _heads_cfg(corpus, root / "target", root)
    train_heads(parse_train_config(cfg), quiet=True)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def alpha_1(beta):\n", "def gamma_5(")))
    return {"root": root, "target": root / "target", "medusa": root / "medusa", "eagle": root / "eagle",
            "prompts": prompts}


def _config(setup, method: str) -> Path:
    path = setup["root"] / f"{method}.yaml"
    path.write_text(f"model: {{checkpoint: target}}\ndraft: {{method: {method}, checkpoint: {method}}}\n"
                    f"build: {{dtype: float32, max_draft_len: 12, onnx: false, output: engines/{method}}}\n")
    return path


# At toy size every module call is Python overhead, so an EAGLE step (a head forward per depth) cannot beat plain
# decoding on tokens/s; it is tuned for tau (acceptance alone) here.
@pytest.mark.parametrize("method,objective", [("medusa", "tokens_per_s"), ("eagle", "tau")])
def test_tune_writes_a_config_that_builds_and_is_lossless(setup, method, objective, tmp_path):
    cfg_path = _config(setup, method)
    prompts = read_prompts(setup["prompts"])
    # Whether the toy tree beats plain decoding is a timing on a shared 2-core host: the choice is checked, not the
    # speed (require_speedup's refusal is tested with a plain step made artificially fast, below).
    settings = TuneSettings(max_tokens=12, width=3, depth=2, max_nodes=8, grid=(1, 2, 4, 8), timing_prompts=1,
                            objective=objective, require_speedup=False)
    result = tune(load_config(cfg_path), prompts, settings)
    assert len(result.acceptance) == 2 and all(len(r) == 3 for r in result.acceptance)
    assert sum(result.trials) > 0 and result.calibration["counted_steps"] > 0
    best = result.best
    assert 2 <= best.num_nodes <= 8 and best.depth <= 2 and best.tokens_per_s > 0
    if objective == "tokens_per_s":
        # The model's best few were re-timed beside plain decoding; the fastest measured one was chosen.
        final = result.calibration["finalists"]
        assert "plain" in final and best.name in final and len(final) >= 2
        assert best.measured_tokens_per_s == max(v["tokens_per_s"] for k, v in final.items() if k != "plain")
        assert result.plain.measured_tokens_per_s == final["plain"]["tokens_per_s"]
        assert best.speedup(result.plain) > 0
        predicted_best = max(result.candidates, key=lambda c: c.tokens_per_s)
        assert predicted_best.name in final
    else:
        assert best.expected == pytest.approx(max(c.expected for c in result.candidates)) and best.expected > 1.2
    assert {c.name for c in result.references} == set()  # mc_sim (depth 4) and chains > 2 do not fit depth 2

    out = tmp_path / f"{method}-tuned.yaml"
    written = write_choices(cfg_path, best.choices, out, "tuned")
    assert written.draft.tree.choices == best.choices
    assert out.read_text().startswith("# tune-tree: tuned")
    plan = plan_build(written, require_output=False)
    assert plan.draft.static_tree is not None and plan.draft.static_tree.choices == best.choices
    engine = build_engine(written.with_output(tmp_path / "engine"))
    manifest = json.loads((engine.output / "engine.json").read_text())
    assert [tuple(p) for p in manifest["draft"]["tree"]["choices"]] == list(best.choices)

    # The tuned tree decodes exactly like plain greedy decoding.
    spec = runtime.load(setup["target"], draft=method, draft_model=setup[method], tree=json.dumps([list(p) for p in best.choices]))
    plain = runtime.load(setup["target"])
    for p in prompts:
        assert spec.generate(p, max_tokens=16).token_ids == plain.generate(p, max_tokens=16).token_ids


def test_tuning_for_speed_refuses_trees_slower_than_plain_decoding(setup, monkeypatch):
    """require_speedup (the CLI's default): when the timed finalists all run slower than plain decoding (here plain's
    measured rate is made 100x what it was), tuning for tokens/s stops with an error that says what to do."""
    real = builder.tune_tree.time_trees

    def plain_made_fast(*args, **kwargs):
        out = real(*args, **kwargs)
        out["plain"] = dataclasses.replace(out["plain"], tokens_per_s=100 * out["plain"].tokens_per_s)
        return out

    monkeypatch.setattr(builder.tune_tree, "time_trees", plain_made_fast)
    settings = TuneSettings(max_tokens=12, width=3, depth=2, max_nodes=8, grid=(1, 2, 4, 8), timing_prompts=1)
    assert settings.require_speedup and settings.objective == "tokens_per_s"
    with pytest.raises(BuildConfigError, match="no draft tree beats plain decoding on this machine.*--even-if-slower"):
        tune(load_config(_config(setup, "medusa")), read_prompts(setup["prompts"]), settings)


def test_cli_and_errors(setup, tmp_path):
    cfg_path = _config(setup, "medusa")
    out, report = tmp_path / "tuned.yaml", tmp_path / "report.json"
    rc = builder_main(["tune-tree", "--config", str(cfg_path), "--prompts", str(setup["prompts"]), "--output", str(out),
                       "--report", str(report), "--max-tokens", "10", "--width", "2", "--depth", "2",
                       "--max-nodes", "6", "--timing-prompts", "1", "--even-if-slower"])
    assert rc == 0
    rep = json.loads(report.read_text())
    assert rep["method"] == "medusa" and rep["best"]["choices"] == [list(p) for p in load_config(out).draft.tree.choices]
    Tree.from_choices([tuple(p) for p in rep["best"]["choices"]])

    lookup = tmp_path / "lookup.yaml"
    lookup.write_text(f"model: {{checkpoint: {setup['target']}}}\ndraft: {{method: lookup}}\n")
    with pytest.raises(BuildConfigError, match="draft.method: got 'lookup', expected 'medusa' or 'eagle3' or 'eagle'"):
        tune(load_config(lookup), ["x"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: unknown key\(s\) \['text'\]"):
        read_prompts(bad)
    assert builder_main(["tune-tree", "--config", str(lookup), "--prompts", str(setup["prompts"])]) == 2
    with pytest.raises(BuildConfigError, match="width: got 0, expected an integer >= 1"):
        TuneSettings(width=0)
    with pytest.raises(BuildConfigError, match="objective: got 'speed', expected one of 'tokens_per_s', 'tau'"):
        TuneSettings(objective="speed")
