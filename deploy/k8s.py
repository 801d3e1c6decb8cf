"""Deployment files for GPU machines, rendered from one typed config (`DeployConfig`):

    Dockerfile         FROM NVIDIA's Triton image (tritonserver 2.51 = release 24.10); installs this project
    compose.yaml       one service: GPU reservation, loopback-published ports, readiness healthcheck, the
                       engine mounted read-only
    k8s/deployment.yaml, k8s/service.yaml
                       readiness on /v2/health/ready, liveness on /v2/health/live, the metrics port (with
                       prometheus.io annotations), CPU / memory / nvidia.com/gpu resources, the engine from a
                       PersistentVolumeClaim

The container renders its model repository from the mounted engine at start (`python -m model_repo render`)
and then runs `python -m deploy serve` on all interfaces. Nothing here is a template with blanks: each file is
built as data (or as Dockerfile instructions) from the config and dumped.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy.server import project_root, tcp_port
from runtime import schema
from runtime.errors import ConfigError
from runtime.scheduler_config import SchedulerConfig
from runtime.schema import setting

TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"  # tritonserver 2.51.0, the version the CPU tests run
_DNS = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"  # a DNS label (RFC 1123), without its 63-character cap


def _quantity(default: str) -> str:
    return setting(default, pattern=r"\d+(\.\d+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?",
                   what="a Kubernetes quantity such as 4, 500m or 32Gi")


def _container_path(default: str) -> str:
    return setting(default, pattern="/.*", what="an absolute path inside the container")


@dataclass(frozen=True)
class DeployConfig:
    """Everything `python -m deploy k8s` / `docker` accept (flags are these field names)."""

    # Kubernetes object / compose service name
    name: str = setting("spectree", pattern=f"(?=.{{1,63}}$){_DNS}",
                        what="a DNS label (lowercase letters, digits, '-'; at most 63)")
    image: str = "spectree-triton:latest"  # the image the Dockerfile builds and the manifests run
    base_image: str = TRITON_IMAGE
    namespace: str | None = setting(None, pattern=_DNS, what="a DNS label")
    replicas: int = setting(1, ge=1)
    engine_claim: str = "spectree-engines"  # PersistentVolumeClaim holding the engine directory (k8s)
    engine_subpath: str = "engine"  # the engine directory inside that claim
    engine_host_dir: str = "./engine"  # the engine directory on the docker host (compose)
    engine_mount: str = _container_path("/engines/engine")  # where the container sees the engine
    repo_dir: str = _container_path("/tmp/spectree-repo")  # where the container renders its model repository
    # spec_decode instance kind: cuda (KIND_GPU) or cpu
    device: str = setting("cuda", choices=("cpu", "cuda"))
    max_concurrent_requests: int = setting(SchedulerConfig.max_concurrent_requests, ge=1)
    http_port: int = tcp_port(8000)
    grpc_port: int = tcp_port(8001)
    metrics_port: int = tcp_port(8002)
    gpus: int = setting(1, ge=0)
    cpu_request: str = _quantity("4")
    cpu_limit: str = _quantity("8")
    memory_request: str = _quantity("32Gi")
    memory_limit: str = _quantity("64Gi")
    shm_size: str = _quantity("2Gi")  # the python backend moves tensors through /dev/shm

    def __post_init__(self) -> None:
        schema.check(self, ConfigError)
        ports = [self.http_port, self.grpc_port, self.metrics_port]
        if len(set(ports)) != 3:
            raise ConfigError(f"http_port, grpc_port and metrics_port must differ, got {ports}")
        if self.device == "cuda" and self.gpus < 1:
            raise ConfigError("gpus: device cuda needs at least 1 GPU")

    @property
    def labels(self) -> dict[str, str]:
        return {"app.kubernetes.io/name": self.name, "app.kubernetes.io/component": "triton"}


def container_command(cfg: DeployConfig) -> list[str]:
    """Render the repository from the mounted engine, then serve it on every interface."""
    render = ["python3", "-m", "model_repo", "render", "--engine", cfg.engine_mount, "--output", cfg.repo_dir,
              "--device", cfg.device, "--max-concurrent-requests", str(cfg.max_concurrent_requests), "--force"]
    serve = ["python3", "-m", "deploy", "serve", "--repo", cfg.repo_dir, "--address", "0.0.0.0",
             "--http-port", str(cfg.http_port), "--grpc-port", str(cfg.grpc_port),
             "--metrics-port", str(cfg.metrics_port)]
    return ["/bin/sh", "-c", f"{shlex.join(render)} && exec {shlex.join(serve)}"]


def dockerfile(cfg: DeployConfig) -> str:
    instructions = [
        "# syntax=docker/dockerfile:1",
        "# Rendered by `python -m deploy docker`; the build context is the project root (see compose.yaml).",
        f"FROM {cfg.base_image}",
        "WORKDIR /opt/spectree",
        "COPY pyproject.toml ./",
        "COPY runtime ./runtime",
        "COPY plugins ./plugins",
        "COPY builder ./builder",
        "COPY model_repo ./model_repo",
        "COPY deploy ./deploy",
        "COPY perf ./perf",
        # The image's tritonserver and python backend serve with the system Python; torch is installed there
        # (the registry's 2.13.0 Linux wheel is the CUDA build); the serve extra for deploy serve's HTTP front.
        (
            'RUN python3 -m pip install --no-cache-dir "torch==2.13.0" "numpy<2" && '
            'python3 -m pip install --no-cache-dir ".[kernels,serve]" && '
            'python3 -m pip install --no-cache-dir "tritonclient[grpc]==2.51.0"'
        ),
        f"EXPOSE {cfg.http_port} {cfg.grpc_port} {cfg.metrics_port}",
        (
            "HEALTHCHECK --interval=10s --timeout=3s --start-period=300s CMD curl -fsS "
            f"http://127.0.0.1:{cfg.http_port}/v2/health/ready || exit 1"
        ),
        f"CMD {_json_list(container_command(cfg))}",
    ]
    return "\n".join(instructions) + "\n"


def _json_list(items: list[str]) -> str:
    import json

    return json.dumps(items)


def compose(cfg: DeployConfig, context: str = ".", dockerfile_path: str = "Dockerfile") -> dict[str, Any]:
    """compose.yaml; context: the project root relative to the compose file, dockerfile_path: the Dockerfile
    relative to that root."""
    service: dict[str, Any] = {
        "build": {"context": context, "dockerfile": dockerfile_path},
        "image": cfg.image,
        "command": container_command(cfg),
        "ports": [f"127.0.0.1:{p}:{p}" for p in (cfg.http_port, cfg.grpc_port, cfg.metrics_port)],
        "volumes": [f"{cfg.engine_host_dir}:{cfg.engine_mount}:ro"],
        "shm_size": _compose_size(cfg.shm_size),
        "healthcheck": {
            "test": ["CMD", "curl", "-fsS", f"http://127.0.0.1:{cfg.http_port}/v2/health/ready"],
            "interval": "10s",
            "timeout": "3s",
            "start_period": "300s",
        },
        "stop_signal": "SIGTERM",
        "stop_grace_period": "60s",
        # `deploy serve` exits non-zero (3) when tritonserver lost a model's process; compose starts it again.
        # (Kubernetes: a Deployment's pods always restart.)
        "restart": "on-failure",
    }
    if cfg.gpus:
        service["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": cfg.gpus, "capabilities": ["gpu"]}]}}}
    return {"services": {cfg.name: service}}


def _compose_size(quantity: str) -> str:
    """Kubernetes quantity -> docker size ("2Gi" -> "2g")."""
    m = re.match(r"^(\d+)(Ki|Mi|Gi|Ti)?$", quantity)
    if m is None:
        raise ConfigError(f"shm_size: docker needs a whole binary size such as 2Gi, got {quantity!r}")
    unit = {None: "b", "Ki": "k", "Mi": "m", "Gi": "g", "Ti": "t"}[m.group(2)]
    return f"{m.group(1)}{unit}"


def _metadata(cfg: DeployConfig, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": cfg.name, "labels": dict(cfg.labels)}
    if cfg.namespace is not None:
        meta["namespace"] = cfg.namespace
    meta.update(extra)
    return meta


def deployment(cfg: DeployConfig) -> dict[str, Any]:
    limits: dict[str, Any] = {"cpu": cfg.cpu_limit, "memory": cfg.memory_limit}
    requests: dict[str, Any] = {"cpu": cfg.cpu_request, "memory": cfg.memory_request}
    if cfg.gpus:
        limits["nvidia.com/gpu"] = cfg.gpus
        requests["nvidia.com/gpu"] = cfg.gpus
    container = {
        "name": "triton",
        "image": cfg.image,
        "command": container_command(cfg),
        "ports": [
            {"name": "http", "containerPort": cfg.http_port, "protocol": "TCP"},
            {"name": "grpc", "containerPort": cfg.grpc_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": cfg.metrics_port, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"},
                           "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"},
                          "periodSeconds": 10, "failureThreshold": 6},
        "startupProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"},
                         "periodSeconds": 10, "failureThreshold": 60},
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": [
            {"name": "engine", "mountPath": cfg.engine_mount, "subPath": cfg.engine_subpath, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    pod = {
        "metadata": {"labels": dict(cfg.labels),
                     "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(cfg.metrics_port),
                                     "prometheus.io/path": "/metrics"}},
        "spec": {
            "terminationGracePeriodSeconds": 60,
            "containers": [container],
            "volumes": [
                {"name": "engine", "persistentVolumeClaim": {"claimName": cfg.engine_claim, "readOnly": True}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm_size}},
            ],
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(cfg),
        "spec": {"replicas": cfg.replicas, "selector": {"matchLabels": dict(cfg.labels)}, "template": pod},
    }


def service(cfg: DeployConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(cfg, annotations={"prometheus.io/scrape": "true",
                                                "prometheus.io/port": str(cfg.metrics_port)}),
        "spec": {
            "type": "ClusterIP",
            "selector": dict(cfg.labels),
            "ports": [
                {"name": "http", "port": cfg.http_port, "targetPort": "http", "protocol": "TCP"},
                {"name": "grpc", "port": cfg.grpc_port, "targetPort": "grpc", "protocol": "TCP"},
                {"name": "metrics", "port": cfg.metrics_port, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def _dump(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def write_docker(cfg: DeployConfig, output: str | Path) -> list[Path]:
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "Dockerfile", out / "compose.yaml"]
    root = project_root()
    context = os.path.relpath(root, out.resolve())
    dockerfile_path = os.path.relpath(files[0].resolve(), root)
    files[0].write_text(dockerfile(cfg), encoding="utf-8")
    files[1].write_text(_dump(compose(cfg, context, dockerfile_path)), encoding="utf-8")
    return files


def write_k8s(cfg: DeployConfig, output: str | Path) -> list[Path]:
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "deployment.yaml", out / "service.yaml"]
    files[0].write_text(_dump(deployment(cfg)), encoding="utf-8")
    files[1].write_text(_dump(service(cfg)), encoding="utf-8")
    return files


def config_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(DeployConfig))


__all__ = [
    "TRITON_IMAGE",
    "DeployConfig",
    "compose",
    "config_fields",
    "container_command",
    "deployment",
    "dockerfile",
    "service",
    "write_docker",
    "write_k8s",
]
