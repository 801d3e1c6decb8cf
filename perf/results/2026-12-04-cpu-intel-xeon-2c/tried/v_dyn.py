import torch, warnings
warnings.filterwarnings("ignore")
from runtime import model as M
_orig = M.Int8Weight.matmul
_packed = {}
_mode = {'dyn': False}
torch.backends.quantized.engine = 'x86'
def matmul(self, x):
    flat = x.reshape(-1, x.shape[-1])
    if not _mode['dyn'] or flat.shape[0] > M.INT8_MAX_ROWS:
        return _orig(self, x)
    p = _packed.get(id(self))
    if p is None:
        w = self.q.float() * self.scales.float()[:, None]
        wq = torch.quantize_per_channel(w, self.scales.float(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        p = _packed[id(self)] = torch.ops.quantized.linear_prepack(wq, None)
    out = torch.ops.quantized.linear_dynamic(flat.float(), p, False)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
M.Int8Weight.matmul = matmul
def mode(v):
    def f(): _mode['dyn'] = v
    return f
def make(target, base, build_decoder):
    d = build_decoder(target, base)[0]
    return {'int8': (d, mode(False)), 'w8a8dyn': (d, mode(True))}
