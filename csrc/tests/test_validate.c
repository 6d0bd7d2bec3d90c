/*
 * test_validate.c — every descriptor rule of nbhd_validate (nbhd.h, docs/design.md §1) is rejected
 * with NBHD_ERR_ARG and a message naming the field; every entry point rejects NULL args, NULL
 * data of each tensor it needs, and a missing or short workspace; invalid problems need no
 * workspace. Last line: "N passed, M failed".
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nbhd.h"

static int passed, failed;

static void expect(int ok, const char *what) {
    if (ok) {
        passed++;
    } else {
        failed++;
        fprintf(stderr, "FAIL %s (last error: \"%s\")\n", what, nbhd_last_error());
    }
}

/* a valid 2-D problem: 9x8 tokens, kernel 3x4, GQA 4/2, D=8, Dv=5, 2 extra keys */
static nbhd_problem valid(void) {
    nbhd_problem p;
    memset(&p, 0, sizeof p);
    p.rank = 2;
    p.extent[0] = 9; p.extent[1] = 8;
    p.kernel[0] = 3; p.kernel[1] = 4;
    p.stride[0] = 1; p.stride[1] = 2;
    p.dilation[0] = 2; p.dilation[1] = 1;
    p.causal[0] = 0; p.causal[1] = 1;
    p.batch = 2;
    p.extra_kv = 2;
    p.heads = 4; p.kv_heads = 2;
    p.head_dim = 8; p.head_dim_v = 5;
    p.scale = 0.35;
    p.dtype = NBHD_F32;
    p.device = NBHD_CPU;
    return p;
}

/* the problem is rejected with NBHD_ERR_ARG, a message holding `field`, no workspace asked, and
 * every entry point rejects it the same way */
static void expect_rejected(const nbhd_problem *p, const char *rule, const char *field) {
    char what[256];
    nbhd_status st = nbhd_validate(p);
    const int named = strstr(nbhd_last_error(), field) != NULL;
    snprintf(what, sizeof what, "validate rejects %s with NBHD_ERR_ARG naming '%s'", rule, field);
    expect(st == NBHD_ERR_ARG && named, what);
    snprintf(what, sizeof what, "workspace_bytes is 0 for %s", rule);
    expect(nbhd_workspace_bytes(p, NBHD_OP_BACKWARD, NULL) == 0, what);
    nbhd_forward_args fa;
    nbhd_backward_args ba;
    nbhd_forward_jvp_args ja;
    memset(&fa, 0, sizeof fa);
    memset(&ba, 0, sizeof ba);
    memset(&ja, 0, sizeof ja);
    snprintf(what, sizeof what, "forward/backward/forward_jvp reject %s", rule);
    expect(nbhd_forward(p, &fa, NULL) == NBHD_ERR_ARG && nbhd_backward(p, &ba, NULL) == NBHD_ERR_ARG &&
               nbhd_forward_jvp(p, &ja, NULL) == NBHD_ERR_ARG && strstr(nbhd_last_error(), field),
           what);
}

#define REJECT(field, rule, stmt)             \
    do {                                      \
        nbhd_problem p = valid();             \
        stmt;                                 \
        expect_rejected(&p, rule, field);     \
    } while (0)

static void descriptor_rules(void) {
    expect(nbhd_validate(NULL) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "problem"), "NULL problem");
    {
        nbhd_problem p = valid();
        expect(nbhd_validate(&p) == NBHD_OK, "the valid problem is valid");
    }
    REJECT("rank", "rank -1", p.rank = -1);
    REJECT("rank", "rank 4", p.rank = 4);
    REJECT("rank", "rank INT32_MIN", p.rank = INT32_MIN);
    REJECT("dtype", "dtype 4", p.dtype = (nbhd_dtype)4);
    REJECT("dtype", "dtype -1", p.dtype = (nbhd_dtype)-1);
    REJECT("device", "device 2", p.device = (nbhd_device)2);
    REJECT("device", "device -1", p.device = (nbhd_device)-1);
    REJECT("batch", "batch -1", p.batch = -1);
    REJECT("batch", "batch 2^60", p.batch = (int64_t)1 << 60);
    REJECT("batch", "batch INT64_MAX", p.batch = INT64_MAX);
    REJECT("heads", "heads -1", p.heads = -1);
    REJECT("kv_heads", "kv_heads 0", p.kv_heads = 0);
    REJECT("kv_heads", "kv_heads -2", p.kv_heads = -2);
    REJECT("kv_heads", "heads 5 % kv_heads 2", p.heads = 5);
    REJECT("kv_heads", "heads 2 % kv_heads 4", (p.heads = 2, p.kv_heads = 4));
    REJECT("head_dim", "head_dim 0", p.head_dim = 0);
    REJECT("head_dim", "head_dim -3", p.head_dim = -3);
    REJECT("head_dim_v", "head_dim_v 0", p.head_dim_v = 0);
    REJECT("head_dim_v", "head_dim_v INT32_MIN", p.head_dim_v = INT32_MIN);
    REJECT("scale", "scale NaN", p.scale = NAN);
    REJECT("scale", "scale +inf", p.scale = INFINITY);
    REJECT("scale", "scale -inf", p.scale = -INFINITY);
    REJECT("scale", "scale 1e300 for float32 scores", p.scale = 1e300);
    REJECT("extra_kv", "extra_kv -1", p.extra_kv = -1);
    REJECT("extra_kv", "extra_kv 2^62", p.extra_kv = (int64_t)1 << 62);
    for (int a = 0; a < 2; ++a) {
        char f[32], r[64];
#define AXIS(name, rule, stmt)                                         \
    do {                                                               \
        snprintf(f, sizeof f, "%s[%d]", name, a);                      \
        snprintf(r, sizeof r, "%s on axis %d", rule, a);               \
        REJECT(f, r, stmt);                                            \
    } while (0)
        AXIS("extent", "extent 0", p.extent[a] = 0);
        AXIS("extent", "extent -5", p.extent[a] = -5);
        AXIS("extent", "extent 2^60", p.extent[a] = (int64_t)1 << 60);
        AXIS("kernel", "kernel 1", p.kernel[a] = 1);
        AXIS("kernel", "kernel 0", p.kernel[a] = 0);
        AXIS("kernel", "kernel -7", p.kernel[a] = -7);
        AXIS("kernel", "kernel*dilation > extent", p.kernel[a] = 9);
        AXIS("kernel", "kernel > extent", (p.kernel[a] = 10, p.dilation[a] = 1));
        AXIS("kernel", "kernel INT32_MAX", p.kernel[a] = INT32_MAX);
        AXIS("dilation", "dilation 0", p.dilation[a] = 0);
        AXIS("dilation", "dilation -1", p.dilation[a] = -1);
        AXIS("kernel", "kernel*dilation overflow int32", (p.kernel[a] = 65536, p.dilation[a] = 65536));
        AXIS("stride", "stride 0", p.stride[a] = 0);
        AXIS("stride", "stride -1", p.stride[a] = -1);
        AXIS("stride", "stride > kernel", p.stride[a] = p.kernel[a] + 1);
        AXIS("causal", "causal 2", p.causal[a] = 2);
        AXIS("causal", "causal 255", p.causal[a] = 255);
#undef AXIS
    }
    /* 3-D: the third axis' rules too */
    REJECT("kernel[2]", "kernel 1 on axis 2", (p.rank = 3, p.extent[2] = 4, p.kernel[2] = 1, p.stride[2] = 1, p.dilation[2] = 1));
    REJECT("stride[2]", "stride 3 > kernel 2 on axis 2", (p.rank = 3, p.extent[2] = 4, p.kernel[2] = 2, p.stride[2] = 3, p.dilation[2] = 1));
    REJECT("extent", "extent product 2^40 * 2^40 overflows",
           (p.extent[0] = (int64_t)1 << 40, p.extent[1] = (int64_t)1 << 40));
    REJECT("extent", "extent product > 2^56",
           (p.rank = 3, p.extent[0] = (int64_t)1 << 20, p.extent[1] = (int64_t)1 << 20,
            p.extent[2] = (int64_t)1 << 20, p.kernel[2] = 2, p.stride[2] = 1, p.dilation[2] = 1));
    REJECT("batch", "batch*tokens*heads*head_dim > 2^56",
           (p.batch = (int64_t)1 << 40, p.extent[0] = (int64_t)1 << 15));
    REJECT("extra_kv", "batch*extra_kv*kv_heads*head_dim > 2^56",
           (p.batch = (int64_t)1 << 30, p.extra_kv = (int64_t)1 << 30));
    REJECT("head_dim", "batch*tokens*heads*head_dim via head_dim > 2^56",
           (p.batch = (int64_t)1 << 40, p.head_dim = INT32_MAX));
    /* rank 0 */
    REJECT("extent[0]", "rank 0 with extent[0] 0", (p.rank = 0, p.extent[0] = 0));
    REJECT("extent[0]", "rank 0 with extent[0] -1", (p.rank = 0, p.extent[0] = -1));
    REJECT("extra_kv", "rank 0 without extra keys", (p.rank = 0, p.extra_kv = 0));
    /* query range: both 0, or 0 <= begin < end <= extent, on the problem's axes only */
    REJECT("query range", "query range begin == end", (p.query_begin[0] = 4, p.query_end[0] = 4));
    REJECT("query range", "query range begin > end", (p.query_begin[1] = 5, p.query_end[1] = 3));
    REJECT("query range", "query range end 0 with begin 3", (p.query_begin[0] = 3, p.query_end[0] = 0));
    REJECT("query range", "query range end > extent", (p.query_begin[0] = 2, p.query_end[0] = 10));
    REJECT("query range", "query range end > extent on axis 1", (p.query_begin[1] = 0, p.query_end[1] = 9));
    REJECT("query range", "query range begin < 0", (p.query_begin[1] = -1, p.query_end[1] = 3));
    REJECT("query range", "query range begin INT64_MIN", (p.query_begin[0] = INT64_MIN, p.query_end[0] = 1));
    REJECT("query range", "query range end INT64_MAX", (p.query_begin[0] = 1, p.query_end[0] = INT64_MAX));
    REJECT("query range", "query range begin == extent", (p.query_begin[0] = 9, p.query_end[0] = 10));
    REJECT("query range", "query range, one axis bad of two", (p.query_begin[0] = 1, p.query_end[0] = 5,
                                                              p.query_begin[1] = 6, p.query_end[1] = 6));
    REJECT("query_begin[2]", "query range on axis 2 of a rank-2 problem", p.query_end[2] = 1);
    REJECT("query_begin[2]", "query begin alone on axis 2 of a rank-2 problem", p.query_begin[2] = 1);
    REJECT("query_begin[1]", "query range on axis 1 of a rank-1 problem",
           (p.rank = 1, p.query_begin[1] = 0, p.query_end[1] = 3));
    REJECT("query_begin[0]", "query range on rank 0", (p.rank = 0, p.extent[0] = 5, p.query_end[0] = 2));
    REJECT("query_begin[0]", "query range on rank 0, the whole axis",
           (p.rank = 0, p.extent[0] = 5, p.query_begin[0] = 0, p.query_end[0] = 5));
    REJECT("query_begin[1]", "query end alone on axis 1 of rank 0", (p.rank = 0, p.extent[0] = 5, p.query_end[1] = 1));
    {
        static const struct { int rank; int64_t b[3], e[3]; const char *what; } ok[] = {
            {2, {0, 0, 0}, {0, 0, 0}, "query range (0,0) on every axis is valid (the whole grid)"},
            {2, {0, 0, 0}, {9, 8, 0}, "query range of the whole extent is valid"},
            {2, {3, 0, 0}, {4, 0, 0}, "query range of one query on axis 0, axis 1 whole, is valid"},
            {2, {8, 7, 0}, {9, 8, 0}, "query range of the last query on both axes is valid"},
            {2, {0, 2, 0}, {0, 5, 0}, "query range on axis 1 only is valid"},
            {2, {2, 1, 0}, {7, 6, 0}, "query range on both axes is valid"},
            {1, {5, 0, 0}, {9, 0, 0}, "query range on rank 1 is valid"},
            {3, {0, 0, 1}, {0, 0, 3}, "query range on axis 2 of rank 3 is valid"},
        };
        for (size_t i = 0; i < sizeof ok / sizeof ok[0]; ++i) {
            nbhd_problem p = valid();
            p.rank = ok[i].rank;
            if (p.rank == 3) { p.extent[2] = 4; p.kernel[2] = 2; p.stride[2] = 1; p.dilation[2] = 1; }
            for (int a = 0; a < 3; ++a) { p.query_begin[a] = ok[i].b[a]; p.query_end[a] = ok[i].e[a]; }
            expect(nbhd_validate(&p) == NBHD_OK, ok[i].what);
        }
    }
    {
        nbhd_problem p = valid();
        p.rank = 0;
        p.extent[0] = 5;
        p.kernel[0] = -1; /* ignored for rank 0 */
        expect(nbhd_validate(&p) == NBHD_OK, "rank 0 ignores the per-axis fields");
        p = valid();
        p.extent[2] = -1;
        p.kernel[2] = 0;
        expect(nbhd_validate(&p) == NBHD_OK, "rank 2 ignores axis 2");
        p = valid();
        p.heads = 0;
        expect(nbhd_validate(&p) == NBHD_OK, "heads 0 is valid");
        p = valid();
        p.batch = 0;
        p.extent[0] = (int64_t)1 << 50;
        expect(nbhd_validate(&p) == NBHD_OK, "batch 0 with a huge extent is valid (empty)");
        p = valid();
        p.kernel[0] = 4;
        p.dilation[0] = 2;
        p.stride[0] = 4;
        p.extent[0] = 8;
        expect(nbhd_validate(&p) == NBHD_OK, "kernel*dilation == extent, stride == kernel is valid");
    }
}

/* a tensor with data: a small dummy buffer (the calls below must fail before touching it) */
static double dummy[8];
static nbhd_tensor some(void) {
    nbhd_tensor t;
    memset(&t, 0, sizeof t);
    t.data = dummy;
    return t;
}

static void tensor_rules(void) {
    const nbhd_problem p = valid();
    nbhd_exec e;
    memset(&e, 0, sizeof e);
    const nbhd_tensor T = some();
    char what[128];

    expect(nbhd_forward(&p, NULL, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "args"), "forward args NULL");
    expect(nbhd_backward(&p, NULL, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "args"), "backward args NULL");
    expect(nbhd_forward_jvp(&p, NULL, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "args"), "forward_jvp args NULL");

    /* forward: each required tensor NULL in turn */
    {
        const char *names[] = {"q", "k", "v", "kx", "vx", "out", "lse"};
        for (int i = 0; i < 7; ++i) {
            nbhd_forward_args a = {T, T, T, T, T, T, T, {0}};
            nbhd_tensor *f = &a.q;
            f[i].data = NULL;
            const nbhd_status st = nbhd_forward(&p, &a, &e);
            snprintf(what, sizeof what, "forward with %s NULL -> NBHD_ERR_ARG naming it", names[i]);
            expect(st == NBHD_ERR_ARG && strstr(nbhd_last_error(), names[i]), what);
        }
    }
    /* backward: each required tensor NULL in turn (d_lse may be NULL) */
    {
        const char *names[] = {"q", "k", "v", "kx", "vx", "out", "lse", "d_out", "d_lse",
                               "d_q", "d_k", "d_v", "d_kx", "d_vx"};
        for (int i = 0; i < 14; ++i) {
            if (i == 8) continue;
            nbhd_backward_args a = {T, T, T, T, T, T, T, T, T, T, T, T, T, T, {0}, {0}};
            nbhd_tensor *f = &a.q;
            f[i].data = NULL;
            e.workspace = dummy; /* large enough is not checked before the NULL data */
            e.workspace_bytes = (size_t)1 << 40;
            const nbhd_status st = nbhd_backward(&p, &a, &e);
            snprintf(what, sizeof what, "backward with %s NULL -> NBHD_ERR_ARG naming it", names[i]);
            expect(st == NBHD_ERR_ARG && strstr(nbhd_last_error(), names[i]), what);
        }
        memset(&e, 0, sizeof e);
    }
    /* forward_jvp: each required tensor NULL in turn (tangents may be NULL) */
    {
        const char *names[] = {"q", "k", "v", "kx", "vx", "t_q", "t_k", "t_v", "t_kx", "t_vx",
                               "out", "lse", "t_out", "t_lse"};
        for (int i = 0; i < 14; ++i) {
            if (i >= 5 && i < 10) continue;
            nbhd_forward_jvp_args a = {T, T, T, T, T, T, T, T, T, T, T, T, T, T, {0}, {0}};
            nbhd_tensor *f = &a.q;
            f[i].data = NULL;
            const nbhd_status st = nbhd_forward_jvp(&p, &a, &e);
            snprintf(what, sizeof what, "forward_jvp with %s NULL -> NBHD_ERR_ARG naming it", names[i]);
            expect(st == NBHD_ERR_ARG && strstr(nbhd_last_error(), names[i]), what);
        }
    }
    /* workspace: missing or one byte short (for every op that asks for one) */
    const nbhd_op ops[3] = {NBHD_OP_FORWARD, NBHD_OP_BACKWARD, NBHD_OP_FORWARD_JVP};
    for (int o = 0; o < 3; ++o) {
        const size_t need = nbhd_workspace_bytes(&p, ops[o], &e);
        if (!need) continue;
        char *ws = (char *)malloc(need);
        for (int mode = 0; mode < 3; ++mode) {
            memset(&e, 0, sizeof e);
            e.workspace = mode == 0 ? NULL : ws;
            e.workspace_bytes = mode == 1 ? need - 1 : mode == 2 ? 0 : need;
            nbhd_status st;
            if (ops[o] == NBHD_OP_FORWARD) {
                nbhd_forward_args a = {T, T, T, T, T, T, T, {0}};
                st = nbhd_forward(&p, &a, &e);
            } else if (ops[o] == NBHD_OP_BACKWARD) {
                nbhd_backward_args a = {T, T, T, T, T, T, T, T, T, T, T, T, T, T, {0}, {0}};
                st = nbhd_backward(&p, &a, &e);
            } else {
                nbhd_forward_jvp_args a = {T, T, T, T, T, T, T, T, T, T, T, T, T, T, {0}, {0}};
                st = nbhd_forward_jvp(&p, &a, &e);
            }
            snprintf(what, sizeof what, "op %d with workspace %s -> NBHD_ERR_WORKSPACE", (int)ops[o],
                     mode == 0 ? "NULL" : mode == 1 ? "one byte short" : "of 0 bytes");
            expect(st == NBHD_ERR_WORKSPACE && strstr(nbhd_last_error(), "workspace"), what);
        }
        free(ws);
    }
    /* empty problems need nothing: no data, no workspace */
    {
        nbhd_problem q = valid();
        q.batch = 0;
        nbhd_forward_args fa;
        nbhd_backward_args ba;
        nbhd_forward_jvp_args ja;
        memset(&fa, 0, sizeof fa);
        memset(&ba, 0, sizeof ba);
        memset(&ja, 0, sizeof ja);
        expect(nbhd_forward(&q, &fa, NULL) == NBHD_OK && nbhd_backward(&q, &ba, NULL) == NBHD_OK &&
                   nbhd_forward_jvp(&q, &ja, NULL) == NBHD_OK,
               "batch 0: every entry point succeeds without tensors");
        q = valid();
        q.heads = 0;
        expect(nbhd_forward(&q, &fa, NULL) == NBHD_OK && nbhd_forward_jvp(&q, &ja, NULL) == NBHD_OK,
               "heads 0: forward and forward_jvp succeed without tensors");
        expect(nbhd_backward(&q, &ba, NULL) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "d_k"),
               "heads 0: backward still needs d_k (it writes zeros there)");
    }
    /* exec: absurd thread counts are refused before OpenMP tries to create them */
    {
        const int32_t bad[5] = {1025, 100000, INT32_MAX, -1025, INT32_MIN};
        for (int i = 0; i < 5; ++i) {
            nbhd_exec x;
            memset(&x, 0, sizeof x);
            x.threads = bad[i];
            nbhd_forward_args fa = {T, T, T, T, T, T, T, {0}};
            nbhd_backward_args ba = {T, T, T, T, T, T, T, T, T, T, T, T, T, T, {0}, {0}};
            nbhd_forward_jvp_args ja = {T, T, T, T, T, T, T, T, T, T, T, T, T, T, {0}, {0}};
            snprintf(what, sizeof what, "exec threads=%d -> NBHD_ERR_ARG naming threads", bad[i]);
            expect(nbhd_forward(&p, &fa, &x) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "threads") &&
                       nbhd_backward(&p, &ba, &x) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "threads") &&
                       nbhd_forward_jvp(&p, &ja, &x) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "threads"),
                   what);
        }
    }
    /* CUDA on a build without it */
    if (!nbhd_has_cuda()) {
        nbhd_problem q = valid();
        q.device = NBHD_CUDA;
        nbhd_forward_args a = {T, T, T, T, T, T, T, {0}};
        expect(nbhd_forward(&q, &a, NULL) == NBHD_ERR_UNSUPPORTED, "CUDA problem on a CPU-only build -> UNSUPPORTED");
    }
}

/* Tensor extents: every tensor of every entry point, given exactly its elements, runs; one
 * element short, a negative stride, a stride that overflows 64-bit offsets or a negative
 * `elements` is refused with NBHD_ERR_ARG, the message starting with the tensor's name (and
 * nothing is read: the buffers are exact, so ASan sees any access past them). */
enum { K_Q, K_K, K_V, K_O, K_ROW, K_KX, K_VX };

static nbhd_tensor exact(const nbhd_problem *p, int kind) {
    const int64_t B = p->batch, X = p->extent[0], Y = p->extent[1], S = p->extra_kv;
    const int64_t H = kind == K_K || kind == K_V || kind == K_KX || kind == K_VX ? p->kv_heads : p->heads;
    const int64_t W = kind == K_Q || kind == K_K || kind == K_KX ? p->head_dim : kind == K_ROW ? 1 : p->head_dim_v;
    nbhd_tensor t;
    memset(&t, 0, sizeof t);
    t.stride[5] = kind == K_ROW ? 0 : 1;
    t.stride[4] = W;
    if (kind == K_KX || kind == K_VX) {
        t.stride[1] = H * W;
        t.stride[0] = S * H * W;
        t.elements = B * S * H * W;
    } else {   /* rank 2: [B, X, Y, 1, H, W] */
        t.stride[3] = H * W;
        t.stride[2] = H * W;
        t.stride[1] = Y * H * W;
        t.stride[0] = X * Y * H * W;
        t.elements = B * X * Y * H * W;
    }
    t.data = calloc((size_t)t.elements, sizeof(float));
    return t;
}

static int names_tensor(const char *name) {
    const char *e = nbhd_last_error();
    const size_t n = strlen(name);
    return strncmp(e, name, n) == 0 && (e[n] == ':' || e[n] == ' ');
}

typedef nbhd_status (*entry_fn)(const nbhd_problem *, const void *, const nbhd_exec *);
static nbhd_status call_fwd(const nbhd_problem *p, const void *a, const nbhd_exec *e) { return nbhd_forward(p, a, e); }
static nbhd_status call_bwd(const nbhd_problem *p, const void *a, const nbhd_exec *e) { return nbhd_backward(p, a, e); }
static nbhd_status call_jvp(const nbhd_problem *p, const void *a, const nbhd_exec *e) { return nbhd_forward_jvp(p, a, e); }
static nbhd_status call_jvpb(const nbhd_problem *p, const void *a, const nbhd_exec *e) {
    return nbhd_forward_jvp_backward(p, a, e);
}

static void extent_rules_of(const char *op_name, nbhd_op op, entry_fn fn, nbhd_tensor *f, int n,
                            const char *const *names, const int *kinds, const nbhd_problem *p) {
    char what[192];
    for (int i = 0; i < n; ++i) f[i] = exact(p, kinds[i]);
    nbhd_exec e;
    memset(&e, 0, sizeof e);
    e.workspace_bytes = nbhd_workspace_bytes(p, op, &e);
    e.workspace = e.workspace_bytes ? malloc(e.workspace_bytes) : NULL;
    snprintf(what, sizeof what, "%s runs with every tensor exactly its elements", op_name);
    expect(fn(p, f, &e) == NBHD_OK, what);
    for (int i = 0; i < n; ++i) {
        const nbhd_tensor keep = f[i];
        f[i].elements = keep.elements - 1;
        snprintf(what, sizeof what, "%s with %s one element short -> NBHD_ERR_ARG naming it", op_name, names[i]);
        expect(fn(p, f, &e) == NBHD_ERR_ARG && names_tensor(names[i]) && strstr(nbhd_last_error(), "past its"), what);
        f[i] = keep;
        f[i].stride[1] = -keep.stride[1];
        snprintf(what, sizeof what, "%s with %s stride[1] negative -> NBHD_ERR_ARG naming it", op_name, names[i]);
        expect(fn(p, f, &e) == NBHD_ERR_ARG && names_tensor(names[i]) && strstr(nbhd_last_error(), "negative"), what);
        f[i] = keep;
        f[i].stride[1] = INT64_MAX / 4;   /* x extent 9 (or 2 extra keys, 4-byte elements) */
        f[i].elements = 0;   /* unknown size: the overflow alone is refused */
        snprintf(what, sizeof what, "%s with %s stride[1] overflowing -> NBHD_ERR_ARG naming it", op_name, names[i]);
        expect(fn(p, f, &e) == NBHD_ERR_ARG && names_tensor(names[i]) && strstr(nbhd_last_error(), "64-bit"), what);
        f[i] = keep;
        f[i].elements = -1;
        snprintf(what, sizeof what, "%s with %s elements=-1 -> NBHD_ERR_ARG naming it", op_name, names[i]);
        expect(fn(p, f, &e) == NBHD_ERR_ARG && names_tensor(names[i]) && strstr(nbhd_last_error(), "elements"), what);
        f[i] = keep;
    }
    for (int i = 0; i < n; ++i) free(f[i].data);
    free(e.workspace);
}

static void extent_rules(void) {
    nbhd_problem p = valid();
    p.batch = 1;
    {
        static const char *names[] = {"q", "k", "v", "kx", "vx", "out", "lse"};
        static const int kinds[] = {K_Q, K_K, K_V, K_KX, K_VX, K_O, K_ROW};
        nbhd_forward_args a;
        memset(&a, 0, sizeof a);   /* the bias tables after the tensors set: absent */
        extent_rules_of("forward", NBHD_OP_FORWARD, call_fwd, &a.q, 7, names, kinds, &p);
    }
    {
        static const char *names[] = {"q", "k", "v", "kx", "vx", "out", "lse", "d_out", "d_lse",
                                      "d_q", "d_k", "d_v", "d_kx", "d_vx"};
        static const int kinds[] = {K_Q, K_K, K_V, K_KX, K_VX, K_O, K_ROW, K_O, K_ROW,
                                    K_Q, K_K, K_V, K_KX, K_VX};
        nbhd_backward_args a;
        memset(&a, 0, sizeof a);   /* the bias tables after the tensors set: absent */
        extent_rules_of("backward", NBHD_OP_BACKWARD, call_bwd, &a.q, 14, names, kinds, &p);
    }
    {
        static const char *names[] = {"q", "k", "v", "kx", "vx", "t_q", "t_k", "t_v", "t_kx", "t_vx",
                                      "out", "lse", "t_out", "t_lse"};
        static const int kinds[] = {K_Q, K_K, K_V, K_KX, K_VX, K_Q, K_K, K_V, K_KX, K_VX,
                                    K_O, K_ROW, K_O, K_ROW};
        nbhd_forward_jvp_args a;
        memset(&a, 0, sizeof a);   /* the bias tables after the tensors set: absent */
        extent_rules_of("forward_jvp", NBHD_OP_FORWARD_JVP, call_jvp, &a.q, 14, names, kinds, &p);
    }
    {
        static const char *names[] = {"q", "k", "v", "kx", "vx", "t_q", "t_k", "t_v", "t_kx", "t_vx",
                                      "out", "lse", "t_out", "t_lse", "d_out", "d_lse", "d_t_out", "d_t_lse",
                                      "d_q", "d_k", "d_v", "d_kx", "d_vx", "d_t_q", "d_t_k", "d_t_v",
                                      "d_t_kx", "d_t_vx"};
        static const int kinds[] = {K_Q, K_K, K_V, K_KX, K_VX, K_Q, K_K, K_V, K_KX, K_VX,
                                    K_O, K_ROW, K_O, K_ROW, K_O, K_ROW, K_O, K_ROW,
                                    K_Q, K_K, K_V, K_KX, K_VX, K_Q, K_K, K_V, K_KX, K_VX};
        nbhd_forward_jvp_backward_args a;
        memset(&a, 0, sizeof a);   /* the bias tables after the tensors set: absent */
        extent_rules_of("forward_jvp_backward", NBHD_OP_FORWARD_JVP_BACKWARD, call_jvpb, &a.q, 28, names,
                        kinds, &p);
    }
    {   /* heads 0: the backward zeroes d_k, d_v, d_kx, d_vx, so their extents are checked too */
        nbhd_problem z = p;
        z.heads = 0;
        nbhd_backward_args a;
        memset(&a, 0, sizeof a);
        a.d_k = exact(&z, K_K); a.d_v = exact(&z, K_V); a.d_kx = exact(&z, K_KX); a.d_vx = exact(&z, K_VX);
        expect(nbhd_backward(&z, &a, NULL) == NBHD_OK, "heads 0: backward zeroes exact d_k, d_v, d_kx, d_vx");
        a.d_v.elements -= 1;
        expect(nbhd_backward(&z, &a, NULL) == NBHD_ERR_ARG && names_tensor("d_v"),
               "heads 0: backward refuses a short d_v naming it");
        free(a.d_k.data); free(a.d_v.data); free(a.d_kx.data); free(a.d_vx.data);
    }
    {   /* the message names the stride, the element and the size */
        nbhd_problem one = p;
        one.rank = 1; one.extent[0] = 400000; one.kernel[0] = 3; one.stride[0] = 1; one.dilation[0] = 1;
        one.causal[0] = 0; one.extra_kv = 0; one.heads = one.kv_heads = 1; one.head_dim = one.head_dim_v = 1;
        static float small[400];
        nbhd_forward_args a;
        memset(&a, 0, sizeof a);
        nbhd_tensor t = {small, {400000, 1, 0, 0, 1, 1}, 400};
        a.q = a.k = a.v = a.out = t;
        a.lse = (nbhd_tensor){small, {400000, 1, 0, 0, 1, 0}, 400};
        expect(nbhd_forward(&one, &a, NULL) == NBHD_ERR_ARG &&
                   strstr(nbhd_last_error(), "q: stride[1]=1 addresses element 399999 past its 400 elements"),
               "a 400000-token query over a 400-element buffer: the message names stride, element, size");
    }
    expect(nbhd_workspace_bytes(&p, (nbhd_op)7, NULL) == 0 && strstr(nbhd_last_error(), "op"),
           "workspace_bytes refuses an invalid op naming it");
}

static void strings(void) {
    expect(strcmp(nbhd_status_string(NBHD_OK), "NBHD_OK") == 0, "status string OK");
    expect(strcmp(nbhd_status_string(NBHD_ERR_ARG), "NBHD_ERR_ARG") == 0, "status string ARG");
    expect(strcmp(nbhd_status_string(NBHD_ERR_WORKSPACE), "NBHD_ERR_WORKSPACE") == 0, "status string WORKSPACE");
    expect(strcmp(nbhd_status_string((nbhd_status)77), "NBHD_ERR_UNKNOWN") == 0, "status string unknown");
    expect(nbhd_version() && nbhd_version()[0] != '\0', "version string");
}

/* nbhd_tile_configs lists positive tiles on the problem's axes only; entry points accept a
 * listed (or partly given) configuration, refuse an unlisted one with NBHD_ERR_UNSUPPORTED and a
 * malformed one with NBHD_ERR_ARG, both naming the tile; the scalar kernels ignore tiles. */
static void tile_rules(void) {
    nbhd_problem p = valid();
    nbhd_tile_config list[64];
    const int32_t n = nbhd_tile_configs(&p, NBHD_OP_FORWARD, list, 64);
    expect(n >= 1 && n <= 64, "fp32 CPU rank 2 lists at least one tile configuration");
    int well_formed = n >= 1;
    for (int i = 0; i < n && i < 64; ++i)
        for (int a = 0; a < 3; ++a) {
            const int on_axis = a < p.rank;
            well_formed &= on_axis ? list[i].q_tile[a] > 0 && list[i].kv_tile[a] > 0
                                   : list[i].q_tile[a] == 0 && list[i].kv_tile[a] == 0;
        }
    expect(well_formed, "listed tiles are positive on the problem's axes and 0 past them");
    expect(nbhd_tile_configs(&p, NBHD_OP_FORWARD, NULL, 0) == n, "count without an output array");
    expect(nbhd_tile_configs(&p, NBHD_OP_FORWARD, NULL, 1) == -1, "out NULL with max > 0 is refused");
    expect(nbhd_tile_configs(&p, (nbhd_op)9, list, 64) == -1 && strstr(nbhd_last_error(), "op"),
           "an invalid op is refused");
    nbhd_problem bad = p;
    bad.heads = 3;
    expect(nbhd_tile_configs(&bad, NBHD_OP_FORWARD, list, 64) == -1, "an invalid problem gives -1");
    nbhd_problem f64 = p;
    f64.dtype = NBHD_F64;
    expect(nbhd_tile_configs(&f64, NBHD_OP_FORWARD, list, 64) == 0, "fp64 (scalar kernels) has no tiles");

    nbhd_forward_args fa;
    memset(&fa, 0, sizeof fa);  /* NULL tensors: a call that passes the tile check fails on them */
    nbhd_exec e;
    memset(&e, 0, sizeof e);
    nbhd_tile_configs(&p, NBHD_OP_FORWARD, list, 1);
    memcpy(e.q_tile, list[0].q_tile, sizeof e.q_tile);
    memcpy(e.kv_tile, list[0].kv_tile, sizeof e.kv_tile);
    expect(nbhd_forward(&p, &fa, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "tensor"),
           "a listed configuration passes the tile check");
    memset(e.kv_tile, 0, sizeof e.kv_tile);
    expect(nbhd_forward(&p, &fa, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "tensor"),
           "a query tile alone takes the first matching configuration");
    e.q_tile[0] = 1000003;  /* no kernel lists a prime this large */
    expect(nbhd_forward(&p, &fa, &e) == NBHD_ERR_UNSUPPORTED && strstr(nbhd_last_error(), "q_tile"),
           "an unlisted tile is refused naming q_tile");
    expect(nbhd_forward(&f64, &fa, &e) == NBHD_ERR_UNSUPPORTED, "fp64 refuses any tile");
    e.use_reference = 1;
    expect(nbhd_forward(&p, &fa, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "tensor"),
           "the scalar kernels (use_reference) ignore tiles");
    e.use_reference = 0;
    memset(e.q_tile, 0, sizeof e.q_tile);
    e.q_tile[2] = 4;
    expect(nbhd_forward(&p, &fa, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "q_tile[2]"),
           "a tile past the rank is refused naming it");
    e.q_tile[2] = 0;
    e.kv_tile[0] = -1;
    nbhd_backward_args ba;
    memset(&ba, 0, sizeof ba);
    expect(nbhd_backward(&p, &ba, &e) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "kv_tile[0]"),
           "a negative tile is refused naming it (backward)");
}

/* nbhd_merge: every rule refused with NBHD_ERR_ARG naming its field; NULL tensors named */
static void merge_rules(void) {
    float outs[2][4] = {{1, 2, 3, 4}, {5, 6, 7, 8}}, lses[2][2] = {{0, 0}, {0, -INFINITY}};
    float out[4], lse[2];
    nbhd_merge_problem p = {2, 1, 2, 1, 2, NBHD_F32, NBHD_CPU};  /* rows [1, 2, 1], Dv 2 */
    nbhd_merge_args a;
    memset(&a, 0, sizeof a);
    for (int i = 0; i < 2; ++i) {
        a.outs[i] = (nbhd_tensor){outs[i], {4, 2, 0, 0, 2, 1}, 4};
        a.lses[i] = (nbhd_tensor){lses[i], {2, 1, 0, 0, 1, 0}, 2};
    }
    a.out = (nbhd_tensor){out, {4, 2, 0, 0, 2, 1}, 4};
    a.lse = (nbhd_tensor){lse, {2, 1, 0, 0, 1, 0}, 2};
    expect(nbhd_merge(&p, &a, NULL) == NBHD_OK, "a valid merge runs");
    /* row 0: equal weights; row 1: only part 0 has keys */
    expect(fabsf(out[0] - 3) < 1e-6f && fabsf(out[1] - 4) < 1e-6f && fabsf(lse[0] - logf(2)) < 1e-6f,
           "merge of two equal-LSE parts averages them");
    expect(out[2] == 3 && out[3] == 4 && lse[1] == 0, "a part with LSE -inf has weight 0");
    struct { const char *field; nbhd_merge_problem bad; } cases[] = {
        {"parts", {0, 1, 2, 1, 2, NBHD_F32, NBHD_CPU}},
        {"parts", {NBHD_MERGE_MAX_PARTS + 1, 1, 2, 1, 2, NBHD_F32, NBHD_CPU}},
        {"batch", {2, -1, 2, 1, 2, NBHD_F32, NBHD_CPU}},
        {"heads", {2, 1, 2, 0, 2, NBHD_F32, NBHD_CPU}},
        {"head_dim_v", {2, 1, 2, 1, 0, NBHD_F32, NBHD_CPU}},
        {"dtype", {2, 1, 2, 1, 2, (nbhd_dtype)7, NBHD_CPU}},
        {"device", {2, 1, 2, 1, 2, NBHD_F32, (nbhd_device)9}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        char what[96];
        snprintf(what, sizeof what, "merge refuses a bad %s", cases[i].field);
        expect(nbhd_merge(&cases[i].bad, &a, NULL) == NBHD_ERR_ARG &&
               strstr(nbhd_last_error(), cases[i].field), what);
    }
    nbhd_merge_args missing = a;
    missing.lses[1].data = NULL;
    expect(nbhd_merge(&p, &missing, NULL) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "lses[1]"),
           "merge names a NULL part");
    expect(nbhd_merge(NULL, &a, NULL) == NBHD_ERR_ARG && nbhd_merge(&p, NULL, NULL) == NBHD_ERR_ARG,
           "merge refuses NULL problem and args");
    nbhd_merge_args shrt = a;
    shrt.out.elements = 3;   /* 4 addressed */
    expect(nbhd_merge(&p, &shrt, NULL) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "out: ") &&
               strstr(nbhd_last_error(), "past its 3 elements"),
           "merge refuses an out one element short naming it");
    shrt = a;
    shrt.lses[1].stride[1] = -1;
    expect(nbhd_merge(&p, &shrt, NULL) == NBHD_ERR_ARG && strstr(nbhd_last_error(), "lses[1]: stride[1]=-1"),
           "merge refuses a negative stride naming the part");
    shrt = a;
    shrt.outs[0].elements = 4;
    expect(nbhd_merge(&p, &shrt, NULL) == NBHD_OK, "merge runs with parts of exactly their elements");
    nbhd_merge_problem cuda = p;
    cuda.device = NBHD_CUDA;
    if (!nbhd_has_cuda())
        expect(nbhd_merge(&cuda, &a, NULL) == NBHD_ERR_UNSUPPORTED, "CPU-only build refuses a CUDA merge");
}

int main(void) {
    descriptor_rules();
    tensor_rules();
    extent_rules();
    strings();
    tile_rules();
    merge_rules();
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
