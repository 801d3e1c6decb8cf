# Run from the repository root. One bf16 target forward of 1 row against one of a 14-node random tree (context 256,
# 2 threads): wall median of 30, then torch.profiler self CPU time per op over 10 forwards of each.
import torch, time, sys
from torch.profiler import profile, ProfilerActivity
from runtime.model import TargetModel, causal_mask
from plugins.tree_attention.mask import pack_mask
torch.set_num_threads(2)
m = TargetModel.from_pretrained("models/smollm2-135m-instruct", dtype="bfloat16")
m.pack_weights() if hasattr(m, "pack_weights") else None
cache = m.new_cache(2048)
g = torch.Generator().manual_seed(0)
ctx = torch.randint(0, 49152, (1, 256), generator=g)
m.prefill(ctx, cache)
def inputs(n):
    toks = torch.randint(0, 49152, (1, n), generator=g)
    # tree: root + chain-ish tree: parents random
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    depth = [0]*n
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True; j = parents[j]
        depth[i] = int(anc[i].sum()) - 1
    pos = (cache.length + torch.tensor(depth))[None]
    return toks, pos, pack_mask(anc)[None].contiguous()
res = {}
for n in (1, 14):
    t, p, mk = inputs(n)
    for _ in range(5): m.forward(t, p, cache, mk)
    ts = []
    for _ in range(30):
        a = time.perf_counter(); m.forward(t, p, cache, mk); ts.append(time.perf_counter() - a)
    ts.sort(); print(n, "median ms", 1e3 * ts[len(ts)//2])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10): m.forward(t, p, cache, mk)
    res[n] = {e.key: e.self_cpu_time_total / 10 for e in prof.key_averages()}
    cnt = {e.key: e.count / 10 for e in prof.key_averages()}
keys = sorted(set(res[1]) | set(res[14]), key=lambda k: -(res[14].get(k, 0)))
print(f"{'op':40s} {'N=1 us':>9s} {'N=14 us':>9s} {'delta':>8s} calls")
for k in keys[:30]:
    print(f"{k:40s} {res[1].get(k,0):9.0f} {res[14].get(k,0):9.0f} {res[14].get(k,0)-res[1].get(k,0):8.0f} {cnt.get(k,0):.0f}")
print("total", sum(res[1].values()), sum(res[14].values()))
