"""The one request contract: every sampling field a request may carry, declared once, and checked once.

Each field of `SamplingParams` is declared here with its type, default and bounds (`runtime.schema`, which checks
them when a SamplingParams is built) and its names on each wire (`Wire`); `ONE_VALUE_FIELDS` adds the fields this
server takes one value of (n, best_of, beam_width: one sequence per request). `REQUEST_FIELDS` lists them all, and
every front end derives its table from it:
  tensors  Triton inputs: model_repo.contract declares them, model_repo.request reads them, deploy.client sends them
  vllm     keys of vLLM's sampling_parameters JSON and of request parameters (`vllm_values`: model_repo.request for
           vllm_backend-shaped requests, deploy.openai_api for OpenAI's, whose sampling fields are vLLM's)
  openai   fields of an OpenAI request, per endpoint (deploy.openai_api)
  trtllm   the tensorrt_llm model's inputs under NVIDIA's tensorrtllm backend (model_repo.tensorrtllm)
A value out of its field's type or bounds raises `RequestError.invalid(field, expected, value)`, the expectation
in words made from the declaration; `sampling_params` restates it in the request's own input names, as every
front end reports it ("top_p: expected a number in (0, 1] (1 = off), got 1.5").

Imports only the standard library and runtime's schema and errors (a client imports it without torch).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime import schema
from runtime.errors import RequestError
from runtime.schema import Bounds, setting

_UINT64_MAX = 2**64 - 1
MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's top_logprobs limit)
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (temperature 0), as vLLM treats them
OPENAI_ENDPOINTS = ("completions", "chat")
_METADATA = "spectree.request"  # the dataclasses.field metadata key holding a field's request declaration


@dataclass(frozen=True)
class Wire:
    """A request field's names and forms on each wire."""

    tensors: tuple[str, ...] = ()  # Triton inputs carrying it: tensorrtllm_backend's current name first
    tensor_type: str = ""  # their Triton datatype, as clients name it (FP32, INT32, UINT64, BOOL, BYTES)
    vllm: bool = True  # a key of vLLM's sampling_parameters JSON (and of request parameters)
    openai: tuple[str, ...] = ()  # the OpenAI endpoints whose requests take it under its own name
    trtllm: str = ""  # the tensorrt_llm model's input for it (TensorRT-LLM's backend), when that model samples by it
    vllm_default: Any = None  # what a vllm_backend-shaped request that leaves it out gets (vLLM's default), if set
    spellings: tuple[tuple[Any, Any], ...] = ()  # vLLM's other spellings of a value: (as sent, as meant)
    one_or_list: bool = False  # a list field a single value may stand for (a list of one), as vLLM and OpenAI take it


@dataclass(frozen=True)
class RequestField:
    """One field of the request contract: its name (the SamplingParams field, the vLLM and OpenAI key), type,
    default and bounds, and its names on each wire."""

    name: str
    type: Any  # as runtime.schema reads it (float, int, bool, X | None, tuple[X, ...])
    default: Any
    bounds: Bounds
    doc: str
    wire: Wire = Wire()
    note: str = ""  # what a special value means ("0 = off"), said in errors
    at_most: str = ""  # another field this one may not exceed (min_tokens <= max_tokens)
    only: Any = None  # set: the one value this server takes (None, or the field left out, means the same)

    @property
    def listed(self) -> bool:
        """Whether the field is a list (a [-1] tensor on the wire)."""
        return typing.get_origin(_plain(self.type)) is tuple

    @property
    def scalar_type(self) -> type | None:
        """int, float or bool for a scalar field (what a text value is parsed as), else None."""
        tp = _plain(self.type)
        return tp if tp in (int, float, bool) else None

    def expected(self, values: Any = None) -> str:
        """What the field takes, in words; `values`: the request's other fields (a bound that is one of them)."""
        if self.bounds.what is not None:  # where the words made from the type and bounds would not say it
            return self.bounds.what
        limit = self.at_most + ("" if values is None or not self.at_most else f"={getattr(values, self.at_most)}")
        words = _words(self.type, self.bounds, limit)
        return f"{words} ({self.note})" if self.note else words

    def check(self, value: Any, values: Any = None) -> Any:
        """`value` as the field holds it (converted: an int for a float is a float, a list a tuple, a single value
        of a `one_or_list` field a tuple of one); RequestError.invalid when its type or bounds are not the field's.
        `values`: the request's other fields, for a bound that is one of them (checked before this one)."""
        given, value = value, self.listing(value)
        try:
            value = schema.convert(self.type, value, self.bounds, _Refused)
        except _Refused:
            raise RequestError.invalid(self.name, self.expected(values), given) from None
        if self.at_most and values is not None and value is not None and value > getattr(values, self.at_most):
            raise RequestError.invalid(self.name, self.expected(values), given)
        return value

    def listing(self, value: Any) -> Any:
        """A single item of a `one_or_list` field (a string for stop) as the list of one it stands for; any other
        value as it is."""
        if not self.wire.one_or_list or not isinstance(value, typing.get_args(_plain(self.type))[0]):
            return value
        return [value]

    def refuses(self, value: Any) -> bool:
        """Whether this server refuses `value` of a one-value field (n, best_of, beam_width)."""
        return self.only is not None and value is not None and value != self.only


class _Refused(Exception):
    """runtime.schema's failure inside `RequestField.check` (restated there as the field's RequestError)."""


def _plain(tp: Any) -> Any:
    """X for `X | None`, else tp."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp


def _words(tp: Any, b: Bounds, at_most: str = "") -> str:
    """A request field's type and bounds in words: "a number in (0, 1]", "None or an integer in [0, 20]", "a list of
    non-empty strings" (a Python reader's words: None, a bool); `at_most`: the upper bound is another field."""
    if _plain(tp) is not tp:
        return "None or " + _words(_plain(tp), b, at_most)
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        items = b.items or Bounds()
        plural = {int: "integers", float: "numbers", str: "strings", bool: "bools"}[item]
        plural = f"non-empty {plural}" if items.nonempty else plural
        bound = schema.interval(items)
        return f"a list of {plural} {bound}" if bound else f"a list of {plural}"
    base = {int: "an integer", float: "a finite number" if b.finite else "a number", bool: "a bool",
            str: "a non-empty string" if b.nonempty else "a string"}[tp]
    bound = f"in [{b.ge:g}, {at_most}]" if at_most else schema.interval(b)
    return f"{base} {bound}" if bound else base


def request_field(default: Any, *, doc: str, wire: Wire = Wire(), note: str = "", at_most: str = "",
                  **bounds: Any) -> Any:
    """A SamplingParams field declared in the contract: its default, bounds (`runtime.schema.setting`'s: ge, le,
    finite, items, what, ...) and wire names."""
    return setting(default, **bounds, metadata={_METADATA: dict(doc=doc, wire=wire, note=note, at_most=at_most)})


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; validated on construction (the one check of every field, the contract's:
    a bad one raises `RequestError.invalid(field, expected, value)`), never mutated afterwards."""

    temperature: float = request_field(
        0.0, ge=0, finite=True, note="0 = greedy", doc="softmax temperature; below 1e-5 greedy",
        wire=Wire(("temperature",), "FP32", openai=OPENAI_ENDPOINTS, trtllm="temperature", vllm_default=1.0))
    top_k: int = request_field(
        0, ge=0, note="0 = off", doc="sample among the k likeliest tokens",
        wire=Wire(("top_k",), "INT32", openai=OPENAI_ENDPOINTS, trtllm="runtime_top_k", spellings=((-1, 0),)))
    top_p: float = request_field(
        1.0, gt=0, le=1, note="1 = off", doc="sample among the likeliest tokens of this much probability",
        wire=Wire(("top_p",), "FP32", openai=OPENAI_ENDPOINTS, trtllm="runtime_top_p"))
    seed: int | None = request_field(
        None, ge=0, le=_UINT64_MAX, what="None or an integer in [0, 2**64 - 1]",
        doc="random seed (unset: nondeterministic)",
        # random_seed: tensorrtllm_backend's older name
        wire=Wire(("seed", "random_seed"), "UINT64", openai=OPENAI_ENDPOINTS, trtllm="seed"))
    max_tokens: int = request_field(
        64, ge=1, doc="tokens to generate at most",
        wire=Wire(("max_tokens",), "INT32", openai=OPENAI_ENDPOINTS, vllm_default=16))  # vLLM's = OpenAI's default
    stop: tuple[str, ...] = request_field(
        (), items=Bounds(nonempty=True), doc="stop strings (not included in the output)",
        wire=Wire(("stop_words",), "BYTES", openai=OPENAI_ENDPOINTS, one_or_list=True))
    stop_token_ids: tuple[int, ...] = request_field((), items=Bounds(ge=0), doc="more end tokens")
    ignore_eos: bool = request_field(False, doc="generate past the model's end tokens",
                                     wire=Wire(openai=OPENAI_ENDPOINTS))
    repetition_penalty: float = request_field(
        1.0, gt=0, finite=True, note="1 = off", doc="divides (multiplies) the logits of prompt and output tokens",
        wire=Wire(("repetition_penalty",), "FP32", openai=OPENAI_ENDPOINTS))
    presence_penalty: float = request_field(
        0.0, ge=-2, le=2, note="0 = off", doc="subtracted from the logits of output tokens",
        wire=Wire(("presence_penalty",), "FP32", openai=OPENAI_ENDPOINTS))
    frequency_penalty: float = request_field(
        0.0, ge=-2, le=2, note="0 = off", doc="subtracted per occurrence from the logits of output tokens",
        wire=Wire(("frequency_penalty",), "FP32", openai=OPENAI_ENDPOINTS))
    min_tokens: int = request_field(
        0, ge=0, at_most="max_tokens", doc="end tokens are impossible before this many tokens",
        wire=Wire(("min_tokens",), "INT32", openai=OPENAI_ENDPOINTS))
    bad_words: tuple[tuple[int, ...], ...] = request_field(
        (), items=Bounds(nonempty=True, items=Bounds(ge=0)), what="a list of non-empty token-id lists",
        doc="token-id sequences never generated (as text on the wire: encoded by the server)",
        wire=Wire(("bad_words",), "BYTES"))
    logprobs: int | None = request_field(
        None, ge=0, le=MAX_LOGPROBS, doc="None: off; k: each emitted token's log-probability and the k likeliest",
        wire=Wire(("num_top_log_probs",), "INT32"))  # OpenAI's endpoints each spell it their own way

    def __post_init__(self) -> None:
        # Normalised while the object is being built (it is frozen afterwards): tuples, floats.
        for field in SAMPLING_FIELDS:
            object.__setattr__(self, field.name, field.check(getattr(self, field.name), self))
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether any setting changes the logits before temperature (runtime.sampling's docstring)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or bool(self.bad_words))

    def new_generator(self, device: Any = "cpu") -> Any:
        """A fresh torch.Generator seeded with `seed` (or from OS entropy when seed is None)."""
        import torch

        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def _declared(f: dataclasses.Field, hints: Mapping[str, Any]) -> RequestField:
    return RequestField(name=f.name, type=hints[f.name], default=f.default, bounds=schema.bounds_of(f),
                        **f.metadata[_METADATA])


SAMPLING_FIELDS: tuple[RequestField, ...] = tuple(
    _declared(f, typing.get_type_hints(SamplingParams)) for f in dataclasses.fields(SamplingParams))
_ADVICE = "send the request again, with another seed, for more"
ONE_VALUE_FIELDS: tuple[RequestField, ...] = (
    RequestField("n", int, 1, Bounds(), "sequences returned (vLLM, OpenAI)", only=1,
                 wire=Wire(("num_return_sequences",), "INT32", openai=OPENAI_ENDPOINTS)),
    RequestField("best_of", int, 1, Bounds(), "sequences generated to return the best n of (vLLM, OpenAI)", only=1,
                 wire=Wire(openai=("completions",))),
    RequestField("beam_width", int, 1, Bounds(), "beam search's width (tensorrtllm_backend)", only=1,
                 wire=Wire(("beam_width",), "INT32", vllm=False)),
)
REQUEST_FIELDS: tuple[RequestField, ...] = SAMPLING_FIELDS + ONE_VALUE_FIELDS
FIELDS: dict[str, RequestField] = {f.name: f for f in REQUEST_FIELDS}
VLLM_KEYS: tuple[str, ...] = tuple(f.name for f in REQUEST_FIELDS if f.wire.vllm)
# What a vllm_backend-shaped request leaves out gets vLLM's SamplingParams defaults (16 tokens, temperature 1.0)
VLLM_DEFAULTS: dict[str, Any] = {f.name: f.wire.vllm_default for f in REQUEST_FIELDS
                                 if f.wire.vllm_default is not None}


def openai_fields(endpoint: str) -> tuple[RequestField, ...]:
    """The fields an OpenAI endpoint ("completions" | "chat") takes under their own names."""
    return tuple(f for f in REQUEST_FIELDS if endpoint in f.wire.openai)


def add_flags(parser: Any, names: tuple[str, ...], defaults: bool = True) -> None:
    """argparse flags --NAME for scalar request fields, typed and documented by the declaration; `defaults`: each
    the field's default (else unset, the server's)."""
    for name in names:
        field = FIELDS[name]
        flag = "--" + name.replace("_", "-")
        if field.scalar_type is bool:
            parser.add_argument(flag, action="store_true", default=field.default, help=field.doc)
        else:
            parser.add_argument(flag, type=field.scalar_type, default=field.default if defaults else None,
                                help=field.doc)


def vllm_values(data: Mapping[str, Any], source: str = "", text: bool = False) -> dict[str, Any]:
    """Values of vLLM's sampling keys (`VLLM_KEYS`; the caller refuses others) -> SamplingParams values: with `text`,
    a string is parsed by its field's type (vllm_backend's clients send every value as a string, and vllm_backend
    converts them so); a single stop string is a list of one; vLLM's spellings are mapped (top_k -1: off); the
    one-value fields (n, best_of) are refused unless 1 (or null) and left out. `source`: where the keys came from,
    for errors ("sampling_parameters", "parameters"; "": the request's own fields, OpenAI's)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        field = FIELDS[key]
        if text and isinstance(value, str) and field.scalar_type is not None:
            value = _parsed(field, value, source)
        value = field.listing(value)
        for sent, meant in field.wire.spellings:
            if type(value) is type(sent) and value == sent:
                value = meant
        if field.only is None:
            out[key] = value
            continue
        name = f"{source}.{key}" if source else key
        if value is not None:
            try:
                value = field.check(value)
            except RequestError as exc:
                raise _named(exc.restated({key: name})[1], name) from None
        if field.refuses(value):
            where = f"{source}: {key} = " if source else f"{key}: "
            raise _named(f"{where}{value!r}; this server returns one sequence per request ({_ADVICE})", name)
    return out


def _named(message: str, name: str) -> RequestError:
    """A RequestError about the request's field `name` (its `name`: what a front end reports as the field)."""
    err = RequestError(message)
    err.name = name
    return err


def _parsed(field: RequestField, value: str, source: str) -> Any:
    kind = field.scalar_type
    try:
        if kind is bool:
            if value.strip().lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.strip().lower() in ("true", "1")
        assert kind is not None
        return kind(value)
    except ValueError:
        article = "an" if kind is int else "a"
        raise RequestError(f"{source}: {field.name} = {value!r} is not {article} {kind.__name__}") from None


def sampling_params(values: Mapping[str, Any], origin: Mapping[str, str]) -> SamplingParams:
    """SamplingParams(**values), checked by the contract; its error restated in the request's own names (`origin`:
    field -> the input or key it came from): a RequestError whose `name` is that input."""
    try:
        return SamplingParams(**values)
    except RequestError as exc:
        if exc.field is None:
            raise
        raise _named(*reversed(exc.restated(origin))) from exc


__all__ = [
    "FIELDS",
    "GREEDY_BELOW",
    "MAX_LOGPROBS",
    "ONE_VALUE_FIELDS",
    "OPENAI_ENDPOINTS",
    "REQUEST_FIELDS",
    "RequestField",
    "SAMPLING_FIELDS",
    "SamplingParams",
    "VLLM_DEFAULTS",
    "VLLM_KEYS",
    "Wire",
    "add_flags",
    "openai_fields",
    "request_field",
    "sampling_params",
    "vllm_values",
]
