"""The one module that touches triton_python_backend_utils: Triton python-backend models over the serving
modules of model_repo (contract, request, responses, generations, metrics, bls, settings, errors).

Each rendered model.py imports one class from here as TritonPythonModel. This module is only importable inside
the python backend's stub process (where triton_python_backend_utils exists); tests drive it through a real
tritonserver.

spec_decode is decoupled: `execute` parses each request, encodes its prompt and submits it to the instance's
`generations.Generations`: ONE `runtime.batching.Scheduler` (in-flight batching: up to max_concurrent_requests
requests decoded together, every one's draft tree verified in one target forward per step; the rest wait in FIFO
order). A bad request, one that can never fit the KV budget, or one beyond the batch and the queue is answered at
once with a Triton error: INVALID_ARG / UNAVAILABLE. Responses go out from the scheduler's thread as deltas come;
cancellation (client gone, CancelBoard mark) is checked after every delta and every 0.1 s for waiting requests.
A scheduler whose loop failed ends every request with an error and then this stub process exits, which
`deploy serve` sees as a dead stub (not ready; it stops the server, exit status 3): tritonserver 2.51 has no way
for a python model to declare itself not ready.

ensemble is the entry point (decoupled, BLS): it calls preprocessing, then streams spec_decode's responses back
to its client. Unlike a Triton ensemble (platform "ensemble", which in 2.51 does not pass a client's cancellation
on to a running step) it sees its client go: it marks the request on the `bls.CancelBoard`, and spec_decode stops
at its next step.
"""

from __future__ import annotations

import collections
import inspect
import json
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
import triton_python_backend_utils as pb_utils

from model_repo.bls import (
    CANCEL_TOKEN_PARAMETER,
    CODED_ERRORS_PARAMETER,
    CancelBoard,
    InFlight,
    error_of_outputs,
    error_outputs,
)
from model_repo.contract import ENSEMBLE_INPUTS, PREPROCESSING_INPUTS, SPEC_DECODE_INPUTS, SPEC_DECODE_OUTPUTS
from model_repo.engines import load_tokenizer
from model_repo.errors import (
    ErrorCode,
    RequestCancelled,
    coded_error_message,
    decode_error_message,
    error_code,
    error_message,
)
from model_repo.generations import Generations, available_memory_bytes
from model_repo.metrics import ENTRY_METRICS, METRICS, EntryMetrics, MetricSpec, SpecMetrics
from model_repo.request import GenerateRequest, parse_generate_request, preprocess, prompt_ids, split_batch
from model_repo.responses import batch_row_outputs, is_final_response
from model_repo.settings import CallerOptions, EnsembleSettings, PreprocessingSettings, SpecDecodeSettings

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
DEAD_SCHEDULER_EXIT_DELAY_S = 1.0  # lets the error responses of a failed scheduler's requests go out first
CANCEL_POLL_S = 0.1  # how often the ensemble model asks whether its clients are still there
KEEP_BLS_ITERATORS = 256  # finished BLS response iterators the ensemble model holds on to (EnsembleModel._keep)


def _triton_error(exc: BaseException, coded: bool = False) -> Any:
    """The Triton error for exc; coded: its message starts with "[CODE] " (for the ensemble model, whose BLS
    calls receive every error as INTERNAL)."""
    code = getattr(pb_utils.TritonError, error_code(exc).value)
    return pb_utils.TritonError(coded_error_message(exc) if coded else error_message(exc), code)


def _caller(request: Any) -> CallerOptions:
    """The request parameters the ensemble model sets on its calls (CallerOptions() when they are unreadable)."""
    try:
        return CallerOptions.from_parameters(request.parameters())
    except Exception:  # noqa: BLE001  (a client's odd parameters are not this model's business)
        return CallerOptions()


def _request_parameters(request: Any) -> dict[str, Any]:
    """A request's parameters as a dict ({} when there are none or they are unreadable)."""
    try:
        params = json.loads(request.parameters() or "{}")
    except (TypeError, ValueError):
        return {}
    return params if isinstance(params, dict) else {}


def _coded_triton_error(code: ErrorCode, message: str, coded: bool) -> Any:
    """A Triton error with this code; coded: the message carries it too ("[CODE] message")."""
    return pb_utils.TritonError(f"[{code.value}] {message}" if coded else message, getattr(pb_utils.TritonError,
                                                                                        code.value))


def _bls_error(response: Any, coded: bool = False) -> Any:
    """A BLS response's error as the Triton error it was before the python backend dropped its code (coded: for a
    caller that asked for coded messages itself)."""
    code, message = decode_error_message(response.error().message())
    return _coded_triton_error(code, message, coded)


def _inputs(request: Any, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    out = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            out[name] = tensor.as_numpy()
    return out


def _response(outputs: Mapping[str, np.ndarray]) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])


def _respond(requests: list[Any], compute: Callable[[Any], Mapping[str, np.ndarray]],
             error: Callable[[Any, BaseException], Any] | None = None) -> list[Any]:
    """One response per request of a non-decoupled model: compute(request)'s tensors, or the failure as a Triton
    error (error(request, exc); default `_triton_error(exc)`), so one bad request never fails its batch."""
    responses = []
    for request in requests:
        try:
            outputs = compute(request)
        except Exception as exc:  # noqa: BLE001  (every failure goes back to the client as a Triton error)
            responses.append(pb_utils.InferenceResponse(
                error=_triton_error(exc) if error is None else error(request, exc)))
        else:
            responses.append(_response(outputs))
    return responses


def _parameters(args: dict[str, str]) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def _require_decoupled(args: dict[str, str]) -> None:
    if not pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
        raise pb_utils.TritonModelException(
            f"{args['model_name']}: needs model_transaction_policy {{ decoupled: true }}")


class PrometheusMetrics:
    """metrics.MetricsBackend over pb_utils custom metrics (served on Triton's metrics port)."""

    _KINDS: ClassVar[dict[str, str]] = {"counter": "COUNTER", "gauge": "GAUGE", "histogram": "HISTOGRAM"}

    def __init__(self, specs: tuple[MetricSpec, ...]) -> None:
        self._families = {
            s.name: pb_utils.MetricFamily(name=s.name, description=s.description,
                                          kind=getattr(pb_utils.MetricFamily, self._KINDS[s.kind]))
            for s in specs
        }
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._lock = threading.Lock()

    def _metric(self, spec: MetricSpec, labels: Mapping[str, str]) -> Any:
        key = (spec.name, tuple(sorted(labels.items())))
        with self._lock:
            metric = self._metrics.get(key)
            if metric is None:
                family = self._families[spec.name]
                if spec.buckets is not None:
                    metric = family.Metric(labels=dict(labels), buckets=[float(b) for b in spec.buckets])
                else:
                    metric = family.Metric(labels=dict(labels))
                self._metrics[key] = metric
            return metric

    def add(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._metric(spec, labels).increment(float(value))

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._metric(spec, labels).set(float(value))

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._metric(spec, labels).observe(float(value))

    def close(self) -> None:
        # Metrics must go before their families (the stub refuses the reverse order).
        with self._lock:
            self._metrics.clear()
        self._families.clear()


class PreprocessingModel:
    """The tokenizer stage: text_input, or messages through the chat template -> input_ids, input_length."""

    def initialize(self, args: dict[str, str]) -> None:
        self.settings = PreprocessingSettings.from_parameters(_parameters(args), args["model_name"])
        self.tokenizer = load_tokenizer(self.settings.engine_dir)

    def execute(self, requests: list[Any]) -> list[Any]:
        names = tuple(s.name for s in PREPROCESSING_INPUTS)
        return _respond(
            requests,
            lambda request: preprocess(_inputs(request, names), self.tokenizer, self.settings.max_context,
                                       self.settings.max_prompt_bytes),
            lambda request, exc: _triton_error(exc, _caller(request).coded_errors),
        )


class _Sink:
    """responses.ResponseSink over a decoupled response sender; cancelled when the client cancels, when the model
    shuts down, or when the ensemble model marked the request's token on the CancelBoard. Asked from the scheduler's
    thread and the watcher's, so the sender's is_cancelled() and the final response are serialised (2.51 crashes
    when is_cancelled() is asked after the final response: see _Watched)."""

    def __init__(self, sender: Any, stopping: threading.Event, board: CancelBoard, caller: CallerOptions,
                 model: str) -> None:
        self.sender = sender
        self.stopping = stopping
        self.board = board
        self.token = caller.cancel_token
        self.coded = caller.coded_errors
        self.model = model
        self.closed = False
        self.lock = threading.Lock()

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        with self.lock:
            self.closed = self.closed or final
            self.sender.send(_response(outputs), flags=_FINAL if final else 0)

    def is_cancelled(self) -> bool:
        if self.stopping.is_set() or (self.token is not None and self.board.is_marked(self.token)):
            return True
        with self.lock:
            return not self.closed and self.sender.is_cancelled()

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._send_error(exc)

    def _send_error(self, exc: BaseException) -> None:
        try:
            if self.coded:  # a BLS caller (the ensemble model): see model_repo.bls.error_outputs
                self.sender.send(_response(error_outputs(exc)), flags=_FINAL)
            else:
                self.sender.send(pb_utils.InferenceResponse(error=_triton_error(exc)), flags=_FINAL)
        except Exception as send_exc:  # noqa: BLE001  (the client is gone; nothing more to tell it)
            pb_utils.Logger.log_warn(f"{self.model}: could not send the error response: {send_exc}")


class SpecDecodeModel:
    """The decoupled generation model: its requests batched in flight by one `model_repo.generations.Generations` (a
    `runtime.batching.Scheduler`: batch, bounded FIFO queue, KV budget)."""

    def initialize(self, args: dict[str, str]) -> None:
        import torch

        import runtime

        self.name = args["model_name"]
        _require_decoupled(args)
        self.settings = SpecDecodeSettings.from_parameters(_parameters(args), self.name)
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        options = dict(self.settings.load_options)
        if self.settings.device != "cpu":
            if "device" not in inspect.signature(runtime.load).parameters:
                raise pb_utils.TritonModelException(
                    f"{self.name}: device {self.settings.device!r}: this runtime.load places models on the CPU only "
                    "(it has no device argument); render the repository with --device cpu"
                )
            options["device"] = self.settings.device
        self.decoder = runtime.load(self.settings.engine_dir, **options)
        self.limits = self.settings.request_limits(self.decoder.model.config.vocab_size)
        config = self.settings.scheduler_config(lambda: available_memory_bytes(self.settings.device))
        pb_utils.Logger.log_info(
            f"{self.name}: in-flight batching of up to {config.max_concurrent_requests} requests, queue of "
            f"{config.max_queue_size}, KV budget {config.kv_budget_bytes / 2**20:.0f} MiB"
            + ("" if self.settings.kv_memory_mb else " (half the memory free after loading; kv_memory_mb: 0)")
            + (f", tree budget {config.tree_budget} nodes per step" if config.tree_budget else ""))
        self.metrics_backend = PrometheusMetrics(METRICS)
        self.metrics = SpecMetrics(self.metrics_backend, self.name, args["model_instance_name"])
        self.stopping = threading.Event()
        self.board = CancelBoard.of_server()
        self.generations = Generations(self.decoder, config, self.metrics, on_done=self._done, on_dead=self._dead,
                                       name=self.name)

    def execute(self, requests: list[Any]) -> None:
        names = tuple(s.name for s in SPEC_DECODE_INPUTS)
        for request in requests:
            sink = _Sink(request.get_response_sender(), self.stopping, self.board, _caller(request), self.name)
            try:
                parsed = parse_generate_request(_inputs(request, names), self.limits, self.decoder.tokenizer,
                                                _request_parameters(request))
                if self.stopping.is_set():
                    raise RequestCancelled("the model is shutting down")
                ids = prompt_ids(self.decoder, parsed)
                self.generations.submit(parsed, ids, sink)
            except Exception as exc:  # noqa: BLE001  (bad, oversized or one too many: answered now, as a Triton error)
                sink.fail(exc)
                self.metrics.finished(exc)
                if error_code(exc) is ErrorCode.INTERNAL:
                    pb_utils.Logger.log_error(f"{self.name}: request refused: {error_message(exc)}")

    def _done(self, request: GenerateRequest, error: BaseException | None, final: Any) -> None:
        if error is not None and error_code(error) is ErrorCode.INTERNAL:
            pb_utils.Logger.log_error(f"{self.name}: request failed: {error_message(error)}")

    def _dead(self, error: BaseException | None) -> None:
        """The scheduler's loop failed (its requests have ended with an error): this process exits, so the server
        stops being served as ready (see the module docstring)."""
        import os
        import time

        pb_utils.Logger.log_error(f"{self.name}: the batching scheduler failed ({error!r}); exiting this process so "
                                  "the server is no longer ready (deploy serve stops it with exit status 3)")
        self.generations.scheduler.close(timeout=5)
        time.sleep(DEAD_SCHEDULER_EXIT_DELAY_S)
        os._exit(1)

    def finalize(self) -> None:
        self.stopping.set()  # requests end CANCELLED ("shutting down") at the next step
        self.generations.close(timeout=30)
        self.metrics_backend.close()
        self.board.close()


class _Watched:
    """A request the watcher asks about. Tritonserver 2.51 crashes (use after free in
    TRITONBACKEND_ResponseFactoryIsCancelled, measured: SIGSEGV) when is_cancelled() is asked after the final
    response went out, so the question and the final response are serialised by `lock` and `done`."""

    def __init__(self, token: str, sender: Any) -> None:
        self.token = token
        self.sender = sender
        self.lock = threading.Lock()
        self.done = False


class _CancelWatch:
    """The ensemble model's watcher: every CANCEL_POLL_S it asks each in-flight request's sender whether its client
    cancelled (or disconnected), and marks that request's token on the CancelBoard for spec_decode to see."""

    def __init__(self, board: CancelBoard, model: str) -> None:
        self.board = board
        self.model = model
        self._watched: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{model}-cancel-watch", daemon=True)
        self._thread.start()

    def add(self, token: str, sender: Any) -> None:
        with self._lock:
            self._watched[token] = _Watched(token, sender)

    def remove(self, token: str) -> None:
        """Stop asking about it; call before its final response is sent."""
        with self._lock:
            watched = self._watched.pop(token, None)
        if watched is not None:
            with watched.lock:
                watched.done = True

    def _run(self) -> None:
        while not self._stop.wait(CANCEL_POLL_S):
            with self._lock:
                watched = list(self._watched.values())
            for w in watched:
                with w.lock:
                    if w.done:
                        continue
                    try:
                        cancelled = w.sender.is_cancelled()
                    except Exception as exc:  # noqa: BLE001  (the watcher must outlive any one request)
                        pb_utils.Logger.log_warn(f"{self.model}: is_cancelled failed: {exc}")
                        continue
                if cancelled:
                    self.board.mark(w.token)
                    self.remove(w.token)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class EnsembleModel:
    """The entry point (decoupled, BLS): preprocessing, then spec_decode's responses streamed back; a client's
    cancellation or disconnect reaches spec_decode through the CancelBoard (see the module docstring)."""

    def initialize(self, args: dict[str, str]) -> None:
        self.name = args["model_name"]
        _require_decoupled(args)
        self.settings = EnsembleSettings.from_parameters(_parameters(args), self.name)
        self.metrics_backend = PrometheusMetrics(ENTRY_METRICS)
        self.metrics = EntryMetrics(self.metrics_backend, self.name, args["model_instance_name"])
        limit = self.settings.max_in_flight
        self.metrics.in_flight(0, limit)
        self.in_flight = InFlight(limit, "max_in_flight", lambda n: self.metrics.in_flight(n, limit))
        self.board = CancelBoard.of_server()
        self.watch = _CancelWatch(self.board, self.name)
        self.pool = ThreadPoolExecutor(max_workers=self.settings.max_in_flight, thread_name_prefix=f"{self.name}-req")
        self.input_names = {i.name for i in ENSEMBLE_INPUTS}
        self.pre_names = {i.name for i in PREPROCESSING_INPUTS}
        self.output_names = [o.name for o in SPEC_DECODE_OUTPUTS]
        self._kept: collections.deque = collections.deque(maxlen=KEEP_BLS_ITERATORS)
        self._kept_lock = threading.Lock()

    def _keep(self, responses: Any) -> None:
        """Hold a BLS response iterator well past its end. The stub's C++ cleanup thread drops its own reference to
        a finished iterator; were that the last one, the iterator's responses (numpy arrays inside) would be freed
        there, without the GIL. Dropping the oldest kept one here, in a Python thread, frees it with the GIL."""
        with self._kept_lock:
            self._kept.append(responses)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self.in_flight.enter()
            except Exception as exc:  # noqa: BLE001  (one too many: answered now, UNAVAILABLE)
                sender.send(pb_utils.InferenceResponse(error=_triton_error(exc, _caller(request).coded_errors)),
                            flags=_FINAL)
                self.metrics.ended(exc)
                continue
            self.pool.submit(self._serve, request, sender)

    def _serve(self, request: Any, sender: Any) -> None:
        token = self.board.new_token()
        state = {"final": False, "left": False, "passed": False}  # passed: spec_decode has it (and counts it)
        coded = _caller(request).coded_errors  # the client's own wish (deploy client, OpenAI frontend)

        def leave() -> None:
            if not state["left"]:
                state["left"] = True
                self.watch.remove(token)
                self.in_flight.leave()

        def finish(response: Any) -> None:
            leave()  # room for the next request before this client hears the end of this one
            sender.send(response, flags=_FINAL)
            state["final"] = True

        self.watch.add(token, sender)
        try:
            # tensorrtllm_backend's shapes: every input [batch, ...]; each row is one spec_decode request (rows run
            # one after another), its responses tagged with batch_index; the last row's final response ends it all.
            rows = split_batch({t.name(): t.as_numpy() for t in request.inputs() if t.name() in self.input_names})
            for row, row_inputs in enumerate(rows):
                last_row = row == len(rows) - 1
                tensors = [pb_utils.Tensor(k, v) for k, v in row_inputs.items()]
                pre = pb_utils.InferenceRequest(
                    model_name=self.settings.preprocessing, requested_output_names=["input_ids"],
                    inputs=[t for t in tensors if t.name() in self.pre_names],
                    parameters={CODED_ERRORS_PARAMETER: True},
                ).exec()
                if pre.has_error():
                    error = _bls_error(pre, coded)
                    if not state["passed"]:
                        self.metrics.ended(decode_error_message(pre.error().message())[0])
                    finish(pb_utils.InferenceResponse(error=error))
                    return
                ids = pb_utils.get_output_tensor_by_name(pre, "input_ids")
                state["passed"] = True
                responses = pb_utils.InferenceRequest(
                    model_name=self.settings.spec_decode, requested_output_names=self.output_names,
                    inputs=[pb_utils.Tensor("input_ids", ids.as_numpy()), *tensors],
                    parameters={CODED_ERRORS_PARAMETER: True, CANCEL_TOKEN_PARAMETER: token},
                ).exec(decoupled=True)
                self._keep(responses)
                row_done = False
                for response in responses:
                    if state["final"] or row_done:
                        continue  # drain: nothing may follow the final response
                    if response.has_error():
                        finish(pb_utils.InferenceResponse(error=_bls_error(response, coded)))
                        continue
                    outputs = response.output_tensors()
                    if not outputs:
                        continue  # the empty response that ends a decoupled stream
                    row_done = is_final_response([t.name() for t in outputs])
                    arrays = {t.name(): t.as_numpy() for t in outputs}
                    failed = error_of_outputs(arrays) if row_done else None
                    if failed is not None:  # spec_decode's error, as a final response (model_repo.bls.error_outputs)
                        code, message = failed
                        finish(pb_utils.InferenceResponse(error=_coded_triton_error(code, message, coded)))
                        continue
                    batched = _response(batch_row_outputs(arrays, row))
                    if row_done and last_row:
                        finish(batched)
                    else:
                        sender.send(batched, flags=0)
                if state["final"]:
                    return
                if not row_done:
                    raise RuntimeError(f"{self.settings.spec_decode} ended the stream without a final response")
        except Exception as exc:  # noqa: BLE001  (every failure goes back to the client as a Triton error)
            if not state["passed"]:
                self.metrics.ended(exc)
            if not state["final"]:
                if error_code(exc) is ErrorCode.INTERNAL:
                    pb_utils.Logger.log_error(f"{self.name}: request failed: {error_message(exc)}")
                try:
                    finish(pb_utils.InferenceResponse(error=_triton_error(exc, coded)))
                except Exception as send_exc:  # noqa: BLE001  (the client is gone)
                    pb_utils.Logger.log_warn(f"{self.name}: could not send the error response: {send_exc}")
        finally:
            leave()
            self.board.clear(token)

    def finalize(self) -> None:
        self.watch.close()
        self.pool.shutdown(wait=True)
        self.board.close()
        self.metrics_backend.close()


__all__ = ["EnsembleModel", "PreprocessingModel", "PrometheusMetrics", "SpecDecodeModel"]


# ---- the tensorrtllm-backend repository's python stages (model_repo/tensorrtllm.py) ----------------------------
# Untested under a server: no tensorrtllm backend runs where this was written (see model_repo/tensorrtllm.py).


class TrtllmPreprocessingModel:
    """QUERY, REQUEST_OUTPUT_LEN, ... -> INPUT_ID, ... (the public preprocessing's interface, our tokenizer)."""

    def initialize(self, args: dict[str, str]) -> None:
        from model_repo.tensorrtllm import PREPROCESSING_INPUTS
        from runtime.engine import open_engine

        params = _parameters(args)
        self.names = tuple(i.name for i in PREPROCESSING_INPUTS)
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])
        self.add_special_tokens = params["add_special_tokens"].lower() in ("true", "1", "yes")
        self.max_context = open_engine(params["tokenizer_dir"]).limits.max_seq_len

    def execute(self, requests: list[Any]) -> list[Any]:
        from model_repo.tensorrtllm import preprocess_batch

        return _respond(requests, lambda request: preprocess_batch(
            _inputs(request, self.names), self.tokenizer, self.add_special_tokens, self.max_context))


class TrtllmPostprocessingModel:
    """TOKENS_BATCH, SEQUENCE_LENGTH -> OUTPUT (the public postprocessing's interface, our tokenizer)."""

    def initialize(self, args: dict[str, str]) -> None:
        params = _parameters(args)
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])
        self.skip_special_tokens = params["skip_special_tokens"].lower() in ("true", "1", "yes")

    def execute(self, requests: list[Any]) -> list[Any]:
        from model_repo.tensorrtllm import postprocess_batch

        return _respond(requests, lambda request: postprocess_batch(
            _inputs(request, ("TOKENS_BATCH", "SEQUENCE_LENGTH")), self.tokenizer, self.skip_special_tokens))


class TrtllmBlsModel:
    """Decoupled BLS: preprocessing -> tensorrt_llm -> postprocessing through BLS calls (model_repo.tensorrtllm)."""

    def initialize(self, args: dict[str, str]) -> None:
        from pathlib import Path

        from model_repo.tensorrtllm import CLIENT_INPUTS, SAMPLING_CLIENT_INPUTS, decoding_mode_of

        self.names = tuple(i.name for i in CLIENT_INPUTS + SAMPLING_CLIENT_INPUTS)
        # args["model_repository"] is this model's directory; the repository root holds tensorrt_llm/.
        self.decoding_mode = decoding_mode_of(Path(args["model_repository"]).parent)

    @staticmethod
    def _infer(model: str, inputs: Mapping[str, np.ndarray], decoupled: bool):
        request = pb_utils.InferenceRequest(model_name=model, requested_output_names=[],
                                            inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()])
        for response in request.exec(decoupled=True) if decoupled else [request.exec()]:
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            yield {t.name(): t.as_numpy() for t in response.output_tensors()}

    def execute(self, requests: list[Any]) -> None:
        from model_repo.tensorrtllm import bls_generate

        for request in requests:
            sender = request.get_response_sender()
            try:
                for outputs in bls_generate(_inputs(request, self.names), self.decoding_mode, self._infer):
                    sender.send(_response(outputs))
            except Exception as exc:  # noqa: BLE001  (every failure goes back to the client as a Triton error)
                sender.send(pb_utils.InferenceResponse(error=_triton_error(exc)), flags=_FINAL)
            else:
                sender.send(flags=_FINAL)


class SpectreeVerifyModel:
    """Our lossless verification stage: runtime.verify over the engine's tree logits (model_repo.tensorrtllm)."""

    def initialize(self, args: dict[str, str]) -> None:
        from model_repo.tensorrtllm import VERIFY_INPUTS, VerifySettings

        self.names = tuple(i.name for i in VERIFY_INPUTS)
        self.settings = VerifySettings.from_parameters(_parameters(args), args["model_name"])

    def execute(self, requests: list[Any]) -> list[Any]:
        from model_repo.tensorrtllm import verify_tree_logits

        return _respond(requests, lambda request: verify_tree_logits(_inputs(request, self.names), self.settings))


__all__ += ["SpectreeVerifyModel", "TrtllmBlsModel", "TrtllmPostprocessingModel", "TrtllmPreprocessingModel"]
