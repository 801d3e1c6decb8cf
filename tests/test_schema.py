"""runtime.schema, the one typed config layer: mappings -> frozen dataclasses, bounds declared on the fields, errors
naming the source, the key path, the value and what was expected, raised as the caller's own error type."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from runtime import schema
from runtime.errors import ConfigError, SpectreeError
from runtime.schema import check, load, setting


class MyError(ConfigError):
    """A caller's own error type: load and check raise it, not ConfigError."""


class RuntimeOptionError(SpectreeError, ValueError):
    """Another type's error, raised by a nested dataclass's own checks."""


@dataclass(frozen=True)
class Inner:
    top_k: int = setting(10, ge=1)
    ratio: float = setting(0.5, gt=0.0, le=1.0)
    mode: Literal["greedy", "sampled"] = "greedy"


@dataclass(frozen=True)
class Foreign:
    """A dataclass that checks itself with another error type (like runtime's drafter options)."""

    n: int = 1

    def __post_init__(self) -> None:
        if self.n > 5:
            raise RuntimeOptionError(f"option n must be at most 5, got {self.n}")


@dataclass(frozen=True)
class Outer:
    name: str = setting(nonempty=True)  # required
    path: Path | None = None
    sizes: tuple[int, ...] = ()
    pair: tuple[int, str] | None = None
    choices: tuple[tuple[int, ...], ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)
    maybe: Inner | None = None
    foreign: Foreign | None = None
    device: str = setting("cpu", choices=("cpu", "cuda"))
    flag: bool = False
    label: str = setting("ab", pattern="[a-z]+", what="lowercase letters")
    count: int | None = setting(None, ge=0, lt=10)
    origin: str = setting("config", parsed=False)

    def __post_init__(self) -> None:
        check(self, MyError)
        if self.maybe is not None and self.maybe.top_k > self.inner.top_k:  # a cross-field rule stays hand-written
            raise MyError(f"maybe.top_k: got {self.maybe.top_k}, expected at most inner.top_k {self.inner.top_k}")


@dataclass(frozen=True)
class Aliased:
    preprocessing: str = setting(key="preprocessing_model")
    max_in_flight: int = setting(ge=1)


def fails(data: Any, cls: type = Outer, **kwargs: Any) -> str:
    with pytest.raises(MyError) as info:
        load(cls, data, MyError, source="x.yaml", **kwargs)
    return str(info.value)


def test_nested_literal_tuple_path_dict_and_defaults(tmp_path):
    out = load(Outer, {"name": "n", "path": "sub/f", "sizes": [1, 2], "pair": [3, "x"], "choices": [[0], [0, 1]],
                       "options": {"a": [1]}, "inner": {"top_k": 3, "ratio": 1, "mode": "sampled"}, "flag": True},
               MyError, base_dir=tmp_path)
    assert out.path == (tmp_path / "sub" / "f").resolve()
    assert out.sizes == (1, 2) and out.pair == (3, "x") and out.choices == ((0,), (0, 1))
    assert out.options == {"a": [1]}
    assert out.inner == Inner(top_k=3, ratio=1.0, mode="sampled") and isinstance(out.inner.ratio, float)
    assert out.flag is True and out.device == "cpu" and out.maybe is None and out.origin == "config"
    assert load(Outer, {"name": "n", "path": "rel"}, MyError).path == Path("rel")  # no base_dir: kept as given
    assert schema.jsonable(out)["inner"] == {"top_k": 3, "ratio": 1.0, "mode": "sampled"}
    assert "origin" not in schema.jsonable(out)  # parsed=False fields are not the source's


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"name": "n", "inner": {"top_k": 0}}, "x.yaml: inner.top_k: got 0, expected an integer >= 1"),
        ({"name": "n", "inner": {"top_k": True}}, "x.yaml: inner.top_k: got True, expected an integer"),
        ({"name": "n", "inner": {"top_k": "3"}}, "x.yaml: inner.top_k: got '3', expected an integer"),
        ({"name": "n", "inner": {"ratio": 0}}, "x.yaml: inner.ratio: got 0.0, expected a number in (0, 1]"),
        ({"name": "n", "inner": {"ratio": 1.5}}, "inner.ratio: got 1.5, expected a number in (0, 1]"),
        ({"name": "n", "inner": {"ratio": math.nan}}, "inner.ratio: got nan, expected a number in (0, 1]"),
        ({"name": "n", "inner": {"mode": "beam"}}, "inner.mode: got 'beam', expected one of 'greedy', 'sampled'"),
        ({"name": "n", "inner": {"topk": 3}}, "x.yaml: inner.topk: unknown key (value 3); expected one of top_k, "
                                              "ratio, mode"),
        ({"name": "n", "inner": [1]}, "inner: got [1], expected a mapping with keys top_k, ratio, mode"),
        ({"name": "n", "maybe": {"top_k": 0}}, "maybe.top_k: got 0, expected an integer >= 1"),
        ({"name": "n", "choices": [[0], [0, "a"]]}, "x.yaml: choices[1][1]: got 'a', expected an integer"),
        ({"name": "n", "sizes": 3}, "sizes: got 3, expected a list of an integer"),
        ({"name": "n", "pair": [1]}, "pair: got [1], expected a list of 2: an integer, a string"),
        ({"name": "n", "options": [1]}, "options: got [1], expected a mapping"),
        ({"name": "n", "path": ""}, "path: got '', expected a path (string)"),
        ({"name": "n", "device": "tpu"}, "device: got 'tpu', expected one of 'cpu', 'cuda'"),
        ({"name": "n", "flag": "yes"}, "flag: got 'yes', expected true or false"),
        ({"name": "n", "label": "AB"}, "label: got 'AB', expected lowercase letters"),
        ({"name": "n", "count": 10}, "count: got 10, expected an integer in [0, 10)"),
        ({"name": "n", "count": -1}, "count: got -1, expected an integer in [0, 10)"),
        ({"name": ""}, "x.yaml: name: got '', expected a non-empty string"),
        ({"name": "n", "origin": "y"}, "x.yaml: origin: unknown key (value 'y')"),
        ({}, "x.yaml: name: missing (required)"),
        ([1], "x.yaml: <top level>: got [1], expected a mapping with keys name, path"),
        # the dataclass's own cross-field rule: its message, prefixed with the source
        ({"name": "n", "inner": {"top_k": 2}, "maybe": {"top_k": 3}},
         "x.yaml: maybe.top_k: got 3, expected at most inner.top_k 2"),
        # another type's error from a nested dataclass: re-raised as MyError, naming that dataclass's key path
        ({"name": "n", "foreign": {"n": 6}}, "x.yaml: foreign: option n must be at most 5, got 6"),
    ],
)
def test_errors_name_source_key_path_value_and_expectation(data, expected):
    assert expected in fails(data)


def test_errors_nest_under_the_given_path():
    assert fails({"top_k": 0}, Inner, path="draft.tree.dynamic") == (
        "x.yaml: draft.tree.dynamic.top_k: got 0, expected an integer >= 1")
    with pytest.raises(ConfigError, match=r"^top_k: got 0, expected an integer >= 1$"):  # the default error type
        load(Inner, {"top_k": 0})


def test_string_mode_parses_text_with_the_same_errors():
    params = {"name": "n", "sizes": "[1, 2]", "options": '{"draft": "lookup"}', "inner": '{"top_k": 4}',
              "flag": "true", "count": "7", "device": "cuda"}
    out = load(Outer, params, MyError, strings=True)
    assert out.sizes == (1, 2) and out.options == {"draft": "lookup"} and out.inner.top_k == 4
    assert out.flag is True and out.count == 7 and out.device == "cuda"
    assert load(Inner, {"ratio": "0.25", "mode": "sampled"}, MyError, strings=True).ratio == 0.25
    assert fails({"name": "n", "count": "seven"}, strings=True) == (
        "x.yaml: count: got 'seven', expected an integer")
    assert fails({"name": "n", "count": "12"}, strings=True) == "x.yaml: count: got 12, expected an integer in [0, 10)"
    assert fails({"name": "n", "flag": "yes"}, strings=True) == "x.yaml: flag: got 'yes', expected true or false"
    assert "x.yaml: sizes: got '[1,', expected a list of an integer as JSON text" in fails(
        {"name": "n", "sizes": "[1,"}, strings=True)
    # JSON text is typed: inside it a string is not parsed again
    assert fails({"name": "n", "sizes": '["1"]'}, strings=True) == "x.yaml: sizes[0]: got '1', expected an integer"
    assert fails({"name": "n", "inner": '{"top_k": 0}'}, strings=True) == (
        "x.yaml: inner.top_k: got 0, expected an integer >= 1")
    # outside string mode a string is never a number
    assert fails({"name": "n", "count": "7"}) == "x.yaml: count: got '7', expected an integer"


def test_keys_other_than_field_names():
    assert load(Aliased, {"preprocessing_model": "p", "max_in_flight": "3"}, MyError, strings=True) == (
        Aliased(preprocessing="p", max_in_flight=3))
    assert fails({"preprocessing": "p", "max_in_flight": "3"}, Aliased, strings=True).startswith(
        "x.yaml: preprocessing: unknown key (value 'p'); expected one of preprocessing_model, max_in_flight")
    assert fails({"preprocessing_model": "p"}, Aliased) == "x.yaml: max_in_flight: missing (required)"


def test_check_holds_a_directly_built_instance_to_the_declared_bounds():
    assert Outer(name="n", count=3).count == 3
    for kwargs, message in (
        ({"name": ""}, "name: got '', expected a non-empty string"),
        ({"name": "n", "count": 10}, "count: got 10, expected an integer in [0, 10)"),
        ({"name": "n", "count": True}, "count: got True, expected an integer"),
        ({"name": "n", "device": "tpu"}, "device: got 'tpu', expected one of 'cpu', 'cuda'"),
        ({"name": "n", "origin": 3}, "origin: got 3, expected a string"),
    ):
        with pytest.raises(MyError) as info:
            Outer(**kwargs)
        assert str(info.value) == message
    # Inner has no __post_init__: an instance out of bounds can be built, and check() names it under a prefix
    with pytest.raises(MyError, match=r"^inner\.top_k: got 0, expected an integer >= 1$"):
        check(Inner(top_k=0), MyError, "inner")


def test_unsupported_field_types_are_a_programming_error():
    @dataclass(frozen=True)
    class Bad:
        x: set

    with pytest.raises(TypeError, match="unsupported config field type"):
        load(Bad, {"x": [1]})


def test_read_yaml_raises_the_callers_error(tmp_path):
    with pytest.raises(MyError, match="does not exist"):
        schema.read_yaml(tmp_path / "missing.yaml", MyError)
    (tmp_path / "bad.yaml").write_text("a: [1\n", encoding="utf-8")
    with pytest.raises(MyError, match="cannot read"):
        schema.read_yaml(tmp_path / "bad.yaml", MyError)
    (tmp_path / "ok.yaml").write_text("name: n\ninner: {top_k: 2}\n", encoding="utf-8")
    data, base = schema.read_yaml(tmp_path / "ok.yaml", MyError)
    assert load(Outer, data, MyError, base_dir=base).inner.top_k == 2 and base == tmp_path.resolve()
