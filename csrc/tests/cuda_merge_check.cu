/*
 * cuda_merge_check.cu — the CUDA merge kernel on its own, for a GPU machine without building the
 * whole extension: random parts (some rows without keys, one part strided), outputs poisoned
 * with NaN, compared with a double-precision merge on the host. Prints the worst errors and
 * exits non-zero on a mismatch.
 *   nvcc -std=c++17 -arch=sm_90a -Icsrc/include -Icsrc/core -Icsrc/cuda \
 *        csrc/tests/cuda_merge_check.cu -o /tmp/merge_check && /tmp/merge_check
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "../cuda/merge.cu"

extern "C" nbhd_status nbhd_fail(nbhd_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    return status;
}

template <typename T> static T to_t(float x);
template <> float to_t<float>(float x) { return x; }
template <> double to_t<double>(float x) { return x; }
template <> __half to_t<__half>(float x) { return __float2half_rn(x); }
template <> __nv_bfloat16 to_t<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
static double from_t(float x) { return x; }
static double from_t(double x) { return x; }
static double from_t(__half x) { return __half2float(x); }
static double from_t(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T, typename L>
static int check(nbhd_dtype dtype, const char *name, double tol) {
    const int parts = 5, B = 2, Tk = 37, H = 3, Dv = 24;
    const int64_t rows = (int64_t)B * Tk * H, n = rows * Dv;
    srand(7);
    auto uni = []() { return (float)rand() / RAND_MAX * 2 - 1; };
    T *h_o[parts];
    L *h_l[parts];
    nbhd_merge_problem p = {parts, B, Tk, H, Dv, dtype, NBHD_CUDA};
    nbhd_merge_args a;
    memset(&a, 0, sizeof a);
    void *dev[2 * parts + 2];
    for (int i = 0; i < parts; ++i) {
        h_o[i] = (T *)malloc(sizeof(T) * n);
        h_l[i] = (L *)malloc(sizeof(L) * rows);
        for (int64_t j = 0; j < n; ++j) h_o[i][j] = to_t<T>(uni());
        for (int64_t r = 0; r < rows; ++r) {
            const bool empty = r == rows - 1 || (i == 0 && r % 5 == 0);  /* no keys there */
            h_l[i][r] = empty ? (L)-INFINITY : (L)(3 * uni());
        }
        /* part 1 interleaved with junk (every element stride doubled), the others contiguous */
        const int64_t spread = i == 1 ? 2 : 1;
        T *staged = (T *)malloc(sizeof(T) * n * spread);
        for (int64_t j = 0; j < n * spread; ++j) staged[j] = to_t<T>(1e4f);
        for (int64_t j = 0; j < n; ++j) staged[j * spread] = h_o[i][j];
        cudaMalloc(&dev[2 * i], sizeof(T) * n * spread);
        cudaMalloc(&dev[2 * i + 1], sizeof(L) * rows);
        cudaMemcpy(dev[2 * i], staged, sizeof(T) * n * spread, cudaMemcpyHostToDevice);
        cudaMemcpy(dev[2 * i + 1], h_l[i], sizeof(L) * rows, cudaMemcpyHostToDevice);
        free(staged);
        a.outs[i] = (nbhd_tensor){dev[2 * i], {spread * Tk * H * Dv, spread * H * Dv, 0, 0,
                                               spread * Dv, spread}};
        a.lses[i] = (nbhd_tensor){dev[2 * i + 1], {Tk * H, H, 0, 0, 1, 0}};
    }
    cudaMalloc(&dev[2 * parts], sizeof(T) * n);
    cudaMalloc(&dev[2 * parts + 1], sizeof(L) * rows);
    cudaMemset(dev[2 * parts], 0xFF, sizeof(T) * n);          /* NaN poison */
    cudaMemset(dev[2 * parts + 1], 0xFF, sizeof(L) * rows);
    a.out = (nbhd_tensor){dev[2 * parts], {Tk * H * Dv, H * Dv, 0, 0, Dv, 1}};
    a.lse = (nbhd_tensor){dev[2 * parts + 1], {Tk * H, H, 0, 0, 1, 0}};
    nbhd_exec e;
    memset(&e, 0, sizeof e);
    if (nbhd_cuda_merge(&p, &a, &e) != NBHD_OK) return 1;
    T *out = (T *)malloc(sizeof(T) * n);
    L *lse = (L *)malloc(sizeof(L) * rows);
    cudaMemcpy(out, dev[2 * parts], sizeof(T) * n, cudaMemcpyDeviceToHost);
    cudaMemcpy(lse, dev[2 * parts + 1], sizeof(L) * rows, cudaMemcpyDeviceToHost);
    double worst_o = 0, worst_l = 0;
    int bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
        double m = -INFINITY;
        for (int i = 0; i < parts; ++i) m = fmax(m, (double)h_l[i][r]);
        double want_l = -INFINITY;
        if (m > -INFINITY) {
            double sum = 0;
            for (int i = 0; i < parts; ++i) sum += exp((double)h_l[i][r] - m);
            want_l = m + log(sum);
        }
        if (isinf(want_l)) bad |= !(isinf((double)lse[r]) && lse[r] < 0);
        else worst_l = fmax(worst_l, fabs((double)lse[r] - want_l));
        for (int c = 0; c < Dv; ++c) {
            double want = 0;
            if (m > -INFINITY)
                for (int i = 0; i < parts; ++i)
                    want += exp((double)h_l[i][r] - want_l) * from_t(h_o[i][r * Dv + c]);
            const double got = from_t(out[r * Dv + c]);
            if (isnan(got)) bad = 1;
            worst_o = fmax(worst_o, fabs(got - want));
        }
    }
    const int ok = !bad && worst_o <= tol && worst_l <= tol && cudaGetLastError() == cudaSuccess;
    printf("merge %-5s: max |out err| %.3g, max |lse err| %.3g, empty rows %s -> %s\n", name,
           worst_o, worst_l, bad ? "WRONG" : "ok", ok ? "PASS" : "FAIL");
    for (int i = 0; i < 2 * parts + 2; ++i) cudaFree(dev[i]);
    for (int i = 0; i < parts; ++i) { free(h_o[i]); free(h_l[i]); }
    free(out);
    free(lse);
    return !ok;
}

int main() {
    int fails = 0;
    fails += check<double, double>(NBHD_F64, "f64", 1e-12);
    fails += check<float, float>(NBHD_F32, "f32", 1e-5);
    fails += check<__half, float>(NBHD_F16, "f16", 4e-3);
    fails += check<__nv_bfloat16, float>(NBHD_BF16, "bf16", 2e-2);
    printf("%s\n", fails ? "cuda merge check: FAILED" : "cuda merge check: all passed");
    return fails != 0;
}
