# Run from the repository root. The head on its own, weights warm: one static draft step, one 2-row head forward and
# one draft output layer repeated in a loop; then the op profile and the Python profile of the head forward.
import sys, time, os, collections
import torch
from common import setup  # first: puts the repository root on sys.path
from runtime.drafters import eagle as E
target, enc, dec = setup(8)
drafter = dec.drafter.primary
head = drafter.head
m = target.model
# session at ~300 tokens
ids = torch.tensor(enc[0] + [100]*(300-len(enc[0])) if len(enc[0]) < 300 else enc[0][:300])
cache = m.new_cache(1024)
with torch.no_grad():
    logits, hidden = m.prefill(ids[None], cache)
sess = drafter.start(ids, hidden[0], 64)
d = sess.draft(int(ids[-1]))
print('tree', d.tree.num_nodes)
# now time static draft steps repeatedly (draft() again without advance redoes root pair)
def one():
    return sess.draft(int(ids[-1]))
for _ in range(20): one()
ts = []
for _ in range(200):
    t = time.perf_counter(); one(); ts.append(time.perf_counter() - t)
ts.sort(); print(f"draft warm median {ts[100]*1e3:.3f} ms")
# per head forward on DraftTreeCache
step = E.DraftTreeCache(head, sess.cache)
emb = m.embed(torch.tensor([5, 6])); feats = torch.randn(2, 576).to(m.dtype)
pos = torch.tensor([step.base, step.base]); vis = torch.tensor([[True, False], [False, True]])
sess._reserve(4)
def fw():
    out = step.forward(emb, feats, pos, vis); step.cache.truncate(step.base); return out
for _ in range(20): fw()
ts = []
for _ in range(300):
    t = time.perf_counter(); fw(); ts.append(time.perf_counter() - t)
ts.sort(); print(f"head fwd 2 rows warm median {ts[150]*1e6:.0f} us")
lw = lambda: drafter.draft_logits(feats)
ts = []
for _ in range(300):
    t = time.perf_counter(); lw(); ts.append(time.perf_counter() - t)
ts.sort(); print(f"draft logits 2 rows median {ts[150]*1e6:.0f} us")
from torch.profiler import profile
with profile() as p:
    for _ in range(100): fw()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for _ in range(300): fw()
pr.disable()
st = pstats.Stats(pr)
rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:40]
from pathlib import Path as P
for (f, l, fn), (cc, nc, tt, ct, callers) in rows:
    print(f"{tt/300*1e6:7.1f} us self {ct/300*1e6:7.1f} cum {nc/300:5.1f} calls  {P(f).name}:{l} {fn}")
