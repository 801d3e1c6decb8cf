"""Sampling parameters and the target distribution p that verification is lossless against.

p = softmax of the logits after temperature, then top-k, then top-p, with the semantics of transformers'
`TemperatureLogitsWarper` / `TopKLogitsWarper` / `TopPLogitsWarper` (and vLLM's sampler):
  top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are all kept);
  top-p keeps the smallest highest-probability set whose mass is >= top_p (at least one token).
temperature == 0 means greedy: p is one-hot at the argmax (first index on ties, like torch.argmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.errors import RequestError

_UINT64_MAX = 2**64 - 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; validated on construction, never mutated afterwards."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = nondeterministic
    max_tokens: int = 64
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise RequestError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _UINT64_MAX):
            raise RequestError(f"seed must be None or an int in [0, 2**64 - 1], got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        # Normalise list/str inputs into tuples while the object is being built (it is frozen afterwards).
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise RequestError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def new_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh generator seeded with `seed` (or from OS entropy when seed is None)."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits  # [..., V]  ->  probs  # [..., V] float32: the distribution sampling draws from."""
    x = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(torch.float32)
    x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        # Ascending sort: drop the low tail whose cumulative mass is <= 1 - top_p; the top token always stays.
        sorted_x, order = x.sort(dim=-1, stable=True)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    return x.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs  # [V] (non-negative, need not be normalised).

    The draw happens on the generator's device (probs move there if needed), so a seeded CPU generator gives the
    same tokens whether the logits live on CPU or GPU.
    """
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


__all__ = ["SamplingParams", "target_probs", "sample"]
