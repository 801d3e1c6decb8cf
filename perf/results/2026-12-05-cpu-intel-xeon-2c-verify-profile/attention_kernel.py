# Run from the repository root. The row-invariant attention kernel alone (ctypes call) and through the op, bf16,
# 9 query / 3 KV heads of 64, random trees of N nodes over L prefix keys: median of 300 calls each, warm caches.
import time, torch, sys
from plugins.tree_attention import native
from plugins.tree_attention.mask import pack_mask
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
def case(n, L, hq=9, hkv=3, d=64):
    q = torch.randn(1, hq, n, d, generator=g).bfloat16()
    k = torch.randn(1, hkv, L + n, d, generator=g).bfloat16()
    v = torch.randn(1, hkv, L + n, d, generator=g).bfloat16()
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0: anc[i, j] = True; j = parents[j]
    return q, k, v, pack_mask(anc)[None].contiguous()
nat = native.load()
for L in (256, 512):
    for n in (1, 8, 14, 16, 24):
        q, k, v, m = case(n, L)
        out = torch.empty(1, 9, n, 64)
        args = (q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3],
                m.data_ptr(), m.shape[-1], out.data_ptr(), 1, 9, 3, n, k.shape[2], 64, 0.125, 1)
        for _ in range(50): nat.fn(*args)
        ts = []
        for _ in range(300):
            a = time.perf_counter(); nat.fn(*args); ts.append(time.perf_counter() - a)
        ts.sort()
        t2 = []
        for _ in range(300):
            a = time.perf_counter(); torch.ops.spectree.tree_attention(q, k, v, m, 0.125); t2.append(time.perf_counter() - a)
        t2.sort()
        print(f"L={L} n={n:2d} kernel {1e6*ts[150]:6.1f} us  op {1e6*t2[150]:6.1f} us")
