"""Building the plugins' C kernels for this CPU: compiled on first use, cached, loaded through ctypes.

Build: the system C compiler (`$CC`, else `cc`), `-O3 -march=native` (a library runs where it is built; a forced
lower level's target instead, plugins/cpu/) with OpenMP, which resolves to the libgomp torch has already loaded, so
its threads are torch's (torch.set_num_threads applies); without OpenMP where the compiler has none. A library is
cached under `$SPECTREE_CACHE_DIR` (default `$XDG_CACHE_HOME/spectree` or `~/.cache/spectree`), named by a hash of its
source and the local headers it includes (`sources_of`), the flags, the compiler's version and this CPU's feature
flags as the process sees them; written to a temporary name and renamed, so concurrent processes never load a
half-written file. Where the cache folder cannot be written, a private folder of this user's under the system temp
folder is used. `build` raises with the compiler's message where nothing builds; each kernel's module turns that into
"unavailable, and why" and keeps its torch route.

Emulation, for tests (`SPECTREE_EMULATE=avx512` or `avx512-bf16`, on a CPU without AVX-512): every kernel is built
with plugins/emulate_avx512.h forced in, which defines the AVX-512 (and AVX512-BF16) macros and the intrinsics the
kernels call as portable vector code, so the kernels' AVX-512 routes run, slowly, on an AVX2-only machine (.ci/run
checks them there). Python sees those routes as the CPU's own: each kernel reports its lane width and routes itself.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from plugins import cpu

# -Wno-psabi: GCC notes, for every 64-byte vector passed by value, that its ABI changed in GCC 4.6 (nothing here
# crosses a library boundary by value)
FLAGS = ("-O3", "-fPIC", "-shared", "-std=gnu11", "-Wno-psabi")
OPENMP = "-fopenmp"
COMPILE_TIMEOUT_S = 60  # each kernel builds in seconds (the attention kernel ~12 s with AVX-512, ~3 s for AVX2, 2 cores)
CACHE_ENV = "SPECTREE_CACHE_DIR"
# what a failed build raises (callers catch these and report the message)
BUILD_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError)
EMULATE_ENV = "SPECTREE_EMULATE"
EMULATE_HEADER = Path(__file__).with_name("emulate_avx512.h")
# what each emulation adds to the flags besides the forced header, and the instruction set it stands for
EMULATIONS = {"avx512": ((), "AVX-512"), "avx512-bf16": (("-DSPECTREE_EMULATE_BF16",), "AVX-512 + BF16")}


def emulation() -> str | None:
    """The emulated instruction set SPECTREE_EMULATE names (a key of EMULATIONS), None when unset; ValueError naming the
    variable, its value and the choices for any other value (a typo must not quietly build the CPU's own routes)."""
    value = os.environ.get(EMULATE_ENV) or None
    if value is not None and value not in EMULATIONS:
        raise ValueError(f"{EMULATE_ENV}={value!r}: expected one of {', '.join(EMULATIONS)} (or unset)")
    return value


def _emulation_flags() -> tuple[str, ...]:
    """The forced header and its macros; -O1 because GCC's -O3 takes minutes over 64-byte vectors on a target without
    them (the attention kernel's wide tiles: ~4 minutes against ~8 s), and optimisation levels do not change the
    arithmetic (no -ffast-math; contraction is each kernel's own flag)."""
    name = emulation()
    return () if name is None else ("-O1", "-include", str(EMULATE_HEADER), *EMULATIONS[name][0])


def cache_dir() -> Path:
    """Where built libraries are kept."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spectree"


def _private_temp_dir() -> Path:
    """A folder of this user's under the system temp folder (0700): where libraries go when the cache folder cannot
    be written. Refused if someone else owns it (a library loaded from there would run their code)."""
    path = Path(tempfile.gettempdir()) / f"spectree-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{path} is not a private folder of this user's")
    return path


def _compile(cc: str, flags: tuple[str, ...], source: Path, out: Path) -> None:
    """Compile `source` into `out` (atomically: a temporary name in the same folder, then renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        result = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                                timeout=COMPILE_TIMEOUT_S, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_or_compile(cc: str, flags: tuple[str, ...], source: Path, name: str) -> tuple[ctypes.CDLL, Path]:
    """The library `name` from the cache folder, compiled there first if missing; the private temp folder where the
    cache folder cannot be written."""
    try:
        path = cache_dir() / name
        if not path.exists():
            _compile(cc, flags, source, path)
    except OSError:
        path = _private_temp_dir() / name
        if not path.exists():
            _compile(cc, flags, source, path)
    return ctypes.CDLL(str(path)), path


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def sources_of(source: Path) -> list[Path]:
    """`source` and the local headers it includes (`#include "..."` found relative to the including file; one that is
    not there comes from an -I folder, e.g. llama.h), recursively, in the order first met: what a library built from it
    depends on."""
    seen: list[Path] = []
    todo = [source.resolve()]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        todo += [header for name in _LOCAL_INCLUDE.findall(path.read_text())
                 if (header := (path.parent / name).resolve()).is_file()]
    return seen


def build(source: Path, stem: str, extra_flags: tuple[str, ...] = (),
          openmp: bool = True) -> tuple[ctypes.CDLL, Path, bool]:
    """(library, its path, whether it has OpenMP) for the C file `source`, named `{stem}_{hash}.so` in the cache;
    raises one of BUILD_ERRORS, naming every attempt's failure, where it cannot be built. openmp=False: never
    linked with OpenMP (a library preloaded into another program)."""
    name = os.environ.get("CC") or "cc"
    cc = shutil.which(name)
    if cc is None:
        raise RuntimeError(f"no C compiler: {name} is not on PATH (set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    features = cpu.features()
    # what the library depends on besides its flags: the source, the compiler, the CPU -march=native targets
    emulated = _emulation_flags()
    built_from = [*(f.read_bytes() for f in sources_of(source)), version.encode(),
                  " ".join(sorted(features.flags)).encode() or (platform.processor() or platform.machine()).encode(),
                  *((EMULATE_HEADER.read_bytes(),) if emulated else ())]
    errors = []
    for threaded in (True, False) if openmp else (False,):
        flags = FLAGS + (f"-march={features.march}",) + extra_flags + emulated + ((OPENMP,) if threaded else ())
        key = hashlib.sha256(b"\0".join([" ".join(flags).encode(), *built_from])).hexdigest()[:16]
        try:
            lib, path = _load_or_compile(cc, flags, source, f"{stem}_{key}.so")
        except BUILD_ERRORS as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
            continue
        return lib, path, threaded
    raise RuntimeError("; ".join(errors))


_ISA_MACROS = (("__AVX512BF16__", "AVX-512 + BF16"), ("__AVX512F__", "AVX-512"), ("__AVX2__", "AVX2"),
               ("__SSE2__", "SSE2"))


@functools.lru_cache(maxsize=1)
def compiled_isa() -> str:
    """The widest instruction set the kernels are compiled for here (from the compiler's predefined macros at this
    process's -march), e.g. "AVX-512 + BF16" or "AVX2"; "unknown" where the compiler cannot say; an emulated one
    (SPECTREE_EMULATE) as "AVX-512 (emulated)"."""
    name = emulation()
    if name is not None:
        return f"{EMULATIONS[name][1]} (emulated)"
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        return "unknown"
    try:
        macros = subprocess.run([cc, f"-march={cpu.features().march}", "-dM", "-E", "-x", "c", os.devnull],
                                capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    defined = {line.split()[1] for line in macros.splitlines() if line.startswith("#define ")}
    return next((name for macro, name in _ISA_MACROS if macro in defined), "unknown")


T = TypeVar("T")


class Lazy(Generic[T]):
    """A kernel's loaded library, built by `make` on the first `get()` (thread-safe, once): None from then on where
    that raised one of BUILD_ERRORS, with the reason in `failure`."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._value: T | None = None
        self.failure: str | None = None

    def get(self) -> T | None:
        if self._value is not None or self.failure is not None:
            return self._value
        with self._lock:
            if self._value is None and self.failure is None:
                try:
                    self._value = self._make()
                except BUILD_ERRORS as exc:
                    self.failure = str(exc)
        return self._value


__all__ = ["BUILD_ERRORS", "CACHE_ENV", "EMULATE_ENV", "EMULATE_HEADER", "EMULATIONS", "FLAGS", "Lazy", "OPENMP",
           "build", "cache_dir", "compiled_isa", "emulation", "sources_of"]
