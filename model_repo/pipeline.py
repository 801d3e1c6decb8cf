"""Request handling for the served pipeline, with no Triton import (the BLS pattern of tensorrtllm_backend:
`model_repo.triton_adapter` is the one module that talks to triton_python_backend_utils; everything it does
with a request lives here and is tested without a server).

The request interface follows the Triton LLM conventions of tensorrtllm_backend / vllm_backend
(reference-facts section 8), so their clients work unchanged:

    inputs   text_input STRING [1] or messages STRING [1] (a JSON array of {role, content}, OpenAI chat form,
             rendered by the model's chat template; exactly one of the two), max_tokens INT32 [1] (required);
             optional stream BOOL, temperature FP32,
             top_k INT32, top_p FP32, random_seed UINT64, stop_words / bad_words STRING [-1], end_id INT32,
             exclude_input_in_output BOOL, sampling_parameters STRING (vLLM-style JSON), parse_special_tokens BOOL
             (special-token text in text_input becomes special tokens; default: literal text); tensorrtllm_backend's
             seed, min_tokens, repetition / presence / frequency penalties, pad_id, beam_width and
             num_return_sequences (1), return_log_probs, return_num_input_tokens / ..._output_tokens
             (COMPAT_INPUTS). The entry model adds a batch dimension (split_batch / batch_row_outputs).
    outputs  text_output STRING [-1]: the DELTA text of each streamed response (the whole text when not
             streaming); optional output_ids INT32 [-1] (the delta's token ids) and, on the final response,
             finish_reason, verification (the lossless verification mode this request ran: "greedy" at
             temperature 0, "rejection_sampling/<proposal>" otherwise), tau and accepted_per_step, plus
             tensorrtllm_backend's cum_log_probs / output_log_probs, acceptance_rate,
             total_accepted_draft_tokens, total_draft_tokens, num_input_tokens / num_output_tokens.

Deltas come straight from `SpecDecoder.stream` (its incremental detokenizer and stop-string hold-back), so the
served text is exactly the offline runtime's, and the deltas concatenate to the full text.

Under load and faults: `RequestLimits` (checked before a request costs anything), in-flight batching through
`Generations` (one `runtime.batching.Scheduler` per instance: one target forward per step for every running
request, a bounded FIFO queue, a KV-cache budget; runtime.errors.OverloadedError beyond), and the ensemble
model's cancellation and error hand-over across BLS calls (`CancelBoard`, `CallerOptions`, `error_outputs`).
"""

from __future__ import annotations

import enum
import logging
import json
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from model_repo.schema import DataType, ModelInput, ModelOutput
from runtime.batching import RequestHandle, Scheduler, SchedulerConfig
from runtime.errors import ConfigError, OverloadedError, RequestError, SchedulerStopped, SpectreeError
from runtime.sampling import SamplingParams
from runtime.tokenizer import ChatMessage, chat_messages

log = logging.getLogger(__name__)

# ---- the interface --------------------------------------------------------------------------------------

# Every input is declared optional, text_input and max_tokens included, and the models enforce what is
# required with an error naming the input. Measured on tritonserver 2.51: the gRPC streaming path does not
# check required inputs, and an ensemble missing a required input ends with an empty final response and no
# error at all, so a config-level `optional: false` would turn a bad request into a silent empty answer.
TEXT_INPUT = ModelInput("text_input", DataType.TYPE_STRING, (1,), optional=True)
MESSAGES = ModelInput("messages", DataType.TYPE_STRING, (1,), optional=True)  # JSON [{"role", "content"}, ...]
INPUT_IDS = ModelInput("input_ids", DataType.TYPE_INT32, (-1,), optional=True)
MAX_TOKENS = ModelInput("max_tokens", DataType.TYPE_INT32, (1,), optional=True)
# Special-token text typed in a prompt ("<s>", "</s>", "<|im_start|>") is literal text unless the request sets
# this true (a chat template's own special tokens are always parsed).
PARSE_SPECIAL_TOKENS = ModelInput("parse_special_tokens", DataType.TYPE_BOOL, (1,), optional=True)
# tensorrtllm_backend's ensemble inputs beyond the basic ones (its names, types and dims: `seed` is its current
# name for `random_seed`, which stays for older clients), and `num_top_log_probs` (ours: the likeliest
# alternatives of every emitted token, as the OpenAI frontend's logprobs need).
COMPAT_INPUTS: tuple[ModelInput, ...] = (
    ModelInput("seed", DataType.TYPE_UINT64, (1,), optional=True),
    ModelInput("min_tokens", DataType.TYPE_INT32, (1,), optional=True),
    ModelInput("repetition_penalty", DataType.TYPE_FP32, (1,), optional=True),
    ModelInput("presence_penalty", DataType.TYPE_FP32, (1,), optional=True),
    ModelInput("frequency_penalty", DataType.TYPE_FP32, (1,), optional=True),
    ModelInput("pad_id", DataType.TYPE_INT32, (1,), optional=True),
    ModelInput("num_return_sequences", DataType.TYPE_INT32, (1,), optional=True),
    ModelInput("beam_width", DataType.TYPE_INT32, (1,), optional=True),
    ModelInput("return_log_probs", DataType.TYPE_BOOL, (1,), optional=True),
    ModelInput("return_num_input_tokens", DataType.TYPE_BOOL, (1,), optional=True),
    ModelInput("return_num_output_tokens", DataType.TYPE_BOOL, (1,), optional=True),
    ModelInput("num_top_log_probs", DataType.TYPE_INT32, (1,), optional=True),
)
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
    PARSE_SPECIAL_TOKENS,
    *COMPAT_INPUTS,
)
# What the ensemble takes from clients.
ENSEMBLE_INPUTS: tuple[ModelInput, ...] = (TEXT_INPUT, MAX_TOKENS, MESSAGES, *OPTIONAL_INPUTS)
# spec_decode takes the prompt as text or messages, as token ids (from the preprocessing stage), or ids with the
# text or messages they came from (ids are decoded; text is only echoed when exclude_input_in_output is false).
SPEC_DECODE_INPUTS: tuple[ModelInput, ...] = (TEXT_INPUT, INPUT_IDS, MAX_TOKENS, MESSAGES, *OPTIONAL_INPUTS)
PREPROCESSING_INPUTS: tuple[ModelInput, ...] = (TEXT_INPUT, MESSAGES, PARSE_SPECIAL_TOKENS)
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
    # tensorrtllm_backend's names: log-probabilities (return_log_probs: of this response's tokens, and the running
    # sum), its speculative-decoding statistics (final response; acceptance_rate = accepted draft tokens / draft
    # positions, see runtime.decode) and token counts (return_num_input_tokens / return_num_output_tokens).
    ModelOutput("cum_log_probs", DataType.TYPE_FP32, (1,)),
    ModelOutput("output_log_probs", DataType.TYPE_FP32, (-1,)),
    ModelOutput("acceptance_rate", DataType.TYPE_FP32, (1,)),  # final response only
    ModelOutput("total_accepted_draft_tokens", DataType.TYPE_INT32, (1,)),  # final response only
    ModelOutput("total_draft_tokens", DataType.TYPE_INT32, (1,)),  # final response only
    ModelOutput("num_input_tokens", DataType.TYPE_INT32, (1,)),
    ModelOutput("num_output_tokens", DataType.TYPE_INT32, (1,)),  # tokens in this response
    # num_top_log_probs = k: [tokens, k] likeliest alternatives per token (ids -1 / log-probs -inf past the end)
    ModelOutput("top_log_probs", DataType.TYPE_FP32, (-1, -1)),
    ModelOutput("top_log_probs_ids", DataType.TYPE_INT32, (-1, -1)),
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


# runtime.errors.OverloadedError (the scheduler's batch and queue are full, or the ensemble's max_in_flight):
# Triton UNAVAILABLE, and the message clients read starts with OVERLOADED (`error_message`).
OVERLOADED = "overloaded:"  # the first word of every OverloadedError message (clients may match on it)


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
    if isinstance(exc, OverloadedError):
        return ErrorCode.UNAVAILABLE
    if isinstance(exc, RequestCancelled):
        return ErrorCode.CANCELLED
    return ErrorCode.INTERNAL


def error_message(exc: BaseException) -> str:
    """What the client reads: our own errors as they are, anything else with its type (an internal bug)."""
    if isinstance(exc, OverloadedError) and not str(exc).startswith(OVERLOADED):
        return f"{OVERLOADED} {exc}"
    if isinstance(exc, SpectreeError):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"


# ---- the ensemble model's calls (BLS) -------------------------------------------------------------------
# The ensemble model calls preprocessing and spec_decode as BLS requests with two request parameters. Tritonserver
# 2.51's python backend hands a BLS caller every error as INTERNAL (the code is dropped), so a caller that asks
# gets its errors as "[CODE] message" and restores the code; and spec_decode watches the caller's cancel token.
# Also measured on 2.51: an error response a decoupled model sends a BLS caller from a thread other than execute's
# (a generation that failed or was cancelled mid-way) never reaches the caller, which then waits forever. So
# spec_decode ends a BLS caller's request with a normal final response instead (`error_outputs`), which the caller
# turns back into the error (`error_of_outputs`).

CANCEL_TOKEN_PARAMETER = "spectree_cancel_token"  # the request's mark on the CancelBoard
CODED_ERRORS_PARAMETER = "spectree_coded_errors"  # true: error messages start with "[CODE] "


@dataclass(frozen=True)
class CallerOptions:
    """What a request's parameters (JSON, Triton's request parameters) ask of this pipeline."""

    cancel_token: str | None = None
    coded_errors: bool = False

    @classmethod
    def from_parameters(cls, text: str | None) -> CallerOptions:
        try:
            params = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise InputError(f"request parameters: not valid JSON ({exc})") from exc
        if not isinstance(params, dict):
            return cls()
        token = params.get(CANCEL_TOKEN_PARAMETER)
        if token is not None and not (isinstance(token, str) and CancelBoard.is_token(token)):
            raise InputError(f"parameter {CANCEL_TOKEN_PARAMETER}: expected {CancelBoard.TOKEN_HEX} lowercase hex "
                             f"digits (the ensemble model sets it), got {str(token)[:40]!r}")
        return cls(cancel_token=token, coded_errors=params.get(CODED_ERRORS_PARAMETER) is True)


def coded_error_message(exc: BaseException) -> str:
    return f"[{error_code(exc).value}] {error_message(exc)}"


ERROR_FINISH_REASON = "error"  # finish_reason of a final response that carries an error (BLS callers only)


def error_outputs(exc: BaseException) -> dict[str, np.ndarray]:
    """A final response standing for an error: finish_reason "error", text_output the coded message."""
    return {"text_output": _string_tensor(coded_error_message(exc)),
            "finish_reason": _string_tensor(ERROR_FINISH_REASON)}


def error_of_outputs(outputs: Mapping[str, np.ndarray]) -> tuple[ErrorCode, str] | None:
    """(code, message) when a response made by `error_outputs`, else None."""
    reason = outputs.get("finish_reason")
    if reason is None or _text(np.asarray(reason).reshape(-1)[0], "finish_reason") != ERROR_FINISH_REASON:
        return None
    return decode_error_message(_text(np.asarray(outputs["text_output"]).reshape(-1)[0], "text_output"))


def decode_error_message(message: str) -> tuple[ErrorCode, str]:
    """(code, message) of a coded error message; anything else is INTERNAL, as it came."""
    if message.startswith("["):
        name, sep, rest = message[1:].partition("] ")
        if sep and name in ErrorCode.__members__:
            return ErrorCode[name], rest
    return ErrorCode.INTERNAL, message


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
    """Server-side limits on a request (from the model config; None: no limit). Every one is checked before
    the request costs anything: prompt bytes before decoding or tokenising, stop strings before the decode loop
    would scan them at every step."""

    max_tokens: int  # the largest max_tokens a request may ask for
    vocab_size: int  # end_id / input_ids must be below this
    max_prompt_bytes: int | None = None  # text_input / messages size (the render option max_prompt_bytes)
    max_stop_words: int | None = None  # stop strings per request (entries of stop_words, or sampling_parameters.stop)
    max_stop_word_bytes: int | None = None  # UTF-8 bytes per stop string

    def __post_init__(self) -> None:
        for name in ("max_tokens", "vocab_size", "max_prompt_bytes", "max_stop_words", "max_stop_word_bytes"):
            v = getattr(self, name)
            if v is None and name not in ("max_tokens", "vocab_size"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SettingsError(f"RequestLimits.{name} must be an int >= 1, got {v!r}")


def check_prompt_bytes(inputs: Inputs, limit: int | None) -> None:
    """text_input / messages may hold at most `limit` bytes; checked before they are decoded or tokenised (so an
    oversized prompt costs a length check, not a tokenisation)."""
    if limit is None:
        return
    for spec in (TEXT_INPUT, MESSAGES):
        value = inputs.get(spec.name)
        if value is None:
            continue
        size = sum(len(v) for v in np.asarray(value).reshape(-1) if isinstance(v, (bytes, str)))
        if size > limit:
            raise InputError(f"{spec.name}: {size} bytes; this server takes prompts of at most {limit} bytes "
                             "(max_prompt_bytes)")


def _check_stop(stop: Any, source: str, limits: RequestLimits) -> None:
    if not isinstance(stop, (list, tuple)):
        return  # SamplingParams names the type error
    if limits.max_stop_words is not None and len(stop) > limits.max_stop_words:
        raise InputError(f"{source}: {len(stop)} stop strings; this server takes at most {limits.max_stop_words} "
                         "(max_stop_words)")
    if limits.max_stop_word_bytes is not None:
        for i, word in enumerate(stop):
            size = len(word.encode("utf-8")) if isinstance(word, str) else 0
            if size > limits.max_stop_word_bytes:
                raise InputError(f"{source}[{i}]: {size} bytes; this server takes stop strings of at most "
                                 f"{limits.max_stop_word_bytes} bytes (max_stop_word_bytes)")


@dataclass
class RequestTiming:
    """When a request's responses went out, for the latency metrics (monotonic seconds; mutable, per request)."""

    arrival: float = field(default_factory=time.monotonic)  # parsed on arrival at the model
    first_token_s: float | None = None  # arrival -> the first response with tokens
    last: float | None = None  # the latest response with tokens
    gaps: list[tuple[float, int]] = field(default_factory=list)  # (time since the previous response, its tokens)

    def sent(self, tokens: int) -> None:
        if tokens <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.first_token_s = now - self.arrival
        else:
            self.gaps.append((now - self.last, tokens))
        self.last = now


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | tuple[int, ...] | tuple[ChatMessage, ...]  # what the decoder encodes (text, messages) or takes
    prompt_source: str  # the input the prompt came from: "text_input" | "messages" | "input_ids"
    echo: str  # text put before the first delta ("" unless exclude_input_in_output is false)
    params: SamplingParams
    stream: bool
    parse_special_tokens: bool = False  # text_input: special-token text becomes special tokens (default: literal)
    return_log_probs: bool = False  # cum_log_probs / output_log_probs outputs
    top_log_probs: int = 0  # top_log_probs / top_log_probs_ids outputs with this many alternatives
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    timing: RequestTiming = field(default_factory=RequestTiming, compare=False)  # starts at parsing (arrival)


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
    "min_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "bad_words": "bad_words",
    "logprobs": "logprobs",
    "n": "n",
    "best_of": "best_of",
}
_TENSOR_FOR_FIELD = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed / random_seed",
                     "max_tokens": "max_tokens", "stop": "stop_words", "min_tokens": "min_tokens",
                     "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                     "frequency_penalty": "frequency_penalty", "bad_words": "bad_words",
                     "logprobs": "num_top_log_probs"}
# vLLM's sample client sends every value as a string ({"temperature": "0.1", "max_tokens": "100"}); vllm_backend
# converts them by the field's type, and so do we.
_JSON_TYPES: dict[str, type] = {"temperature": float, "top_p": float, "top_k": int, "seed": int, "max_tokens": int,
                                "min_tokens": int, "repetition_penalty": float, "presence_penalty": float,
                                "frequency_penalty": float, "logprobs": int, "n": int, "best_of": int,
                                "ignore_eos": bool}


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
    out = {_JSON_KEYS[k]: _json_value(k, v) for k, v in data.items()}
    for key in ("n", "best_of"):
        if out.pop(key, 1) not in (1, None):
            raise InputError(f"{name}: {key} = {data[key]!r}; this server returns one sequence per request "
                             "(send the request again, with another seed, for more)")
    if out.get("top_k") == -1:  # vLLM spells "top-k off" as -1
        out["top_k"] = 0
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


def _json_value(key: str, value: Any) -> Any:
    kind = _JSON_TYPES.get(key)
    if kind is None or not isinstance(value, str):
        return value
    try:
        if kind is bool:
            if value.strip().lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.strip().lower() in ("true", "1")
        return kind(value)
    except ValueError:
        raise InputError(f"sampling_parameters: {key} = {value!r} is not {'an' if kind is int else 'a'} "
                         f"{kind.__name__}") from None


def _bad_words(words: Any, source: str, tokenizer: Any, limits: RequestLimits) -> tuple[tuple[int, ...], ...]:
    """Bad words (text) -> token-id sequences, each encoded on its own as tensorrtllm_backend's preprocessing does
    (no BOS, special-token text literal); at most max_stop_words of max_stop_word_bytes each."""
    if isinstance(words, str):
        words = [words]
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise InputError(f"{source}: expected a list of strings, got {words!r}"[:200])
    words = [w for w in words if w]
    if limits.max_stop_words is not None and len(words) > limits.max_stop_words:
        raise InputError(f"{source}: {len(words)} bad words; this server takes at most {limits.max_stop_words} "
                         "(max_stop_words)")
    for i, word in enumerate(words):
        if limits.max_stop_word_bytes is not None and len(word.encode("utf-8")) > limits.max_stop_word_bytes:
            raise InputError(f"{source}[{i}]: {len(word.encode('utf-8'))} bytes; this server takes bad words of at "
                             f"most {limits.max_stop_word_bytes} bytes (max_stop_word_bytes)")
    if words and tokenizer is None:
        raise InputError(f"{source}: this model has no tokenizer to encode bad words with")
    return tuple(ids for ids in (tuple(tokenizer.encode(w, add_bos=False, parse_special=False)) for w in words)
                 if ids)


def _one_sequence(inputs: Inputs, name: str) -> None:
    value = _scalar(inputs, _SPEC[name])
    if value is not None and value != 1:
        raise InputError(f"{name}: {value}; this server generates one sequence per request (tree speculative "
                         "decoding with lossless verification has no beam search): send 1, or send the request "
                         "again with another seed")


def parse_generate_request(inputs: Inputs, limits: RequestLimits, tokenizer: Any = None) -> GenerateRequest:
    """Triton-style inputs (name -> numpy array) -> a validated GenerateRequest; InputError names the input.
    tokenizer: encodes bad_words (a request with bad words needs it)."""
    unknown = sorted(set(inputs) - set(_SPEC))
    if unknown:
        raise InputError(f"unknown input(s) {unknown}; this model takes {sorted(_SPEC)}")
    check_prompt_bytes(inputs, limits.max_prompt_bytes)
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
    stop_arr = _array(inputs, _SPEC["stop_words"])
    if stop_arr is not None:  # counted before decoding (empty entries are padding, as in trtllm, but count here)
        _check_stop(list(stop_arr.reshape(-1)), "stop_words", limits)
    stop = tuple(s for s in _texts(inputs, _SPEC["stop_words"]) if s)
    if stop:
        fields["stop"] = stop
    bad_arr = _array(inputs, _SPEC["bad_words"])
    if bad_arr is not None:
        given = sum(1 for v in bad_arr.reshape(-1) if len(v))  # counted before decoding; "" entries are padding
        if limits.max_stop_words is not None and given > limits.max_stop_words:
            raise InputError(f"bad_words: {given} bad words; this server takes at most {limits.max_stop_words} "
                             "(max_stop_words)")
        bad = _bad_words(list(_texts(inputs, _SPEC["bad_words"])), "bad_words", tokenizer, limits)
        if bad:
            fields["bad_words"] = bad
    seed = _scalar(inputs, _SPEC["seed"])
    if seed is not None:
        if "seed" in fields:
            raise InputError("seed and random_seed: both given; give one (seed is tensorrtllm_backend's current "
                             "name, random_seed its older one)")
        fields["seed"] = seed
    for name in ("min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = _scalar(inputs, _SPEC[name])
        if value is not None:
            fields[name] = value
    top = _scalar(inputs, _SPEC["num_top_log_probs"])
    if top is not None:
        fields["logprobs"] = top
    pad_id = _scalar(inputs, _SPEC["pad_id"])
    if pad_id is not None and not 0 <= pad_id < limits.vocab_size:  # accepted: responses are never padded
        raise InputError(f"pad_id: expected a token id in [0, {limits.vocab_size}), got {pad_id}")
    for name in ("num_return_sequences", "beam_width"):
        _one_sequence(inputs, name)
    end_id = _scalar(inputs, _SPEC["end_id"])
    if end_id is not None:
        if not 0 <= end_id < limits.vocab_size:
            raise InputError(f"end_id: expected a token id in [0, {limits.vocab_size}), got {end_id}")
        # end_id replaces the model's EOS tokens (tensorrtllm_backend's meaning).
        fields["stop_token_ids"] = (end_id,)
        fields["ignore_eos"] = True
    sp_text = _scalar(inputs, _SPEC["sampling_parameters"])
    if sp_text is not None and sp_text.strip():
        json_fields = _sampling_json(sp_text)
        _check_stop(json_fields.get("stop"), "sampling_parameters.stop", limits)
        if "bad_words" in json_fields:
            json_fields["bad_words"] = _bad_words(json_fields["bad_words"], "sampling_parameters.bad_words",
                                                  tokenizer, limits)
        for key, value in json_fields.items():
            if key in fields:
                tensor = _TENSOR_FOR_FIELD.get(key, "end_id")
                raise InputError(f"sampling_parameters: {key!r} is also given as the input {tensor!r}; give it once")
            fields[key] = value
    if stop:
        _check_stop(list(stop), "stop_words", limits)  # byte sizes, now decoded

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
    # Log-probabilities come back when return_log_probs is set or alternatives were asked for (num_top_log_probs,
    # or vLLM's sampling_parameters.logprobs).
    return_log_probs = bool(_scalar(inputs, _SPEC["return_log_probs"])) or fields.get("logprobs") is not None
    top_log_probs = fields.get("logprobs") or 0
    if return_log_probs and fields.get("logprobs") is None:
        fields["logprobs"] = 0
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
    parse_special = _scalar(inputs, PARSE_SPECIAL_TOKENS)
    return GenerateRequest(prompt=prompt, prompt_source=source, echo=echo, params=params, stream=stream,
                           parse_special_tokens=bool(parse_special),
                           return_log_probs=return_log_probs,
                           top_log_probs=top_log_probs,
                           return_num_input_tokens=bool(_scalar(inputs, _SPEC["return_num_input_tokens"])),
                           return_num_output_tokens=bool(_scalar(inputs, _SPEC["return_num_output_tokens"])))


# ---- cancellation across models -------------------------------------------------------------------------


class CancelBoard:
    """Cancellation marks shared by the python-backend processes of one tritonserver.

    The ensemble model calls spec_decode as a BLS request, and tritonserver 2.51's python backend cannot cancel a
    BLS request (its response iterator's cancel() came in 25.04). So the ensemble gives each spec_decode request a
    random token, and when its own client cancels or disconnects it marks that token here; spec_decode checks the
    mark between decode steps (a stat() call) and ends the request CANCELLED, freeing its cache. The marks are
    files in a directory private to the user and the server process (every stub's parent), in the system's
    temporary directory; the ensemble removes a mark once the request has ended.
    """

    TOKEN_HEX = 32

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def of_server(cls) -> CancelBoard:
        """The board of the tritonserver this process is a python-backend stub of (its parent process)."""
        import os
        import tempfile

        return cls(Path(tempfile.gettempdir()) / f"spectree-cancel-{os.getuid()}-{os.getppid()}")

    @classmethod
    def is_token(cls, token: str) -> bool:
        return len(token) == cls.TOKEN_HEX and all(c in "0123456789abcdef" for c in token)

    def new_token(self) -> str:
        import secrets

        return secrets.token_hex(self.TOKEN_HEX // 2)

    def mark(self, token: str) -> None:
        self.root.mkdir(mode=0o700, exist_ok=True)
        (self.root / token).touch()

    def is_marked(self, token: str) -> bool:
        return (self.root / token).exists()

    def clear(self, token: str) -> None:
        (self.root / token).unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the board's directory if no mark is left in it."""
        try:
            self.root.rmdir()
        except OSError:
            pass


class InFlight:
    """A counter of requests a model holds at once; `enter` beyond `limit` raises OverloadedError."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what  # names the setting in the message
        self._n = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._n

    def enter(self) -> None:
        with self._lock:
            if self._n >= self.limit:
                raise OverloadedError(f"{OVERLOADED} {self._n} requests in flight ({self.what} {self.limit}); "
                                      "retry later")
            self._n += 1

    def leave(self) -> None:
        with self._lock:
            if self._n <= 0:
                raise RuntimeError("InFlight.leave without a matching enter")
            self._n -= 1


def is_final_response(output_names: Sequence[str]) -> bool:
    """Whether a spec_decode response is its request's last: only the last one carries finish_reason."""
    return "finish_reason" in output_names


# ---- the ensemble's batch dimension (tensorrtllm_backend's shapes) --------------------------------------
#
# The entry model has max_batch_size > 0 like tensorrtllm_backend's ensemble: clients send [batch, 1] tensors
# (NVIDIA's end_to_end_grpc_client.py sends [[prompt]]), and each row becomes one spec_decode request (whose
# inputs are the same tensors without the batch dimension, vllm_backend's shapes).

BATCH_INDEX = ModelOutput("batch_index", DataType.TYPE_INT32, (1,))
SEQUENCE_INDEX = ModelOutput("sequence_index", DataType.TYPE_INT32, (1,))
# Dims as tensorrtllm_backend's ensemble declares them: log-probabilities carry a beam dimension.
_ENSEMBLE_DIMS = {"cum_log_probs": (-1,), "output_log_probs": (-1, -1)}
ENSEMBLE_OUTPUTS: tuple[ModelOutput, ...] = (
    *(ModelOutput(o.name, o.data_type, _ENSEMBLE_DIMS.get(o.name, o.dims)) for o in SPEC_DECODE_OUTPUTS),
    BATCH_INDEX,
    SEQUENCE_INDEX,
)


def split_batch(inputs: Inputs) -> list[dict[str, np.ndarray]]:
    """A batched request's inputs (name -> [batch, ...]) -> one spec_decode request's inputs per row.

    As tensorrtllm_backend does, a streamed response never repeats the prompt, whatever exclude_input_in_output
    says (its end_to_end_grpc_client.py sends false and expects no prompt when streaming)."""
    batch = None
    for name, value in inputs.items():
        arr = np.asarray(value)
        if arr.ndim < 2:
            raise InputError(f"{name}: shape {list(arr.shape)}; this model batches (max_batch_size > 0), so every "
                             "input is [batch, ...]: send [[value]] for one request, e.g. text_input [1, 1]")
        if batch is None:
            batch = arr.shape[0]
        elif arr.shape[0] != batch:
            raise InputError(f"{name}: batch size {arr.shape[0]}, but other inputs have {batch}; every input needs "
                             "the same batch size")
    if not batch:
        raise InputError("text_input: missing; expected the prompt text ([batch, 1] STRING), or messages")
    rows = [{name: np.asarray(value)[b] for name, value in inputs.items()} for b in range(batch)]
    for row in rows:
        stream = row.get("stream")
        if stream is not None and stream.size == 1 and bool(stream.reshape(-1)[0]):
            row["exclude_input_in_output"] = np.array([True])
    return rows


def batch_row_outputs(outputs: Mapping[str, np.ndarray], row: int) -> dict[str, np.ndarray]:
    """One spec_decode response's outputs -> the batched model's, for batch row `row`, in tensorrtllm_backend's
    shapes: text_output [1] as its postprocessing sends it, cum_log_probs [1, beam], output_log_probs
    [1, beam, tokens], every other output with a leading batch dimension; plus batch_index and sequence_index."""
    out: dict[str, np.ndarray] = {}
    for name, value in outputs.items():
        arr = np.asarray(value)
        if name == TEXT_OUTPUT.name:
            out[name] = arr
        elif name == "output_log_probs":
            out[name] = arr[None, None]
        else:
            out[name] = arr[None]
    out[BATCH_INDEX.name] = np.array([[row]], dtype=np.int32)
    out[SEQUENCE_INDEX.name] = np.array([[0]], dtype=np.int32)
    return out


# ---- preprocessing (the tokenizer stage) ----------------------------------------------------------------


def preprocess(inputs: Inputs, tokenizer: Any, max_context: int,
               max_prompt_bytes: int | None = None) -> dict[str, np.ndarray]:
    """text_input or messages -> input_ids INT32 [n], input_length INT32 [1]; the ids `encode_text` makes of the
    text (BOS first when the model has one; special-token text literal unless parse_special_tokens) or
    `SpecDecoder.encode_prompt` of the messages (the chat template's text). The prompt's size is checked against
    max_prompt_bytes before anything decodes it."""
    unknown = sorted(set(inputs) - {i.name for i in PREPROCESSING_INPUTS})
    if unknown:
        raise InputError(f"unknown input(s) {unknown}; preprocessing takes {[i.name for i in PREPROCESSING_INPUTS]}")
    check_prompt_bytes(inputs, max_prompt_bytes)
    text, messages = _text_or_messages(inputs)
    if messages is not None:
        source = MESSAGES.name
        try:
            ids = tokenizer.apply_chat_template(messages)
        except RequestError as exc:  # no chat template, or the template refused the conversation
            raise InputError(f"messages: {exc}") from exc
    else:
        source = TEXT_INPUT.name
        ids = encode_text(tokenizer, text, bool(_scalar(inputs, PARSE_SPECIAL_TOKENS)))
    if len(ids) >= max_context:
        raise InputError(
            f"{source}: the prompt is {len(ids)} tokens; the context limit is {max_context} tokens, so a prompt "
            f"may have at most {max_context - 1}"
        )
    return {
        "input_ids": np.asarray(ids, dtype=np.int32),
        "input_length": np.asarray([len(ids)], dtype=np.int32),
    }


def encode_text(tokenizer: Any, text: str, parse_special_tokens: bool) -> list[int]:
    """A text prompt's ids as served: BOS first (when the model has one); special-token text typed in the prompt
    stays literal text unless the request asked for parse_special_tokens."""
    return tokenizer.encode(text, parse_special=parse_special_tokens)


def prompt_ids(decoder: Any, request: GenerateRequest) -> list[int]:
    """The token ids spec_decode generates from (validated by `SpecDecoder.encode_prompt`: vocabulary, context);
    text is encoded by `encode_text`, messages through the chat template."""
    prompt: Any = request.prompt
    try:
        if request.prompt_source == TEXT_INPUT.name:
            if decoder.tokenizer is None:
                raise RequestError("the prompt is text but this model has no tokenizer; send input_ids instead")
            prompt = encode_text(decoder.tokenizer, prompt, request.parse_special_tokens)
        return decoder.encode_prompt(prompt)
    except RequestError as exc:  # too long for the context, bad ids, no chat template
        raise InputError(f"{request.prompt_source}: {exc}") from exc


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
        out["acceptance_rate"] = np.asarray([stats.acceptance_rate], dtype=np.float32)
        out["total_accepted_draft_tokens"] = np.asarray([stats.accepted_tokens], dtype=np.int32)
        out["total_draft_tokens"] = np.asarray([stats.draft_positions], dtype=np.int32)
    return out


class ResponseBuilder:
    """A request's deltas since its last response, turned into that response's output tensors: text, ids and
    stats (`response_tensors`), plus the outputs the request asked for (log-probabilities, alternatives, token
    counts). cum_log_probs is the running sum over every token sent so far."""

    def __init__(self, request: GenerateRequest, prompt_tokens: int) -> None:
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.cum_log_prob = 0.0
        self._reset(request.echo)

    def _reset(self, text: str = "") -> None:
        self.text: list[str] = [text]
        self.ids: list[int] = []
        self.log_probs: list[float] = []
        self.top: list[tuple[tuple[int, float], ...]] = []

    def add(self, delta: Any) -> None:
        self.text.append(delta.text)
        self.ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.log_probs.extend(delta.logprobs)
            self.top.extend(delta.top_logprobs)
            self.cum_log_prob += sum(delta.logprobs)

    def take(self, final: Any = None) -> dict[str, np.ndarray]:
        """The outputs of one response (final: the last GenerationDelta), and a fresh start for the next."""
        request = self.request
        out = response_tensors("".join(self.text), self.ids, final)
        if request.return_log_probs:
            out["cum_log_probs"] = np.asarray([self.cum_log_prob], dtype=np.float32)
            out["output_log_probs"] = np.asarray(self.log_probs, dtype=np.float32)
        if request.top_log_probs:
            k = request.top_log_probs
            ids = np.full((len(self.top), k), -1, dtype=np.int32)
            lps = np.full((len(self.top), k), -np.inf, dtype=np.float32)
            for row, alternatives in enumerate(self.top):
                for col, (tok, lp) in enumerate(alternatives[:k]):
                    ids[row, col], lps[row, col] = tok, lp
            out["top_log_probs"], out["top_log_probs_ids"] = lps, ids
        if request.return_num_input_tokens:
            out["num_input_tokens"] = np.asarray([self.prompt_tokens], dtype=np.int32)
        if request.return_num_output_tokens:
            out["num_output_tokens"] = np.asarray([len(self.ids)], dtype=np.int32)
        request.timing.sent(len(self.ids))
        self._reset()
        return out


class ResponseSink(Protocol):
    """Where a generation's responses go (a Triton response sender in the server, a list in tests)."""

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...

    def fail(self, exc: BaseException) -> None: ...  # the final response is this error (unless one was sent)

    def is_cancelled(self) -> bool: ...


# ---- generation: in-flight batching on one scheduler per instance -----------------------------------------


def available_memory_bytes(device: str) -> int:
    """Memory free for new allocations now: the GPU's free memory (cuda), else MemAvailable, capped by the cgroup
    (container) limit when there is one."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            room = int(limit) - used
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    if available is None:
        raise SettingsError("cannot read the free memory (/proc/meminfo); render with kv_memory_mb set")
    return available


def check_kv_budget(decoder: Any, prompt_tokens: int, params: SamplingParams, budget_bytes: int) -> None:
    """InputError (naming max_tokens, with the largest that fits) when a request's worst-case KV cache could never
    fit the instance's budget: the sizing `runtime.batching.Scheduler.submit` admits by (`SpecDecoder.cache_tokens`,
    `model.cache_bytes`: the KV dtype the model really keeps, float64 for bf16 on CPU), told in serving's terms."""
    model = decoder.model
    need = model.cache_bytes(decoder.cache_tokens(prompt_tokens, params))
    if need <= budget_bytes:
        return
    most = budget_bytes // model.cache_bytes(1) - prompt_tokens - decoder.max_tree_nodes
    raise InputError(
        f"max_tokens: {params.max_tokens} with a {prompt_tokens}-token prompt needs {need / 2**20:.1f} MiB of KV "
        f"cache; this instance's KV budget is {budget_bytes / 2**20:.1f} MiB (kv_memory_mb), so this prompt allows "
        f"max_tokens <= {max(0, most)}"
    )


@dataclass(eq=False)
class _Live:
    """A request between submit and its end: where its responses go."""

    request: GenerateRequest
    sink: ResponseSink
    builder: ResponseBuilder
    handle: RequestHandle | None = None
    ended: bool = False


class Generations:
    """spec_decode's requests on ONE `runtime.batching.Scheduler` (in-flight batching: every running request's
    draft tree verified in one target forward per step; a bounded FIFO queue; admission by a KV budget).

    `submit` hands a parsed request to the scheduler and returns at once: a request that can never fit the budget
    is refused with InputError, one beyond max_batch_size + max_queue_size with runtime.errors.OverloadedError
    (UNAVAILABLE, "overloaded: ..."). Its deltas become responses on the scheduler's thread (`ResponseBuilder`:
    one per delta when streaming, one whole response otherwise); a request leaves the batch before its final
    response goes out, so a client sending its next request at once finds room.

    Cancellation: after each delta the request's sink is asked (a client gone, a CancelBoard mark, shutdown), and
    a watcher thread asks every `poll_s` for requests still waiting (which get no deltas); a cancelled request
    stops at the next step boundary, its KV cache freed, and ends with RequestCancelled. The watcher also keeps
    the gauges current and reports a scheduler that died (`on_dead(error)`, once; its requests have ended with
    SchedulerStopped). Every request ends in exactly one `metrics.finished` and one
    `on_done(request, error, final)`, after its final response (or error) went out.
    """

    def __init__(self, decoder: Any, config: SchedulerConfig, metrics: SpecMetrics | None = None,
                 on_done: Callable[[GenerateRequest, BaseException | None, Any], None] | None = None,
                 on_dead: Callable[[BaseException | None], None] | None = None, poll_s: float = 0.1,
                 name: str = "spec_decode") -> None:
        self.decoder = decoder
        self.config = config
        self.metrics = metrics
        self._on_done = on_done
        self._on_dead = on_dead
        self._live: dict[int, _Live] = {}  # id(live) -> live
        self._lock = threading.Lock()
        self._closing = False
        self._dead_reported = False
        self._published: tuple[int, int, int] | None = None
        self._counted = (0, 0)  # (steps, segments) already added to the metrics
        if metrics is not None:
            metrics.limits(config)
        self.scheduler = Scheduler(decoder, config, name=f"{name}-scheduler")
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._watcher = threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)
        self._watcher.start()

    @property
    def healthy(self) -> bool:
        return self.scheduler.healthy

    def submit(self, request: GenerateRequest, prompt: Sequence[int], sink: ResponseSink) -> RequestHandle:
        ids = list(prompt)
        check_kv_budget(self.decoder, len(ids), request.params, self.config.kv_budget_bytes)
        live = _Live(request, sink, ResponseBuilder(request, len(ids)))
        with self._lock:
            if self._closing:
                raise RequestCancelled("the model is shutting down")
            self._live[id(live)] = live
        try:
            handle = self.scheduler.submit(ids, request.params, on_delta=lambda h, item: self._on_item(live, h, item))
        except BaseException:
            with self._lock:
                self._live.pop(id(live), None)
            raise
        with self._lock:
            live.handle = handle
        self.publish()
        return handle

    def _on_item(self, live: _Live, handle: RequestHandle, item: Any) -> None:
        """The scheduler's delta callback (its thread): each delta, then the final delta or the exception."""
        live.handle = handle
        if isinstance(item, BaseException):
            self._end(live, item)
            return
        if item.finished:
            if item.finish_reason == "cancelled":
                self._end(live, RequestCancelled("the request was cancelled"))
                return
            live.builder.add(item)
            try:
                live.sink.send(live.builder.take(item), final=True)
            except Exception as exc:  # noqa: BLE001  (the client is gone: the request ends with that)
                self._end(live, exc)
                return
            self._end(live, None, item)
            return
        if live.sink.is_cancelled():
            handle.cancel()  # at the next step boundary; this delta is not sent
            return
        live.builder.add(item)
        self.publish(counters=False)  # a client that sees this delta sees the request counted as running
        if live.request.stream:
            live.sink.send(live.builder.take(), final=False)  # raising ends the request (the scheduler's rule)

    def _end(self, live: _Live, error: BaseException | None, final: Any = None) -> None:
        with self._lock:
            if live.ended:
                return
            live.ended = True
            self._live.pop(id(live), None)
            if isinstance(error, SchedulerStopped) and self._closing:
                error = RequestCancelled("the model is shutting down")
        try:
            if error is not None:
                live.sink.fail(error)
        finally:
            if self.metrics is not None:
                self.metrics.finished(error, final, live.request.timing)
            self.publish()
            if self._on_done is not None:
                self._on_done(live.request, error, final)

    def publish(self, counters: bool = True) -> None:
        """The scheduler's state to the metrics: gauges (when they changed) and the batch counters."""
        if self.metrics is None:
            return
        st = self.scheduler.stats()
        with self._lock:
            state = (st.active, st.waiting, st.kv_reserved_bytes)
            changed = state != self._published
            self._published = state
            steps, segments = 0, 0
            if counters:
                steps, segments = st.steps - self._counted[0], st.segments - self._counted[1]
                self._counted = (st.steps, st.segments)
        if changed:
            self.metrics.state(*state)
        if steps or segments:
            self.metrics.batches(steps, segments)

    def poll(self) -> None:
        """Cancel requests whose client has gone (waiting ones included), publish the state, report a dead loop."""
        with self._lock:
            live = [x for x in self._live.values() if x.handle is not None and not x.ended]
        for x in live:
            if not x.handle.cancel_requested and x.sink.is_cancelled():
                x.handle.cancel()
        self.publish()
        if not self.scheduler.healthy:
            with self._lock:
                report = not (self._closing or self._dead_reported)
                self._dead_reported = True
            if report and self._on_dead is not None:
                self._on_dead(self.scheduler.error)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001  (the watcher outlives any one request's sink)
                log.warning("spec_decode watcher: %r", exc)

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new requests; those in flight or waiting end CANCELLED ("shutting down") at the next step
        boundary. True when the scheduler's thread stopped within `timeout`."""
        with self._lock:
            self._closing = True
        stopped = self.scheduler.close(timeout)
        self._stop.set()
        if threading.current_thread() is not self._watcher:
            self._watcher.join()
        return stopped

    def __enter__(self) -> Generations:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_generation(decoder: Any, request: GenerateRequest, sink: ResponseSink,
                   prompt: Sequence[int] | None = None) -> Any:
    """One request, alone, through the serving path (`Generations` over a batch-1 scheduler whose KV budget fits
    any request): the responses spec_decode would send to `sink`. Raises the request's error (RequestCancelled when
    the sink said so; prompt errors as InputError before anything runs); returns the final GenerationDelta."""
    ids = prompt_ids(decoder, request) if prompt is None else list(prompt)
    budget = decoder.model.cache_bytes(decoder.max_context + decoder.max_tree_nodes)
    ended: list[tuple[BaseException | None, Any]] = []
    config = SchedulerConfig(max_batch_size=1, max_queue_size=0, kv_budget_bytes=budget)
    with Generations(decoder, config, on_done=lambda _r, error, final: ended.append((error, final)),
                     name="run_generation") as gens:
        gens.submit(request, ids, sink).wait()
    error, final = ended[0]
    if error is not None:
        raise error
    return final


# ---- metrics --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None  # histograms only


REQUESTS = MetricSpec("spectree_requests_total", "counter",
                      "Generation requests finished, by outcome (completed, invalid, overloaded, cancelled, error)",
                      ("model", "outcome"))
GENERATED = MetricSpec("spectree_generated_tokens_total", "counter", "Tokens generated", ("model",))
# Speculation counters in vLLM's spec-decode meanings (runtime/decode.py): drafts = verification steps, draft
# tokens = positions speculated (each step's tree depth), accepted tokens; per position k, the steps whose k-th
# speculated token was accepted. acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted /
# drafts. Tree nodes count the verification work (a tree of depth 3 may have 60 nodes).
STEPS = MetricSpec("spectree_verify_steps_total", "counter",
                   "Drafts: verification steps (target forwards over a draft tree), by verification mode",
                   ("model", "verification"))
DRAFT_TOKENS = MetricSpec("spectree_draft_tokens_total", "counter",
                          "Draft tokens: positions speculated (the tree depth of every step)",
                          ("model", "verification"))
TREE_NODES = MetricSpec("spectree_tree_nodes_total", "counter",
                        "Draft tree nodes fed to the target, roots excluded (verification work)",
                        ("model", "verification"))
ACCEPTED = MetricSpec("spectree_accepted_tokens_total", "counter", "Draft tokens accepted by verification",
                      ("model", "verification"))
ACCEPTED_PER_POSITION = MetricSpec("spectree_accepted_tokens_per_position_total", "counter",
                                   "Steps whose draft token at this position (1 = first after the root) was accepted",
                                   ("model", "verification", "position"))
MEAN_ACCEPTED_LENGTH = MetricSpec("spectree_mean_accepted_length", "histogram",
                                  "Per request: 1 + accepted draft tokens per step",
                                  ("model", "verification"), (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0,
                                                              8.0))
ACCEPTANCE_RATE = MetricSpec("spectree_acceptance_rate", "histogram",
                             "Per request: accepted draft tokens / draft tokens (positions)",
                             ("model", "verification"), (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
TTFT = MetricSpec("spectree_time_to_first_token_seconds", "histogram",
                  "From the request's arrival at the model to its first response with tokens (queueing included)",
                  ("model",), _LATENCY_BUCKETS)
ITL = MetricSpec("spectree_inter_token_latency_seconds", "histogram",
                 "Time between a request's responses divided by the tokens the later one carries, once per token",
                 ("model",), _LATENCY_BUCKETS)
ACCEPTED_PER_STEP = MetricSpec("spectree_accepted_tokens_per_step", "histogram",
                               "Draft tokens accepted per verification step",
                               ("model", "verification"), (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 32, 64))
TAU = MetricSpec("spectree_tau", "histogram", "Tokens emitted per verification step, per request (tau)",
                 ("model", "verification"), (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0))
ACTIVE = MetricSpec("spectree_active_requests", "gauge", "Requests in the batch now, per model instance",
                    ("model", "instance"))
CAPACITY = MetricSpec("spectree_generation_slots", "gauge",
                      "Requests decoded together (the scheduler's max_batch_size), per model instance",
                      ("model", "instance"))
QUEUED = MetricSpec("spectree_queued_requests", "gauge", "Requests waiting to join the batch",
                    ("model", "instance"))
QUEUE_CAPACITY = MetricSpec("spectree_queue_slots", "gauge", "Requests allowed to wait (max_queue_size)",
                            ("model", "instance"))
KV_RESERVED = MetricSpec("spectree_kv_reserved_bytes", "gauge",
                         "KV cache reserved by the running generations (prompt + max_tokens + one tree each)",
                         ("model", "instance"))
KV_BUDGET = MetricSpec("spectree_kv_budget_bytes", "gauge", "KV cache the running generations may reserve together",
                       ("model", "instance"))
KV_USAGE = MetricSpec("spectree_kv_cache_usage_ratio", "gauge",
                      "KV cache reserved / KV budget (0 = empty, 1 = full)", ("model", "instance"))
# In-flight batching: forwards / segments = the mean number of requests verified together per target forward.
BATCH_FORWARDS = MetricSpec("spectree_batch_forwards_total", "counter",
                            "Target forwards run by the scheduler (one per step, for every request in the batch)",
                            ("model", "instance"))
BATCH_SEGMENTS = MetricSpec("spectree_batch_segments_total", "counter",
                            "Requests' segments (prompt chunks, draft trees) in those forwards", ("model", "instance"))
METRICS: tuple[MetricSpec, ...] = (REQUESTS, GENERATED, STEPS, DRAFT_TOKENS, TREE_NODES, ACCEPTED,
                                   ACCEPTED_PER_POSITION, ACCEPTED_PER_STEP, MEAN_ACCEPTED_LENGTH, ACCEPTANCE_RATE,
                                   TAU, TTFT, ITL, ACTIVE, CAPACITY, QUEUED, QUEUE_CAPACITY, KV_RESERVED, KV_BUDGET,
                                   KV_USAGE, BATCH_FORWARDS, BATCH_SEGMENTS)

OUTCOMES = ("completed", "invalid", "overloaded", "cancelled", "error")


def outcome_of(exc: BaseException | None) -> str:
    if exc is None:
        return "completed"
    return {ErrorCode.INVALID_ARG: "invalid", ErrorCode.UNAVAILABLE: "overloaded",
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
    _kv_budget: int = 0

    def limits(self, config: SchedulerConfig) -> None:
        labels = {"model": self.model, "instance": self.instance}
        self.backend.set(CAPACITY, labels, config.max_batch_size)
        self.backend.set(QUEUE_CAPACITY, labels, config.max_queue_size)
        self.backend.set(KV_BUDGET, labels, config.kv_budget_bytes)
        self._kv_budget = config.kv_budget_bytes
        self.state(0, 0, 0)

    def state(self, running: int, queued: int, kv_reserved: int) -> None:
        """The scheduler's gauges (`Generations.publish`)."""
        labels = {"model": self.model, "instance": self.instance}
        self.backend.set(ACTIVE, labels, running)
        self.backend.set(QUEUED, labels, queued)
        self.backend.set(KV_RESERVED, labels, kv_reserved)
        if self._kv_budget:
            self.backend.set(KV_USAGE, labels, kv_reserved / self._kv_budget)

    def batches(self, forwards: int, segments: int) -> None:
        """Forwards the scheduler ran since the last call, and the request segments in them."""
        labels = {"model": self.model, "instance": self.instance}
        self.backend.add(BATCH_FORWARDS, labels, forwards)
        self.backend.add(BATCH_SEGMENTS, labels, segments)

    def finished(self, exc: BaseException | None, final: Any = None, timing: RequestTiming | None = None) -> None:
        """One request ended (exc None: completed; final: its last GenerationDelta when it got that far; timing:
        when its responses went out)."""
        with self._lock:
            self.backend.add(REQUESTS, {"model": self.model, "outcome": outcome_of(exc)}, 1)
            if timing is not None:
                if timing.first_token_s is not None:
                    self.backend.observe(TTFT, {"model": self.model}, timing.first_token_s)
                for gap, n in timing.gaps:
                    for _ in range(n):
                        self.backend.observe(ITL, {"model": self.model}, gap / n)
            if final is None or final.stats is None:
                return
            stats = final.stats
            self.backend.add(GENERATED, {"model": self.model}, stats.generated_tokens)
            if stats.steps == 0:
                return
            mode = VERIFICATION_GREEDY if stats.verification == "greedy" else VERIFICATION_SAMPLED
            labels = {"model": self.model, "verification": mode}
            self.backend.add(STEPS, labels, stats.steps)
            self.backend.add(DRAFT_TOKENS, labels, stats.draft_positions)
            self.backend.add(TREE_NODES, labels, stats.drafted_tokens)
            self.backend.add(ACCEPTED, labels, stats.accepted_tokens)
            for position, n in enumerate(stats.accepted_per_position, start=1):
                self.backend.add(ACCEPTED_PER_POSITION, {**labels, "position": str(position)}, n)
            for n in stats.accepted_per_step:
                self.backend.observe(ACCEPTED_PER_STEP, labels, n)
            self.backend.observe(TAU, labels, stats.tau)
            self.backend.observe(MEAN_ACCEPTED_LENGTH, labels, stats.mean_accepted_length)
            if stats.draft_positions:
                self.backend.observe(ACCEPTANCE_RATE, labels, stats.acceptance_rate)


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
    """spec_decode's config.pbtxt parameters, parsed (every key required, unknown keys rejected). What they mean:
    model_repo.render.RepoOptions, whose fields carry the same names."""

    engine_dir: str
    load_options: dict[str, Any]  # keyword arguments of runtime.load (JSON in the config)
    max_concurrent_requests: int  # the scheduler's max_batch_size
    max_queue_size: int
    prefill_chunk: int  # prompt tokens per request per step
    max_tokens_limit: int
    kv_memory_mb: int  # 0: half the memory free once the model is loaded
    max_prompt_bytes: int
    max_stop_words: int
    max_stop_word_bytes: int
    torch_threads: int  # 0: torch's default
    device: str  # "cpu" | "cuda"

    KEYS = ("engine_dir", "load_options", "max_concurrent_requests", "max_queue_size", "prefill_chunk",
            "max_tokens_limit",
            "kv_memory_mb", "max_prompt_bytes", "max_stop_words", "max_stop_word_bytes", "torch_threads", "device",
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
            max_queue_size=_int_param(params, "max_queue_size", 0, model),
            prefill_chunk=_int_param(params, "prefill_chunk", 1, model),
            max_tokens_limit=_int_param(params, "max_tokens_limit", 1, model),
            kv_memory_mb=_int_param(params, "kv_memory_mb", 0, model),
            max_prompt_bytes=_int_param(params, "max_prompt_bytes", 1, model),
            max_stop_words=_int_param(params, "max_stop_words", 1, model),
            max_stop_word_bytes=_int_param(params, "max_stop_word_bytes", 1, model),
            torch_threads=_int_param(params, "torch_threads", 0, model),
            device=params["device"],
        )

    def request_limits(self, vocab_size: int) -> RequestLimits:
        return RequestLimits(max_tokens=self.max_tokens_limit, vocab_size=vocab_size,
                             max_prompt_bytes=self.max_prompt_bytes, max_stop_words=self.max_stop_words,
                             max_stop_word_bytes=self.max_stop_word_bytes)

    def kv_budget_bytes(self, free_bytes: Callable[[], int]) -> int:
        """kv_memory_mb, or (0) half of what free_bytes() reports once the model is loaded."""
        if self.kv_memory_mb:
            return self.kv_memory_mb * 2**20
        return max(1, free_bytes() // 2)

    def scheduler_config(self, free_bytes: Callable[[], int]) -> SchedulerConfig:
        """The instance's `runtime.batching.Scheduler` settings."""
        return SchedulerConfig(max_batch_size=self.max_concurrent_requests, max_queue_size=self.max_queue_size,
                               kv_budget_bytes=self.kv_budget_bytes(free_bytes), prefill_chunk=self.prefill_chunk)


@dataclass(frozen=True)
class PreprocessingSettings:
    engine_dir: str
    max_context: int
    max_prompt_bytes: int

    KEYS = ("engine_dir", "max_context", "max_prompt_bytes")

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], model: str = "preprocessing") -> PreprocessingSettings:
        _check_keys(params, cls.KEYS, model)
        return cls(engine_dir=params["engine_dir"], max_context=_int_param(params, "max_context", 2, model),
                   max_prompt_bytes=_int_param(params, "max_prompt_bytes", 1, model))


@dataclass(frozen=True)
class EnsembleSettings:
    """The ensemble (entry) model's parameters: the models it calls, and how many requests it holds at once
    (every spec_decode instance's slots and queue; beyond that it answers OverloadedError itself)."""

    preprocessing: str
    spec_decode: str
    max_in_flight: int

    KEYS = ("preprocessing_model", "spec_decode_model", "max_in_flight")

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], model: str = "ensemble") -> EnsembleSettings:
        _check_keys(params, cls.KEYS, model)
        return cls(preprocessing=params["preprocessing_model"], spec_decode=params["spec_decode_model"],
                   max_in_flight=_int_param(params, "max_in_flight", 1, model))


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


def verify_engine(path: str) -> None:
    """Check every file of an engine directory against the size and sha256 engine.json records
    (EngineChecksumError names the file); a Hugging Face checkpoint directory has no checksums to check."""
    from runtime.engine import is_engine_dir, open_engine

    if not is_engine_dir(path):
        return
    engine = open_engine(path)
    for relpath in sorted(engine.manifest["files"]):
        engine.path(relpath)


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
    "CANCEL_TOKEN_PARAMETER",
    "CODED_ERRORS_PARAMETER",
    "ERROR_FINISH_REASON",
    "BATCH_INDEX",
    "COMPAT_INPUTS",
    "ENSEMBLE_INPUTS",
    "ENSEMBLE_OUTPUTS",
    "SEQUENCE_INDEX",
    "INPUT_IDS",
    "MAX_TOKENS",
    "MESSAGES",
    "METRICS",
    "OPTIONAL_INPUTS",
    "OUTCOMES",
    "OVERLOADED",
    "PARSE_SPECIAL_TOKENS",
    "PREPROCESSING_INPUTS",
    "PREPROCESSING_OUTPUTS",
    "SPEC_DECODE_INPUTS",
    "SPEC_DECODE_OUTPUTS",
    "TEXT_INPUT",
    "TEXT_OUTPUT",
    "VERIFICATION_GREEDY",
    "VERIFICATION_SAMPLED",
    "CallerOptions",
    "CancelBoard",
    "EnsembleSettings",
    "Generations",
    "ErrorCode",
    "GenerateRequest",
    "InFlight",
    "InputError",
    "MetricSpec",
    "MetricsBackend",
    "PreprocessingSettings",
    "RequestCancelled",
    "RequestLimits",
    "RequestTiming",
    "ResponseBuilder",
    "ResponseSink",
    "SettingsError",
    "SpecDecodeSettings",
    "SpecMetrics",
    "available_memory_bytes",
    "check_kv_budget",
    "check_prompt_bytes",
    "coded_error_message",
    "decode_error_message",
    "error_of_outputs",
    "error_outputs",
    "encode_text",
    "engine_facts",
    "batch_row_outputs",
    "error_code",
    "error_message",
    "is_final_response",
    "load_tokenizer",
    "outcome_of",
    "parse_generate_request",
    "preprocess",
    "prompt_ids",
    "response_tensors",
    "split_batch",
    "run_generation",
    "verify_engine",
]
