/* Row operations in plain C: RMSNorm, SiLU(gate) * up and rotary embedding of one head, the reference
 * bodies of q_common.h's contract (each lane computed as the vector bodies compute it). */
#include "../q_common.h"

/* sums of squares in 32 lanes (4 x 8: lane l of accumulator j takes x[32i + 8j + l] by fused
 * multiply-adds), the accumulators added (s0 + s1) + (s2 + s3) lane by lane, then sf_hsum8; the tail
 * past the last 32 added one by one (a product, then the sum) */
void sfq_rmsnorm_row(const float *x, int64_t K, const float *w, float eps, float *out) {
    float s[4][8] = {{0}};
    int64_t i = 0;
    for (; i + 32 <= K; i += 32)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 8; l++) {
                const float v = x[i + 8 * j + l];
                s[j][l] = fmaf(v, v, s[j][l]);
            }
    float lanes[8];
    for (int l = 0; l < 8; l++) lanes[l] = (s[0][l] + s[1][l]) + (s[2][l] + s[3][l]);
    float ss = sf_hsum8(lanes);
    for (; i < K; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)K + eps);
    for (i = 0; i < K; i++) out[i] = w[i] * (x[i] * r);
}

void sfq_silu_mul_row(const float *g, const float *u, int64_t K, float *out) {
    for (int64_t i = 0; i < K; i++) out[i] = g[i] / (1.0f + sf_exp(-g[i])) * u[i];
}

void sfq_rope_head(const float *x, const float *c, const float *s, int64_t D, float *out) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; d++) {
        const float a = x[d], b = x[half + d];
        const float p0 = a * c[d], p1 = -b * s[d], p2 = b * c[half + d], p3 = a * s[half + d];
        out[d] = p0 + p1;
        out[half + d] = p2 + p3;
    }
}
