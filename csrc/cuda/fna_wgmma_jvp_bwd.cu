/*
 * fna_wgmma_jvp_bwd.cu — the Hopper key pass of the backward through forward + JVP
 * (fna_mma_jvp_bwd.cu has the op, its row terms and notation; docs/design.md §6.8): the window
 * keys' dK, dV and, KV-parallel, their part of dQ by fp32 atomics, on warpgroup MMA (sm_90a),
 * f16/bf16, D = Dv in {64, 128}, no bias table. Key-stationary: a 128-key patch (two
 * warpgroups of 64 keys) walks the exact union of its keys' inverse neighbourhoods in tiles of
 * 64 queries, every query head of its key head in turn. Per tile and warpgroup (64 keys x 64
 * queries, the scores in two slices of 32 at D = 128):
 *
 *   S^T = K Q^T,  tS^T = K tQ^T + tK Q^T,  GV^T = V G^T,  dP^T = V dO^T + tV G^T
 *   P, n = tS - mu, dS = P (dP - D' - E + w n), dtS = P w    (jvpb_terms, mma_util.cuh)
 *   dV += P^T dO + (P n)^T G,  dK += dS^T Q + dtS^T tQ      (P^T, dS^T, ... from registers)
 *   dQ += dS K + dtS tK    over the CTA's 128 keys, half the columns per warpgroup: dS^T, dtS^T
 *                          staged in shared memory (A MN-major); B at D = 64 K^T, tK^T
 *                          transposed there once per CTA (K-major, m64n32), at D = 128 a
 *                          64-column block of K, tK (MN-major); added with fp32 atomics
 *
 * A product with an absent operand (tQ, tK, tV, dO) is not issued: the flags are kernel
 * arguments, uniform over the CTA, so ptxas keeps every wgmma asynchronous; absent operands take
 * no shared memory. The extra keys, the deterministic mode, other head dims, bias tables, and at
 * D = 128 operands too many for a block's shared memory stay on fna_mma_jvp_bwd.cu's kernels.
 */
#include "wgmma.cuh"

#define WGJ_BN 64     /* queries per tile */
#define WGJ_STAGES 2  /* the query-side tiles, loaded one ahead: each is read within its tile */

/* Shared memory of the key pass, byte offsets after the 1024-byte alignment: only the tiles of
 * present operands (the tangents, dO) take room, so that D = 128 fits where they are few.
 * K, V, tK, tV [128][HD]; at D = 64 K^T, tK^T [HD][128]; per stage Q, G, tQ, dO [BN][HD];
 * dS^T, dtS^T [128][BN]; per stage the queries' row terms (float4) and in-group coordinates. */
struct wgj_layout {
    uint32_t k, v, tk, tv, kt, tkt, q, g, tq, dout, ds, dts, rt, qc, bytes;
    __host__ __device__ wgj_layout(int hd, int rank, bool has_tq, bool has_tk, bool has_tv, bool has_do) {
        const uint32_t rows = 2u * 128 * hd, tile = 2u * WGJ_STAGES * WGJ_BN * hd, st = 2u * 128 * WGJ_BN;
        uint32_t at = 0;
        auto take = [&](bool present, uint32_t n) { const uint32_t o = at; at += present ? n : 0; return o; };
        k = take(true, rows);
        v = take(true, rows);
        tk = take(has_tk, rows);
        tv = take(has_tv, rows);
        kt = take(hd == 64, rows);
        tkt = take(hd == 64 && has_tk, rows);
        q = take(true, tile);
        g = take(true, tile);
        tq = take(has_tq, tile);
        dout = take(has_do, tile);
        ds = take(true, st);
        dts = take(has_tk, st);
        rt = take(true, sizeof(float4) * WGJ_STAGES * WGJ_BN);
        qc = take(true, sizeof(int) * WGJ_STAGES * rank * WGJ_BN);
        bytes = 1024 + at;
    }
};

/* SPLIT: the score products of a tile in SPLIT slices of 64 / SPLIT queries (two at D = 128, for
 * the registers: dK and dV take 128 there, so a slice's dK/dV products finish before the next
 * slice's scores). At D = 64 two slices leave nothing spilled but ran 5-9 % slower on an H100
 * (bench/profile_kernels.py --op jvpb --dims 64 --problems 1d,2d-256, both in one build) */
template <typename T, int HD, int RANK, bool DP /* dO or tV present: dP has a term */>
__global__ void __launch_bounds__(256, 1)
fna_wgmma_jvpb_keys_kernel(const __grid_constant__ nbhd_geometry g,
                           const __grid_constant__ nbhd_forward_jvp_backward_args a, const float *ws3,
                           const float4 *rt, float *dq_acc, const mma_plan P) {
#if NBHD_HAS_WGMMA
    using CTA = wg_cta<RANK, 2>;
    constexpr int BN = WGJ_BN, BM = CTA::BM, THREADS = CTA::THREADS, ST = WGJ_STAGES;
    constexpr int SPLIT = HD == 128 ? 2 : 1, NS = BN / SPLIT, KS = NS / 16;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    /* without dO and tV (double backward) dP, P^T's fragments and their products vanish at
     * compile time: registers for D = 128 */
    const bool has_tq = a.t_q.data, has_tk = a.t_k.data, has_tv = DP && a.t_v.data, has_do = DP && a.d_out.data;
    const bool has_ts = has_tq || has_tk;  /* tS has a term */
    const wgj_layout L(HD, RANK, has_tq, has_tk, has_tv, has_do);
    unsigned char *base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    T *Ks = (T *)(base + L.k), *Vs = (T *)(base + L.v), *tKs = (T *)(base + L.tk), *tVs = (T *)(base + L.tv);
    T *KTs = (T *)(base + L.kt), *tKTs = (T *)(base + L.tkt);
    T *Qs = (T *)(base + L.q), *Gs = (T *)(base + L.g), *tQs = (T *)(base + L.tq), *dOs = (T *)(base + L.dout);
    T *dSs = (T *)(base + L.ds), *dtSs = (T *)(base + L.dts);
    float4 *qt = (float4 *)(base + L.rt);
    int *qc = (int *)(base + L.qc);

    // not warpgroup_of: with the warpgroup warp-uniform ptxas spills twice as much here (190
    // local loads per tile against 100 in the bf16 D = 128 2-D kernel's SASS)
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, wg = w >> 2;
    CTA C;  /* rows: the patch's keys; C.h the key head */
    if (!C.place_keys(g, P)) return;
    const int hk = C.h;

    const key_box qb = C.inverse_box(g);  /* columns: the union of the rows' inverse neighbourhoods */
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

    // this thread's rows (keys): inverse windows, the warpgroup's intersection
    const int cq = lane & 3;
    int ist[2][RANK], ien[2][RANK], ilo[RANK], ihi[RANK];
    C.key_windows(g, w, lane, ist, ien, ilo, ihi);

    float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
    const float sl2 = P.scale_log2, scale = sl2 * 0.69314718055994531f;
    const uint32_t rows_off = wg * 64 * 128;  /* the warpgroup's 64 rows in a [BM][64] tile */
    const uint32_t k_base = smem_u32(Ks) + rows_off, v_base = smem_u32(Vs) + rows_off;
    const uint32_t tk_base = smem_u32(tKs) + rows_off, tv_base = smem_u32(tVs) + rows_off;
    /* dQ's B: at D = 64 this warpgroup's 32 columns, rows 32 wg.. of K^T and tK^T; at D = 128
     * its 64 columns, column block wg of K and tK (MN-major) */
    const uint32_t kq_base = HD == 64 ? smem_u32(KTs) + wg * 32 * 128 : smem_u32(Ks) + wg * BM * 128;
    const uint32_t tkq_base = HD == 64 ? smem_u32(tKTs) + wg * 32 * 128 : smem_u32(tKs) + wg * BM * 128;

    /* D = 64: K^T (and tK^T) [HD][BM] in 64-key column blocks from the resident rows (seen by
     * wgmma after the proxy fence and the barrier before dQ's first product) */
    auto transpose_keys = [&]() {
        if constexpr (HD == 64) {
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
        }
    };

    tile_ring_start<ST, ST - 1>(tiles, load_tile);  /* K, V, tK, tV ride with tile 0's group */
    for (int t = 0; t < tiles; ++t) {
        const int s = tile_ring_next<ST, ST - 1, true>(t, tiles, load_tile);
        const uint32_t q_st = smem_u32(Qs + s * BN * HD), tq_st = smem_u32(tQs + s * BN * HD);
        const uint32_t do_st = smem_u32(dOs + s * BN * HD), g_st = smem_u32(Gs + s * BN * HD);
        const int *qct = qc + s * RANK * BN;
        const float4 *qtt = qt + s * BN;
        const bool full = tile_inside<BN, RANK>(qct, lane, ilo, ihi);

        uint32_t pf[KS][4], pnf[KS][4], dsf[KS][4], dtsf[KS][4];  /* a slice's A fragments */
        auto fence_products = [&]() {  /* after the wait: the dK/dV products' registers */
            fence_regs(pf);
            fence_regs(pnf);
            fence_regs(dsf);
            fence_regs(dtsf);
            fence_regs(dk);
            fence_regs(dv);
        };
#pragma unroll
        for (int h = 0; h < SPLIT; ++h) {
            // the slice's four score products (absent operands' skipped; a sum with no term is
            // zero)
            const uint32_t ro = h * NS * 128;  /* the slice's rows of the query-side tiles */
            float sc[NS / 8][4], ts[NS / 8][4], gv[NS / 8][4], dp[NS / 8][4];
#pragma unroll
            for (int nb = 0; nb < NS / 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (!has_ts) ts[nb][e] = 0.f;
                    if (!DP) dp[nb][e] = 0.f;
                }
            wgmma_fence();
            wgmma_score<T, HD, NS, BM, BN>(sc, k_base, q_st + ro, 0);
            wgmma_score<T, HD, NS, BM, BN>(gv, v_base, g_st + ro, 0);
            if (has_tq) wgmma_score<T, HD, NS, BM, BN>(ts, k_base, tq_st + ro, 0);
            if (has_tk) wgmma_score<T, HD, NS, BM, BN>(ts, tk_base, q_st + ro, has_tq);
            if (DP) {  /* dO V^T, else tV G^T; then tV G^T where both are present */
                wgmma_score<T, HD, NS, BM, BN>(dp, has_do ? v_base : tv_base, (has_do ? do_st : g_st) + ro, 0);
                if (has_do && has_tv) wgmma_score<T, HD, NS, BM, BN>(dp, tv_base, g_st + ro, 1);
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(sc);
            fence_regs(ts);
            fence_regs(gv);
            fence_regs(dp);

            // P into sc, P n into ts, dS into dp, dtS into gv (masked unless full)
#pragma unroll
            for (int nb = 0; nb < NS / 8; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int cr = h * NS + nb * 8 + 2 * cq + e;
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

            // dV += P^T dO + (P n)^T G over the slice's queries (k-steps h KS ..)
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                a_frag_of<T>(pf[kk], sc[2 * kk], sc[2 * kk + 1]);
                a_frag_of<T>(pnf[kk], ts[2 * kk], ts[2 * kk + 1]);
                a_frag_of<T>(dsf[kk], dp[2 * kk], dp[2 * kk + 1]);
                a_frag_of<T>(dtsf[kk], gv[2 * kk], gv[2 * kk + 1]);
            }
            wgmma_fence();
            if (has_do)
#pragma unroll
                for (int kk = 0; kk < KS; ++kk)
                    wgmma_op<T, HD>::rs_bt(&dv[0][0], pf[kk], gmma_desc(do_st, ro + kk * 16 * 128, BN * 128, 1024), 1);
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)
                wgmma_op<T, HD>::rs_bt(&dv[0][0], pnf[kk], gmma_desc(g_st, ro + kk * 16 * 128, BN * 128, 1024), 1);
            // dK += dS^T Q + dtS^T tQ
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)
                wgmma_op<T, HD>::rs_bt(&dk[0][0], dsf[kk], gmma_desc(q_st, ro + kk * 16 * 128, BN * 128, 1024), 1);
            if (has_tq)
#pragma unroll
                for (int kk = 0; kk < KS; ++kk)
                    wgmma_op<T, HD>::rs_bt(&dk[0][0], dtsf[kk], gmma_desc(tq_st, ro + kk * 16 * 128, BN * 128, 1024), 1);
            wgmma_commit();

            // dS^T and dtS^T of this warp's 16 keys and the slice's queries, staged for dQ
            const int kr = w * 16 + (lane >> 2);
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = kr + 8 * (i & 1), col = h * NS + kk * 16 + 8 * (i >> 1) + 2 * cq;
                    const int at = gmma_off<BM>(row, col >> 3) + (col & 7);
                    *(uint32_t *)(dSs + at) = dsf[kk][i];
                    if (has_tk) *(uint32_t *)(dtSs + at) = dtsf[kk][i];
                }
            if (SPLIT > 1) {  /* the slice's fragments free for the next (registers at D = 128) */
                wgmma_wait<0>();
                fence_products();
            }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  /* dS^T seen by wgmma */

        // dQ (64 queries x this warpgroup's HD / 2 columns) = dS K + dtS tK over the CTA's 128
        // keys, once both warpgroups' dS^T are staged (and, on the first tile, K^T)
        if (t == 0) transpose_keys();
        __syncthreads();
        float dq[HD / 16][4];
        auto dq_product = [&](uint32_t ds, uint32_t kb, int accumulate) {  /* dq (+)= (ds^T)^T (kb's K) */
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                const uint64_t ad = gmma_desc(ds, kk * 16 * 128, BM * 128, 1024);
                if constexpr (HD == 64)
                    wgmma_op<T, 32>::ss_ta(&dq[0][0], ad, gmma_desc(kb, (kk >> 2) * HD * 128 + (kk & 3) * 32, 16, 1024),
                                           kk > 0 || accumulate);
                else
                    wgmma_op<T, 64>::ss_tt(&dq[0][0], ad, gmma_desc(kb, kk * 16 * 128, BM * 128, 1024),
                                           kk > 0 || accumulate);
            }
        };
        wgmma_fence();
        dq_product(smem_u32(dSs), kq_base, 0);
        if (has_tk) dq_product(smem_u32(dtSs), tkq_base, 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_products();
        fence_regs(dq);
        const int64_t cols = (int64_t)(t / tiles_per_head) * HD + wg * (HD / 2);  /* the query head's */
        add_dq_block<RANK, BN>(dqp, qct, w & 3, cols, dq, lane);
    }
    cp_async_wait<0>();

    float *scratch = (float *)Ks + w * exact_jvpb_key_scratch(HD, HD);  /* non-finite rows again, exactly */
    C.template store_rows<T, HD / 8>(g, hk, w, lane, a.d_k, dk, scale, &a.d_v, dv, [&](const int64_t r[3]) {
        redo_jvpb_key_row<T, false>(&g, &a, ws3, C.b, r[0], r[1], r[2], hk, scratch);
    });
#endif
}

/* the key pass applies: D = Dv in {64, 128}, no bias table, KV-parallel (dq_acc), an sm_90a
 * image, the wgmma first-order backward chosen for the tangents (128-row patches: this
 * kernel's plan), the present operands' tiles within the shared memory of a block */
int nbhd_cuda_wgmma_jvpb_keys_apply(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                    const nbhd_cuda_choice *tangent) {
    const int D = g->head_dim;
    if (!((D == 64 || D == 128) && g->head_dim_v == D && !g->rpb && g->has_window && tangent->kv_parallel &&
          tangent->family == NBHD_CUDA_WGMMA && tangent->mb == 2 && nbhd_cuda_wgmma_ready()))
        return 0;
    const wgj_layout L(D, NBHD_MAX_RANK, a->t_q.data, a->t_k.data, a->t_v.data, a->d_out.data);
    return nbhd_cuda_device_facts().smem_optin >= L.bytes;
}

template <typename T, int HD>
static nbhd_status launch_keys(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a, const float *ws3,
                               const float4 *rt, float *dq_acc, cudaStream_t st) {
    return with_rank<2>(g, [&](auto rank, const mma_plan &P) {
        constexpr int RANK = decltype(rank)::value;
        const int64_t ctas = g->batch * g->kv_heads * P.patches;
        const wgj_layout L(HD, RANK, a->t_q.data, a->t_k.data, a->t_v.data, a->d_out.data);
        nbhd_status s;
        if ((s = nbhd_cuda_grid_fits(ctas, "wgmma backward through forward+JVP")) != NBHD_OK) return s;
        auto kernel = a->d_out.data || a->t_v.data ? fna_wgmma_jvpb_keys_kernel<T, HD, RANK, true>
                                                   : fna_wgmma_jvpb_keys_kernel<T, HD, RANK, false>;
        return nbhd_cuda_launch(kernel, ctas, 256, L.bytes, "wgmma backward through forward+JVP (dk, dv, dq)", st,
                                *g, *a, ws3, rt, dq_acc, P);
    });
}

nbhd_status nbhd_cuda_wgmma_jvpb_keys(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                      const float *ws3, const float4 *rt, float *dq_acc, cudaStream_t st) {
    const bool bf = g->dtype == NBHD_BF16;
    switch (g->head_dim) {
    case 64: return bf ? launch_keys<__nv_bfloat16, 64>(g, a, ws3, rt, dq_acc, st)
                       : launch_keys<__half, 64>(g, a, ws3, rt, dq_acc, st);
    case 128: return bf ? launch_keys<__nv_bfloat16, 128>(g, a, ws3, rt, dq_acc, st)
                        : launch_keys<__half, 128>(g, a, ws3, rt, dq_acc, st);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "wgmma backward through forward+JVP: head_dim %d", g->head_dim);
}
