"""Exception types shared by the runtime.

Every error raised on bad input names the field or file, the value found and what was expected. Each type
also subclasses the builtin that best describes it, so callers may catch either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class SpectreeError(Exception):
    """Base of every error spectree raises on purpose."""


class ConfigError(SpectreeError, ValueError):
    """A model / drafter / tree / sampling configuration is invalid or unsupported."""


class CheckpointError(SpectreeError, ValueError):
    """A checkpoint directory or file is missing, corrupt, or does not match its config."""


class TokenizerError(SpectreeError, ValueError):
    """tokenizer.json / tokenizer_config.json missing or unusable."""


class CacheError(SpectreeError, RuntimeError):
    """KV-cache misuse: overflow past max_len, bad commit indices, bad truncation."""


class RequestError(SpectreeError, ValueError):
    """A generation request (prompt, sampling parameters, limits) is invalid.

    Made by `invalid` when one field is out of range: `field`, `expected` and `value` then say which, so a front
    end (model_repo.request) can restate the error in its own input names without checking the field again."""

    field: str | None = None  # the SamplingParams field (None: the error is not about one field)
    expected: str = ""
    value: Any = None
    name: str | None = None  # the request's own name for that field, once restated in it (its input, its key)

    @classmethod
    def invalid(cls, field: str, expected: str, value: Any) -> RequestError:
        """'{field} must be {expected}, got {value!r}', with the three kept as attributes."""
        err = cls(f"{field} must be {expected}, got {value!r}")
        err.field, err.expected, err.value = field, expected, value
        return err

    def restated(self, names: Mapping[str, str]) -> tuple[str, str]:
        """An `invalid` error in a front end's words: (its name for the field, '{name}: expected ..., got ...');
        `names` maps SamplingParams fields to the client's names (a field not in it keeps its own)."""
        assert self.field is not None, "only errors made by invalid() name a field"
        name = names.get(self.field, self.field)
        return name, f"{name}: expected {self.expected}, got {self.value!r}"


class OverloadedError(SpectreeError, RuntimeError):
    """The scheduler's queue is full: the request was not accepted; retrying later may succeed (serve it as HTTP
    429 / 503 or gRPC UNAVAILABLE, not as bad input)."""


class SchedulerStopped(SpectreeError, RuntimeError):
    """The scheduler was shut down or its loop failed (its __cause__ is the failure): the request did not run or
    did not finish."""


__all__ = [
    "SpectreeError",
    "ConfigError",
    "CheckpointError",
    "TokenizerError",
    "CacheError",
    "RequestError",
    "OverloadedError",
    "SchedulerStopped",
]
