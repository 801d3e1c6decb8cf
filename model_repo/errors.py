"""Serving errors and the Triton error codes they become: a bad request is a runtime.errors.RequestError whose
message names the input (INVALID_ARG), a bad config.pbtxt parameter a runtime.errors.ConfigError
(model_repo.settings), RequestCancelled a request its client cancelled; `error_code` / `error_message` say what a
client gets for any exception, `coded_error_message` / `decode_error_message` carry the code through a BLS call."""

from __future__ import annotations

import enum

from runtime.errors import OverloadedError, RequestError, SpectreeError


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


def coded_error_message(exc: BaseException) -> str:
    return f"[{error_code(exc).value}] {error_message(exc)}"


def decode_error_message(message: str) -> tuple[ErrorCode, str]:
    """(code, message) of a coded error message; anything else is INTERNAL, as it came."""
    if message.startswith("["):
        name, sep, rest = message[1:].partition("] ")
        if sep and name in ErrorCode.__members__:
            return ErrorCode[name], rest
    return ErrorCode.INTERNAL, message


__all__ = [
    "OVERLOADED",
    "ErrorCode",
    "RequestCancelled",
    "coded_error_message",
    "decode_error_message",
    "error_code",
    "error_message",
]
