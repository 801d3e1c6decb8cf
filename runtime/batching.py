"""In-flight (continuous) batching of speculative decoding: one `Scheduler` per model instance.

Requests join and leave at step boundaries. One step:
  1. boundary: cancelled requests leave (their memory is freed at once); waiting requests are admitted, first come
     first served, while the batch has room (`max_concurrent_requests`) and their KV reservation fits the budget
     (Memory);
  2. every active request's `RequestState.next_segment()`: the next chunk of its prompt (a joining request), or the
     tree its own drafter session drafts, with its own generator (pruned to its share of `tree_budget`, if set);
  3. ONE target forward over all those segments (`TargetModel.forward_segments`): the token-wise layers run over the
     packed rows of every request, attention runs per request against its own cache (ragged trees: their own
     node counts, prefix lengths, positions and masks);
  4. per request: verification with its own SamplingParams and generator, cache commit, drafter advance, stop
     conditions, and its delta streamed to its handle; finished requests leave.
Steps 2 and 4 are the single-request loop's own code (`runtime.decode.RequestState`), in the same order, drawing from
the request's generator in the same order: a request's output does not depend on what else is in the batch. Its
greedy output is plain greedy decoding's; sampled output is distributed exactly as the target. (Bit-for-bit, a
packed matmul over a different number of rows may round the last bits differently, as any batched inference does:
a greedy argmax or a sampling threshold that falls within that rounding can differ. tests/test_batching.py
measures it.)

Tree budget (`tree_budget`): verifying a tree costs little more than one token only while the forward is bound by
reading the weights; a batch of trees soon makes it compute-bound (SmolLM2 on 2 CPU cores, bf16: 16 rows cost 1.2x
one row, 64 rows 2.4x), and drafting runs once per request. With a budget, each step splits it evenly over the
decoding requests and prunes each tree to its share (`Tree.best_nodes`, the likeliest nodes; a share of 1 is a plain
step and skips drafting), so speculation shrinks as the batch grows, as vLLM's speculative_disable_by_batch_size
and SGLang's draft-token budgets do, without being switched off at once. Pruning keeps every tree a lossless
proposal (greedy output is plain greedy decoding's; sampled output exactly distributed). A seeded sampled request is
never pruned: its draws follow its trees, and the same seed must give the same output whatever else is in the
batch; its trees count in the split all the same.

Memory: a request's KV cache is allocated for its prompt plus one tree and grows geometrically as tokens are
produced (`KVCache.reserve`), never beyond its worst case `SpecDecoder.cache_tokens(prompt, params)` (prompt +
max_tokens + one tree, within the context). Admission reserves that worst case against `kv_budget_bytes`, so a
running request never waits for memory nor is evicted (TensorRT-LLM's GUARANTEED_NO_EVICT policy: no request's
output depends on another's memory use); a request whose worst case exceeds the whole budget is refused at
`submit` with a RequestError saying how many tokens would fit. Allocated bytes (`SchedulerStats.kv_bytes`) follow
the tokens actually produced and return to zero when requests finish or are cancelled. Drafter state (the EAGLE
head's own small cache) is not counted.

Errors: a failure in one request's own work (drafting, verification, commit, its delta callback) ends that request
with that exception and the others go on. A failure of the shared forward, or of the loop itself, stops the
scheduler: every request in flight or waiting ends with SchedulerStopped (its __cause__ the failure), `healthy`
turns False and `error` holds it, so a health check can report it; later submits raise SchedulerStopped.

Threads: `submit` / `cancel` / `stats` / `close` are thread-safe; the steps run in one background thread. Prompts
are encoded on the submitting thread.

Stats: each request's GenerationStats charge it the whole shared forward of every step it took part in (its
latency), and time_total runs from submit (queueing included).

Host memory: every step allocates and frees tens of MiB of short-lived blocks (logits [rows, V] in float32, the
sampling work on them, attention scratch) whose sizes change with the batch's make-up, on this one thread,
among KV caches that live as long as their request. Once a freed mmap has raised glibc's dynamic mmap threshold
(up to 32 MiB), malloc serves such blocks from its heaps, and a heap gives free pages back only from its top: the
freed holes stay resident, so resident memory grows under sustained load with no live tensor or request object
left behind, and `malloc_trim(0)` gives it back. So the scheduler hands free heap pages back itself
(`release_free_memory`: glibc's malloc_trim; nothing elsewhere) whenever the batch empties, and every
`trim_interval_s` seconds while requests run, for one call of a few milliseconds a second.
`SchedulerStats.memory_trims` counts them; tests/test_memory.py and `python -m perf.soak` measure the growth.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from runtime.decode import GenerationDelta, GenerationResult, PromptLike, RequestState, SpecDecoder, collect
from runtime.errors import OverloadedError, RequestError, SchedulerStopped
from runtime.scheduler_config import SchedulerConfig
from runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

# on_delta(handle, item): each delta of the request, then its final delta or its exception
DeltaCallback = Callable[["RequestHandle", GenerationDelta | BaseException], None]


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of a Scheduler (bytes are KV cache of the target; counters since it started)."""

    active: int  # requests in the batch
    waiting: int  # requests queued for admission
    kv_bytes: int  # KV cache allocated now (grows with produced tokens)
    kv_reserved_bytes: int  # the active requests' worst cases (what admission counts)
    kv_budget_bytes: int
    steps: int  # target forwards run
    segments: int  # request segments in those forwards (segments / steps = mean batch size)
    rows: int  # tokens in those forwards (prompt chunks and tree nodes)
    finished: int  # requests ended by a stop condition or their length limit
    cancelled: int
    failed: int  # requests ended by an error (their own, or the scheduler stopping)
    rejected: int  # submits refused with OverloadedError
    memory_trims: int  # free heap memory handed back to the OS (`release_free_memory`; 0 without glibc)
    healthy: bool

    @property
    def mean_batch(self) -> float:
        return self.segments / self.steps if self.steps else 0.0


class RequestHandle:
    """A submitted request. Iterate it for its GenerationDeltas (blocking; the last one has finish_reason and stats,
    or the request's exception is raised instead); `cancel()` it; `result()` waits for the whole output.
    `close()` cancels an unfinished request, so a handle can stand where `SpecDecoder.stream`'s iterator did (a
    handle that is merely dropped keeps generating to its end: cancel or close it).

    With an `on_delta` callback (see `Scheduler.submit`) deltas go to the callback instead; `done`, `wait`,
    `finish_reason` and `error` still tell how the request ended, and iterating the handle is an error."""

    def __init__(self, scheduler: Scheduler, request_id: int, prompt_tokens: int, kv_reserved_bytes: int,
                 on_delta: DeltaCallback | None) -> None:
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self.kv_reserved_bytes = kv_reserved_bytes
        self._scheduler = scheduler
        self._on_delta = on_delta
        self._queue: queue.SimpleQueue[GenerationDelta | BaseException] = queue.SimpleQueue()
        self._done = threading.Event()  # the final delta or an error was delivered
        self._exhausted = False  # the consumer has seen the end
        self.cancel_requested = False  # set under the scheduler's lock
        self.finish_reason: str | None = None
        self.error: BaseException | None = None

    # ---- consumer side ----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The request ended (finished, cancelled or failed); its last delta / error may still be unread."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request ended; False on timeout."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Stop generating at the next step boundary and free the request's memory (no-op once it ended)."""
        self._scheduler.cancel(self)

    def close(self) -> None:
        if not self.done:
            self.cancel()

    def __iter__(self) -> Iterator[GenerationDelta]:
        return self

    def __next__(self) -> GenerationDelta:
        delta = self.next_delta()
        if delta is None:  # unreachable: without a timeout next_delta waits for an item
            raise RuntimeError("next_delta() returned nothing without a timeout")
        return delta

    def next_delta(self, timeout: float | None = None) -> GenerationDelta | None:
        """The next delta; None when none came within `timeout` seconds; StopIteration after the last one; the
        request's exception (once) if it failed."""
        if self._on_delta is not None:
            raise RuntimeError(f"request {self.id} delivers its deltas to its on_delta callback, not to its handle")
        if self._exhausted:
            raise StopIteration
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self._exhausted = True
            raise item
        if item.finished:
            self._exhausted = True
        return item

    def result(self) -> GenerationResult:
        """Every delta, joined (blocks until the request ends; raises its exception)."""
        return collect(self)

    # ---- scheduler side (its loop thread) --------------------------------------------------------------

    def _deliver(self, item: GenerationDelta | BaseException) -> None:
        """Hand a delta or the terminal exception to the consumer; exceptions from the callback propagate."""
        terminal = isinstance(item, BaseException) or item.finished
        if terminal:
            if isinstance(item, BaseException):
                self.error = item
            else:
                self.finish_reason = item.finish_reason
        try:
            if self._on_delta is not None:
                self._on_delta(self, item)
            else:
                self._queue.put(item)
        finally:
            if terminal:
                self._done.set()


@dataclass(eq=False)
class _Request:
    handle: RequestHandle
    state: RequestState
    reserved: int  # bytes: the worst-case cache, counted against the budget while active


class Scheduler:
    """In-flight batching over one SpecDecoder (its model, tokenizer and drafter); see the module docstring.

        with Scheduler(decoder, SchedulerConfig(max_concurrent_requests=8)) as sched:
            handle = sched.submit("prompt", SamplingParams(max_tokens=64))
            for delta in handle: ...

    The background thread starts here; `close()` (or leaving the with-block) stops it.
    """

    def __init__(self, decoder: SpecDecoder, config: SchedulerConfig | None = None,
                 name: str = "spectree-scheduler") -> None:
        self.decoder = decoder
        self.config = config or SchedulerConfig()
        self._cond = threading.Condition(threading.Lock())
        self._waiting: deque[_Request] = deque()
        self._active: list[_Request] = []  # changed under the lock, by the loop thread only
        self._reserved = 0
        self._kv_bytes = 0
        self._closing = False
        self._error: BaseException | None = None
        self._next_id = 1
        self._counts = dict.fromkeys(("steps", "segments", "rows", "finished", "cancelled", "failed", "rejected",
                                      "memory_trims"), 0)
        self._trimmed_at = time.monotonic()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    # ---- API ----------------------------------------------------------------------------------------------

    def submit(self, prompt: PromptLike, params: SamplingParams | None = None, *,
               on_delta: DeltaCallback | None = None, **sampling) -> RequestHandle:
        """Queue a request; returns its handle at once. The prompt and settings are validated here (RequestError,
        also when its worst-case KV cache could never fit the budget); OverloadedError when the batch and the queue
        are full; SchedulerStopped after close() or a loop failure.

        on_delta(handle, item): called on the scheduler's thread with each GenerationDelta and finally with the final
        delta or the request's exception (possibly before submit has returned: hence the handle argument); it must
        return quickly (every request waits for it). If it raises, the request ends with that exception.
        """
        self.check()  # before encoding the prompt
        prompt_ids, params = self.decoder.request(prompt, params, **sampling)
        slots = self.decoder.cache_tokens(len(prompt_ids), params)
        model = self.decoder.model
        need = model.cache_bytes(slots)
        budget = self.config.kv_budget_bytes
        if need > budget:
            per_token = model.cache_bytes(1)
            fit = budget // per_token
            most = fit - len(prompt_ids) - self.decoder.max_tree_nodes
            hint = f"max_tokens may be at most {most}" if most >= 1 else "the prompt alone does not fit"
            raise RequestError(
                f"request needs up to {slots} tokens of KV cache (prompt {len(prompt_ids)}, max_tokens "
                f"{params.max_tokens}, a draft tree of {self.decoder.max_tree_nodes}, within the context of "
                f"{self.decoder.max_context}) = {need} bytes, above the scheduler's kv_budget_bytes {budget} "
                f"({fit} tokens): {hint}"
            )
        state = RequestState(self.decoder, prompt_ids, params, self.config.prefill_chunk)  # no cache until admitted
        with self._cond:
            self._raise_if_stopped()
            capacity = self.config.max_concurrent_requests + self.config.max_queue_size
            if len(self._active) + len(self._waiting) >= capacity:
                self._counts["rejected"] += 1
                raise OverloadedError(
                    f"server busy: {len(self._active)} requests running and {len(self._waiting)} queued "
                    f"(max_concurrent_requests {self.config.max_concurrent_requests} + max_queue_size "
                    f"{self.config.max_queue_size}); "
                    "retry later"
                )
            handle = RequestHandle(self, self._next_id, len(prompt_ids), need, on_delta)
            self._next_id += 1
            self._waiting.append(_Request(handle, state, need))
            self._cond.notify_all()
        return handle

    def stream(self, prompt: PromptLike, params: SamplingParams | None = None, **sampling) -> RequestHandle:
        """`submit` without a callback: the handle is the iterator of deltas (like `SpecDecoder.stream`)."""
        return self.submit(prompt, params, **sampling)

    def generate(self, prompt: PromptLike, params: SamplingParams | None = None, **sampling) -> GenerationResult:
        """Submit and wait for the whole result (like `SpecDecoder.generate`)."""
        return self.submit(prompt, params, **sampling).result()

    def cancel(self, handle: RequestHandle) -> None:
        """The request stops at the next step boundary: its final delta has finish_reason "cancelled" and its
        memory is freed. No-op once it ended."""
        with self._cond:
            if not handle.done:
                handle.cancel_requested = True
                self._cond.notify_all()

    def stats(self) -> SchedulerStats:
        with self._cond:
            return SchedulerStats(active=len(self._active), waiting=len(self._waiting), kv_bytes=self._kv_bytes,
                                  kv_reserved_bytes=self._reserved, kv_budget_bytes=self.config.kv_budget_bytes,
                                  healthy=self._healthy(), **self._counts)

    @property
    def healthy(self) -> bool:
        """The loop is running and has not failed (False after close() too)."""
        with self._cond:
            return self._healthy()

    @property
    def error(self) -> BaseException | None:
        """What stopped the loop, if it failed."""
        return self._error

    def check(self) -> None:
        """Raise SchedulerStopped (from the loop's failure, if any) unless healthy: for health checks."""
        with self._cond:
            self._raise_if_stopped()

    def close(self, timeout: float | None = None) -> bool:
        """Stop: new submits are refused; requests in flight or waiting end with SchedulerStopped at the next step
        boundary. Waits up to `timeout` seconds (None: until the current step ends) for the thread; True when it
        has stopped."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- the loop (background thread) -------------------------------------------------------------------

    def _healthy(self) -> bool:
        return self._error is None and not self._closing and self._thread.is_alive()

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise SchedulerStopped(f"the scheduler's loop failed: {self._error!r}") from self._error
        if self._closing or not self._thread.is_alive():
            raise SchedulerStopped("the scheduler was shut down")

    def _main(self) -> None:
        try:
            while self._boundary():
                self._step()
                self._trim()
        except BaseException as exc:  # noqa: BLE001  (recorded for health checks and every request, not swallowed)
            log.exception("spectree scheduler loop failed; every request in flight ends with SchedulerStopped")
            with self._cond:
                self._error = exc
        finally:
            self._stop_all()

    def _boundary(self) -> bool:
        """Between steps: drop cancelled requests, admit waiting ones; False when closing. Blocks while idle."""
        with self._cond:
            while not (self._closing or self._active or self._waiting):
                self._cond.wait()
            if self._closing:
                return False
            cancelled = [r for r in self._active if r.handle.cancel_requested]
            cancelled += [r for r in self._waiting if r.handle.cancel_requested]
            for r in cancelled:
                self._remove(r)
                self._counts["cancelled"] += 1
            while self._waiting and len(self._active) < self.config.max_concurrent_requests:
                head = self._waiting[0]
                if self._reserved + head.reserved > self.config.kv_budget_bytes:
                    break  # first come, first served: later requests wait behind the head
                self._waiting.popleft()
                self._reserved += head.reserved
                self._active.append(head)
        finals = [(r, r.state.cancel()) for r in cancelled]
        for r in cancelled:
            self._release(r)
        if cancelled:
            self._count_memory()
        for r, final in finals:
            self._send(r, final)
        return True

    def _step(self) -> None:
        """One target forward for every active request (see the module docstring)."""
        model = self.decoder.model
        work = []
        share = self._tree_share()
        for r in list(self._active):
            try:
                segment = r.state.next_segment(share if r.state.decoding and _prunable(r.state.params) else None)
                model.check_segment(segment)
            except Exception as exc:  # noqa: BLE001
                self._fail(r, exc)
                continue
            work.append((r, segment))
        if not work:
            return
        t0 = time.perf_counter()
        # checked above, request by request; a failure here stops the scheduler
        outputs = model.forward_segments([segment for _, segment in work], check=False)
        seconds = time.perf_counter() - t0
        with self._cond:
            self._counts["steps"] += 1
            self._counts["segments"] += len(work)
            self._counts["rows"] += sum(segment.size for _, segment in work)
        emitted = []
        for (r, _), (logits, hidden) in zip(work, outputs):
            try:
                delta = r.state.absorb(logits, hidden, seconds)
            except Exception as exc:  # noqa: BLE001
                self._fail(r, exc)
                continue
            if delta is not None:
                emitted.append((r, delta))
        # Finished requests leave (and their memory is counted out) before anyone hears of this step's deltas.
        done = [r for r, delta in emitted if delta.finished]
        with self._cond:
            for r in done:
                self._remove(r)
            self._counts["finished"] += len(done)
        for r in done:
            self._release(r)
        self._count_memory()
        for r, delta in emitted:
            self._send(r, delta)

    def _tree_share(self) -> int | None:
        """A prunable decoding request's most tree nodes this step (tree_budget split evenly over the decoding
        requests; None: no budget)."""
        budget = self.config.tree_budget
        decoding = sum(r.state.decoding for r in self._active)
        if budget is None or decoding == 0:
            return None
        return max(1, budget // decoding)

    def _trim(self) -> None:
        """After a step: free heap pages back to the OS when the batch has emptied, or once trim_interval_s has
        passed since the last time (see "Host memory" in the module docstring)."""
        interval = self.config.trim_interval_s
        if interval is None:
            return
        with self._cond:
            idle = not (self._active or self._waiting)
        if not idle and time.monotonic() - self._trimmed_at < interval:
            return
        trimmed = release_free_memory()
        self._trimmed_at = time.monotonic()
        if trimmed:
            with self._cond:
                self._counts["memory_trims"] += 1

    def _remove(self, r: _Request) -> None:
        """Take r out of the batch or the queue (under the lock)."""
        if r in self._active:
            self._active.remove(r)
            self._reserved -= r.reserved
        elif r in self._waiting:
            self._waiting.remove(r)

    def _release(self, r: _Request) -> None:
        r.state.release()

    def _count_memory(self) -> None:
        with self._cond:
            self._kv_bytes = sum(r.state.kv_bytes for r in self._active)

    def _send(self, r: _Request, item: GenerationDelta | BaseException) -> None:
        try:
            r.handle._deliver(item)
        except Exception as exc:  # noqa: BLE001  (the request's callback failed: that request ends)
            if not r.handle.done:
                self._fail(r, exc)
            else:
                log.warning("request %d: its delta callback raised on its final delta: %r", r.handle.id, exc)

    def _fail(self, r: _Request, exc: BaseException) -> None:
        log.warning("request %d failed: %r", r.handle.id, exc)
        with self._cond:
            self._remove(r)
            self._counts["failed"] += 1
        self._release(r)
        self._count_memory()
        try:
            r.handle._deliver(exc)
        except Exception as callback_exc:  # noqa: BLE001
            log.warning("request %d: its delta callback raised on its error: %r", r.handle.id, callback_exc)

    def _stop_all(self) -> None:
        """The loop ended (closed or failed): every request still here ends with SchedulerStopped."""
        with self._cond:
            self._closing = True
            left = list(self._active) + list(self._waiting)
            cause = self._error
        for r in left:
            message = (f"the scheduler's loop failed: {cause!r}" if cause is not None
                       else "the scheduler was shut down before the request finished")
            err = SchedulerStopped(message)
            err.__cause__ = cause
            self._fail(r, err)


def _prunable(params: SamplingParams) -> bool:
    """Whether the tree budget may prune this request's trees: yes unless its output is a seeded sample, which
    must not depend on the batch (its draws follow its trees)."""
    return params.greedy or params.seed is None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the process's C library has none (musl, macOS, Windows)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Hand the free pages of every C-heap arena back to the OS (glibc's `malloc_trim(0)`: the free chunks inside
    the heaps too, not only the top); live memory is untouched. False where the C library has no such call."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


__all__ = ["DeltaCallback", "RequestHandle", "Scheduler", "SchedulerConfig", "SchedulerStats", "release_free_memory"]
