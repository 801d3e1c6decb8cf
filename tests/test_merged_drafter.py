"""Prompt lookup merged into a model drafter's trees (runtime/drafters/merged.py): the trie merge itself, and greedy
output through runtime.load and an engine directory identical to plain decoding. Sampled output stays exactly
distributed: tests/test_decode.py::test_sampled_distribution_with_merged_prompt_lookup (+ its negative control)."""

from __future__ import annotations

import math
import random

import pytest
import torch

import runtime
from runtime.draft_spec import DraftSpec, LookupOptions
from runtime.drafters import load_drafter
from runtime.drafters.lookup import LookupDrafter
from runtime.drafters.merged import MergedDrafter, draft_pool, merge_drafts, merge_pools
from runtime.errors import ConfigError
from runtime.model import TargetModel
from runtime.protocol import Draft, Proposal
from runtime.tree import CandidatePool, Tree
from tests.heads import draft_paths, write_eagle_config, write_eagle_head, write_medusa_head
from tests.tiny import make_checkpoint


def _draft(choices, tokens) -> Draft:
    tree = Tree.from_choices(choices) if choices else Tree.root_only()
    order = {tuple(c): i + 1 for i, c in enumerate(choices)}  # tokens given in `choices` order
    toks = [tokens[0]] + [tokens[order[c]] for c in tree.choices]
    return Draft(tree, torch.tensor(toks))


def test_shared_prefixes_are_shared_and_new_branches_added():
    head = _draft([[0], [1], [0, 0]], [5, 7, 8, 9])  # 5 -> 7 -> 9, 5 -> 8
    look = _draft([[0], [0, 0], [0, 0, 0]], [5, 7, 9, 4])  # 5 -> 7 -> 9 -> 4
    merged = merge_drafts(head, look, 16)
    assert draft_paths(merged) == {(7,), (8,), (7, 9), (7, 9, 4)}
    assert merged.tree.num_nodes == 5 and merged.proposal is Proposal.DETERMINISTIC
    other = merge_drafts(head, _draft([[0], [0, 0]], [5, 8, 1]), 16)  # grafted under the head's 8
    assert draft_paths(other) == {(7,), (8,), (7, 9), (8, 1)}


def test_budget_and_nothing_new():
    head = _draft([[0], [1]], [5, 7, 8])
    look = _draft([[0], [0, 0], [0, 0, 0], [1]], [5, 3, 4, 6, 2])
    # lookup's nodes in its own order (parents first: 3, 2, 3->4, 3->4->6) until the tree has 5 nodes
    assert draft_paths(merge_drafts(head, look, 5)) == {(7,), (8,), (3,), (2,)}
    assert merge_drafts(head, look, 3) is head  # no room
    assert merge_drafts(head, _draft([[0]], [5, 8]), 16) is head  # everything already there


def test_random_merges_keep_every_path_and_distinct_siblings():
    rng = random.Random(0)
    for _ in range(200):
        def rand(n):
            choices, tokens = [], [1]
            for _ in range(n):
                parent = rng.choice([()] + [tuple(c) for c in choices])
                rank = sum(1 for c in choices if tuple(c[:-1]) == parent)
                choices.append(list(parent) + [rank])
            # distinct sibling tokens, as drafters give them
            toks = {}
            for c in choices:
                used = {toks[tuple(o)] for o in choices if tuple(o) in toks and o[:-1] == c[:-1]}
                toks[tuple(c)] = rng.choice([t for t in range(2, 9) if t not in used])
            return _draft(choices, [1] + [toks[tuple(c)] for c in choices])

        head, look = rand(rng.randint(0, 6)), rand(rng.randint(1, 6))
        budget = rng.randint(1, 14)
        merged = merge_drafts(head, look, budget)
        assert draft_paths(head) <= draft_paths(merged) <= draft_paths(head) | draft_paths(look)
        assert merged.tree.num_nodes <= max(budget, head.tree.num_nodes)
        if head.tree.num_nodes + len(draft_paths(look) - draft_paths(head)) <= budget:
            assert draft_paths(merged) == draft_paths(head) | draft_paths(look)
        toks, parents = merged.tokens.tolist(), merged.tree.parent_list
        for node in range(merged.tree.num_nodes):
            kids = [toks[c] for c in merged.tree.children(node)]
            assert len(kids) == len(set(kids))
        assert all(parents[n] < n for n in range(1, merged.tree.num_nodes))


def _scored(draft: Draft, scores_by_path: dict[tuple[int, ...], float]) -> Draft:
    """The draft with each node's score given by its token path."""
    paths = {}
    toks, parents = draft.tokens.tolist(), draft.tree.parent_list
    scores = [0.0]
    for node in range(1, draft.tree.num_nodes):
        paths[node] = paths.get(parents[node], ()) + (toks[node],)
        scores.append(scores_by_path[paths[node]])
    return Draft(draft.tree, draft.tokens, draft.proposal, scores=torch.tensor(scores))


def _node_scores(draft: Draft) -> dict[tuple[int, ...], float]:
    toks, parents, out, paths = draft.tokens.tolist(), draft.tree.parent_list, {}, {0: ()}
    for node in range(1, draft.tree.num_nodes):
        paths[node] = paths[parents[node]] + (toks[node],)
        out[paths[node]] = float(draft.scores[node])
    return out


def test_scored_merge_keeps_the_best_nodes_of_both():
    # head: 5 -> 7 (-0.2) -> 9 (-1.5), 5 -> 8 (-2.0); lookup: 5 -> 7 -> 9 -> 4 and 5 -> 3, at -0.5 per token
    head = _scored(_draft([[0], [1], [0, 0]], [5, 7, 8, 9]), {(7,): -0.2, (8,): -2.0, (7, 9): -1.5})
    look = _scored(_draft([[0], [0, 0], [0, 0, 0], [1]], [5, 7, 9, 4, 3]),
                   {(7,): -0.5, (7, 9): -1.0, (7, 9, 4): -1.5, (3,): -0.5})
    merged = merge_drafts(head, look, 5)
    # the union, each node its parent's score plus the likelier source's step: 7 (-0.2, head's), 3 (-0.5),
    # 7->9 (-0.2 - 0.5: lookup's step), 7->9->4 (-0.7 - 0.5), 8 (-2.0): the best 4 are kept
    assert _node_scores(merged) == pytest.approx({(7,): -0.2, (3,): -0.5, (7, 9): -0.7, (7, 9, 4): -1.2})
    assert merged.tree.num_nodes == 5 and merged.proposal is Proposal.DETERMINISTIC
    # siblings ranked by score: 7 before 3
    assert [int(merged.tokens[c]) for c in merged.tree.children(0)] == [7, 3]
    assert draft_paths(merge_drafts(head, look, 2)) == {(7,)}
    assert draft_paths(merge_drafts(head, look, 16)) == draft_paths(head) | draft_paths(look)
    # without scores on either side: the head's tree first, lookup in what budget is left
    assert draft_paths(merge_drafts(head, _draft([[0]], [5, 3]), 4)) == {(7,), (8,), (7, 9)}


def test_random_scored_merges_are_the_top_nodes_of_the_union():
    rng = random.Random(1)
    for _ in range(200):
        def rand(n):
            choices, tokens, score = [], {}, {(): 0.0}
            for _ in range(n):
                parent = rng.choice([()] + [tuple(c) for c in choices])
                rank = sum(1 for c in choices if tuple(c[:-1]) == parent)
                c = parent + (rank,)
                used = {tokens[o] for o in tokens if o[:-1] == parent}
                free = [t for t in range(2, 9) if t not in used]
                if not free:
                    continue
                choices.append(c)
                tokens[c] = rng.choice(free)
                score[c] = score[parent] - rng.random() - 1e-3  # a child below its parent, no ties
            draft = _draft([list(c) for c in choices], [1] + [tokens[c] for c in choices])
            by_path = {}
            for c in choices:
                by_path[tuple(tokens[c[:i]] for i in range(1, len(c) + 1))] = score[c]
            return _scored(draft, by_path)

        head, look = rand(rng.randint(0, 7)), rand(rng.randint(1, 7))
        budget = rng.randint(1, 16)
        step: dict[tuple[int, ...], float] = {}  # each node's likeliest step from its parent, over both sources
        for draft in (head, look):
            scores = _node_scores(draft)
            for path, score in scores.items():
                step[path] = max(score - scores.get(path[:-1], 0.0), step.get(path, -math.inf))
        eff = {p: sum(step[p[:i]] for i in range(1, len(p) + 1)) for p in step}
        best = sorted(eff, key=lambda p: -eff[p])[: budget - 1]
        merged = merge_drafts(head, look, budget)
        assert draft_paths(merged) == set(best)
        assert _node_scores(merged) == pytest.approx({p: eff[p] for p in best})
        parents = merged.tree.parent_list
        assert all(merged.scores[n] <= merged.scores[parents[n]] for n in range(1, merged.tree.num_nodes))


def test_merge_pools_ranks_a_head_candidate_below_a_lookup_node_by_the_head_step():
    # The head's pool: 7 (-0.1), 8 (-3.0) -> 9 (-3.2: a likely step after an unlikely 8). Lookup proposes 8 (-0.3).
    head = CandidatePool(torch.tensor([-1, -1, 1]), torch.tensor([7, 8, 9]), torch.tensor([-0.1, -3.0, -3.2]))
    look = CandidatePool(torch.tensor([-1]), torch.tensor([8]), torch.tensor([-0.3]))
    merged = merge_pools([head, look], 5, 3)
    # 8 counts as lookup's -0.3 and 8 -> 9 as -0.3 - 0.2: above the head's own -3.2, so 9 is kept beside 7 and 8
    assert _node_scores(merged) == pytest.approx({(7,): -0.1, (8,): -0.3})
    assert _node_scores(merge_pools([head, look], 5, 4)) == pytest.approx({(7,): -0.1, (8,): -0.3, (8, 9): -0.5})
    assert _node_scores(merge_pools([head], 5, 3)) == pytest.approx({(7,): -0.1, (8,): -3.0})
    assert merge_pools([], 5, 4).tree.num_nodes == 1


def test_eagle_candidates_are_the_pool_its_dynamic_tree_is_cut_from(target, tmp_path):
    """`EagleSession.candidates`: the pool `draft` selects from (pruned entries left out), so a merge can rank all
    of it; a static tree has none; a merged session's tree is the best of that pool and lookup's."""
    model = TargetModel.from_pretrained(target)
    head = write_eagle_head(tmp_path / "eagle", target, seed=1)
    hidden = model.prefill(torch.tensor([PROMPT]), model.new_cache(len(PROMPT)))[1][0]

    def load(**kw):
        return load_drafter(DraftSpec.create("eagle", path=head, tree="dynamic", options=options | kw), model)

    options = dict(total_tokens=6, top_k=3, depth=3)
    whole = load().start(torch.tensor(PROMPT), hidden, 6).candidates(44, None, None)
    floor = float(whole.scores.median())  # prune about half of it
    options["min_path_prob"] = math.exp(floor)
    drafter = load()
    a, b = drafter.start(torch.tensor(PROMPT), hidden, 6), drafter.start(torch.tensor(PROMPT), hidden, 6)
    own, pool = a.draft(44, None, None), b.candidates(44, None, None)
    assert own.tree.num_nodes == 6 and pool.tokens.shape[0] > 5  # more candidates than the cut keeps
    parents = pool.parents.tolist()
    assert all(-1 <= p < i for i, p in enumerate(parents))
    kept = [(tok, score) for tok, score in zip(whole.tokens.tolist(), whole.scores.tolist())
            if score >= math.log(options["min_path_prob"])]
    assert list(zip(pool.tokens.tolist(), pool.scores.tolist())) == kept  # in order, the pruned ones left out
    assert 0 < len(kept) < whole.tokens.shape[0]
    cut = merge_pools([pool], 44, 6)
    assert _node_scores(cut) == pytest.approx(_node_scores(own), abs=1e-6)
    static = load_drafter(DraftSpec.create("eagle", path=head, tree="chain-2"), model)
    assert static.start(torch.tensor(PROMPT), hidden, 6).candidates(44, None, None) is None
    # merged with prompt lookup: the best of the head's whole pool and lookup's continuations
    lookup = LookupOptions(num_draft_tokens=6, max_branches=2)
    merged = load(num_draft_tokens=lookup.num_draft_tokens, max_branches=lookup.max_branches)
    session = merged.start(torch.tensor(PROMPT), hidden, 6)
    tree = session.draft(44, None, None)
    look = LookupDrafter(lookup).start(torch.tensor(PROMPT), None, 6).draft(44)
    assert look.tree.num_nodes > 1
    ref = merge_pools([drafter.start(torch.tensor(PROMPT), hidden, 6).candidates(44, None, None), draft_pool(look)],
                      44, 6)
    assert _node_scores(tree) == pytest.approx(_node_scores(ref), abs=1e-6)
    assert draft_paths(tree) & draft_paths(look)  # lookup's nodes compete for the budget


def test_eagle2_total_tokens_bound_the_merged_tree(target, tmp_path):
    """EAGLE-2 + prompt lookup: total_tokens is the merged tree's size, whatever budget the caller has left (the
    merge keeps the best nodes of the union), so a config's node budget need only cover total_tokens; a static
    tree takes lookup's nodes on top of its own."""
    from builder.config import load_config
    from builder.plan import plan_build

    model = TargetModel.from_pretrained(target)
    head = write_eagle_head(tmp_path / "eagle", target, seed=1)
    hidden = model.prefill(torch.tensor([PROMPT]), model.new_cache(len(PROMPT)))[1][0]
    options = dict(total_tokens=6, top_k=3, depth=3, num_draft_tokens=8, max_branches=2)
    spec = DraftSpec.create("eagle", path=head, tree="dynamic", options=options)
    assert spec.draft_nodes == 5 and spec.max_tree_depth <= 5
    merged = load_drafter(spec, model)
    assert merged.node_budget(30) == 6 and merged.node_budget(4) == 4
    tree = merged.start(torch.tensor(PROMPT), hidden, 30).draft(44, None, None)
    pool = load_drafter(spec.model_only, model).start(torch.tensor(PROMPT), hidden, 30).candidates(44, None, None)
    look = LookupDrafter(spec.lookup).start(torch.tensor(PROMPT), None, 30).draft(44)
    assert look.tree.num_nodes > 1
    assert tree.tree.num_nodes == 6
    assert _node_scores(tree) == pytest.approx(_node_scores(merge_pools([pool, draft_pool(look)], 44, 6)), abs=1e-6)
    static = DraftSpec.create("eagle", path=head, tree="chain-2", options=dict(num_draft_tokens=8))
    merged_static = load_drafter(static, model)
    assert static.draft_nodes == 10 and merged_static.node_budget(30) == 11 and merged_static.node_budget(7) == 7
    # the bound is the spec's, not a cut: the merged static tree is what an unbounded merge of the two gives
    base = load_drafter(static.model_only, model).start(torch.tensor(PROMPT), hidden, 30).draft(44, None, None)
    look = LookupDrafter(static.lookup).start(torch.tensor(PROMPT), None, 30).draft(44)
    tree = merged_static.start(torch.tensor(PROMPT), hidden, 30).draft(44, None, None)
    assert draft_paths(tree) == draft_paths(merge_drafts(base, look, 64)) and tree.tree.num_nodes <= 11
    def dynamic(name, total_tokens):
        return write_eagle_config(tmp_path / name, target, head, build={"max_draft_len": 5}, draft={
            "tree": {"dynamic": {"total_tokens": total_tokens, "top_k": 3}},
            "lookup": {"num_draft_tokens": 8, "datastore_tokens": 0}})

    assert plan_build(load_config(dynamic("eagle2.yaml", 6))).draft.draft_nodes == 5
    bad = dynamic("bad.yaml", 7)
    with pytest.raises(ConfigError, match=r"6 draft nodes per step.*build.max_draft_len = 5"):
        plan_build(load_config(bad))


def test_merge_refuses_sampled_proposals_and_other_roots():
    head = _draft([[0]], [5, 7])
    with pytest.raises(ConfigError, match="roots differ"):
        merge_drafts(head, _draft([[0]], [6, 7]), 8)
    sampled = Draft(head.tree, head.tokens, Proposal.IID, draft_probs=torch.full((2, 4), 0.25))
    with pytest.raises(ConfigError, match="DETERMINISTIC"):
        merge_drafts(sampled, head, 8)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("merged") / "llama3", "llama3")


# The prompt repeats itself, so prompt lookup finds continuations at most steps.
PROMPT = [0, 40, 41, 42, 43, 44, 40, 41, 42, 50, 51, 40, 41, 42, 43]


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_greedy_output_identical_to_plain_decoding(target, tmp_path, kind):
    model = TargetModel.from_pretrained(target)
    if kind == "eagle":
        heads = write_eagle_head(tmp_path / "eagle", target, seed=1)
    else:
        heads = write_medusa_head(tmp_path / "medusa", model.config.hidden_size, model.config.vocab_size, num_heads=2)
    plain = runtime.load(str(target), draft="none").generate(PROMPT, max_tokens=40, ignore_eos=True)
    dec = runtime.load(str(target), draft=kind, draft_model=str(heads), tree="chain-2",
                       num_draft_tokens=6, max_branches=2)
    assert isinstance(dec.drafter, MergedDrafter)
    assert dec.drafter.spec.lookup == LookupOptions(num_draft_tokens=6, max_branches=2)
    out = dec.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert out.token_ids == plain.token_ids
    # lookup nodes really were drafted: more than the chain's 2 per step
    assert out.stats.drafted_tokens > 2 * out.stats.steps


def test_scored_merge_greedy_output_identical_to_plain_decoding(target, tmp_path):
    """EAGLE-2's scored nodes and prompt lookup's share a 6-node budget (`merge_drafts`' scored rule)."""
    heads = write_eagle_head(tmp_path / "eagle", target, seed=1)
    plain = runtime.load(str(target), draft="none").generate(PROMPT, max_tokens=40, ignore_eos=True)
    dec = runtime.load(str(target), draft="eagle", draft_model=str(heads), max_draft_len=5, total_tokens=6, top_k=3,
                       depth=3, num_draft_tokens=6, max_branches=2)
    out = dec.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted_tokens <= 5 * out.stats.steps


def test_engine_keeps_the_merge(target, tmp_path):
    from builder.build import build_engine
    from builder.config import load_config
    from builder.plan import plan_build

    heads = write_eagle_head(tmp_path / "eagle", target, seed=1)
    lookup = {"lookup": {"num_draft_tokens": 4, "max_branches": 1}}
    cfg = write_eagle_config(tmp_path / "eagle.yaml", target, heads, draft=lookup, build={"max_draft_len": 6})
    result = build_engine(load_config(cfg))
    assert result.manifest["draft"]["options"]["num_draft_tokens"] == 4
    dec = runtime.load(str(result.output))
    assert isinstance(dec.drafter, MergedDrafter) and dec.drafter.spec.lookup.num_draft_tokens == 4
    plain = runtime.load(str(target), draft="none").generate(PROMPT, max_tokens=24, ignore_eos=True)
    assert dec.generate(PROMPT, max_tokens=24, ignore_eos=True).token_ids == plain.token_ids
    # the node budget covers the head's tree plus lookup's nodes
    bad = write_eagle_config(tmp_path / "bad.yaml", target, heads, draft=lookup, build={"max_draft_len": 5})
    with pytest.raises(ConfigError, match=r"draft.tree \+ draft.lookup.num_draft_tokens: 6 draft nodes per step"):
        plan_build(load_config(bad))


def test_drafter_is_built_from_the_spec(target, tmp_path):
    model = TargetModel.from_pretrained(target)
    heads = write_eagle_head(tmp_path / "eagle", target, seed=1)
    spec = DraftSpec.create("eagle", path=heads, tree="chain-2", options={"num_draft_tokens": 3})
    drafter = load_drafter(spec, model)
    assert isinstance(drafter, MergedDrafter) and drafter.name == "eagle"
    assert drafter.head is drafter.primary.head  # the model drafter's attributes stay reachable
    assert not isinstance(load_drafter(spec.model_only, model), MergedDrafter)
