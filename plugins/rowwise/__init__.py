"""Row-wise layer ops on CPU (RMSNorm, rotary embeddings) as single native calls: native.py."""
