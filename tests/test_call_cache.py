"""A validated call's normalisation is reused only for a call validation would see the same:
every argument that differs in type, value, dtype, device, shape or strides is checked again."""
import pytest
import torch

import nbhd
from nbhd import functional


def test_reused_only_for_the_same_arguments():
    q = torch.randn(1, 8, 8, 2, 8)
    want = nbhd.na2d(q, q, q, 3)
    assert functional._CHECKED                          # the valid call was kept
    torch.testing.assert_close(nbhd.na2d(q, q, q, 3), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="stride"):
        nbhd.na2d(q, q, q, 3, stride=True)               # True == 1, but a bool is refused
    with pytest.raises(TypeError, match="kernel_size"):
        nbhd.na2d(q, q, q, 3.0)
    with pytest.raises(ValueError, match="dtype"):
        nbhd.na2d(q, q.double(), q, 3)
    with pytest.raises(ValueError, match="kernel_size"):
        nbhd.na2d(q[:, :2], q[:, :2], q[:, :2], 3)        # fewer tokens than the window
    strided = torch.randn(1, 8, 8, 2, 16)[..., ::2]      # same shape, other strides: checked, runs
    torch.testing.assert_close(nbhd.na2d(strided, strided, strided, 3),
                               nbhd.na2d(strided.contiguous(), strided.contiguous(), strided.contiguous(), 3),
                               rtol=0, atol=0)
