"""One request on its own tritonserver gRPC stream, for the asyncio fronts (the OpenAI API, the HTTP front): its
responses as they come, every failure as a `StreamError` with the Triton code, and the request cancelled on the
server whenever the caller stops early (its client went away).

Errors: requests ask for coded errors (model_repo.bls.CODED_ERRORS_PARAMETER), so a model's error arrives as
"[CODE] message" (or, from spec_decode, as a final response whose finish_reason is "error"); a stream the server
drops (it died, or was stopped) is UNAVAILABLE, so a client that has started reading still gets an error, never a
silent end.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import numpy as np

from deploy.client import output_text
from model_repo.errors import ErrorCode, decode_error_message
from runtime.errors import SpectreeError


class StreamError(SpectreeError, RuntimeError):
    """A request's stream ended with an error: `code` (model_repo.errors.ErrorCode) and the server's message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def of_message(cls, message: str) -> StreamError:
        """From a Triton error message ("[CODE] message" when coded; anything else is INTERNAL)."""
        return cls(*decode_error_message(message))


def _is_final(result: Any) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


async def stream_request(client: Any, model: str, inputs: Mapping[str, np.ndarray], timeout_s: float,
                         parameters: Mapping[str, Any] | None = None, version: str = "") -> AsyncIterator[Any]:
    """Yield each tritonclient InferResult of one request to `model` (a decoupled model) up to its final one.

    client: a tritonclient.grpc.aio.InferenceServerClient; inputs: name -> array, shapes as the model takes them;
    parameters: request parameters (str / int / float / bool values); version: "" for the model's default.
    Raises StreamError on an error response or a dropped stream. Leaving the loop early (or closing this
    generator) cancels the gRPC stream, and the server stops the generation at its next step."""
    import grpc
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    from model_repo.bls import CODED_ERRORS_PARAMETER, ERROR_FINISH_REASON  # (imports the request parser: torch)

    tensors = []
    for name, value in inputs.items():
        t = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        tensors.append(t)

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": model, "model_version": version, "inputs": tensors, "request_id": uuid.uuid4().hex,
               "parameters": {**(parameters or {}), CODED_ERRORS_PARAMETER: True}}

    responses = client.stream_infer(inputs_iterator=requests(), stream_timeout=timeout_s)
    ended = False  # the server closed the stream: nothing to cancel
    try:
        try:
            async for result, error in responses:
                if error is not None:
                    raise StreamError.of_message(error.message() if hasattr(error, "message") else str(error))
                final = _is_final(result)
                if final and output_text(result, "finish_reason") == ERROR_FINISH_REASON:  # spec_decode's coded error
                    raise StreamError.of_message(output_text(result, "text_output") or "")
                if final:
                    # Let the server close the stream (it does after the final response: the request side is
                    # already closed) rather than cancel it: a cancelled stream keeps the model's request alive in
                    # tritonserver 2.51 (the model then never unloads at shutdown).
                    async for _ in responses:
                        pass
                    ended = True
                    yield result
                    return
                yield result
        except grpc.RpcError as exc:  # the server dropped the stream (it died or is stopping), or the deadline
            ended = True
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise StreamError(ErrorCode.UNAVAILABLE, f"{model}: no final response within {timeout_s:g} s") \
                    from None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise StreamError(ErrorCode.UNAVAILABLE, f"the server closed the stream ({details}); the request did "
                              "not finish") from None
        ended = True
        raise StreamError(ErrorCode.INTERNAL, f"{model} ended the stream without a final response")
    finally:
        if not ended:
            responses.cancel()


__all__ = ["StreamError", "stream_request"]
