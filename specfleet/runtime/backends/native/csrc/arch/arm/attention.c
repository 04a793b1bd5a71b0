/* Attention of one KV head's query heads on AArch64 NEON, the generic body's bits
 * (../../generic/attention.c): a score's eight lanes in two registers, summed by hsum8_pairs; exp4 on
 * four keys at a time, their sum in eight lanes (key j in lane j % 8); the weighted sum of values a chain
 * of vfmaq_f32 in key order, 16 values of D at a time. A row's bits never depend on the other rows. */
#include "arm.h"

#ifndef VCHUNK_D
#define VCHUNK_D 16 /* values of D whose sums stay in registers over all keys */
#endif

void sfq_attend_group(const float *q, int64_t qs, int64_t m, int64_t G, const float *k, const float *v,
                      int64_t ldk, const int64_t *krow, const int64_t *L, int64_t D, float scale, float *sc,
                      int64_t L8, float *qp, float *out) {
    (void)qp;
    for (int64_t r = 0; r < m; r++) {
        const int64_t Lr = L[r];
        for (int64_t a = 0; a < G; a++) {
            const float *qa = q + r * qs + a * D;
            float *s = sc + r * G * L8 + a * L8;
            for (int64_t j = 0; j < Lr; j++) {
                const float *kr = k + krow[j] * ldk;
                float32x4_t lo = vdupq_n_f32(0.0f), hi = vdupq_n_f32(0.0f);
                for (int64_t d = 0; d < D; d += 8) {
                    lo = vfmaq_f32(lo, vld1q_f32(qa + d), vld1q_f32(kr + d));
                    hi = vfmaq_f32(hi, vld1q_f32(qa + d + 4), vld1q_f32(kr + d + 4));
                }
                s[j] = hsum8_pairs(lo, hi) * scale;
            }
            float mx = s[0];
            for (int64_t j = 1; j < Lr; j++) mx = s[j] > mx ? s[j] : mx;
            const float32x4_t mv = vdupq_n_f32(mx);
            float32x4_t sv[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
            static const int32_t lane[4] = {0, 1, 2, 3};
            const int32x4_t lanes = vld1q_s32(lane);
            for (int64_t j = 0; j < Lr; j += 4) { /* s has L8 >= Lr rounded up to 8 floats */
                const uint32x4_t live = vcltq_s32(lanes, vdupq_n_s32((int32_t)(Lr - j)));
                const float32x4_t e = vreinterpretq_f32_u32(
                    vandq_u32(vreinterpretq_u32_f32(exp4(vsubq_f32(vld1q_f32(s + j), mv))), live));
                vst1q_f32(s + j, e);
                sv[(j >> 2) & 1] = vaddq_f32(sv[(j >> 2) & 1], e);
            }
            const float inv = 1.0f / hsum8(sv[0], sv[1]);
            for (int64_t j = 0; j < Lr; j++) s[j] *= inv;
            float *o = out + r * qs + a * D;
            for (int64_t d = 0; d < D; d += VCHUNK_D) {
                float32x4_t acc[VCHUNK_D / 4];
                for (int u = 0; u < VCHUNK_D / 4; u++) acc[u] = vdupq_n_f32(0.0f);
                for (int64_t j = 0; j < Lr; j++) {
                    const float *vr = v + krow[j] * ldk + d;
                    const float32x4_t p = vdupq_n_f32(s[j]);
                    for (int u = 0; u < VCHUNK_D / 4; u++) acc[u] = vfmaq_f32(acc[u], p, vld1q_f32(vr + 4 * u));
                }
                for (int u = 0; u < VCHUNK_D / 4; u++) vst1q_f32(o + d + 4 * u, acc[u]);
            }
        }
    }
}
