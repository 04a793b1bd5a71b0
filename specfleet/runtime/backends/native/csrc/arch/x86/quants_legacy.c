/* The 32-weight GGUF formats on x86-64 (AVX2, AVX-VNNI, AVX512-VNNI; see x86.h and ../../q_common.h): one weight row
 * against up to TILE int8 activation rows, and the activation quantizer for 32-value blocks.
 *
 * Block layouts: ../../q_common.h.
 * The products: nibbles (and Q5_0's fifth bit) unpacked to unsigned bytes, times the activation quants
 * by maddubs/madd; the -8 / -16 offsets come off through the activation block's quant sum, Q4_1's
 * m term is m * d_x * sum, Q8_0's signed quants move their sign onto the activation (sign_epi8).
 * Per block the integer sum is scaled by d_w * d_x in fp32 into an 8-lane accumulator. */
#include "x86.h"

/* 32 floats -> 32 int8 (round to nearest) with scale d = amax / 127; returns the quants' sum. */
ALWAYS_INLINE int32_t quant32(const float *x, int8_t *q, float *d_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float mx = _mm_cvtss_f32(m);
    const float d = mx / 127.0f;
    const float id = mx > 0.0f ? 127.0f / mx : 0.0f;
    *d_out = d;
    const __m256 mul = _mm256_set1_ps(id);
    __m256i i32[4];
    for (int i = 0; i < 4; i++)
        i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    /* pack 32 int32 -> 32 int8; packs work per 128-bit lane, so restore the order afterwards */
    __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]);
    __m256i p16b = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p8);
    return _mm_cvtsi128_si32(s);
}

void sfq_quantize_row32(const float *x, int64_t K, xq32 *out) {
    for (int64_t b = 0; b < K / 32; b++) out[b].sum = quant32(x + 32 * b, out[b].q, &out[b].d);
}


/* 16 packed nibble bytes -> 32 bytes: low nibbles (weights 0..15) then high nibbles (16..31); the bytes
 * go to both lanes, the high lane's dwords shift down by 4 (bits of the next byte are masked away) */
ALWAYS_INLINE __m256i nibbles32(const uint8_t *qs) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0f));
}

/* the 32 bits of qh -> 32 bytes, 0x10 where the bit is set */
ALWAYS_INLINE __m256i highbits32(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    __m256i v = _mm256_set1_epi32((int)bits);
    /* byte i takes byte i / 8 of the word, then keeps bit i % 8 */
    v = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

ALWAYS_INLINE void dot_q4_0(const uint8_t *wrow, int64_t nb, const xq32 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q4_0 *w = (const b_q4_0 *)wrow;
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q4_0));
        const float d = h2f(w[b].d);
        const __m256i q = nibbles32(w[b].qs);
        for (int r = 0; r < R; r++) {
            const xq32 *xb = &x[r][b];
            __m256i p = dot_u8i8(q, _mm256_loadu_si256((const __m256i *)xb->q));
            p = _mm256_sub_epi32(p, _mm256_setr_epi32(8 * xb->sum, 0, 0, 0, 0, 0, 0, 0));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

ALWAYS_INLINE void dot_q4_1(const uint8_t *wrow, int64_t nb, const xq32 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q4_1 *w = (const b_q4_1 *)wrow;
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q4_1));
        const float d = h2f(w[b].d), m = h2f(w[b].m);
        const __m256i q = nibbles32(w[b].qs);
        for (int r = 0; r < R; r++) {
            const xq32 *xb = &x[r][b];
            __m256i p = dot_u8i8(q, _mm256_loadu_si256((const __m256i *)xb->q));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(p), acc[r]);
            cacc[r] += m * (xb->d * (float)xb->sum);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) + cacc[r];
}

ALWAYS_INLINE void dot_q5_0(const uint8_t *wrow, int64_t nb, const xq32 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q5_0 *w = (const b_q5_0 *)wrow;
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q5_0));
        const float d = h2f(w[b].d);
        const __m256i q = _mm256_or_si256(nibbles32(w[b].qs), highbits32(w[b].qh));
        for (int r = 0; r < R; r++) {
            const xq32 *xb = &x[r][b];
            __m256i p = dot_u8i8(q, _mm256_loadu_si256((const __m256i *)xb->q));
            p = _mm256_sub_epi32(p, _mm256_setr_epi32(16 * xb->sum, 0, 0, 0, 0, 0, 0, 0));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

ALWAYS_INLINE void dot_q8_0(const uint8_t *wrow, int64_t nb, const xq32 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q8_0 *w = (const b_q8_0 *)wrow;
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q8_0));
        const float d = h2f(w[b].d);
        const __m256i q = _mm256_loadu_si256((const __m256i *)w[b].qs);
        const __m256i aq = _mm256_sign_epi8(q, q); /* |w|, and the sign moves onto x */
        for (int r = 0; r < R; r++) {
            const xq32 *xb = &x[r][b];
            const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb->q), q);
            __m256i p = dot_u8i8(aq, sx);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

#ifdef SF_VNNI512
/* Q4_0 / Q5_0 two weight rows at once for several activation rows (as q_kquants.c's dot2_q4_k): the two
 * rows' unpacked blocks side by side in a 512-bit register, the activation block in both halves; lane by
 * lane the one-row kernel's instructions (the offset off * sum taken off lane 0 of each half), so a row's
 * bits do not depend on pairing. */
ALWAYS_INLINE void dot2_offset(const uint8_t *row0, const uint8_t *row1, int64_t nb, const xq32 *const *x, int R,
                               float *out0, float *out1, int five_bit) {
    __m512 acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t bs = five_bit ? (int64_t)sizeof(b_q5_0) : (int64_t)sizeof(b_q4_0);
    const int32_t off = five_bit ? 16 : 8;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p0 = row0 + b * bs, *p1 = row1 + b * bs;
        stream_ahead(p0, bs);
        stream_ahead(p1, bs);
        __m256i q0, q1;
        if (five_bit) {
            const b_q5_0 *a = (const b_q5_0 *)p0, *c = (const b_q5_0 *)p1;
            q0 = _mm256_or_si256(nibbles32(a->qs), highbits32(a->qh));
            q1 = _mm256_or_si256(nibbles32(c->qs), highbits32(c->qh));
        } else {
            q0 = nibbles32(((const b_q4_0 *)p0)->qs);
            q1 = nibbles32(((const b_q4_0 *)p1)->qs);
        }
        const __m512i q = pair_i(q0, q1);
        const __m512 dw = pair_f(_mm256_set1_ps(h2f(*(const uint16_t *)p0)), _mm256_set1_ps(h2f(*(const uint16_t *)p1)));
        for (int r = 0; r < R; r++) {
            const xq32 *xb = &x[r][b];
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, both_i(xb->q));
            p = _mm512_sub_epi32(p, _mm512_maskz_set1_epi32(0x0101, off * xb->sum));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xb->d)), _mm512_cvtepi32_ps(p), acc[r]);
        }
    }
    pair_out(acc, R, out0, out1);
}
ALWAYS_INLINE void dot2_q4_0(const uint8_t *w0, const uint8_t *w1, int64_t nb, const xq32 *const *x, int R, float *o0, float *o1) {
    dot2_offset(w0, w1, nb, x, R, o0, o1, 0);
}
ALWAYS_INLINE void dot2_q5_0(const uint8_t *w0, const uint8_t *w1, int64_t nb, const xq32 *const *x, int R, float *o0, float *o1) {
    dot2_offset(w0, w1, nb, x, R, o0, o1, 1);
}
DEFINE_COLUMNS_PAIRED(cols_q4_0, dot_q4_0, dot2_q4_0, xq32)
DEFINE_COLUMNS_PAIRED(cols_q5_0, dot_q5_0, dot2_q5_0, xq32)
#else
DEFINE_COLUMNS(cols_q4_0, dot_q4_0, xq32)
DEFINE_COLUMNS(cols_q5_0, dot_q5_0, xq32)
#endif
DEFINE_COLUMNS(cols_q4_1, dot_q4_1, xq32)
DEFINE_COLUMNS(cols_q8_0, dot_q8_0, xq32)

SF_LEGACY_COLUMNS_TABLE

/* the ISA path this library was built for (x86.h) */
const char *sfq_isa_name(void) { return SF_ISA_NAME; }
