"""Average draft heads' weights: a soup of fine-tunes of one head (Wortsman et al. 2022, "Model soups"; WiSE-FT).

A head fine-tuned on new text (`heads.eagle.init`) learns it but drifts from what it knew: on SmolLM2 the prose
fine-tune raised held-out agreement on prose and lowered it on code. Heads that share a starting point sit in one
basin of the loss, so their weighted mean keeps much of both, and often beats each on text neither was tuned for
(demo/smollm2/README.md, "The averaged head"). The mean is a head like any other: same architecture, same files,
the same lossless verification behind it.

    python -m builder average-heads --heads DIR_A DIR_B [--weights 0.5 0.5] --output DIR [--datastore FILE] [--force]

Every head must be the same kind (one with head weights: EAGLE, Medusa), with equal config.json and the same tensors
(names, shapes);
integer tensors (a reduced draft vocabulary's d2t / t2d) must be equal, floating ones are averaged in float32 and
saved in the first head's dtype. The output holds config.json, the weights under the first head's file name,
`averaging.json` (each ingredient's path, weight, sha256 and training summary) and a datastore
(`runtime.drafters.datastore`): --datastore's file, else the first head's if it has one.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from builder.config import BuildConfigError
from builder.train_heads import fresh_tmp, swap_in
from builder.train_target import SUMMARY_FILE as TRAINING_SUMMARY
from runtime.checkpoint import read_head_state
from runtime.draft_spec import drafter_kind
from runtime.drafters.datastore import DATASTORE_FILE, Datastore
from runtime.engine import sha256_file
from runtime.errors import CheckpointError
from runtime.files import read_json_object, shown_path

SUMMARY_FILE = "averaging.json"


@dataclass(frozen=True)
class AverageResult:
    output: Path
    kind: str
    weights: tuple[float, ...]  # normalised, one per head
    num_tensors: int


def head_kind(path: Path, flag: str = "--heads") -> str:
    """The kind of a head directory, told by its public format (`runtime.api.infer_draft_kind`); errors name
    `flag`."""
    from runtime.api import infer_draft_kind

    try:
        kind = infer_draft_kind(path)
    except CheckpointError as exc:
        raise BuildConfigError(f"{flag}: {shown_path(path)} is not a draft head directory ({exc})") from exc
    if not drafter_kind(kind).weighted:
        raise BuildConfigError(f"{flag}: {shown_path(path)} is not a draft head directory (a {kind} drafter has no "
                               "weights)")
    return kind


def _weights(weights: Sequence[float] | None, n: int) -> tuple[float, ...]:
    if weights is None:
        return tuple(1.0 / n for _ in range(n))
    if len(weights) != n:
        raise BuildConfigError(f"--weights: got {len(weights)} values for {n} heads; expected one per head")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise BuildConfigError(f"--weights: got {list(weights)}; expected positive finite numbers")
    total = sum(weights)
    return tuple(w / total for w in weights)


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return read_json_object(file, CheckpointError)
    except CheckpointError as exc:
        raise BuildConfigError(f"--heads: {exc}") from exc


def average_state(states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float],
                  names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The weighted mean of state dicts with the same tensors (`names` label them in errors): floating tensors
    averaged in float32 and cast back to the first's dtype, integer / bool tensors required equal."""
    first = states[0]
    for name, state in zip(names[1:], states[1:]):
        if state.keys() != first.keys():
            missing, extra = sorted(first.keys() - state.keys()), sorted(state.keys() - first.keys())
            raise BuildConfigError(f"--heads: {name} has other tensors than {names[0]} (missing {missing[:4]}, "
                                   f"unexpected {extra[:4]})")
        for key, value in state.items():
            if value.shape != first[key].shape:
                raise BuildConfigError(f"--heads: {key} is {tuple(value.shape)} in {name}, "
                                       f"{tuple(first[key].shape)} in {names[0]}")
    out = {}
    for key, ref in first.items():
        if ref.is_floating_point():
            mean = sum(w * s[key].float() for w, s in zip(weights, states))
            out[key] = mean.to(ref.dtype).contiguous()
            continue
        for name, state in zip(names[1:], states[1:]):
            if not torch.equal(state[key], ref):
                raise BuildConfigError(f"--heads: {key} differs between {names[0]} and {name}; heads are averaged "
                                       "only over the same integer tensors (e.g. the same reduced draft vocabulary)")
        out[key] = ref.clone()
    return out


def average_heads(heads: Sequence[str | Path], output: str | Path, weights: Sequence[float] | None = None,
                  datastore: str | Path | None = None, force: bool = False) -> AverageResult:
    """Write the weighted mean of `heads` (head directories) to `output` (see the module doc); weights default to
    equal and are normalised to sum 1. Everything is read and checked before anything is written."""
    paths = [Path(h) for h in heads]
    if len(paths) < 2:
        raise BuildConfigError(f"--heads: got {len(paths)} head directory; expected two or more to average")
    for p in paths:
        if not p.is_dir():
            raise BuildConfigError(f"--heads: {shown_path(p)} is not a directory")
    out = Path(output)
    if out.exists() and not force:
        what = "is one of --heads" if out.resolve() in {p.resolve() for p in paths} else "exists"
        raise BuildConfigError(f"--output: {shown_path(out)} {what} (pass --force to replace it)")
    w = _weights(weights, len(paths))
    kinds = [head_kind(p) for p in paths]
    if len(set(kinds)) != 1:
        raise BuildConfigError(f"--heads: mixes kinds {kinds}; expected heads of one kind")
    kind = kinds[0]
    configs = [_read_json(p / "config.json") for p in paths]
    for p, cfg in zip(paths[1:], configs[1:]):
        differ = sorted(k for k in configs[0].keys() | cfg.keys() if configs[0].get(k) != cfg.get(k))
        if differ:
            raise BuildConfigError(f"--heads: config.json of {shown_path(p)} differs from {shown_path(paths[0])} in "
                                   f"{differ}; expected heads of one architecture")
    files, states = [], []
    for p in paths:
        try:
            file, state = read_head_state(p, drafter_kind(kind).weight_files, drafter_kind(kind).title)
        except CheckpointError as exc:
            raise BuildConfigError(f"--heads: {exc}") from exc
        files.append(file)
        states.append(state)
    mean = average_state(states, w, [shown_path(p) for p in paths])
    if datastore is None and (paths[0] / DATASTORE_FILE).is_file():
        datastore = paths[0] / DATASTORE_FILE
    store = None
    if datastore is not None:
        try:
            store = Datastore.load(datastore, int(configs[0]["vocab_size"]))
        except (CheckpointError, KeyError) as exc:
            raise BuildConfigError(f"--datastore: {exc}") from exc
    ingredients = []
    for p, file, weight in zip(paths, files, w):
        entry: dict[str, Any] = {"path": shown_path(p), "weight": weight, "file": file.name,
                                 "sha256": sha256_file(file)}
        if (p / TRAINING_SUMMARY).is_file():
            entry["training_summary"] = _read_json(p / TRAINING_SUMMARY)
        elif (p / SUMMARY_FILE).is_file():  # an averaged head's own ingredients
            entry["averaging"] = _read_json(p / SUMMARY_FILE)
        ingredients.append(entry)

    tmp = fresh_tmp(out)
    (tmp / "config.json").write_text(json.dumps(configs[0], indent=2) + "\n", encoding="utf-8")
    weights_file = tmp / files[0].name
    if weights_file.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(mean, str(weights_file))
    else:
        torch.save(mean, weights_file)
    if store is not None:
        shutil.copyfile(datastore, tmp / DATASTORE_FILE)
    summary = {"kind": kind, "method": "weighted mean of the ingredients' weights (model soup)",
               "weights_file": files[0].name, "sha256": sha256_file(weights_file), "ingredients": ingredients}
    if datastore is not None:
        summary["datastore"] = {"from": shown_path(Path(datastore)), "tokens": store.size}
    (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    swap_in(tmp, out)
    return AverageResult(out, kind, w, len(mean))


__all__ = ["AverageResult", "SUMMARY_FILE", "average_heads", "average_state", "head_kind"]
