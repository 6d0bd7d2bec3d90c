/*
 * mma_util.cuh — inline-PTX helpers of the tensor-core kernels (fna_mma.cu, fna_mma_bwd.cu):
 * cp.async, ldmatrix, mma.sync m16n8k16 (f16/bf16 -> f32), packing, the XOR-swizzled tile layout,
 * and the tile plan shared by the forward and backward kernels.
 */
#ifndef NBHD_CUDA_MMA_UTIL_CUH
#define NBHD_CUDA_MMA_UTIL_CUH

#include <stdlib.h>

#include "cuda_common.cuh"

#define KEY_NONE (-(1 << 30))

/* tile shapes and the CTA -> (b, head, patch) map, computed on the host */
struct mma_plan {
    int wt[3];        /* warp patch per axis, product 16 */
    int wc[3];        /* warps per axis, product 4 */
    int ct[3];        /* CTA patch = wt * wc */
    int64_t slots[3]; /* patch slots per axis: dilation * ceil(ceil(L/d) / ct) */
    int64_t patches;  /* product of slots */
    float scale_log2; /* scale * log2(e) */
    int flat_walk;    /* 1: walk the union box row-major (the default); 0: region by region
                         (env NBHD_MMA_REGION_WALK=1; measured no faster, see RESULTS_GPU.md) */
};

/* 64-row patches: 1-D 64, 2-D 8x8 (warps 4x4), 3-D 4x4x4 (warps 2x2x4) */
static inline mma_plan mma_plan_of(const nbhd_geometry *g) {
    mma_plan P;
    const int rank = !g->has_window ? 1 : g->axis[2].extent > 1 || g->axis[2].kernel > 1 ? 3
                                   : g->axis[1].extent > 1 || g->axis[1].kernel > 1 ? 2 : 1;
    static const int wt_of[4][3] = {{16, 1, 1}, {16, 1, 1}, {4, 4, 1}, {2, 2, 4}};
    static const int wc_of[4][3] = {{4, 1, 1}, {4, 1, 1}, {2, 2, 1}, {2, 2, 1}};
    P.patches = 1;
    for (int ax = 0; ax < 3; ++ax) {
        P.wt[ax] = wt_of[rank][ax];
        P.wc[ax] = wc_of[rank][ax];
        P.ct[ax] = P.wt[ax] * P.wc[ax];
        const int64_t d = g->axis[ax].dilation, L = g->axis[ax].extent;
        const int64_t lg = (L + d - 1) / d;
        P.slots[ax] = d * ((lg + P.ct[ax] - 1) / P.ct[ax]);
        P.patches *= P.slots[ax];
    }
    P.scale_log2 = (float)(g->scale * 1.4426950408889634);
    const char *rw = getenv("NBHD_MMA_REGION_WALK");
    P.flat_walk = !(rw && rw[0] == '1');
    return P;
}

/* rows of 16-byte-aligned vectors: unit element stride, other strides multiples of align_elems */
static inline bool aligned_rows(const nbhd_tensor &t, int64_t align_elems, uintptr_t align_bytes) {
    if (!t.data || ((uintptr_t)t.data % align_bytes) != 0 || t.stride[5] != 1) return false;
    for (int i = 0; i < 5; ++i)
        if (t.stride[i] % align_elems != 0) return false;
    return true;
}

// ----------------------------------------------------------------------------
// PTX helpers

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    const int n = valid ? 16 : 0;  /* 0 source bytes: the 16 bytes are zero-filled */
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* c += a b, m16n8k16, fp32 accumulators */
template <typename T> __device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4],
                                                                uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float c[4], const uint32_t a[4],
                                                                     uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float c[4], const uint32_t a[4],
                                                              uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* element offset of (row, col) in a [rows][HD] tile, 16-byte chunks XOR-swizzled by row */
template <int HD> __device__ __forceinline__ int swz(int row, int col) {
    constexpr int CH = HD / 8, MASK = (CH < 8 ? CH : 8) - 1;
    return row * HD + ((((col >> 3) ^ (row & MASK))) << 3) + (col & 7);
}

/* window.h's rule in 32-bit integers (the mma paths need tokens < 2^31): same signatures as
 * nbhd_window_in_group and nbhd_inverse_window, without their 64-bit divisions */
__device__ __forceinline__ void window32(const nbhd_axis *a, int64_t i64, int64_t n64,
                                         int64_t *start, int64_t *end) {
    const int K = a->kernel, s = a->stride, i = (int)i64, n = (int)n64;
    const int q = i / s;
    if (a->causal) {
        const int leader = min(q * s + s - 1, n - 1);
        *start = max(leader - K + 1, 0);
        *end = i + 1;
    } else {
        const int leader = min(q * s + s / 2, n - 1);
        const int st = max(min(leader - K / 2, n - K), 0);
        *start = st;
        *end = st + K;
    }
}

__device__ __forceinline__ void inverse32(const nbhd_axis *a, int64_t y64, int64_t *first,
                                          int64_t *count) {
    const int d = a->dilation, y = (int)y64, g = y % d, j = y / d;
    const int n = ((int)a->extent - g + d - 1) / d;
    int64_t st, en;
    int lo = 0, hi = n;  /* first i with end(i) > j */
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        window32(a, mid, n, &st, &en);
        if (en > j) hi = mid; else lo = mid + 1;
    }
    const int i_lo = lo;
    hi = n;  /* first i with start(i) > j */
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        window32(a, mid, n, &st, &en);
        if (st > j) hi = mid; else lo = mid + 1;
    }
    *first = g + (int64_t)i_lo * d;
    *count = lo - i_lo;
}

// ----------------------------------------------------------------------------
// the union walk: the order in which a CTA visits the keys of its windows
//
// Per axis the CTA's warp rows (P.wc of them, P.wt queries each) have key unions [lo_r, hi_r)
// (in-group coordinates; starts and ends never decrease along an axis). Their breakpoints cut
// the axis into segments, each needed by a fixed run of warp rows (gaps needed by none are
// dropped). The CTA visits the product regions of these segments one after the other, each
// row-major, so a tile holds keys of few regions and a warp skips the tiles of regions outside
// its own union (2-D 7x7: 9 regions of the 14x14 box; a warp needs 4 of them, 10x10 keys). The
// walk covers every row's window exactly once; the element mask stays as before.
// Measured on an H200 (bench/RESULTS_GPU.md): 10-16 % fewer MMA tiles but no faster (the kernels
// are bound by instruction issue at 8 warps/SM, not by MMAs), so the default is one region, the
// whole union box row-major (P.flat_walk); env NBHD_MMA_REGION_WALK=1 selects the regions.

#define UW_SEG 8   /* segments per axis: at most 2 * wc - 1 (wc <= 4) */
#define UW_MAX 32  /* regions (one lane each when built) */

struct uwalk {    /* in shared memory */
    int nreg, total;
    int pre[UW_MAX + 1];               /* first walk index of each region */
    int f0[UW_MAX], f1[UW_MAX], f2[UW_MAX];  /* first key of each region, in-group */
    int c1[UW_MAX], c2[UW_MAX];        /* extents of each region on axes 1 and 2 */
    int seg_lo[3][UW_SEG], seg_n[3][UW_SEG], nseg[3];
};

/* Built by one whole warp (all 32 lanes); the CTA synchronises before reading it. */
__device__ __forceinline__ void uwalk_build(uwalk *u, const nbhd_geometry &g, const mma_plan &P,
                                            const int64_t i0[3], const int64_t Lg[3], int lane) {
    if (lane < 3) {
        const int ax = lane;
        int lo[4], hi[4], nr = 0;
        for (int r = 0; r < P.wc[ax] && r < 4; ++r) {
            const int64_t first = i0[ax] + (int64_t)r * P.wt[ax];
            if (first >= Lg[ax]) break;
            const int64_t last = min(first + P.wt[ax], Lg[ax]) - 1;
            int64_t st, en, st2, en2;
            window32(&g.axis[ax], first, Lg[ax], &st, &en);
            window32(&g.axis[ax], last, Lg[ax], &st2, &en2);
            lo[nr] = (int)st;
            hi[nr] = (int)en2;
            ++nr;
        }
        int pts[8], np = 0;
        for (int r = 0; r < nr; ++r) {
            pts[np++] = lo[r];
            pts[np++] = hi[r];
        }
        for (int i = 1; i < np; ++i)  /* insertion sort, at most 8 */
            for (int k = i; k > 0 && pts[k - 1] > pts[k]; --k) {
                const int x = pts[k]; pts[k] = pts[k - 1]; pts[k - 1] = x;
            }
        int ns = 0;
        for (int i = 0; i + 1 < np; ++i) {
            const int p0 = pts[i], p1 = pts[i + 1];
            if (p1 <= p0) continue;
            bool need = false;
            for (int r = 0; r < nr; ++r) need |= lo[r] <= p0 && p1 <= hi[r];
            if (need && ns < UW_SEG) {
                u->seg_lo[ax][ns] = p0;
                u->seg_n[ax][ns] = p1 - p0;
                ++ns;
            }
        }
        u->nseg[ax] = ns;
    }
    __syncwarp();
    if (P.flat_walk || u->nseg[0] * u->nseg[1] * u->nseg[2] > UW_MAX) {  /* > UW_MAX: never with
                                                                             mma_plan_of's plans */
        __syncwarp();
        if (lane < 3) {  /* one segment per axis: the whole union box */
            const int k = u->nseg[lane] - 1;
            u->seg_n[lane][0] = u->seg_lo[lane][k] + u->seg_n[lane][k] - u->seg_lo[lane][0];
            u->nseg[lane] = 1;
        }
        __syncwarp();
    }
    const int n0 = u->nseg[0], n1 = u->nseg[1], n2 = u->nseg[2];
    const int nreg = g.has_window ? min(n0 * n1 * n2, UW_MAX) : 0;
    int size = 0;
    if (lane < nreg) {
        const int s2 = lane % n2, s1 = (lane / n2) % n1, s0 = lane / (n1 * n2);
        u->f0[lane] = u->seg_lo[0][s0];
        u->f1[lane] = u->seg_lo[1][s1];
        u->f2[lane] = u->seg_lo[2][s2];
        u->c1[lane] = u->seg_n[1][s1];
        u->c2[lane] = u->seg_n[2][s2];
        size = u->seg_n[0][s0] * u->seg_n[1][s1] * u->seg_n[2][s2];
    }
    int incl = size;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane < nreg) u->pre[lane] = incl - size;
    if (lane == 31) {
        u->nreg = nreg;
        u->total = incl;
        u->pre[nreg] = incl;
    }
}

/* in-group coordinates of the n-th key of the walk (0 <= n < total) */
__device__ __forceinline__ void uwalk_key(const uwalk *u, int n, int j[3]) {
    int r = 0;
    const int nreg = u->nreg;
    while (r + 1 < nreg && u->pre[r + 1] <= n) ++r;
    const uint32_t m = (uint32_t)(n - u->pre[r]), c2 = (uint32_t)u->c2[r], c1 = (uint32_t)u->c1[r];
    const uint32_t q2 = m / c2, q1 = q2 / c1;
    j[2] = u->f2[r] + (int)(m - q2 * c2);
    j[1] = u->f1[r] + (int)(q2 - q1 * c1);
    j[0] = u->f0[r] + (int)q1;
}

#define BR 64  /* rows per CTA of the backward and JVP kernels (4 warps x 16) */
#define BC 32  /* columns per tile of the backward and JVP kernels */

// ----------------------------------------------------------------------------
// shared pieces: a 16 x BC score tile of one warp, A from shared rows, B from shared columns

/* acc[BC/8][4] += A(16 x HD, rows a_row0.. of As) * B(BC x HD of Bs)^T */
template <typename T, int HD>
__device__ __forceinline__ void tile_abt(float acc[BC / 8][4], const T *As, int a_row0, const T *Bs,
                                         int lane) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t af[4];
        {
            const int row = a_row0 + ((lane >> 3) & 1) * 8 + (lane & 7);
            const int col = kk * 16 + (lane >> 4) * 8;
            ldmatrix_x4(af, smem_u32(As + swz<HD>(row, col)));
        }
#pragma unroll
        for (int nb2 = 0; nb2 < BC / 16; ++nb2) {
            uint32_t bf[4];
            const int mat = lane >> 3;
            const int row = nb2 * 16 + (mat >> 1) * 8 + (lane & 7);
            const int col = kk * 16 + (mat & 1) * 8;
            ldmatrix_x4(bf, smem_u32(Bs + swz<HD>(row, col)));
            mma16816<T>(acc[2 * nb2], af, bf[0], bf[1]);
            mma16816<T>(acc[2 * nb2 + 1], af, bf[2], bf[3]);
        }
    }
}

/* acc[HD/8][4] += X(16 x BC, registers) * Bs(BC x HD, k = row of Bs) */
template <typename T, int HD>
__device__ __forceinline__ void tile_xb(float acc[HD / 8][4], const float x[BC / 8][4], const T *Bs,
                                        int lane) {
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t pf[4];
        pf[0] = pack2<T>(x[2 * kk][0], x[2 * kk][1]);
        pf[1] = pack2<T>(x[2 * kk][2], x[2 * kk][3]);
        pf[2] = pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        pf[3] = pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
#pragma unroll
        for (int nd2 = 0; nd2 < HD / 16; ++nd2) {
            uint32_t bf[4];
            const int mat = lane >> 3;
            const int row = kk * 16 + (mat & 1) * 8 + (lane & 7);
            const int col = nd2 * 16 + (mat >> 1) * 8;
            ldmatrix_x4_trans(bf, smem_u32(Bs + swz<HD>(row, col)));
            mma16816<T>(acc[2 * nd2], pf, bf[0], bf[1]);
            mma16816<T>(acc[2 * nd2 + 1], pf, bf[2], bf[3]);
        }
    }
}

/* row-tile geometry of a CTA: per axis dilation group, first in-group index, group length */
struct patch_rows {
    int64_t grp[3], i0[3], Lg[3];
};

__device__ __forceinline__ bool patch_of(const nbhd_geometry &g, const mma_plan &P, int64_t patch,
                                         patch_rows &pr) {
    int64_t slot[3];
    slot[2] = patch % P.slots[2];
    slot[1] = (patch / P.slots[2]) % P.slots[1];
    slot[0] = patch / (P.slots[1] * P.slots[2]);
    for (int ax = 0; ax < 3; ++ax) {
        const int64_t d = g.axis[ax].dilation;
        pr.grp[ax] = slot[ax] % d;
        pr.i0[ax] = (slot[ax] / d) * P.ct[ax];
        pr.Lg[ax] = nbhd_group_len(&g.axis[ax], pr.grp[ax]);
        if (pr.i0[ax] >= pr.Lg[ax]) return false;
    }
    return true;
}

/* row qr of the CTA -> in-group coordinates; valid if inside every axis */
__device__ __forceinline__ bool patch_row(const mma_plan &P, const patch_rows &pr, int qr,
                                          int64_t iq[3]) {
    const int ww = qr >> 4, r = qr & 15;
    const int w2 = ww % P.wc[2], w1 = (ww / P.wc[2]) % P.wc[1], w0 = ww / (P.wc[1] * P.wc[2]);
    const int r2 = r % P.wt[2], r1 = (r / P.wt[2]) % P.wt[1], r0 = r / (P.wt[1] * P.wt[2]);
    iq[0] = pr.i0[0] + w0 * P.wt[0] + r0;
    iq[1] = pr.i0[1] + w1 * P.wt[1] + r1;
    iq[2] = pr.i0[2] + w2 * P.wt[2] + r2;
    return iq[0] < pr.Lg[0] && iq[1] < pr.Lg[1] && iq[2] < pr.Lg[2];
}

template <typename T> __device__ __forceinline__ void store_pairs(T *dst, const float (*acc)[4],
                                                                   int n8, int hrow, int cq,
                                                                   float mul) {
    for (int nd = 0; nd < n8; ++nd)
        *(uint32_t *)(dst + nd * 8 + 2 * cq) =
            pack2<T>(acc[nd][2 * hrow] * mul, acc[nd][2 * hrow + 1] * mul);
}

#endif /* NBHD_CUDA_MMA_UTIL_CUH */

