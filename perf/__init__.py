"""Measuring what spectree exists for (see perf/README.md):

    python -m perf bench    speculative decoding vs plain decoding vs transformers' generate, one run, same prompts
    python -m perf serve    NVIDIA perf_analyzer against a served Triton repository (gRPC streaming)
    python -m perf results  the latest record per machine kind (perf/results/) and README.md's table of them
    python -m perf kernels  the tree-attention kernel check + microbenchmark on a CUDA GPU (tree_attention_gpu.py)
"""
