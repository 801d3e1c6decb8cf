"""deploy without a running server: Dockerfile / compose / Kubernetes rendering (parsed back and checked field by
field; docker and kubectl are not available here), the server launch command and environment, and the CLIs'
input checking. The real server runs in tests/test_serving.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.__main__ import main
from deploy.k8s import (
    DeployConfig,
    container_command,
    write_docker,
    write_k8s,
)
from deploy.server import (
    ADMIN_TOKEN_MARK,
    Installation,
    ServerConfig,
    ServerError,
    TritonServer,
    command,
    find_installation,
    free_ports,
    port_is_free,
    secret_environment,
    secret_preload,
    server_environment,
)
from runtime.errors import ConfigError


def test_k8s_manifests(tmp_path):
    cfg = DeployConfig(name="spec-llama", image="registry.example/spectree:1", namespace="llm", replicas=2, gpus=2,
                       cpu_request="6", memory_limit="80Gi", http_port=9000, grpc_port=9001, metrics_port=9002,
                       max_concurrent_requests=16)
    files = write_k8s(cfg, tmp_path / "k8s")
    dep, svc = (yaml.safe_load(f.read_text()) for f in files)

    assert dep["apiVersion"] == "apps/v1" and dep["kind"] == "Deployment"
    assert dep["metadata"]["name"] == "spec-llama" and dep["metadata"]["namespace"] == "llm"
    spec = dep["spec"]
    assert spec["replicas"] == 2
    assert spec["selector"]["matchLabels"] == spec["template"]["metadata"]["labels"]
    pod = spec["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9002"
    (c,) = pod["spec"]["containers"]
    assert c["image"] == "registry.example/spectree:1"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 9000, "grpc": 9001, "metrics": 9002}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    res = c["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 2 == res["requests"]["nvidia.com/gpu"]
    assert res["requests"]["cpu"] == "6" and res["limits"]["memory"] == "80Gi"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["engine"]["mountPath"] == cfg.engine_mount and mounts["engine"]["readOnly"]
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["engine"]["persistentVolumeClaim"]["claimName"] == "spectree-engines"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    script = c["command"][-1]
    assert c["command"][:2] == ["/bin/sh", "-c"]
    assert f"python3 -m model_repo render --engine {cfg.engine_mount}" in script
    assert "--device cuda" in script and "--max-concurrent-requests 16" in script
    assert "exec python3 -m deploy serve" in script and "--address 0.0.0.0" in script
    assert "--metrics-port 9002" in script

    assert svc["kind"] == "Service" and svc["spec"]["selector"] == pod["metadata"]["labels"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "http": (9000, "http"), "grpc": (9001, "grpc"), "metrics": (9002, "metrics")}


def test_docker_and_compose(tmp_path):
    out = tmp_path / "docker"
    cfg = DeployConfig(gpus=1, engine_host_dir="/data/engines/llama")
    dockerfile, compose_file = write_docker(cfg, out)
    lines = dockerfile.read_text().splitlines()
    from_lines = [line for line in lines if line.startswith("FROM ")]
    assert from_lines == ["FROM nvcr.io/nvidia/tritonserver:24.10-py3"]
    assert any(line.startswith("EXPOSE 8000 8001 8002") for line in lines)
    assert any("/v2/health/ready" in line for line in lines if line.startswith("HEALTHCHECK"))
    for pkg in ("runtime", "plugins", "model_repo", "deploy"):
        assert f"COPY {pkg} ./{pkg}" in lines
        assert (Path(__file__).parent.parent / pkg).is_dir()  # what the Dockerfile copies exists
    cmd = next(line for line in lines if line.startswith("CMD "))
    assert cmd == "CMD " + __import__("json").dumps(container_command(cfg))
    assert any('".[kernels,serve]"' in line for line in lines if line.startswith("RUN "))  # deploy serve's HTTP front

    compose = yaml.safe_load(compose_file.read_text())
    svc = compose["services"]["spectree"]
    root = Path(__file__).resolve().parent.parent
    assert (out / svc["build"]["context"]).resolve() == root
    assert (root / svc["build"]["dockerfile"]).resolve() == dockerfile.resolve()
    assert svc["ports"] == ["127.0.0.1:8000:8000", "127.0.0.1:8001:8001", "127.0.0.1:8002:8002"]
    assert svc["volumes"] == ["/data/engines/llama:/engines/engine:ro"]
    assert svc["healthcheck"]["test"][-1] == "http://127.0.0.1:8000/v2/health/ready"
    assert svc["restart"] == "on-failure"  # deploy serve exits 3 when a model's process died
    assert svc["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert svc["shm_size"] == "2g"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"name": "Bad_Name"}, "name: got 'Bad_Name', expected a DNS label"),
        ({"http_port": 8001}, "must differ"),
        ({"metrics_port": 70000}, "metrics_port: got 70000, expected a TCP port"),
        ({"memory_limit": "lots"}, "memory_limit: got 'lots', expected a Kubernetes quantity"),
        ({"gpus": 0}, "device cuda needs at least 1 GPU"),
        ({"device": "tpu"}, "device: got 'tpu', expected one of 'cpu', 'cuda'"),
        ({"engine_mount": "engines"}, "engine_mount: got 'engines', expected an absolute path"),
        ({"replicas": 0}, "replicas: got 0, expected an integer >= 1"),
        ({"name": "a" * 64}, "expected a DNS label (lowercase letters, digits, '-'; at most 63)"),
        ({"replicas": True}, "replicas: got True, expected an integer"),
    ],
)
def test_deploy_config_is_validated(kwargs, message):
    with pytest.raises(ConfigError) as e:
        DeployConfig(**kwargs)
    assert message in str(e.value)


def test_deploy_cli_renders_and_refuses_unknown_flags(tmp_path, capsys):
    assert main(["k8s", "--output", str(tmp_path / "k"), "--replicas", "3", "--device", "cpu", "--gpus", "0"]) == 0
    dep = yaml.safe_load((tmp_path / "k" / "deployment.yaml").read_text())
    assert dep["spec"]["replicas"] == 3
    assert "nvidia.com/gpu" not in dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert main(["docker", "--output", str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / "Dockerfile").is_file()
    assert main(["k8s", "--output", str(tmp_path / "k2"), "--gpus", "0"]) == 2
    assert "device cuda needs at least 1 GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["k8s", "--output", str(tmp_path / "k3"), "--gpu-count", "1"])
    assert e.value.code == 2


# ---- server launch --------------------------------------------------------------------------------------


def test_server_config_defaults_bind_loopback(tmp_path):
    cfg = ServerConfig(repo=str(tmp_path))
    assert cfg.address == "127.0.0.1" and cfg.grpc_url == "127.0.0.1:8001"
    wheel = Installation(binary=Path("/x/tritonserver"), backend_source=Path("/x/backends"), stub=Path("/x/stub"),
                         lib_dirs=(Path("/x/libs"),), kind="wheel")
    cmd = command(cfg, wheel, tmp_path / "backends")
    assert cmd[0] == "/x/tritonserver"
    for flag in ("--model-control-mode=none", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
                 "--metrics-address=127.0.0.1", "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002",
                 f"--model-repository={tmp_path.resolve()}", f"--backend-directory={tmp_path / 'backends'}"):
        assert flag in cmd
    anywhere = ServerConfig(repo=str(tmp_path), address="0.0.0.0")
    assert "--grpc-address=0.0.0.0" in command(anywhere, wheel, None) and anywhere.http_url == "http://127.0.0.1:8000"
    on_path = Installation(binary=Path("/opt/tritonserver/bin/tritonserver"), backend_source=None, stub=None)
    assert not any(a.startswith("--backend-directory") for a in command(cfg, on_path, None))


def test_server_restricts_the_admin_apis(tmp_path):
    """Shared memory (a client could read a /dev/shm region back through a prompt), the model repository, trace and
    logging settings are closed to requests without the admin token; inference, health, metadata, model config and
    statistics stay open."""
    from deploy.server import ADMIN_HEADER, RESTRICTED_APIS

    on_path = Installation(binary=Path("/opt/tritonserver/bin/tritonserver"), backend_source=None, stub=None)
    token = "t" * 20
    config = ServerConfig(repo=str(tmp_path), admin_token=token)
    for cmd, value in ((command(config, on_path, None), ADMIN_TOKEN_MARK), (command(config, on_path, None, token),
                                                                            token)):
        group = f"shared-memory,model-repository,trace,logging:{ADMIN_HEADER}={value}"
        assert f"--http-restricted-api={group}" in cmd and f"--grpc-restricted-protocol={group}" in cmd
    assert token not in " ".join(command(config, on_path, None))  # by default the mark stands in for it
    assert set(RESTRICTED_APIS).isdisjoint({"inference", "health", "metadata", "model-config", "statistics"})
    with pytest.raises(ConfigError, match="admin_token: expected at least 16"):
        ServerConfig(repo=str(tmp_path), admin_token="short")


def test_the_admin_token_reaches_the_program_but_never_its_command_line(tmp_path):
    """deploy/argv_secret.c, preloaded as tritonserver is: the program's own argv holds the token where the command
    line holds the mark, /proc/PID/cmdline (what ps shows every local user) only the mark, and neither the token nor
    the preload is passed on to the program's children. The program here is Python, whose sys.argv is main()'s."""
    preload = secret_preload()
    token = "secret-admin-token-0123456789"
    probe = ("import os, subprocess, sys; print(sys.argv[1]); print(open('/proc/self/cmdline', 'rb').read()); "
             "print(subprocess.run(['env'], capture_output=True, text=True).stdout)")
    env = secret_environment({"PATH": os.environ["PATH"], "LD_PRELOAD": "/nonexistent-other.so"}, token, preload)
    r = subprocess.run([sys.executable, "-c", probe, f"--x=a:{ADMIN_TOKEN_MARK}"], capture_output=True, text=True,
                       env=env, timeout=60, check=True)
    argv, cmdline, child_env = r.stdout.split("\n", 2)
    assert argv == f"--x=a:{token}"
    assert ADMIN_TOKEN_MARK in cmdline and token not in cmdline
    assert token not in child_env and "SPECTREE_SECRET" not in child_env and str(preload) not in child_env
    assert "LD_PRELOAD=/nonexistent-other.so" in child_env  # someone else's preload stays
    without = subprocess.run([sys.executable, "-c", "import sys; print(sys.argv[1])", f"--x={ADMIN_TOKEN_MARK}"],
                             capture_output=True, text=True, timeout=60, check=True)
    assert without.stdout.strip() == f"--x={ADMIN_TOKEN_MARK}"  # negative control: nothing replaces it unpreloaded


def test_server_environment_for_the_wheel():
    import sysconfig

    wheel = Installation(binary=Path("/x/tritonserver"), backend_source=Path("/x/b"), stub=Path("/x/s"),
                         lib_dirs=(Path("/x/libs"),), kind="wheel")
    env = server_environment(wheel, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/usr/lib", "PYTHONPATH": "/p"})
    assert env["PATH"].split(os.pathsep)[:2] == [str(Path(sys.executable).parent), "/usr/bin"]
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert libs == [sysconfig.get_config_var("LIBDIR"), "/x/libs", "/usr/lib"]
    assert env["PYTHONPATH"].split(os.pathsep) == [str(Path(__file__).resolve().parent.parent), "/p"]
    container = Installation(binary=Path("/opt/tritonserver/bin/tritonserver"), backend_source=None, stub=None)
    env = server_environment(container, {"PATH": "/usr/bin"})
    assert env["PATH"] == "/usr/bin" and "LD_LIBRARY_PATH" not in env


def test_server_config_and_installation_errors(tmp_path):
    with pytest.raises(ConfigError, match="repo: .* is not a directory"):
        ServerConfig(repo=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="must differ"):
        ServerConfig(repo=str(tmp_path), http_port=1, grpc_port=1)
    with pytest.raises(ConfigError, match="expected a TCP port"):
        ServerConfig(repo=str(tmp_path), grpc_port=0)
    with pytest.raises(ServerError, match="is not an executable file"):
        find_installation(str(tmp_path / "tritonserver"))


def test_start_refuses_a_busy_port(tmp_path):
    http, grpc, metrics = free_ports(3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", grpc))
        s.listen()
        assert not port_is_free(grpc)
        server = TritonServer(ServerConfig(repo=str(tmp_path), http_port=http, grpc_port=grpc, metrics_port=metrics))
        with pytest.raises(ServerError, match=rf"port\(s\) \[{grpc}\] on 127.0.0.1 are already in use"):
            server.start()
        assert server.process is None
    assert port_is_free(grpc)


def test_serve_cli_reports_a_server_that_fails_to_start(tmp_path, capsys):
    # A repository whose only model cannot load: tritonserver exits, `deploy serve` says why and exits 1.
    bad = tmp_path / "repo" / "broken"
    (bad / "1").mkdir(parents=True)
    (bad / "config.pbtxt").write_text('name: "broken"\nbackend: "no_such_backend"\nmax_batch_size: 0\n')
    try:
        find_installation()
    except ServerError as exc:
        pytest.skip(f"no tritonserver: {exc}")
    http, grpc, metrics = free_ports(3)
    code = main(["serve", "--repo", str(tmp_path / "repo"), "--http-port", str(http), "--grpc-port", str(grpc),
                 "--metrics-port", str(metrics), "--ready-timeout-s", "120"])
    err = capsys.readouterr().err
    assert code == 1 and "before it was ready" in err and "no_such_backend" in err
    for port in (http, grpc, metrics):
        assert port_is_free(port)


def test_stop_kills_a_server_whose_models_never_unload_after_the_drain(tmp_path):
    """TritonServer.stop: once the server's log says every inference has finished and the models are unloading, a
    server still up UNLOAD_GRACE_S later (tritonserver 2.51 never unloads a model that leaked a cancelled gRPC
    stream's request) is killed then, not after the whole exit timeout; a server that exits on its own keeps its
    status. The server is a shell script standing in for tritonserver's shutdown."""
    import time

    from deploy.server import DRAINED_LOG_LINE, UNLOAD_GRACE_S

    def fake(after_term: str) -> TritonServer:
        log = tmp_path / f"{len(list(tmp_path.iterdir()))}.log"
        log.write_text(f"an earlier run's {DRAINED_LOG_LINE}\n")  # --log-file appends: only this run's lines count
        server = TritonServer(ServerConfig(repo=str(tmp_path), exit_timeout_s=30), log_path=log)
        server._log_start = log.stat().st_size
        script = f"trap '{after_term}' TERM; echo started >> {log}; while true; do sleep 0.05; done"
        server.process = subprocess.Popen(["sh", "-c", script], start_new_session=True)
        while "started" not in log.read_text():
            time.sleep(0.05)
        return server

    stuck = fake(f'echo "{DRAINED_LOG_LINE}" >> {tmp_path}/0.log; sleep 60')
    t0 = time.monotonic()
    code = stuck.stop()
    assert stuck.killed_after_drain and UNLOAD_GRACE_S <= time.monotonic() - t0 < UNLOAD_GRACE_S + 5, code
    clean = fake("exit 0")
    assert clean.stop() == 0 and not clean.killed_after_drain
