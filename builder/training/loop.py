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


# A resumable state (module and optimizer state dicts, RNG state, counters) is one safetensors file: its tensors
# by position ("t0", "t1", ...) and, in the header's metadata, the structure around them as JSON in which every
# tensor is {"tensor": "tN"}, every tuple {"tuple": [...]} and every dict {"dict": [[key, value], ...]} (optimizer
# state is keyed by ints). Nothing in it is code: a file that is not one of these (a pickle, say) is refused, never
# unpickled.
STATE_FORMAT = "spectree-training-state"
STATE_SUFFIX = ".safetensors"
LEGACY_STATE_SUFFIX = ".pt"  # pickled states written by earlier versions: refused, never loaded


def _flatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().cpu().contiguous().clone()
        return {"tensor": key}
    if isinstance(value, dict):
        return {"dict": [[k, _flatten(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"tuple": [_flatten(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_flatten(v, tensors) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"training state: cannot store a {type(value).__name__}")


def _unflatten(value: Any, tensors: dict[str, torch.Tensor], where: Path) -> Any:
    if isinstance(value, list):
        return [_unflatten(v, tensors, where) for v in value]
    if isinstance(value, dict):
        if set(value) == {"tensor"} and value["tensor"] in tensors:
            return tensors[value["tensor"]]
        if set(value) == {"tuple"} and isinstance(value["tuple"], list):
            return tuple(_unflatten(v, tensors, where) for v in value["tuple"])
        if set(value) == {"dict"} and isinstance(value["dict"], list):
            return {k: _unflatten(v, tensors, where) for k, v in value["dict"]}
        raise ResumeError(f"{where}: malformed training state (unexpected object {sorted(value)})")
    return value


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Write to a temporary sibling, then rename: an interrupted save never corrupts the last one."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(state, tensors)
    save_file(tensors, str(tmp), metadata={"format": STATE_FORMAT, "state": json.dumps(structure)})
    tmp.replace(path)


def load_state(path: Path, fingerprint: str) -> dict[str, Any] | None:
    """The saved state at `path` (None when there is none); it must have been saved under `fingerprint`.

    Only the safetensors + JSON format above is read; anything else raises ResumeError without being parsed any
    further, and an old pickled state beside it (same name, .pt) raises ResumeError without being opened at all.
    """
    from safetensors import SafetensorError, safe_open

    legacy = path.with_suffix(LEGACY_STATE_SUFFIX)
    if legacy != path and legacy.exists():
        raise ResumeError(
            f"{legacy} is a pickled training state from an earlier version; it is not loaded (unpickling can run "
            f"code). Delete it, or pass --fresh to start over"
        )
    if not path.is_file():
        return None
    refuse = (f"{path} is not a spectree training state (a safetensors file whose metadata holds format "
              f"{STATE_FORMAT!r}); refusing to load it. Delete it, or pass --fresh to start over")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != STATE_FORMAT or "state" not in metadata:
                raise ResumeError(refuse)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        structure = json.loads(metadata["state"])
    except (SafetensorError, OSError, json.JSONDecodeError) as exc:
        raise ResumeError(f"{refuse} ({exc})") from exc
    state = _unflatten(structure, tensors, path)
    if not isinstance(state, dict):
        raise ResumeError(refuse)
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
    step_loss: Callable[[torch.Tensor, int], tuple[torch.Tensor, dict[str, float]]],
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

    step_loss(windows  # [batch_size, window_len] int64 from train_tokens, step) -> (loss, extra step-log fields);
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
            loss, info = step_loss(random_windows(train_tokens, opt.batch_size, window_len, gen), step)
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
    "LEGACY_STATE_SUFFIX", "LOG_EVERY", "STATE_FORMAT", "STATE_SUFFIX", "ResumeError", "RunLog", "learning_rate", "load_state", "optimise", "param_groups",
    "progress_fraction", "rounded", "save_state",
]
