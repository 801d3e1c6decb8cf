"""A datastore of the target's own answers, searched by n-gram for draft continuations (REST, He et al. 2023).

Prompt lookup copies from the request's own text; a datastore copies from text the target wrote before: the answers
it gave to the self-distillation prompts its draft heads were trained on (`python -m builder datastore`). A chat
model words recurring things the same way ("Here's a simple ...", "def __init__(self", a list's framing), and a
head one layer deep guesses a few tokens ahead, so a matched continuation often runs further than the head's tree.

Layout: one int32 token array, every answer preceded by SEPARATOR (-1), so an n-gram never spans two answers and
the separator marks where an answer begins: a request's query is SEPARATOR + its answer so far, so the first tokens
of an answer match the first tokens of stored answers. For each n-gram length n in [min_ngram, max_ngram] the
positions are sorted by a 64-bit hash of the n tokens ending there (computed at load, ~0.2 s per million tokens and
length); a query binary-searches its hash, and candidates are checked token by token (a hash collision can only
cost a look, never a wrong draft: verification checks every drafted token against the target anyway).

A draft is one chain, grown greedily: among the stored occurrences of the longest matching suffix, the most frequent
next token, then among those occurrences that continue with it the most frequent next, ... while that token's share
of the occurrences still continuing is at least `min_share` (REST builds a trie of all continuations; one chain
per step is what a few spare tree nodes on a CPU afford). Ties go to the smaller token id: drafts are deterministic.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from runtime.errors import CheckpointError

SEPARATOR = -1
DATASTORE_FILE = "datastore.npz"  # in a draft head's directory (and in an engine's draft/)
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier of the rolling hash (arithmetic mod 2^64)
_MAX_OCCURRENCES = 1024  # occurrences of one n-gram read per draft (evenly spaced over all of them)


def _hash_rows(windows: np.ndarray) -> np.ndarray:  # windows [m, n] int64 -> [m] uint64
    h = np.zeros(windows.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(windows.shape[1]):
            h = h * _MULT + (windows[:, k] + 2).astype(np.uint64)  # + 2: the separator hashes like any token
    return h


def _hash_one(ngram: list[int]) -> np.uint64:
    """_hash_rows of one row, in Python integers: a draft step looks up a few n-grams, and numpy's per-call costs
    (error-state switches, small arrays) were most of that time."""
    h, mult = 0, int(_MULT)
    for tok in ngram:
        h = (h * mult + int(tok) + 2) & 0xFFFF_FFFF_FFFF_FFFF  # int(): a numpy id would wrap at 64 bits first
    return np.uint64(h)


def pack_answers(answers: list[list[int]]) -> np.ndarray:  # -> [T] int32
    """Answers (token id lists) -> the stored layout: each answer after a SEPARATOR."""
    parts: list[int] = []
    for answer in answers:
        parts.append(SEPARATOR)
        parts.extend(int(t) for t in answer)
    return np.asarray(parts, dtype=np.int32)


def save_tokens(path: str | Path, tokens: np.ndarray) -> None:
    """Write a datastore file from its token array (`pack_answers`); the indexes are built when it is loaded."""
    np.savez_compressed(path, tokens=tokens)


class Datastore:
    """tokens # [T] int32: answers, each preceded by SEPARATOR; n-gram indexes for n in [min_ngram, max_ngram]."""

    def __init__(self, tokens: np.ndarray, min_ngram: int = 2, max_ngram: int = 4, source: str = "datastore") -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or tokens.shape[0] == 0:
            raise CheckpointError(f"{source}: tokens must be a non-empty 1-D integer array, got {tokens.dtype} "
                                  f"{tokens.shape}")
        if int(tokens.min()) < SEPARATOR:
            raise CheckpointError(f"{source}: token ids must be >= 0 (or {SEPARATOR}, the separator), "
                                  f"got {int(tokens.min())}")
        if int(tokens[0]) != SEPARATOR:
            raise CheckpointError(f"{source}: must start with the separator {SEPARATOR} (each answer is preceded by it)")
        if not 1 <= min_ngram <= max_ngram:
            raise CheckpointError(f"{source}: n-gram lengths need 1 <= min_ngram <= max_ngram, got {min_ngram}, "
                                  f"{max_ngram}")
        self.tokens = tokens.astype(np.int32)
        self.source = source
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        t = self.tokens.astype(np.int64)
        self._index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n in range(min_ngram, max_ngram + 1):
            if t.shape[0] < n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(t, n)  # [T - n + 1, n]: window i ends at i + n
            hashes = _hash_rows(windows)
            order = np.argsort(hashes, kind="stable")  # equal hashes keep position order
            self._index[n] = (hashes[order], (order + n).astype(np.int32))  # sorted hashes, end positions

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_token(self) -> int:
        return int(self.tokens.max())

    # ---- files ------------------------------------------------------------------------------------------------

    @classmethod
    def from_answers(cls, answers: list[list[int]], **kwargs: int) -> Datastore:
        """Answers (token id lists) -> a datastore holding each after a separator."""
        return cls(pack_answers(answers), **kwargs)

    def save(self, path: str | Path) -> None:
        save_tokens(path, self.tokens)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int, min_ngram: int = 2, max_ngram: int = 4) -> Datastore:
        """Read a datastore file and check its ids against the target's vocabulary."""
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"datastore {path} does not exist (write one with `python -m builder datastore`)")
        try:
            with np.load(path, allow_pickle=False) as data:
                if "tokens" not in data.files:
                    raise CheckpointError(f"datastore {path}: no 'tokens' array (has {sorted(data.files)})")
                tokens = data["tokens"]
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"datastore {path}: not a readable .npz file ({exc})") from exc
        store = cls(tokens, min_ngram, max_ngram, source=f"datastore {path}")
        if store.max_token >= vocab_size:
            raise CheckpointError(f"datastore {path}: token id {store.max_token} is outside the target's vocabulary "
                                  f"[0, {vocab_size})")
        return store

    # ---- search -----------------------------------------------------------------------------------------------

    def occurrences(self, ngram: list[int]) -> np.ndarray:
        """End positions (exclusive) of the stored occurrences of `ngram` # [m] int32, ascending."""
        n = len(ngram)
        if n not in self._index:
            return np.zeros(0, dtype=np.int32)
        hashes, ends = self._index[n]
        key = _hash_one(ngram)
        lo, hi = np.searchsorted(hashes, key, side="left"), np.searchsorted(hashes, key, side="right")
        cand = ends[lo:hi]
        if cand.shape[0] == 0:
            return cand
        windows = self.tokens[cand[:, None] - n + np.arange(n)]  # [m, n]
        return cand[(windows == np.asarray(ngram, dtype=np.int32)).all(axis=1)]

    def continuation(self, context: list[int], depth: int, min_share: float) -> list[int]:
        """Up to `depth` tokens to follow `context` (SEPARATOR + the answer so far, root last; see the module doc)."""
        if depth <= 0:
            return []
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            ends = self.occurrences(context[-n:])
            if ends.shape[0]:
                break
        else:
            return []
        if ends.shape[0] > _MAX_OCCURRENCES:
            ends = ends[:: -(-ends.shape[0] // _MAX_OCCURRENCES)]
        # The tokens after each occurrence; past the array's end reads as a separator (the chain stops there).
        idx = ends[:, None].astype(np.int64) + np.arange(depth)  # [m, depth]
        follow = np.where(idx < self.size, self.tokens[np.minimum(idx, self.size - 1)], SEPARATOR).tolist()
        # Counted in Python: most matches are a handful of occurrences (a median of one), and a draft step runs right
        # after a target forward has pushed numpy's code and data out of cache, where each of np.unique's many small
        # calls cost more than counting them here (measured inside decoding; commit history of this line).
        chain: list[int] = []
        for d in range(depth):
            counts = Counter(row[d] for row in follow)
            tok, count = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))  # ties go to the smaller id
            if tok == SEPARATOR or count < min_share * len(follow):
                break
            chain.append(tok)
            follow = [row for row in follow if row[d] == tok]
        return chain


__all__ = ["Datastore", "DATASTORE_FILE", "SEPARATOR", "pack_answers", "save_tokens"]
