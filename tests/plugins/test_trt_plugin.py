"""The TensorRT plugin module without TensorRT: lazy import, clear errors, and the ahead-of-time PTX it would
hand to TensorRT (compiled here for sm_90 by Triton's own compiler, no GPU needed)."""

import importlib.util
import re
import subprocess
import sys

import pytest
import torch

from plugins.tree_attention.launch import AOT_TACTIC_BLOCK_M, SCALAR_ARGS
from plugins.tree_attention.trt_plugin import TensorRTUnavailableError, register_trt_plugin

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def test_importing_the_plugin_module_imports_neither_tensorrt_nor_triton():
    code = "import sys, plugins.tree_attention.trt_plugin; print(sorted(m for m in ('tensorrt', 'triton') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
def test_register_without_tensorrt_names_what_is_missing():
    with pytest.raises(TensorRTUnavailableError, match=r"`tensorrt` Python package \(>= 10\.9"):
        register_trt_plugin(arch=90)


def entry_param_types(ptx: str, entry: str) -> list[str]:
    body = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)", ptx, re.S).group(1)
    return re.findall(r"\.param\s+\.(\w+)", body)


@pytest.fixture(scope="module")
def kernel_module():
    triton = pytest.importorskip("triton")
    from plugins.tree_attention import kernel

    if not isinstance(kernel.tree_attention_kernel, triton.runtime.JITFunction):
        pytest.skip("TRITON_INTERPRET is set for the whole process: no compiled kernels to test")
    return kernel


def test_aot_kernel_abi(kernel_module):
    """TensorRT launches with: input pointers (q, k, v, tree_mask), the int scalars, the output pointer, and
    null for any parameter it was not given (Triton's hidden scratch pointers, which must then be unused)."""
    aot = kernel_module.compile_aot(torch.float16, 128, 128**-0.5, arch=90, block_m=AOT_TACTIC_BLOCK_M[1])
    types = entry_param_types(aot.ptx, aot.name)
    assert aot.name == "tree_attention_kernel" and aot.num_params == len(types)
    visible = 4 + len(SCALAR_ARGS) + 1
    assert types[:4] == ["u64"] * 4
    assert types[4 : 4 + len(SCALAR_ARGS)] == ["u32"] * len(SCALAR_ARGS)
    assert types[4 + len(SCALAR_ARGS)] == "u64"
    assert types[visible:] == ["u64"] * (len(types) - visible) and len(types) - visible <= 2  # scratch pointers
    assert aot.shared_mem <= kernel_module.MAX_STATIC_SHARED and 32 <= aot.num_warps * 32 <= 1024
    assert f".target sm_{aot.arch}" in aot.ptx


def test_aot_rejects_unsupported_requests(kernel_module):
    from plugins.tree_attention.launch import LaunchConfigError
    from plugins.tree_attention.spec import TreeAttentionDtypeError

    with pytest.raises(TreeAttentionDtypeError, match="fp16, bf16 or fp32"):
        kernel_module.compile_aot(torch.float64, 64, 0.1, arch=90)
    with pytest.raises(LaunchConfigError, match="scale must be finite"):
        kernel_module.compile_aot(torch.float16, 64, float("nan"), arch=90)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tactic", sorted(AOT_TACTIC_BLOCK_M))
def test_every_plugin_specialisation_compiles_within_limits(kernel_module, dtype, head_dim, tactic):
    aot = kernel_module.compile_aot(dtype, head_dim, head_dim**-0.5, arch=90, block_m=AOT_TACTIC_BLOCK_M[tactic])
    assert aot.shared_mem <= kernel_module.MAX_STATIC_SHARED
    assert aot.tiles.block_m == AOT_TACTIC_BLOCK_M[tactic]


@pytest.mark.slow
def test_scale_is_baked_into_the_ptx(kernel_module):
    a = kernel_module.compile_aot(torch.float16, 64, 0.125, arch=90, block_m=16)
    b = kernel_module.compile_aot(torch.float16, 64, 0.25, arch=90, block_m=16)
    assert a.ptx != b.ptx


def test_compiled_kernel_refuses_cpu_tensors(kernel_module):
    from plugins.tree_attention.spec import TreeAttentionDeviceError

    q, k, v = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16)
    with pytest.raises(TreeAttentionDeviceError, match="needs CUDA tensors"):
        kernel_module.tree_attention_triton(q, k, v, torch.ones(1, 2, 1, dtype=torch.int32), 0.25)
