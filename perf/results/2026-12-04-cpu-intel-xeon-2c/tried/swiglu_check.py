# cc -O3 -march=native -fPIC -shared -std=gnu11 -ffp-contract=off -o /tmp/swiglu.so swiglu.c -lm; python swiglu_check.py
# Bit identity against F.silu(gate) * up (bf16 / float32, several widths and row counts), then the time per call.
import torch, ctypes, os, time
import torch.nn.functional as F
torch.set_num_threads(2)
tl = ctypes.CDLL(os.path.join(torch.__path__[0], 'lib', 'libtorch_cpu.so'))
fn = ctypes.cast(tl.Sleef_expf16_u10, ctypes.c_void_p).value
lib = ctypes.CDLL(os.environ.get('SWIGLU_SO', '/tmp/swiglu.so')); f = lib.spectree_swiglu; f.restype = None
i64, ptr = ctypes.c_int64, ctypes.c_void_p
f.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int, ptr]
def mine(gu, inter):
    m = gu.shape[0]; out = torch.empty(m, inter, dtype=gu.dtype)
    f(gu.data_ptr(), m, inter, gu.stride(0), out.data_ptr(), int(gu.dtype == torch.bfloat16), fn); return out
def ref(gu, inter):
    g, u = gu.split([inter, inter], dim=-1); return F.silu(g) * u
print(torch.backends.cpu.get_cpu_capability())
for dtype in (torch.bfloat16, torch.float32):
    for inter in (1536, 1000, 37, 64, 14336):
        for m in (1, 3, 13, 100):
            bad = 0; tot = 0
            for trial in range(5):
                gu = (torch.randn(m, 2 * inter) * (4 if trial % 2 else 1)).to(dtype)
                a, b = ref(gu, inter), mine(gu, inter)
                bad += (a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32) != b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)).sum().item(); tot += a.numel()
            print(dtype, inter, m, 'mismatches', bad, 'of', tot)
gu = torch.randn(13, 3072).bfloat16()
def bench(fn_, n=2000):
    for _ in range(50): fn_()
    t = time.perf_counter()
    for _ in range(n): fn_()
    return (time.perf_counter() - t) / n * 1e6
for m in (1, 13):
    gu = torch.randn(m, 3072).bfloat16()
    print(m, 'torch', bench(lambda: ref(gu, 1536)), 'mine', bench(lambda: mine(gu, 1536)))
