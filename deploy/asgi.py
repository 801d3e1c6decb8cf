"""What the ASGI fronts of `python -m deploy serve` share (the HTTP front, deploy/http_front.py, and the OpenAI API,
deploy/openai_api.py): an app served by uvicorn on a background thread (`AppServer`), and waiting for a result
while watching whether the HTTP client is still there (`unless_disconnected`), so a client that leaves a
non-streaming request cancels its generation as a dropped stream does."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from runtime.errors import ConfigError, SpectreeError

T = TypeVar("T")


class ClientGone(SpectreeError, ConnectionError):
    """The HTTP client disconnected before its answer was ready (the work for it has been cancelled)."""


async def _disconnect(request: Any) -> None:
    """Returns when the client of `request` (a Starlette Request whose body was read) disconnects."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def unless_disconnected(request: Any, work: Awaitable[T]) -> T:
    """`work`'s result; ClientGone as soon as the client disconnects, `work` cancelled (for a generation: its gRPC
    stream, so the server frees the request's batch slot at its next step). Call after reading the body."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001  (cancelled: its outcome is not wanted)
                pass
    if task.cancelled():
        raise ClientGone("the client disconnected")
    return task.result()


def grpc_client_lifespan(url: str, state: dict[str, Any]) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """An ASGI lifespan that opens one tritonclient.aio gRPC client to `url` as `state["client"]` for the app's life
    and closes it after."""
    import tritonclient.grpc.aio as grpcclient

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state["client"] = grpcclient.InferenceServerClient(url=url)
        try:
            yield
        finally:
            await state["client"].close()

    return lifespan


class AppServer:
    """An ASGI app served by uvicorn on a background thread."""

    def __init__(self, app: Any, host: str, port: int, name: str) -> None:
        import uvicorn

        self.host, self.port, self.name = host, port, name
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, name=name, daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise ConfigError(f"the {self.name} could not start on {self.host}:{self.port} (port in use?)")
            if time.monotonic() > deadline:
                raise ConfigError(f"the {self.name} did not start within {timeout_s:.0f} s")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)


__all__ = ["AppServer", "ClientGone", "unless_disconnected"]
