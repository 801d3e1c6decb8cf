#!/usr/bin/env bash
# The soak as run for this directory: build + render the default engine as scripts/demo.sh does, serve it, then
# python -m perf.soak at 16 and 64 clients, 60 s each. Usage: bash soak.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../../../.."
PY=.venv/bin/python
OUT=${1:-out/soak-run}
mkdir -p $OUT
$PY -m builder build --config configs/smollm2.yaml --output "$OUT/engine" --force
$PY -m model_repo render --engine "$OUT/engine" --output "$OUT/repo" --force --tree-budget 24
read -r HTTP GRPC METRICS < <($PY -c 'from deploy.server import free_ports; print(*free_ports(3))')
$PY -m deploy serve --repo "$OUT/repo" --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS" \
    --log-file "$OUT/tritonserver.log" > "$OUT/serve.out" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do grep -q "^ready" "$OUT/serve.out" 2>/dev/null && break; sleep 1; done
TPID=$(pgrep -f "tritonserver.*$OUT/repo" | head -1)
echo "server $SERVER tritonserver $TPID grpc $GRPC"
$PY -m perf.soak --url 127.0.0.1:$GRPC --engine "$OUT/engine" --server-pid $TPID --clients 16,64 --seconds 60 --out $OUT/result
