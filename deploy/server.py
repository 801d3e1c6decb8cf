"""Start, watch and stop a real tritonserver on a model repository.

Where the server comes from (`find_installation`):
  1. an explicit binary (`tritonserver=`), or a `tritonserver` on PATH (NVIDIA's container: /opt/tritonserver),
     used with its own backends and environment;
  2. otherwise the server bundled in the nvidia-pytriton wheel (tritonserver 2.51 + python backend). That one
     needs a writable backend directory holding the python backend and the stub built for the running Python,
     PATH starting with this interpreter's bin/ (the stub finds the virtualenv's site-packages through the
     `python3` on PATH) and LD_LIBRARY_PATH with this interpreter's libpython directory first, then the wheel's
     bundled libraries (measured facts: /work/shared/notes/serving-on-cpu.md).

The server binds loopback unless told otherwise, runs with model control off, and is stopped with SIGTERM
(SIGKILL to its whole process group after a grace period), so its python stubs go with it; the shared-memory
regions of its stubs (every one seen while it ran) are removed afterwards.

Restricted by default (tritonserver's --http-restricted-api / --grpc-restricted-protocol): the shared-memory,
model-repository, trace and logging APIs answer only requests carrying the header ADMIN_HEADER (gRPC:
triton-grpc-protocol-ADMIN_HEADER) with the admin token; without a configured token a random one is used and never
shown, so those APIs are off. Left open: health, metadata, inference, model-config and statistics (clients and
perf_analyzer use them). The token never shows on tritonserver's command line: it carries ADMIN_TOKEN_MARK, which a
preloaded library (deploy/argv_secret.c) replaces with the token from the environment before the server parses its
arguments (`secret_environment`); without a C compiler to build that library the token goes on the command line,
and `TritonServer.warning` says so.

Health (`dead_stubs`): tritonserver 2.51 keeps a model "ready" after its python backend stub died (it restarts
no stub of a decoupled model; measured: /v2/health/ready stays 200, the in-flight stream hangs, every new request
fails). The server's watcher (`python -m deploy serve`) checks the stubs it saw at start and stops everything when
one is gone.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runtime import schema
from runtime.errors import ConfigError, SpectreeError
from runtime.schema import setting


class ServerError(SpectreeError, RuntimeError):
    """tritonserver could not be found, did not become ready, or exited."""


def tcp_port(default: int) -> int:
    """A TCP port field (deploy's configs): an integer in 1..65535."""
    return setting(default, ge=1, le=65535, what="a TCP port in 1..65535")


@dataclass(frozen=True)
class ServerConfig:
    repo: str  # model repository directory
    http_port: int = tcp_port(8000)
    grpc_port: int = tcp_port(8001)
    metrics_port: int = tcp_port(8002)
    # every endpoint binds here (0.0.0.0 to serve other hosts)
    address: str = setting("127.0.0.1", nonempty=True, what="an IP address to bind")
    # how long tritonserver lets in-flight requests finish on shutdown
    exit_timeout_s: int = setting(30, ge=0)
    ready_timeout_s: float = 300.0  # how long `start` waits for /v2/health/ready
    log_verbose: int = 0
    tritonserver: str | None = None  # explicit binary; None: PATH, then the nvidia-pytriton wheel
    extra_args: tuple[str, ...] = ()  # more tritonserver flags, passed through
    # The token the restricted APIs (RESTRICTED_APIS) want in the ADMIN_HEADER header; None: a random one per start,
    # never shown (those APIs are then unreachable).
    admin_token: str | None = None
    # Where tritonserver's own HTTP endpoint listens when an HTTP front (deploy.http_front) serves http_port:
    # 127.0.0.1 on this port. None: tritonserver serves http_port itself.
    internal_http_port: int | None = setting(None, ge=1, le=65535, what="None or a TCP port in 1..65535")

    def __post_init__(self) -> None:
        schema.check(self, ConfigError)
        names = ("http_port", "grpc_port", "metrics_port", "internal_http_port")
        ports = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        if len(set(ports.values())) != len(ports):
            raise ConfigError(f"{', '.join(ports)} must differ, got {ports}")
        if not Path(self.repo).is_dir():
            raise ConfigError(f"repo: {self.repo!r} is not a directory")
        if self.admin_token is not None and not re.fullmatch(r"[A-Za-z0-9_\-]{16,}", self.admin_token):
            raise ConfigError("admin_token: expected at least 16 letters, digits, '-' or '_' (it goes into an HTTP "
                              "header)")

    @property
    def client_host(self) -> str:
        """Where a local client connects (a wildcard bind is reachable on loopback)."""
        return "127.0.0.1" if self.address in ("0.0.0.0", "::", "[::]") else self.address

    @property
    def http_url(self) -> str:
        return f"http://{self.client_host}:{self.http_port}"

    @property
    def triton_http_url(self) -> str:
        """tritonserver's own HTTP endpoint (http_url unless an HTTP front serves that)."""
        if self.internal_http_port is None:
            return self.http_url
        return f"http://127.0.0.1:{self.internal_http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def triton_http_url(self) -> str:
        """tritonserver's own HTTP endpoint (http_url unless an HTTP front serves that)."""
        if self.internal_http_port is None:
            return self.http_url
        return f"http://127.0.0.1:{self.internal_http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"


@dataclass(frozen=True)
class Installation:
    binary: Path
    backend_source: Path | None  # python backend to copy into a writable backend dir (wheel only)
    stub: Path | None  # triton_python_backend_stub for this Python (wheel only)
    lib_dirs: tuple[Path, ...] = ()  # LD_LIBRARY_PATH additions (wheel only)
    kind: str = "path"  # "explicit" | "path" | "wheel"


def find_installation(tritonserver: str | None = None) -> Installation:
    if tritonserver is not None:
        binary = Path(tritonserver)
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise ServerError(f"tritonserver: {tritonserver!r} is not an executable file")
        return Installation(binary=binary, backend_source=None, stub=None, kind="explicit")
    on_path = shutil.which("tritonserver")
    if on_path is not None:
        return Installation(binary=Path(on_path), backend_source=None, stub=None, kind="path")
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(
            "no tritonserver found: none on PATH and the nvidia-pytriton wheel is not installed "
            "(pip install nvidia-pytriton==0.7.0, or run inside NVIDIA's tritonserver container)"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    binary = root / "bin" / "tritonserver"
    libs = root.parent.parent / "nvidia_pytriton.libs"
    for path in (binary, stub, root / "backends" / "python", libs):
        if not path.exists():
            raise ServerError(f"nvidia-pytriton install is incomplete: {path} is missing "
                              f"(the wheel has no stub for Python {version}?)")
    return Installation(binary=binary, backend_source=root / "backends", stub=stub, lib_dirs=(libs,), kind="wheel")


def project_root() -> Path:
    """The directory holding this package (and runtime/, model_repo/): the stub imports the same code."""
    return Path(__file__).resolve().parent.parent


def server_environment(install: Installation, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    python_path = [str(project_root())] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(python_path))
    if install.kind == "wheel":
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([bin_dir, *[p for p in env.get("PATH", "").split(os.pathsep) if p]])
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        inherited = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        libs = [libdir, *map(str, install.lib_dirs), *inherited]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(p for p in libs if p))
    return env


def prepare_backends(install: Installation, into: Path) -> Path | None:
    """A writable backend directory for the wheel's server (the python backend + this Python's stub)."""
    if install.backend_source is None or install.stub is None:
        return None
    target = into / "backends"
    shutil.copytree(install.backend_source, target, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(install.stub, target / "python" / "triton_python_backend_stub")
    return target


# tritonserver 2.51's log line once every in-flight inference has finished at shutdown (server.cc), and how long
# the models then get to unload before the server is killed (TritonServer.stop).
DRAINED_LOG_LINE = "All models are stopped, unloading models"
# tritonserver's handler of a fatal signal logs this line and a backtrace, then exits; the exit can hang with every
# listener already closed (seen in CI: gRPC and metrics refused connections while the process lived on).
CRASH_LOG_LINE = re.compile(rb"^Signal \((\d+)\) received\.$", re.M)
CRASH_REPORT_LINES = 12  # of the backtrace that follows
UNLOAD_GRACE_S = 3.0
RESTRICTED_APIS = ("shared-memory", "model-repository", "trace", "logging")
ADMIN_HEADER = "spectree-admin"
# tritonserver 2.51 reads the restricted APIs' header value from its command line only, which every local user can
# read (ps, /proc/PID/cmdline). So the command line carries this mark instead, and a library preloaded into the
# server (deploy/argv_secret.c) puts the token, passed in the environment, in its place before main() runs.
ADMIN_TOKEN_MARK = "spectree-admin-token-from-the-environment"
SECRET_SOURCE = Path(__file__).with_name("argv_secret.c")


def secret_preload() -> Path:
    """The library that hands tritonserver the admin token from its environment (deploy/argv_secret.c, built on
    first use by plugins.native_build); ServerError when it cannot be built (no C compiler)."""
    from plugins import native_build

    try:
        return native_build.build(SECRET_SOURCE, "argv_secret", openmp=False)[1]
    except native_build.BUILD_ERRORS as exc:
        raise ServerError(f"cannot build {SECRET_SOURCE.name}, which keeps the admin token off tritonserver's command "
                          f"line: {exc}") from exc


def secret_environment(env: dict[str, str], token: str, preload: Path) -> dict[str, str]:
    """`env` for a tritonserver whose command line carries ADMIN_TOKEN_MARK where `token` goes (see
    deploy/argv_secret.c: these variables and the preload leave the server's environment before its main())."""
    preloads = [str(preload), *[p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]]
    return {**env, "LD_PRELOAD": ":".join(preloads), "SPECTREE_SECRET": token,
            "SPECTREE_SECRET_MARK": ADMIN_TOKEN_MARK, "SPECTREE_SECRET_PRELOAD": str(preload)}


def restricted_api_args(admin_token: str) -> list[str]:
    """tritonserver flags putting RESTRICTED_APIS behind the ADMIN_HEADER header, on HTTP and on gRPC."""
    group = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={admin_token}"
    return [f"--http-restricted-api={group}", f"--grpc-restricted-protocol={group}"]


def command(config: ServerConfig, install: Installation, backend_dir: Path | None,
            admin_token: str = ADMIN_TOKEN_MARK) -> list[str]:
    """The tritonserver command line; the restricted APIs' header value is `admin_token` (by default the mark the
    preloaded library replaces: `secret_environment`)."""
    cmd = [
        str(install.binary),
        f"--model-repository={Path(config.repo).resolve()}",
        "--model-control-mode=none",
        "--disable-auto-complete-config",
        "--strict-readiness=true",
        f"--http-address={config.address if config.internal_http_port is None else '127.0.0.1'}",
        f"--http-port={config.http_port if config.internal_http_port is None else config.internal_http_port}",
        f"--grpc-address={config.address}",
        f"--grpc-port={config.grpc_port}",
        f"--metrics-address={config.address}",
        f"--metrics-port={config.metrics_port}",
        "--allow-gpu-metrics=false" if install.kind == "wheel" else "--allow-gpu-metrics=true",
        f"--exit-timeout-secs={config.exit_timeout_s}",
        f"--log-verbose={config.log_verbose}",
        *restricted_api_args(admin_token),
    ]
    if backend_dir is not None:
        cmd.append(f"--backend-directory={backend_dir}")
    return [*cmd, *config.extra_args]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free right now (the OS picks them)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _procs_where(stat_field: int, value: int) -> list[int]:
    """Pids whose /proc/PID/stat field (counted after the command name: 1 = ppid, 2 = pgrp) equals value."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[stat_field]) == value:
            out.append(int(stat.parent.name))
    return out


def child_pids(pid: int) -> list[int]:
    """Direct children of pid (from /proc)."""
    return _procs_where(1, pid)


def group_members(pgid: int) -> list[int]:
    """Processes in process group pgid (from /proc)."""
    return _procs_where(2, pgid)


def shm_regions(pids: Sequence[int]) -> list[str]:
    """Shared-memory region names the python backend stubs among pids were started with."""
    return [stub.region for stub in python_stubs(pids).values()]


@dataclass(frozen=True)
class Stub:
    """A python backend stub process: `triton_python_backend_stub MODEL_PATH SHM_REGION SHM_SIZE SHM_GROWTH
    PARENT_PID BACKEND_DIR IPC_HANDLE INSTANCE_NAME ...` (python_backend's stub_launcher.cc, 2.51)."""

    pid: int
    instance: str  # Triton's model instance name, e.g. spec_decode_0_0
    region: str  # its shared-memory region in /dev/shm


def python_stubs(pids: Sequence[int]) -> dict[int, Stub]:
    """The python backend stubs among pids."""
    out = {}
    for pid in pids:
        try:
            args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if len(args) > 8 and args[0].endswith("triton_python_backend_stub"):
            out[pid] = Stub(pid=pid, instance=args[8], region=args[2])
    return out


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class TritonServer:
    """A running tritonserver (use as a context manager, or call start / stop)."""

    config: ServerConfig
    log_path: Path | None = None  # server output; None: a file in the server's temporary directory
    process: subprocess.Popen | None = field(default=None, init=False)
    install: Installation | None = field(default=None, init=False)
    stubs: dict[int, Stub] = field(default_factory=dict, init=False)  # the python stubs seen once it was ready
    _regions: set[str] = field(default_factory=set, init=False)  # every stub's shared-memory region seen
    _tmp: Path | None = field(default=None, init=False)
    _log_file: object = field(default=None, init=False)
    warning: str | None = field(default=None, init=False)  # set by start when the admin token had to go on argv
    killed_after_drain: bool = field(default=False, init=False)  # set by stop (see there)
    _log_start: int = field(default=0, init=False)
    _crash_scanned: int = field(default=0, init=False)  # the log's bytes already searched for CRASH_LOG_LINE

    def start(self) -> TritonServer:
        if self.process is not None:
            raise ServerError("this server was already started")
        busy = [p for p in (self.config.http_port, self.config.grpc_port, self.config.metrics_port)
                if not port_is_free(p, self.config.address)]
        if self.config.internal_http_port is not None and not port_is_free(self.config.internal_http_port):
            busy.append(self.config.internal_http_port)
        if busy:
            raise ServerError(f"port(s) {busy} on {self.config.address} are already in use")
        self.install = find_installation(self.config.tritonserver)
        self._tmp = Path(tempfile.mkdtemp(prefix="spectree-triton-"))
        backend_dir = prepare_backends(self.install, self._tmp)
        if self.log_path is None:
            self.log_path = self._tmp / "tritonserver.log"
        self._log_file = open(self.log_path, "ab")
        self._log_start = self._log_file.tell()  # a --log-file may hold earlier runs' lines
        self._crash_scanned = self._log_start
        # No token configured: a random one, never shown (the restricted APIs are then unreachable).
        token = self.config.admin_token or secrets.token_urlsafe(24)
        env = server_environment(self.install)
        try:
            env = secret_environment(env, token, secret_preload())
            cmd = command(self.config, self.install, backend_dir)
        except ServerError as exc:
            self.warning = f"{exc}; the admin token is on tritonserver's command line (visible to local users)"
            cmd = command(self.config, self.install, backend_dir, token)
        self.process = subprocess.Popen(
            cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group: stop() can take the python stubs down with it
        )
        try:
            self.wait_ready(self.config.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.stubs = python_stubs(child_pids(self.process.pid))
        self._regions.update(stub.region for stub in self.stubs.values())
        return self

    def _log_shows(self, text: str) -> bool:
        """Whether the server's log (written since this start) holds `text`."""
        if self.log_path is None:
            return False
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return text.encode() in f.read()
        except OSError:
            return False

    def crash_report(self) -> str | None:
        """tritonserver's report of a fatal signal since this start ("Signal (11) received." and the backtrace's
        first lines), or None. Reads only what the log gained since the last call, so a watcher can call it often."""
        if self.log_path is None:
            return None
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._crash_scanned)
                chunk = f.read()
        except OSError:
            return None
        found = CRASH_LOG_LINE.search(chunk)
        if found is None:
            # The last line may be incomplete: search it again next time.
            self._crash_scanned += chunk.rfind(b"\n") + 1
            return None
        lines = chunk[found.start():].decode(errors="replace").splitlines()
        return "\n".join(lines[:1 + CRASH_REPORT_LINES])

    def listening(self) -> bool:
        """Whether tritonserver's gRPC listener takes connections (a refused connection: it closed its listeners,
        as a crashed server tearing itself down does; any other failure, such as a slow accept, counts as
        listening)."""
        try:
            socket.create_connection((self.config.client_host, self.config.grpc_port), timeout=1).close()
        except ConnectionRefusedError:
            return False
        except OSError:
            return True
        return True

    def dead_stubs(self) -> list[Stub]:
        """The python stubs seen at start that are gone now (their models cannot answer any more)."""
        return [stub for pid, stub in self.stubs.items() if not pid_alive(pid)]

    def log_tail(self, lines: int = 15) -> str:
        """The server log's error lines, then its last lines."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        errors = [line for line in text if re.match(r"^E\d{4} ", line)]
        return "\n".join([*errors[:10], "...", *text[-lines:]] if errors else text[-lines:])

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.config.triton_http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise ServerError(f"tritonserver exited with status {code} before it was ready; its log ends:\n"
                                  f"{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise ServerError(f"tritonserver was not ready after {timeout_s:.0f} s; its log ends:\n{self.log_tail()}")

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, wait (exit_timeout_s + 15 s by default), then SIGKILL the process group. Returns the exit
        status (None if it was never started).

        Once tritonserver says every inference has finished and it is unloading the models (DRAINED_LOG_LINE in its
        log), a model still loaded UNLOAD_GRACE_S later is one tritonserver 2.51 can never unload: it leaks a
        request of a gRPC stream its client cancelled (measured: intermittently, after clients left ensemble
        streams; the model's finalize is never called) and would hold the exit until exit_timeout_s, then exit 1.
        Nothing is left to finish then, so the server is killed at once and `killed_after_drain` says so."""
        proc = self.process
        if proc is None:
            return None
        grace = self.config.exit_timeout_s + 15 if grace_s is None else grace_s
        regions = self._regions | set(shm_regions(group_members(proc.pid)))
        self.killed_after_drain = False
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            drained_at = None
            while proc.poll() is None and time.monotonic() < deadline:
                if drained_at is None and self._log_shows(DRAINED_LOG_LINE):
                    drained_at = time.monotonic()
                if drained_at is not None and time.monotonic() - drained_at > UNLOAD_GRACE_S:
                    self.killed_after_drain = True
                    break
                time.sleep(0.1)
        # Anything left in the group (a stuck stub) goes now.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        code = proc.wait()
        # A stub that did not exit on its own leaves its shared-memory region behind; no process maps it now. Nor
        # does it remove its models' cancellation board (model_repo.bls.CancelBoard, named by the server's pid).
        for region in regions:
            Path("/dev/shm", region).unlink(missing_ok=True)
        from model_repo.bls import CancelBoard

        CancelBoard.for_server(proc.pid).remove()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def cleanup(self) -> None:
        """Remove the temporary directory (backend copy, and the log unless log_path was given)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.cleanup()


def endpoints_text(config: ServerConfig, models: Sequence[str]) -> str:
    lines = [
        f"  HTTP     {config.http_url}   (POST /v2/models/<model>/generate, /generate_stream)",
        f"  gRPC     {config.grpc_url}",
        f"  metrics  {config.metrics_url}",
        f"  models   {', '.join(models) if models else '(none)'}",
    ]
    return "\n".join(lines)


__all__ = [
    "ADMIN_HEADER",
    "ADMIN_TOKEN_MARK",
    "RESTRICTED_APIS",
    "Installation",
    "ServerConfig",
    "ServerError",
    "TritonServer",
    "child_pids",
    "command",
    "endpoints_text",
    "find_installation",
    "free_ports",
    "group_members",
    "pid_alive",
    "port_is_free",
    "prepare_backends",
    "project_root",
    "server_environment",
    "python_stubs",
    "restricted_api_args",
    "secret_environment",
    "secret_preload",
    "shm_regions",
    "Stub",
]
