"""Store a draft head's weights another way: `python -m builder convert-head`.

    python -m builder convert-head --head DIR --storage int8|float32|bfloat16|float16 --output DIR [--force]

`int8` stores every 2-D floating-point weight as int8 with one scale per output row, by `runtime.model.Int8Weight`'s
rule (symmetric; the scales in the weight's dtype, nudged so that no weight rounds past 127 steps), under the
layout `runtime.checkpoint.dequantized` reads back (the scales beside the weight, `NAME.int8_scale`): half the bytes
of bfloat16. Every loader of a head reads through it (`read_head_state`) and casts to the target's dtype, so the
head runs as before with weights within half a step of the stored ones; drafts are proposals, so verification, and
what is emitted, do not change. A float dtype stores the floating-point weights in it (an int8 head back as
floats). Other tensors (biases, a reduced draft vocabulary's d2t / t2d) are kept as they are, and every
other file of the head directory (config.json, training summaries, a datastore) is copied unchanged. The same
input gives the same bytes (no timestamps; CPU rounding is deterministic).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from builder.average_heads import head_kind
from builder.config import BuildConfigError
from builder.train_heads import fresh_tmp, swap_in
from runtime.checkpoint import INT8_SCALE_SUFFIX, read_head_state
from runtime.config import DTYPES
from runtime.draft_spec import drafter_kind
from runtime.errors import CheckpointError
from runtime.files import shown_path
from runtime.model import Int8Weight

INT8 = "int8"
STORAGES = (INT8, *DTYPES)


@dataclass(frozen=True)
class ConvertResult:
    output: Path
    kind: str
    storage: str
    weights_file: Path
    converted: int  # tensors stored another way


def stored(state: dict[str, torch.Tensor], storage: str) -> tuple[dict[str, torch.Tensor], int]:
    """`state` (floating-point weights) as `storage` keeps it, and how many tensors changed form."""
    if storage not in STORAGES:
        raise BuildConfigError(f"--storage: got {storage!r}, expected one of {', '.join(STORAGES)}")
    out: dict[str, torch.Tensor] = {}
    converted = 0
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            out[name] = tensor
        elif storage != INT8:
            out[name] = tensor.to(DTYPES[storage]).contiguous()
            converted += int(out[name].dtype != tensor.dtype)
        elif tensor.ndim == 2:
            q = Int8Weight.of(tensor)  # scales in the weight's dtype
            out[name], out[name + INT8_SCALE_SUFFIX] = q.q, q.scales.contiguous()
            converted += 1
        else:
            out[name] = tensor
    return out, converted


def convert_head(head: str | Path, output: str | Path, storage: str, force: bool = False) -> ConvertResult:
    """Write the head directory `head` to `output` with its weights stored as `storage` (the module doc); `output`
    may be `head` itself with `force`. Everything is read and checked before anything is written."""
    src, out = Path(head), Path(output)
    if not src.is_dir():
        raise BuildConfigError(f"--head: {shown_path(src)} is not a directory")
    if out.exists() and not force:
        raise BuildConfigError(f"--output: {shown_path(out)} exists (pass --force to replace it)")
    kind = drafter_kind(head_kind(src, "--head"))
    try:
        file, state = read_head_state(src, kind.weight_files, kind.title)
    except CheckpointError as exc:
        raise BuildConfigError(f"--head: {exc}") from exc
    converted_state, converted = stored(state, storage)
    tmp = fresh_tmp(out)
    for other in sorted(src.iterdir()):
        if other != file and other.is_file():
            shutil.copyfile(other, tmp / other.name)
    weights_file = tmp / file.name
    if weights_file.suffix == ".safetensors":
        from safetensors.torch import save_file

        # one metadata key: safetensors writes its metadata map in no fixed order, and the bytes must be reproducible
        save_file(converted_state, str(weights_file), metadata={"format": "pt"})
    else:
        torch.save(converted_state, weights_file)
    swap_in(tmp, out)
    return ConvertResult(out, kind.name, storage, out / file.name, converted)


__all__ = ["STORAGES", "ConvertResult", "convert_head", "stored"]
