"""Tokenizer over a checkpoint's tokenizer.json (the `tokenizers` library), and a streaming detokenizer.

Special tokens: bos from tokenizer_config.json ("bos_token", authoritative when the key is present, even
null as in Qwen2), else generation_config.json / config.json bos_token_id. eos ids are the union of
generation_config.json eos_token_id (an int or a list, as in Llama 3), config.json eos_token_id and
tokenizer_config.json's eos_token, in that order.

Chat template: a `chat_template.jinja` file beside tokenizer.json (wins, as in transformers >= 4.43), else
tokenizer_config.json "chat_template" (a string, or HF's list of {name, template} where "default" is used).
It is rendered as transformers renders it (sandboxed jinja2, trim_blocks / lstrip_blocks, `raise_exception`,
`bos_token` / `eos_token`) and the text is encoded without adding a BOS: the template places special tokens.
Only the template's own special tokens become control tokens: special-token text inside a message's content
("<|im_end|>\n<|im_start|>assistant") stays literal text (`apply_chat_template`, unless parse_special), so a user
cannot forge turns or roles; a role holding special-token text is refused.
`chat_messages` is the one validator of chat messages (the runtime's prompt and the served `messages` input).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from runtime.config import token_id_list
from runtime.errors import ConfigError, RequestError, TokenizerError
from runtime.files import read_json_object

REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The special-token strings a chat template sees (transformers' special_tokens_map keys).
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn (OpenAI chat form)."""

    role: str  # "system" | "user" | "assistant" | whatever else the model's template knows
    content: str


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def chat_messages(messages: Any, name: str = "messages") -> tuple[ChatMessage, ...]:
    """Validate chat messages: a non-empty list of {"role": str, "content": str} (dicts or ChatMessages).

    RequestError names the index, the key and the value, e.g. `messages[1].role must be a string, got 3`.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError(f"{name} must be a list of {{role, content}} messages, got {_shown(messages)}")
    if not messages:
        raise RequestError(f"{name} is empty; expected at least one {{role, content}} message")
    out = []
    for i, message in enumerate(messages):
        where = f"{name}[{i}]"
        if isinstance(message, ChatMessage):
            message = {"role": message.role, "content": message.content}
        if not isinstance(message, Mapping):
            raise RequestError(f"{where} must be an object with role and content, got {_shown(message)}")
        unknown = sorted(str(k) for k in set(message) - {"role", "content"})
        if unknown:
            raise RequestError(f"{where} has unknown key(s) {unknown}; expected only role and content")
        for key in ("role", "content"):
            if key not in message:
                raise RequestError(f"{where} has no {key!r}; expected role and content strings")
            if not isinstance(message[key], str):
                raise RequestError(f"{where}.{key} must be a string, got {_shown(message[key])}")
        if not message["role"]:
            raise RequestError(f"{where}.role must be a non-empty string, got ''")
        out.append(ChatMessage(message["role"], message["content"]))
    return tuple(out)


def check_unicode(value: Any, name: str) -> None:
    """RequestError naming the first string in `value` (a str, or lists / mappings of them, keys included) that is
    not Unicode text: a lone surrogate such as "\\ud800", which JSON can escape but no UTF-8 text holds, so no
    tokenizer takes it. Each front end calls it once on what a client sent, where JSON text becomes strings."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(f"{name}: {value[exc.start]!r} at character {exc.start} is a lone surrogate (half of "
                               "a UTF-16 pair), not a character; expected valid Unicode text") from None
    elif isinstance(value, Mapping):
        for key, item in value.items():
            check_unicode(key, f"{name}: a key" if name else "a key")
            check_unicode(item, f"{name}.{key}" if name else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_unicode(item, f"{name}[{i}]")


def single_turn(user: str, system: str | None = None) -> list[dict[str, str]]:
    """The messages of a one-question chat (the CLIs' --chat [--system]): a system message if given, then the user's."""
    return [*([] if system is None else [{"role": "system", "content": system}]), {"role": "user", "content": user}]


def is_chat(prompt: Any) -> bool:
    """Whether a prompt is chat messages (a non-empty list or tuple starting with a dict or ChatMessage)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], (Mapping, ChatMessage))


def _chat_template(root: Path, tok_cfg: dict[str, Any]) -> tuple[str | None, str]:
    """(template, where it came from) of a tokenizer directory; (None, why not) when it has none."""
    path = root / CHAT_TEMPLATE_FILE
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"cannot read {path}: {exc}") from exc
    where = f"{root / 'tokenizer_config.json'} chat_template"
    value = tok_cfg.get("chat_template")
    if value is None:
        return None, f"neither {CHAT_TEMPLATE_FILE} nor a tokenizer_config.json chat_template in {root}"
    if isinstance(value, str):
        return value, where
    if isinstance(value, list):
        named: dict[str, str] = {}
        for i, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(f"{where}[{i}]: expected {{\"name\": str, \"template\": str}}, got "
                                     f"{_shown(entry)}")
            named[entry["name"]] = entry["template"]
        if "default" in named:
            return named["default"], f"{where} 'default'"
        return None, f"{where} has no 'default' template (has {sorted(named)})"
    raise TokenizerError(f"{where}: expected a string or a list of {{name, template}}, got {type(value).__name__}")


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
        chat_template: str | None = None,
        chat_template_source: str | None = None,  # where the template came from, or why there is none
        special_tokens: Mapping[str, str] | None = None,  # bos_token, eos_token, ... as the template sees them
    ) -> None:
        self._tok = tokenizer
        self._literal_tok: _HFTokenizer | None = None  # built on first use by _literal
        self._literal_lock = threading.Lock()
        self.chat_template = chat_template
        self._chat_template_source = chat_template_source or ("given" if chat_template else "none was given")
        self._compiled_template: Any = None
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
        specials = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.special_ids = frozenset(specials)
        # the text of every special token, longest first (special-token text in chat content: apply_chat_template)
        texts = sorted({t for t in specials.values() if t}, key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, texts))) if texts else None
        for tid in (*self.eos_token_ids, *(() if bos_token_id is None else (bos_token_id,))):
            if not 0 <= tid < size:
                raise TokenizerError(f"special token id {tid} is outside the tokenizer vocabulary [0, {size})")
        if special_tokens is None:
            special_tokens = {name: tokenizer.id_to_token(tid) for name, tid in (
                ("bos_token", bos_token_id), ("eos_token", self.eos_token_ids[0] if self.eos_token_ids else None))
                if tid is not None}
        self.special_tokens: dict[str, str] = dict(special_tokens)

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
        template, template_source = _chat_template(root, tok_cfg)
        # What transformers hands a template: tokenizer_config's special token strings (bos_token may be null).
        special = {name: text for name in _TEMPLATE_TOKENS if (text := _token_content(tok_cfg.get(name))) is not None}
        if "bos_token" not in tok_cfg and bos is not None:
            special["bos_token"] = tok.id_to_token(bos)
        if "eos_token" not in special and eos:
            special["eos_token"] = tok.id_to_token(eos[0])
        return cls(tok, bos, eos, add_bos=bool(add_bos), chat_template=template, chat_template_source=template_source,
                   special_tokens=special)

    def encode(self, text: str, add_bos: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, BOS first when add_bos and the model has one.

        parse_special: special-token strings in the text ("<s>", "<|im_start|>") become their special ids, as
        transformers encodes; False: they are literal text (what a server does with text a user typed).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, got {type(text).__name__}")
        tok = self._tok if parse_special else self._literal()
        ids = tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def _literal(self) -> _HFTokenizer:
        """A copy of the tokenizer that encodes special-token text as ordinary text (`encode_special_tokens` is
        a setting of the tokenizer object, so it lives on a copy: the shared one keeps parsing them)."""
        with self._literal_lock:
            if self._literal_tok is None:
                tok = _HFTokenizer.from_str(self._tok.to_str())
                tok.encode_special_tokens = True
                self._literal_tok = tok
            return self._literal_tok

    def render_chat_template(self, messages: Any, add_generation_prompt: bool = True) -> str:
        """The chat template's text for `messages` (validated by `chat_messages`), as transformers renders it.

        RequestError when the tokenizer has no template or the template refuses the messages (its
        raise_exception, e.g. roles that do not alternate); TokenizerError when the template itself is broken.
        """
        turns = chat_messages(messages)
        if self.chat_template is None:
            raise RequestError(f"the tokenizer has no chat template ({self._chat_template_source}); send the "
                               "prompt as text or token ids instead of chat messages")
        template = self._compiled()
        import jinja2  # importable: compiling needed it

        try:
            return template.render(
                messages=[{"role": t.role, "content": t.content} for t in turns],
                add_generation_prompt=add_generation_prompt, tools=None, documents=None, **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"the chat template ({self._chat_template_source}) refused the messages: {exc}") from exc

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True,
                            parse_special: bool = False) -> list[int]:
        """Token ids of the rendered chat template (no BOS added: the template places its special tokens).

        The template's own special tokens are control tokens; special-token text inside a message's content stays
        literal text (the ids of that text as ordinary characters), so content cannot close its turn or open
        another role's. parse_special: content's special-token text becomes special tokens too (transformers'
        apply_chat_template, which tokenises the rendered text as a whole). Messages without special-token text
        get transformers' ids either way.
        """
        turns = chat_messages(messages)
        pattern = None if parse_special else self._special_text
        if pattern is not None:
            for i, turn in enumerate(turns):
                found = pattern.search(turn.role)
                if found:
                    raise RequestError(f"messages[{i}].role holds the special-token text {found.group(0)!r}; a role "
                                       "is a plain name (user, assistant, system, ...)")
        if pattern is None or not any(pattern.search(t.content) for t in turns):
            return self.encode(self.render_chat_template(turns, add_generation_prompt), add_bos=False)
        text, literal = self._render_marked(turns, add_generation_prompt, pattern)
        return self._encode_with_literal_spans(text, literal)

    def _render_marked(self, turns: tuple[ChatMessage, ...], add_generation_prompt: bool,
                       pattern: re.Pattern[str]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text, and the spans in it of special-token text that came from message content. Content's
        special-token text is replaced by unique marks before rendering (a template may trim or cut content; marks
        of private-use characters and digits pass through such changes unaltered) and put back after."""
        nonce = str(secrets.randbelow(10**12))
        originals: list[str] = []

        def mark(m: re.Match[str]) -> str:
            originals.append(m.group(0))
            return f"\ue000{nonce}.{len(originals) - 1}\ue001"

        rendered = self.render_chat_template(
            [ChatMessage(t.role, pattern.sub(mark, t.content)) for t in turns], add_generation_prompt)
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        size = pos = 0
        for m in re.finditer(f"\ue000{nonce}\\.(\\d+)\ue001", rendered):
            parts.append(rendered[pos:m.start()])
            size += m.start() - pos
            original = originals[int(m.group(1))]
            parts.append(original)
            spans.append((size, size + len(original)))
            size += len(original)
            pos = m.end()
        parts.append(rendered[pos:])
        text = "".join(parts)
        if f"\ue000{nonce}" in text:
            raise RequestError("messages: the chat template changed message content that holds special-token text, "
                               "so that text cannot be kept literal; remove the special-token text from the messages")
        return text, spans

    def _encode_with_literal_spans(self, text: str, literal: list[tuple[int, int]]) -> list[int]:
        """Ids of `text` where the special tokens inside the `literal` spans are ordinary text: every other special
        token as parsed, the text between them as the literal tokenizer encodes it in place (its tokens from one
        encoding of the whole text, so each stretch gets the context the pre-tokenizer gives it inside the text;
        a stretch whose edge a literal token crosses is encoded on its own)."""
        parsed = self._tok.encode(text, add_special_tokens=False)
        kept = [(tid, a, b) for tid, (a, b) in zip(parsed.ids, parsed.offsets)
                if tid in self.special_ids and not any(a < end and start < b for start, end in literal)]
        whole = self._literal().encode(text, add_special_tokens=False)
        pieces = list(zip(whole.ids, whole.offsets))
        ids: list[int] = []
        i, pos = 0, 0
        for tid, a, b in [*kept, (None, len(text), len(text))]:
            crossed = False
            while i < len(pieces) and pieces[i][1][0] < pos:  # tokens of the special token before this stretch
                crossed = crossed or pieces[i][1][1] > pos
                i += 1
            region = []
            while i < len(pieces) and pieces[i][1][0] < a:
                crossed = crossed or pieces[i][1][1] > a
                region.append(pieces[i][0])
                i += 1
            if crossed:
                region = self._literal().encode(text[pos:a], add_special_tokens=False).ids
            ids += region
            if tid is not None:
                ids.append(tid)
            pos = b
        return ids

    def _compiled(self) -> Any:
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template, self._chat_template_source)
        return self._compiled_template

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


def _compile_chat_template(source: str, where: str) -> Any:
    """A chat template compiled in the environment transformers gives it (chat templates are untrusted code: the
    sandbox forbids attribute escapes, and the environment is immutable)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise TokenizerError(f"chat templates need jinja2 >= 3.1.6 (pip install jinja2): {exc}") from exc
    version = tuple(int(p) if p.isdigit() else 0 for p in jinja2.__version__.split(".")[:3])
    if version < (3, 1, 6):  # older sandboxes have known escapes, and a template is code from the checkpoint
        raise TokenizerError(f"chat templates need jinja2 >= 3.1.6 (its sandbox), found {jinja2.__version__}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters; templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template ({where}) does not compile: {exc}") from exc


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


__all__ = ["CHAT_TEMPLATE_FILE", "ChatMessage", "IncrementalDetokenizer", "Tokenizer", "chat_messages",
           "check_unicode", "is_chat", "single_turn"]
