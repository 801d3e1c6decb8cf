"""perf/merge_replay.py: replaying a merged EAGLE-2 drafter over recorded candidate pools drafts, step by step, the
trees the decoder drafts (greedy output is the plain answer, so the steps are fixed by the trees), for several merge
and pruning options."""

from __future__ import annotations

import pytest
import torch

import perf.merge_replay as merge_replay
from perf.merge_replay import record, replay, tau
from runtime.decode import SpecDecoder
from runtime.draft_spec import DraftSpec
from runtime.drafters import load_drafter
import runtime.drafters.merged as merged
from runtime.drafters.merged import MergedSession
from runtime.errors import ConfigError
from runtime.model import TargetModel
from tests.heads import draft_paths, write_eagle_head
from tests.tiny import make_checkpoint

BASE = [0, 40, 41, 42, 43, 44, 45]
MAX_TOKENS = 40


def _spec(head, **options) -> DraftSpec:
    base = dict(total_tokens=8, top_k=3, depth=3, num_draft_tokens=6, max_branches=2)
    return DraftSpec.create("eagle", path=head, tree="dynamic", options=base | options, max_draft_len=7)


class _Recorder:
    """A drafter whose sessions keep every draft (the decoder's trees)."""

    def __init__(self, drafter, drafts: list) -> None:
        self.drafter, self.drafts = drafter, drafts

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def start(self, *args):
        session, drafts = self.drafter.start(*args), self.drafts

        class Session:
            def draft(self, *a, **k):
                d = session.draft(*a, **k)
                drafts.append(d)
                return d

            def advance(self, *a):
                session.advance(*a)

        return Session()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    target = make_checkpoint(tmp / "llama3", "llama3")
    model = TargetModel.from_pretrained(target)
    head = write_eagle_head(tmp / "eagle", target, seed=2)
    plain = SpecDecoder(model, None, load_drafter(DraftSpec("none"), model), max_tree_nodes=1)
    # the base, the target's continuation of it, the base again: prompt lookup proposes what the target says
    echo = BASE + list(plain.generate(BASE, max_tokens=12, ignore_eos=True).token_ids) + BASE
    prompts = [echo, echo[2:] + echo[:3]]
    return model, head, prompts, record(model, _spec(head), prompts, MAX_TOKENS, 8)


@pytest.mark.parametrize("options", [{}, {"min_path_prob": 0.005}, {"max_branches": 1, "token_prob": [0.9]},
                                     {"num_draft_tokens": 12, "max_depth": 10, "token_prob": [0.01]}])
def test_replay_drafts_the_decoders_trees(setup, monkeypatch, options):
    model, head, prompts, recordings = setup
    assert [len(r.pools) for r in recordings] == [MAX_TOKENS - 1] * 2
    spec = _spec(head, **options)
    replayed_drafts: list = []

    class Recording(MergedSession):
        def draft(self, *a, **k):
            d = super().draft(*a, **k)
            replayed_drafts.append(d)
            return d

    with monkeypatch.context() as patched:  # the replay's sessions only, not the decoder's below
        patched.setattr(merged, "MergedSession", Recording)
        replayed = replay(recordings, load_drafter(spec, model), 8)
    k = compared = 0
    for rec, prompt, steps in zip(recordings, prompts, replayed):
        decoded_drafts: list = []
        decoder = SpecDecoder(model, None, _Recorder(load_drafter(spec, model), decoded_drafts), max_tree_nodes=8)
        out = decoder.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert list(out.token_ids) == list(rec.answer)
        # every step, the last ones too (their trees cut to the tokens left, as the decoder cuts them)
        assert steps == list(out.stats.accepted_per_step) and sum(steps) + len(steps) == MAX_TOKENS - 1
        assert len(replayed_drafts[k : k + len(steps)]) == len(decoded_drafts) == len(steps)
        for mine, theirs in zip(replayed_drafts[k : k + len(steps)], decoded_drafts):
            assert draft_paths(mine) == draft_paths(theirs)
            assert int(mine.tokens[0]) == int(theirs.tokens[0])
            compared += mine.tree.num_nodes > 1
        k += len(steps)
    assert compared >= 20  # real trees, not root-only ones


def test_tau_and_bad_input(setup):
    model, head, prompts, recordings = setup
    assert tau([[0, 2], [1]]) == 2.0  # (accepted + 1) per step over all steps: 6 tokens in 3 steps
    with pytest.raises(ConfigError, match="EAGLE-2 drafters"):
        record(model, DraftSpec.create("eagle", path=head, tree="chain-2", max_draft_len=2), prompts[:1], 4, 3)
    plain_eagle = DraftSpec.create("eagle", path=head, tree="dynamic", options=dict(total_tokens=8), max_draft_len=7)
    with pytest.raises(ConfigError, match="merges prompt lookup"):
        replay(recordings, load_drafter(plain_eagle, model), 8)


def test_replay_cuts_the_last_trees_to_the_tokens_left(setup):
    """An answer that copies its prompt: prompt lookup drafts the whole rest of it, and the replayed steps emit
    exactly the answer's tokens (the first comes from the prefill), as the decoder does, never a bonus past its end."""
    model, head, _, recordings = setup
    copied = [50, 51, 52, 53, 54, 55, 56, 57]
    prompt, answer = tuple(copied + copied[:3]), tuple(copied[3:] + copied[:2])  # the answer: 53 54 ... 57 50 51
    rec = merge_replay.Recording(prompt, answer, recordings[0].pools[: len(answer) - 1])
    for options in ({}, {"num_draft_tokens": 12, "max_depth": 10, "token_prob": [0.99]}):
        (steps,) = replay([rec], load_drafter(_spec(head, **options), model), 8)
        assert sum(steps) + len(steps) == len(answer) - 1
        assert max(steps) >= 3  # lookup's copy was accepted: the cut is what ends it
