"""The row-invariant CPU kernel (invariant.c): compiled for this CPU on first use, called through ctypes.

Why: a bfloat16 model on CPU must give a token the same logits whether it is verified in a tree or decoded alone
(runtime/model.py, "batch invariance"). torch's SDPA does not: its reductions run in orders that depend on the number
of query rows and on where the masked keys sit, so the runtime used to attend in float64 to push those differences
below a bf16 rounding step. This kernel is row-invariant by construction (invariant.c says how) and accumulates in
float32 over bf16 or float32 K/V: 2-3x faster than float64 SDPA at 16 rows, and a quarter of its cache memory in bf16.
On CPUs with AVX512-BF16, bf16 inputs with a head size that is a multiple of 32 take a route built on bf16 pair dot
products, with 16 (row, head) pairs per vector, which multiplies the values by softmax weights rounded to bf16 (as GPU
flash attention does): ~1.5x faster again at 8-24 rows (`Native.rounds_weights`).

Build: the system C compiler (`$CC`, else `cc`), `-O3 -march=native` (it runs where it is built) with OpenMP, which
resolves to the libgomp torch has already loaded, so its threads are torch's (torch.set_num_threads applies). The
library is cached under `$SPECTREE_CACHE_DIR` (default `$XDG_CACHE_HOME/spectree` or `~/.cache/spectree`), named by a
hash of the source, the flags, the compiler's version and this CPU's feature flags; written to a temporary name and
renamed, so concurrent processes never load a half-written file. Where no compiler works, `load()` returns None,
`unavailable()` says why, and callers keep the float64 route.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from plugins.tree_attention.spec import check_inputs

SOURCE = Path(__file__).with_name("invariant.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11")
OPENMP = "-fopenmp"
# the dtypes it takes: q, k and v share one of them; the output is float32
DTYPES = (torch.float32, torch.bfloat16)
# the dtype the op routes to it on CPU (plugins/tree_attention/op.py); float32 keeps SDPA, which is as fast or faster
# at long prefixes and many rows, and float32 models need no row invariance (runtime/model.py)
INVARIANT_DTYPE = torch.bfloat16
CACHE_ENV = "SPECTREE_CACHE_DIR"


@dataclass(frozen=True)
class Native:
    """The loaded kernel: `fn` is `spectree_tree_attention` with its argument types set; `path` the library."""

    fn: ctypes._CFuncPtr
    path: Path
    threaded: bool  # built with OpenMP
    rounds_weights_fn: ctypes._CFuncPtr  # spectree_rounds_weights

    def rounds_weights(self, head_size: int, dtype: torch.dtype) -> bool:
        """Whether inputs of this head size and dtype take the kernel's bf16 route (this CPU has AVX512-BF16, bf16,
        head size a multiple of 32), which multiplies the values by softmax weights rounded to bf16 (invariant.c)."""
        return bool(self.rounds_weights_fn(head_size, int(dtype == torch.bfloat16)))


_lock = threading.Lock()
_loaded: Native | None = None
_failure: str | None = None


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


def _cpu_flags() -> str:
    """This CPU's feature flags (what -march=native compiles for); the machine name where /proc/cpuinfo is absent."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compile(cc: str, flags: tuple[str, ...], out: Path) -> None:
    """Compile SOURCE into `out` (atomically: a temporary name in the same folder, then renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        result = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                                timeout=120, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_or_compile(cc: str, flags: tuple[str, ...], name: str) -> tuple[ctypes.CDLL, Path]:
    """The library `name` from the cache folder, compiled there first if missing; the private temp folder where the
    cache folder cannot be written."""
    try:
        path = cache_dir() / name
        if not path.exists():
            _compile(cc, flags, path)
    except OSError:
        path = _private_temp_dir() / name
        if not path.exists():
            _compile(cc, flags, path)
    return ctypes.CDLL(str(path)), path


def _build() -> Native:
    name = os.environ.get("CC") or "cc"
    cc = shutil.which(name)
    if cc is None:
        raise RuntimeError(f"no C compiler: {name} is not on PATH (set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    # what the library depends on besides its flags: the source, the compiler, the CPU -march=native targets
    built_from = [SOURCE.read_bytes(), version.encode(), _cpu_flags().encode()]
    errors = []
    for threaded in (True, False):  # without OpenMP where the compiler has none: one thread
        flags = FLAGS + ((OPENMP,) if threaded else ())
        key = hashlib.sha256(b"\0".join([" ".join(flags).encode(), *built_from])).hexdigest()[:16]
        try:
            lib, path = _load_or_compile(cc, flags, f"tree_attention_{key}.so")
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
            continue
        fn = lib.spectree_tree_attention
        fn.restype = ctypes.c_int
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64,
                       ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        rounds = lib.spectree_rounds_weights
        rounds.restype = ctypes.c_int
        rounds.argtypes = [i64, ctypes.c_int]
        return Native(fn, path, threaded, rounds)
    raise RuntimeError("; ".join(errors))


def load() -> Native | None:
    """The kernel, built on first call (about a second); None where it cannot be built (see `unavailable`)."""
    global _loaded, _failure
    if _loaded is not None or _failure is not None:
        return _loaded
    with _lock:
        if _loaded is None and _failure is None:
            try:
                _loaded = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _failure = str(exc)
    return _loaded


def unavailable() -> str | None:
    """Why `load()` gave None (None while it has not been tried or when it worked)."""
    return _failure


def tree_attention_native(
    q: torch.Tensor,  # [B, Hq, N, D] float32 or bfloat16, last dim contiguous
    k: torch.Tensor,  # [B, Hkv, L + N, D] q's dtype, last dim contiguous
    v: torch.Tensor,  # [B, Hkv, L + N, D] q's dtype, last dim contiguous
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32 packed
    scale: float,
    *,
    checked: bool = False,
) -> torch.Tensor:  # [B, Hq, N, D] float32
    """The kernel; raises if it is unavailable. Inputs are validated (plugins/tree_attention/spec.py `check_inputs`:
    the kernel trusts every shape it is given) unless the caller has done so (`checked`, the op's CPU path)."""
    native = load()
    if native is None:
        raise RuntimeError(f"the row-invariant tree-attention kernel is unavailable: {_failure}")
    if not checked:
        check_inputs(q, k, v, tree_mask)
    if q.dtype not in DTYPES:
        raise TypeError(f"tree_attention_native takes {[str(d) for d in DTYPES]}, got {q.dtype}")
    if any(t.device.type != "cpu" for t in (q, k, v, tree_mask)):
        raise ValueError("tree_attention_native runs on CPU tensors only")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = tree_mask.contiguous()
    b, hq, n, d = q.shape
    out = torch.empty(b, hq, n, d, dtype=torch.float32)
    rc = native.fn(q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3],
                   mask.data_ptr(), mask.shape[-1], out.data_ptr(), b, hq, k.shape[1], n, k.shape[2], d, scale,
                   int(q.dtype == torch.bfloat16))
    if rc != 0:
        raise MemoryError("tree_attention_native: the kernel could not allocate its scratch memory")
    return out


__all__ = ["CACHE_ENV", "DTYPES", "INVARIANT_DTYPE", "Native", "SOURCE", "cache_dir", "load", "tree_attention_native",
           "unavailable"]
