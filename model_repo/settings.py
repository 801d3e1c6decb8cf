"""The served models' settings: each model's config.pbtxt parameters, parsed and checked (`SpecDecodeSettings`,
`PreprocessingSettings`, `EnsembleSettings`: every key required, unknown keys rejected, ConfigError naming the
model, key and value), and the request parameters the ensemble model sets on its BLS calls (`CallerOptions`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from model_repo.bls import CANCEL_TOKEN_PARAMETER, CODED_ERRORS_PARAMETER, CancelBoard
from model_repo.contract import VERIFICATION_GREEDY, VERIFICATION_SAMPLED
from model_repo.request import RequestLimits
from runtime import schema
from runtime.batching import SchedulerConfig
from runtime.errors import ConfigError, RequestError
from runtime.schema import setting

T = TypeVar("T")

# ---- model settings (config.pbtxt parameters) -----------------------------------------------------------
# Loaded by runtime.schema in string mode (Triton parameters are text): every key required, unknown keys rejected,
# bounds declared on the fields; ConfigError "MODEL config parameters: KEY: got VALUE, expected WHAT".


class _ModelParameters:
    """`from_parameters`: a model's config.pbtxt parameters -> the settings dataclass (MODEL: the default model
    name errors carry)."""

    MODEL: ClassVar[str]

    @classmethod
    def from_parameters(cls: type[T], params: Mapping[str, str], model: str | None = None) -> T:
        return schema.load(cls, params, ConfigError, source=f"{model or cls.MODEL} config parameters",
                           strings=True)


# The verification stage each temperature range runs: what runtime.verify implements, recorded in spec_decode's
# config (render writes these values; a config naming another rule is refused).
VERIFICATION_PARAMETERS = {"verification_at_temperature_0": VERIFICATION_GREEDY,
                           "verification_above_temperature_0": VERIFICATION_SAMPLED}


@dataclass(frozen=True)
class SpecDecodeSettings(_ModelParameters):
    """spec_decode's config.pbtxt parameters, parsed (every key required, unknown keys rejected). What they mean:
    model_repo.render.RepoOptions, whose fields carry the same names."""

    engine_dir: str
    load_options: dict[str, Any]  # keyword arguments of runtime.load (JSON in the config)
    max_concurrent_requests: int = setting(ge=1)  # the scheduler's max_concurrent_requests
    max_queue_size: int = setting(ge=0)
    prefill_chunk: int = setting(ge=1)  # prompt tokens per request per step
    tree_budget: int = setting(ge=0)  # tree nodes per step across the batch; 0: none
    max_tokens_limit: int = setting(ge=1)
    kv_memory_mb: int = setting(ge=0)  # 0: half the memory free once the model is loaded
    max_prompt_bytes: int = setting(ge=1)
    max_stop_words: int = setting(ge=1)
    max_stop_word_bytes: int = setting(ge=1)
    torch_threads: int = setting(ge=0)  # 0: torch's default
    device: str = setting(choices=("cpu", "cuda"))

    MODEL = "spec_decode"

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], model: str | None = None) -> SpecDecodeSettings:
        model = model or cls.MODEL
        params = dict(params)
        for key, expected in VERIFICATION_PARAMETERS.items():
            if key not in params:
                raise ConfigError(f"{model} config parameters: {key}: missing (required)")
            if (got := params.pop(key)) != expected:
                raise ConfigError(f"{model} config parameters: {key}: got {got!r}, expected {expected!r} "
                                  f"(runtime.verify implements {expected!r})")
        return super().from_parameters(params, model)

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
        return SchedulerConfig(max_concurrent_requests=self.max_concurrent_requests, max_queue_size=self.max_queue_size,
                               kv_budget_bytes=self.kv_budget_bytes(free_bytes), prefill_chunk=self.prefill_chunk,
                               tree_budget=self.tree_budget or None)


@dataclass(frozen=True)
class PreprocessingSettings(_ModelParameters):
    engine_dir: str
    max_context: int = setting(ge=2)
    max_prompt_bytes: int = setting(ge=1)

    MODEL = "preprocessing"


@dataclass(frozen=True)
class EnsembleSettings(_ModelParameters):
    """The ensemble (entry) model's parameters: the models it calls, and how many requests it holds at once
    (every spec_decode instance's slots and queue; beyond that it answers OverloadedError itself)."""

    preprocessing: str = setting(key="preprocessing_model")
    spec_decode: str = setting(key="spec_decode_model")
    max_in_flight: int = setting(ge=1)

    MODEL = "ensemble"


# ---- request parameters (the ensemble model's BLS calls) ------------------------------------------------


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
            raise RequestError(f"request parameters: not valid JSON ({exc})") from exc
        if not isinstance(params, dict):
            return cls()
        token = params.get(CANCEL_TOKEN_PARAMETER)
        if token is not None and not (isinstance(token, str) and CancelBoard.is_token(token)):
            raise RequestError(f"parameter {CANCEL_TOKEN_PARAMETER}: expected {CancelBoard.TOKEN_HEX} lowercase hex "
                             f"digits (the ensemble model sets it), got {str(token)[:40]!r}")
        return cls(cancel_token=token, coded_errors=params.get(CODED_ERRORS_PARAMETER) is True)


__all__ = ["CallerOptions", "EnsembleSettings", "PreprocessingSettings", "SpecDecodeSettings"]
