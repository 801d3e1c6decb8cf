"""The op's CPU implementation: torch's fused scaled-dot-product attention under the unpacked tree mask.

Same contract as `reference.py` (shapes in `__init__.py`), but computed in the inputs' dtype by SDPA's fused
CPU kernel (fp32 accumulation inside for bf16/fp16) with no fp32 copies of the cache, no GQA repeat and no
softmax materialised by hand: this is what the runtime's decode loop runs on a CPU. The reference stays the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.tree_attention.mask import unpack_mask

# SDPA's CPU kernels take these; float64 is what bf16 models attend in on CPU (runtime/model.py `kv_dtype`).
SDPA_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The model hands the same packed mask to every layer of one forward (a packed batch: one mask per request):
# unpack each once. A small memo keyed on the packed tensor's identity, its version (a write bumps it), the key
# length and the dtype; an entry holds its tensor, so that storage cannot be reused by another mask while cached.
# Rebound, never cleared in place, when full: concurrent requests in threads can only miss, never read another
# request's mask.
_MEMO_SIZE = 64
_visible: dict[tuple[int, int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor | None]] = {}


def attn_mask(tree_mask: torch.Tensor, n: int, s: int,
              dtype: torch.dtype) -> torch.Tensor | None:  # [B, 1, N, L + N] in dtype
    """SDPA's additive mask for the packed tree mask over L + N = s keys: 0 where a query sees a key, -inf where not
    (what SDPA turns a boolean mask into on every call; made once per forward here); None when no mask is needed
    (one token that sees itself sees everything: plain decoding, SDPA's fastest path)."""
    global _visible
    if tree_mask.is_inference():  # no version counter to tell an in-place edit: not memoised
        return _additive(tree_mask, n, s, dtype)
    key = (id(tree_mask), tree_mask._version, s, dtype)
    hit = _visible.get(key)
    if hit is not None and hit[0] is tree_mask:
        return hit[1]
    additive = _additive(tree_mask, n, s, dtype)
    memo = _visible
    if len(memo) >= _MEMO_SIZE:
        memo = _visible = {}
    memo[key] = (tree_mask, additive)
    return additive


def _additive(tree_mask: torch.Tensor, n: int, s: int, dtype: torch.dtype) -> torch.Tensor | None:
    if n == 1 and bool(torch.all(tree_mask[:, 0, 0] & 1)):
        return None
    tree = unpack_mask(tree_mask, n)  # [B, N, N] bool
    additive = torch.zeros(tree.shape[0], 1, n, s, dtype=dtype, device=tree_mask.device)  # prefix visible
    additive[:, 0, :, s - n:].masked_fill_(~tree, float("-inf"))
    return additive  # [B, 1, N, L + N]


def tree_attention_sdpa(
    q: torch.Tensor,  # [B, Hq, N, D]
    k: torch.Tensor,  # [B, Hkv, L + N, D]
    v: torch.Tensor,  # [B, Hkv, L + N, D]
    tree_mask: torch.Tensor,  # [B, N, ceil(N / 32)] int32 packed
    scale: float,
) -> torch.Tensor:  # [B, Hq, N, D]
    hq, n, hkv, s = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask(tree_mask, n, s, q.dtype), scale=scale, enable_gqa=hq != hkv
    )  # attn_mask [B, 1, N, L + N] broadcasts over heads
