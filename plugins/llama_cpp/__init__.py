"""llama.cpp as a target executor: its CPU forward (ggml kernels, F32 / BF16 / Q8_0 / Q4_1 GGUF weights) driven one
batch at a time, so our drafters and verification run on top of the engine a CPU user would otherwise pick.

Optional. `bash scripts/setup-llama-cpp.sh` builds llama.cpp's shared libraries and headers into .llama.cpp/lib and
.llama.cpp/include (or $SPECTREE_LLAMA_CPP_LIB names a folder holding both); executor.c, a few plain C functions over
llama.h, is compiled against them on first use (plugins/native_build.py). `available()` says why not where not.

Trees in one batch: the KV cache is unified over `n_seq` sequences; a token attends to the cached tokens that share a
sequence with it at a position not after its own. Each root-to-leaf path of a drafted tree is one sequence, a node
belongs to the sequences of the leaves under it, and the committed tokens to all of them (`seq_cp` before the step,
`seq_rm` after), so each node sees exactly its ancestors.

What is exact, and why (read from ggml's CPU code at llama.cpp build 11434, the version setup installs):
  - A matmul over two rows or more goes through llamafile's tinyBLAS (one vector accumulator per output element
    over the whole reduction, then one horizontal sum: the same order for any batch size and tile shape); over one
    row it goes through ggml's vec_dot (four accumulators): another order. llama.cpp runs the last layer's
    feed-forward and lm_head over the output rows only. So the decode loop never decodes fewer than two rows nor
    asks for fewer than two outputs (`runtime.llama_cpp_decode._decode` adds a token of a throwaway sequence).
  - Weight repacking (extra buffer types: GEMV for one row, GEMM for several) is off; flash attention is off (its
    CPU kernel takes one route for one query row, another for many, another for long caches). Attention is then
    K^T q, a masked softmax and V p, matmuls and a row-wise softmax whose sums run over the cache's cells in cell
    order (masked cells add exact zeros).
  - So a token's logits are bit-identical whatever else the batch holds, provided every token it attends to sits
    in the cell numbered by its position. The committed tokens do (the decode loop keeps the cache as cells
    0..P-1); a drafted node's ancestors inside the tree do not (the tree's nodes fill the cells after P in node
    order), so logits of nodes below the root are close to, not equal to, what plain decoding computes there.
    runtime/llama_cpp_decode.py therefore re-decodes every accepted token at its own cell in the next step and
    emits it only once those exact logits confirm it (greedy output is plain greedy decoding's by construction).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plugins import native_build

LIB_ENV = "SPECTREE_LLAMA_CPP_LIB"
DEFAULT_LIB_DIR = Path(__file__).resolve().parents[2] / ".llama.cpp" / "lib"
SOURCE = Path(__file__).with_name("executor.c")
HEADERS = ("llama.h", "ggml.h")


class LlamaCppError(RuntimeError):
    """llama.cpp is not built here, or it refused a model or a batch."""


def lib_dir() -> Path:
    """Where libllama.so and its headers are: $SPECTREE_LLAMA_CPP_LIB, else .llama.cpp/lib."""
    return Path(os.environ.get(LIB_ENV) or DEFAULT_LIB_DIR)


def _include_dir(lib: Path) -> Path:
    return lib.parent / "include" if not (lib / "llama.h").exists() else lib


@functools.lru_cache(maxsize=4)
def _library(lib: Path) -> ctypes.CDLL:
    include = _include_dir(lib)
    missing = [p for p in (lib / "libllama.so", *(include / h for h in HEADERS)) if not p.exists()]
    if missing:
        raise LlamaCppError(f"llama.cpp is not built here (missing {', '.join(map(str, missing))}): run "
                            f"`bash scripts/setup-llama-cpp.sh`, or set ${LIB_ENV} to a folder with libllama.so")
    # The build depends on the headers' text (the structs executor.c fills in) and the libraries' place.
    stamp = hashlib.sha256(b"".join((include / h).read_bytes() for h in HEADERS)).hexdigest()[:12]
    flags = (f"-I{include}", f"-DSPECTREE_LLAMA_H={stamp}", f"-L{lib}", "-Wl,--no-as-needed", "-lllama",
             f"-Wl,-rpath,{lib}")
    try:
        so, _, _ = native_build.build(SOURCE, "llama_cpp_executor", flags, openmp=False)
    except native_build.BUILD_ERRORS as exc:
        raise LlamaCppError(f"the llama.cpp executor did not build: {exc}") from exc
    i32, p = ctypes.c_int32, ctypes.c_void_p
    so.st_open.restype = p
    so.st_open.argtypes = [ctypes.c_char_p, i32, i32, i32, i32, i32, i32, ctypes.c_char_p, i32]
    so.st_decode.restype = i32
    so.st_decode.argtypes = [p, i32, p, p, p, p, p, p, p]
    for name, args, res in (("st_n_vocab", [p], i32), ("st_n_ctx", [p], i32), ("st_n_embd", [p], i32),("st_seq_rm", [p, i32, i32, i32], i32),
                            ("st_seq_cp", [p, i32, i32, i32, i32], None), ("st_seq_pos_max", [p, i32], i32),
                            ("st_clear", [p], None), ("st_close", [p], None)):
        fn = getattr(so, name)
        fn.argtypes, fn.restype = args, res
    return so


def available() -> str | None:
    """None where the executor loads here, else why not (one line)."""
    try:
        _library(lib_dir())
    except LlamaCppError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class ExecutorConfig:
    """One llama.cpp context."""

    model: str  # a GGUF file
    n_ctx: int = 4096  # KV cells (tokens of all sequences together)
    n_batch: int = 512  # the most tokens one decode takes
    n_seq: int = 64  # sequences: a tree's leaves, the committed sequence (0) and the padding one (n_seq - 1)
    threads: int = 2
    hidden: bool = False  # also return each output token's final-norm hidden state (what EAGLE heads read)
    verbose: bool = False  # llama.cpp's own log (errors are always shown)


class LlamaCppExecutor:
    """A loaded model and its context. `decode` runs one batch; `seq_rm` / `seq_cp` edit the cache."""

    def __init__(self, config: ExecutorConfig) -> None:
        if not Path(config.model).is_file():
            raise LlamaCppError(f"model: {config.model} is not a file (expected a GGUF file)")
        self.config = config
        self._so = _library(lib_dir())
        err = ctypes.create_string_buffer(512)
        handle = self._so.st_open(str(config.model).encode(), config.n_ctx, config.n_batch, config.n_seq,
                                  config.threads, int(config.hidden), int(config.verbose), err, len(err))
        if not handle:
            raise LlamaCppError(err.value.decode(errors="replace"))
        self._h = ctypes.c_void_p(handle)
        self.vocab_size = int(self._so.st_n_vocab(self._h))
        self.n_ctx = int(self._so.st_n_ctx(self._h))
        self.hidden_size = int(self._so.st_n_embd(self._h))
        self.pad_seq = config.n_seq - 1

    def decode(self, tokens: list[int], positions: list[int], seqs: list[tuple[int, ...]],
               outputs: list[bool]) -> tuple[np.ndarray, np.ndarray | None]:
        """One llama_decode: token i at positions[i] in sequences seqs[i]. For the tokens whose outputs[i] is set,
        in batch order: their logits [sum(outputs), vocab] float32, and their hidden states [sum(outputs), hidden]
        float32 when the executor was opened with `hidden` (else None)."""
        n = len(tokens)
        if not (len(positions) == len(seqs) == len(outputs) == n):
            raise LlamaCppError(f"decode: {n} tokens, {len(positions)} positions, {len(seqs)} sequence sets and "
                                f"{len(outputs)} output flags (expected one of each per token)")
        tok = np.asarray(tokens, dtype=np.int32)
        pos = np.asarray(positions, dtype=np.int32)
        start = np.zeros(n + 1, dtype=np.int32)
        start[1:] = np.cumsum([len(s) for s in seqs])
        ids = np.fromiter((q for s in seqs for q in s), dtype=np.int32, count=int(start[-1]))
        out = np.asarray(outputs, dtype=np.int8)
        logits = np.empty((int(out.sum()), self.vocab_size), dtype=np.float32)
        hidden = np.empty((int(out.sum()), self.hidden_size), dtype=np.float32) if self.config.hidden else None
        status = self._so.st_decode(self._h, n, tok.ctypes.data, pos.ctypes.data, start.ctypes.data,
                                    ids.ctypes.data, out.ctypes.data, logits.ctypes.data,
                                    None if hidden is None else hidden.ctypes.data)
        if status != 0:
            why = {1: "no room left in the KV cache", -100: f"batch of {n} tokens (expected 1..{self.config.n_batch})",
                   -101: "a token with no sequence, or more than n_seq"}.get(status, "llama_decode failed")
            raise LlamaCppError(f"decode of {n} tokens: {why} (status {status})")
        return logits, hidden

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Drop sequence `seq`'s tokens at positions [p0, p1) (seq -1: every sequence; -1 bounds: open)."""
        self._so.st_seq_rm(self._h, seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Sequence `dst` also holds `src`'s tokens at positions [p0, p1)."""
        self._so.st_seq_cp(self._h, src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        return int(self._so.st_seq_pos_max(self._h, seq))

    def clear(self) -> None:
        self._so.st_clear(self._h)

    def close(self) -> None:
        if self._h is not None:
            self._so.st_close(self._h)
            self._h = None

    def __enter__(self) -> LlamaCppExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ExecutorConfig", "LlamaCppError", "LlamaCppExecutor", "available", "lib_dir"]
