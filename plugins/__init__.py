"""Kernels owned by spectree: the tree-attention op (torch reference, OpenAI Triton kernel, TensorRT plugin).

Nothing here imports runtime/ or anything above it.
"""
