"""A generation's responses: the output tensors of each (`response_tensors`, `ResponseBuilder`: text, ids, stats
and the outputs a request asked for), where they go (`ResponseSink`), and the ensemble's batched shapes
(`batch_row_outputs`).

Deltas come straight from `SpecDecoder.stream` (its incremental detokenizer and stop-string hold-back), so the
served text is exactly the offline runtime's, and the deltas concatenate to the full text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from model_repo.contract import BATCH_INDEX, SEQUENCE_INDEX, TEXT_OUTPUT
from model_repo.request import GenerateRequest

def string_tensor(s: str) -> np.ndarray:
    return np.asarray([s.encode("utf-8")], dtype=np.object_)


def response_tensors(text: str, token_ids: Sequence[int], final: Any = None) -> dict[str, np.ndarray]:
    """Outputs of one response; `final` is the last GenerationDelta (adds finish_reason and the stats)."""
    out = {
        "text_output": string_tensor(text),
        "output_ids": np.asarray(token_ids, dtype=np.int32),
    }
    if final is not None:
        stats = final.stats
        out["finish_reason"] = string_tensor(final.finish_reason)
        out["verification"] = string_tensor(stats.verification)
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


def is_final_response(output_names: Sequence[str]) -> bool:
    """Whether a spec_decode response is its request's last: only the last one carries finish_reason."""
    return "finish_reason" in output_names


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


__all__ = [
    "ResponseBuilder",
    "ResponseSink",
    "batch_row_outputs",
    "is_final_response",
    "response_tensors",
    "string_tensor",
]
