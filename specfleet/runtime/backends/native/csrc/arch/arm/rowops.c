/* Row operations on AArch64 NEON: RMSNorm, SiLU(gate) * up (exp4 of arm.h) and rotary embedding of one
 * head, the generic bodies' bits (../../generic/rowops.c) lane by lane. Each is per row. */
#include "arm.h"

void sfq_rmsnorm_row(const float *x, int64_t K, const float *w, float eps, float *out) {
    float32x4_t s[4][2];
    for (int j = 0; j < 4; j++) s[j][0] = s[j][1] = vdupq_n_f32(0.0f);
    int64_t i = 0;
    for (; i + 32 <= K; i += 32)
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++) {
                const float32x4_t v = vld1q_f32(x + i + 8 * j + 4 * h);
                s[j][h] = vfmaq_f32(s[j][h], v, v);
            }
    const float32x4_t lo = vaddq_f32(vaddq_f32(s[0][0], s[1][0]), vaddq_f32(s[2][0], s[3][0]));
    const float32x4_t hi = vaddq_f32(vaddq_f32(s[0][1], s[1][1]), vaddq_f32(s[2][1], s[3][1]));
    float ss = hsum8(lo, hi);
    for (; i < K; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)K + eps);
    const float32x4_t rv = vdupq_n_f32(r);
    for (i = 0; i + 4 <= K; i += 4) vst1q_f32(out + i, vmulq_f32(vld1q_f32(w + i), vmulq_f32(vld1q_f32(x + i), rv)));
    for (; i < K; i++) out[i] = w[i] * (x[i] * r);
}

void sfq_silu_mul_row(const float *g, const float *u, int64_t K, float *out) {
    int64_t i = 0;
    const float32x4_t one = vdupq_n_f32(1.0f);
    for (; i + 4 <= K; i += 4) {
        const float32x4_t gv = vld1q_f32(g + i);
        const float32x4_t e = exp4(vnegq_f32(gv));
        vst1q_f32(out + i, vmulq_f32(vdivq_f32(gv, vaddq_f32(one, e)), vld1q_f32(u + i)));
    }
    for (; i < K; i++) out[i] = g[i] / (1.0f + sf_exp(-g[i])) * u[i];
}

void sfq_rope_head(const float *x, const float *c, const float *s, int64_t D, float *out) {
    const int64_t half = D / 2;
    int64_t d = 0;
    for (; d + 4 <= half; d += 4) {
        const float32x4_t a = vld1q_f32(x + d), b = vld1q_f32(x + half + d);
        vst1q_f32(out + d, vaddq_f32(vmulq_f32(a, vld1q_f32(c + d)), vmulq_f32(vnegq_f32(b), vld1q_f32(s + d))));
        vst1q_f32(out + half + d, vaddq_f32(vmulq_f32(b, vld1q_f32(c + half + d)), vmulq_f32(a, vld1q_f32(s + half + d))));
    }
    for (; d < half; d++) {
        const float a = x[d], b = x[half + d];
        const float p0 = a * c[d], p1 = -b * s[d], p2 = b * c[half + d], p3 = a * s[half + d];
        out[d] = p0 + p1;
        out[half + d] = p2 + p3;
    }
}
