# Variant file for ../2026-12-04-cpu-intel-xeon-2c/tried/ab.py, the prototype of runtime.model.Int4Weight: int4
# draft weights (torch's CPU int4 kernel, groups of 32, asymmetric) rounded to nearest over each group's [min, max]
# (session 28's v_int4.py), or with each group's range shrunk by the factor in SHRINK that minimises the group's
# squared error, against the configured int8.
import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    'v_int4', Path(__file__).resolve().parents[1] / '2026-12-04-cpu-intel-xeon-2c-rerun' / 'tried' / 'v_int4.py')
v4 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v4)
GS = v4.GS
SHRINK = [1.0 - 0.025 * i for i in range(13)]  # 1.0 .. 0.7


def of4_mse(w):
    """v4.Int4Weight.of4 with a per-group range shrink chosen to minimise the group's squared rounding error."""
    o, i = w.shape
    wf = w.detach().float().reshape(o, i // GS, GS)
    mn0, mx0 = wf.amin(-1, keepdim=True), wf.amax(-1, keepdim=True)
    best_err = best_mn = best_scale = None
    for a in SHRINK:
        mn, mx = mn0 * a, mx0 * a
        scale = ((mx - mn) / 15).clamp(min=1e-8)
        # the kernel reads bf16 scales and zeros: round them first, so the error measured is the one it will see
        scale_r = scale.to(w.dtype).float()
        zero_r = (mn + 8 * scale).to(w.dtype).float()
        q = torch.round((wf - mn) / scale).clamp(0, 15)
        deq = (q - 8) * scale_r + zero_r
        err = (deq - wf).pow(2).sum(-1, keepdim=True)
        if best_err is None:
            best_err, best_mn, best_scale = err, mn, scale
        else:
            take = err < best_err
            best_err = torch.where(take, err, best_err)
            best_mn = torch.where(take, mn, best_mn)
            best_scale = torch.where(take, scale, best_scale)
    q = torch.round((wf - best_mn) / best_scale).clamp(0, 15).to(torch.int32).reshape(o, i)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.cat([best_scale.reshape(o, -1, 1), (best_mn + 8 * best_scale).reshape(o, -1, 1)], -1) \
        .transpose(0, 1).contiguous().to(w.dtype)
    return v4.Int4Weight(w.detach(), packed, sz, o)


def to4(d, build):
    d = d.primary
    d.lm_int8 = build(d.lm_weight)
    h = d.head
    h.fc_int8 = build(h.fc.weight)
    for layer in h.layers:
        for mod in (layer.self_attn, layer.mlp):
            fused, out = mod.int8
            mod.int8 = (build(fused.source), build(out.source))


def make(target, base, build_decoder):
    out = {'plain': (build_decoder(target, None)[0], None), 'int8': (build_decoder(target, base)[0], None)}
    d = build_decoder(target, base)[0]; to4(d.drafter, v4.Int4Weight.of4); out['int4-rtn'] = (d, None)
    d = build_decoder(target, base)[0]; to4(d.drafter, of4_mse); out['int4-mse'] = (d, None)
    return out
