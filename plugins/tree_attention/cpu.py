"""The op's CPU implementation: torch's fused scaled-dot-product attention under the unpacked tree mask.

Same contract as `reference.py` (shapes in `__init__.py`), but computed in the inputs' dtype by SDPA's fused
CPU kernel (fp32 accumulation inside for bf16/fp16) with no fp32 copies of the cache, no GQA repeat and no
softmax materialised by hand: this is what the runtime's decode loop runs on a CPU. The reference stays the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.tree_attention.mask import unpack_mask

# The model hands the same packed mask to every layer of one forward: unpack it once. A single-entry memo keyed on
# the packed tensor's identity and version (a write to it bumps the version) and the key length; it holds that
# tensor, so its storage cannot be reused by another mask while cached. Replaced atomically (one tuple), so
# concurrent requests in threads can only miss, never read another request's mask.
_last_visible: tuple[torch.Tensor, int, int, torch.Tensor | None] | None = None


def attn_mask(tree_mask: torch.Tensor, n: int, s: int) -> torch.Tensor | None:  # [B, 1, N, L + N] bool
    """SDPA's mask for the packed tree mask over L + N = s keys; None when no mask is needed (one token that sees
    itself sees everything: plain decoding, SDPA's fastest path)."""
    global _last_visible
    last = _last_visible
    if last is not None and last[0] is tree_mask and last[1] == tree_mask._version and last[2] == s:
        return last[3]
    if n == 1 and bool(torch.all(tree_mask[:, 0, 0] & 1)):
        visible = None
    else:
        tree = unpack_mask(tree_mask, n)  # [B, N, N]
        visible = torch.cat([tree.new_ones(tree.shape[0], n, s - n), tree], dim=-1)[:, None]  # prefix visible
    _last_visible = (tree_mask, tree_mask._version, s, visible)
    return visible


def tree_attention_sdpa(
    q: torch.Tensor,  # [B, Hq, N, D]
    k: torch.Tensor,  # [B, Hkv, L + N, D]
    v: torch.Tensor,  # [B, Hkv, L + N, D]
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32 packed
    scale: float,
) -> torch.Tensor:  # [B, Hq, N, D]
    hq, n, hkv, s = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask(tree_mask, n, s), scale=scale, enable_gqa=hq != hkv
    )  # attn_mask [B, 1, N, L + N] broadcasts over heads
