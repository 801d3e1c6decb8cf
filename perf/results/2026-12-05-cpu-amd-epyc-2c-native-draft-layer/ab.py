# Run from the repository root. The configured drafter's head forwards and draft output layer on the native layer
# (plugins/draft_layer) against the torch route over the same int8 copies, side by side in one process: every
# `step`-th merge-tuning prompt (default 6: 8 prompts), 128 tokens, greedy, two rounds, plain decoding alongside.
# Every output must be identical (it is the target's greedy output).
import statistics
import sys
import time

sys.path.insert(0, 'perf/results/2026-12-04-cpu-intel-xeon-2c-head-features')
from common import setup  # noqa: E402

step = int(sys.argv[1]) if len(sys.argv) > 1 else 6
target, enc, dec, plain = setup(step, plain=True)
drafter = dec.drafter.primary
native = (drafter.head.native, drafter.lm_native)
assert None not in native, "the native layer is unavailable here"
rates, outs = {"plain": [], "torch route": [], "native": []}, {}
dec.generate(enc[0], max_tokens=16, ignore_eos=True)
for rnd in range(2):
    for mode in rates:
        drafter.head.native, drafter.lm_native = native if mode == "native" else (None, None)
        d = plain if mode == "plain" else dec
        toks = steps = 0
        draft = 0.0
        t0 = time.perf_counter()
        for i, ids in enumerate(enc):
            o = d.generate(ids, max_tokens=128, ignore_eos=True)
            toks, steps, draft = toks + len(o.token_ids), steps + o.stats.steps, draft + (o.stats.time_draft or 0.0)
            assert outs.setdefault(i, o.token_ids) == o.token_ids, (mode, i)
        wall = time.perf_counter() - t0
        rates[mode].append(toks / wall)
        print(f"round {rnd} {mode:12s} {toks / wall:6.1f} tok/s  tau {toks / steps:.3f}  drafting "
              f"{draft / steps * 1e3:.2f} ms/step  step {wall / steps * 1e3:.2f} ms", flush=True)
print("median tok/s:", {m: round(statistics.median(v), 1) for m, v in rates.items()})
