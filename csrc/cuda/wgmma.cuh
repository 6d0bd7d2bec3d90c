/*
 * wgmma.cuh — inline-PTX helpers of the Hopper (sm_90a) kernels (fna_wgmma.cu): warpgroup MMA
 * (wgmma.mma_async, m64nNk16, f16/bf16 -> f32) with B, and A when it is not in registers, read
 * from shared memory through 64-bit matrix descriptors (PTX ISA, "Matrix Descriptor Format").
 *
 * Shared-memory layout of every tile: rows of HD elements split into 64-element (128-byte)
 * column blocks stored one after another, [HD/64][rows][64], each block's 16-byte chunks
 * XOR-swizzled by row % 8 (the 128-byte swizzle; blocks 1024-byte aligned). Then:
 *  - a K-major operand (Q as A, K as B of S = Q K^T) is addressed per k-step of 16 columns at
 *    block (k / 64) + 32 bytes * ((k % 64) / 16), 8-row groups 1024 bytes apart (the stride
 *    byte offset); the leading byte offset is unused;
 *  - an MN-major B (V in O += P V, keys along k, head dim along n; "transposed") is addressed
 *    per k-step at row 16 k-step: 8-key groups 1024 bytes apart (stride byte offset), 64-column
 *    blocks rows * 128 bytes apart (leading byte offset).
 * The accumulator fragment of m64nN is, per warp of the warpgroup, that of mma.sync m16n8 for
 * rows 16 * (warp % 4) .. + 15, n-block i in d[4i .. 4i+3]; an A fragment in registers is that of
 * mma.sync m16n8k16 — so the softmax code of the mma.sync kernels carries over unchanged.
 *
 * Compiled only for sm_90a (NBHD_HAS_WGMMA); the host asks nbhd_cuda_wgmma_ready first.
 */
#ifndef NBHD_CUDA_WGMMA_CUH
#define NBHD_CUDA_WGMMA_CUH

#include <type_traits>

#include "mma_util.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NBHD_HAS_WGMMA 1
#else
#define NBHD_HAS_WGMMA 0
#endif

/* The Hopper kernels' CTA: wgs warpgroups of 64 rows each (wg_cta below); K/V tiles loaded one
 * ahead by cp.async. K (and key coordinates) of tile t are read only while tile t is computed:
 * two stages; V of tile t is read until tile t+1's softmax is done (its P V runs then): three. */
__host__ __device__ constexpr int wg_rows(int wgs) { return 64 * wgs; }
__host__ __device__ constexpr int wg_threads(int wgs) { return 128 * wgs; }
/* x, which every lane of the warp holds alike, as ptxas can tell (lane 0's): what it derives
 * from it stays in uniform registers. The wgmma descriptors need them there; built from a
 * value ptxas must assume per thread (the thread index, or a loop index whose trip count it
 * cannot prove uniform) each is formed per thread and moved before its wgmma. */
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }
/* warp w's warpgroup (a constant on one) */
template <int WGS>
__device__ __forceinline__ int warpgroup_of(int w) { return WGS == 1 ? 0 : warp_uniform(w >> 2); }
#define WGMMA_K_STAGES 2
#define WGMMA_V_STAGES 3

/* f(std::integral_constant<int, RANK>, plan) for the problem's rank, its plan on patches of wgs
 * warpgroups: the launchers' one switch from the run-time rank to the kernels' template */
template <int WGS, typename F>
static nbhd_status with_rank(const nbhd_geometry *g, F &&f, int shape = PATCH_CUBE) {
    const mma_plan P = mma_plan_of(g, WGS, shape);
    switch (P.rank) {
    case 1: return f(std::integral_constant<int, 1>{}, P);
    case 2: return f(std::integral_constant<int, 2>{}, P);
    default: return f(std::integral_constant<int, 3>{}, P);
    }
}

/* f(RANK, SHAPE, plan) as integral constants: with_rank and the 3-D m-block (mma_util.cuh
 * patch_wt). PATCH_FLAT is instantiated on two warpgroups in 3-D only, without a bias table
 * (dispatch.cu on_patches asks for it only there); any other request is refused. */
template <int WGS, typename F>
static nbhd_status with_patch(const nbhd_geometry *g, int shape, F &&f) {
    if (shape != PATCH_CUBE && (shape != PATCH_FLAT || WGS != 2 || g->rpb || mma_rank_of(g) != 3))
        return nbhd_fail(NBHD_ERR_UNSUPPORTED, "wgmma kernels: patch shape %d here", shape);
    return with_rank<WGS>(g, [&](auto rank, const mma_plan &P) {
        constexpr int RANK = decltype(rank)::value;
        if constexpr (RANK == 3 && WGS == 2)
            if (shape == PATCH_FLAT) return f(rank, std::integral_constant<int, PATCH_FLAT>{}, P);
        return f(rank, std::integral_constant<int, PATCH_CUBE>{}, P);
    }, shape);
}

/* the one-warpgroup kernels' row masks (cta_patch.cuh row_masks) exist in 2-D and 3-D with
 * tiles of 32 */
__host__ __device__ constexpr bool row_masked_kernel(int wgs, int rank, int bn) {
    return wgs == 1 && rank >= 2 && bn == 32;
}

/* element offset of 8-element chunk ch of row `row` in a [ROWS][HD] tile of the layout above */
template <int ROWS>
__device__ __forceinline__ int gmma_off(int row, int ch) {
    return (ch >> 3) * ROWS * 64 + row * 64 + (((ch & 7) ^ (row & 7)) << 3);
}

/* the shared-memory matrix descriptor of address base + offset (both 16-byte aligned), 128-byte
 * swizzle. The offset is added to the base's encoded address (bits 0-13, address / 16: a shared
 * address stays below 256 KiB, so no carry leaves the field), so that the k-steps of one tile,
 * constant offsets from one base, share its encoding and cost one add each. */
__device__ __forceinline__ uint64_t gmma_desc(uint32_t base, uint32_t offset, uint32_t lead_bytes,
                                              uint32_t stride_bytes) {
    const uint32_t lo = (((base & 0x3FFFF) >> 4) | ((lead_bytes >> 4) << 16)) + (offset >> 4);
    const uint32_t hi = (stride_bytes >> 4) | (1u << 30);
    return ((uint64_t)hi << 32) | lo;
}


/* The CTA of the Hopper kernels (fna_wgmma*.cu): WGS warpgroups on a 64 WGS-row patch
 * (cta_patch.cuh with MB = WGS: m-blocks stacked along axis 0, warp w owning m-block w, warpgroup
 * wg the box of m-blocks 4 wg .. 4 wg + 3), with the loads and masks of that shape. Two on the
 * large windows; one on small windows, whose 64-query patches waste less of the union. */
template <int RANK, int WGS = 2, int SHAPE = PATCH_CUBE>
struct wg_cta : cta_patch<RANK, WGS, SHAPE> {
    static constexpr int BM = wg_rows(WGS), THREADS = wg_threads(WGS);
    /* the patch's rows of x1 and x2 (head `head`) into [BM][HD] tiles d1, d2 of the layout
     * above (cta_patch::copy_rows) */
    template <typename T, int HD, bool TWO = true>
    __device__ __forceinline__ void load_rows(const nbhd_geometry &g, const mma_plan &P, const nbhd_tensor &x1,
                                              const nbhd_tensor &x2, int64_t head, T *d1, T *d2, int tid) const {
        this->template copy_rows<T, HD, BM, THREADS, TWO>(
            g, P, x1, x2, head, d1, d2, tid, [](int r, int ch) { return gmma_off<BM>(r, ch); });
    }

    /* A key patch's walk (the dK/dV kernels): the union of its rows' inverse neighbourhoods,
     * in-group, row-major */
    __device__ __forceinline__ key_box inverse_box(const nbhd_geometry &g) const {
        key_box qb;
        int64_t ncol = 1;
#pragma unroll
        for (int ax = 0; ax < 3; ++ax) {
            qb.lo[ax] = 0;
            qb.cnt[ax] = 1;
            if (ax < RANK) {
                int64_t lo, cnt;
                const int last = min(this->i0[ax] + patch_ct(RANK, ax, WGS, SHAPE), this->Lg[ax]) - 1;
                inverse_union(&g.axis[ax], this->grp[ax], this->i0[ax], last, &lo, &cnt);
                qb.lo[ax] = (int)lo;
                qb.cnt[ax] = (int)cnt;
            }
            ncol *= qb.cnt[ax];
        }
        qb.d1 = udiv32_of((uint32_t)max(qb.cnt[1], 1));
        qb.d2 = udiv32_of((uint32_t)max(qb.cnt[2], 1));
        qb.total = (int)ncol;
        return qb;
    }

    /* A key patch's thread rows qr = 16 w + lane / 4 + 8 hrow: inverse windows [ist, ien) per
     * axis, in-group (invalid rows: empty); and the intersection [ilo, ihi) over the warpgroup's
     * box, [first(last key), end(first key)) as both ends never decrease along an axis (empty
     * unless all its keys are in the grid): a query tile inside it needs no mask */
    __device__ __forceinline__ void key_windows(const nbhd_geometry &g, int w, int lane, int (&ist)[2][RANK],
                                                int (&ien)[2][RANK], int (&ilo)[RANK], int (&ihi)[RANK]) const {
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            int ik[3];
            const bool valid = this->row(w * 16 + (lane >> 2) + 8 * hrow, ik);
#pragma unroll
            for (int ax = 0; ax < RANK; ++ax) {
                const int d = g.axis[ax].dilation;
                int64_t f = 0, c = 0;
                if (valid) inverse32(&g.axis[ax], this->grp[ax] + (int64_t)ik[ax] * d, &f, &c);
                ist[hrow][ax] = (int)(f / d);
                ien[hrow][ax] = valid ? (int)(f / d + c) : 0;
            }
        }
        constexpr int WX[3] = {patch_wt(RANK, 0, SHAPE) * 4, patch_wt(RANK, 1, SHAPE), patch_wt(RANK, 2, SHAPE)};
        int wk[3];
        this->row((w >> 2) * 64, wk);
        bool all_rows = true;
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) all_rows &= wk[ax] + WX[ax] <= this->Lg[ax];
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            const int d = g.axis[ax].dilation;
            const int f = min(wk[ax], this->Lg[ax] - 1), l = min(wk[ax] + WX[ax], this->Lg[ax]) - 1;
            int64_t ff, fc, lf, lc;
            inverse32(&g.axis[ax], this->grp[ax] + (int64_t)f * d, &ff, &fc);
            inverse32(&g.axis[ax], this->grp[ax] + (int64_t)l * d, &lf, &lc);
            ilo[ax] = all_rows ? (int)(lf / d) : 1 << 30;
            ihi[ax] = all_rows ? (int)(ff / d + fc) : -(1 << 30);
        }
    }

    /* The thread's fragment rows of one output x1 (head `head`) from accumulator a1 times mul1,
     * and of a second, x2 (not null), from a2: rows holding a non-finite value are computed again
     * by redo(full coordinates) (exact_rows.cuh redo_rows) after a barrier, so that redo may
     * use shared memory */
    template <typename T, int N8, typename Redo>
    __device__ __forceinline__ void store_rows(const nbhd_geometry &g, int64_t head, int w, int lane,
                                               const nbhd_tensor &x1, const float (&a1)[N8][4], float mul1,
                                               const nbhd_tensor *x2, const float (&a2)[N8][4], Redo &&redo) const {
        unsigned bad = 0;
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            int ik[3];
            if (!this->row(w * 16 + (lane >> 2) + 8 * hrow, ik)) continue;
            store_pairs<T>((T *)x1.data + this->offset(x1, g, ik, head), a1, N8, hrow, lane & 3, mul1);
            bool finite = pairs_finite<N8>(a1, hrow);
            if (x2) {
                store_pairs<T>((T *)x2->data + this->offset(*x2, g, ik, head), a2, N8, hrow, lane & 3, 1.f);
                finite = finite && pairs_finite<N8>(a2, hrow);
            }
            if (!finite) bad |= 1u << hrow;
        }
        if (__syncthreads_or(bad != 0))
            for (int hrow = 0; hrow < 2; ++hrow) {
                int ik[3] = {0, 0, 0};
                this->row(w * 16 + (lane >> 2) + 8 * hrow, ik);
                int64_t c[3];
                for (int ax = 0; ax < 3; ++ax) c[ax] = this->grp[ax] + (int64_t)ik[ax] * g.axis[ax].dilation;
                redo_rows((bad >> hrow) & 1u, c, redo);
            }
    }

    /* a thread's fragment rows (validity, in-group windows, coordinates iq) and warpgroup wg's
     * intersection of windows (box_inside) */
    __device__ __forceinline__ void rows_and_box(const nbhd_geometry &g, const mma_plan &P, int w, int lane, int wg,
                                                 int (&wst)[2][RANK], int (&wen)[2][RANK], bool (&rvalid)[2],
                                                 int (&iq)[2][3], int (&ilo)[RANK], int (&ihi)[RANK]) const {
        this->fragment_rows(g, P, w, lane, wst, wen, rvalid, iq);
        box_inside(g, wg, ilo, ihi);
    }

    /* a thread's fragment rows (validity, windows, tile_bias::row) and its warpgroup's
     * intersection of windows */
    __device__ __forceinline__ void row_windows(const nbhd_geometry &g, const mma_plan &P, int w, int lane,
                                                int (&wst)[2][RANK], int (&wen)[2][RANK], bool (&rvalid)[2],
                                                int (&ilo)[RANK], int (&ihi)[RANK], int (&brow)[2]) const {
        int iq[2][3];
        rows_and_box(g, P, w, lane, w >> 2, wst, wen, rvalid, iq, ilo, ihi);
        brow[0] = tile_bias<RANK>::row(g, iq[0]);
        brow[1] = tile_bias<RANK>::row(g, iq[1]);
    }

    /* along axis ax, the first and last of warpgroup wg's rows in the query range and their
     * windows [start, end): first and last; false where it has none there */
    __device__ __forceinline__ bool box_ends(const nbhd_geometry &g, int wg, int ax, int64_t (&first)[2],
                                             int64_t (&last)[2]) const {
        constexpr int WX[3] = {patch_wt(RANK, 0, SHAPE) * 4, patch_wt(RANK, 1, SHAPE), patch_wt(RANK, 2, SHAPE)};
        int wq[3];
        this->row(wg * 64, wq);
        const int f = max(wq[ax], this->Qb[ax]), l = min(wq[ax] + WX[ax], this->Qe[ax]) - 1;
        if (f > l) return false;
        window32(&g.axis[ax], f, this->Lg[ax], &first[0], &first[1]);
        window32(&g.axis[ax], l, this->Lg[ax], &last[0], &last[1]);
        return true;
    }

    /* the intersection of the windows of warpgroup wg's box (empty unless all its rows are in
     * the grid): a tile inside it needs no mask. Starts and ends never decrease along an axis,
     * so it is [start(last), end(first)). */
    __device__ __forceinline__ void box_inside(const nbhd_geometry &g, int wg, int (&ilo)[RANK],
                                               int (&ihi)[RANK]) const {
        constexpr int WX[3] = {patch_wt(RANK, 0, SHAPE) * 4, patch_wt(RANK, 1, SHAPE), patch_wt(RANK, 2, SHAPE)};
        int wq[3];
        this->row(wg * 64, wq);
        bool all_rows = true;
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) all_rows &= wq[ax] >= this->Qb[ax] && wq[ax] + WX[ax] <= this->Qe[ax];
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            int64_t first[2], last[2];
            all_rows = all_rows && box_ends(g, wg, ax, first, last);
            ilo[ax] = all_rows ? (int)last[0] : 1 << 30;
            ihi[ax] = all_rows ? (int)first[1] : -(1 << 30);
        }
    }
};

/* The row masks (cta_patch.cuh row_masks) of a one-warpgroup kernel on 64-row patches in 2-D
 * and 3-D (ON; else nothing): the CTA's table (ENTRIES words) over the box its
 * columns walk, and each column stage's words [STAGES][2][BN] (rows 0-31, then 32-63), written by
 * the thread that loads the column. KEY_ROWS: rows are keys, columns queries (dK/dV). */
template <int RANK, int BN, int STAGES, bool ON, bool KEY_ROWS = false, int ENTRIES = row_masks<3>::ENTRIES>
struct wg_row_masks {
    static constexpr size_t BYTES = ON ? 8 * ENTRIES + 4 * STAGES * 2 * BN : 0;
    uint64_t *tab;
    uint32_t *words;
    uint64_t extra = 0; /* an extra key's rows: those in the query range */

    __device__ __forceinline__ explicit wg_row_masks(void *smem)
        : tab((uint64_t *)smem), words((uint32_t *)(tab + (ON ? ENTRIES : 0))) {}

    /* the table over box cols, then a CTA barrier (before the loads that read it) */
    __device__ __forceinline__ void build(const wg_cta<RANK, 1> &C, const nbhd_geometry &g, const key_box &cols,
                                          int tid) {
        if constexpr (ON) {
            C.template row_mask_table<128, KEY_ROWS, ENTRIES>(g, cols, tab, tid);
            extra = C.valid_rows();
            __syncthreads();
        }
    }
    /* column c of the tile in stage s: its rows (ok: a real column; win: a window key, else an
     * extra key) */
    __device__ __forceinline__ void put(int s, int c, const key_box &cols, bool ok, bool win,
                                        const int (&j)[3]) const {
        if constexpr (ON) {
            const uint64_t rows = !ok ? 0ull : win ? wg_cta<RANK, 1>::column_rows(tab, cols, j) : extra;
            words[s * 2 * BN + c] = (uint32_t)rows;
            words[s * 2 * BN + BN + c] = (uint32_t)(rows >> 32);
        }
    }
    /* load_kv_tile's key_out for a key tile in stage s of query patch C (columns: C.kb); without
     * row masks nothing */
    template <typename CTA>
    __device__ __forceinline__ auto key_out(const CTA &C, int s) const {
        if constexpr (ON)
            return [=, &C](int kr, bool ok, bool win, const int (&j)[3]) { put(s, kr, C.kb, ok, win, j); };
        else
            return no_key_out{};
    }
    /* stage s's words of warp w's half of the rows; its rows' bit for hrow 0 (hrow 1: + 8) */
    __device__ __forceinline__ const uint32_t *warp_words(int s, int w) const { return words + (s * 2 + (w >> 1)) * BN; }
    __device__ __forceinline__ static int row_bit(int w, int lane) { return 16 * (w & 1) + (lane >> 2); }
    /* does every column of the tile meet all 16 rows of warp w (then no mask)? */
    __device__ __forceinline__ static bool full(const uint32_t *ww, int w, int lane) {
        static_assert(BN == 32, "a column per lane");
        return __all_sync(0xffffffffu, ((ww[lane] >> (16 * (w & 1))) & 0xffffu) == 0xffffu);
    }
};

/* Is every key of a tile (in-group coordinates kct[ax * BN + kr]) inside [ilo, ihi) per axis,
 * a warpgroup's intersection of windows (then no key needs a mask)? Each warp reads all BN
 * keys, so the four warps of a warpgroup agree. */
template <int BN, int RANK>
__device__ __forceinline__ bool tile_inside(const int *kct, int lane, const int (&ilo)[RANK],
                                            const int (&ihi)[RANK]) {
    bool inside = true;
#pragma unroll
    for (int kr = lane; kr < BN; kr += 32)
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            const int j = kct[ax * BN + kr];
            inside = inside && j >= ilo[ax] && j < ihi[ax];
        }
    return __all_sync(0xffffffffu, inside);
}

/* A warpgroup's KV-parallel dQ block added to the accumulator (fp32 atomics): rows 16 qw +
 * lane / 4 + 8 hrow of a tile's queries (in-group coordinates qct [RANK][BN]; past the end:
 * skipped), columns cols + 8 nb + 2 (lane % 4) of accumulator fragment dq */
template <int RANK, int BN, int NB>
__device__ __forceinline__ void add_dq_block(const group_ptr<float> &dqp, const int *qct, int qw, int64_t cols,
                                             const float (&dq)[NB][4], int lane) {
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        const int cr = qw * 16 + (lane >> 2) + 8 * hrow;
        int j[3] = {0, 0, 0};
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) j[ax] = qct[ax * BN + cr];
        if (j[0] == KEY_NONE) continue;
        float *dst = dqp.at(j[0], j[1], j[2]) + cols + 2 * (lane & 3);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            atomicAdd((float2 *)(dst + nb * 8), make_float2(dq[nb][2 * hrow], dq[nb][2 * hrow + 1]));
    }
}

#if NBHD_HAS_WGMMA
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* the compiler does not know wgmma reads and writes registers after the instruction issues:
 * an empty asm that "modifies" them keeps them from being moved across the wait */
__device__ __forceinline__ void fence_reg(float &x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void fence_reg(uint32_t &x) { asm volatile("" : "+r"(x)::"memory"); }
/* the same over a fragment array: accumulators [n-block][4] or A fragments [k-step][4] */
template <typename R, int N> __device__ __forceinline__ void fence_regs(R (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) fence_reg(x[i][e]);
}

/* d (64 x N per warpgroup) (+)= A (64 x 16, descriptor) B (16 x N, descriptor); accumulate 0
 * overwrites d. N = 32 serves the S tiles of the forward+JVP's 32-key variant and the backward
 * through forward+JVP's dQ halves: no rs_bt */
template <typename T, int N> struct wgmma_op;

/* The instructions: the accumulator registers (an m64nN tile holds N/2 floats a thread:
 * NBHD_WGMMA_DN the operands, NBHD_WGMMA_RN their "{%0, ...}" list), then the descriptors
 * (SS) or A registers and B's descriptor (RS), then the scale-d predicate: P, A, B name the
 * operand numbers that follow the N/2 registers. */
#define NBHD_WGMMA_D16 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
    "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
    "+f"(d[14]), "+f"(d[15])
#define NBHD_WGMMA_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define NBHD_WGMMA_D32 NBHD_WGMMA_D16, "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
    "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
    "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define NBHD_WGMMA_R32 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define NBHD_WGMMA_D64 NBHD_WGMMA_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), \
    "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), \
    "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), \
    "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), \
    "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define NBHD_WGMMA_R64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define NBHD_WGMMA_D40 NBHD_WGMMA_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define NBHD_WGMMA_R40 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define NBHD_WGMMA_D48 NBHD_WGMMA_D40, "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define NBHD_WGMMA_R48 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define NBHD_WGMMA_SS(SHAPE, TY, TRANS, REGS, A, B, P, ...)                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                                  \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " REGS ", " A ", " B     \
                 ", p, 1, 1, " TRANS ";\n}\n"                                                      \
                 : __VA_ARGS__                                                                     \
                 : "l"(a_desc), "l"(b_desc), "r"(accumulate))
#define NBHD_WGMMA_RS(SHAPE, TY, TRANS, REGS, A, B, P, ...)                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                                  \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " REGS ", " A ", " B     \
                 ", p, 1, 1, " TRANS ";\n}\n"                                                     \
                 : __VA_ARGS__                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate))
#define NBHD_WGMMA_SS_N32(TY, TRANS) \
    NBHD_WGMMA_SS("m64n32k16", TY, TRANS, NBHD_WGMMA_R16, "%16", "%17", "%18", NBHD_WGMMA_D16)
#define NBHD_WGMMA_RS_N32(TY, TRANS) \
    NBHD_WGMMA_RS("m64n32k16", TY, TRANS, NBHD_WGMMA_R16, "{%16, %17, %18, %19}", "%20", "%21", NBHD_WGMMA_D16)
#define NBHD_WGMMA_SS_N64(TY, TRANS) \
    NBHD_WGMMA_SS("m64n64k16", TY, TRANS, NBHD_WGMMA_R32, "%32", "%33", "%34", NBHD_WGMMA_D32)
#define NBHD_WGMMA_RS_N64(TY, TRANS) \
    NBHD_WGMMA_RS("m64n64k16", TY, TRANS, NBHD_WGMMA_R32, "{%32, %33, %34, %35}", "%36", "%37", NBHD_WGMMA_D32)
#define NBHD_WGMMA_SS_N128(TY) \
    NBHD_WGMMA_SS("m64n128k16", TY, "0, 0", NBHD_WGMMA_R64, "%64", "%65", "%66", NBHD_WGMMA_D64)
#define NBHD_WGMMA_SS_N80(TY) \
    NBHD_WGMMA_SS("m64n80k16", TY, "0, 0", NBHD_WGMMA_R40, "%40", "%41", "%42", NBHD_WGMMA_D40)
#define NBHD_WGMMA_SS_N96(TY) \
    NBHD_WGMMA_SS("m64n96k16", TY, "0, 0", NBHD_WGMMA_R48, "%48", "%49", "%50", NBHD_WGMMA_D48)
#define NBHD_WGMMA_RS_N128(TY) \
    NBHD_WGMMA_RS("m64n128k16", TY, "1", NBHD_WGMMA_R64, "{%64, %65, %66, %67}", "%68", "%69", NBHD_WGMMA_D64)

template <> struct wgmma_op<__nv_bfloat16, 32> {
    static __device__ __forceinline__ void ss(float d[16], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N32("bf16", "0, 0");
    }
    /* A MN-major, B K-major (the backward through forward+JVP's dQ = dS K: dS^T staged, K^T) */
    static __device__ __forceinline__ void ss_ta(float d[16], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N32("bf16", "1, 0");
    }
    /* A in registers; B K-major (the forward's S = Q K^T with Q's fragments held) */
    static __device__ __forceinline__ void rs(float d[16], const uint32_t a[4], uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_RS_N32("bf16", "0");
    }
};
template <> struct wgmma_op<__half, 32> {
    static __device__ __forceinline__ void ss(float d[16], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N32("f16", "0, 0");
    }
    /* A MN-major, B K-major (the backward through forward+JVP's dQ = dS K: dS^T staged, K^T) */
    static __device__ __forceinline__ void ss_ta(float d[16], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N32("f16", "1, 0");
    }
    /* A in registers; B K-major (the forward's S = Q K^T with Q's fragments held) */
    static __device__ __forceinline__ void rs(float d[16], const uint32_t a[4], uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_RS_N32("f16", "0");
    }
};
template <> struct wgmma_op<__nv_bfloat16, 64> {
    static __device__ __forceinline__ void ss(float d[32], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N64("bf16", "0, 0");
    }
    /* A and B MN-major ("transposed": the KV-parallel backward's dQ += dS K, dS^T staged) */
    static __device__ __forceinline__ void ss_tt(float d[32], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N64("bf16", "1, 1");
    }
    /* A in registers (an mma.sync m16n8k16 A fragment per warp); B MN-major */
    static __device__ __forceinline__ void rs_bt(float d[32], const uint32_t a[4], uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_RS_N64("bf16", "1");
    }
    /* A in registers; B K-major (the forward's S = Q K^T with Q's fragments held) */
    static __device__ __forceinline__ void rs(float d[32], const uint32_t a[4], uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_RS_N64("bf16", "0");
    }
};
template <> struct wgmma_op<__half, 64> {
    static __device__ __forceinline__ void ss(float d[32], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N64("f16", "0, 0");
    }
    /* A and B MN-major ("transposed": the KV-parallel backward's dQ += dS K, dS^T staged) */
    static __device__ __forceinline__ void ss_tt(float d[32], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N64("f16", "1, 1");
    }
    /* A in registers (an mma.sync m16n8k16 A fragment per warp); B MN-major */
    static __device__ __forceinline__ void rs_bt(float d[32], const uint32_t a[4], uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_RS_N64("f16", "1");
    }
    /* A in registers; B K-major (the forward's S = Q K^T with Q's fragments held) */
    static __device__ __forceinline__ void rs(float d[32], const uint32_t a[4], uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_RS_N64("f16", "0");
    }
};
template <> struct wgmma_op<__nv_bfloat16, 128> {
    static __device__ __forceinline__ void ss(float d[64], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N128("bf16");
    }
    /* A in registers (an mma.sync m16n8k16 A fragment per warp); B MN-major */
    static __device__ __forceinline__ void rs_bt(float d[64], const uint32_t a[4], uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_RS_N128("bf16");
    }
};
template <> struct wgmma_op<__half, 128> {
    static __device__ __forceinline__ void ss(float d[64], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N128("f16");
    }
    /* A in registers (an mma.sync m16n8k16 A fragment per warp); B MN-major */
    static __device__ __forceinline__ void rs_bt(float d[64], const uint32_t a[4], uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_RS_N128("f16");
    }
};

/* the TMA forward's score tiles of 80 and 96 keys (fna_wgmma_tma.cu): S = Q K^T only */
template <> struct wgmma_op<__nv_bfloat16, 80> {
    static __device__ __forceinline__ void ss(float d[40], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N80("bf16");
    }
};
template <> struct wgmma_op<__half, 80> {
    static __device__ __forceinline__ void ss(float d[40], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N80("f16");
    }
};
template <> struct wgmma_op<__nv_bfloat16, 96> {
    static __device__ __forceinline__ void ss(float d[48], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N96("bf16");
    }
};
template <> struct wgmma_op<__half, 96> {
    static __device__ __forceinline__ void ss(float d[48], uint64_t a_desc, uint64_t b_desc, int accumulate) {
        NBHD_WGMMA_SS_N96("f16");
    }
};

/* k-step kk of d (+)= A B^T (per warpgroup 64 x N): both operands K-major in shared memory at
 * their warpgroup's first row, A in a tile of ROWS_A rows, B in one of ROWS_B (64-column blocks
 * ROWS * 128 bytes apart); accumulate 0 overwrites d. N past 128 as two products (160 = 80 + 80,
 * 144 = 80 + 64), the second's B that many rows on (a multiple of 8: the swizzle's 1024-byte
 * atoms). */
template <typename T, int N, int ROWS_A, int ROWS_B>
__device__ __forceinline__ void wgmma_score_step(float (&d)[N / 8][4], uint32_t a, uint32_t b, int kk, int accumulate) {
    const uint32_t sa = (kk >> 2) * ROWS_A * 128 + (kk & 3) * 32, sb = (kk >> 2) * ROWS_B * 128 + (kk & 3) * 32;
    if constexpr (N > 128) {
        constexpr int F = N / 2 == 64 || N / 2 == 80 || N / 2 == 96 ? N / 2 : 80;  /* shapes wgmma_op has */
        static_assert(F % 8 == 0, "parts of whole 8-row swizzle atoms");
        wgmma_op<T, F>::ss(&d[0][0], gmma_desc(a, sa, 16, 1024), gmma_desc(b, sb, 16, 1024), accumulate);
        wgmma_op<T, N - F>::ss(&d[F / 8][0], gmma_desc(a, sa, 16, 1024), gmma_desc(b, sb + F * 128, 16, 1024),
                               accumulate);
    } else {
        wgmma_op<T, N>::ss(&d[0][0], gmma_desc(a, sa, 16, 1024), gmma_desc(b, sb, 16, 1024), accumulate);
    }
}

/* The backward's score pair, d1 = A1 B1^T and d2 = A2 B2^T (per warpgroup 64 x BN, k = HD), as
 * wgmma_score_step with B in tiles of BN rows, their k-steps interleaved. Committed as one
 * group. */
template <typename T, int HD, int BN, int ROWS_A>
__device__ __forceinline__ void wgmma_score_pair(float (&d1)[BN / 8][4], uint32_t a1, uint32_t b1,
                                                 float (&d2)[BN / 8][4], uint32_t a2, uint32_t b2) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        wgmma_score_step<T, BN, ROWS_A, BN>(d1, a1, b1, kk, kk > 0);
        wgmma_score_step<T, BN, ROWS_A, BN>(d2, a2, b2, kk, kk > 0);
    }
    wgmma_commit();
}

/* A forward warpgroup's state over its key tiles (fna_wgmma.cu, fna_wgmma_tma.cu): O, the
 * online max m and sum l of its thread's two rows, and the previous tile's P as A fragments,
 * whose O += P V runs on the tensor cores while the next tile's softmax does. Every wgmma is
 * issued on every tile, outside any branch (ptxas serialises wgmma it cannot prove
 * warpgroup-uniform): before the first tile P = 0. */
template <typename T, int HD, int BN>
struct wg_forward_state {
    float o[1][HD / 8][4];
    float m[1][2], l[1][2];
    uint32_t pf[BN / 16][4];

    __device__ __forceinline__ wg_forward_state() {
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) o[0][i][0] = o[0][i][1] = o[0][i][2] = o[0][i][3] = 0.f;
        m[0][0] = m[0][1] = -INFINITY;
        l[0][0] = l[0][1] = 0.f;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) pf[kk][0] = pf[kk][1] = pf[kk][2] = pf[kk][3] = 0u;
    }
    /* O += P V, V the tile of BN keys at shared address v; one commit group */
    __device__ __forceinline__ void issue_pv(uint32_t v) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_op<T, HD>::rs_bt(&o[0][0][0], pf[kk], gmma_desc(v, kk * 16 * 128, BN * 128, 1024), 1);
        wgmma_commit();
    }
    /* after the wait for P V: P and O may be touched again */
    __device__ __forceinline__ void pv_done() {
        fence_regs(pf);
        fence_regs(o[0]);
    }
    /* after the tile's softmax (fwd_softmax_tile, leaving its P in sc): O rescaled where it
     * asked, and P the next P V's A fragments */
    __device__ __forceinline__ void take_p(const float (&sc)[1][BN / 8][4], bool rescale, const float (&corr)[1][2]) {
        if (rescale) fwd_rescale<1, HD>(o, corr);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) a_frag_of<T>(pf[kk], sc[0][2 * kk], sc[0][2 * kk + 1]);
    }
};

/* d (+)= A B^T (per warpgroup 64 x N, k = HD) as wgmma_score_step; accumulate 0: the first
 * k-step overwrites d. Not committed. */
template <typename T, int HD, int N, int ROWS_A, int ROWS_B = N>
__device__ __forceinline__ void wgmma_score(float (&d)[N / 8][4], uint32_t a, uint32_t b, int accumulate) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) wgmma_score_step<T, N, ROWS_A, ROWS_B>(d, a, b, kk, kk > 0 || accumulate);
}

#undef NBHD_WGMMA_D16
#undef NBHD_WGMMA_D32
#undef NBHD_WGMMA_D64
#undef NBHD_WGMMA_R16
#undef NBHD_WGMMA_R32
#undef NBHD_WGMMA_R64
#undef NBHD_WGMMA_SS
#undef NBHD_WGMMA_RS
#undef NBHD_WGMMA_SS_N32
#undef NBHD_WGMMA_SS_N64
#undef NBHD_WGMMA_RS_N64
#undef NBHD_WGMMA_SS_N128
#undef NBHD_WGMMA_RS_N128
#undef NBHD_WGMMA_D40
#undef NBHD_WGMMA_R40
#undef NBHD_WGMMA_D48
#undef NBHD_WGMMA_R48
#undef NBHD_WGMMA_SS_N80
#undef NBHD_WGMMA_SS_N96
#endif /* NBHD_HAS_WGMMA */

#endif /* NBHD_CUDA_WGMMA_CUH */
