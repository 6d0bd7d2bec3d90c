/*
 * nbhd.h — the one public header of the nbhd C library.
 *
 * Neighborhood attention (1-D/2-D/3-D sliding-window attention) with fused kernels for the
 * forward pass, the backward pass and the forward-mode derivative (JVP). Semantics follow
 * NATTEN exactly (docs/design.md §1); the math is docs/design.md §4. Usable from C with this header alone.
 *
 * Shape legend (heads-last, every tensor is addressed as a 6-D view with element strides):
 *   B batch, X Y Z spatial axes (rank 1..3; unused axes have extent 1), H query heads,
 *   Hkv key/value heads (H % Hkv == 0), D head dim of Q and K, Dv head dim of V.
 *   Q, dQ, tQ            [B, X, Y, Z, H,   D ]
 *   K, dK, tK            [B, X, Y, Z, Hkv, D ]
 *   V, dV, tV            [B, X, Y, Z, Hkv, Dv]
 *   O, dO, tO            [B, X, Y, Z, H,   Dv]
 *   LSE, dLSE, tLSE      [B, X, Y, Z, H     ]   (stride[5] ignored)
 *   Kx, Vx (+ d, t)      [B, S,  -, -, Hkv, D/Dv]  additional keys: stride[1] steps tokens
 * Rank 0 is dense attention: Q/O/LSE are [B, S_q, -, -, H, .] with S_q = extent[0] and every
 * query sees only the extra_kv additional keys.
 *
 * Per query i with key set W(i) (its neighborhood, then the additional keys), s = scale:
 *   S_ij = s q_i.k_j,  lse_i = log sum_j exp S_ij,  o_i = sum_j exp(S_ij - lse_i) v_j.
 *
 * Element types: F64 inputs give F64 LSE and F64 accumulation; F32/F16/BF16 inputs give an
 * F32 LSE and accumulate in F32. Outputs are write-only: they are never read, so poisoned or
 * uninitialised output buffers are fine. The library never allocates on the hot path: scratch
 * memory comes from the caller (nbhd_workspace_bytes).
 *
 * Non-finite inputs: a NaN or an infinity reaches exactly the outputs that depend on it through
 * the formulas below (a query's window, its inverse window for key gradients), never a query
 * that does not see it (docs/nonfinite.md).
 */
#ifndef NBHD_H
#define NBHD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define NBHD_API __declspec(dllexport)
#else
#define NBHD_API __attribute__((visibility("default")))
#endif

#define NBHD_VERSION_MAJOR 0
#define NBHD_VERSION_MINOR 1
#define NBHD_VERSION_PATCH 0

typedef enum {
    NBHD_OK = 0,
    NBHD_ERR_ARG = 1,          /* a field of the problem or a tensor is invalid */
    NBHD_ERR_UNSUPPORTED = 2,  /* valid, but this build or device cannot run it */
    NBHD_ERR_DEVICE = 3,       /* the device runtime reported an error */
    NBHD_ERR_WORKSPACE = 4,    /* workspace missing or smaller than nbhd_workspace_bytes */
    NBHD_ERR_ALLOC = 5,        /* host memory for per-thread scratch could not be allocated */
} nbhd_status;

typedef enum { NBHD_F64 = 0, NBHD_F32 = 1, NBHD_F16 = 2, NBHD_BF16 = 3 } nbhd_dtype;
typedef enum { NBHD_CPU = 0, NBHD_CUDA = 1 } nbhd_device;
typedef enum {
    NBHD_OP_FORWARD = 0,
    NBHD_OP_BACKWARD = 1,
    NBHD_OP_FORWARD_JVP = 2,
    NBHD_OP_FORWARD_JVP_BACKWARD = 3,
} nbhd_op;

#define NBHD_MAX_RANK 3

/* The geometry and sizes of one problem. Every rule is checked by nbhd_validate. */
typedef struct {
    int32_t rank;                     /* 0 (dense over extra keys only), 1, 2 or 3 */
    int64_t extent[NBHD_MAX_RANK];    /* tokens per spatial axis (rank 0: extent[0] = S_q) */
    int32_t kernel[NBHD_MAX_RANK];    /* window size per axis, 2 <= kernel*dilation <= extent */
    int32_t stride[NBHD_MAX_RANK];    /* 1 <= stride <= kernel */
    int32_t dilation[NBHD_MAX_RANK];  /* >= 1 */
    uint8_t causal[NBHD_MAX_RANK];    /* 0 or 1 */
    int64_t batch;                    /* >= 0 */
    int64_t extra_kv;                 /* additional keys seen by every query, >= 0 */
    int32_t heads, kv_heads;          /* heads % kv_heads == 0 (0 heads: nothing to do) */
    int32_t head_dim, head_dim_v;     /* D and Dv, >= 1 */
    double scale;                     /* finite; S = scale * q.k */
    nbhd_dtype dtype;                 /* of every input, output, gradient and tangent but LSE */
    nbhd_device device;
    int32_t rpb;                      /* 1: the scores carry a relative positional bias (below;
                                         no causal axis, rank >= 1); 0: none, and the
                                         args' rpb fields must have NULL data */
    int64_t query_begin[NBHD_MAX_RANK];  /* query range (below): per axis both 0 (the whole axis) */
    int64_t query_end[NBHD_MAX_RANK];    /* or 0 <= query_begin < query_end <= extent */
} nbhd_problem;

/* Query range (context parallelism, docs/context_parallel.md): only the queries x with
 * query_begin[a] <= x_a < query_end[a] on every axis are computed; windows are those of the whole
 * grid, so a key outside the range is still seen by the queries inside it. The rows of the other
 * queries are neither read nor written by any op: their q, out, lse, d_out, d_lse, t_q, t_out,
 * t_lse may hold anything (NaN included), and their d_q, d_t_q, out, lse, t_out, t_lse keep what
 * they held. Key-side gradients (d_k, d_v, their tangents' and the tables') sum over the range's
 * queries only. Rank 0 has no range (all zero). */

/* Relative positional bias (docs/rpb.md): with problem.rpb = 1 the window scores gain a bias
 * from a per-head table of M = prod_a (2 K_a - 1) entries (axes 0..rank-1, row-major): for
 * query x and a key y of its window, r_a = (y_a - x_a) / d_a + K_a - 1 and
 *   S_ij = s q_i.k_j + rpb[h, flat(r)]
 * (additional keys get no bias). Tables rpb, t_rpb, d_rpb, d_t_rpb are [H, M] (H query heads),
 * float32 (float64 for NBHD_F64), contiguous: stride[4] = M (steps heads), stride[5] = 1, the
 * other strides ignored. A read table with NULL data is zero; a written one with NULL data is
 * not computed. The gradients d_rpb and d_t_rpb are sums over batch, queries and window slots:
 * on the CPU accumulated per thread in the workspace and reduced in a fixed order (deterministic
 * for a given exec.threads); on CUDA zeroed, then added to by atomics (summation order not fixed,
 * whatever exec.kv_parallel says). */

/* A tensor: data pointer and element strides of its [B, X, Y, Z, H, D] view (see legend).
 * Every entry point checks each tensor it reads or writes: data not NULL, strides >= 0 on the
 * axes of extent > 1, the largest addressed element (sum of (extent - 1) * stride) within int64
 * byte offsets, and, when `elements` is set, below it. */
typedef struct {
    void *data;
    int64_t stride[6];
    int64_t elements;   /* elements of the allocation from data on (0: unknown, not checked) */
} nbhd_tensor;

/* How to run it. Zero-initialised is a valid default. */
typedef struct {
    void *stream;                     /* cudaStream_t for NBHD_CUDA, ignored on the CPU */
    void *workspace;                  /* at least nbhd_workspace_bytes(...) bytes, or NULL if 0 */
    size_t workspace_bytes;
    int32_t threads;                  /* CPU threads: > 0 exactly that many; 0 up to OpenMP's
                                         count, < 0 up to -threads, fewer for small problems */
    int32_t kv_parallel;              /* GPU backward may add dQ with fp32 atomics (f16/bf16,
                                         D <= 64; D = 128 on Hopper's 128-row patches): not
                                         bitwise deterministic; 0: deterministic (a CUDA
                                         d_rpb is not, above). Pass the same
                                         value to nbhd_workspace_bytes. */
    int32_t use_reference;            /* force the plain scalar kernels (tests, debugging) */
    int32_t q_tile[NBHD_MAX_RANK];    /* query tile per problem axis; all 0: the library chooses */
    int32_t kv_tile[NBHD_MAX_RANK];   /* key tile per axis; a set tile must belong to one of
                                         nbhd_tile_configs (the other may be 0: first match) */
} nbhd_exec;

/* A tile configuration of a kernel: the query patch one worker owns and the key tiles it
 * walks over the union of the patch's windows (docs/design.md §2.4), per problem axis. */
typedef struct {
    int32_t q_tile[NBHD_MAX_RANK];
    int32_t kv_tile[NBHD_MAX_RANK];
} nbhd_tile_config;

/* Forward: O = softmax(s Q K^T + mask) V, LSE. Inputs q,k,v (+kx,vx when extra_kv > 0). */
typedef struct {
    nbhd_tensor q, k, v, kx, vx;      /* read */
    nbhd_tensor out, lse;             /* written */
    nbhd_tensor rpb;                  /* read when problem.rpb: S += rpb[h, flat(r)] */
} nbhd_forward_args;

/* Backward (docs/design.md §4.2): D_i = dO_i.O_i - dLSE_i, P = exp(S - LSE), dS = P (dO V^T - D),
 * dQ = s dS K, dK = s dS^T Q, dV = P^T dO. d_lse.data may be NULL (no gradient on LSE).
 * With problem.rpb: S includes the bias, and d_rpb[h, flat(r_ij)] += dS_ij over the window pairs.
 * Deterministic (exec.kv_parallel 0): every output element is written by one thread in a fixed
 * order, but for the CUDA table gradient (above). */
typedef struct {
    nbhd_tensor q, k, v, kx, vx, out, lse, d_out, d_lse;   /* read */
    nbhd_tensor d_q, d_k, d_v, d_kx, d_vx;                 /* written */
    nbhd_tensor rpb;                                       /* read when problem.rpb */
    nbhd_tensor d_rpb;                                     /* written when problem.rpb and data != NULL */
} nbhd_backward_args;

/* Forward + JVP in one pass: O, LSE, tO and tLSE = mu from (Q,K,V) and tangents (tQ,tK,tV);
 * a tangent whose data is NULL is zero and its products are skipped.
 *   tS = s (tq.k + q.tk) [+ t_rpb[h, flat(r)]], mu = sum P tS, tO = sum P (tv + tS v) - mu O. */
typedef struct {
    nbhd_tensor q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx; /* read */
    nbhd_tensor out, lse, t_out, t_lse;                     /* written */
    nbhd_tensor rpb, t_rpb;                                 /* read when problem.rpb */
} nbhd_forward_jvp_args;

/* Backward through forward+JVP (docs/design.md §4.4): gradients of a loss on (O, LSE, tO, tLSE) with
 * respect to Q, K, V and their tangents. With G = dL/dtO, g_mu = dL/dtLSE, n = tS - mu,
 * c = G.O, E = G.tO, D' = dO.O - dLSE and w = G v^T - c + g_mu:
 *   dtS = P w,  dS = P (dO v^T - D' + G tv^T + w n - E),
 *   dQ = s (dS K + dtS tK),  dK = s (dS^T Q + dtS^T tQ),  dV = P^T dO + (P n)^T G,
 *   dtQ = s dtS K,  dtK = s dtS^T Q,  dtV = P^T G.
 * With problem.rpb, S and tS include rpb and t_rpb; the bias is additive in S and t_rpb in tS,
 * so over the window pairs d_rpb[h, flat(r_ij)] += dS_ij and d_t_rpb[h, flat(r_ij)] += dtS_ij.
 * Any of d_out, d_lse, d_t_out, d_t_lse and the tangents may have NULL data (zero); d_t_*
 * outputs with NULL data are not computed. Deterministic, like nbhd_backward. */
typedef struct {
    nbhd_tensor q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx;  /* read */
    nbhd_tensor out, lse, t_out, t_lse;                      /* read: nbhd_forward_jvp's outputs */
    nbhd_tensor d_out, d_lse, d_t_out, d_t_lse;              /* read */
    nbhd_tensor d_q, d_k, d_v, d_kx, d_vx;                   /* written */
    nbhd_tensor d_t_q, d_t_k, d_t_v, d_t_kx, d_t_vx;         /* written when data != NULL */
    nbhd_tensor rpb, t_rpb;                                  /* read when problem.rpb */
    nbhd_tensor d_rpb, d_t_rpb;                              /* written when problem.rpb and data != NULL */
} nbhd_forward_jvp_backward_args;

/* Merge (docs/design.md §4.5): n partial attentions of the same queries, as if their keys had been
 * concatenated: LSE = log sum_a exp(LSE_a), O = sum_a exp(LSE_a - LSE) O_a. A row whose parts
 * all have LSE = -inf gets O = 0 and LSE = -inf. A row where some parts have LSE = +inf gets
 * LSE = +inf and O = the mean of those parts' O_a (the limit as their LSE grow together; the
 * other parts' weights go to 0). A NaN LSE in any part gives a NaN row. Rows are [B, T, H]
 * (T tokens in any layout the strides describe); every part, and the result, may have its own
 * strides. */
#define NBHD_MERGE_MAX_PARTS 32
typedef struct {
    int32_t parts;                    /* 1 <= parts <= NBHD_MERGE_MAX_PARTS */
    int64_t batch, tokens;            /* >= 0 */
    int32_t heads, head_dim_v;        /* >= 1 */
    nbhd_dtype dtype;                 /* of the outputs; LSE is float32 (float64 for NBHD_F64) */
    nbhd_device device;
} nbhd_merge_problem;

typedef struct {
    nbhd_tensor outs[NBHD_MERGE_MAX_PARTS];  /* read: [B, T, -, -, H, Dv] (stride[1] steps tokens) */
    nbhd_tensor lses[NBHD_MERGE_MAX_PARTS];  /* read: [B, T, -, -, H] */
    nbhd_tensor out, lse;                    /* written */
} nbhd_merge_args;

NBHD_API const char *nbhd_version(void);
NBHD_API const char *nbhd_status_string(nbhd_status status);
/* The message of the last failed call on this thread: names the field, the value and the rule. */
NBHD_API const char *nbhd_last_error(void);
/* 1 when the library was built with CUDA kernels. */
NBHD_API int nbhd_has_cuda(void);
/* The instruction set the fast CPU kernels run with on this machine: "amx" (AVX-512, and AMX-BF16
 * tiles for the bf16 forward, forward+JVP and backward), "avx512", "avx2" or "generic". NBHD_CPU_ISA=avx512|avx2|generic
 * in the environment lowers it (never past what the CPU has). */
NBHD_API const char *nbhd_cpu_isa(void);

NBHD_API nbhd_status nbhd_validate(const nbhd_problem *p);
/* The tile configurations the op's tiled kernels accept for this problem (on p->device): writes
 * the first min(count, max) to out (out may be NULL when max is 0) and returns the count; the
 * first is the default. 0: no tiled kernel runs this problem (exec tiles are refused), -1:
 * the problem is invalid (see nbhd_last_error). Axes past p->rank are 0. A kernel that falls
 * back to the untiled path for a tensor layout refuses exec tiles with NBHD_ERR_UNSUPPORTED. */
NBHD_API int32_t nbhd_tile_configs(const nbhd_problem *p, nbhd_op op, nbhd_tile_config *out,
                                   int32_t max);
/* Scratch bytes the op needs for this problem (0 when none) on the path and threads exec picks;
 * pass the same exec (use_reference, threads, kv_parallel) to the call.
 * CPU: the fast kernels (fp32, fp16, bf16 with a window) pack their operands one slab of key
 * heads, or one tile of a head's tokens with the halo its windows need, at a time, so the size
 * does not grow with the tokens: at most
 *     max(T, 4 F P) + 4 E + 1024 bytes, where
 *   T = 32 MiB + 2 MiB * threads (threads: exec.threads, its magnitude when negative, OpenMP's
 *       count when 0); NBHD_CPU_TILE_BYTES=n in the environment makes T n bytes (tests),
 *   F = c (D + Dv), plus G (D + Dv + 2) for NBHD_OP_BACKWARD and G (2 (D + Dv) + 4) for
 *       NBHD_OP_FORWARD_JVP_BACKWARD: floats per packed token (c = 2 for NBHD_OP_FORWARD_JVP
 *       and NBHD_OP_FORWARD_JVP_BACKWARD, else 1; G = heads / kv_heads),
 *   P = (32 + 2 (K_l - 1)) (4 + 2 (K_m - 1)) (1 + 2 (K_f - 1)): tokens of the smallest tile
 *       and its halo, K_l, K_m, K_f the kernel sizes along the last axis, the one before it and
 *       the one before that (a missing axis's factor is 1),
 *   E = c S (D + Dv) kv_heads: the packed extra keys (S = extra_kv).
 * The reference kernels (exec.use_reference, fp64, rank 0) take 8
 * bytes per query row (batch * tokens * heads) for NBHD_OP_BACKWARD, 24 for
 * NBHD_OP_FORWARD_JVP_BACKWARD, nothing for the others. With problem.rpb the backwards, on
 * either path, add 8 heads M bytes per thread (16 for NBHD_OP_FORWARD_JVP_BACKWARD): the
 * per-thread partial tables of d_rpb (and d_t_rpb). */
NBHD_API size_t nbhd_workspace_bytes(const nbhd_problem *p, nbhd_op op, const nbhd_exec *e);

NBHD_API nbhd_status nbhd_forward(const nbhd_problem *p, const nbhd_forward_args *a,
                                  const nbhd_exec *e);
NBHD_API nbhd_status nbhd_backward(const nbhd_problem *p, const nbhd_backward_args *a,
                                   const nbhd_exec *e);
NBHD_API nbhd_status nbhd_forward_jvp(const nbhd_problem *p, const nbhd_forward_jvp_args *a,
                                      const nbhd_exec *e);
/* On the CPU and on CUDA (tensor-core kernels for f16/bf16 at D = Dv in {32, 64, 128}, else a
 * warp per row), in O(N D) memory. */
NBHD_API nbhd_status nbhd_forward_jvp_backward(const nbhd_problem *p,
                                               const nbhd_forward_jvp_backward_args *a,
                                               const nbhd_exec *e);

/* The byte offset of `field` in the public struct named `type` (field "": the struct's size),
 * or -1 when there is no such struct or field: bindings check their own declarations with it. */
NBHD_API int64_t nbhd_layout(const char *type, const char *field);

/* Merge partial attentions (nbhd_merge_problem). Deterministic; no workspace. */
NBHD_API nbhd_status nbhd_merge(const nbhd_merge_problem *p, const nbhd_merge_args *a,
                                const nbhd_exec *e);

#ifdef __cplusplus
}
#endif
#endif /* NBHD_H */
