/* Attention of one KV head's query heads in plain C: the reference body behind ../attention.c's driver.
 *
 * For each row r (of m, sharing the KV head) and query head a (of G): key j's score is the dot product of
 * q_a and k_j in eight lanes (lane l takes dimensions 8i + l by fused multiply-adds), summed by
 * sf_hsum8_pairs, times scale; the softmax takes the largest score, sf_exp(score - max) per key, their sum
 * in eight lanes (key j in lane j % 8, added chunk after chunk) by sf_hsum8, and multiplies each by the
 * sum's reciprocal; the output is the chain of fused multiply-adds p_j * v_j in key order from 0. A row's
 * values never depend on the other rows or on where its keys sit in the cache. */
#include "../q_common.h"

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
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int64_t d = 0; d < D; d += 8)
                    for (int l = 0; l < 8; l++) acc[l] = fmaf(qa[d + l], kr[d + l], acc[l]);
                s[j] = sf_hsum8_pairs(acc) * scale;
            }
            float mx = s[0];
            for (int64_t j = 1; j < Lr; j++) mx = s[j] > mx ? s[j] : mx;
            float sv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t j = 0; j < Lr; j++) {
                s[j] = sf_exp(s[j] - mx);
                sv[j % 8] += s[j];
            }
            const float inv = 1.0f / sf_hsum8(sv);
            for (int64_t j = 0; j < Lr; j++) s[j] *= inv;
            float *o = out + r * qs + a * D;
            for (int64_t d = 0; d < D; d++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < Lr; j++) acc = fmaf(s[j], v[krow[j] * ldk + d], acc);
                o[d] = acc;
            }
        }
    }
}
