# Run from the repository root. Per decoding step, torch profiler op time of plain decoding and of the configured
# drafter (4 merge-tuning prompts, 96 tokens each, twice in turn): what a speculative step adds, op by op.
import sys, time, collections
import torch
from common import setup  # first: puts the repository root on sys.path
from runtime.drafters import eagle as E
from torch.profiler import profile
target, enc, dec, plain = setup(11, plain=True)
for d in (dec, plain): d.generate(enc[0], max_tokens=32, ignore_eos=True)
res = {}
for name, d in (('plain', plain), ('spec', dec), ('plain2', plain), ('spec2', dec)):
    steps = 0
    with profile() as p:
        for ids in enc:
            r = d.generate(ids, max_tokens=96, ignore_eos=True); steps += r.stats.steps
    tot = collections.Counter()
    for e in p.key_averages():
        tot[e.key] += e.self_cpu_time_total
    res[name] = (steps, tot)
    print(name, steps, f"wall-ish total self {sum(tot.values())/steps/1e3:.2f} ms/step")
for a, b in (('plain', 'spec'), ('plain2', 'spec2')):
    sa, ta = res[a]; sb, tb = res[b]
    keys = sorted(set(ta) | set(tb), key=lambda k: -(tb[k]/sb - ta[k]/sa))
    print(f"--- per step: {a} vs {b}")
    for k in keys[:25]:
        print(f"{k[:50]:50s} {ta[k]/sa/1e3:8.3f} {tb[k]/sb/1e3:8.3f} {tb[k]/sb/1e3 - ta[k]/sa/1e3:+8.3f}")
