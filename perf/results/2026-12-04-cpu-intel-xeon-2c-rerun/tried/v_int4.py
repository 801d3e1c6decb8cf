# int4 (asymmetric, groups of 32) draft weights through torch's CPU int4 kernel: the draft output layer only, or it
# and every head matmul, against the configured int8.
import torch, dataclasses
from runtime.model import Int8Weight
GS = 32
class Int4Weight(Int8Weight):
    """experiment: int4 groupwise (asymmetric, group 32) through torch's CPU int4 kernel"""
    def __init__(self, src, packed, sz, n):
        object.__setattr__(self, 'source', src); object.__setattr__(self, 'packed', packed)
        object.__setattr__(self, 'sz', sz); object.__setattr__(self, 'n', n)
        object.__setattr__(self, 'q', torch.empty(n, src.shape[1], dtype=torch.int8)); object.__setattr__(self, 'scales', None)
    @classmethod
    def of4(cls, w):
        o, i = w.shape
        wf = w.detach().float().reshape(o, i // GS, GS)
        mn, mx = wf.amin(-1, keepdim=True), wf.amax(-1, keepdim=True)
        scale = ((mx - mn) / 15).clamp(min=1e-8)
        q = torch.round((wf - mn) / scale).clamp(0, 15).to(torch.int32).reshape(o, i)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.cat([scale.reshape(o, -1, 1), (mn + 8 * scale).reshape(o, -1, 1)], -1).transpose(0, 1).contiguous().to(w.dtype)
        return cls(w.detach(), packed, sz, o)
    def matmul(self, x):
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > 16:
            return torch.nn.functional.linear(x, self.source)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GS, self.sz).view(*x.shape[:-1], self.n)

def to4(d, lm_only):
    d = d.primary
    d.lm_int8 = Int4Weight.of4(d.lm_weight)
    if lm_only: return
    h = d.head
    h.fc_int8 = Int4Weight.of4(h.fc.weight)
    for layer in h.layers:
        for mod in (layer.self_attn, layer.mlp):
            fused, out = mod.int8
            mod.int8 = (Int4Weight.of4(fused.source), Int4Weight.of4(out.source))

def make(target, base, build_decoder):
    out = {'plain': (build_decoder(target, None)[0], None), 'int8': (build_decoder(target, base)[0], None)}
    d = build_decoder(target, base)[0]; to4(d.drafter, True); out['int4-lm'] = (d, None)
    d = build_decoder(target, base)[0]; to4(d.drafter, False); out['int4-all'] = (d, None)
    return out
