# Run from the repository root. The EAGLE head forward wrapped in torch.compile(dynamic=True) as it is, timed per call
# during decoding (6 merge-tuning prompts, 128 tokens): compare with head_warm.py / the eager figures in README.md.
import sys, time, os, collections
import torch
from common import setup  # first: puts the repository root on sys.path
from runtime.drafters import eagle as E
target, enc, dec = setup(8)
head = dec.drafter.primary.head
import torch._dynamo
torch._dynamo.config.cache_size_limit = 64
t = time.perf_counter()
comp = torch.compile(head.forward, dynamic=True)
stats = collections.defaultdict(list)
def timed(embeds, features, positions, cache, mask):
    t = time.perf_counter(); out = comp(embeds, features, positions, cache, mask); stats[(embeds.shape[1], type(cache).__name__)].append(time.perf_counter() - t); return out
head.forward = timed
r0 = dec.generate(enc[0], max_tokens=32, ignore_eos=True)
print('warm', time.perf_counter() - t)
stats.clear()
for ids in enc:
    r = dec.generate(ids, max_tokens=128, ignore_eos=True)
for k, v in sorted(stats.items(), key=lambda kv: -len(kv[1]))[:8]:
    v = sorted(v); print(k, len(v), f"median {v[len(v)//2]*1e6:.0f} us")
print(torch._dynamo.utils.counters['stats'], dict(torch._dynamo.utils.counters['graph_break']))
