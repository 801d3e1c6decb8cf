"""What the training loops share: schedule and budget, resumable state, progress and the JSON-lines log."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from builder.training.config import OptimSection
from builder.training.corpus import random_windows
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


LOG_EVERY = 10  # steps between "step" records in the log


def rounded(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics (floats or lists of floats) rounded for the log."""
    return {k: [round(x, 4) for x in v] if isinstance(v, (list, tuple)) else round(v, 4) if isinstance(v, float)
            else v for k, v in metrics.items()}


def optimise(
    module: torch.nn.Module,
    step_loss: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
    evaluate: Callable[[int], dict[str, Any]],
    opt: OptimSection,
    train_tokens: Any,
    window_len: int,
    state_file: Path,
    fingerprint: str,
    log_file: Path,
    desc: str,
    quiet: bool = False,
    start_fields: dict[str, Any] | None = None,
) -> tuple[int, float, float, dict[str, Any]]:
    """The one optimisation loop: AdamW, schedule and budget, periodic eval, resumable state.

    step_loss(windows  # [batch_size, window_len] int64 from train_tokens) -> (loss, extra step-log fields);
    evaluate(step) -> metrics logged with each eval and returned at the end (module in eval mode meanwhile).
    Returns (steps, elapsed seconds, last loss, final metrics). The JSON-lines log goes to log_file (progress bar
    labelled desc); start_fields are added to its start/resume record.
    """
    module.train()
    optimizer = torch.optim.AdamW(param_groups(module, opt.weight_decay), lr=opt.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(opt.seed)
    step, elapsed, loss_value = 0, 0.0, float("nan")
    state = load_state(state_file, fingerprint)
    if state is not None:
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step, elapsed, loss_value = state["step"], state["elapsed_s"], state["loss"]

    def checkpoint() -> None:
        save_state(state_file, {"fingerprint": fingerprint, "module": module.state_dict(),
                                "optimizer": optimizer.state_dict(), "generator": gen.get_state(), "step": step,
                                "elapsed_s": elapsed, "loss": loss_value})

    def evaluated() -> dict[str, Any]:
        module.eval()
        with torch.no_grad():
            m = evaluate(step)
        module.train()
        return m

    log = RunLog(log_file, total=opt.max_steps, desc=desc, initial=step, quiet=quiet)
    log.event("start" if state is None else "resume", step=step,
              parameters=sum(p.numel() for p in module.parameters()), threads=torch.get_num_threads(),
              **(start_fields or {}))
    try:
        while progress_fraction(opt, step, elapsed) < 1.0:
            t0 = time.perf_counter()
            lr = learning_rate(opt, step, elapsed)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, info = step_loss(random_windows(train_tokens, opt.batch_size, window_len, gen))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(module.parameters(), opt.grad_clip or float("inf")))
            optimizer.step()
            step += 1
            loss_value = loss.item()
            elapsed += time.perf_counter() - t0
            log.step(loss=loss_value, lr=lr)
            if step == 1 or step % LOG_EVERY == 0:
                log.event("step", step=step, loss=round(loss_value, 4), lr=lr, grad_norm=round(grad_norm, 4),
                          elapsed_s=round(elapsed, 1), **{k: round(v, 4) for k, v in info.items()})
            if step % opt.eval_every == 0:
                log.event("eval", step=step, elapsed_s=round(elapsed, 1), **rounded(evaluated()))
            if step % opt.checkpoint_every == 0:
                checkpoint()
        checkpoint()
        final = evaluated()
        log.event("done", step=step, elapsed_s=round(elapsed, 1), loss=round(loss_value, 4), **rounded(final))
    finally:
        log.close()
    return step, elapsed, loss_value, final



__all__ = [
    "LOG_EVERY", "ResumeError", "RunLog", "learning_rate", "load_state", "optimise", "param_groups",
    "progress_fraction", "rounded", "save_state",
]
