/*
 * geometry.h — the fast CPU kernels' view of a problem (docs/design.md §5.2): sizes, the Z
 * position of every (dilation group, in-group index), the 16-query chunks along Z and the runs
 * of them a work item owns, the Y blocks, each chunk's lane ranges (zdesc) and a query work
 * item's lines and windows (qitem). Included once per ISA by generic.c, avx2.c and avx512.c,
 * which define FAST(name) to add their suffix.
 *
 * Dimension letters: B batch, X Y Z spatial axes (fast.c rotates the real axes to the end, so
 * Z is the last), H query heads, Hk key/value heads, D, Dv head dims, S extra keys.
 */
#include <stdlib.h>

#include "convert.h"
#include "fast.h"
#include "internal.h"
#include "tables.h"
#ifdef _OPENMP
#include <omp.h>
#endif

enum {
    SMAX = 512,    /* slot vectors per processed unit (32 KiB of scores) */
    PAD = 16,      /* zero floats after each dilation group of a packed row */
    MAXLINES = 4,  /* query lines a work item shares each key load among */
};
static const double LOG2E = 1.4426950408889634, LN2 = 0.6931471805599453;

// ----------------------------------------------------------------------------
// scalar helpers

static inline float FAST(ld)(const void *base, int64_t idx, nbhd_dtype t) {
    switch (t) {
    case NBHD_F32: return ((const float *)base)[idx];
    case NBHD_F16: return nbhd_f16_to_f32(((const uint16_t *)base)[idx]);
    case NBHD_BF16: return nbhd_bf16_to_f32(((const uint16_t *)base)[idx]);
    default: return (float)((const double *)base)[idx];
    }
}

static inline void FAST(st)(void *base, int64_t idx, nbhd_dtype t, float x) {
    switch (t) {
    case NBHD_F32: ((float *)base)[idx] = x; break;
    case NBHD_F16: ((uint16_t *)base)[idx] = nbhd_f32_to_f16(x); break;
    case NBHD_BF16: ((uint16_t *)base)[idx] = nbhd_f32_to_bf16(x); break;
    default: ((double *)base)[idx] = x; break;
    }
}

static inline int64_t FAST(off)(const nbhd_tensor *t, int64_t b, int64_t x, int64_t y,
                                int64_t z, int64_t h) {
    return b * t->stride[0] + x * t->stride[1] + y * t->stride[2] + z * t->stride[3] +
           h * t->stride[4];
}

static inline int64_t FAST(min)(int64_t a, int64_t b) { return a < b ? a : b; }

// ----------------------------------------------------------------------------
// per-call geometry

/* Sizes, packed strides, the Z position of every (group, index), chunks. */
typedef struct {
    int64_t B, X, Y, Z, H, Hk, G, D, Dv, S;   /* G: query heads per key head; S: extra keys */
    int64_t ZP, SP;                           /* packed row lengths: Z + PAD * dil; S */
    int64_t dil;                              /* dilation on Z */
    int64_t *goff, *glen;                     /* [dil] first packed position, length of each group */
    int64_t nchunks;                          /* chunks of 16 in-group queries per (x, y) line */
    int64_t *chunk_g, *chunk_i0;              /* [nchunks] */
    int64_t *chunk_first;                     /* [dil] the first chunk of each group */
    int64_t nruns, *run_c0, *run_len;         /* work items' runs of chunks (FAST(geo_runs)) */
    int64_t *chunk_run;                       /* [nchunks] the run holding each chunk */
} FAST(geo);

static void FAST(geo_sizes)(FAST(geo) *G, const nbhd_geometry *g) {
    G->B = g->batch; G->X = g->axis[0].extent; G->Y = g->axis[1].extent; G->Z = g->axis[2].extent;
    G->H = g->heads; G->Hk = g->kv_heads; G->G = g->group; G->D = g->head_dim;
    G->Dv = g->head_dim_v; G->S = g->extra_kv;
    G->dil = g->axis[2].dilation;
    G->ZP = G->Z + PAD * G->dil; G->SP = G->S;
}

/* 0 when out of memory (nothing to free then) */
static int FAST(geo_init)(FAST(geo) *G, const nbhd_geometry *g) {
    FAST(geo_sizes)(G, g);
    G->goff = (int64_t *)malloc(sizeof(int64_t) * 3 * (size_t)G->dil);
    if (!G->goff) return 0;
    G->glen = G->goff + G->dil;
    G->chunk_first = G->glen + G->dil;
    G->nchunks = 0;
    for (int64_t gr = 0, at = 0; gr < G->dil; ++gr) {
        const int64_t Lg = nbhd_group_len(&g->axis[2], gr);
        G->goff[gr] = at;
        G->glen[gr] = Lg;
        G->chunk_first[gr] = G->nchunks;
        at += Lg + PAD;
        G->nchunks += (Lg + 15) / 16;
    }
    G->chunk_g = (int64_t *)malloc(sizeof(int64_t) * 5 * (size_t)G->nchunks);
    if (!G->chunk_g) { free(G->goff); return 0; }
    G->chunk_i0 = G->chunk_g + G->nchunks;
    G->run_c0 = G->chunk_i0 + G->nchunks;
    G->run_len = G->run_c0 + G->nchunks;
    G->chunk_run = G->run_len + G->nchunks;
    G->nruns = 0;
    int64_t c = 0;
    for (int64_t gr = 0; gr < G->dil; ++gr)
        for (int64_t i0 = 0; i0 < G->glen[gr]; i0 += 16) {
            G->chunk_g[c] = gr;
            G->chunk_i0[c++] = i0;
        }
    return 1;
}

static void FAST(geo_free)(FAST(geo) *G) {
    free(G->goff);
    free(G->chunk_g);
}

/* live lanes of the chunk at in-group index i0 of a group of length Lg */
static inline int FAST(chunk_lanes)(int64_t Lg, int64_t i0) { return (int)FAST(min)(Lg - i0, 16); }

// ----------------------------------------------------------------------------
// lane ranges along Z

/* Lane ranges along Z of one chunk: lane l covers in-group positions [lo_l, hi_l).
 *   shift (bcast = 0): slot c of lane l is position base + c + l. Unmasked when every lane's
 *     range is [base + l, base + l + n); masked otherwise, and then lo[l], hi[l] hold
 *     lo_l - l, hi_l - l, so the per-lane test of slot c is lo[l] <= base + c < hi[l].
 *     base >= -15 and base + n + 14 <= group length + 14: within the packed margins.
 *   union (bcast = 1): slot c is position base + c for every lane, masked by lo[l], hi[l].
 * The mode with fewer slots wins. */
typedef struct {
    int32_t lo[NBHD_LANES], hi[NBHD_LANES];
    int64_t base, n;
    int bcast, masked;
} FAST(zdesc);

static void FAST(zdesc_finish)(FAST(zdesc) *zd, int nl) {
    int shift = 1;
    int64_t ulo = -1, uhi = -1, slo = 0, shi = 0;
    int any = 0;
    for (int l = 0; l < nl; ++l) {
        if (zd->lo[l] != zd->lo[0] + l || zd->hi[l] - zd->lo[l] != zd->hi[0] - zd->lo[0]) shift = 0;
        if (zd->hi[l] > zd->lo[l]) {
            if (ulo < 0 || zd->lo[l] < ulo) ulo = zd->lo[l];
            if (zd->hi[l] > uhi) uhi = zd->hi[l];
            if (!any || zd->lo[l] - l < slo) slo = zd->lo[l] - l;
            if (!any || zd->hi[l] - l > shi) shi = zd->hi[l] - l;
            any = 1;
        }
    }
    for (int l = nl; l < NBHD_LANES; ++l) zd->lo[l] = zd->hi[l] = 0;
    if (shift && zd->hi[0] > zd->lo[0]) {
        zd->base = zd->lo[0]; zd->n = zd->hi[0] - zd->lo[0]; zd->bcast = 0; zd->masked = 0;
    } else if (any && shi - slo <= uhi - ulo) {
        for (int l = 0; l < nl; ++l) { zd->lo[l] -= l; zd->hi[l] -= l; }
        zd->base = slo; zd->n = shi - slo; zd->bcast = 0; zd->masked = 1;
    } else {
        zd->base = ulo < 0 ? 0 : ulo; zd->n = ulo < 0 ? 0 : uhi - ulo; zd->bcast = 1; zd->masked = 1;
    }
}

/* Windows of the in-group queries i0..i0+nl-1 of a group of length Lg along Z. */
static void FAST(zdesc_window)(FAST(zdesc) *zd, const nbhd_axis *az, int64_t i0, int nl, int64_t Lg) {
    for (int l = 0; l < nl; ++l) {
        int64_t st, en;
        nbhd_window_in_group(az, i0 + l, Lg, &st, &en);
        zd->lo[l] = (int32_t)st; zd->hi[l] = (int32_t)en;
    }
    FAST(zdesc_finish)(zd, nl);
}

/* Inverse windows (queries that see each key) of in-group keys j0..j0+nl-1 of group gr. */
static void FAST(zdesc_inverse)(FAST(zdesc) *zd, const nbhd_axis *az, int64_t gr, int64_t j0, int nl) {
    for (int l = 0; l < nl; ++l) {
        int64_t first, count;
        nbhd_inverse_window(az, gr + (j0 + l) * az->dilation, &first, &count);
        zd->lo[l] = (int32_t)((first - gr) / az->dilation);
        zd->hi[l] = zd->lo[l] + (int32_t)count;
    }
    FAST(zdesc_finish)(zd, nl);
}

/* Groups the chunks into the runs work items own: up to `zlines` consecutive chunks of one
 * dilation group whose windows are pure shifts 16 slots apart (interior chunks of a window of
 * at least 16), so that one shifted load of a key row feeds one FMA per chunk where their
 * windows overlap; any other chunk is a run of its own. zlines = 1: every chunk alone. A run
 * never crosses an in-group index that is a multiple of tz (tz > 0: where tiles meet, slab.h).
 * Runs change which loads are shared, never a query's arithmetic. */
static void FAST(geo_runs)(FAST(geo) *G, const nbhd_geometry *g, int zlines, int64_t tz) {
    FAST(zdesc) prev = {0};   /* read only once `open` (set after the first chunk) */
    int open = 0;   /* whether the last run may take the next chunk */
    G->nruns = 0;
    for (int64_t ch = 0; ch < G->nchunks; ++ch) {
        const int64_t gr = G->chunk_g[ch], i0 = G->chunk_i0[ch], Lg = G->glen[gr];
        FAST(zdesc) zd;
        FAST(zdesc_window)(&zd, &g->axis[2], i0, FAST(chunk_lanes)(Lg, i0), Lg);
        const int pure = !zd.masked && !zd.bcast && zd.n >= 16 && zd.n <= SMAX;
        const int64_t last = G->nruns - 1;
        const int cut = tz > 0 && i0 % tz == 0;
        if (open && pure && !cut && G->run_len[last] < zlines && G->chunk_g[ch - 1] == gr && zd.n == prev.n &&
            zd.base == prev.base + 16) {
            ++G->run_len[last];
        } else {
            G->run_c0[G->nruns] = ch;
            G->run_len[G->nruns++] = 1;
            open = pure && zlines > 1;
        }
        G->chunk_run[ch] = G->nruns - 1;
        prev = zd;
    }
}

// ----------------------------------------------------------------------------
// query lines per work item

/* Whether NR lines' full-width blocks stay in registers: always with 32 vf (AVX-512); with
 * fewer (AVX2's 16 ymm are 8 vf, portable 4) only one line's, so several lines take narrower
 * blocks there. */
NBHD_ALWAYS_INLINE int FAST(lines_fit_regs)(int nr) { return NBHD_VREGS >= 32 || nr == 1; }

/* Z-line runs pay only where the 4-line x 6-slot score block stays in registers: with fewer
 * (AVX2, portable) the spills cost more than the shared loads save, so each chunk runs alone
 * there (bench/ab_cpu.py A.so B.so 1d fp32 fwd on an AVX2 machine). */
NBHD_ALWAYS_INLINE int FAST(zlines_pay)(void) { return FAST(lines_fit_regs)(MAXLINES); }

/* Rank 1 (Y extent 1 after fast.c's rotation): a work item's lines are chunks along Z. */
static inline int FAST(zline_mode)(const nbhd_geometry *g) { return g->axis[1].extent == 1; }

/* Query lines per work item where exec names none: the ISA's NBHD_QUERY_LINES (simd.h) on Y;
 * Z-line mode (rank 1) keeps MAXLINES (2 lines there are no faster on AVX2: bench/ab_cpu.py ... 1d).
 * tiles.c lists this configuration first. */
static inline int FAST(default_lines)(int zline) { return zline ? MAXLINES : NBHD_QUERY_LINES; }

static int FAST(nbhd_cpu_fast_default_lines)(int rank) { return FAST(default_lines)(rank == 1); }

/* Query lines per work item: exec.q_tile on Y, or on Z / 16 in Z-line mode (kernel axes: fast.c
 * rotates the tiles), else the default; 0 when exec asks for a patch this kernel does not run
 * (tiles.c lists the ones it does: q 16 on Z, `lines` on Y, 1 on X, or 16 * lines on Z in
 * rank 1; key tile 16 on Z, 1 elsewhere). */
static int FAST(tile_lines)(const nbhd_exec *e, const nbhd_geometry *g, int max_lines) {
    const int32_t *q = e->q_tile, *kv = e->kv_tile;
    if (q[0] > 1 || (kv[2] && kv[2] != 16) || kv[0] > 1 || kv[1] > 1) return 0;
    if (FAST(zline_mode)(g)) {
        if (q[1] > 1 || (q[2] && (q[2] % 16 || q[2] / 16 > max_lines))) return 0;
        return q[2] ? q[2] / 16 : FAST(default_lines)(1);
    }
    if ((q[2] && q[2] != 16) || q[1] > max_lines) return 0;
    return q[1] > 0 ? q[1] : FAST(default_lines)(0);
}

// ----------------------------------------------------------------------------
// blocks of lines along Y, and the query work items

/* The lines a work item owns: up to `lines` consecutive in-group rows along Y. */
typedef struct {
    int64_t n, *g, *i0;   /* [n] Y dilation group and first in-group index of each block */
    int64_t *gfirst;      /* [dilation] the first block of each group */
} FAST(yblocks);

static int FAST(yblocks_init)(FAST(yblocks) *yb, const nbhd_axis *ay, int lines) {
    yb->n = 0;
    for (int64_t gr = 0; gr < ay->dilation; ++gr) yb->n += (nbhd_group_len(ay, gr) + lines - 1) / lines;
    yb->g = (int64_t *)malloc(sizeof(int64_t) * (2 * (size_t)yb->n + (size_t)ay->dilation));
    if (!yb->g) return 0;
    yb->i0 = yb->g + yb->n;
    yb->gfirst = yb->i0 + yb->n;
    int64_t at = 0;
    for (int64_t gr = 0; gr < ay->dilation; ++gr) {
        yb->gfirst[gr] = at;
        for (int64_t i0 = 0; i0 < nbhd_group_len(ay, gr); i0 += lines) { yb->g[at] = gr; yb->i0[at++] = i0; }
    }
    return 1;
}

/* The work of one tile (slab.h): query lines at x = x0 + i * xstep (i < nx), the Y blocks
 * [yb0, yb0 + nyb), the runs [run0, run0 + nruns) of the chunks [ch0, ch0 + nch) */
typedef struct {
    int64_t x0, xstep, nx, yb0, nyb, run0, nruns, ch0, nch;
} FAST(work);

/* A query work item w of a slab (heads innermost, then runs of Z chunks, Y blocks, X;
 * neighbouring items share token rows): head h0 + w % nqh and up to MAXLINES lines r of 16 lanes
 * along Z (zl[r], nl[r] of them live), either
 *   Y lines (zlines = 0): one chunk (window descriptor zd) on up to `lines` rows y_r along Y
 *     whose windows [fy_r, fy_r + cy_r) make union rows u in [0, U) (line r sees [ua[r], ub[r])), or
 *   Z lines (zlines = 1): a run of chunks (FAST(geo_runs)) on one row; line r's slots are the
 *     key positions zoff[r] + [0, zd.n) of line 0's window (zd: line 0's descriptor),
 * and the X window [fx, fx + cx). gr, i0: line 0's dilation group and first in-group index. */
typedef struct {
    int64_t h, x, gr, i0, U, fx, cx;
    int nly, zlines;
    int nl[MAXLINES];
    int64_t zl[MAXLINES][NBHD_LANES], zoff[MAXLINES];
    int64_t ys[MAXLINES], fy[MAXLINES], cy[MAXLINES], ua[MAXLINES], ub[MAXLINES];
    FAST(zdesc) zd;
} FAST(qitem);

/* the Z side of item it: run `run` of chunks, line r's lanes and offset from line 0 */
static void FAST(qitem_z)(FAST(qitem) *it, const nbhd_geometry *g, const FAST(geo) *G, int64_t run) {
    const int64_t ch0 = G->run_c0[run], nz = G->run_len[run];
    it->gr = G->chunk_g[ch0];
    it->i0 = G->chunk_i0[ch0];
    const int64_t Lg = G->glen[it->gr];
    it->zlines = nz > 1;
    for (int64_t r = 0; r < nz; ++r) {
        const int64_t i0 = G->chunk_i0[ch0 + r];
        it->nl[r] = FAST(chunk_lanes)(Lg, i0);
        for (int l = 0; l < it->nl[r]; ++l) it->zl[r][l] = it->gr + (i0 + l) * G->dil;
        it->zoff[r] = i0 - it->i0;
    }
    it->nly = (int)nz;
    FAST(zdesc_window)(&it->zd, &g->axis[2], it->i0, it->nl[0], Lg);
}

/* item w of work wk (heads innermost, then runs, Y blocks, X) */
static void FAST(qitem_of)(FAST(qitem) *it, const nbhd_geometry *g, const FAST(geo) *G, const FAST(yblocks) *YB,
                           const FAST(work) *wk, int lines, int64_t w, int64_t nqh, int64_t h0) {
    const int64_t run = wk->run0 + (w / nqh) % wk->nruns, yb = wk->yb0 + (w / (nqh * wk->nruns)) % wk->nyb;
    it->h = h0 + w % nqh;
    it->x = wk->x0 + (w / (nqh * wk->nruns * wk->nyb)) * wk->xstep;
    FAST(qitem_z)(it, g, G, run);
    const int64_t dy = g->axis[1].dilation, gy = YB->g[yb], Lgy = nbhd_group_len(&g->axis[1], gy);
    if (!it->zlines) it->nly = (int)FAST(min)(Lgy - YB->i0[yb], lines);
    for (int r = 0; r < it->nly; ++r) {
        const int ry = it->zlines ? 0 : r;
        it->ys[r] = gy + (YB->i0[yb] + ry) * dy;
        nbhd_window(&g->axis[1], it->ys[r], &it->fy[r], &it->cy[r]);
        it->ua[r] = (it->fy[r] - it->fy[0]) / dy;
        it->ub[r] = it->ua[r] + it->cy[r];
        if (!it->zlines && r > 0) {   /* Y lines share line 0's chunk */
            it->nl[r] = it->nl[0];
            memcpy(it->zl[r], it->zl[0], sizeof it->zl[0]);
            it->zoff[r] = 0;
        }
    }
    it->U = it->ub[it->nly - 1];
    nbhd_window(&g->axis[0], it->x, &it->fx, &it->cx);
}

// ----------------------------------------------------------------------------
// the key rows of a query item's unit, cut into segments of lines

/* One key row as a query item's lines see it: segment i is the row's slots [p[i], p[i] + ns[i])
 * (from the unit's first), seen by lines [ra[i], rb[i]); lines [la, lb) count the row.
 *   Y lines: one segment of all n slots, for the lines whose window holds the row.
 *   Z lines: every line sees the row; the positions [0, zoff[nly-1] + n) are cut where a line's
 *     span [zoff[r], zoff[r] + n) starts or ends, and line r's slot of position p is p - zoff[r]. */
typedef struct {
    int n, la, lb;
    int64_t p[2 * MAXLINES], ns[2 * MAXLINES];
    int8_t ra[2 * MAXLINES], rb[2 * MAXLINES];
} FAST(rowsegs);

/* Z lines: the segments every key row of the item's units has (n = the window's slots). */
static void FAST(zline_segments)(FAST(rowsegs) *sg, const FAST(qitem) *it, int64_t n) {
    int64_t cut[2 * MAXLINES];
    int nc = 0;
    for (int a = 0, b = 0; a < it->nly || b < it->nly;) {   /* merge the sorted starts and ends */
        const int64_t x = b >= it->nly || (a < it->nly && it->zoff[a] <= it->zoff[b] + n) ? it->zoff[a++]
                                                                                           : it->zoff[b++] + n;
        if (!nc || cut[nc - 1] != x) cut[nc++] = x;
    }
    for (int i = 0; i + 1 < nc; ++i) {
        int a = 0;
        while (it->zoff[a] + n <= cut[i]) ++a;
        int b = a;
        while (b < it->nly && it->zoff[b] <= cut[i]) ++b;
        sg->p[i] = cut[i];
        sg->ns[i] = cut[i + 1] - cut[i];
        sg->ra[i] = (int8_t)a;
        sg->rb[i] = (int8_t)b;
    }
    sg->n = nc - 1;
    sg->la = 0;
    sg->lb = it->nly;
}

/* Y lines: the one segment of union row u (n slots): the lines whose windows hold it */
static void FAST(yline_segment)(FAST(rowsegs) *sg, const FAST(qitem) *it, int64_t u, int64_t n) {
    int ra = 0;
    while (ra < it->nly && it->ub[ra] <= u) ++ra;
    int rb = ra;
    while (rb < it->nly && it->ua[rb] <= u) ++rb;
    sg->n = 1;
    sg->p[0] = 0;
    sg->ns[0] = n;
    sg->ra[0] = (int8_t)ra;
    sg->rb[0] = (int8_t)rb;
    sg->la = ra;
    sg->lb = rb;
}

/* line r's slot offset of the row's position 0 */
static inline int64_t FAST(line_zoff)(const FAST(qitem) *it, int r) { return it->zlines ? it->zoff[r] : 0; }

/* where lines [ra, rb) keep the slots of a segment at row position p: out[r - ra] in line r's
 * buffer buf[r], past its cnt[r] rows of nn slot vectors */
static inline void FAST(segment_at)(float **out, float *const *buf, const FAST(qitem) *it, const int64_t *cnt,
                                    int ra, int rb, int64_t nn, int64_t p) {
    for (int r = ra; r < rb; ++r) out[r - ra] = buf[r] + 16 * (nn * cnt[r] + p - FAST(line_zoff)(it, r));
}
