"""A streaming gRPC client for the served pipeline (tritonclient), and what `python -m deploy client` prints.

    for event in generate_stream("127.0.0.1:8001", "ensemble", "Once upon a time", max_tokens=64):
        print(event.text, end="", flush=True)
    chat = [{"role": "user", "content": "Tell me a story."}]       # a chat prompt: the `messages` input
    for event in generate_stream("127.0.0.1:8001", "ensemble", chat, max_tokens=64): ...

Closing the iterator early (or leaving the loop) cancels the request on the server (gRPC stream cancellation).
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.errors import SpectreeError


class ClientError(SpectreeError, RuntimeError):
    """The server answered a request with an error (the message is the server's)."""


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
) -> list[Any]:
    """tritonclient InferInputs in the Triton LLM conventions (only the options given are sent). A text prompt
    goes as text_input; chat messages ([{"role": ..., "content": ...}, ...]) as the JSON `messages` input, which
    the server validates and renders with the model's chat template."""
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
    return inputs


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

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    finished = False
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            try:
                result, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise ClientError(f"{model}: no response within {timeout_s:.0f} s") from None
            if error is not None:
                finished = True
                raise ClientError(error.message() if hasattr(error, "message") else str(error))
            event = event_of(result)
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
    """Stream a generation (text deltas as they arrive); prompt and options as in `build_inputs`."""
    return stream_infer(url, model, build_inputs(prompt, max_tokens, **options), timeout_s)


__all__ = ["ClientError", "PromptLike", "StreamEvent", "build_inputs", "event_of", "generate_stream", "stream_infer"]
