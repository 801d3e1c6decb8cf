"""Pure arithmetic over measurements (no torch, no I/O), shared by the bench and serve reports.

Accepted length: a speculative step accepts k draft tokens (0 <= k <= tree depth) and emits k + 1 tokens.
    reach(d)       = P(k >= d)                  fraction of steps whose accepted path reaches depth d
    conditional(d) = P(k >= d | k >= d - 1)     Medusa's per-head "acceptance rate" at depth d
    tau            = mean(k) + 1                 tokens per verification step
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence


def accepted_histogram(accepted: Sequence[int]) -> list[int]:
    """counts[k] = steps that accepted exactly k draft tokens (k = 0 .. max)."""
    if not accepted:
        return []
    if any(k < 0 for k in accepted):
        raise ValueError(f"accepted lengths must be >= 0, got {min(accepted)}")
    counts = [0] * (max(accepted) + 1)
    for k in accepted:
        counts[k] += 1
    return counts


def reach_by_depth(accepted: Sequence[int], max_depth: int | None = None) -> list[float]:
    """[P(k >= 1), P(k >= 2), ..., P(k >= D)]; D = max_depth or the longest accepted length seen."""
    if not accepted:
        return []
    depth = max(accepted) if max_depth is None else max_depth
    n = len(accepted)
    return [sum(1 for k in accepted if k >= d) / n for d in range(1, depth + 1)]


def conditional_by_depth(accepted: Sequence[int], max_depth: int | None = None) -> list[float | None]:
    """[P(k >= d | k >= d - 1)] for d = 1..D; None where no step reached depth d - 1."""
    if not accepted:
        return []
    depth = max(accepted) if max_depth is None else max_depth
    out: list[float | None] = []
    for d in range(1, depth + 1):
        reached = sum(1 for k in accepted if k >= d - 1)
        out.append(sum(1 for k in accepted if k >= d) / reached if reached else None)
    return out


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of no values")
    return sum(values) / len(values)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def bootstrap_interval(
    n: int, statistic: Callable[[Sequence[int]], float], resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of a statistic over n items: `statistic(indices)` is computed on `resamples`
    draws of n indices in [0, n) with replacement (seeded, so a report is reproducible), and the interval is the
    (1 - level) / 2 and (1 + level) / 2 percentiles of those values. Indices rather than items, so a paired
    statistic (two measurements of the same prompt) resamples both together."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"bootstrap needs at least one item, got n={n!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"bootstrap resamples must be a positive int, got {resamples!r}")
    if not 0 < level < 1:
        raise ValueError(f"bootstrap level must be in (0, 1), got {level!r}")
    rng = random.Random(seed)
    values = [statistic([rng.randrange(n) for _ in range(n)]) for _ in range(resamples)]
    tail = 100 * (1 - level) / 2
    return percentile(values, tail), percentile(values, 100 - tail)


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first position where two token sequences differ (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


__all__ = [
    "accepted_histogram",
    "bootstrap_interval",
    "conditional_by_depth",
    "first_difference",
    "mean",
    "median",
    "percentile",
    "ratio",
    "reach_by_depth",
]
