/* Row operations on x86-64 (AVX2; 512-bit registers on the avx512vnni path, the same lanes and sums):
 * RMSNorm, SiLU(gate) * up with the vector exp of x86.h, and rotary embedding of one head. Each is per
 * row, so a row's bits never depend on the other rows of a call. The arch-free contract and the
 * generic bodies these reproduce lane for lane: ../../q_common.h, ../../generic/rowops.c. */
#include "x86.h"

/* the same for a tail of t < 8 values (the lanes past t are computed from zeros and dropped) */
static void exp_tail(const float *x, int64_t t, float *out) {
    float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < t; i++) buf[i] = x[i];
    _mm256_storeu_ps(buf, exp8(_mm256_loadu_ps(buf)));
    for (int64_t i = 0; i < t; i++) out[i] = buf[i];
}

/* out = w * (x * r), r = 1 / sqrt(mean(x^2) + eps): sums of squares in 32 lanes, added in a fixed order */
void sfq_rmsnorm_row(const float *x, int64_t K, const float *w, float eps, float *out) {
    int64_t i = 0;
#ifdef SF_VNNI512
    /* s01 holds the AVX2 path's s[0] and s[1] side by side, s23 s[2] and s[3]: the same lanes, the same sums */
    __m512 s01 = _mm512_setzero_ps(), s23 = _mm512_setzero_ps();
    for (; i + 32 <= K; i += 32) {
        const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        s01 = _mm512_fmadd_ps(a, a, s01);
        s23 = _mm512_fmadd_ps(b, b, s23);
    }
    float ss = hsum8(_mm256_add_ps(_mm256_add_ps(lo8(s01), hi8(s01)), _mm256_add_ps(lo8(s23), hi8(s23))));
#else
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 32 <= K; i += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
            s[j] = _mm256_fmadd_ps(v, v, s[j]);
        }
    float ss = hsum8(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])));
#endif
    for (; i < K; i++) ss += x[i] * x[i];
    const float r = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.0f), _mm_sqrt_ss(_mm_set_ss(ss / (float)K + eps))));
    i = 0;
#ifdef SF_VNNI512
    const __m512 rw = _mm512_set1_ps(r);
    for (; i + 16 <= K; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(x + i), rw)));
#endif
    const __m256 rv = _mm256_set1_ps(r);
    for (; i + 8 <= K; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
    for (; i < K; i++) out[i] = w[i] * (x[i] * r);
}

/* out = silu(g) * u = g / (1 + exp(-g)) * u */
void sfq_silu_mul_row(const float *g, const float *u, int64_t K, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
#ifdef SF_VNNI512
    for (; i + 16 <= K; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32((int)0x80000000))));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i + 8 <= K; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_xor_ps(gv, neg));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    if (i < K) {
        float ng[8], e[8];
        for (int64_t j = i; j < K; j++) ng[j - i] = -g[j];
        exp_tail(ng, K - i, e);
        for (int64_t j = i; j < K; j++) out[j] = g[j] / (1.0f + e[j - i]) * u[j];
    }
}

/* out[d] = x[d] * cos[d] + rot[d] * sin[d], rot = (-x[D/2:], x[:D/2]): the arithmetic of Rotary.forward
 * in runtime/model/decoder.py (a product each, then the sum; no fused multiply-add), so it equals torch's. */
void sfq_rope_head(const float *x, const float *c, const float *s, int64_t D, float *out) {
    const int64_t half = D / 2;
#ifdef SF_VNNI512
    if (half % 16 == 0) { /* rope_head's lanes, 16 at a time */
        const __m512i neg = _mm512_set1_epi32((int)0x80000000);
        for (int64_t d = 0; d < half; d += 16) {
            const __m512 a = _mm512_loadu_ps(x + d), b = _mm512_loadu_ps(x + half + d);
            const __m512 nb = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(b), neg));
            _mm512_storeu_ps(out + d, _mm512_add_ps(_mm512_mul_ps(a, _mm512_loadu_ps(c + d)), _mm512_mul_ps(nb, _mm512_loadu_ps(s + d))));
            _mm512_storeu_ps(out + half + d, _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(c + half + d)),
                                                           _mm512_mul_ps(a, _mm512_loadu_ps(s + half + d))));
        }
        return;
    }
#endif
    if (half % 8 == 0) {
        const __m256 neg = _mm256_set1_ps(-0.0f);
        for (int64_t d = 0; d < half; d += 8) {
            const __m256 a = _mm256_loadu_ps(x + d), b = _mm256_loadu_ps(x + half + d);
            _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + d)),
                                                    _mm256_mul_ps(_mm256_xor_ps(b, neg), _mm256_loadu_ps(s + d))));
            _mm256_storeu_ps(out + half + d, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + d)),
                                                           _mm256_mul_ps(a, _mm256_loadu_ps(s + half + d))));
        }
        return;
    }
    for (int64_t d = 0; d < half; d++) {
        const float a = x[d], b = x[half + d];
        const float p0 = a * c[d], p1 = -b * s[d], p2 = b * c[half + d], p3 = a * s[half + d];
        out[d] = p0 + p1;
        out[half + d] = p2 + p3;
    }
}
