"""The registry of drafter kinds: a kind added by one module (tests/toy_kind.py, "echo") is a drafter like the
built-in ones everywhere a kind is named (DraftSpec's grammar and rules, engine.json's record, runtime.load and its
CLI, the builder's plan and TensorRT-LLM export), and greedy decoding through it equals plain decoding."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import runtime
from builder import trtllm
from builder.config import parse_config
from builder.drafters import builder_kind
from builder.plan import plan_build
from runtime.draft_spec import (
    DraftSpec,
    DraftSpecError,
    DrafterKind,
    LookupOptions,
    drafter_kind,
    kind_names,
    option_names,
    register,
    unregister,
)
from runtime.errors import ConfigError
from runtime.tree import Tree
from tests.tiny import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def echo():
    from tests import toy_kind

    register(toy_kind.KIND)  # importing the module registered it; a test before this one may have unregistered it
    yield toy_kind
    unregister(toy_kind.NAME)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "llama3", seed=5)


def test_a_registered_kind_is_a_kind_like_the_others(echo):
    assert kind_names()[-1] == "echo" and drafter_kind("echo") is echo.KIND
    spec = DraftSpec.parse("echo:chain-2+max_draft_len=2")
    assert spec.static_tree == Tree.chain(2) and spec.draft_nodes == 2 and option_names("echo") == ()
    assert DraftSpec.from_mapping(spec.to_dict()) == spec  # engine.json's record
    assert DraftSpec("echo").draft_nodes == echo.DEPTH  # its own default shape
    with pytest.raises(DraftSpecError, match="path: drafter 'echo' has no weights"):
        DraftSpec("echo", path="h")
    with pytest.raises(DraftSpecError, match="drafts chains"):
        DraftSpec.parse("echo:[[0],[1]]")  # its own rule
    with pytest.raises(DraftSpecError, match=r"unknown option\(s\) \['max_ngram'\] for drafter 'echo'"):
        DraftSpec.parse("echo+max_ngram=2")  # the generic rules read its declared option sets
    with pytest.raises(DraftSpecError, match="lookup options apply to drafter 'lookup', or to medusa / eagle"):
        DraftSpec("echo", lookup=LookupOptions())
    with pytest.raises(ConfigError, match="already registered"):
        register(type(echo.KIND)())  # another object under a taken name
    from runtime.__main__ import parser

    generate = parser()._subparsers._group_actions[0].choices["generate"]
    assert "echo" in next(a for a in generate._actions if a.dest == "draft").choices


def test_unknown_until_registered():
    unregister("echo")
    with pytest.raises(DraftSpecError, match="unknown drafter kind 'echo'"):
        DraftSpec("echo")
    with pytest.raises(TypeError):
        register("echo")


def test_greedy_decoding_through_it_is_plain_decoding(echo, target_dir):
    plain = runtime.load(target_dir)
    speculative = runtime.load(target_dir, draft="echo")
    assert speculative.drafter.name == "echo" and plain.drafter.name == "none"
    prompts = [[1, 2, 3, 4], [7, 7, 7], list(range(5, 30))]
    accepted = 0
    for prompt in prompts:
        want = plain.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
        got = speculative.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
        assert got.token_ids == want.token_ids
        accepted += got.stats.accepted_tokens
    assert accepted > 0  # its drafts were verified and some kept: the loop really ran through it


def test_the_builder_gives_it_the_defaults(echo, target_dir):
    """No builder module: the plan checks it by the runtime's rules, and TensorRT-LLM gets the target alone."""
    config = parse_config({"model": {"checkpoint": str(target_dir)}, "draft": {"method": "echo"},
                           "build": {"output": "out", "max_draft_len": 4}}, target_dir, "echo.yaml")
    plan = plan_build(config)
    assert plan.draft.kind == "echo" and plan.draft.static_tree == Tree.chain(echo.DEPTH)
    assert builder_kind("echo").trtllm_build_args(plan) == []
    assert "--speculative_decoding_mode" not in trtllm.build_args(plan) and trtllm.run_args(plan) == []
    small = parse_config({"model": {"checkpoint": str(target_dir)}, "draft": {"method": "echo"},
                          "build": {"output": "out", "max_draft_len": 2}}, target_dir, "echo.yaml")
    with pytest.raises(ConfigError, match="draft.tree: 3 draft nodes per step"):
        plan_build(small)


def test_a_kind_needs_a_name_and_a_loader():
    class Nameless(DrafterKind):
        pass

    with pytest.raises(NotImplementedError, match="no loader"):
        type("Bare", (DrafterKind,), {"name": "bare"})().load(DraftSpec(), None)
    assert not Nameless().recognizes(ROOT)


def model_kind_literals() -> list[tuple[str, str]]:
    """(file, name) for every string constant spelling a built-in weighted kind's name (words with no other meaning
    here, unlike "lookup" and "none") in the project packages, outside the kind's own modules
    (runtime/drafters/<kind>.py, builder/drafters/<kind>.py)."""
    names = {"medusa", "eagle", "eagle3"}
    found = set()
    for package in ("plugins", "runtime", "builder", "model_repo", "deploy", "perf"):
        for file in sorted((ROOT / package).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            if file.stem in names and rel in (f"runtime/drafters/{file.name}", f"builder/drafters/{file.name}"):
                continue
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.add((rel, node.value))
    return sorted(found)


def test_kind_names_are_spelled_only_in_their_own_modules():
    assert model_kind_literals() == []
