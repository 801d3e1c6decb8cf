"""Find NVIDIA's `perf_analyzer` and make it runnable on this machine, or say exactly what is missing.

Where the binary comes from (first found wins):
  1. an explicit path (`--perf-analyzer`);
  2. `perf_analyzer` on PATH (NVIDIA's Triton SDK container);
  3. this interpreter's bin/ directory: the `tritonclient` manylinux1 wheels carry the binary
     (`pip install "tritonclient[grpc,http]==2.51.0"`; 2.52.0 and later need glibc 2.38).
The wheel's binary links two libraries a CPU-only Debian 12 machine does not have: libb64.so.0d and
libcudart.so.12 (/work/shared/notes/serving-on-cpu.md). Both ship inside the nvidia-pytriton wheel
(`site-packages/nvidia_pytriton.libs/libb64-<hash>.so.0d`, `libcudart-<hash>.so.12.*`), and the CUDA runtime
also in the `nvidia-cuda-runtime-cu12` wheel. `locate` asks `ldd` which libraries are missing (then the loader, when
a wrapper script such as a pyenv shim hides the binary from `ldd`), links each one
under its soname into a cache directory inside the virtualenv (`<sys.prefix>/var/spectree/perf_analyzer-libs`,
or `~/.cache/spectree/perf_analyzer-libs` when that is not writable), and sets LD_LIBRARY_PATH for the
perf_analyzer subprocess only. A system copy (`apt-get install -y libb64-0d`) is used when present.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import SpectreeError
from runtime.files import shown_path

TRITONCLIENT_PIN = "tritonclient[grpc,http]==2.51.0"
PYTRITON_PIN = "nvidia-pytriton==0.7.0"
# soname -> (file-name pattern inside nvidia_pytriton.libs, how to get it otherwise)
KNOWN_LIBS = {
    "libb64.so.0d": ("libb64-*.so.0d", f"apt-get update && apt-get install -y libb64-0d, or pip install {PYTRITON_PIN}"),
    "libcudart.so.12": ("libcudart-*.so.12*", f"pip install {PYTRITON_PIN} (bundles it) or nvidia-cuda-runtime-cu12"),
}


class PerfAnalyzerMissing(SpectreeError, RuntimeError):
    """perf_analyzer is not installed, or cannot run here; the message says what is missing and how to get it."""


@dataclass(frozen=True)
class PerfAnalyzer:
    binary: Path
    version: str
    lib_dir: Path | None = None  # the soname links made for it (None: nothing was missing)
    linked: tuple[str, ...] = ()  # "soname -> target" for each link in lib_dir
    env: dict[str, str] = field(default_factory=dict, repr=False)  # the subprocess environment

    def describe(self) -> dict[str, object]:
        return {"binary": shown_path(self.binary), "version": self.version,
                "lib_dir": None if self.lib_dir is None else shown_path(self.lib_dir), "linked": list(self.linked)}


def find_binary(explicit: str | Path | None = None) -> Path:
    if explicit is not None:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise PerfAnalyzerMissing(f"--perf-analyzer: {str(path)!r} is not an executable file")
        return path
    on_path = shutil.which("perf_analyzer")
    if on_path is not None:
        return Path(on_path)
    beside = Path(sys.executable).parent / "perf_analyzer"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    raise PerfAnalyzerMissing(
        "perf_analyzer not found: not on PATH and not in this interpreter's bin/ "
        f"({beside.parent}). Install it with `{sys.executable} -m pip install \"{TRITONCLIENT_PIN}\"` (the "
        "manylinux1 tritonclient wheels carry the binary; 2.52.0 and later need glibc 2.38), or run inside "
        "NVIDIA's Triton SDK container, or pass --perf-analyzer PATH"
    )


def missing_libraries(binary: Path, env: dict[str, str]) -> list[str]:
    """Sonames `ldd` reports as "not found" for binary under env ([] when ldd itself is unavailable)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    proc = subprocess.run([ldd, str(binary)], capture_output=True, text=True, env=env, timeout=60, check=False)
    return re.findall(r"^\s*(\S+)\s+=>\s+not found", proc.stdout, flags=re.MULTILINE)


def pytriton_libs() -> Path | None:
    """site-packages/nvidia_pytriton.libs of the installed nvidia-pytriton wheel (found without importing it)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(next(iter(spec.submodule_search_locations))).parent / "nvidia_pytriton.libs"
    return libs if libs.is_dir() else None


def cuda_runtime_lib() -> Path | None:
    """site-packages/nvidia/cuda_runtime/lib of the nvidia-cuda-runtime-cu12 wheel, if installed."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        lib = Path(root) / "cuda_runtime" / "lib"
        if (lib / "libcudart.so.12").exists():
            return lib
    return None


def provider(soname: str) -> Path | None:
    """A file that can stand in for soname (see KNOWN_LIBS), or None."""
    pattern = KNOWN_LIBS.get(soname, (None,))[0]
    libs = pytriton_libs()
    if pattern is not None and libs is not None:
        found = sorted(libs.glob(pattern))
        if found:
            return found[0]
    if soname == "libcudart.so.12":
        lib = cuda_runtime_lib()
        if lib is not None:
            return lib / soname
    return None


def default_cache_dir() -> Path:
    venv_dir = Path(sys.prefix) / "var" / "spectree" / "perf_analyzer-libs"
    try:
        venv_dir.mkdir(parents=True, exist_ok=True)
        if os.access(venv_dir, os.W_OK):
            return venv_dir
    except OSError:
        pass
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spectree" / "perf_analyzer-libs"


def _link(target: Path, link: Path) -> None:
    """Make `link` point at `target` atomically (a concurrent run sees the old link or the new one)."""
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _with_lib_dir(env: dict[str, str], lib_dir: Path) -> dict[str, str]:
    parts = [str(lib_dir), *[p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]]
    return {**env, "LD_LIBRARY_PATH": os.pathsep.join(dict.fromkeys(parts))}


_LOADER_MISSING = re.compile(r"error while loading shared libraries: (\S+): cannot open shared object file")


def _unfound(binary: Path, lib_dir: Path | None, sonames: list[str]) -> None:
    """PerfAnalyzerMissing naming the libraries still not found and where each comes from (nothing when none)."""
    if sonames:
        how = "; ".join(f"{s}: {KNOWN_LIBS[s][1]}" if s in KNOWN_LIBS else f"{s}: no known source" for s in sonames)
        raise PerfAnalyzerMissing(f"{binary} cannot run: shared libraries not found: {', '.join(sonames)} "
                                  f"(looked in the system, {pytriton_libs() or 'no nvidia-pytriton wheel'} and "
                                  f"{lib_dir}). Get them: {how}")


def _version_run(binary: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([str(binary), "--version"], capture_output=True, text=True, env=env, timeout=60,
                              check=False)
    except OSError as exc:
        raise PerfAnalyzerMissing(f"{binary} cannot be started: {exc}") from exc


def locate(explicit: str | Path | None = None, cache_dir: Path | None = None) -> PerfAnalyzer:
    """A runnable perf_analyzer, its version, and the environment to run it with (PerfAnalyzerMissing if not).

    The libraries it lacks are those `ldd` reports, and then any the dynamic loader reports when it is started: a
    wrapper script on PATH (a pyenv shim, a module system's) hides the real binary from `ldd`, and LD_LIBRARY_PATH
    reaches the binary it execs all the same."""
    binary = find_binary(explicit)
    env = dict(os.environ)
    lib_dir = None
    linked: list[str] = []
    missing = missing_libraries(binary, env)
    tried: set[str] = set()
    while True:
        if missing:
            lib_dir = lib_dir or cache_dir or default_cache_dir()
            lib_dir.mkdir(parents=True, exist_ok=True)
            for soname in missing:
                tried.add(soname)
                target = provider(soname)
                if target is not None:
                    _link(target.resolve(), lib_dir / soname)
                    linked.append(f"{soname} -> {target.resolve()}")
            env = _with_lib_dir(env, lib_dir)
            _unfound(binary, lib_dir, missing_libraries(binary, env))
        proc = _version_run(binary, env)
        text = (proc.stdout + proc.stderr).strip()
        if proc.returncode == 0:
            break
        # the loader names one missing library per start: provide it and start again (each soname once)
        reported = _LOADER_MISSING.findall(text)
        missing = [s for s in reported if s not in tried]
        if not missing:
            _unfound(binary, lib_dir, reported)
            hint = (" (tritonclient 2.52.0 and later need glibc 2.38; pin "
                    f"\"{TRITONCLIENT_PIN}\")" if "GLIBC" in text else "")
            raise PerfAnalyzerMissing(f"{binary} --version failed with status {proc.returncode}{hint}: {text[-500:]}")
    version = text.splitlines()[-1] if text else "unknown"
    return PerfAnalyzer(binary=binary, version=version, lib_dir=lib_dir, linked=tuple(linked), env=env)


__all__ = [
    "KNOWN_LIBS",
    "PYTRITON_PIN",
    "TRITONCLIENT_PIN",
    "PerfAnalyzer",
    "PerfAnalyzerMissing",
    "default_cache_dir",
    "find_binary",
    "locate",
    "missing_libraries",
    "provider",
    "pytriton_libs",
]
