"""The op's CPU implementation: torch's fused scaled-dot-product attention under the unpacked tree mask.

Same contract as `reference.py` (shapes in `__init__.py`), but computed in the inputs' dtype by SDPA's fused
CPU kernel (fp32 accumulation inside for bf16/fp16) with no fp32 copies of the cache, no GQA repeat and no
softmax materialised by hand: this is what the runtime's decode loop runs on a CPU. The reference stays the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.tree_attention.mask import unpack_mask


def tree_attention_sdpa(
    q: torch.Tensor,  # [B, Hq, N, D]
    k: torch.Tensor,  # [B, Hkv, L + N, D]
    v: torch.Tensor,  # [B, Hkv, L + N, D]
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32 packed
    scale: float,
) -> torch.Tensor:  # [B, Hq, N, D]
    b, hq, n, _ = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if n == 1 and bool(torch.all(tree_mask[:, 0, 0] & 1)):
        # One token that sees itself sees everything (plain decoding): no mask, SDPA's fastest path.
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=hq != hkv)
    tree = unpack_mask(tree_mask, n)  # [B, N, N]
    visible = torch.cat([tree.new_ones(b, n, s - n), tree], dim=-1)  # [B, N, L + N]: prefix always visible
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=hq != hkv
    )  # attn_mask [B, 1, N, L + N] broadcasts over heads
