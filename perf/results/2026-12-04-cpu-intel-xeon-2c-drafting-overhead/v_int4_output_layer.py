# Variant file for ../2026-12-04-cpu-intel-xeon-2c/tried/ab.py: the configured int8 head with its draft output layer
# in int4 (runtime.model.Int4Weight) against the configured drafter.
from runtime.model import Int4Weight
def make(target, base, build_decoder):
    a = build_decoder(target, base)[0]
    b = build_decoder(target, base)[0]
    d = b.drafter
    d = getattr(d, 'primary', d)
    d.lm_quantized = Int4Weight.of(d.lm_weight)
    return {'plain': (build_decoder(target, None)[0], None), 'int8': (a, None), 'lm4': (b, None)}
