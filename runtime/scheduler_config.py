"""`SchedulerConfig`, apart from `runtime.batching`'s scheduler so that the configs reading its defaults (model_repo's
render options, deploy's config) do not load a model's code to do so."""

from __future__ import annotations

from dataclasses import dataclass

from runtime import schema
from runtime.errors import ConfigError
from runtime.schema import setting


@dataclass(frozen=True)
class SchedulerConfig:
    """How one Scheduler batches: the one source of the serving settings' defaults (model_repo's render options and
    deploy's config read theirs here). `max_batch_size` is never this: it is Triton's batch dimension of a model
    (model_repo) or TensorRT-LLM's build limit (builder)."""

    # requests decoded together (one target forward per step for all of them)
    max_concurrent_requests: int = setting(8, ge=1)
    max_queue_size: int = setting(32, ge=0)  # requests waiting beyond the batch; a submit beyond that: OverloadedError
    kv_budget_bytes: int = setting(2 * 2**30, ge=1)  # the KV-cache reservations of all active requests together
    prefill_chunk: int = setting(512, ge=1)  # prompt tokens per request per step (longer prompts join over steps)
    # tree nodes (roots included) one step verifies across the batch: each decoding request's tree is pruned to an
    # equal share (`Tree.best_nodes`; a share of 1 is a plain step, its drafter not run), except a seeded sampled
    # request's (runtime.batching, "Tree budget"). None: every tree whole.
    tree_budget: int | None = setting(None, ge=1)
    # free C-heap pages go back to the OS whenever the batch empties and at most this often (seconds) while
    # requests run; None: never (runtime.batching, "Host memory")
    trim_interval_s: float | None = setting(1.0, ge=0)

    def __post_init__(self) -> None:
        schema.check(self, ConfigError, "scheduler")


__all__ = ["SchedulerConfig"]
