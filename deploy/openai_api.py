"""An OpenAI-compatible HTTP API in front of tritonserver: `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (streamed as server-sent events, or whole), served by uvicorn (an ASGI server) over a
Starlette app, each request one gRPC stream to the served repository's generation model.

    python -m deploy serve --repo REPO --openai-port 8080      (tritonserver + this frontend)
    client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="unused")
    client.chat.completions.create(model=MODEL, messages=[...], stream=True)

What goes to Triton: the prompt (completions: text_input, or input_ids for a token-id prompt; chat: messages,
rendered by the engine's chat template server-side, the same `Tokenizer.apply_chat_template` as
`python -m runtime generate --chat`, so greedy text is identical), sampling settings as vllm_backend's
sampling_parameters JSON, always streamed (a whole response is the streamed deltas joined). The sampling fields are
those of the request contract (runtime.request_fields: the fields an endpoint takes under their own names), read
as the server reads vLLM's sampling keys (`vllm_values`) and checked here by the contract (as the server's request
parser checks them), its error restated with the request's field name. Supported request fields: model, prompt /
messages, max_tokens (chat: also max_completion_tokens), temperature, top_p, n (1), stream,
stream_options.include_usage, stop, seed, presence_penalty, frequency_penalty, logprobs (completions: the number
of alternatives; chat: a bool, with top_logprobs), echo and best_of (1) (completions), user; vLLM's extra fields
top_k, min_tokens, repetition_penalty, ignore_eos. Anything else that changes the output (tools, logit_bias,
response_format other than text, suffix, best_of > 1) is refused with a 400 naming the field, never ignored.

Log-probabilities are those the server reports (runtime.sampling.token_logprobs: the distribution each token was
drawn from). `usage` carries the OpenAI counts plus `spec_decode`, this server's speculation statistics (vLLM's
meanings): steps (drafts), draft_tokens (positions speculated: steps x tree depth), accepted_tokens,
acceptance_rate, mean_accepted_length, tau, verification.

Errors are OpenAI's shape ({"error": {"message", "type", "param", "code"}}): a request the server refuses as
invalid is 400, an overloaded server 503, an unknown model 404; a stream that fails after it started ends with an
`error` event.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deploy.client import output_text
from deploy.server import tcp_port
from deploy.triton_stream import StreamError, stream_request
from model_repo.errors import OVERLOADED, ErrorCode
from runtime import schema
from runtime.errors import ConfigError, RequestError, SpectreeError
from runtime.files import read_json_object
from runtime.request_fields import VLLM_DEFAULTS, openai_fields, sampling_params, vllm_values
from runtime.schema import setting

COMPLETIONS_DEFAULT_MAX_TOKENS = VLLM_DEFAULTS["max_tokens"]  # OpenAI's default for /v1/completions (vLLM's too)


@dataclass(frozen=True)
class OpenAIConfig:
    """The frontend's settings (`python -m deploy serve --openai-port` fills them)."""

    grpc_url: str  # tritonserver's gRPC endpoint, HOST:PORT
    repo: str  # the served model repository (spectree-repo.json names the engine: tokenizer, context, limits)
    port: int = tcp_port(8080)
    host: str = "127.0.0.1"
    model: str = "spec_decode"  # the Triton model requests go to (vllm_backend's shapes, max_batch_size 0)
    served_model_name: str | None = None  # the id /v1/models lists and requests name; None: the engine's name
    timeout_s: float = setting(600.0, gt=0.0)  # a request's gRPC stream is cancelled after this long (seconds)

    def __post_init__(self) -> None:
        schema.check(self, ConfigError, "openai")


@dataclass(frozen=True)
class ServedModel:
    """What the frontend knows of the repository it fronts."""

    name: str  # the OpenAI model id
    tokenizer: Any  # runtime.tokenizer.Tokenizer (token texts for log-probabilities)
    max_tokens_limit: int  # the largest max_tokens the server takes (the chat default)
    created: int  # /v1/models `created`: the repository's render time

    @classmethod
    def from_repo(cls, repo: str | Path, name: str | None = None) -> ServedModel:
        from model_repo.engines import load_tokenizer

        manifest_path = Path(repo) / "spectree-repo.json"
        try:
            manifest = read_json_object(manifest_path, ConfigError)
            engine = manifest["options"]["engine"]
            limit = int(manifest["max_tokens_limit"])
        except (ConfigError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{manifest_path}: not a rendered repository's manifest ({exc}); render the repository "
                              "with python -m model_repo render") from exc
        return cls(name=name or Path(engine).resolve().name, tokenizer=load_tokenizer(engine),
                   max_tokens_limit=limit, created=int(manifest_path.stat().st_mtime))


class APIError(SpectreeError, ValueError):
    """A request the API refuses, in OpenAI's error shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


# ---- requests: OpenAI JSON -> Triton inputs (pure) ------------------------------------------------------


@dataclass(frozen=True)
class GenerationCall:
    """One OpenAI request, translated: the Triton inputs (max_batch_size 0 shapes) and how to answer."""

    kind: str  # "completion" | "chat"
    model: str
    inputs: dict[str, np.ndarray]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool  # report log-probabilities
    top_logprobs: int  # alternatives per token
    echo: str = ""  # completions with echo: the prompt text put before the completion


_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logit_bias", "suffix", "audio",
                "prediction", "modalities", "parallel_tool_calls", "guided_json", "guided_regex", "guided_choice")
_IGNORED = ("user", "metadata", "store", "service_tier", "stream_options", "reasoning_effort")  # no effect on text


def _get(body: Mapping[str, Any], key: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise APIError(f"{key}: expected {what}, got {value!r}", param=key)
    if not isinstance(value, kinds):
        raise APIError(f"{key}: expected {what}, got {json.dumps(value)[:80]}", param=key)
    return value


def _check_common(body: Any, known: tuple[str, ...]) -> None:
    from runtime.tokenizer import check_unicode

    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for key, value in body.items():  # every string the client sent, once: JSON escapes can spell lone surrogates
        try:
            check_unicode(key, "a field name")
            check_unicode(value, key)
        except RequestError as exc:
            raise APIError(str(exc), param=key) from exc
    for key in _UNSUPPORTED:
        value = body.get(key)
        if value in (None, [], {}) or (key == "tool_choice" and value == "none"):
            continue
        raise APIError(f"{key}: not supported by this server (lossless speculative decoding of plain text)",
                       param=key)
    unknown = sorted(set(body) - set(known) - set(_UNSUPPORTED) - set(_IGNORED))
    if unknown:
        raise APIError(f"unknown field(s) {unknown}; this server takes {sorted(known)}", param=unknown[0])
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise APIError("response_format: only {\"type\": \"text\"} is supported", param="response_format")


def _known(endpoint: str, *own: str) -> tuple[str, ...]:
    """The fields an endpoint takes: the request contract's under their own names, and its `own`."""
    return ("model", "stream", "stream_options", "response_format", *(f.name for f in openai_fields(endpoint)), *own)


def _sampling(body: Mapping[str, Any], endpoint: str, max_tokens: tuple[str, Any],
              logprobs: tuple[str, Any] | None) -> dict[str, Any]:
    """The request's sampling fields as vllm_backend's sampling_parameters JSON (the values as sent, and vLLM's
    defaults for what it leaves out), read as the server reads them and checked by the contract, its error restated
    under the request's field name; `max_tokens` / `logprobs`: (the request field that gave it, its value)."""
    origin = {"max_tokens": max_tokens[0]}  # SamplingParams field -> the request field it came from
    sp: dict[str, Any] = {"max_tokens": max_tokens[1]}
    for f in openai_fields(endpoint):
        if f.name != "max_tokens" and body.get(f.name) is not None:
            sp[f.name], origin[f.name] = f.listing(body[f.name]), f.name
    for key, default in VLLM_DEFAULTS.items():
        sp.setdefault(key, default)
    if logprobs is not None:
        origin["logprobs"], sp["logprobs"] = logprobs
    try:
        sampling_params(vllm_values(sp), origin)
    except RequestError as exc:
        raise APIError(str(exc), param=exc.name) from exc
    return sp


def _max_tokens(body: Mapping[str, Any], default: int, *keys: str) -> tuple[str, Any]:
    """(the first of `keys` the request gives, its value), else ("max_tokens", default); SamplingParams checks it."""
    for key in keys:
        if body.get(key) is not None:
            return key, body[key]
    return "max_tokens", default


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise APIError("stream_options: only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise APIError("stream_options: expected {\"include_usage\": true|false}", param="stream_options")
    return bool(options.get("include_usage", False))


def _bytes(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def _model(body: Mapping[str, Any], served: ServedModel) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError("model: missing; expected the model id (GET /v1/models lists it)", param="model")
    if model != served.name:
        raise APIError(f"model: {model!r} does not exist; this server serves {served.name!r}", status=404,
                       param="model", code="model_not_found")
    return model


def completion_call(body: Any, served: ServedModel) -> GenerationCall:
    """POST /v1/completions body -> a GenerationCall."""
    _check_common(body, _known("completions", "prompt", "logprobs", "echo"))
    model = _model(body, served)
    stream = _get(body, "stream", (bool,), "a boolean", False)
    logprobs = body.get("logprobs")
    sp = _sampling(body, "completions", _max_tokens(body, COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens"),
                   None if logprobs is None else ("logprobs", logprobs))
    echo = _get(body, "echo", (bool,), "a boolean", False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    inputs: dict[str, np.ndarray] = {}
    if isinstance(prompt, str) and prompt:
        inputs["text_input"] = _bytes(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if echo:
            raise APIError("echo: needs a text prompt (a token-id prompt has no text to echo)", param="echo")
        inputs["input_ids"] = np.asarray(prompt, dtype=np.int32)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise APIError(f"prompt: a batch of {len(prompt)} prompts; this server takes one prompt per request",
                       param="prompt")
    else:
        raise APIError("prompt: expected a non-empty string or a list of token ids", param="prompt")
    if echo and logprobs is not None:
        raise APIError("echo with logprobs: the prompt's log-probabilities are not computed by this server",
                       param="echo")
    return _call("completion", model, inputs, sp, stream, _stream_options(body, stream), logprobs is not None,
                 logprobs or 0, prompt if echo else "")


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"{where}[{i}]: only text content parts ({{\"type\": \"text\", \"text\": ...}}) are "
                               "supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(f"{where}: expected a string or a list of text parts", param="messages")


def chat_call(body: Any, served: ServedModel) -> GenerationCall:
    """POST /v1/chat/completions body -> a GenerationCall (the messages go to the server's chat template)."""
    _check_common(body, _known("chat", "messages", "logprobs", "top_logprobs", "max_completion_tokens"))
    model = _model(body, served)
    stream = _get(body, "stream", (bool,), "a boolean", False)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages: expected a non-empty list of {role, content}", param="messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}]: expected an object with a string role", param="messages")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise APIError(f"messages[{i}]: field(s) {extra} not supported (no tools)", param="messages")
        plain.append({"role": m["role"], "content": _message_text(m.get("content"), f"messages[{i}].content")})
    want = _get(body, "logprobs", (bool,), "a boolean", False)
    top = body.get("top_logprobs")
    if top is not None and not want:
        raise APIError(f"top_logprobs: needs logprobs: true (got top_logprobs {top!r} without it)",
                       param="top_logprobs")
    sp = _sampling(body, "chat", _max_tokens(body, served.max_tokens_limit, "max_completion_tokens", "max_tokens"),
                   ("top_logprobs", 0 if top is None else top) if want else None)
    inputs = {"messages": _bytes(json.dumps(plain, ensure_ascii=False))}
    return _call("chat", model, inputs, sp, stream, _stream_options(body, stream), want, top or 0)


def _call(kind: str, model: str, inputs: dict[str, np.ndarray], sampling: dict[str, Any], stream: bool,
          include_usage: bool, logprobs: bool, top: int, echo: str = "") -> GenerationCall:
    inputs = {**inputs,
              "stream": np.array([True]),  # always streamed from Triton; a whole answer joins the deltas
              "sampling_parameters": _bytes(json.dumps(sampling)),
              "return_num_input_tokens": np.array([True])}
    if "text_input" in inputs:
        inputs["exclude_input_in_output"] = np.array([True])
    return GenerationCall(kind=kind, model=model, inputs=inputs, stream=stream, include_usage=include_usage,
                          logprobs=logprobs, top_logprobs=top, echo=echo)


# ---- responses: Triton stream -> OpenAI JSON ------------------------------------------------------------


@dataclass
class Piece:
    """One Triton response, decoded."""

    text: str
    token_ids: list[int]
    log_probs: list[float]
    top: list[list[tuple[int, float]]]  # per token: (id, log-probability) alternatives
    finish_reason: str | None = None  # set on the final response
    stats: dict[str, Any] = field(default_factory=dict)  # the final response's speculation outputs
    prompt_tokens: int | None = None


def _np(result: Any, name: str) -> np.ndarray | None:
    return result.as_numpy(name)


def piece_of(result: Any) -> Piece:
    ids = _np(result, "output_ids")
    lps = _np(result, "output_log_probs")
    top_ids, top_lps = _np(result, "top_log_probs_ids"), _np(result, "top_log_probs")
    top = []
    if top_ids is not None and top_lps is not None:
        for row_ids, row_lps in zip(top_ids.tolist(), top_lps.tolist()):
            top.append([(t, lp) for t, lp in zip(row_ids, row_lps) if t >= 0])
    prompt = _np(result, "num_input_tokens")
    piece = Piece(text=output_text(result, "text_output") or "",
                  token_ids=[] if ids is None else ids.reshape(-1).tolist(),
                  log_probs=[] if lps is None else lps.reshape(-1).tolist(), top=top,
                  finish_reason=output_text(result, "finish_reason"),
                  prompt_tokens=None if prompt is None else int(prompt.reshape(-1)[0]))
    if piece.finish_reason is not None:
        steps = _np(result, "accepted_per_step")
        accepted = _np(result, "total_accepted_draft_tokens")
        n_steps = 0 if steps is None else int(steps.size)
        n_acc = 0 if accepted is None else int(accepted.reshape(-1)[0])
        draft = _np(result, "total_draft_tokens")
        tau = _np(result, "tau")
        rate = _np(result, "acceptance_rate")
        piece.stats = {
            "steps": n_steps,
            "draft_tokens": 0 if draft is None else int(draft.reshape(-1)[0]),
            "accepted_tokens": n_acc,
            "acceptance_rate": 0.0 if rate is None else float(rate.reshape(-1)[0]),
            "mean_accepted_length": 1.0 + n_acc / n_steps if n_steps else 1.0,
            "tau": None if tau is None else float(tau.reshape(-1)[0]),
            "verification": output_text(result, "verification"),
        }
    return piece


def _api_error(exc: StreamError) -> APIError:
    """A Triton stream's error -> the API error it means."""
    if exc.code is ErrorCode.INVALID_ARG:
        return APIError(str(exc), status=400)
    if exc.code is ErrorCode.UNAVAILABLE:
        return APIError(str(exc), status=503, kind="server_overloaded" if str(exc).startswith(OVERLOADED) else
                        "service_unavailable", code="overloaded" if str(exc).startswith(OVERLOADED) else None)
    if exc.code is ErrorCode.CANCELLED:
        return APIError(str(exc), status=499, kind="cancelled")
    return APIError(str(exc), status=500, kind="internal_error")


async def triton_pieces(client: Any, model: str, call: GenerationCall, timeout_s: float) -> AsyncIterator[Piece]:
    """Stream one request over tritonserver's gRPC stream (`deploy.triton_stream.stream_request`): its decoded
    responses, up to the final one; errors as APIErrors. Leaving the loop early (the HTTP client went away)
    cancels the gRPC stream, and the server stops the generation."""
    results = stream_request(client, model, call.inputs, timeout_s)
    try:
        async for result in results:
            yield piece_of(result)
    except StreamError as exc:
        raise _api_error(exc) from exc
    finally:
        await results.aclose()


class Answer:
    """Turns pieces into OpenAI objects (chunks, or one whole response) for one GenerationCall."""

    def __init__(self, call: GenerationCall, tokenizer: Any) -> None:
        self.call = call
        self.tokenizer = tokenizer
        prefix = "chatcmpl" if call.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.stats: dict[str, Any] = {}
        self.text_offset = len(call.echo)

    def _token(self, tok: int) -> str:
        return self.tokenizer.decode([tok])

    def logprobs(self, piece: Piece) -> dict[str, Any] | None:
        if not self.call.logprobs:
            return None
        top_n = self.call.top_logprobs
        if self.call.kind == "chat":
            content = []
            for k, tok in enumerate(piece.token_ids):
                text = self._token(tok)
                alts = piece.top[k] if k < len(piece.top) else []
                content.append({"token": text, "logprob": _finite(piece.log_probs[k]),
                                "bytes": list(text.encode("utf-8")),
                                "top_logprobs": [{"token": self._token(t), "logprob": _finite(lp),
                                                  "bytes": list(self._token(t).encode("utf-8"))}
                                                 for t, lp in alts[:top_n]]})
            return {"content": content}
        tokens, offsets, tops = [], [], []
        for k, tok in enumerate(piece.token_ids):
            text = self._token(tok)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
            alts = piece.top[k] if k < len(piece.top) else []
            tops.append({self._token(t): _finite(lp) for t, lp in alts[:top_n]} if top_n else None)
        return {"tokens": tokens, "token_logprobs": [_finite(x) for x in piece.log_probs], "top_logprobs": tops,
                "text_offset": offsets}

    def absorb(self, piece: Piece) -> None:
        self.completion_tokens += len(piece.token_ids)
        if piece.prompt_tokens is not None:
            self.prompt_tokens = piece.prompt_tokens
        if piece.finish_reason is not None:
            self.stats = piece.stats

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens, "spec_decode": self.stats}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.call.model}

    def chunk(self, piece: Piece, first: bool) -> dict[str, Any]:
        if self.call.kind == "chat":
            delta: dict[str, Any] = {"content": piece.text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": self.logprobs(piece),
                      "finish_reason": piece.finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        text = (self.call.echo if first else "") + piece.text
        choice = {"index": 0, "text": text, "logprobs": self.logprobs(piece), "finish_reason": piece.finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.call.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}

    def whole(self, pieces: list[Piece]) -> dict[str, Any]:
        text = "".join(p.text for p in pieces)
        finish = pieces[-1].finish_reason
        merged = Piece(text=text, token_ids=[t for p in pieces for t in p.token_ids],
                       log_probs=[x for p in pieces for x in p.log_probs], top=[t for p in pieces for t in p.top])
        if self.call.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self.logprobs(merged), "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage()}
        choice = {"index": 0, "text": self.call.echo + text, "logprobs": self.logprobs(merged),
                  "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage()}


def _finite(x: float) -> float:
    """JSON has no -inf: a token the distribution gave probability 0 reports -9999.0 (vLLM's convention)."""
    return x if math.isfinite(x) else -9999.0


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


# ---- the ASGI app ---------------------------------------------------------------------------------------


def create_app(config: OpenAIConfig, served: ServedModel) -> Any:
    """The Starlette app: one shared gRPC channel to tritonserver, opened at startup."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from deploy.asgi import ClientGone, grpc_client_lifespan, unless_disconnected

    state: dict[str, Any] = {}

    lifespan = grpc_client_lifespan(config.grpc_url, state)

    def error_response(exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": served.created, "owned_by": "spectree"}]})

    async def generate(request: Request, make: Any) -> Any:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise APIError(f"the request body is not valid JSON ({exc})") from exc
            call = make(body, served)
        except APIError as exc:
            return error_response(exc)
        answer = Answer(call, served.tokenizer)
        pieces = triton_pieces(state["client"], config.model, call, config.timeout_s)
        if not call.stream:
            async def whole() -> list[Piece]:
                got = []
                async for piece in pieces:
                    answer.absorb(piece)
                    got.append(piece)
                return got

            try:  # a client that leaves before the answer cancels the generation, as a dropped stream does
                return JSONResponse(answer.whole(await unless_disconnected(request, whole())))
            except APIError as exc:
                return error_response(exc)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it
            finally:
                await pieces.aclose()
        try:  # the first piece before the 200: a refused request gets its status code, not an event
            first = await unless_disconnected(request, pieces.__anext__())
        except APIError as exc:
            await pieces.aclose()
            return error_response(exc)
        except ClientGone:
            await pieces.aclose()
            return Response(status_code=499)

        async def events() -> AsyncIterator[bytes]:
            piece, is_first = first, True
            try:
                while True:
                    answer.absorb(piece)
                    yield _sse(answer.chunk(piece, is_first))
                    if piece.finish_reason is not None:
                        break
                    piece, is_first = await pieces.__anext__(), False
                if call.include_usage:
                    yield _sse(answer.usage_chunk())
            except APIError as exc:
                yield _sse(exc.body())
            except StopAsyncIteration:
                yield _sse(APIError("the server ended the stream early", status=500, kind="internal_error").body())
            finally:
                await pieces.aclose()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def completions(request: Request) -> Any:
        return await generate(request, completion_call)

    async def chat(request: Request) -> Any:
        return await generate(request, chat_call)

    return Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ], lifespan=lifespan)


class OpenAIServer:
    """`create_app` served by uvicorn on a background thread (started and stopped by `python -m deploy serve`)."""

    def __init__(self, config: OpenAIConfig, served: ServedModel | None = None) -> None:
        from deploy.asgi import AppServer

        self.config = config
        self.served = served or ServedModel.from_repo(config.repo, config.served_model_name)
        self._server = AppServer(create_app(config, self.served), config.host, config.port, "OpenAI API")

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}/v1"

    def start(self, timeout_s: float = 30.0) -> None:
        self._server.start(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.stop(timeout_s)


def run_forever(config: OpenAIConfig) -> None:
    """Serve in the foreground (blocking), for running the frontend on its own."""
    import uvicorn

    served = ServedModel.from_repo(config.repo, config.served_model_name)
    uvicorn.run(create_app(config, served), host=config.host, port=config.port, log_level="warning")


__all__ = [
    "APIError",
    "Answer",
    "GenerationCall",
    "OpenAIConfig",
    "OpenAIServer",
    "Piece",
    "ServedModel",
    "chat_call",
    "completion_call",
    "create_app",
    "piece_of",
    "run_forever",
    "triton_pieces",
]
