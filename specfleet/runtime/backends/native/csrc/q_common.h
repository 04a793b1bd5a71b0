/* Shared by specfleet's GGUF block-format kernels (q_legacy.c, q_kquants.c, driven by q_linear.c):
 * the int8 activation blocks, small AVX2 helpers, and the tiled loop every format runs.
 *
 * Activations are quantized per row to int8 before any product, one scale per 32 values (xq32, for
 * the 32-weight formats) or per 256 with the sums of every 16 quants (xq256, for the K formats):
 * x[i] ~= d * q[i], d = amax / 127, q = round-half-even(x[i] * 127 / amax); an xq256 holds its quants
 * in the K kernels' interleaved order (q_kquants.c). The inner products are
 * then integer: a weight's unsigned quant times the activation's signed quant by
 * _mm256_maddubs_epi16, widened by _mm256_madd_epi16.
 *
 * Batch invariance: an output y[m, n] is always computed by the same instruction sequence over the
 * same blocks in the same order, whatever M is, which rows share a tile and which thread runs it
 * (threads split weight rows only; K is never split). Speculative verification therefore gives each
 * verified row bit for bit what decoding it alone gives. */
#ifndef SPECFLEET_Q_COMMON_H
#define SPECFLEET_Q_COMMON_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define TILE 8 /* activation rows multiplied by each unpacked weight row at once */

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 }; /* GGMLQuantizationType */

typedef struct { _Alignas(32) int8_t q[32]; float d; int32_t sum; } xq32; /* 64 B: q never straddles a cache line */
/* 384 B, q 64-byte aligned (activation buffers are too: a 512-bit load never straddles two cache lines);
 * bsum: sums of every 16 quants in element order; fsum[u]: the sum of sub-block u's 32 quants in fp32 */
typedef struct { _Alignas(64) int8_t q[256]; float fsum[8]; int16_t bsum[16]; float d; } xq256;

/* weight rows [n0, n1) against quantized activation rows [c0, c1) (each arb bytes from a), into
 * y[m * ldy + n]: v = dot (+ bias[n] when bias is not 0), then y = v, or y = y + v with accumulate
 * (a residual add fused into the product). The epilogue is the same whatever M is. */
typedef void (*cols_fn)(const uint8_t *W, int64_t row_bytes, int64_t nb, const uint8_t *a, int64_t arb,
                        int64_t c0, int64_t c1, int64_t n0, int64_t n1, float *y, int64_t ldy,
                        const float *bias, int accumulate);

cols_fn sfq_legacy_columns(int type);  /* q_legacy.c; 0 for another type */
cols_fn sfq_kquant_columns(int type);  /* q_kquants.c; 0 for another type */
void sfq_quantize_row32(const float *x, int64_t K, xq32 *out);
void sfq_quantize_row256(const float *x, int64_t K, xq256 *out);

ALWAYS_INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }

ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The ISA path this library is built for (runtime/formats/qtensor.py builds one library per path, chosen by the
 * CPU's flags): "avx2" (maddubs + madd), "avxvnni" (256-bit VEX vpdpbusd) or "avx512vnni" (the K
 * formats in 512-bit registers, vpdpbusd; 256-bit EVEX vpdpbusd for the 32-weight formats).
 * Every path computes bit for bit what the AVX2 path computes: the integer sums are exact in each (no
 * int16 lane of the AVX2 path saturates, see q_kquants.c), they are grouped per 32-weight sub-block the
 * same way before any scale, and the floating-point work after them is the same instruction sequence. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SF_VNNI 1
#define SF_VNNI512 1
#define SF_ISA_NAME "avx512vnni"
ALWAYS_INLINE __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define SF_VNNI 1
#define SF_ISA_NAME "avxvnni"
ALWAYS_INLINE __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define SF_ISA_NAME "avx2"
#endif

/* sum over groups of four u8 * i8 products, in 8 int32 lanes (dword j: bytes 4j..4j+3). AVX2's maddubs
 * sums pairs into int16 first: exact while a pair stays within int16, which every caller ensures. */
ALWAYS_INLINE __m256i dot_u8i8(__m256i u, __m256i s) {
#ifdef SF_VNNI
    return dpbusd256(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

#ifdef SF_VNNI512
/* Row pairs (DEFINE_COLUMNS_PAIRED): two weight rows' 256-bit registers side by side in one 512-bit
 * register, an activation's register in both halves, and each half's 8-lane accumulator summed as the
 * one-row kernels sum theirs. */
ALWAYS_INLINE __m512i pair_i(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
ALWAYS_INLINE __m512 pair_f(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}
ALWAYS_INLINE __m512i both_i(const void *p) { return _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)p)); }
ALWAYS_INLINE __m512 both_f(const float *p) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_load_pd((const double *)p))); }
ALWAYS_INLINE void pair_out(const __m512 *acc, int R, float *out0, float *out1) {
    for (int r = 0; r < R; r++) {
        out0[r] = hsum8(_mm512_castps512_ps256(acc[r]));
        out1[r] = hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
    }
}
#endif

#ifndef PF_BYTES
#define PF_BYTES 4096
#endif
/* Every product streams its weights from memory: each block asks for the lines PF_BYTES further on (past
 * a row's end, the next row's: rows follow each other), spread evenly over the blocks. At one to eight
 * activation rows (decode, verification) this read the 1.5B's matrices 10-20 % faster than the earlier
 * prefetch of whole rows a few rows ahead, whose bunched requests the hardware dropped; at more rows the
 * extra prefetches of lines already cached cost nothing measurable. Prefetches change no result. */
ALWAYS_INLINE void stream_ahead(const void *block, int64_t bytes) {
    const char *p = (const char *)block + PF_BYTES;
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

#define ACC_INIT(R)                                             \
    __m256 acc[TILE];                                              \
    float cacc[TILE];                                              \
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); cacc[r] = 0.0f; } \
    (void)cacc;

/* Output columns [n0, n1) for activation rows [c0, c1) of one format: FN is inlined with a constant
 * tile height, so the loops over a weight row's blocks carry no dispatch. */
#define DEFINE_COLUMNS(NAME, FN, XT)                                                              \
    static void NAME(const uint8_t *W, int64_t row_bytes, int64_t nb, const uint8_t *a, int64_t arb,  \
                     int64_t c0, int64_t c1, int64_t n0, int64_t n1, float *y, int64_t ldy,          \
                     const float *bias, int accumulate) {                                         \
        if (c1 - c0 == 1) { /* one activation row (a decode step): the same FN with R = 1, less set-up */ \
            const XT *x1[1] = {(const XT *)(a + c0 * arb)};                                       \
            float *yr = y + c0 * ldy;                                                             \
            for (int64_t n = n0; n < n1; n++) {                                                   \
                float v;                                                                          \
                FN(W + n * row_bytes, nb, x1, 1, &v);                                             \
                if (bias) v += bias[n];                                                           \
                yr[n] = accumulate ? yr[n] + v : v;                                               \
            }                                                                                     \
            return;                                                                               \
        }                                                                                         \
        for (int64_t n = n0; n < n1; n++) {                                                       \
            const uint8_t *wrow = W + n * row_bytes;                                              \
            for (int64_t m0 = c0; m0 < c1; m0 += TILE) {                                          \
                const int R = (int)(c1 - m0 < TILE ? c1 - m0 : TILE);                             \
                const XT *xs[TILE];                                                               \
                float out[TILE];                                                                  \
                for (int r = 0; r < R; r++) xs[r] = (const XT *)(a + (m0 + r) * arb);             \
                switch (R) {                                                                      \
                case 1: FN(wrow, nb, xs, 1, out); break;                                          \
                case 2: FN(wrow, nb, xs, 2, out); break;                                          \
                case 3: FN(wrow, nb, xs, 3, out); break;                                          \
                case 4: FN(wrow, nb, xs, 4, out); break;                                          \
                case 5: FN(wrow, nb, xs, 5, out); break;                                          \
                case 6: FN(wrow, nb, xs, 6, out); break;                                          \
                case 7: FN(wrow, nb, xs, 7, out); break;                                          \
                default: FN(wrow, nb, xs, 8, out); break;                                         \
                }                                                                                 \
                for (int r = 0; r < R; r++) {                                                     \
                    float v = out[r];                                                             \
                    if (bias) v += bias[n];                                                       \
                    float *dst = y + (m0 + r) * ldy + n;                                          \
                    *dst = accumulate ? *dst + v : v;                                             \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

/* The same with weight rows taken two at a time where an activation tile has more than one row: FN2
 * (rows n and n + 1, one pass over both) must give each row the bits FN gives it alone (the odd last
 * row of a range and one-row calls take FN). */
#define DEFINE_COLUMNS_PAIRED(NAME, FN, FN2, XT)                                                  \
    DEFINE_COLUMNS(NAME##_single, FN, XT)                                                         \
    static void NAME(const uint8_t *W, int64_t row_bytes, int64_t nb, const uint8_t *a, int64_t arb,  \
                     int64_t c0, int64_t c1, int64_t n0, int64_t n1, float *y, int64_t ldy,          \
                     const float *bias, int accumulate) {                                         \
        int64_t n = n0;                                                                           \
        if (c1 - c0 > 1)                                                                          \
            for (; n + 1 < n1; n += 2) {                                                          \
                const uint8_t *w0 = W + n * row_bytes, *w1 = w0 + row_bytes;                      \
                for (int64_t m0 = c0; m0 < c1; m0 += TILE) {                                      \
                    const int R = (int)(c1 - m0 < TILE ? c1 - m0 : TILE);                         \
                    const XT *xs[TILE];                                                           \
                    float o0[TILE], o1[TILE];                                                     \
                    for (int r = 0; r < R; r++) xs[r] = (const XT *)(a + (m0 + r) * arb);         \
                    switch (R) {                                                                  \
                    case 1: FN2(w0, w1, nb, xs, 1, o0, o1); break;                                \
                    case 2: FN2(w0, w1, nb, xs, 2, o0, o1); break;                                \
                    case 3: FN2(w0, w1, nb, xs, 3, o0, o1); break;                                \
                    case 4: FN2(w0, w1, nb, xs, 4, o0, o1); break;                                \
                    case 5: FN2(w0, w1, nb, xs, 5, o0, o1); break;                                \
                    case 6: FN2(w0, w1, nb, xs, 6, o0, o1); break;                                \
                    case 7: FN2(w0, w1, nb, xs, 7, o0, o1); break;                                \
                    default: FN2(w0, w1, nb, xs, 8, o0, o1); break;                               \
                    }                                                                             \
                    for (int r = 0; r < R; r++) {                                                 \
                        float v0 = o0[r], v1 = o1[r];                                             \
                        if (bias) { v0 += bias[n]; v1 += bias[n + 1]; }                           \
                        float *dst = y + (m0 + r) * ldy + n;                                      \
                        dst[0] = accumulate ? dst[0] + v0 : v0;                                   \
                        dst[1] = accumulate ? dst[1] + v1 : v1;                                   \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
        if (n < n1) NAME##_single(W, row_bytes, nb, a, arb, c0, c1, n, n1, y, ldy, bias, accumulate); \
    }

#endif
