/* x86-64 helpers of specfleet's kernels (csrc/arch/x86/): AVX2 + FMA + F16C, and the VNNI paths the
 * compiler flags of runtime/backends/native/kernels.py turn on. Included by the x86 bodies only; the
 * arch-free contract they implement is ../../q_common.h. */
#ifndef SPECFLEET_X86_H
#define SPECFLEET_X86_H
#include <immintrin.h>

#include "../../q_common.h"

ALWAYS_INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }

ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The ISA path this library is built for (runtime/backends/native/kernels.py builds one library per path, chosen by the
 * CPU's flags): "avx2" (maddubs + madd), "avxvnni" (256-bit VEX vpdpbusd) or "avx512vnni" (the K
 * formats in 512-bit registers, vpdpbusd; 256-bit EVEX vpdpbusd for the 32-weight formats).
 * Every path computes bit for bit what the AVX2 path computes: the integer sums are exact in each (no
 * int16 lane of the AVX2 path saturates, see quants_k.c), they are grouped per 32-weight sub-block the
 * same way before any scale, and the floating-point work after them is the same instruction sequence. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SF_VNNI 1
#define SF_VNNI512 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
/* "amx": the 512-bit VNNI path whose K-format products over several activation rows run on AMX's int8 tile unit
 * (quants_k.c, the end); one row (decode) and every rest stay on the VNNI kernels, with the same bits */
#define SF_AMX 1
#define SF_ISA_NAME "amx"
#else
#define SF_ISA_NAME "avx512vnni"
#endif
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

/* Every product streams its weights from memory: each block asks for the lines a set distance further on
 * (past a row's end, the next row's: rows follow each other), spread evenly over the blocks. The distance
 * depends on how many activation rows share the pass (R, a constant where the kernels are inlined):
 * sf_prefetch_bytes[0] for one row (decode), [1] for more row by row (verification, prefill); the kernels that
 * take weight rows in pairs and fours use sf_grouped_ahead ([2] for long activation rows, else [1]; q_common.h).
 * With sf_prefetch_l2 set, passes over more than one activation row prefetch into L2 instead of L1: there the
 * activation quants, which every weight row reads again, stay in L1 (on a Zen 4 the 1.5B's down product, 8960
 * wide, verified 2-5 rows in 9-13 ms against 14-20 ms prefetching into L1). All settable at run time
 * (specfleet_set_prefetch) so one process can compare them. Where sf_prefetch_far is set, each block also asks for
 * the lines that much further on into L2 alone (specfleet_set_prefetch_far): the L1 prefetch then meets them in L2.
 * A core keeps only as many misses to memory in flight as its L1 has fill buffers (16 on a Golden Cove core), and
 * one row read 12.4 GB/s a core on an AMX Xeon; the L2 takes more requests than that, so with the lines 12 KB
 * ahead in L2 the 1.5B's one-row forward ran 10-13 % faster there, 2-5 rows 5-15 % (benchmarks/RESULTS.md, session
 * 48). The far prefetch stops at the end of the thread's chunk of weight rows (sf_far_end), whose first far bytes the
 * driver asks for when the chunk starts (sf_far_chunk, q_common.h): another 2 % on plain decoding there. Prefetches
 * change no result. */
ALWAYS_INLINE void prefetch_lines(const char *p, int64_t bytes, int l2) {
    if (l2)
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T2);
    else
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}
ALWAYS_INLINE void stream_ahead(const void *block, int64_t bytes, int R) {
    prefetch_lines((const char *)block + sf_prefetch_bytes[R > 1], bytes, R > 1 && sf_prefetch_l2);
    const int64_t far = sf_prefetch_far[R > 1];
    if (far && (uintptr_t)block + far < sf_far_end) prefetch_lines((const char *)block + far, bytes, 1);
}
ALWAYS_INLINE void stream_ahead_grouped(const void *block, int64_t bytes) {
    prefetch_lines((const char *)block + sf_grouped_ahead, bytes, (int)sf_prefetch_l2);
    const int64_t far = sf_prefetch_far[1];
    if (far && (uintptr_t)block + far < sf_far_end) prefetch_lines((const char *)block + far, bytes, 1);
}

#define ACC_INIT_N(R, N)                                        \
    __m256 acc[N];                                                 \
    float cacc[N];                                                 \
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); cacc[r] = 0.0f; } \
    (void)cacc;
#define ACC_INIT(R) ACC_INIT_N(R, TILE)

/* exp of a vector of floats: x clamped to [-87.3, 88.3], 2^n * p(r) with r = x - n ln 2 (|r| <= ln2 / 2) and
 * p the degree-7 Taylor-like polynomial of Cephes' expf (relative error about 2e-7). One body for both
 * widths (P: the intrinsics' prefix), so exp16's lanes run exp8's instruction sequence and give its bits. */
#define DEFINE_EXP(NAME, V, VI, P, ROUND, CAST_I2F)                                                       \
    ALWAYS_INLINE V NAME(V x) {                                                                          \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.3f)), P##_set1_ps(88.3f));                          \
        const V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),                              \
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                            \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                           \
        V p = P##_set1_ps(1.9875691500e-4f);                                                             \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                           \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                           \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                           \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                           \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                           \
        p = P##_fmadd_ps(p, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.0f)));                         \
        const VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);         \
        return P##_mul_ps(p, CAST_I2F(e));                                                               \
    }

DEFINE_EXP(exp8, __m256, __m256i, _mm256, _mm256_round_ps, _mm256_castsi256_ps)

#ifdef SF_VNNI512
DEFINE_EXP(exp16, __m512, __m512i, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)
ALWAYS_INLINE __m256 lo8(__m512 v) { return _mm512_castps512_ps256(v); }
ALWAYS_INLINE __m256 hi8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
/* 8 floats at p (any alignment) in both halves */
ALWAYS_INLINE __m512 both_f8(const float *p) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)p))); }
#endif

/* 8 sums of 8 lanes each -> one vector of the 8 sums (a fixed tree of horizontal adds) */
ALWAYS_INLINE __m256 hsum8x8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    /* ab: lanes 0-3 keys 0-3 (low halves), 4-7 keys 0-3 (high halves); cd likewise for keys 4-7 */
    const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
    return _mm256_add_ps(lo, hi);
}

#endif
