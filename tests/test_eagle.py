"""EAGLE-1 head: checkpoint formats, head outputs and drafts vs a straightforward transformers reference
(LlamaDecoderLayer with input_layernorm = Identity, run over the whole sequence without a cache), static and
dynamic (EAGLE-2) trees across several steps, bounds and errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from plugins.tree_attention.mask import pack_mask
from runtime.draft_spec import DraftSpec, DynamicTreeOptions
from runtime.drafters import load_drafter
from runtime.drafters.eagle import DraftStateError, EagleDrafter, load_eagle_head
from runtime.errors import CheckpointError, ConfigError
from runtime.model import TargetModel, causal_mask
from runtime.protocol import Proposal
from runtime.tree import Tree
from tests.heads import write_eagle_head
from tests.tiny import make_checkpoint

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "llama2", seed=3)


@pytest.fixture(scope="module")
def target(target_dir):
    return TargetModel.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target_dir):
    return write_eagle_head(tmp_path_factory.mktemp("eagle"), target_dir, fmt="bin", seed=1)


class ReferenceEagle:
    """EAGLE-1 head as written in the paper, on transformers components; recomputes the whole sequence."""

    def __init__(self, head_dir: Path, hf_target) -> None:
        from safetensors.torch import load_file
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        raw = json.loads((head_dir / "config.json").read_text())
        cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")})
        cfg._attn_implementation = "eager"
        bin_file = head_dir / "pytorch_model.bin"
        if bin_file.exists():
            state = torch.load(bin_file, weights_only=True)
        else:
            state = load_file(str(head_dir / "model.safetensors"))
        self.layers = [LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: no input norm in layer 0
        for i, layer in enumerate(self.layers):
            prefix = f"layers.{i}."
            layer.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias="fc.bias" in state)
        self.fc.load_state_dict({k[3:]: v for k, v in state.items() if k.startswith("fc.")})
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.embed = (
            nn.Embedding.from_pretrained(state["embed_tokens.weight"])
            if "embed_tokens.weight" in state
            else hf_target.model.embed_tokens
        )
        self.lm_head = hf_target.lm_head

    @torch.no_grad()
    def features(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """feats # [T, H] (f_t), tokens # [T] (x_{t+1}) -> predicted features # [T, H], positions 0..T-1."""
        t = tokens.shape[0]
        x = self.fc(torch.cat([self.embed(tokens), feats], dim=-1))[None]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x, pos))
            x = x[0] if isinstance(x, tuple) else x
        return x[0]

    @torch.no_grad()
    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        return self.lm_head(feats).float()


class Sequence:
    """The committed sequence and the target's hidden states (from transformers, full recompute)."""

    def __init__(self, hf_target, prompt: list[int]) -> None:
        self.hf = hf_target
        self.tokens = list(prompt)

    @torch.no_grad()
    def hidden(self) -> torch.Tensor:  # [L, H]: final-norm output
        return self.hf.model(torch.tensor([self.tokens])).last_hidden_state[0]

    @torch.no_grad()
    def next_token(self, extra: list[int]) -> int:
        return int(self.hf(torch.tensor([self.tokens + extra])).logits[0, -1].argmax())


class ReferenceDrafts:
    """Node outputs of the reference head for one step: base pairs (h_t, x_{t+1}) up to the root."""

    def __init__(self, ref: ReferenceEagle, hidden: torch.Tensor, tokens: list[int], root: int) -> None:
        self.ref = ref
        self.base_feats = hidden  # [L, H]
        self.base_toks = torch.tensor(tokens[1:] + [root])  # [L]
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def out(self, path: tuple[int, ...]) -> torch.Tensor:
        """Head output at the node reached by token path (() = the root): # [H]."""
        if path not in self.memo:
            feats = [self.base_feats] + [self.out(path[:j])[None] for j in range(len(path))]
            toks = torch.cat([self.base_toks, torch.tensor(path, dtype=torch.int64)])
            self.memo[path] = self.ref.features(torch.cat(feats), toks)[-1]
        return self.memo[path]

    def logprobs(self, path: tuple[int, ...]) -> torch.Tensor:
        return torch.log_softmax(self.ref.logits(self.out(path)), dim=-1)

    def dynamic_pool(self, total_tokens: int, depth: int, top_k: int) -> dict[tuple[int, ...], float]:
        """EAGLE-2 (reference-facts 2): token path -> cumulative log-prob of the selected nodes."""
        top = self.logprobs(()).topk(top_k)
        level = {(int(t),): float(s) for s, t in zip(top.values, top.indices)}
        pool = dict(level)
        frontier = sorted(level, key=lambda p: -level[p])[:top_k]
        for _ in range(min(depth, total_tokens - 2)):
            cands = {}
            for p in frontier:
                top = self.logprobs(p).topk(top_k)
                for s, t in zip(top.values, top.indices):
                    cands[p + (int(t),)] = pool[p] + float(s)
            pool.update(cands)
            frontier = sorted(cands, key=lambda p: -cands[p])[:top_k]
        keep = sorted(pool, key=lambda p: -pool[p])[: total_tokens - 1]
        return {p: pool[p] for p in keep}


def token_paths(draft) -> dict[int, tuple[int, ...]]:
    toks = draft.tokens.tolist()
    return {i: tuple(toks[j] for j in draft.tree.path(i)[1:]) for i in range(draft.tree.num_nodes)}


def check_static_draft(draft, rd: ReferenceDrafts) -> None:
    tree = draft.tree
    paths = token_paths(draft)
    ranks = tree.ranks.tolist()
    for i in range(tree.num_nodes):
        kids = tree.children(i)
        if kids:
            top = rd.ref.logits(rd.out(paths[i])).topk(max(ranks[c] for c in kids) + 1).indices.tolist()
            assert [int(draft.tokens[c]) for c in kids] == [top[ranks[c]] for c in kids], f"children of node {i}"


def run_steps(drafter, seq: Sequence, ref: ReferenceEagle, accepted: list[int], check, max_nodes: int = 64,
              step_nodes: list[int | None] | None = None):
    """Drive a session like the decode loop: draft (step k asking for step_nodes[k] nodes), accept `a` nodes along
    the deepest path, advance."""
    prompt = torch.tensor(seq.tokens)
    session = drafter.start(prompt, seq.hidden(), max_nodes)
    root = seq.next_token([])
    for k, a in enumerate(accepted):
        draft = session.draft(root, max_nodes=None if step_nodes is None else step_nodes[k])
        assert draft.tokens[0] == root and draft.proposal is Proposal.DETERMINISTIC
        assert draft.tree.num_nodes <= max_nodes
        check(draft, ReferenceDrafts(ref, seq.hidden(), seq.tokens, root))
        leaf = draft.tree.leaves[0]  # a deepest leaf
        path = draft.tree.path(leaf)[1 : a + 1]
        new = [root] + [int(draft.tokens[i]) for i in path]
        old_len = len(seq.tokens)
        seq.tokens += new
        session.advance(torch.tensor(new), seq.hidden()[old_len:])
        root = seq.next_token([])
    return session, root


# ---- head numerics -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, with_embedding", [("bin", False), ("safetensors", True), ("bin", True)])
def test_head_forward_matches_reference(tmp_path, target_dir, target, hf_target, fmt, with_embedding):
    path = write_eagle_head(tmp_path, target_dir, fmt=fmt, seed=2, with_embedding=with_embedding)
    head = load_eagle_head(path, target)
    assert (head.embed_tokens is not None) == with_embedding
    ref = ReferenceEagle(path, hf_target)
    gen = torch.Generator().manual_seed(0)
    t = 9
    feats = torch.randn(t, 64, generator=gen)
    toks = torch.randint(0, 420, (t,), generator=gen)
    embed = head.embed_tokens if with_embedding else target.embed
    cache = head.new_cache(32)
    out = head(embed(toks)[None], feats[None], torch.arange(t)[None], cache, causal_mask(t))[0]
    torch.testing.assert_close(out, ref.features(feats, toks), **TOL)
    cache.advance(t)
    # A tree block on top of the cache: node i at position t + depth - 1, attending its ancestors only.
    tree = Tree.from_choices([[0], [1], [0, 0], [1, 0], [1, 1], [1, 1, 0]])
    n = tree.num_nodes - 1  # the tree's root is the last cached pair; the block holds nodes 1..n
    node_feats = torch.randn(n, 64, generator=gen)
    node_toks = torch.randint(0, 420, (n,), generator=gen)
    positions = t - 1 + tree.depth[1:]
    mask = tree.mask[1:, 1:]
    got = head(embed(node_toks)[None], node_feats[None], positions[None], cache, pack_mask(mask)[None])[0]
    for i in range(n):
        anc = [j - 1 for j in tree.path(i + 1)[1:]]
        want = ref.features(torch.cat([feats, node_feats[anc]]), torch.cat([toks, node_toks[anc]]))[-1]
        torch.testing.assert_close(got[i], want, **TOL)


# ---- drafting vs the reference -----------------------------------------------------------------------------


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "chain-4"])
def test_static_tree_drafts_match_reference_over_steps(head_dir, target, hf_target, tree):
    drafter = load_drafter(DraftSpec.create("eagle", path=head_dir, tree=tree), target)
    assert drafter.name == "eagle"
    ref = ReferenceEagle(head_dir, hf_target)
    seq = Sequence(hf_target, [0, 11, 23, 5, 42, 7, 99])
    run_steps(drafter, seq, ref, accepted=[0, 2, 3, 1], check=check_static_draft)


def check_dynamic(total_tokens: int, depth: int, top_k: int):
    def check(draft, rd: ReferenceDrafts) -> None:
        want = rd.dynamic_pool(total_tokens, depth, top_k)
        paths = token_paths(draft)
        got = {p for i, p in paths.items() if i > 0}
        assert got == set(want)
        tree = draft.tree
        assert tree.num_nodes == total_tokens and tree.max_depth <= depth + 1
        for i in range(tree.num_nodes):  # ancestor-closed by construction of Tree; siblings best-first
            scores = [want[paths[c]] for c in tree.children(i)]
            assert scores == sorted(scores, reverse=True)

    return check


@pytest.mark.parametrize("total_tokens, depth, top_k", [(16, 3, 4), (30, 5, 6), (8, 1, 10)])
def test_dynamic_tree_matches_reference_eagle2_over_steps(head_dir, target, hf_target, total_tokens, depth, top_k):
    options = {"total_tokens": total_tokens, "depth": depth, "top_k": top_k}
    drafter = load_drafter(DraftSpec.create("eagle", path=head_dir, options=options), target)
    assert drafter.tree is None
    ref = ReferenceEagle(head_dir, hf_target)
    seq = Sequence(hf_target, [0, 17, 3, 3, 250, 8])
    run_steps(drafter, seq, ref, accepted=[1, 0, 4], check=check_dynamic(total_tokens, depth, top_k))


def test_dynamic_default_options_and_budget(head_dir, target, hf_target):
    drafter = load_drafter(DraftSpec.create("eagle", path=head_dir), target)
    assert drafter.dynamic == DynamicTreeOptions(total_tokens=60, depth=5, top_k=10)
    seq = Sequence(hf_target, [0, 5, 6, 7])
    session = drafter.start(torch.tensor(seq.tokens), seq.hidden(), 64)
    draft = session.draft(seq.next_token([]))
    assert draft.tree.num_nodes == 60 and draft.tree.max_depth <= 6
    # max_nodes below total_tokens shrinks the dynamic budget.
    session = drafter.start(torch.tensor(seq.tokens), seq.hidden(), 25)
    assert session.draft(seq.next_token([])).tree.num_nodes == 25
    session = drafter.start(torch.tensor(seq.tokens), seq.hidden(), 1)
    assert session.draft(3).tree.num_nodes == 1


def test_static_tree_shrinks_to_max_nodes(head_dir, target, hf_target):
    drafter = load_drafter(DraftSpec.create("eagle", path=head_dir, tree="mc_sim_7b_63"), target)
    ref = ReferenceEagle(head_dir, hf_target)
    seq = Sequence(hf_target, [0, 9, 8, 7])
    run_steps(drafter, seq, ref, accepted=[1, 2], check=check_static_draft, max_nodes=20)


def test_step_budgets_draft_the_pruned_tree(head_dir, target, hf_target):
    """draft(max_nodes=k) drafts exactly the subtree pruning would keep (Tree.best_nodes: fewer head forwards when
    it is shallower) and still matches the reference; a dynamic tree drafts min(total_tokens, k) nodes."""
    tree = Tree.parse("mc_sim_7b_63")
    budgets = [5, None, 1, 2, 17, 3]
    drafter = load_drafter(DraftSpec.create("eagle", path=head_dir, tree="mc_sim_7b_63"), target)
    ref = ReferenceEagle(head_dir, hf_target)
    got = []

    def check(draft, rd):
        check_static_draft(draft, rd)
        got.append(draft.tree)

    run_steps(drafter, Sequence(hf_target, [0, 9, 8, 7]), ref, [1, 2, 0, 1, 3, 0], check, step_nodes=budgets)
    for t, k in zip(got, budgets):
        keep = tree.best_nodes(k) if k is not None else range(tree.num_nodes)
        assert t.choices == tuple(tree.choices[i - 1] for i in keep if i)
    dyn = load_drafter(DraftSpec.create("eagle", path=head_dir, options={"total_tokens": 12, "depth": 3, "top_k": 4}),
                       target)
    for k, want in [(None, 12), (20, 12), (7, 7), (2, 2), (1, 1)]:
        run_steps(dyn, Sequence(hf_target, [0, 17, 3, 3]), ref, [1], check_dynamic(want, 3, 4), step_nodes=[k])


def reference_scores(tree: Tree, rd: ReferenceDrafts) -> tuple[dict, dict]:
    """The reference's unpruned static draft: rank path -> token path, and rank path -> cumulative log-prob."""
    tokens_of, score = {(): ()}, {(): 0.0}
    for p in tree.choices:  # canonical order: parents first
        parent = tokens_of[p[:-1]]
        lp = rd.logprobs(parent)
        tok = int(lp.topk(p[-1] + 1).indices[p[-1]])
        tokens_of[p], score[p] = parent + (tok,), score[p[:-1]] + float(lp[tok])
    return tokens_of, score


def check_pruned(tree: Tree, min_path_prob: float, seen: list[tuple[int, int]]):
    """The draft keeps exactly the nodes of `tree` whose reference path probability is >= min_path_prob (nodes
    within 1e-3 of it in log space are not judged: float rounding may put them on either side), with the tokens the
    unpruned draft has there; `seen` collects (kept, pruned) counts per step."""
    floor = math.log(min_path_prob)

    def check(draft, rd: ReferenceDrafts) -> None:
        tokens_of, score = reference_scores(tree, rd)
        got = set(draft.tree.choices)
        assert got <= set(tree.choices)
        for p in tree.choices:
            if abs(score[p] - floor) > 1e-3:
                assert (p in got) == (score[p] >= floor), (p, score[p], floor)
        paths = token_paths(draft)
        assert all(paths[i + 1] == tokens_of[p] for i, p in enumerate(draft.tree.choices))
        seen.append((len(got), tree.num_nodes - 1 - len(got)))

    return check


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]"])
def test_pruned_static_tree_keeps_the_likely_paths_over_steps(head_dir, target, hf_target, tree):
    """min_path_prob: each step verifies the nodes whose path the head finds at least that likely (the reference's
    cumulative log-probs), tokens unchanged; the floor sits at the median path of the first step, so both kept and
    pruned nodes occur."""
    tree = Tree.parse(tree)
    ref = ReferenceEagle(head_dir, hf_target)
    seq = Sequence(hf_target, [0, 9, 8, 7, 6])
    _, score = reference_scores(tree, ReferenceDrafts(ref, seq.hidden(), seq.tokens, seq.next_token([])))
    ordered = sorted(score[p] for p in tree.choices)
    mid = len(ordered) // 2
    min_path_prob = math.exp((ordered[mid - 1] + ordered[mid]) / 2)
    spec = DraftSpec.create("eagle", path=head_dir, tree=tree, options={"min_path_prob": min_path_prob})
    drafter = load_drafter(spec, target)
    assert drafter.spec.pruning.min_path_prob == min_path_prob
    seen: list[tuple[int, int]] = []
    run_steps(drafter, seq, ref, accepted=[1, 0, 2, 1], check=check_pruned(tree, min_path_prob, seen))
    assert seen[0][0] > 0 and seen[0][1] > 0, seen


@pytest.mark.parametrize("quantile", [0.25, 0.75])
def test_pruned_dynamic_tree_matches_reference(head_dir, target, hf_target, quantile):
    """EAGLE-2 with min_path_prob: the reference's selection, less the entries below the floor (placed at a quantile
    of the first step's selection)."""
    ref = ReferenceEagle(head_dir, hf_target)
    seq = Sequence(hf_target, [0, 17, 3, 3, 250, 8])
    first = sorted(ReferenceDrafts(ref, seq.hidden(), seq.tokens, seq.next_token([])).dynamic_pool(16, 3, 4).values())
    i = int(quantile * len(first))
    floor = (first[i - 1] + first[i]) / 2
    options = {"total_tokens": 16, "depth": 3, "top_k": 4, "min_path_prob": math.exp(floor)}
    drafter = load_drafter(DraftSpec.create("eagle", path=head_dir, options=options), target)
    sizes = []

    def check(draft, rd: ReferenceDrafts) -> None:
        want = rd.dynamic_pool(16, 3, 4)
        got = {p for i, p in token_paths(draft).items() if i > 0}
        assert got <= set(want)
        for p, score in want.items():
            if abs(score - floor) > 1e-3:
                assert (p in got) == (score >= floor), (p, score, floor)
        sizes.append(len(got))

    run_steps(drafter, seq, ref, accepted=[1, 0, 2], check=check)
    assert 0 < sizes[0] < 15, sizes


def test_pruning_nothing_drafts_the_same_tree(head_dir, target, hf_target):
    """A floor below every path (1e-30) keeps the whole tree with the same tokens as no pruning at all."""
    ref = ReferenceEagle(head_dir, hf_target)
    drafts = []
    for options in ({}, {"min_path_prob": 1e-30}):
        drafter = load_drafter(DraftSpec.create("eagle", path=head_dir, tree="mc_sim_7b_63", options=options), target)
        got = []
        run_steps(drafter, Sequence(hf_target, [0, 9, 8, 7]), ref, [1, 2], lambda d, rd: got.append(d))
        drafts.append(got)
    for a, b in zip(*drafts):
        assert a.tree == b.tree and torch.equal(a.tokens, b.tokens)


def test_redraft_and_advance_without_draft(head_dir, target, hf_target):
    """draft() twice gives the same tree; advance() without a draft keeps the root pair pending."""
    drafter = load_drafter(DraftSpec.create("eagle", path=head_dir, tree="mc_sim_7b_63"), target)
    ref = ReferenceEagle(head_dir, hf_target)
    seq = Sequence(hf_target, [0, 31, 32, 33, 34])
    session = drafter.start(torch.tensor(seq.tokens), seq.hidden(), 64)
    root = seq.next_token([])
    first = session.draft(root)
    again = session.draft(root)
    assert torch.equal(first.tokens, again.tokens)
    other = session.draft((root + 1) % 420)  # a different root replaces the pending root pair
    check_static_draft(other, ReferenceDrafts(ref, seq.hidden(), seq.tokens, (root + 1) % 420))
    with pytest.raises(DraftStateError, match=rf"tokens\[0\] = {root}, but the last draft was rooted at"):
        session.advance(torch.tensor([root]), seq.hidden()[-1:])
    # Commit root + 2 more tokens without drafting in between, then draft: same as the reference.
    session = drafter.start(torch.tensor(seq.tokens), seq.hidden(), 64)
    new = [root, 44, 45]
    old = len(seq.tokens)
    seq.tokens += new
    session.advance(torch.tensor(new), seq.hidden()[old:])
    root = seq.next_token([])
    check_static_draft(session.draft(root), ReferenceDrafts(ref, seq.hidden(), seq.tokens, root))


def test_head_cache_grows_past_its_initial_capacity(head_dir, target, hf_target):
    drafter = load_drafter(DraftSpec.create("eagle", path=head_dir, tree="chain-2"), target)
    ref = ReferenceEagle(head_dir, hf_target)
    seq = Sequence(hf_target, [0, 1, 2])
    session = drafter.start(torch.tensor(seq.tokens), seq.hidden(), 8)
    start_capacity = session.cache.max_len
    gen = torch.Generator().manual_seed(4)
    root = 5
    while len(seq.tokens) < start_capacity + 10:
        session.draft(root)
        new = [root] + torch.randint(3, 420, (40,), generator=gen).tolist()
        old = len(seq.tokens)
        seq.tokens += new
        session.advance(torch.tensor(new), seq.hidden()[old:])
        root = int(torch.randint(3, 420, (1,), generator=gen))
    draft = session.draft(root)  # runs the pending pairs: more than the initial capacity in all
    assert session.cache.max_len > start_capacity and session.cache.length == len(seq.tokens)
    check_static_draft(draft, ReferenceDrafts(ref, seq.hidden(), seq.tokens, root))


@pytest.mark.parametrize("spec", [{"tree": "mc_sim_7b_63"}, {"options": {"total_tokens": 12, "depth": 3, "top_k": 3}}])
def test_drafted_nodes_never_stay_in_the_head_cache(head_dir, target, hf_target, spec, monkeypatch):
    """A step's drafted nodes live in the head cache only while it drafts, also when drafting fails midway; the
    next draft is the reference's again."""
    drafter = load_drafter(DraftSpec.create("eagle", path=head_dir, **spec), target)
    ref = ReferenceEagle(head_dir, hf_target)
    seq = Sequence(hf_target, [0, 5, 6, 7, 8])
    session = drafter.start(torch.tensor(seq.tokens), seq.hidden(), 64)
    root = seq.next_token([])
    session.draft(root)
    assert session.cache.length == len(seq.tokens)  # the committed pairs, the root's last
    calls = []
    real = EagleDrafter.draft_logits

    def failing(self, features):
        calls.append(features.shape[0])
        if len(calls) == 3:  # after two head forwards of the step
            raise RuntimeError("boom")
        return real(self, features)

    monkeypatch.setattr(EagleDrafter, "draft_logits", failing)
    with pytest.raises(RuntimeError, match="boom"):
        session.draft(root)
    assert session.cache.length == len(seq.tokens)
    monkeypatch.setattr(EagleDrafter, "draft_logits", real)
    draft = session.draft(root)
    rd = ReferenceDrafts(ref, seq.hidden(), seq.tokens, root)
    if "tree" in spec:
        check_static_draft(draft, rd)
    else:
        check_dynamic(12, 3, 3)(draft, rd)


def test_draft_tree_cache_checks_the_mask_shape(head_dir, target):
    from runtime.drafters.eagle import DraftTreeCache

    head = load_eagle_head(head_dir, target)
    step = DraftTreeCache(head, head.new_cache(16))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"visible must be \[2, 2\], got \(2, 3\)"):
        step.forward(x, x, torch.arange(2), torch.ones(2, 3, dtype=torch.bool))
    step.forward(x, x, torch.arange(2), torch.eye(2, dtype=torch.bool))
    assert step.drafted == 2
    step.close()
    assert step.cache.length == 0


# ---- errors ------------------------------------------------------------------------------------------------


def test_hidden_size_mismatch(tmp_path, target):
    small = make_checkpoint(tmp_path / "small", "llama2", hidden_size=32, intermediate_size=64)
    path = write_eagle_head(tmp_path / "e", small)
    with pytest.raises(CheckpointError, match=r"hidden_size 32 does not match the target model's hidden_size 64"):
        load_drafter(DraftSpec.create("eagle", path=path), target)
    path = write_eagle_head(tmp_path / "e2", small, config_overrides={"hidden_size": None})
    with pytest.raises(CheckpointError, match=r"hidden size 32 \(fc.weight\) does not match .* hidden_size 64"):
        load_eagle_head(path, target)


def test_vocab_mismatch(tmp_path, target_dir, target):
    path = write_eagle_head(tmp_path / "a", target_dir, config_overrides={"vocab_size": 400})
    with pytest.raises(CheckpointError, match=r"vocab_size 400 does not match the target model's vocab_size 420"):
        load_eagle_head(path, target)

    def small_embedding(state):
        state["embed_tokens.weight"] = state["embed_tokens.weight"][:400]
        return state

    path = write_eagle_head(
        tmp_path / "b", target_dir, with_embedding=True, state_hook=small_embedding,
        config_overrides={"vocab_size": None},
    )
    with pytest.raises(CheckpointError, match=r"vocab size 400 \(embed_tokens.weight\) .* vocab_size 420"):
        load_eagle_head(path, target)


def test_missing_fc_and_files(tmp_path, target_dir, target):
    def no_fc(state):
        del state["fc.weight"], state["fc.bias"]
        return state

    with pytest.raises(CheckpointError, match="has no fc.weight"):
        load_eagle_head(write_eagle_head(tmp_path / "a", target_dir, state_hook=no_fc), target)
    path = write_eagle_head(tmp_path / "b", target_dir)
    (path / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match="neither pytorch_model.bin nor model.safetensors"):
        load_eagle_head(path, target)
    path = write_eagle_head(tmp_path / "c", target_dir)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_eagle_head(path, target)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_eagle_head(tmp_path / "missing", target)
    with pytest.raises(ConfigError, match="path: required for drafter 'eagle'"):
        load_drafter(DraftSpec.create("eagle"), target)


def test_key_and_config_mismatches(tmp_path, target_dir, target):
    def drop_mlp(state):
        del state["layers.0.mlp.up_proj.weight"]
        return state

    with pytest.raises(CheckpointError, match=r"missing 1 key\(s\) \['layers.0.mlp.up_proj.weight'\]"):
        load_eagle_head(write_eagle_head(tmp_path / "a", target_dir, state_hook=drop_mlp), target)

    def add_norm(state):
        state["layers.0.input_layernorm.weight"] = torch.ones(64)
        return state

    with pytest.raises(CheckpointError, match="EAGLE-1 heads have no input norm in layer 0"):
        load_eagle_head(write_eagle_head(tmp_path / "b", target_dir, state_hook=add_norm), target)
    # config says no fc bias, but the file has one
    path = write_eagle_head(tmp_path / "c", target_dir, config_overrides={"bias": False})
    with pytest.raises(CheckpointError, match=r"bias=False.*unexpected 1 key\(s\) \['fc.bias'\]"):
        load_eagle_head(path, target)
    path = write_eagle_head(tmp_path / "d", target_dir, config_overrides={"intermediate_size": 96})
    with pytest.raises(CheckpointError, match=r"gate_proj.weight has shape \(128, 64\), expected \(96, 64\)"):
        load_eagle_head(path, target)
    path = write_eagle_head(tmp_path / "e", target_dir, config_overrides={"max_position_embeddings": None})
    with pytest.raises(CheckpointError, match="max_position_embeddings"):
        load_eagle_head(path, target)
    # The ".rotary_emb.inv_freq" buffers some old checkpoints carry are ignored, not rejected.

    def old_buffer(state):
        state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        return state

    load_eagle_head(write_eagle_head(tmp_path / "f", target_dir, state_hook=old_buffer), target)


def test_two_layer_head_matches_reference(tmp_path, target_dir, target, hf_target):
    path = write_eagle_head(tmp_path, target_dir, num_layers=2, seed=6)
    dynamic = DynamicTreeOptions(total_tokens=12, depth=3, top_k=3)
    drafter = load_drafter(DraftSpec("eagle", path=path, dynamic=dynamic), target)
    assert len(drafter.head.layers) == 2 and drafter.head.layers[1].input_layernorm is not None
    seq = Sequence(hf_target, [0, 8, 9, 10])
    run_steps(drafter, seq, ReferenceEagle(path, hf_target), accepted=[2, 1], check=check_dynamic(12, 3, 3))


def test_no_fc_bias_variant_loads(tmp_path, target_dir, target, hf_target):
    path = write_eagle_head(tmp_path, target_dir, fc_bias=False, seed=5)
    drafter = load_drafter(DraftSpec.create("eagle", path=path, tree="chain-3"), target)
    seq = Sequence(hf_target, [0, 4, 4, 4])
    run_steps(drafter, seq, ReferenceEagle(path, hf_target), accepted=[2], check=check_static_draft)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(total_tokens=0), r"dynamic.total_tokens: got 0, expected an integer >= 1"),
        (dict(depth=-1), r"dynamic.depth: got -1, expected an integer >= 0"),
        (dict(top_k=0), r"dynamic.top_k: got 0, expected an integer >= 1"),
        (dict(top_k=2.0), r"dynamic.top_k: got 2.0, expected an integer"),
    ],
)
def test_bad_dynamic_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DynamicTreeOptions(**kwargs)


def test_bad_drafter_arguments(head_dir, target):
    with pytest.raises(ConfigError, match="apply to the dynamic EAGLE-2 tree only"):
        load_drafter(DraftSpec.create("eagle", path=head_dir, tree="chain-2", options={"top_k": 3}), target)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['beam'\]"):
        load_drafter(DraftSpec.create("eagle", path=head_dir, options={"beam": 2}), target)
    head = load_eagle_head(head_dir, target)
    with pytest.raises(ConfigError, match="exactly one of tree="):
        EagleDrafter(head, target)
    drafter = EagleDrafter(head, target, tree=Tree.chain(2))
    with pytest.raises(ConfigError, match=r"hidden must be \[3, 64\]"):
        drafter.start(torch.tensor([1, 2, 3]), torch.zeros(2, 64), 8)
    with pytest.raises(ConfigError, match="max_nodes must be an integer >= 1"):
        drafter.start(torch.tensor([1, 2, 3]), torch.zeros(3, 64), 0)
