# The kernel alone, both routes (amx_route.patch applied): 9 query heads / 3 KV heads of 64, L context keys, a random
# tree of N rows; T threads. L=300 T=2 python <this file>
import sys, time, torch, os
sys.path.insert(0, '.')
torch.set_num_threads(int(os.environ.get("T", 2)))
from plugins.tree_attention import native
from perf.verify_cost import verify_input
nat = native.load()
gen = torch.Generator().manual_seed(0)
L = int(os.environ.get('L', 300))
for n in (1, 4, 8, 13, 16, 24):
    inp = verify_input('tree', n, L, 1000, gen)
    q = torch.randn(1, 9, n, 64).bfloat16(); k = torch.randn(1, 3, L + n, 64).bfloat16(); v = torch.randn(1, 3, L + n, 64).bfloat16()
    m = inp.mask
    res = {}
    for amx in (False, True, False, True):
        nat.set_amx(amx)
        for _ in range(20): native.tree_attention_native(q, k, v, m, 0.125, checked=True)
        t = time.perf_counter()
        for _ in range(300): native.tree_attention_native(q, k, v, m, 0.125, checked=True)
        res[amx] = (time.perf_counter() - t) / 300 * 1e6
    nat.set_amx(True); a = native.tree_attention_native(q, k, v, m, 0.125, checked=True)
    nat.set_amx(False); b = native.tree_attention_native(q, k, v, m, 0.125, checked=True)
    print(f"N={n:3d} dp {res[False]:7.1f} us  amx {res[True]:7.1f} us   max|diff| {(a-b).abs().max().item():.2e}")
