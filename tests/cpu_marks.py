"""Skip marks for tests that need a CPU feature (plugins/cpu/, as this process sees it: a forced level masks
features). Each reason names the feature, so a run on an AVX2-only CPU, or in the forced mode `.ci/run` also runs,
says what it did not check."""

import pytest

from plugins import cpu

_FEATURES = cpu.features()

needs_native_bf16 = pytest.mark.skipif(
    not _FEATURES.native_bf16,
    reason=f"needs native bf16 matmuls (AVX512_BF16 or AMX-BF16): {_FEATURES.missing_bf16()}",
)
needs_avx512 = pytest.mark.skipif(
    not _FEATURES.avx512, reason=f"needs AVX-512 (F, BW, VL, DQ): this CPU is {_FEATURES.row}"
)
