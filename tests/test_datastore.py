"""The datastore of the target's own answers (runtime/drafters/datastore.py): search against a brute-force reference,
file checks, its continuation grafted into lookup's trees, greedy output through runtime.load and an engine directory
identical to plain decoding. Sampled output stays exactly distributed:
tests/test_decode.py::test_sampled_distribution_with_merged_prompt_lookup[...-datastore] (+ its negative control)."""

from __future__ import annotations

import math

import random
from collections import Counter

import numpy as np
import pytest
import torch

import runtime
from runtime.draft_spec import DraftSpec, LookupOptions
from runtime.drafters import load_drafter
from runtime.drafters.datastore import DATASTORE_FILE, SEPARATOR, Datastore
from runtime.drafters.lookup import LookupDrafter
from runtime.errors import CheckpointError, ConfigError, SpectreeError
from runtime.model import TargetModel
from tests.heads import write_eagle_config, write_eagle_head
from tests.tiny import make_checkpoint


def _reference(answers: list[list[int]], context: list[int], depth: int, min_share: float, min_n: int,
               max_n: int) -> list[int]:
    """The rule of the module docstring, by scanning every stored position."""
    seq: list[int] = []
    for a in answers:
        seq += [SEPARATOR] + a
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        gram = context[-n:]
        ends = [e for e in range(n, len(seq) + 1) if seq[e - n:e] == gram]
        if ends:
            break
    else:
        return []
    chain: list[int] = []
    for d in range(depth):
        nxt = [seq[e + d] if e + d < len(seq) else SEPARATOR for e in ends]
        counts = Counter(nxt)
        top = max(counts.values())
        tok = min(t for t, c in counts.items() if c == top)
        if tok == SEPARATOR or top < min_share * len(nxt):
            break
        chain.append(tok)
        ends = [e for e, t in zip(ends, nxt) if t == tok]
    return chain


@pytest.mark.parametrize("seed", range(4))
def test_continuation_matches_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])  # small vocabularies: many repeats, ties and separators in the way
    answers = [[rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in range(rng.randint(1, 40))]
    min_n, max_n = rng.choice([(1, 3), (2, 4), (3, 5)])
    store = Datastore.from_answers(answers, min_ngram=min_n, max_ngram=max_n)
    for _ in range(150):
        context = [SEPARATOR] + [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        depth, share = rng.randint(0, 7), rng.choice([0.0, 0.3, 0.5, 1.0])
        assert store.continuation(context, depth, share) == _reference(answers, context, depth, share, min_n, max_n)


def test_one_ngram_hashes_as_the_index_does():
    """The lookup's one-row hash (Python integers) equals the index's vectorised one, wrap-around included."""
    from runtime.drafters.datastore import _hash_one, _hash_rows

    rng = np.random.default_rng(0)
    rows = rng.integers(-1, 2**31 - 1, size=(200, 5))
    rows[::7, 0] = SEPARATOR
    expected = _hash_rows(rows)
    assert [_hash_one(r.tolist()) for r in rows] == expected.tolist()
    assert [_hash_one(list(r)) for r in rows[:20]] == expected[:20].tolist()  # numpy ids too
    assert _hash_one([SEPARATOR]) != _hash_one([0])  # the + 2 keeps the separator apart from token 0


def test_occurrences_and_answer_starts():
    store = Datastore.from_answers([[5, 6, 7, 8], [5, 6, 9], [1, 5, 6, 7]], min_ngram=2, max_ngram=3)
    assert store.tokens.tolist() == [-1, 5, 6, 7, 8, -1, 5, 6, 9, -1, 1, 5, 6, 7]
    assert store.occurrences([5, 6]).tolist() == [3, 8, 13]
    assert store.occurrences([SEPARATOR, 5, 6]).tolist() == [3, 8]  # answers that begin with 5, 6
    assert store.occurrences([6, 9, SEPARATOR]).tolist() == [10]
    assert store.occurrences([4, 4]).tolist() == [] and store.occurrences([5]).tolist() == []  # n=1 not indexed
    # the longest match decides: [-1, 5, 6] is followed by 7 and 9 (a tie: the smaller id), [1, 5, 6] by 7
    assert store.continuation([SEPARATOR, 5, 6], 3, 0.0) == [7, 8]  # then the answer ends
    assert store.continuation([1, 5, 6], 3, 0.0) == [7]  # the last answer ends there
    assert store.continuation([SEPARATOR, 5, 6], 3, 0.6) == []  # 7 follows only half of the occurrences


def test_file_round_trip_and_bad_files(tmp_path):
    store = Datastore.from_answers([[1, 2, 3], [2, 3, 4]])
    store.save(tmp_path / DATASTORE_FILE)
    back = Datastore.load(tmp_path / DATASTORE_FILE, vocab_size=5)
    assert back.tokens.tolist() == store.tokens.tolist()
    with pytest.raises(CheckpointError, match=r"token id 4 is outside the target's vocabulary \[0, 4\)"):
        Datastore.load(tmp_path / DATASTORE_FILE, vocab_size=4)
    with pytest.raises(CheckpointError, match="does not exist .*builder datastore"):
        Datastore.load(tmp_path / "missing.npz", vocab_size=5)
    np.savez(tmp_path / "other.npz", ids=np.arange(3))
    with pytest.raises(CheckpointError, match=r"no 'tokens' array \(has \['ids'\]\)"):
        Datastore.load(tmp_path / "other.npz", vocab_size=5)
    np.savez(tmp_path / "pickled.npz", tokens=np.array([{"a": 1}], dtype=object))
    with pytest.raises(CheckpointError, match="not a readable .npz"):  # object arrays would need pickle: refused
        Datastore.load(tmp_path / "pickled.npz", vocab_size=5)
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(CheckpointError, match="not a readable .npz"):
        Datastore.load(tmp_path / "text.npz", vocab_size=5)
    with pytest.raises(CheckpointError, match="must start with the separator"):
        Datastore(np.array([1, 2, -1, 3]))
    with pytest.raises(CheckpointError, match="must be >= 0"):
        Datastore(np.array([-1, 2, -3]))
    with pytest.raises(CheckpointError, match="min_ngram <= max_ngram"):
        Datastore(np.array([-1, 2]), min_ngram=3, max_ngram=2)


def test_options_and_spec_rules(tmp_path):
    with pytest.raises(ConfigError, match=r"datastore_min_ngram \(4\) must not exceed datastore_max_ngram \(3\)"):
        LookupOptions(datastore_min_ngram=4, datastore_max_ngram=3)
    with pytest.raises(ConfigError, match="datastore_min_share"):
        LookupOptions(datastore_min_share=1.5)
    with pytest.raises(ConfigError, match="lookup: datastore_tokens 4: .*drafter 'lookup' has none"):
        DraftSpec.create("lookup", options={"datastore_tokens": 4})
    spec = DraftSpec.create("eagle", path=tmp_path, tree="chain-2", options={"num_draft_tokens": 3,
                                                                             "datastore_tokens": 5})
    assert spec.draft_nodes == 2 + 3 + 5 and spec.max_tree_depth == 5  # the chain can run 5 deep
    with pytest.raises(ConfigError, match="needs a datastore"):
        LookupDrafter(LookupOptions(datastore_tokens=2))


def test_lookup_session_grafts_the_stored_continuation():
    store = Datastore.from_answers([[7, 8, 9, 10, 11], [7, 8, 9, 10, 12]], min_ngram=2, max_ngram=3)
    opts = LookupOptions(num_draft_tokens=2, max_branches=1, datastore_tokens=3, datastore_min_ngram=2,
                         datastore_max_ngram=3)
    prompt = torch.tensor([3, 9, 10, 13, 5])  # the answer starts after it
    session = LookupDrafter(opts, store).start(prompt, None, 16)
    # the answer so far is the root 7: the prompt has no 7; the stored answers begin 7, 8, 9, 10 (3 nodes: its budget)
    draft = session.draft(7)
    assert draft.tokens.tolist() == [7, 8, 9, 10]
    session.advance(torch.tensor([7, 8]))
    # root 9: prompt lookup copies 10, 13 (what followed the prompt's 9); the datastore continues 7, 8, 9 with 10,
    # then 11 or 12 (a tie: the smaller id), then the answers end; the shared 10 is one node
    draft = session.draft(9)
    paths = {tuple(draft.tokens[_path(draft, i)].tolist()): float(draft.scores[i]) for i in range(1, draft.tree.num_nodes)}
    # scores: the prompt's 1-gram match counts token_prob[0] per node, the datastore's datastore_token_prob
    p1, pd = math.log(opts.token_prob[0]), math.log(opts.datastore_token_prob)
    assert paths == pytest.approx({(10,): p1, (10, 13): 2 * p1, (10, 11): p1 + pd})
    # the session's node bound caps both
    small = LookupDrafter(opts, store).start(prompt, None, 3)
    assert small.draft(7).tokens.tolist() == [7, 8, 9]


def _path(draft, node):
    parents, out = draft.tree.parent_list, []
    while node:
        out.append(node)
        node = parents[node]
    return list(reversed(out))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("datastore") / "llama3", "llama3")


PROMPTS = [[0, 17, 23, 5, 9], [0, 40, 41, 42], [0, 8, 8, 31, 2, 60]]


def _head_with_datastore(target, tmp_path, answers) -> str:
    heads = write_eagle_head(tmp_path / "eagle", target, seed=1)
    Datastore.from_answers(answers).save(heads / DATASTORE_FILE)
    return str(heads)


def test_greedy_output_identical_and_the_datastore_is_used(target, tmp_path):
    plain = runtime.load(str(target), draft="none")
    refs = [plain.generate(p, max_tokens=30, ignore_eos=True).token_ids for p in PROMPTS]
    # The datastore holds the target's own answers to the first two prompts (and noise): a random head rarely guesses
    # right, the stored answers often do.
    rng = random.Random(0)
    noise = [[rng.randrange(plain.model.config.vocab_size) for _ in range(20)] for _ in range(30)]
    heads = _head_with_datastore(target, tmp_path, [list(refs[0]), list(refs[1])] + noise)
    opts = dict(num_draft_tokens=2, max_branches=1)
    without = runtime.load(str(target), draft="eagle", draft_model=heads, tree="chain-2", **opts)
    with_ds = runtime.load(str(target), draft="eagle", draft_model=heads, tree="chain-2", datastore_tokens=6,
                           datastore_min_ngram=2, **opts)
    for prompt, ref in zip(PROMPTS, refs):
        a = without.generate(prompt, max_tokens=30, ignore_eos=True)
        b = with_ds.generate(prompt, max_tokens=30, ignore_eos=True)
        assert a.token_ids == ref and b.token_ids == ref
        if prompt is not PROMPTS[2]:  # its answer is not stored
            assert b.stats.steps < a.stats.steps


def test_engine_carries_the_datastore(target, tmp_path):
    from builder.build import build_engine
    from builder.config import load_config

    plain = runtime.load(str(target), draft="none").generate(PROMPTS[0], max_tokens=24, ignore_eos=True)
    heads = _head_with_datastore(target, tmp_path, [list(plain.token_ids)])
    cfg = write_eagle_config(tmp_path / "eagle.yaml", target, heads,
                             draft={"lookup": {"num_draft_tokens": 2, "max_branches": 1, "datastore_tokens": 4}},
                             build={"max_draft_len": 8})
    result = build_engine(load_config(cfg))
    assert f"draft/{DATASTORE_FILE}" in result.manifest["files"]
    assert result.manifest["draft"]["options"]["datastore_tokens"] == 4
    dec = runtime.load(str(result.output))
    assert dec.drafter.lookup.datastore is not None
    out = dec.generate(PROMPTS[0], max_tokens=24, ignore_eos=True)
    assert out.token_ids == plain.token_ids and out.stats.steps < 24 / 2
    # a head directory without one: the build names the file
    (tmp_path / "eagle" / DATASTORE_FILE).unlink()
    with pytest.raises(SpectreeError, match=f"draft.checkpoint: datastore .*{DATASTORE_FILE} does not exist"):
        build_engine(load_config(cfg), force=True)


def test_drafter_built_from_spec_reads_the_head_directory(target, tmp_path):
    model = TargetModel.from_pretrained(target)
    heads = _head_with_datastore(target, tmp_path, [[1, 2, 3]])
    spec = DraftSpec.create("eagle", path=heads, tree="chain-2", options={"datastore_tokens": 2,
                                                                          "datastore_max_ngram": 6})
    drafter = load_drafter(spec, model)
    assert drafter.lookup.datastore.max_ngram == 6 and drafter.spec.lookup.datastore_tokens == 2
    assert load_drafter(DraftSpec.create("eagle", path=heads, tree="chain-2",
                                         options={"num_draft_tokens": 2}), model).lookup.datastore is None
