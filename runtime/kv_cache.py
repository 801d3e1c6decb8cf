"""KV cache with tree compaction, allocated as it fills.

Slots [0, length) hold the committed sequence. A forward pass writes its N new tokens (a causal chunk or a
draft tree) at slots [length, length + N) without advancing `length`; the caller then keeps some of them
with `commit`. For a tree, the kept nodes are one root-to-node path: each node was written with RoPE at
position length + depth, and the path's i-th node has depth i, so moving it to slot length + i puts it
exactly where a plain causal pass would have put it. No RoPE recompute is needed.

Memory: `max_len` is the most positions the cache may ever hold; `capacity` is how many slots are allocated now.
A cache made with a smaller `capacity` grows (geometrically, so a sequence of n tokens is copied O(n) times in
total) whenever a write or `reserve` needs more slots, never beyond max_len. Slots are not zero-filled: only slots
[0, length + N) that were written are ever read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.errors import CacheError


class KVCache:
    """k, v  # [num_layers, B, Hkv, capacity, D]; `k[layer]` is that layer's # [B, Hkv, capacity, D]."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        capacity: int | None = None,
    ) -> None:
        """capacity: slots allocated now (None: max_len, all of them up front); more are allocated on demand."""
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_len", max_len),
            ("batch", batch),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CacheError(f"KVCache {name} must be a positive int, got {value!r}")
        capacity = max_len if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 < capacity <= max_len:
            raise CacheError(f"KVCache capacity must be an int in [1, max_len={max_len}], got {capacity!r}")
        self._max_len = max_len
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self._length = 0
        self._written = 0  # end of the slots written since `length` last changed

    @property
    def length(self) -> int:
        """Number of committed positions (slots [0, length) are valid)."""
        return self._length

    @property
    def max_len(self) -> int:
        """The most positions this cache may hold (committed + written)."""
        return self._max_len

    @property
    def capacity(self) -> int:
        """Slots allocated now (<= max_len)."""
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V allocated now."""
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def bytes_for(
        num_layers: int, num_kv_heads: int, head_dim: int, slots: int, dtype: torch.dtype, batch: int = 1
    ) -> int:
        """Bytes of K and V for `slots` positions of a cache with this layout."""
        return 2 * num_layers * batch * num_kv_heads * slots * head_dim * dtype.itemsize

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[4]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def remaining(self) -> int:
        return self.max_len - self._length

    def check_room(self, num_new: int) -> None:
        """CacheError unless num_new more tokens fit after the committed ones."""
        if self._length + num_new > self.max_len:
            raise CacheError(
                f"KV cache overflow: {self._length} committed + {num_new} new tokens exceeds max_len {self.max_len}"
            )

    def reserve(self, total: int) -> None:
        """Make slots [0, total) allocated (total <= max_len): grow to max(total, 2 x capacity), capped at max_len,
        keeping every written slot. A no-op when they already are."""
        if total <= self.capacity:
            return
        if total > self._max_len:
            raise CacheError(f"KV cache reserve({total}) exceeds max_len {self._max_len}")
        new = min(self._max_len, max(total, 2 * self.capacity))
        shape = (*self.k.shape[:3], new, self.k.shape[4])
        keep = self._written
        k = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
        v = torch.empty(shape, dtype=self.v.dtype, device=self.v.device)
        k[:, :, :, :keep] = self.k[:, :, :, :keep]
        v[:, :, :, :keep] = self.v[:, :, :, :keep]
        self.k, self.v = k, v

    def write(
        self,
        layer: int,
        k_new: torch.Tensor,  # [B, Hkv, N, D]
        v_new: torch.Tensor,  # [B, Hkv, N, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store N tokens at slots [length, length + N) of `layer`; return that layer's k, v over
        [0, length + N), each # [B, Hkv, length + N, D] (views into the cache)."""
        if not 0 <= layer < self.num_layers:
            raise CacheError(f"layer {layer} out of range for a cache with {self.num_layers} layers")
        expected = (self.batch, self.num_kv_heads, k_new.shape[2], self.head_dim)
        if tuple(k_new.shape) != expected or tuple(v_new.shape) != expected:
            raise CacheError(
                f"k/v shapes {tuple(k_new.shape)} / {tuple(v_new.shape)} do not fit the cache; expected {expected}"
            )
        n = k_new.shape[2]
        self.open(n)
        end = self._length + n
        self.k[layer, :, :, self._length : end] = k_new
        self.v[layer, :, :, self._length : end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def open(self, n: int) -> None:
        """Make slots [length, length + n) allocated and count them written (what `write` does before it copies): for
        a kernel that stores the new tokens' K/V into `k` / `v` itself (plugins/draft_layer)."""
        self.check_room(n)
        end = self._length + n
        self.reserve(end)
        self._written = max(self._written, end)

    def commit(self, num_new: int, keep: torch.Tensor | Sequence[int]) -> None:
        """Keep `keep` of the last `num_new` written slots: move them to [length, length + a), advance by a.

        keep  # [a] int64, strictly increasing indices in [0, num_new) (for a tree: the accepted path).
        """
        self._check_new("commit", num_new)
        idx = torch.as_tensor(keep).to("cpu")
        if idx.ndim != 1 or idx.dtype not in (torch.int64, torch.int32):
            raise CacheError(f"commit keep must be a 1-D int64 tensor, got shape {tuple(idx.shape)} {idx.dtype}")
        values = idx.tolist()
        if any(i < 0 or i >= num_new for i in values) or any(b <= a for a, b in zip(values, values[1:])):
            raise CacheError(f"commit keep must be strictly increasing indices in [0, {num_new}), got {values}")
        a = len(values)
        start = self._length
        if values != list(range(a)):
            # Advanced indexing gathers into a new tensor first, so overlapping source/destination is safe.
            src = (idx.to(torch.int64) + start).to(self.device)
            self.k[:, :, :, start : start + a] = self.k[:, :, :, src]
            self.v[:, :, :, start : start + a] = self.v[:, :, :, src]
        self._length = start + a
        self._written = self._length

    def advance(self, num_new: int) -> None:
        """Keep all of the last num_new written slots (a causal chunk): commit(num_new, arange(num_new)), with
        nothing to move."""
        self._check_new("advance", num_new)
        self._length += num_new
        self._written = self._length

    def _check_new(self, op: str, num_new: int) -> None:
        """CacheError unless num_new is an int in [0, slots written after the committed ones]."""
        written = self._written - self._length
        if isinstance(num_new, bool) or not isinstance(num_new, int) or not 0 <= num_new <= written:
            raise CacheError(f"{op} num_new={num_new!r}, but {written} slots were written after the committed ones")

    def truncate(self, n: int) -> None:
        """Drop committed positions [n, length)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self._length:
            raise CacheError(f"truncate({n!r}) out of range: cache length is {self._length}")
        self._length = n
        self._written = n

    def reset(self) -> None:
        self.truncate(0)


__all__ = ["KVCache"]
