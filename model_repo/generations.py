"""spec_decode's generations: in-flight batching through `Generations` (one `runtime.batching.Scheduler` per
instance: one target forward per step for every running request, a bounded FIFO queue, a KV-cache budget;
runtime.errors.OverloadedError beyond), admission by the KV budget (`check_kv_budget`), and `run_generation`
(one request alone through the same path)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_repo.errors import RequestCancelled
from model_repo.metrics import SpecMetrics
from model_repo.request import GenerateRequest, prompt_ids
from model_repo.responses import ResponseBuilder, ResponseSink
from runtime.batching import RequestHandle, Scheduler, SchedulerConfig
from runtime.errors import ConfigError, RequestError, SchedulerStopped
from runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

# ---- generation: in-flight batching on one scheduler per instance -----------------------------------------


def available_memory_bytes(device: str) -> int:
    """Memory free for new allocations now: the GPU's free memory (cuda), else MemAvailable, capped by the cgroup
    (container) limit when there is one."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            room = int(limit) - used
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    if available is None:
        raise ConfigError("cannot read the free memory (/proc/meminfo); render with kv_memory_mb set")
    return available


def check_kv_budget(decoder: Any, prompt_tokens: int, params: SamplingParams, budget_bytes: int) -> None:
    """RequestError (naming max_tokens, with the largest that fits) when a request's worst-case KV cache could never
    fit the instance's budget: the sizing `runtime.batching.Scheduler.submit` admits by (`SpecDecoder.cache_tokens`,
    `model.cache_bytes`: the KV dtype the model really keeps, `runtime.model.kv_dtype`), told in serving's terms."""
    model = decoder.model
    need = model.cache_bytes(decoder.cache_tokens(prompt_tokens, params))
    if need <= budget_bytes:
        return
    most = budget_bytes // model.cache_bytes(1) - prompt_tokens - decoder.max_tree_nodes
    raise RequestError(
        f"max_tokens: {params.max_tokens} with a {prompt_tokens}-token prompt needs {need / 2**20:.1f} MiB of KV "
        f"cache; this instance's KV budget is {budget_bytes / 2**20:.1f} MiB (kv_memory_mb), so this prompt allows "
        f"max_tokens <= {max(0, most)}"
    )


@dataclass(eq=False)
class _Live:
    """A request between submit and its end: where its responses go."""

    request: GenerateRequest
    sink: ResponseSink
    builder: ResponseBuilder
    handle: RequestHandle | None = None
    ended: bool = False


class Generations:
    """spec_decode's requests on ONE `runtime.batching.Scheduler` (in-flight batching: every running request's
    draft tree verified in one target forward per step; a bounded FIFO queue; admission by a KV budget).

    `submit` hands a parsed request to the scheduler and returns at once: a request that can never fit the budget
    is refused with RequestError, one beyond max_concurrent_requests + max_queue_size with
    runtime.errors.OverloadedError
    (UNAVAILABLE, "overloaded: ..."). Its deltas become responses on the scheduler's thread (`ResponseBuilder`:
    one per delta when streaming, one whole response otherwise); a request leaves the batch before its final
    response goes out, so a client sending its next request at once finds room.

    Cancellation: after each delta the request's sink is asked (a client gone, a CancelBoard mark, shutdown), and
    a watcher thread asks every `poll_s` for requests still waiting (which get no deltas); a cancelled request
    stops at the next step boundary, its KV cache freed, and ends with RequestCancelled. The watcher also keeps
    the gauges current and reports a scheduler that died (`on_dead(error)`, once; its requests have ended with
    SchedulerStopped). Every request ends in exactly one `metrics.finished` and one
    `on_done(request, error, final)`, after its final response (or error) went out.
    """

    def __init__(self, decoder: Any, config: SchedulerConfig, metrics: SpecMetrics | None = None,
                 on_done: Callable[[GenerateRequest, BaseException | None, Any], None] | None = None,
                 on_dead: Callable[[BaseException | None], None] | None = None, poll_s: float = 0.1,
                 name: str = "spec_decode") -> None:
        self.decoder = decoder
        self.config = config
        self.metrics = metrics
        self._on_done = on_done
        self._on_dead = on_dead
        self._live: dict[int, _Live] = {}  # id(live) -> live
        self._lock = threading.Lock()
        self._closing = False
        self._dead_reported = False
        self._published: tuple[int, int, int] | None = None
        self._counted = (0, 0)  # (steps, segments) already added to the metrics
        if metrics is not None:
            metrics.limits(config)
        self.scheduler = Scheduler(decoder, config, name=f"{name}-scheduler")
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._watcher = threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)
        self._watcher.start()

    @property
    def healthy(self) -> bool:
        return self.scheduler.healthy

    def submit(self, request: GenerateRequest, prompt: Sequence[int], sink: ResponseSink) -> RequestHandle:
        ids = list(prompt)
        check_kv_budget(self.decoder, len(ids), request.params, self.config.kv_budget_bytes)
        live = _Live(request, sink, ResponseBuilder(request, len(ids)))
        with self._lock:
            if self._closing:
                raise RequestCancelled("the model is shutting down")
            self._live[id(live)] = live
        try:
            handle = self.scheduler.submit(ids, request.params, on_delta=lambda h, item: self._on_item(live, h, item))
        except BaseException:
            with self._lock:
                self._live.pop(id(live), None)
            raise
        with self._lock:
            live.handle = handle
        self.publish()
        return handle

    def _on_item(self, live: _Live, handle: RequestHandle, item: Any) -> None:
        """The scheduler's delta callback (its thread): each delta, then the final delta or the exception."""
        live.handle = handle
        if isinstance(item, BaseException):
            self._end(live, item)
            return
        if item.finished:
            if item.finish_reason == "cancelled":
                self._end(live, RequestCancelled("the request was cancelled"))
                return
            live.builder.add(item)
            try:
                live.sink.send(live.builder.take(item), final=True)
            except Exception as exc:  # noqa: BLE001  (the client is gone: the request ends with that)
                self._end(live, exc)
                return
            self._end(live, None, item)
            return
        if live.sink.is_cancelled():
            handle.cancel()  # at the next step boundary; this delta is not sent
            return
        live.builder.add(item)
        self.publish(counters=False)  # a client that sees this delta sees the request counted as running
        if live.request.stream:
            live.sink.send(live.builder.take(), final=False)  # raising ends the request (the scheduler's rule)

    def _end(self, live: _Live, error: BaseException | None, final: Any = None) -> None:
        with self._lock:
            if live.ended:
                return
            live.ended = True
            self._live.pop(id(live), None)
            if isinstance(error, SchedulerStopped) and self._closing:
                error = RequestCancelled("the model is shutting down")
        try:
            if error is not None:
                live.sink.fail(error)
        finally:
            if self.metrics is not None:
                self.metrics.finished(error, final, live.request.timing)
            self.publish()
            if self._on_done is not None:
                self._on_done(live.request, error, final)

    def publish(self, counters: bool = True) -> None:
        """The scheduler's state to the metrics: gauges (when they changed) and the batch counters."""
        if self.metrics is None:
            return
        st = self.scheduler.stats()
        with self._lock:
            state = (st.active, st.waiting, st.kv_reserved_bytes)
            changed = state != self._published
            self._published = state
            steps, segments = 0, 0
            if counters:
                steps, segments = st.steps - self._counted[0], st.segments - self._counted[1]
                self._counted = (st.steps, st.segments)
        if changed:
            self.metrics.state(*state)
        if steps or segments:
            self.metrics.batches(steps, segments)

    def poll(self) -> None:
        """Cancel requests whose client has gone (waiting ones included), publish the state, report a dead loop."""
        with self._lock:
            live = [x for x in self._live.values() if x.handle is not None and not x.ended]
        for x in live:
            if not x.handle.cancel_requested and x.sink.is_cancelled():
                x.handle.cancel()
        self.publish()
        if not self.scheduler.healthy:
            with self._lock:
                report = not (self._closing or self._dead_reported)
                self._dead_reported = True
            if report and self._on_dead is not None:
                self._on_dead(self.scheduler.error)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001  (the watcher outlives any one request's sink)
                log.warning("spec_decode watcher: %r", exc)

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new requests; those in flight or waiting end CANCELLED ("shutting down") at the next step
        boundary. True when the scheduler's thread stopped within `timeout`."""
        with self._lock:
            self._closing = True
        stopped = self.scheduler.close(timeout)
        self._stop.set()
        if threading.current_thread() is not self._watcher:
            self._watcher.join()
        return stopped

    def __enter__(self) -> Generations:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_generation(decoder: Any, request: GenerateRequest, sink: ResponseSink,
                   prompt: Sequence[int] | None = None) -> Any:
    """One request, alone, through the serving path (`Generations` over a batch-1 scheduler whose KV budget fits
    any request): the responses spec_decode would send to `sink`. Raises the request's error (RequestCancelled when
    the sink said so; prompt errors as RequestError before anything runs); returns the final GenerationDelta."""
    ids = prompt_ids(decoder, request) if prompt is None else list(prompt)
    budget = decoder.model.cache_bytes(decoder.max_context + decoder.max_tree_nodes)
    ended: list[tuple[BaseException | None, Any]] = []
    config = SchedulerConfig(max_concurrent_requests=1, max_queue_size=0, kv_budget_bytes=budget)
    with Generations(decoder, config, on_done=lambda _r, error, final: ended.append((error, final)),
                     name="run_generation") as gens:
        gens.submit(request, ids, sink).wait()
    error, final = ended[0]
    if error is not None:
        raise error
    return final


__all__ = ['Generations', 'available_memory_bytes', 'check_kv_budget', 'run_generation']
