/* Attention of one KV head's query heads on x86-64 (AVX2; the avx512vnni path two heads per 512-bit
 * register with the AVX2 path's lanes, and two rows of a group at a time wherever both see the same keys, so each
 * key and value is loaded once for both: 4-16 % off the attention of 3-13 verification rows after 512-4096 keys
 * on a Cascade Lake Xeon, none for one row; AVX2's 16 registers hold one row's accumulators): the body behind
 * ../../attention.c's driver. */
#include <stdlib.h>

#include "x86.h"

#ifndef VCHUNK
#define VCHUNK 64 /* keys whose values the weighted sum takes at a time */
#endif

#ifdef SF_VNNI512
/* For `rows` rows (1 or 2) over the same keys: o[2w][0 .. 16 nv) (and o[2w + 1], the second head's, unless 0) +=
 * sum over keys j in [j0, j1) of p[2w][j] (p[2w + 1][j]) times the values of cache row krow[j] (v: those values
 * at this part of D), in key order; the sums start from 0 at j0 = 0 and from what o holds after. Each value
 * register is loaded once for every row, and an output lane's chain of fused multiply-adds does not depend on
 * `rows`, so one row gets the same bits alone or paired. nv (2 or 4 registers) and rows are constants at each
 * call, so the loops unroll. */
ALWAYS_INLINE void values_chunk512(const float *v, const int64_t *krow, int64_t ldk, int64_t j0, int64_t j1,
                                   const float *const *p, float *const *o, const int nv, const int rows) {
    __m512 x[4][4];
    for (int h = 0; h < 2 * rows; h++)
        for (int u = 0; u < nv; u++) x[h][u] = j0 && o[h] ? _mm512_loadu_ps(o[h] + 16 * u) : _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        const float *vr = v + krow[j] * ldk;
        __m512 b[4];
        for (int h = 0; h < 2 * rows; h++) b[h] = _mm512_set1_ps(p[h][j]);
        for (int u = 0; u < nv; u++) {
            const __m512 vv = _mm512_loadu_ps(vr + 16 * u);
            for (int h = 0; h < 2 * rows; h++) x[h][u] = _mm512_fmadd_ps(b[h], vv, x[h][u]);
        }
    }
    for (int h = 0; h < 2 * rows; h++)
        if (o[h])
            for (int u = 0; u < nv; u++) _mm512_storeu_ps(o[h] + 16 * u, x[h][u]);
}

/* The scores of 8 keys (kr) for query heads a and a + 1 (packed in q[w] as the driver lays them out) of `rows` rows
 * (1 or 2, a constant at each call) sharing each key load: s[w][u], and s[w][L8 + u] (head a + 1) when `two`. */
ALWAYS_INLINE void scores8_512(const float *const *q, const float *const *kr, int64_t D, float scale,
                               float *const *s, int64_t L8, int two, const int rows) {
    __m512 acc[2][8];
    for (int w = 0; w < rows; w++)
        for (int u = 0; u < 8; u++) acc[w][u] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m512 qv[2];
        for (int w = 0; w < rows; w++) qv[w] = _mm512_load_ps(q[w] + 2 * d);
        for (int u = 0; u < 8; u++) {
            const __m512 kv = both_f8(kr[u] + d);
            for (int w = 0; w < rows; w++) acc[w][u] = _mm512_fmadd_ps(qv[w], kv, acc[w][u]);
        }
    }
    for (int w = 0; w < rows; w++) {
        __m256 half[8];
        for (int u = 0; u < 8; u++) half[u] = lo8(acc[w][u]);
        _mm256_storeu_ps(s[w], _mm256_mul_ps(hsum8x8(half), _mm256_set1_ps(scale)));
        if (two) {
            for (int u = 0; u < 8; u++) half[u] = hi8(acc[w][u]);
            _mm256_storeu_ps(s[w] + L8, _mm256_mul_ps(hsum8x8(half), _mm256_set1_ps(scale)));
        }
    }
}
#endif

/* The G query heads (q[r * qs + a * D], a < G) of m rows r < m sharing one KV head, row r over the first L[r]
 * keys of one list: key j is the cache row krow[j], read at k + krow[j] * ldk (values likewise).
 * out[r * qs + a * D] = softmax(scale * q_a.k) weighted sum of v. Scores go 8 keys at a time (keys past a
 * row's L read as zeros and are dropped), so a key's score never depends on L, nothing depends on where the
 * keys sit in the cache, and nothing a row computes depends on the other rows: the rows only share the
 * loads of each 8 keys (and of each chunk of values) while those sit in L1. A row computes the same bits
 * alone or with others, whether its keys are a prefix of its request's rows or gathered from a tree.
 * sc: m * G * L8 floats of scratch (L8 = the longest L rounded up to 8); qp (AVX512): m * (G + 1) * D
 * floats, 64-byte aligned. */
void sfq_attend_group(const float *q, int64_t qs, int64_t m, int64_t G, const float *k, const float *v,
                      int64_t ldk, const int64_t *krow, const int64_t *L, int64_t D, float scale, float *sc,
                      int64_t L8, float *qp, float *out) {
    static const float zero[MAX_D] = {0};
#ifndef SF_VNNI512
    (void)qp;
#endif
    int64_t lmax = 0;
    for (int64_t r = 0; r < m; r++) lmax = L[r] > lmax ? L[r] : lmax;
#ifdef SF_VNNI512
    /* Query heads two at a time, head a in a 512-bit register's low half and a + 1 in its high half (an odd
     * last head shares a register with itself), each key's 8 values broadcast into both halves: every half
     * runs the AVX2 path's fused multiply-adds on the same lanes in the same order, 8 keys in 8 registers. */
    const int64_t G2 = (G + 1) / 2 * 2;
    for (int64_t r = 0; r < m; r++)
        for (int64_t a = 0; a < G; a += 2) {
            const float *q0 = q + r * qs + a * D, *q1 = q + r * qs + (a + 1 < G ? a + 1 : a) * D;
            float *dst = qp + (r * G2 + a) * D;
            for (int64_t d = 0; d < D; d += 8) {
                memcpy(dst + 2 * d, q0 + d, 8 * sizeof(float));
                memcpy(dst + 2 * d + 8, q1 + d, 8 * sizeof(float));
            }
        }
#endif
    for (int64_t j0 = 0; j0 < lmax; j0 += 8) {
        const float *kall[8];
        for (int u = 0; u < 8; u++) kall[u] = j0 + u < lmax ? k + krow[j0 + u] * ldk : zero;
        for (int64_t r = 0; r < m; r++) {
            if (j0 >= L[r]) continue;
            const float *kr[8];
            for (int u = 0; u < 8; u++) kr[u] = j0 + u < L[r] ? kall[u] : zero;
            float *s = sc + r * G * L8;
#ifdef SF_VNNI512
            /* two rows at once where both see all 8 keys (their kr alike): each key loaded once for both */
            const int pair = r + 1 < m && j0 + 8 <= L[r] && j0 + 8 <= L[r + 1];
            for (int64_t a = 0; a < G; a += 2) {
                const float *qs2[2] = {qp + (r * G2 + a) * D, qp + ((r + pair) * G2 + a) * D};
                float *const s2[2] = {s + a * L8 + j0, s + pair * G * L8 + a * L8 + j0};
                if (pair)
                    scores8_512(qs2, kr, D, scale, s2, L8, a + 1 < G, 2);
                else
                    scores8_512(qs2, kr, D, scale, s2, L8, a + 1 < G, 1);
            }
            r += pair;
#else
            for (int64_t a = 0; a < G; a++) {
                const float *qa = q + r * qs + a * D;
                __m256 acc[8];
                for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qa + d);
                    for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[u] + d), acc[u]);
                }
                _mm256_storeu_ps(s + a * L8 + j0, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
            }
#endif
        }
    }
    for (int64_t r = 0; r < m; r++) {
        const int64_t Lr = L[r], L8r = (Lr + 7) / 8 * 8;
        for (int64_t a = 0; a < G; a++) {
            float *s = sc + r * G * L8 + a * L8;
            float mx = s[0];
            for (int64_t j = 1; j < Lr; j++) mx = s[j] > mx ? s[j] : mx;
            const __m256 mv = _mm256_set1_ps(mx);
            __m256 sv = _mm256_setzero_ps();
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            int64_t j = 0;
#ifdef SF_VNNI512
            /* two 8-key chunks at a time while both hold keys; their exps are exp8's, added to sv one chunk
             * after the other as below */
            const __m512i lane16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (; j + 8 < Lr; j += 16) {
                __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(mx)));
                e = _mm512_maskz_mov_ps(_mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int)(Lr - j)), lane16), e);
                _mm512_storeu_ps(s + j, e);
                sv = _mm256_add_ps(sv, lo8(e));
                sv = _mm256_add_ps(sv, hi8(e));
            }
#endif
            for (; j < Lr; j += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
                const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(Lr - j)), lane));
                e = _mm256_and_ps(e, live); /* keys past L weigh nothing */
                _mm256_storeu_ps(s + j, e);
                sv = _mm256_add_ps(sv, e);
            }
            const float inv = 1.0f / hsum8(sv);
            for (int64_t j = 0; j < L8r; j++) s[j] *= inv;
        }
    }
    /* out_a = sum_j p_a[j] v_j, keys in chunks of VCHUNK (whose values stay in L1 while every row, head and
     * part of D passes over them), the sums carried in out from one chunk to the next: each output lane is
     * the same chain of fused multiply-adds in key order as one pass over all keys would make. */
    for (int64_t j0 = 0; j0 < lmax; j0 += VCHUNK) {
        for (int64_t r = 0; r < m; r++) {
            if (j0 >= L[r]) continue;
            const int64_t j1 = j0 + VCHUNK < L[r] ? j0 + VCHUNK : L[r];
            const float *sr = sc + r * G * L8;
            float *o = out + r * qs;
#ifdef SF_VNNI512
            /* the AVX2 loop below with 16 lanes per register; two rows at once where both take this whole chunk */
            const int pair = r + 1 < m && j0 + VCHUNK <= L[r] && j0 + VCHUNK <= L[r + 1];
            const float *sr2 = sr + pair * G * L8;
            float *o2 = o + pair * qs;
            for (int64_t a = 0; a < G; a += 2) {
                const int two = a + 1 < G;
                const float *const p[4] = {sr + a * L8, sr + (a + two) * L8, sr2 + a * L8, sr2 + (a + two) * L8};
                for (int64_t d = 0; d < D;) {
                    float *const od[4] = {o + a * D + d, two ? o + (a + 1) * D + d : 0, o2 + a * D + d,
                                          two ? o2 + (a + 1) * D + d : 0};
                    const int nv = D - d >= 64 ? 4 : 2; /* 64 values of D for both heads in 8 registers, else 32 in 4 */
                    if (pair && nv == 4)
                        values_chunk512(v + d, krow, ldk, j0, j1, p, od, 4, 2);
                    else if (pair)
                        values_chunk512(v + d, krow, ldk, j0, j1, p, od, 2, 2);
                    else if (nv == 4)
                        values_chunk512(v + d, krow, ldk, j0, j1, p, od, 4, 1);
                    else
                        values_chunk512(v + d, krow, ldk, j0, j1, p, od, 2, 1);
                    d += 16 * nv;
                }
            }
            r += pair;
#else
            /* 32 values of D at a time for two heads at a time (8 accumulators) */
            for (int64_t a = 0; a < G; a += 2) {
                const int two = a + 1 < G;
                const float *p0 = sr + a * L8, *p1 = sr + (a + two) * L8;
                for (int64_t d = 0; d < D; d += 32) {
                    __m256 x0[4], x1[4];
                    for (int u = 0; u < 4; u++) {
                        x0[u] = j0 ? _mm256_loadu_ps(o + a * D + d + 8 * u) : _mm256_setzero_ps();
                        x1[u] = j0 && two ? _mm256_loadu_ps(o + (a + 1) * D + d + 8 * u) : _mm256_setzero_ps();
                    }
                    for (int64_t j = j0; j < j1; j++) {
                        const float *vr = v + krow[j] * ldk + d;
                        const __m256 b0 = _mm256_set1_ps(p0[j]), b1 = _mm256_set1_ps(p1[j]);
                        for (int u = 0; u < 4; u++) {
                            const __m256 vv = _mm256_loadu_ps(vr + 8 * u);
                            x0[u] = _mm256_fmadd_ps(b0, vv, x0[u]);
                            x1[u] = _mm256_fmadd_ps(b1, vv, x1[u]);
                        }
                    }
                    for (int u = 0; u < 4; u++) {
                        _mm256_storeu_ps(o + a * D + d + 8 * u, x0[u]);
                        if (two) _mm256_storeu_ps(o + (a + 1) * D + d + 8 * u, x1[u]);
                    }
                }
            }
#endif
        }
    }
}
