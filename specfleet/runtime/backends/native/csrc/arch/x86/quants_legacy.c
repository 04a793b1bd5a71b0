/* The 32-weight GGUF formats on x86-64 (AVX2, AVX-VNNI, AVX512-VNNI; see x86.h and ../../q_common.h): one weight row
 * against up to TILE int8 activation rows, and the activation quantizers for 32-value blocks.
 *
 * Block layouts: ../../q_common.h (Q4_0, Q5_0 and Q8_0 in its groups of eight blocks, Q4_1 as the file has it).
 * The products: nibbles (and Q5_0's fifth bit) unpacked to unsigned bytes, times the activation quants
 * by maddubs/madd or vpdpbusd; the -8 / -16 offsets come off through the activation block's quant sum,
 * Q4_1's m term is m * d_x * sum, Q8_0's signed quants move their sign onto the activation (sign_epi8).
 * Q4_1: per block the integer lanes are scaled by d_w * d_x in fp32 into an 8-lane accumulator; the
 * grouped formats: per group of eight blocks, one lane per block. On the 512-bit path Q4_0 and Q5_0 take
 * weight rows in pairs for several activation rows (dot2_g32), one row per register half: over the 0.5B's
 * shapes and 854 rows (two threads, Zen 5) Q4_0 ran 1.26-1.40x and Q5_0 1.11-1.30x faster. */
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

SF_DEFINE_QUANTIZE_ROW32G(quant32) /* the grouped formats' activations (q_common.h) */


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

ALWAYS_INLINE void dot_q4_1(const uint8_t *wrow, int64_t nb, const xq32 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q4_1 *w = (const b_q4_1 *)wrow;
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q4_1), R);
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

/* ---- The grouped formats Q4_0, Q5_0, Q8_0 (q_common.h): a group of eight blocks is eight 32-byte registers,
 * lane j of each holding four quants of block j, so the registers' products add up lane by lane into the
 * eight blocks' totals, and one fp32 epilogue (eight scales, one conversion, one fused multiply-add)
 * serves the group. A row's last group of four blocks (K = 128 mod 256, e.g. 896) is four registers of
 * two four-block halves folded once; other tails go through the contract's plain C (sf_g32_group). ---- */

/* The quants of a group of nt = 8 (n = 8 registers) or nt = 4 (n = 4) blocks, register k holding bytes
 * 32k..32k+31 of the group's order (offsets not applied); Q8_0 also their magnitudes in u */
ALWAYS_INLINE void g32_regs(int type, const uint8_t *grp, int nt, __m256i *w, __m256i *u) {
    const int n = nt; /* registers: 32 * nt bytes of quants */
    const uint8_t *p = grp + 2 * nt;
    if (type == T_Q8_0) { /* and u: |w|, the sign moving onto the activation in g32_sum */
        for (int k = 0; k < n; k++) {
            w[k] = _mm256_loadu_si256((const __m256i *)(p + 32 * k));
            u[k] = _mm256_sign_epi8(w[k], w[k]);
        }
        return;
    }
    const uint8_t *qh = p, *qs = type == T_Q5_0 ? p + 4 * nt : p;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int m = 0; m < n / 2; m++) { /* qs[n] low nibble: byte n, high nibble: byte n + 16 nt */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * m));
        w[m] = _mm256_and_si256(v, m4);
        w[m + n / 2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    if (type == T_Q5_0)
        for (int k = 0; k < n; k++) w[k] = _mm256_or_si256(w[k], highbits32(qh + 4 * k));
}

/* the int32 lane totals of n registers of weights (w; u: Q8_0's |w|) against activation quants xq */
ALWAYS_INLINE __m256i g32_sum(int type, const __m256i *w, const __m256i *u, const int8_t *xq, int n) {
#ifdef SF_VNNI
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256(); /* two chains; exact in any order */
    for (int k = 0; k < n; k++) {
        __m256i xv = _mm256_load_si256((const __m256i *)(xq + 32 * k));
        const __m256i wk = type == T_Q8_0 ? u[k] : w[k];
        if (type == T_Q8_0) xv = _mm256_sign_epi8(xv, w[k]); /* |w|, and the sign moves onto x */
        if (k & 1) s1 = dpbusd256(s1, wk, xv);
        else s0 = dpbusd256(s0, wk, xv);
    }
    return _mm256_add_epi32(s0, s1);
#else
    /* maddubs sums pairs into int16; int16 sums of registers stay exact up to: Q4_0 all eight
     * (8 * 2 * 15 * 127 = 30480), Q5_0 four (4 * 2 * 31 * 127 = 31496), Q8_0 one (2 * 128 * 127) */
    const int per = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 4 : 1;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256(), t = _mm256_setzero_si256();
    for (int k = 0; k < n; k++) {
        __m256i xv = _mm256_load_si256((const __m256i *)(xq + 32 * k));
        const __m256i wk = type == T_Q8_0 ? u[k] : w[k];
        if (type == T_Q8_0) xv = _mm256_sign_epi8(xv, w[k]);
        const __m256i p = _mm256_maddubs_epi16(wk, xv);
        t = k % per ? _mm256_add_epi16(t, p) : p;
        if (k % per == per - 1 || k == n - 1) s = _mm256_add_epi32(s, _mm256_madd_epi16(t, ones));
    }
    return s;
#endif
}

/* The plain-C group (q_common.h) for the short groups with no register path (nt other than 4: rows whose K is not a
 * multiple of 128 weights, none of the embedded models' matrices), kept out of line: inlined into every format,
 * row count and pairing it tripled this file's compile time, and it runs at most once per weight row */
static __attribute__((noinline)) void g32_group_c(int type, const uint8_t *grp, int nt, const xq32g *const *x, int R,
                                                  float (*acc)[8]) {
    sf_g32_group(type, grp, nt, x, R, acc);
}

/* a row's last, short group (nt = nb % 8 blocks, group index ng) into its accumulators acc[r] */
ALWAYS_INLINE void g32_tail(int type, const uint8_t *grp, int nt, int64_t ng, const xq32g *const *x, int R, __m256 *acc) {
    const int sh = type == T_Q4_0 ? 3 : 4;
    if (nt == 4) { /* register k: blocks 0-3 of steps 2k (low half) and 2k + 1 (high half) */
        __m256i w[4], u[4];
        g32_regs(type, grp, 4, w, u);
        const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)grp));
        for (int r = 0; r < R; r++) {
            const xq32g *xg = x[r] + ng;
            const __m256i s8 = g32_sum(type, w, u, xg->q, 4);
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
            if (type != T_Q8_0) s = _mm_sub_epi32(s, _mm_slli_epi32(_mm_load_si128((const __m128i *)xg->sum), sh));
            const __m128 lo = _mm_fmadd_ps(_mm_mul_ps(dw, _mm_load_ps(xg->d)), _mm_cvtepi32_ps(s), _mm256_castps256_ps128(acc[r]));
            acc[r] = _mm256_insertf128_ps(acc[r], lo, 0);
        }
    } else if (nt) {
        float a[TILE][8];
        const xq32g *xg[TILE];
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(a[r], acc[r]);
            xg[r] = x[r] + ng;
        }
        g32_group_c(type, grp, nt, xg, R, a);
        for (int r = 0; r < R; r++) acc[r] = _mm256_loadu_ps(a[r]);
    }
}

ALWAYS_INLINE void dot_g32(int type, const uint8_t *wrow, int64_t nb, const xq32g *const *x, int R, float *out) {
    ACC_INIT(R)
    const int64_t gbytes = 8 * sf_g32_block_bytes(type), ng = nb / 8;
    const int sh = type == T_Q4_0 ? 3 : 4; /* the offset (8 or 16) times the activation sums */
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *grp = wrow + g * gbytes;
        stream_ahead(grp, gbytes, R);
        __m256i w[8], u[8];
        g32_regs(type, grp, 8, w, u);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)grp));
        for (int r = 0; r < R; r++) {
            const xq32g *xg = x[r] + g;
            __m256i s = g32_sum(type, w, u, xg->q, 8);
            if (type != T_Q8_0) s = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_load_si256((const __m256i *)xg->sum), sh));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_load_ps(xg->d)), _mm256_cvtepi32_ps(s), acc[r]);
        }
    }
    g32_tail(type, wrow + ng * gbytes, (int)(nb - 8 * ng), ng, x, R, acc);
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}
ALWAYS_INLINE void dot_q4_0(const uint8_t *w, int64_t nb, const xq32g *const *x, int R, float *out) { dot_g32(T_Q4_0, w, nb, x, R, out); }
ALWAYS_INLINE void dot_q5_0(const uint8_t *w, int64_t nb, const xq32g *const *x, int R, float *out) { dot_g32(T_Q5_0, w, nb, x, R, out); }
ALWAYS_INLINE void dot_q8_0(const uint8_t *w, int64_t nb, const xq32g *const *x, int R, float *out) { dot_g32(T_Q8_0, w, nb, x, R, out); }


#ifdef SF_VNNI512
/* Q4_0 and Q5_0 two weight rows at once (DEFINE_COLUMNS_PAIRED) on the 512-bit path: register k of row n in the
 * low half and of row n + 1 in the high half, the activation's register k in both halves, so one vpdpbusd
 * serves both rows and one epilogue both groups. Lane by lane dot_g32's integer totals and fp32 steps, and each
 * row's last short group goes through dot_g32's own tail, so a row's bits do not depend on being paired.
 * (Q8_0 keeps one row at a time: 512-bit registers have no sign_epi8 to move the weights' signs.) */
ALWAYS_INLINE void dot2_g32(int type, const uint8_t *row0, const uint8_t *row1, int64_t nb, const xq32g *const *x, int R,
                            float *out0, float *out1) {
    __m512 acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t gbytes = 8 * sf_g32_block_bytes(type), ng = nb / 8;
    const int sh = type == T_Q4_0 ? 3 : 4;
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *g0 = row0 + g * gbytes, *g1 = row1 + g * gbytes;
        stream_ahead_grouped(g0, gbytes);
        stream_ahead_grouped(g1, gbytes);
        __m256i w0[8], w1[8], u[8];
        g32_regs(type, g0, 8, w0, u);
        g32_regs(type, g1, 8, w1, u);
        __m512i w[8];
        for (int k = 0; k < 8; k++) w[k] = pair_i(w0[k], w1[k]);
        const __m512 dw = pair_f(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g0)),
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g1)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const xq32g *xg = x[r] + g;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512(); /* two chains, as g32_sum */
            for (int k = 0; k < 8; k += 2) {
                s0 = _mm512_dpbusd_epi32(s0, w[k], both_i(xg->q + 32 * k));
                s1 = _mm512_dpbusd_epi32(s1, w[k + 1], both_i(xg->q + 32 * k + 32));
            }
            __m512i s = _mm512_add_epi32(s0, s1);
            s = _mm512_sub_epi32(s, _mm512_slli_epi32(both_i(xg->sum), sh));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, both_f(xg->d)), _mm512_cvtepi32_ps(s), acc[r]);
        }
    }
    const int nt = (int)(nb - 8 * ng);
    if (nt == 4) { /* g32_tail's four-block group for both rows: lanes 0-3 of each half, the rest kept */
        const uint8_t *g0 = row0 + ng * gbytes, *g1 = row1 + ng * gbytes;
        __m256i w0[4], w1[4], u[4];
        g32_regs(type, g0, 4, w0, u);
        g32_regs(type, g1, 4, w1, u);
        __m512i w[4];
        for (int k = 0; k < 4; k++) w[k] = pair_i(w0[k], w1[k]);
        const __m512 dw = pair_f(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)g0))),
                                 _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)g1))));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const xq32g *xg = x[r] + ng;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int k = 0; k < 4; k += 2) {
                s0 = _mm512_dpbusd_epi32(s0, w[k], both_i(xg->q + 32 * k));
                s1 = _mm512_dpbusd_epi32(s1, w[k + 1], both_i(xg->q + 32 * k + 32));
            }
            __m512i s = _mm512_add_epi32(s0, s1);
            s = _mm512_add_epi32(s, _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1))); /* the halves' folds */
            s = _mm512_sub_epi32(s, _mm512_slli_epi32(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)xg->sum)), sh));
            const __m512 d = _mm512_mul_ps(dw, _mm512_broadcast_f32x4(_mm_load_ps(xg->d)));
            acc[r] = _mm512_mask3_fmadd_ps(d, _mm512_cvtepi32_ps(s), acc[r], 0x0F0F);
        }
    }
    __m256 a0[TILE], a1[TILE];
    for (int r = 0; r < R; r++) {
        a0[r] = _mm512_castps512_ps256(acc[r]);
        a1[r] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1));
    }
    if (nt && nt != 4) {
        g32_tail(type, row0 + ng * gbytes, nt, ng, x, R, a0);
        g32_tail(type, row1 + ng * gbytes, nt, ng, x, R, a1);
    }
    for (int r = 0; r < R; r++) {
        out0[r] = hsum8(a0[r]);
        out1[r] = hsum8(a1[r]);
    }
}
ALWAYS_INLINE void dot2_q4_0(const uint8_t *w0, const uint8_t *w1, int64_t nb, const xq32g *const *x, int R, float *o0,
                             float *o1) { dot2_g32(T_Q4_0, w0, w1, nb, x, R, o0, o1); }
ALWAYS_INLINE void dot2_q5_0(const uint8_t *w0, const uint8_t *w1, int64_t nb, const xq32g *const *x, int R, float *o0,
                             float *o1) { dot2_g32(T_Q5_0, w0, w1, nb, x, R, o0, o1); }
DEFINE_COLUMNS_PAIRED(cols_q4_0, dot_q4_0, dot2_q4_0, xq32g)
DEFINE_COLUMNS_PAIRED(cols_q5_0, dot_q5_0, dot2_q5_0, xq32g)
#else
DEFINE_COLUMNS(cols_q4_0, dot_q4_0, xq32g)
DEFINE_COLUMNS(cols_q5_0, dot_q5_0, xq32g)
#endif
DEFINE_COLUMNS(cols_q4_1, dot_q4_1, xq32)
DEFINE_COLUMNS(cols_q8_0, dot_q8_0, xq32g)

SF_LEGACY_COLUMNS_TABLE

/* the ISA path this library was built for (x86.h) */
const char *sfq_isa_name(void) { return SF_ISA_NAME; }
