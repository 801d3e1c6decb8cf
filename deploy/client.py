"""A streaming gRPC client for the served pipeline (tritonclient), and what `python -m deploy client` prints.

    for event in generate_stream("127.0.0.1:8001", "ensemble", "Once upon a time", max_tokens=64):
        print(event.text, end="", flush=True)
    chat = [{"role": "user", "content": "Tell me a story."}]       # a chat prompt: the `messages` input
    for event in generate_stream("127.0.0.1:8001", "ensemble", chat, max_tokens=64): ...

Closing the iterator early (or leaving the loop) cancels the request on the server (gRPC stream cancellation).

Error codes: a gRPC stream carries an error response as a bare message. Requests ask for coded errors (request
parameter spectree_coded_errors, model_repo.bls.CODED_ERRORS_PARAMETER), so the server's messages come as
"[CODE] message" (or, from spec_decode, as a final response whose finish_reason is "error"); ClientError carries the
code: INVALID_ARG (a bad request), UNAVAILABLE (overloaded: retry later), CANCELLED, INTERNAL. Tritonserver's own
`triton_grpc_error: true` stream header would end the stream with the gRPC status instead, but in 2.51 that mode
can crash the server (a use after free, fixed upstream in 2026, server #8708; measured here: SIGSEGV), so it is
not used.
"""

from __future__ import annotations

import functools
import json
import queue
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.errors import RequestError, SpectreeError
from runtime.request_fields import FIELDS, REQUEST_FIELDS, sampling_params


class ClientError(SpectreeError, RuntimeError):
    """The server answered a request with an error (the message is the server's; `code` the Triton error code,
    model_repo.errors.ErrorCode's value: "INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL"; None when the
    answer did not come from a model, e.g. "no response within N s")."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code

    @property
    def unavailable(self) -> bool:
        """The server could not take the request now (overloaded: every slot and the queue full): retry later."""
        return self.code == "UNAVAILABLE"


def _server_error(message: str) -> ClientError:
    from model_repo.errors import decode_error_message

    code, text = decode_error_message(message)
    return ClientError(text, code.value)


@dataclass(frozen=True)
class StreamEvent:
    """One response: its text delta and token ids; the final one also carries the request's stats."""

    text: str
    token_ids: tuple[int, ...]
    final: bool
    finish_reason: str | None = None
    verification: str | None = None
    tau: float | None = None
    accepted_per_step: tuple[int, ...] | None = None


def _tensor(name: str, value: np.ndarray, datatype: str) -> Any:
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(value.shape), datatype)
    t.set_data_from_numpy(value)
    return t


PromptLike = str | Sequence[Mapping[str, str]]  # text (text_input) or chat messages (messages, sent as JSON)


def build_inputs(
    prompt: PromptLike,
    max_tokens: int,
    *,
    stream: bool = True,
    end_id: int | None = None,
    exclude_input_in_output: bool | None = None,
    sampling_parameters: dict[str, Any] | None = None,
    extra: Mapping[str, np.ndarray] | None = None,
    batched: bool = False,
    **sampling: Any,
) -> list[Any]:
    """tritonclient InferInputs in the Triton LLM conventions (only the options given are sent). A text prompt
    goes as text_input; chat messages ([{"role": ..., "content": ...}, ...]) as the JSON `messages` input, which
    the server validates and renders with the model's chat template. sampling: fields of the request contract
    that Triton inputs carry (runtime.request_fields: temperature, top_k, top_p, seed, stop, min_tokens, the
    penalties, ...; None or an empty list: not sent), each as its input (tensorrtllm_backend's current name and
    type). extra: more inputs, name -> [1]-shaped array (e.g. {"parse_special_tokens": np.array([True])}). batched:
    for a model with max_batch_size > 0 (the ensemble, tensorrtllm_backend's shapes), every input gets a leading
    batch dimension of 1 ([[prompt]])."""
    if isinstance(prompt, str):
        name, raw = "text_input", prompt.encode("utf-8")
    else:
        name, raw = "messages", json.dumps([dict(m) for m in prompt], ensure_ascii=False).encode("utf-8")
    inputs = [
        _tensor(name, np.array([raw], dtype=np.object_), "BYTES"),
        _field_tensor("max_tokens", max_tokens),
        _tensor("stream", np.array([stream], dtype=np.bool_), "BOOL"),
    ]
    for key, value in sampling.items():
        field = FIELDS.get(key)
        if field is None or not field.wire.tensors or key == "max_tokens":
            raise TypeError(f"build_inputs() got an unexpected keyword argument {key!r} (the request contract's "
                            f"fields sent as inputs: {', '.join(_TENSOR_FIELDS)})")
        if value is not None and (not field.listed or len(field.listing(value))):
            inputs.append(_field_tensor(key, value))
    for name, value, dtype, wire in (("end_id", end_id, np.int32, "INT32"),
                                     ("exclude_input_in_output", exclude_input_in_output, np.bool_, "BOOL")):
        if value is not None:
            inputs.append(_tensor(name, np.array([value], dtype=dtype), wire))
    if sampling_parameters is not None:
        raw = json.dumps(sampling_parameters).encode("utf-8")
        inputs.append(_tensor("sampling_parameters", np.array([raw], dtype=np.object_), "BYTES"))
    if extra:
        from tritonclient.utils import np_to_triton_dtype

        for name, value in extra.items():
            arr = np.asarray(value)
            inputs.append(_tensor(name, arr, np_to_triton_dtype(arr.dtype)))
    if batched:
        for t in inputs:
            t.set_shape([1, *t.shape()])
    return inputs


_TENSOR_FIELDS = tuple(f.name for f in REQUEST_FIELDS if f.wire.tensors and f.name != "max_tokens")


def _wire_array(key: str, value: Any) -> np.ndarray:
    """A request contract field's value as its Triton input carries it ([1], or [n] texts for a list field)."""
    field = FIELDS[key]
    if field.wire.tensor_type == "BYTES":
        return np.array([str(v).encode("utf-8") for v in field.listing(value)], dtype=np.object_)
    from tritonclient.utils import triton_to_np_dtype

    return np.array([value], dtype=triton_to_np_dtype(field.wire.tensor_type))


def _field_tensor(key: str, value: Any) -> Any:
    field = FIELDS[key]
    return _tensor(field.wire.tensors[0], _wire_array(key, value), field.wire.tensor_type)


def check_sampling(max_tokens: int, **sampling: Any) -> None:
    """The request contract's check of the scalar fields `build_inputs` would send (max_tokens and the sampling
    settings, as their inputs carry them: an FP32 input's value is a float32), before anything is sent: a
    ClientError with code INVALID_ARG and the message the server's own check gives. The lists (stop words, bad
    words: the server drops empty entries as padding and encodes bad words) and the one-value fields are the
    server's to check."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in {"max_tokens": max_tokens, **sampling}.items():
        field = FIELDS.get(key)
        if field is None or value is None or not field.wire.tensors or field.listed or field.only is not None:
            continue
        values[key], origin[key] = _wire_array(key, value).item(), field.wire.tensors[0]
    try:
        sampling_params(values, origin)
    except RequestError as exc:
        raise ClientError(str(exc), "INVALID_ARG") from None


@functools.lru_cache(maxsize=64)
def model_batches(url: str, model: str) -> bool:
    """Whether a served model has max_batch_size > 0 (its inputs then carry a batch dimension)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        return client.get_model_config(model).config.max_batch_size > 0
    except Exception as exc:  # noqa: BLE001  (tritonclient raises its own exception type for every failure)
        raise ClientError(f"{model}: cannot read its config from {url}: {exc}") from exc
    finally:
        client.close()


def output_text(result: Any, name: str) -> str | None:
    """A response's STRING output `name` as text (its elements' UTF-8 joined), or None when it is absent."""
    arr = result.as_numpy(name)
    if arr is None:
        return None
    return b"".join(v if isinstance(v, bytes) else str(v).encode() for v in arr.reshape(-1)).decode("utf-8")


def event_of(result: Any) -> StreamEvent:
    ids = result.as_numpy("output_ids")
    tau = result.as_numpy("tau")
    acc = result.as_numpy("accepted_per_step")
    final = result.get_response().parameters["triton_final_response"].bool_param
    return StreamEvent(
        text=output_text(result, "text_output") or "",
        token_ids=() if ids is None else tuple(int(t) for t in ids.reshape(-1)),
        final=final,
        finish_reason=output_text(result, "finish_reason"),
        verification=output_text(result, "verification"),
        tau=None if tau is None else float(tau.reshape(-1)[0]),
        accepted_per_step=None if acc is None else tuple(int(a) for a in acc.reshape(-1)),
    )


def stream_infer(url: str, model: str, inputs: list[Any], timeout_s: float = 120.0) -> Iterator[StreamEvent]:
    """Send one request on its own gRPC stream and yield its responses until the final one.

    Raises ClientError with the server's message on an error response; closing the iterator early cancels the
    request on the server.
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from model_repo.bls import CODED_ERRORS_PARAMETER, ERROR_FINISH_REASON

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    finished = False
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            client.async_stream_infer(model, inputs, enable_empty_final_response=True,
                                      parameters={CODED_ERRORS_PARAMETER: True})
        except InferenceServerException as exc:  # the stream ended before the request went out: why is queued
            try:
                _, error = responses.get(timeout=5)
            except queue.Empty:
                error = exc
            finished = True
            raise _server_error(error.message() if hasattr(error, "message") else str(error)) from None
        while True:
            try:
                result, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise ClientError(f"{model}: no response within {timeout_s:.0f} s") from None
            if error is not None:
                finished = True
                raise _server_error(error.message() if hasattr(error, "message") else str(error))
            event = event_of(result)
            if event.final and event.finish_reason == ERROR_FINISH_REASON:  # spec_decode's coded error response
                finished = True
                raise _server_error(event.text)
            if event.final and not event.text and not event.token_ids and event.finish_reason is None:
                finished = True  # the empty final response that marks the end of a stream
                return
            yield event
            if event.final:
                finished = True
                return
    finally:
        client.stop_stream(cancel_requests=not finished)
        client.close()


def generate_stream(url: str, model: str, prompt: PromptLike, max_tokens: int, timeout_s: float = 120.0,
                    **options: Any) -> Iterator[StreamEvent]:
    """Stream a generation (text deltas as they arrive); prompt and options as in `build_inputs` (batched is
    read from the model's config unless given). Sampling options out of the request contract's bounds are refused
    here (`check_sampling`), as the server would refuse them, before the server is asked anything."""
    check_sampling(max_tokens, **{k: v for k, v in options.items() if k in FIELDS})
    options.setdefault("batched", model_batches(url, model))
    return stream_infer(url, model, build_inputs(prompt, max_tokens, **options), timeout_s)


__all__ = ["ClientError", "PromptLike", "StreamEvent", "build_inputs", "check_sampling", "event_of",
           "generate_stream", "model_batches", "output_text", "stream_infer"]
