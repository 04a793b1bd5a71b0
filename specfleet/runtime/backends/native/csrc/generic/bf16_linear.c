/* y[M, N] = x[M, K] @ W[N, K]^T for bf16 weights in plain C, the bits of the x86 body
 * (../arch/x86/bf16_linear.c): each output's sum in eight lanes (lane l takes k = 8i + l by fused
 * multiply-adds), sf_hsum8, then the tail past the last 8 added one by one (a product, then the sum). */
#include <omp.h>

#include "../q_common.h"

static inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void specfleet_bf16_linear(const float *x, int64_t M, int64_t K, const uint16_t *W, int64_t N, float *y,
                           int num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && N >= 64)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *w = W + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t k = 0;
            for (; k + 8 <= K; k += 8)
                for (int l = 0; l < 8; l++) acc[l] = fmaf(bf16_to_f32(w[k + l]), xm[k + l], acc[l]);
            float s = sf_hsum8(acc);
            for (; k < K; k++) s += xm[k] * bf16_to_f32(w[k]);
            y[m * N + n] = s;
        }
    }
}
