/*
 * fna_wgmma_bwd.cu — the Hopper backward (dQ, dK, dV) on 128-row patches (two warpgroups), and
 * at D = 128 on 64-row patches (one warpgroup, small windows, deterministic only): warpgroup MMA
 * (wgmma, sm_90a), f16/bf16, D = Dv in {64, 128}. The two deterministic passes of
 * fna_mma_bwd.cu (which keeps D_i and the extra keys' dK/dV) on wgmma:
 *
 *   dq kernel    query-stationary: a 128-query patch (two warpgroups of 64 queries) walks the
 *                exact union of its windows, then the extra keys, in tiles of BN keys:
 *                  S = Q K^T, dP = dO V^T            Q, dO, K, V from shared memory
 *                  P = 2^(S s log2e - lse log2e), dS = P (dP - D_i)
 *                  dQ += dS K                        dS from registers, K MN-major
 *   dkdv kernel  key-stationary: a 128-key patch walks the exact union of its keys' inverse
 *                neighbourhoods in tiles of BN queries, for every query head of its key head:
 *                  S^T = K Q^T, dP^T = V dO^T
 *                  dV += P^T dO, dK += dS^T Q        P^T, dS^T from registers
 *                KV-parallel: dS^T is also staged in shared memory, and each warpgroup forms a
 *                64 x 64 block of dQ = dS K (its 64 of the tile's 128 queries at D = 64, its 64
 *                of 128 columns at D = 128) over the CTA's 128 keys (both operands MN-major)
 *                and adds it with fp32 atomics to
 *                the accumulator fna_mma_bwd.cu clears and converts: no dq kernel, so S and dP
 *                are formed once (5 products per tile instead of 7), summation order not fixed.
 *
 * Otherwise each output element is written once by one thread: deterministic. A tile inside every row's
 * window of a warpgroup skips the mask (wgmma.cuh tile_inside); one warpgroup in 2-D and 3-D masks
 * by row bits instead (RMASK: cta_patch.cuh row_masks; a warp whose rows all meet the tile skips
 * it). Every wgmma is issued on every
 * tile outside any branch (ptxas serialises wgmma it cannot prove warpgroup-uniform). The dq
 * kernel leaves the previous tile's dQ product running during this tile's P and dS, as the
 * forward does its P V; the dkdv kernel's two accumulators (128 registers at D = 128) leave no
 * room for a second tile's scores, so its dV product runs while dS^T is formed, and it waits
 * for dK before the next tile (left running into the next tile's barrier, the products made
 * ptxas serialise every wgmma of the kernel, warning C7515); the other warpgroup's work fills
 * the tensor cores while this one computes P^T. Splitting S^T and dP^T into two groups, to form
 * P^T while dP^T runs, measured no faster (bench/bench_gpu.py).
 */
#include <stdlib.h>

#include "wgmma.cuh"

/* Stages: an operand of a product still running after its tile's barrier (K of dQ += dS K; Q,
 * dO of dK, dV) needs three in a ring loaded one tile ahead, one read only by the scores two. */
#define WGB_DQ_K_STAGES 3
#define WGB_DQ_V_STAGES 2
#define WGB_KV_STAGES 3

/* the dq kernel's: alignment slack, Q, dO, the K and V stages, their key coordinates, with row
 * masks their table and the keys' words (tiles of 32), and with a bias the head's table and its
 * gradient (rpb_entries floats each) */
static size_t dq_smem_bytes(const nbhd_geometry *g, int HD, int BN, int RANK, int WGS, bool rmask) {
    return 1024 + 2 * (size_t)(2 * wg_rows(WGS) + (WGB_DQ_K_STAGES + WGB_DQ_V_STAGES) * BN) * HD +
           sizeof(int) * WGB_DQ_V_STAGES * RANK * BN +
           (rmask ? wg_row_masks<3, 32, WGB_DQ_V_STAGES, true>::BYTES : 0) +
           (g->rpb ? 2 * sizeof(float) * (size_t)g->rpb_entries : 0);
}

size_t nbhd_cuda_wgmma_dq_smem_bytes(const nbhd_geometry *g, int mb) {
    const int HD = (int)g->head_dim;
    return dq_smem_bytes(g, HD, mb == 1 ? 32 : HD == 64 ? 128 : 64, NBHD_MAX_RANK, mb, mb == 1 && !g->rpb);
}
template <int HD, int BN, int RANK, bool KVP, int WGS, bool RMASK = false>
static constexpr size_t dkdv_smem_bytes() {
    return 1024 + 2 * (size_t)(2 * wg_rows(WGS) + 2 * WGB_KV_STAGES * BN) * HD + (KVP ? 2 * (size_t)wg_rows(WGS) * BN : 0) +
           sizeof(int) * WGB_KV_STAGES * (RANK + 2) * BN + wg_row_masks<RANK, BN, WGB_KV_STAGES, RMASK, true>::BYTES;
}

// ----------------------------------------------------------------------------
// dQ, query-stationary

/* D_i = dO_i.O_i - dLSE_i of a thread's two fragment rows (in-group coordinates rq, valid
 * rvalid) of head h: the row's four threads (cq) take interleaved 16-byte chunks of it (O and
 * dO rows 16-byte aligned, unit element stride: fna_mma_bwd.cu launch_bwd's condition); the
 * sums into Di, and by the cq = 0 thread into dp (D_i's workspace) */
template <typename T, int HD>
__device__ __forceinline__ void form_rows_di(const nbhd_geometry &g, const nbhd_backward_args &a, int64_t b,
                                             const int64_t grp[3], int h, const int (&rq)[2][3],
                                             const bool (&rvalid)[2], int cq, float (&Di)[2],
                                             const group_ptr<float> &dp) {
    const group_ptr<const T> op = group_ptr_of<const T>(a.out, g, b, grp, h);
    const group_ptr<const T> gp = group_ptr_of<const T>(a.d_out, g, b, grp, h);
    uint4 ov[2][HD / 32], dv[2][HD / 32];
    float dl[2] = {0.f, 0.f};  /* dLSE_i */
    if (a.d_lse.data) {
        const group_ptr<const float> lp = group_ptr_of<const float>(a.d_lse, g, b, grp, h);
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow)
            if (rvalid[hrow]) dl[hrow] = *lp.at(rq[hrow][0], rq[hrow][1], rq[hrow][2]);
    }
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        const T *o = op.at(rq[hrow][0], rq[hrow][1], rq[hrow][2]), *d = gp.at(rq[hrow][0], rq[hrow][1], rq[hrow][2]);
#pragma unroll
        for (int i = 0; i < HD / 32; ++i) {
            const int ch = 4 * i + cq;  /* the row's four threads: adjacent chunks, whole sectors */
            ov[hrow][i] = rvalid[hrow] ? *(const uint4 *)(o + ch * 8) : make_uint4(0, 0, 0, 0);
            dv[hrow][i] = rvalid[hrow] ? *(const uint4 *)(d + ch * 8) : make_uint4(0, 0, 0, 0);
        }
    }
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < HD / 32; ++i) {
            const uint32_t ow[4] = {ov[hrow][i].x, ov[hrow][i].y, ov[hrow][i].z, ov[hrow][i].w};
            const uint32_t dw[4] = {dv[hrow][i].x, dv[hrow][i].y, dv[hrow][i].z, dv[hrow][i].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 o2 = unpack2<T>(ow[e]), d2 = unpack2<T>(dw[e]);
                acc += o2.x * d2.x + o2.y * d2.y;
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        acc -= dl[hrow];
        Di[hrow] = rvalid[hrow] ? acc : 0.f;
        if (rvalid[hrow] && cq == 0) *dp.at(rq[hrow][0], rq[hrow][1], rq[hrow][2]) = acc;
    }
}

/* two warpgroups: one CTA per SM (at two, 128 registers, ptxas serialises the wgmma (C7512)
 * even at D = 64); one warpgroup (64-query patches at D = 128): three */
template <typename T, int HD, int BN, int RANK, int WGS, bool BIAS /* problem.rpb */,
          bool RMASK /* row masks (row_masks_fit): 64-query patches in 2-D and 3-D, no bias */,
          int SHAPE = PATCH_CUBE /* the 3-D m-block (mma_util.cuh patch_wt) */>
__global__ void __launch_bounds__(wg_threads(WGS), WGS == 1 ? (BIAS ? 2 : 3) : 1)
fna_wgmma_dq_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_backward_args a, float *Dws,
                    bool form_di, const mma_plan P) {
#if NBHD_HAS_WGMMA
    static_assert(!RMASK || (row_masked_kernel(WGS, RANK, BN) && !BIAS), "row masks: one warpgroup, 2-D/3-D");
    using CTA = wg_cta<RANK, WGS, SHAPE>;
    constexpr int BM = CTA::BM, THREADS = CTA::THREADS, KST = WGB_DQ_K_STAGES, VST = WGB_DQ_V_STAGES;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = (T *)(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023)); /* [BM][HD] */
    T *dOs = Qs + BM * HD;                   /* [BM][HD] */
    T *Ks = dOs + BM * HD;                   /* [KST][BN][HD] */
    T *Vs = Ks + KST * BN * HD;              /* [VST][BN][HD] */
    int *kc = (int *)(Vs + VST * BN * HD);   /* [VST][RANK][BN] in-group key coordinates */
    using Masks = wg_row_masks<RANK, BN, VST, RMASK>;
    Masks rm(kc + VST * RANK * BN);          /* with row masks: their table and words */
    float *tabs = (float *)((char *)(kc + VST * RANK * BN) + Masks::BYTES); /* with a bias: the head's table * log2e */
    float *dtabs = tabs + (BIAS ? g.rpb_entries : 0);     /* and the CTA's sum of its gradient */

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, wg = warpgroup_of<WGS>(w);
    CTA C;
    if (!C.place_queries(g, P, BN)) return;
    const int win_tiles = C.win_tiles, tiles = C.tiles;

    C.template load_rows<T, HD>(g, P, a.q, a.d_out, C.h, Qs, dOs, tid);  /* zero rows outside the grid */
    if constexpr (RMASK) rm.build(C, g, C.kb, tid);

    // K, V (and key coordinates, row masks) of tile t: one key per TPR threads
    const group_ptr<const T> kp = group_ptr_of<const T>(a.k, g, C.b, C.grp, C.hk);
    const group_ptr<const T> vp = group_ptr_of<const T>(a.v, g, C.b, C.grp, C.hk);
    auto load_tile = [&](int t, int) {
        C.template load_kv_tile<T, HD, BN, THREADS>(g, a, kp, vp, t, Ks + (t % KST) * BN * HD,
                                                    Vs + (t % VST) * BN * HD, kc + (t % VST) * RANK * BN, tid,
                                                    [](int r, int ch) { return gmma_off<BN>(r, ch); }, rm.key_out(C, t % VST));
    };

    // this thread's rows: windows, lse (base 2), D_i
    const int cq = lane & 3;
    int wst[2][RANK], wen[2][RANK], ilo[RANK], ihi[RANK], brow[2];
    bool rvalid[2];
    C.row_windows(g, P, w, lane, wst, wen, rvalid, ilo, ihi, brow);
    // the table gradient is summed in shared memory and added to d_rpb once per CTA: global
    // atomics per pair queue on the table's few entries (x1.7-2.9 the backward without a bias)
    if (BIAS) {
        stage_bias_table(tabs, tile_bias<RANK>::table(g, a.rpb, C.h), g.rpb_entries, tid, THREADS);
        for (int64_t i = tid; i < g.rpb_entries; i += THREADS) dtabs[i] = 0.f;
    }
    float lse2[2], Di[2];
    int rq[2][3];
    const group_ptr<float> dp = group_ptr_of<float>(di_tensor(g, Dws), g, C.b, C.grp, C.h);
    {
        const group_ptr<const float> lp = group_ptr_of<const float>(a.lse, g, C.b, C.grp, C.h);
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            int *iq = rq[hrow];
            C.row(w * 16 + (lane >> 2) + 8 * hrow, iq);
            lse2[hrow] = rvalid[hrow] ? *lp.at(iq[0], iq[1], iq[2]) * 1.4426950408889634f : 0.f;
            Di[hrow] = rvalid[hrow] && !form_di ? *dp.at(iq[0], iq[1], iq[2]) : 0.f;
        }
    }

    float dq[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
    const float sl2 = P.scale_log2;
    const uint32_t q_base = smem_u32(Qs) + wg * 64 * 128, do_base = smem_u32(dOs) + wg * 64 * 128;

    // dQ += dS K of the previous tile runs during this tile's P and dS: dS in registers (zero
    // before the first tile), K in that tile's stage
    uint32_t df[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) df[kk][0] = df[kk][1] = df[kk][2] = df[kk][3] = 0u;
    uint32_t dq_k = smem_u32(Ks);
    auto issue_dq = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_op<T, HD>::rs_bt(&dq[0][0], df[kk], gmma_desc(dq_k, kk * 16 * 128, BN * 128, 1024), 1);
        wgmma_commit();
    };
    auto dq_done = [&]() {
        fence_regs(df);
        fence_regs(dq);
    };

    constexpr int RING = KST * VST;  /* the ring's stage index is unused: K and V have their own */
    tile_ring_start<RING, 1>(tiles, load_tile);  /* Q and dO ride with tile 0's group */
    // form_di: D_i = dO_i.O_i - dLSE_i of this thread's rows from global memory while the first
    // copies fly (no pass of its own: the dK/dV kernel reads what this writes)
    if (form_di) form_rows_di<T, HD>(g, a, C.b, C.grp, C.h, rq, rvalid, lane & 3, Di, dp);
    for (int t = 0; t < tiles; ++t) {
        tile_ring_next<RING, 1, true>(t, tiles, load_tile);
        const uint32_t k_base = smem_u32(Ks + (t % KST) * BN * HD), v_base = smem_u32(Vs + (t % VST) * BN * HD);
        const int *kct = kc + (t % VST) * RANK * BN;
        const bool win = t < win_tiles;

        // S = Q K^T and dP = dO V^T, then the previous tile's dQ += dS K behind them
        float sc[BN / 8][4], dpt[BN / 8][4];
        wgmma_fence();
        wgmma_score_pair<T, HD, BN, BM>(sc, q_base, k_base, dpt, do_base, v_base);
        issue_dq();

        const uint32_t *kmt = rm.warp_words(t % VST, w);
        bool full;
        if constexpr (RMASK) full = Masks::full(kmt, w, lane);
        else full = !BIAS && win && tile_inside<BN, RANK>(kct, lane, ilo, ihi);
        wgmma_wait<1>();  /* S and dP are done; dQ may still run */
        fence_regs(sc);
        fence_regs(dpt);

        // P = 2^(S s log2e + bias log2e - lse), masked unless full; dS = P (dP - D_i), left in
        // sc and added to the bias table's gradient
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int kr = nb * 8 + 2 * cq + e;
                int j[RANK];
#pragma unroll
                for (int ax = 0; ax < RANK; ++ax) j[ax] = full || RMASK ? 0 : kct[ax * BN + kr];
                const int bk = BIAS ? tile_bias<RANK>::key(g, j) : 0;
                const uint2 words = RMASK ? *(const uint2 *)(kmt + nb * 8 + 2 * cq) : uint2{0u, 0u};
#pragma unroll
                for (int hrow = 0; hrow < 2; ++hrow) {
                    const bool ok = full || (RMASK ? row_sees(words, e, Masks::row_bit(w, lane) + 8 * hrow)
                                                   : key_visible<RANK>(win, j, wst[hrow], wen[hrow], rvalid[hrow]));
                    float &x = sc[nb][2 * hrow + e];
                    if constexpr (BIAS) {
                        const bool pair = ok && win;  /* a window pair: it has a table entry */
                        const float b2 = pair ? tabs[bk - brow[hrow]] : 0.f;
                        const float p = ok ? prob_exp2(fmaf(x, sl2, b2 - lse2[hrow])) : 0.f;
                        x = p * (dpt[nb][2 * hrow + e] - Di[hrow]);
                        if (pair) atomicAdd(dtabs + (bk - brow[hrow]), x);
                    } else {
                        const float p = ok ? prob_exp2(x * sl2 - lse2[hrow]) : 0.f;
                        x = p * (dpt[nb][2 * hrow + e] - Di[hrow]);
                    }
                }
            }
        wgmma_wait<0>();
        dq_done();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) a_frag_of<T>(df[kk], sc[2 * kk], sc[2 * kk + 1]);
        dq_k = k_base;
    }
    wgmma_fence();
    issue_dq();  /* the last tile's */
    wgmma_wait<0>();
    dq_done();
    cp_async_wait<0>();
    if (BIAS) {
        __syncthreads();
        float *d_tab = (float *)tile_bias<RANK>::table(g, a.d_rpb, C.h);
        for (int64_t i = tid; d_tab && i < g.rpb_entries; i += THREADS)
            if (dtabs[i] != 0.f) atomicAdd(d_tab + i, dtabs[i]);  /* entries no pair reached stay 0 */
    }

    float *scratch = (float *)Qs + w * exact_dq_scratch(HD, HD);  /* non-finite rows again, exactly */
    C.template store_rows<T, HD / 8>(g, C.h, w, lane, a.d_q, dq, sl2 * 0.69314718055994531f, nullptr, dq,
                                     [&](const int64_t r[3]) {
                                         redo_dq_row<T>(&g, &a, Dws, C.b, r[0], r[1], r[2], C.h, scratch);
                                     });
#endif
}

// ----------------------------------------------------------------------------
// dK, dV of the window keys, key-stationary (KVP: and their part of dQ, by fp32 atomics)

/* two warpgroups on 128-key patches, one CTA per SM; one warpgroup (64-key patches at D = 128,
 * not KV-parallel): two */
template <typename T, int HD, int BN, int RANK, bool KVP, int WGS, bool BIAS /* problem.rpb (not with KVP) */,
          bool RMASK = false /* row masks (row_masks_fit): 64-key patches in 2-D and 3-D, no bias */,
          int SHAPE = PATCH_CUBE /* the 3-D m-block (mma_util.cuh patch_wt) */>
__global__ void __launch_bounds__(wg_threads(WGS), WGS == 1 ? 2 : 1)
fna_wgmma_dkdv_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_backward_args a, const float *Dws,
                      float *dq_acc, const mma_plan P) {
#if NBHD_HAS_WGMMA
    static_assert(!RMASK || (row_masked_kernel(WGS, RANK, BN) && !BIAS && !KVP), "row masks: one warpgroup, 2-D/3-D");
    using CTA = wg_cta<RANK, WGS, SHAPE>;
    constexpr int BM = CTA::BM, THREADS = CTA::THREADS, ST = WGB_KV_STAGES;
    static_assert(!KVP || WGS == 2, "KV-parallel dQ: a 64 x 64 block per warpgroup of two");
    /* KVP: a warpgroup's dQ is 64 queries x 64 columns: of 128 queries at D = 64 it takes query
     * block wg, of 64 queries at D = 128 column block wg */
    constexpr int NQB = BN / 64;
    static_assert(!KVP || NQB * (HD / 64) == 2, "KV-parallel dQ: two 64 x 64 blocks per tile");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Ks = (T *)(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023)); /* [BM][HD] */
    T *Vs = Ks + BM * HD;                       /* [BM][HD] */
    T *Qs = Vs + BM * HD;                       /* [ST][BN][HD] */
    T *dOs = Qs + ST * BN * HD;                 /* [ST][BN][HD] */
    T *dSs = dOs + ST * BN * HD;                /* KVP: [BN / 64][BM][64] dS^T of the tile */
    int *qc = (int *)(dSs + (KVP ? BM * BN : 0)); /* [ST][RANK][BN] in-group query coordinates */
    float *ql = (float *)(qc + ST * RANK * BN); /* [ST][BN] lse */
    float *qd = ql + ST * BN;                   /* [ST][BN] D_i */
    using Masks = wg_row_masks<RANK, BN, ST, RMASK, true>;
    Masks rm(qd + ST * BN);                     /* with row masks: their table and words */

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, wg = warpgroup_of<WGS>(w);
    CTA C;  /* rows: the patch's keys; C.h the key head */
    if (!C.place_keys(g, P)) return;
    const int hk = C.h;

    const key_box qb = C.inverse_box(g);  /* columns: the union of the rows' inverse neighbourhoods */
    const int tiles_per_head = (qb.total + BN - 1) / BN;
    const int tiles = warp_uniform(tiles_per_head * g.group);  /* the loop's index in uniform registers */

    C.template load_rows<T, HD>(g, P, a.k, a.v, hk, Ks, Vs, tid);  /* K and V rows, zero outside the grid */
    if constexpr (RMASK) rm.build(C, g, qb, tid);

    // Q, dO (and query coordinates, lse, D_i) of tile t: query head hk * group + t / tiles_per_head
    const int64_t h0 = (int64_t)hk * g.group;
    const group_ptr<const T> qp = group_ptr_of<const T>(a.q, g, C.b, C.grp, h0);
    const group_ptr<const T> dop = group_ptr_of<const T>(a.d_out, g, C.b, C.grp, h0);
    const group_ptr<const float> lp = group_ptr_of<const float>(a.lse, g, C.b, C.grp, h0);
    const group_ptr<const float> dwp = group_ptr_of<const float>(di_tensor(g, Dws), g, C.b, C.grp, h0);
    const group_ptr<float> dqp = KVP ? group_ptr_of<float>(dq_accumulator(g, dq_acc), g, C.b, C.grp, h0)
                                     : group_ptr<float>{};
    auto load_tile = [&](int t, int s) {
        constexpr int CH = HD / 8, TPR = THREADS / BN, CPT = CH / TPR;
        const int hh = g.group == 1 ? 0 : t / tiles_per_head;  /* no division without GQA */
        const int cr = tid / TPR, n = (t - hh * tiles_per_head) * BN + cr;
        const bool ok = n < qb.total;
        int j[3] = {0, 0, 0};
        if (ok) key_box_at<RANK>(qb, n, j);
        // the thread's first chunk; the others at constant offsets (immediates of the copies)
        const int c0 = tid % TPR;
        const T *qs = qp.at(j[0], j[1], j[2]) + (int64_t)hh * a.q.stride[4] + c0 * 8;
        const T *ds = dop.at(j[0], j[1], j[2]) + (int64_t)hh * a.d_out.stride[4] + c0 * 8;
        T *Qd = Qs + s * BN * HD, *dOd = dOs + s * BN * HD;
#pragma unroll
        for (int cc = 0; cc < CPT; ++cc) {
            const int ch = cc * TPR + c0, off = gmma_off<BN>(cr, ch);
            cp_async16(smem_u32(Qd + off), qs + cc * TPR * 8, ok);
            cp_async16(smem_u32(dOd + off), ds + cc * TPR * 8, ok);
        }
        if (tid % TPR == 0) {
            put_coords<RANK, BN>(qc + s * RANK * BN, cr, ok, j);
            rm.put(s, cr, qb, ok, true, j);
            cp_async4(smem_u32(ql + s * BN + cr), lp.at(j[0], j[1], j[2]) + (int64_t)hh * a.lse.stride[4], ok);
            cp_async4(smem_u32(qd + s * BN + cr), dwp.at(j[0], j[1], j[2]) + hh, ok);
        }
    };

    // this thread's rows (keys): inverse windows, the warpgroup's intersection, bias keys
    const int cq = lane & 3;
    int ist[2][RANK], ien[2][RANK], ilo[RANK], ihi[RANK], bkey[2];
    C.key_windows(g, w, lane, ist, ien, ilo, ihi);
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        int ik[3];
        C.row(w * 16 + (lane >> 2) + 8 * hrow, ik);
        bkey[hrow] = tile_bias<RANK>::key(g, ik);
    }

    float dk[HD / 8][4], dv[HD / 8][4], dq[KVP ? 8 : 1][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
#pragma unroll
    for (int i = 0; i < (KVP ? 8 : 1); ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
    const float sl2 = P.scale_log2;
    const uint32_t k_base = smem_u32(Ks) + wg * 64 * 128, v_base = smem_u32(Vs) + wg * 64 * 128;
    /* KVP: the warpgroup's dQ block = dS K over the CTA's 128 keys; A its query block of the
     * staged dS^T (queries along m, keys along k: MN-major), B its column block of K (keys along
     * k, head dim along n: MN-major) */
    const int dq_qb = NQB == 2 ? wg : 0, dq_cb = NQB == 2 ? 0 : wg;
    const uint32_t ds_base = smem_u32(dSs) + dq_qb * BM * 128, k_cols = smem_u32(Ks) + dq_cb * BM * 128;

    tile_ring_start<ST, 1>(tiles, load_tile);  /* K and V ride with tile 0's group */
    for (int t = 0; t < tiles; ++t) {
        const int s = tile_ring_next<ST, 1, true>(t, tiles, load_tile);
        const uint32_t q_st = smem_u32(Qs + s * BN * HD), do_st = smem_u32(dOs + s * BN * HD);
        const int *qct = qc + s * RANK * BN;
        const float *qlt = ql + s * BN, *qdt = qd + s * BN;

        // S^T = K Q^T, dP^T = V dO^T
        float sc[BN / 8][4], dpt[BN / 8][4];
        wgmma_fence();
        wgmma_score_pair<T, HD, BN, BM>(sc, k_base, q_st, dpt, v_base, do_st);
        const float *tab = BIAS ? tile_bias<RANK>::table(g, a.rpb, (int)(h0 + t / tiles_per_head)) : nullptr;
        const uint32_t *kmt = rm.warp_words(s, w);
        bool full;
        if constexpr (RMASK) full = Masks::full(kmt, w, lane);
        else full = !BIAS && tile_inside<BN, RANK>(qct, lane, ilo, ihi);
        wgmma_wait<0>();
        fence_regs(sc);
        fence_regs(dpt);

        // P^T = 2^(S^T s log2e + bias log2e - lse), masked unless full
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int cr = nb * 8 + 2 * cq + e;
                const float lv = qlt[cr] * 1.4426950408889634f;
                int j[RANK];
#pragma unroll
                for (int ax = 0; ax < RANK; ++ax) j[ax] = full || RMASK ? 0 : qct[ax * BN + cr];
                const int bq = BIAS ? tile_bias<RANK>::row(g, j) : 0;
                const uint2 words = RMASK ? *(const uint2 *)(kmt + nb * 8 + 2 * cq) : uint2{0u, 0u};
#pragma unroll
                for (int hrow = 0; hrow < 2; ++hrow) {
                    bool ok = true;
                    if (RMASK)
                        ok = full || row_sees(words, e, Masks::row_bit(w, lane) + 8 * hrow);
                    else if (!full)
#pragma unroll
                        for (int ax = 0; ax < RANK; ++ax)
                            ok = ok && j[ax] >= ist[hrow][ax] && j[ax] < ien[hrow][ax];
                    float &x = sc[nb][2 * hrow + e];
                    if constexpr (BIAS) {
                        const float b2 = tile_bias<RANK>::at(tab, ok, bkey[hrow], bq) * LOG2E_F;
                        x = ok ? prob_exp2(fmaf(x, sl2, b2 - lv)) : 0.f;
                    } else {
                        x = ok ? prob_exp2(x * sl2 - lv) : 0.f;
                    }
                }
            }
        uint32_t pf[BN / 16][4], df[BN / 16][4];  /* P^T, dS^T as wgmma A fragments */
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) a_frag_of<T>(pf[kk], sc[2 * kk], sc[2 * kk + 1]);

        // dV += P^T dO, running while dS^T = P^T (dP^T - D_i) is formed; then dK += dS^T Q
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_op<T, HD>::rs_bt(&dv[0][0], pf[kk], gmma_desc(do_st, kk * 16 * 128, BN * 128, 1024), 1);
        wgmma_commit();
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) dpt[nb][e] = sc[nb][e] * (dpt[nb][e] - qdt[nb * 8 + 2 * cq + (e & 1)]);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) a_frag_of<T>(df[kk], dpt[2 * kk], dpt[2 * kk + 1]);
        if constexpr (KVP) {  /* stage dS^T (this warp's 16 keys x BN queries) for dQ */
            const int kr = w * 16 + (lane >> 2);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = kr + 8 * (i & 1), col = kk * 16 + 8 * (i >> 1) + 2 * cq;
                    *(uint32_t *)(dSs + gmma_off<BM>(row, col >> 3) + (col & 7)) = df[kk][i];
                }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  /* seen by wgmma */
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_op<T, HD>::rs_bt(&dk[0][0], df[kk], gmma_desc(q_st, kk * 16 * 128, BN * 128, 1024), 1);
        wgmma_commit();
        if constexpr (KVP) {  /* both warpgroups' dS^T staged: dQ = dS K, then added to the accumulator */
            __syncthreads();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
                wgmma_op<T, 64>::ss_tt(&dq[0][0], gmma_desc(ds_base, kk * 16 * 128, BM * 128, 1024),
                                       gmma_desc(k_cols, kk * 16 * 128, BM * 128, 1024), kk > 0);
            wgmma_commit();
        }
        wgmma_wait<0>();
        fence_regs(pf);
        fence_regs(df);
        fence_regs(dk);
        fence_regs(dv);
        if constexpr (KVP) {  /* dS^T is rewritten only after the next tile's barrier */
            fence_regs(dq);
            const int64_t cols = (int64_t)(t / tiles_per_head) * HD + dq_cb * 64;  /* head, block */
            add_dq_block<RANK, BN>(dqp, qct, NQB == 2 ? w : w & 3, cols, dq, lane);  /* dq_qb's rows */
        }
    }
    cp_async_wait<0>();

    float *scratch = (float *)Ks + w * exact_dkv_scratch(HD, HD);  /* non-finite rows again, exactly */
    C.template store_rows<T, HD / 8>(g, hk, w, lane, a.d_k, dk, sl2 * 0.69314718055994531f, &a.d_v, dv,
                                     [&](const int64_t r[3]) {
                                         redo_dkv_row<T, false>(&g, &a, Dws, C.b, r[0], r[1], r[2], hk, scratch);
                                     });
#endif
}

// ----------------------------------------------------------------------------
// launch

/* dq_acc: the KV-parallel pass (two warpgroups; tiles of 128 at D = 64, 64 at D = 128): dK/dV and
 * dQ by atomics, no dq kernel */
template <typename T, int HD, int BN, int RANK, int WGS, int SHAPE>
static nbhd_status launch_rank(const nbhd_geometry *g, const nbhd_backward_args *a, float *Dws,
                               float *dq_acc, bool form_di, const mma_plan &P, cudaStream_t st) {
    const int64_t q_ctas = g->batch * g->heads * P.patches, kv_ctas = g->batch * g->kv_heads * P.patches;
    nbhd_status s;
    if ((s = nbhd_cuda_grid_fits(q_ctas, "wgmma backward")) != NBHD_OK) return s;
    if constexpr (WGS == 2 && (BN / 64) * (HD / 64) == 2) {
        if (dq_acc)
            return nbhd_cuda_launch(fna_wgmma_dkdv_kernel<T, HD, BN, RANK, true, WGS, false, false, SHAPE>, kv_ctas, wg_threads(WGS),
                                    dkdv_smem_bytes<HD, BN, RANK, true, WGS>(), "wgmma backward (dk, dv, dq)", st,
                                    *g, *a, Dws, dq_acc, P);
    }
    if (dq_acc) return nbhd_fail(NBHD_ERR_UNSUPPORTED, "wgmma backward: no KV-parallel pass on one warpgroup");
    // row masks on one warpgroup's 64-row patches in 2-D and 3-D where the tables fit
    constexpr bool RM = row_masked_kernel(WGS, RANK, BN);
    const bool rmask = RM && row_masks_fit(g, RANK);
    constexpr bool CUBE = SHAPE == PATCH_CUBE;  // no bias table on flat patches (with_patch)
    auto dq_kernel = g->rpb  ? fna_wgmma_dq_kernel<T, HD, BN, RANK, WGS, CUBE, false, SHAPE>
                     : rmask ? fna_wgmma_dq_kernel<T, HD, BN, RANK, WGS, false, RM, SHAPE>
                             : fna_wgmma_dq_kernel<T, HD, BN, RANK, WGS, false, false, SHAPE>;
    const bool rmask_keys = RM && row_masks_fit(g, RANK, true);
    auto dkdv_kernel = g->rpb       ? fna_wgmma_dkdv_kernel<T, HD, BN, RANK, false, WGS, CUBE, false, SHAPE>
                       : rmask_keys ? fna_wgmma_dkdv_kernel<T, HD, BN, RANK, false, WGS, false, RM, SHAPE>
                                    : fna_wgmma_dkdv_kernel<T, HD, BN, RANK, false, WGS, false, false, SHAPE>;
    if ((s = nbhd_cuda_launch(dq_kernel, q_ctas, wg_threads(WGS),
                              dq_smem_bytes(g, HD, BN, RANK, WGS, rmask), "wgmma backward (dq)", st, *g, *a, Dws, form_di, P)) != NBHD_OK)
        return s;
    return nbhd_cuda_launch(dkdv_kernel, kv_ctas, wg_threads(WGS),
                            rmask_keys ? dkdv_smem_bytes<HD, BN, RANK, false, WGS, RM>()
                                       : dkdv_smem_bytes<HD, BN, RANK, false, WGS>(),
                            "wgmma backward (dk, dv)", st,
                            *g, *a, Dws, (float *)nullptr, P);
}

template <typename T, int HD, int BN, int WGS>
static nbhd_status launch_ranks(const nbhd_geometry *g, const nbhd_backward_args *a, float *Dws,
                                float *dq_acc, bool form_di, int shape, cudaStream_t st) {
    return with_patch<WGS>(g, shape, [&](auto rank, auto shape_c, const mma_plan &P) {
        return launch_rank<T, HD, BN, decltype(rank)::value, WGS, decltype(shape_c)::value>(g, a, Dws, dq_acc, form_di, P, st);
    });
}

/* the kernels of the choice (kernel_choice.cu choose_backward): on 128-row patches tiles of 64
 * at D = 128, of 128 at D = 64; at D = 128 also 64-row patches on one warpgroup, tiles of 32 */
template <typename T, int HD>
static nbhd_status launch(const nbhd_geometry *g, const nbhd_backward_args *a, float *Dws,
                          float *dq_acc, bool form_di, const nbhd_cuda_choice &c, cudaStream_t st) {
    constexpr int BN = HD == 64 ? 128 : 64;
    if (c.mb == 2 && c.bn == BN) return launch_ranks<T, HD, BN, 2>(g, a, Dws, dq_acc, form_di, c.shape, st);
    if constexpr (HD == 128)
        if (c.mb == 1 && c.bn == 32) return launch_ranks<T, HD, 32, 1>(g, a, Dws, dq_acc, form_di, c.shape, st);
    return nbhd_cuda_no_kernel("wgmma backward", &c);
}

nbhd_status nbhd_cuda_wgmma_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                     float *Dws, float *dq_acc, bool form_di, const nbhd_cuda_choice *c,
                                     cudaStream_t st) {
    const bool bf = g->dtype == NBHD_BF16;
    switch (g->head_dim) {
    case 64: return bf ? launch<__nv_bfloat16, 64>(g, a, Dws, dq_acc, form_di, *c, st) : launch<__half, 64>(g, a, Dws, dq_acc, form_di, *c, st);
    case 128: return bf ? launch<__nv_bfloat16, 128>(g, a, Dws, dq_acc, form_di, *c, st) : launch<__half, 128>(g, a, Dws, dq_acc, form_di, *c, st);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "wgmma backward: head_dim %d", g->head_dim);
}
