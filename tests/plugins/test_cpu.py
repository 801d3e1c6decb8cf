"""plugins/cpu/: features read from the CPU, a forced level masking them, and the dtype choice that follows
(runtime.config.choose_dtype)."""

import subprocess
import sys
import warnings

import pytest
import torch

from plugins import cpu, native_build
from plugins.stream_linear import native as stream_linear
from runtime.config import AUTO, choose_dtype
from runtime.errors import ConfigError

ZEN3 = frozenset("sse2 avx avx2 fma f16c bmi2 movbe".split())
ZEN4 = ZEN3 | frozenset("avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni".split())
SAPPHIRE = ZEN4 | frozenset("amx_tile amx_bf16 amx_int8 avx_vnni".split())
SKYLAKE = ZEN3 | frozenset("avx512f avx512bw avx512vl avx512dq".split())


def _features(flags, forced=None):
    return cpu.CpuFeatures(frozenset(flags), "x86_64", forced, None if forced is None else f"SPECTREE_CPU_ISA={forced}")


@pytest.fixture
def fresh(monkeypatch):
    """features() read again under the test's environment (and again after it)."""
    cpu.features.cache_clear()
    yield monkeypatch
    cpu.features.cache_clear()


@pytest.mark.parametrize("flags,row,bf16,onednn", [
    (SAPPHIRE, "AMX", True, True),
    (ZEN4, "AVX-512 + BF16", True, True),
    (SKYLAKE, "AVX-512", False, True),
    (ZEN3, "AVX2", False, False),
    ({"sse2"}, "x86-64 (no AVX2)", False, False),
])
def test_rows_and_routes_follow_the_flags(flags, row, bf16, onednn):
    f = _features(flags)
    assert (f.row, f.native_bf16, f.onednn_bf16, f.march) == (row, bf16, onednn, "native")
    assert ("bf16 in hardware" in f.describe()) == bf16


def test_the_forced_level_masks_everything_above_avx2(fresh):
    fresh.setattr(cpu, "_cpuinfo_flags", lambda: SAPPHIRE)
    fresh.setenv(cpu.ISA_ENV, "avx2")
    f = cpu.features()
    assert f.flags == ZEN3 and f.row == "AVX2" and not f.native_bf16 and not f.onednn_bf16
    assert f.march == "x86-64-v3" and "forced by SPECTREE_CPU_ISA=avx2" in f.describe()
    assert "neither AVX512_BF16 nor AMX-BF16" in f.missing_bf16()


def test_without_the_variable_the_cpu_is_taken_as_it_is(fresh):
    fresh.setattr(cpu, "_cpuinfo_flags", lambda: SAPPHIRE)
    fresh.setattr(cpu, "_torch_level", lambda: None)
    for value in (None, "native", " NATIVE "):
        if value is None:
            fresh.delenv(cpu.ISA_ENV, raising=False)
        else:
            fresh.setenv(cpu.ISA_ENV, value)
        cpu.features.cache_clear()
        assert cpu.features().flags == SAPPHIRE and cpu.features().forced is None


def test_torch_held_to_avx2_counts_as_the_forced_level(fresh):
    fresh.delenv(cpu.ISA_ENV, raising=False)
    fresh.setattr(cpu, "_cpuinfo_flags", lambda: SAPPHIRE)
    fresh.setattr(cpu, "_torch_level", lambda: "avx2")
    f = cpu.features()
    assert f.forced == "avx2" and not f.native_bf16 and "ATEN_CPU_CAPABILITY" in f.describe()


def test_an_unknown_level_is_named(fresh):
    fresh.setenv(cpu.ISA_ENV, "sse9")
    with pytest.raises(cpu.CpuLevelError, match=r"SPECTREE_CPU_ISA='sse9': expected one of native, avx2"):
        cpu.features()
    with pytest.raises(cpu.CpuLevelError, match="level 'sse9'"):
        cpu.forced_env("sse9")


def test_the_forced_environment_is_one_list():
    env = cpu.forced_env("avx2")
    assert env == {"SPECTREE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-m", "plugins.cpu", "--env", "avx2"], capture_output=True, text=True,
                         check=True).stdout.split()
    assert dict(line.split("=", 1) for line in out) == env


def test_the_cli_says_which_row_this_machine_is():
    out = subprocess.run([sys.executable, "-m", "plugins.cpu"], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"CPU: {cpu.features().row}") and "\ndtype auto -> " in out
    bad = subprocess.run([sys.executable, "-m", "plugins.cpu"], capture_output=True, text=True,
                         env={"SPECTREE_CPU_ISA": "mmx", "PATH": ""})
    assert bad.returncode == 2 and "SPECTREE_CPU_ISA='mmx'" in bad.stderr and "Traceback" not in bad.stderr


# ---- the dtype that follows ----------------------------------------------------------------------------------


@pytest.fixture(params=["native", "avx2", "avx2-no-compiler"])
def machine(request, monkeypatch):
    """choose_dtype on a CPU with native bf16, on an AVX2 one, and on an AVX2 one where the weight-streaming kernel
    did not build (no C compiler): only there is bfloat16 slow."""
    f = _features(SAPPHIRE) if request.param == "native" else _features(ZEN3)
    monkeypatch.setattr(cpu, "features", lambda: f)
    if request.param == "avx2-no-compiler":

        monkeypatch.setenv("CC", "/nonexistent/cc")
        monkeypatch.setattr(stream_linear, "_library", native_build.Lazy(stream_linear._build))
    elif stream_linear.load() is None:
        pytest.skip(f"the weight-streaming kernel does not build here: {stream_linear.unavailable()}")
    return request.param


def test_auto_is_bfloat16_wherever_bf16_runs_fast(machine):
    choice = choose_dtype(AUTO, "float32")
    fast = machine != "avx2-no-compiler"
    assert choice.dtype == ("bfloat16" if fast else "float32") and choice.requested == AUTO
    if machine == "avx2":
        assert "weight-streaming kernel (AVX2)" in choice.reason
    if not fast:
        assert "did not build" in choice.reason and "neither AVX512_BF16 nor AMX-BF16" in choice.reason
    assert choose_dtype(AUTO, "bfloat16", runs_here=False).dtype == choice.dtype  # chosen for this machine


def test_a_bfloat16_checkpoint_by_default_runs_as_float32_only_where_bf16_is_slow(machine):
    choice = choose_dtype(None, "bfloat16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice.warn_if_demoted("ckpt")
    if machine != "avx2-no-compiler":
        assert choice.dtype == "bfloat16" and not choice.demoted and not caught
    else:
        assert choice.dtype == "float32" and choice.demoted
        assert len(caught) == 1 and "ckpt: the checkpoint's bfloat16 runs as float32" in str(caught[0].message)
    assert choose_dtype(None, "float16").dtype == "float16"  # only bfloat16 is demoted
    assert choose_dtype(None, "bfloat16", runs_here=False).dtype == "bfloat16"  # a conversion keeps it


def test_asking_for_bfloat16_where_it_is_slow_is_refused_by_name(machine):
    if machine != "avx2-no-compiler":
        assert choose_dtype("bf16", "float32").dtype == "bfloat16"
        return
    with pytest.raises(ConfigError, match=r"dtype 'bfloat16' needs a CPU that multiplies bf16 natively or the "
                                          r"weight-streaming kernel.*did not build.*AVX2.*neither AVX512_BF16 nor "
                                          r"AMX-BF16.*expected dtype 'auto' or 'float32'"):
        choose_dtype("bfloat16", "float32")
    assert choose_dtype("bfloat16", "float32", runs_here=False).dtype == "bfloat16"
    assert choose_dtype(torch.float32, "bfloat16").dtype == "float32"
    assert choose_dtype("bfloat16", "float32", device="meta").dtype == "bfloat16"  # not a CPU


# ---- the kernels' build at the forced level --------------------------------------------------------------------


def test_the_forced_level_builds_portable_kernels_that_say_so(fresh, tmp_path):
    fresh.setenv(cpu.ISA_ENV, "avx2")
    fresh.delenv(native_build.EMULATE_ENV, raising=False)
    fresh.setenv(native_build.CACHE_ENV, str(tmp_path))
    native_build.compiled_isa.cache_clear()
    try:
        from plugins.tree_attention import native

        lib, path, _ = native_build.build(native.SOURCE, "tree_attention")
        assert path.parent == tmp_path
        assert native_build.compiled_isa() == "AVX2"
        rounds = lib.spectree_rounds_weights
        assert rounds(64, 1) == 0  # no AVX512-BF16 route in an x86-64-v3 build
    finally:
        native_build.compiled_isa.cache_clear()


# ---- the AVX-512 routes emulated (SPECTREE_EMULATE) --------------------------------------------------------------


def _native_avx512() -> bool:
    native_build.compiled_isa.cache_clear()
    try:
        return native_build.compiled_isa().startswith("AVX-512") and native_build.emulation() is None
    finally:
        native_build.compiled_isa.cache_clear()


def test_emulation_builds_the_avx512_routes_and_says_so(fresh, tmp_path):
    fresh.delenv(native_build.EMULATE_ENV, raising=False)
    if _native_avx512():
        pytest.skip("this CPU runs the AVX-512 routes natively (the emulation refuses to build here)")
    fresh.setenv(native_build.EMULATE_ENV, "avx512-bf16")
    fresh.setenv(native_build.CACHE_ENV, str(tmp_path))
    native_build.compiled_isa.cache_clear()
    try:
        from plugins.stream_linear import native as stream
        from plugins.tree_attention import native

        lib, _, _ = native_build.build(native.SOURCE, "tree_attention", native.EXTRA_FLAGS)
        assert native_build.compiled_isa() == "AVX-512 + BF16 (emulated)"
        assert lib.spectree_rounds_weights(64, 1) == 1  # the AVX512-BF16 route, emulated
        assert lib.spectree_rounds_weights(64, 0) == 0
        slib, _, _ = native_build.build(stream.SOURCE, "stream_linear", stream.EXTRA_FLAGS)
        assert slib.spectree_stream_lanes() == 16 and slib.spectree_stream_panel() == 32
        fresh.setenv(native_build.EMULATE_ENV, "avx512")  # without BF16: the float32 route for bf16 too
        lib, _, _ = native_build.build(native.SOURCE, "tree_attention", native.EXTRA_FLAGS)
        assert lib.spectree_rounds_weights(64, 1) == 0
    finally:
        native_build.compiled_isa.cache_clear()


def test_emulation_refuses_an_unknown_name_and_a_cpu_with_avx512(fresh, tmp_path):
    from plugins.stream_linear import native as stream

    fresh.setenv(native_build.CACHE_ENV, str(tmp_path))
    fresh.setenv(native_build.EMULATE_ENV, "avx-512")
    with pytest.raises(ValueError, match=r"SPECTREE_EMULATE='avx-512': expected one of avx512, avx512-bf16"):
        native_build.build(stream.SOURCE, "stream_linear", stream.EXTRA_FLAGS)
    fresh.delenv(native_build.EMULATE_ENV)
    if not _native_avx512():
        return
    fresh.setenv(native_build.EMULATE_ENV, "avx512")
    with pytest.raises(RuntimeError, match="nothing to emulate"):
        native_build.build(stream.SOURCE, "stream_linear", stream.EXTRA_FLAGS)
