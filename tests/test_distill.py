"""Self-distilled heads with a reduced draft vocabulary, at toy size: the target answers chat prompts, its features
are cached once, Medusa and EAGLE heads train on them over the K most frequent answer tokens, save in their public
formats plus EAGLE-3's d2t / t2d, load back through runtime.drafters, and speculative greedy output stays identical
to plain decoding."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import runtime
from builder.config import BuildConfigError
from builder.train_heads import train_heads
from builder.training.config import parse_train_config
from builder.training.distill import HIDDEN, TOKENS, GenerateSettings, conversations, features
from runtime.drafters.draft_vocab import DraftVocab, top_frequent
from runtime.errors import CheckpointError, ConfigError
from tests.tiny import make_checkpoint

CHATML = ("{% for m in messages %}{{ '<|eot_id|>' + m['role'] + '\\n' + m['content'] + '</s>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|eot_id|>assistant\\n' }}{% endif %}")
K = 48


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    out = make_checkpoint(tmp_path_factory.mktemp("target"), "llama2")
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = CHATML
    cfg_file.write_text(json.dumps(cfg))
    return out


def _config(target: Path, tmp: Path, prompts: int = 16, **heads) -> dict:
    p = tmp / "prompts.jsonl"
    words = ("add two numbers", "sort a list", "print hello", "reverse text", "count words", "read a file",
             "sum values", "find the max")
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Write code to {words[i % 8]} ({i}).", "chat": True})
                         + "\n" for i in range(prompts)))
    train = {"max_steps": 12, "batch_size": 4, "seq_len": 24, "eval_every": 6, "eval_batches": 2, "warmup_steps": 1,
             "lr": 5e-3, "checkpoint_every": 6, "threads": 1}
    return {
        "corpus": {"source": "chat", "prompts": str(p), "held_out": 0.25, "max_new_tokens": 20, "generate_batch": 5,
                   "answers": 2},
        "heads": {"target": str(target), "work_dir": str(tmp / "work"), "save_dtype": "float32",
                  "draft_vocab_size": K,
                  "medusa": {"output": str(tmp / "medusa"), "num_heads": 3, "train": train},
                  "eagle": {"output": str(tmp / "eagle"), "train": train}, **heads},
    }


def test_chat_heads_with_reduced_vocabulary(chat_target, tmp_path):
    cfg = parse_train_config(_config(chat_target, tmp_path))
    results = {r.kind: r for r in train_heads(cfg, quiet=True)}
    assert set(results) == {"medusa", "eagle"} and all(r.steps == 12 for r in results.values())

    # The answers were generated once and their features cached; the cache matches a fresh target pass.
    data_dir = tmp_path / "work" / "distill"
    convs = conversations(data_dir)
    assert len(convs) == 32 and all(c["response_ids"] for c in convs)
    by_id = {c["id"]: c for c in convs}
    assert {f"p{i}" for i in range(16)} | {f"p{i}#1" for i in range(16)} == set(by_id)
    # answer 0 is greedy (what plain decoding of the target says), answer 1 sampled: they differ somewhere
    assert any(by_id[f"p{i}"]["response_ids"] != by_id[f"p{i}#1"]["response_ids"] for i in range(16))
    tokens = np.load(data_dir / TOKENS)
    assert tokens.shape[0] == sum(len(c["prompt_ids"]) + len(c["response_ids"]) for c in convs)
    hidden = torch.load(data_dir / HIDDEN, weights_only=True)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(chat_target), dtype=torch.bfloat16).eval()
    first = convs[0]["prompt_ids"] + convs[0]["response_ids"]
    with torch.no_grad():
        want = ref.model(input_ids=torch.tensor([first])).last_hidden_state[0]
    torch.testing.assert_close(hidden[: len(first)].float(), want.float(), atol=2e-2, rtol=2e-2)
    assert features(chat_target, data_dir, convs).num_tokens == tokens.shape[0]  # served from the cache

    # Both heads carry the same K-token vocabulary in EAGLE-3's keys, and it holds the EOS token.
    for kind, file in (("medusa", "medusa_lm_head.safetensors"), ("eagle", "pytorch_model.bin")):
        out = tmp_path / kind
        assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == K
        summary = json.loads((out / "training_summary.json").read_text())
        assert summary["draft_vocab_size"] == K and 0.0 < summary["draft_vocab_coverage"] <= 1.0
    # Each head directory holds the datastore of the target's answers to the training prompts (held-out excluded).
    from builder.training.corpus import is_held_out
    from builder.training.distill import prompt_of
    from runtime.drafters.datastore import DATASTORE_FILE, SEPARATOR, Datastore

    train_answers = [c["response_ids"] for c in convs if not is_held_out(prompt_of(c["id"]), 0.25)]
    assert 0 < len(train_answers) < len(convs)
    for kind in ("medusa", "eagle"):
        store = Datastore.load(tmp_path / kind / DATASTORE_FILE, 420)
        assert store.tokens.tolist() == [t for a in train_answers for t in [SEPARATOR] + a]
    state = torch.load(tmp_path / "eagle" / "pytorch_model.bin", weights_only=True)
    vocab = DraftVocab.from_state(dict(state), 420, "eagle")
    assert vocab is not None and vocab.size == K and 1 in vocab.target_ids.tolist()

    # Loaded by the runtime, the reduced heads draft target ids and greedy output equals plain decoding.
    prompt = [{"role": "user", "content": "Write code to sort a list (99)."}]
    plain = runtime.load(chat_target, draft="none").generate(prompt, max_tokens=24, ignore_eos=True)
    for kind, tree in (("medusa", "chain-3"), ("eagle", "mc_sim_7b_63")):
        dec = runtime.load(chat_target, draft=kind, draft_model=tmp_path / kind, tree=tree)
        assert dec.drafter.head.vocab.size == K if kind == "eagle" else dec.drafter.heads.vocab.size == K
        got = dec.generate(prompt, max_tokens=24, ignore_eos=True)
        assert got.token_ids == plain.token_ids, kind
        assert got.stats.drafted_tokens > 0
    eagle2 = runtime.load(chat_target, draft="eagle", draft_model=tmp_path / "eagle", total_tokens=12, depth=3)
    assert eagle2.generate(prompt, max_tokens=24, ignore_eos=True).token_ids == plain.token_ids
    stored = runtime.load(chat_target, draft="eagle", draft_model=tmp_path / "eagle", tree="chain-2",
                          datastore_tokens=4, datastore_min_ngram=2)
    assert stored.generate(prompt, max_tokens=24, ignore_eos=True).token_ids == plain.token_ids

    # An engine directory keeps the reduced vocabulary with the head weights, and serves the same output.
    from builder.build import build_engine
    from builder.config import load_config

    for kind, tree in (("eagle", "mc_sim_7b_63"), ("medusa", "chain-3")):
        cfg_file = tmp_path / f"{kind}.yaml"
        cfg_file.write_text(f"model: {{checkpoint: {chat_target}}}\n"
                            f"draft: {{method: {kind}, checkpoint: {tmp_path / kind}, tree: {{preset: {tree}}}}}\n"
                            f"build: {{dtype: float32, output: {tmp_path / ('engine-' + kind)}, onnx: false}}\n")
        result = build_engine(load_config(cfg_file))
        assert result.manifest["draft"]["config"]["draft_vocab_size"] == K
        dec = runtime.load(result.output)
        head = dec.drafter.head if kind == "eagle" else dec.drafter.heads
        assert head.vocab.target_ids.tolist() == vocab.target_ids.tolist()
        assert dec.generate(prompt, max_tokens=24, ignore_eos=True).token_ids == plain.token_ids


def test_draft_vocab_validation():
    assert top_frequent(torch.tensor([5, 0, 9, 1, 7]), 2).tolist() == [2, 4]
    assert top_frequent(torch.tensor([5, 0, 9, 1, 7]), 3, always=(1,)).tolist() == [1, 2, 4]
    v = DraftVocab(torch.tensor([1, 4, 6]), 8)
    assert v.d2t().tolist() == [1, 3, 4] and v.t2d().nonzero().flatten().tolist() == [1, 4, 6]
    assert v.to_target(torch.tensor([[2, 0]])).tolist() == [[6, 1]]
    assert v.draft_index().tolist() == [-1, 0, -1, -1, 1, -1, 2, -1]
    assert DraftVocab.from_state({"d2t": v.d2t(), "t2d": v.t2d()}, 8, "f").target_ids.tolist() == [1, 4, 6]
    with pytest.raises(CheckpointError, match=r"lie in \[0, 8\)"):
        DraftVocab(torch.tensor([1, 8]), 8)
    with pytest.raises(CheckpointError, match="strictly increasing"):
        DraftVocab(torch.tensor([4, 1]), 8)
    with pytest.raises(CheckpointError, match="t2d does not mark exactly"):
        DraftVocab.from_state({"d2t": v.d2t(), "t2d": torch.zeros(8, dtype=torch.bool)}, 8, "f")
    with pytest.raises(CheckpointError, match="has t2d but no d2t"):
        DraftVocab.from_state({"t2d": v.t2d()}, 8, "f")


def test_chat_config_errors(chat_target, tmp_path):
    cfg = _config(chat_target, tmp_path)
    cfg["corpus"].pop("prompts")
    with pytest.raises(BuildConfigError, match="corpus.prompts: got None, expected a prompts file exactly when"):
        parse_train_config(cfg)
    cfg = _config(chat_target, tmp_path)
    cfg["heads"]["draft_vocab_size"] = 1
    with pytest.raises(BuildConfigError, match="heads.draft_vocab_size: got 1, expected an integer >= 2"):
        parse_train_config(cfg)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 0}, "generate.temperature: got 0, expected a number > 0"),
    ({"answers": 0}, "generate.answers: got 0, expected an integer >= 1"),
    ({"batch_size": True}, "generate.batch_size: got True, expected an integer"),
    ({"dtype": "float16"}, "generate.dtype: got 'float16', expected one of 'float32', 'bfloat16'"),
])
def test_generate_settings_name_the_setting(kwargs, message):
    with pytest.raises(ConfigError) as info:
        GenerateSettings(**kwargs)
    assert str(info.value) == message


def test_features_reuse_the_cached_prefix(chat_target, tmp_path):
    """Conversations appended to the corpus run through the target on their own: the cached rows of the earlier ones
    are kept (a marker written into them survives), the new rows equal a fresh pass, and an edited earlier
    conversation invalidates the whole cache."""
    from builder.training.distill import CONVERSATIONS, generate

    settings = GenerateSettings(max_new_tokens=8, batch_size=3)
    prompts = [(f"q{i}", f"Write code to count words ({i}).") for i in range(6)]
    data_dir = tmp_path / "d"
    generate(chat_target, prompts[:4], data_dir, settings, quiet=True)
    first = features(chat_target, data_dir, conversations(data_dir), quiet=True)
    n = first.num_tokens
    torch.save(torch.full_like(first.hidden, 7.0), data_dir / HIDDEN)

    generate(chat_target, prompts, data_dir, settings, quiet=True)  # appends q4, q5
    convs = conversations(data_dir)
    assert len(convs) == 6
    grown = features(chat_target, data_dir, convs, quiet=True)
    assert grown.num_tokens > n and bool((grown.hidden[:n] == 7.0).all())
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    (fresh_dir / CONVERSATIONS).write_text((data_dir / CONVERSATIONS).read_text())
    fresh = features(chat_target, fresh_dir, convs, quiet=True)
    torch.testing.assert_close(grown.hidden[n:].float(), fresh.hidden[n:].float(), atol=2e-2, rtol=2e-2)
    assert not bool((fresh.hidden[:n] == 7.0).all(-1).any())

    answer = convs[0]["response_ids"]
    edited = [dict(convs[0], response_ids=[(answer[0] + 1) % 400] + answer[1:])] + convs[1:]
    again = features(chat_target, data_dir, edited, quiet=True)
    assert not bool((again.hidden[:n] == 7.0).all(-1).any())


def test_chat_run_goes_on_after_the_corpus_grows(chat_target, tmp_path):
    """Appending prompts to a chat corpus and extending the budget resumes the run (its log says how many training
    positions it sees from then on); a changed draft vocabulary size is a different run and is refused."""
    from builder.training.loop import ResumeError

    cfg = _config(chat_target, tmp_path, prompts=12)
    del cfg["heads"]["medusa"]
    train_heads(parse_train_config(cfg), quiet=True)
    prompts = Path(cfg["corpus"]["prompts"])
    prompts.write_text(prompts.read_text() + "".join(
        json.dumps({"id": f"n{i}", "prompt": f"Explain what a variable is ({i}).", "chat": True}) + "\n"
        for i in range(8)))
    cfg["heads"]["eagle"]["train"] = {**cfg["heads"]["eagle"]["train"], "max_steps": 18}
    (result,) = train_heads(parse_train_config(cfg), quiet=True)
    assert result.steps == 18
    log = [json.loads(line) for line in (tmp_path / "work" / "eagle_log.jsonl").read_text().splitlines()]
    start, resume = [e for e in log if e["event"] in ("start", "resume")]
    assert resume["event"] == "resume" and resume["step"] == 12
    assert resume["train_positions"] > start["train_positions"]
    assert len(conversations(tmp_path / "work" / "distill")) == 40

    cfg["heads"]["draft_vocab_size"] = K + 8
    with pytest.raises(ResumeError, match="different configuration"):
        train_heads(parse_train_config(cfg), quiet=True)


def test_eagle_fine_tunes_from_an_init_head(chat_target, tmp_path):
    """heads.eagle.init starts a run from a head's weights and keeps its draft vocabulary, even when the answers it
    now trains on would count another one; a resumable state in the work directory wins over init; an init that does
    not fit is refused, naming the setting."""
    for part in "abc":
        (tmp_path / part).mkdir()
    first = _config(chat_target, tmp_path / "a", prompts=12)
    del first["heads"]["medusa"]
    train_heads(parse_train_config(first), quiet=True)
    init = tmp_path / "a" / "eagle"
    init_state = torch.load(init / "pytorch_model.bin", weights_only=True)

    # More prompts of another kind (their answers would move the K most frequent tokens), no learning: the run's
    # output is the init head, weight for weight, with its vocabulary.
    cfg = _config(chat_target, tmp_path / "b", prompts=12, eagle={"output": str(tmp_path / "b" / "eagle"),
                                                                  "init": str(init)})
    del cfg["heads"]["medusa"]
    prompts = Path(cfg["corpus"]["prompts"])
    prompts.write_text(prompts.read_text() + "".join(
        json.dumps({"id": f"n{i}", "prompt": f"Tell me a story about a cat named {i}.", "chat": True}) + "\n"
        for i in range(10)))
    cfg["heads"]["eagle"]["train"] = {**first["heads"]["eagle"]["train"], "lr": 0.0, "max_steps": 2}
    train_heads(parse_train_config(cfg), quiet=True)
    got = torch.load(tmp_path / "b" / "eagle" / "pytorch_model.bin", weights_only=True)
    assert got.keys() == init_state.keys()
    for key, value in init_state.items():
        assert torch.equal(got[key], value), key
    summary = json.loads((tmp_path / "b" / "eagle" / "training_summary.json").read_text())
    assert summary["init"].endswith("eagle") and summary["steps"] == 2
    start = json.loads((tmp_path / "b" / "work" / "eagle_log.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["init"] == summary["init"]
    # Counted afresh on these answers, the vocabulary would differ: what was kept is the init head's.
    from builder.train_heads import chat_data
    counted = chat_data(parse_train_config(cfg), 420, (1,), quiet=True).vocab
    assert counted.target_ids.tolist() != DraftVocab.from_state(dict(got), 420, "b").target_ids.tolist()

    # With a resumable state, init is not read again: the run resumes (here: a learning run picks up at step 2).
    cfg["heads"]["eagle"]["train"] = {**cfg["heads"]["eagle"]["train"], "max_steps": 3}
    (result,) = train_heads(parse_train_config(cfg), quiet=True)
    assert result.steps == 3

    bad = _config(chat_target, tmp_path / "c", eagle={"output": str(tmp_path / "c" / "eagle"),
                                                        "init": str(tmp_path / "nowhere")})
    del bad["heads"]["medusa"]
    with pytest.raises(BuildConfigError, match=r"heads.eagle.init: .*nowhere is not a directory; expected an EAGLE"):
        train_heads(parse_train_config(bad), quiet=True)
    bad["heads"]["eagle"]["init"] = str(init)
    bad["heads"]["draft_vocab_size"] = K + 8
    with pytest.raises(BuildConfigError, match=f"heads.draft_vocab_size: got {K + 8}, but the init head scores a "
                                               f"draft vocabulary of {K} tokens"):
        train_heads(parse_train_config(bad), quiet=True)
    bad["heads"]["draft_vocab_size"] = None
    with pytest.raises(BuildConfigError, match="has a reduced draft vocabulary, but heads.draft_vocab_size is None"):
        train_heads(parse_train_config(bad), quiet=True)
    (init / "pytorch_model.bin").write_bytes(b"not a state dict")
    bad["heads"]["draft_vocab_size"] = K
    with pytest.raises(BuildConfigError, match="heads.eagle.init: cannot read EAGLE weights"):
        train_heads(parse_train_config(bad), quiet=True)


def test_rebuild_distill_knows_the_order_generate_writes(chat_target, tmp_path):
    """demo/smollm2/rebuild_distill.py reads answers back from a datastore by replaying generate()'s order (greedy
    answers first, then sampled, each sorted by prompt length): it must be the order generate() writes, run by run."""
    import importlib.util

    from builder.training.distill import CONVERSATIONS, generate

    spec = importlib.util.spec_from_file_location("rebuild_distill", Path(__file__).resolve().parents[1] / "demo" /
                                                  "smollm2" / "rebuild_distill.py")
    rebuild = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rebuild)
    texts = {f"a{i}": "Sort a list." + " Please." * (i % 3) for i in range(5)}
    texts.update({f"b{i}": "Count words" + " now" * (4 - i) + "." for i in range(4)})
    prompts = list(texts.items())
    data_dir = tmp_path / "d"
    settings = GenerateSettings(max_new_tokens=4, batch_size=3)
    two = dataclasses.replace(settings, answers=2)
    generate(chat_target, prompts[:5], data_dir, settings, quiet=True)  # run 1: a*, greedy
    generate(chat_target, prompts[:5], data_dir, two, quiet=True)  # run 2: a*, the sampled answers
    generate(chat_target, prompts, data_dir, two, quiet=True)  # run 3: b* appended, both answers
    written = [json.loads(line)["id"] for line in (data_dir / CONVERSATIONS).read_text().splitlines()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_target))
    encoded = {i: tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for i, t in prompts}
    assert len({len(e) for e in encoded.values()}) > 2  # the sort has work to do
    ids = [i for i, _ in prompts]
    want = (rebuild.run_order(("a",), (0,), ids, encoded) + rebuild.run_order(("a",), (1,), ids, encoded)
            + rebuild.run_order(("b",), (0, 1), ids, encoded))
    assert written == want
    assert written[:5] != [f"a{i}" for i in range(5)]  # sorted by prompt length, not in file order
