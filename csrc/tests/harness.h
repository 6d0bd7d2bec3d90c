/*
 * harness.h — what the C tests and the fuzzer share: a seeded RNG, strided typed tensors with
 * poison and canaries, dense gathers, and error metrics against naive.h.
 *
 * A test tensor is a logical 6-D array dims[6] = [B, X, Y, Z, H, D] (see nbhd.h's legend) laid
 * out with arbitrary element strides (permuted, padded, size-1 axes with junk strides, stride-0
 * broadcast for inputs). The whole allocation is filled with 0xFF bytes (NaN in every dtype);
 * after a kernel runs, every byte that is not a logical element must still be 0xFF. Canaries of
 * CANARY elements sit before and after the span; under AddressSanitizer they are dropped so the
 * allocation is exact and any out-of-bounds read is reported too.
 */
#ifndef NBHD_TESTS_HARNESS_H
#define NBHD_TESTS_HARNESS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "nbhd.h"

#if defined(__SANITIZE_ADDRESS__)
#define NBHD_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NBHD_TEST_ASAN 1
#endif
#endif
#ifdef NBHD_TEST_ASAN
#define CANARY 0
#else
#define CANARY 16
#endif

// ----------------------------------------------------------------------------
// rng: splitmix64

typedef struct { uint64_t s; } rng_t;

static inline uint64_t rng_next(rng_t *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* uniform integer in [lo, hi] */
static inline int64_t rng_int(rng_t *r, int64_t lo, int64_t hi) {
    return lo + (int64_t)(rng_next(r) % (uint64_t)(hi - lo + 1));
}

static inline double rng_unit(rng_t *r) { return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }

// ----------------------------------------------------------------------------
// strided typed tensors

typedef struct {
    nbhd_tensor t;       /* what the library sees */
    unsigned char *base; /* the allocation */
    size_t esize, alloc; /* element size, allocated elements */
    int64_t dims[6];
    int64_t span;        /* elements from data to one past the farthest logical element */
    nbhd_dtype dtype;
} tbuf;

static inline int64_t dims_count(const int64_t dims[6]) {
    int64_t n = 1;
    for (int i = 0; i < 6; ++i) n *= dims[i];
    return n;
}

/* Offset of logical element `lin` (row-major over dims). */
static inline int64_t tbuf_offset(const tbuf *b, int64_t lin) {
    int64_t off = 0;
    for (int i = 5; i >= 0; --i) {
        const int64_t c = lin % b->dims[i];
        lin /= b->dims[i];
        off += c * b->t.stride[i];
    }
    return off;
}

/* Strides for dims: random order of axes (or row-major), random padding, junk strides on
 * size-1 axes (their coordinate is always 0), stride 0 on one axis when bcast (inputs only).
 * ignore_last: the last axis is ignored by the library (LSE): its stride is junk. */
static inline void random_layout(rng_t *r, const int64_t dims[6], int bcast, int ignore_last,
                          int64_t stride[6]) {
    int order[6] = {0, 1, 2, 3, 4, 5};
    const int mode = (int)rng_int(r, 0, 3);
    if (mode >= 2)
        for (int i = 5; i > 0; --i) { /* Fisher-Yates */
            const int j = (int)rng_int(r, 0, i), tmp = order[i];
            order[i] = order[j];
            order[j] = tmp;
        }
    int64_t st = 1;
    for (int k = 5; k >= 0; --k) {
        const int a = order[k];
        if (ignore_last && a == 5) continue;
        stride[a] = st;
        st *= dims[a] + (mode == 1 || mode == 3 ? rng_int(r, 0, 2) : 0);
    }
    for (int a = 0; a < 6; ++a)
        if (dims[a] == 1 && rng_int(r, 0, 1)) stride[a] = rng_int(r, 0, 1000003);
    if (ignore_last) stride[5] = rng_int(r, -99999, 99999);
    if (bcast && rng_int(r, 0, 5) == 0) {
        const int a = (int)rng_int(r, 0, ignore_last ? 4 : 5);
        if (dims[a] > 1) stride[a] = 0;
    }
}

static inline tbuf tbuf_make(const int64_t dims[6], nbhd_dtype dt, const int64_t stride[6]) {
    tbuf b;
    memset(&b, 0, sizeof b);
    memcpy(b.dims, dims, sizeof b.dims);
    memcpy(b.t.stride, stride, sizeof b.t.stride);
    b.dtype = dt;
    b.esize = dt == NBHD_F64 ? 8 : dt == NBHD_F32 ? 4 : 2;
    b.span = 0;
    if (dims_count(dims) > 0) {
        b.span = 1;
        for (int i = 0; i < 6; ++i) b.span += (dims[i] - 1) * stride[i];
    }
    b.alloc = (size_t)b.span + 2 * CANARY;
    b.base = (unsigned char *)malloc(b.alloc ? b.alloc * b.esize : 1);
    memset(b.base, 0xff, b.alloc * b.esize);
    b.t.data = b.base + CANARY * b.esize;
    b.t.elements = b.span;   /* the view's own extent: the library checks it addresses no more */
    return b;
}

static inline void tbuf_free(tbuf *b) {
    free(b->base);
    b->base = NULL;
    b->t.data = NULL;
}

/* Writes dense values (rounded to the dtype) into the logical elements, then reads them back so
 * that dense holds exactly what the library will see (broadcast axes keep the last write). */
static inline void tbuf_fill(tbuf *b, double *dense) {
    const int64_t n = dims_count(b->dims);
    for (int64_t i = 0; i < n; ++i) nbhd_store(b->t.data, tbuf_offset(b, i), b->dtype, dense[i]);
    for (int64_t i = 0; i < n; ++i) dense[i] = nbhd_load(b->t.data, tbuf_offset(b, i), b->dtype);
}

static inline void tbuf_gather(const tbuf *b, double *dense) {
    const int64_t n = dims_count(b->dims);
    for (int64_t i = 0; i < n; ++i) dense[i] = nbhd_load(b->t.data, tbuf_offset(b, i), b->dtype);
}

/* 1 when every byte outside the logical elements is still poison (0xFF). */
static inline int tbuf_untouched_outside(const tbuf *b) {
    const int64_t n = dims_count(b->dims);
    unsigned char *mark = (unsigned char *)calloc(b->alloc ? b->alloc : 1, 1);
    for (int64_t i = 0; i < n; ++i) mark[CANARY + tbuf_offset(b, i)] = 1;
    int ok = 1;
    for (size_t e = 0; e < b->alloc && ok; ++e)
        if (!mark[e])
            for (size_t j = 0; j < b->esize; ++j)
                if (b->base[e * b->esize + j] != 0xff) { ok = 0; break; }
    free(mark);
    return ok;
}

static inline double *dense_random(rng_t *r, int64_t n, double lo, double hi) {
    double *x = (double *)malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; ++i) x[i] = lo + (hi - lo) * rng_unit(r);
    return x;
}

static inline double *dense_alloc(int64_t n) {
    return (double *)calloc((size_t)(n > 0 ? n : 1), sizeof(double));
}

/* Largest error of got vs want, in units of (|want_i| + max(rms(want), 1e-3)) (inputs are O(1):
 * exact zeros carry float roundoff); NaN/inf mismatch -> inf. */
static inline double rel_error(const double *got, const double *want, int64_t n) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += want[i] * want[i];
    const double rms = n ? sqrt(ss / (double)n) : 0, floor_ = rms > 1e-3 ? rms : 1e-3;
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (isnan(want[i]) && isnan(got[i])) continue;
        if (!isfinite(got[i]) || !isfinite(want[i])) {
            if (got[i] == want[i]) continue;
            return INFINITY;
        }
        const double e = fabs(got[i] - want[i]) / (fabs(want[i]) + floor_);
        if (e > worst) worst = e;
    }
    return worst;
}

static inline double tol_of(nbhd_dtype dt) {
    switch (dt) {
    case NBHD_F64: return 1e-10;
    case NBHD_F32: return 5e-4;
    default: return 3e-2;
    }
}

/* A row output's contents before a call with a query range (nbhd.h): the rows outside the range
 * must keep them. 12345 is no f16/bf16 value: compared as the dtype rounds it (sentinel_as). */
#define ROW_SENTINEL 12345.0

static inline double sentinel_as(nbhd_dtype dt) {
    double buf[1];
    nbhd_store(buf, 0, dt, ROW_SENTINEL);
    return nbhd_load(buf, 0, dt);
}

static inline void fill_sentinel(tbuf *b) {
    const int64_t n = dims_count(b->dims);
    for (int64_t i = 0; i < n; ++i) nbhd_store(b->t.data, tbuf_offset(b, i), b->dtype, ROW_SENTINEL);
}

#endif /* NBHD_TESTS_HARNESS_H */
