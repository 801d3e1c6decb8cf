"""A request's inputs, read and validated before it costs anything: `parse_generate_request` (spec_decode's
inputs -> a GenerateRequest: it reads the request contract's fields, runtime.request_fields, from their tensors or
from vLLM's sampling keys, and the contract checks them, every error a runtime.errors.RequestError naming the
input), `RequestLimits` (the server's limits), `split_batch` (the ensemble's batch rows), and the tokenizer stage
(`preprocess`, `prompt_ids`)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model_repo.contract import (
    INPUT_IDS,
    MESSAGES,
    NUMPY_DTYPES,
    PARSE_SPECIAL_TOKENS,
    PREPROCESSING_INPUTS,
    SPEC_DECODE_INPUTS,
    TEXT_INPUT,
    Inputs,
)
from model_repo.model_config import DataType, ModelInput
from runtime.errors import ConfigError, RequestError
from runtime.request_fields import (
    FIELDS,
    REQUEST_FIELDS,
    VLLM_DEFAULTS,
    VLLM_KEYS,
    RequestField,
    SamplingParams,
    sampling_params,
    vllm_values,
)
from runtime.tokenizer import ChatMessage, chat_messages, check_unicode

# ---- reading inputs -------------------------------------------------------------------------------------


def _array(inputs: Inputs, spec: ModelInput) -> np.ndarray | None:
    value = inputs.get(spec.name)
    if value is None:
        return None
    arr = np.asarray(value)
    expected = NUMPY_DTYPES[spec.data_type]
    ok = arr.dtype == expected or (spec.data_type is DataType.TYPE_STRING and arr.dtype.kind in ("S", "U", "O"))
    if not ok:
        raise RequestError(f"{spec.name}: expected {spec.data_type.wire} ({spec.data_type.name}), "
                           f"got numpy {arr.dtype}")
    return arr


def _scalar(inputs: Inputs, spec: ModelInput) -> Any:
    arr = _array(inputs, spec)
    if arr is None:
        return None
    if arr.size != 1:
        raise RequestError(f"{spec.name}: expected exactly one value (shape [1]), got shape {list(arr.shape)}")
    value = arr.reshape(-1)[0]
    if spec.data_type is DataType.TYPE_STRING:
        return text_value(value, spec.name)
    return value.item()


def text_value(value: Any, name: str) -> str:
    """One element of a STRING tensor as text (UTF-8); RequestError names the input `name`."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"{name}: not valid UTF-8 ({exc})") from exc
    if isinstance(value, str):
        check_unicode(value, name)
        return value
    raise RequestError(f"{name}: expected text (bytes), got {type(value).__name__}")


def _texts(inputs: Inputs, spec: ModelInput) -> tuple[str, ...]:
    arr = _array(inputs, spec)
    if arr is None:
        return ()
    return tuple(text_value(v, spec.name) for v in arr.reshape(-1))


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
        raise RequestError(f"messages: not valid JSON ({exc}); expected a JSON array of {{role, content}}") from exc
    check_unicode(data, MESSAGES.name)  # JSON escapes can spell lone surrogates ("\ud800"), UTF-8 cannot
    return chat_messages(data, MESSAGES.name)


def _text_or_messages(inputs: Inputs, ids_given: bool = False) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
    """(text_input, messages): exactly one of them, or neither when the prompt came as input_ids."""
    text = _scalar(inputs, TEXT_INPUT)
    messages = _messages(inputs)
    if text is not None and messages is not None:
        raise RequestError("text_input and messages: both given; give exactly one (text_input: the prompt text, "
                         "messages: a JSON array of {role, content})")
    if text is None and messages is None and not ids_given:
        raise RequestError("text_input: missing; expected the prompt text (STRING [1]), or messages (a JSON array of "
                         "{role, content})")
    if text is not None and not text and not ids_given:
        raise RequestError("text_input: empty; expected a non-empty prompt")
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
                raise ConfigError(f"RequestLimits.{name} must be an int >= 1, got {v!r}")


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
            raise RequestError(f"{spec.name}: {size} bytes; this server takes prompts of at most {limit} bytes "
                             "(max_prompt_bytes)")


def _check_stop(stop: Any, source: str, limits: RequestLimits) -> None:
    if not isinstance(stop, (list, tuple)):
        return  # SamplingParams names the type error
    if limits.max_stop_words is not None and len(stop) > limits.max_stop_words:
        raise RequestError(f"{source}: {len(stop)} stop strings; this server takes at most {limits.max_stop_words} "
                         "(max_stop_words)")
    if limits.max_stop_word_bytes is not None:
        for i, word in enumerate(stop):
            size = len(word.encode("utf-8")) if isinstance(word, str) else 0
            if size > limits.max_stop_word_bytes:
                raise RequestError(f"{source}[{i}]: {size} bytes; this server takes stop strings of at most "
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


REQUEST_PARAMETERS = "parameters"  # the source name of sampling fields read from the request's parameters


def _sampling_json(text: str) -> dict[str, Any]:
    name = "sampling_parameters"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"{name}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise RequestError(f"{name}: expected a JSON object, got {type(data).__name__}")
    check_unicode(data, name)
    unknown = sorted(set(data) - set(VLLM_KEYS))
    if unknown:
        raise RequestError(f"{name}: unknown key(s) {unknown}; accepted: {sorted(VLLM_KEYS)}")
    return vllm_values(data, name, text=True)


def tensor_values(inputs: Inputs,
                  fields: tuple[RequestField, ...] = REQUEST_FIELDS) -> tuple[dict[str, Any], dict[str, str]]:
    """The values of the request contract's scalar fields that the request's tensors carry (each field from one of
    its tensors: tensorrtllm_backend's current name or an older one), and the tensor each came from; a one-value
    field (num_return_sequences, beam_width) is refused unless 1. The list fields (stop_words, bad_words) are the
    caller's."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for field in fields:
        if field.listed:
            continue
        for name in field.wire.tensors:
            value = _scalar(inputs, _SPEC[name])
            if value is None:
                continue
            if field.refuses(value):
                raise RequestError(f"{name}: {value}; this server generates one sequence per request (tree "
                                   "speculative decoding with lossless verification has no beam search): send 1, "
                                   "or send the request again with another seed")
            if field.only is not None:
                continue
            if field.name in values:
                current, *older = field.wire.tensors
                raise RequestError(f"{' and '.join(field.wire.tensors)}: both given; give one ({current} is "
                                   f"tensorrtllm_backend's current name, {', '.join(older)} its older one)")
            values[field.name], origin[field.name] = value, name
    return values, origin


def _bad_words(words: Any, source: str, tokenizer: Any, limits: RequestLimits) -> tuple[tuple[int, ...], ...]:
    """Bad words (text) -> token-id sequences, each encoded on its own as tensorrtllm_backend's preprocessing does
    (no BOS, special-token text literal); at most max_stop_words of max_stop_word_bytes each."""
    if isinstance(words, str):
        words = [words]
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise RequestError(f"{source}: expected a list of strings, got {words!r}"[:200])
    words = [w for w in words if w]
    if limits.max_stop_words is not None and len(words) > limits.max_stop_words:
        raise RequestError(f"{source}: {len(words)} bad words; this server takes at most {limits.max_stop_words} "
                         "(max_stop_words)")
    for i, word in enumerate(words):
        if limits.max_stop_word_bytes is not None and len(word.encode("utf-8")) > limits.max_stop_word_bytes:
            raise RequestError(f"{source}[{i}]: {len(word.encode('utf-8'))} bytes; this server takes bad words of at "
                             f"most {limits.max_stop_word_bytes} bytes (max_stop_word_bytes)")
    if words and tokenizer is None:
        raise RequestError(f"{source}: this model has no tokenizer to encode bad words with")
    return tuple(ids for ids in (tuple(tokenizer.encode(w, add_bos=False, parse_special=False)) for w in words)
                 if ids)


def parse_generate_request(inputs: Inputs, limits: RequestLimits, tokenizer: Any = None,
                           parameters: Mapping[str, Any] | None = None) -> GenerateRequest:
    """Triton-style inputs (name -> numpy array) -> a validated GenerateRequest; RequestError names the input.
    tokenizer: encodes bad_words (a request with bad words needs it). parameters: the request's parameters; as
    vllm_backend does, their vLLM sampling keys are read when there is no sampling_parameters input (other keys are
    not this parser's: Triton's, the pipeline's own).

    A vllm_backend-shaped request (sampling settings as vLLM's sampling_parameters JSON, or as request parameters)
    gets vLLM's defaults for what it leaves out (runtime.request_fields.VLLM_DEFAULTS: 16 tokens, temperature 1.0);
    a request of tensors alone (tensorrtllm_backend's shape) must give max_tokens, and is greedy unless it gives a
    temperature (SamplingParams' defaults)."""
    unknown = sorted(set(inputs) - set(_SPEC))
    if unknown:
        raise RequestError(f"unknown input(s) {unknown}; this model takes {sorted(_SPEC)}")
    check_prompt_bytes(inputs, limits.max_prompt_bytes)
    ids_arr = _array(inputs, _SPEC["input_ids"])
    text, messages = _text_or_messages(inputs, ids_given=ids_arr is not None)
    prompt: str | tuple[int, ...] | tuple[ChatMessage, ...]
    if ids_arr is not None:
        if ids_arr.size == 0:
            raise RequestError("input_ids: empty; expected at least one token id")
        ids = tuple(int(t) for t in ids_arr.reshape(-1))
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestError(f"input_ids: token ids must be in [0, {limits.vocab_size}), got {bad[:5]}")
        prompt, source = ids, "input_ids"
    elif messages is not None:
        prompt, source = messages, "messages"
    else:
        prompt, source = text, "text_input"

    # SamplingParams fields, each with the input it came from: the contract checks them (the one check), and its
    # error is restated here in the input's name.
    fields, origin = tensor_values(inputs)

    def given(key: str, value: Any, wire: str) -> None:
        fields[key] = value
        origin[key] = wire

    stop_arr = _array(inputs, _SPEC["stop_words"])
    if stop_arr is not None:  # counted before decoding (empty entries are padding, as in trtllm, but count here)
        _check_stop(list(stop_arr.reshape(-1)), "stop_words", limits)
    stop = tuple(s for s in _texts(inputs, _SPEC["stop_words"]) if s)
    if stop:
        given("stop", stop, "stop_words")
    bad_arr = _array(inputs, _SPEC["bad_words"])
    if bad_arr is not None:
        count = sum(1 for v in bad_arr.reshape(-1) if len(v))  # counted before decoding; "" entries are padding
        if limits.max_stop_words is not None and count > limits.max_stop_words:
            raise RequestError(f"bad_words: {count} bad words; this server takes at most {limits.max_stop_words} "
                             "(max_stop_words)")
        bad = _bad_words(list(_texts(inputs, _SPEC["bad_words"])), "bad_words", tokenizer, limits)
        if bad:
            given("bad_words", bad, "bad_words")
    pad_id = _scalar(inputs, _SPEC["pad_id"])
    if pad_id is not None and not 0 <= pad_id < limits.vocab_size:  # accepted: responses are never padded
        raise RequestError(f"pad_id: expected a token id in [0, {limits.vocab_size}), got {pad_id}")
    end_id = _scalar(inputs, _SPEC["end_id"])
    if end_id is not None:
        if not 0 <= end_id < limits.vocab_size:
            raise RequestError(f"end_id: expected a token id in [0, {limits.vocab_size}), got {end_id}")
        # end_id replaces the model's EOS tokens (tensorrtllm_backend's meaning).
        given("stop_token_ids", (end_id,), "end_id")
        given("ignore_eos", True, "end_id")
    sp_text = _scalar(inputs, _SPEC["sampling_parameters"])
    vllm_source = None  # where a vllm_backend-shaped request's sampling settings came from
    if sp_text is not None and sp_text.strip():
        vllm_source, json_fields = "sampling_parameters", _sampling_json(sp_text)
    elif parameters and set(parameters) & set(VLLM_KEYS):
        check_unicode(dict(parameters), REQUEST_PARAMETERS)
        vllm_source = REQUEST_PARAMETERS
        json_fields = vllm_values({k: v for k, v in parameters.items() if k in VLLM_KEYS}, REQUEST_PARAMETERS,
                                  text=True)
    if vllm_source is not None:
        _check_stop(json_fields.get("stop"), f"{vllm_source}.stop", limits)
        if "bad_words" in json_fields:
            json_fields["bad_words"] = _bad_words(json_fields["bad_words"], f"{vllm_source}.bad_words",
                                                  tokenizer, limits)
        for key, value in json_fields.items():
            if key in fields:
                tensor = " / ".join(FIELDS[key].wire.tensors) or origin[key]
                raise RequestError(f"{vllm_source}: {key!r} is also given as the input {tensor!r}; give it once")
            given(key, value, f"{vllm_source}.{key}")
        for key, default in VLLM_DEFAULTS.items():
            if key not in fields:
                given(key, default, f"{vllm_source} (vLLM's default {key} {default})")
    if stop:
        _check_stop(list(stop), "stop_words", limits)  # byte sizes, now decoded

    if "max_tokens" not in fields:
        raise RequestError("max_tokens: missing; expected INT32 [1] (or max_tokens in sampling_parameters)")
    # Log-probabilities come back when return_log_probs is set or alternatives were asked for (num_top_log_probs,
    # or vLLM's sampling_parameters.logprobs).
    return_log_probs = bool(_scalar(inputs, _SPEC["return_log_probs"])) or fields.get("logprobs") is not None
    if return_log_probs and fields.get("logprobs") is None:
        given("logprobs", 0, "return_log_probs")
    params = sampling_params(fields, origin)
    if params.max_tokens > limits.max_tokens:
        raise RequestError(f"{origin['max_tokens']}: {params.max_tokens} is above this server's limit of "
                         f"{limits.max_tokens}")
    top_log_probs = params.logprobs or 0

    stream = _scalar(inputs, _SPEC["stream"])
    stream = bool(stream) if stream is not None else False
    exclude = _scalar(inputs, _SPEC["exclude_input_in_output"])
    # Default as tensorrtllm_backend: a streamed response never repeats the prompt, a whole one includes it
    # (when there is prompt text to repeat: a request of token ids or messages gets the generated text only).
    exclude = (stream or text is None) if exclude is None else bool(exclude)
    echo = ""
    if not exclude:
        if text is None:
            raise RequestError("exclude_input_in_output: false needs text_input (the prompt text to echo); a "
                             "prompt of input_ids alone or of messages has no text to echo")
        echo = text
    parse_special = _scalar(inputs, PARSE_SPECIAL_TOKENS)
    return GenerateRequest(prompt=prompt, prompt_source=source, echo=echo, params=params, stream=stream,
                           parse_special_tokens=bool(parse_special),
                           return_log_probs=return_log_probs,
                           top_log_probs=top_log_probs,
                           return_num_input_tokens=bool(_scalar(inputs, _SPEC["return_num_input_tokens"])),
                           return_num_output_tokens=bool(_scalar(inputs, _SPEC["return_num_output_tokens"])))


# ---- the ensemble's batch dimension (tensorrtllm_backend's shapes: model_repo.contract) ----------------


def split_batch(inputs: Inputs) -> list[dict[str, np.ndarray]]:
    """A batched request's inputs (name -> [batch, ...]) -> one spec_decode request's inputs per row.

    As tensorrtllm_backend does, a streamed response never repeats the prompt, whatever exclude_input_in_output
    says (its end_to_end_grpc_client.py sends false and expects no prompt when streaming)."""
    batch = None
    for name, value in inputs.items():
        arr = np.asarray(value)
        if arr.ndim < 2:
            raise RequestError(f"{name}: shape {list(arr.shape)}; this model batches (max_batch_size > 0), so every "
                             "input is [batch, ...]: send [[value]] for one request, e.g. text_input [1, 1]")
        if batch is None:
            batch = arr.shape[0]
        elif arr.shape[0] != batch:
            raise RequestError(f"{name}: batch size {arr.shape[0]}, but other inputs have {batch}; every input needs "
                             "the same batch size")
    if not batch:
        raise RequestError("text_input: missing; expected the prompt text ([batch, 1] STRING), or messages")
    rows = [{name: np.asarray(value)[b] for name, value in inputs.items()} for b in range(batch)]
    for row in rows:
        stream = row.get("stream")
        if stream is not None and stream.size == 1 and bool(stream.reshape(-1)[0]):
            row["exclude_input_in_output"] = np.array([True])
    return rows


# ---- preprocessing (the tokenizer stage) ----------------------------------------------------------------


def preprocess(inputs: Inputs, tokenizer: Any, max_context: int,
               max_prompt_bytes: int | None = None) -> dict[str, np.ndarray]:
    """text_input or messages -> input_ids INT32 [n], input_length INT32 [1]; the ids `encode_text` makes of the
    text (BOS first when the model has one; special-token text literal unless parse_special_tokens) or the chat
    template's ids of the messages (special-token text in their content literal, unless parse_special_tokens: see
    `Tokenizer.apply_chat_template`). The prompt's size is checked against
    max_prompt_bytes before anything decodes it."""
    unknown = sorted(set(inputs) - {i.name for i in PREPROCESSING_INPUTS})
    if unknown:
        raise RequestError(f"unknown input(s) {unknown}; preprocessing takes {[i.name for i in PREPROCESSING_INPUTS]}")
    check_prompt_bytes(inputs, max_prompt_bytes)
    text, messages = _text_or_messages(inputs)
    parse_special = bool(_scalar(inputs, PARSE_SPECIAL_TOKENS))
    if messages is not None:
        source = MESSAGES.name
        try:  # the chat template's own special tokens; content's special-token text literal unless parse_special
            ids = tokenizer.apply_chat_template(messages, parse_special=parse_special)
        except RequestError as exc:  # no chat template, the template refused the conversation, a forged role
            raise RequestError(f"messages: {exc}") from exc
    else:
        source = TEXT_INPUT.name
        ids = encode_text(tokenizer, text, parse_special)
    if len(ids) >= max_context:
        raise RequestError(
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
    text is encoded by `encode_text`, messages by the chat template (`Tokenizer.apply_chat_template`)."""
    prompt: Any = request.prompt
    source = request.prompt_source
    try:
        if source != INPUT_IDS.name and decoder.tokenizer is None:
            raise RequestError(f"the prompt is {source} but this model has no tokenizer; send input_ids instead")
        if source == TEXT_INPUT.name:
            prompt = encode_text(decoder.tokenizer, prompt, request.parse_special_tokens)
        elif source == MESSAGES.name:
            prompt = decoder.tokenizer.apply_chat_template(prompt, parse_special=request.parse_special_tokens)
        return decoder.encode_prompt(prompt)
    except RequestError as exc:  # too long for the context, bad ids, no chat template, a forged role
        raise RequestError(f"{source}: {exc}") from exc


__all__ = [
    "GenerateRequest",
    "RequestLimits",
    "RequestTiming",
    "check_prompt_bytes",
    "encode_text",
    "parse_generate_request",
    "preprocess",
    "prompt_ids",
    "split_batch",
    "tensor_values",
    "text_value",
]
