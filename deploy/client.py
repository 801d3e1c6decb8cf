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

from runtime.errors import SpectreeError


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
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    end_id: int | None = None,
    exclude_input_in_output: bool | None = None,
    sampling_parameters: dict[str, Any] | None = None,
    extra: Mapping[str, np.ndarray] | None = None,
    batched: bool = False,
) -> list[Any]:
    """tritonclient InferInputs in the Triton LLM conventions (only the options given are sent). A text prompt
    goes as text_input; chat messages ([{"role": ..., "content": ...}, ...]) as the JSON `messages` input, which
    the server validates and renders with the model's chat template. extra: more inputs, name -> [1]-shaped array
    (e.g. {"min_tokens": np.array([4], np.int32)}). batched: for a model with max_batch_size > 0 (the ensemble,
    tensorrtllm_backend's shapes), every input gets a leading batch dimension of 1 ([[prompt]])."""
    if isinstance(prompt, str):
        name, raw = "text_input", prompt.encode("utf-8")
    else:
        name, raw = "messages", json.dumps([dict(m) for m in prompt], ensure_ascii=False).encode("utf-8")
    inputs = [
        _tensor(name, np.array([raw], dtype=np.object_), "BYTES"),
        _tensor("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
        _tensor("stream", np.array([stream], dtype=np.bool_), "BOOL"),
    ]
    optional = (
        ("temperature", temperature, np.float32, "FP32"),
        ("top_k", top_k, np.int32, "INT32"),
        ("top_p", top_p, np.float32, "FP32"),
        ("random_seed", seed, np.uint64, "UINT64"),
        ("end_id", end_id, np.int32, "INT32"),
        ("exclude_input_in_output", exclude_input_in_output, np.bool_, "BOOL"),
    )
    for name, value, dtype, wire in optional:
        if value is not None:
            inputs.append(_tensor(name, np.array([value], dtype=dtype), wire))
    if stop:
        inputs.append(_tensor("stop_words", np.array([s.encode("utf-8") for s in stop], dtype=np.object_), "BYTES"))
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


def _text(result: Any, name: str) -> str | None:
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
        text=_text(result, "text_output") or "",
        token_ids=() if ids is None else tuple(int(t) for t in ids.reshape(-1)),
        final=final,
        finish_reason=_text(result, "finish_reason"),
        verification=_text(result, "verification"),
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
    read from the model's config unless given)."""
    options.setdefault("batched", model_batches(url, model))
    return stream_infer(url, model, build_inputs(prompt, max_tokens, **options), timeout_s)


__all__ = ["ClientError", "PromptLike", "StreamEvent", "build_inputs", "event_of", "generate_stream",
           "model_batches", "stream_infer"]
