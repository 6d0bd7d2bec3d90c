"""bench/union_efficiency.py: the TMA forward's tiles compute at least each patch's exact union
(its share of useful products never exceeds the union's), and exactly the window where a
patch's queries share one window whose last-axis width is a row width (the strided problems)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import union_efficiency as ue  # noqa: E402


@pytest.mark.parametrize("name,ext,ks,st", ue.PROBLEMS, ids=[p[0] for p in ue.PROBLEMS])
def test_tma_rows_cover_the_union(name, ext, ks, st):
    patch = ue.PATCHES[0][1][len(ext) - 1]
    exact, tma = ue.efficiency(ext, ks, st, patch), ue.tma_efficiency(ext, ks, st, patch)
    assert 0 < tma <= exact + 1e-12
    if "stride" in name:
        assert tma == pytest.approx(1.0)


def test_tma_row_width_hand_count():
    # 2-D 20x20, window 5x5, patch 16x8: along the last axis patches of 8, 8 and 4 queries see
    # unions of 10, 12 and 6 keys, so rows are 24 wide, 4 to a tile; along the first axis
    # patches of 16 and 4 queries see 18 and 6 rows: 5 and 2 tiles of 4 rows
    useful = (20 * 5) ** 2
    computed = (16 * 5 * 4 + 4 * 2 * 4) * (8 + 8 + 4) * 24
    assert ue.tma_efficiency((20, 20), (5, 5), (1, 1), (16, 8)) == pytest.approx(useful / computed)
