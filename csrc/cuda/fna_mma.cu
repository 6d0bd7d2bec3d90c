/*
 * fna_mma.cu — tensor-core forward (O, LSE) for f16/bf16 with D = Dv in {32, 64, 128}:
 * mma.sync m16n8k16 with fp32 accumulation, through inline PTX (docs/design.md §6.2).
 *
 * Tiles. A CTA of 4 warps owns a multi-dimensional patch of 64 queries (one 16-row m-block per
 * warp) or, on large windows, 128 (two m-blocks per warp, so that each K/V fragment read from
 * shared memory feeds two MMAs) of one (batch, head), taken in one dilation group per axis (so
 * every window of the patch lies in that group):
 *   64:  1-D 64,  2-D 8x8  (m-blocks 2x8 each), 3-D 4x4x4 (m-blocks 1x4x4 each)
 *   128: 1-D 128, 2-D 16x8,                     3-D 8x4x4          (mma_util.cuh patch_*)
 * The patch shape is a template argument (RANK, MB), so row and key coordinates need no run-time
 * division but two multiply-highs per key (key_box). Its keys are the exact union of the
 * patch's windows: per axis the in-group range [start(first query), end(last query)), walked
 * row-major in tiles of 32 or 64 keys, then the extra keys. K and V tiles are double-buffered in
 * XOR-swizzled shared memory by cp.async (zero-filled past the end), addressed per CTA base +
 * 32-bit in-group steps; Q stays in registers or is re-read from shared memory (QREG). Each warp
 * first asks (one ballot) whether the tile holds any key of its own union and skips the tile if
 * not; a tile inside every row's window takes the mask-free path, any other is masked per element.
 *
 *   S = (scale*log2 e) Q K^T     (ldmatrix K, mma)          16*MB x BN per warp
 *   online softmax in base 2: m, l per row (quad shuffles); O *= 2^(m_old - m) only when a
 *   row max of the warp moved
 *   O += P V                      (P from the S registers, ldmatrix.trans V, mma)
 *   O /= l,  LSE = (m + log2 l) ln 2
 */
#include "mma_util.cuh"

#define MMA_WARPS 4
#define MMA_THREADS (MMA_WARPS * 32)
#define FWD_STAGES 2  /* K/V tiles in the cp.async ring */

// ----------------------------------------------------------------------------
// the kernel

template <typename T, int HD, int BN /* keys per tile: 64, or 32 for small windows */,
          int RANK /* patch shape: 1, 2 or 3 (mma_rank_of) */,
          int MB /* 16-row m-blocks per warp: 1 (64-query patches) or 2 (128) */,
          int MINB /* CTAs per SM the registers are budgeted for */,
          bool QREG /* Q fragments held in registers (else re-read from shared memory per tile,
                       32 registers fewer per m-block at D = 128) */,
          bool BIAS /* problem.rpb: the scores gain the table's bias (mma_util.cuh tile_bias) */>
__global__ void __launch_bounds__(MMA_THREADS, MINB)
fna_mma_forward_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_forward_args a, const mma_plan P) {
    constexpr int BM = 64 * MB;  /* queries per CTA */
    constexpr int ST = FWD_STAGES;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = (T *)smem_raw;                          /* [BM][HD]; O staged here at the end */
    T *Ks = Qs + BM * HD;                           /* [ST][BN][HD] */
    T *Vs = Ks + ST * BN * HD;                      /* [ST][BN][HD] */
    int *kc = (int *)(Vs + ST * BN * HD);           /* [ST][RANK][BN] in-group key coordinates */

    constexpr int WT[3] = {patch_wt(RANK, 0), patch_wt(RANK, 1), patch_wt(RANK, 2)};
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;

    cta_patch<RANK, MB> C;  /* (b, head, patch) and the patch's key walk */
    if (!C.place_queries(g, P, BN)) return;
    const int win_tiles = C.win_tiles, tiles = C.tiles;
    const group_ptr<const T> kp = group_ptr_of<const T>(a.k, g, C.b, C.grp, C.hk);
    const group_ptr<const T> vp = group_ptr_of<const T>(a.v, g, C.b, C.grp, C.hk);
    auto row_coords = [&](int qr, int iq[3]) -> bool { return C.row(qr, iq); };

    C.template copy_rows<T, HD, BM, MMA_THREADS, false>(g, P, a.q, a.q, C.h, Qs, Qs, tid,  /* Q, zero outside */
                                                       [](int r, int ch) { return swz<HD>(r, ch * 8); });

    // K, V (and key coordinates) of tile t into stage s: one key per TPR threads
    auto load_tile = [&](int t, int s) {
        C.template load_kv_tile<T, HD, BN, MMA_THREADS>(g, a, kp, vp, t, Ks + s * BN * HD, Vs + s * BN * HD,
                                                        kc + s * RANK * BN, tid,
                                                        [](int r, int ch) { return swz<HD>(r, ch * 8); });
    };

    // this thread's rows (r, r+8 of each of the warp's m-blocks): validity and in-group
    // windows per axis; invalid rows get empty windows
    const int rq = lane >> 2, cq = lane & 3;
    auto my_row = [&](int mb, int hrow) { return (w * MB + mb) * 16 + rq + 8 * hrow; };
    int wst[MB][2][RANK], wen[MB][2][RANK], brow[MB][2];
    bool rvalid[MB][2];
    const float *tab = BIAS ? tile_bias<RANK>::table(g, a.rpb, C.h) : nullptr;
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            int iq[3];
            rvalid[mb][hrow] = row_coords(my_row(mb, hrow), iq);
            brow[mb][hrow] = tile_bias<RANK>::row(g, iq);
#pragma unroll
            for (int ax = 0; ax < RANK; ++ax) {
                int64_t st = 0, en = 0;
                if (rvalid[mb][hrow]) window32(&g.axis[ax], iq[ax], C.Lg[ax], &st, &en);
                wst[mb][hrow][ax] = (int)st;
                wen[mb][hrow][ax] = rvalid[mb][hrow] ? (int)en : 0;
            }
        }
    // The warp's rows are a box (its m-blocks stacked along axis 0): per axis its first and
    // last valid coordinates f, l. Their key union (for skipping tiles) is [start(f), end(l));
    // the intersection of their windows (a tile inside it needs no mask) is [start(l), end(f))
    // when every row is valid (starts and ends never decrease along an axis).
    int ulo[RANK], uhi[RANK], ilo[RANK], ihi[RANK];
    bool warp_has_rows = true, all_rows = true;
    {
        constexpr int WX[3] = {WT[0] * MB, WT[1], WT[2]};  /* the warp's box */
        int wq[3];
        row_coords(w * MB * 16, wq);  /* the warp's first row */
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            warp_has_rows &= wq[ax] < C.Qe[ax] && wq[ax] + WX[ax] > C.Qb[ax];
            all_rows &= wq[ax] >= C.Qb[ax] && wq[ax] + WX[ax] <= C.Qe[ax];
        }
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            const int f = max(min(wq[ax], C.Qe[ax] - 1), C.Qb[ax]), l = min(wq[ax] + WX[ax], C.Qe[ax]) - 1;
            int64_t sf, ef, sl, el;
            window32(&g.axis[ax], f, C.Lg[ax], &sf, &ef);
            window32(&g.axis[ax], l, C.Lg[ax], &sl, &el);
            ulo[ax] = warp_has_rows ? (int)sf : 1 << 30;
            uhi[ax] = warp_has_rows ? (int)el : -(1 << 30);
            ilo[ax] = all_rows ? (int)sl : 1 << 30;
            ihi[ax] = all_rows ? (int)ef : -(1 << 30);
        }
    }

    float o[MB][HD / 8][4];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) o[mb][i][0] = o[mb][i][1] = o[mb][i][2] = o[mb][i][3] = 0.f;
    float m[MB][2], l[MB][2];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) m[mb][0] = m[mb][1] = -INFINITY, l[mb][0] = l[mb][1] = 0.f;
    uint32_t qf[QREG ? MB : 1][HD / 16][4];
    const float sl2 = P.scale_log2;

    // two stages: three were no faster and spilled more (bench/bench_gpu.py)
    tile_ring_start<ST>(tiles, load_tile);  /* Q rides with tile 0's group */
    for (int t = 0; t < tiles; ++t) {
        const int s = tile_ring_next<ST>(t, tiles, load_tile);
        auto load_qf = [&](int mb, int kk, uint32_t f[4]) {
            const int row = (w * MB + mb) * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
            const int col = kk * 16 + (lane >> 4) * 8;
            ldmatrix_x4(f, smem_u32(Qs + swz<HD>(row, col)));
        };
        if constexpr (QREG) {
            if (t == 0) {
#pragma unroll
                for (int mb = 0; mb < MB; ++mb)
#pragma unroll
                    for (int kk = 0; kk < HD / 16; ++kk) load_qf(mb, kk, qf[mb][kk]);
            }
        }
        const T *Kt = Ks + s * BN * HD, *Vt = Vs + s * BN * HD;
        const int *kct = kc + s * RANK * BN;
        const bool win = t < win_tiles;

        // does the tile hold a key of this warp's union; is it inside every row's window?
        bool any, full;
        if (win) {
            bool mine = false, inside = true;
#pragma unroll
            for (int kr = lane; kr < BN; kr += 32) {
                bool in_u = true, in_i = true;
#pragma unroll
                for (int ax = 0; ax < RANK; ++ax) {
                    const int j = kct[ax * BN + kr];
                    in_u = in_u && j >= ulo[ax] && j < uhi[ax];
                    in_i = in_i && j >= ilo[ax] && j < ihi[ax];
                }
                mine |= in_u;
                inside &= in_i;
            }
            any = __any_sync(0xffffffffu, mine);
            full = __all_sync(0xffffffffu, inside);
        } else {
            any = warp_has_rows;
            full = false;
        }

        if (any) {
            // S = Q K^T: each K fragment feeds the warp's MB m-blocks
            float sc[MB][BN / 8][4];
#pragma unroll
            for (int mb = 0; mb < MB; ++mb)
#pragma unroll
                for (int k = 0; k < BN / 8; ++k) sc[mb][k][0] = sc[mb][k][1] = sc[mb][k][2] = sc[mb][k][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                uint32_t qk[MB][4];
#pragma unroll
                for (int mb = 0; mb < MB; ++mb) {
                    if constexpr (QREG) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) qk[mb][i] = qf[mb][kk][i];
                    } else {
                        load_qf(mb, kk, qk[mb]);
                    }
                }
#pragma unroll
                for (int nb2 = 0; nb2 < BN / 16; ++nb2) {
                    uint32_t kf[4];
                    const int mat = lane >> 3;
                    const int row = nb2 * 16 + (mat >> 1) * 8 + (lane & 7);
                    const int col = kk * 16 + (mat & 1) * 8;
                    ldmatrix_x4(kf, smem_u32(Kt + swz<HD>(row, col)));
#pragma unroll
                    for (int mb = 0; mb < MB; ++mb) {
                        mma16816<T>(sc[mb][2 * nb2], qk[mb], kf[0], kf[1]);
                        mma16816<T>(sc[mb][2 * nb2 + 1], qk[mb], kf[2], kf[3]);
                    }
                }
            }
            float corr[MB][2];
            if (fwd_softmax_tile<MB, BN, RANK, BIAS>(g, sc, m, l, corr, full, win, kct, wst, wen, rvalid, sl2, cq,
                                                     tab, brow))
                fwd_rescale<MB, HD>(o, corr);
            // O += P V: each V fragment feeds the warp's MB m-blocks
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                uint32_t pf[MB][4];
#pragma unroll
                for (int mb = 0; mb < MB; ++mb) {
                    a_frag_of<T>(pf[mb], sc[mb][2 * kk], sc[mb][2 * kk + 1]);
                }
#pragma unroll
                for (int nd2 = 0; nd2 < HD / 16; ++nd2) {
                    uint32_t vf[4];
                    const int mat = lane >> 3;
                    const int row = kk * 16 + (mat & 1) * 8 + (lane & 7);
                    const int col = nd2 * 16 + (mat >> 1) * 8;
                    ldmatrix_x4_trans(vf, smem_u32(Vt + swz<HD>(row, col)));
#pragma unroll
                    for (int mb = 0; mb < MB; ++mb) {
                        mma16816<T>(o[mb][2 * nd2], pf[mb], vf[0], vf[1]);
                        mma16816<T>(o[mb][2 * nd2 + 1], pf[mb], vf[2], vf[3]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    if (tiles == 0) __syncthreads();  /* every thread's Q copies landed before Qs is reused */

    // O /= l, LSE, O out (the warp's ldmatrix reads of its Qs rows come first: with a single
    // tile no barrier follows them)
    fwd_store<T, MB, HD>(g, a, C.grp, C.b, C.h, o, m, l, Qs, w * MB * 16, lane, row_coords, my_row);
}

// ----------------------------------------------------------------------------
// plan, conditions, launch

int nbhd_cuda_mma_forward_supported(const nbhd_geometry *g, const nbhd_forward_args *a) {
    const bool half_type = g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    const int D = g->head_dim;
    const bool head_dim_ok = D == g->head_dim_v && (D == 32 || D == 64 || D == 128);
    const bool inputs_aligned =
        aligned_rows(a->q, 8, 16) &&
        (!g->has_window || (aligned_rows(a->k, 8, 16) && aligned_rows(a->v, 8, 16))) &&
        (g->extra_kv == 0 || (aligned_rows(a->kx, 8, 16) && aligned_rows(a->vx, 8, 16)));
    const bool out_aligned = aligned_rows(a->out, 2, 4);
    /* in-group coordinates in int, box positions in 32 bits, in-group steps in int */
    const bool small_axes = g->tokens < ((int64_t)1 << 31) && g->extra_kv < ((int64_t)1 << 31);
    const bool small_steps = steps_fit(a->q, g) && steps_fit(a->out, g) &&
                             (!g->has_window || (steps_fit(a->k, g) && steps_fit(a->v, g)));
    return half_type && head_dim_ok && inputs_aligned && out_aligned && small_axes && small_steps;
}

template <typename T, int HD, int BN, int RANK, int MB, int MINB, bool QREG>
static nbhd_status launch_rank(const nbhd_geometry *g, const nbhd_forward_args *a, const mma_plan &P,
                               cudaStream_t st) {
    constexpr int ST = FWD_STAGES;
    const size_t smem = sizeof(T) * (size_t)(64 * MB * HD + 2 * ST * BN * HD) + sizeof(int) * ST * RANK * BN;
    auto kernel = g->rpb ? fna_mma_forward_kernel<T, HD, BN, RANK, MB, MINB, QREG, true>
                         : fna_mma_forward_kernel<T, HD, BN, RANK, MB, MINB, QREG, false>;
    return nbhd_cuda_launch(kernel, g->batch * g->heads * P.patches,
                            MMA_THREADS, smem, "mma forward", st, *g, *a, P);
}

/* the kernel of the choice (kernel_choice.cu choose_forward), if it is one of these */
template <typename T, int HD, int BN, int MB, int MINB, bool QREG>
static nbhd_status launch_choice(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_cuda_choice &c,
                                 cudaStream_t st) {
    if (c.bn != BN || c.mb != MB || c.minb != MINB || c.qreg != (int)QREG) return nbhd_cuda_no_kernel("mma forward", &c);
    const mma_plan P = mma_plan_of(g, MB);
    switch (P.rank) {
    case 1: return launch_rank<T, HD, BN, 1, MB, MINB, QREG>(g, a, P, st);
    case 2: return launch_rank<T, HD, BN, 2, MB, MINB, QREG>(g, a, P, st);
    default: return launch_rank<T, HD, BN, 3, MB, MINB, QREG>(g, a, P, st);
    }
}

/* the instantiated kernels: 128-query patches at D >= 64 only */
template <typename T, int HD>
static nbhd_status launch(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_cuda_choice &c,
                          cudaStream_t st) {
    constexpr int extra_cta = HD <= 64 ? 1 : 0;
    if constexpr (HD >= 64) {
        if (c.family == NBHD_CUDA_WGMMA) return nbhd_cuda_wgmma_forward(g, a, &c, st);
        if (c.mb == 2) {
            if (c.bn == 32) return launch_choice<T, HD, 32, 2, 2, HD != 128>(g, a, c, st);
            return launch_choice<T, HD, 64, 2, 2, HD != 128>(g, a, c, st);
        }
    }
    if (c.bn == 32) return launch_choice<T, HD, 32, 1, 3 + extra_cta, HD != 128>(g, a, c, st);
    return launch_choice<T, HD, 64, 1, 2 + extra_cta, true>(g, a, c, st);
}

nbhd_status nbhd_cuda_mma_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                  const nbhd_cuda_choice *c, cudaStream_t st) {
    const bool bf = g->dtype == NBHD_BF16;
    switch (g->head_dim) {
    case 32: return bf ? launch<__nv_bfloat16, 32>(g, a, *c, st) : launch<__half, 32>(g, a, *c, st);
    case 64: return bf ? launch<__nv_bfloat16, 64>(g, a, *c, st) : launch<__half, 64>(g, a, *c, st);
    case 128: return bf ? launch<__nv_bfloat16, 128>(g, a, *c, st) : launch<__half, 128>(g, a, *c, st);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "mma forward: head_dim %d", g->head_dim);
}
