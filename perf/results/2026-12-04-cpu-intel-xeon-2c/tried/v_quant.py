import dataclasses
def make(target, base, build_decoder):
    return {
        'plain': (build_decoder(target, None)[0], None),
        'int8': (build_decoder(target, base)[0], None),
        'bf16packed': (build_decoder(target, dataclasses.replace(base, quantization=None))[0], None),
    }
