"""Request handling for the served pipeline, with no Triton import (the BLS pattern of tensorrtllm_backend:
`model_repo.triton_adapter` is the one module that talks to triton_python_backend_utils; everything it does
with a request lives here and is tested without a server).

The request interface follows the Triton LLM conventions of tensorrtllm_backend / vllm_backend
(reference-facts section 8), so their clients work unchanged:

    inputs   text_input STRING [1] or messages STRING [1] (a JSON array of {role, content}, OpenAI chat form,
             rendered by the model's chat template; exactly one of the two), max_tokens INT32 [1] (required);
             optional stream BOOL, temperature FP32,
             top_k INT32, top_p FP32, random_seed UINT64, stop_words / bad_words STRING [-1], end_id INT32,
             exclude_input_in_output BOOL, sampling_parameters STRING (vLLM-style JSON)
    outputs  text_output STRING [-1]: the DELTA text of each streamed response (the whole text when not
             streaming); optional output_ids INT32 [-1] (the delta's token ids) and, on the final response,
             finish_reason, verification (the lossless verification mode this request ran: "greedy" at
             temperature 0, "rejection_sampling/<proposal>" otherwise), tau and accepted_per_step.

Deltas come straight from `SpecDecoder.stream` (its incremental detokenizer and stop-string hold-back), so the
served text is exactly the offline runtime's, and the deltas concatenate to the full text.
"""

from __future__ import annotations

import enum
import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from model_repo.schema import DataType, ModelInput, ModelOutput
from runtime.errors import ConfigError, RequestError, SpectreeError
from runtime.sampling import SamplingParams
from runtime.tokenizer import ChatMessage, chat_messages

# ---- the interface --------------------------------------------------------------------------------------

# Every input is declared optional, text_input and max_tokens included, and the models enforce what is
# required with an error naming the input. Measured on tritonserver 2.51: the gRPC streaming path does not
# check required inputs, and an ensemble missing a required input ends with an empty final response and no
# error at all, so a config-level `optional: false` would turn a bad request into a silent empty answer.
TEXT_INPUT = ModelInput("text_input", DataType.TYPE_STRING, (1,), optional=True)
MESSAGES = ModelInput("messages", DataType.TYPE_STRING, (1,), optional=True)  # JSON [{"role", "content"}, ...]
INPUT_IDS = ModelInput("input_ids", DataType.TYPE_INT32, (-1,), optional=True)
MAX_TOKENS = ModelInput("max_tokens", DataType.TYPE_INT32, (1,), optional=True)
OPTIONAL_INPUTS: tuple[ModelInput, ...] = (
    ModelInput("stream", DataType.TYPE_BOOL, (1,), optional=True),
    ModelInput("temperature", DataType.TYPE_FP32, (1,), optional=True),
    ModelInput("top_k", DataType.TYPE_INT32, (1,), optional=True),
    ModelInput("top_p", DataType.TYPE_FP32, (1,), optional=True),
    ModelInput("random_seed", DataType.TYPE_UINT64, (1,), optional=True),
    ModelInput("stop_words", DataType.TYPE_STRING, (-1,), optional=True),
    ModelInput("bad_words", DataType.TYPE_STRING, (-1,), optional=True),
    ModelInput("end_id", DataType.TYPE_INT32, (1,), optional=True),
    ModelInput("exclude_input_in_output", DataType.TYPE_BOOL, (1,), optional=True),
    ModelInput("sampling_parameters", DataType.TYPE_STRING, (1,), optional=True),
)
# What the ensemble takes from clients.
ENSEMBLE_INPUTS: tuple[ModelInput, ...] = (TEXT_INPUT, MAX_TOKENS, MESSAGES, *OPTIONAL_INPUTS)
# spec_decode takes the prompt as text or messages, as token ids (from the preprocessing stage), or ids with the
# text or messages they came from (ids are decoded; text is only echoed when exclude_input_in_output is false).
SPEC_DECODE_INPUTS: tuple[ModelInput, ...] = (TEXT_INPUT, INPUT_IDS, MAX_TOKENS, MESSAGES, *OPTIONAL_INPUTS)
PREPROCESSING_INPUTS: tuple[ModelInput, ...] = (TEXT_INPUT, MESSAGES)
PREPROCESSING_OUTPUTS: tuple[ModelOutput, ...] = (
    ModelOutput("input_ids", DataType.TYPE_INT32, (-1,)),
    ModelOutput("input_length", DataType.TYPE_INT32, (1,)),
)
TEXT_OUTPUT = ModelOutput("text_output", DataType.TYPE_STRING, (-1,))
SPEC_DECODE_OUTPUTS: tuple[ModelOutput, ...] = (
    TEXT_OUTPUT,
    ModelOutput("output_ids", DataType.TYPE_INT32, (-1,)),
    ModelOutput("finish_reason", DataType.TYPE_STRING, (1,)),  # final response only
    ModelOutput("verification", DataType.TYPE_STRING, (1,)),  # final response only
    ModelOutput("tau", DataType.TYPE_FP32, (1,)),  # final response only
    ModelOutput("accepted_per_step", DataType.TYPE_INT32, (-1,)),  # final response only
)

# The verification stage as recorded in spec_decode's config.pbtxt: the rule runtime.verify applies.
VERIFICATION_GREEDY = "greedy"  # temperature == 0: longest draft path equal to the target's argmax
VERIFICATION_SAMPLED = "rejection_sampling"  # temperature > 0: lossless tree rejection sampling

_NUMPY = {
    DataType.TYPE_BOOL: np.dtype(np.bool_),
    DataType.TYPE_INT32: np.dtype(np.int32),
    DataType.TYPE_UINT64: np.dtype(np.uint64),
    DataType.TYPE_FP32: np.dtype(np.float32),
    DataType.TYPE_STRING: np.dtype(np.object_),
}


class InputError(RequestError):
    """A request input is missing, malformed or out of range; the message names the input."""


class SettingsError(ConfigError):
    """A model's config.pbtxt parameters are missing, unknown or malformed."""


class SlotsFullError(SpectreeError, RuntimeError):
    """Every generation slot of the model instance is busy."""


class RequestCancelled(SpectreeError, RuntimeError):
    """The client cancelled the request (or the model is shutting down)."""


class ErrorCode(enum.Enum):
    """Triton error codes (pb_utils.TritonError.<name>) this pipeline returns."""

    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"


def error_code(exc: BaseException) -> ErrorCode:
    """The Triton error code for an exception raised while serving a request."""
    if isinstance(exc, RequestError):  # bad prompt / sampling parameters / limits
        return ErrorCode.INVALID_ARG
    if isinstance(exc, SlotsFullError):
        return ErrorCode.UNAVAILABLE
    if isinstance(exc, RequestCancelled):
        return ErrorCode.CANCELLED
    return ErrorCode.INTERNAL


def error_message(exc: BaseException) -> str:
    """What the client reads: our own errors as they are, anything else with its type (an internal bug)."""
    if isinstance(exc, SpectreeError):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"


# ---- reading inputs -------------------------------------------------------------------------------------

Inputs = Mapping[str, np.ndarray]


def _array(inputs: Inputs, spec: ModelInput) -> np.ndarray | None:
    value = inputs.get(spec.name)
    if value is None:
        return None
    arr = np.asarray(value)
    expected = _NUMPY[spec.data_type]
    ok = arr.dtype == expected or (spec.data_type is DataType.TYPE_STRING and arr.dtype.kind in ("S", "U", "O"))
    if not ok:
        raise InputError(f"{spec.name}: expected {spec.data_type.wire} ({spec.data_type.name}), got numpy {arr.dtype}")
    return arr


def _scalar(inputs: Inputs, spec: ModelInput) -> Any:
    arr = _array(inputs, spec)
    if arr is None:
        return None
    if arr.size != 1:
        raise InputError(f"{spec.name}: expected exactly one value (shape [1]), got shape {list(arr.shape)}")
    value = arr.reshape(-1)[0]
    if spec.data_type is DataType.TYPE_STRING:
        return _text(value, spec.name)
    return value.item()


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{name}: not valid UTF-8 ({exc})") from exc
    if isinstance(value, str):
        return value
    raise InputError(f"{name}: expected text (bytes), got {type(value).__name__}")


def _texts(inputs: Inputs, spec: ModelInput) -> tuple[str, ...]:
    arr = _array(inputs, spec)
    if arr is None:
        return ()
    return tuple(_text(v, spec.name) for v in arr.reshape(-1))


_SPEC = {s.name: s for s in SPEC_DECODE_INPUTS}


def _messages(inputs: Inputs) -> tuple[ChatMessage, ...] | None:
    """The messages input: JSON text of [{"role": ..., "content": ...}, ...], validated by the runtime's
    `chat_messages` (errors name the index, key and value)."""
    raw = _scalar(inputs, MESSAGES)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InputError(f"messages: not valid JSON ({exc}); expected a JSON array of {{role, content}}") from exc
    try:
        return chat_messages(data, MESSAGES.name)
    except RequestError as exc:
        raise InputError(str(exc)) from exc


def _text_or_messages(inputs: Inputs, ids_given: bool = False) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
    """(text_input, messages): exactly one of them, or neither when the prompt came as input_ids."""
    text = _scalar(inputs, TEXT_INPUT)
    messages = _messages(inputs)
    if text is not None and messages is not None:
        raise InputError("text_input and messages: both given; give exactly one (text_input: the prompt text, "
                         "messages: a JSON array of {role, content})")
    if text is None and messages is None and not ids_given:
        raise InputError("text_input: missing; expected the prompt text (STRING [1]), or messages (a JSON array of "
                         "{role, content})")
    if text is not None and not text and not ids_given:
        raise InputError("text_input: empty; expected a non-empty prompt")
    return text, messages


@dataclass(frozen=True)
class RequestLimits:
    """Server-side limits on a request (from the model config)."""

    max_tokens: int  # the largest max_tokens a request may ask for
    vocab_size: int  # end_id / input_ids must be below this

    def __post_init__(self) -> None:
        for name in ("max_tokens", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SettingsError(f"RequestLimits.{name} must be an int >= 1, got {v!r}")


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | tuple[int, ...] | tuple[ChatMessage, ...]  # what the decoder encodes (text, messages) or takes
    prompt_source: str  # the input the prompt came from: "text_input" | "messages" | "input_ids"
    echo: str  # text put before the first delta ("" unless exclude_input_in_output is false)
    params: SamplingParams
    stream: bool


# sampling_parameters (vLLM's JSON) keys -> SamplingParams fields; a key may not repeat a tensor input.
_JSON_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "max_tokens": "max_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}
_TENSOR_FOR_FIELD = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "random_seed",
                     "max_tokens": "max_tokens", "stop": "stop_words"}


def _sampling_json(text: str) -> dict[str, Any]:
    name = "sampling_parameters"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{name}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise InputError(f"{name}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_JSON_KEYS))
    if unknown:
        raise InputError(f"{name}: unknown key(s) {unknown}; accepted: {sorted(_JSON_KEYS)}")
    out = {_JSON_KEYS[k]: v for k, v in data.items()}
    if out.get("top_k") == -1:  # vLLM spells "top-k off" as -1
        out["top_k"] = 0
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


def parse_generate_request(inputs: Inputs, limits: RequestLimits) -> GenerateRequest:
    """Triton-style inputs (name -> numpy array) -> a validated GenerateRequest; InputError names the input."""
    unknown = sorted(set(inputs) - set(_SPEC))
    if unknown:
        raise InputError(f"unknown input(s) {unknown}; this model takes {sorted(_SPEC)}")
    ids_arr = _array(inputs, _SPEC["input_ids"])
    text, messages = _text_or_messages(inputs, ids_given=ids_arr is not None)
    prompt: str | tuple[int, ...] | tuple[ChatMessage, ...]
    if ids_arr is not None:
        if ids_arr.size == 0:
            raise InputError("input_ids: empty; expected at least one token id")
        ids = tuple(int(t) for t in ids_arr.reshape(-1))
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InputError(f"input_ids: token ids must be in [0, {limits.vocab_size}), got {bad[:5]}")
        prompt, source = ids, "input_ids"
    elif messages is not None:
        prompt, source = messages, "messages"
    else:
        prompt, source = text, "text_input"

    fields: dict[str, Any] = {}
    max_tokens = _scalar(inputs, _SPEC["max_tokens"])
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    for name, key in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("random_seed", "seed")):
        value = _scalar(inputs, _SPEC[name])
        if value is not None:
            fields[key] = value
    stop = tuple(s for s in _texts(inputs, _SPEC["stop_words"]) if s)  # empty entries are padding, as in trtllm
    if stop:
        fields["stop"] = stop
    bad_words = tuple(s for s in _texts(inputs, _SPEC["bad_words"]) if s)
    if bad_words:
        raise InputError(f"bad_words: not supported by this server (got {list(bad_words)[:3]}); send an empty list")
    end_id = _scalar(inputs, _SPEC["end_id"])
    if end_id is not None:
        if not 0 <= end_id < limits.vocab_size:
            raise InputError(f"end_id: expected a token id in [0, {limits.vocab_size}), got {end_id}")
        # end_id replaces the model's EOS tokens (tensorrtllm_backend's meaning).
        fields["stop_token_ids"] = (end_id,)
        fields["ignore_eos"] = True
    sp_text = _scalar(inputs, _SPEC["sampling_parameters"])
    if sp_text is not None and sp_text.strip():
        for key, value in _sampling_json(sp_text).items():
            if key in fields:
                tensor = _TENSOR_FOR_FIELD.get(key, "end_id")
                raise InputError(f"sampling_parameters: {key!r} is also given as the input {tensor!r}; give it once")
            fields[key] = value

    if "max_tokens" not in fields:
        raise InputError("max_tokens: missing; expected INT32 [1] (or max_tokens in sampling_parameters)")
    mt = fields["max_tokens"]
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise InputError(f"max_tokens: expected an integer >= 1, got {mt!r}")
    if mt > limits.max_tokens:
        raise InputError(f"max_tokens: {mt} is above this server's limit of {limits.max_tokens}")
    t = fields.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
        raise InputError(f"temperature: expected a finite number >= 0 (0 = greedy), got {t!r}")
    p = fields.get("top_p")
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0):
        raise InputError(f"top_p: expected a number in (0, 1] (1 = off), got {p!r}")
    k = fields.get("top_k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise InputError(f"top_k: expected an integer >= 0 (0 = off), got {k!r}")
    try:
        params = SamplingParams(**fields)
    except RequestError as exc:  # anything not caught above (stop / stop_token_ids / seed from the JSON)
        raise InputError(str(exc)) from exc

    stream = _scalar(inputs, _SPEC["stream"])
    stream = bool(stream) if stream is not None else False
    exclude = _scalar(inputs, _SPEC["exclude_input_in_output"])
    # Default as tensorrtllm_backend: a streamed response never repeats the prompt, a whole one includes it
    # (when there is prompt text to repeat: a request of token ids or messages gets the generated text only).
    exclude = (stream or text is None) if exclude is None else bool(exclude)
    echo = ""
    if not exclude:
        if text is None:
            raise InputError("exclude_input_in_output: false needs text_input (the prompt text to echo); a "
                             "prompt of input_ids alone or of messages has no text to echo")
        echo = text
    return GenerateRequest(prompt=prompt, prompt_source=source, echo=echo, params=params, stream=stream)


# ---- preprocessing (the tokenizer stage) ----------------------------------------------------------------


def preprocess(inputs: Inputs, tokenizer: Any, max_context: int) -> dict[str, np.ndarray]:
    """text_input or messages -> input_ids INT32 [n], input_length INT32 [1]; the same ids
    `SpecDecoder.encode_prompt` makes of the text (BOS first when the model has one) or of the messages (the chat
    template's text)."""
    unknown = sorted(set(inputs) - {i.name for i in PREPROCESSING_INPUTS})
    if unknown:
        raise InputError(f"unknown input(s) {unknown}; preprocessing takes {[i.name for i in PREPROCESSING_INPUTS]}")
    text, messages = _text_or_messages(inputs)
    if messages is not None:
        source = MESSAGES.name
        try:
            ids = tokenizer.apply_chat_template(messages)
        except RequestError as exc:  # no chat template, or the template refused the conversation
            raise InputError(f"messages: {exc}") from exc
    else:
        source = TEXT_INPUT.name
        ids = tokenizer.encode(text)
    if len(ids) >= max_context:
        raise InputError(
            f"{source}: the prompt is {len(ids)} tokens; the context limit is {max_context} tokens, so a prompt "
            f"may have at most {max_context - 1}"
        )
    return {
        "input_ids": np.asarray(ids, dtype=np.int32),
        "input_length": np.asarray([len(ids)], dtype=np.int32),
    }


# ---- responses ------------------------------------------------------------------------------------------


def _string_tensor(s: str) -> np.ndarray:
    return np.asarray([s.encode("utf-8")], dtype=np.object_)


def response_tensors(text: str, token_ids: Sequence[int], final: Any = None) -> dict[str, np.ndarray]:
    """Outputs of one response; `final` is the last GenerationDelta (adds finish_reason and the stats)."""
    out = {
        "text_output": _string_tensor(text),
        "output_ids": np.asarray(token_ids, dtype=np.int32),
    }
    if final is not None:
        stats = final.stats
        out["finish_reason"] = _string_tensor(final.finish_reason)
        out["verification"] = _string_tensor(stats.verification)
        out["tau"] = np.asarray([stats.tau], dtype=np.float32)
        out["accepted_per_step"] = np.asarray(stats.accepted_per_step, dtype=np.int32)
    return out


class ResponseSink(Protocol):
    """Where a generation's responses go (a Triton response sender in the server, a list in tests)."""

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...

    def is_cancelled(self) -> bool: ...


def run_generation(decoder: Any, request: GenerateRequest, sink: ResponseSink) -> Any:
    """Run one request through `decoder.stream`, sending deltas (stream) or one whole response.

    Cancellation is checked after every step; a cancelled request stops drafting at once (the stream is closed,
    which releases its KV cache) and raises RequestCancelled. Returns the final GenerationDelta (its stats).
    """
    try:
        deltas = decoder.stream(request.prompt, request.params)
    except RequestError as exc:  # the prompt is validated eagerly (too long for the context, bad ids)
        raise InputError(f"{request.prompt_source}: {exc}") from exc
    pending_text: list[str] = [request.echo]
    pending_ids: list[int] = []
    try:
        for delta in deltas:
            if sink.is_cancelled():
                raise RequestCancelled("the request was cancelled")
            pending_text.append(delta.text)
            pending_ids.extend(delta.token_ids)
            if request.stream or delta.finished:
                final = delta if delta.finished else None
                sink.send(response_tensors("".join(pending_text), pending_ids, final), final=delta.finished)
                pending_text, pending_ids = [], []
            if delta.finished:
                return delta
    finally:
        deltas.close()
    raise RuntimeError("the decoder's stream ended without a final delta")


# ---- generation slots -----------------------------------------------------------------------------------


class Slots:
    """A fixed number of concurrent generations per model instance; `acquire` never waits.

    on_change(active) runs under the lock after every change, so observers (the active-requests gauge) see the
    changes in order.
    """

    def __init__(self, capacity: int, on_change: Callable[[int], None] | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise SettingsError(f"max_concurrent_requests must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._active = 0
        self._lock = threading.Lock()
        self._on_change = on_change

    @property
    def active(self) -> int:
        return self._active

    def acquire(self) -> None:
        with self._lock:
            if self._active >= self.capacity:
                raise SlotsFullError(
                    f"all {self.capacity} generation slots are busy (max_concurrent_requests); retry later"
                )
            self._active += 1
            if self._on_change is not None:
                self._on_change(self._active)

    def release(self) -> None:
        with self._lock:
            if self._active <= 0:
                raise RuntimeError("Slots.release without a matching acquire")
            self._active -= 1
            if self._on_change is not None:
                self._on_change(self._active)


# ---- metrics --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None  # histograms only


REQUESTS = MetricSpec("spectree_requests_total", "counter",
                      "Generation requests finished, by outcome (completed, invalid, busy, cancelled, error)",
                      ("model", "outcome"))
GENERATED = MetricSpec("spectree_generated_tokens_total", "counter", "Tokens generated", ("model",))
STEPS = MetricSpec("spectree_verify_steps_total", "counter",
                   "Verification steps (target forwards over a draft tree), by verification mode",
                   ("model", "verification"))
DRAFTED = MetricSpec("spectree_drafted_tokens_total", "counter", "Draft tokens fed to the target (roots excluded)",
                     ("model", "verification"))
ACCEPTED = MetricSpec("spectree_accepted_tokens_total", "counter", "Draft tokens accepted by verification",
                      ("model", "verification"))
ACCEPTED_PER_STEP = MetricSpec("spectree_accepted_tokens_per_step", "histogram",
                               "Draft tokens accepted per verification step",
                               ("model", "verification"), (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 32, 64))
TAU = MetricSpec("spectree_tau", "histogram", "Tokens emitted per verification step, per request (tau)",
                 ("model", "verification"), (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0))
ACTIVE = MetricSpec("spectree_active_requests", "gauge", "Generations running now, per model instance",
                    ("model", "instance"))
CAPACITY = MetricSpec("spectree_generation_slots", "gauge", "Concurrent generations allowed, per model instance",
                      ("model", "instance"))
METRICS: tuple[MetricSpec, ...] = (REQUESTS, GENERATED, STEPS, DRAFTED, ACCEPTED, ACCEPTED_PER_STEP, TAU, ACTIVE,
                                   CAPACITY)

OUTCOMES = ("completed", "invalid", "busy", "cancelled", "error")


def outcome_of(exc: BaseException | None) -> str:
    if exc is None:
        return "completed"
    return {ErrorCode.INVALID_ARG: "invalid", ErrorCode.UNAVAILABLE: "busy",
            ErrorCode.CANCELLED: "cancelled"}.get(error_code(exc), "error")


class MetricsBackend(Protocol):
    def add(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...


@dataclass
class SpecMetrics:
    """Turns request events into metric updates (Prometheus, on Triton's metrics port, in the server)."""

    backend: MetricsBackend
    model: str
    instance: str  # Triton's model instance name (gauges are per instance; counters add up across instances)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def capacity(self, slots: int) -> None:
        self.backend.set(CAPACITY, {"model": self.model, "instance": self.instance}, slots)

    def active(self, n: int) -> None:
        self.backend.set(ACTIVE, {"model": self.model, "instance": self.instance}, n)

    def finished(self, exc: BaseException | None, final: Any = None) -> None:
        """One request ended (exc None: completed; final: its last GenerationDelta when it got that far)."""
        with self._lock:
            self.backend.add(REQUESTS, {"model": self.model, "outcome": outcome_of(exc)}, 1)
            if final is None or final.stats is None:
                return
            stats = final.stats
            self.backend.add(GENERATED, {"model": self.model}, stats.generated_tokens)
            if stats.steps == 0:
                return
            mode = VERIFICATION_GREEDY if stats.verification == "greedy" else VERIFICATION_SAMPLED
            labels = {"model": self.model, "verification": mode}
            self.backend.add(STEPS, labels, stats.steps)
            self.backend.add(DRAFTED, labels, stats.drafted_tokens)
            self.backend.add(ACCEPTED, labels, stats.accepted_tokens)
            for n in stats.accepted_per_step:
                self.backend.observe(ACCEPTED_PER_STEP, labels, n)
            self.backend.observe(TAU, labels, stats.tau)


# ---- model settings (config.pbtxt parameters) -----------------------------------------------------------


def _check_keys(params: Mapping[str, str], keys: tuple[str, ...], model: str) -> None:
    missing = sorted(set(keys) - set(params))
    unknown = sorted(set(params) - set(keys))
    if missing or unknown:
        raise SettingsError(f"{model} config parameters: missing {missing}, unknown {unknown}; expected {list(keys)}")


def _int_param(params: Mapping[str, str], key: str, minimum: int, model: str) -> int:
    raw = params[key]
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{model} config parameter {key}: expected an integer, got {raw!r}") from None
    if value < minimum:
        raise SettingsError(f"{model} config parameter {key}: expected an integer >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class SpecDecodeSettings:
    """spec_decode's config.pbtxt parameters, parsed (every key required, unknown keys rejected)."""

    engine_dir: str
    load_options: dict[str, Any]  # keyword arguments of runtime.load (JSON in the config)
    max_concurrent_requests: int
    max_tokens_limit: int
    torch_threads: int  # 0: torch's default
    device: str  # "cpu" | "cuda"

    KEYS = ("engine_dir", "load_options", "max_concurrent_requests", "max_tokens_limit", "torch_threads", "device",
            "verification_at_temperature_0", "verification_above_temperature_0")

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], model: str = "spec_decode") -> SpecDecodeSettings:
        _check_keys(params, cls.KEYS, model)
        for key, expected in (("verification_at_temperature_0", VERIFICATION_GREEDY),
                              ("verification_above_temperature_0", VERIFICATION_SAMPLED)):
            if params[key] != expected:
                raise SettingsError(f"{model} config parameter {key}: runtime.verify implements {expected!r}, "
                                 f"got {params[key]!r}")
        try:
            options = json.loads(params["load_options"])
        except json.JSONDecodeError as exc:
            raise SettingsError(f"{model} config parameter load_options: not valid JSON ({exc})") from exc
        if not isinstance(options, dict):
            raise SettingsError(f"{model} config parameter load_options: expected a JSON object")
        if params["device"] not in ("cpu", "cuda"):
            raise SettingsError(f"{model} config parameter device: expected cpu or cuda, got {params['device']!r}")
        return cls(
            engine_dir=params["engine_dir"],
            load_options=options,
            max_concurrent_requests=_int_param(params, "max_concurrent_requests", 1, model),
            max_tokens_limit=_int_param(params, "max_tokens_limit", 1, model),
            torch_threads=_int_param(params, "torch_threads", 0, model),
            device=params["device"],
        )


@dataclass(frozen=True)
class PreprocessingSettings:
    engine_dir: str
    max_context: int

    KEYS = ("engine_dir", "max_context")

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], model: str = "preprocessing") -> PreprocessingSettings:
        _check_keys(params, cls.KEYS, model)
        return cls(engine_dir=params["engine_dir"], max_context=_int_param(params, "max_context", 2, model))


# ---- engine helpers -------------------------------------------------------------------------------------


def engine_facts(path: str) -> tuple[int, int, bool]:
    """(max_context, vocab_size, has_tokenizer) of an engine directory or HF checkpoint directory."""
    from pathlib import Path

    from runtime.config import ModelConfig
    from runtime.engine import is_engine_dir, open_engine

    if is_engine_dir(path):
        engine = open_engine(path)
        config = engine.model_config()
        return config.max_context, config.vocab_size, engine.has("tokenizer.json")
    config = ModelConfig.from_hf(path)
    return config.max_context, config.vocab_size, (Path(path) / "tokenizer.json").is_file()


def load_tokenizer(path: str) -> Any:
    """The tokenizer `runtime.load(path)` would use (checksum-verified for engine directories)."""
    from runtime.engine import is_engine_dir, open_engine
    from runtime.tokenizer import Tokenizer

    if is_engine_dir(path):
        tok = open_engine(path).tokenizer()
        if tok is None:
            raise SettingsError(f"engine directory {path} has no tokenizer.json; text prompts need one")
        return tok
    return Tokenizer.from_dir(path)


__all__ = [
    "ENSEMBLE_INPUTS",
    "INPUT_IDS",
    "MAX_TOKENS",
    "MESSAGES",
    "METRICS",
    "OPTIONAL_INPUTS",
    "OUTCOMES",
    "PREPROCESSING_INPUTS",
    "PREPROCESSING_OUTPUTS",
    "SPEC_DECODE_INPUTS",
    "SPEC_DECODE_OUTPUTS",
    "TEXT_INPUT",
    "TEXT_OUTPUT",
    "VERIFICATION_GREEDY",
    "VERIFICATION_SAMPLED",
    "ErrorCode",
    "GenerateRequest",
    "InputError",
    "MetricSpec",
    "MetricsBackend",
    "PreprocessingSettings",
    "RequestCancelled",
    "RequestLimits",
    "ResponseSink",
    "SettingsError",
    "Slots",
    "SlotsFullError",
    "SpecDecodeSettings",
    "SpecMetrics",
    "engine_facts",
    "error_code",
    "error_message",
    "load_tokenizer",
    "outcome_of",
    "parse_generate_request",
    "preprocess",
    "response_tensors",
    "run_generation",
]
