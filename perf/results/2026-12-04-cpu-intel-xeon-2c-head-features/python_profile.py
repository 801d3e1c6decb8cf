# Run from the repository root. Unprofiled ms per step, then cProfile of plain decoding and of the configured drafter
# (4 merge-tuning prompts, 96 tokens): Python self time per function per step.
import sys, time, cProfile, pstats
import torch
from common import setup  # first: puts the repository root on sys.path
target, enc, dec, plain = setup(11, plain=True)
for d in (dec, plain): d.generate(enc[0], max_tokens=32, ignore_eos=True)
for name, d in (('plain', plain), ('spec', dec)):
    steps = 0; t = time.perf_counter()
    for ids in enc:
        r = d.generate(ids, max_tokens=96, ignore_eos=True); steps += r.stats.steps
    print(name, 'unprofiled ms/step', (time.perf_counter() - t) / steps * 1e3)
for name, d in (('plain', plain), ('spec', dec)):
    pr = cProfile.Profile(); steps = 0
    pr.enable()
    for ids in enc:
        r = d.generate(ids, max_tokens=96, ignore_eos=True); steps += r.stats.steps
    pr.disable()
    st = pstats.Stats(pr); print('=====', name, steps, 'steps; total', st.total_tt / steps * 1e3, 'ms/step')
    st.sort_stats('tottime')
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:45]
    for (f, l, fn), (cc, nc, tt, ct, callers) in rows:
        print(f"{tt/steps*1e3:7.3f} ms/step self {ct/steps*1e3:7.3f} cum {nc/steps:6.1f} calls/step  {Path(f).name}:{l} {fn}")
