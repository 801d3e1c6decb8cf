# Variant file for ../2026-12-04-cpu-intel-xeon-2c/tried/ab.py: the configured head with its MLP and draft output
# layer in int4 (attention and fc int8), against int8 (configured) and int4 throughout.
import dataclasses
from runtime.model import Int4Weight
def prim(dec):
    d = dec.drafter
    return getattr(d, 'primary', d)
def make(target, base, build_decoder):
    a = build_decoder(target, base)[0]
    b = build_decoder(target, base)[0]
    d = prim(b)
    d.lm_quantized = Int4Weight.of(d.lm_weight)
    for layer in d.head.layers:
        layer.mlp.quantize(Int4Weight)
    c = build_decoder(target, dataclasses.replace(base, quantization='int4'))[0]
    return {'plain': (build_decoder(target, None)[0], None), 'int8': (a, None), 'mlp4+lm4': (b, None), 'int4': (c, None)}
