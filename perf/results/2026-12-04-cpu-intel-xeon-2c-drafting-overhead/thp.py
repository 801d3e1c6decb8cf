# Run from the repository root, once as it is and once with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 in the environment:
# plain decoding and the configured drafter, twice each, on every sixth merge-tuning prompt, 128 tokens: ms per step.
import sys, time, os
sys.path.insert(0, 'perf/results/2026-12-04-cpu-intel-xeon-2c-head-features')
from common import setup
target, enc, spec, plain = setup(6, plain=True)
for d in (plain, spec): d.generate(enc[0], max_tokens=32, ignore_eos=True)
res = {}
for name, d in (('plain', plain), ('spec', spec), ('plain2', plain), ('spec2', spec)):
    steps = 0; toks = 0; t0 = time.perf_counter()
    for ids in enc:
        r = d.generate(ids, max_tokens=128, ignore_eos=True); steps += r.stats.steps; toks += len(r.token_ids)
    res[name] = (time.perf_counter() - t0, steps, toks)
ah = [l for l in open('/proc/self/smaps_rollup') if 'AnonHuge' in l]
p = res['plain'][0] + res['plain2'][0]; s = res['spec'][0] + res['spec2'][0]
print(os.environ.get('GLIBC_TUNABLES', '-'), f"plain {p/(res['plain'][1]+res['plain2'][1])*1e3:.2f} ms/step  spec {s/(res['spec'][1]+res['spec2'][1])*1e3:.2f} ms/step  ratio {p/s:.3f}", ah[0].strip() if ah else '')
