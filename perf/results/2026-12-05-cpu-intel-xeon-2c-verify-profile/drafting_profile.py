# Run from the repository root. The configured drafter decoding 4 merge-tuning prompts (128 tokens) under torch.profiler:
# the self CPU time of the ops inside drafting, by the innermost of draft / _run_pending / a head level forward /
# the draft output layer (labels DRAFT, PENDING, LEVEL, LMHEAD), per verification step. The profiler inflates times.
import sys, time
from collections import defaultdict
sys.path.insert(0, 'perf/results/2026-12-04-cpu-intel-xeon-2c-head-features')
from common import setup
import torch
from torch.profiler import profile, ProfilerActivity, record_function
import runtime.drafters.merged as M
import runtime.drafters.eagle as E
target, enc, dec = setup(4)
def wrap(owner, name, label):
    raw = owner.__dict__[name]
    def f(*a, **k):
        with record_function(label):
            return raw(*a, **k)
    setattr(owner, name, f)
wrap(M.MergedSession, 'draft', 'DRAFT')
wrap(E.EagleSession, '_run_pending', 'PENDING')
wrap(E.DraftTreeCache, 'forward', 'LEVEL')
wrap(E.EagleDrafter, 'draft_logits', 'LMHEAD')
dec.generate(enc[0], max_tokens=32, ignore_eos=True)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    steps = sum(dec.generate(ids, max_tokens=128, ignore_eos=True).stats.steps for ids in enc[:4])
ev = prof.events()
tot = defaultdict(float); inside = defaultdict(lambda: defaultdict(float)); cnt = defaultdict(lambda: defaultdict(int))
labels = ('DRAFT', 'PENDING', 'LEVEL', 'LMHEAD')
for e in ev:
    if e.name in labels:
        tot[e.name] += e.cpu_time_total
        continue
    # innermost label ancestor
    p = e.cpu_parent; lab = None
    while p is not None:
        if p.name in labels and lab is None: lab = p.name
        if p.name == 'DRAFT': break
        p = p.cpu_parent
    if p is None: continue
    inside[lab][e.name] += e.self_cpu_time_total
    cnt[lab][e.name] += 1
print("steps", steps)
for l in labels: print(f"{l:8s} total {tot[l]/steps:8.1f} us/step")
for l in labels:
    s = sum(inside[l].values())
    print(f"== {l}: ops self {s/steps:.1f} us/step")
    for k, v in sorted(inside[l].items(), key=lambda kv: -kv[1])[:14]:
        print(f"   {k:40s} {v/steps:7.1f} us/step {cnt[l][k]/steps:5.1f} calls/step")
