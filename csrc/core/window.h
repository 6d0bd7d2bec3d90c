/*
 * window.h — NATTEN's window rule (docs/design.md §1), per axis, shared by the CPU and CUDA kernels.
 *
 * Coordinates are full-axis indices x in [0, L). Dilation d splits an axis into groups
 * g = x mod d of length L_g = ceil((L - g) / d); in-group index i = x div d. A query at in-group
 * index i sees in-group keys [start, end); the full-axis keys are g + j*d for j in that range.
 * Unused axes are padded as L = K = s = d = 1, which gives the window [i, i+1).
 */
#ifndef NBHD_CORE_WINDOW_H
#define NBHD_CORE_WINDOW_H

#include <stdint.h>

#if defined(__CUDACC__)
#define NBHD_INLINE static __host__ __device__ __forceinline__
#else
#define NBHD_INLINE static inline
#endif

typedef struct {
    int64_t extent;
    int32_t kernel, stride, dilation, causal;
    int64_t query_begin, query_end;  /* the queries computed, [begin, end) (nbhd.h query range) */
} nbhd_axis;

/* In-group indices [lo, hi) of group g's queries inside the axis's query range. */
NBHD_INLINE void nbhd_query_range_in_group(const nbhd_axis *a, int64_t g, int64_t *lo, int64_t *hi) {
    const int64_t d = a->dilation;
    *lo = a->query_begin > g ? (a->query_begin - g + d - 1) / d : 0;
    *hi = a->query_end > g ? (a->query_end - g + d - 1) / d : 0;
}

/* Is full-axis query x inside the axis's query range? */
NBHD_INLINE int nbhd_query_in_range(const nbhd_axis *a, int64_t x) {
    return x >= a->query_begin && x < a->query_end;
}

/* Is the query at coordinates c (the three axes of `axes`) inside the query range? */
NBHD_INLINE int nbhd_token_in_range(const nbhd_axis axes[3], const int64_t c[3]) {
    return nbhd_query_in_range(&axes[0], c[0]) && nbhd_query_in_range(&axes[1], c[1]) &&
           nbhd_query_in_range(&axes[2], c[2]);
}

/* In-group window [start, end) of in-group query index i on a group of length group_len. */
NBHD_INLINE void nbhd_window_in_group(const nbhd_axis *a, int64_t i, int64_t group_len,
                                      int64_t *start, int64_t *end) {
    const int64_t K = a->kernel, s = a->stride;
    const int64_t q = i / s;
    if (a->causal) {
        int64_t leader = q * s + s - 1;
        if (leader > group_len - 1) leader = group_len - 1;
        int64_t st = leader - K + 1;
        *start = st > 0 ? st : 0;
        *end = i + 1;
    } else {
        int64_t leader = q * s + s / 2;
        if (leader > group_len - 1) leader = group_len - 1;
        int64_t st = leader - K / 2;  /* left = K // 2 */
        if (st > group_len - K) st = group_len - K;
        if (st < 0) st = 0;
        *start = st;
        *end = st + K;
    }
}

NBHD_INLINE int64_t nbhd_group_len(const nbhd_axis *a, int64_t g) {
    return (a->extent - g + a->dilation - 1) / a->dilation;
}

/* Full-axis keys of query x: first key, count, step (= dilation). */
NBHD_INLINE void nbhd_window(const nbhd_axis *a, int64_t x, int64_t *first, int64_t *count) {
    const int64_t d = a->dilation, g = x % d;
    int64_t st, en;
    nbhd_window_in_group(a, x / d, nbhd_group_len(a, g), &st, &en);
    *first = g + st * d;
    *count = en - st;
}

/* In-group query range [i_lo, i_hi) of group g cut to the axis's query range: first, count.
 * Both ends are clamped into the range, so that cut ranges stay ordered along the keys (an
 * empty one sits at the range's edge) and the union of consecutive keys' cut ranges is
 * [first of the first, end of the last). */
NBHD_INLINE void nbhd_inverse_in_range(const nbhd_axis *a, int64_t g, int64_t i_lo, int64_t i_hi,
                                       int64_t *first, int64_t *count) {
    int64_t q_lo, q_hi;
    nbhd_query_range_in_group(a, g, &q_lo, &q_hi);
    const int64_t f = i_lo < q_lo ? q_lo : i_lo > q_hi ? q_hi : i_lo;
    const int64_t e = i_hi < q_lo ? q_lo : i_hi > q_hi ? q_hi : i_hi;
    *first = g + f * a->dilation;
    *count = e - f;
}

/* Inverse neighborhood of key y: the queries x (same group, step = dilation) whose window holds
 * y form one contiguous in-group range, because start(i) and end(i) never decrease with i.
 * Found by two binary searches, then cut to the query range. */
NBHD_INLINE void nbhd_inverse_window(const nbhd_axis *a, int64_t y, int64_t *first,
                                     int64_t *count) {
    const int64_t d = a->dilation, g = y % d, j = y / d, n = nbhd_group_len(a, g);
    int64_t st, en;
    /* lo = first i with end(i) > j */
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        nbhd_window_in_group(a, mid, n, &st, &en);
        if (en > j) hi = mid; else lo = mid + 1;
    }
    const int64_t i_lo = lo;
    /* up = first i with start(i) > j */
    lo = i_lo; hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        nbhd_window_in_group(a, mid, n, &st, &en);
        if (st > j) hi = mid; else lo = mid + 1;
    }
    nbhd_inverse_in_range(a, g, i_lo, lo, first, count);
}

#endif /* NBHD_CORE_WINDOW_H */
