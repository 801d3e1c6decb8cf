"""What verifying n draft nodes costs on this machine, relative to one: the curve `PruneOptions.by_cost` cuts each
step's tree with (`runtime.tree.cost_budget`).

Measured once per target model in a process, when the first decoder that asks for it is built or a drafter that
asks for it first drafts: target forwards of n chained tokens over a short prefilled context at a few node counts
(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), passes interleaved, the median of each, then linear between them and
made non-decreasing (a forward of more rows never counts as cheaper). SmolLM2 on 2 CPU cores takes ~3 s;
`perf verify-cost` is the full measurement with its report.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Sequence

import torch

from runtime.draft_spec import PruneOptions

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CONTEXT = 128  # tokens prefilled before the timed forwards
PASSES = 3

CAP = 64  # the most nodes measured; the curve goes on linearly past it

_measured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its curve up to CAP nodes


def verify_cost_for(pruning: PruneOptions | None, model: object, max_nodes: int) -> tuple[float, ...] | None:
    """The curve trees of at most `max_nodes` nodes are cut with (`costs`) where `pruning` (a DraftSpec's, a drafter's)
    asks for it (`PruneOptions.by_cost`) and a tree has more than one node; None otherwise. The one rule for the
    decoder's cut (`SpecDecoder.for_spec`) and a drafter's stop (`EagleDrafter.verify_cost`)."""
    if pruning is None or not pruning.by_cost or max_nodes < 2:
        return None
    return costs(model, max_nodes)


def costs(model: object, max_nodes: int) -> tuple[float, ...]:
    """cost[n - 1] for n = 1 .. max_nodes on `model`, from one measurement per model in this process (up to CAP
    nodes, or what its context leaves; past that, the last two points' slope goes on)."""
    if model not in _measured:
        _measured[model] = measure(model, max(2, min(CAP, model.config.max_context - CONTEXT)))
    curve_ = _measured[model]
    if max_nodes <= len(curve_):
        return curve_[:max_nodes]
    slope = curve_[-1] - curve_[-2]
    return curve_ + tuple(curve_[-1] + slope * k for k in range(1, max_nodes - len(curve_) + 1))


def measure(model, max_nodes: int, sizes: Sequence[int] = SIZES, passes: int = PASSES,
            context: int = CONTEXT) -> tuple[float, ...]:
    """cost[n - 1] for n = 1 .. max_nodes: the median time of a target forward over n new chained tokens after
    `context` prefilled ones, over the time of one, at `sizes` (those up to max_nodes, and max_nodes itself), linear
    between them, non-decreasing."""
    from runtime.model import causal_mask

    points = sorted({n for n in sizes if n <= max_nodes} | {1, max_nodes})
    vocab, device = model.config.vocab_size, model.device
    cache = model.new_cache(context + max_nodes)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=generator).to(device)
    with torch.no_grad():
        model.forward(prompt, torch.arange(context, device=device)[None], cache, causal_mask(context, 1, device))
        cache.advance(context)
        inputs = {n: (torch.randint(0, vocab, (1, n), generator=generator).to(device),
                      torch.arange(context, context + n, device=device)[None], causal_mask(n, 1, device))
                  for n in points}
        times: dict[int, list[float]] = {n: [] for n in points}
        for _ in range(passes + 1):  # the first pass warms up
            for n in points:
                tokens, positions, mask = inputs[n]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                model.forward(tokens, positions, cache, mask)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[n].append(time.perf_counter() - start)
    median = {n: statistics.median(t[1:]) for n, t in times.items()}
    return curve(median, max_nodes)


def curve(median: dict[int, float], max_nodes: int) -> tuple[float, ...]:
    """Measured times at some node counts (1 among them) as cost[n - 1] for every n = 1 .. max_nodes: relative to
    n = 1, linear between the measured counts, flat past the last, and never decreasing."""
    points = sorted(median)
    one = median[1]
    out, floor = [], 1.0
    for n in range(1, max_nodes + 1):
        above = next((p for p in points if p >= n), points[-1])
        below = max((p for p in points if p <= n), default=points[0])
        if above == below:
            t = median[below]
        else:
            t = median[below] + (median[above] - median[below]) * (n - below) / (above - below)
        floor = max(floor, t / one)
        out.append(floor)
    return tuple(out)


__all__ = ["CAP", "CONTEXT", "PASSES", "SIZES", "costs", "curve", "measure", "verify_cost_for"]
