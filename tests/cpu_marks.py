"""Skip marks for tests that need a CPU feature (plugins/cpu/, as this process sees it: a forced level masks
features) or a route that follows from one. Each reason names the feature, so a run on an AVX2-only CPU, or in the
forced mode `.ci/run` also runs, says what it did not check."""

import pytest

from plugins import cpu
from plugins.stream_linear import native as stream_linear

_FEATURES = cpu.features()

needs_native_bf16 = pytest.mark.skipif(
    not _FEATURES.native_bf16,
    reason=f"needs native bf16 matmuls (AVX512_BF16 or AMX-BF16): {_FEATURES.missing_bf16()}",
)
needs_fast_bf16 = pytest.mark.skipif(
    stream_linear.bf16_missing() is not None,
    reason=f"needs bf16 that runs fast (the weight-streaming kernel, or native bf16): {stream_linear.bf16_missing()}",
)
needs_avx512 = pytest.mark.skipif(
    not _FEATURES.avx512, reason=f"needs AVX-512 (F, BW, VL, DQ): this CPU is {_FEATURES.row}"
)
