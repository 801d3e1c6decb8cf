"""DraftSpec, the one description of "which drafter": its grammar, its engine.json record, its rules (each error
naming the field, restated under each front end's own key), key-by-key options, and the front ends built on it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from builder.config import BuildConfigError, DraftSection
from runtime.__main__ import parser as runtime_parser
from runtime.api import LoadConfig
from runtime.draft_spec import (
    DYNAMIC,
    FIELD_NAMES,
    DraftSpec,
    DraftSpecError,
    DynamicTreeOptions,
    LookupOptions,
    PruneOptions,
    field_names,
    kind_names,
)
from runtime.errors import ConfigError
from runtime.tree import Tree


@pytest.mark.parametrize("text, expected", [
    ("none", DraftSpec()),
    ("medusa:mc_sim_7b_63", DraftSpec("medusa", tree=Tree.preset("mc_sim_7b_63"))),
    ("medusa:[[0],[0,0],[1]]", DraftSpec("medusa", tree=Tree.from_choices([[0], [1], [0, 0]]))),
    ("eagle", DraftSpec("eagle")),
    ("eagle:dynamic", DraftSpec("eagle", tree=DYNAMIC)),
    ("eagle+top_k=4", DraftSpec("eagle", tree=DYNAMIC, dynamic=DynamicTreeOptions(top_k=4))),
    ("eagle:dynamic+total_tokens=30+depth=4", DraftSpec("eagle", dynamic=DynamicTreeOptions(30, 4))),
    ("lookup+max_ngram=4+max_depth=null", DraftSpec("lookup", lookup=LookupOptions(max_ngram=4, max_depth=None))),
    (" medusa : chain-1 + max_draft_len=1 ", DraftSpec("medusa", tree=Tree.chain(1), max_draft_len=1)),
    # prompt lookup merged into a model drafter's trees: lookup's options on medusa / eagle, routed by name
    ("eagle:chain-2+num_draft_tokens=4", DraftSpec("eagle", tree=Tree.chain(2), lookup=LookupOptions(num_draft_tokens=4))),
    ("eagle:dynamic+top_k=4+max_branches=1", DraftSpec("eagle", dynamic=DynamicTreeOptions(top_k=4),
                                                       lookup=LookupOptions(max_branches=1))),
    ("medusa:chain-3+max_ngram=2", DraftSpec("medusa", tree=Tree.chain(3), lookup=LookupOptions(max_ngram=2))),
    ("eagle:chain-2+quantization=int8", DraftSpec("eagle", tree=Tree.chain(2), quantization="int8")),
    # pruning by path probability: static or dynamic EAGLE trees; 0 prunes nothing and is stored as no pruning
    ("eagle:chain-2+min_path_prob=0.02", DraftSpec("eagle", tree=Tree.chain(2), pruning=PruneOptions(0.02))),
    ("eagle+top_k=4+min_path_prob=0.5", DraftSpec("eagle", dynamic=DynamicTreeOptions(top_k=4),
                                                  pruning=PruneOptions(0.5))),
    ("eagle:chain-2+min_path_prob=0", DraftSpec("eagle", tree=Tree.chain(2))),
    ("eagle:chain-2+num_draft_tokens=4+token_prob=[0.5,0.7]+datastore_token_prob=0.4",
     DraftSpec("eagle", tree=Tree.chain(2), lookup=LookupOptions(num_draft_tokens=4, token_prob=(0.5, 0.7),
                                                                 datastore_token_prob=0.4))),
])
def test_grammar(text, expected):
    spec = DraftSpec.parse(text)
    assert spec == expected
    assert DraftSpec.from_mapping(spec.to_dict()) == spec  # the engine.json record round-trips


@pytest.mark.parametrize("text, field, message", [
    ("", "kind", "empty string"),
    ("hydra", "kind", "unknown drafter kind 'hydra'; expected one of medusa, eagle3, eagle, lookup, none"),
    ("medusa:", "tree", "empty tree after ':'"),
    ("medusa:bushy", "tree", "unknown tree preset 'bushy'"),
    ("medusa:[[0,0]]", "tree", "no parent"),
    ("medusa:dynamic", "tree", "the dynamic tree is EAGLE-2's; Medusa needs a static tree"),
    ("lookup:chain-2", "tree", "drafter 'lookup' builds its own trees from matches"),
    ("lookup:dynamic", "tree", "the dynamic tree is EAGLE-2's, not drafter 'lookup''s"),
    ("none:chain-2", "tree", "drafter 'none' drafts root-only trees; got a tree with 3 nodes"),
    ("eagle:chain-2+top_k=3", "options", "apply to the dynamic EAGLE-2 tree only"),
    ("medusa+top_k=3", "options", "unknown option(s) ['top_k'] for drafter 'medusa'; accepted: ['datastore_max_ngram', "),
    ("none+num_draft_tokens=3", "options", "unknown option(s) ['num_draft_tokens'] for drafter 'none'; accepted: none"),
    ("lookup+ngram=3", "options", "unknown option(s) ['ngram'] for drafter 'lookup'"),
    ("lookup+max_ngram=0", "options", "lookup.max_ngram: got 0, expected an integer >= 1"),
    ("lookup+max_ngram", "options", "must look like KEY=VALUE"),
    ("lookup+max_ngram=2+max_ngram=3", "options", "'max_ngram' is given twice"),
    ("lookup+max_draft_len=-1", "max_draft_len", "got -1, expected an integer >= 0"),
    ("eagle+quantization=int2", "quantization",
     "got 'int2', expected one of int8, int4 (or none: the weights' own dtype)"),
    ("medusa:chain-2+quantization=int8", "quantization", "drafter 'medusa' runs its weights as they are"),
    ("eagle+min_path_prob=1.5", "options", "pruning.min_path_prob: got 1.5, expected a number in [0, 1]"),
    ("eagle+min_path_prob=-0.1", "options", "pruning.min_path_prob: got -0.1, expected a number in [0, 1]"),
    ("medusa:chain-2+min_path_prob=0.1", "options", "unknown option(s) ['min_path_prob'] for drafter 'medusa'"),
    ("eagle+num_draft_tokens=4+token_prob=[0.3,0]", "options",
     "lookup.token_prob: got [0.3, 0], expected numbers in (0, 1], one per matched n-gram length"),
    ("eagle+num_draft_tokens=4+token_prob=[]", "options", "lookup.token_prob: got [], expected a list of a number, "
                                                         "not empty"),
    ("eagle+num_draft_tokens=4+token_prob=0.5", "options", "lookup.token_prob: got 0.5, expected a list of a number"),
    ("eagle+datastore_token_prob=1.5", "options", "lookup.datastore_token_prob: got 1.5, expected a number in (0, 1]"),
])
def test_rules_name_the_field(text, field, message):
    with pytest.raises(DraftSpecError) as info:
        DraftSpec.parse(text)
    assert info.value.field == field and message in info.value.detail
    assert str(info.value) == f"{field}: {info.value.detail}"


def test_rules_on_typed_fields():
    with pytest.raises(DraftSpecError, match="path: drafter 'lookup' has no weights"):
        DraftSpec("lookup", path="heads/")
    with pytest.raises(DraftSpecError, match="dynamic: the dynamic tree is EAGLE-2's; Medusa needs a static tree"):
        DraftSpec("medusa", tree=DYNAMIC, dynamic=DynamicTreeOptions())
    with pytest.raises(DraftSpecError, match="dynamic: options apply to the dynamic EAGLE-2 tree only"):
        DraftSpec("eagle", tree=Tree.chain(2), dynamic=DynamicTreeOptions())
    with pytest.raises(DraftSpecError, match="lookup: lookup options apply to drafter 'lookup', or to medusa / eagle3 / eagle "
                                             r"\(prompt-lookup continuations merged into their trees\), not 'none'"):
        DraftSpec("none", lookup=LookupOptions())
    with pytest.raises(DraftSpecError, match="tree: expected a Tree"):
        DraftSpec("medusa", tree="chain-2")  # text is parsed by create / parse, not the constructor
    with pytest.raises(DraftSpecError, match="path: required for drafter 'eagle'"):
        DraftSpec("eagle").require_weights()
    with pytest.raises(DraftSpecError, match="pruning: pruning by path probability is EAGLE-3 / EAGLE's"):
        DraftSpec("medusa", tree=Tree.chain(2), pruning=PruneOptions(0.1))
    with pytest.raises(DraftSpecError, match="pruning: expected PruneOptions, got 0.1"):
        DraftSpec("eagle", pruning=0.1)
    assert DraftSpec("eagle", pruning=PruneOptions()) == DraftSpec("eagle")  # nothing pruned: one form
    DraftSpec("none", tree=Tree.root_only()).require_weights()
    assert DraftSpec("medusa", path=Path("/h")).path == "/h"  # paths are kept as text


def test_pruning_floor_as_a_score():
    # a node's score is its path's log-probability: the floor is log(min_path_prob), a floor of 0 a finite score
    # every drafted node reaches and a never-drafted one (-inf) does not
    assert PruneOptions(0.02).min_score == pytest.approx(math.log(0.02))
    assert PruneOptions(1.0).min_score == 0.0
    assert -math.inf < PruneOptions().min_score < math.log(1e-299)


def test_options_merge_key_by_key():
    engine = DraftSpec("eagle", path="/e/draft", dynamic=DynamicTreeOptions(12, 3, 3))
    assert engine.with_options({"total_tokens": 5}).dynamic == DynamicTreeOptions(5, 3, 3)
    assert DraftSpec("eagle").with_options({"top_k": 2}) == DraftSpec("eagle", dynamic=DynamicTreeOptions(top_k=2))
    assert DraftSpec("lookup").with_options({}) == DraftSpec("lookup")
    assert DraftSpec.create("lookup", options={"max_branches": 1}).lookup == LookupOptions(max_branches=1)


def test_engine_records():
    static = DraftSpec("medusa", path="draft", tree=Tree.chain(2))
    assert static.to_dict() == {"method": "medusa", "path": "draft", "options": {},
                                "tree": {"kind": "static", "choices": [[0], [0, 0]], "num_nodes": 3, "max_depth": 2}}
    dynamic = DraftSpec("eagle", path="draft", dynamic=DynamicTreeOptions(12, 3, 3))
    assert dynamic.to_dict() == {"method": "eagle", "path": "draft", "options": {"total_tokens": 12, "depth": 3,
                                 "top_k": 3}, "tree": {"kind": "dynamic", "total_tokens": 12, "depth": 3, "top_k": 3}}
    assert DraftSpec("lookup", lookup=LookupOptions()).to_dict()["options"] == dataclasses.asdict(LookupOptions())
    assert DraftSpec.from_mapping({"method": "medusa", "path": "draft", "config": {}, "tree": {"kind": "static",
                                   "choices": [[0]]}, "options": {}}) == DraftSpec("medusa", "draft", Tree.chain(1))
    assert DraftSpec.from_mapping({"method": "none", "tree": None}) == DraftSpec()
    with pytest.raises(DraftSpecError, match="tree: expected null"):
        DraftSpec.from_mapping({"method": "medusa", "tree": {"kind": "bushy"}})
    with pytest.raises(DraftSpecError, match="kind: missing key 'method'"):
        DraftSpec.from_mapping({"path": "draft"})


def test_describe_and_tree_shape():
    assert DraftSpec().describe() == "none"
    assert DraftSpec("medusa", path="h", tree=Tree.chain(3), max_draft_len=8).describe() == (
        "medusa (weights h, static tree: 4 nodes, depth 3, max_draft_len 8)")
    assert DraftSpec("eagle", dynamic=DynamicTreeOptions(30, 4, 5)).describe() == (
        "eagle (dynamic tree: total_tokens 30, depth 4, top_k 5)")
    assert DraftSpec("medusa").describe() == "medusa (the drafter's default tree)"
    assert DraftSpec("eagle", tree=Tree.chain(2), pruning=PruneOptions(0.02)).describe() == (
        "eagle (static tree: 3 nodes, depth 2, paths below probability 0.02 pruned)")
    assert (DraftSpec("eagle").draft_nodes, DraftSpec("eagle").max_tree_depth) == (59, 6)
    assert (DraftSpec("eagle", dynamic=DynamicTreeOptions(3, 5)).max_tree_depth) == 2  # 3 nodes: depth 2 at most
    lookup = DraftSpec("lookup", lookup=LookupOptions(num_draft_tokens=7, max_depth=4))
    assert (lookup.draft_nodes, lookup.max_tree_depth) == (7, 4)
    assert (DraftSpec().draft_nodes, DraftSpec().max_tree_depth) == (0, 0)
    merged = DraftSpec("eagle", path="h", tree=Tree.chain(3), lookup=LookupOptions(num_draft_tokens=5, max_depth=4))
    assert (merged.draft_nodes, merged.max_tree_depth) == (3 + 5, 4)  # the head's nodes plus lookup's, deepest of both
    assert merged.merges_lookup and not merged.model_only.merges_lookup
    assert merged.model_only == DraftSpec("eagle", path="h", tree=Tree.chain(3))
    assert (merged.model_only.draft_nodes, merged.model_only.max_tree_depth) == (3, 3)
    assert not DraftSpec("lookup", lookup=LookupOptions()).merges_lookup
    assert "merged prompt lookup: max_ngram 3" in merged.describe()
    with pytest.raises(ConfigError, match="loaded drafter's spec"):
        DraftSpec("medusa").draft_nodes  # noqa: B018


def test_front_ends_name_their_own_keys():
    with pytest.raises(ConfigError, match="^draft.checkpoint: drafter 'none' has no weights"):
        with field_names("yaml"):
            DraftSpec("none", path="h")
    with pytest.raises(ConfigError, match="^draft_model: drafter 'lookup' has no weights"):
        LoadConfig(model="m", draft="lookup", draft_model="h")
    with pytest.raises(ConfigError, match=r"^draft_options: unknown option\(s\) \['beam'\]"):
        LoadConfig(model="m", draft="eagle", draft_options={"beam": 2})
    with pytest.raises(ConfigError, match="^max_draft_len: got -1"):
        LoadConfig(model="m", max_draft_len=-1)
    with pytest.raises(ConfigError, match="^draft: unknown drafter kind 'hydra'"):
        LoadConfig(model="m", draft="hydra")


def test_one_list_of_kinds():
    assert kind_names() == ("medusa", "eagle3", "eagle", "lookup", "none")  # the built-in kinds, in registry order
    with pytest.raises(BuildConfigError, match="^draft.method: unknown drafter kind 'hydra'; expected one of medusa, "
                                               "eagle3, eagle, lookup, none"):
        DraftSection("hydra")  # the builder YAML's draft.method
    draft = next(a for a in runtime_parser()._subparsers._group_actions[0].choices["generate"]._actions
                 if a.dest == "draft")
    assert tuple(draft.choices) == kind_names()  # python -m runtime --draft
    assert DraftSection("medusa", checkpoint="/h").spec() == DraftSpec("medusa", path="/h")


def test_one_table_of_field_names():
    """Every DraftSpec field has its name in each front end in FIELD_NAMES, and engine.json's record uses them."""
    assert {f.name for f in dataclasses.fields(DraftSpec)} | {"options"} == set(FIELD_NAMES)
    record = DraftSpec("eagle", path="h", max_draft_len=4, quantization="int8").to_dict()
    assert set(record) == {FIELD_NAMES[f].record for f in ("kind", "path", "tree", "options", "max_draft_len",
                                                           "quantization")}
    assert record["method"] == "eagle"  # engine.json keeps its key, as engines already built have it
    with pytest.raises(ValueError, match="front_end"):
        with field_names("json"):
            pass