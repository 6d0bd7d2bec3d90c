/*
 * fna_mma.cu — tensor-core forward (O, LSE) for f16/bf16 with D = Dv in {32, 64, 128}:
 * mma.sync m16n8k16 with fp32 accumulation, through inline PTX (DESIGN.md §4, KERNELS.md §1-2).
 *
 * Tiles. A CTA of 4 warps owns a multi-dimensional patch of 64 queries of one (batch, head),
 * taken in one dilation group per axis (so every window of the patch lies in that group):
 *   1-D 64, 2-D 8x8 (warps 4x4 each), 3-D 4x4x4 (warps 2x2x4 each).
 * Its keys are the exact union of the patch's windows: per axis the in-group range
 * [start(first query), end(last query)) (start and end never decrease along an axis), walked
 * row-major (or, env NBHD_MMA_REGION_WALK=1, region by region: mma_util.cuh's union walk) in
 * tiles of 64 keys (32 for windows under 512 keys), then the extra keys. K and V tiles are
 * double-buffered in XOR-swizzled shared memory by cp.async (zero-filled past the end); Q stays
 * in registers. Each warp first asks (one ballot) whether the tile holds any key of its own
 * union and skips the tile's MMAs if not, then masks element-wise by each row's window.
 *
 *   S = (scale*log2 e) Q K^T     (ldmatrix K, mma)          16 x 64 per warp
 *   online softmax in base 2: m, l per row (quad shuffles), O *= 2^(m_old - m)
 *   O += P V                      (P from the S registers, ldmatrix.trans V, mma)
 *   O /= l,  LSE = (m + log2 l) ln 2
 */
#include "mma_util.cuh"

#define MMA_WARPS 4
#define MMA_THREADS (MMA_WARPS * 32)
#define BM 64  /* queries per CTA */

// ----------------------------------------------------------------------------
// the kernel

template <typename T, int HD, int BN /* keys per tile: 64, or 32 for small windows */,
          int MINB /* CTAs per SM the registers are budgeted for */,
          int NS /* K/V stages: 2 (load t+1, two barriers a tile) or 3 (load t+2, one barrier) */>
__global__ void __launch_bounds__(MMA_THREADS, MINB)
fna_mma_forward_kernel(const nbhd_geometry g, const nbhd_forward_args a, const mma_plan P) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = (T *)smem_raw;                 /* [BM][HD] */
    T *Ks = Qs + BM * HD;                  /* [NS][BN][HD] */
    T *Vs = Ks + NS * BN * HD;             /* [NS][BN][HD] */
    int *kc = (int *)(Vs + NS * BN * HD);  /* [NS][3][BN] in-group key coordinates */
    uwalk *uw = (uwalk *)(kc + 3 * NS * BN);  /* the order of the window keys */

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;

    // CTA -> (b, hk, patch, head in group); heads of one kv head are adjacent (L2 reuse)
    int64_t idx = blockIdx.x;
    const int hg = (int)(idx % g.group);
    idx /= g.group;
    const int64_t patch = idx % P.patches;
    idx /= P.patches;
    const int hk = (int)(idx % g.kv_heads);
    const int64_t b = idx / g.kv_heads;
    const int h = hk * g.group + hg;

    // per axis: dilation group, first in-group query of the patch, group length, key range
    int64_t grp[3], i0[3], Lg[3];
    {
        int64_t rest = patch;
        int64_t slot[3];
        slot[2] = rest % P.slots[2];
        rest /= P.slots[2];
        slot[1] = rest % P.slots[1];
        slot[0] = rest / P.slots[1];
        for (int ax = 0; ax < 3; ++ax) {
            const int64_t d = g.axis[ax].dilation;
            grp[ax] = slot[ax] % d;
            i0[ax] = (slot[ax] / d) * P.ct[ax];
            Lg[ax] = nbhd_group_len(&g.axis[ax], grp[ax]);
            if (i0[ax] >= Lg[ax]) return;  /* an empty slot (uniform over the CTA) */
        }
    }
    if (w == 0) uwalk_build(uw, g, P, i0, Lg, lane);

    // query row qr = w*16 + r of the CTA -> in-group coordinates; valid if inside every axis
    auto row_coords = [&](int qr, int64_t iq[3]) -> bool {
        const int ww = qr >> 4, r = qr & 15;
        const int w2 = ww % P.wc[2], w1 = (ww / P.wc[2]) % P.wc[1], w0 = ww / (P.wc[1] * P.wc[2]);
        const int r2 = r % P.wt[2], r1 = (r / P.wt[2]) % P.wt[1], r0 = r / (P.wt[1] * P.wt[2]);
        iq[0] = i0[0] + w0 * P.wt[0] + r0;
        iq[1] = i0[1] + w1 * P.wt[1] + r1;
        iq[2] = i0[2] + w2 * P.wt[2] + r2;
        return iq[0] < Lg[0] && iq[1] < Lg[1] && iq[2] < Lg[2];
    };

    // load Q (zero rows outside the grid)
    {
        constexpr int CH = HD / 8;
        constexpr int TPR = MMA_THREADS / BM, CPT = CH / TPR;  /* threads per row, chunks each */
        const int row = tid / TPR;
#pragma unroll
        for (int cc = 0; cc < CPT; ++cc) {
            const int ch = (tid % TPR) * CPT + cc;
            int64_t iq[3];
            const bool ok = row_coords(row, iq);
            const T *src = (const T *)a.q.data;
            if (ok)
                src += offset_of(a.q, b, grp[0] + iq[0] * g.axis[0].dilation,
                                 grp[1] + iq[1] * g.axis[1].dilation,
                                 grp[2] + iq[2] * g.axis[2].dilation, h) + ch * 8;
            cp_async16(smem_u32(Qs + swz<HD>(row, ch * 8)), src, ok);
        }
    }

    __syncthreads();  /* the walk is built */
    const int nk = uw->total;
    const int64_t nx = g.extra_kv;
    const int win_tiles = (nk + BN - 1) / BN;
    const int tiles = win_tiles + (int)((nx + BN - 1) / BN);

    // K, V (and key coordinates) of tile t into stage s
    auto load_tile = [&](int t, int s) {
        constexpr int CH = HD / 8;
        T *Kd = Ks + s * BN * HD, *Vd = Vs + s * BN * HD;
        int *kcd = kc + s * 3 * BN;
        const bool win = t < win_tiles;
        // MMA_THREADS / BN threads per row, each a run of chunks: one coordinate computation
        constexpr int TPR = MMA_THREADS / BN, CPT = CH / TPR;
        const int kr = tid / TPR;
        int j[3] = {0, 0, 0};
        const int nwalk = t * BN + kr;
        if (win && nwalk < nk) uwalk_key(uw, nwalk, j);
#pragma unroll
        for (int cc = 0; cc < CPT; ++cc) {
            const int ch = (tid % TPR) * CPT + cc;
            const T *ksrc = (const T *)(win ? a.k.data : a.kx.data);
            const T *vsrc = (const T *)(win ? a.v.data : a.vx.data);
            bool ok;
            if (win) {
                ok = nwalk < nk;
                if (ok) {
                    const int64_t y0 = grp[0] + j[0] * g.axis[0].dilation,
                                  y1 = grp[1] + j[1] * g.axis[1].dilation,
                                  y2 = grp[2] + j[2] * g.axis[2].dilation;
                    ksrc += offset_of(a.k, b, y0, y1, y2, hk) + ch * 8;
                    vsrc += offset_of(a.v, b, y0, y1, y2, hk) + ch * 8;
                }
            } else {
                const int64_t e = (int64_t)(t - win_tiles) * BN + kr;
                ok = e < nx;
                if (ok) {
                    ksrc += b * a.kx.stride[0] + e * a.kx.stride[1] + hk * a.kx.stride[4] + ch * 8;
                    vsrc += b * a.vx.stride[0] + e * a.vx.stride[1] + hk * a.vx.stride[4] + ch * 8;
                }
            }
            cp_async16(smem_u32(Kd + swz<HD>(kr, ch * 8)), ksrc, ok);
            cp_async16(smem_u32(Vd + swz<HD>(kr, ch * 8)), vsrc, ok);
            if (ch == 0) {
                kcd[kr] = ok ? j[0] : KEY_NONE;
                kcd[BN + kr] = j[1];
                kcd[2 * BN + kr] = j[2];
            }
        }
    };

    // this thread's two rows (r, r+8 of the warp): validity and in-group windows per axis;
    // invalid rows get empty windows
    const int rq = lane >> 2, cq = lane & 3;
    int wst[2][3], wen[2][3];
    bool rvalid[2];
    int64_t rfull[2][3];
    for (int hrow = 0; hrow < 2; ++hrow) {
        int64_t iq[3];
        rvalid[hrow] = row_coords(w * 16 + rq + 8 * hrow, iq);
        for (int ax = 0; ax < 3; ++ax) {
            int64_t st = 0, en = 0;
            if (rvalid[hrow]) window32(&g.axis[ax], iq[ax], Lg[ax], &st, &en);
            wst[hrow][ax] = (int)st;
            wen[hrow][ax] = rvalid[hrow] ? (int)en : 0;
            rfull[hrow][ax] = grp[ax] + iq[ax] * g.axis[ax].dilation;
        }
    }
    // the warp's own key union (for skipping tiles): min start, max end over its valid rows
    int ulo[3], uhi[3];
    for (int ax = 0; ax < 3; ++ax) {
        int l0 = 1 << 30, h0 = -(1 << 30);
        for (int hrow = 0; hrow < 2; ++hrow)
            if (rvalid[hrow]) {
                l0 = min(l0, wst[hrow][ax]);
                h0 = max(h0, wen[hrow][ax]);
            }
        for (int o = 16; o > 0; o >>= 1) {
            l0 = min(l0, __shfl_xor_sync(0xffffffffu, l0, o));
            h0 = max(h0, __shfl_xor_sync(0xffffffffu, h0, o));
        }
        ulo[ax] = l0;
        uhi[ax] = h0;
    }
    // the intersection of the warp's windows: a tile inside it needs no mask (interior tiles
    // of large or strided windows); only when all 16 rows are valid
    int ilo[3], ihi[3];
    const bool all_rows = __all_sync(0xffffffffu, rvalid[0] && rvalid[1]);
    for (int ax = 0; ax < 3; ++ax) {
        int l0 = max(wst[0][ax], wst[1][ax]), h0 = min(wen[0][ax], wen[1][ax]);
        for (int o = 16; o > 0; o >>= 1) {
            l0 = max(l0, __shfl_xor_sync(0xffffffffu, l0, o));
            h0 = min(h0, __shfl_xor_sync(0xffffffffu, h0, o));
        }
        ilo[ax] = all_rows ? l0 : 1 << 30;
        ihi[ax] = all_rows ? h0 : -(1 << 30);
    }

    float o[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    uint32_t qf[HD / 16][4];

    if (tiles > 0) load_tile(0, 0);
    cp_async_commit();
    if (NS == 3) {
        if (tiles > 1) load_tile(1, 1);
        cp_async_commit();
    }

    for (int t = 0; t < tiles; ++t) {
        const int s = NS == 3 ? t % 3 : t & 1;
        if (NS == 3) {
            /* groups 0 .. t+1 committed: wait for tile t; the barrier also frees the stage of
             * tile t-1, which tile t+2 takes */
            cp_async_wait<1>();
            __syncthreads();
            if (t + 2 < tiles) load_tile(t + 2, (t + 2) % 3);
            cp_async_commit();
        } else {
            if (t + 1 < tiles) load_tile(t + 1, s ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
        }
        if (t == 0) {
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                const int row = w * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
                const int col = kk * 16 + (lane >> 4) * 8;
                ldmatrix_x4(qf[kk], smem_u32(Qs + swz<HD>(row, col)));
            }
        }
        const T *Kt = Ks + s * BN * HD, *Vt = Vs + s * BN * HD;
        const int *kct = kc + s * 3 * BN;
        const bool win = t < win_tiles;

        // does the tile hold a key of this warp's union?
        bool any, full;
        if (win) {
            bool mine = false, inside = true;
            for (int kr = lane; kr < BN; kr += 32) {
                const int j0 = kct[kr], j1 = kct[BN + kr], j2 = kct[2 * BN + kr];
                mine |= j0 >= ulo[0] && j0 < uhi[0] && j1 >= ulo[1] && j1 < uhi[1] &&
                        j2 >= ulo[2] && j2 < uhi[2];
                inside &= j0 >= ilo[0] && j0 < ihi[0] && j1 >= ilo[1] && j1 < ihi[1] &&
                          j2 >= ilo[2] && j2 < ihi[2];
            }
            any = __any_sync(0xffffffffu, mine);
            full = __all_sync(0xffffffffu, inside);
        } else {
            any = ulo[0] < uhi[0];  /* the warp has a valid row */
            full = false;
        }

        if (any) {
            // S = Q K^T
            float sc[BN / 8][4];
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
                for (int nb2 = 0; nb2 < BN / 16; ++nb2) {
                    uint32_t kf[4];
                    const int mat = lane >> 3;
                    const int row = nb2 * 16 + (mat >> 1) * 8 + (lane & 7);
                    const int col = kk * 16 + (mat & 1) * 8;
                    ldmatrix_x4(kf, smem_u32(Kt + swz<HD>(row, col)));
                    mma16816<T>(sc[2 * nb2], qf[kk], kf[0], kf[1]);
                    mma16816<T>(sc[2 * nb2 + 1], qf[kk], kf[2], kf[3]);
                }
            }
            // scale to base 2 and mask: key column nb*8 + 2*cq + e
            float mx[2] = {-INFINITY, -INFINITY};
            if (full) {  /* every key of the tile is in every row's window */
#pragma unroll
                for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        sc[nb][e] *= P.scale_log2;
                        mx[e >> 1] = fmaxf(mx[e >> 1], sc[nb][e]);
                    }
            } else {
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int kr = nb * 8 + 2 * cq + e;
                    const int j0 = kct[kr], j1 = kct[BN + kr], j2 = kct[2 * BN + kr];
#pragma unroll
                    for (int hrow = 0; hrow < 2; ++hrow) {
                        bool ok;
                        if (win)
                            ok = j0 >= wst[hrow][0] && j0 < wen[hrow][0] && j1 >= wst[hrow][1] &&
                                 j1 < wen[hrow][1] && j2 >= wst[hrow][2] && j2 < wen[hrow][2];
                        else
                            ok = rvalid[hrow] && j0 != KEY_NONE;
                        float &x = sc[nb][2 * hrow + e];
                        x = ok ? x * P.scale_log2 : -INFINITY;
                        mx[hrow] = fmaxf(mx[hrow], x);
                    }
                }
            }
            }
            float corr[2], mu[2];
#pragma unroll
            for (int hrow = 0; hrow < 2; ++hrow) {
                mx[hrow] = fmaxf(mx[hrow], __shfl_xor_sync(0xffffffffu, mx[hrow], 1));
                mx[hrow] = fmaxf(mx[hrow], __shfl_xor_sync(0xffffffffu, mx[hrow], 2));
                const float m_new = fmaxf(m[hrow], mx[hrow]);
                mu[hrow] = m_new == -INFINITY ? 0.f : m_new;  /* a row with no key yet */
                corr[hrow] = exp2f(m[hrow] - mu[hrow]);       /* O = O 2^(m_old - m) */
                m[hrow] = m_new;
                l[hrow] *= corr[hrow];
            }
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = exp2f(sc[nb][e] - mu[e >> 1]);
                    sc[nb][e] = p;
                    l[e >> 1] += p;
                }
            }
#pragma unroll
            for (int nd = 0; nd < HD / 8; ++nd) {
                o[nd][0] *= corr[0];
                o[nd][1] *= corr[0];
                o[nd][2] *= corr[1];
                o[nd][3] *= corr[1];
            }
            // O += P V
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                uint32_t pf[4];
                pf[0] = pack2<T>(sc[2 * kk][0], sc[2 * kk][1]);
                pf[1] = pack2<T>(sc[2 * kk][2], sc[2 * kk][3]);
                pf[2] = pack2<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
                pf[3] = pack2<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
                for (int nd2 = 0; nd2 < HD / 16; ++nd2) {
                    uint32_t vf[4];
                    const int mat = lane >> 3;
                    const int row = kk * 16 + (mat & 1) * 8 + (lane & 7);
                    const int col = nd2 * 16 + (mat >> 1) * 8;
                    ldmatrix_x4_trans(vf, smem_u32(Vt + swz<HD>(row, col)));
                    mma16816<T>(o[2 * nd2], pf, vf[0], vf[1]);
                    mma16816<T>(o[2 * nd2 + 1], pf, vf[2], vf[3]);
                }
            }
        }
        if (NS == 2) __syncthreads();  /* stage s is free for tile t + 2 */
    }
    cp_async_wait<0>();

    // O /= l, LSE = (m + log2 l) ln 2
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        float lt = l[hrow];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        if (!rvalid[hrow]) continue;
        const float inv = 1.f / lt;
        const int64_t ooff = offset_of(a.out, b, rfull[hrow][0], rfull[hrow][1], rfull[hrow][2], h);
        T *out = (T *)a.out.data + ooff;
#pragma unroll
        for (int nd = 0; nd < HD / 8; ++nd) {
            const int col = nd * 8 + 2 * cq;
            *(uint32_t *)(out + col) = pack2<T>(o[nd][2 * hrow] * inv, o[nd][2 * hrow + 1] * inv);
        }
        if (cq == 0)
            ((float *)a.lse.data)[offset_of(a.lse, b, rfull[hrow][0], rfull[hrow][1], rfull[hrow][2], h)] =
                (m[hrow] + log2f(lt)) * 0.69314718055994531f;
    }
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
    /* in-group coordinates are kept in int */
    /* in-group coordinates in int, box positions in 32 bits */
    const bool small_axes = g->tokens < ((int64_t)1 << 31) && g->extra_kv < ((int64_t)1 << 31);
    return half_type && head_dim_ok && inputs_aligned && out_aligned && small_axes;
}

template <typename T, int HD, int BN, int MINB, int NS>
static nbhd_status launch_bn(const nbhd_geometry *g, const nbhd_forward_args *a, cudaStream_t st) {
    const mma_plan P = mma_plan_of(g);
    const size_t smem =
        sizeof(T) * (size_t)(BM * HD + 2 * NS * BN * HD) + sizeof(int) * 3 * NS * BN + sizeof(uwalk);
    /* per device and cheap: set on every launch (legal during stream capture) */
    if (cudaFuncSetAttribute(fna_mma_forward_kernel<T, HD, BN, MINB, NS>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) {
        const cudaError_t err = cudaGetLastError();
        return nbhd_fail(NBHD_ERR_DEVICE, "mma forward: cannot reserve %zu bytes of shared memory: %s",
                         smem, cudaGetErrorString(err));
    }
    const int64_t ctas = g->batch * g->heads * P.patches;
    if (ctas > 0x7fffffff)
        return nbhd_fail(NBHD_ERR_UNSUPPORTED, "mma forward: %lld CTAs exceed the grid limit",
                         (long long)ctas);
    fna_mma_forward_kernel<T, HD, BN, MINB, NS><<<(unsigned)ctas, MMA_THREADS, smem, st>>>(*g, *a, P);
    NBHD_CUDA_CHECK_LAUNCH("mma forward");
    return NBHD_OK;
}

/* Small windows (|window| < 512 keys) take 32-key tiles: finer per-warp tile skipping and
 * less padding of the union; large ones 64-key tiles (more work per barrier). */
template <typename T, int HD>
static nbhd_status launch(const nbhd_geometry *g, const nbhd_forward_args *a, cudaStream_t st) {
    const int64_t window = (int64_t)g->axis[0].kernel * g->axis[1].kernel * g->axis[2].kernel;
    const bool small_window = g->has_window && window < 512;
    /* 64-key tiles keep 2 stages (3 would leave one 112 KiB CTA per SM at D = 128) */
    if (!small_window) return launch_bn<T, HD, 64, 2, 2>(g, a, st);
    /* 32-key tiles: 2 stages unless env NBHD_MMA_FWD_STAGES=3; D = 128 budgets registers for
     * 2 CTAs/SM (234 registers) unless NBHD_MMA_FWD_OCC=3 (168, a few spills). Both env
     * switches exist for A/B runs on the device (bench/ab_fwd.py); neither was faster on an
     * H200 (bench/RESULTS_GPU.md). */
    const char *stg = getenv("NBHD_MMA_FWD_STAGES"), *occ = getenv("NBHD_MMA_FWD_OCC");
    const bool two = !(stg && stg[0] == '3');
    if (HD <= 64 || (occ && occ[0] == '3'))
        return two ? launch_bn<T, HD, 32, 3, 2>(g, a, st) : launch_bn<T, HD, 32, 3, 3>(g, a, st);
    return two ? launch_bn<T, HD, 32, 2, 2>(g, a, st) : launch_bn<T, HD, 32, 2, 3>(g, a, st);
}

nbhd_status nbhd_cuda_mma_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                  const nbhd_exec *e, cudaStream_t st) {
    (void)e;
    const bool bf = g->dtype == NBHD_BF16;
    switch (g->head_dim) {
    case 32: return bf ? launch<__nv_bfloat16, 32>(g, a, st) : launch<__half, 32>(g, a, st);
    case 64: return bf ? launch<__nv_bfloat16, 64>(g, a, st) : launch<__half, 64>(g, a, st);
    case 128: return bf ? launch<__nv_bfloat16, 128>(g, a, st) : launch<__half, 128>(g, a, st);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "mma forward: head_dim %d", g->head_dim);
}
