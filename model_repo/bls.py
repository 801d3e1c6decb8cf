"""The ensemble model's calls to preprocessing and spec_decode (BLS): the request parameters it sets
(CANCEL_TOKEN_PARAMETER, CODED_ERRORS_PARAMETER; parsed by model_repo.settings.CallerOptions), cancellation
across models (`CancelBoard`), its bound on requests held at once (`InFlight`), and the hand-over of an error as a
final response (`error_outputs` / `error_of_outputs`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from model_repo.errors import OVERLOADED, ErrorCode, coded_error_message, decode_error_message
from runtime.errors import OverloadedError

# The ensemble model calls preprocessing and spec_decode as BLS requests with two request parameters. Tritonserver
# 2.51's python backend hands a BLS caller every error as INTERNAL (the code is dropped), so a caller that asks
# gets its errors as "[CODE] message" and restores the code; and spec_decode watches the caller's cancel token.
# Also measured on 2.51: an error response a decoupled model sends a BLS caller from a thread other than execute's
# (a generation that failed or was cancelled mid-way) never reaches the caller, which then waits forever. So
# spec_decode ends a BLS caller's request with a normal final response instead (`error_outputs`), which the caller
# turns back into the error (`error_of_outputs`).

CANCEL_TOKEN_PARAMETER = "spectree_cancel_token"  # the request's mark on the CancelBoard
CODED_ERRORS_PARAMETER = "spectree_coded_errors"  # true: error messages start with "[CODE] "
ERROR_FINISH_REASON = "error"  # finish_reason of a final response that carries an error (BLS callers only)


def error_outputs(exc: BaseException) -> dict[str, np.ndarray]:
    """A final response standing for an error: finish_reason "error", text_output the coded message."""
    from model_repo.responses import string_tensor  # (imported here: this module stays light for deploy/server.py)

    return {"text_output": string_tensor(coded_error_message(exc)),
            "finish_reason": string_tensor(ERROR_FINISH_REASON)}


def error_of_outputs(outputs: Mapping[str, np.ndarray]) -> tuple[ErrorCode, str] | None:
    """(code, message) when a response made by `error_outputs`, else None."""
    from model_repo.request import text_value

    reason = outputs.get("finish_reason")
    if reason is None or text_value(np.asarray(reason).reshape(-1)[0], "finish_reason") != ERROR_FINISH_REASON:
        return None
    return decode_error_message(text_value(np.asarray(outputs["text_output"]).reshape(-1)[0], "text_output"))


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

        return cls.for_server(os.getppid())

    @classmethod
    def for_server(cls, server_pid: int) -> CancelBoard:
        """The board of the tritonserver with this pid (run by this user)."""
        import os
        import tempfile

        return cls(Path(tempfile.gettempdir()) / f"spectree-cancel-{os.getuid()}-{server_pid}")

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

    def remove(self) -> None:
        """Remove the board and its marks (once its server has stopped: a stub killed before its finalize leaves
        them)."""
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)


class InFlight:
    """A counter of requests a model holds at once; `enter` beyond `limit` raises OverloadedError. on_change(count)
    is told every new count (in order: called under the counter's lock)."""

    def __init__(self, limit: int, what: str, on_change: Callable[[int], None] | None = None) -> None:
        self.limit = limit
        self.what = what  # names the setting in the message
        self._n = 0
        self._lock = threading.Lock()
        self._on_change = on_change

    @property
    def count(self) -> int:
        return self._n

    def enter(self) -> None:
        with self._lock:
            if self._n >= self.limit:
                raise OverloadedError(f"{OVERLOADED} {self._n} requests in flight ({self.what} {self.limit}); "
                                      "retry later")
            self._n += 1
            if self._on_change is not None:
                self._on_change(self._n)

    def leave(self) -> None:
        with self._lock:
            if self._n <= 0:
                raise RuntimeError("InFlight.leave without a matching enter")
            self._n -= 1
            if self._on_change is not None:
                self._on_change(self._n)


__all__ = [
    "CANCEL_TOKEN_PARAMETER",
    "CODED_ERRORS_PARAMETER",
    "ERROR_FINISH_REASON",
    "CancelBoard",
    "InFlight",
    "error_of_outputs",
    "error_outputs",
]
