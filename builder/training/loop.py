"""What the training loops share: schedule and budget, resumable state, progress and the JSON-lines log."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from builder.training.config import OptimSection
from runtime.errors import SpectreeError


class ResumeError(SpectreeError, ValueError):
    """A saved training state does not belong to this configuration."""


def progress_fraction(opt: OptimSection, step: int, elapsed_s: float) -> float:
    """How far through its budget a run is: the larger of the step and wall-clock fractions (0 .. 1)."""
    frac = step / opt.max_steps
    if opt.max_minutes is not None:
        frac = max(frac, elapsed_s / (60.0 * opt.max_minutes))
    return min(frac, 1.0)


def learning_rate(opt: OptimSection, step: int, elapsed_s: float) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr to min_lr_ratio * lr along the budget."""
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    frac = progress_fraction(opt, step, elapsed_s)
    floor = opt.lr * opt.min_lr_ratio
    return floor + (opt.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on norms, biases)."""
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def save_state(path: Path, state: dict[str, Any]) -> None:
    """torch.save to a temporary sibling, then rename: an interrupted save never corrupts the last one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_state(path: Path, fingerprint: str) -> dict[str, Any] | None:
    """The saved state at `path` (None when there is none); it must have been saved under `fingerprint`."""
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own file: optimizer state, RNG
    if state.get("fingerprint") != fingerprint:
        raise ResumeError(
            f"{path} was saved by a different configuration (fingerprint {state.get('fingerprint')!r}, this one "
            f"{fingerprint!r}); pass --fresh to start over or restore the configuration"
        )
    return state


@dataclass
class RunLog:
    """JSON-lines log (appended, so a resumed run continues it) plus a tqdm progress bar on stderr."""

    path: Path
    total: int
    desc: str
    initial: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        from tqdm import tqdm

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        tty = sys.stderr.isatty()
        self.bar = tqdm(total=self.total, initial=self.initial, desc=self.desc, disable=self.quiet,
                        mininterval=0.5 if tty else 30.0, dynamic_ncols=True, file=sys.stderr)

    def event(self, kind: str, **fields: Any) -> None:
        rec = {"event": kind, "time": round(time.time(), 3), **fields}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if kind != "step":
            self.bar.write(f"[{self.desc}] {kind}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in fields.items()),
                           file=sys.stderr)

    def step(self, n: int = 1, **postfix: Any) -> None:
        self.bar.update(n)
        if postfix:
            self.bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)

    def close(self) -> None:
        self.bar.close()
        self._file.close()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


__all__ = ["ResumeError", "RunLog", "learning_rate", "load_state", "param_groups", "progress_fraction", "save_state"]
