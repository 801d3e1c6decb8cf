"""Build configs: YAML -> typed dataclasses, errors naming key / value / expectation, checks against checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from builder.__main__ import main
from builder.config import (
    BuildConfig,
    BuildConfigError,
    BuildSection,
    DraftSection,
    load_config,
    parse_config,
)
from builder.plan import plan_build
from runtime.api import LoadConfig
from runtime.draft_spec import DynamicTreeOptions, LookupOptions
from tests.heads import write_eagle_head, write_medusa_head
from tests.tiny import make_checkpoint, vocab_size

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    llama = make_checkpoint(root / "llama", "llama2")
    qwen = make_checkpoint(root / "qwen", "qwen2")
    v = vocab_size()
    return {
        "root": root,
        "llama": llama,
        "qwen": qwen,
        "medusa3": write_medusa_head(root / "medusa3", 64, v, num_heads=3),
        "medusa_h32": write_medusa_head(root / "medusa_h32", 32, v, num_heads=3),
        "eagle": write_eagle_head(root / "eagle", llama),
        "eagle_qwen": write_eagle_head(root / "eagle_qwen", qwen),
        "eagle_badvocab": write_eagle_head(root / "eagle_badvocab", llama, config_overrides={"vocab_size": v + 5}),
    }


def write_yaml(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def parse(text: str, base: Path = Path("/base")) -> BuildConfig:
    return parse_config(yaml.safe_load(text), base, "x.yaml")


# ---- parsing ----------------------------------------------------------------------------------------------


def test_example_configs_parse():
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert len(files) >= 4
    methods = set()
    for f in files:
        cfg = load_config(f)
        methods.add(cfg.draft.method)
        assert cfg.model.checkpoint.is_absolute()
        assert cfg.model.checkpoint.is_relative_to(REPO)  # "../checkpoints/x" from configs/ stays in the repo
        assert cfg.build.output is not None and cfg.build.output.is_relative_to(REPO / "engines")
        assert cfg.source == str(f)
    assert methods == {"medusa", "eagle", "lookup", "none"}


def test_defaults_come_from_the_dataclasses():
    cfg = parse("model: {checkpoint: ck}")
    assert cfg.draft == DraftSection()
    assert cfg.build == BuildSection()
    assert cfg.build.max_draft_len == LoadConfig.max_draft_len
    assert cfg.model.checkpoint == Path("/base/ck")
    # Drafter option dataclasses are the runtime's own: their defaults are not restated here.
    cfg = parse("model: {checkpoint: ck}\ndraft: {method: eagle, checkpoint: h, tree: {dynamic: {top_k: 4}}}")
    assert cfg.draft.tree.dynamic == DynamicTreeOptions(top_k=4)
    cfg = parse("model: {checkpoint: ck}\ndraft: {method: lookup, lookup: {max_ngram: 5}}")
    assert cfg.draft.lookup == LookupOptions(max_ngram=5)


def test_paths_resolve_from_the_config_file(tmp_path):
    path = write_yaml(tmp_path / "configs" / "a.yaml",
                      {"model": {"checkpoint": "../ck"}, "build": {"output": "out/e", "tp_size": 2}})
    cfg = load_config(path)
    assert cfg.model.checkpoint == (tmp_path / "ck").resolve()
    assert cfg.build.output == (tmp_path / "configs" / "out" / "e").resolve()
    assert cfg.build.tp_size == 2
    assert cfg.with_output(tmp_path / "x").build.output == (tmp_path / "x").resolve()


def test_config_is_frozen_and_hash_ignores_output():
    a = parse("model: {checkpoint: ck}\nbuild: {output: a}")
    b = parse("model: {checkpoint: ck}\nbuild: {output: b}")
    c = parse("model: {checkpoint: ck}\nbuild: {output: a, tp_size: 2}")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.build.tp_size = 4  # type: ignore[misc]
    assert a.config_hash() == b.config_hash() != c.config_hash()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("model: {checkpoint: ck}\nbuild: {tp: 2}", ["build.tp", "unknown key", "2", "tp_size"]),
        ("model: {checkpoint: ck}\nbuild: {tp_size: '2'}", ["build.tp_size", "'2'", "an integer"]),
        ("model: {checkpoint: ck}\nbuild: {tp_size: true}", ["build.tp_size", "True", "an integer"]),
        ("model: {checkpoint: ck}\nbuild: {tp_size: 0}", ["build.tp_size", "0", ">= 1"]),
        ("model: {checkpoint: ck}\nbuild: {dtype: fp8}", ["build.dtype", "'fp8'", "'float16'"]),
        ("model: {checkpoint: ck}\nbuild: {onnx: 'yes'}", ["build.onnx", "'yes'", "true or false"]),
        ("model: {checkpoint: ck}\nbuild: {max_seq_len: 8, max_draft_len: 8}", ["build.max_draft_len", "8", "7"]),
        ("model: {checkpoint: 3}", ["model.checkpoint", "3", "a path"]),
        ("model: {}", ["model.checkpoint", "missing"]),
        ("draft: {method: none}", ["model", "missing"]),
        ("[1, 2]", ["<top level>", "[1, 2]", "a mapping with keys model, draft, build"]),
        ("model: {checkpoint: ck}\ndraft: {method: medusaa}", ["draft.method", "'medusaa'", "one of medusa, eagle"]),
        ("model: {checkpoint: ck}\ndraft: {method: medusa}", ["draft.checkpoint", "required", "'medusa'"]),
        ("model: {checkpoint: ck}\ndraft: {method: none, checkpoint: h}", ["draft.checkpoint", "'none'"]),
        ("model: {checkpoint: ck}\ndraft: {method: eagle, checkpoint: h, tree: {choices: [[0], [0, a]]}}",
         ["draft.tree.choices[1][1]", "'a'", "an integer"]),
        ("model: {checkpoint: ck}\ndraft: {method: eagle, checkpoint: h, tree: {choices: [[0], [1, 0]]}}",
         ["draft.tree", "[1, 0]", "no parent"]),
        ("model: {checkpoint: ck}\ndraft: {method: eagle, checkpoint: h, tree: {choices: [[0], [-1]]}}",
         ["draft.tree", "-1", ">= 0"]),
        ("model: {checkpoint: ck}\ndraft: {method: eagle, checkpoint: h, tree: {preset: mc_sim_7b_64}}",
         ["draft.tree", "'mc_sim_7b_64'", "mc_sim_7b_63"]),
        ("model: {checkpoint: ck}\ndraft: {method: eagle, checkpoint: h, tree: {preset: chain-2, choices: [[0]]}}",
         ["draft.tree", "exactly one of preset, choices, dynamic", "preset, choices"]),
        ("model: {checkpoint: ck}\ndraft: {method: eagle, checkpoint: h, tree: {dynamic: {top_k: 0}}}",
         ["draft.tree.dynamic", "top_k", "0", ">= 1"]),
        ("model: {checkpoint: ck}\ndraft: {method: eagle, checkpoint: h, tree: {dynamic: {topk: 3}}}",
         ["draft.tree.dynamic.topk", "unknown key", "top_k"]),
        ("model: {checkpoint: ck}\ndraft: {method: medusa, checkpoint: h, tree: {dynamic: {top_k: 3}}}",
         ["draft.tree.dynamic", "Medusa needs a static tree"]),
        ("model: {checkpoint: ck}\ndraft: {method: lookup, tree: {preset: chain-2}}", ["draft.tree", "'lookup'"]),
        ("model: {checkpoint: ck}\ndraft: {method: lookup, lookup: {min_ngram: 4, max_ngram: 2}}",
         ["draft.lookup", "min_ngram (4)", "max_ngram (2)"]),
        ("model: {checkpoint: ck}\ndraft: {method: none, lookup: {max_ngram: 2}}", ["draft.lookup", "'none'"]),
        ("model: {checkpoint: ck}\ndraft: {method: eagle, checkpoint: h, pruning: {min_path_prob: 2}}",
         ["draft.pruning.min_path_prob", "2", "[0, 1]"]),
        ("model: {checkpoint: ck}\ndraft: {method: eagle, checkpoint: h, pruning: {min_prob: 0.1}}",
         ["draft.pruning.min_prob", "unknown key", "min_path_prob"]),
        ("model: {checkpoint: ck}\ndraft: {method: medusa, checkpoint: h, pruning: {min_path_prob: 0.1}}",
         ["draft.pruning", "EAGLE's", "'medusa'"]),
    ],
)
def test_bad_configs_name_key_value_and_expectation(text, expected):
    with pytest.raises(BuildConfigError) as info:
        parse(text)
    message = str(info.value)
    assert message.startswith("x.yaml: ")
    for part in expected:
        assert part in message, (part, message)


# ---- checks against the checkpoints ------------------------------------------------------------------------


def config_for(ckpts, draft=None, **build) -> BuildConfig:
    data = {"model": {"checkpoint": str(ckpts["llama"])}, "build": {"output": str(ckpts["root"] / "out"), **build}}
    if draft is not None:
        data["draft"] = draft
    return parse_config(data, ckpts["root"], "t.yaml")


def test_plan_resolves_drafter_defaults(ckpts):
    plan = plan_build(config_for(ckpts, {"method": "medusa", "checkpoint": str(ckpts["medusa3"])}, max_draft_len=10))
    # The drafter's own default for 3 heads (fewer than mc_sim_7b_63's depth): a chain as deep as the heads.
    assert plan.draft.static_tree.choices == ((0,), (0, 0), (0, 0, 0))
    assert plan.draft.path == str(ckpts["medusa3"]) and plan.draft.max_draft_len == 10
    assert plan.max_seq_len == 512 and plan.dtype == "float32"
    plan = plan_build(config_for(ckpts, {"method": "eagle", "checkpoint": str(ckpts["eagle"])}, dtype="bfloat16"))
    assert plan.draft.static_tree is None and plan.draft.dynamic == DynamicTreeOptions()
    assert plan.dtype == "bfloat16" and plan.model.dtype == "bfloat16"
    assert plan.draft.max_tree_depth == DynamicTreeOptions().depth + 1
    assert plan.draft.draft_nodes == DynamicTreeOptions().total_tokens - 1


@pytest.mark.parametrize(
    "draft, build, expected",
    [
        # tree deeper than the number of Medusa heads
        ({"method": "medusa", "tree": {"preset": "chain-4"}}, {}, ["draft.tree", "depth 4", "3 Medusa heads"]),
        # tree larger than max_draft_len
        ({"method": "medusa", "tree": {"choices": [[0], [1], [2], [0, 0]]}}, {"max_draft_len": 3},
         ["draft.tree", "4 draft nodes", "build.max_draft_len = 3"]),
        ({"method": "eagle", "tree": {"dynamic": {"total_tokens": 30}}}, {"max_draft_len": 20},
         ["draft.tree", "29 draft nodes", "build.max_draft_len = 20"]),
        ({"method": "lookup", "lookup": {"num_draft_tokens": 12}}, {"max_draft_len": 8},
         ["draft.lookup.num_draft_tokens", "12 draft nodes", "= 8"]),
        # tp_size not dividing the heads (4 attention heads, 2 kv heads)
        ({"method": "none"}, {"tp_size": 3}, ["build.tp_size", "num_attention_heads 4", "tp_size 3"]),
        ({"method": "none"}, {"tp_size": 8}, ["build.tp_size", "num_attention_heads 4", "tp_size 8"]),
        ({"method": "none"}, {"max_seq_len": 4096}, ["build.max_seq_len", "4096", "at most 512"]),
        ({"method": "eagle"}, {"max_draft_len": 300, "max_seq_len": 512}, ["build.max_draft_len", "300", "256"]),
    ],
)
def test_plan_rejects_impossible_values(ckpts, draft, build, expected):
    if draft["method"] in ("medusa", "eagle"):
        draft = {**draft, "checkpoint": str(ckpts["medusa3" if draft["method"] == "medusa" else "eagle"])}
    with pytest.raises(BuildConfigError) as info:
        plan_build(config_for(ckpts, draft, **build))
    for part in expected:
        assert part in str(info.value), (part, str(info.value))


def test_plan_rejects_heads_that_do_not_fit_the_target(ckpts):
    with pytest.raises(BuildConfigError, match=r"draft\.checkpoint: .*hidden size 32 .* hidden_size 64"):
        plan_build(config_for(ckpts, {"method": "medusa", "checkpoint": str(ckpts["medusa_h32"])}))
    with pytest.raises(BuildConfigError, match=r"draft\.checkpoint: .*vocab_size"):
        plan_build(config_for(ckpts, {"method": "eagle", "checkpoint": str(ckpts["eagle_badvocab"])}))
    with pytest.raises(BuildConfigError, match=r"draft\.checkpoint: .*no config\.json"):
        plan_build(config_for(ckpts, {"method": "medusa", "checkpoint": str(ckpts["root"])}))
    with pytest.raises(BuildConfigError, match=r"model\.checkpoint: .*config\.json"):
        plan_build(parse_config({"model": {"checkpoint": "nowhere"}, "build": {"output": "o"}}, ckpts["root"], "t"))


def test_plan_rejects_eagle_on_qwen2_and_missing_output(ckpts):
    data = {"model": {"checkpoint": str(ckpts["qwen"])}, "draft": {"method": "eagle", "checkpoint": str(ckpts["eagle_qwen"])},
            "build": {"output": "o"}}
    with pytest.raises(BuildConfigError, match=r"draft\.method: got 'eagle' for a Qwen2 target"):
        plan_build(parse_config(data, ckpts["root"], "t"))
    cfg = parse_config({"model": {"checkpoint": str(ckpts["llama"])}}, ckpts["root"], "t")
    with pytest.raises(BuildConfigError, match=r"build\.output: missing"):
        plan_build(cfg)
    assert plan_build(cfg, require_output=False).draft.kind == "none"


def test_tp_size_with_fewer_kv_heads_than_ranks_is_accepted(ckpts):
    # 2 kv heads over 4 ranks: TensorRT-LLM duplicates each kv head on two ranks.
    assert plan_build(config_for(ckpts, {"method": "none"}, tp_size=4)).config.build.tp_size == 4


def test_cli_validate(ckpts, capsys):
    good = write_yaml(ckpts["root"] / "v" / "good.yaml",
                      {"model": {"checkpoint": "../llama"},
                       "draft": {"method": "medusa", "checkpoint": "../medusa3", "tree": {"choices": [[0], [1], [0, 0]]}},
                       "build": {"max_draft_len": 8}})
    assert main(["validate", "--config", str(good)]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "medusa" in out and "3 draft nodes" in out
    bad = write_yaml(ckpts["root"] / "v" / "bad.yaml",
                     {"model": {"checkpoint": "../llama"}, "build": {"tp_size": 3}})
    assert main(["validate", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "build.tp_size" in err and "tp_size 3" in err
