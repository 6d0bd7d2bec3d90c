/*
 * fna_wgmma_jvp.cu — the Hopper forward+JVP (O, LSE, tO, mu) on 128-query patches (and at
 * D = 128 on 64-query ones, one warpgroup per CTA: small windows): warpgroup MMA (wgmma, sm_90a)
 * for f16/bf16 with D = Dv in {64, 128}. The math is fna_mma_jvp.cu's:
 *
 *   S  = Q K^T,  tS = s (tQ K^T + Q tK^T)
 *   m, l online in base 2; p = 2^(S s log2e - m);  r = r 2^(m_old-m) + sum p tS
 *   O  = O 2^(m_old-m) + P V
 *   C  = C 2^(m_old-m) + (P . tS) V + P tV
 *   o = O/l, mu = r/l, tO = C/l - mu o
 *
 * the tiles and pipeline those of fna_wgmma.cu (warpgroups of 64 queries; per tile S and tS
 * by wgmma from shared memory, then the previous tile's three value products from registers
 * while this tile's softmax runs). Absent tangents are loaded as zeros, so that every wgmma is
 * issued unconditionally (ptxas serialises wgmma under branches it cannot prove uniform).
 */
#include "wgmma.cuh"

/* row masks (one warpgroup in 2-D and 3-D, cta_patch.cuh row_masks) with the smaller table */
template <int RANK, int BN, bool RMASK>
using wgj_row_masks = wg_row_masks<RANK, BN, WGMMA_K_STAGES, RMASK, false, row_masks<3>::JVP_ENTRIES>;

/* The tiles (after up to 1024 bytes of alignment) and the key coordinates, or with row masks
 * their table and words in the coordinates' place. One warpgroup at D = 128 takes no alignment
 * slack, so that two CTAs fit an SM (2 x 113 KiB): the dynamic shared memory of a CTA without
 * static shared memory starts 1024-aligned on Hopper, which the kernel checks (a trap, never a
 * silent overrun). */
template <int HD, int BN, int WGS, bool RMASK = false>
static constexpr size_t wgj_smem_bytes(int rank) {
    return (WGS == 1 ? 0 : 1024) +
           2 * (size_t)(2 * wg_rows(WGS) * HD + 2 * (WGMMA_K_STAGES + WGMMA_V_STAGES) * BN * HD) +
           (RMASK ? wgj_row_masks<3, BN, true>::BYTES : sizeof(int) * WGMMA_K_STAGES * rank * BN);
}

template <typename T, int HD, int BN, int RANK, int WGS, bool BIAS /* problem.rpb */,
          bool RMASK /* row masks (row_masks_fit, JVP_ENTRIES): 64-query patches in 2-D and 3-D, no bias */,
          int SHAPE = PATCH_CUBE /* the 3-D m-block (mma_util.cuh patch_wt) */>
__global__ void __launch_bounds__(wg_threads(WGS), WGS == 1 ? 2 : 1)
fna_wgmma_jvp_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_forward_jvp_args a, const mma_plan P) {
#if NBHD_HAS_WGMMA
    static_assert(!RMASK || (row_masked_kernel(WGS, RANK, BN) && !BIAS), "row masks: one warpgroup, 2-D/3-D");
    using CTA = wg_cta<RANK, WGS, SHAPE>;
    constexpr int BM = CTA::BM, THREADS = CTA::THREADS, KST = WGMMA_K_STAGES, VST = WGMMA_V_STAGES, TILE = BN * HD;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t pad = (1024 - (smem_u32(smem_raw) & 1023)) & 1023;
    if (WGS == 1 && pad) __trap();
    T *Qs = (T *)(smem_raw + pad); /* [BM][HD] */
    T *tQs = Qs + BM * HD;                  /* [BM][HD] */
    T *Ks = tQs + BM * HD;                  /* [KST][BN][HD] */
    T *tKs = Ks + KST * TILE;               /* [KST][BN][HD] */
    T *Vs = tKs + KST * TILE;               /* [VST][BN][HD] */
    T *tVs = Vs + VST * TILE;               /* [VST][BN][HD] */
    int *kc = (int *)(tVs + VST * TILE);    /* [KST][RANK][BN] in-group key coordinates */
    using Masks = wgj_row_masks<RANK, BN, RMASK>;
    Masks rm(kc);                           /* with row masks (in kc's place): their table and words */

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, wg = warpgroup_of<WGS>(w);
    CTA C;
    if (!C.place_queries(g, P, BN)) return;
    const int win_tiles = C.win_tiles, tiles = C.tiles;

    C.template load_rows<T, HD>(g, P, a.q, a.t_q, C.h, Qs, tQs, tid);  /* zero rows outside the grid; tQ when absent */
    if constexpr (RMASK) rm.build(C, g, C.kb, tid);

    // K, tK, V, tV (and key coordinates) of tile t: one key per TPR threads
    auto load_tile = [&](int t, int) {
        constexpr int CH = HD / 8, TPR = THREADS / BN, CPT = CH / TPR;
        const int kr = tid / TPR;
        int j[3];
        int64_t e;
        const bool ok = C.key(g, t, kr, BN, j, e);
        const bool win = t < win_tiles;
        const nbhd_tensor &k = win ? a.k : a.kx, &v = win ? a.v : a.vx;
        const nbhd_tensor &tk = win ? a.t_k : a.t_kx, &tv = win ? a.t_v : a.t_vx;
        const bool has_tk = tk.data != nullptr, has_tv = tv.data != nullptr;
        auto src = [&](const nbhd_tensor &x) -> const T * {
            if (!x.data) return (const T *)k.data;  /* absent: a valid address, copied as zeros */
            if (!win) return C.template extra_row<T>(x, e);
            return group_ptr_of<const T>(x, g, C.b, C.grp, C.hk).at(j[0], j[1], j[2]);
        };
        const T *ks = src(k), *vs = src(v), *tks = src(tk), *tvs = src(tv);
        T *Kd = Ks + (t % KST) * TILE, *tKd = tKs + (t % KST) * TILE;
        T *Vd = Vs + (t % VST) * TILE, *tVd = tVs + (t % VST) * TILE;
#pragma unroll
        for (int cc = 0; cc < CPT; ++cc) {
            const int ch = cc * TPR + tid % TPR, off = gmma_off<BN>(kr, ch);
            cp_async16(smem_u32(Kd + off), ks + ch * 8, ok);
            cp_async16(smem_u32(Vd + off), vs + ch * 8, ok);
            cp_async16(smem_u32(tKd + off), tks + ch * 8, ok && has_tk);
            cp_async16(smem_u32(tVd + off), tvs + ch * 8, ok && has_tv);
        }
        if (tid % TPR == 0) {
            if constexpr (RMASK) rm.put(t % KST, kr, C.kb, ok, win, j);
            else put_coords<RANK, BN>(kc + (t % KST) * RANK * BN, kr, ok, j);
        }
    };

    const int cq = lane & 3;
    int wst[2][RANK], wen[2][RANK], ilo[RANK], ihi[RANK], brow[2];
    bool rvalid[2];
    C.row_windows(g, P, w, lane, wst, wen, rvalid, ilo, ihi, brow);
    const float *tab = BIAS ? tile_bias<RANK>::table(g, a.rpb, C.h) : nullptr;
    const float *t_tab = BIAS ? tile_bias<RANK>::table(g, a.t_rpb, C.h) : nullptr;

    float o[HD / 8][4], ct[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][e] = ct[i][e] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, r[2] = {0.f, 0.f};
    const float sl2 = P.scale_log2, scale = P.scale_log2 * 0.69314718055994531f;
    const uint32_t q_base = smem_u32(Qs) + wg * 64 * 128, tq_base = smem_u32(tQs) + wg * 64 * 128;

    // the previous tile's value products, in flight during this tile's softmax: P and P . tS in
    // registers (zero before the first tile), V and tV in that tile's stages
    uint32_t pf[BN / 16][4], ptf[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) pf[kk][i] = ptf[kk][i] = 0u;
    uint32_t pv_v = smem_u32(Vs), pv_tv = smem_u32(tVs);
    auto issue_pv = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const uint64_t vd = gmma_desc(pv_v, kk * 16 * 128, BN * 128, 1024);
            const uint64_t tvd = gmma_desc(pv_tv, kk * 16 * 128, BN * 128, 1024);
            wgmma_op<T, HD>::rs_bt(&o[0][0], pf[kk], vd, 1);     // O += P V
            wgmma_op<T, HD>::rs_bt(&ct[0][0], ptf[kk], vd, 1);   // C += (P . tS) V
            wgmma_op<T, HD>::rs_bt(&ct[0][0], pf[kk], tvd, 1);   //    + P tV
        }
        wgmma_commit();
    };
    auto pv_done = [&]() {
        fence_regs(pf);
        fence_regs(ptf);
        fence_regs(o);
        fence_regs(ct);
    };

    constexpr int RING = KST * VST;  /* the ring's stage index is unused: K and V have their own */
    tile_ring_start<RING, 1>(tiles, load_tile);  /* Q, tQ ride with tile 0's group */
    for (int t = 0; t < tiles; ++t) {
        tile_ring_next<RING, 1, true>(t, tiles, load_tile);
        const uint32_t k_base = smem_u32(Ks + (t % KST) * TILE), tk_base = smem_u32(tKs + (t % KST) * TILE);
        const int *kct = kc + (t % KST) * RANK * BN;
        const bool win = t < win_tiles;

        // S = Q K^T, tS = tQ K^T + Q tK^T, then the previous tile's value products
        float sc[BN / 8][4], ts[BN / 8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const uint32_t at = (kk >> 2) * BM * 128 + (kk & 3) * 32, bt = (kk >> 2) * BN * 128 + (kk & 3) * 32;
            const uint64_t qd = gmma_desc(q_base, at, 16, 1024), tqd = gmma_desc(tq_base, at, 16, 1024);
            const uint64_t kd = gmma_desc(k_base, bt, 16, 1024), tkd = gmma_desc(tk_base, bt, 16, 1024);
            wgmma_op<T, BN>::ss(&sc[0][0], qd, kd, kk > 0);
            wgmma_op<T, BN>::ss(&ts[0][0], tqd, kd, kk > 0);
            wgmma_op<T, BN>::ss(&ts[0][0], qd, tkd, 1);
        }
        wgmma_commit();
        issue_pv();

        // the tile inside every row's window of the warpgroup (with row masks: every key holds
        // all 16 rows of the warp): no mask
        const uint32_t *kmt = rm.warp_words(t % KST, w);
        bool full = false;
        if constexpr (RMASK) full = Masks::full(kmt, w, lane);
        else if (win) full = tile_inside<BN, RANK>(kct, lane, ilo, ihi);
        wgmma_wait<1>();  /* S and tS are done; the value products may still run */
        fence_regs(sc);
        fence_regs(ts);

        float corr[2];
        const bool rescale = jvp_softmax_tile<BN, RANK, BIAS, RMASK>(g, sc, ts, m, l, r, corr, full, win, kct, wst,
                                                                     wen, rvalid, sl2, scale, cq, tab, t_tab, brow,
                                                                     kmt, Masks::row_bit(w, lane));
        wgmma_wait<0>();
        pv_done();
        if (rescale) {
#pragma unroll
            for (int nd = 0; nd < HD / 8; ++nd) {
                o[nd][0] *= corr[0]; o[nd][1] *= corr[0]; o[nd][2] *= corr[1]; o[nd][3] *= corr[1];
                ct[nd][0] *= corr[0]; ct[nd][1] *= corr[0]; ct[nd][2] *= corr[1]; ct[nd][3] *= corr[1];
            }
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            a_frag_of<T>(pf[kk], sc[2 * kk], sc[2 * kk + 1]);
            a_frag_of<T>(ptf[kk], ts[2 * kk], ts[2 * kk + 1]);
        }
        pv_v = smem_u32(Vs + (t % VST) * TILE);
        pv_tv = smem_u32(tVs + (t % VST) * TILE);
    }
    wgmma_fence();
    issue_pv();  /* the last tile's (with no tile, P = 0) */
    wgmma_wait<0>();
    pv_done();
    cp_async_wait<0>();

    const int64_t dil[3] = {g.axis[0].dilation, g.axis[1].dilation, g.axis[2].dilation};
    jvp_store<T, HD>(g, a, C.b, C.h, o, ct, m, l, r, lane, (float *)Qs + w * exact_jvp_scratch(HD, HD),
                     [&](int hrow, int64_t c[3]) {
        int iq[3];
        if (!C.row(w * 16 + (lane >> 2) + 8 * hrow, iq)) return false;
        for (int ax = 0; ax < 3; ++ax) c[ax] = C.grp[ax] + (int64_t)iq[ax] * dil[ax];
        return true;
    });
#endif
}

// ----------------------------------------------------------------------------
// launch (on the mma.sync forward+JVP's conditions, fna_mma_jvp.cu, when nbhd_cuda_wgmma_ready)

template <typename T, int HD, int BN, int RANK, int WGS, int SHAPE>
static nbhd_status launch_rank(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, const mma_plan &P,
                               cudaStream_t st) {
    // row masks on one warpgroup's 64-query patches in 2-D and 3-D where the smaller table fits
    constexpr bool RM = row_masked_kernel(WGS, RANK, BN);
    constexpr bool CUBE = SHAPE == PATCH_CUBE;  // no bias table on flat patches (with_patch)
    const bool rmask = RM && row_masks_fit(g, RANK, false, row_masks<3>::JVP_ENTRIES);
    constexpr size_t smem = wgj_smem_bytes<HD, BN, WGS>(RANK), smem_rm = wgj_smem_bytes<HD, BN, WGS, RM>(RANK);
    static_assert(smem <= 227 * 1024 && smem_rm <= 227 * 1024, "a Hopper CTA has at most 227 KiB of shared memory");
    static_assert(WGS == 2 || (smem <= 113 * 1024 && smem_rm <= 113 * 1024), "one warpgroup: two CTAs per SM");
    auto kernel = g->rpb   ? fna_wgmma_jvp_kernel<T, HD, BN, RANK, WGS, CUBE, false, SHAPE>
                  : rmask ? fna_wgmma_jvp_kernel<T, HD, BN, RANK, WGS, false, RM, SHAPE>
                          : fna_wgmma_jvp_kernel<T, HD, BN, RANK, WGS, false, false, SHAPE>;
    return nbhd_cuda_launch(kernel, g->batch * g->heads * P.patches,
                            wg_threads(WGS), rmask ? smem_rm : smem, "wgmma forward_jvp", st, *g, *a, P);
}

template <typename T, int HD, int BN, int WGS>
static nbhd_status launch_ranks(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, int shape, cudaStream_t st) {
    return with_patch<WGS>(g, shape, [&](auto rank, auto shape_c, const mma_plan &P) {
        return launch_rank<T, HD, BN, decltype(rank)::value, WGS, decltype(shape_c)::value>(g, a, P, st);
    });
}

/* the kernel of the choice (kernel_choice.cu choose_forward_jvp): 128-query patches on two
 * warpgroups with key tiles of 64; at D = 128 also 64-query patches on one warpgroup with key
 * tiles of 32, two CTAs per SM */
template <typename T, int HD>
static nbhd_status launch(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, const nbhd_cuda_choice &c,
                          cudaStream_t st) {
    if (c.mb == 2 && c.bn == 64) return launch_ranks<T, HD, 64, 2>(g, a, c.shape, st);
    if constexpr (HD == 128)
        if (c.mb == 1 && c.bn == 32) return launch_ranks<T, HD, 32, 1>(g, a, c.shape, st);
    return nbhd_cuda_no_kernel("wgmma forward_jvp", &c);
}

nbhd_status nbhd_cuda_wgmma_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                        const nbhd_cuda_choice *c, cudaStream_t st) {
    const bool bf = g->dtype == NBHD_BF16;
    switch (g->head_dim) {
    case 64: return bf ? launch<__nv_bfloat16, 64>(g, a, *c, st) : launch<__half, 64>(g, a, *c, st);
    case 128: return bf ? launch<__nv_bfloat16, 128>(g, a, *c, st) : launch<__half, 128>(g, a, *c, st);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "wgmma forward_jvp: head_dim %d", g->head_dim);
}
