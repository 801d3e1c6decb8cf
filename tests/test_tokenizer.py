"""Tokenizer special tokens and the streaming detokenizer (byte-level BPE and SentencePiece-style byte fallback)."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, trainers

from runtime.errors import TokenizerError
from runtime.tokenizer import REPLACEMENT, Tokenizer
from tests.tiny import BOS_ID, CORPUS, EOS_ID, EOT_ID, make_checkpoint, tokenizer_json

TEXTS = [
    "The quick brown fox",
    "Café naïve — “quotes” 🙂🚀 日本語のテキスト 한국어 Ωmega",
    "  leading spaces and\nnew lines\n\n",
    "def add(a, b):\n    return a + b",
]


@functools.lru_cache(maxsize=None)
def byte_level_tokenizer() -> Tokenizer:
    return Tokenizer(HFTokenizer.from_str(tokenizer_json()), BOS_ID, [EOS_ID])


@functools.lru_cache(maxsize=None)
def sentencepiece_like_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer.json: metaspace normalizer, BPE with <0xNN> byte fallback, Strip decoder."""
    tok = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([line for line in CORPUS.splitlines() if line.isascii()], trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # byte tokens are ordinary vocabulary entries, as in Llama 2
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Tokenizer(HFTokenizer.from_str(json.dumps(spec)), 1, [2])


TOKENIZERS = {"byte_level": byte_level_tokenizer, "sentencepiece_like": sentencepiece_like_tokenizer}


@pytest.fixture
def byte_level() -> Tokenizer:
    return byte_level_tokenizer()


def stream(tok: Tokenizer, ids: list[int], chunks: list[int] | None = None, skip: bool = False) -> list[str]:
    """Deltas from feeding ids (one at a time, or in the given chunk sizes), then flush."""
    detok = tok.detokenizer(skip_special_tokens=skip)
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.add(ids[i : i + size]) if size != 1 else detok.add(ids[i]))
        i += size
    deltas.append(detok.flush())
    return deltas


# ---- special tokens ------------------------------------------------------------------------------------


def test_llama2_style_special_tokens(tmp_path):
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, "llama2"))
    assert tok.bos_token_id == BOS_ID and tok.eos_token_ids == (EOS_ID,)
    ids = tok.encode("The quick brown fox")
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    assert tok.encode("The quick brown fox", add_bos=False) == ids[1:]
    assert tok.decode(ids[1:]) == "The quick brown fox"
    assert tok.encode("</s>", add_bos=False) == [EOS_ID]  # special-token text maps to the special id


def test_llama3_eos_list_from_generation_config(tmp_path):
    path = make_checkpoint(tmp_path, "llama3")
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [EOS_ID, EOT_ID]
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token_ids == (EOS_ID, EOT_ID)


def test_qwen2_has_no_bos(tmp_path):
    tok = Tokenizer.from_dir(make_checkpoint(tmp_path, "qwen2"))
    assert tok.bos_token_id is None
    assert tok.encode("hello") == tok.encode("hello", add_bos=False)
    assert BOS_ID not in tok.encode("hello")


def test_fallback_to_config_ids_and_union(tmp_path):
    path = make_checkpoint(tmp_path, "llama2")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|eot_id|>"}}))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    tok = Tokenizer.from_dir(path)
    assert tok.bos_token_id == 0  # no "bos_token" key: generation_config's id
    assert tok.eos_token_ids == (EOS_ID, EOT_ID)


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda p: (p / "tokenizer.json").unlink(), "missing tokenizer.json"),
        (lambda p: (p / "tokenizer.json").write_text("{not json"), "cannot load .*tokenizer.json"),
        (lambda p: (p / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"})),
         "eos_token '<eos>' is not in tokenizer.json"),
        (lambda p: (p / "tokenizer_config.json").write_text("[1, 2]"), "must hold a JSON object"),
        (lambda p: (p / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"})),
         "generation_config.json eos_token_id"),
        (lambda p: (p / "generation_config.json").write_text(json.dumps({"eos_token_id": 100000})),
         "special token id 100000 is outside the tokenizer vocabulary"),
    ],
)
def test_tokenizer_errors(tmp_path, setup, message):
    path = make_checkpoint(tmp_path, "llama2")
    setup(path)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_dir(path)


# ---- incremental detokenizer ----------------------------------------------------------------------------


@pytest.mark.parametrize("which", sorted(TOKENIZERS))
@pytest.mark.parametrize("text", TEXTS)
def test_stream_never_emits_partial_characters(which, text):
    tok = TOKENIZERS[which]()
    ids = tok.encode(text, add_bos=False)
    # The test can fail: some tokens of this text are partial UTF-8 on their own.
    if not text.isascii():
        assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    deltas = stream(tok, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_partial_character_is_held_then_flushed(byte_level):
    ids = byte_level.encode("🙂", add_bos=False)
    assert len(ids) > 1
    detok = byte_level.detokenizer()
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "🙂"
    detok = byte_level.detokenizer()
    assert detok.add(ids[:-1]) == ""
    assert detok.add(ids[-1:]) == "🙂"
    assert detok.flush() == ""


def test_flush_emits_trailing_partial_as_decode_does(byte_level):
    ids = byte_level.encode("ab🙂", add_bos=False)[:-1]
    deltas = stream(byte_level, ids)
    assert deltas[-1].endswith(REPLACEMENT)
    assert "".join(deltas) == byte_level.decode(ids)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans(), which=st.sampled_from(sorted(TOKENIZERS)))
def test_stream_concatenation_equals_decode(data, skip, which):
    """Any id sequence, any chunking: concatenated deltas == decode(all ids)."""
    tok = TOKENIZERS[which]()
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40), label="ids")
    cuts = data.draw(st.lists(st.integers(1, 5), max_size=40), label="chunks")
    chunks, total = [], 0
    for c in cuts:
        if total >= len(ids):
            break
        chunks.append(min(c, len(ids) - total))
        total += chunks[-1]
    if total < len(ids):
        chunks.append(len(ids) - total)
    assert "".join(stream(tok, ids, chunks, skip)) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=30).filter(lambda t: REPLACEMENT not in t))
def test_stream_of_valid_text_has_no_replacement_chars(text):
    tok = byte_level_tokenizer()
    ids = tok.encode(text, add_bos=False)
    deltas = stream(tok, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize("skip", [False, True])
def test_byte_fallback_runs_are_held_until_closed(skip):
    """A valid byte token followed by an invalid continuation turns the whole run into U+FFFD in decode (the
    tokenizers ByteFallback decoder), even across a skipped special token: streaming must agree."""
    tok = sentencepiece_like_tokenizer()
    b00, b80, bos = tok.token_to_id("<0x00>"), tok.token_to_id("<0x80>"), tok.bos_token_id
    for ids in ([b00, b80], [b00, bos, b80], [b00, bos, b80, tok.encode("end", add_bos=False)[0]]):
        full = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(stream(tok, ids, skip=skip)) == full
    assert tok.decode([b00, b80]) == REPLACEMENT * 2  # the decoder behaviour this guards against
