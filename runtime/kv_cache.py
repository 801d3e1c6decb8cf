"""Preallocated KV cache with tree compaction.

Slots [0, length) hold the committed sequence. A forward pass writes its N new tokens (a causal chunk or a
draft tree) at slots [length, length + N) without advancing `length`; the caller then keeps some of them
with `commit`. For a tree, the kept nodes are one root-to-node path: each node was written with RoPE at
position length + depth, and the path's i-th node has depth i, so moving it to slot length + i puts it
exactly where a plain causal pass would have put it. No RoPE recompute is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.errors import CacheError


class KVCache:
    """k, v  # [num_layers, B, Hkv, max_len, D]; `k[layer]` is that layer's # [B, Hkv, max_len, D]."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_len", max_len),
            ("batch", batch),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CacheError(f"KVCache {name} must be a positive int, got {value!r}")
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._length = 0
        self._written = 0  # end of the slots written since `length` last changed

    @property
    def length(self) -> int:
        """Number of committed positions (slots [0, length) are valid)."""
        return self._length

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

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
        self.check_room(n)
        end = self._length + n
        self.k[layer, :, :, self._length : end] = k_new
        self.v[layer, :, :, self._length : end] = v_new
        self._written = max(self._written, end)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def commit(self, num_new: int, keep: torch.Tensor | Sequence[int]) -> None:
        """Keep `keep` of the last `num_new` written slots: move them to [length, length + a), advance by a.

        keep  # [a] int64, strictly increasing indices in [0, num_new) (for a tree: the accepted path).
        """
        written = self._written - self._length
        if isinstance(num_new, bool) or not isinstance(num_new, int) or not 0 <= num_new <= written:
            raise CacheError(f"commit num_new={num_new!r}, but {written} slots were written after the committed ones")
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
        """Keep all of the last num_new written slots (a causal chunk): commit(num_new, arange(num_new))."""
        self.commit(num_new, torch.arange(num_new))

    def truncate(self, n: int) -> None:
        """Drop committed positions [n, length)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self._length:
            raise CacheError(f"truncate({n!r}) out of range: cache length is {self._length}")
        self._length = n
        self._written = n

    def reset(self) -> None:
        self.truncate(0)


__all__ = ["KVCache"]
