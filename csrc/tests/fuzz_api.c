/*
 * fuzz_api.c — libFuzzer harness of the public C API.
 *
 * Decodes the input bytes into a problem descriptor (every field, including invalid and extreme
 * values), an exec (threads, use_reference, tiles), a mode (all tensors, one tensor NULL, a short
 * workspace, one tensor's allocation smaller than its view, NULL args/exec), a seed for layouts
 * and data, and on one input in three a query range (valid, or now and then not). Then:
 *   invalid problem      every entry point returns an error status, nbhd_workspace_bytes is 0,
 *                        and nothing is read or written (the tensors are 1-byte allocations);
 *                        the query range alone is judged against nbhd.h's rule as well
 *   valid, empty         batch 0 or heads 0: the calls succeed without data (backward with
 *                        heads 0 writes zero key gradients)
 *   valid, small         tensors allocated exactly from the descriptor and the strides chosen
 *                        (under ASan an access one element out is reported), outputs poisoned;
 *                        forward, backward and forward_jvp are checked against naive.h; every
 *                        tensor states its extent (nbhd_tensor.elements), and one shrunk to a
 *                        single element is refused naming it, before anything is read. With a
 *                        query range, input rows outside it are NaN, output rows outside it must
 *                        keep a sentinel, and key-side gradients sum over the range's queries
 *   valid, large         nbhd_workspace_bytes only (no buffers that big)
 * Any mismatch or unexpected status aborts, which libFuzzer reports as a crash.
 *
 * Build: clang -fsanitize=fuzzer,address,undefined (make fuzz-smoke). test_fuzz_corpus.c runs
 * the seed corpus and the crash reproducers in csrc/tests/fuzz_corpus/ through the same function.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "naive.h"

// ----------------------------------------------------------------------------
// byte decoding: a byte >= 240 picks an extreme value, otherwise a small in-range one

typedef struct { const uint8_t *p; size_t n; } fz_reader;

static uint8_t fz_u8(fz_reader *r) {
    if (!r->n) return 0;
    r->n--;
    return *r->p++;
}

static int64_t fz_i64(fz_reader *r, int64_t lo, int64_t hi) {
    static const int64_t ext[16] = {-1, 0, 1, 2, INT64_MAX, INT64_MIN, (int64_t)1 << 31,
                                    (int64_t)1 << 56, ((int64_t)1 << 56) + 1, (int64_t)1 << 62,
                                    -((int64_t)1 << 40), 65536, 3, 1000, (int64_t)1 << 28, 5};
    const uint8_t b = fz_u8(r);
    if (b >= 240) return ext[b - 240];
    return lo + (int64_t)(b % (uint64_t)(hi - lo + 1));
}

static int32_t fz_i32(fz_reader *r, int32_t lo, int32_t hi) {
    static const int32_t ext[16] = {-1, 0, 1, 2, INT32_MAX, INT32_MIN, 65536, -65536,
                                    1000000, 3, 255, 256, 46341, -2, 7, 1};
    const uint8_t b = fz_u8(r);
    if (b >= 240) return ext[b - 240];
    return lo + (int32_t)(b % (uint32_t)(hi - lo + 1));
}

static double fz_scale(fz_reader *r, int32_t head_dim) {
    const uint8_t b = fz_u8(r);
    switch (b) {
    case 255: return NAN;
    case 254: return INFINITY;
    case 253: return -INFINITY;
    case 252: return 0.0;
    case 251: return 1e300;
    case 250: return -1.0;
    case 249: return 1e-300;
    case 248: return 10.0;
    default: return b < 128 && head_dim > 0 ? 1.0 / sqrt((double)head_dim) : 0.05 + b / 128.0;
    }
}

/* valid-ish: the raw fields repaired into a valid problem (most inputs) */
static void fz_repair(nbhd_problem *p) {
    if (p->rank < 0 || p->rank > 3) p->rank = (int32_t)((uint32_t)p->rank % 4u);
    for (int a = 0; a < 3; ++a) {
        if (p->kernel[a] < 2 || p->kernel[a] > 9) p->kernel[a] = 2 + (int32_t)((uint32_t)p->kernel[a] % 8u);
        if (p->dilation[a] < 1 || p->dilation[a] > 3) p->dilation[a] = 1 + (int32_t)((uint32_t)p->dilation[a] % 3u);
        if (p->stride[a] < 1 || p->stride[a] > p->kernel[a])
            p->stride[a] = 1 + (int32_t)((uint32_t)p->stride[a] % (uint32_t)p->kernel[a]);
        const int64_t need = (int64_t)p->kernel[a] * p->dilation[a];
        if (p->extent[a] < need || p->extent[a] > need + 16) p->extent[a] = need + (int64_t)((uint64_t)p->extent[a] % 5u);
        p->causal[a] &= 1;
    }
    if (p->rank == 0) {
        if (p->extent[0] < 1 || p->extent[0] > 16) p->extent[0] = 1 + (int64_t)((uint64_t)p->extent[0] % 16u);
        if (p->extra_kv < 1) p->extra_kv = 1;
    }
    if (p->batch < 0 || p->batch > 3) p->batch = (int64_t)((uint64_t)p->batch % 3u);
    if (p->extra_kv < 0 || p->extra_kv > 8) p->extra_kv = (int64_t)((uint64_t)p->extra_kv % 5u) + (p->rank == 0);
    if (p->kv_heads < 1 || p->kv_heads > 3) p->kv_heads = 1 + (int32_t)((uint32_t)p->kv_heads % 3u);
    if (p->heads < 0 || p->heads > 12 || p->heads % p->kv_heads)
        p->heads = p->kv_heads * (int32_t)((uint32_t)p->heads % 4u);
    if (p->head_dim < 1 || p->head_dim > 64) p->head_dim = 1 + (int32_t)((uint32_t)p->head_dim % 16u);
    if (p->head_dim_v < 1 || p->head_dim_v > 64) p->head_dim_v = 1 + (int32_t)((uint32_t)p->head_dim_v % 16u);
    if (!isfinite(p->scale) || fabs(p->scale) > 100) p->scale = 0.5;
    if ((unsigned)p->dtype > NBHD_BF16) p->dtype = NBHD_F32;
    p->device = p->device == NBHD_CUDA ? NBHD_CUDA : NBHD_CPU;
    if (p->rank == 0) p->rpb = 0;
    for (int a = 0; p->rpb && a < 3; ++a) p->causal[a] = 0;  /* the bias is undefined with causal axes */
}

/* The query range, read after the seed so that inputs from before ranges decode as they did (a
 * missing byte is 0: no range). One input in three draws one; per axis a byte picks the whole
 * axis (both 0), the extent given as a range (the range path computing every query), a random
 * [begin, end) inside the extent, or (>= 240) raw bounds, valid or not, for validation to judge.
 * Past the rank only raw bounds are set. */
static void fz_range(fz_reader *r, nbhd_problem *p) {
    if (fz_u8(r) % 3 != 1) return;
    for (int a = 0; a < 3; ++a) {
        const uint8_t kind = fz_u8(r);
        const int64_t L = p->extent[a];
        if (kind >= 240) {
            p->query_begin[a] = fz_i64(r, -1, 15);
            p->query_end[a] = fz_i64(r, -1, 15);
        } else if (a >= p->rank || L < 1 || kind % 4 == 0) {
            continue;
        } else if (kind % 4 == 1) {
            p->query_end[a] = L;
        } else {
            p->query_begin[a] = fz_u8(r) % L;
            p->query_end[a] = p->query_begin[a] + 1 + fz_u8(r) % (L - p->query_begin[a]);
        }
    }
}

/* nbhd.h's range rule, transcribed independently of nbhd_validate */
static int fz_range_ok(const nbhd_problem *p) {
    for (int a = 0; a < 3; ++a) {
        const int64_t b = p->query_begin[a], e = p->query_end[a];
        if ((b || e) && !(a < p->rank && 0 <= b && b < e && e <= p->extent[a])) return 0;
    }
    return 1;
}

static int fz_has_range(const nbhd_problem *p) {
    for (int a = 0; a < 3; ++a)
        if (p->query_begin[a] || p->query_end[a]) return 1;
    return 0;
}

// ----------------------------------------------------------------------------
// checks

#define FZ_CHECK(cond, ...)                                         \
    do {                                                            \
        if (!(cond)) {                                              \
            fprintf(stderr, "fuzz_api: check failed: " __VA_ARGS__); \
            fprintf(stderr, "\n  last error: %s\n", nbhd_last_error()); \
            fz_describe(p);                                         \
            abort();                                                \
        }                                                           \
    } while (0)

static const char *fz_input_name;  /* set by test_fuzz_corpus.c */

static void fz_describe(const nbhd_problem *p) {
    if (fz_input_name) fprintf(stderr, "  input file: %s\n", fz_input_name);
    fprintf(stderr, "  rank=%d extent=[%lld,%lld,%lld] kernel=[%d,%d,%d] stride=[%d,%d,%d] dilation=[%d,%d,%d] "
            "causal=[%d,%d,%d] batch=%lld heads=%d kv_heads=%d D=%d Dv=%d extra_kv=%lld scale=%g dtype=%d device=%d\n",
            p->rank, (long long)p->extent[0], (long long)p->extent[1], (long long)p->extent[2],
            p->kernel[0], p->kernel[1], p->kernel[2], p->stride[0], p->stride[1], p->stride[2],
            p->dilation[0], p->dilation[1], p->dilation[2], p->causal[0], p->causal[1], p->causal[2],
            (long long)p->batch, p->heads, p->kv_heads, p->head_dim, p->head_dim_v,
            (long long)p->extra_kv, p->scale, (int)p->dtype, (int)p->device);
    if (fz_has_range(p))
        fprintf(stderr, "  query range [%lld,%lld) [%lld,%lld) [%lld,%lld)\n", (long long)p->query_begin[0],
                (long long)p->query_end[0], (long long)p->query_begin[1], (long long)p->query_end[1],
                (long long)p->query_begin[2], (long long)p->query_end[2]);
}

/* The output format's spacing at zero: f16 holds nothing between 0 and 2^-24, so a result that
 * small reads 0 or 2^-24 whatever the kernel computed (the other formats' subnormals lie far
 * below any magnitude the checks use) */
static double fz_zero_step(nbhd_dtype dt) {
    return dt == NBHD_F16 ? ldexp(1.0, -24) : 0.0;
}

/* The worst error of got against want: rel_error, or with magnitude > 0 each element's error
 * beyond the format's spacing at zero, over its size plus that magnitude. Gradient outputs sum
 * terms of both signs (dQ = s sum dS k with sum dS = 0), so their result can be far smaller than
 * the terms; rounding error scales with the terms. `magnitude` (0 for none) is the typical size
 * of those terms and floors the normalisation of the error. */
static double fz_error(const double *got, const double *want, int64_t n, double magnitude, double zero_step) {
    double worst = rel_error(got, want, n);
    if (magnitude > 0 && worst > 0) {
        worst = 0;
        for (int64_t i = 0; i < n; ++i) {
            if (isnan(want[i]) && isnan(got[i])) continue;
            if (!isfinite(got[i]) || !isfinite(want[i])) {
                if (got[i] == want[i]) continue;
                return INFINITY;
            }
            const double e = fmax(fabs(got[i] - want[i]) - zero_step, 0.0) / (fabs(want[i]) + magnitude);
            if (e > worst) worst = e;
        }
    }
    return worst;
}

static double fz_magnitude;  /* set per problem by fz_compute for the gradient checks */

/* is element lin of a row tensor [B, X, Y, Z, H, .] a query the problem computes? */
static int fz_in_range(const nbhd_problem *p, const int64_t dims[6], int64_t lin) {
    return naive_in_range(p, lin / (dims[4] * dims[5]) % (dims[1] * dims[2] * dims[3]));
}

/* tbuf_fill of a row input whose rows outside the query range are NaN (nbhd.h: never read),
 * unless a broadcast spatial axis aliases them with rows inside */
static void fz_fill_rows(const nbhd_problem *p, tbuf *b, double *dense) {
    int poison = fz_has_range(p);
    for (int a = 1; a <= 3; ++a) poison &= !(b->dims[a] > 1 && b->t.stride[a] == 0);
    const int64_t n = dims_count(b->dims);
    for (int64_t i = 0; i < n && poison; ++i)
        if (!fz_in_range(p, b->dims, i)) dense[i] = NAN;
    tbuf_fill(b, dense);
}

/* got against the oracle; a row output (rows: out, lse, t_out, t_lse, dq, dtq) only on the rows
 * of the query range, its other rows still harness.h's sentinel, written before the call */
static void fz_close(const nbhd_problem *p, const char *what, const tbuf *b, const double *want,
                     double tol, int rows) {
    const int64_t n = dims_count(b->dims);
    double *got = dense_alloc(n), *want_in = dense_alloc(n);
    tbuf_gather(b, got);
    const double sentinel = sentinel_as(b->dtype);
    int64_t m = 0, lost = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (!rows || fz_in_range(p, b->dims, i)) {  /* compacted in place: m <= i */
            got[m] = got[i];
            want_in[m++] = want[i];
        } else {
            lost += !(got[i] == sentinel);
        }
    }
    /* gradients and the output tangent (sum P (tv + (tS - mu) v)) are sums that cancel */
    const int cancels = strncmp(what, "backward", 8) == 0 || strstr(what, "t_out") != NULL;
    const double err = fz_error(got, want_in, m, cancels ? fz_magnitude : 0, fz_zero_step(b->dtype));
    if (!(err <= tol) && getenv("NBHD_FUZZ_VERBOSE"))
        for (int64_t i = 0; i < m && i < 48; ++i)
            fprintf(stderr, "    %s[%lld] got %.9g want %.9g\n", what, (long long)i, got[i], want_in[i]);
    FZ_CHECK(err <= tol, "%s: rel error %g > %g", what, err, tol);
    FZ_CHECK(lost == 0, "%s: %lld elements of rows outside the query range lost their sentinel", what,
             (long long)lost);
    FZ_CHECK(tbuf_untouched_outside(b), "%s: wrote outside its elements", what);
    free(got);
    free(want_in);
}

/* Does the exec's (partial) tile request name configuration c? (the rule of nbhd.h) */
static int fz_tile_matches(const nbhd_tile_config *c, const nbhd_exec *e, int rank) {
    for (int a = 0; a < rank; ++a)
        if ((e->q_tile[a] && e->q_tile[a] != c->q_tile[a]) ||
            (e->kv_tile[a] && e->kv_tile[a] != c->kv_tile[a]))
            return 0;
    return 1;
}

/* exec tiles of a valid problem: random requests must be refused unless a listed configuration
 * matches; then the request is replaced by a configuration every computed op lists (picked by
 * the request's bytes), so that the computed case runs a real tile. */
static void fz_tiles(const nbhd_problem *p, nbhd_exec *e) {
    const int rank = p->rank > 0 ? p->rank : 1;
    int any = 0, past_rank = 0;
    for (int a = 0; a < 3; ++a) {
        any |= e->q_tile[a] | e->kv_tile[a];
        past_rank |= (a >= rank && (e->q_tile[a] | e->kv_tile[a])) || e->q_tile[a] < 0 || e->kv_tile[a] < 0;
    }
    if (!any) return;
    nbhd_forward_args fa;
    memset(&fa, 0, sizeof fa);
    if (past_rank) {
        FZ_CHECK(nbhd_forward(p, &fa, e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "tile"),
                 "forward accepted a negative tile or one past the rank");
        for (int a = 0; a < 3; ++a) {
            if (a >= rank || e->q_tile[a] < 0) e->q_tile[a] = 0;
            if (a >= rank || e->kv_tile[a] < 0) e->kv_tile[a] = 0;
        }
        any = 0;
        for (int a = 0; a < rank; ++a) any |= e->q_tile[a] | e->kv_tile[a];
        if (!any) return;
    }
    if (e->use_reference) return;  /* the scalar kernels have no tiles: any request is ignored */
    enum { MAX_CONFIGS = 64 };
    nbhd_tile_config lists[3][MAX_CONFIGS];
    int32_t counts[3];
    for (int op = 0; op < 3; ++op) {
        counts[op] = nbhd_tile_configs(p, (nbhd_op)op, lists[op], MAX_CONFIGS);
        FZ_CHECK(counts[op] >= 0 && counts[op] <= MAX_CONFIGS, "tile_configs(op %d) returned %d", op, counts[op]);
    }
    int listed = 0;
    for (int i = 0; i < counts[0]; ++i) listed |= fz_tile_matches(&lists[0][i], e, rank);
    const nbhd_status st = nbhd_forward(p, &fa, e);  /* NULL tensors: refused after the tiles */
    if (!listed)
        FZ_CHECK(st == NBHD_ERR_UNSUPPORTED && strstr(nbhd_last_error(), "tile"),
                 "forward accepted an unlisted tile (status %d)", (int)st);
    else
        FZ_CHECK(p->batch == 0 || p->heads == 0 || st == NBHD_ERR_ARG, "forward with a listed tile: status %d", (int)st);
    const nbhd_tile_config *pick = NULL;
    const uint32_t start = (uint32_t)e->q_tile[0] + (uint32_t)e->kv_tile[0];
    for (int k = 0; k < counts[0] && !pick; ++k) {
        const nbhd_tile_config *c = &lists[0][(start + (uint32_t)k) % (uint32_t)counts[0]];
        int everywhere = 1;
        for (int op = 1; op < 3; ++op) {
            int found = 0;
            for (int i = 0; i < counts[op]; ++i)
                found |= memcmp(&lists[op][i], c, sizeof *c) == 0;
            everywhere &= found;
        }
        if (everywhere) pick = c;
    }
    memset(e->q_tile, 0, sizeof e->q_tile);
    memset(e->kv_tile, 0, sizeof e->kv_tile);
    if (pick) {
        memcpy(e->q_tile, pick->q_tile, sizeof e->q_tile);
        memcpy(e->kv_tile, pick->kv_tile, sizeof e->kv_tile);
    }
}

/* every entry point must fail on an invalid problem without touching any tensor */
static void fz_invalid(const nbhd_problem *p, nbhd_exec *e) {
    unsigned char *byte = (unsigned char *)malloc(1);
    nbhd_tensor t;
    memset(&t, 0, sizeof t);
    t.data = byte;
    for (int i = 0; i < 6; ++i) t.stride[i] = 1 << 20;  /* any access lands far out of bounds */
    nbhd_forward_args fa = {t, t, t, t, t, t, t, {0}};
    nbhd_backward_args ba = {t, t, t, t, t, t, t, t, t, t, t, t, t, t, {0}, {0}};
    nbhd_forward_jvp_args ja = {t, t, t, t, t, t, t, t, t, t, t, t, t, t, {0}, {0}};
    e->workspace = byte;
    e->workspace_bytes = 1;
    FZ_CHECK(nbhd_workspace_bytes(p, NBHD_OP_FORWARD, e) == 0 &&
                 nbhd_workspace_bytes(p, NBHD_OP_BACKWARD, e) == 0 &&
                 nbhd_workspace_bytes(p, NBHD_OP_FORWARD_JVP, NULL) == 0,
             "invalid problem asks for workspace");
    FZ_CHECK(nbhd_forward(p, &fa, e) == NBHD_ERR_ARG, "forward accepted an invalid problem");
    FZ_CHECK(nbhd_backward(p, &ba, e) == NBHD_ERR_ARG, "backward accepted an invalid problem");
    FZ_CHECK(nbhd_forward_jvp(p, &ja, NULL) == NBHD_ERR_ARG, "forward_jvp accepted an invalid problem");
    FZ_CHECK(strlen(nbhd_last_error()) > 0, "no message");
    free(byte);
}

static nbhd_tensor fz_none(void) {
    nbhd_tensor t;
    memset(&t, 0, sizeof t);
    return t;
}

static void *fz_workspace(const nbhd_problem *p, nbhd_op op, nbhd_exec *e) {
    const size_t need = nbhd_workspace_bytes(p, op, e);
    FZ_CHECK(need < ((size_t)1 << 30), "workspace of %zu bytes for a small problem", need);
    e->workspace = need ? malloc(need) : NULL;
    e->workspace_bytes = need;
    return e->workspace;
}

/* Mode 3's victim: a view of more than one element over a one-byte allocation that says it
 * holds one element (ASan reports any read); 0 when the view has one element (nothing to shrink). */
static int fz_shrink(nbhd_tensor *t, void **tiny) {
    if (t->elements <= 1) return 0;
    *tiny = malloc(1);
    t->data = *tiny;
    t->elements = 1;
    return 1;
}

/* refused with NBHD_ERR_ARG and a message naming the element past the allocation */
#define FZ_SHORT(call, what)                                                                  \
    do {                                                                                      \
        FZ_CHECK((call) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "past its 1 elements"),  \
                 "%s accepted a tensor larger than its allocation (%s)", what, nbhd_last_error()); \
        free(tiny);                                                                           \
    } while (0)

/* the valid, small problem: exact buffers (each tensor's `elements` is its view's extent), all
 * ops against the oracle. mode 1 nulls one required tensor (expect NBHD_ERR_ARG), mode 2 gives
 * one byte less workspace, mode 3 shrinks one required tensor's allocation below its view. */
static void fz_compute(const nbhd_problem *p, nbhd_exec *e, int mode, uint8_t victim, uint64_t seed) {
    rng_t r = {seed};
    if (getenv("NBHD_FUZZ_VERBOSE")) {  /* which problem a sanitizer report is about */
        fz_describe(p);
        fprintf(stderr, "  mode=%d threads=%d use_reference=%d seed=%llu\n", mode, e->threads,
                e->use_reference, (unsigned long long)seed);
    }
    const nbhd_dtype dt = p->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const double range = (seed & 3) == 0 ? 4.0 : 1.0;
    /* |S| <= M: an accumulation in float loses about M * 2^-23 on S, hence on P (relative) */
    const double M = fabs(p->scale) * range * range * (double)p->head_dim;
    /* gradients also lose eps * |dO.v| to the cancellation dO.v - D_i (near one-hot P) */
    const double C = M + range * range * (double)(p->head_dim + p->head_dim_v);
    const double tol = tol_of(dt) + C * (dt == NBHD_F64 ? 1e-14 : 8e-6);
    /* The backward ops take the oracle's LSE and form P = exp(S - LSE) from their own scores,
     * whose rounding is about M * eps: past 1 (a scale like 1e300) P, and every gradient through
     * it, is anything in [0, inf], not a function of the inputs (inf, NaN or 2x the oracle, by
     * compiler and -O level). Their values are then not compared: the call must still succeed
     * and write nothing outside its elements. */
    const double grad_tol = M * (lt == NBHD_F64 ? 0x1p-52 : 0x1p-23) > 1 ? INFINITY : tol;
    /* size of one gradient term, s * |dO.v| * |k| (dQ, dK) or |dO| (dV), and of one tangent
     * term, |tS| * |v| with tS = s (tq.k + q.tk) */
    const double dmax = (double)(p->head_dim > p->head_dim_v ? p->head_dim : p->head_dim_v);
    fz_magnitude = 0.1 * (fabs(p->scale) * range * range * dmax * range + range);
    const int64_t B = p->batch, X = naive_ext(p, 0), Y = naive_ext(p, 1), Z = naive_ext(p, 2);
    const int64_t H = p->heads, Hk = p->kv_heads, D = p->head_dim, Dv = p->head_dim_v, S = p->extra_kv;
    const int64_t sq[6] = {B, X, Y, Z, H, D}, sk[6] = {B, X, Y, Z, Hk, D}, sv[6] = {B, X, Y, Z, Hk, Dv},
                  so[6] = {B, X, Y, Z, H, Dv}, sl[6] = {B, X, Y, Z, H, 1}, skx[6] = {B, S, 1, 1, Hk, D},
                  svx[6] = {B, S, 1, 1, Hk, Dv};
    const int has_k = p->rank > 0, has_x = S > 0;
    int64_t st[6];
    void *tiny = NULL;
#define MAKE_IN(name, dims, type, dense, ign, bc)                                  \
    double *dense = dense_random(&r, dims_count(dims), -range, range);             \
    random_layout(&r, dims, bc, ign, st);                                          \
    tbuf name = tbuf_make(dims, type, st);                                         \
    tbuf_fill(&name, dense)
#define MAKE_OUT(name, dims, type, ign)                                            \
    random_layout(&r, dims, 0, ign, st);                                           \
    tbuf name = tbuf_make(dims, type, st)
    /* a query row's tensor: inputs NaN outside the query range, outputs the sentinel */
#define MAKE_ROW_IN(name, dims, type, dense, ign)                                  \
    MAKE_IN(name, dims, type, dense, ign, 1);                                      \
    fz_fill_rows(p, &name, dense)
#define MAKE_ROW_OUT(name, dims, type, ign)                                        \
    MAKE_OUT(name, dims, type, ign);                                               \
    fill_sentinel(&name)

    MAKE_ROW_IN(Q, sq, dt, q, 0);
    MAKE_IN(K, sk, dt, k, 0, 1);
    MAKE_IN(V, sv, dt, v, 0, 1);
    MAKE_IN(KX, skx, dt, kx, 0, 1);
    MAKE_IN(VX, svx, dt, vx, 0, 1);
    const nbhd_tensor tK = has_k ? K.t : fz_none(), tV = has_k ? V.t : fz_none();
    const nbhd_tensor tKX = has_x ? KX.t : fz_none(), tVX = has_x ? VX.t : fz_none();
    /* a bias table when the problem has one (problem.rpb): every op reads it, the oracle adds it
     * to its scores; the backward's table gradient is checked (the rng advances only then, so
     * the other problems see the same inputs as before) */
    const int64_t n_rpb = naive_bias_entries(p);
    const int64_t srpb[6] = {1, 1, 1, 1, H, n_rpb}, strpb[6] = {0, 0, 0, 0, n_rpb, 1};
    double *rpb = p->rpb ? dense_random(&r, H * n_rpb, -range, range) : NULL;
    tbuf R = tbuf_make(srpb, lt, strpb);
    if (p->rpb) tbuf_fill(&R, rpb);
    const nbhd_tensor tR = p->rpb ? R.t : fz_none();
    naive_bias.rpb = rpb;
    double *out = dense_alloc(dims_count(so)), *lse = dense_alloc(dims_count(sl));
    naive_forward(p, q, k, v, kx, vx, out, lse);

    /* ---- forward */
    {
        MAKE_ROW_OUT(O, so, dt, 0);
        MAKE_ROW_OUT(L, sl, lt, 1);
        nbhd_forward_args a = {Q.t, tK, tV, tKX, tVX, O.t, L.t, tR};
        fz_workspace(p, NBHD_OP_FORWARD, e);
        nbhd_tensor *req[5] = {&a.q, &a.out, &a.lse, has_k ? &a.k : &a.q, has_x ? &a.kx : &a.q};
        if (mode == 1) {
            req[victim % 5]->data = NULL;
            FZ_CHECK(nbhd_forward(p, &a, e) == NBHD_ERR_ARG, "forward accepted a NULL tensor");
        } else if (mode == 2 && e->workspace_bytes) {
            e->workspace_bytes--;
            FZ_CHECK(nbhd_forward(p, &a, e) == NBHD_ERR_WORKSPACE, "forward accepted a short workspace");
        } else if (mode == 3 && fz_shrink(req[victim % 5], &tiny)) {
            FZ_SHORT(nbhd_forward(p, &a, e), "forward");
        } else {
            FZ_CHECK(nbhd_forward(p, &a, e) == NBHD_OK, "forward failed");
            fz_close(p, "forward out", &O, out, tol, 1);
            fz_close(p, "forward lse", &L, lse, dt == NBHD_F64 ? 1e-12 : 1e-5 + M * 1e-7, 1);
        }
        free(e->workspace);
        tbuf_free(&O);
        tbuf_free(&L);
    }
    /* ---- backward from the oracle's out and lse */
    {
        MAKE_IN(Oi, so, dt, o_in, 0, 0);
        memcpy(o_in, out, sizeof(double) * (size_t)dims_count(so));
        fz_fill_rows(p, &Oi, o_in);
        MAKE_IN(Li, sl, lt, l_in, 1, 0);
        memcpy(l_in, lse, sizeof(double) * (size_t)dims_count(sl));
        fz_fill_rows(p, &Li, l_in);
        MAKE_ROW_IN(dO, so, dt, dout, 0);
        MAKE_ROW_IN(dL, sl, lt, dlse, 1);
        const int with_dlse = (seed >> 8) & 1;
        MAKE_ROW_OUT(dQ, sq, dt, 0);
        MAKE_OUT(dK, sk, dt, 0);
        MAKE_OUT(dV, sv, dt, 0);
        MAKE_OUT(dKX, skx, dt, 0);
        MAKE_OUT(dVX, svx, dt, 0);
        tbuf dR = tbuf_make(srpb, lt, strpb);
        nbhd_backward_args a = {Q.t, tK, tV, tKX, tVX, Oi.t, Li.t, dO.t, with_dlse ? dL.t : fz_none(),
                                dQ.t, has_k ? dK.t : fz_none(), has_k ? dV.t : fz_none(),
                                has_x ? dKX.t : fz_none(), has_x ? dVX.t : fz_none(), tR,
                                p->rpb ? dR.t : fz_none()};
        fz_workspace(p, NBHD_OP_BACKWARD, e);
        nbhd_tensor *req[6] = {&a.q, &a.d_out, &a.lse, &a.d_q, has_k ? &a.d_k : &a.out,
                               has_x ? &a.d_vx : &a.d_q};
        if (mode == 1) {
            req[victim % 6]->data = NULL;
            FZ_CHECK(nbhd_backward(p, &a, e) == NBHD_ERR_ARG, "backward accepted a NULL tensor");
        } else if (mode == 2 && e->workspace_bytes) {
            e->workspace_bytes--;
            FZ_CHECK(nbhd_backward(p, &a, e) == NBHD_ERR_WORKSPACE, "backward accepted a short workspace");
        } else if (mode == 3 && fz_shrink(req[victim % 6], &tiny)) {
            FZ_SHORT(nbhd_backward(p, &a, e), "backward");
        } else {
            FZ_CHECK(nbhd_backward(p, &a, e) == NBHD_OK, "backward failed");
            const int64_t nq = dims_count(sq), nk = dims_count(sk), nv = dims_count(sv),
                          nkx = dims_count(skx), nvx = dims_count(svx);
            double *dq = dense_alloc(nq), *dk = dense_alloc(nk), *dv = dense_alloc(nv),
                   *dkx = dense_alloc(nkx), *dvx = dense_alloc(nvx), *drpb = dense_alloc(H * n_rpb);
            memset(drpb, 0, sizeof(double) * (size_t)(H * n_rpb));
            naive_bias.d_rpb = p->rpb ? drpb : NULL;
            naive_backward(p, q, k, v, kx, vx, o_in, dout, with_dlse ? dlse : NULL, dq, dk, dv, dkx, dvx);
            naive_bias.d_rpb = NULL;
            if (p->rpb) fz_close(p, "backward d_rpb", &dR, drpb, grad_tol, 0);
            free(drpb);
            fz_close(p, "backward dq", &dQ, dq, grad_tol, 1);
            if (has_k) {
                fz_close(p, "backward dk", &dK, dk, grad_tol, 0);
                fz_close(p, "backward dv", &dV, dv, grad_tol, 0);
            }
            if (has_x) {
                fz_close(p, "backward dkx", &dKX, dkx, grad_tol, 0);
                fz_close(p, "backward dvx", &dVX, dvx, grad_tol, 0);
            }
            free(dq); free(dk); free(dv); free(dkx); free(dvx);
        }
        free(e->workspace);
        tbuf_free(&Oi); tbuf_free(&Li); tbuf_free(&dO); tbuf_free(&dL);
        tbuf_free(&dQ); tbuf_free(&dK); tbuf_free(&dV); tbuf_free(&dKX); tbuf_free(&dVX); tbuf_free(&dR);
        free(o_in); free(l_in); free(dout); free(dlse);
    }
    /* ---- forward + JVP */
    {
        const int use_t = (int)(seed >> 16);
        MAKE_ROW_IN(TQ, sq, dt, tq, 0);
        MAKE_IN(TK, sk, dt, tk, 0, 1);
        MAKE_IN(TV, sv, dt, tv, 0, 1);
        MAKE_IN(TKX, skx, dt, tkx, 0, 1);
        MAKE_IN(TVX, svx, dt, tvx, 0, 1);
        MAKE_ROW_OUT(JO, so, dt, 0);
        MAKE_ROW_OUT(JL, sl, lt, 1);
        MAKE_ROW_OUT(JTO, so, dt, 0);
        MAKE_ROW_OUT(JTL, sl, lt, 1);
        const int t0 = use_t & 1, t1 = (use_t >> 1) & 1 && has_k, t2 = (use_t >> 2) & 1 && has_k,
                  t3 = (use_t >> 3) & 1 && has_x, t4 = (use_t >> 4) & 1 && has_x;
        nbhd_forward_jvp_args a = {Q.t, tK, tV, tKX, tVX,
                                   t0 ? TQ.t : fz_none(), t1 ? TK.t : fz_none(), t2 ? TV.t : fz_none(),
                                   t3 ? TKX.t : fz_none(), t4 ? TVX.t : fz_none(),
                                   JO.t, JL.t, JTO.t, JTL.t, tR, {0}};
        fz_workspace(p, NBHD_OP_FORWARD_JVP, e);
        nbhd_tensor *req[4] = {&a.t_out, &a.t_lse, &a.out, has_k ? &a.v : &a.q};
        if (mode == 1) {
            req[victim % 4]->data = NULL;
            FZ_CHECK(nbhd_forward_jvp(p, &a, e) == NBHD_ERR_ARG, "forward_jvp accepted a NULL tensor");
        } else if (mode == 2 && e->workspace_bytes) {
            e->workspace_bytes--;
            FZ_CHECK(nbhd_forward_jvp(p, &a, e) == NBHD_ERR_WORKSPACE, "forward_jvp accepted a short workspace");
        } else if (mode == 3 && fz_shrink(req[victim % 4], &tiny)) {
            FZ_SHORT(nbhd_forward_jvp(p, &a, e), "forward_jvp");
        } else {
            FZ_CHECK(nbhd_forward_jvp(p, &a, e) == NBHD_OK, "forward_jvp failed");
            const int64_t no = dims_count(so), nl = dims_count(sl);
            double *jo = dense_alloc(no), *jl = dense_alloc(nl), *jto = dense_alloc(no), *jtl = dense_alloc(nl);
            naive_forward_jvp(p, q, k, v, kx, vx, t0 ? tq : NULL, t1 ? tk : NULL, t2 ? tv : NULL,
                              t3 ? tkx : NULL, t4 ? tvx : NULL, jo, jl, jto, jtl);
            fz_close(p, "forward_jvp out", &JO, jo, tol, 1);
            fz_close(p, "forward_jvp lse", &JL, jl, dt == NBHD_F64 ? 1e-12 : 1e-5 + M * 1e-7, 1);
            fz_close(p, "forward_jvp t_out", &JTO, jto, tol, 1);
            fz_close(p, "forward_jvp t_lse", &JTL, jtl, dt == NBHD_F64 ? 1e-10 : 1e-3 + M * 4e-6, 1);
            free(jo); free(jl); free(jto); free(jtl);
        }
        free(e->workspace);
        tbuf_free(&TQ); tbuf_free(&TK); tbuf_free(&TV); tbuf_free(&TKX); tbuf_free(&TVX);
        tbuf_free(&JO); tbuf_free(&JL); tbuf_free(&JTO); tbuf_free(&JTL);
        free(tq); free(tk); free(tv); free(tkx); free(tvx);
    }
    /* ---- backward through forward + JVP, from the oracle's (out, lse, tout, tlse) */
    {
        const int use_t = (int)(seed >> 16), pick = (int)(seed >> 24);
        MAKE_ROW_IN(TQ, sq, dt, tq, 0);
        MAKE_IN(TK, sk, dt, tk, 0, 1);
        MAKE_IN(TV, sv, dt, tv, 0, 1);
        MAKE_IN(TKX, skx, dt, tkx, 0, 1);
        MAKE_IN(TVX, svx, dt, tvx, 0, 1);
        const int t0 = use_t & 1, t1 = (use_t >> 1) & 1 && has_k, t2 = (use_t >> 2) & 1 && has_k,
                  t3 = (use_t >> 3) & 1 && has_x, t4 = (use_t >> 4) & 1 && has_x;
        const int64_t no = dims_count(so), nl = dims_count(sl);
        double *jo = dense_alloc(no), *jl = dense_alloc(nl), *jto = dense_alloc(no), *jtl = dense_alloc(nl);
        naive_forward_jvp(p, q, k, v, kx, vx, t0 ? tq : NULL, t1 ? tk : NULL, t2 ? tv : NULL,
                          t3 ? tkx : NULL, t4 ? tvx : NULL, jo, jl, jto, jtl);
        MAKE_IN(Oi, so, dt, o_in, 0, 0);
        memcpy(o_in, jo, sizeof(double) * (size_t)no);
        fz_fill_rows(p, &Oi, o_in);
        MAKE_IN(Li, sl, lt, l_in, 1, 0);
        memcpy(l_in, jl, sizeof(double) * (size_t)nl);
        fz_fill_rows(p, &Li, l_in);
        MAKE_IN(TOi, so, dt, to_in, 0, 0);
        memcpy(to_in, jto, sizeof(double) * (size_t)no);
        fz_fill_rows(p, &TOi, to_in);
        MAKE_IN(TLi, sl, lt, tl_in, 1, 0);
        memcpy(tl_in, jtl, sizeof(double) * (size_t)nl);
        fz_fill_rows(p, &TLi, tl_in);
        MAKE_ROW_IN(dO, so, dt, dout, 0);
        MAKE_ROW_IN(dL, sl, lt, dlse, 1);
        MAKE_ROW_IN(dTO, so, dt, dtout, 0);
        MAKE_ROW_IN(dTL, sl, lt, dtlse, 1);
        const int c0 = pick & 1, c1 = (pick >> 1) & 1, c2 = (pick >> 2) & 1, c3 = (pick >> 3) & 1,
                  with_dt = (pick >> 4) & 1;
        MAKE_ROW_OUT(dQ, sq, dt, 0);
        MAKE_OUT(dK, sk, dt, 0);
        MAKE_OUT(dV, sv, dt, 0);
        MAKE_OUT(dKX, skx, dt, 0);
        MAKE_OUT(dVX, svx, dt, 0);
        MAKE_ROW_OUT(dTQ, sq, dt, 0);
        MAKE_OUT(dTK, sk, dt, 0);
        MAKE_OUT(dTV, sv, dt, 0);
        MAKE_OUT(dTKX, skx, dt, 0);
        MAKE_OUT(dTVX, svx, dt, 0);
        nbhd_forward_jvp_backward_args a = {
            Q.t, tK, tV, tKX, tVX,
            t0 ? TQ.t : fz_none(), t1 ? TK.t : fz_none(), t2 ? TV.t : fz_none(),
            t3 ? TKX.t : fz_none(), t4 ? TVX.t : fz_none(),
            Oi.t, Li.t, TOi.t, TLi.t,
            c0 ? dO.t : fz_none(), c1 ? dL.t : fz_none(), c2 ? dTO.t : fz_none(), c3 ? dTL.t : fz_none(),
            dQ.t, has_k ? dK.t : fz_none(), has_k ? dV.t : fz_none(),
            has_x ? dKX.t : fz_none(), has_x ? dVX.t : fz_none(),
            with_dt ? dTQ.t : fz_none(), with_dt && has_k ? dTK.t : fz_none(),
            with_dt && has_k ? dTV.t : fz_none(), with_dt && has_x ? dTKX.t : fz_none(),
            with_dt && has_x ? dTVX.t : fz_none(), tR, {0}, {0}, {0}};
        /* exec tiles were picked from the other ops' lists; keep them only if this op lists them */
        nbhd_tile_config listed[64];
        const int32_t n_listed = nbhd_tile_configs(p, NBHD_OP_FORWARD_JVP_BACKWARD, listed, 64);
        int tile_listed = 0;
        for (int i = 0; i < n_listed && i < 64; ++i) tile_listed |= fz_tile_matches(&listed[i], e, p->rank > 0 ? p->rank : 1);
        if (!tile_listed) {
            memset(e->q_tile, 0, sizeof e->q_tile);
            memset(e->kv_tile, 0, sizeof e->kv_tile);
        }
        fz_workspace(p, NBHD_OP_FORWARD_JVP_BACKWARD, e);
        nbhd_tensor *req[5] = {&a.q, &a.t_out, &a.t_lse, &a.d_q, has_k ? &a.d_v : &a.lse};
        if (mode == 1) {
            req[victim % 5]->data = NULL;
            FZ_CHECK(nbhd_forward_jvp_backward(p, &a, e) == NBHD_ERR_ARG,
                     "forward_jvp_backward accepted a NULL tensor");
        } else if (mode == 2 && e->workspace_bytes) {
            e->workspace_bytes--;
            FZ_CHECK(nbhd_forward_jvp_backward(p, &a, e) == NBHD_ERR_WORKSPACE,
                     "forward_jvp_backward accepted a short workspace");
        } else if (mode == 3 && fz_shrink(req[victim % 5], &tiny)) {
            FZ_SHORT(nbhd_forward_jvp_backward(p, &a, e), "forward_jvp_backward");
        } else {
            FZ_CHECK(nbhd_forward_jvp_backward(p, &a, e) == NBHD_OK, "forward_jvp_backward failed");
            const int64_t nq = dims_count(sq), nk = dims_count(sk), nv = dims_count(sv),
                          nkx = dims_count(skx), nvx = dims_count(svx);
            double *want[10], *scale[10];
            const int64_t sizes[10] = {nq, nk, nv, nkx, nvx, nq, nk, nv, nkx, nvx};
            for (int i = 0; i < 10; ++i) {
                want[i] = dense_alloc(sizes[i] > 0 ? sizes[i] : 1);
                scale[i] = dense_alloc(sizes[i] > 0 ? sizes[i] : 1);
            }
            const naive_jvp_backward_in in = {
                q, k, v, kx, vx, t0 ? tq : NULL, t1 ? tk : NULL, t2 ? tv : NULL, t3 ? tkx : NULL,
                t4 ? tvx : NULL, o_in, to_in, tl_in, c0 ? dout : NULL, c1 ? dlse : NULL,
                c2 ? dtout : NULL, c3 ? dtlse : NULL};
            for (int absolute = 0; absolute < 2; ++absolute) {
                double **w = absolute ? scale : want;
                naive_forward_jvp_backward(p, &in, absolute, w[0], has_k ? w[1] : NULL,
                                           has_k ? w[2] : NULL, has_x ? w[3] : NULL,
                                           has_x ? w[4] : NULL, with_dt ? w[5] : NULL,
                                           with_dt && has_k ? w[6] : NULL,
                                           with_dt && has_k ? w[7] : NULL,
                                           with_dt && has_x ? w[8] : NULL,
                                           with_dt && has_x ? w[9] : NULL);
            }
            /* every gradient is a sum of signed terms: its error scales with the terms' sizes */
            double terms = 0;
            for (int i = 0; i < 10; ++i)
                for (int64_t j = 0; j < sizes[i]; ++j)
                    if (scale[i][j] > terms) terms = scale[i][j];
            const double saved_magnitude = fz_magnitude;
            fz_magnitude = terms > 0 ? terms : 1e-300;
            const tbuf *got[10] = {&dQ, &dK, &dV, &dKX, &dVX, &dTQ, &dTK, &dTV, &dTKX, &dTVX};
            static const char *names[10] = {
                "backward_jvp dq", "backward_jvp dk", "backward_jvp dv", "backward_jvp dkx",
                "backward_jvp dvx", "backward_jvp dtq", "backward_jvp dtk", "backward_jvp dtv",
                "backward_jvp dtkx", "backward_jvp dtvx"};
            for (int i = 0; i < 10; ++i) {
                const int present = (i % 5 == 0 || ((i % 5 == 1 || i % 5 == 2) ? has_k : has_x)) &&
                                    (i < 5 || with_dt);
                if (present) fz_close(p, names[i], got[i], want[i], grad_tol, i % 5 == 0);
            }
            fz_magnitude = saved_magnitude;
            for (int i = 0; i < 10; ++i) { free(want[i]); free(scale[i]); }
        }
        free(e->workspace);
        tbuf_free(&TQ); tbuf_free(&TK); tbuf_free(&TV); tbuf_free(&TKX); tbuf_free(&TVX);
        tbuf_free(&Oi); tbuf_free(&Li); tbuf_free(&TOi); tbuf_free(&TLi);
        tbuf_free(&dO); tbuf_free(&dL); tbuf_free(&dTO); tbuf_free(&dTL);
        tbuf_free(&dQ); tbuf_free(&dK); tbuf_free(&dV); tbuf_free(&dKX); tbuf_free(&dVX);
        tbuf_free(&dTQ); tbuf_free(&dTK); tbuf_free(&dTV); tbuf_free(&dTKX); tbuf_free(&dTVX);
        free(tq); free(tk); free(tv); free(tkx); free(tvx); free(jo); free(jl); free(jto); free(jtl);
        free(o_in); free(l_in); free(to_in); free(tl_in); free(dout); free(dlse); free(dtout); free(dtlse);
    }
    tbuf_free(&Q); tbuf_free(&K); tbuf_free(&V); tbuf_free(&KX); tbuf_free(&VX); tbuf_free(&R);
    free(q); free(k); free(v); free(kx); free(vx); free(out); free(lse); free(rpb);
    naive_bias.rpb = NULL;
#undef MAKE_IN
#undef MAKE_OUT
#undef MAKE_ROW_IN
#undef MAKE_ROW_OUT
}

/* batch 0 or heads 0: nothing to read; backward with heads 0 and batch > 0 zeroes dK/dV */
static void fz_empty(const nbhd_problem *p, nbhd_exec *e) {
    nbhd_forward_args fa;
    nbhd_forward_jvp_args ja;
    memset(&fa, 0, sizeof fa);
    memset(&ja, 0, sizeof ja);
    e->workspace = NULL;
    e->workspace_bytes = 0;
    FZ_CHECK(nbhd_workspace_bytes(p, NBHD_OP_BACKWARD, e) == 0, "empty problem asks for workspace");
    FZ_CHECK(nbhd_forward(p, &fa, e) == NBHD_OK, "empty forward failed");
    FZ_CHECK(nbhd_forward_jvp(p, &ja, e) == NBHD_OK, "empty forward_jvp failed");
    if (p->batch == 0) {
        nbhd_backward_args ba;
        memset(&ba, 0, sizeof ba);
        FZ_CHECK(nbhd_backward(p, &ba, e) == NBHD_OK, "empty backward failed");
    }
}

// ----------------------------------------------------------------------------
// what the inputs became, printed at exit (the numbers of the note)

static struct {
    long inputs, invalid, bad_range, absurd_threads, null_args, device_refused, empty, too_large,
        computed, null_tensor, short_workspace, short_tensor, ranged;
} fz_count;

static void fz_report(void) {
    fprintf(stderr,
            "fuzz_api: %ld inputs: %ld invalid problems (all refused; %ld only for their query "
            "range), %ld absurd thread counts (refused), %ld NULL-args probes, %ld CUDA problems "
            "refused, %ld empty (batch or heads 0), %ld valid but too large to allocate (workspace "
            "size only), %ld computed and checked against naive.h (%ld with one required tensor "
            "NULL, %ld with a short workspace, %ld with a tensor past its allocation: refused; %ld "
            "with a query range)\n",
            fz_count.inputs, fz_count.invalid, fz_count.bad_range, fz_count.absurd_threads,
            fz_count.null_args, fz_count.device_refused, fz_count.empty, fz_count.too_large,
            fz_count.computed, fz_count.null_tensor, fz_count.short_workspace,
            fz_count.short_tensor, fz_count.ranged);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (fz_count.inputs++ == 0 && !fz_input_name) atexit(fz_report);
    fz_reader rd = {data, size};
    nbhd_problem prob;
    nbhd_problem *p = &prob;
    memset(p, 0, sizeof *p);
    p->rank = fz_i32(&rd, 0, 3);
    for (int a = 0; a < 3; ++a) {
        p->extent[a] = fz_i64(&rd, 1, 14);
        p->kernel[a] = fz_i32(&rd, 2, 7);
        p->stride[a] = fz_i32(&rd, 1, 4);
        p->dilation[a] = fz_i32(&rd, 1, 3);
        const uint8_t c = fz_u8(&rd);
        p->causal[a] = c >= 250 ? c : (c & 1);
    }
    p->batch = fz_i64(&rd, 0, 2);
    p->extra_kv = fz_i64(&rd, 0, 4);
    p->kv_heads = fz_i32(&rd, 1, 3);
    const int32_t group = fz_i32(&rd, 0, 3);
    const int64_t heads_raw = (int64_t)p->kv_heads * group;  /* extremes: the raw group */
    p->heads = heads_raw >= INT32_MIN && heads_raw <= INT32_MAX ? (int32_t)heads_raw : group;
    p->head_dim = fz_i32(&rd, 1, 12);
    p->head_dim_v = fz_i32(&rd, 1, 12);
    p->scale = fz_scale(&rd, p->head_dim);
    const uint8_t tb = fz_u8(&rd);
    p->dtype = tb >= 250 ? (nbhd_dtype)(int)(tb - 252) : (nbhd_dtype)(tb % 4);
    const uint8_t dev = fz_u8(&rd);
    p->device = dev >= 250 ? (nbhd_device)(int)(dev - 249) : NBHD_CPU;  /* 1 (CUDA) .. 6 */
    const uint8_t flags = fz_u8(&rd);
    p->rpb = (flags >> 2) % 4 == 3;    /* one in four with a relative positional bias */
    if (flags % 4 != 0) fz_repair(p);  /* three in four inputs become valid problems */

    nbhd_exec e;
    memset(&e, 0, sizeof e);
    e.threads = fz_i32(&rd, -1, 3);
    /* |threads| > 1024 is refused by every entry point; < 0 means "up to -threads" */
    const int absurd_threads = e.threads > 1024 || e.threads < -1024;
    if (e.threads > 8 && !absurd_threads) e.threads = 8;   /* valid, but slow to fuzz with */
    if (e.threads < -8 && !absurd_threads) e.threads = -8;
    e.use_reference = fz_u8(&rd) & 1;
    e.kv_parallel = fz_u8(&rd) & 1;
    for (int a = 0; a < 3; ++a) {
        e.q_tile[a] = fz_u8(&rd) < 200 ? 0 : fz_i32(&rd, 1, 16);
        e.kv_tile[a] = fz_u8(&rd) < 200 ? 0 : fz_i32(&rd, 1, 16);
    }
    const uint8_t mode = fz_u8(&rd) % 8, victim = fz_u8(&rd);
    uint64_t seed = 0;
    for (int i = 0; i < 8; ++i) seed = seed << 8 | fz_u8(&rd);
    fz_range(&rd, p);

    /* a query range makes a problem invalid exactly when it breaks nbhd.h's rule */
    nbhd_problem whole = *p;
    memset(whole.query_begin, 0, sizeof whole.query_begin);
    memset(whole.query_end, 0, sizeof whole.query_end);
    const int whole_valid = nbhd_validate(&whole) == NBHD_OK, valid = nbhd_validate(p) == NBHD_OK;
    FZ_CHECK(valid == (whole_valid && fz_range_ok(p)), "validate %s the query range",
             valid ? "accepted" : "refused");
    if (!valid) {
        fz_count.invalid++;
        fz_count.bad_range += whole_valid;
        fz_invalid(p, &e);
        return 0;
    }
    if (absurd_threads) {
        fz_count.absurd_threads++;
        nbhd_forward_args fa;
        nbhd_backward_args ba;
        nbhd_forward_jvp_args ja;
        memset(&fa, 0, sizeof fa);
        memset(&ba, 0, sizeof ba);
        memset(&ja, 0, sizeof ja);
        FZ_CHECK(nbhd_forward(p, &fa, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "threads"),
                 "forward accepted threads=%d", e.threads);
        FZ_CHECK(nbhd_backward(p, &ba, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "threads"),
                 "backward accepted threads=%d", e.threads);
        FZ_CHECK(nbhd_forward_jvp(p, &ja, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "threads"),
                 "forward_jvp accepted threads=%d", e.threads);
        return 0;
    }
    /* a valid problem: the same answer from every entry point, whatever the mode */
    if (mode == 7) {  /* NULL args are rejected, NULL exec is the default */
        fz_count.null_args++;
        FZ_CHECK(nbhd_forward(p, NULL, &e) == NBHD_ERR_ARG, "forward accepted NULL args");
        FZ_CHECK(nbhd_backward(p, NULL, &e) == NBHD_ERR_ARG, "backward accepted NULL args");
        FZ_CHECK(nbhd_forward_jvp(p, NULL, NULL) == NBHD_ERR_ARG, "forward_jvp accepted NULL args");
    }
    if (p->device == NBHD_CPU) fz_tiles(p, &e);
    if (p->device != NBHD_CPU) {  /* host buffers only: a CPU-only build must refuse */
        fz_count.device_refused++;
        if (!nbhd_has_cuda() && p->batch > 0 && p->heads > 0) {
            unsigned char *byte = (unsigned char *)malloc(1);
            nbhd_tensor t = fz_none();
            t.data = byte;
            nbhd_forward_args fa = {t, t, t, t, t, t, t, {0}};
            e.workspace = NULL;
            e.workspace_bytes = 0;
            memset(e.q_tile, 0, sizeof e.q_tile);  /* tiles are checked first: not this case */
            memset(e.kv_tile, 0, sizeof e.kv_tile);
            FZ_CHECK(nbhd_forward(p, &fa, &e) == NBHD_ERR_UNSUPPORTED, "CUDA problem on a CPU-only build");
            free(byte);
        }
        return 0;
    }
    if (p->batch == 0 || p->heads == 0) {
        fz_count.empty++;
        fz_empty(p, &e);
        if (p->batch == 0) return 0;
    }
    const int64_t T = naive_tokens(p), width = p->head_dim > p->head_dim_v ? p->head_dim : p->head_dim_v;
    const int64_t heads = p->heads > p->kv_heads ? p->heads : p->kv_heads;
    const double cost = (double)p->batch * (double)T * (double)heads * (double)(T + p->extra_kv) * (double)width;
    if (T > 1024 || (double)p->batch * (double)(T + p->extra_kv) * (double)heads * (double)width > 2e4 ||
        cost > 3e5) {
        fz_count.too_large++;
        for (int op = 0; op < 3; ++op) (void)nbhd_workspace_bytes(p, (nbhd_op)op, &e);
        return 0;
    }
    const int m = (mode == 1 || mode == 2 || mode == 3) && p->heads > 0 ? mode : 0;
    fz_count.computed++;
    fz_count.null_tensor += m == 1;
    fz_count.short_workspace += m == 2;
    fz_count.short_tensor += m == 3;
    fz_count.ranged += fz_has_range(p);
    fz_compute(p, &e, m, victim, seed);
    return 0;
}
