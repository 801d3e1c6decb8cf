#!/usr/bin/env bash
# The main job on the embedded default: build an engine, generate with speculation, stream, measure.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python scripts/demo.py "$@"
