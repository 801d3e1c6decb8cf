# Run from the repository root. The configured drafter decoding 6 merge-tuning prompts (128 tokens): every EAGLE head
# forward and draft output layer timed per call, by rows and cache kind; then an op profile of 48 decoded tokens.
import sys, time, os, collections
import torch
from common import setup  # first: puts the repository root on sys.path
from runtime.drafters import eagle as E
target, enc, dec = setup(8)
dec.generate(enc[0], max_tokens=32, ignore_eos=True)
orig = E.EagleHead.forward
stats = collections.defaultdict(list)
def timed(self, embeds, features, positions, cache, mask):
    t = time.perf_counter(); out = orig(self, embeds, features, positions, cache, mask); stats[(embeds.shape[1], type(cache).__name__)].append(time.perf_counter() - t); return out
E.EagleHead.forward = timed
lstats = collections.defaultdict(list)
origdl = E.EagleDrafter.draft_logits
def tdl(self, f):
    t = time.perf_counter(); out = origdl(self, f); lstats[f.shape[0]].append(time.perf_counter() - t); return out
E.EagleDrafter.draft_logits = tdl
for ids in enc:
    r = dec.generate(ids, max_tokens=128, ignore_eos=True)
for k, v in sorted(stats.items(), key=lambda kv: -len(kv[1]))[:12]:
    v = sorted(v); print(k, len(v), f"median {v[len(v)//2]*1e6:.0f} us")
for k, v in sorted(lstats.items()):
    v = sorted(v); print('logits', k, len(v), f"median {v[len(v)//2]*1e6:.0f} us")
# profile a few 3-row forwards
E.EagleHead.forward = orig
from torch.profiler import profile
with profile() as p:
    dec.generate(enc[1], max_tokens=48, ignore_eos=True)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=45))
