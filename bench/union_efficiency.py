"""Tile waste of the kernels' query patches (docs/kernels.md §1): the share of the products a
patch computes over the exact union box of its windows that are real (query, key) neighbour
pairs. A property of the window rule and the patch shape, not a measurement: no kernel runs.

Per axis the window rule (docs/design.md §1) gives each query's key range; a patch is a box of
queries, so both its real pairs and its union box factor over the axes:
  useful   = prod_axes sum_{patch queries on the axis} |window|
  computed = prod_axes (patch queries on the axis) * |union of their windows|
summed over every patch of the grid (border patches clipped to the grid). The patches are the
CUDA kernels' (csrc/cuda/mma_util.cuh patch_*); the fast CPU kernels compute only real pairs on
interior patches (docs/design.md §5.2), so they have no row here. The last column is what the
Hopper TMA forward computes on its 128-query patches (csrc/cuda/fna_wgmma_tma.cu): in 1-D runs
of 128 keys; in 2-D and 3-D tiles of R rows of RS keys along the last axis, RS the first row
width of TMA_ROWS that holds the widest union there, so that keys past a patch's union count
as computed too; each of its two warpgroups (the halves of the patch along the first axis)
computes the tiles that hold its own union's rows.

A second table counts what the patches load rather than compute: the keys of K and V that a
patch's CTA reads (its union box; the TMA forward's whole row tiles over the patch's union,
shared by its two warpgroups) per query of the grid. At D = 128 in bf16 a key is 512 bytes of
K and V and a query another 512 of Q and O, so a forward moves B * H * N * (keys + 1) * 512
bytes through L2 at least (docs/kernels.md §1).

    python bench/union_efficiency.py
"""


def window(L, K, s, causal, i):
    """In-group key range [start, end) of query i on an axis of length L (dilation 1)."""
    q = i // s
    if causal:
        leader = min(q * s + s - 1, L - 1)
        return max(leader - K + 1, 0), i + 1
    leader = min(q * s + s // 2, L - 1)
    start = max(min(leader - K // 2, L - K), 0)
    return start, start + K


def axis_patches(L, K, s, n):
    """[(queries, union start, union end, useful)] of the patches of n queries along one axis."""
    out = []
    for p0 in range(0, L, n):
        rows = [window(L, K, s, False, i) for i in range(p0, min(p0 + n, L))]
        out.append((len(rows), min(b for b, _ in rows), max(e for _, e in rows), sum(e - b for b, e in rows)))
    return out


TMA_ROWS = [(16, 8), (24, 6), (32, 5), (48, 2), (64, 2), (80, 2), (96, 1), (128, 1)]  # fna_wgmma_tma.cu


def first_axis_halves(L, K, s, n):
    """[(union start, union end, [(queries, start, end) per warpgroup])] of the patches of n
    queries along the first axis, each split into two warpgroups' halves of n / 2."""
    halves = axis_patches(L, K, s, n // 2)
    return [(min(b for _, b, _, _ in pair), max(e for _, _, e, _ in pair), [(q, b, e) for q, b, e, _ in pair])
            for pair in (halves[i:i + 2] for i in range(0, len(halves), 2))]


def tma_tiles(axes):
    """(RS, R, middle) of the TMA forward's 2-D or 3-D tiles over axes (axis_patches per axis):
    rows of RS keys, the first width of TMA_ROWS that holds the widest union along the last
    axis, R to a tile; middle, the patches of the axis between the first and the last (the union
    rows per first-axis coordinate: e - b; one in 2-D)."""
    rs, r = next(c for c in TMA_ROWS if max(e - b for _, b, e, _ in axes[-1]) <= c[0])
    return rs, r, axes[1] if len(axes) == 3 else [(1, 0, 1, 0)]


def tma_efficiency(extent, kernel, stride, patch):
    """Useful share of what the TMA forward computes (module docstring): each warpgroup the tiles
    from the one holding its half's first union row along the first axis to the one holding
    its last."""
    axes = [axis_patches(L, K, s, n) for L, K, s, n in zip(extent, kernel, stride, patch)]
    useful = 1
    for a in axes:
        useful *= sum(u for *_, u in a)
    first = first_axis_halves(extent[0], kernel[0], stride[0], patch[0])
    if len(axes) == 1:
        return useful / sum(q * (-(-(e - lo) // 128) - (b - lo) // 128) * 128
                            for lo, _, halves in first for q, b, e in halves)
    rs, r, middle = tma_tiles(axes)
    computed = 0
    for lo, hi, halves in first:
        for q1, b1, e1, _ in middle:
            unit = e1 - b1
            tiles = -(-(hi - lo) * unit // r)
            for q0, b, e in halves:
                walked = min(tiles, -(-(e - lo) * unit // r)) - (b - lo) * unit // r
                computed += q0 * q1 * sum(q for q, *_ in axes[-1]) * walked * r * rs
    return useful / computed


def loaded_keys(extent, kernel, stride, patch):
    """Keys of K and V that the CTAs of patches `patch` load per query of the grid: each patch
    its exact union box (the CUDA kernels' walk)."""
    keys = 1
    for L, K, s, n in zip(extent, kernel, stride, patch):
        keys *= sum(e - b for _, b, e, _ in axis_patches(L, K, s, n)) / L
    return keys


def tma_loaded_keys(extent, kernel, stride, patch):
    """Keys the TMA forward loads per query of the grid: per 128-query patch the tiles over its
    union (in 1-D runs of 128 keys from the union's start; in 2-D and 3-D rows of RS keys, R to a
    tile, over the union's rows on the leading axes)."""
    axes = [axis_patches(L, K, s, n) for L, K, s, n in zip(extent, kernel, stride, patch)]
    queries = 1
    for L in extent:
        queries *= L
    if len(axes) == 1:
        return sum(-(-(e - b) // 128) * 128 for _, b, e, _ in axes[0]) / queries
    rs, r, middle = tma_tiles(axes)
    rows = sum(-(-(e0 - b0) * (e1 - b1) // r) * r for _, b0, e0, _ in axes[0] for _, b1, e1, _ in middle)
    return rows * rs * len(axes[-1]) / queries


def axis_totals(L, K, s, n):
    """(useful, computed) summed over the patches of n queries along one axis."""
    patches = axis_patches(L, K, s, n)
    return sum(u for *_, u in patches), sum(q * (e - b) for q, b, e, _ in patches)


def efficiency(extent, kernel, stride, patch):
    useful = computed = 1
    for L, K, s, n in zip(extent, kernel, stride, patch):
        u, c = axis_totals(L, K, s, n)
        useful, computed = useful * u, computed * c
    return useful / computed


PROBLEMS = [  # name, extent, kernel, stride
    ("1-D 32768, window 2048", (32768,), (2048,), (1,)),
    ("2-D 128x128, window 13x13", (128, 128), (13, 13), (1, 1)),
    ("2-D 64x64, window 7x7", (64, 64), (7, 7), (1, 1)),
    ("2-D 56x56, window 7x7", (56, 56), (7, 7), (1, 1)),
    ("3-D 16x32x32, window 7x7x7", (16, 32, 32), (7, 7, 7), (1, 1, 1)),
    ("3-D 8x24x24, window 5x5x5", (8, 24, 24), (5, 5, 5), (1, 1, 1)),
    ("2-D 256x256, window 80x80", (256, 256), (80, 80), (1, 1)),
    ("2-D 256x256, window 80x80, stride 16x16", (256, 256), (80, 80), (16, 16)),
    ("3-D 30x48x80, window 18x24x24", (30, 48, 80), (18, 24, 24), (1, 1, 1)),
    ("3-D 30x48x80, window 18x24x24, stride 16x8x8", (30, 48, 80), (18, 24, 24), (16, 8, 8)),
]
PATCHES = [  # name, patch per rank (1-D, 2-D, 3-D)
    ("CUDA CTA, 128 queries", [(128,), (16, 8), (8, 4, 4)]),
    ("CUDA CTA, 64 queries", [(64,), (8, 8), (4, 4, 4)]),
    ("CUDA warp m-block, 16", [(16,), (2, 8), (1, 4, 4)]),
]


def table(title, per_patch, tma, cell):
    """One table: per problem per_patch(...) for each of PATCHES, then tma(...) on 128-query
    patches, each cell formatted by cell."""
    print(title)
    print(f"{'problem':48s}" + "".join(f"{name:>26s}" for name, _ in PATCHES) + f"{'TMA rows, 128 queries':>26s}")
    for name, ext, ks, st in PROBLEMS:
        cells = [per_patch(ext, ks, st, shapes[len(ext) - 1]) for _, shapes in PATCHES]
        cells.append(tma(ext, ks, st, PATCHES[0][1][len(ext) - 1]))
        print(f"{name:48s}" + "".join(cell(c) for c in cells))


def main():
    table("useful share of the products over each patch's exact union box (last: the TMA forward's tiles)",
          efficiency, tma_efficiency, lambda c: f"{100 * c:25.0f}%")
    print()
    table("keys of K and V loaded per query of the grid (last: the TMA forward's tiles)",
          loaded_keys, tma_loaded_keys, lambda c: f"{c:26.1f}")


if __name__ == "__main__":
    main()
