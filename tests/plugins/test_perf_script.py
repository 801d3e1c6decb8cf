import pytest
import torch

from perf import tree_attention_gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs for real")
def test_gpu_script_refuses_to_run_without_cuda(capsys):
    assert tree_attention_gpu.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_check_shapes_cover_the_required_edge_cases():
    shapes = tree_attention_gpu.CHECK_SHAPES
    assert any(prefix == 0 for _, _, _, _, prefix, _, _ in shapes)
    assert any(n == 1 for _, _, _, n, _, _, _ in shapes)
    assert any(n > 32 and n & (n - 1) for _, _, _, n, _, _, _ in shapes)
    assert any(prefix % 64 for _, _, _, _, prefix, _, _ in shapes)
    assert {hq // hkv for _, hq, hkv, *_ in shapes} >= {1, 2, 4, 7}
    assert tree_attention_gpu.BENCH_PREFIX == (512, 4096, 16384) and tree_attention_gpu.BENCH_TREE == (1, 16, 64)
