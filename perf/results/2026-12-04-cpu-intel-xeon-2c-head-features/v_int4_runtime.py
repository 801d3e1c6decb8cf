# Variant file for ../2026-12-04-cpu-intel-xeon-2c/tried/ab.py: the configured drafter with `quantization: int4`
# (runtime.model.Int4Weight, the searched ranges of v_int4q.py) against its configured int8.
import dataclasses


def make(target, base, build_decoder):
    return {'plain': (build_decoder(target, None)[0], None), 'int8': (build_decoder(target, base)[0], None),
            'int4': (build_decoder(target, dataclasses.replace(base, quantization='int4'))[0], None)}
