"""The EAGLE head's first draft after a prompt (its forward over every prompt pair, then the tree), side by side in
one process: int8 draft weights for every call (INT8_MAX_ROWS unbounded, as before 2026-12-04) against calls over
INT8_MAX_ROWS rows multiplying by the source weights. Random prompt tokens and features: the time does not depend
on their values. Run from the repo root:
    .venv/bin/python perf/results/2026-12-04-cpu-amd-epyc-2c-int8-prompt/first_draft_ab.py
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import runtime.model as model  # noqa: E402
from perf.bench import BenchConfig, VariantSpec, build_decoder, load_target, resolve  # noqa: E402

torch.set_num_threads(2)
target = load_target(BenchConfig(config=Path("configs/smollm2.yaml")))
decoder, _ = build_decoder(target, resolve(VariantSpec.parse("eagle"), target, {}))
eagle = decoder.drafter.primary
hidden_size = eagle.head.config.hidden_size
limits = {"int8 always": 10**9, "source over 16 rows": model.INT8_MAX_ROWS}
torch.manual_seed(0)
results = []
for tokens in (128, 512, 2000):
    prompt = torch.randint(100, 40000, (tokens,))
    hidden = torch.randn(tokens, hidden_size, dtype=eagle.model.dtype)
    best = {}
    for _ in range(2):  # alternated, the best of two each
        for name, limit in limits.items():
            model.INT8_MAX_ROWS = limit
            session = eagle.start(prompt, hidden, 64)
            t = time.perf_counter()
            session.draft(5)
            best[name] = min(best.get(name, float("inf")), 1e3 * (time.perf_counter() - t))
    results.append({"prompt_tokens": tokens, **{f"{k} ms": round(v, 1) for k, v in best.items()}})
    print(results[-1])
(Path(__file__).parent / "first_draft_ab.json").write_text(json.dumps(results, indent=1) + "\n")
