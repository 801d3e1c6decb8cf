"""A reduced draft vocabulary: the head scores only K of the target's V tokens (EAGLE-3 / FR-Spec).

A head's output layer over a 50K-150K vocabulary costs a large share of a small target's step; restricted to the
K most frequent tokens it costs K / V of that. Drafting picks among those K tokens and maps them back to target ids;
the verifier still checks every drafted token against the target's FULL distribution, so what is accepted (and
the residual/bonus token, drawn from the target) is unchanged in law: a smaller draft vocabulary can only lower
acceptance, never change the output distribution.

Stored as EAGLE-3 stores it, in the head's weight file:
    d2t  # [K] int64   offsets: target_id = draft_id + d2t[draft_id]  (draft ids 0..K-1 in increasing target order)
    t2d  # [V] bool    (optional) t2d[target_id] is True for the K draft tokens
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.errors import CheckpointError


class DraftVocab:
    """target_ids # [K] int64, strictly increasing, in [0, V)."""

    def __init__(self, target_ids: torch.Tensor, target_vocab: int, source: str = "draft vocabulary") -> None:
        ids = torch.as_tensor(target_ids).to("cpu", torch.int64)
        if ids.ndim != 1 or ids.shape[0] == 0:
            raise CheckpointError(f"{source}: a draft vocabulary needs a non-empty 1-D id list, got {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= target_vocab:
            raise CheckpointError(f"{source}: draft vocabulary ids must lie in [0, {target_vocab}) (the target's "
                                  f"vocabulary), got range [{int(ids.min())}, {int(ids.max())}]")
        if ids.shape[0] > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise CheckpointError(f"{source}: draft vocabulary ids must be strictly increasing (no duplicates)")
        self.target_ids = ids
        self.target_vocab = target_vocab

    @property
    def size(self) -> int:
        return int(self.target_ids.shape[0])

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], target_vocab: int, file: Path | str) -> DraftVocab | None:
        """The vocabulary stored in a head's state dict (popping `d2t` / `t2d`), or None when it has none."""
        d2t = state.pop("d2t", None)
        t2d = state.pop("t2d", None)
        if d2t is None:
            if t2d is not None:
                raise CheckpointError(f"{file}: has t2d but no d2t (a reduced draft vocabulary needs d2t)")
            return None
        if d2t.ndim != 1 or d2t.is_floating_point():
            raise CheckpointError(f"{file}: d2t must be a 1-D integer tensor, got {d2t.dtype} {tuple(d2t.shape)}")
        vocab = cls(torch.arange(d2t.shape[0]) + d2t.to(torch.int64), target_vocab, f"{file}: d2t")
        if t2d is not None:
            if tuple(t2d.shape) != (target_vocab,):
                raise CheckpointError(f"{file}: t2d has shape {tuple(t2d.shape)}, expected ({target_vocab},)")
            if not torch.equal(t2d.to(torch.bool), vocab.t2d()):
                raise CheckpointError(f"{file}: t2d does not mark exactly the tokens d2t maps to")
        return vocab

    def d2t(self) -> torch.Tensor:  # [K] int64
        return self.target_ids - torch.arange(self.size)

    def t2d(self) -> torch.Tensor:  # [V] bool
        mask = torch.zeros(self.target_vocab, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    def draft_index(self) -> torch.Tensor:  # [V] int64
        """Target id -> draft id, -1 for tokens outside the draft vocabulary."""
        index = torch.full((self.target_vocab,), -1, dtype=torch.int64)
        index[self.target_ids] = torch.arange(self.size)
        return index

    def state(self) -> dict[str, torch.Tensor]:
        """What a head's weight file stores (EAGLE-3's keys)."""
        return {"d2t": self.d2t(), "t2d": self.t2d()}

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """draft_ids # [...] int64 in [0, K) -> target ids # [...] (same device)."""
        return self.target_ids.to(draft_ids.device)[draft_ids]


def top_frequent(counts: torch.Tensor, k: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The k most frequent token ids (counts # [V]), `always` included, as increasing target ids # [k]."""
    counts = counts.to(torch.float64).clone()
    if always:
        counts[torch.tensor(always)] = float("inf")
    return torch.sort(torch.topk(counts, k).indices).values


__all__ = ["DraftVocab", "top_frequent"]
