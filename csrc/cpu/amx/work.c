/*
 * work.c — the AMX kernels' work items: blocks of queries (or keys), their lanes' windows, the key
 * rows they visit cut into units; the rows per item (ny), the row pairs of small Z unions, the
 * pieces the packing runs in, and what a driver keeps for its call (amx_call).
 */
#include "amx_internal.h"

#ifdef NBHD_CPU_AMX_BUILD

/* in-group windows [st, en) of the n in-group indices i0.. of group gr (forward windows, or the
 * inverse windows when inverse); empty past the group's end */
static void amx_spans(const nbhd_axis *a, int64_t gr, int64_t i0, int n, int inverse, int64_t *st, int64_t *en) {
    const int64_t Lg = nbhd_group_len(a, gr);
    for (int j = 0; j < n; ++j) {
        st[j] = en[j] = 0;
        if (i0 + j >= Lg) continue;
        if (inverse) {
            int64_t first, count;
            nbhd_inverse_window(a, gr + (i0 + j) * a->dilation, &first, &count);
            st[j] = (first - gr) / a->dilation;
            en[j] = st[j] + count;
        } else {
            nbhd_window_in_group(a, i0 + j, Lg, &st[j], &en[j]);
        }
    }
}

/* Windows start and end monotonically along an axis and neighbouring windows touch (stride <=
 * kernel; causal ends at i + 1), so the unions are contiguous. */
static void amx_lanes_of(const nbhd_geometry *g, const amx_block *B, int inverse, amx_lanes *L) {
    const nbhd_axis *ay = &g->axis[1], *az = &g->axis[2];
    const int ny = B->ny, nz = 16 / ny;
    int64_t yst[16], yen[16], zst[16], zen[16];
    amx_spans(ay, B->gy, B->iy0, ny, inverse, yst, yen);
    amx_spans(az, B->gz, B->iz0, nz, inverse, zst, zen);
    const int64_t Lgz = nbhd_group_len(az, B->gz);
    int64_t ylo = INT64_MAX, yhi = 0;
    L->live = 0;
    L->ulo = INT64_MAX; L->uhi = 0;
    for (int l = 0; l < 16; ++l) {
        const int r = l / nz, j = l % nz;
        const int on = zen[j] > zst[j] && yen[r] > yst[r];
        L->ylo[l] = (int32_t)yst[r]; L->yhi[l] = (int32_t)yen[r];
        L->zlo[l] = on ? (int32_t)zst[j] : 0; L->zhi[l] = on ? (int32_t)zen[j] : 0;
        L->y[l] = B->gy + (B->iy0 + r) * ay->dilation;
        L->z[l] = B->gz + (B->iz0 + j) * az->dilation;
        if (B->iz0 + j < Lgz) L->live |= 1u << l;
        if (on) {
            if (zst[j] < L->ulo) L->ulo = zst[j];
            if (zen[j] > L->uhi) L->uhi = zen[j];
            if (yst[r] < ylo) ylo = yst[r];
            if (yen[r] > yhi) yhi = yen[r];
        }
    }
    if (L->ulo == INT64_MAX) { L->ulo = L->uhi = 0; ylo = yhi = 0; }
    L->iyu = ylo;
    L->cy = yhi - ylo;
    L->fy = B->gy + ylo * ay->dilation;
}

static amx_rows amx_rows_of(const amx_geo *G, const nbhd_geometry *g, int64_t x, int64_t gz, const amx_lanes *L,
                            int inverse) {
    amx_rows R;
    R.nvalid = L->uhi - L->ulo;
    R.zb = amx_goff(G, gz) + L->ulo;
    R.delta = R.zb % 32;
    R.nslots = (R.delta + R.nvalid + 31) / 32 * 32;
    if (inverse) nbhd_inverse_window(&g->axis[0], x, &R.fx, &R.cx);
    else nbhd_window(&g->axis[0], x, &R.fx, &R.cx);
    R.fy = L->fy; R.cy = L->cy; R.iyu = L->iyu;
    R.dx = g->axis[0].dilation; R.dy = g->axis[1].dilation;
    R.rows = R.cx * R.cy;
    R.ylo = _mm512_loadu_si512(L->ylo);
    R.yhi = _mm512_loadu_si512(L->yhi);
    return R;
}

/* row pairs (amx_pair_slices): rows of 16 slots from the union's start, whole pairs of lines
 * (2i, 2i + 1) per X row (a line added at either end is outside every lane's window) */
static void amx_rows_pairs(amx_rows *R) {
    R->delta = 0;
    R->nslots = 16;
    R->cy += R->fy & 1;
    R->iyu -= R->fy & 1;
    R->fy -= R->fy & 1;
    R->cy += R->cy & 1;
    R->rows = R->cx * R->cy;
}

/* An item's lanes (block B at x; forward windows, or inverse ones when inverse) and the key rows
 * they visit, on row pairs when slice_of (the slice of each packed union start) is given: returns
 * the item's slice there, -1 off row pairs */
int amx_item_rows(const amx_geo *G, const nbhd_geometry *g, int64_t x, const amx_block *B, int inverse,
                  const int32_t *slice_of, amx_lanes *L, amx_rows *R) {
    amx_lanes_of(g, B, inverse, L);
    *R = amx_rows_of(G, g, x, B->gz, L, inverse);
    const int slice = slice_of ? slice_of[R->zb] : -1;
    if (slice_of) amx_rows_pairs(R);
    return slice;
}

int amx_unit(const amx_rows *R, int64_t Y, int64_t g0, amx_seg *seg) {
    int nseg = 0;
    const int64_t n = R->nslots;
    for (int64_t rr = g0 / n; rr < R->rows && rr * n < g0 + USLOTS; ++rr) {
        const int64_t s0 = (g0 > rr * n ? g0 : rr * n) - rr * n;
        const int64_t s1 = (g0 + USLOTS < (rr + 1) * n ? g0 + USLOTS : (rr + 1) * n) - rr * n;
        const int64_t r = rr % R->cy, line = (R->fx + (rr / R->cy) * R->dx) * Y + R->fy + r * R->dy;
        seg[nseg++] = (amx_seg){line, s0, s1, rr * n + s0 - g0, amx_in(R->ylo, R->yhi, R->iyu + r)};
    }
    return nseg;
}

// ----------------------------------------------------------------------------
// the drivers' common parts

/* rows of the Y block at an in-group row with `left` rows left in its group, when blocks take up
 * to ny rows: the largest power of two <= ny that fits */
static int amx_block_rows(int ny, int64_t left) {
    while (ny > left) ny /= 2;
    return ny;
}

/* Y rows per item (1, 2, 4, 8 or 16; 16 / that many Z positions): the one whose items cost the
 * least, counting per key row one for each 16 computed slots (S^T tiles, softmax) and one for each
 * 32-key tile of its frame (PV), times the rows (X kernel x Y union), plus AMX_ITEM_COST per item
 * (Q^T packing, output transposes). The unions are exact (borders, stride, causal, dilation
 * groups), and the cost is a sum over Y blocks of (Y union x a Z term), so one pass per axis
 * gives it.
 * 2-D window 7: 2 rows (one 16-slot tile per key row instead of 32 slots); window 13: 4 rows;
 * windows of ~32 and more along Z, and rank 1: 1 row. */
#define AMX_ITEM_COST 4
int amx_choose_ny(const amx_geo *G, const nbhd_geometry *g) {
    const nbhd_axis *ax = &g->axis[0], *ay = &g->axis[1], *az = &g->axis[2];
    int64_t zcost[5] = {0}, zitems[5] = {0};   /* [log2 rows]: Z chunks of 16 / rows positions */
    for (int k = 0; k < 5; ++k)
        for (int64_t gz = 0; gz < az->dilation; ++gz) {
            const int64_t Lg = nbhd_group_len(az, gz);
            for (int64_t i0 = 0; i0 < Lg; i0 += 16 >> k) {
                int64_t st, en, st2, en2;
                nbhd_window_in_group(az, i0, Lg, &st, &en);
                nbhd_window_in_group(az, (i0 + (16 >> k) < Lg ? i0 + (16 >> k) : Lg) - 1, Lg, &st2, &en2);
                const int64_t u = en2 - st, delta = (amx_goff(G, gz) + st) % 32;
                zcost[k] += (u + 15) / 16 + (delta + u + 31) / 32;
                zitems[k] += 1;
            }
        }
    int best = 1;
    int64_t best_cost = INT64_MAX;
    for (int ny = 1; ny <= 16; ny *= 2) {
        int64_t cost = 0;
        for (int64_t gy = 0; gy < ay->dilation; ++gy) {
            const int64_t Lg = nbhd_group_len(ay, gy);
            for (int64_t iy = 0, n; iy < Lg; iy += n) {
                n = amx_block_rows(ny, Lg - iy);
                const int k = __builtin_ctz((unsigned)n);
                int64_t st, en, st2, en2;
                nbhd_window_in_group(ay, iy, Lg, &st, &en);
                nbhd_window_in_group(ay, iy + n - 1, Lg, &st2, &en2);
                cost += ax->kernel * (en2 - st) * zcost[k] + AMX_ITEM_COST * zitems[k];
            }
        }
        if (cost < best_cost) { best = ny; best_cost = cost; }
    }
    return best;
}

/* The forward on row pairs (amx_values): when the Y dilation is 1 and the Z union of every item
 * (at the ny of amx_choose_ny) holds at most 16 keys, each item's rows take 16 slots from the
 * union's start, and V^T is packed once per distinct union start (a slice: 16 in-group tokens
 * from it, zeros past the group). Returns the number of slices (id[p]: the slice of packed start
 * p, ZP entries; sgr, sulo: each slice's group and in-group start, ZP entries each), or -1 (also
 * when the slices hold more than 2 ZP tokens: 2-D 128^2 window 13, 32 slices of 16 per 256, is
 * slower on pairs; bench/ab_cpu.py A.so B.so 2d128 bf16). */
int64_t amx_pair_slices(const amx_geo *G, const nbhd_geometry *g, int inverse, int32_t *id, int64_t *sgr,
                        int64_t *sulo) {
    const nbhd_axis *ay = &g->axis[1], *az = &g->axis[2];
    if (ay->dilation != 1 || az->kernel > 16) return -1;   /* a Z union holds a whole window */
    const int ny = amx_choose_ny(G, g);
    unsigned rows = 0;   /* the block heights that occur */
    for (int64_t iy = 0, n; iy < ay->extent; iy += n) {
        n = amx_block_rows(ny, ay->extent - iy);
        rows |= 1u << n;
    }
    for (int64_t p = 0; p < G->ZP; ++p) id[p] = -1;
    int64_t ns = 0;
    for (int n = 1; n <= 16; n *= 2) {
        if (!(rows >> n & 1)) continue;
        for (int64_t gz = 0; gz < az->dilation; ++gz) {
            const int64_t Lg = nbhd_group_len(az, gz);
            for (int64_t iz = 0; iz < Lg; iz += 16 / n) {
                int64_t st[16], en[16], lo = INT64_MAX, hi = 0;
                amx_spans(az, gz, iz, 16 / n, inverse, st, en);
                for (int j = 0; j < 16 / n; ++j)
                    if (en[j] > st[j]) { lo = st[j] < lo ? st[j] : lo; hi = en[j] > hi ? en[j] : hi; }
                if (hi - lo > 16) return -1;
                const int64_t p = amx_goff(G, gz) + lo;
                if (id[p] < 0) { id[p] = (int32_t)ns; sgr[ns] = gz; sulo[ns++] = lo; }
            }
        }
    }
    return ns * 16 <= 2 * G->ZP ? ns : -1;   /* packing more than twice V^T's tokens costs more than it saves */
}

/* Packing runs in pieces of PIECE in-group tokens of one line (so that a 1-D problem, one line,
 * still packs on every thread); the piece holding a group's end zeroes its margin. */
#define PIECE 256

int amx_work_init(amx_work *W, const nbhd_geometry *g, int ny) {
    const nbhd_axis *ay = &g->axis[1], *az = &g->axis[2];
    W->blk = NULL;
    W->piece = NULL;
    for (int fill = 0; fill < 2; ++fill) {   /* count, then fill */
        int64_t nb = 0, np = 0;
        for (int64_t gy = 0; gy < ay->dilation; ++gy) {
            const int64_t Lgy = nbhd_group_len(ay, gy);
            for (int64_t iy = 0, n; iy < Lgy; iy += n) {
                n = amx_block_rows(ny, Lgy - iy);
                for (int64_t gz = 0; gz < az->dilation; ++gz)
                    for (int64_t iz = 0; iz < nbhd_group_len(az, gz); iz += 16 / n, ++nb)
                        if (fill) W->blk[nb] = (amx_block){gy, iy, gz, iz, (int)n};
            }
        }
        for (int64_t gz = 0; gz < az->dilation; ++gz)
            for (int64_t i0 = 0; i0 < nbhd_group_len(az, gz); i0 += PIECE, ++np)
                if (fill) { W->piece[2 * np] = gz; W->piece[2 * np + 1] = i0; }
        W->nblocks = nb;
        W->npieces = np;
        if (!fill) {
            W->blk = (amx_block *)malloc(sizeof(amx_block) * (size_t)nb + sizeof(int64_t) * 2 * (size_t)np);
            if (!W->blk) return 0;
            W->piece = (int64_t *)(W->blk + nb);
        }
    }
    return 1;
}

/* packing task `it` of a slab: line ln, group gr, in-group tokens [i0, i1) */
void amx_piece(const amx_work *W, const nbhd_geometry *g, int64_t it, int64_t *ln, int64_t *gr,
               int64_t *i0, int64_t *i1) {
    const int64_t p = it % W->npieces, Lg = nbhd_group_len(&g->axis[2], W->piece[2 * p]);
    *ln = it / W->npieces;
    *gr = W->piece[2 * p];
    *i0 = W->piece[2 * p + 1];
    *i1 = *i0 + PIECE < Lg ? *i0 + PIECE : Lg;
}

// ----------------------------------------------------------------------------
// a call's work, and the slabs left to the reference kernels

/* c's work items and its slab flags (none set); plan is c's (freed with it, also on failure) */
nbhd_status amx_call_begin(amx_call *c, const amx_geo *G, const nbhd_geometry *g, int64_t *plan) {
    c->plan = plan;
    c->to_ref = NULL;
    if (!amx_work_init(&c->W, g, amx_choose_ny(G, g))) {
        free(plan);
        return nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory");
    }
    c->to_ref = (unsigned char *)calloc((size_t)(g->batch * g->kv_heads), 1);
    if (!c->to_ref) {
        free(c->W.blk);
        free(plan);
        return nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory");
    }
    return NBHD_OK;
}

/* After the kernels (failed: a thread had no scratch): frees c, then runs each flagged slab on the
 * reference kernels of the call's op, the one of fwd, jvp and bwd given */
nbhd_status amx_call_end(amx_call *c, const nbhd_geometry *g, const nbhd_exec *e, int failed,
                         const nbhd_forward_args *fwd, const nbhd_forward_jvp_args *jvp,
                         const nbhd_backward_args *bwd) {
    const int64_t Hk = g->kv_heads;
    free(c->W.blk);
    free(c->plan);
    nbhd_status st = failed ? nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory for per-thread scratch") : NBHD_OK;
    for (int64_t slab = 0; st == NBHD_OK && slab < g->batch * Hk; ++slab)
        if (c->to_ref[slab])
            st = bwd ? nbhd_cpu_fast_slab_backward(g, bwd, e, slab / Hk, slab % Hk, 1)
                 : jvp ? nbhd_cpu_fast_slab_forward_jvp(g, jvp, e, slab / Hk, slab % Hk, 1)
                       : nbhd_cpu_fast_slab_forward(g, fwd, e, slab / Hk, slab % Hk, 1);
    free(c->to_ref);
    return st;
}

#endif
