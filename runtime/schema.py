"""The one typed config layer: a mapping (a YAML document, a Triton model's `parameters`, a JSON manifest) -> a
frozen dataclass, every key and type checked, bounds declared on the fields, errors naming the key path.

    @dataclass(frozen=True)
    class BuildSection:
        dtype: Literal["float32", "bfloat16", "float16"] | None = None
        tp_size: int = setting(1, ge=1)
        output: Path | None = None

        def __post_init__(self) -> None:
            check(self, BuildConfigError, "build")  # the declared bounds, for an instance built directly

    load(BuildSection, {"tp_size": 0}, BuildConfigError, path="build", source="x.yaml")
    # BuildConfigError: x.yaml: build.tp_size: got 0, expected an integer >= 1

Field types: bool, int, float (an int is taken), str, Path (relative ones resolve from `base_dir`), Literal[...],
X | None, tuple[X, ...], dict[str, X], Any, and nested dataclasses. A bool is never an int. `setting` declares a
field's bounds: ge / gt / le / lt, finite, choices, nonempty, pattern, items (the bounds of each item of a tuple;
`what`: the expectation in words); `key` reads the field from another key of the source; `parsed=False` keeps a
field out of sources (the caller sets it). `convert` checks one value against a type and bounds (the request
contract, runtime.request_fields, checks its fields with it).

`strings=True` reads a source whose values are all text (Triton `parameters`): ints, floats and bools ("true" /
"false") are parsed from it, tuples, dicts and dataclasses from JSON text, with the same errors.

Errors are raised as the caller's own type (`error`), "SOURCE: KEY.PATH: got VALUE, expected WHAT". A
`ConfigError` a dataclass's own `__post_init__` raises (cross-field rules) is re-raised as `error`, prefixed with
the source (and the key path of that dataclass, unless it is `error` already: those name their keys).
Imports only the standard library (`yaml` lazily, in `read_yaml`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from runtime.errors import ConfigError, SpectreeError

T = TypeVar("T")
_METADATA = "spectree.schema"  # the dataclasses.field metadata key holding a field's Bounds


@dataclass(frozen=True)
class Bounds:
    """What a field declares beyond its type (see `setting`)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = False  # numbers: not NaN, not infinite
    choices: tuple[Any, ...] | None = None
    nonempty: bool = False  # strings, tuples, dicts: at least one character / item
    pattern: str | None = None  # strings: re.fullmatch
    items: Bounds | None = None  # tuples: the bounds of every item
    what: str | None = None  # the expectation in words, instead of the one written from the type and bounds
    key: str | None = None  # the source's key, when it is not the field's name
    parsed: bool = True  # False: never read from a source (the caller sets it)


_UNBOUNDED = Bounds()


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
            finite: bool = False, choices: tuple[Any, ...] | None = None, nonempty: bool = False,
            pattern: str | None = None, items: Bounds | None = None, what: str | None = None, key: str | None = None,
            parsed: bool = True, metadata: Mapping[str, Any] | None = None) -> Any:
    """A dataclass field with declared bounds: `tp_size: int = setting(1, ge=1)`; `setting()`: required.
    `metadata`: more of the field's metadata (another layer's declaration beside the bounds)."""
    bounds = Bounds(ge=ge, gt=gt, le=le, lt=lt, finite=finite, choices=None if choices is None else tuple(choices),
                    nonempty=nonempty, pattern=pattern, items=items, what=what, key=key, parsed=parsed)
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={**(metadata or {}), _METADATA: bounds})


def bounds_of(f: dataclasses.Field) -> Bounds:
    return f.metadata.get(_METADATA, _UNBOUNDED)


def parsed_fields(cls: type) -> list[dataclasses.Field]:
    """The fields a source may give (every field but those declared `parsed=False`)."""
    return [f for f in dataclasses.fields(cls) if bounds_of(f).parsed]


def key_path(path: str, name: str | int) -> str:
    """`path` extended by a mapping key (`a.b`) or a list index (`a[0]`)."""
    if isinstance(name, int):
        return f"{path}[{name}]"
    return f"{path}.{name}" if path else name


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class _Source:
    error: type[Exception]
    source: str
    base_dir: Path | None
    strings: bool

    def where(self, key: str) -> str:
        key = key or "<top level>"
        return f"{self.source}: {key}" if self.source else key

    def fail(self, key: str, value: Any, expected: str) -> Exception:
        return self.error(f"{self.where(key)}: got {value!r}, expected {expected}")

    def typed(self) -> _Source:
        """The same source for a value parsed from JSON text (typed: no more string parsing)."""
        return dataclasses.replace(self, strings=False)


# ---- reading -----------------------------------------------------------------------------------------------


def load(cls: type[T], data: Any, error: type[Exception] = ConfigError, *, path: str = "", source: str = "",
         base_dir: str | Path | None = None, strings: bool = False) -> T:
    """`data` (a mapping) -> the dataclass `cls`: unknown keys, missing required keys, wrong types and values out
    of the declared bounds fail as `error`, naming `source`, the key path (`path` is that of `data` in its
    document), the value and what was expected. Relative Path fields resolve from `base_dir` (None: kept as
    given); `strings`: every value is text (Triton parameters)."""
    src = _Source(error, source, None if base_dir is None else Path(base_dir).resolve(), strings)
    return _dataclass(cls, data, path, src)


def _dataclass(cls: type[T], data: Any, path: str, src: _Source) -> T:
    by_key = {bounds_of(f).key or f.name: f for f in parsed_fields(cls)}
    if not isinstance(data, Mapping):
        raise src.fail(path, data, f"a mapping with keys {', '.join(by_key)}")
    for k in data:
        if k not in by_key:
            raise src.error(f"{src.where(key_path(path, str(k)))}: unknown key (value {data[k]!r}); expected one of "
                            f"{', '.join(by_key)}")
    hints = _hints(cls)
    kwargs = {}
    for k, f in by_key.items():
        key = key_path(path, k)
        if k not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise src.error(f"{src.where(key)}: missing (required)")
            continue
        value = _convert(hints[f.name], data[k], key, src)
        _check_bounds(hints[f.name], bounds_of(f), value, key, src)
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except src.error as exc:  # the dataclass's own (cross-field) checks, which name their keys
        if not src.source:
            raise
        raise src.error(f"{src.source}: {exc}") from exc
    except SpectreeError as exc:  # another type's checks (runtime option dataclasses): name the key path here
        raise src.error(f"{src.where(path)}: {exc}" if path or src.source else str(exc)) from exc


def _json(value: str, key: str, tp: Any, src: _Source) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise src.error(f"{src.where(key)}: got {value!r}, expected {describe(tp)} as JSON text ({exc})") from exc


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _without_none(tp: Any) -> Any:
    if not _is_optional(tp):
        return tp
    rest = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(rest) != 1:
        raise TypeError(f"unsupported config field type {tp} (only `X | None` unions)")
    return rest[0]


def _text(value: Any) -> str:
    """A Literal value as a string-valued source writes it."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _convert(tp: Any, value: Any, key: str, src: _Source) -> Any:
    if tp is Any:
        return value
    if _is_optional(tp):
        return None if value is None else _convert(_without_none(tp), value, key, src)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    text = src.strings and isinstance(value, str)
    if origin is Literal:
        for a in args:
            if (type(value) is type(a) and value == a) or (text and not isinstance(a, str) and value == _text(a)):
                return a
        raise src.fail(key, value, describe(tp))
    if origin is tuple or tp is tuple:
        if text:
            return _convert(tp, _json(value, key, tp, src), key, src.typed())
        if not isinstance(value, (list, tuple)):
            raise src.fail(key, value, describe(tp))
        if not args or args[-1] is Ellipsis:
            item = args[0] if args else Any
            return tuple(_convert(item, v, key_path(key, i), src) for i, v in enumerate(value))
        if len(value) != len(args):
            raise src.fail(key, value, describe(tp))
        return tuple(_convert(a, v, key_path(key, i), src) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict or tp is dict:
        if text:
            return _convert(tp, _json(value, key, tp, src), key, src.typed())
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise src.fail(key, value, describe(tp))
        item = args[1] if args else Any
        return {k: _convert(item, v, key_path(key, k), src) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # already built (a default, or an instance being checked)
            return value
        if text:
            return _dataclass(tp, _json(value, key, tp, src), key, src.typed())
        return _dataclass(tp, value, key, src)
    if tp is Path:
        if isinstance(value, Path):
            value = str(value)
        if not isinstance(value, str) or not value:
            raise src.fail(key, value, "a path (string)")
        p = Path(value).expanduser()
        if src.base_dir is None:
            return p
        return (p if p.is_absolute() else src.base_dir / p).resolve()
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text and value in ("true", "false"):
            return value == "true"
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text:
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if text:
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config field type {tp}")
    raise src.fail(key, value, describe(tp))


# ---- bounds ----------------------------------------------------------------------------------------------------


def interval(b: Bounds) -> str:
    """The numeric bounds in words: "in [0, 1)", ">= 1", "" (none)."""
    low = f"[{b.ge:g}" if b.ge is not None else f"({b.gt:g}" if b.gt is not None else None
    high = f"{b.le:g}]" if b.le is not None else f"{b.lt:g})" if b.lt is not None else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return (">= " if b.ge is not None else "> ") + low[1:]
    if high:
        return ("<= " if b.le is not None else "< ") + high[:-1]
    return ""


def expectation(tp: Any, b: Bounds) -> str:
    """What a field takes, in words: its type and declared bounds (or `what`)."""
    if b.what is not None:
        return b.what
    if b.choices is not None:
        return "one of " + ", ".join(repr(c) for c in b.choices)
    base = describe(_without_none(tp))
    if b.finite:
        base = {"a number": "a finite number"}.get(base, f"{base}, finite")
    if b.nonempty:
        base = {"a string": "a non-empty string"}.get(base, f"{base}, not empty")
    bound = interval(b)
    return f"{base} {bound}" if bound else base


def _check_bounds(tp: Any, b: Bounds, value: Any, key: str, src: _Source) -> None:
    if value is None or b is _UNBOUNDED:
        return
    if b.items is not None and isinstance(value, tuple):
        args = typing.get_args(_without_none(tp))
        for i, item in enumerate(value):
            _check_bounds(args[0] if args else Any, b.items, item, key_path(key, i), src)
    ok = True
    if b.choices is not None:
        ok = value in b.choices
    if b.nonempty and hasattr(value, "__len__"):
        ok = ok and len(value) > 0
    if b.pattern is not None and isinstance(value, str):
        ok = ok and re.fullmatch(b.pattern, value) is not None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # written as `not (x >= bound)` so that NaN is out of every bound
        ok = ok and not any((
            b.ge is not None and not value >= b.ge, b.gt is not None and not value > b.gt,
            b.le is not None and not value <= b.le, b.lt is not None and not value < b.lt,
            b.finite and not math.isfinite(value),
        ))
    if not ok:
        raise src.fail(key, value, expectation(tp, b))


def convert(tp: Any, value: Any, bounds: Bounds = _UNBOUNDED, error: type[Exception] = ConfigError,
            key: str = "") -> Any:
    """One value as a field of type `tp` with `bounds` takes it (converted as `load` converts: an int for a float
    is a float, a list for a tuple a tuple); a wrong type or a value out of bounds raises `error` naming `key`."""
    src = _Source(error, "", None, False)
    value = _convert(tp, value, key, src)
    _check_bounds(tp, bounds, value, key, src)
    return value


def check(obj: Any, error: type[Exception] = ConfigError, prefix: str = "") -> None:
    """The declared type and bounds of every `setting` field of the dataclass instance `obj` (call it from
    `__post_init__`: an instance built directly is held to what `load` enforces); errors name `prefix.field`."""
    src = _Source(error, "", None, False)
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.metadata.get(_METADATA) is None:
            continue
        key = key_path(prefix, f.name)
        value = getattr(obj, f.name)
        _convert(hints[f.name], value, key, src)  # the type
        _check_bounds(hints[f.name], bounds_of(f), value, key, src)


# ---- describing and writing ---------------------------------------------------------------------------------


def describe(tp: Any) -> str:
    """A field type in words, as error messages say what was expected."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if _is_optional(tp):
        return " or ".join("null" if a is type(None) else describe(a) for a in typing.get_args(tp))
    if origin is tuple or tp is tuple:
        args = typing.get_args(tp)
        if args and args[-1] is not Ellipsis:
            return f"a list of {len(args)}: " + ", ".join(describe(a) for a in args)
        return f"a list of {describe(args[0]) if args else 'values'}"
    if origin is dict or tp is dict:
        args = typing.get_args(tp)
        return "a mapping" + (f" of {describe(args[1])}" if args and args[1] is not Any else "")
    if tp is Path:
        return "a path"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(bounds_of(f).key or f.name for f in parsed_fields(tp))}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def jsonable(value: Any) -> Any:
    """A dataclass (its parsed fields), Path, tuple, dict -> JSON-ready values (what `load` reads back)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {bounds_of(f).key or f.name: jsonable(getattr(value, f.name)) for f in parsed_fields(type(value))}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def read_yaml(path: str | Path, error: type[Exception] = ConfigError) -> tuple[Any, Path]:
    """The YAML document in `path` and the directory relative paths in it resolve from; failures raise `error`."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise error(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise error(f"cannot read {path}: {exc}") from exc
    return data, path.resolve().parent


__all__ = [
    "Bounds",
    "bounds_of",
    "check",
    "convert",
    "describe",
    "expectation",
    "interval",
    "jsonable",
    "key_path",
    "load",
    "parsed_fields",
    "read_yaml",
    "setting",
]
