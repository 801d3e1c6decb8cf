"""python -m deploy {serve,client,k8s,docker}

    serve   --repo REPO_DIR [--http-port 8000 --grpc-port 8001 --metrics-port 8002 --address 127.0.0.1]
            start tritonserver on a model repository, wait until it is ready, print the endpoints, and shut it
            down cleanly on SIGINT / SIGTERM (exit status 0 after a clean shutdown). --http-port is served by the
            HTTP front (deploy/http_front.py: generate requests validated, and cancelled when their client
            leaves; tritonserver's own HTTP endpoint behind it on a loopback port; --no-http-front: tritonserver's
            own). It watches the server: when tritonserver exits or crashes (its log's "Signal (N) received."
            and backtrace are shown), or a model's python backend process dies (tritonserver 2.51 would keep
            reporting that model ready while its requests hang), it says so, answers 503 on readiness at once,
            stops everything within a second (every open stream ends with an error) and exits with status 3, for
            a supervisor (Kubernetes, systemd, compose) to restart it. The shared-memory,
            model-repository, trace and logging APIs need the header spectree-admin: TOKEN (--admin-token-file, or
            $SPECTREE_ADMIN_TOKEN; neither: those APIs are off; the token is never on a command line).
            --openai-port PORT also serves an OpenAI-compatible API (/v1/models, /v1/completions,
            /v1/chat/completions, SSE streaming) on PORT over the gRPC endpoint (deploy/openai_api.py)
    client  --url HOST:GRPC_PORT --prompt TEXT [--chat [--system TEXT]] [--model ensemble] [--max-tokens N]
            [sampling options]
            stream a generation over gRPC, printing text as it arrives (--chat: the prompt is one user message,
            sent as the `messages` input and rendered by the model's chat template)
    k8s     --output DIR [options]   render Kubernetes manifests (deployment.yaml, service.yaml)
    docker  --output DIR [options]   render a Dockerfile (FROM NVIDIA's Triton image) and compose.yaml

Exit status: 0 on success, 2 on bad input, 1 when the server fails to start or a request is answered with an
error, 3 when a running server died or lost a model's process (serve).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.errors import SpectreeError
from runtime.request_fields import add_flags

if TYPE_CHECKING:
    from deploy.server import TritonServer


class _Shutdown(BaseException):
    """Raised by the SIGINT / SIGTERM handler to unwind into a clean shutdown."""


EXIT_SERVER_LOST = 3  # serve: tritonserver exited, or one of its python backend processes died
WATCH_INTERVAL_S = 0.25  # how often serve checks the server and its stubs
# SIGTERM -> SIGKILL when a stub died: its in-flight requests would never finish, and every open stream should end
# with an error now rather than after a grace period
LOST_STUB_GRACE_S = 0.5
FRONT_DRAIN_S = 0.5  # after the server is gone, how long the fronts get to write their streams' error events
ADMIN_TOKEN_ENV = "SPECTREE_ADMIN_TOKEN"
CLIENT_SAMPLING = ("temperature", "top_k", "top_p", "seed")  # the client's sampling flags (request contract fields)


def _server_lost(server: TritonServer) -> str | None:
    """Why a running server can serve no more (None: it still can): tritonserver exited, crashed (its log reports
    a fatal signal: the process may hang in its exit with every listener closed) or refuses connections, or a
    python backend process died (its model would stay "ready" while its requests hang). Several can happen within
    one watch interval (a killed stub can take tritonserver down with it), so the message names all of them."""
    dead = server.dead_stubs()
    stubs = ", ".join(f"{d.instance} (pid {d.pid})" for d in dead)
    crash = server.crash_report()
    code = server.process.poll()
    deaf = code is None and not server.listening()
    if code is None and crash is None and not dead and not deaf:
        return None
    if code is not None or crash is not None or deaf:
        why = (f"tritonserver exited on its own with status {code}" if code is not None
               else "tritonserver crashed and is not serving" if crash is not None
               else "tritonserver closed its gRPC listener (connections are refused) but did not exit")
        return (why + (f"; the python backend processes that died with it: {stubs}" if dead else "")
                + (f"; its log:\n{crash}" if crash is not None else ""))
    return (f"the python backend process of {stubs} died; tritonserver 2.51 would keep reporting it ready while "
            "its requests hang")


def _default(cls: type, name: str) -> Any:
    return cls.__dataclass_fields__[name].default


def parser() -> argparse.ArgumentParser:
    from deploy.k8s import DeployConfig
    from deploy.openai_api import OpenAIConfig
    from deploy.server import ServerConfig

    p = argparse.ArgumentParser(prog="python -m deploy", description="Serve spectree model repositories with Triton.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run tritonserver on a model repository")
    s.add_argument("--repo", required=True, help="model repository (python -m model_repo render)")
    for name in ("http_port", "grpc_port", "metrics_port"):
        s.add_argument("--" + name.replace("_", "-"), type=int, default=_default(ServerConfig, name))
    s.add_argument("--address", default=_default(ServerConfig, "address"),
                   help="address every endpoint binds (default: loopback only)")
    s.add_argument("--exit-timeout-s", type=int, default=_default(ServerConfig, "exit_timeout_s"),
                   help="seconds in-flight requests get to finish at shutdown")
    s.add_argument("--ready-timeout-s", type=float, default=_default(ServerConfig, "ready_timeout_s"))
    s.add_argument("--log-verbose", type=int, default=_default(ServerConfig, "log_verbose"))
    s.add_argument("--log-file", help="tritonserver's log (default: a temporary file)")
    s.add_argument("--tritonserver", help="tritonserver binary (default: PATH, then the nvidia-pytriton wheel)")
    s.add_argument("--no-http-front", action="store_true",
                   help="serve --http-port with tritonserver's own HTTP endpoint instead of the HTTP front "
                        "(deploy/http_front.py: validated generate requests, cancelled when their client leaves)")
    s.add_argument("--openai-port", type=int,
                   help="also serve an OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions) on "
                        "this port, on --address, over the gRPC endpoint (deploy/openai_api.py)")
    s.add_argument("--openai-model", default=_default(OpenAIConfig, "model"),
                   help="the Triton model the OpenAI API sends requests to")
    s.add_argument("--served-model-name", help="the model id the OpenAI API serves (default: the engine's name)")
    s.add_argument("--admin-token-file", type=Path,
                   help="a file holding the token for the restricted APIs (shared-memory, model-repository, trace, "
                        f"logging), sent as the spectree-admin header (default: ${ADMIN_TOKEN_ENV}; neither: those "
                        "APIs are off). Never a flag value: command lines are visible to every local user")

    c = sub.add_parser("client", help="stream a generation over gRPC")
    c.add_argument("--url", required=True, help="gRPC endpoint, HOST:PORT")
    c.add_argument("--prompt", required=True)
    c.add_argument("--chat", action="store_true",
                   help="send the prompt as one user message (the messages input, through the chat template)")
    c.add_argument("--system", help="with --chat: a system message before the user message")
    c.add_argument("--model", default="ensemble",
                   help="ensemble (default) or spec_decode; Ctrl-C stops the server-side generation on either")
    add_flags(c, ("max_tokens",))
    add_flags(c, CLIENT_SAMPLING, defaults=False)  # unset: the server's default
    c.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    c.add_argument("--no-stream", action="store_true", help="one response with the whole text")
    c.add_argument("--stats", action="store_true", help="print the speculation stats to stderr at the end")
    c.add_argument("--timeout-s", type=float, default=120.0)

    hints = typing.get_type_hints(DeployConfig)
    for command, help_text in (("k8s", "render Kubernetes manifests"), ("docker", "render Dockerfile + compose.yaml")):
        d = sub.add_parser(command, help=help_text)
        d.add_argument("--output", required=True, help="directory to write into")
        for f in dataclasses.fields(DeployConfig):
            tp = hints[f.name]
            base = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
            d.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=base, default=argparse.SUPPRESS,
                           help=f"default: {f.default!r}")
    return p


def _admin_token(ns: argparse.Namespace) -> str | None:
    """--admin-token-file's token (its first line), else $SPECTREE_ADMIN_TOKEN, else None."""
    if ns.admin_token_file is None:
        return os.environ.get(ADMIN_TOKEN_ENV) or None
    try:
        return ns.admin_token_file.read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpectreeError(f"--admin-token-file: cannot read {ns.admin_token_file}: {exc}") from exc


def _serve(ns: argparse.Namespace) -> int:
    from deploy.server import ServerConfig, TritonServer, endpoints_text, free_ports

    if not ns.no_http_front:
        from deploy.http_front import HttpFront

        missing = HttpFront.available()
        if missing is not None:
            raise SpectreeError(f"{missing}; or serve with --no-http-front (tritonserver's own HTTP endpoint)")
    internal_http = None if ns.no_http_front else free_ports(1)[0]
    config = ServerConfig(repo=ns.repo, http_port=ns.http_port, grpc_port=ns.grpc_port, metrics_port=ns.metrics_port,
                          address=ns.address, exit_timeout_s=ns.exit_timeout_s, ready_timeout_s=ns.ready_timeout_s,
                          log_verbose=ns.log_verbose, tritonserver=ns.tritonserver, admin_token=_admin_token(ns),
                          internal_http_port=internal_http)
    server = TritonServer(config, log_path=Path(ns.log_file) if ns.log_file else None)

    def on_signal(signum: int, frame: Any) -> None:
        # Once: a second signal during shutdown must not interrupt it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Shutdown(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    lost = None  # why the server can no longer serve, when it is lost
    http_front = None  # the HTTP front on --http-port (unless --no-http-front)
    fronts: list[Any] = []  # the ASGI fronts started, stopped after tritonserver (their streams end first)

    def going_down(why: str) -> None:
        """Readiness and liveness answer 503 from now on (the HTTP front's; tritonserver's own go when it does)."""
        if http_front is not None:
            http_front.lost = why

    def stop_fronts() -> None:
        for front in reversed(fronts):
            front.stop()

    try:
        print(f"starting tritonserver on {config.repo} ...", flush=True)
        server.start()
        if server.warning is not None:
            print(f"warning: {server.warning}", file=sys.stderr, flush=True)
        models = sorted(p.parent.name for p in Path(config.repo).glob("*/config.pbtxt"))
        # The fronts are up before "ready" is printed: a client reading it may connect at once.
        if internal_http is not None:
            from deploy.http_front import FrontConfig, HttpFront

            http_front = HttpFront(FrontConfig(grpc_url=config.grpc_url, triton_http=f"127.0.0.1:{internal_http}",
                                               port=config.http_port, host=config.address))
            http_front.start()
            fronts.append(http_front)
        openai_line = ""
        if ns.openai_port is not None:
            from deploy.openai_api import OpenAIConfig, OpenAIServer

            frontend = OpenAIServer(OpenAIConfig(
                grpc_url=f"{config.address}:{config.grpc_port}", repo=config.repo, port=ns.openai_port,
                host=config.address, model=ns.openai_model, served_model_name=ns.served_model_name))
            frontend.start()
            fronts.append(frontend)
            openai_line = f"\n  openai   {frontend.url} (model {frontend.served.name!r})"
        front_note = "" if http_front is None else f"; HTTP front over tritonserver's {config.triton_http_url}"
        print(f"ready (tritonserver pid {server.process.pid}, {server.install.kind} install{front_note})\n"
              f"{endpoints_text(config, models)}{openai_line}", flush=True)
        while lost is None:
            time.sleep(WATCH_INTERVAL_S)
            lost = _server_lost(server)
    except _Shutdown as sig:
        print(f"shutting down ({sig}) ...", flush=True)
        going_down(f"shutting down ({sig})")
        code = server.stop()  # in-flight requests finish (exit_timeout_s), through the fronts still up
        stop_fronts()
        server.cleanup()
        if server.killed_after_drain:  # every request had finished: a clean stop (see TritonServer.stop)
            print("stopped (every request finished; tritonserver 2.51 kept a model loaded after a client cancelled "
                  "its gRPC stream, so it was stopped after the drain)", flush=True)
            return 0
        print(f"stopped (tritonserver exit status {code})", flush=True)
        return 0 if code == 0 else 1
    except SpectreeError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        server.stop()
        stop_fronts()
        server.cleanup()
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # nothing may interrupt the stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    going_down(lost)
    print(f"error: {lost}; stopping the server (exit status {EXIT_SERVER_LOST}: restart it)", file=sys.stderr,
          flush=True)
    code = server.stop(grace_s=LOST_STUB_GRACE_S)  # every open stream ends, with an error
    if fronts:
        time.sleep(FRONT_DRAIN_S)
    stop_fronts()
    server.cleanup()
    print(f"stopped (tritonserver exit status {code})", flush=True)
    return EXIT_SERVER_LOST


def _client(ns: argparse.Namespace) -> int:
    from deploy.client import ClientError, generate_stream
    from runtime.tokenizer import single_turn

    if ns.system is not None and not ns.chat:
        print("error: --system needs --chat (it is a chat message)", file=sys.stderr)
        return 2
    prompt: Any = single_turn(ns.prompt, ns.system) if ns.chat else ns.prompt
    options = {"stream": not ns.no_stream, "stop": tuple(ns.stop), **{k: getattr(ns, k) for k in CLIENT_SAMPLING}}
    last = None
    try:
        for event in generate_stream(ns.url, ns.model, prompt, ns.max_tokens, timeout_s=ns.timeout_s, **options):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            last = event
    except ClientError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving the loop cancelled the request on the server
        print("\n(cancelled)", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    if ns.stats and last is not None:
        print(f"finish_reason={last.finish_reason} verification={last.verification} tau={last.tau} "
              f"accepted_per_step={list(last.accepted_per_step or ())}", file=sys.stderr)
    return 0


def _render(ns: argparse.Namespace) -> int:
    from deploy.k8s import DeployConfig, write_docker, write_k8s

    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(DeployConfig) if hasattr(ns, f.name)}
    cfg = DeployConfig(**values)
    files = (write_k8s if ns.command == "k8s" else write_docker)(cfg, ns.output)
    for f in files:
        print(f)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        if ns.command == "serve":
            return _serve(ns)
        if ns.command == "client":
            return _client(ns)
        return _render(ns)
    except (SpectreeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
