"""What a measurement ran on: CPU model, cores, memory, library versions, torch threads; a short machine slug.

Every report (bench and serve) embeds `machine_info()` (through `report_header`), so a number is never separated
from the machine it was measured on. Nothing here changes any state, except `torch_threads`: a block that sets
torch's intra-op threads and restores them after.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import re
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from plugins import cpu


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo ("model name"), else platform.processor(), else "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask), which is what torch's thread pool can use."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def settings_dict(config: Any) -> dict[str, Any]:
    """A frozen settings dataclass as the JSON a report records: paths as strings, tuples as lists (nested), and
    `threads` resolved to what ran (`config.resolved_threads()`) when the settings have one."""
    import dataclasses

    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        return value

    d = {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if hasattr(config, "resolved_threads"):
        d["threads"] = config.resolved_threads()
    return d


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def gpu_name() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine_info() -> dict[str, Any]:
    """JSON-ready description of this machine and software, with torch's current thread settings."""
    features = cpu.features()
    return {
        "cpu_model": cpu_model(),
        "cpu_row": features.row,  # the README's CPU support table row (plugins/cpu/)
        "cpu_forced": features.forced,  # a forced instruction-set level (SPECTREE_CPU_ISA), None: the CPU's own
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gib": memory_gib(),
        "gpu": gpu_name(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "transformers": package_version("transformers"),
        "tritonclient": package_version("tritonclient"),
        "spectree": package_version("spectree"),
    }


def machine_slug(info: dict[str, Any] | None = None) -> str:
    """A short, file-name-safe name of the machine kind, e.g. "cpu-amd-epyc-2c" or "gpu-nvidia-h200"."""
    info = info or machine_info()
    if info.get("gpu"):
        name, prefix = info["gpu"], "gpu"
    else:
        name, prefix = f"{info['cpu_model']} {info['usable_cores']}c", "cpu"
    name = re.sub(r"\((r|tm)\)|\bprocessor\b|\bcpu\b|@.*?(?=\s\d+c$|$)", " ", name.lower())
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    forced = f"-forced-{info['cpu_forced']}" if info.get("cpu_forced") and not info.get("gpu") else ""
    return f"{prefix}-{slug[:40].strip('-')}{forced}"


def today() -> str:
    return _dt.date.today().isoformat()


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def report_header(fmt: str, format_version: int, settings: dict[str, Any],
                  machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields every perf report starts with; machine: `machine_info()` taken by the caller (e.g. while its
    torch threads were set), else now."""
    return {"format": fmt, "format_version": format_version, "created": now_iso(),
            "machine": machine_info() if machine is None else machine, "settings": settings}


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n for the block, restored after (also when it raises)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def expand_out(template: str | Path, info: dict[str, Any] | None = None) -> Path:
    """An output directory template with {date} (YYYY-MM-DD) and {machine} (machine_slug) filled in."""
    text = str(template)
    if "{machine}" in text:
        text = text.replace("{machine}", machine_slug(info))
    return Path(text.replace("{date}", today()))


__all__ = [
    "cpu_model",
    "expand_out",
    "gpu_name",
    "machine_info",
    "machine_slug",
    "memory_gib",
    "now_iso",
    "package_version",
    "report_header",
    "today",
    "torch_threads",
    "usable_cores",
]
