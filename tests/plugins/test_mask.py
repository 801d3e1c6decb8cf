import pytest
import torch

from plugins.tree_attention.mask import mask_words, pack_mask, unpack_mask


@pytest.mark.parametrize("m", [1, 5, 31, 32, 33, 64, 65, 100])
def test_pack_unpack_roundtrip(m):
    g = torch.Generator().manual_seed(m)
    mask = torch.rand(3, 7, m, generator=g) < 0.5  # [3, 7, m]
    packed = pack_mask(mask)
    assert packed.dtype == torch.int32 and packed.shape == (3, 7, mask_words(m))
    assert torch.equal(unpack_mask(packed, m), mask)


def test_packed_layout_is_least_significant_bit_first():
    mask = torch.zeros(1, 40, dtype=torch.bool)
    mask[0, [0, 3, 31, 32, 39]] = True
    packed = pack_mask(mask)  # [1, 2]
    # word 0: bits 0, 3 and 31 (the sign bit: negative int32); word 1: bits 0 and 7.
    assert packed.tolist() == [[1 + 8 - 2**31, 1 + 128]]


def test_mask_words():
    assert [mask_words(n) for n in (0, 1, 32, 33, 64, 65)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="n must be >= 0"):
        mask_words(-1)


def test_bad_inputs_are_rejected():
    with pytest.raises(TypeError, match="mask must be bool"):
        pack_mask(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        unpack_mask(torch.zeros(2, 1, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="expected 2 for m=33"):
        unpack_mask(torch.zeros(2, 1, dtype=torch.int32), 33)


def test_masks_stay_on_their_device():
    # The bit weights / shifts are built where the mask lives: gpu-check's first run on an H200 failed in the
    # reference (unpack_mask on a CUDA mask with CPU shifts). Meta tensors hit the same device check on the CPU.
    mask = torch.ones(3, 40, dtype=torch.bool, device="meta")  # [N, m]
    assert pack_mask(mask).device.type == "meta"
    assert unpack_mask(torch.zeros(3, 2, dtype=torch.int32, device="meta"), 40).device.type == "meta"
