/*
 * api.c — the public entry points: validation of every descriptor rule (docs/design.md §1), the
 * checks of tensors, exec, tiles and workspace, then dispatch through the problem's device's
 * table of operations (nbhd_device_ops, internal.h). Errors are errors.c's; nothing here
 * touches tensor data.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

const char *nbhd_version(void) { return "0.1.0"; }

size_t nbhd_dtype_size(nbhd_dtype t) {
    switch (t) {
    case NBHD_F64: return 8;
    case NBHD_F32: return 4;
    case NBHD_F16: case NBHD_BF16: return 2;
    }
    return 0;
}

// ----------------------------------------------------------------------------
// devices: each entry point calls its op in the table of the problem's device

/* The table of a validated device, or NULL where this build has none (CUDA without nvcc). */
static const nbhd_device_ops *device_ops(nbhd_device device) {
#ifdef NBHD_WITH_CUDA
    static const nbhd_device_ops *const tables[] = {[NBHD_CPU] = &nbhd_cpu_ops, [NBHD_CUDA] = &nbhd_cuda_ops};
#else
    static const nbhd_device_ops *const tables[] = {[NBHD_CPU] = &nbhd_cpu_ops, [NBHD_CUDA] = NULL};
#endif
    return tables[device];
}

int nbhd_has_cuda(void) { return device_ops(NBHD_CUDA) != NULL; }

static nbhd_status no_device(void) {
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "this build of nbhd has no CUDA kernels (nvcc was not found when it was built)");
}

static nbhd_status no_kernel(const nbhd_device_ops *ops, const char *op) {
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "%s has no %s kernel yet", op, ops->name);
}

/* ops->fn(args...) for the problem's device, or the refusal of a device or op the build lacks */
#define DISPATCH(device, fn, ...)                                                              \
    do {                                                                                       \
        const nbhd_device_ops *ops_ = device_ops(device);                                      \
        if (!ops_) return no_device();                                                         \
        if (!ops_->fn) return no_kernel(ops_, #fn);                                            \
        return ops_->fn(__VA_ARGS__);                                                          \
    } while (0)

// ----------------------------------------------------------------------------
// validation: one rule per check, the message names the field, the value and the rule

/* Products of sizes must not overflow int64 indexing. */
#define NBHD_MAX_COUNT ((int64_t)1 << 56)

/* a*b*c*d for non-negative factors, saturated at NBHD_MAX_COUNT + 1 (0 if any factor is 0). */
static int64_t count_product(int64_t a, int64_t b, int64_t c, int64_t d) {
    const int64_t f[4] = {a, b, c, d};
    int64_t n = 1;
    for (int i = 0; i < 4; ++i) if (f[i] == 0) return 0;
    for (int i = 0; i < 4; ++i) {
        if (f[i] > NBHD_MAX_COUNT / n) return NBHD_MAX_COUNT + 1;
        n *= f[i];
    }
    return n;
}

nbhd_status nbhd_validate(const nbhd_problem *p) {
    if (!p) return nbhd_fail(NBHD_ERR_ARG, "problem is NULL");
    if (p->rank < 0 || p->rank > NBHD_MAX_RANK)
        return nbhd_fail_rule(NBHD_ERR_ARG, "0 <= rank <= 3", "rank=%d is invalid", p->rank);
    if ((unsigned)p->dtype > NBHD_BF16)
        return nbhd_fail_rule(NBHD_ERR_ARG, "NBHD_F64..NBHD_BF16", "dtype=%d is invalid", (int)p->dtype);
    if ((unsigned)p->device > NBHD_CUDA)
        return nbhd_fail_rule(NBHD_ERR_ARG, "NBHD_CPU or NBHD_CUDA", "device=%d is invalid", (int)p->device);
    if (p->batch < 0 || p->batch > NBHD_MAX_COUNT)
        return nbhd_fail_rule(NBHD_ERR_ARG, "0 <= batch < 2^56", "batch=%lld is invalid", (long long)p->batch);
    if (p->heads < 0 || p->kv_heads < 1)
        return nbhd_fail_rule(NBHD_ERR_ARG, "heads >= 0, kv_heads >= 1", "heads=%d, kv_heads=%d are invalid",
                         p->heads, p->kv_heads);
    if (p->heads % p->kv_heads != 0)
        return nbhd_fail(NBHD_ERR_ARG, "heads=%d is not a multiple of kv_heads=%d (GQA/MQA need heads %% kv_heads == 0)",
                         p->heads, p->kv_heads);
    if (p->head_dim < 1 || p->head_dim_v < 1)
        return nbhd_fail_rule(NBHD_ERR_ARG, ">= 1", "head_dim=%d, head_dim_v=%d are invalid",
                         p->head_dim, p->head_dim_v);
    if (!isfinite(p->scale))
        return nbhd_fail_rule(NBHD_ERR_ARG, "a finite number", "scale=%g is invalid", p->scale);
    if (p->dtype != NBHD_F64 && fabs(p->scale) > FLT_MAX)  /* scores are float: inf - inf */
        return nbhd_fail(NBHD_ERR_ARG, "scale=%g is out of range for a float32/float16/bfloat16 problem "
                         "(need |scale| <= 3.4e38: scores are computed in float)", p->scale);
    if (p->extra_kv < 0 || p->extra_kv > NBHD_MAX_COUNT)
        return nbhd_fail_rule(NBHD_ERR_ARG, "0 <= extra_kv < 2^56", "extra_kv=%lld is invalid", (long long)p->extra_kv);
    if (p->rank == 0) {
        if (p->extent[0] < 1 || p->extent[0] > NBHD_MAX_COUNT)
            return nbhd_fail_rule(NBHD_ERR_ARG, ">= 1 queries", "extent[0]=%lld is invalid for rank 0",
                             (long long)p->extent[0]);
        if (p->extra_kv < 1)
            return nbhd_fail(NBHD_ERR_ARG, "rank 0 (dense attention) needs extra_kv >= 1 keys, got %lld",
                             (long long)p->extra_kv);
    }
    int64_t tokens = 1;
    for (int a = 0; a < p->rank; ++a) {
        const int64_t L = p->extent[a];
        const int32_t K = p->kernel[a], s = p->stride[a], d = p->dilation[a];
        if (L < 1 || L > NBHD_MAX_COUNT)
            return nbhd_fail_rule(NBHD_ERR_ARG, "1 <= extent < 2^56", "extent[%d]=%lld is invalid", a, (long long)L);
        if (K < 2)
            return nbhd_fail_rule(NBHD_ERR_ARG, "kernel >= 2", "kernel[%d]=%d is invalid", a, K);
        if (d < 1)
            return nbhd_fail_rule(NBHD_ERR_ARG, "dilation >= 1", "dilation[%d]=%d is invalid", a, d);
        if ((int64_t)K * d > L)
            return nbhd_fail(NBHD_ERR_ARG,
                             "kernel[%d]=%d with dilation %d exceeds extent %lld on axis %d (need kernel*dilation <= extent)",
                             a, K, d, (long long)L, a);
        if (s < 1 || s > K)
            return nbhd_fail(NBHD_ERR_ARG, "stride[%d]=%d is invalid (need 1 <= stride <= kernel=%d)", a, s, K);
        if (p->causal[a] > 1)
            return nbhd_fail_rule(NBHD_ERR_ARG, "0 or 1", "causal[%d]=%d is invalid", a, p->causal[a]);
        if (L > NBHD_MAX_COUNT / tokens)  /* tokens*L > 2^56, checked without overflowing */
            return nbhd_fail(NBHD_ERR_ARG, "extent product over axes 0..%d exceeds 2^56 tokens", a);
        tokens *= L;
    }
    if (p->rank == 0) tokens = p->extent[0];
    for (int a = 0; a < NBHD_MAX_RANK; ++a) {
        const int64_t b = p->query_begin[a], e = p->query_end[a];
        if (b == 0 && e == 0) continue;
        if (a >= p->rank)
            return nbhd_fail(NBHD_ERR_ARG, "query_begin[%d]=%lld, query_end[%d]=%lld on an axis past rank %d "
                             "(need both 0)", a, (long long)b, a, (long long)e, p->rank);
        if (b < 0 || b >= e || e > p->extent[a])
            return nbhd_fail(NBHD_ERR_ARG, "query range [%lld, %lld) on axis %d is invalid (need both 0, or "
                             "0 <= query_begin < query_end <= extent=%lld)", (long long)b, (long long)e, a,
                             (long long)p->extent[a]);
    }
    if (p->rpb != 0 && p->rpb != 1)
        return nbhd_fail_rule(NBHD_ERR_ARG, "0 or 1", "rpb=%d is invalid", p->rpb);
    if (p->rpb && p->rank == 0)
        return nbhd_fail(NBHD_ERR_ARG, "rpb=1 needs a window (rank >= 1); rank 0 has only additional keys, "
                         "which get no bias");
    for (int a = 0; p->rpb && a < p->rank; ++a)
        if (p->causal[a])
            return nbhd_fail(NBHD_ERR_ARG, "rpb=1 with causal[%d]=1: a relative positional bias is undefined "
                             "with causal masking (need no causal axis)", a);
    /* every tensor's element count (and each kernel's row count) must fit int64 indexing */
    const int64_t width = p->head_dim > p->head_dim_v ? p->head_dim : p->head_dim_v;
    const int64_t heads = p->heads > p->kv_heads ? p->heads : p->kv_heads;
    const int64_t n_window = count_product(p->batch, tokens, heads, width);
    const int64_t n_extra = count_product(p->batch, p->extra_kv, p->kv_heads, width);
    if (n_window > NBHD_MAX_COUNT || n_extra > NBHD_MAX_COUNT)
        return nbhd_fail(NBHD_ERR_ARG,
                         "batch=%lld x tokens=%lld (or extra_kv=%lld) x heads=%lld x head_dim=%lld "
                         "exceeds 2^56 elements in one tensor",
                         (long long)p->batch, (long long)tokens, (long long)p->extra_kv,
                         (long long)heads, (long long)width);
    return NBHD_OK;
}

nbhd_geometry nbhd_geometry_of(const nbhd_problem *p) {
    nbhd_geometry g;
    g.tokens = 1;
    g.query_range = 0;
    for (int a = 0; a < NBHD_MAX_RANK; ++a) {
        nbhd_axis ax = {1, 1, 1, 1, 0, 0, 1};
        if (a < p->rank) {
            const int whole = p->query_begin[a] == 0 && p->query_end[a] == 0;
            ax = (nbhd_axis){p->extent[a], p->kernel[a], p->stride[a], p->dilation[a], p->causal[a],
                             whole ? 0 : p->query_begin[a], whole ? p->extent[a] : p->query_end[a]};
            g.query_range |= !whole;
        }
        g.axis[a] = ax;
        g.tokens *= ax.extent;
    }
    g.has_window = p->rank > 0;
    if (p->rank == 0) {
        /* dense: queries along axis 0, no neighborhood keys */
        g.axis[0].extent = g.axis[0].query_end = p->extent[0];
        g.tokens = p->extent[0];
    }
    g.batch = p->batch;
    g.extra_kv = p->extra_kv;
    g.heads = p->heads;
    g.kv_heads = p->kv_heads;
    g.head_dim = p->head_dim;
    g.head_dim_v = p->head_dim_v;
    g.group = p->kv_heads > 0 ? p->heads / p->kv_heads : 1;
    g.scale = p->scale;
    g.dtype = p->dtype;
    g.rpb = p->rpb;
    g.rpb_entries = 1;
    for (int a = NBHD_MAX_RANK - 1; a >= 0; --a) {  /* row-major: the last axis steps by 1 */
        g.rpb_stride[a] = g.rpb_entries;
        g.rpb_entries *= 2 * (int64_t)g.axis[a].kernel - 1;
    }
    return g;
}

// ----------------------------------------------------------------------------
// tensor checks: every tensor an op reads or writes has data, and its view addresses only
// elements it owns (nbhd_tensor)

#define NEED(t, name)                                                                       \
    do {                                                                                    \
        if (!(t).data) return nbhd_fail(NBHD_ERR_ARG, "tensor %s has no data (NULL)", name); \
    } while (0)

static int is_empty(const nbhd_geometry *g) { return g->batch == 0 || g->heads == 0; }

/* The extents of a tensor's 6-D view (nbhd.h legend); width 0: a row tensor (LSE), stride[5]
 * unused. */
typedef struct { int64_t n[6]; size_t esize; } tensor_view;

/* [B, X, Y, Z, heads, width] of a spatial tensor, or [B, S, 1, 1, heads, width] of an extra-key
 * tensor (extra = 1); rank 0's queries are [B, S_q, 1, 1, heads, width] */
static tensor_view view_of(const nbhd_geometry *g, int extra, int64_t heads, int64_t width,
                           size_t esize) {
    tensor_view v = {{g->batch, 1, 1, 1, heads, width ? width : 1}, esize};
    if (extra) v.n[1] = g->extra_kv;
    else for (int a = 0; a < 3; ++a) v.n[1 + a] = g->axis[a].extent;
    return v;
}

/* t's largest addressed element, or a rejection naming `name` and the rule */
static nbhd_status check_view(const nbhd_tensor *t, const char *name, const tensor_view *v) {
    if (t->elements < 0)
        return nbhd_fail_rule(NBHD_ERR_ARG, ">= 0; 0: not checked", "%s: elements=%lld is invalid", name,
                         (long long)t->elements);
    int64_t last = 0;
    int big = 0;   /* the axis with the largest contribution, for the message */
    int64_t big_part = -1;
    for (int i = 0; i < 6; ++i) {
        if (v->n[i] == 0) return NBHD_OK;   /* no element addressed */
        if (v->n[i] == 1) continue;
        const int64_t s = t->stride[i], steps = v->n[i] - 1;
        if (s < 0)
            return nbhd_fail(NBHD_ERR_ARG, "%s: stride[%d]=%lld is negative (need >= 0 on an axis of extent %lld)",
                             name, i, (long long)s, (long long)v->n[i]);
        if (s > 0 && steps > (INT64_MAX - last) / s)
            return nbhd_fail(NBHD_ERR_ARG,
                             "%s: stride[%d]=%lld x extent %lld overflows 64-bit element offsets", name, i,
                             (long long)s, (long long)v->n[i]);
        last += steps * s;
        if (steps * s > big_part) { big_part = steps * s; big = i; }
    }
    if (last >= INT64_MAX / (int64_t)v->esize)
        return nbhd_fail(NBHD_ERR_ARG, "%s: element %lld is past 64-bit byte offsets", name, (long long)last);
    if (t->elements > 0 && last >= t->elements)
        return nbhd_fail(NBHD_ERR_ARG,
                         "%s: stride[%d]=%lld addresses element %lld past its %lld elements (view [%lld, %lld, "
                         "%lld, %lld, %lld, %lld], strides [%lld, %lld, %lld, %lld, %lld, %lld])",
                         name, big, (long long)t->stride[big], (long long)last, (long long)t->elements,
                         (long long)v->n[0], (long long)v->n[1], (long long)v->n[2], (long long)v->n[3],
                         (long long)v->n[4], (long long)v->n[5], (long long)t->stride[0],
                         (long long)t->stride[1], (long long)t->stride[2], (long long)t->stride[3],
                         (long long)t->stride[4], (long long)t->stride[5]);
    return NBHD_OK;
}

/* The kinds of tensor an op takes (nbhd.h legend). */
typedef enum { T_Q, T_K, T_V, T_O, T_ROW, T_KX, T_VX } tensor_kind;

static tensor_view kind_view(const nbhd_geometry *g, tensor_kind k) {
    const size_t es = nbhd_dtype_size(g->dtype), ls = g->dtype == NBHD_F64 ? 8 : 4;
    switch (k) {
    case T_Q: return view_of(g, 0, g->heads, g->head_dim, es);
    case T_K: return view_of(g, 0, g->kv_heads, g->head_dim, es);
    case T_V: return view_of(g, 0, g->kv_heads, g->head_dim_v, es);
    case T_O: return view_of(g, 0, g->heads, g->head_dim_v, es);
    case T_ROW: return view_of(g, 0, g->heads, 0, ls);
    case T_KX: return view_of(g, 1, g->kv_heads, g->head_dim, es);
    case T_VX: return view_of(g, 1, g->kv_heads, g->head_dim_v, es);
    }
    return view_of(g, 0, 0, 0, es);
}

/* A tensor the op needs (required) or may take (optional: NULL data is absent): checked. */
static nbhd_status check_tensor(const nbhd_geometry *g, const nbhd_tensor *t, const char *name,
                                tensor_kind k, int required) {
    if (!t->data) return required ? nbhd_fail(NBHD_ERR_ARG, "tensor %s has no data (NULL)", name) : NBHD_OK;
    const tensor_view v = kind_view(g, k);
    return check_view(t, name, &v);
}

/* A bias table (rpb, t_rpb, d_rpb, d_t_rpb; nbhd.h): with problem.rpb = 0 it must be absent;
 * otherwise absent (NULL data) or contiguous [heads, M] in the LSE's element type. */
static nbhd_status check_table(const nbhd_geometry *g, const nbhd_tensor *t, const char *name) {
    if (!g->rpb)
        return t->data ? nbhd_fail(NBHD_ERR_ARG, "%s has data but problem.rpb=0 (set rpb=1 to add the bias)", name)
                       : NBHD_OK;
    if (!t->data) return NBHD_OK;
    const int64_t M = g->rpb_entries;
    if (t->stride[5] != 1 || (g->heads > 1 && t->stride[4] != M))
        return nbhd_fail(NBHD_ERR_ARG, "%s: strides [%lld, %lld] (heads, entries) are invalid: the table must be "
                         "contiguous [heads=%d, prod(2*kernel-1)=%lld] (need stride[4]=%lld, stride[5]=1)",
                         name, (long long)t->stride[4], (long long)t->stride[5], g->heads, (long long)M,
                         (long long)M);
    nbhd_tensor flat = *t;
    flat.stride[0] = flat.stride[1] = flat.stride[2] = flat.stride[3] = 0;
    const tensor_view v = {{1, 1, 1, 1, g->heads, M}, g->dtype == NBHD_F64 ? 8 : 4};
    return check_view(&flat, name, &v);
}

nbhd_status nbhd_zero_table(const nbhd_device_ops *ops, const nbhd_geometry *g, nbhd_tensor t, const nbhd_exec *e) {
    if (!g->rpb || !t.data) return NBHD_OK;
    const int64_t one[3] = {1, 1, 1};
    return ops->zero(t, 1, one, g->heads, g->rpb_entries, g->dtype == NBHD_F64 ? 8 : 4, e);
}

/* A problem with no query rows (batch 0 or heads 0) sums nothing into a table gradient. */
static nbhd_status zero_table(const nbhd_geometry *g, nbhd_device device, nbhd_tensor t, const nbhd_exec *e) {
    const nbhd_device_ops *ops = device_ops(device);
    if (!g->rpb || !t.data) return NBHD_OK;
    return ops ? nbhd_zero_table(ops, g, t, e) : no_device();
}

#define TABLE(t, name) if ((st = check_table(&g, &(t), name)) != NBHD_OK) return st

#define REQUIRE(t, name, kind) if ((st = check_tensor(&g, &(t), name, kind, 1)) != NBHD_OK) return st
#define OPTIONAL(t, name, kind) if ((st = check_tensor(&g, &(t), name, kind, 0)) != NBHD_OK) return st

static nbhd_status check_extra(const nbhd_geometry *g, nbhd_tensor kx, nbhd_tensor vx,
                               const char *kx_name, const char *vx_name) {
    nbhd_status st = NBHD_OK;
    if (g->extra_kv > 0 && (st = check_tensor(g, &kx, kx_name, T_KX, 1)) == NBHD_OK)
        st = check_tensor(g, &vx, vx_name, T_VX, 1);
    return st;
}
#define KX_NAMES "kx (additional keys)", "vx (additional values)"
#define DKX_NAMES "d_kx (gradient of additional keys)", "d_vx (gradient of additional values)"

static nbhd_status check_workspace(const nbhd_problem *p, nbhd_op op, const nbhd_exec *e) {
    const size_t need = nbhd_workspace_bytes(p, op, e);
    if (need && (!e->workspace || e->workspace_bytes < need))
        return nbhd_fail(NBHD_ERR_WORKSPACE, "workspace of %zu bytes given, %zu needed (see nbhd_workspace_bytes)",
                         e->workspace ? e->workspace_bytes : (size_t)0, need);
    return NBHD_OK;
}

static const nbhd_exec default_exec;

size_t nbhd_workspace_bytes(const nbhd_problem *p, nbhd_op op, const nbhd_exec *e) {
    if (nbhd_validate(p) != NBHD_OK) return 0;
    if ((unsigned)op > NBHD_OP_FORWARD_JVP_BACKWARD) {
        nbhd_fail_rule(NBHD_ERR_ARG, "NBHD_OP_FORWARD..NBHD_OP_FORWARD_JVP_BACKWARD", "op=%d is invalid", (int)op);
        return 0;
    }
    if (!e) e = &default_exec;
    const nbhd_geometry g = nbhd_geometry_of(p);
    if (is_empty(&g)) return 0;
    const nbhd_device_ops *ops = device_ops(p->device);
    return ops ? ops->workspace_bytes(&g, op, e) : 0;
}

/* Threads beyond this are a mistake (OpenMP aborts or crashes creating 10^5 of them). */
#define NBHD_MAX_THREADS 1024

static nbhd_status check_exec(const nbhd_exec *e) {
    if (e->threads > NBHD_MAX_THREADS || e->threads < -NBHD_MAX_THREADS)
        return nbhd_fail(NBHD_ERR_ARG, "exec threads=%d is invalid (need |threads| <= %d; 0 picks up to "
                         "OpenMP's count, < 0 up to -threads)", e->threads, NBHD_MAX_THREADS);
    return NBHD_OK;
}

// ----------------------------------------------------------------------------
// tile configurations: the kernels list what they accept, the entry points check exec's tiles

#define NBHD_MAX_TILE_CONFIGS 64

int32_t nbhd_tile_configs(const nbhd_problem *p, nbhd_op op, nbhd_tile_config *out, int32_t max) {
    if (nbhd_validate(p) != NBHD_OK) return -1;
    if ((unsigned)op > NBHD_OP_FORWARD_JVP_BACKWARD) {
        nbhd_fail_rule(NBHD_ERR_ARG, "NBHD_OP_FORWARD..NBHD_OP_FORWARD_JVP_BACKWARD", "op=%d is invalid", (int)op);
        return -1;
    }
    if (max < 0 || (max > 0 && !out)) {
        nbhd_fail_rule(NBHD_ERR_ARG, "max >= 0 and out != NULL when max > 0", "max=%d with out=%p is invalid",
                  max, (void *)out);
        return -1;
    }
    const nbhd_geometry g = nbhd_geometry_of(p);
    if (max > 0) memset(out, 0, (size_t)max * sizeof *out);
    const nbhd_device_ops *ops = device_ops(p->device);
    return ops ? ops->tile_configs(&g, p->rank, op, out, max) : 0;
}

static int tile_matches(const nbhd_tile_config *c, const nbhd_exec *e, int32_t rank) {
    for (int a = 0; a < rank; ++a) {
        if (e->q_tile[a] && e->q_tile[a] != c->q_tile[a]) return 0;
        if (e->kv_tile[a] && e->kv_tile[a] != c->kv_tile[a]) return 0;
    }
    return 1;
}

static int format_tile(char *buf, size_t n, const int32_t *t, int32_t rank) {
    int w = snprintf(buf, n, "(");
    for (int a = 0; a < rank && (size_t)w < n; ++a)
        w += snprintf(buf + w, n - (size_t)w, a ? ", %d" : "%d", t[a]);
    if ((size_t)w < n) w += snprintf(buf + w, n - (size_t)w, ")");
    return w;
}

/* exec's tiles, checked against the kernels' list and completed to a whole configuration (a
 * partly given pair takes the first listed configuration that matches it) in *resolved. All
 * zero, or exec.use_reference (untiled scalar kernels), leaves exec as it is. */
static nbhd_status resolve_tiles(const nbhd_problem *p, nbhd_op op, const nbhd_exec *e,
                                 nbhd_exec *resolved) {
    *resolved = *e;
    const int32_t rank = p->rank > 0 ? p->rank : 1;
    int any = 0;
    for (int a = 0; a < NBHD_MAX_RANK; ++a) {
        const int32_t q = e->q_tile[a], kv = e->kv_tile[a];
        if (q < 0 || kv < 0 || (a >= rank && (q || kv)))
            return nbhd_fail(NBHD_ERR_ARG, "exec q_tile[%d]=%d, kv_tile[%d]=%d are invalid (need >= 0, and 0 past rank %d)",
                             a, q, a, kv, rank);
        any |= q | kv;
    }
    if (!any || e->use_reference) return NBHD_OK;
    nbhd_tile_config list[NBHD_MAX_TILE_CONFIGS];
    const int32_t count = nbhd_tile_configs(p, op, list, NBHD_MAX_TILE_CONFIGS);
    const int32_t shown = count < NBHD_MAX_TILE_CONFIGS ? count : NBHD_MAX_TILE_CONFIGS;
    for (int i = 0; i < shown; ++i)
        if (tile_matches(&list[i], e, rank)) {
            memcpy(resolved->q_tile, list[i].q_tile, sizeof list[i].q_tile);
            memcpy(resolved->kv_tile, list[i].kv_tile, sizeof list[i].kv_tile);
            return NBHD_OK;
        }
    char q[64], kv[64], first[64] = "none";
    format_tile(q, sizeof q, e->q_tile, rank);
    format_tile(kv, sizeof kv, e->kv_tile, rank);
    if (shown > 0) {
        int w = format_tile(first, sizeof first, list[0].q_tile, rank);
        if ((size_t)w < sizeof first) w += snprintf(first + w, sizeof first - (size_t)w, " x ");
        if ((size_t)w < sizeof first) format_tile(first + w, sizeof first - (size_t)w, list[0].kv_tile, rank);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED,
                     "exec q_tile=%s, kv_tile=%s is not a tile configuration of the %s kernels for this "
                     "problem (%d listed by nbhd_tile_configs, the default %s)",
                     q, kv, p->device == NBHD_CPU ? "CPU" : "CUDA", count, first);
}

/* What every entry point checks first: the problem, the args pointer, the exec (NULL: the
 * defaults) and its tiles; *e then points at `tiled`, the exec with the tiles resolved. */
static nbhd_status enter(const nbhd_problem *p, const void *args, nbhd_op op, const nbhd_exec **e,
                         nbhd_exec *tiled) {
    nbhd_status st = nbhd_validate(p);
    if (st != NBHD_OK) return st;
    if (!args) return nbhd_fail(NBHD_ERR_ARG, "args is NULL");
    if (!*e) *e = &default_exec;
    if ((st = check_exec(*e)) != NBHD_OK) return st;
    if ((st = resolve_tiles(p, op, *e, tiled)) != NBHD_OK) return st;
    *e = tiled;
    return NBHD_OK;
}

nbhd_status nbhd_forward(const nbhd_problem *p, const nbhd_forward_args *a, const nbhd_exec *e) {
    nbhd_exec tiled;
    nbhd_status st = enter(p, a, NBHD_OP_FORWARD, &e, &tiled);
    if (st != NBHD_OK) return st;
    const nbhd_geometry g = nbhd_geometry_of(p);
    TABLE(a->rpb, "rpb");
    if (is_empty(&g)) return NBHD_OK;
    REQUIRE(a->q, "q", T_Q); REQUIRE(a->out, "out", T_O); REQUIRE(a->lse, "lse", T_ROW);
    if (g.has_window) { REQUIRE(a->k, "k", T_K); REQUIRE(a->v, "v", T_V); }
    if ((st = check_extra(&g, a->kx, a->vx, KX_NAMES)) != NBHD_OK) return st;
    if ((st = check_workspace(p, NBHD_OP_FORWARD, e)) != NBHD_OK) return st;
    DISPATCH(p->device, forward, &g, a, e);
}

/* heads == 0 with batch > 0: no query sees any key, so dK, dV, dKx, dVx are zero (and the
 * kernels are not called with zero query heads). */
static nbhd_status backward_no_heads(const nbhd_geometry *g, const nbhd_backward_args *a,
                                     nbhd_device device, const nbhd_exec *e, const char *dk_name,
                                     const char *dv_name, const char *dkx_name, const char *dvx_name) {
    nbhd_status st;
    if (g->has_window) {
        if ((st = check_tensor(g, &a->d_k, dk_name, T_K, 1)) != NBHD_OK) return st;
        if ((st = check_tensor(g, &a->d_v, dv_name, T_V, 1)) != NBHD_OK) return st;
    }
    if ((st = check_extra(g, a->d_kx, a->d_vx, dkx_name, dvx_name)) != NBHD_OK) return st;
    const nbhd_device_ops *ops = device_ops(device);
    if (!ops) return no_device();
    const size_t es = nbhd_dtype_size(g->dtype);
    const int64_t sp[3] = {g->axis[0].extent, g->axis[1].extent, g->axis[2].extent};
    const int64_t sx[3] = {g->extra_kv, 1, 1};
    if (g->has_window) {
        if ((st = ops->zero(a->d_k, g->batch, sp, g->kv_heads, g->head_dim, es, e)) != NBHD_OK) return st;
        if ((st = ops->zero(a->d_v, g->batch, sp, g->kv_heads, g->head_dim_v, es, e)) != NBHD_OK) return st;
    }
    if (g->extra_kv > 0) {  /* extra tensors: stride[1] steps tokens, stride[2..3] unused */
        nbhd_tensor kx = a->d_kx, vx = a->d_vx;
        kx.stride[2] = kx.stride[3] = vx.stride[2] = vx.stride[3] = 0;
        if ((st = ops->zero(kx, g->batch, sx, g->kv_heads, g->head_dim, es, e)) != NBHD_OK) return st;
        if ((st = ops->zero(vx, g->batch, sx, g->kv_heads, g->head_dim_v, es, e)) != NBHD_OK) return st;
    }
    return NBHD_OK;
}

nbhd_status nbhd_backward(const nbhd_problem *p, const nbhd_backward_args *a, const nbhd_exec *e) {
    nbhd_exec tiled;
    nbhd_status st = enter(p, a, NBHD_OP_BACKWARD, &e, &tiled);
    if (st != NBHD_OK) return st;
    const nbhd_geometry g = nbhd_geometry_of(p);
    TABLE(a->rpb, "rpb"); TABLE(a->d_rpb, "d_rpb");
    if (g.batch > 0 && g.heads == 0) return backward_no_heads(&g, a, p->device, e, "d_k", "d_v", DKX_NAMES);
    if (is_empty(&g)) return zero_table(&g, p->device, a->d_rpb, e);
    REQUIRE(a->q, "q", T_Q); REQUIRE(a->out, "out", T_O); REQUIRE(a->lse, "lse", T_ROW);
    REQUIRE(a->d_out, "d_out", T_O); OPTIONAL(a->d_lse, "d_lse", T_ROW); REQUIRE(a->d_q, "d_q", T_Q);
    if (g.has_window) {
        REQUIRE(a->k, "k", T_K); REQUIRE(a->v, "v", T_V); REQUIRE(a->d_k, "d_k", T_K); REQUIRE(a->d_v, "d_v", T_V);
    }
    if ((st = check_extra(&g, a->kx, a->vx, KX_NAMES)) != NBHD_OK) return st;
    if ((st = check_extra(&g, a->d_kx, a->d_vx, DKX_NAMES)) != NBHD_OK) return st;
    if ((st = check_workspace(p, NBHD_OP_BACKWARD, e)) != NBHD_OK) return st;
    DISPATCH(p->device, backward, &g, a, e);
}

nbhd_status nbhd_forward_jvp(const nbhd_problem *p, const nbhd_forward_jvp_args *a, const nbhd_exec *e) {
    nbhd_exec tiled;
    nbhd_status st = enter(p, a, NBHD_OP_FORWARD_JVP, &e, &tiled);
    if (st != NBHD_OK) return st;
    const nbhd_geometry g = nbhd_geometry_of(p);
    TABLE(a->rpb, "rpb"); TABLE(a->t_rpb, "t_rpb");
    if (is_empty(&g)) return NBHD_OK;
    REQUIRE(a->q, "q", T_Q); REQUIRE(a->out, "out", T_O); REQUIRE(a->lse, "lse", T_ROW);
    REQUIRE(a->t_out, "t_out", T_O); REQUIRE(a->t_lse, "t_lse", T_ROW);
    OPTIONAL(a->t_q, "t_q", T_Q);
    if (g.has_window) {
        REQUIRE(a->k, "k", T_K); REQUIRE(a->v, "v", T_V); OPTIONAL(a->t_k, "t_k", T_K); OPTIONAL(a->t_v, "t_v", T_V);
    }
    if ((st = check_extra(&g, a->kx, a->vx, KX_NAMES)) != NBHD_OK) return st;
    if (g.extra_kv > 0) { OPTIONAL(a->t_kx, "t_kx", T_KX); OPTIONAL(a->t_vx, "t_vx", T_VX); }
    if ((st = check_workspace(p, NBHD_OP_FORWARD_JVP, e)) != NBHD_OK) return st;
    DISPATCH(p->device, forward_jvp, &g, a, e);
}

nbhd_status nbhd_forward_jvp_backward(const nbhd_problem *p, const nbhd_forward_jvp_backward_args *a,
                                      const nbhd_exec *e) {
    nbhd_exec tiled;
    nbhd_status st = enter(p, a, NBHD_OP_FORWARD_JVP_BACKWARD, &e, &tiled);
    if (st != NBHD_OK) return st;
    const nbhd_geometry g = nbhd_geometry_of(p);
    TABLE(a->rpb, "rpb"); TABLE(a->t_rpb, "t_rpb"); TABLE(a->d_rpb, "d_rpb"); TABLE(a->d_t_rpb, "d_t_rpb");
    if (g.batch > 0 && g.heads == 0) {  /* no query sees any key: key-side gradients are zero */
        nbhd_backward_args zero = {0};
        zero.d_k = a->d_k; zero.d_v = a->d_v; zero.d_kx = a->d_kx; zero.d_vx = a->d_vx;
        if ((st = backward_no_heads(&g, &zero, p->device, e, "d_k", "d_v", DKX_NAMES)) != NBHD_OK) return st;
        const int has_t = a->d_t_k.data || a->d_t_v.data || a->d_t_kx.data || a->d_t_vx.data;
        if (!has_t) return NBHD_OK;
        zero.d_k = a->d_t_k; zero.d_v = a->d_t_v; zero.d_kx = a->d_t_kx; zero.d_vx = a->d_t_vx;
        return backward_no_heads(&g, &zero, p->device, e, "d_t_k", "d_t_v", "d_t_kx", "d_t_vx");
    }
    if (is_empty(&g)) {
        if ((st = zero_table(&g, p->device, a->d_rpb, e)) != NBHD_OK) return st;
        return zero_table(&g, p->device, a->d_t_rpb, e);
    }
    REQUIRE(a->q, "q", T_Q); REQUIRE(a->out, "out", T_O); REQUIRE(a->lse, "lse", T_ROW);
    REQUIRE(a->t_out, "t_out", T_O); REQUIRE(a->t_lse, "t_lse", T_ROW); REQUIRE(a->d_q, "d_q", T_Q);
    OPTIONAL(a->t_q, "t_q", T_Q); OPTIONAL(a->d_out, "d_out", T_O); OPTIONAL(a->d_lse, "d_lse", T_ROW);
    OPTIONAL(a->d_t_out, "d_t_out", T_O); OPTIONAL(a->d_t_lse, "d_t_lse", T_ROW); OPTIONAL(a->d_t_q, "d_t_q", T_Q);
    if (g.has_window) {
        REQUIRE(a->k, "k", T_K); REQUIRE(a->v, "v", T_V); REQUIRE(a->d_k, "d_k", T_K); REQUIRE(a->d_v, "d_v", T_V);
        OPTIONAL(a->t_k, "t_k", T_K); OPTIONAL(a->t_v, "t_v", T_V);
        OPTIONAL(a->d_t_k, "d_t_k", T_K); OPTIONAL(a->d_t_v, "d_t_v", T_V);
    }
    if ((st = check_extra(&g, a->kx, a->vx, KX_NAMES)) != NBHD_OK) return st;
    if ((st = check_extra(&g, a->d_kx, a->d_vx, DKX_NAMES)) != NBHD_OK) return st;
    if (g.extra_kv > 0) {
        OPTIONAL(a->t_kx, "t_kx", T_KX); OPTIONAL(a->t_vx, "t_vx", T_VX);
        OPTIONAL(a->d_t_kx, "d_t_kx", T_KX); OPTIONAL(a->d_t_vx, "d_t_vx", T_VX);
    }
    if ((st = check_workspace(p, NBHD_OP_FORWARD_JVP_BACKWARD, e)) != NBHD_OK) return st;
    DISPATCH(p->device, forward_jvp_backward, &g, a, e);
}

// ----------------------------------------------------------------------------
// merge of partial attentions

nbhd_status nbhd_merge(const nbhd_merge_problem *p, const nbhd_merge_args *a, const nbhd_exec *e) {
    if (!p) return nbhd_fail(NBHD_ERR_ARG, "merge problem is NULL");
    if (!a) return nbhd_fail(NBHD_ERR_ARG, "args is NULL");
    if (!e) e = &default_exec;
    nbhd_status st = check_exec(e);
    if (st != NBHD_OK) return st;
    if (p->parts < 1 || p->parts > NBHD_MERGE_MAX_PARTS)
        return nbhd_fail(NBHD_ERR_ARG, "parts=%d is invalid (need 1 <= parts <= %d)", p->parts,
                         NBHD_MERGE_MAX_PARTS);
    if (p->batch < 0 || p->tokens < 0 || p->batch > NBHD_MAX_COUNT || p->tokens > NBHD_MAX_COUNT)
        return nbhd_fail_rule(NBHD_ERR_ARG, "0 <= each < 2^56", "batch=%lld, tokens=%lld are invalid",
                         (long long)p->batch, (long long)p->tokens);
    if (p->heads < 1 || p->head_dim_v < 1)
        return nbhd_fail_rule(NBHD_ERR_ARG, ">= 1", "heads=%d, head_dim_v=%d are invalid", p->heads,
                         p->head_dim_v);
    if ((unsigned)p->dtype > NBHD_BF16)
        return nbhd_fail_rule(NBHD_ERR_ARG, "NBHD_F64..NBHD_BF16", "dtype=%d is invalid", (int)p->dtype);
    if ((unsigned)p->device > NBHD_CUDA)
        return nbhd_fail_rule(NBHD_ERR_ARG, "NBHD_CPU or NBHD_CUDA", "device=%d is invalid", (int)p->device);
    if (count_product(p->batch, p->tokens, p->heads, p->head_dim_v) > NBHD_MAX_COUNT)
        return nbhd_fail(NBHD_ERR_ARG, "batch x tokens x heads x head_dim_v exceeds 2^56 elements");
    if (p->batch == 0 || p->tokens == 0) return NBHD_OK;
    char name[32];
    /* rows [B, T, -, -, H] (stride[1] steps tokens) of Dv outputs, and of one LSE */
    const tensor_view vo = {{p->batch, p->tokens, 1, 1, p->heads, p->head_dim_v}, nbhd_dtype_size(p->dtype)};
    const tensor_view vl = {{p->batch, p->tokens, 1, 1, p->heads, 1}, p->dtype == NBHD_F64 ? 8 : 4};
    for (int i = 0; i < p->parts; ++i) {
        snprintf(name, sizeof name, "outs[%d]", i);
        NEED(a->outs[i], name);
        if ((st = check_view(&a->outs[i], name, &vo)) != NBHD_OK) return st;
        snprintf(name, sizeof name, "lses[%d]", i);
        NEED(a->lses[i], name);
        if ((st = check_view(&a->lses[i], name, &vl)) != NBHD_OK) return st;
    }
    NEED(a->out, "out");
    if ((st = check_view(&a->out, "out", &vo)) != NBHD_OK) return st;
    NEED(a->lse, "lse");
    if ((st = check_view(&a->lse, "lse", &vl)) != NBHD_OK) return st;
    DISPATCH(p->device, merge, p, a, e);
}
