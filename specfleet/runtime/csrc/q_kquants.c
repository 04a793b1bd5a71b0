/* The 256-weight K formats for specfleet's block-format kernels (see q_common.h): one weight row
 * against up to TILE int8 activation rows, and the activation quantizer for 256-value blocks.
 *
 * Block layouts (ggml's, read from the file as they are; "fp16" is IEEE half):
 *   Q4_K  256 weights, 144 B: fp16 d | fp16 dmin | u8 scales[12] | u8 qs[128]
 *         eight sub-blocks of 32 with 6-bit scale sc[j] and min mn[j] packed in scales[12];
 *         qs[32c + l] low nibble is q of weight 64c + l, high nibble of weight 64c + 32 + l;
 *         w = d * sc[j] * q - dmin * mn[j]
 *   Q6_K  256 weights, 210 B: u8 ql[128] | u8 qh[64] | i8 scales[16] | fp16 d
 *         for each half h (128 weights; ql += 64h, qh += 32h), l in 0..31:
 *           q(l)      = ql[l] & 15      | (qh[l] >> 0 & 3) << 4
 *           q(l + 32) = ql[l + 32] & 15 | (qh[l] >> 2 & 3) << 4
 *           q(l + 64) = ql[l] >> 4      | (qh[l] >> 4 & 3) << 4
 *           q(l + 96) = ql[l + 32] >> 4 | (qh[l] >> 6 & 3) << 4
 *         w = d * scales[e / 16] * (q - 32) for weight e of the block
 *
 *
 * The products: per 32-weight sub-block, maddubs of the unsigned quants with the activation quants,
 * then madd by the sub-block's scale; Q4_K's mins and Q6_K's -32 offset come off through the
 * activation block's sums of 16 (bsum). Per block the integer sum is scaled by d_w * d_x in fp32 into
 * an 8-lane accumulator. */
#include "q_common.h"

void sfq_quantize_row256(const float *x, int64_t K, xq256 *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 32; i++) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float mx = _mm_cvtss_f32(m);
        const __m256 mul = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
        out[b].d = mx / 127.0f;
        for (int g = 0; g < 8; g++) {
            __m256i i32[4];
            for (int i = 0; i < 4; i++)
                i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 32 * g + 8 * i), mul),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
            p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(out[b].q + 32 * g), p8);
        }
        for (int s = 0; s < 16; s++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += out[b].q[16 * s + i];
            out[b].bsum[s] = (int16_t)sum;
        }
    }
}

typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } b_q4_k;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } b_q6_k;

/* The eight 6-bit scales (bytes 0..7 of the result) and mins (bytes 8..15) of a Q4_K block, from its
 * 12 packed bytes taken as three little-endian words u0, u1, u2 (byte-wise, in one SSE register):
 *   sc[0..3] = u0 & 63,  mn[0..3] = u1 & 63  (per byte)
 *   sc[4..7] = (u2 & 15) | (u0 >> 6) << 4,  mn[4..7] = (u2 >> 4 & 15) | (u1 >> 6) << 4 */
ALWAYS_INLINE __m128i q4k_scales_mins(const uint8_t *s) {
    /* bytes s[0..15] (the 12 packed bytes and 4 of the quants that follow them in the block, unused) */
    const __m128i v = _mm_loadu_si128((const __m128i *)s);
    /* dwords: a = (u0, u2, u1, u2) for the low bits, b = (-, u0, -, u1) for the top two bits of sc/mn[0..3] */
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7));
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i top = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(b, 6), _mm_set1_epi8(0x03)), 4);
    const __m128i low6 = _mm_and_si128(a, _mm_set1_epi8(0x3f));
    const __m128i lo4 = _mm_or_si128(_mm_and_si128(a, m4), top);
    const __m128i hi4 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), m4), top);
    return _mm_blend_epi32(_mm_blend_epi32(low6, lo4, 0x2), hi4, 0x8);
}

ALWAYS_INLINE void dot_q4_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    ACC_INIT(R)
    /* the mins' products go to their own accumulators: one dependent FMA per block and chain, not two */
    __m256 macc[TILE];
    for (int r = 0; r < R; r++) macc[r] = _mm256_setzero_ps();
    const b_q4_k *w = (const b_q4_k *)wrow;
    const __m256i lo_mask = _mm256_set1_epi8(0x0f);
    /* pick 16-bit element j of a vector holding 8 of them, into every lane */
    const __m256i pick[8] = {
        _mm256_set1_epi16(0x0100), _mm256_set1_epi16(0x0302), _mm256_set1_epi16(0x0504), _mm256_set1_epi16(0x0706),
        _mm256_set1_epi16(0x0908), _mm256_set1_epi16(0x0b0a), _mm256_set1_epi16(0x0d0c), _mm256_set1_epi16(0x0f0e)};
    for (int64_t b = 0; b < nb; b++) {
        const float d = h2f(w[b].d), dmin = h2f(w[b].dmin);
        const __m128i sm = q4k_scales_mins(w[b].scales);
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  /* sc[0..7] in each lane */
        /* the mins: lane j of madd(mins, bsum) is mn[j] * (bsum[2j] + bsum[2j+1]) */
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11,
                                                                                      12, 12, 13, 13, 14, 14, 15, 15)));
        __m256i isum[TILE];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(w[b].qs + 32 * c));
            const __m256i lo = _mm256_and_si256(q, lo_mask);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo_mask);
            const __m256i s_lo = _mm256_shuffle_epi8(sc16, pick[2 * c]), s_hi = _mm256_shuffle_epi8(sc16, pick[2 * c + 1]);
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r][b].q + 64 * c;
                const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)), s_lo);
                const __m256i h = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))), s_hi);
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(a, h));
            }
        }
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            const __m256i mterm = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)xb->bsum));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            macc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * xb->d), _mm256_cvtepi32_ps(mterm), macc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) - hsum8(macc[r]);
}

ALWAYS_INLINE void dot_q6_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q6_k *w = (const b_q6_k *)wrow;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);
    __m256i pick[8]; /* byte s into the high byte of every 16-bit element: s = 2k in the low lane, 2k+1 high */
    for (int k = 0; k < 8; k++) {
        const int16_t lo = (int16_t)(((2 * k) << 8) | 0x80), hi = (int16_t)(((2 * k + 1) << 8) | 0x80);
        pick[k] = _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo));
    }
    for (int64_t b = 0; b < nb; b++) {
        const float d = h2f(w[b].d);
        const int8_t *scales = w[b].scales;
        const __m256i sc8 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)scales));
        __m256i isum[TILE];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w[b].ql + 64 * h, *qh = w[b].qh + 32 * h;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
            for (int g = 0; g < 4; g++) {
                /* scales[8h + 2g] in the low lane's 16-bit elements, scales[8h + 2g + 1] in the high
                 * lane's: the byte moved into each element's high byte, then shifted down with its sign */
                const __m256i sv = _mm256_srai_epi16(_mm256_shuffle_epi8(sc8, pick[4 * h + g]), 8);
                for (int r = 0; r < R; r++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(x[r][b].q + 128 * h + 32 * g));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], xv), sv));
                }
            }
        }
        /* the -32 offset: 32 * sum over sub-blocks of scale * (sum of the sub-block's activation quants) */
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scales));
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)xb->bsum));
            const __m256i p = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(off, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

DEFINE_COLUMNS(cols_q4_k, dot_q4_k, xq256)
DEFINE_COLUMNS(cols_q6_k, dot_q6_k, xq256)

cols_fn sfq_kquant_columns(int type) {
    switch (type) {
    case T_Q4_K: return cols_q4_k;
    case T_Q6_K: return cols_q6_k;
    default: return 0;
    }
}
