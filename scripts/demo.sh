#!/usr/bin/env bash
# The main job on the embedded default (the committed demo model, configs/demo.yaml), end to end on this CPU:
#   1. build the engine directory          python -m builder build
#   2. render a Triton model repository     python -m model_repo render
#   3. serve it with a real tritonserver    python -m deploy serve
#   4. stream a completion over gRPC        python -m deploy client
#   5. measure: plain vs speculative vs transformers, speedup table + plots   python -m perf bench
# Usage: bash scripts/demo.sh [OUT_DIR]   (default out/demo-run)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${1:-out/demo-run}
mkdir -p "$OUT"

echo "== 1. engine"
$PY -m builder build --config configs/demo.yaml --output "$OUT/engine" --force

echo "== 2. Triton model repository"
$PY -m model_repo render --engine "$OUT/engine" --output "$OUT/repo" --force

echo "== 3. tritonserver"
read -r HTTP GRPC METRICS < <($PY -c 'from deploy.server import free_ports; print(*free_ports(3))')
$PY -m deploy serve --repo "$OUT/repo" --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS" \
    --log-file "$OUT/tritonserver.log" > "$OUT/serve.out" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    grep -q "^ready" "$OUT/serve.out" 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/serve.out"; exit 1; }
    sleep 1
done
cat "$OUT/serve.out"

echo "== 4. streaming a completion over gRPC (greedy: identical to plain decoding)"
$PY -m deploy client --url "127.0.0.1:$GRPC" --max-tokens 96 --stats \
    --prompt $'def read_config(path):\n    """Read a JSON config file and return it as a dict."""\n'
echo
kill -TERM $SERVER; wait $SERVER || true
trap - EXIT

echo "== 5. benchmark (same prompts: plain, transformers generate, and each drafter of the demo)"
# The configured Medusa tree, the EAGLE head with its own tuned tree (configs/demo-eagle.yaml), prompt lookup.
EAGLE_TREE=$($PY -c 'import json, yaml; print(json.dumps(yaml.safe_load(open("configs/demo-eagle.yaml"))["draft"]["tree"]["choices"], separators=(",", ":")))')
$PY -m perf bench --config configs/demo.yaml --draft-model eagle=demo/eagle --prompts-per-set 3 --max-tokens 64 \
    --drafters "medusa,eagle-tuned=eagle:$EAGLE_TREE,lookup" --out "$OUT/bench"
