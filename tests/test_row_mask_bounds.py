"""The bounds the CUDA kernels' row-mask tables are sized by (csrc/cuda/cta_patch.cuh
row_masks_fit), checked against the window rule itself (nbhd.reference.axis_windows) on random
axes: the union of the windows of ct consecutive in-group queries spans at most ct + K + s
positions, and the union of the inverse windows of ct consecutive keys at most ct + 2 K + 2 s.
A table sized by a bound that a geometry broke would make the kernel trap; this keeps the bound
honest for every stride, dilation and causal axis, without a GPU."""
import random

import pytest

from nbhd.reference import axis_windows


def windows_in_group(L, K, s, d, causal, g):
    """[start, end) in-group per in-group query of dilation group g"""
    keys, valid = axis_windows(L, K, s, d, causal)
    out = []
    for x in range(g, L, d):
        js = [int(k) // d for k, ok in zip(keys[x], valid[x]) if ok]
        out.append((min(js), max(js) + 1))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_row_mask_table_bounds(seed):
    rng = random.Random(seed)
    for _ in range(60):
        K = rng.randint(1, 24)
        s, d = rng.randint(1, K), rng.randint(1, 3)
        L = rng.randint(K * d, K * d + 60)
        causal = rng.random() < 0.3
        for g in range(d):
            win = windows_in_group(L, K, s, d, causal, g)
            n = len(win)
            inverse = [[i for i in range(n) if win[i][0] <= j < win[i][1]] for j in range(n)]
            for ct in (4, 8, 64):
                for first in range(0, n, ct):
                    last = min(first + ct, n) - 1
                    union = win[last][1] - win[first][0]
                    assert union <= ct + K + s, (L, K, s, d, causal, ct, first, union)
                    if inverse[first] and inverse[last]:
                        keys_union = inverse[last][-1] + 1 - inverse[first][0]
                        assert keys_union <= ct + 2 * K + 2 * s, (L, K, s, d, causal, ct, first, keys_union)
