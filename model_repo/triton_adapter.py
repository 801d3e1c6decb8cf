"""The one module that touches triton_python_backend_utils: Triton python-backend models over `pipeline`.

Each rendered model.py imports one class from here as TritonPythonModel. This module is only importable inside
the python backend's stub process (where triton_python_backend_utils exists); tests drive it through a real
tritonserver.

spec_decode is decoupled: `execute` parses and admits each request (a bad request or a full house is answered
at once with a Triton error), then runs its generation on a worker thread, so up to max_concurrent_requests
generations share the instance (each has its own KV cache and drafter session; torch releases the GIL inside
its kernels). Workers check the request's cancellation after every decode step.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
import triton_python_backend_utils as pb_utils

from model_repo.pipeline import (
    METRICS,
    PREPROCESSING_INPUTS,
    SPEC_DECODE_INPUTS,
    ErrorCode,
    MetricSpec,
    PreprocessingSettings,
    RequestCancelled,
    RequestLimits,
    Slots,
    SpecDecodeSettings,
    SpecMetrics,
    error_code,
    error_message,
    load_tokenizer,
    parse_generate_request,
    preprocess,
    run_generation,
)

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _triton_error(exc: BaseException) -> Any:
    code = getattr(pb_utils.TritonError, error_code(exc).value)
    return pb_utils.TritonError(error_message(exc), code)


def _inputs(request: Any, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    out = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            out[name] = tensor.as_numpy()
    return out


def _response(outputs: Mapping[str, np.ndarray]) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])


def _parameters(args: dict[str, str]) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


class PrometheusMetrics:
    """pipeline.MetricsBackend over pb_utils custom metrics (served on Triton's metrics port)."""

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
        responses = []
        for request in requests:
            try:
                outputs = preprocess(_inputs(request, names), self.tokenizer, self.settings.max_context)
            except Exception as exc:  # noqa: BLE001  (every failure goes back to the client as a Triton error)
                responses.append(pb_utils.InferenceResponse(error=_triton_error(exc)))
            else:
                responses.append(_response(outputs))
        return responses


class _Sink:
    """pipeline.ResponseSink over a decoupled response sender."""

    def __init__(self, sender: Any, stopping: threading.Event) -> None:
        self.sender = sender
        self.stopping = stopping
        self.closed = False

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        self.sender.send(_response(outputs), flags=_FINAL if final else 0)
        self.closed = final

    def is_cancelled(self) -> bool:
        return self.stopping.is_set() or self.sender.is_cancelled()

    def fail(self, exc: BaseException) -> None:
        if not self.closed:
            self.sender.send(pb_utils.InferenceResponse(error=_triton_error(exc)), flags=_FINAL)
            self.closed = True


class SpecDecodeModel:
    """The decoupled generation model: the runtime's draft -> verify -> commit loop per request."""

    def initialize(self, args: dict[str, str]) -> None:
        import torch

        import runtime

        self.name = args["model_name"]
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(f"{self.name}: needs model_transaction_policy {{ decoupled: true }}")
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
        self.limits = RequestLimits(max_tokens=self.settings.max_tokens_limit,
                                    vocab_size=self.decoder.model.config.vocab_size)
        self.metrics_backend = PrometheusMetrics(METRICS)
        self.metrics = SpecMetrics(self.metrics_backend, self.name, args["model_instance_name"])
        self.slots = Slots(self.settings.max_concurrent_requests, on_change=self.metrics.active)
        self.metrics.capacity(self.slots.capacity)
        self.metrics.active(0)
        self.stopping = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=self.slots.capacity, thread_name_prefix=f"{self.name}-gen")

    def execute(self, requests: list[Any]) -> None:
        names = tuple(s.name for s in SPEC_DECODE_INPUTS)
        for request in requests:
            sink = _Sink(request.get_response_sender(), self.stopping)
            try:
                parsed = parse_generate_request(_inputs(request, names), self.limits)
                if self.stopping.is_set():
                    raise RequestCancelled("the model is shutting down")
                self.slots.acquire()
            except Exception as exc:  # noqa: BLE001  (a bad request or a full house: answered now, as a Triton error)
                sink.fail(exc)
                self.metrics.finished(exc)
                continue
            self.pool.submit(self._generate, parsed, sink)

    def _generate(self, request: Any, sink: _Sink) -> None:
        final = None
        error: BaseException | None = None
        try:
            final = run_generation(self.decoder, request, sink)
        except Exception as exc:  # noqa: BLE001  (every failure goes back to the client as a Triton error)
            error = exc
            try:
                sink.fail(exc)
            except Exception as send_exc:  # noqa: BLE001  (the client is gone; nothing more to tell it)
                pb_utils.Logger.log_warn(f"{self.name}: could not send the error response: {send_exc}")
        finally:
            self.slots.release()
            self.metrics.finished(error, final)
        if error is not None and error_code(error) is ErrorCode.INTERNAL:
            pb_utils.Logger.log_error(f"{self.name}: request failed: {error_message(error)}")

    def finalize(self) -> None:
        self.stopping.set()  # running generations end at their next step with CANCELLED
        self.pool.shutdown(wait=True)
        self.metrics_backend.close()


__all__ = ["PreprocessingModel", "PrometheusMetrics", "SpecDecodeModel"]
