/* y[M, N] = x[M, K] @ W[N, K]^T for weights kept in llama.cpp's GGUF block formats, on x86-64 CPUs
 * with AVX2, FMA and F16C. Written for specfleet; compiled on first use by runtime/qtensor.py (via runtime/native.py).
 *
 * Block layouts (ggml's, read from the file as they are; "fp16" is IEEE half; values w[i]):
 *   Q4_0  32 weights, 18 B: fp16 d | u8 qs[16]        w[i] = d * (q[i] - 8)
 *   Q4_1  32 weights, 20 B: fp16 d | fp16 m | qs[16]  w[i] = d * q[i] + m
 *         (qs[j] low nibble is q[j], high nibble is q[j + 16])
 *   Q5_0  32 weights, 22 B: fp16 d | u8 qh[4] | qs[16] w[i] = d * ((q[i] | h[i] << 4) - 16),
 *         h[i] = bit i of the little-endian 32-bit qh
 *   Q8_0  32 weights, 34 B: fp16 d | i8 qs[32]        w[i] = d * qs[i]
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
 * Activations are quantized per row to int8 first, one scale per 32 values for the 32-weight formats
 * and one per 256 (with the sums of every 16 quants) for the K formats, so the inner products are
 * integer: each weight's unsigned quant times the activation's signed quant through
 * _mm256_maddubs_epi16, widened by _mm256_madd_epi16 (with the sub-block scales folded in where the
 * format has them), and the constant offsets (-8, -16, -32, the mins) applied from the activation
 * sums. Per block the integer sum is scaled in fp32 into an 8-lane accumulator.
 *
 * Batch invariance: an output y[m, n] is always computed by the same instruction sequence over the
 * same blocks in the same order, whatever M is, which rows share a tile and how threads split the
 * work (threads own whole output columns; K is never split). Speculative verification therefore
 * gives each verified row bit for bit what decoding it alone gives.
 *
 * Tiling: a thread owns a contiguous range of weight rows; rows of x go in chunks of XCHUNK (kept in
 * L2), and each weight row is unpacked once per tile of up to 4 activation rows. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define XCHUNK 64

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

typedef struct { float d; int32_t sum; int8_t q[32]; } xq32;            /* 40 B */
typedef struct { float d; int16_t bsum[16]; int8_t q[256]; } xq256;     /* 292 B */

typedef struct { uint16_t d; uint8_t qs[16]; } b_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[16]; } b_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } b_q5_0;
typedef struct { uint16_t d; int8_t qs[32]; } b_q8_0;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } b_q4_k;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } b_q6_k;

ALWAYS_INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }

ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- activation quantization --------------------------------------------------------------- */

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

static void quantize_row32(const float *x, int64_t K, xq32 *out) {
    for (int64_t b = 0; b < K / 32; b++) out[b].sum = quant32(x + 32 * b, out[b].q, &out[b].d);
}

static void quantize_row256(const float *x, int64_t K, xq256 *out) {
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

/* ---- helpers for the 32-weight formats ----------------------------------------------------- */

/* 16 packed nibble bytes -> 32 bytes: low nibbles (weights 0..15) then high nibbles (16..31) */
ALWAYS_INLINE __m256i nibbles32(const uint8_t *qs) {
    const __m128i lo_mask = _mm_set1_epi8(0x0f);
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(q, lo_mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), lo_mask);
    return _mm256_set_m128i(hi, lo);
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

/* sum over pairs of u8 * i8 products, widened to 8 int32 lanes */
ALWAYS_INLINE __m256i dot_u8i8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* ---- per-format dot products: one weight row against R activation rows ---------------------- */

#define ACC_INIT(R)                                             \
    __m256 acc[4];                                              \
    float cacc[4];                                              \
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); cacc[r] = 0.0f; } \
    (void)cacc;

ALWAYS_INLINE void dot_q4_0(const uint8_t *wrow, int64_t nb, const xq32 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q4_0 *w = (const b_q4_0 *)wrow;
    for (int64_t b = 0; b < nb; b++) {
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

ALWAYS_INLINE void q4k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
    }
    for (int j = 4; j < 8; j++) {
        sc[j] = (uint8_t)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        mn[j] = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

ALWAYS_INLINE void dot_q4_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q4_k *w = (const b_q4_k *)wrow;
    const __m256i lo_mask = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const float d = h2f(w[b].d), dmin = h2f(w[b].dmin);
        uint8_t sc[8], mn[8];
        q4k_scales(w[b].scales, sc, mn);
        __m256i isum[4];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(w[b].qs + 32 * c));
            const __m256i lo = _mm256_and_si256(q, lo_mask);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo_mask);
            const __m256i s_lo = _mm256_set1_epi16(sc[2 * c]), s_hi = _mm256_set1_epi16(sc[2 * c + 1]);
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r][b].q + 64 * c;
                const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)), s_lo);
                const __m256i h = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))), s_hi);
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(a, h));
            }
        }
        /* the mins: lane j of madd(mins, bsum) is mn[j] * (bsum[2j] + bsum[2j+1]) */
        uint64_t mn8;
        memcpy(&mn8, mn, 8);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mn8),
                                                                   _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)));
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            const __m256i mterm = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)xb->bsum));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * xb->d), _mm256_cvtepi32_ps(mterm), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

ALWAYS_INLINE void dot_q6_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q6_k *w = (const b_q6_k *)wrow;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);
    for (int64_t b = 0; b < nb; b++) {
        const float d = h2f(w[b].d);
        const int8_t *scales = w[b].scales;
        __m256i isum[4];
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
                const int s0 = 8 * h + 2 * g;
                const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(scales[s0 + 1]), _mm_set1_epi16(scales[s0]));
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

/* ---- driver ---------------------------------------------------------------------------------- */

/* Output columns [n0, n1) for activation rows [c0, c1) of one format: FN is inlined with a constant
 * tile height, so the loops over a weight row's blocks carry no dispatch. */
#define DEFINE_COLUMNS(NAME, FN, XT)                                                              \
    static void NAME(const uint8_t *W, int64_t row_bytes, int64_t nb, const uint8_t *a, int64_t arb,  \
                     int64_t c0, int64_t c1, int64_t n0, int64_t n1, int64_t N, float *y) {          \
        for (int64_t n = n0; n < n1; n++) {                                                       \
            const uint8_t *wrow = W + n * row_bytes;                                              \
            for (int64_t m0 = c0; m0 < c1; m0 += 4) {                                             \
                const int R = (int)(c1 - m0 < 4 ? c1 - m0 : 4);                                   \
                const XT *xs[4];                                                                  \
                float out[4];                                                                     \
                for (int r = 0; r < R; r++) xs[r] = (const XT *)(a + (m0 + r) * arb);             \
                switch (R) {                                                                      \
                case 1: FN(wrow, nb, xs, 1, out); break;                                          \
                case 2: FN(wrow, nb, xs, 2, out); break;                                          \
                case 3: FN(wrow, nb, xs, 3, out); break;                                          \
                default: FN(wrow, nb, xs, 4, out); break;                                         \
                }                                                                                 \
                for (int r = 0; r < R; r++) y[(m0 + r) * N + n] = out[r];                         \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_COLUMNS(cols_q4_0, dot_q4_0, xq32)
DEFINE_COLUMNS(cols_q4_1, dot_q4_1, xq32)
DEFINE_COLUMNS(cols_q5_0, dot_q5_0, xq32)
DEFINE_COLUMNS(cols_q8_0, dot_q8_0, xq32)
DEFINE_COLUMNS(cols_q4_k, dot_q4_k, xq256)
DEFINE_COLUMNS(cols_q6_k, dot_q6_k, xq256)

typedef void (*cols_fn)(const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, float *);

static cols_fn columns_for(int type) {
    switch (type) {
    case T_Q4_0: return cols_q4_0;
    case T_Q4_1: return cols_q4_1;
    case T_Q5_0: return cols_q5_0;
    case T_Q8_0: return cols_q8_0;
    case T_Q4_K: return cols_q4_k;
    case T_Q6_K: return cols_q6_k;
    default: return 0;
    }
}

static int is_k_type(int type) { return type == T_Q4_K || type == T_Q6_K; }

/* bytes of one quantized activation row, 0 for an unknown type */
int64_t specfleet_q_act_row_bytes(int type, int64_t K) {
    if (is_k_type(type)) return (K / 256) * (int64_t)sizeof(xq256);
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q8_0: return (K / 32) * (int64_t)sizeof(xq32);
    default: return 0;
    }
}

/* x fp32 [M, K] row-major; W [N, row_bytes] blocks; y fp32 [M, N] (written); act: scratch of
 * M * specfleet_q_act_row_bytes(type, K) bytes. Returns 0, or -1 for an unknown type / bad K. */
int specfleet_q_linear(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K, const float *x,
                       int64_t M, float *y, void *act, int num_threads) {
    const int kq = is_k_type(type);
    const int64_t qk = kq ? 256 : 32;
    const int64_t arb = specfleet_q_act_row_bytes(type, K);
    if (arb == 0 || K % qk != 0 || K <= 0) return -1;
    const cols_fn cols = columns_for(type);
    if (num_threads < 1) num_threads = 1;
    const int64_t nb = K / qk;
    uint8_t *a = (uint8_t *)act;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M > 1 && num_threads > 1)
    for (int64_t m = 0; m < M; m++) {
        if (kq) quantize_row256(x + m * K, K, (xq256 *)(a + m * arb));
        else quantize_row32(x + m * K, K, (xq32 *)(a + m * arb));
    }
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && N >= 64)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = (N + nt - 1) / nt;
        const int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        for (int64_t c0 = 0; c0 < M; c0 += XCHUNK) {
            const int64_t c1 = c0 + XCHUNK < M ? c0 + XCHUNK : M;
            if (n0 < n1) cols(W, row_bytes, nb, a, arb, c0, c1, n0, n1, N, y);
        }
    }
    return 0;
}

int specfleet_q_abi(void) { return 1; }
