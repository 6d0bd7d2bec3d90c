/*
 * fna_wgmma_tma.cu — the Hopper forward (O, LSE) on 128-query patches, pipelined in the manner
 * FlashAttention-3 describes: the tensor memory accelerator loads Q, K and V, warps specialise,
 * the two consumer warpgroups take turns at the tensor cores. The large-window default.
 *
 * Why: the cp.async forward (fna_wgmma.cu) spends issue slots on every thread's copies and their
 * addresses, and its CTA barrier per tile keeps both warpgroups in step, so both wait for their
 * S = Q K^T together and then both run the softmax while the tensor cores idle.
 *
 * A CTA is three warpgroups, persistent: one per multiprocessor, walking the 128-query patches
 * (mma_util.cuh patch_*, as fna_wgmma.cu's mb = 2) gridDim.x apart, so that the next patch's
 * loads run under this one's last tiles and its O store:
 *  - warpgroup 2, the producer, gives its registers up (setmaxnreg); one thread, per patch, loads
 *    Q into the free one of two buffers (a TMA box per 16-row m-block), then walks the patch's
 *    union of windows in tiles of BN keys and, per tile, loads K into a ring of KST stages and V
 *    into one of VST, one TMA box per row of the tile and 64 columns (the 128-byte swizzle of
 *    wgmma.cuh's layout). Each buffer and stage has a `full` mbarrier counting the bytes, waited
 *    on by the consumers, and an `empty` one they arrive on, which the producer waits for before
 *    loading into it again (tma.cuh); the rings run on across patches;
 *  - warpgroups 0 and 1 each own 64 queries and run fna_wgmma.cu's loop: S = Q K^T of tile t
 *    and O += P V of tile t - 1 issued together, the softmax of S while P V runs. Between them
 *    two named barriers pass the turn: a warpgroup issues its products only after the other
 *    has issued its own, so one's softmax overlaps the other's products. A consumer warp
 *    releases a K stage once its S is done and a V stage once its P V is; O is staged through
 *    the patch's Q buffer, which is then released. The warpgroups split the patch along its
 *    first axis, so each computes only the tiles that hold a row of its own union there
 *    (box_ends, tma_rows::tile_range); the other's tiles it frees and passes the turn on.
 * Tiles: in 1-D a run of 128 tokens; in 2-D and 3-D R rows of RS keys along the last axis
 * (tma_rows), RS at least the union's extent there (TMA_ROWS: 16 to 128), so that a row is one
 * box. Keys past the grid come as zeros, keys past the union are masked like every key outside a
 * row's window (fwd_softmax_tile with ROW_KEYS: the last-axis coordinate and a bit per row for
 * the leading axes), so the tiles need no coordinate table.
 * Conditions (nbhd_cuda_tma_forward_applies and _fits, kernel_choice.cu): no dilation, extra keys
 * or bias, D = Dv = 128, f16/bf16, unions at most 128 keys wide on the last axis; Q, K and V with
 * unit column stride, 16-byte aligned steps and, in 3-D, heads D elements apart (or one head).
 * Queries past the grid come as zeros; those outside a query range are loaded but never stored.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <string.h>

#include "tma.cuh"

#define TMA_K_STAGES 2
#define TMA_V_STAGES 2
#define TMA_CONSUMER_REGS 240
#define TMA_PRODUCER_REGS 24
/* named barriers of the consumers: the two turns, and all 256 */
#define TMA_BAR_TURN 1   /* warpgroup w issues on TMA_BAR_TURN + w */
#define TMA_BAR_CONSUMERS 3

/* a CTA's shared memory: alignment slack, two Q buffers, the K and V stages of BN keys, the
 * mbarriers of both */
__host__ __device__ constexpr size_t tma_forward_smem(int HD, int BN) {
    return 1024 + 2 * (size_t)(2 * 128 + (TMA_K_STAGES + TMA_V_STAGES) * BN) * HD +
           8 * 2 * (TMA_K_STAGES + TMA_V_STAGES + 2);
}

/* The union's rows and tiles: in 1-D a tile is a run of RS keys (R = 1); in 2-D and 3-D R rows
 * of RS keys along the last axis (RS at least the union's extent there, kernel-wide), row i of
 * the union's leading axes row-major. */
template <int RANK, int RS, int R>
struct tma_rows {
    static __device__ __forceinline__ int tiles(const key_box &kb) {
        const int rows = RANK == 1 ? kb.total : RANK == 2 ? kb.cnt[0] : kb.cnt[0] * kb.cnt[1];
        return (rows + (RANK == 1 ? RS : R) - 1) / (RANK == 1 ? RS : R);
    }
    /* [t_lo, t_hi): the tiles holding the rows whose first-axis coordinate is in [lo, hi) (in
     * 1-D the keys); empty for an empty range */
    static __device__ __forceinline__ void tile_range(const key_box &kb, int lo, int hi, int &t_lo, int &t_hi) {
        const int unit = RANK == 3 ? kb.cnt[1] : 1, per = RANK == 1 ? RS : R;  /* rows per coordinate, per tile */
        t_lo = max(lo - kb.lo[0], 0) * unit / per;
        t_hi = min(tiles(kb), ((min(hi, kb.lo[0] + kb.cnt[0]) - kb.lo[0]) * unit + per - 1) / per);
        t_hi = max(t_hi, t_lo);
    }
    /* the last-axis coordinate of tile t's first key (of every row's in 2-D and 3-D) */
    static __device__ __forceinline__ int first_key(const key_box &kb, int t) {
        return RANK == 1 ? kb.lo[0] + t * RS : kb.lo[RANK - 1];
    }
    /* leading in-group coordinates of row i (RANK - 1 of them) */
    static __device__ __forceinline__ void lead(const key_box &kb, int i, int (&c)[3]) {
        if (RANK == 2) {
            c[0] = kb.lo[0] + i;
        } else if (RANK == 3) {
            const uint32_t q = udiv((uint32_t)i, kb.d1);
            c[0] = kb.lo[0] + (int)q;
            c[1] = kb.lo[1] + (i - (int)q * kb.cnt[1]);
        }
    }
};

template <typename T, int HD, int RANK, int RS, int R, int SHAPE>
__global__ void __launch_bounds__(384, 1)
fna_wgmma_tma_forward_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_forward_args a,
                             const mma_plan P, const __grid_constant__ CUtensorMap qmap,
                             const __grid_constant__ CUtensorMap kmap, const __grid_constant__ CUtensorMap vmap) {
#if NBHD_HAS_WGMMA
    constexpr int BN = RS * R, KST = TMA_K_STAGES, VST = TMA_V_STAGES, BM = 128, CONSUMERS = 256;
    constexpr int LAST = RANK - 1;
    static_assert(BN % 16 == 0 && RS % 8 == 0, "tiles of whole 16-key steps, 8-key rows");
    constexpr uint32_t TILE_BYTES = BN * HD * sizeof(T), Q_BYTES = BM * HD * sizeof(T);
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = (T *)(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023)); /* [2][BM][HD]; O staged there */
    T *Ks = Qs + 2 * BM * HD;                                                /* [KST][BN][HD] */
    T *Vs = Ks + KST * BN * HD;                                              /* [VST][BN][HD] */
    const uint32_t bars = smem_u32(Vs + VST * BN * HD);
    auto k_full = [&](int s) { return bars + 8 * s; };
    auto k_empty = [&](int s) { return bars + 8 * (KST + s); };
    auto v_full = [&](int s) { return bars + 8 * (2 * KST + s); };
    auto v_empty = [&](int s) { return bars + 8 * (2 * KST + VST + s); };
    auto q_full = [&](int s) { return bars + 8 * (2 * KST + 2 * VST + s); };
    auto q_empty = [&](int s) { return bars + 8 * (2 * KST + 2 * VST + 2 + s); };
    auto k_stage = [&](int s) { return Ks + s * BN * HD; };
    auto v_stage = [&](int s) { return Vs + s * BN * HD; };
    auto q_buffer = [&](int s) { return Qs + s * BM * HD; };

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, wg = warp_uniform(w >> 2);
    using Rows = tma_rows<RANK, RS, R>;
    const uint32_t items = (uint32_t)(g.batch * g.heads * P.patches);
    if (tid == 0) {
        for (int s = 0; s < KST; ++s) mbar_init(k_full(s), 1), mbar_init(k_empty(s), CONSUMERS / 32);
        for (int s = 0; s < VST; ++s) mbar_init(v_full(s), 1), mbar_init(v_empty(s), CONSUMERS / 32);
        for (int s = 0; s < 2; ++s) mbar_init(q_full(s), 1), mbar_init(q_empty(s), 1);
        mbar_init_fence();
    }
    __syncthreads();

    // Every warp walks the same items (patches, head-major, gridDim.x apart) and the same tiles:
    // use n of the K and V rings is tile n of the CTA's walk so far, use i of the Q buffers its
    // i-th patch.
    if (wg == 2) {  // the producer
        regs_shrink<TMA_PRODUCER_REGS>();
        if (tid != 256) return;  /* the consumers' barriers are named ones over their 256 threads */
        tma_prefetch_map(&qmap);
        tma_prefetch_map(&kmap);
        tma_prefetch_map(&vmap);
        int n = 0, qi = 0;
        for (uint32_t item = blockIdx.x; item < items; item += gridDim.x) {
            wg_cta<RANK, 2, SHAPE> C;
            if (!C.place_queries(g, P, BN, item)) continue;  /* uniform over the CTA */
            const key_box kb = C.kb;
            const int b = (int)C.b, hk = (int)C.hk, qb = qi & 1;
            // the patch's queries, a box per 16-row m-block (mma_util.cuh patch_wt) and 64 columns:
            // 1-D (col, h, x, b); 2-D (col, h, y, x, b); 3-D (h D + col, z, y, x, b)
            if (qi >= 2) mbar_wait(q_empty(qb), ((qi >> 1) + 1) & 1);
            mbar_arrive_expect(q_full(qb), Q_BYTES);
#pragma unroll
            for (int mb = 0; mb < BM / 16; ++mb) {
                const int x = C.i0[0] + mb * patch_wt(RANK, 0, SHAPE);
#pragma unroll
                for (int c = 0; c < HD / 64; ++c) {
                    const uint32_t dst = smem_u32(q_buffer(qb) + c * BM * 64 + mb * 16 * 64);
                    if (RANK == 1) tma_load_4d(dst, &qmap, c * 64, C.h, x, b, q_full(qb));
                    else if (RANK == 2) tma_load_5d(dst, &qmap, c * 64, C.h, C.i0[1], x, b, q_full(qb));
                    else tma_load_5d(dst, &qmap, C.h * HD + c * 64, C.i0[2], C.i0[1], x, b, q_full(qb));
                }
            }
            ++qi;
            // K and V: one box of RS keys per row and 64 columns: 1-D (D, H, X, B) at (col, hk, key, b);
            // 2-D (D, H, Y, X, B) at (col, hk, y, x, b); 3-D (H D, Z, Y, X, B) at (hk D + col, z, y, x, b)
            auto load = [&](const CUtensorMap *map, T *stage, uint32_t bar, int t) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    int lc[3] = {0, 0, 0};
                    Rows::lead(kb, t * R + r, lc);
                    const int key = Rows::first_key(kb, t);
#pragma unroll
                    for (int c = 0; c < HD / 64; ++c) {
                        const uint32_t dst = smem_u32(stage + c * BN * 64 + r * RS * 64);
                        if (RANK == 1) tma_load_4d(dst, map, c * 64, hk, key, b, bar);
                        else if (RANK == 2) tma_load_5d(dst, map, c * 64, hk, key, lc[0], b, bar);
                        else tma_load_5d(dst, map, hk * HD + c * 64, key, lc[1], lc[0], b, bar);
                    }
                }
            };
            const int tiles = Rows::tiles(kb);
            for (int t = 0; t < tiles; ++t, ++n) {
                const int ks = n % KST, vs = n % VST;
                if (n >= KST) mbar_wait(k_empty(ks), ((n / KST) + 1) & 1);
                mbar_arrive_expect(k_full(ks), TILE_BYTES);
                load(&kmap, k_stage(ks), k_full(ks), t);
                if (n >= VST) mbar_wait(v_empty(vs), ((n / VST) + 1) & 1);
                mbar_arrive_expect(v_full(vs), TILE_BYTES);
                load(&vmap, v_stage(vs), v_full(vs), t);
            }
        }
        return;
    }
    regs_grow<TMA_CONSUMER_REGS>();

    const int rq = lane >> 2, cq = lane & 3;
    const int my_turn = TMA_BAR_TURN + wg, next_turn = TMA_BAR_TURN + 1 - wg;
    const float sl2 = P.scale_log2;
    int n0 = 0, qi = 0;  /* the ring's uses before this patch's first tile; patches so far */
    for (uint32_t item = blockIdx.x; item < items; item += gridDim.x) {
        wg_cta<RANK, 2, SHAPE> C;
        if (!C.place_queries(g, P, BN, item)) continue;  /* uniform over the CTA */
        const key_box kb = C.kb;
        const int tiles = Rows::tiles(kb), qb = qi & 1;
        T *const Qb = q_buffer(qb);

        auto my_row = [&](int, int hrow) { return w * 16 + rq + 8 * hrow; };
        auto row_coords = [&](int qr, int iq[3]) -> bool { return C.row(qr, iq); };
        int wst[1][2][RANK], wen[1][2][RANK], iq[2][3], ilo[RANK], ihi[RANK];
        bool rvalid[1][2];
        C.rows_and_box(g, P, w, lane, wg, wst[0], wen[0], rvalid[0], iq, ilo, ihi);
        const int brow[1][2] = {{0, 0}};
        const uint32_t q_base = smem_u32(Qb) + wg * 64 * 128; /* this warpgroup's 64 rows */

        // This warpgroup's tiles [t_lo, t_hi): those holding a row of its windows' union along
        // the first axis, on which the warpgroups split the patch (small windows: about half the
        // patch's tiles each). A tile of the other's it only passes on: it frees the tile's
        // stages once loaded (so no empty barrier runs a phase ahead) and passes the turn.
        int t_lo = 0, t_hi = 0;
        {
            int64_t first[2], last[2]; /* windows of its first and last rows: its union is [first, last) */
            if (C.box_ends(g, wg, 0, first, last)) Rows::tile_range(kb, (int)first[0], (int)last[1], t_lo, t_hi);
            t_lo = warp_uniform(t_lo), t_hi = warp_uniform(t_hi);
        }
        // the turn: warpgroup 0 issues first
        if (wg == 1) named_arrive(TMA_BAR_TURN, CONSUMERS);
        auto pass = [&](int t) {
            const int n = n0 + t;
            mbar_wait(k_full(n % KST), (n / KST) & 1);
            mbar_wait(v_full(n % VST), (n / VST) & 1);
            if (lane == 0) mbar_arrive(k_empty(n % KST)), mbar_arrive(v_empty(n % VST));
            named_sync(my_turn, CONSUMERS);
            named_arrive(next_turn, CONSUMERS);
        };
        for (int t = 0; t < t_lo; ++t) pass(t);
        mbar_wait(q_full(qb), (qi >> 1) & 1);

        // O += P V of the previous tile (the first tile's: P = 0 on its own V) runs while this
        // tile's softmax does, as in fna_wgmma.cu
        wg_forward_state<T, HD, BN> F;
        uint32_t pv_stage = smem_u32(v_stage((n0 + t_lo) % VST));
        for (int t = t_lo; t < t_hi; ++t) {
            const int n = n0 + t;
            const int ks = n % KST;
            const int pn = t > t_lo ? n - 1 : n; /* the use whose V the P V reads */
            mbar_wait(k_full(ks), (n / KST) & 1);
            mbar_wait(v_full(pn % VST), (pn / VST) & 1);
            const uint32_t k_base = smem_u32(k_stage(ks));

            named_sync(my_turn, CONSUMERS);
            float sc[1][BN / 8][4];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) wgmma_score_step<T, BN, BM, BN>(sc[0], q_base, k_base, kk, kk > 0);
            wgmma_commit();
            F.issue_pv(pv_stage);
            named_arrive(next_turn, CONSUMERS);

            // meanwhile: which of the tile's rows each thread row sees on the leading axes, and
            // whether the whole tile lies inside every row's window of the warpgroup (no mask)
            const int key0 = Rows::first_key(kb, t);
            uint32_t lead = 3u;
            bool full = key0 >= ilo[LAST] && key0 + RS <= ihi[LAST];
            if constexpr (RANK > 1) {
                lead = 0u;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    int lc[3];
                    Rows::lead(kb, t * R + r, lc);
#pragma unroll
                    for (int hrow = 0; hrow < 2; ++hrow) {
                        bool ok = true;
#pragma unroll
                        for (int ax = 0; ax < LAST; ++ax)
                            ok = ok && lc[ax] >= wst[0][hrow][ax] && lc[ax] < wen[0][hrow][ax];
                        lead |= (uint32_t)ok << (2 * r + hrow);
                    }
#pragma unroll
                    for (int ax = 0; ax < LAST; ++ax) full = full && lc[ax] >= ilo[ax] && lc[ax] < ihi[ax];
                }
            }
            wgmma_wait<1>(); /* S is done; P V may still run */
            fence_regs(sc[0]);
            if (lane == 0) mbar_arrive(k_empty(ks));

            float corr[1][2];
            const bool rescale = fwd_softmax_tile<1, BN, RANK, BIAS_NONE, false, RS>(
                g, sc, F.m, F.l, corr, full, true, nullptr, wst, wen, rvalid, sl2, cq, nullptr, brow, nullptr, 0,
                key0, lead);
            wgmma_wait<0>();
            F.pv_done();
            if (t > t_lo && lane == 0) mbar_arrive(v_empty(pn % VST));
            F.take_p(sc, rescale, corr);
            pv_stage = smem_u32(v_stage(n % VST));
        }
        if (t_hi > t_lo) { /* the last tile's P V */
            const int n = n0 + t_hi - 1;
            mbar_wait(v_full(n % VST), (n / VST) & 1);
            wgmma_fence();
            F.issue_pv(pv_stage);
            wgmma_wait<0>();
            F.pv_done();
            if (lane == 0) mbar_arrive(v_empty(n % VST));
        }
        for (int t = t_hi; t < tiles; ++t) pass(t);
        if (wg == 0) named_sync(TMA_BAR_TURN, CONSUMERS);  /* warpgroup 1's last turn */
        named_sync(TMA_BAR_CONSUMERS, CONSUMERS);  /* both warpgroups' wgmma reads of Q are done before it stages O */

        fwd_store<T, 1, HD>(g, a, C.grp, C.b, C.h, F.o, F.m, F.l, Qb, w * 16, lane, row_coords, my_row,
                            TMA_BAR_CONSUMERS, CONSUMERS);
        // the buffer's reads and writes as O's stage come before the next TMA load into it
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        named_sync(TMA_BAR_CONSUMERS, CONSUMERS);
        if (tid == 0) mbar_arrive(q_empty(qb));
        n0 += tiles;
        ++qi;
    }
#endif
}

// ----------------------------------------------------------------------------
// tensor maps and launch

/* the driver's cuTensorMapEncodeTiled, through the runtime (the library links cudart only) */
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    static int tried;
    if (!__atomic_load_n(&tried, __ATOMIC_ACQUIRE)) {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            p = nullptr;
        cudaGetLastError();
        fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        __atomic_store_n(&tried, 1, __ATOMIC_RELEASE);
    }
    return fn;
}

/* The widest union of a 128-query patch's windows along axis a (ct queries of the patch along
 * it, no dilation) over the patch positions of the axis's query range */
static int64_t union_width(const nbhd_axis *a, int ct) {
    int64_t lo, hi, width = 0;
    nbhd_query_range_in_group(a, 0, &lo, &hi);
    for (int64_t i0 = lo / ct * ct; i0 < hi; i0 += ct) {
        const int64_t first = i0 > lo ? i0 : lo, last = (i0 + ct < hi ? i0 + ct : hi) - 1;
        int64_t s1, e1, s2, e2;
        nbhd_window_in_group(a, first, a->extent, &s1, &e1);
        nbhd_window_in_group(a, last, a->extent, &s2, &e2);
        if (e2 - s1 > width) width = e2 - s1;
    }
    return width;
}

/* rows of a 2-D or 3-D tile: (keys per row, rows per tile) for unions up to 128 keys wide along
 * the last axis, the first whose rows hold the union. Tiles past 128 keys issue two score
 * products per k-step (wgmma_score_step): 160 keys against 80 on 2-D 256x256 w80 stride 16, 5.72
 * against 6.06-6.17 ms; 160 against 128 on 3-D 30x48x80 w18x24x24 27.5 against 27.7-27.8 ms,
 * 144 against 96 with stride 16x8x8 17.6 against 17.5-17.6; 192 (96 x 2) spilled and was no
 * faster on 2-D w80 (H200, bf16, 16 heads, bench/ab_gpu.py --auto-only --dims 128, two builds) */
static constexpr int TMA_ROWS[][2] = {{16, 8}, {24, 6}, {32, 5}, {48, 2}, {64, 2}, {80, 2}, {96, 1}, {128, 1}};
static constexpr int TMA_ROW_CONFIGS = (int)(sizeof TMA_ROWS / sizeof TMA_ROWS[0]);
static int tma_row_config(int64_t width) {
    for (int i = 0; i < TMA_ROW_CONFIGS; ++i)
        if (width <= TMA_ROWS[i][0]) return i;
    return -1;
}
int nbhd_cuda_tma_row_keys(const nbhd_axis *a, int ct) {
    const int i = tma_row_config(union_width(a, ct));
    return i < 0 ? -1 : TMA_ROWS[i][0];
}

/* Q, K or V ([B, X, Y, Z, H, D] by its strides, f16/bf16, `heads` heads) as a tensor map's
 * axes: 1-D (D, H, X, B), 2-D (D, H, Y, X, B), 3-D (H D, Z, Y, X, B) (the heads and columns as
 * one axis: TMA has 5 at most). False where TMA cannot address it: a step not a positive
 * multiple of 16 bytes below 2^40, a start not 16-byte aligned, columns not contiguous, in 3-D
 * heads not D elements apart. */
struct tensor_map_layout {
    int rank;
    cuuint64_t dims[5], strides[4];
};
static bool map_shape(const nbhd_tensor &t, const nbhd_geometry *g, int rank, int64_t heads, tensor_map_layout *m) {
    const int64_t D = g->head_dim, H = heads;
    if (t.stride[5] != 1 || (uintptr_t)t.data % 16 || (rank == 3 && H > 1 && t.stride[4] != D)) return false;
    const int64_t X = g->axis[0].extent, Y = g->axis[1].extent, Z = g->axis[2].extent;
    int64_t dims[5], steps[4];
    if (rank == 1) {
        const int64_t d[4] = {D, H, X, g->batch}, s[3] = {t.stride[4], t.stride[1], t.stride[0]};
        memcpy(dims, d, sizeof d), memcpy(steps, s, sizeof s);
    } else if (rank == 2) {
        const int64_t d[5] = {D, H, Y, X, g->batch}, s[4] = {t.stride[4], t.stride[2], t.stride[1], t.stride[0]};
        memcpy(dims, d, sizeof d), memcpy(steps, s, sizeof s);
    } else {
        const int64_t d[5] = {H * D, Z, Y, X, g->batch}, s[4] = {t.stride[3], t.stride[2], t.stride[1], t.stride[0]};
        memcpy(dims, d, sizeof d), memcpy(steps, s, sizeof s);
    }
    m->rank = rank == 1 ? 4 : 5;
    for (int i = 0; i < m->rank; ++i) m->dims[i] = (cuuint64_t)dims[i];
    for (int i = 0; i + 1 < m->rank; ++i) {
        // a step along an axis of one position is never taken: any valid value
        const int64_t s = dims[i + 1] == 1 ? 16 : steps[i] * 2;
        if (s <= 0 || s % 16 || s >= (int64_t)1 << 40) return false;
        m->strides[i] = (cuuint64_t)s;
    }
    return true;
}
/* boxes (64 columns of one head by box[1..4] positions on map_shape's axes) of K and V: rs keys
 * along the last axis */
static void row_box(int rank, int rs, cuuint32_t (&box)[5]) {
    for (int i = 0; i < 5; ++i) box[i] = 1;
    box[0] = 64;
    box[rank == 3 ? 1 : 2] = rs;
}
/* Q: boxes of one 16-row m-block (mma_util.cuh patch_wt), its rows in the patch's order (the last
 * axis fastest) */
static void mblock_box(int rank, int shape, cuuint32_t (&box)[5]) {
    for (int i = 0; i < 5; ++i) box[i] = 1;
    box[0] = 64;
    if (rank == 1) {
        box[2] = patch_wt(1, 0);
    } else if (rank == 2) {
        box[2] = patch_wt(2, 1), box[3] = patch_wt(2, 0);
    } else {
        box[1] = patch_wt(3, 2, shape), box[2] = patch_wt(3, 1, shape), box[3] = patch_wt(3, 0, shape);
    }
}
static bool tensor_map(CUtensorMap *map, const nbhd_tensor &t, const nbhd_geometry *g, int rank, int64_t heads,
                       const cuuint32_t (&box)[5]) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    tensor_map_layout m;
    if (!encode || !map_shape(t, g, rank, heads, &m)) return false;
    const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
    return encode(map, g->dtype == NBHD_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                  (cuuint32_t)m.rank, t.data, m.dims, m.strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int nbhd_cuda_tma_forward_applies(const nbhd_geometry *g) {
    const int rank = mma_rank_of(g);
    if (!g->has_window || g->extra_kv || g->rpb || g->head_dim != 128 || g->head_dim_v != 128 ||
        (g->dtype != NBHD_F16 && g->dtype != NBHD_BF16))
        return 0;
    for (int ax = 0; ax < rank; ++ax)
        if (g->axis[ax].dilation != 1) return 0;
    /* 2-D and 3-D: rows of the union fit a tile's row (a 3-D patch may be 8 wide on the last axis) */
    return rank == 1 || nbhd_cuda_tma_row_keys(&g->axis[rank - 1], 8) > 0;
}

int nbhd_cuda_tma_forward_fits(const nbhd_geometry *g, const nbhd_forward_args *a) {
    const int rank = mma_rank_of(g);
    tensor_map_layout m;
    return map_shape(a->q, g, rank, g->heads, &m) && map_shape(a->k, g, rank, g->kv_heads, &m) &&
           map_shape(a->v, g, rank, g->kv_heads, &m) && tensor_map_encoder() != nullptr;
}

template <typename T, int RANK, int SHAPE, int RS, int R>
static nbhd_status launch_rows(const nbhd_geometry *g, const nbhd_forward_args *a, const mma_plan &P,
                               cudaStream_t st) {
    static_assert(tma_forward_smem(128, RS * R) <= 227 * 1024, "a Hopper CTA has at most 227 KiB of shared memory");
    alignas(64) CUtensorMap qmap, kmap, vmap;
    cuuint32_t qbox[5], kvbox[5];
    mblock_box(RANK, SHAPE, qbox);
    row_box(RANK, RS, kvbox);
    if (!tensor_map(&qmap, a->q, g, RANK, g->heads, qbox) || !tensor_map(&kmap, a->k, g, RANK, g->kv_heads, kvbox) ||
        !tensor_map(&vmap, a->v, g, RANK, g->kv_heads, kvbox))
        return nbhd_fail(NBHD_ERR_UNSUPPORTED, "TMA forward: Q, K or V not addressable by a tensor map");
    // persistent CTAs, one per multiprocessor, each walking the patches gridDim.x apart
    const int64_t items = g->batch * g->heads * P.patches;
    nbhd_status s;
    if ((s = nbhd_cuda_grid_fits(items, "TMA forward")) != NBHD_OK) return s;
    const int64_t sms = nbhd_cuda_device_facts().sms;
    return nbhd_cuda_launch(fna_wgmma_tma_forward_kernel<T, 128, RANK, RS, R, SHAPE>, items < sms ? items : sms, 384,
                            tma_forward_smem(128, RS * R), "TMA forward", st, *g, *a, P, qmap, kmap, vmap);
}

/* the kernel of TMA_ROWS[config] */
template <typename T, int RANK, int SHAPE, int I = 0>
static nbhd_status launch_row_config(int config, const nbhd_geometry *g, const nbhd_forward_args *a,
                                     const mma_plan &P, cudaStream_t st) {
    if constexpr (I == TMA_ROW_CONFIGS) {
        return nbhd_fail(NBHD_ERR_UNSUPPORTED, "TMA forward: a union wider than 128 keys on the last axis");
    } else {
        if (config == I) return launch_rows<T, RANK, SHAPE, TMA_ROWS[I][0], TMA_ROWS[I][1]>(g, a, P, st);
        return launch_row_config<T, RANK, SHAPE, I + 1>(config, g, a, P, st);
    }
}

template <typename T>
static nbhd_status launch(const nbhd_geometry *g, const nbhd_forward_args *a, int shape, cudaStream_t st) {
    return with_patch<2>(g, shape, [&](auto rank, auto shape_c, const mma_plan &P) -> nbhd_status {
        constexpr int RANK = decltype(rank)::value, SHAPE = decltype(shape_c)::value;
        if constexpr (RANK == 1) {
            return launch_rows<T, 1, SHAPE, 128, 1>(g, a, P, st);
        } else {
            return launch_row_config<T, RANK, SHAPE>(
                tma_row_config(union_width(&g->axis[RANK - 1], P.ct[RANK - 1])), g, a, P, st);
        }
    });
}

nbhd_status nbhd_cuda_tma_forward(const nbhd_geometry *g, const nbhd_forward_args *a, int shape, cudaStream_t st) {
    return g->dtype == NBHD_BF16 ? launch<__nv_bfloat16>(g, a, shape, st) : launch<__half>(g, a, shape, st);
}
