"""The verify-cost cut (`PruneOptions.by_cost`): the pure budget rule (`runtime.tree.cost_budget`), the measured curve's
shape (`runtime.verify_cost`), and the option's way from a spec to the decoder."""

from __future__ import annotations

import math

import pytest

from runtime import verify_cost
from runtime.draft_spec import DraftSpec, PruneOptions
from runtime.errors import ConfigError
from runtime.tree import Tree, cost_budget


def _scores(probs: list[float]) -> list[float]:
    return [0.0] + [math.log(p) for p in probs]


def test_cost_budget_maximises_expected_tokens_per_cost():
    parents = [-1, 0, 1, 2]  # a chain of three below the root
    scores = _scores([0.9, 0.6, 0.3])  # expected tokens 1, 1.9, 2.5, 2.8 for 1..4 nodes
    assert cost_budget(parents, scores, (1.0, 1.0, 1.0, 1.0)) == 4  # free nodes: all of them
    assert cost_budget(parents, scores, (1.0, 2.0, 3.0, 4.0)) == 1  # a node costs a forward: none pays
    # 1.9 / 1.2 = 1.58, 2.5 / 1.4 = 1.79, 2.8 / 1.8 = 1.56: three nodes
    assert cost_budget(parents, scores, (1.0, 1.2, 1.4, 1.8)) == 3


def test_cost_budget_ranks_by_score_capped_at_the_parent_and_stops_at_the_curve():
    parents = [-1, 0, 0, 1]
    # node 3's own score is above its parent's (a merged source's): it counts as its parent's, after it
    scores = [0.0, math.log(0.2), math.log(0.8), math.log(0.5)]
    # best order: node 2 (0.8), node 1 (0.2), node 3 (capped 0.2): 1.8 / 1.1 = 1.64 beats 2.0 / 1.5 and 2.2 / 1.9
    assert cost_budget(parents, scores, (1.0, 1.1, 1.5, 1.9)) == 2
    assert cost_budget(parents, scores, (1.0, 1.0)) == 2  # no curve past two nodes: two at most
    assert cost_budget([-1], [0.0], (1.0, 1.0)) == 1  # the root alone


def test_ties_go_to_fewer_nodes():
    assert cost_budget([-1, 0], _scores([0.5]), (1.0, 1.5)) == 1  # 1.5 / 1.5 = 1 / 1


def test_curve_is_relative_linear_between_points_and_never_decreasing():
    c = verify_cost.curve({1: 2.0, 2: 2.0, 4: 3.0, 8: 2.5}, 10)
    assert c[:4] == (1.0, 1.0, 1.25, 1.5)
    assert c[4:] == (1.5,) * 6  # 2.5 at 8 would be cheaper than 4: held at 4's; flat past the last point


def test_measure_gives_one_entry_per_node_count_starting_at_one(tmp_path):
    from runtime.model import TargetModel
    from tests.tiny import make_checkpoint

    model = TargetModel.from_pretrained(make_checkpoint(tmp_path / "m", "llama3", seed=1))
    c = verify_cost.measure(model, 5, sizes=(1, 2, 4), passes=1, context=8)
    assert len(c) == 5 and c[0] == 1.0 and all(b >= a for a, b in zip(c, c[1:]))


def test_a_spec_asks_for_the_curve_only_with_by_cost(monkeypatch):
    calls = []
    monkeypatch.setattr(verify_cost, "measure", lambda model, n: calls.append(n) or (1.0,) * n)
    model = object.__new__(type("Model", (), {}))  # anything weak-referenceable: measure is replaced
    tree = Tree.from_choices([[0], [1], [0, 0]])
    plain = DraftSpec.create("eagle", path="unused", tree=tree, options={"min_path_prob": 0.1})
    assert verify_cost.verify_cost_for(plain, model, 4) is None
    cut = DraftSpec.create("eagle", path="unused", tree=tree, options={"by_cost": True})
    assert verify_cost.verify_cost_for(cut, model, 4) == (1.0,) * 4
    assert verify_cost.verify_cost_for(cut, model, 4) == (1.0,) * 4 and calls == [4]  # measured once
    assert verify_cost.verify_cost_for(cut, model, 1) is None  # a root-only budget has nothing to cut
    assert "cut by measured verify cost" in cut.describe()


def test_by_cost_must_be_a_bool():
    with pytest.raises(ConfigError, match="by_cost"):
        PruneOptions(by_cost="yes")
