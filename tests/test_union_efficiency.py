"""bench/union_efficiency.py: the TMA forward's tiles compute at least the exact union of each
warpgroup's half of a patch (its share of useful products never exceeds that union's), and
exactly the window where a patch's queries share one window whose last-axis width is a row
width (the strided problems); its row table is the kernel's; the keys each patch loads, counted
by hand on small grids."""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import union_efficiency as ue  # noqa: E402


@pytest.mark.parametrize("name,ext,ks,st", ue.PROBLEMS, ids=[p[0] for p in ue.PROBLEMS])
def test_tma_rows_cover_the_union(name, ext, ks, st):
    # each warpgroup's half of a 128-query patch is the 64-query patch
    patch, half = ue.PATCHES[0][1][len(ext) - 1], ue.PATCHES[1][1][len(ext) - 1]
    exact, tma = ue.efficiency(ext, ks, st, half), ue.tma_efficiency(ext, ks, st, patch)
    assert 0 < tma <= exact + 1e-12
    if "stride" in name:
        assert tma == pytest.approx(1.0)


def test_tma_row_width_hand_count():
    # 2-D 20x20, window 5x5, patch 16x8: along the last axis patches of 8, 8 and 4 queries see
    # unions of 10, 12 and 6 keys, so rows are 16 wide, 8 to a tile; along the first axis the
    # patch of 16 queries sees rows [0, 18), 3 tiles of 8 rows, its halves [0, 10) (tiles 0-1)
    # and [6, 18) (tiles 0-2); the patch of 4 sees rows [14, 20): 1 tile
    useful = (20 * 5) ** 2
    computed = (8 * 2 * 8 + 8 * 3 * 8 + 4 * 1 * 8) * (8 + 8 + 4) * 16
    assert ue.tma_efficiency((20, 20), (5, 5), (1, 1), (16, 8)) == pytest.approx(useful / computed)


def test_tma_rows_mirror_the_kernel():
    # union_efficiency.py mirrors fna_wgmma_tma.cu's TMA_ROWS: the same (row keys, rows) pairs
    src = (Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "fna_wgmma_tma.cu").read_text()
    table = re.search(r"TMA_ROWS\[\]\[2\] = \{(.*?)\};", src, re.S).group(1)
    pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+), (\d+)\}", table)]
    assert pairs == ue.TMA_ROWS


def test_loaded_keys_hand_count():
    # 1-D 10 tokens, window 3, patches of 4: unions [0, 5), [3, 9), [7, 10): 14 keys for 10
    # queries; the TMA forward's one patch of 128 loads one run of 128 keys
    assert ue.loaded_keys((10,), (3,), (1,), (4,)) == pytest.approx(1.4)
    assert ue.tma_loaded_keys((10,), (3,), (1,), (128,)) == pytest.approx(12.8)
    # 2-D 20x20, window 5x5, patch 16x8 (as above): union boxes (18 + 6) x (10 + 12 + 6) keys;
    # the TMA forward's rows of 16 keys, 8 to a tile: 18 rows -> 3 tiles, 6 -> 1, per each of
    # the three patches along the last axis
    assert ue.loaded_keys((20, 20), (5, 5), (1, 1), (16, 8)) == pytest.approx(24 * 28 / 400)
    assert ue.tma_loaded_keys((20, 20), (5, 5), (1, 1), (16, 8)) == pytest.approx((24 + 8) * 16 * 3 / 400)
