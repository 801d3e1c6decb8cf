"""`python -m perf bench`: the real CLI on tiny checkpoints (numbers not asserted; structure, greedy identity and
the baselines' honesty are), chat prompts through the chat template, transformers' prompt lookup and assisted
generation as peers, plus the pieces it is made of (spec grammar, prompt files, statistics)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

import runtime
from perf import stats
from perf.__main__ import main
from perf.bench import (
    BenchConfig,
    BenchConfigError,
    Run,
    Target,
    Variant,
    VariantSpec,
    check_identity,
    parse_specs,
    resolve,
    speedup_interval,
    split_specs,
    summarize,
    tau_interval,
)
from perf.hf_baseline import HFBaseline
from runtime.draft_spec import DraftSpec, DynamicTreeOptions, LookupOptions
from runtime.errors import ConfigError
from runtime.tokenizer import Tokenizer
from runtime.tree import Tree
from perf.machine import expand_out, machine_slug
from perf.prompt_sets import DEFAULT_SETS, Prompt, load_prompt_file, load_prompts
from tests.cli import PNG, exit_status
from tests.heads import write_eagle_head, write_medusa_head
from tests.test_chat import CHATML, with_template
from tests.tiny import make_checkpoint, vocab_size

DRAFTERS = "lookup,medusa:chain-2,small=medusa:[[0],[0,0],[1]],eagle,pruned=eagle:mc_sim_7b_63+min_path_prob=0.1"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("perf_bench")
    ckpt = make_checkpoint(root / "target", "llama2")
    write_medusa_head(root / "medusa", 64, vocab_size(), num_heads=3)
    write_eagle_head(root / "eagle", ckpt)
    cfg = root / "bench.yaml"
    cfg.write_text("model: {checkpoint: target}\n"
                   "draft: {method: medusa, checkpoint: medusa, tree: {preset: chain-3}}\n"
                   "build: {dtype: float32, max_draft_len: 40, output: engine, onnx: false, tensorrt: false}\n")
    return root, cfg


@pytest.fixture(scope="module")
def bench_run(tiny):
    root, cfg = tiny
    out = root / "results" / "2000-01-01-test"
    code = main(["bench", "--config", str(cfg), "--drafters", DRAFTERS, "--draft-model", f"eagle={root / 'eagle'}",
                 "--prompts-per-set", "2", "--max-tokens", "7", "--threads", "1", "--out", str(out), "--quiet"])
    return code, out


def test_bench_cli_writes_json_markdown_and_plots(bench_run):
    code, out = bench_run
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    names = [v["name"] for v in report["variants"]]
    assert names == ["plain", "hf", "lookup", "medusa:chain-2", "small", "eagle", "pruned"]
    assert report["greedy_identical"] is True and report["mismatches"] == []
    assert report["settings"]["threads"] == 1 and report["machine"]["torch"] == torch.__version__
    assert {"cpu_model", "usable_cores", "torch_threads", "python", "transformers"} <= set(report["machine"])
    assert [p["set"] for p in report["prompts"]] == ["code", "code", "prose", "prose"]
    assert all(len(p["output_ids"]) == 7 for p in report["prompts"])
    # every (variant, prompt) was timed once, after the warm-up
    assert len(report["runs"]) == len(names) * 4 and all(r["generated_tokens"] == 7 for r in report["runs"])
    by = {v["name"]: v for v in report["variants"]}
    for v in report["variants"]:
        assert v["generated_tokens"] == 4 * 7 and v["tokens_per_s"] > 0 and v["greedy_identical"]
        assert set(v["per_set"]) == {"code", "prose"}
    assert by["plain"]["speedup_vs_plain"] == 1.0 and by["hf"]["speedup_vs_hf"] == 1.0
    assert by["plain"]["speedup_vs_plain_ci95"] is None
    for v in report["variants"][1:]:
        lo, hi = v["speedup_vs_plain_ci95"]
        assert lo <= v["speedup_vs_plain"] <= hi
        assert f"{v['speedup_vs_plain']:.2f}x ({lo:.2f}-{hi:.2f})" in (out / "bench.md").read_text()
        if v["kind"] == "speculative":
            lo, hi = v["tau_ci95"]
            assert lo <= v["tau"] <= hi and f"{v['tau']:.2f} ({lo:.2f}-{hi:.2f})" in (out / "bench.md").read_text()
        else:
            assert v.get("tau_ci95") is None
    assert report["best_hf"] is None and by["plain"]["speedup_vs_best_hf"] is None
    assert by["hf"]["identity_enforced"] is False and by["lookup"]["identity_enforced"] is True
    assert not any(p["chat"] for p in report["prompts"]) and "vs best hf" not in (out / "bench.md").read_text()
    assert by["plain"]["tau"] == 1.0 and by["plain"]["target_forwards_per_token"] == 1.0
    assert by["hf"]["target_forwards_per_token"] == 1.0  # counted by a forward hook, not assumed
    assert by["hf"].get("tau") is None and by["hf"]["attn_implementation"]
    for name in ("lookup", "medusa:chain-2", "small", "eagle", "pruned"):
        v = by[name]
        assert v["kind"] == "speculative" and v["tau"] >= 1.0 and v["speedup_vs_hf"] > 0
        assert v["target_forwards_per_token"] <= 1.0
        assert sum(v["accepted_histogram"]) == v["steps"]
        assert len(v["acceptance_by_depth"]) == v["tree_depth"]
        assert all(0.0 <= p <= 1.0 for p in v["acceptance_by_depth"])
        assert v["acceptance_by_depth"] == sorted(v["acceptance_by_depth"], reverse=True)
        assert abs(sum(v["time_split"].values()) - 1.0) < 1e-9
        # per prompt: the prefill emits one token, then each verification step emits tau on average
        assert v["tau"] * v["steps"] + v["prompts"] == pytest.approx(v["generated_tokens"])
    assert (by["medusa:chain-2"]["tree_nodes"], by["medusa:chain-2"]["tree_depth"]) == (3, 2)
    assert (by["small"]["tree_nodes"], by["eagle"]["tree"]) == (4, "dynamic")
    assert by["pruned"]["pruning"] == {"min_path_prob": 0.1, "by_cost": False} and "pruning" not in by["eagle"]
    assert by["pruned"]["mean_tree_nodes"] < by["pruned"]["tree_nodes"] == 41  # max_draft_len 40; pruned below 10%
    md = (out / "bench.md").read_text()
    assert "| pruned | static pruned ≤41 (mean " in md
    assert "Greedy outputs identical** to plain decoding for every variant and prompt: **yes**" in md
    for name in names:
        assert f"| {name} |" in md
    for png in ("speedup_by_tree_size.png", "acceptance_by_depth.png", "time_split.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
        assert f"]({png})" in md


def test_hf_baseline_is_greedy_and_ignores_eos(tmp_path):
    """A checkpoint whose argmax is often EOS: transformers must keep generating, like the runtime's ignore_eos."""
    from safetensors.torch import load_file, save_file

    ckpt = make_checkpoint(tmp_path / "eosy", "llama2", seed=3)
    state = load_file(str(ckpt / "model.safetensors"))
    state["lm_head.weight"][1] += 5.0 * state["model.norm.weight"]
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    ids = [0, 50, 60, 70]
    ours = runtime.load(ckpt).generate(ids, max_tokens=12, ignore_eos=True)
    assert 1 in ours.token_ids[:-1]  # EOS is generated and generation carries on
    hf = HFBaseline.from_checkpoint(ckpt, torch.float32).generate(ids, 12)
    assert hf.token_ids == ours.token_ids and hf.target_forwards == 12


def test_bench_from_engine_directory(tiny, tmp_path):
    """--engine: targets and heads come from the engine; the hf baseline gets the engine's own weights."""
    from builder.build import build_engine
    from builder.config import load_config

    _, cfg = tiny
    engine = build_engine(load_config(cfg).with_output(tmp_path / "engine")).output
    out = tmp_path / "bench"
    code = main(["bench", "--engine", str(engine), "--drafters", "medusa,medusa:chain-1+max_draft_len=1",
                 "--prompts-per-set", "1", "--max-tokens", "5", "--warmup", "0", "--threads", "1",
                 "--out", str(out), "--quiet"])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["target"]["kind"] == "engine" and report["greedy_identical"]
    by = {v["name"]: v for v in report["variants"]}
    assert by["medusa"]["tree_nodes"] == 4 and by["medusa"]["path"].endswith("draft")  # the engine's chain-3 heads
    assert by["medusa:chain-1+max_draft_len=1"]["tree_nodes"] == 2
    assert by["medusa"]["configured"] and not by["medusa:chain-1+max_draft_len=1"]["configured"]
    assert "| medusa (configured) |" in (out / "bench.md").read_text()


@pytest.mark.parametrize("args,message", [
    (["--drafters", "medusa:dynamic"], "dynamic tree is EAGLE-2's"),
    (["--drafters", "hf"], "hf is a transformers baseline (measured in every run unless --no-hf)"),
    (["--drafters", "hf-lookup"], "hf-lookup is a transformers baseline (measured with --hf-lookup N)"),
    (["--hf-lookup", "0"], "hf_lookup: got 0"),
    (["--drafters", "plain"], "plain (none) is a baseline"),
    (["--drafters", "lookup,lookup"], "more than once"),
    (["--drafters", "eagle"], "--draft-model eagle=DIR"),
    (["--drafters", "medusa+max_draft_len=99"], "above the checkpoint's limit of 40"),
    (["--drafters", "medusa:chain-5"], "exceeds the 3 Medusa heads"),
    (["--max-tokens", "0"], "max_tokens: got 0"),
    (["--draft-model", "lookup=/x"], "expected medusa or eagle"),
    (["--prompts", "/nonexistent/p.jsonl"], "prompt file /nonexistent/p.jsonl does not exist"),
])
def test_bench_bad_input_exits_2_naming_the_problem(tiny, tmp_path, capsys, args, message):
    _, cfg = tiny
    code = run_main(["bench", "--config", str(cfg), "--out", str(tmp_path), "--quiet", "--max-tokens", "2", *args])
    assert code == 2
    assert message in capsys.readouterr().err


def run_main(args: list[str]) -> int:
    return exit_status(main, args)


def test_config_and_engine_are_exclusive():
    with pytest.raises(BenchConfigError, match="exactly one of --config"):
        BenchConfig()
    with pytest.raises(BenchConfigError, match="exactly one of --config"):
        BenchConfig(config=Path("a.yaml"), engine=Path("e"))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens: got 0, expected an integer >= 1"),
    ({"warmup": -1}, "warmup: got -1, expected an integer >= 0"),
    ({"threads": True}, "threads: got True, expected an integer"),
    ({"hf_lookup": 0}, "hf_lookup: got 0, expected an integer >= 1"),
    ({"dtype": "float64"}, "dtype: got 'float64', expected one of 'float32', 'bfloat16', 'float16', 'auto'"),
    ({"out": ""}, "out: got '', expected an output directory"),
])
def test_settings_bounds_name_the_setting(kwargs, message):
    with pytest.raises(BenchConfigError) as info:
        BenchConfig(config=Path("a.yaml"), **kwargs)
    assert str(info.value) == message


# ---- drafter specs ------------------------------------------------------------------------------------------


def test_spec_grammar():
    s = VariantSpec.parse("eagle:dynamic+total_tokens=30+depth=4")
    assert (s.draft.kind, s.draft.tree, s.draft.dynamic, s.name) == (
        "eagle", "dynamic", DynamicTreeOptions(total_tokens=30, depth=4), "eagle:dynamic+total_tokens=30+depth=4")
    assert VariantSpec.parse("medusa:[[0],[0,0],[1]]").draft.tree == Tree.from_choices([[0], [0, 0], [1]])
    assert VariantSpec.parse("lookup+max_ngram=4").draft.lookup == LookupOptions(max_ngram=4)
    named = VariantSpec.parse("tuned=medusa:[[0],[1],[0,0]]+max_draft_len=2")
    assert (named.name, named.draft) == ("tuned", DraftSpec("medusa", tree=Tree.from_choices([[0], [1], [0, 0]]),
                                                            max_draft_len=2))
    assert VariantSpec.parse("plain").draft == DraftSpec("none") and VariantSpec.parse("eagle").configured
    assert not VariantSpec.parse("eagle:dynamic").configured
    assert split_specs("lookup, medusa:[[0],[1],[0,0]] ,eagle:chain-2") == ["lookup", "medusa:[[0],[1],[0,0]]",
                                                                           "eagle:chain-2"]
    assert [s.draft.kind for s in parse_specs("medusa:mc_sim_7b_63,eagle,lookup")] == ["medusa", "eagle", "lookup"]


def test_a_variant_of_the_configured_kind_runs_the_configured_heads_quantization(tmp_path):
    """Whatever tree a variant names, its head runs as configured (int8 here) unless it says otherwise; its tree,
    options and pruning come from the configuration only when it names none."""
    conf = DraftSpec("eagle", path=tmp_path, tree=Tree.from_choices([[0], [1], [0, 0]]), quantization="int8",
                     max_draft_len=8)
    target = Target("checkpoint", tmp_path, None, None, conf)
    chain = resolve(VariantSpec.parse("eagle:chain-2"), target, {})
    assert (chain.quantization, chain.tree, Path(chain.path)) == ("int8", Tree.from_choices([[0], [0, 0]]), tmp_path)
    assert resolve(VariantSpec.parse("eagle:chain-2+quantization=int4"), target, {}).quantization == "int4"
    assert resolve(VariantSpec.parse("eagle"), target, {}).tree == conf.tree
    other = DraftSpec("medusa", path=tmp_path, max_draft_len=8)  # another kind configured: nothing of it
    assert resolve(VariantSpec.parse("eagle:chain-2"), Target("checkpoint", tmp_path, None, None, other),
                   {"eagle": tmp_path}).quantization is None


@pytest.mark.parametrize("text,message", [
    ("", "empty string"),
    ("beam", "unknown drafter kind 'beam'"),
    ("medusa:", "empty tree"),
    ("medusa:nonsense", "unknown tree preset 'nonsense'"),
    ("medusa:[[0,0]]", "tree"),
    ("lookup:chain-2", "'lookup' builds its own trees"),
    ("lookup+max_ngram", "KEY=VALUE"),
    ("lookup+a=1+a=2", "given twice"),
    ("medusa+max_draft_len=0", "max_draft_len: got 0"),
    ("hf=medusa", "not a baseline's name"),
    ("a b=medusa", "label 'a b'"),
])
def test_spec_errors_name_the_spec(text, message):
    with pytest.raises(BenchConfigError) as info:
        VariantSpec.parse(text)
    assert message in str(info.value)


def test_unbalanced_brackets():
    with pytest.raises(BenchConfigError, match="unbalanced"):
        split_specs("medusa:[[0],[1]")


# ---- identity check and summaries (pure functions on hand-made runs) ----------------------------------------


def _run(variant, prompt, ids, wall=1.0, accepted=(), steps=None):
    return Run(variant=variant, prompt=prompt, repeat=0, prompt_tokens=3, token_ids=tuple(ids), wall_s=wall,
               target_forwards=len(ids) if steps is None else steps + 1, steps=steps,
               drafted_tokens=None if steps is None else 3 * steps, accepted_per_step=tuple(accepted),
               time_prefill=None if steps is None else 0.1, time_draft=None if steps is None else 0.2,
               time_verify=None if steps is None else 0.6, time_other=None if steps is None else 0.1)


def test_identity_check_finds_the_first_difference():
    runs = [_run("plain", "code/a", [5, 6, 7, 8]), _run("spec", "code/a", [5, 6, 9, 8]),
            _run("short", "code/a", [5, 6, 7])]
    mm = check_identity(runs)
    assert [(m.variant, m.index) for m in mm] == [("spec", 2), ("short", 3)]
    assert mm[0].expected == (5, 6, 7, 8) and mm[0].got == (5, 6, 9, 8)


def test_summary_speedups_acceptance_and_flags():
    prompts = [Prompt("code", "a", "x"), Prompt("prose", "b", "y")]

    def variant(name, kind="speculative"):
        return Variant(name, kind, "medusa", {"tree": "static", "tree_nodes": 4, "tree_depth": 3}, generate=None)

    runs = [
        _run("plain", "code/a", [1] * 8, wall=2.0, accepted=[0] * 7, steps=7),
        _run("plain", "prose/b", [1] * 8, wall=2.0, accepted=[0] * 7, steps=7),
        _run("hf", "code/a", [1] * 8, wall=1.0), _run("hf", "prose/b", [1] * 8, wall=1.0),
        _run("spec", "code/a", [1] * 8, wall=0.5, accepted=[3, 3, 0], steps=3),
        _run("spec", "prose/b", [1] * 8, wall=1.5, accepted=[2, 0, 1, 1], steps=4),
    ]
    variants = [variant("plain", "baseline"), Variant("hf", "baseline", "transformers", {}, None), variant("spec")]
    assert check_identity(runs) == []
    out = {v["name"]: v for v in summarize(variants, runs, prompts, [])}
    spec = out["spec"]
    assert spec["speedup_vs_plain"] == pytest.approx(2.0) and spec["speedup_vs_hf"] == pytest.approx(1.0)
    assert spec["per_set"]["code"]["speedup_vs_plain"] == pytest.approx(4.0)
    assert spec["per_set"]["prose"]["speedup_vs_hf"] == pytest.approx(1 / 1.5)
    assert spec["tau"] == pytest.approx((10 + 7) / 7) and spec["steps"] == 7
    assert spec["accepted_histogram"] == [2, 2, 1, 2]
    assert spec["acceptance_by_depth"] == pytest.approx([5 / 7, 3 / 7, 2 / 7])
    assert spec["mean_tree_nodes"] == pytest.approx(4.0)
    assert out["hf"]["target_forwards_per_token"] == 1.0 and "tau" not in out["hf"]
    bad = summarize(variants, runs, prompts, check_identity(runs[:4] + [_run("spec", "code/a", [2] * 8),
                                                                        runs[5]]))
    assert [v["greedy_identical"] for v in bad] == [True, True, False]


def test_speedup_interval_is_paired_over_prompts():
    walls = [0.5, 1.0, 4.0, 9.0, 2.0, 3.0]  # plain's: prompts of very different cost
    plain = [_run("plain", f"code/{i}", [1] * 8, wall=w) for i, w in enumerate(walls)]
    # the same 2x on every prompt: the interval is that point, however much the prompts' costs differ (an unpaired
    # bootstrap of the two tokens/s would give a wide one)
    even = [_run("spec", f"code/{i}", [1] * 8, wall=w / 2) for i, w in enumerate(walls)]
    assert speedup_interval(even, plain) == pytest.approx((2.0, 2.0))
    # speedups that differ by prompt: an interval around the point estimate, within the per-prompt extremes
    factors = [1.5, 2.5, 1.8, 2.2, 3.0, 1.2]
    uneven = [_run("spec", f"code/{i}", [1] * 8, wall=w / f) for i, (w, f) in enumerate(zip(walls, factors))]
    point = sum(walls) / sum(w / f for w, f in zip(walls, factors))
    lo, hi = speedup_interval(uneven, plain)
    assert min(factors) <= lo < point < hi <= max(factors)
    assert speedup_interval(uneven, plain) == (lo, hi)  # seeded: a report regenerates identically
    # only the prompts both measured count; fewer than two: no interval
    assert speedup_interval(uneven[:3], plain) != (lo, hi)
    assert speedup_interval(uneven[:1], plain) is None


def test_tau_interval_resamples_prompts():
    # the same acceptance on every prompt: the interval is tau itself
    same = [_run("spec", f"code/{i}", [1] * 8, accepted=[2, 1, 0], steps=3) for i in range(5)]
    assert tau_interval(same) == pytest.approx((2.0, 2.0))
    # prompts that accept differently: an interval around the pooled tau, within the per-prompt extremes
    mixed = same[:2] + [_run("spec", f"code/{i}", [1] * 8, accepted=a, steps=len(a))
                        for i, a in enumerate(([0, 0, 0, 0], [4, 4], [1, 0, 2]), start=2)]
    accepted = [k for r in mixed for k in r.accepted_per_step]
    pooled = (sum(accepted) + len(accepted)) / len(accepted)
    lo, hi = tau_interval(mixed)
    assert 1.0 <= lo < pooled < hi <= 5.0
    assert tau_interval(same[:1]) is None and tau_interval([_run("plain", "code/0", [1] * 8)]) is None


def test_summary_carries_the_speedup_interval():
    prompts = [Prompt("code", str(i), "x") for i in range(4)]
    variants = [Variant("plain", "baseline", "none", {}, None), Variant("spec", "speculative", "lookup", {}, None)]
    runs = ([_run("plain", f"code/{i}", [1] * 8, wall=1.0 + i) for i in range(4)]
            + [_run("spec", f"code/{i}", [1] * 8, wall=(1.0 + i) / (1.5 + i / 2)) for i in range(4)])
    out = {v["name"]: v for v in summarize(variants, runs, prompts, [])}
    assert out["plain"]["speedup_vs_plain_ci95"] is None
    lo, hi = out["spec"]["speedup_vs_plain_ci95"]
    assert 1.5 <= lo < out["spec"]["speedup_vs_plain"] < hi <= 3.0
    assert "tau_ci95" not in out["spec"]  # no verification steps recorded in these runs


# ---- statistics ------------------------------------------------------------------------------------------------


def test_bootstrap_interval_covers_as_its_level_says():
    rng = np.random.default_rng(1)
    assert stats.bootstrap_interval(5, lambda idx: 3.0) == (3.0, 3.0)
    values = rng.normal(size=400).tolist()
    lo, hi = stats.bootstrap_interval(400, lambda idx: sum(values[i] for i in idx) / len(idx), resamples=500)
    assert lo < stats.mean(values) < hi and 0.14 < hi - lo < 0.26  # ~ 2 x 1.96 / sqrt(400)
    # coverage of the true mean over many samples: ~95% at level 0.95; the negative control, level 0.5, ~50%
    covered = {0.95: 0, 0.5: 0}
    trials = 100
    for t in range(trials):
        sample = rng.normal(loc=1.0, size=30).tolist()
        for level in covered:
            lo, hi = stats.bootstrap_interval(30, lambda idx: sum(sample[i] for i in idx) / 30, resamples=200,
                                              level=level, seed=t)
            covered[level] += lo <= 1.0 <= hi
    assert covered[0.95] / trials >= 0.85 and 0.3 <= covered[0.5] / trials <= 0.7
    for kwargs, message in ((dict(n=0), "at least one item"), (dict(n=3, level=1.0), "level must be in"),
                            (dict(n=3, resamples=0), "resamples must be a positive int")):
        with pytest.raises(ValueError, match=message):
            stats.bootstrap_interval(statistic=lambda idx: 0.0, **kwargs)



def test_acceptance_statistics():
    acc = [0, 1, 3, 3, 2, 0]
    assert stats.accepted_histogram(acc) == [2, 1, 1, 2]
    assert stats.reach_by_depth(acc) == pytest.approx([4 / 6, 3 / 6, 2 / 6])
    assert stats.reach_by_depth(acc, 5)[3:] == [0.0, 0.0]
    assert stats.conditional_by_depth(acc) == pytest.approx([4 / 6, 3 / 4, 2 / 3])
    assert stats.conditional_by_depth([0, 0], 2) == [0.0, None]
    with pytest.raises(ValueError):
        stats.accepted_histogram([1, -1])


def test_percentile_and_median_match_numpy():
    rng = np.random.default_rng(0)
    values = rng.exponential(size=37).tolist()
    for q in (0, 10, 50, 90, 99, 100):
        assert stats.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert stats.median(values) == pytest.approx(statistics.median(values))
    assert stats.first_difference([1, 2], [1, 2]) is None and stats.first_difference([1, 2], [1]) == 1


# ---- prompt sets ---------------------------------------------------------------------------------------------


def test_shipped_prompt_sets():
    prompts = load_prompts()
    assert {p.set for p in prompts} == set(DEFAULT_SETS)
    assert len({p.key for p in prompts}) == len(prompts)
    for name in DEFAULT_SETS:
        chosen = [p for p in prompts if p.set == name]
        assert len(chosen) >= 6 and all(p.text.strip() and p.source for p in chosen)
    assert len(load_prompts(limit=2)) == 2 * len(DEFAULT_SETS)


def test_prompt_ids_default_to_line_numbers(tmp_path):
    """Plain {"prompt": ...} files (tune-tree's format) load; ids come from line numbers."""
    path = tmp_path / "held.jsonl"
    path.write_text('{"prompt": "def a():"}\n\n{"prompt": "def b():"}\n{"id": "line-9", "prompt": "x"}\n')
    assert [(p.set, p.id, p.text) for p in load_prompt_file(path)] == [
        ("held", "line-1", "def a():"), ("held", "line-3", "def b():"), ("held", "line-9", "x")]
    path.write_text('{"prompt": "a"}\n{"id": "line-1", "prompt": "b"}\n')
    with pytest.raises(ConfigError, match="id 'line-1' repeats the id on line 1"):
        load_prompt_file(path)


@pytest.mark.parametrize("content,message", [
    ('{"id": "a", "prompt": "x"}\nnot json\n', ":2: not a JSON object"),
    ('["a"]\n', ":1: got a JSON list"),
    ('{"id": "a", "prompt": ""}\n', ":1: prompt: got ''"),
    ('{"id": "", "prompt": "x"}\n', ":1: id: got ''"),
    ('{"id": "a", "prompt": "x", "extra": 1}\n', "unknown key(s) ['extra']"),
    ('{"id": "a", "prompt": "x"}\n\n{"id": "a", "prompt": "y"}\n', ":3: id 'a' repeats the id on line 1"),
    ("\n\n", "holds no prompts"),
])
def test_prompt_file_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "set.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_prompt_file(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_two_prompt_files_with_one_name(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "set.jsonl").write_text('{"id": "x", "prompt": "y"}\n')
    with pytest.raises(ConfigError, match="same set name 'set'"):
        load_prompts([tmp_path / "a" / "set.jsonl", tmp_path / "b" / "set.jsonl"])


# ---- machine info ----------------------------------------------------------------------------------------------------


def test_machine_slug_and_out_template():
    info = {"gpu": None, "cpu_model": "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz", "usable_cores": 16}
    assert machine_slug(info) == "cpu-intel-xeon-platinum-8480-16c"
    assert machine_slug({"gpu": "NVIDIA H200", "cpu_model": "x", "usable_cores": 1}) == "gpu-nvidia-h200"
    out = expand_out("r/{date}-{machine}", info)
    assert out.name.endswith("-cpu-intel-xeon-platinum-8480-16c") and out.name[:4].isdigit()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel check runs for real")
def test_kernels_subcommand_runs_the_gpu_check(capsys):
    assert main(["kernels", "--skip-bench"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_report_regenerates_markdown_and_plots_from_json(bench_run, tmp_path):
    _, out = bench_run
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "bench.json").write_bytes((out / "bench.json").read_bytes())
    assert main(["report", str(copy)]) == 0
    assert (copy / "bench.md").read_text() == (out / "bench.md").read_text()
    assert all((copy / png).read_bytes().startswith(PNG) for png in ("speedup_by_tree_size.png",
                                                                       "acceptance_by_depth.png", "time_split.png"))
    assert main(["report", str(tmp_path / "empty")]) == 2


# ---- chat prompts and transformers' speculative peers -----------------------------------------------------------


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    """A ChatML target, an assistant of the same variant and vocabulary (another seed), a mixed prompt file."""
    root = tmp_path_factory.mktemp("perf_chat")
    target = with_template(make_checkpoint(root / "target", "llama2"), CHATML)
    make_checkpoint(root / "assistant", "llama2", seed=5)
    prompts = root / "mixed.jsonl"
    prompts.write_text('{"id": "ask", "prompt": "The quick brown fox", "chat": true}\n'
                       '{"id": "raw", "prompt": "def add(a, b):\\n    return a + b\\ndef add(a, b):"}\n')
    cfg = root / "bench.yaml"
    cfg.write_text("model: {checkpoint: target}\ndraft: {method: lookup}\n"
                   "build: {dtype: float32, max_draft_len: 12, output: engine, onnx: false, tensorrt: false}\n")
    return root, cfg, prompts


@pytest.fixture(scope="module")
def peers_run(chat_setup):
    root, cfg, prompts = chat_setup
    out = root / "results"
    code = main(["bench", "--config", str(cfg), "--prompts", str(prompts), "--hf-lookup", "10",
                 "--hf-assistant", str(root / "assistant"), "--max-tokens", "9", "--warmup", "0", "--repeats", "2",
                 "--threads", "1", "--out", str(out), "--quiet"])
    return code, out, json.loads((out / "bench.json").read_text())


def test_chat_prompts_go_through_the_chat_template(chat_setup, peers_run):
    root, _, _ = chat_setup
    code, _, report = peers_run
    assert code == 0
    tok = Tokenizer.from_dir(root / "target")
    expected = {"mixed/ask": tok.apply_chat_template([{"role": "user", "content": "The quick brown fox"}]),
                "mixed/raw": tok.encode("def add(a, b):\n    return a + b\ndef add(a, b):")}
    assert expected["mixed/ask"][0] != tok.bos_token_id  # the template's ids, no BOS added in front
    assert [(p["key"], p["chat"], p["prompt_tokens"]) for p in report["prompts"]] == [
        ("mixed/ask", True, len(expected["mixed/ask"])), ("mixed/raw", False, len(expected["mixed/raw"]))]
    # every variant, ours and transformers', got the same prompt ids
    for r in report["runs"]:
        assert r["prompt_tokens"] == len(expected[r["prompt"]])
    # and the same greedy continuation as our plain decoding of those ids
    plain = runtime.load(root / "target").generate(expected["mixed/ask"], max_tokens=9, ignore_eos=True)
    assert report["prompts"][0]["output_ids"] == list(plain.token_ids)


def test_transformers_speculative_peers_are_measured_side_by_side(peers_run):
    code, out, report = peers_run
    names = [v["name"] for v in report["variants"]]
    assert names == ["plain", "hf", "hf-lookup", "hf-assisted", "lookup (configured)"]
    assert len(report["runs"]) == len(names) * 2 * 2  # every variant on every prompt, both repeats
    by = {v["name"]: v for v in report["variants"]}
    lookup, assisted = by["hf-lookup"], by["hf-assisted"]
    assert (lookup["kind"], lookup["drafter"], lookup["method"]) == ("speculative", "transformers", "prompt_lookup")
    assert (lookup["prompt_lookup_num_tokens"], lookup["tree"], lookup["tree_nodes"]) == (10, "chain", 11)
    assert assisted["method"] == "assisted" and assisted["assistant"]["path"].endswith("assistant")
    assert assisted["assistant"]["num_assistant_tokens"] == 20 and assisted["tree_nodes"] == 21
    for v in (by["hf"], lookup, assisted):  # float32: transformers matches our plain decoding here
        assert v["identity_enforced"] is False and v["greedy_identical"] and v["first_difference"] is None
    # only the target's forwards count: prompt lookup and the assistant never need more than one per token
    assert 0 < lookup["target_forwards_per_token"] <= 1.0 and 0 < assisted["target_forwards_per_token"] <= 1.0
    best = report["best_hf"]
    assert best in ("hf-lookup", "hf-assisted") and by[best]["speedup_vs_best_hf"] == 1.0
    ours = by["lookup (configured)"]
    assert ours["speedup_vs_best_hf"] == pytest.approx(ours["tokens_per_s"] / by[best]["tokens_per_s"])
    assert ours["per_set"]["mixed"]["speedup_vs_best_hf"] is not None and ours["identity_enforced"]
    assert report["greedy_identical"] and report["transformers_mismatches"] == []
    md = (out / "bench.md").read_text()
    assert "| vs plain | vs hf | vs best hf |" in md and f"**Best transformers speculative variant**: `{best}`" in md
    assert "| hf-lookup | prompt_lookup chain ≤11 |" in md and "| hf-assisted | assisted chain ≤21 |" in md
    assert "to plain decoding for every variant and prompt: **yes**" in md and "1 through the chat template" in md
    assert "| lookup (configured) |" in md
    assert (out / "speedup_by_tree_size.png").read_bytes().startswith(PNG)


def test_transformers_differences_are_recorded_not_fatal(chat_setup, tmp_path, monkeypatch, capsys):
    """One identity rule: a transformers variant that differs from plain is reported, the run still succeeds;
    a runtime variant that differs fails it (exit 1)."""
    root, cfg, prompts = chat_setup
    generate = HFBaseline.generate

    def off_by_one(self, ids, max_tokens):
        r = generate(self, ids, max_tokens)
        if self.name != "hf-lookup":
            return r
        return dataclasses.replace(r, token_ids=r.token_ids[:3] + ((r.token_ids[3] + 1) % 7,) + r.token_ids[4:])

    monkeypatch.setattr(HFBaseline, "generate", off_by_one)
    args = ["bench", "--config", str(cfg), "--prompts", str(prompts), "--hf-lookup", "4", "--max-tokens", "6",
            "--warmup", "0", "--threads", "1", "--out", str(tmp_path / "a"), "--quiet"]
    assert main(args) == 0
    report = json.loads((tmp_path / "a" / "bench.json").read_text())
    by = {v["name"]: v for v in report["variants"]}
    assert report["greedy_identical"] and report["mismatches"] == []
    assert {m["variant"] for m in report["transformers_mismatches"]} == {"hf-lookup"}
    assert not by["hf-lookup"]["greedy_identical"] and by["hf-lookup"]["prompts_differing"] == 2
    assert by["hf-lookup"]["first_difference"] == {"prompt": "mixed/ask", "repeat": 0, "index": 3}
    md = (tmp_path / "a" / "bench.md").read_text()
    assert "for every spectree variant and prompt: **yes**" in md
    assert "`hf-lookup` differs on 2 of 2 prompts (first: `mixed/ask` from token 3)" in md
    assert "| no (from token 3; recorded) |" in md
    assert "note: transformers variant(s) hf-lookup differ" in capsys.readouterr().err


def test_assistant_with_another_vocabulary_is_refused(chat_setup, tmp_path, capsys):
    root, cfg, prompts = chat_setup
    other = make_checkpoint(tmp_path / "big-vocab", "llama2", seed=2, vocab_size=vocab_size() + 80)
    code = main(["bench", "--config", str(cfg), "--prompts", str(prompts), "--no-hf", "--hf-assistant", str(other),
                 "--max-tokens", "2", "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert (f"hf_assistant {other}: vocab_size {vocab_size() + 80}, expected the target's {vocab_size()}" in err
            and "sharing the target's tokenizer" in err)


def test_chat_prompt_without_a_template_names_the_prompt(tiny, chat_setup, tmp_path, capsys):
    _, cfg = tiny  # this target has no chat template
    _, _, prompts = chat_setup
    code = main(["bench", "--config", str(cfg), "--prompts", str(prompts), "--max-tokens", "2",
                 "--out", str(tmp_path), "--quiet"])
    assert code == 2
    assert "prompt mixed/ask (chat: true): the tokenizer has no chat template" in capsys.readouterr().err
