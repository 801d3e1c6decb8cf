"""Serving spectree model repositories with a real Triton Inference Server.

    python -m deploy serve  --repo REPO_DIR      tritonserver (nvidia-pytriton wheel or PATH), ready, endpoints
    python -m deploy client --url HOST:PORT --prompt TEXT     stream a generation over gRPC
    python -m deploy k8s / docker --output DIR   Kubernetes manifests, Dockerfile + compose.yaml for GPU machines
"""
