/*
 * cta_patch.cuh — one CTA's share of a problem, the description every tensor-core kernel
 * (fna_mma*.cu, fna_wgmma*.cu) starts from: its batch and head, a patch of in-group positions
 * (queries; keys in the dK/dV kernels) in one dilation group per axis, the exact union of the
 * patch's windows (key_box) and where each key of its walk is read from (docs/kernels.md).
 *
 * A patch is ct = wt * wc in-group positions per axis (mma_util.cuh patch_*): 16-row m-blocks
 * of shape wt stacked wc deep along axis 0, so row qr of the CTA is row qr % 16 of m-block
 * qr / 16. RANK > 0 fixes the shape at compile time (no run-time division by it); RANK 0 reads
 * it from the plan (the mma backward and forward+JVP, compiled once for every rank). Included
 * by mma_util.cuh after the window functions.
 */
#pragma once

/* The exact union of a CTA's windows: per axis the in-group range [lo, lo + cnt) from the
 * start of its first query to the end of its last (starts and ends never decrease along an
 * axis), walked row-major: walk index n -> in-group key coordinates. Its queries are the
 * patch's inside [begin, end) (the group, or its query range). */
struct key_box {
    int lo[3], cnt[3];
    udiv32 d1, d2;  /* by cnt[1], cnt[2] */
    int total;      /* keys in the box; 0 without a window */
};

template <typename I>
__device__ __forceinline__ key_box key_box_of(const nbhd_geometry &g, const I i0[3], const int ct[3],
                                              const I Lg[3], const I begin[3], const I end[3]) {
    key_box kb;
    int64_t total = g.has_window ? 1 : 0;
#pragma unroll
    for (int ax = 0; ax < 3; ++ax) {
        int64_t st, en, st2, en2;
        const int first = max((int)i0[ax], (int)begin[ax]);
        const int last = (int)min((int64_t)i0[ax] + ct[ax], (int64_t)end[ax]) - 1;
        window32(&g.axis[ax], first, Lg[ax], &st, &en);
        window32(&g.axis[ax], last, Lg[ax], &st2, &en2);
        kb.lo[ax] = (int)st;
        kb.cnt[ax] = max((int)(en2 - st), 1);
        total *= kb.cnt[ax];
    }
    kb.d1 = udiv32_of((uint32_t)kb.cnt[1]);
    kb.d2 = udiv32_of((uint32_t)kb.cnt[2]);
    kb.total = (int)total;
    return kb;
}

/* RANK < 3: the box is one key thick on the padded axes, whose coordinates stay 0 */
template <int RANK = 3>
__device__ __forceinline__ void key_box_at(const key_box &kb, int n, int j[3]) {
    if (RANK == 1) {
        j[0] = kb.lo[0] + n;
    } else if (RANK == 2) {
        const uint32_t q1 = udiv((uint32_t)n, kb.d1);
        j[1] = kb.lo[1] + (int)((uint32_t)n - q1 * (uint32_t)kb.cnt[1]);
        j[0] = kb.lo[0] + (int)q1;
    } else {
        const uint32_t q2 = udiv((uint32_t)n, kb.d2), q1 = udiv(q2, kb.d1);
        j[2] = kb.lo[2] + (int)((uint32_t)n - q2 * (uint32_t)kb.cnt[2]);
        j[1] = kb.lo[1] + (int)(q2 - q1 * (uint32_t)kb.cnt[1]);
        j[0] = kb.lo[0] + (int)q1;
    }
}

/* One (batch, head) of a [B, X, Y, Z, H, D] tensor in one dilation group: in-group element
 * (j0, j1, j2) at base + sum_a j_a step_a (steps in int by steps_fit, the sum in 64 bits: three
 * wide multiply-adds instead of five 64-bit products per address). */
template <typename T> struct group_ptr {
    T *base;
    int step[3];
    __device__ __forceinline__ T *at(int j0, int j1, int j2) const {
        return base + (int64_t)j0 * step[0] + (int64_t)j1 * step[1] + (int64_t)j2 * step[2];
    }
};

/* unit_step: full-axis coordinates (dilation ignored), e.g. every query of the extra keys */
template <typename T>
__device__ __forceinline__ group_ptr<T> group_ptr_of(const nbhd_tensor &t, const nbhd_geometry &g,
                                                     int64_t b, const int64_t grp[3], int64_t h,
                                                     bool unit_step = false) {
    group_ptr<T> p;
    p.base = (T *)t.data + b * t.stride[0] + grp[0] * t.stride[1] + grp[1] * t.stride[2] +
             grp[2] * t.stride[3] + h * t.stride[4];
#pragma unroll
    for (int a = 0; a < 3; ++a)
        p.step[a] = (int)(t.stride[a + 1] * (unit_step ? 1 : g.axis[a].dilation));
    return p;
}

/* load_kv_tile's default: nothing beside the coordinates */
struct no_key_out {
    __device__ __forceinline__ void operator()(int, bool, bool, const int (&)[3]) const {}
};

/* entry n of a tile's in-group coordinates [RANK][BN] (at dst): j, or KEY_NONE on axis 0 for a
 * position past the end (ok false) */
template <int RANK, int BN>
__device__ __forceinline__ void put_coords(int *dst, int n, bool ok, const int (&j)[3]) {
    dst[n] = ok ? j[0] : KEY_NONE;
#pragma unroll
    for (int ax = 1; ax < RANK; ++ax) dst[ax * BN + n] = j[ax];
}

/* Row masks of a 64-row query patch (one m-block per warp) in 2-D and 3-D: bit qr of a key's
 * 64-bit word says whether row qr sees the key, so that a kernel's mask is one bit test per
 * score instead of comparing the key's coordinates with the row's window on every axis
 * (docs/kernels.md §3). The rows are the patch box row-major (qr = (c0 ct1 + c1) ct2 + c2: the
 * m-blocks of patch_wt stacked along axis 0) and windows are products of per-axis ranges, so the
 * rows that see window key j are the AND over the axes of the rows whose coordinate's window
 * holds j[ax]: cta_patch::row_mask_table builds one entry per key-box position and axis once per
 * CTA, and a key's word is RANK shared loads. */
template <int RANK>
struct row_masks {
    /* entries of a table: the column box's extents summed over the axes (row_masks_fit); the
     * forward+JVP, whose two CTAs per SM leave it less shared memory, takes JVP_ENTRIES */
    static constexpr int ENTRIES = 192, JVP_ENTRIES = 64;
    /* rows per step of coordinate ax */
    __host__ __device__ static constexpr int step(int ax) {
        return ax == 0 ? patch_ct(RANK, 1) * patch_ct(RANK, 2) : ax == 1 ? patch_ct(RANK, 2) : 1;
    }
    /* the rows whose coordinate along ax is 0: runs of step(ax) rows, one per period of
     * step(ax) * ct rows (ax is a constant wherever this is called: the loops over axes unroll) */
    __host__ __device__ static constexpr uint64_t first_rows(int ax) {
        const int s = step(ax), p = s * patch_ct(RANK, ax);
        const uint64_t run = s >= 64 ? ~0ull : (1ull << s) - 1;
        return p >= 64 ? run : run * (~0ull / ((1ull << p) - 1));
    }
    /* the rows whose coordinate along ax is c */
    __device__ __forceinline__ static uint64_t rows_at(int ax, int c) { return first_rows(ax) << (c * step(ax)); }
};

/* Do row masks serve this problem (rank >= 2, no bias table: a bias needs the key coordinates)
 * and does a 64-row patch's table fit row_masks::ENTRIES? Bounds each
 * axis's box of columns: for query rows the union of ct windows, ct + K + s (their starts at most
 * ct + s - 2 apart); for key rows the union of ct keys' inverse windows, ct + 2 K + 2 s (an
 * inverse window holds at most K + s queries, and 1.5 K at a border; tests/test_row_mask_bounds.py
 * checks both against the window rule). The table's builder traps on a box beyond ENTRIES,
 * never overrunning it. */
__host__ __device__ inline bool row_masks_fit(const nbhd_geometry *g, int rank, bool key_rows = false,
                                              int entries = row_masks<3>::ENTRIES) {
    int64_t n = 0;
    for (int ax = 0; ax < rank; ++ax)
        n += patch_ct(rank, ax) + (key_rows ? 2 : 1) * (g->axis[ax].kernel + g->axis[ax].stride);
    return rank >= 2 && !g->rpb && n <= entries;
}

/* ROWS rows of one tensor (TWO: two) into shared tiles d1 (and d2) by cp.async over THREADS
 * threads, CPT 16-byte chunks per thread, a row's TPR threads taking adjacent chunks in each copy (whole
 * 32-byte sectors per row, not TPR half-used ones). rows(r, s1, s2, ok2): the sources of row
 * r and whether each is copied (else zeros, from a valid address); it returns the first's.
 * off(r, ch): the element offset of chunk ch of row r in a tile. */
template <typename T, int HD, int ROWS, int THREADS, bool TWO, typename Off, typename Rows>
__device__ __forceinline__ void load_row_tiles(int tid, T *d1, T *d2, Off off, Rows rows) {
    constexpr int CH = HD / 8, TPR = THREADS / ROWS, CPT = CH / TPR;
    const int r = tid / TPR;
    const T *s1, *s2;
    bool ok2;
    const bool ok = rows(r, s1, s2, ok2);
#pragma unroll
    for (int cc = 0; cc < CPT; ++cc) {
        const int ch = cc * TPR + tid % TPR, o = off(r, ch);  /* a row's TPR threads: adjacent chunks */
        cp_async16(smem_u32(d1 + o), s1 + ch * 8, ok);
        if (TWO) cp_async16(smem_u32(d2 + o), s2 + ch * 8, ok2);
    }
}

/* MB: 16-row m-blocks per warp of the 4-warp kernels (the patch is 64 * MB positions); SHAPE:
 * the 3-D m-block's (mma_util.cuh patch_wt) */
template <int RANK, int MB, int SHAPE = PATCH_CUBE>
struct cta_patch {
    int64_t b, hk;        /* batch; the kv head of a query patch */
    int h;                /* the patch's head: a query head, or the key head of a key patch */
    int64_t grp[3];       /* dilation group per axis */
    int i0[3], Lg[3];     /* first in-group position of the patch, group length */
    int Qb[3], Qe[3];     /* the patch's valid rows: a query patch's query range (nbhd.h), else [0, Lg) */
    key_box kb;           /* a query patch's keys (walk): the union of its windows */
    int win_tiles, tiles; /* tiles of the walk: the key box's, then the extra keys' */

    __device__ __forceinline__ static int wt(const mma_plan &P, int ax) {
        return RANK ? patch_wt(RANK, ax, SHAPE) : P.wt[ax];
    }
    __device__ __forceinline__ static int ct(const mma_plan &P, int ax) {
        return RANK ? patch_ct(RANK, ax, MB, SHAPE) : P.ct[ax];
    }

    /* patch index -> dilation group, first in-group position and group length per axis (the
     * last axis fastest); false: an empty slot (uniform over the CTA). A query patch (queries)
     * covers its group's query range: slots past its end are empty. The grid has
     * < 2^31 CTAs (nbhd_cuda_grid_fits) and the axes < 2^31 positions: 32-bit arithmetic. */
    __device__ __forceinline__ bool locate(const nbhd_geometry &g, const mma_plan &P, uint32_t patch,
                                           bool queries) {
        constexpr int AXES = RANK ? RANK : 3;
#pragma unroll
        for (int ax = 0; ax < 3; ++ax) grp[ax] = 0, i0[ax] = 0, Lg[ax] = 1, Qb[ax] = 0, Qe[ax] = 1;
#pragma unroll
        for (int ax = AXES - 1; ax >= 0; --ax) {
            const uint32_t ns = (uint32_t)P.slots[ax], slot = patch % ns;
            patch /= ns;
            const int d = g.axis[ax].dilation;
            grp[ax] = d == 1 ? 0 : (int)(slot % (uint32_t)d);
            Lg[ax] = d == 1 ? (int)g.axis[ax].extent : ((int)g.axis[ax].extent - (int)grp[ax] + d - 1) / d;
            Qb[ax] = 0;
            Qe[ax] = Lg[ax];
            if (queries) query_range32(&g.axis[ax], (int)grp[ax], Qb[ax], Qe[ax]);
            // patches stay where the whole grid's are (a stride group's queries share a patch
            // there), from the one holding the range's first query
            const int c = ct(P, ax);
            i0[ax] = (Qb[ax] / c + (d == 1 ? (int)slot : (int)(slot / (uint32_t)d))) * c;
            if (i0[ax] >= Qe[ax]) return false;
        }
        return true;
    }

    /* CTA (or a persistent CTA's item idx) -> (b, head h of `heads`, patch), patches fastest:
     * neighbouring CTAs take neighbouring patches of one head (their key boxes overlap in L2);
     * returns the patch */
    __device__ __forceinline__ uint32_t head_major(const mma_plan &P, uint32_t heads, uint32_t idx = blockIdx.x) {
        const uint32_t patches = (uint32_t)P.patches;
        const uint32_t patch = idx % patches;
        idx /= patches;
        h = (int)(idx % heads);
        b = idx / heads;
        return patch;
    }

    /* CTA -> (b, kv head, patch, query head of its group), the group fastest: the query heads
     * that share a kv head run side by side and read its keys from L2; returns the patch */
    __device__ __forceinline__ uint32_t group_major(const nbhd_geometry &g, const mma_plan &P) {
        uint32_t idx = blockIdx.x;
        const uint32_t group = (uint32_t)g.group, patches = (uint32_t)P.patches;
        const int hg = (int)(idx % group);
        idx /= group;
        const uint32_t patch = idx % patches;
        idx /= patches;
        hk = idx % (uint32_t)g.kv_heads;
        b = idx / (uint32_t)g.kv_heads;
        h = (int)hk * g.group + hg;
        return patch;
    }

    /* key patch of kv head h (the dK/dV kernels); false: an empty slot */
    __device__ __forceinline__ bool place_keys(const nbhd_geometry &g, const mma_plan &P) {
        const uint32_t patch = head_major(P, (uint32_t)g.kv_heads);
        hk = h;
        return locate(g, P, patch, false);
    }

    /* query patch of CTA (or item) idx, head-major, with its key walk in tiles of bn keys;
     * false: an empty slot */
    __device__ __forceinline__ bool place_queries(const nbhd_geometry &g, const mma_plan &P, int bn,
                                                  uint32_t idx = blockIdx.x) {
        const uint32_t patch = head_major(P, (uint32_t)g.heads, idx);
        hk = g.group == 1 ? h : h / g.group;
        if (!locate(g, P, patch, true)) return false;
        walk(g, P, bn);
        return true;
    }

    /* the exact union of a query patch's windows */
    __device__ __forceinline__ key_box keys(const nbhd_geometry &g, const mma_plan &P) const {
        const int c[3] = {ct(P, 0), ct(P, 1), ct(P, 2)};
        return key_box_of(g, i0, c, Lg, Qb, Qe);
    }

    /* the union of the patch's windows, walked in tiles of bn keys, then the extra keys */
    __device__ __forceinline__ void walk(const nbhd_geometry &g, const mma_plan &P, int bn) {
        kb = keys(g, P);
        win_tiles = (kb.total + bn - 1) / bn;
        tiles = win_tiles + (int)((g.extra_kv + bn - 1) / bn);
    }

    /* row qr of the CTA -> in-group coordinates; false outside the grid (a query patch: outside
     * the query range) */
    __device__ __forceinline__ bool row(const mma_plan &P, int qr, int iq[3]) const {
        return row_in(wt(P, 0), wt(P, 1), wt(P, 2), qr, iq);
    }
    __device__ __forceinline__ bool row(int qr, int iq[3]) const {
        static_assert(RANK > 0, "a run-time patch shape comes from the plan: row(P, qr, iq)");
        return row_in(patch_wt(RANK, 0, SHAPE), patch_wt(RANK, 1, SHAPE), patch_wt(RANK, 2, SHAPE), qr, iq);
    }
    __device__ __forceinline__ bool row_in(int w0, int w1, int w2, int qr, int iq[3]) const {
        const int mblock = qr >> 4, r = qr & 15;
        const int r2 = r % w2, r1 = (r / w2) % w1, r0 = r / (w1 * w2);
        iq[0] = i0[0] + mblock * w0 + r0;
        iq[1] = i0[1] + r1;
        iq[2] = i0[2] + r2;
        return iq[0] >= Qb[0] && iq[1] >= Qb[1] && iq[2] >= Qb[2] && iq[0] < Qe[0] && iq[1] < Qe[1] &&
               iq[2] < Qe[2];
    }

    /* a thread's fragment rows qr(hrow) = 16 w + lane / 4 + 8 hrow: validity, in-group
     * coordinates iq and windows [wst, wen) on the first AX axes (invalid rows: empty) */
    template <int AX>
    __device__ __forceinline__ void fragment_rows(const nbhd_geometry &g, const mma_plan &P, int w, int lane,
                                                  int (&wst)[2][AX], int (&wen)[2][AX], bool (&rvalid)[2],
                                                  int (&iq)[2][3]) const {
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            rvalid[hrow] = row(P, w * 16 + (lane >> 2) + 8 * hrow, iq[hrow]);
#pragma unroll
            for (int ax = 0; ax < AX; ++ax) {
                int64_t st = 0, en = 0;
                if (rvalid[hrow]) window32(&g.axis[ax], iq[hrow][ax], Lg[ax], &st, &en);
                wst[hrow][ax] = (int)st;
                wen[hrow][ax] = rvalid[hrow] ? (int)en : 0;
            }
        }
    }

    /* element offset of in-group row iq, head `head`, in a [B, X, Y, Z, H, D] tensor (64-bit:
     * for tensors whose steps steps_fit does not check, the outputs) */
    __device__ __forceinline__ int64_t offset(const nbhd_tensor &t, const nbhd_geometry &g, const int iq[3],
                                              int64_t head) const {
        return offset_of(t, b, grp[0] + (int64_t)iq[0] * g.axis[0].dilation,
                         grp[1] + (int64_t)iq[1] * g.axis[1].dilation,
                         grp[2] + (int64_t)iq[2] * g.axis[2].dilation, head);
    }

    /* key kr of walk tile t (of bn keys): a window key's in-group coordinates j, or an extra
     * key's row e; false past the end (then j = 0, e = 0: a valid address, copied as zeros) */
    __device__ __forceinline__ bool key(const nbhd_geometry &g, int t, int kr, int bn, int j[3],
                                        int64_t &e) const {
        j[0] = j[1] = j[2] = 0;
        e = 0;
        if (t < win_tiles) {
            const int n = t * bn + kr;
            if (n >= kb.total) return false;
            key_box_at<RANK ? RANK : 3>(kb, n, j);
            return true;
        }
        const int64_t x = (int64_t)(t - win_tiles) * bn + kr;
        if (x >= g.extra_kv) return false;
        e = x;
        return true;
    }

    /* the address of row r of x (head `head`); false outside the grid (then x's first
     * element: a valid address, copied as zeros) */
    template <typename T>
    __device__ __forceinline__ bool row_source(const nbhd_tensor &x, const nbhd_geometry &g, const mma_plan &P,
                                               int r, int64_t head, const T *&src) const {
        int iq[3];
        const bool ok = row(P, r, iq);
        src = (const T *)x.data + (ok ? offset(x, g, iq, head) : 0);
        return ok;
    }

    /* the patch's ROWS rows of x1 (TWO: and x2) of head `head` into shared tiles d1, d2
     * (load_row_tiles); x2 absent (no data): d2 zero */
    template <typename T, int HD, int ROWS, int THREADS, bool TWO, typename Off>
    __device__ __forceinline__ void copy_rows(const nbhd_geometry &g, const mma_plan &P, const nbhd_tensor &x1,
                                              const nbhd_tensor &x2, int64_t head, T *d1, T *d2, int tid,
                                              Off off) const {
        load_row_tiles<T, HD, ROWS, THREADS, TWO>(tid, d1, d2, off, [&](int r, const T *&s1, const T *&s2, bool &ok2) {
            const bool ok = row_source(x1, g, P, r, head, s1);
            s2 = s1;
            ok2 = TWO && ok && x2.data;
            if (ok2) row_source(x2, g, P, r, head, s2);
            return ok;
        });
    }

    /* the K and V rows of key kr of walk tile t: window keys through kp, vp (in-group
     * coordinates j), extra keys from a.kx, a.vx; false past the end (zero-filled copies) */
    template <typename T, typename Args>
    __device__ __forceinline__ bool kv_rows(const nbhd_geometry &g, const Args &a, const group_ptr<const T> &kp,
                                            const group_ptr<const T> &vp, int t, int kr, int bn, int j[3],
                                            const T *&ks, const T *&vs) const {
        int64_t e;
        const bool ok = key(g, t, kr, bn, j, e);
        const bool win = t < win_tiles;
        ks = win ? kp.at(j[0], j[1], j[2]) : extra_row<T>(a.kx, e);
        vs = win ? vp.at(j[0], j[1], j[2]) : extra_row<T>(a.vx, e);
        return ok;
    }

    /* K and V of walk tile t (BN keys) into shared tiles Kd, Vd at element offsets off(key,
     * chunk), the keys' in-group coordinates into kcd [RANK][BN] (put_coords): one key per
     * THREADS / BN threads, which also calls key_out(kr, ok, win, j) for its key */
    template <typename T, int HD, int BN, int THREADS, typename Args, typename Off, typename KeyOut = no_key_out>
    __device__ __forceinline__ void load_kv_tile(const nbhd_geometry &g, const Args &a, const group_ptr<const T> &kp,
                                                 const group_ptr<const T> &vp, int t, T *Kd, T *Vd, int *kcd,
                                                 int tid, Off off, KeyOut key_out = {}) const {
        constexpr int TPR = THREADS / BN;
        int j[3];
        bool ok;
        load_row_tiles<T, HD, BN, THREADS, true>(tid, Kd, Vd, off, [&](int kr, const T *&ks, const T *&vs, bool &ok2) {
            return ok = ok2 = kv_rows(g, a, kp, vp, t, kr, BN, j, ks, vs);
        });
        if (tid % TPR == 0) {
            put_coords<RANK ? RANK : 3, BN>(kcd, tid / TPR, ok, j);
            key_out(tid / TPR, ok, t < win_tiles, j);
        }
    }

    /* The row-mask table (ENTRIES words) of a 64-row patch (row_masks) whose columns walk box `cols`: for each
     * axis and box position u, the rows that meet column coordinate cols.lo + u (rows outside
     * [Qb, Qe): none), at entry u after the earlier axes' entries. Query rows (KEY_ROWS false)
     * meet the keys of their windows; key rows (the dK/dV kernels) the queries whose windows
     * hold them. The caller syncs before reading it. */
    template <int THREADS, bool KEY_ROWS, int ENTRIES>
    __device__ __forceinline__ void row_mask_table(const nbhd_geometry &g, const key_box &cols, uint64_t *tab,
                                                   int tid) const {
        static_assert(RANK >= 2 && MB == 1 && SHAPE == PATCH_CUBE, "row masks: 64-row patches in 2-D and 3-D");
        if (cols.cnt[0] + cols.cnt[1] + (RANK == 3 ? cols.cnt[2] : 0) > ENTRIES) __trap();
        int base = 0;
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            for (int u = tid; u < cols.cnt[ax]; u += THREADS) {
                const int j = cols.lo[ax] + u;
                int64_t cst = 0, cen = 0;  /* a query column's window */
                if (KEY_ROWS) window32(&g.axis[ax], j, Lg[ax], &cst, &cen);
                uint64_t rows = 0;
#pragma unroll
                for (int c = 0; c < patch_ct(RANK, ax); ++c) {
                    const int i = i0[ax] + c;
                    bool meets = false;
                    if (KEY_ROWS) {
                        meets = cst <= i && i < cen;
                    } else {
                        int64_t st = 0, en = 0;
                        window32(&g.axis[ax], i, Lg[ax], &st, &en);
                        meets = st <= j && j < en;
                    }
                    if (meets && i >= Qb[ax] && i < Qe[ax]) rows |= row_masks<RANK>::rows_at(ax, c);
                }
                tab[base + u] = rows;
            }
            base += cols.cnt[ax];
        }
    }

    /* the rows that meet column j (in-group coordinates in box cols) from the table */
    __device__ __forceinline__ static uint64_t column_rows(const uint64_t *tab, const key_box &cols,
                                                           const int (&j)[3]) {
        uint64_t rows = ~0ull;
        int base = 0;
#pragma unroll
        for (int ax = 0; ax < (RANK ? RANK : 3); ++ax) {
            rows &= tab[base + j[ax] - cols.lo[ax]];
            base += cols.cnt[ax];
        }
        return rows;
    }

    /* the rows inside [Qb, Qe) (an extra key's rows) */
    __device__ __forceinline__ uint64_t valid_rows() const {
        static_assert(RANK >= 2 && MB == 1 && SHAPE == PATCH_CUBE, "row masks: 64-row patches in 2-D and 3-D");
        uint64_t rows = ~0ull;
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            uint64_t on = 0;
#pragma unroll
            for (int c = 0; c < patch_ct(RANK, ax); ++c)
                if (i0[ax] + c >= Qb[ax] && i0[ax] + c < Qe[ax]) on |= row_masks<RANK>::rows_at(ax, c);
            rows &= on;
        }
        return rows;
    }

    /* row e of an extra-key tensor [B, S, Hkv, D] */
    template <typename T>
    __device__ __forceinline__ const T *extra_row(const nbhd_tensor &x, int64_t e) const {
        return (const T *)x.data + b * x.stride[0] + e * x.stride[1] + hk * x.stride[4];
    }
};

/* per axis, the union [lo, hi) of the ranges [st, en) of the warp's valid fragment rows (a warp
 * without any: lo > hi) */
template <int AX>
__device__ __forceinline__ void warp_union(const int (&st)[2][AX], const int (&en)[2][AX], const bool (&valid)[2],
                                           int (&lo)[AX], int (&hi)[AX]) {
#pragma unroll
    for (int ax = 0; ax < AX; ++ax) {
        int l0 = 1 << 30, h0 = -(1 << 30);
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow)
            if (valid[hrow]) {
                l0 = min(l0, st[hrow][ax]);
                h0 = max(h0, en[hrow][ax]);
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            l0 = min(l0, __shfl_xor_sync(0xffffffffu, l0, o));
            h0 = max(h0, __shfl_xor_sync(0xffffffffu, h0, o));
        }
        lo[ax] = l0;
        hi[ax] = h0;
    }
}

/* per axis, the intersection [lo, hi) of the ranges [st, en) of the warp's fragment rows when
 * all of them are valid (a tile of keys inside it needs no mask), else empty (lo > hi) */
template <int AX>
__device__ __forceinline__ void warp_intersection(const int (&st)[2][AX], const int (&en)[2][AX],
                                                  const bool (&valid)[2], int (&lo)[AX], int (&hi)[AX]) {
    const bool all_rows = __all_sync(0xffffffffu, valid[0] && valid[1]);
#pragma unroll
    for (int ax = 0; ax < AX; ++ax) {
        int l1 = max(st[0][ax], st[1][ax]), h1 = min(en[0][ax], en[1][ax]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            l1 = max(l1, __shfl_xor_sync(0xffffffffu, l1, o));
            h1 = min(h1, __shfl_xor_sync(0xffffffffu, h1, o));
        }
        lo[ax] = all_rows ? l1 : 1 << 30;
        hi[ax] = all_rows ? h1 : -(1 << 30);
    }
}
