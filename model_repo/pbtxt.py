"""A small typed protobuf text-format writer and parser for Triton's config.pbtxt.

Messages are frozen dataclasses; a field's Python type says how it is written:

    str / int / float / bool        name: "text" / 3 / 0.5 / true
    an Enum subclass                name: MEMBER_NAME                  (bare identifier)
    a dataclass                     name { ... }
    tuple[scalar, ...]              name: [ 1, 2 ]
    tuple[dataclass, ...]           name [ { ... }, { ... } ]
    dict[str, scalar | dataclass]   one `name { key: "k" value: ... }` entry per item (a protobuf map)
    X | None                        omitted when None

`dumps(message)` renders a message; `loads(cls, text)` parses text back into `cls`, failing with ConfigError on an
unknown field, a missing required field, a repeated singular field or a value of the wrong kind. The parser
reads the text format generally (comments, `name: { }` or `name { }`, repeated fields written either as
lists or as repeated entries), so it also reads configs this module did not write.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from runtime.errors import ConfigError


# ---- writer ---------------------------------------------------------------------------------------------

_INDENT = "  "


def dumps(message: Any) -> str:
    """Protobuf text of a message dataclass (fields in declaration order, None fields omitted)."""
    if not dataclasses.is_dataclass(message) or isinstance(message, type):
        raise ConfigError(f"dumps expects a message dataclass instance, got {type(message).__name__}")
    return "".join(_fields(message, 0))


def _fields(message: Any, depth: int) -> Iterator[str]:
    hints = _hints(type(message))
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        yield from _field(f.name, hints[f.name], value, depth, f"{type(message).__name__}.{f.name}")


def _field(name: str, tp: Any, value: Any, depth: int, where: str) -> Iterator[str]:
    pad = _INDENT * depth
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if not optional:
            raise ConfigError(f"{where} is required but unset (None)")
        return
    origin = typing.get_origin(inner)
    if origin is tuple:
        item_tp = _tuple_item(inner, where)
        if not isinstance(value, tuple):
            raise ConfigError(f"{where} must be a tuple, got {type(value).__name__}")
        if not value:
            return  # an empty repeated field is simply absent
        if _is_message(item_tp):
            yield f"{pad}{name} [\n"
            for i, item in enumerate(value):
                _check_message(item, item_tp, f"{where}[{i}]")
                sep = "," if i < len(value) - 1 else ""
                yield f"{pad}{_INDENT}{{\n"
                yield from _fields(item, depth + 2)
                yield f"{pad}{_INDENT}}}{sep}\n"
            yield f"{pad}]\n"
        else:
            items = ", ".join(_scalar(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
            yield f"{pad}{name}: [ {items} ]\n"
    elif origin is dict:
        key_tp, value_tp = typing.get_args(inner)
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a dict, got {type(value).__name__}")
        for key in sorted(value):
            yield f"{pad}{name} {{\n"
            yield f"{pad}{_INDENT}key: {_scalar(key_tp, key, f'{where} key')}\n"
            item = value[key]
            if _is_message(value_tp):
                _check_message(item, value_tp, f"{where}[{key!r}]")
                yield f"{pad}{_INDENT}value {{\n"
                yield from _fields(item, depth + 2)
                yield f"{pad}{_INDENT}}}\n"
            else:
                yield f"{pad}{_INDENT}value: {_scalar(value_tp, item, f'{where}[{key!r}]')}\n"
            yield f"{pad}}}\n"
    elif _is_message(inner):
        _check_message(value, inner, where)
        yield f"{pad}{name} {{\n"
        yield from _fields(value, depth + 1)
        yield f"{pad}}}\n"
    else:
        yield f"{pad}{name}: {_scalar(inner, value, where)}\n"


def _check_message(value: Any, tp: type, where: str) -> None:
    if type(value) is not tp:
        raise ConfigError(f"{where} must be a {tp.__name__}, got {type(value).__name__}")


def _scalar(tp: Any, value: Any, where: str) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if not isinstance(value, tp):
            raise ConfigError(f"{where} must be a {tp.__name__} member, got {value!r}")
        return value.name
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be a bool, got {value!r}")
        return "true" if value else "false"
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an int, got {value!r}")
        return str(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        return repr(float(value))
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a str, got {value!r}")
        return _quote(value)
    raise ConfigError(f"{where}: unsupported field type {tp!r}")


def _quote(s: str) -> str:
    out = []
    for ch in s:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\{ord(ch):03o}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


# ---- type helpers ---------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise ConfigError(f"unsupported union type {tp!r}")
        return args[0], True
    return tp, False


def _tuple_item(tp: Any, where: str) -> Any:
    args = typing.get_args(tp)
    if len(args) != 2 or args[1] is not Ellipsis:
        raise ConfigError(f"{where}: repeated fields must be typed tuple[X, ...], got {tp!r}")
    return args[0]


def _is_message(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


# ---- parser ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Token:
    kind: str  # "ident" | "string" | "number" | "punct"
    text: str  # decoded text for strings
    line: int


_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r\n]+|\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf|nan)(?![A-Za-z_0-9]))
  | (?P<ident>[A-Za-z_][A-Za-z_0-9.]*)
  | (?P<punct>[{}\[\]:,;<>])
    """,
    re.VERBOSE,
)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "'": "'", "\\": "\\", "a": "\a", "b": "\b", "f": "\f",
            "v": "\v", "?": "?"}


def _unquote(raw: str, line: int) -> str:
    body, out, i = raw[1:-1], bytearray(), 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out += ch.encode("utf-8")
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in _ESCAPES:
            out += _ESCAPES[nxt].encode()
            i += 2
        elif nxt in "01234567":
            digits = re.match(r"[0-7]{1,3}", body[i + 1 :]).group(0)
            out.append(int(digits, 8))
            i += 1 + len(digits)
        elif nxt == "x":
            digits = re.match(r"[0-9a-fA-F]{1,2}", body[i + 2 :])
            if digits is None:
                raise ConfigError(f"line {line}: bad \\x escape in {raw}")
            out.append(int(digits.group(0), 16))
            i += 2 + len(digits.group(0))
        else:
            raise ConfigError(f"line {line}: unknown escape \\{nxt} in {raw}")
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"line {line}: string {raw} is not valid UTF-8 ({exc})") from exc


def _tokenize(text: str) -> list[_Token]:
    tokens, pos, line = [], 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ConfigError(f"line {line}: unexpected character {text[pos]!r}")
        kind = m.lastgroup
        raw = m.group(0)
        if kind == "string":
            tokens.append(_Token("string", _unquote(raw, line), line))
        elif kind != "ws":
            tokens.append(_Token(kind, raw, line))
        line += raw.count("\n")
        pos = m.end()
    return tokens


# A parsed message: field name -> list of values in order. A value is a _Token (scalar) or a nested dict.
Parsed = dict[str, list[Any]]


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokenize(text)
        self.i = 0

    def peek(self) -> _Token | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, kind: str | None = None, text: str | None = None) -> _Token:
        tok = self.peek()
        if tok is None:
            raise ConfigError(f"unexpected end of text, expected {text or kind}")
        if (kind is not None and tok.kind != kind) or (text is not None and tok.text != text):
            raise ConfigError(f"line {tok.line}: expected {text or kind}, got {tok.text!r}")
        self.i += 1
        return tok

    def accept(self, text: str) -> bool:
        tok = self.peek()
        if tok is not None and tok.kind == "punct" and tok.text == text:
            self.i += 1
            return True
        return False

    def message(self, close: str | None) -> Parsed:
        fields: Parsed = {}
        while True:
            tok = self.peek()
            if tok is None:
                if close is not None:
                    raise ConfigError(f"unexpected end of text, expected {close!r}")
                return fields
            if close is not None and tok.kind == "punct" and tok.text == close:
                self.i += 1
                return fields
            name = self.take("ident").text
            colon = self.accept(":")
            values = fields.setdefault(name, [])
            if self.accept("["):
                if not self.accept("]"):
                    while True:
                        values.append(self.value(colon_seen=True))
                        if self.accept("]"):
                            break
                        self.take("punct", ",")
            else:
                values.append(self.value(colon_seen=colon))
            if not self.accept(","):
                self.accept(";")

    def value(self, colon_seen: bool) -> Any:
        if self.accept("{"):
            return self.message("}")
        if self.accept("<"):
            return self.message(">")
        tok = self.peek()
        if not colon_seen:
            raise ConfigError(f"line {tok.line if tok else '?'}: expected ':' or '{{' after a field name")
        if tok is None or tok.kind == "punct":
            raise ConfigError(f"line {tok.line if tok else '?'}: expected a value, got {tok.text if tok else 'end'!r}")
        self.i += 1
        if tok.kind == "string":
            # Adjacent string literals concatenate, as in C and protobuf.
            parts = [tok.text]
            while (nxt := self.peek()) is not None and nxt.kind == "string":
                parts.append(nxt.text)
                self.i += 1
            return _Token("string", "".join(parts), tok.line)
        return tok


def parse(text: str) -> Parsed:
    """Untyped parse: field name -> list of values (tokens or nested dicts)."""
    return _Parser(text).message(None)


def loads(cls: type, text: str) -> Any:
    """Parse protobuf text into the message dataclass `cls` (strict: see the module docstring)."""
    return _build(cls, parse(text), cls.__name__)


def _build(cls: type, fields: Parsed, where: str) -> Any:
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; {cls.__name__} has {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        tp, optional = _unwrap_optional(hints[name])
        here = f"{where}.{name}"
        values = fields.get(name)
        origin = typing.get_origin(tp)
        if values is None:
            if origin in (tuple, dict):
                kwargs[name] = () if origin is tuple else {}
            elif optional:
                kwargs[name] = None
            elif f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            else:
                raise ConfigError(f"{here} is required but missing")
            continue
        if origin is tuple:
            item_tp = _tuple_item(tp, here)
            kwargs[name] = tuple(_value(item_tp, v, f"{here}[{i}]") for i, v in enumerate(values))
        elif origin is dict:
            key_tp, value_tp = typing.get_args(tp)
            out: dict[Any, Any] = {}
            for i, entry in enumerate(values):
                if not isinstance(entry, dict):
                    raise ConfigError(f"{here}[{i}]: a map entry must be a message {{ key: ... value: ... }}")
                extra = sorted(set(entry) - {"key", "value"})
                if extra or len(entry.get("key", ())) != 1 or len(entry.get("value", ())) != 1:
                    raise ConfigError(
                        f"{here}[{i}]: a map entry needs exactly one key and one value (got {sorted(entry)})"
                    )
                key = _value(key_tp, entry["key"][0], f"{here}[{i}].key")
                if key in out:
                    raise ConfigError(f"{here}: key {key!r} appears twice")
                out[key] = _value(value_tp, entry["value"][0], f"{here}[{key!r}]")
            kwargs[name] = out
        else:
            if len(values) != 1:
                raise ConfigError(f"{here} is a singular field but appears {len(values)} times")
            kwargs[name] = _value(tp, values[0], here)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _value(tp: Any, raw: Any, where: str) -> Any:
    if _is_message(tp):
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be a message {{ ... }}, got {raw.text!r}")
        return _build(tp, raw, where)
    if isinstance(raw, dict):
        raise ConfigError(f"{where} must be a scalar, got a message")
    tok: _Token = raw
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if tok.kind != "ident" or tok.text not in tp.__members__:
            raise ConfigError(f"{where} must be one of {', '.join(tp.__members__)}, got {tok.text!r}")
        return tp[tok.text]
    if tp is bool:
        if tok.kind != "ident" or tok.text not in ("true", "false", "True", "False"):
            raise ConfigError(f"{where} must be true or false, got {tok.text!r}")
        return tok.text in ("true", "True")
    if tp is int:
        if tok.kind != "number" or not re.fullmatch(r"[-+]?\d+", tok.text):
            raise ConfigError(f"{where} must be an integer, got {tok.text!r}")
        return int(tok.text)
    if tp is float:
        if tok.kind != "number":
            raise ConfigError(f"{where} must be a number, got {tok.text!r}")
        return float(tok.text)
    if tp is str:
        if tok.kind != "string":
            raise ConfigError(f"{where} must be a quoted string, got {tok.text!r}")
        return tok.text
    raise ConfigError(f"{where}: unsupported field type {tp!r}")


__all__ = ["dumps", "loads", "parse"]
