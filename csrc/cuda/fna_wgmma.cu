/*
 * fna_wgmma.cu — the Hopper forward (O, LSE): warpgroup MMA (wgmma, sm_90a), for f16/bf16 with
 * D = Dv in {64, 128} on 128-query patches (mma_util.cuh patch_*, mb = 2: large windows) and at
 * D = 128 also on 64-query patches (mb = 1: small windows, whose unions waste less at 64).
 *
 * Why: mma.sync feeds the tensor cores from registers that every warp first loads with ldmatrix,
 * which caps the mma.sync forward near a third of the dense rate (bench/bench_gpu.py, large windows);
 * wgmma reads K and V straight from shared memory, 64 query rows per instruction.
 *
 * A CTA is WGS warpgroups (two on 128-query patches, one on 64); warpgroup wg owns the patch's
 * m-blocks 4 wg .. 4 wg + 3 (64 queries, a box: 1-D 64, 2-D 8x8, 3-D 4x4x4), warp w m-block w,
 * so a thread's rows and columns are those of the mma.sync forward (fna_mma.cu) with one
 * m-block per warp, and its softmax and epilogue are the same functions (mma_util.cuh
 * fwd_softmax_tile, fwd_store). The CTA walks the exact union of its windows in tiles of BN
 * keys (then the extra keys), K and V in a ring of shared-memory stages filled by cp.async in
 * the layout of wgmma.cuh; per tile each warpgroup issues
 *   S = Q K^T          HD/16 wgmma m64nBNk16, K from shared memory, Q from registers (each
 *                      warp's A fragments; from shared memory on two warpgroups in 1-D)
 *   O += P' V'         BN/16 wgmma m64nHDk16 of the previous tile, P' from registers
 * then, while the second runs on the tensor cores, the softmax of S (scale, mask unless the tile
 * is inside every row's window, online max and sum), and after it O's rescale and the new P.
 * One warpgroup in 2-D and 3-D masks by row bits (RMASK: cta_patch.cuh row_masks, each key's
 * word written by the thread that loads it) instead of comparing key coordinates.
 */
#include "wgmma.cuh"

template <typename T, int HD, int BN, int RANK, int MINB, int WGS, bool BIAS /* problem.rpb */,
          bool RMASK /* row masks (row_masks_fit): 64-query patches in 2-D and 3-D, no bias */,
          int SHAPE = PATCH_CUBE /* the 3-D m-block (mma_util.cuh patch_wt) */>
__global__ void __launch_bounds__(wg_threads(WGS), MINB)
fna_wgmma_forward_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_forward_args a, const mma_plan P) {
#if NBHD_HAS_WGMMA
    static_assert(!RMASK || (row_masked_kernel(WGS, RANK, BN) && !BIAS), "row masks: one warpgroup, 2-D/3-D");
    using CTA = wg_cta<RANK, WGS, SHAPE>;
    constexpr int BM = CTA::BM, THREADS = CTA::THREADS, KST = WGMMA_K_STAGES, VST = WGMMA_V_STAGES;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = (T *)(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023)); /* [BM][HD]; O staged here */
    T *Ks = Qs + BM * HD;                          /* [KST][BN][HD] */
    T *Vs = Ks + KST * BN * HD;                    /* [VST][BN][HD] */
    int *kc = (int *)(Vs + VST * BN * HD);         /* [KST][RANK][BN] in-group key coordinates */
    using Masks = wg_row_masks<RANK, BN, KST, RMASK>;
    Masks rm(kc + KST * RANK * BN);                /* with row masks: their table and words */
    float *tabs = (float *)((char *)(kc + KST * RANK * BN) + Masks::BYTES); /* with a bias: the head's table * log2e */

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, wg = warpgroup_of<WGS>(w);
    CTA C;  /* (b, head, patch) and the patch's key walk */
    if (!C.place_queries(g, P, BN)) return;
    const int win_tiles = C.win_tiles, tiles = C.tiles;
    auto row_coords = [&](int qr, int iq[3]) -> bool { return C.row(qr, iq); };

    C.template load_rows<T, HD, false>(g, P, a.q, a.q, C.h, Qs, Qs, tid);  /* zero rows outside the grid */
    if constexpr (RMASK) rm.build(C, g, C.kb, tid);

    // K, V (and key coordinates) of tile t into their stages: one key per TPR threads
    const group_ptr<const T> kp = group_ptr_of<const T>(a.k, g, C.b, C.grp, C.hk);
    const group_ptr<const T> vp = group_ptr_of<const T>(a.v, g, C.b, C.grp, C.hk);
    auto load_tile = [&](int t, int) {
        C.template load_kv_tile<T, HD, BN, THREADS>(g, a, kp, vp, t, Ks + (t % KST) * BN * HD,
                                                    Vs + (t % VST) * BN * HD, kc + (t % KST) * RANK * BN, tid,
                                                    [](int r, int ch) { return gmma_off<BN>(r, ch); }, rm.key_out(C, t % KST));
    };

    // this thread's rows (r, r + 8 of its warp's m-block): validity and in-group windows; the
    // intersection of the warpgroup's windows (a tile inside it skips the mask)
    const int rq = lane >> 2, cq = lane & 3;
    auto my_row = [&](int, int hrow) { return w * 16 + rq + 8 * hrow; };
    int wst[1][2][RANK], wen[1][2][RANK], iq[2][3], ilo[RANK], ihi[RANK];
    bool rvalid[1][2];
    C.rows_and_box(g, P, w, lane, wg, wst[0], wen[0], rvalid[0], iq, ilo, ihi);
    if (BIAS) stage_bias_table(tabs, tile_bias<RANK>::table(g, a.rpb, C.h), g.rpb_entries, tid, THREADS);
    const int brow[1][2] = {{tile_bias<RANK>::row(g, iq[0]), tile_bias<RANK>::row(g, iq[1])}};

    // O += P V of the previous tile runs while this tile's softmax does (wg_forward_state): V in
    // the previous tile's stage (the ring loads one tile ahead of three stages, so that stage is
    // not reloaded before the next barrier); no tile is skipped, and the first tile's "previous"
    // P V is P = 0 on its own V
    wg_forward_state<T, HD, BN> F;
    const float sl2 = P.scale_log2;
    const uint32_t q_base = smem_u32(Qs) + wg * 64 * 128;  /* this warpgroup's 64 rows */
    uint32_t pv_stage = smem_u32(Vs);

    // Each warp holds its Q rows as A fragments (m16 x k16 per k-step), so that S = Q K^T reads
    // only K from shared memory. One warpgroup's m64n32k16 would read 3 KB of shared memory (Q's
    // 2, K's 1) per 16 cycles of products: with Q held, faster on every problem that runs it
    // (bench/ab_gpu.py --auto-only, A/B of two builds; docs/kernels.md §3); on two warpgroups'
    // 64-key tiles 2-8 % faster in 2-D and 3-D, even or slower in 1-D (bench/bench_gpu.py
    // --forward-only, A/B of two builds)
    constexpr bool QREG = WGS == 1 || RANK >= 2;
    uint32_t qf[QREG ? HD / 16 : 1][4];
    constexpr int RING = KST * VST;  /* the ring's stage index is unused: K and V have their own */
    tile_ring_start<RING, 1>(tiles, load_tile);  /* Q rides with tile 0's group */
    for (int t = 0; t < tiles; ++t) {
        tile_ring_next<RING, 1, true>(t, tiles, load_tile);
        if constexpr (QREG)
            if (t == 0)
#pragma unroll
                for (int kk = 0; kk < HD / 16; ++kk)
                    ldmatrix_x4(qf[kk], smem_u32(Qs + gmma_off<BM>(w * 16 + (lane & 15), 2 * kk + (lane >> 4))));
        const uint32_t k_base = smem_u32(Ks + (t % KST) * BN * HD), v_base = smem_u32(Vs + (t % VST) * BN * HD);
        const int *kct = kc + (t % KST) * RANK * BN;
        const bool win = t < win_tiles;

        // S = Q K^T, then the previous tile's O += P V behind it
        float sc[1][BN / 8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            if constexpr (QREG) {
                const uint32_t sb = (kk >> 2) * BN * 128 + (kk & 3) * 32;  /* as wgmma_score_step's B */
                wgmma_op<T, BN>::rs(&sc[0][0][0], qf[kk], gmma_desc(k_base, sb, 16, 1024), kk > 0);
            } else {
                wgmma_score_step<T, BN, BM, BN>(sc[0], q_base, k_base, kk, kk > 0);
            }
        }
        wgmma_commit();
        F.issue_pv(pv_stage);

        // meanwhile: is the tile inside every row's window of the warpgroup (no mask)? With row
        // masks: does every key of the tile hold all 16 rows of the warp?
        const uint32_t *kmt = rm.warp_words(t % KST, w);
        bool full = false;
        if constexpr (RMASK)
            full = Masks::full(kmt, w, lane);
        else if (win)
            full = tile_inside<BN, RANK>(kct, lane, ilo, ihi);
        wgmma_wait<1>();  /* S is done; P V may still run */
        fence_regs(sc[0]);

        float corr[1][2];
        const bool rescale = fwd_softmax_tile<1, BN, RANK, BIAS ? BIAS_STAGED : BIAS_NONE, RMASK>(
            g, sc, F.m, F.l, corr, full, win, kct, wst, wen, rvalid, sl2, cq, tabs, brow, kmt, Masks::row_bit(w, lane));
        wgmma_wait<0>();
        F.pv_done();
        F.take_p(sc, rescale, corr);
        pv_stage = v_base;
    }
    wgmma_fence();
    F.issue_pv(pv_stage);  /* the last tile's (with no tile, P = 0) */
    wgmma_wait<0>();
    F.pv_done();
    cp_async_wait<0>();
    __syncthreads();  /* both warpgroups' wgmma reads of Qs are done before it stages O */

    fwd_store<T, 1, HD>(g, a, C.grp, C.b, C.h, F.o, F.m, F.l, Qs, w * 16, lane, row_coords, my_row);
#endif
}

// ----------------------------------------------------------------------------
// availability and launch

/* The kernels exist only in an sm_90a image (setup.py builds "90" as "90a"): the image the
 * driver picked for this device must be one. Cached per device. */
int nbhd_cuda_wgmma_ready(void) {
    static int ready[64];  /* 0 unknown, 1 yes, 2 no */
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        cudaGetLastError();
        return 0;
    }
    if (!ready[dev]) {
        cudaFuncAttributes attr;
        const bool ok = cudaFuncGetAttributes(&attr, fna_wgmma_forward_kernel<__nv_bfloat16, 128, 64, 1, 1, 2, false, false>) ==
                            cudaSuccess && attr.binaryVersion == 90;
        cudaGetLastError();
        ready[dev] = ok ? 1 : 2;
    }
    return ready[dev] == 1;
}

/* a CTA's shared memory: alignment slack, Q, the K and V stages, their key coordinates, with
 * row masks their table and the keys' words, and with a bias the head's table (rpb_entries
 * floats) */
static size_t forward_smem_bytes(const nbhd_geometry *g, size_t elem, int HD, int BN, int RANK, int WGS,
                                 bool rmask) {
    return 1024 + elem * (size_t)(wg_rows(WGS) + (WGMMA_K_STAGES + WGMMA_V_STAGES) * BN) * HD +
           sizeof(int) * WGMMA_K_STAGES * RANK * BN +
           (rmask ? wg_row_masks<3, 32, WGMMA_K_STAGES, true>::BYTES : 0) +
           (g->rpb ? sizeof(float) * (size_t)g->rpb_entries : 0);
}

size_t nbhd_cuda_wgmma_forward_smem_bytes(const nbhd_geometry *g, int mb) {
    const int HD = (int)g->head_dim;
    return forward_smem_bytes(g, 2, HD, mb == 2 ? 64 : 32, NBHD_MAX_RANK, mb, mb == 1 && !g->rpb);
}

template <typename T, int HD, int BN, int RANK, int MINB, int WGS, int SHAPE>
static nbhd_status launch_rank(const nbhd_geometry *g, const nbhd_forward_args *a, const mma_plan &P,
                               cudaStream_t st) {
    // row masks on one warpgroup's 64-query patches in 2-D and 3-D where the table fits
    constexpr bool RM = row_masked_kernel(WGS, RANK, BN);
    constexpr bool CUBE = SHAPE == PATCH_CUBE;  // no bias table on flat patches (with_patch)
    const bool rmask = RM && row_masks_fit(g, RANK);
    const size_t smem = forward_smem_bytes(g, sizeof(T), HD, BN, RANK, WGS, rmask);
    auto kernel = g->rpb   ? fna_wgmma_forward_kernel<T, HD, BN, RANK, MINB, WGS, CUBE, false, SHAPE>
                  : rmask ? fna_wgmma_forward_kernel<T, HD, BN, RANK, MINB, WGS, false, RM, SHAPE>
                          : fna_wgmma_forward_kernel<T, HD, BN, RANK, MINB, WGS, false, false, SHAPE>;
    return nbhd_cuda_launch(kernel, g->batch * g->heads * P.patches,
                            wg_threads(WGS), smem, "wgmma forward", st, *g, *a, P);
}

template <typename T, int HD, int BN, int MINB, int WGS>
static nbhd_status launch_ranks(const nbhd_geometry *g, const nbhd_forward_args *a, int shape, cudaStream_t st) {
    return with_patch<WGS>(g, shape, [&](auto rank, auto shape_c, const mma_plan &P) {
        return launch_rank<T, HD, BN, decltype(rank)::value, MINB, WGS, decltype(shape_c)::value>(g, a, P, st);
    });
}

/* the kernel of the choice (kernel_choice.cu choose_forward): 128-query patches on two
 * warpgroups with key tiles of 64, two CTAs per SM at D = 64, one at D = 128; at D = 128 also
 * 64-query patches on one warpgroup with key tiles of 32, three CTAs per SM */
template <typename T, int HD>
static nbhd_status launch(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_cuda_choice &c,
                          cudaStream_t st) {
    if (c.mb == 2 && c.bn == 64 && c.minb == (HD == 64 ? 2 : 1))
        return c.tma ? nbhd_cuda_tma_forward(g, a, c.shape, st)
                     : launch_ranks<T, HD, 64, HD == 64 ? 2 : 1, 2>(g, a, c.shape, st);
    if constexpr (HD == 128)
        if (c.mb == 1 && c.bn == 32 && c.minb == 3) return launch_ranks<T, HD, 32, 3, 1>(g, a, c.shape, st);
    return nbhd_cuda_no_kernel("wgmma forward", &c);
}
nbhd_status nbhd_cuda_wgmma_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                    const nbhd_cuda_choice *c, cudaStream_t st) {
    const bool bf = g->dtype == NBHD_BF16;
    switch (g->head_dim) {
    case 64: return bf ? launch<__nv_bfloat16, 64>(g, a, *c, st) : launch<__half, 64>(g, a, *c, st);
    case 128: return bf ? launch<__nv_bfloat16, 128>(g, a, *c, st) : launch<__half, 128>(g, a, *c, st);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "wgmma forward: head_dim %d", g->head_dim);
}
