"""spec_decode's metrics (Prometheus, on Triton's metrics port): every metric declared once (`MetricSpec`,
`METRICS`), and `SpecMetrics`, which turns request and scheduler events into their updates."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from model_repo.contract import VERIFICATION_GREEDY, VERIFICATION_SAMPLED
from model_repo.errors import ErrorCode, error_code
from model_repo.request import RequestTiming
from runtime.batching import SchedulerConfig

# ---- metrics --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None  # histograms only


# Every request is counted once, by the model where it ended: spec_decode counts the requests it took (and the ones
# it refused); the ensemble only those it ended itself (refused beyond max_in_flight, or refused by preprocessing or
# for their batch shape), so the sum over models of outcome="overloaded" is every refusal the server made.
REQUESTS = MetricSpec("spectree_requests_total", "counter",
                      "Generation requests finished, by outcome (completed, invalid, overloaded, cancelled, error), "
                      "counted by the model where each ended", ("model", "outcome"))
GENERATED = MetricSpec("spectree_generated_tokens_total", "counter", "Tokens generated", ("model",))
# Speculation counters in vLLM's spec-decode meanings (runtime/decode.py): drafts = verification steps, draft
# tokens = positions speculated (each step's tree depth), accepted tokens; per position k, the steps whose k-th
# speculated token was accepted. acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted /
# drafts. Tree nodes count the verification work (a tree of depth 3 may have 60 nodes).
STEPS = MetricSpec("spectree_verify_steps_total", "counter",
                   "Drafts: verification steps (target forwards over a draft tree), by verification mode",
                   ("model", "verification"))
DRAFT_TOKENS = MetricSpec("spectree_draft_tokens_total", "counter",
                          "Draft tokens: positions speculated (the tree depth of every step)",
                          ("model", "verification"))
TREE_NODES = MetricSpec("spectree_tree_nodes_total", "counter",
                        "Draft tree nodes fed to the target, roots excluded (verification work)",
                        ("model", "verification"))
ACCEPTED = MetricSpec("spectree_accepted_tokens_total", "counter", "Draft tokens accepted by verification",
                      ("model", "verification"))
ACCEPTED_PER_POSITION = MetricSpec("spectree_accepted_tokens_per_position_total", "counter",
                                   "Steps whose draft token at this position (1 = first after the root) was accepted",
                                   ("model", "verification", "position"))
MEAN_ACCEPTED_LENGTH = MetricSpec("spectree_mean_accepted_length", "histogram",
                                  "Per request: 1 + accepted draft tokens per step",
                                  ("model", "verification"), (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0,
                                                              8.0))
ACCEPTANCE_RATE = MetricSpec("spectree_acceptance_rate", "histogram",
                             "Per request: accepted draft tokens / draft tokens (positions)",
                             ("model", "verification"), (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
TTFT = MetricSpec("spectree_time_to_first_token_seconds", "histogram",
                  "From the request's arrival at the model to its first response with tokens (queueing included)",
                  ("model",), _LATENCY_BUCKETS)
ITL = MetricSpec("spectree_inter_token_latency_seconds", "histogram",
                 "Time between a request's responses divided by the tokens the later one carries, once per token",
                 ("model",), _LATENCY_BUCKETS)
ACCEPTED_PER_STEP = MetricSpec("spectree_accepted_tokens_per_step", "histogram",
                               "Draft tokens accepted per verification step",
                               ("model", "verification"), (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 32, 64))
TAU = MetricSpec("spectree_tau", "histogram", "Tokens emitted per verification step, per request (tau)",
                 ("model", "verification"), (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0))
ACTIVE = MetricSpec("spectree_active_requests", "gauge", "Requests in the batch now, per model instance",
                    ("model", "instance"))
CAPACITY = MetricSpec("spectree_generation_slots", "gauge",
                      "Requests decoded together (the scheduler's max_concurrent_requests), per model instance",
                      ("model", "instance"))
QUEUED = MetricSpec("spectree_queued_requests", "gauge", "Requests waiting to join the batch",
                    ("model", "instance"))
QUEUE_CAPACITY = MetricSpec("spectree_queue_slots", "gauge", "Requests allowed to wait (max_queue_size)",
                            ("model", "instance"))
FREE_SLOTS = MetricSpec("spectree_free_request_slots", "gauge",
                        "Requests this instance can still take before it refuses new ones as overloaded (spec_decode: "
                        "max_concurrent_requests + max_queue_size - running - queued; ensemble: max_in_flight - in flight)",
                        ("model", "instance"))
KV_RESERVED = MetricSpec("spectree_kv_reserved_bytes", "gauge",
                         "KV cache reserved by the running generations (prompt + max_tokens + one tree each)",
                         ("model", "instance"))
KV_BUDGET = MetricSpec("spectree_kv_budget_bytes", "gauge", "KV cache the running generations may reserve together",
                       ("model", "instance"))
KV_USAGE = MetricSpec("spectree_kv_cache_usage_ratio", "gauge",
                      "KV cache reserved / KV budget (0 = empty, 1 = full)", ("model", "instance"))
# In-flight batching: forwards / segments = the mean number of requests verified together per target forward.
BATCH_FORWARDS = MetricSpec("spectree_batch_forwards_total", "counter",
                            "Target forwards run by the scheduler (one per step, for every request in the batch)",
                            ("model", "instance"))
BATCH_SEGMENTS = MetricSpec("spectree_batch_segments_total", "counter",
                            "Requests' segments (prompt chunks, draft trees) in those forwards", ("model", "instance"))
METRICS: tuple[MetricSpec, ...] = (REQUESTS, GENERATED, STEPS, DRAFT_TOKENS, TREE_NODES, ACCEPTED,
                                   ACCEPTED_PER_POSITION, ACCEPTED_PER_STEP, MEAN_ACCEPTED_LENGTH, ACCEPTANCE_RATE,
                                   TAU, TTFT, ITL, ACTIVE, CAPACITY, QUEUED, QUEUE_CAPACITY, FREE_SLOTS, KV_RESERVED,
                                   KV_BUDGET, KV_USAGE, BATCH_FORWARDS, BATCH_SEGMENTS)
ENTRY_METRICS: tuple[MetricSpec, ...] = (REQUESTS, FREE_SLOTS)  # the ensemble's (`EntryMetrics`)

OUTCOMES = ("completed", "invalid", "overloaded", "cancelled", "error")


_OUTCOMES = {ErrorCode.INVALID_ARG: "invalid", ErrorCode.UNAVAILABLE: "overloaded", ErrorCode.CANCELLED: "cancelled",
             ErrorCode.INTERNAL: "error"}


def outcome_of(exc: BaseException | ErrorCode | None) -> str:
    """A request's outcome label: None completed, else by the Triton code of its error (or the code itself)."""
    if exc is None:
        return "completed"
    return _OUTCOMES[exc if isinstance(exc, ErrorCode) else error_code(exc)]


class MetricsBackend(Protocol):
    def add(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...


@dataclass
class SpecMetrics:
    """Turns request events into metric updates (Prometheus, on Triton's metrics port, in the server)."""

    backend: MetricsBackend
    model: str
    instance: str  # Triton's model instance name (gauges are per instance; counters add up across instances)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _kv_budget: int = 0
    _room: int = 0  # max_concurrent_requests + max_queue_size

    def limits(self, config: SchedulerConfig) -> None:
        labels = {"model": self.model, "instance": self.instance}
        self.backend.set(CAPACITY, labels, config.max_concurrent_requests)
        self.backend.set(QUEUE_CAPACITY, labels, config.max_queue_size)
        self.backend.set(KV_BUDGET, labels, config.kv_budget_bytes)
        self._kv_budget = config.kv_budget_bytes
        self._room = config.max_concurrent_requests + config.max_queue_size
        self.state(0, 0, 0)

    def state(self, running: int, queued: int, kv_reserved: int) -> None:
        """The scheduler's gauges (`Generations.publish`)."""
        labels = {"model": self.model, "instance": self.instance}
        self.backend.set(ACTIVE, labels, running)
        self.backend.set(QUEUED, labels, queued)
        self.backend.set(FREE_SLOTS, labels, max(0, self._room - running - queued))
        self.backend.set(KV_RESERVED, labels, kv_reserved)
        if self._kv_budget:
            self.backend.set(KV_USAGE, labels, kv_reserved / self._kv_budget)

    def batches(self, forwards: int, segments: int) -> None:
        """Forwards the scheduler ran since the last call, and the request segments in them."""
        labels = {"model": self.model, "instance": self.instance}
        self.backend.add(BATCH_FORWARDS, labels, forwards)
        self.backend.add(BATCH_SEGMENTS, labels, segments)

    def finished(self, exc: BaseException | None, final: Any = None, timing: RequestTiming | None = None) -> None:
        """One request ended (exc None: completed; final: its last GenerationDelta when it got that far; timing:
        when its responses went out)."""
        with self._lock:
            self.backend.add(REQUESTS, {"model": self.model, "outcome": outcome_of(exc)}, 1)
            if timing is not None:
                if timing.first_token_s is not None:
                    self.backend.observe(TTFT, {"model": self.model}, timing.first_token_s)
                for gap, n in timing.gaps:
                    for _ in range(n):
                        self.backend.observe(ITL, {"model": self.model}, gap / n)
            if final is None or final.stats is None:
                return
            stats = final.stats
            self.backend.add(GENERATED, {"model": self.model}, stats.generated_tokens)
            if stats.steps == 0:
                return
            mode = VERIFICATION_GREEDY if stats.verification == "greedy" else VERIFICATION_SAMPLED
            labels = {"model": self.model, "verification": mode}
            self.backend.add(STEPS, labels, stats.steps)
            self.backend.add(DRAFT_TOKENS, labels, stats.draft_positions)
            self.backend.add(TREE_NODES, labels, stats.drafted_tokens)
            self.backend.add(ACCEPTED, labels, stats.accepted_tokens)
            for position, n in enumerate(stats.accepted_per_position, start=1):
                self.backend.add(ACCEPTED_PER_POSITION, {**labels, "position": str(position)}, n)
            for n in stats.accepted_per_step:
                self.backend.observe(ACCEPTED_PER_STEP, labels, n)
            self.backend.observe(TAU, labels, stats.tau)
            self.backend.observe(MEAN_ACCEPTED_LENGTH, labels, stats.mean_accepted_length)
            if stats.draft_positions:
                self.backend.observe(ACCEPTANCE_RATE, labels, stats.acceptance_rate)


@dataclass
class EntryMetrics:
    """The ensemble (entry) model's metrics: the requests it ended itself (`ended`) and its free request slots
    (`in_flight`); what it passed on to spec_decode is counted there."""

    backend: MetricsBackend
    model: str
    instance: str

    def ended(self, outcome: BaseException | ErrorCode) -> None:
        self.backend.add(REQUESTS, {"model": self.model, "outcome": outcome_of(outcome)}, 1)

    def in_flight(self, count: int, limit: int) -> None:
        self.backend.set(FREE_SLOTS, {"model": self.model, "instance": self.instance}, max(0, limit - count))


__all__ = ['ENTRY_METRICS', 'METRICS', 'OUTCOMES', 'EntryMetrics', 'MetricSpec', 'MetricsBackend', 'SpecMetrics',
           'outcome_of']
