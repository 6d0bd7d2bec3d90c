/*
 * fna_wgmma_jvp_bwd.cu — the Hopper key pass of the backward through forward + JVP
 * (fna_mma_jvp_bwd.cu has the op, its row terms and notation; docs/design.md §6.8): the window
 * keys' dK, dV and, KV-parallel, their part of dQ by fp32 atomics, on warpgroup MMA (sm_90a),
 * f16/bf16, D = Dv = 64, no bias table. Key-stationary: a 128-key patch (two warpgroups of 64
 * keys) walks the exact union of its keys' inverse neighbourhoods in tiles of 64 queries, every
 * query head of its key head in turn. Per tile and warpgroup (64 keys x 64 queries):
 *
 *   S^T = K Q^T,  tS^T = K tQ^T + tK Q^T,  GV^T = V G^T,  dP^T = V dO^T + tV G^T
 *   P, n = tS - mu, dS = P (dP - D' - E + w n), dtS = P w    (jvpb_terms, mma_util.cuh)
 *   dV += P^T dO + (P n)^T G,  dK += dS^T Q + dtS^T tQ      (P^T, dS^T, ... from registers)
 *   dQ += dS K + dtS tK    over the CTA's 128 keys, 32 of the 64 columns per warpgroup: dS^T,
 *                          dtS^T staged in shared memory (A MN-major), K^T, tK^T transposed
 *                          there once per CTA (B K-major); added with fp32 atomics
 *
 * A product with an absent operand (tQ, tK, tV, dO) is not issued: the flags are kernel
 * arguments, uniform over the CTA, so ptxas keeps every wgmma asynchronous. The extra keys, the
 * deterministic mode, D != 64 and bias tables stay on fna_mma_jvp_bwd.cu's kernels.
 */
#include "wgmma.cuh"

#define WGJ_BN 64     /* queries per tile */
#define WGJ_STAGES 2  /* the query-side tiles, loaded one ahead: each is read within its tile */

template <int RANK>
static constexpr size_t wgj_smem_bytes() {
    /* alignment slack; K, V, tK, tV [128][64]; K^T, tK^T [64][128]; Q, tQ, dO, G [ST][BN][64];
     * dS^T, dtS^T [128][BN]; per stage the queries' row terms (float4) and in-group coordinates */
    return 1024 + 2 * (6 * 128 * 64 + 4 * WGJ_STAGES * WGJ_BN * 64 + 2 * 128 * WGJ_BN) +
           sizeof(float4) * WGJ_STAGES * WGJ_BN + sizeof(int) * WGJ_STAGES * RANK * WGJ_BN;
}

template <typename T, int RANK>
__global__ void __launch_bounds__(256, 1)
fna_wgmma_jvpb_keys_kernel(const __grid_constant__ nbhd_geometry g,
                           const __grid_constant__ nbhd_forward_jvp_backward_args a, const float *ws3,
                           const float4 *rt, float *dq_acc, const mma_plan P) {
#if NBHD_HAS_WGMMA
    using CTA = wg_cta<RANK, 2>;
    constexpr int HD = 64, BN = WGJ_BN, BM = CTA::BM, THREADS = CTA::THREADS, ST = WGJ_STAGES;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Ks = (T *)(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023)); /* [BM][HD] each */
    T *Vs = Ks + BM * HD, *tKs = Vs + BM * HD, *tVs = tKs + BM * HD;
    T *KTs = tVs + BM * HD, *tKTs = KTs + HD * BM;  /* [HD][BM] each (64-key column blocks) */
    T *Qs = tKTs + HD * BM;                     /* [ST][BN][HD] each */
    T *tQs = Qs + ST * BN * HD, *dOs = tQs + ST * BN * HD, *Gs = dOs + ST * BN * HD;
    T *dSs = Gs + ST * BN * HD;                 /* [BM][BN] dS^T, then dtS^T */
    T *dtSs = dSs + BM * BN;
    float4 *qt = (float4 *)(dtSs + BM * BN);    /* [ST][BN] the queries' row terms */
    int *qc = (int *)(qt + ST * BN);            /* [ST][RANK][BN] in-group query coordinates */

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, wg = w >> 2;
    const bool has_tq = a.t_q.data, has_tk = a.t_k.data, has_tv = a.t_v.data, has_do = a.d_out.data;
    CTA C;  /* rows: the patch's keys; C.h the key head */
    if (!C.place_keys(g, P)) return;
    const int hk = C.h;
    constexpr int ct[3] = {patch_ct(RANK, 0, 2), patch_ct(RANK, 1, 2), patch_ct(RANK, 2, 2)};

    // columns: the union of the rows' inverse neighbourhoods, in-group, walked row-major
    key_box qb;
    int64_t ncol = 1;
#pragma unroll
    for (int ax = 0; ax < 3; ++ax) {
        qb.lo[ax] = 0;
        qb.cnt[ax] = 1;
        if (ax < RANK) {
            int64_t lo, cnt;
            inverse_union(&g.axis[ax], C.grp[ax], C.i0[ax], min(C.i0[ax] + ct[ax], C.Lg[ax]) - 1, &lo, &cnt);
            qb.lo[ax] = (int)lo;
            qb.cnt[ax] = (int)cnt;
        }
        ncol *= qb.cnt[ax];
    }
    qb.d1 = udiv32_of((uint32_t)max(qb.cnt[1], 1));
    qb.d2 = udiv32_of((uint32_t)max(qb.cnt[2], 1));
    qb.total = (int)ncol;
    const int tiles_per_head = (qb.total + BN - 1) / BN;
    const int tiles = tiles_per_head * g.group;

    C.template load_rows<T, HD>(g, P, a.k, a.v, hk, Ks, Vs, tid);  /* zero outside the grid */
    if (has_tk) C.template load_rows<T, HD, false>(g, P, a.t_k, a.t_k, hk, tKs, tKs, tid);
    if (has_tv) C.template load_rows<T, HD, false>(g, P, a.t_v, a.t_v, hk, tVs, tVs, tid);

    // the query side of tile t: query head hk * group + t / tiles_per_head
    const int64_t h0 = (int64_t)hk * g.group;
    const group_ptr<const T> qp = group_ptr_of<const T>(a.q, g, C.b, C.grp, h0);
    const group_ptr<const T> tqp = group_ptr_of<const T>(has_tq ? a.t_q : a.q, g, C.b, C.grp, h0);
    const group_ptr<const T> dop = group_ptr_of<const T>(has_do ? a.d_out : a.d_t_out, g, C.b, C.grp, h0);
    const group_ptr<const T> gp = group_ptr_of<const T>(a.d_t_out, g, C.b, C.grp, h0);
    const group_ptr<const float> rtp =
        group_ptr_of<const float>(workspace_tensor(g, (const float *)rt, 4), g, C.b, C.grp, h0);
    const group_ptr<float> dqp = group_ptr_of<float>(dq_accumulator(g, dq_acc), g, C.b, C.grp, h0);
    const int64_t q_hs = a.q.stride[4], tq_hs = has_tq ? a.t_q.stride[4] : 0;
    const int64_t do_hs = has_do ? a.d_out.stride[4] : 0, g_hs = a.d_t_out.stride[4];
    auto load_tile = [&](int t, int s) {
        constexpr int CH = HD / 8, TPR = THREADS / BN, CPT = CH / TPR;
        const int hh = t / tiles_per_head;
        const int cr = tid / TPR, n = (t - hh * tiles_per_head) * BN + cr;
        const bool ok = n < qb.total;
        int j[3] = {0, 0, 0};
        if (ok) key_box_at<RANK>(qb, n, j);
        const T *qs = qp.at(j[0], j[1], j[2]) + hh * q_hs, *tqs = tqp.at(j[0], j[1], j[2]) + hh * tq_hs;
        const T *dos = dop.at(j[0], j[1], j[2]) + hh * do_hs, *gs = gp.at(j[0], j[1], j[2]) + hh * g_hs;
        const int so = s * BN * HD;
#pragma unroll
        for (int cc = 0; cc < CPT; ++cc) {
            const int ch = cc * TPR + tid % TPR, off = so + gmma_off<BN>(cr, ch);
            cp_async16(smem_u32(Qs + off), qs + ch * 8, ok);
            cp_async16(smem_u32(Gs + off), gs + ch * 8, ok);
            if (has_tq) cp_async16(smem_u32(tQs + off), tqs + ch * 8, ok);
            if (has_do) cp_async16(smem_u32(dOs + off), dos + ch * 8, ok);
        }
        if (tid % TPR == 0) {
            put_coords<RANK, BN>(qc + s * RANK * BN, cr, ok, j);
            cp_async16(smem_u32(qt + s * BN + cr), rtp.at(j[0], j[1], j[2]) + 4 * hh, ok);
        }
    };

    // this thread's rows (keys): inverse windows per axis, in-group (invalid rows: empty); the
    // intersection over the warpgroup's box, [first(last key), end(first key)) as both ends
    // never decrease along an axis (empty unless all its keys are in the grid)
    const int cq = lane & 3;
    int ist[2][RANK], ien[2][RANK];
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        int ik[3];
        const bool valid = C.row(w * 16 + (lane >> 2) + 8 * hrow, ik);
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            const int d = g.axis[ax].dilation;
            int64_t f = 0, c = 0;
            if (valid) inverse32(&g.axis[ax], C.grp[ax] + (int64_t)ik[ax] * d, &f, &c);
            ist[hrow][ax] = (int)(f / d);
            ien[hrow][ax] = valid ? (int)(f / d + c) : 0;
        }
    }
    int ilo[RANK], ihi[RANK];
    {
        constexpr int WX[3] = {patch_wt(RANK, 0) * 4, patch_wt(RANK, 1), patch_wt(RANK, 2)};
        int wk[3];
        C.row(wg * 64, wk);
        bool all_rows = true;
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) all_rows &= wk[ax] + WX[ax] <= C.Lg[ax];
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            const int d = g.axis[ax].dilation;
            const int f = min(wk[ax], C.Lg[ax] - 1), l = min(wk[ax] + WX[ax], C.Lg[ax]) - 1;
            int64_t ff, fc, lf, lc;
            inverse32(&g.axis[ax], C.grp[ax] + (int64_t)f * d, &ff, &fc);
            inverse32(&g.axis[ax], C.grp[ax] + (int64_t)l * d, &lf, &lc);
            ilo[ax] = all_rows ? (int)(lf / d) : 1 << 30;
            ihi[ax] = all_rows ? (int)(ff / d + fc) : -(1 << 30);
        }
    }

    float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
    const float sl2 = P.scale_log2, scale = sl2 * 0.69314718055994531f;
    const uint32_t rows_off = wg * 64 * 128;  /* the warpgroup's 64 rows in a [BM][64] tile */
    const uint32_t k_base = smem_u32(Ks) + rows_off, v_base = smem_u32(Vs) + rows_off;
    const uint32_t tk_base = smem_u32(tKs) + rows_off, tv_base = smem_u32(tVs) + rows_off;
    /* dQ: this warpgroup's 32 columns, rows 32 wg.. of K^T and tK^T */
    const uint32_t kt_base = smem_u32(KTs) + wg * 32 * 128, tkt_base = smem_u32(tKTs) + wg * 32 * 128;

    /* K^T (and tK^T) for dQ's B: [HD][BM] in 64-key column blocks, from the resident rows
     * (visible to wgmma after the proxy fence and barrier before dQ's first product) */
    auto transpose_keys = [&]() {
        for (int i = tid; i < BM * HD / 8; i += THREADS) {
            const int r = i / (HD / 8), ch = i % (HD / 8);
            const uint4 kv = *(const uint4 *)(Ks + gmma_off<BM>(r, ch));
            const uint4 tkv = has_tk ? *(const uint4 *)(tKs + gmma_off<BM>(r, ch)) : make_uint4(0, 0, 0, 0);
            const T *k8 = (const T *)&kv, *tk8 = (const T *)&tkv;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int at = gmma_off<HD>(ch * 8 + e, r >> 3) + (r & 7);
                KTs[at] = k8[e];
                if (has_tk) tKTs[at] = tk8[e];
            }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    };

    tile_ring_start<ST, ST - 1>(tiles, load_tile);  /* K, V, tK, tV ride with tile 0's group */
    for (int t = 0; t < tiles; ++t) {
        const int s = tile_ring_next<ST, ST - 1, true>(t, tiles, load_tile);
        const uint32_t q_st = smem_u32(Qs + s * BN * HD), tq_st = smem_u32(tQs + s * BN * HD);
        const uint32_t do_st = smem_u32(dOs + s * BN * HD), g_st = smem_u32(Gs + s * BN * HD);
        const int *qct = qc + s * RANK * BN;
        const float4 *qtt = qt + s * BN;

        // the four score products (absent operands' skipped; a sum with no term is zero)
        float sc[BN / 8][4], ts[BN / 8][4], gv[BN / 8][4], dp[BN / 8][4];
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (!has_tq && !has_tk) ts[nb][e] = 0.f;
                if (!has_do && !has_tv) dp[nb][e] = 0.f;
            }
        wgmma_fence();
        wgmma_score<T, HD, BN, BM>(sc, k_base, q_st, 0);
        wgmma_score<T, HD, BN, BM>(gv, v_base, g_st, 0);
        if (has_tq) wgmma_score<T, HD, BN, BM>(ts, k_base, tq_st, 0);
        if (has_tk) wgmma_score<T, HD, BN, BM>(ts, tk_base, q_st, has_tq);
        if (has_do) wgmma_score<T, HD, BN, BM>(dp, v_base, do_st, 0);
        if (has_tv) wgmma_score<T, HD, BN, BM>(dp, tv_base, g_st, has_do);
        wgmma_commit();
        const bool full = tile_inside<BN, RANK>(qct, lane, ilo, ihi);
        wgmma_wait<0>();
        fence_regs(sc);
        fence_regs(ts);
        fence_regs(gv);
        fence_regs(dp);

        // P into sc, P n into ts, dS into dp, dtS into gv (masked unless full)
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int cr = nb * 8 + 2 * cq + e;
                const float4 q4 = qtt[cr];
                const jvpb_row_terms rw = {q4.x, q4.y, q4.z, q4.w};
                int j[RANK];
#pragma unroll
                for (int ax = 0; ax < RANK; ++ax) j[ax] = full ? 0 : qct[ax * BN + cr];
#pragma unroll
                for (int hrow = 0; hrow < 2; ++hrow) {
                    bool ok = true;
                    if (!full)
#pragma unroll
                        for (int ax = 0; ax < RANK; ++ax) ok = ok && j[ax] >= ist[hrow][ax] && j[ax] < ien[hrow][ax];
                    const int x = 2 * hrow + e;
                    const jvpb_pair_terms pr =
                        jvpb_terms(sc[nb][x], ts[nb][x], dp[nb][x], gv[nb][x], ok, 0.f, 0.f, sl2, scale, rw);
                    sc[nb][x] = pr.p;
                    ts[nb][x] = pr.p * pr.n;
                    dp[nb][x] = pr.ds;
                    gv[nb][x] = pr.dts;
                }
            }

        // dV += P^T dO + (P n)^T G
        uint32_t pf[BN / 16][4], pnf[BN / 16][4], dsf[BN / 16][4], dtsf[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            a_frag_of<T>(pf[kk], sc[2 * kk], sc[2 * kk + 1]);
            a_frag_of<T>(pnf[kk], ts[2 * kk], ts[2 * kk + 1]);
        }
        wgmma_fence();
        if (has_do)
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                wgmma_op<T, HD>::rs_bt(&dv[0][0], pf[kk], gmma_desc(do_st + kk * 16 * 128, BN * 128, 1024), 1);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_op<T, HD>::rs_bt(&dv[0][0], pnf[kk], gmma_desc(g_st + kk * 16 * 128, BN * 128, 1024), 1);
        wgmma_commit();

        // dK += dS^T Q + dtS^T tQ; dS^T and dtS^T staged (this warp's 16 keys x BN queries) for dQ
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            a_frag_of<T>(dsf[kk], dp[2 * kk], dp[2 * kk + 1]);
            a_frag_of<T>(dtsf[kk], gv[2 * kk], gv[2 * kk + 1]);
        }
        {
            const int kr = w * 16 + (lane >> 2);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = kr + 8 * (i & 1), col = kk * 16 + 8 * (i >> 1) + 2 * cq;
                    const int at = gmma_off<BM>(row, col >> 3) + (col & 7);
                    *(uint32_t *)(dSs + at) = dsf[kk][i];
                    if (has_tk) *(uint32_t *)(dtSs + at) = dtsf[kk][i];
                }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  /* seen by wgmma */
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_op<T, HD>::rs_bt(&dk[0][0], dsf[kk], gmma_desc(q_st + kk * 16 * 128, BN * 128, 1024), 1);
        if (has_tq)
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                wgmma_op<T, HD>::rs_bt(&dk[0][0], dtsf[kk], gmma_desc(tq_st + kk * 16 * 128, BN * 128, 1024), 1);
        wgmma_commit();

        // dQ (64 queries x this warpgroup's 32 columns) = dS K + dtS tK over the CTA's 128 keys,
        // once both warpgroups' dS^T are staged (and, on the first tile, K^T)
        if (t == 0) transpose_keys();
        __syncthreads();
        float dq[4][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            const uint32_t a = smem_u32(dSs) + kk * 16 * 128, b = (kk >> 2) * HD * 128 + (kk & 3) * 32;
            wgmma_op<T, 32>::ss_ta(&dq[0][0], gmma_desc(a, BM * 128, 1024), gmma_desc(kt_base + b, 16, 1024), kk > 0);
        }
        if (has_tk)
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                const uint32_t a = smem_u32(dtSs) + kk * 16 * 128, b = (kk >> 2) * HD * 128 + (kk & 3) * 32;
                wgmma_op<T, 32>::ss_ta(&dq[0][0], gmma_desc(a, BM * 128, 1024), gmma_desc(tkt_base + b, 16, 1024), 1);
            }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(pf);
        fence_regs(pnf);
        fence_regs(dsf);
        fence_regs(dtsf);
        fence_regs(dk);
        fence_regs(dv);
        fence_regs(dq);
        const int64_t cols = (int64_t)(t / tiles_per_head) * HD + wg * 32 + 2 * cq;  /* the query head's */
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            const int cr = (w & 3) * 16 + (lane >> 2) + 8 * hrow;
            int j[3] = {0, 0, 0};
#pragma unroll
            for (int ax = 0; ax < RANK; ++ax) j[ax] = qct[ax * BN + cr];
            if (j[0] == KEY_NONE) continue;
            float *dst = dqp.at(j[0], j[1], j[2]) + cols;
#pragma unroll
            for (int nb = 0; nb < 4; ++nb)
                atomicAdd((float2 *)(dst + nb * 8), make_float2(dq[nb][2 * hrow], dq[nb][2 * hrow + 1]));
        }
    }
    cp_async_wait<0>();

    unsigned bad = 0;
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        int ik[3];
        if (!C.row(w * 16 + (lane >> 2) + 8 * hrow, ik)) continue;
        store_pairs<T>((T *)a.d_k.data + C.offset(a.d_k, g, ik, hk), dk, HD / 8, hrow, cq, scale);
        store_pairs<T>((T *)a.d_v.data + C.offset(a.d_v, g, ik, hk), dv, HD / 8, hrow, cq, 1.f);
        if (!pairs_finite<HD / 8>(dk, hrow) || !pairs_finite<HD / 8>(dv, hrow)) bad |= 1u << hrow;
    }
    if (__syncthreads_or(bad != 0)) {  /* non-finite rows again, exactly (exact_rows.cuh) */
        float *scratch = (float *)Ks + w * exact_jvpb_key_scratch(HD, HD);
        for (int hrow = 0; hrow < 2; ++hrow) {
            int ik[3] = {0, 0, 0};
            C.row(w * 16 + (lane >> 2) + 8 * hrow, ik);
            int64_t c[3];
            for (int ax = 0; ax < 3; ++ax) c[ax] = C.grp[ax] + (int64_t)ik[ax] * g.axis[ax].dilation;
            redo_rows((bad >> hrow) & 1u, c, [&](const int64_t r[3]) {
                redo_jvpb_key_row<T, false>(&g, &a, ws3, C.b, r[0], r[1], r[2], hk, scratch);
            });
        }
    }
#endif
}

/* the key pass applies: D = Dv = 64, no bias table, KV-parallel (dq_acc), an sm_90a image, the
 * wgmma first-order backward chosen for the tangents (128-row patches: this kernel's plan) */
int nbhd_cuda_wgmma_jvpb_keys_apply(const nbhd_geometry *g, const nbhd_cuda_choice *tangent) {
    return g->head_dim == 64 && g->head_dim_v == 64 && !g->rpb && g->has_window && tangent->kv_parallel &&
           tangent->family == NBHD_CUDA_WGMMA && tangent->mb == 2 && nbhd_cuda_wgmma_ready() &&
           nbhd_cuda_device_facts().smem_optin >= wgj_smem_bytes<3>();
}

template <typename T>
static nbhd_status launch_keys(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a, const float *ws3,
                               const float4 *rt, float *dq_acc, cudaStream_t st) {
    return with_rank<2>(g, [&](auto rank, const mma_plan &P) {
        constexpr int RANK = decltype(rank)::value;
        const int64_t ctas = g->batch * g->kv_heads * P.patches;
        nbhd_status s;
        if ((s = nbhd_cuda_grid_fits(ctas, "wgmma backward through forward+JVP")) != NBHD_OK) return s;
        return nbhd_cuda_launch(fna_wgmma_jvpb_keys_kernel<T, RANK>, ctas, 256, wgj_smem_bytes<RANK>(),
                                "wgmma backward through forward+JVP (dk, dv, dq)", st, *g, *a, ws3, rt, dq_acc, P);
    });
}

nbhd_status nbhd_cuda_wgmma_jvpb_keys(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                      const float *ws3, const float4 *rt, float *dq_acc, cudaStream_t st) {
    return g->dtype == NBHD_BF16 ? launch_keys<__nv_bfloat16>(g, a, ws3, rt, dq_acc, st)
                                 : launch_keys<__half>(g, a, ws3, rt, dq_acc, st);
}
