"""Exact tree attention in torch: the reference every other host of the op is checked against."""

from __future__ import annotations

import torch

from plugins.tree_attention.mask import unpack_mask
from plugins.tree_attention.spec import check_inputs


def tree_attention_reference(
    q: torch.Tensor,  # [B, Hq, N, D]
    k: torch.Tensor,  # [B, Hkv, L + N, D]
    v: torch.Tensor,  # [B, Hkv, L + N, D]
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32 packed, or [B, N, N] bool
    scale: float,
) -> torch.Tensor:  # [B, Hq, N, D], dtype of q
    """Softmax(q k^T * scale + bias) v, with the prefix fully visible and the tree block masked.

    Computed in fp32 (fp64 when q is fp64), whatever the input dtype. Every row sees at least itself in a
    valid tree, so no row is fully masked; a row that is (invalid input: L = 0 and an empty mask row) yields
    zeros rather than NaN.
    """
    dims = check_inputs(q, k, v, tree_mask, allow_bool=True)
    b, n = dims.batch, dims.num_tree
    tree = tree_mask if tree_mask.dtype == torch.bool else unpack_mask(tree_mask, n)  # [B, N, N]

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kf = k.to(acc).repeat_interleave(dims.group, dim=1)  # [B, Hq, L + N, D]
    vf = v.to(acc).repeat_interleave(dims.group, dim=1)  # [B, Hq, L + N, D]
    scores = torch.matmul(q.to(acc), kf.transpose(-1, -2)) * scale  # [B, Hq, N, L + N]
    prefix = torch.ones(b, n, dims.prefix_len, dtype=torch.bool, device=q.device)
    visible = torch.cat([prefix, tree], dim=-1)  # [B, N, L + N]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing visible -> 0
    return torch.matmul(probs, vf).to(q.dtype)
