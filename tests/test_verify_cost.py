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
    return [0.0] + [math.log(p) if p > 0 else -math.inf for p in probs]


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
    monkeypatch.setattr(verify_cost, "measure",
                        lambda model, n: calls.append(n) or tuple(1.0 + 0.5 * k for k in range(n)))
    model = type("Model", (), {"config": type("Config", (), {"max_context": 1000})})()
    tree = Tree.from_choices([[0], [1], [0, 0]])
    plain = DraftSpec.create("eagle", path="unused", tree=tree, options={"min_path_prob": 0.1})
    assert verify_cost.verify_cost_for(plain.pruning, model, 4) is None
    cut = DraftSpec.create("eagle", path="unused", tree=tree, options={"by_cost": True})
    assert verify_cost.verify_cost_for(cut.pruning, model, 4) == (1.0, 1.5, 2.0, 2.5)
    assert verify_cost.verify_cost_for(cut.pruning, model, 3) == (1.0, 1.5, 2.0)
    assert verify_cost.costs(model, verify_cost.CAP + 2)[-3:] == tuple(1.0 + 0.5 * k for k in range(63, 66))
    assert calls == [verify_cost.CAP]  # measured once per model, up to the cap; sliced and extended after
    assert verify_cost.verify_cost_for(cut.pruning, model, 1) is None  # a root-only budget has nothing to cut
    assert "cut by measured verify cost" in cut.describe()


def test_by_cost_must_be_a_bool():
    with pytest.raises(ConfigError, match="by_cost"):
        PruneOptions(by_cost="yes")


def test_deeper_levels_pay_only_if_their_bound_would_be_kept():
    from runtime.tree import deeper_pays

    tree = Tree.from_choices([[0], [1], [0, 0], [0, 0, 0]])  # root; two children; node 1's child; below it
    assert tree.parent_list == (-1, 0, 0, 1, 3)
    scores = _scores([0.9, 0.05, 0.0, 0.0])  # depth 1 known; nodes 3 and 4 not drafted yet (bounded by 0.9)
    cheap = (1.0, 1.05, 1.1, 1.15, 1.2)
    assert deeper_pays(tree, scores, 1, cheap)  # node 3 at up to 0.9 would be kept
    # 1.9 / 1.5 = 1.27 beats 2.8 / 2.5 (a third node even at 0.9): the cut keeps node 1 alone, whose child ranks
    # after it
    steep = (1.0, 1.5, 2.5, 3.5, 4.5)
    assert not deeper_pays(tree, scores, 1, steep)
    assert not deeper_pays(tree, _scores([0.01, 0.01, 0.0, 0.0]), 1, (1.0, 1.2, 1.4, 1.6, 1.8))  # nothing pays
    assert deeper_pays(tree, _scores([0.9, 0.05, 0.8, 0.0]), 2, cheap)  # depth 2 known: node 4 at up to 0.8


def test_a_static_eagle_step_stops_drafting_levels_the_cut_would_not_verify(tmp_path, monkeypatch):
    """With a verify-cost curve where no second level can pay, the head runs one level a step, not three, and greedy
    output is unchanged."""
    from runtime.decode import SpecDecoder
    from runtime.drafters import eagle, load_drafter
    from runtime.model import TargetModel
    from tests.heads import write_eagle_head
    from tests.tiny import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "m", "llama3", seed=2)
    model = TargetModel.from_pretrained(ckpt)
    head = write_eagle_head(tmp_path / "eagle", ckpt, seed=3)
    tree = Tree.from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    spec = DraftSpec.create("eagle", path=head, tree=tree, options={"by_cost": True})
    forwards = []
    real = eagle.DraftTreeCache.forward
    monkeypatch.setattr(eagle.DraftTreeCache, "forward", lambda self, *a: forwards.append(1) or real(self, *a))
    outputs = {}
    for name, curve in [("flat", (1.0,) * 64), ("steep", tuple(1.0 + 2.0 * n for n in range(64)))]:
        monkeypatch.setitem(verify_cost._measured, model, curve)  # what the drafter's curve is read from
        dec = SpecDecoder(model, None, load_drafter(spec, model), tree.num_nodes, verify_cost=curve)
        forwards.clear()
        outputs[name] = list(dec.generate([5, 6, 7, 8], max_tokens=12, ignore_eos=True).token_ids)
        outputs[name + " forwards"] = len(forwards)
    assert outputs["flat"] == outputs["steep"]
    assert outputs["steep forwards"] == 0 < outputs["flat forwards"]  # the depth-1 nodes come from the root's output


def test_a_builder_plans_with_a_cost_cut_drafter_on_a_weightless_target(tmp_path):
    """The curve is measured on a drafter's first draft, not when it is made: the builder validates heads on a meta
    target that cannot run."""
    from builder.plan import meta_target
    from runtime.drafters import load_drafter
    from runtime.model import TargetModel
    from tests.heads import write_eagle_head
    from tests.tiny import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "m", "llama3", seed=2)
    config = TargetModel.from_pretrained(ckpt).config
    head = write_eagle_head(tmp_path / "eagle", ckpt, seed=3)
    spec = DraftSpec.create("eagle", path=head, tree=Tree.from_choices([[0], [0, 0]]), options={"by_cost": True})
    drafter = load_drafter(spec, meta_target(config))
    assert drafter.pruning.by_cost and drafter.model not in verify_cost._measured  # asks for the curve, not measured
