"""Tree attention: N tree tokens attend to a fully visible KV prefix of length L plus the N tree tokens
under a tree mask.

Shapes (used by every host of the op):
    q          # [B, Hq, N, D]
    k, v       # [B, Hkv, L + N, D]   prefix keys first, then the N tree tokens; Hq % Hkv == 0 (GQA)
    tree_mask  # [B, N, ceil(N / 32)] int32, TensorRT-LLM's packed layout: bit j of row i (word j // 32,
               #  bit j % 32, least-significant first) set <=> tree token i may attend tree token j
    out        # [B, Hq, N, D], dtype of q
"""

from plugins.tree_attention.mask import mask_words, pack_mask, unpack_mask
from plugins.tree_attention.reference import tree_attention_reference

__all__ = ["mask_words", "pack_mask", "unpack_mask", "tree_attention_reference"]
