/*
 * layout.c — the AMX kernels' geometry and workspace, the packing of their operands into it (rows,
 * columns in blocks of 32 positions, 16-key slices on row pairs; amx_internal.h has the layouts),
 * and the transposes of a work item's 16 lanes (Q^T in, outputs out).
 */
#include "amx_internal.h"

#ifdef NBHD_CPU_AMX_BUILD

// ----------------------------------------------------------------------------
// geometry and workspace

/* a group's zero padding */
static inline int64_t amx_gpad(int64_t Lg) { return (Lg + 31) / 32 * 32 - Lg; }

amx_geo amx_geo_of(const nbhd_geometry *g) {
    amx_geo G;
    G.X = g->axis[0].extent; G.Y = g->axis[1].extent; G.Z = g->axis[2].extent;
    G.D = g->head_dim; G.Dv = g->head_dim_v; G.dil = g->axis[2].dilation;
    G.lines = G.X * G.Y;
    G.ZP = amx_goff(&G, G.dil);
    return G;
}

/* the number of 16-key slices on row pairs (amx_pair_slices), -1 off them */
static int64_t amx_slice_count(const amx_geo *G, const nbhd_geometry *g, int inverse) {
    int64_t *buf = (int64_t *)malloc(sizeof(int64_t) * 3 * (size_t)G->ZP), ns = -1;
    if (buf) ns = amx_pair_slices(G, g, inverse, (int32_t *)buf, buf + G->ZP, buf + 2 * G->ZP);
    free(buf);
    return ns;
}

/* elements of a transposed [dim] operand's region: its columns (amx_col), or on row pairs its ns
 * slices, whichever is larger (the region holds the one in use) */
int64_t amx_transposed_elems(const amx_geo *G, int64_t ns, int64_t dim) {
    const int64_t cols = G->lines * G->ZP * dim, slices = ns > 0 ? amx_slice_at(G, ns, 0, 0, dim) : 0;
    return slices > cols ? slices : cols;
}

/* Bytes per slab: forward K and V^T (forward+JVP: tK and tV^T too); backward K, K^T, V and, per
 * query head of the group, Q, Q^T, dO, dO^T and fp32 L, D per position. 0: no AMX kernel. */
size_t nbhd_cpu_amx_workspace_bytes(const nbhd_geometry *g, nbhd_op op) {
    if (!g->has_window) return 0;
    const amx_geo G = amx_geo_of(g);
    const size_t per = (size_t)G.lines * (size_t)G.ZP, D = (size_t)G.D, Dv = (size_t)G.Dv;
    switch (op) {
    case NBHD_OP_FORWARD:   /* on row pairs, V^T slices instead of V^T */
        return per * 2 * D + 2 * (size_t)amx_transposed_elems(&G, amx_slice_count(&G, g, 0), G.Dv) + TAIL + 128;
    case NBHD_OP_FORWARD_JVP: return 2 * per * 2 * (D + Dv) + TAIL + 128;
    case NBHD_OP_BACKWARD: {   /* on row pairs, K^T, Q^T, dO^T slices instead of those */
        const int64_t ns = amx_slice_count(&G, g, 0), ns2 = amx_slice_count(&G, g, 1);
        const size_t kt = 2 * (size_t)amx_transposed_elems(&G, ns, G.D);
        const size_t qt = 2 * (size_t)amx_transposed_elems(&G, ns2, G.D), ot = 2 * (size_t)amx_transposed_elems(&G, ns2, G.Dv);
        return per * 2 * (D + Dv) + kt + (size_t)g->group * (per * (2 * (D + Dv) + 8) + qt + ot) + TAIL + 128;
    }
    default: return 0;
    }
}

// ----------------------------------------------------------------------------
// packing (one slab = one batch b and key head hk)

/* rows of line (x, y) (K, tK; Q, dO, V in the backward), in-group tokens [i0, i1) of group gr:
 * Kp[ZP x dim]. Returns 1 when a value is a NaN or an infinity (all exponent bits set): the slab
 * then runs on the reference kernels, as the other fast kernels' (fast.h). */
int amx_pack_rows(uint16_t *Kp, const amx_geo *G, const nbhd_geometry *g, const nbhd_tensor *k,
                  int64_t dim, int64_t b, int64_t hk, int64_t x, int64_t y, int64_t gr, int64_t i0,
                  int64_t i1) {
    const int64_t Lg = nbhd_group_len(&g->axis[2], gr);
    uint16_t *dst = Kp + amx_goff(G, gr) * dim;
    const __m512i ex = _mm512_set1_epi16(0x7f80);
    __mmask32 bad = 0;
    for (int64_t i = i0; i < i1; ++i) {
        const uint16_t *src = amx_token(k, b, x, y, gr + i * G->dil, hk);
        for (int64_t d = 0; d < dim; d += 32) {   /* dim % 32 == 0 */
            const __m512i w = _mm512_loadu_si512((const void *)(src + d));
            _mm512_storeu_si512((void *)(dst + i * dim + d), w);
            bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(w, ex), ex);
        }
    }
    if (i1 == Lg) memset(dst + Lg * dim, 0, sizeof(uint16_t) * (size_t)(amx_gpad(Lg) * dim));
    return bad != 0;
}

/* 1 when a bf16 element of in-group tokens [i0, i1) of group gr, line (x, y), head h of t (dim
 * elements each) is a NaN or an infinity: the tensors packed as columns only (amx_pack_rows) */
int amx_nonfinite(const nbhd_tensor *t, const amx_geo *G, int64_t dim, int64_t b, int64_t h, int64_t x,
                  int64_t y, int64_t gr, int64_t i0, int64_t i1) {
    const __m512i ex = _mm512_set1_epi16(0x7f80);
    const int64_t s5 = t->stride[5];
    __mmask32 bad = 0;
    for (int64_t i = i0; i < i1; ++i) {
        const uint16_t *src = amx_token(t, b, x, y, gr + i * G->dil, h);
        for (int64_t d = 0; d < dim; d += 32) {
            const __mmask32 m = dim - d >= 32 ? ~0u : (1u << (dim - d)) - 1;
            if (s5 == 1) {
                const __m512i w = _mm512_maskz_loadu_epi16(m, src + d);
                bad |= _mm512_mask_cmpeq_epi16_mask(m, _mm512_and_si512(w, ex), ex);
            } else {
                for (int64_t j = d; j < dim && j < d + 32; ++j) bad |= (src[j * s5] & 0x7f80) == 0x7f80;
            }
        }
    }
    return bad != 0;
}

/* the nz rows tok[] (element stride sv; zeros for the others of 16) as columns: dv d's 16 words
 * at dst + d * dstride, through a register transpose */
static void amx_cols16_of(uint16_t *dst, int64_t dstride, const uint16_t *const *tok, int nz, int64_t Dv,
                          int64_t sv) {
    /* 32 dv (16 at the end) at a time as 32-bit dv pairs: one 16 x 16 transpose, then each
     * pair's low and high words are two dv rows */
    for (int64_t d0 = 0; d0 < Dv; d0 += 32) {
        const int np = Dv - d0 >= 32 ? 16 : 8;
        vf r[16];
        for (int l = 0; l < 16; ++l) {
            if (l >= nz) r[l] = vf_zero();
            else if (sv == 1)
                r[l] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(np == 16 ? ~0u : 0xffffu, tok[l] + d0));
            else {
                uint16_t tmp[32] = {0};
                for (int j = 0; j < 2 * np; ++j) tmp[j] = tok[l][(d0 + j) * sv];
                r[l] = _mm512_castsi512_ps(_mm512_loadu_si512((const void *)tmp));
            }
        }
        vf_transpose16(r);
        for (int p = 0; p < np; ++p) {
            const __m512i w = _mm512_castps_si512(r[p]);
            _mm256_storeu_si256((__m256i *)(dst + (d0 + 2 * p) * dstride), _mm512_cvtepi32_epi16(w));
            _mm256_storeu_si256((__m256i *)(dst + (d0 + 2 * p + 1) * dstride),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
        }
    }
}

/* 16 in-group tokens i0.. of group gr of line (x, y) (the first nz of them; zeros for the others)
 * as columns: dv d's 16 words at dst + d * dstride, through a register transpose */
static void amx_cols16(uint16_t *dst, int64_t dstride, const nbhd_geometry *g, const nbhd_tensor *v, int64_t Dv,
                       int64_t b, int64_t hk, int64_t x, int64_t y, int64_t gr, int64_t i0, int nz) {
    const int64_t dil = g->axis[2].dilation;
    const uint16_t *tok[16];
    for (int l = 0; l < nz; ++l) tok[l] = amx_token(v, b, x, y, gr + (i0 + l) * dil, hk);
    amx_cols16_of(dst, dstride, tok, nz, Dv, v->stride[5]);
}

/* the same from nz consecutive packed rows (amx_pack_rows) from `first`: the tokens come from
 * L2, not gathered again from the tensor */
static void amx_cols16_packed(uint16_t *dst, int64_t dstride, const uint16_t *first, int nz, int64_t dim) {
    const uint16_t *tok[16];
    for (int l = 0; l < nz; ++l) tok[l] = first + l * dim;
    amx_cols16_of(dst, dstride, tok, nz, dim, 1);
}

/* columns of line (x, y), in-group tokens [i0, i1) (i0 % 16 == 0) of group gr, 16 tokens at a
 * time (a last partial block writes zeros into the padding; at % 32 == 0: 16 tokens stay in one
 * block); rows: the line's rows already packed ([ZP][Dv], amx_pack_rows) to read instead of v,
 * or NULL */
void amx_pack_cols(uint16_t *Vt, const amx_geo *G, const nbhd_geometry *g, const nbhd_tensor *v,
                   const uint16_t *rows, int64_t Dv, int64_t b, int64_t hk, int64_t x, int64_t y,
                   int64_t gr, int64_t i0, int64_t i1) {
    const int64_t Lg = nbhd_group_len(&g->axis[2], gr), at = amx_goff(G, gr);
    for (int64_t ib = i0; ib < i1; ib += 16) {
        const int nz = (int)(i1 - ib < 16 ? i1 - ib : 16);
        if (rows) amx_cols16_packed(Vt + amx_col(Dv, 0, at + ib), 32, rows + (at + ib) * Dv, nz, Dv);
        else amx_cols16(Vt + amx_col(Dv, 0, at + ib), 32, g, v, Dv, b, hk, x, y, gr, ib, nz);
    }
    if (i1 == Lg && amx_gpad(Lg))   /* the padding: the rest of the group's last block */
        for (int64_t d = 0; d < Dv; ++d)
            memset(Vt + amx_col(Dv, d, at + Lg), 0, sizeof(uint16_t) * (size_t)amx_gpad(Lg));
}

/* slice packing task `it` (of ns x lines) of tensor t, dim columns, head h, into the slices at C
 * (plan as amx_pair_slices fills it: id, then sgr, then sulo, ZP entries each); rows: the same
 * head's rows already packed (amx_pack_rows, [lines][ZP][dim]) to read instead of t, or NULL
 * (the tokens from L2, not again from t: bench/ab_cpu.py A.so B.so 2d56 bf16 bwd) */
void amx_pack_slice(uint16_t *C, const int64_t *plan, const amx_geo *G, const nbhd_geometry *g,
                    const nbhd_tensor *t, const uint16_t *rows, int64_t dim, int64_t b, int64_t h,
                    int64_t it) {
    const int64_t sl = it / G->lines, ln = it % G->lines, x = ln / G->Y, y = ln % G->Y;
    const int64_t gr = plan[G->ZP + sl], lo = plan[2 * G->ZP + sl], Lg = nbhd_group_len(&g->axis[2], gr);
    const int nz = (int)(Lg - lo < 16 ? Lg - lo : 16);
    uint16_t *dst = C + amx_slice_at(G, sl, x, y, dim);
    if (rows) amx_cols16_packed(dst + (y & 1) * 16, 32, rows + (ln * G->ZP + amx_goff(G, gr) + lo) * dim, nz, dim);
    else amx_cols16(dst + (y & 1) * 16, 32, g, t, dim, b, h, x, y, gr, lo, nz);
    if (y == G->Y - 1 && !(y & 1))
        for (int64_t d = 0; d < dim; ++d) memset(dst + d * 32 + 16, 0, 32);
}

// ----------------------------------------------------------------------------
// the 16 lanes of a work item

/* dst[p][l] = (t[l][2p], t[l][2p+1]) for the live lanes' tokens (others 0): 16 tokens x
 * 16 d-pairs per 32 d, a 16 x 16 transpose of 32-bit words */
void amx_pack_qt(uint16_t *dst, const nbhd_tensor *t, int64_t D, int64_t b, int64_t x, const amx_lanes *L,
                 int64_t h) {
    const uint16_t *tok[16];
    for (int l = 0; l < 16; ++l) tok[l] = L->live >> l & 1 ? amx_token(t, b, x, L->y[l], L->z[l], h) : NULL;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        vf r[16];
        for (int l = 0; l < 16; ++l)
            r[l] = tok[l] ? _mm512_castsi512_ps(_mm512_loadu_si512((const void *)(tok[l] + d0))) : vf_zero();
        vf_transpose16(r);
        for (int p = 0; p < 16; ++p) vf_store((float *)dst + (d0 / 2 + p) * 16, r[p]);
    }
}

/* t[b, x, y_l, z_l, h, :] = bf16(A[:][l]) for the live lanes, A = [Dv][16] (Dv % 16 == 0): per
 * 32 dv, bf16 pairs of neighbouring dv, then one 16 x 16 transpose of 32-bit words (row l: the
 * 32 dv of lane l) */
void amx_store_lanes(const nbhd_tensor *t, const float *A, int64_t Dv, int64_t b, int64_t x,
                     const amx_lanes *L, int64_t h, int stream) {
    uint16_t *row[16];
    for (int l = 0; l < 16; ++l)
        row[l] = L->live >> l & 1 ? (uint16_t *)amx_token(t, b, x, L->y[l], L->z[l], h) : NULL;
    const int64_t st = t->stride[5];
    for (int64_t d0 = 0; d0 < Dv; d0 += 32) {
        const int np = Dv - d0 >= 32 ? 16 : 8;   /* dv pairs */
        vf r[16];
        for (int p = 0; p < 16; ++p)
            r[p] = p < np ? _mm512_castsi512_ps(amx_pair_bf16(vf_load(A + (d0 + 2 * p) * 16),
                                                              vf_load(A + (d0 + 2 * p + 1) * 16)))
                          : vf_zero();
        vf_transpose16(r);
        for (int l = 0; l < 16; ++l) {
            if (!row[l]) continue;
            const __m512i w = _mm512_castps_si512(r[l]);
            if (st == 1 && stream && np == 16 && ((uintptr_t)(row[l] + d0) & 63) == 0)
                _mm512_stream_si512((void *)(row[l] + d0), w);
            else if (st == 1) _mm512_mask_storeu_epi16(row[l] + d0, np == 16 ? 0xffffffffu : 0xffffu, w);
            else {
                uint16_t tmp[32];
                _mm512_storeu_si512((void *)tmp, w);
                for (int j = 0; j < 2 * np; ++j) row[l][(d0 + j) * st] = tmp[j];
            }
        }
    }
}

#endif
