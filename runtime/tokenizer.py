"""Tokenizer over a checkpoint's tokenizer.json (the `tokenizers` library), and a streaming detokenizer.

Special tokens: bos from tokenizer_config.json ("bos_token", authoritative when the key is present, even
null as in Qwen2), else generation_config.json / config.json bos_token_id. eos ids are the union of
generation_config.json eos_token_id (an int or a list, as in Llama 3), config.json eos_token_id and
tokenizer_config.json's eos_token, in that order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from runtime.config import token_id_list
from runtime.errors import ConfigError, TokenizerError
from runtime.files import read_json_object

REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, TokenizerError) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config's "eos_token": a string, an AddedToken dict {"content": ...}, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(
        self,
        tokenizer: _HFTokenizer,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool = True,
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos and bos_token_id is not None
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        # SentencePiece-style byte fallback (<0x00>..<0xFF>, Llama 2 / Mistral): the decoder turns a whole run
        # of byte tokens into text at once, so a run's text is only final once a non-byte token follows it.
        self.byte_fallback_ids: frozenset[int] = frozenset()
        if getattr(tokenizer.model, "byte_fallback", False):
            ids = (tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
            self.byte_fallback_ids = frozenset(i for i in ids if i is not None)
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        for tid in (*self.eos_token_ids, *(() if bos_token_id is None else (bos_token_id,))):
            if not 0 <= tid < size:
                raise TokenizerError(f"special token id {tid} is outside the tokenizer vocabulary [0, {size})")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        tok_path = root / "tokenizer.json"
        if not tok_path.is_file():
            raise TokenizerError(f"missing tokenizer.json in {root}")
        try:
            tok = _HFTokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust binding raises plain Exception subclasses for any parse error
            raise TokenizerError(f"cannot load {tok_path}: {exc}") from exc
        tok_cfg = _read_json(root / "tokenizer_config.json")
        gen_cfg = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")

        def token_id(content: str, field: str) -> int:
            tid = tok.token_to_id(content)
            if tid is None:
                raise TokenizerError(f"tokenizer_config.json {field} {content!r} is not in {tok_path.name}")
            return tid

        try:
            if "bos_token" in tok_cfg:
                content = _token_content(tok_cfg["bos_token"])
                bos = None if content is None else token_id(content, "bos_token")
            else:
                ids = token_id_list(gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id")), "bos_token_id")
                bos = ids[0] if ids else None
            eos: list[int] = []
            for value, field in (
                (gen_cfg.get("eos_token_id"), "generation_config.json eos_token_id"),
                (model_cfg.get("eos_token_id"), "config.json eos_token_id"),
            ):
                eos += [t for t in token_id_list(value, field) if t not in eos]
        except ConfigError as exc:
            raise TokenizerError(str(exc)) from exc
        eos_content = _token_content(tok_cfg.get("eos_token"))
        if eos_content is not None:
            tid = token_id(eos_content, "eos_token")
            if tid not in eos:
                eos.append(tid)
        add_bos = tok_cfg.get("add_bos_token", True)
        return cls(tok, bos, eos, add_bos=bool(add_bos))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text` (special-token strings in it are recognised), BOS first when add_bos and the
        model has one."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Streams text deltas from token ids: the concatenation of every `add` result and `flush()` equals
    `tokenizer.decode(all ids)`, and no delta ends in half a UTF-8 character.

    Decoding is windowed: text is decoded from `_prefix` (the tokens of the previous delta) so that
    decoders that depend on context (SentencePiece's leading-space strip) see the same neighbourhood as a
    full decode, and the cost per token stays constant. Text is held back while it ends in U+FFFD (half a
    character) or in a byte-fallback token (a following byte token could still turn the whole run of byte
    tokens into replacement characters).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids[:_read] have been emitted as text
        self._emitted = 0  # characters emitted so far

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    def add(self, ids: int | Iterable[int]) -> str:
        """Feed one or more token ids; return the newly completed text (possibly "")."""
        self._ids.extend([ids] if isinstance(ids, int) else ids)
        if self._ends_in_byte_run():
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        # Hold back while the window ends in a partial character; a later byte token completes it.
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT) or not text.startswith(prefix_text):
            return ""
        delta = text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._emitted += len(delta)
        return delta

    def _ends_in_byte_run(self) -> bool:
        byte_ids = self._tok.byte_fallback_ids
        if not byte_ids:
            return False
        for i in reversed(self._ids):
            if self._skip and i in self._tok.special_ids:
                continue  # skipped specials vanish before decoding: byte runs join across them
            return i in byte_ids
        return False

    def flush(self) -> str:
        """The rest at end of stream (a trailing partial character becomes U+FFFD, as in decode).

        One full decode: whatever the window held back is settled against decode(all ids).
        """
        text = self._tok.decode(self._ids, self._skip)
        delta = text[self._emitted :]
        self._prefix = self._read = len(self._ids)
        self._emitted = len(text)
        return delta


__all__ = ["Tokenizer", "IncrementalDetokenizer"]
