"""What this CPU runs: its instruction-set features, read once, and the routes that follow from them.

Every CPU-specific route is chosen here, from features, never assumed:
- `native_bf16`: the CPU multiplies bfloat16 in hardware (AVX512_BF16 or AMX-BF16). Without it torch emulates bf16
  matmuls, ~10-20x slower than float32 (measured with torch's AVX2 kernels, a [4, 576] x [576, 1536] matmul), so
  bfloat16 is worth running only through our weight-streaming kernel, or natively (plugins/stream_linear
  `bf16_missing`, the rule `dtype: auto` follows);
- `onednn_bf16`: torch's oneDNN takes bf16 weights (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): packed bf16 weights
  (runtime/model.py `PackedWeight`);
- `march`: what the C kernels (plugins/native_build.py) are compiled for: `-march=native`, or the forced level's
  target. Inside them, AVX-512 / AVX512-BF16 routes are chosen by the compiler's own macros, portable loops elsewhere.

Forcing a lower level on any machine (`SPECTREE_CPU_ISA=avx2`): the features above AVX2 are masked, so this
process takes every route an AVX2-only CPU (AMD Zen 3: AVX2 and FMA, no AVX-512, no native bf16) takes, and the C
kernels are built for `-march=x86-64-v3`. torch's own kernels read their switches when torch loads, so they must be
in the environment from the start: `python -m plugins.cpu --env avx2` prints all three (`.ci/run` runs the suite
that way). A torch limited to AVX2 by its own switch (`ATEN_CPU_CAPABILITY=avx2`) counts as such a level too: its
oneDNN then refuses bf16 weights, as on the real CPU.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

ISA_ENV = "SPECTREE_CPU_ISA"


@dataclass(frozen=True)
class Level:
    """A forced instruction-set level: the compiler target, the flags it masks, torch's matching switches."""

    march: str
    masked_prefixes: tuple[str, ...]  # /proc/cpuinfo flags starting with these are taken away
    torch_env: tuple[tuple[str, str], ...]  # read by torch when it loads (ATen's dispatch, oneDNN's ISA cap)


LEVELS = {
    "avx2": Level(
        march="x86-64-v3",  # AVX2, FMA, BMI1/2, F16C, MOVBE: what every AVX2 CPU since Haswell / Zen 1 has
        masked_prefixes=("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma", "avx10"),
        torch_env=(("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")),
    ),
}
# torch.backends.cpu.get_cpu_capability() values below AVX-512 on x86, and the level they amount to
_TORCH_BELOW_AVX512 = {"AVX2": "avx2", "DEFAULT": "avx2"}


class CpuLevelError(ValueError):
    """SPECTREE_CPU_ISA names no known level."""


@dataclass(frozen=True)
class CpuFeatures:
    """This CPU's features as the process uses them (masked by a forced level)."""

    flags: frozenset[str]  # /proc/cpuinfo names: avx2, fma, avx512f, avx512_bf16, amx_bf16, ...
    machine: str  # platform.machine()
    forced: str | None  # the level forced (SPECTREE_CPU_ISA, or torch's own switch), None: the CPU's own
    why_forced: str | None = None  # what forced it, in words

    def has(self, *names: str) -> bool:
        return all(n in self.flags for n in names)

    @property
    def avx2(self) -> bool:
        return self.has("avx2", "fma")

    @property
    def avx512(self) -> bool:
        return self.has("avx512f", "avx512bw", "avx512vl", "avx512dq")

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls in hardware: AVX512_BF16 (AMD Zen 4+, Intel Cooper Lake+) or AMX-BF16 (Sapphire Rapids+)."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def onednn_bf16(self) -> bool:
        """What torch's oneDNN asks of a CPU before it takes bf16 weights."""
        return self.avx512 or self.has("avx_ne_convert")

    @property
    def march(self) -> str:
        """The C kernels' compiler target."""
        return LEVELS[self.forced].march if self.forced else "native"

    @property
    def row(self) -> str:
        """This CPU's row of the README's CPU support table."""
        if self.has("amx_bf16"):
            return "AMX"
        if self.has("avx512_bf16"):
            return "AVX-512 + BF16"
        if self.avx512:
            return "AVX-512"
        if self.avx2:
            return "AVX2"
        return "x86-64 (no AVX2)" if self.machine in ("x86_64", "AMD64") else self.machine

    @property
    def _forced(self) -> str:
        return f", forced by {self.why_forced}" if self.forced else ""

    def missing_bf16(self) -> str:
        """Why bfloat16 is not native here, in one line."""
        return f"this CPU ({self.row}{self._forced}) has neither AVX512_BF16 nor AMX-BF16"

    def describe(self) -> str:
        """One line: the row, what forced it, whether bf16 is in hardware and the kernels' target."""
        return (f"CPU: {self.row}{self._forced}; bf16 "
                f"{'in hardware' if self.native_bf16 else 'not in hardware (no AVX512_BF16 / AMX-BF16)'}; "
                f"C kernels -march={self.march}")


def _cpuinfo_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _torch_level() -> str | None:
    """The level torch's own kernels are held to (ATEN_CPU_CAPABILITY), where it is below AVX-512 on an x86 CPU
    that has AVX-512; None otherwise."""
    import torch

    return _TORCH_BELOW_AVX512.get(torch.backends.cpu.get_cpu_capability())


@functools.lru_cache(maxsize=1)
def features() -> CpuFeatures:
    """This process's CPU features (read once)."""
    flags, machine = _cpuinfo_flags(), platform.machine()
    asked = os.environ.get(ISA_ENV, "").strip().lower()
    if asked in ("", "native"):
        level, why = None, None
    elif asked in LEVELS:
        level, why = asked, f"{ISA_ENV}={asked}"
    else:
        raise CpuLevelError(f"{ISA_ENV}={os.environ[ISA_ENV]!r}: expected one of native, {', '.join(LEVELS)}")
    if level is None and any(f.startswith("avx512") for f in flags):
        level = _torch_level()
        why = None if level is None else "torch's ATEN_CPU_CAPABILITY"
    if level is not None:
        masked = LEVELS[level].masked_prefixes
        flags = frozenset(f for f in flags if not f.startswith(masked))
    return CpuFeatures(flags, machine, level, why)


def forced_env(level: str) -> dict[str, str]:
    """Every environment variable that makes a process run at `level` (set before torch loads)."""
    if level not in LEVELS:
        raise CpuLevelError(f"level {level!r}: expected one of {', '.join(LEVELS)}")
    return {ISA_ENV: level, **dict(LEVELS[level].torch_env)}


__all__ = ["CpuFeatures", "CpuLevelError", "ISA_ENV", "LEVELS", "Level", "features", "forced_env"]
