"""The HTTP front: the documented HTTP port of `python -m deploy serve`, in front of tritonserver's own HTTP endpoint
(which then listens on a private loopback port).

Why: tritonserver 2.51's HTTP generate endpoints cannot be fixed from a model. They answer 500 for a client's own
mistakes (malformed JSON, a text body, `max_tokens: "8"`, a seed beyond 2**64) without naming the field, silently
wrap an INT32 (`max_tokens: 3000000000` arrives as -1294967296), ignore unknown fields, answer 400 for an overloaded
server, and never cancel a non-streaming request whose client went away (the generation ran to its end).

What it does (`create_app`):
  POST /v2/models/{model}[/versions/{v}]/generate and /generate_stream: the JSON body is read here (an object of
       the model's input names -> a value or a flat list, plus `parameters`: request parameters), every value
       checked against the input's Triton datatype, shape and range, and every string for valid Unicode; a
       mistake is a 400 naming the field, the value and what was expected (`generate_inputs`). The request then
       goes to tritonserver over gRPC (`deploy.triton_stream`), and its responses come back in Triton's own
       JSON (`result_json`: outputs as scalars or flat lists, model_name, model_version), one Server-Sent Event
       each on generate_stream. A client that disconnects cancels the gRPC stream, so the generation stops at its
       next step, streaming or not. Model errors get the status their Triton code means (`STATUS`): 400 invalid,
       503 overloaded / unavailable, 404 unknown model, 500 internal; a stream that fails after it started ends
       with a `data: {"error": ...}` event.
  GET  /v2/health/ready and /live: 503 as soon as `deploy serve` found the server lost (`HttpFront.lost`), before
       anything is stopped; otherwise tritonserver's answer.
  anything else (metadata, model config, statistics, infer, and the admin APIs, whose header check stays
       tritonserver's): passed to tritonserver's HTTP endpoint as it came, and its answer back as it came.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from deploy.server import tcp_port
from deploy.triton_stream import StreamError, stream_request
from model_repo.errors import ErrorCode
from runtime import schema
from runtime.errors import ConfigError, RequestError, SpectreeError
from runtime.schema import setting

# What a client gets for each Triton error code (model_repo.errors.ErrorCode).
STATUS = {ErrorCode.INVALID_ARG: 400, ErrorCode.UNAVAILABLE: 503, ErrorCode.CANCELLED: 499,
          ErrorCode.INTERNAL: 500}
PARAMETERS_KEY = "parameters"  # the body's key for request parameters (Triton's generate extension)
# Inputs whose value is JSON text: a client may send the JSON itself (an object or array) instead of its text.
JSON_TEXT_INPUTS = ("messages", "sampling_parameters")
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                         "transfer-encoding", "upgrade", "host", "content-length"})


@dataclass(frozen=True)
class FrontConfig:
    """The HTTP front's settings (`python -m deploy serve` fills them)."""

    grpc_url: str  # tritonserver's gRPC endpoint, HOST:PORT (generate requests go there)
    triton_http: str  # tritonserver's own HTTP endpoint, HOST:PORT (everything else goes there)
    port: int = tcp_port(8000)
    host: str = "127.0.0.1"
    timeout_s: float = setting(600.0, gt=0.0)  # a generate request's gRPC stream is cancelled after this long
    max_body_bytes: int = setting(64 * 2**20, ge=1)  # tritonserver's own default (--http-max-input-size)

    def __post_init__(self) -> None:
        schema.check(self, ConfigError, "http front")


class FrontError(SpectreeError, ValueError):
    """A request the front answers itself: `status` and Triton's error body {"error": message}."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class InputSpec:
    """A model input as its config declares it."""

    name: str
    datatype: str  # Triton's wire name: BYTES, BOOL, INT32, UINT64, FP32, ...
    dims: tuple[int, ...]  # without the batch dimension; -1: any size


@dataclass(frozen=True)
class ModelSpec:
    inputs: dict[str, InputSpec]
    batched: bool  # max_batch_size > 0: every input gets a leading batch dimension of 1

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """From a model config as tritonclient's get_model_config(as_json=True)["config"] gives it."""
        inputs = {}
        for i in config.get("input", []):
            kind = i.get("data_type", "TYPE_STRING")
            wire = "BYTES" if kind == "TYPE_STRING" else kind.removeprefix("TYPE_")
            inputs[i["name"]] = InputSpec(i["name"], wire, tuple(int(d) for d in i.get("dims", [])))
        return cls(inputs=inputs, batched=int(config.get("max_batch_size", 0) or 0) > 0)


# ---- requests: JSON body -> Triton inputs (pure) ---------------------------------------------------------------


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (FrontError 400 otherwise: not UTF-8, not JSON, not an object)."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise FrontError(f"the request body is not UTF-8 text ({exc}); expected a JSON object") from exc
    except ValueError as exc:
        raise FrontError(f"the request body is not valid JSON ({exc}); expected a JSON object of input names to "
                         "values, e.g. {\"text_input\": \"Hello\", \"max_tokens\": 16}") from exc
    if not isinstance(body, dict):
        raise FrontError(f"the request body is a JSON {type(body).__name__}; expected a JSON object of input names "
                         "to values, e.g. {\"text_input\": \"Hello\", \"max_tokens\": 16}")
    return body


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


# The datatypes a JSON value can be given for (BF16 has no numpy dtype to carry it).
JSON_DATATYPES = frozenset({"BYTES", "BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64",
                            "FP16", "FP32", "FP64"})


def _element(spec: InputSpec, value: Any) -> Any:
    """One element of an input, checked against its datatype; FrontError names the input."""
    if spec.datatype not in JSON_DATATYPES:
        raise FrontError(f"{spec.name}: inputs of type {spec.datatype} are not taken over JSON here; use gRPC")
    dtype = np.dtype(_np_dtype(spec.datatype))
    if spec.datatype == "BYTES":
        if spec.name in JSON_TEXT_INPUTS and isinstance(value, (dict, list)):
            value = json.dumps(value, ensure_ascii=False)
        if not isinstance(value, str):
            raise FrontError(f"{spec.name}: expected a string (BYTES), got {_shown(value)}")
        return value.encode("utf-8")
    if spec.datatype == "BOOL":
        if not isinstance(value, bool):
            raise FrontError(f"{spec.name}: expected true or false (BOOL), got {_shown(value)}")
        return value
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if isinstance(value, bool) or not isinstance(value, int) or not info.min <= value <= info.max:
            raise FrontError(f"{spec.name}: expected an integer in [{info.min}, {info.max}] ({spec.datatype}), got "
                             f"{_shown(value)}")
        return value
    if dtype.kind == "f":
        limit = float(np.finfo(dtype).max)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= limit:
            raise FrontError(f"{spec.name}: expected a number ({spec.datatype}, magnitude at most {limit:.4g}), got "
                             f"{_shown(value)}")
    return value


def _np_dtype(datatype: str) -> Any:
    from tritonclient.utils import triton_to_np_dtype

    return np.object_ if datatype == "BYTES" else triton_to_np_dtype(datatype)


def _array(spec: InputSpec, value: Any) -> np.ndarray:
    values = value if isinstance(value, list) and not (spec.name in JSON_TEXT_INPUTS and _is_json_value(value)) \
        else [value]
    if any(isinstance(v, list) for v in values) and spec.name not in JSON_TEXT_INPUTS:
        raise FrontError(f"{spec.name}: expected a value or a flat list of values, got a nested list")
    fixed = [d for d in spec.dims if d != -1]
    if len(spec.dims) == 1 and fixed and len(values) != fixed[0]:
        raise FrontError(f"{spec.name}: expected {'one value' if fixed[0] == 1 else f'{fixed[0]} values'} (shape "
                         f"{list(spec.dims)}), got {len(values)}")
    return np.array([_element(spec, v) for v in values], dtype=_np_dtype(spec.datatype))


def _is_json_value(value: list) -> bool:
    """A list given for a JSON-text input is the JSON value itself (messages: [{role, content}, ...]), not a list
    of texts."""
    return not all(isinstance(v, str) for v in value)


def generate_inputs(body: Mapping[str, Any], model: ModelSpec, name: str) -> tuple[dict[str, np.ndarray],
                                                                                   dict[str, Any]]:
    """A generate request's JSON body -> (the model's inputs, as arrays shaped for it; request parameters).
    FrontError 400 names the field: unknown fields, values of the wrong type, range or shape, invalid text."""
    from runtime.tokenizer import check_unicode

    for key, value in body.items():
        try:
            check_unicode(key, "a field name")
            check_unicode(value, key)
        except RequestError as exc:
            raise FrontError(str(exc)) from exc
    unknown = sorted(set(body) - set(model.inputs) - {PARAMETERS_KEY})
    if unknown:
        raise FrontError(f"unknown field(s) {unknown}; {name} takes {sorted(model.inputs)}, and "
                         f"{PARAMETERS_KEY!r} (request parameters)")
    parameters = body.get(PARAMETERS_KEY) or {}
    if not isinstance(parameters, dict) or not all(
            isinstance(v, (str, int, float, bool)) and not (isinstance(v, float) and not math.isfinite(v))
            for v in parameters.values()):
        raise FrontError(f"{PARAMETERS_KEY}: expected an object of strings, numbers and booleans, got "
                         f"{_shown(body.get(PARAMETERS_KEY))}")
    inputs = {}
    for key, value in body.items():
        if key == PARAMETERS_KEY or value is None:
            continue
        arr = _array(model.inputs[key], value)
        inputs[key] = arr[np.newaxis] if model.batched else arr
    return inputs, dict(parameters)


def asks_to_stream(inputs: Mapping[str, np.ndarray]) -> bool:
    stream = inputs.get("stream")
    return stream is not None and bool(np.asarray(stream).reshape(-1)[0])


# ---- responses: Triton results -> Triton's generate JSON (pure) -------------------------------------------------


def _json_value(arr: np.ndarray) -> Any:
    flat = arr.reshape(-1)
    values = [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v.item() for v in flat]
    values = [None if isinstance(v, float) and not math.isfinite(v) else v for v in values]
    return values[0] if len(values) == 1 else values


def result_json(model: str, version: str, outputs: Mapping[str, np.ndarray]) -> bytes:
    """One response as tritonserver's generate endpoints write it: model_name, model_version and every output,
    a scalar when it has one element, else a flat list; keys sorted, compact, UTF-8. (Non-finite numbers, which
    JSON cannot hold, are null.)"""
    body = {"model_name": model, "model_version": version, **{k: _json_value(v) for k, v in outputs.items()}}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def error_json(message: str) -> bytes:
    return json.dumps({"error": message}, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _outputs(result: Any) -> dict[str, np.ndarray]:
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


# ---- the ASGI app ------------------------------------------------------------------------------------------------


class HttpFront:
    """The front's state (`lost`, set by `deploy serve`'s watcher) and its app; `serve()` runs it on a thread."""

    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        self.lost: str | None = None  # why the server can serve no more: readiness and liveness answer 503
        self.app = create_app(self)
        self._server: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self) -> None:
        from deploy.asgi import AppServer

        self._server = AppServer(self.app, self.config.host, self.config.port, "HTTP front")
        self._server.start()

    @staticmethod
    def available() -> str | None:
        """None when the front can run here, else why not (its packages are missing)."""
        import importlib.util

        missing = [m for m in ("starlette", "uvicorn", "tritonclient.grpc") if importlib.util.find_spec(
            m.split(".")[0]) is None]
        return None if not missing else (f"the HTTP front needs {', '.join(missing)} (pip install "
                                         "'spectree-llm[serve]' 'tritonclient[grpc]')")

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


def create_app(front: HttpFront) -> Any:
    """The Starlette app (one gRPC channel to tritonserver, opened at startup)."""
    import http.client

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from deploy.asgi import ClientGone, grpc_client_lifespan, unless_disconnected

    config = front.config
    state: dict[str, Any] = {}
    specs: dict[str, ModelSpec] = {}

    lifespan = grpc_client_lifespan(config.grpc_url, state)

    def error(message: str, status: int) -> Response:
        return Response(error_json(message), status_code=status, media_type="application/json")

    async def model_spec(model: str, version: str) -> ModelSpec:
        from tritonclient.utils import InferenceServerException

        key = f"{model}/{version}"
        if key not in specs:
            try:
                config_json = await state["client"].get_model_config(model, version, as_json=True)
            except InferenceServerException as exc:
                status = 404 if "unknown model" in str(exc.message()) or "not found" in str(exc.message()) else 503
                raise FrontError(exc.message() or str(exc), status) from exc
            specs[key] = ModelSpec.from_config(config_json["config"])
        return specs[key]

    async def read_body(request: Request) -> bytes:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > config.max_body_bytes:
            raise FrontError(f"the request body is {size} bytes; this server takes at most {config.max_body_bytes}",
                             413)
        raw = await request.body()
        if len(raw) > config.max_body_bytes:
            raise FrontError(f"the request body is {len(raw)} bytes; this server takes at most "
                             f"{config.max_body_bytes}", 413)
        return raw

    async def generate(request: Request, streaming: bool) -> Response:
        model = request.path_params["model"]
        version = request.path_params.get("version", "")
        try:
            body = parse_body(await read_body(request))
            inputs, parameters = generate_inputs(body, await model_spec(model, version), model)
            if not streaming and asks_to_stream(inputs):
                raise FrontError("stream: true asks for a stream of responses; POST to .../generate_stream for "
                                 "that (.../generate answers once)")
        except FrontError as exc:
            return error(str(exc), exc.status)
        results = stream_request(state["client"], model, inputs, config.timeout_s, parameters, version)
        try:
            if not streaming:
                got = await unless_disconnected(request, _collect(results))
                return Response(result_json(model, got.get_response().model_version, _outputs(got)),
                                media_type="application/json")
            first = await unless_disconnected(request, results.__anext__())
        except StreamError as exc:
            await results.aclose()
            return error(str(exc), STATUS[exc.code])
        except ClientGone:
            await results.aclose()
            return Response(status_code=499)  # nobody reads it
        except StopAsyncIteration:
            return error(f"{model} ended the stream without a response", 500)

        async def events() -> AsyncIterator[bytes]:
            try:
                result = first
                while True:
                    yield b"data: " + result_json(model, result.get_response().model_version,
                                                  _outputs(result)) + b"\n\n"
                    result = await results.__anext__()
            except StopAsyncIteration:
                pass
            except StreamError as exc:
                yield b"data: " + error_json(str(exc)) + b"\n\n"
            finally:
                await results.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def generate_once(request: Request) -> Response:
        return await generate(request, streaming=False)

    async def generate_stream(request: Request) -> Response:
        return await generate(request, streaming=True)

    async def health(request: Request) -> Response:
        if front.lost is not None:
            return error(f"the server is going down: {front.lost}", 503)
        return await proxy(request)

    async def proxy(request: Request) -> Response:
        body = await request.body()
        path = request.scope.get("raw_path") or request.url.path.encode()
        target = path.decode("latin-1") + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        host, port = config.triton_http.rsplit(":", 1)

        def call() -> tuple[int, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection(host, int(port), timeout=config.timeout_s)
            try:
                conn.request(request.method, target, body=body or None, headers=headers)
                answer = conn.getresponse()
                return answer.status, answer.getheaders(), answer.read()
            finally:
                conn.close()

        try:
            status, answer_headers, data = await asyncio.to_thread(call)
        except OSError as exc:
            return error(f"tritonserver's HTTP endpoint is not reachable ({exc})", 503)
        return Response(data, status_code=status,
                        headers={k: v for k, v in answer_headers if k.lower() not in _HOP_BY_HOP})

    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]
    return Starlette(routes=[
        Route("/v2/models/{model}/generate", generate_once, methods=["POST"]),
        Route("/v2/models/{model}/generate_stream", generate_stream, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/generate", generate_once, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/generate_stream", generate_stream, methods=["POST"]),
        Route("/v2/health/ready", health, methods=["GET", "HEAD"]),
        Route("/v2/health/live", health, methods=["GET", "HEAD"]),
        Route("/{path:path}", proxy, methods=methods),
    ], lifespan=lifespan)


async def _collect(results: AsyncIterator[Any]) -> Any:
    """The one response of a non-streaming request (its final one)."""
    last = None
    async for result in results:
        last = result
    if last is None:
        raise StreamError(ErrorCode.INTERNAL, "the model ended the request without a response")
    return last


__all__ = ["FrontConfig", "FrontError", "HttpFront", "InputSpec", "ModelSpec", "STATUS", "asks_to_stream",
           "create_app", "error_json", "generate_inputs", "parse_body", "result_json"]
