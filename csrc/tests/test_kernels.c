/*
 * test_kernels.c — random sweep of nbhd_forward / nbhd_backward / nbhd_forward_jvp against the
 * brute-force oracle naive.h, with the plain reference (use_reference = 1) and the default path.
 *
 * Each case is seeded by its index (reproduce one with `test_kernels CASES FIRST`), and covers
 * rank 0-3, even/odd kernels, stride, dilation, causal per axis, GQA, Dv != D, extra keys,
 * F64/F32/F16/BF16, permuted/padded/broadcast strides, poisoned outputs with canaries, absent
 * tangents and dLSE, thread counts, and bitwise determinism of the backward pass; and a sweep
 * of every op with a relative positional bias (run_rpb_case: tables, their gradients and tangents,
 * on the reference and the default path, the fast kernels for fp32/fp16/bf16); and a sweep of
 * every op with a query range (run_range_case: rows outside it poisoned and never written, the
 * rows inside and the key-side gradients those of the full problem with the outside's
 * cotangents zero).
 * Usage: test_kernels [cases=300] [first=0]. Last line: "N passed, M failed".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "naive.h"

static const char *dtype_name[] = {"F64", "F32", "F16", "BF16"};

static void describe(const nbhd_problem *p, uint64_t seed) {
    fprintf(stderr, "  case seed=%llu rank=%d extent=[%lld,%lld,%lld] kernel=[%d,%d,%d] stride=[%d,%d,%d] "
            "dilation=[%d,%d,%d] causal=[%d,%d,%d] batch=%lld heads=%d kv_heads=%d D=%d Dv=%d "
            "extra_kv=%lld scale=%g dtype=%s\n",
            (unsigned long long)seed, p->rank, (long long)p->extent[0], (long long)p->extent[1],
            (long long)p->extent[2], p->kernel[0], p->kernel[1], p->kernel[2], p->stride[0],
            p->stride[1], p->stride[2], p->dilation[0], p->dilation[1], p->dilation[2],
            p->causal[0], p->causal[1], p->causal[2], (long long)p->batch, p->heads, p->kv_heads,
            p->head_dim, p->head_dim_v, (long long)p->extra_kv, p->scale, dtype_name[p->dtype]);
    if (p->rpb) fprintf(stderr, "    rpb=1\n");
    for (int a = 0; a < 3; ++a)
        if (p->query_begin[a] || p->query_end[a])
            fprintf(stderr, "    query range axis %d: [%lld, %lld)\n", a, (long long)p->query_begin[a],
                    (long long)p->query_end[a]);
}

/* 1: bf16 problems with head dims that the AMX kernels take (32 or 64; Dv also 16) */
static int amx_shapes = 0;

static void random_problem(rng_t *r, nbhd_problem *p) {
    for (;;) {
        memset(p, 0, sizeof *p);
        p->rank = (int32_t)rng_int(r, 0, 3);
        int64_t tokens = 1;
        if (p->rank == 0) {
            p->extent[0] = rng_int(r, 1, 12);
            tokens = p->extent[0];
        }
        for (int a = 0; a < p->rank; ++a) {
            const int big = p->rank == 1;
            p->kernel[a] = (int32_t)rng_int(r, 2, big ? 9 : (p->rank == 2 ? 5 : 3));
            p->dilation[a] = (int32_t)(rng_int(r, 0, 2) ? 1 : rng_int(r, 2, 3));
            p->extent[a] = (int64_t)p->kernel[a] * p->dilation[a] + rng_int(r, 0, big ? 12 : 4);
            p->stride[a] = (int32_t)(rng_int(r, 0, 1) ? 1 : rng_int(r, 1, p->kernel[a]));
            p->causal[a] = rng_int(r, 0, 2) == 0;
            tokens *= p->extent[a];
        }
        if (tokens > 320) continue;
        p->batch = rng_int(r, 0, 15) == 0 ? 0 : rng_int(r, 1, 2);
        p->kv_heads = (int32_t)rng_int(r, 1, 2);
        p->heads = p->kv_heads * (int32_t)(rng_int(r, 0, 19) == 0 ? 0 : rng_int(r, 1, 3));
        p->head_dim = (int32_t)(rng_int(r, 0, 4) ? rng_int(r, 1, 9) : 16);
        p->head_dim_v = (int32_t)(rng_int(r, 0, 1) ? p->head_dim : rng_int(r, 1, 9));
        p->extra_kv = p->rank == 0 ? rng_int(r, 1, 6) : (rng_int(r, 0, 1) ? 0 : rng_int(r, 1, 4));
        p->scale = rng_int(r, 0, 1) ? 1.0 / sqrt((double)p->head_dim) : 0.1 + 2.0 * rng_unit(r);
        p->dtype = (nbhd_dtype)rng_int(r, 0, 3);
        if (amx_shapes) {
            p->dtype = NBHD_BF16;
            p->head_dim = (int32_t)(32 * rng_int(r, 1, 2));
            p->head_dim_v = (int32_t)(rng_int(r, 0, 2) ? 32 * rng_int(r, 1, 2) : 16);
            if (p->rank > 0 && rng_int(r, 0, 3)) p->extra_kv = 0;   /* the AMX kernels take no extra keys */
        }
        p->device = NBHD_CPU;
        return;
    }
}

/* the six logical shapes of a problem */
typedef struct { int64_t q[6], k[6], v[6], o[6], lse[6], kx[6], vx[6]; } shapes;

static shapes shapes_of(const nbhd_problem *p) {
    const int64_t B = p->batch, X = naive_ext(p, 0), Y = naive_ext(p, 1), Z = naive_ext(p, 2);
    const int64_t H = p->heads, Hk = p->kv_heads, D = p->head_dim, Dv = p->head_dim_v, S = p->extra_kv;
    shapes s = {{B, X, Y, Z, H, D}, {B, X, Y, Z, Hk, D}, {B, X, Y, Z, Hk, Dv}, {B, X, Y, Z, H, Dv},
                {B, X, Y, Z, H, 1}, {B, S, 1, 1, Hk, D}, {B, S, 1, 1, Hk, Dv}};
    return s;
}

/* an input tensor with a random layout filled from dense (rounded in place) */
static tbuf input_b(rng_t *r, const int64_t dims[6], nbhd_dtype dt, double *dense,
                    int ignore_last, int bcast) {
    int64_t st[6];
    random_layout(r, dims, bcast, ignore_last, st);
    tbuf b = tbuf_make(dims, dt, st);
    tbuf_fill(&b, dense);
    return b;
}

static tbuf input(rng_t *r, const int64_t dims[6], nbhd_dtype dt, double *dense, int ignore_last) {
    return input_b(r, dims, dt, dense, ignore_last, 1);
}

static tbuf output(rng_t *r, const int64_t dims[6], nbhd_dtype dt, int ignore_last) {
    int64_t st[6];
    random_layout(r, dims, 0, ignore_last, st);
    return tbuf_make(dims, dt, st);
}

static int checks_failed;
static uint64_t cur_seed;
static const nbhd_problem *cur_p;

/* compares a library output with the oracle and checks nothing outside it was written */
static void expect_close(const char *what, const tbuf *b, const double *want, double tol) {
    const int64_t n = dims_count(b->dims);
    double *got = dense_alloc(n);
    tbuf_gather(b, got);
    const double err = rel_error(got, want, n);
    const int outside = tbuf_untouched_outside(b);
    if (!(err <= tol) || !outside) {
        fprintf(stderr, "FAIL %s: rel error %.3g (tol %.1g)%s\n", what, err, tol,
                outside ? "" : ", wrote outside its elements (padding or canary)");
        describe(cur_p, cur_seed);
        if (getenv("NBHD_TEST_VERBOSE"))
            for (int64_t i = 0; i < n && i < 64; ++i)
                fprintf(stderr, "    [%lld] got %.8g want %.8g\n", (long long)i, got[i], want[i]);
        checks_failed++;
    }
    free(got);
}

static void expect_ok(const char *what, nbhd_status st) {
    if (st != NBHD_OK) {
        fprintf(stderr, "FAIL %s: status %s: %s\n", what, nbhd_status_string(st), nbhd_last_error());
        describe(cur_p, cur_seed);
        checks_failed++;
    }
}

static void *workspace_for(const nbhd_problem *p, nbhd_op op, nbhd_exec *e) {
    const size_t need = nbhd_workspace_bytes(p, op, e);
    e->workspace = need ? malloc(need) : NULL;
    e->workspace_bytes = need;
    return e->workspace;
}

static nbhd_tensor none(void) {
    nbhd_tensor t;
    memset(&t, 0, sizeof t);
    return t;
}

/* one case: returns 1 when every check passed */
static int run_case(uint64_t seed) {
    rng_t r = {seed * 0x2545f4914f6cdd1dull + 1};
    nbhd_problem p;
    random_problem(&r, &p);
    cur_p = &p;
    cur_seed = seed;
    const int before = checks_failed;
    const nbhd_dtype dt = p.dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const double tol = tol_of(dt);
    const shapes s = shapes_of(&p);
    const int has_k = p.rank > 0, has_x = p.extra_kv > 0;

    expect_ok("validate", nbhd_validate(&p));

    /* inputs (dense values are rounded to the dtype by tbuf_fill) */
    const int64_t nq = dims_count(s.q), nk = dims_count(s.k), nv = dims_count(s.v),
                  no = dims_count(s.o), nl = dims_count(s.lse), nkx = dims_count(s.kx),
                  nvx = dims_count(s.vx);
    double *q = dense_random(&r, nq, -1, 1), *k = dense_random(&r, nk, -1, 1),
           *v = dense_random(&r, nv, -1, 1), *kx = dense_random(&r, nkx, -1, 1),
           *vx = dense_random(&r, nvx, -1, 1);
    tbuf Q = input(&r, s.q, dt, q, 0), K = input(&r, s.k, dt, k, 0), V = input(&r, s.v, dt, v, 0),
         KX = input(&r, s.kx, dt, kx, 0), VX = input(&r, s.vx, dt, vx, 0);
    nbhd_tensor tK = has_k ? K.t : none(), tV = has_k ? V.t : none();
    nbhd_tensor tKX = has_x ? KX.t : none(), tVX = has_x ? VX.t : none();

    /* oracle forward */
    double *out = dense_alloc(no), *lse = dense_alloc(nl);
    naive_forward(&p, q, k, v, kx, vx, out, lse);

    for (int use_ref = 1; use_ref >= 0; --use_ref) {
        char what[64];
        nbhd_exec e;
        memset(&e, 0, sizeof e);
        e.use_reference = use_ref;
        e.threads = (int32_t)rng_int(&r, 0, 3);

        /* ---- forward */
        tbuf O = output(&r, s.o, dt, 0), L = output(&r, s.lse, lt, 1);
        nbhd_forward_args fa = {Q.t, tK, tV, tKX, tVX, O.t, L.t, {0}};
        workspace_for(&p, NBHD_OP_FORWARD, &e);
        snprintf(what, sizeof what, "forward%s", use_ref ? " (reference)" : "");
        expect_ok(what, nbhd_forward(&p, &fa, &e));
        snprintf(what, sizeof what, "forward out%s", use_ref ? " (reference)" : "");
        expect_close(what, &O, out, tol);
        snprintf(what, sizeof what, "forward lse%s", use_ref ? " (reference)" : "");
        expect_close(what, &L, lse, dt == NBHD_F64 ? 1e-12 : 1e-5);
        free(e.workspace);
        tbuf_free(&O);
        tbuf_free(&L);

        /* ---- backward, from the oracle's out and lse */
        double *o_in = dense_alloc(no), *l_in = dense_alloc(nl);
        memcpy(o_in, out, sizeof(double) * (size_t)no);
        memcpy(l_in, lse, sizeof(double) * (size_t)nl);
        /* no broadcast layouts here: out and lse must stay the forward's values */
        tbuf Oi = input_b(&r, s.o, dt, o_in, 0, 0), Li = input_b(&r, s.lse, lt, l_in, 1, 0);
        double *dout = dense_random(&r, no, -1, 1);
        const int with_dlse = rng_int(&r, 0, 2) > 0;
        double *dlse = dense_random(&r, nl, -1, 1);
        tbuf dO = input(&r, s.o, dt, dout, 0), dL = input(&r, s.lse, lt, dlse, 1);
        double *dq = dense_alloc(nq), *dk = dense_alloc(nk), *dv = dense_alloc(nv),
               *dkx = dense_alloc(nkx), *dvx = dense_alloc(nvx);
        naive_backward(&p, q, k, v, kx, vx, o_in, dout, with_dlse ? dlse : NULL, dq, dk, dv, dkx, dvx);
        tbuf dQ[2], dK[2], dV[2], dKX[2], dVX[2];
        workspace_for(&p, NBHD_OP_BACKWARD, &e);
        for (int run = 0; run < 2; ++run) {
            /* the second run reuses the first run's layouts, for a bitwise comparison */
            if (run == 0) {
                dQ[0] = output(&r, s.q, dt, 0);
                dK[0] = output(&r, s.k, dt, 0);
                dV[0] = output(&r, s.v, dt, 0);
                dKX[0] = output(&r, s.kx, dt, 0);
                dVX[0] = output(&r, s.vx, dt, 0);
            } else {
                dQ[1] = tbuf_make(s.q, dt, dQ[0].t.stride);
                dK[1] = tbuf_make(s.k, dt, dK[0].t.stride);
                dV[1] = tbuf_make(s.v, dt, dV[0].t.stride);
                dKX[1] = tbuf_make(s.kx, dt, dKX[0].t.stride);
                dVX[1] = tbuf_make(s.vx, dt, dVX[0].t.stride);
            }
            nbhd_backward_args ba = {Q.t, tK, tV, tKX, tVX, Oi.t, Li.t, dO.t,
                                     with_dlse ? dL.t : none(), dQ[run].t,
                                     has_k ? dK[run].t : none(), has_k ? dV[run].t : none(),
                                     has_x ? dKX[run].t : none(), has_x ? dVX[run].t : none(), {0}, {0}};
            snprintf(what, sizeof what, "backward%s", use_ref ? " (reference)" : "");
            expect_ok(what, nbhd_backward(&p, &ba, &e));
        }
        snprintf(what, sizeof what, "backward dq%s", use_ref ? " (reference)" : "");
        expect_close(what, &dQ[0], dq, tol);
        if (has_k) {
            snprintf(what, sizeof what, "backward dk%s", use_ref ? " (reference)" : "");
            expect_close(what, &dK[0], dk, tol);
            snprintf(what, sizeof what, "backward dv%s", use_ref ? " (reference)" : "");
            expect_close(what, &dV[0], dv, tol);
        }
        if (has_x) {
            snprintf(what, sizeof what, "backward dkx%s", use_ref ? " (reference)" : "");
            expect_close(what, &dKX[0], dkx, tol);
            snprintf(what, sizeof what, "backward dvx%s", use_ref ? " (reference)" : "");
            expect_close(what, &dVX[0], dvx, tol);
        }
        const tbuf *pairs[5][2] = {{&dQ[0], &dQ[1]}, {&dK[0], &dK[1]}, {&dV[0], &dV[1]},
                                   {&dKX[0], &dKX[1]}, {&dVX[0], &dVX[1]}};
        for (int i = 0; i < 5; ++i)
            if (memcmp(pairs[i][0]->base, pairs[i][1]->base, pairs[i][0]->alloc * pairs[i][0]->esize)) {
                fprintf(stderr, "FAIL backward%s not deterministic: gradient %d differs between two runs\n",
                        use_ref ? " (reference)" : "", i);
                describe(&p, seed);
                checks_failed++;
            }
        for (int run = 0; run < 2; ++run) {
            tbuf_free(&dQ[run]); tbuf_free(&dK[run]); tbuf_free(&dV[run]);
            tbuf_free(&dKX[run]); tbuf_free(&dVX[run]);
        }
        free(e.workspace);
        tbuf_free(&Oi); tbuf_free(&Li); tbuf_free(&dO); tbuf_free(&dL);
        free(o_in); free(l_in); free(dout); free(dlse);
        free(dq); free(dk); free(dv); free(dkx); free(dvx);

        /* ---- forward + JVP, each tangent present or absent */
        const int use_t[5] = {rng_int(&r, 0, 3) > 0, rng_int(&r, 0, 3) > 0, rng_int(&r, 0, 3) > 0,
                              rng_int(&r, 0, 3) > 0, rng_int(&r, 0, 3) > 0};
        double *tq = dense_random(&r, nq, -1, 1), *tk = dense_random(&r, nk, -1, 1),
               *tv = dense_random(&r, nv, -1, 1), *tkx = dense_random(&r, nkx, -1, 1),
               *tvx = dense_random(&r, nvx, -1, 1);
        tbuf TQ = input(&r, s.q, dt, tq, 0), TK = input(&r, s.k, dt, tk, 0),
             TV = input(&r, s.v, dt, tv, 0), TKX = input(&r, s.kx, dt, tkx, 0),
             TVX = input(&r, s.vx, dt, tvx, 0);
        double *jo = dense_alloc(no), *jl = dense_alloc(nl), *jto = dense_alloc(no),
               *jtl = dense_alloc(nl);
        naive_forward_jvp(&p, q, k, v, kx, vx, use_t[0] ? tq : NULL, use_t[1] ? tk : NULL,
                          use_t[2] ? tv : NULL, use_t[3] ? tkx : NULL, use_t[4] ? tvx : NULL,
                          jo, jl, jto, jtl);
        tbuf JO = output(&r, s.o, dt, 0), JL = output(&r, s.lse, lt, 1),
             JTO = output(&r, s.o, dt, 0), JTL = output(&r, s.lse, lt, 1);
        nbhd_forward_jvp_args ja = {Q.t, tK, tV, tKX, tVX,
                                    use_t[0] ? TQ.t : none(),
                                    use_t[1] && has_k ? TK.t : none(),
                                    use_t[2] && has_k ? TV.t : none(),
                                    use_t[3] && has_x ? TKX.t : none(),
                                    use_t[4] && has_x ? TVX.t : none(),
                                    JO.t, JL.t, JTO.t, JTL.t, {0}, {0}};
        workspace_for(&p, NBHD_OP_FORWARD_JVP, &e);
        snprintf(what, sizeof what, "forward_jvp%s", use_ref ? " (reference)" : "");
        expect_ok(what, nbhd_forward_jvp(&p, &ja, &e));
        snprintf(what, sizeof what, "forward_jvp out%s", use_ref ? " (reference)" : "");
        expect_close(what, &JO, jo, tol);
        snprintf(what, sizeof what, "forward_jvp lse%s", use_ref ? " (reference)" : "");
        expect_close(what, &JL, jl, dt == NBHD_F64 ? 1e-12 : 1e-5);
        snprintf(what, sizeof what, "forward_jvp t_out%s", use_ref ? " (reference)" : "");
        expect_close(what, &JTO, jto, tol);
        snprintf(what, sizeof what, "forward_jvp t_lse%s", use_ref ? " (reference)" : "");
        expect_close(what, &JTL, jtl, dt == NBHD_F64 ? 1e-10 : 1e-4);
        free(e.workspace);
        tbuf_free(&TQ); tbuf_free(&TK); tbuf_free(&TV); tbuf_free(&TKX); tbuf_free(&TVX);
        tbuf_free(&JO); tbuf_free(&JL); tbuf_free(&JTO); tbuf_free(&JTL);
        free(tq); free(tk); free(tv); free(tkx); free(tvx);
        free(jo); free(jl); free(jto); free(jtl);
    }

    /* the reference backward does not depend on the thread count (bitwise) */
    if (p.batch > 0 && p.heads > 0) {
        tbuf O = output(&r, s.o, dt, 0), L = output(&r, s.lse, lt, 1);
        nbhd_exec e;
        memset(&e, 0, sizeof e);
        e.use_reference = 1;
        nbhd_forward_args fa = {Q.t, tK, tV, tKX, tVX, O.t, L.t, {0}};
        workspace_for(&p, NBHD_OP_FORWARD, &e);
        expect_ok("forward for thread check", nbhd_forward(&p, &fa, &e));
        free(e.workspace);
        double *dout = dense_random(&r, no, -1, 1);
        tbuf dO = input(&r, s.o, dt, dout, 0);
        workspace_for(&p, NBHD_OP_BACKWARD, &e);
        tbuf dQ[2], dK[2], dV[2];
        for (int run = 0; run < 2; ++run) {
            e.threads = run == 0 ? 1 : 3;
            dQ[run] = output(&r, s.q, dt, 0);
            dK[run] = output(&r, s.k, dt, 0);
            dV[run] = output(&r, s.v, dt, 0);
            tbuf DKX = output(&r, s.kx, dt, 0), DVX = output(&r, s.vx, dt, 0);
            nbhd_backward_args ba = {Q.t, tK, tV, tKX, tVX, O.t, L.t, dO.t, none(), dQ[run].t,
                                     has_k ? dK[run].t : none(), has_k ? dV[run].t : none(),
                                     has_x ? DKX.t : none(), has_x ? DVX.t : none(), {0}, {0}};
            expect_ok("backward for thread check", nbhd_backward(&p, &ba, &e));
            tbuf_free(&DKX);
            tbuf_free(&DVX);
        }
        double *a = dense_alloc(nq), *b = dense_alloc(nq);
        tbuf_gather(&dQ[0], a);
        tbuf_gather(&dQ[1], b);
        if (memcmp(a, b, sizeof(double) * (size_t)nq)) {
            fprintf(stderr, "FAIL reference backward dq differs between 1 and 3 threads\n");
            describe(&p, seed);
            checks_failed++;
        }
        free(a); free(b);
        for (int run = 0; run < 2; ++run) { tbuf_free(&dQ[run]); tbuf_free(&dK[run]); tbuf_free(&dV[run]); }
        free(e.workspace);
        tbuf_free(&dO);
        tbuf_free(&O);
        tbuf_free(&L);
        free(dout);
    }

    tbuf_free(&Q); tbuf_free(&K); tbuf_free(&V); tbuf_free(&KX); tbuf_free(&VX);
    free(q); free(k); free(v); free(kx); free(vx); free(out); free(lse);
    return checks_failed == before;
}

/* a contiguous [H, M] bias table (nbhd.h) of type dt, filled from dense when given, else poisoned */
static tbuf table(const nbhd_problem *p, nbhd_dtype dt, double *dense) {
    const int64_t M = naive_bias_entries(p);
    const int64_t dims[6] = {1, 1, 1, 1, p->heads, M}, st[6] = {0, 0, 0, 0, M, 1};
    tbuf b = tbuf_make(dims, dt, st);
    if (dense) tbuf_fill(&b, dense);
    return b;
}

/* one case with a relative positional bias (problem.rpb = 1: rank >= 1, no causal axis): every op
 * against the oracle with the bias, each table present or absent, outputs poisoned, the table
 * gradients bitwise equal across two runs; returns 1 when every check passed */
static int run_rpb_case(uint64_t seed) {
    rng_t r = {seed * 0x9e3779b97f4a7c15ull + 7};
    nbhd_problem p;
    do random_problem(&r, &p); while (p.rank == 0);
    for (int a = 0; a < 3; ++a) p.causal[a] = 0;
    p.rpb = 1;
    cur_p = &p;
    cur_seed = seed;
    const int before = checks_failed;
    const nbhd_dtype dt = p.dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const double tol = tol_of(dt);
    const shapes s = shapes_of(&p);
    const int has_x = p.extra_kv > 0;
    expect_ok("validate rpb", nbhd_validate(&p));
    const int64_t nq = dims_count(s.q), nk = dims_count(s.k), nv = dims_count(s.v),
                  no = dims_count(s.o), nl = dims_count(s.lse), nkx = dims_count(s.kx),
                  nvx = dims_count(s.vx), nt = p.heads * naive_bias_entries(&p);
    double *x[5], *t[5];
    const int64_t n_of[5] = {nq, nk, nv, nkx, nvx};
    const int64_t *dims_of[5] = {s.q, s.k, s.v, s.kx, s.vx};
    tbuf X[5], T[5];
    for (int i = 0; i < 5; ++i) {
        x[i] = dense_random(&r, n_of[i], -1, 1);
        t[i] = dense_random(&r, n_of[i], -1, 1);
        X[i] = input(&r, dims_of[i], dt, x[i], 0);
        T[i] = input(&r, dims_of[i], dt, t[i], 0);
    }
    /* a table spread like trained biases (a few units), so the bias moves the softmax */
    double *rpb = dense_random(&r, nt, -2, 2), *t_rpb = dense_random(&r, nt, -1, 1);
    tbuf R = table(&p, lt, rpb), TR = table(&p, lt, t_rpb);
    nbhd_tensor tKX = has_x ? X[3].t : none(), tVX = has_x ? X[4].t : none();
    double *dout = dense_random(&r, no, -1, 1), *dlse = dense_random(&r, nl, -1, 1),
           *dtout = dense_random(&r, no, -1, 1), *dtlse = dense_random(&r, nl, -1, 1);
    tbuf dO = input(&r, s.o, dt, dout, 0), dL = input(&r, s.lse, lt, dlse, 1),
         dTO = input(&r, s.o, dt, dtout, 0), dTL = input(&r, s.lse, lt, dtlse, 1);
    char what[80];
    for (int use_ref = 1; use_ref >= 0; --use_ref) {
        const char *path = use_ref ? " (reference)" : "";
        nbhd_exec e;
        memset(&e, 0, sizeof e);
        e.use_reference = use_ref;
        e.threads = (int32_t)rng_int(&r, 0, 3);
        const int with_rpb = rng_int(&r, 0, 5) > 0, with_t_rpb = rng_int(&r, 0, 3) > 0;
        naive_bias.rpb = with_rpb ? rpb : NULL;
        naive_bias.t_rpb = with_t_rpb ? t_rpb : NULL;
        const nbhd_tensor tR = with_rpb ? R.t : none(), tTR = with_t_rpb ? TR.t : none();

        /* ---- forward + JVP and forward against the oracle */
        double *jo = dense_alloc(no), *jl = dense_alloc(nl), *jto = dense_alloc(no), *jtl = dense_alloc(nl);
        naive_forward_jvp(&p, x[0], x[1], x[2], x[3], x[4], t[0], t[1], t[2], t[3], t[4], jo, jl, jto, jtl);
        tbuf O = output(&r, s.o, dt, 0), L = output(&r, s.lse, lt, 1);
        nbhd_forward_args fa = {X[0].t, X[1].t, X[2].t, tKX, tVX, O.t, L.t, tR};
        workspace_for(&p, NBHD_OP_FORWARD, &e);
        expect_ok("rpb forward", nbhd_forward(&p, &fa, &e));
        free(e.workspace);
        snprintf(what, sizeof what, "rpb forward out%s", path);
        expect_close(what, &O, jo, tol);
        snprintf(what, sizeof what, "rpb forward lse%s", path);
        expect_close(what, &L, jl, dt == NBHD_F64 ? 1e-12 : 1e-5);
        tbuf JO = output(&r, s.o, dt, 0), JL = output(&r, s.lse, lt, 1), JTO = output(&r, s.o, dt, 0),
             JTL = output(&r, s.lse, lt, 1);
        nbhd_forward_jvp_args ja = {X[0].t, X[1].t, X[2].t, tKX, tVX, T[0].t, T[1].t, T[2].t,
                                    has_x ? T[3].t : none(), has_x ? T[4].t : none(),
                                    JO.t, JL.t, JTO.t, JTL.t, tR, tTR};
        workspace_for(&p, NBHD_OP_FORWARD_JVP, &e);
        expect_ok("rpb forward_jvp", nbhd_forward_jvp(&p, &ja, &e));
        free(e.workspace);
        snprintf(what, sizeof what, "rpb forward_jvp out%s", path);
        expect_close(what, &JO, jo, tol);
        snprintf(what, sizeof what, "rpb forward_jvp t_out%s", path);
        expect_close(what, &JTO, jto, tol);
        snprintf(what, sizeof what, "rpb forward_jvp t_lse%s", path);
        expect_close(what, &JTL, jtl, dt == NBHD_F64 ? 1e-10 : 1e-4);
        tbuf_free(&O); tbuf_free(&L); tbuf_free(&JO); tbuf_free(&JL); tbuf_free(&JTO); tbuf_free(&JTL);
        /* the backwards take the oracle's forward (no broadcast layouts: they stay its values) */
        double *out = jo, *tout = jto, *tlse = jtl;
        tbuf Oi = input_b(&r, s.o, dt, jo, 0, 0), Li = input_b(&r, s.lse, lt, jl, 1, 0),
             TOi = input_b(&r, s.o, dt, jto, 0, 0), TLi = input_b(&r, s.lse, lt, jtl, 1, 0);

        /* ---- backward (from the oracle's out and lse with the full table: the kernels take them
         * as given), twice for bitwise determinism of the table gradient */
        double *want[5], *want_rpb = dense_alloc(nt);
        for (int i = 0; i < 5; ++i) want[i] = dense_alloc(n_of[i]);
        memset(want_rpb, 0, sizeof(double) * (size_t)nt);
        naive_bias.d_rpb = want_rpb;
        naive_backward(&p, x[0], x[1], x[2], x[3], x[4], out, dout, dlse, want[0], want[1], want[2],
                       want[3], want[4]);
        naive_bias.d_rpb = NULL;
        workspace_for(&p, NBHD_OP_BACKWARD, &e);
        tbuf G[2][5], DR[2];
        for (int run = 0; run < 2; ++run) {
            for (int i = 0; i < 5; ++i) G[run][i] = output(&r, dims_of[i], dt, 0);
            DR[run] = table(&p, lt, NULL);
            nbhd_backward_args ba = {X[0].t, X[1].t, X[2].t, tKX, tVX, Oi.t, Li.t, dO.t, dL.t,
                                     G[run][0].t, G[run][1].t, G[run][2].t,
                                     has_x ? G[run][3].t : none(), has_x ? G[run][4].t : none(),
                                     tR, DR[run].t};
            expect_ok("rpb backward", nbhd_backward(&p, &ba, &e));
        }
        free(e.workspace);
        static const char *gname[5] = {"dq", "dk", "dv", "dkx", "dvx"};
        for (int i = 0; i < (has_x ? 5 : 3); ++i) {
            snprintf(what, sizeof what, "rpb backward %s%s", gname[i], path);
            expect_close(what, &G[0][i], want[i], tol);
        }
        snprintf(what, sizeof what, "rpb backward d_rpb%s", path);
        expect_close(what, &DR[0], want_rpb, tol);
        if (memcmp(DR[0].base, DR[1].base, DR[0].alloc * DR[0].esize)) {
            fprintf(stderr, "FAIL rpb backward%s: d_rpb differs between two runs\n", path);
            describe(&p, seed);
            checks_failed++;
        }
        for (int run = 0; run < 2; ++run) {
            for (int i = 0; i < 5; ++i) tbuf_free(&G[run][i]);
            tbuf_free(&DR[run]);
        }

        /* ---- backward through forward + JVP, the table tangent and both table gradients */
        double *wt[5], *want_t_rpb = dense_alloc(nt);
        for (int i = 0; i < 5; ++i) wt[i] = dense_alloc(n_of[i]);
        memset(want_rpb, 0, sizeof(double) * (size_t)nt);
        memset(want_t_rpb, 0, sizeof(double) * (size_t)nt);
        naive_bias.d_rpb = want_rpb;
        naive_bias.d_t_rpb = want_t_rpb;
        const naive_jvp_backward_in in = {x[0], x[1], x[2], x[3], x[4], t[0], t[1], t[2], t[3], t[4],
                                          out, tout, tlse, dout, dlse, dtout, dtlse};
        naive_forward_jvp_backward(&p, &in, 0, want[0], want[1], want[2], want[3], want[4],
                                   wt[0], wt[1], wt[2], wt[3], wt[4]);
        naive_bias.d_rpb = naive_bias.d_t_rpb = NULL;
        tbuf GQ[10], DT0 = table(&p, lt, NULL), DT1 = table(&p, lt, NULL);
        for (int i = 0; i < 10; ++i) GQ[i] = output(&r, dims_of[i % 5], dt, 0);
        nbhd_forward_jvp_backward_args jb = {
            X[0].t, X[1].t, X[2].t, tKX, tVX, T[0].t, T[1].t, T[2].t, has_x ? T[3].t : none(),
            has_x ? T[4].t : none(), Oi.t, Li.t, TOi.t, TLi.t, dO.t, dL.t, dTO.t, dTL.t,
            GQ[0].t, GQ[1].t, GQ[2].t, has_x ? GQ[3].t : none(), has_x ? GQ[4].t : none(),
            GQ[5].t, GQ[6].t, GQ[7].t, has_x ? GQ[8].t : none(), has_x ? GQ[9].t : none(),
            tR, tTR, DT0.t, DT1.t};
        workspace_for(&p, NBHD_OP_FORWARD_JVP_BACKWARD, &e);
        expect_ok("rpb forward_jvp_backward", nbhd_forward_jvp_backward(&p, &jb, &e));
        /* again with one table gradient asked (which one by seed): bitwise the first run's */
        const int only_t = (int)(seed & 1);
        tbuf DT2 = table(&p, lt, NULL);
        nbhd_forward_jvp_backward_args jb1 = jb;
        jb1.d_rpb = only_t ? none() : DT2.t;
        jb1.d_t_rpb = only_t ? DT2.t : none();
        expect_ok("rpb forward_jvp_backward, one table", nbhd_forward_jvp_backward(&p, &jb1, &e));
        free(e.workspace);
        const tbuf *first = only_t ? &DT1 : &DT0;
        if (memcmp(DT2.base, first->base, DT2.alloc * DT2.esize)) {
            fprintf(stderr, "FAIL rpb backward_jvp%s: %s alone differs from the run with both tables\n", path,
                    only_t ? "d_t_rpb" : "d_rpb");
            describe(&p, seed);
            checks_failed++;
        }
        tbuf_free(&DT2);
        /* sums of signed terms of a few units: bf16/f16 inputs round each to 2^-8 */
        const double jtol = 4 * tol;
        for (int i = 0; i < 10; ++i) {
            if (!has_x && (i % 5) >= 3) continue;
            snprintf(what, sizeof what, "rpb backward_jvp %s%s%s", i < 5 ? "" : "t_", gname[i % 5], path);
            expect_close(what, &GQ[i], i < 5 ? want[i] : wt[i - 5], jtol);
        }
        snprintf(what, sizeof what, "rpb backward_jvp d_rpb%s", path);
        expect_close(what, &DT0, want_rpb, jtol);
        snprintf(what, sizeof what, "rpb backward_jvp d_t_rpb%s", path);
        expect_close(what, &DT1, want_t_rpb, jtol);
        for (int i = 0; i < 10; ++i) tbuf_free(&GQ[i]);
        tbuf_free(&DT0); tbuf_free(&DT1);
        for (int i = 0; i < 5; ++i) { free(want[i]); free(wt[i]); }
        free(want_rpb); free(want_t_rpb);
        tbuf_free(&Oi); tbuf_free(&Li); tbuf_free(&TOi); tbuf_free(&TLi);
        free(jo); free(jl); free(jto); free(jtl);
    }
    naive_bias.rpb = naive_bias.t_rpb = NULL;

    /* ---- the rules: a table with problem.rpb = 0, a causal axis, a padded table */
    {
        nbhd_exec e;
        memset(&e, 0, sizeof e);
        e.use_reference = 1;
        tbuf O = output(&r, s.o, dt, 0), L = output(&r, s.lse, lt, 1);
        nbhd_forward_args fa = {X[0].t, X[1].t, X[2].t, tKX, tVX, O.t, L.t, R.t};
        nbhd_problem q = p;
        q.rpb = 0;
        if (p.batch > 0 && p.heads > 0 && nbhd_forward(&q, &fa, &e) != NBHD_ERR_ARG) {
            fprintf(stderr, "FAIL rpb: a table with problem.rpb=0 was accepted\n");
            checks_failed++;
        }
        q = p;
        q.causal[0] = 1;
        if (nbhd_validate(&q) != NBHD_ERR_ARG || !strstr(nbhd_last_error(), "causal")) {
            fprintf(stderr, "FAIL rpb: a causal axis was accepted (%s)\n", nbhd_last_error());
            checks_failed++;
        }
        fa.rpb.stride[4] += 1;
        if (p.heads > 1 && (nbhd_forward(&p, &fa, &e) != NBHD_ERR_ARG || !strstr(nbhd_last_error(), "rpb"))) {
            fprintf(stderr, "FAIL rpb: a padded table was accepted (%s)\n", nbhd_last_error());
            checks_failed++;
        }
        tbuf_free(&O); tbuf_free(&L);
    }
    if (checks_failed != before) describe(&p, seed);
    for (int i = 0; i < 5; ++i) { tbuf_free(&X[i]); tbuf_free(&T[i]); free(x[i]); free(t[i]); }
    tbuf_free(&R); tbuf_free(&TR);
    tbuf_free(&dO); tbuf_free(&dL); tbuf_free(&dTO); tbuf_free(&dTL);
    free(rpb); free(t_rpb);
    free(dout); free(dlse); free(dtout); free(dtlse);
    return checks_failed == before;
}

/* ---- query range (nbhd.h): only the queries of a box are computed, their windows those of the
 * whole grid; each op runs once on the full problem with the cotangents of the rows outside the
 * box zero (so they add nothing to the key-side sums) and once with the box, its rows outside
 * poisoned with NaN and its outputs prefilled with a sentinel */

/* (the sentinel: harness.h ROW_SENTINEL, fill_sentinel, sentinel_as) */

static tbuf sentinel_output(rng_t *r, const int64_t dims[6], nbhd_dtype dt, int ignore_last) {
    tbuf b = output(r, dims, dt, ignore_last);
    fill_sentinel(&b);
    return b;
}

/* is element lin of a row tensor [B, X, Y, Z, H, .] (dims) one of p's range queries? */
static int in_range(const nbhd_problem *p, const int64_t dims[6], int64_t lin) {
    const int64_t tok = lin / (dims[4] * dims[5]);
    const int64_t c[3] = {(tok / (dims[2] * dims[3])) % dims[1], (tok / dims[3]) % dims[2], tok % dims[3]};
    for (int a = 0; a < p->rank; ++a)
        if ((p->query_begin[a] || p->query_end[a]) && (c[a] < p->query_begin[a] || c[a] >= p->query_end[a]))
            return 0;
    return 1;
}

/* a row input for the full run (from dense, rounded in place; rows outside the range zeroed when
 * zero_out: a cotangent) and for the range run (the same rows inside, NaN outside), in layouts
 * without broadcast (a stride-0 axis would alias rows inside and outside) */
typedef struct { tbuf full, cut; } row_pair;

static row_pair row_inputs(rng_t *r, const nbhd_problem *p, const int64_t dims[6], nbhd_dtype dt,
                           int ignore_last, double *dense, int zero_out) {
    const int64_t n = dims_count(dims);
    double *poisoned = dense_alloc(n);
    for (int64_t i = 0; i < n; ++i)
        if (zero_out && !in_range(p, dims, i)) dense[i] = 0;
    row_pair rp;
    rp.full = input_b(r, dims, dt, dense, ignore_last, 0);
    for (int64_t i = 0; i < n; ++i) poisoned[i] = in_range(p, dims, i) ? dense[i] : NAN;
    rp.cut = input_b(r, dims, dt, poisoned, ignore_last, 0);
    free(poisoned);
    return rp;
}

static void row_pair_free(row_pair *rp) {
    tbuf_free(&rp->full);
    tbuf_free(&rp->cut);
}

/* a rounding's worth: the scalar kernels give the range's rows bitwise the full run's */
static double range_tol(nbhd_dtype dt) {
    return dt == NBHD_F64 ? 1e-12 : dt == NBHD_F32 ? 1e-5 : 1e-2;
}

/* a row output of the range run against the full run's: rows inside close, rows outside still
 * exactly the sentinel, nothing written outside the logical elements */
static void expect_rows(const char *what, const tbuf *cut, const tbuf *full, double tol) {
    const int64_t n = dims_count(cut->dims);
    double *got = dense_alloc(n), *want = dense_alloc(n);
    tbuf_gather(cut, got);
    tbuf_gather(full, want);
    const double sent = sentinel_as(cut->dtype);
    int64_t m = 0, overwritten = 0, first = -1;
    double first_value = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (in_range(cur_p, cut->dims, i)) {  /* compacted in place: m <= i */
            got[m] = got[i];
            want[m] = want[i];
            m++;
        } else if (!(got[i] == sent)) {
            if (first < 0) {
                first = i;
                first_value = got[i];
            }
            overwritten++;
        }
    }
    const double err = rel_error(got, want, m);
    const int outside = tbuf_untouched_outside(cut);
    if (!(err <= tol) || overwritten || !outside) {
        fprintf(stderr, "FAIL %s: rows inside the range: rel error %.3g (tol %.1g); rows outside: %lld of "
                "%lld elements lost the sentinel%s\n", what, err, tol, (long long)overwritten,
                (long long)(n - m), outside ? "" : "; wrote outside its elements (padding or canary)");
        if (first >= 0)
            fprintf(stderr, "    first outside: element %lld holds %.8g\n", (long long)first, first_value);
        describe(cur_p, cur_seed);
        checks_failed++;
    }
    free(got);
    free(want);
}

/* a key-side output (every element written) of the range run against the full run's */
static void expect_same(const char *what, const tbuf *cut, const tbuf *full, double tol) {
    double *want = dense_alloc(dims_count(full->dims));
    tbuf_gather(full, want);
    expect_close(what, cut, want, tol);
    free(want);
}

/* one case with a query range: every op, the range run against the full run; returns 1 when
 * every check passed */
static int run_range_case(uint64_t seed) {
    rng_t r = {seed * 0xd1342543de82ef95ull + 3};
    nbhd_problem p;
    do random_problem(&r, &p); while (p.rank == 0);
    if (rng_int(&r, 0, 2) == 0) {  /* a bias needs no causal axis */
        p.rpb = 1;
        for (int a = 0; a < 3; ++a) p.causal[a] = 0;
    }
    /* per axis whole (0,0), cut, or now and then the whole extent given as a range (the range
     * path computing every query); one axis, `cut`, always cut at random */
    const int cut = (int)rng_int(&r, 0, p.rank - 1);
    for (int a = 0; a < p.rank; ++a) {
        const int64_t L = p.extent[a], kind = a == cut ? 6 : rng_int(&r, 0, 6);
        if (kind <= 1) continue;
        if (kind == 2) {
            p.query_end[a] = L;
            continue;
        }
        p.query_begin[a] = rng_int(&r, 0, L - 1);
        p.query_end[a] = rng_int(&r, p.query_begin[a] + 1, L);
    }
    nbhd_problem full = p;
    memset(full.query_begin, 0, sizeof full.query_begin);
    memset(full.query_end, 0, sizeof full.query_end);
    cur_p = &p;
    cur_seed = seed;
    const int before = checks_failed;
    const nbhd_dtype dt = p.dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const double tol = range_tol(dt), ltol = range_tol(lt);
    const shapes s = shapes_of(&p);
    const int has_x = p.extra_kv > 0;
    expect_ok("range validate", nbhd_validate(&p));

    /* key-side inputs and tangents (shared by both runs), the rows' q and tq */
    const int64_t nq = dims_count(s.q), no = dims_count(s.o), nl = dims_count(s.lse);
    const int64_t *kdims[4] = {s.k, s.v, s.kx, s.vx};
    double *kd[4], *ktd[4];
    tbuf KV[4], TKV[4];
    for (int i = 0; i < 4; ++i) {
        kd[i] = dense_random(&r, dims_count(kdims[i]), -1, 1);
        ktd[i] = dense_random(&r, dims_count(kdims[i]), -1, 1);
        KV[i] = input(&r, kdims[i], dt, kd[i], 0);
        TKV[i] = input(&r, kdims[i], dt, ktd[i], 0);
    }
    double *q = dense_random(&r, nq, -1, 1), *tq = dense_random(&r, nq, -1, 1);
    row_pair Q = row_inputs(&r, &p, s.q, dt, 0, q, 0), TQ = row_inputs(&r, &p, s.q, dt, 0, tq, 0);
    const int64_t nt = p.rpb ? p.heads * naive_bias_entries(&p) : 1;
    double *rpb = dense_random(&r, nt, -2, 2), *t_rpb = dense_random(&r, nt, -1, 1);
    tbuf R = table(&p, lt, p.rpb ? rpb : NULL), TR = table(&p, lt, p.rpb ? t_rpb : NULL);
    const nbhd_tensor tR = p.rpb ? R.t : none(), tTR = p.rpb && rng_int(&r, 0, 3) ? TR.t : none();
    const nbhd_tensor tKX = has_x ? KV[2].t : none(), tVX = has_x ? KV[3].t : none();

    /* the full run on the reference kernels, which the range's run takes on either path */
    nbhd_exec ea, eb;
    memset(&ea, 0, sizeof ea);
    ea.use_reference = 1;
    ea.threads = (int32_t)rng_int(&r, 0, 3);
    eb = ea;
    eb.use_reference = (int32_t)rng_int(&r, 0, 1);
    const char *path = eb.use_reference ? " (reference)" : " (default path)";
    char what[96];

    /* ---- forward */
    tbuf Oa = output(&r, s.o, dt, 0), La = output(&r, s.lse, lt, 1);
    tbuf Ob = sentinel_output(&r, s.o, dt, 0), Lb = sentinel_output(&r, s.lse, lt, 1);
    nbhd_forward_args fa = {Q.full.t, KV[0].t, KV[1].t, tKX, tVX, Oa.t, La.t, tR}, fb = fa;
    fb.q = Q.cut.t;
    fb.out = Ob.t;
    fb.lse = Lb.t;
    workspace_for(&full, NBHD_OP_FORWARD, &ea);
    workspace_for(&p, NBHD_OP_FORWARD, &eb);
    expect_ok("range forward (full)", nbhd_forward(&full, &fa, &ea));
    expect_ok("range forward", nbhd_forward(&p, &fb, &eb));
    free(ea.workspace);
    free(eb.workspace);
    snprintf(what, sizeof what, "range forward out%s", path);
    expect_rows(what, &Ob, &Oa, tol);
    snprintf(what, sizeof what, "range forward lse%s", path);
    expect_rows(what, &Lb, &La, ltol);

    /* ---- forward + JVP, each tangent present or absent */
    const int use_t[5] = {rng_int(&r, 0, 3) > 0, rng_int(&r, 0, 3) > 0, rng_int(&r, 0, 3) > 0,
                          rng_int(&r, 0, 3) > 0, rng_int(&r, 0, 3) > 0};
    const nbhd_tensor tTK = use_t[1] ? TKV[0].t : none(), tTV = use_t[2] ? TKV[1].t : none(),
                      tTKX = use_t[3] && has_x ? TKV[2].t : none(), tTVX = use_t[4] && has_x ? TKV[3].t : none();
    tbuf Ja[4], Jb[4];  /* out, lse, t_out, t_lse */
    for (int i = 0; i < 4; ++i) {
        Ja[i] = output(&r, i % 2 ? s.lse : s.o, i % 2 ? lt : dt, i % 2);
        Jb[i] = sentinel_output(&r, i % 2 ? s.lse : s.o, i % 2 ? lt : dt, i % 2);
    }
    nbhd_forward_jvp_args ja = {Q.full.t, KV[0].t, KV[1].t, tKX, tVX, use_t[0] ? TQ.full.t : none(),
                                tTK, tTV, tTKX, tTVX, Ja[0].t, Ja[1].t, Ja[2].t, Ja[3].t, tR, tTR};
    nbhd_forward_jvp_args jb = ja;
    jb.q = Q.cut.t;
    jb.t_q = use_t[0] ? TQ.cut.t : none();
    jb.out = Jb[0].t;
    jb.lse = Jb[1].t;
    jb.t_out = Jb[2].t;
    jb.t_lse = Jb[3].t;
    workspace_for(&full, NBHD_OP_FORWARD_JVP, &ea);
    workspace_for(&p, NBHD_OP_FORWARD_JVP, &eb);
    expect_ok("range forward_jvp (full)", nbhd_forward_jvp(&full, &ja, &ea));
    expect_ok("range forward_jvp", nbhd_forward_jvp(&p, &jb, &eb));
    free(ea.workspace);
    free(eb.workspace);
    static const char *jname[4] = {"out", "lse", "t_out", "t_lse"};
    for (int i = 0; i < 4; ++i) {
        snprintf(what, sizeof what, "range forward_jvp %s%s", jname[i], path);
        expect_rows(what, &Jb[i], &Ja[i], i % 2 ? ltol : tol);
    }

    /* ---- backward from the full forward's out and lse */
    static const char *gname[5] = {"dq", "dk", "dv", "dkx", "dvx"};
    const int64_t *gdims[5] = {s.q, s.k, s.v, s.kx, s.vx};
    double *o_d = dense_alloc(no), *l_d = dense_alloc(nl), *dout = dense_random(&r, no, -1, 1),
           *dlse = dense_random(&r, nl, -1, 1);
    tbuf_gather(&Oa, o_d);
    tbuf_gather(&La, l_d);
    row_pair OI = row_inputs(&r, &p, s.o, dt, 0, o_d, 0), LI = row_inputs(&r, &p, s.lse, lt, 1, l_d, 0),
             dO = row_inputs(&r, &p, s.o, dt, 0, dout, 1), dL = row_inputs(&r, &p, s.lse, lt, 1, dlse, 1);
    const int with_dlse = rng_int(&r, 0, 2) > 0, with_drpb = p.rpb && rng_int(&r, 0, 4) > 0;
    tbuf Ga[5], Gb[5], DRa = table(&p, lt, NULL), DRb = table(&p, lt, NULL);
    fill_sentinel(&DRb);
    for (int i = 0; i < 5; ++i) {
        Ga[i] = output(&r, gdims[i], dt, 0);
        Gb[i] = sentinel_output(&r, gdims[i], dt, 0);
    }
    nbhd_backward_args ba = {Q.full.t, KV[0].t, KV[1].t, tKX, tVX, OI.full.t, LI.full.t, dO.full.t,
                             with_dlse ? dL.full.t : none(), Ga[0].t, Ga[1].t, Ga[2].t,
                             has_x ? Ga[3].t : none(), has_x ? Ga[4].t : none(), tR,
                             with_drpb ? DRa.t : none()};
    nbhd_backward_args bb = {Q.cut.t, KV[0].t, KV[1].t, tKX, tVX, OI.cut.t, LI.cut.t, dO.cut.t,
                             with_dlse ? dL.cut.t : none(), Gb[0].t, Gb[1].t, Gb[2].t,
                             has_x ? Gb[3].t : none(), has_x ? Gb[4].t : none(), tR,
                             with_drpb ? DRb.t : none()};
    workspace_for(&full, NBHD_OP_BACKWARD, &ea);
    workspace_for(&p, NBHD_OP_BACKWARD, &eb);
    expect_ok("range backward (full)", nbhd_backward(&full, &ba, &ea));
    expect_ok("range backward", nbhd_backward(&p, &bb, &eb));
    free(ea.workspace);
    free(eb.workspace);
    snprintf(what, sizeof what, "range backward dq%s", path);
    expect_rows(what, &Gb[0], &Ga[0], tol);
    for (int i = 1; i < (has_x ? 5 : 3); ++i) {
        snprintf(what, sizeof what, "range backward %s%s", gname[i], path);
        expect_same(what, &Gb[i], &Ga[i], tol);
    }
    if (with_drpb) {
        snprintf(what, sizeof what, "range backward d_rpb%s", path);
        expect_same(what, &DRb, &DRa, ltol);
    }
    for (int i = 0; i < 5; ++i) { tbuf_free(&Ga[i]); tbuf_free(&Gb[i]); }
    tbuf_free(&DRa); tbuf_free(&DRb);
    row_pair_free(&OI); row_pair_free(&LI); row_pair_free(&dO); row_pair_free(&dL);
    free(o_d); free(l_d); free(dout); free(dlse);

    /* ---- backward through forward + JVP from its full run's outputs, each cotangent present or
     * absent, the tangents' gradients asked or not */
    row_pair JI[4], dJ[4];
    const int with_d[4] = {rng_int(&r, 0, 3) > 0, rng_int(&r, 0, 3) > 0, rng_int(&r, 0, 3) > 0,
                           rng_int(&r, 0, 3) > 0};
    for (int i = 0; i < 4; ++i) {
        const int64_t *dims = i % 2 ? s.lse : s.o;
        const nbhd_dtype et = i % 2 ? lt : dt;
        const int64_t n = i % 2 ? nl : no;
        double *x = dense_alloc(n), *d = dense_random(&r, n, -1, 1);
        tbuf_gather(&Ja[i], x);
        JI[i] = row_inputs(&r, &p, dims, et, i % 2, x, 0);
        dJ[i] = row_inputs(&r, &p, dims, et, i % 2, d, 1);
        free(x);
        free(d);
    }
    const int with_dt = rng_int(&r, 0, 3) > 0, with_dt_rpb = p.rpb && rng_int(&r, 0, 3) > 0;
    tbuf Ha[10], Hb[10], DTa[2], DTb[2];
    for (int i = 0; i < 10; ++i) {
        Ha[i] = output(&r, gdims[i % 5], dt, 0);
        Hb[i] = sentinel_output(&r, gdims[i % 5], dt, 0);
    }
    for (int i = 0; i < 2; ++i) {
        DTa[i] = table(&p, lt, NULL);
        DTb[i] = table(&p, lt, NULL);
        fill_sentinel(&DTb[i]);
    }
    nbhd_forward_jvp_backward_args jba, jbb;
    for (int run = 0; run < 2; ++run) {
        const row_pair *rp[9] = {&Q, &TQ, &JI[0], &JI[1], &JI[2], &JI[3], &dJ[0], &dJ[1], &dJ[2]};
        nbhd_tensor x[9];
        for (int i = 0; i < 9; ++i) x[i] = run ? rp[i]->cut.t : rp[i]->full.t;
        const nbhd_tensor dtl = run ? dJ[3].cut.t : dJ[3].full.t;
        tbuf *H = run ? Hb : Ha, *DT = run ? DTb : DTa;
        nbhd_forward_jvp_backward_args a = {
            x[0], KV[0].t, KV[1].t, tKX, tVX, use_t[0] ? x[1] : none(), tTK, tTV, tTKX, tTVX,
            x[2], x[3], x[4], x[5],
            with_d[0] ? x[6] : none(), with_d[1] ? x[7] : none(), with_d[2] ? x[8] : none(),
            with_d[3] ? dtl : none(),
            H[0].t, H[1].t, H[2].t, has_x ? H[3].t : none(), has_x ? H[4].t : none(),
            with_dt ? H[5].t : none(), with_dt ? H[6].t : none(), with_dt ? H[7].t : none(),
            with_dt && has_x ? H[8].t : none(), with_dt && has_x ? H[9].t : none(),
            tR, tTR, p.rpb ? DT[0].t : none(), with_dt_rpb ? DT[1].t : none()};
        if (run) jbb = a; else jba = a;
    }
    workspace_for(&full, NBHD_OP_FORWARD_JVP_BACKWARD, &ea);
    workspace_for(&p, NBHD_OP_FORWARD_JVP_BACKWARD, &eb);
    expect_ok("range forward_jvp_backward (full)", nbhd_forward_jvp_backward(&full, &jba, &ea));
    expect_ok("range forward_jvp_backward", nbhd_forward_jvp_backward(&p, &jbb, &eb));
    free(ea.workspace);
    free(eb.workspace);
    for (int i = 0; i < 10; ++i) {
        if ((i % 5) >= 3 && !has_x) continue;
        if (i >= 5 && !with_dt) continue;
        snprintf(what, sizeof what, "range backward_jvp %s%s%s", i < 5 ? "" : "t_", gname[i % 5], path);
        if (i % 5 == 0) expect_rows(what, &Hb[i], &Ha[i], tol);
        else expect_same(what, &Hb[i], &Ha[i], tol);
    }
    if (p.rpb) {
        snprintf(what, sizeof what, "range backward_jvp d_rpb%s", path);
        expect_same(what, &DTb[0], &DTa[0], ltol);
    }
    if (with_dt_rpb) {
        snprintf(what, sizeof what, "range backward_jvp d_t_rpb%s", path);
        expect_same(what, &DTb[1], &DTa[1], ltol);
    }

    for (int i = 0; i < 10; ++i) { tbuf_free(&Ha[i]); tbuf_free(&Hb[i]); }
    for (int i = 0; i < 2; ++i) { tbuf_free(&DTa[i]); tbuf_free(&DTb[i]); }
    for (int i = 0; i < 4; ++i) {
        row_pair_free(&JI[i]);
        row_pair_free(&dJ[i]);
        tbuf_free(&Ja[i]);
        tbuf_free(&Jb[i]);
        tbuf_free(&KV[i]);
        tbuf_free(&TKV[i]);
        free(kd[i]);
        free(ktd[i]);
    }
    tbuf_free(&Oa); tbuf_free(&La); tbuf_free(&Ob); tbuf_free(&Lb);
    row_pair_free(&Q); row_pair_free(&TQ);
    tbuf_free(&R); tbuf_free(&TR);
    free(q); free(tq); free(rpb); free(t_rpb);
    return checks_failed == before;
}

/* the oracle itself against docs/design.md §1's worked examples (L = 10, d = 1) */
static int check_naive_examples(void) {
    int bad = 0;
    struct { int K, s, c; int64_t i; int64_t start, end; } ex[] = {
        {4, 1, 0, 0, 0, 4}, {4, 1, 0, 1, 0, 4}, {4, 1, 0, 2, 0, 4}, {4, 1, 0, 3, 1, 5},
        {4, 1, 0, 4, 2, 6}, {4, 1, 0, 5, 3, 7}, {4, 1, 0, 6, 4, 8}, {4, 1, 0, 7, 5, 9},
        {4, 1, 0, 8, 6, 10}, {4, 1, 0, 9, 6, 10},
        {5, 2, 0, 0, 0, 5}, {5, 2, 0, 1, 0, 5}, {5, 2, 0, 2, 1, 6}, {5, 2, 0, 3, 1, 6},
        {5, 2, 0, 4, 3, 8}, {5, 2, 0, 5, 3, 8}, {5, 2, 0, 6, 5, 10}, {5, 2, 0, 7, 5, 10},
        {5, 2, 0, 8, 5, 10}, {5, 2, 0, 9, 5, 10},
        {4, 2, 1, 4, 2, 5}, {4, 2, 1, 5, 2, 6},
    };
    for (size_t n = 0; n < sizeof ex / sizeof ex[0]; ++n)
        for (int64_t j = 0; j < 10; ++j) {
            const int want = ex[n].start <= j && j < ex[n].end;
            if (naive_axis_sees(10, ex[n].K, ex[n].s, 1, ex[n].c, ex[n].i, j) != want) {
                fprintf(stderr, "FAIL naive oracle: K=%d s=%d causal=%d i=%lld key %lld\n", ex[n].K,
                        ex[n].s, ex[n].c, (long long)ex[n].i, (long long)j);
                bad = 1;
            }
        }
    return !bad;
}

int main(int argc, char **argv) {
    const int cases = argc > 1 ? atoi(argv[1]) : 300;
    const int first = argc > 2 ? atoi(argv[2]) : 0;
    int passed = 0, failed = 0;
    if (check_naive_examples()) passed++; else failed++;
    for (int c = first; c < first + cases; ++c) {
        if (run_case((uint64_t)c)) passed++;
        else failed++;
    }
    for (int c = first; c < first + (cases + 2) / 3; ++c) {  /* a third as many with a bias */
        if (run_rpb_case((uint64_t)c)) passed++;
        else failed++;
    }
    for (int c = first; c < first + (cases + 2) / 3; ++c) {  /* a third as many with a query range */
        if (run_range_case((uint64_t)c)) passed++;
        else failed++;
    }
    amx_shapes = 1;   /* then a tenth as many for the AMX kernels (the SIMD ones where no AMX) */
    for (int c = first; c < first + (cases + 9) / 10; ++c) {
        if (run_case((uint64_t)c + 1000000)) passed++;
        else failed++;
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
