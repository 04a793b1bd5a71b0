/* The 256-weight K formats on x86-64 (see x86.h and ../../q_common.h): one weight row
 * against up to TILE int8 activation rows, and the activation quantizer for 256-value blocks.
 *
 * ggml's block layouts, as the GGUF file stores them ("fp16" is IEEE half):
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
 * The kernels read both with their quants re-ordered at load (k_pack.c, runtime/formats/qtensor.py `pack_k`; scales, mins
 * and d where they were, so a block keeps its size): the "interleaved" order. Weight e = 32u + 4t + b
 * of a block (u, t in 0..7, b in 0..3) goes to byte 4u + b of 32-byte register t. The activation
 * quants of a block are laid out the same way (sfq_quantize_row256). Then every int16 lane pair
 * (dword u) of a maddubs over registers t holds weights of 32-wide sub-block u alone, whatever t is:
 *   Q4_K/x  qs[32c + p]: low nibble register c, high nibble register c + 4 (c in 0..3, p in 0..31)
 *   Q6_K/x  ql[32c + p]: low 4 bits of registers c (low nibble) and c + 4 (high nibble);
 *           qh[32g + p]: bits 2i..2i+1 hold the top 2 bits of register 4g + i (g in 0..1, i in 0..3)
 *
 * The products: maddubs of the unsigned weight quants with the signed activation quants gives int16
 * sums of two products. Because a lane belongs to the same sub-block in every register, those sums add
 * up in int16 across registers before any scale is applied, and one madd per block (Q4_K: all eight
 * registers, |sum| <= 8 * 2 * 15 * 127 = 30480) or per pair of registers (Q6_K: 63 * 127 * 2 * 2 =
 * 32004) applies the sub-block scales, laid out per dword. ggml's order needs a madd per register.
 * Q4_K's mins and Q6_K's -32 offset come off through the activation block's sums of 16 (bsum). Per
 * block the integer sum is scaled by d_w * d_x in fp32 into an 8-lane accumulator.
 *
 * With VNNI (q_common.h) vpdpbusd sums four u8 * i8 products straight into int32 lanes, so a block's
 * registers add up per sub-block in int32 (dword u of every register is sub-block u; with 512-bit
 * registers, two registers side by side, whose halves are added once per block) and the sub-block
 * scales multiply those int32 totals (vpmulld). That is the same integer as the AVX2 path's madd of the
 * int16 sums with the scales, so the fp32 work that follows, unchanged, gives the same bits. Per block
 * and activation row that is 4 (512-bit) or 8 (256-bit) vpdpbusd where AVX2 takes 8 maddubs, 4 to 7
 * int16 adds and 1 to 4 madds.
 *
 * Several activation rows (verification) on the 512-bit path take Q4_K weight rows four at a time
 * (dot4_q4_k): the four blocks' scales and mins are decoded in one register's 128-bit lanes and each
 * activation register is loaded once for two row pairs. Per block that halves the work shared by the
 * activation rows, which had made two rows cost as much as three; the 1.5B's 5-row forward fell from
 * 1.42-1.45 to 1.26-1.30 decode steps together with the longer prefetch (x86.h), on a Zen 5. Q6_K takes four
 * rows the same way (dot4_q6_k) from six activation rows up: 9 rows of the 1.5B's layer cost 1.92 decode steps
 * against 2.34-2.60 in pairs, and 854 prompt rows ran 12 % faster (Zen 5); below six rows pairs measured
 * faster on one core. */
#include "x86.h"

/* How far ahead stream_ahead prefetches weights (x86.h): for one activation row, for more row by row, and for
 * weight rows in pairs and fours. One row (decode) is read fastest at 4 KB. With 512-bit VNNI, 2-9 rows
 * (verification) run about 10 % faster at 16 KB (benchmarks/RESULTS.md, Zen 5); the AVX2 and AVX-VNNI paths'
 * many-row products are compute-bound and keep 4 KB, which measured best there. Per CPU: kernels.py PREFETCH. */
#ifdef SF_VNNI512
int64_t sf_prefetch_bytes[3] = {4096, 16384, 16384};
#else
int64_t sf_prefetch_bytes[3] = {4096, 4096, 4096};
#endif

void sfq_quantize_row256(const float *x, int64_t K, xq256 *out) {
#ifdef SF_VNNI512
    /* The AVX2 path below in 512-bit registers, to the same bytes: the maximum is exact in any order, the
     * scale, rounding and conversion go lane by lane, a saturating narrowing equals the two saturating packs
     * (the quants lie in [-127, 127]), and the sums of 16 quants are exact integer sums. */
    for (int64_t b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++)
            amax = _mm512_max_ps(amax, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(xb + 16 * i)), abs_mask)));
        const float mx = _mm512_reduce_max_ps(amax);
        const __m512 mul = _mm512_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
        out[b].d = mx / 127.0f;
        int8_t nat[256]; /* the block's quants in element order */
        for (int s = 0; s < 16; s++) {
            const __m512i i32 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * s), mul),
                                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm_storeu_si128((__m128i *)(nat + 16 * s), _mm512_cvtsepi32_epi8(i32));
            out[b].bsum[s] = (int16_t)_mm512_reduce_add_epi32(i32);
        }
        for (int u = 0; u < 8; u++) out[b].fsum[u] = (float)(out[b].bsum[2 * u] + out[b].bsum[2 * u + 1]);
        /* the interleaved order: register t, dword u <- element dword 8u + t (an 8 x 8 dword transpose) */
        const __m512i n01 = _mm512_loadu_si512(nat), n23 = _mm512_loadu_si512(nat + 64);
        const __m512i n45 = _mm512_loadu_si512(nat + 128), n67 = _mm512_loadu_si512(nat + 192);
        for (int t = 0; t < 8; t += 2) {
            /* registers t and t + 1 side by side: lane l holds dword 8u + r, u = l % 8, r = t + (l >= 8); index
             * 8 (u % 4) + r picks it from n01|n23 (u < 4) and, the same index, from n45|n67 (u >= 4) */
            const __m512i idx = _mm512_setr_epi32(t, 8 + t, 16 + t, 24 + t, t, 8 + t, 16 + t, 24 + t,
                                                  t + 1, 9 + t, 17 + t, 25 + t, t + 1, 9 + t, 17 + t, 25 + t);
            const __m512i lo = _mm512_permutex2var_epi32(n01, idx, n23), hi = _mm512_permutex2var_epi32(n45, idx, n67);
            _mm512_storeu_si512(out[b].q + 32 * t, _mm512_mask_blend_epi32(0xF0F0, lo, hi));
        }
    }
#else
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
        int8_t nat[256]; /* the block's quants in element order */
        for (int g = 0; g < 8; g++) {
            __m256i i32[4];
            for (int i = 0; i < 4; i++)
                i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 32 * g + 8 * i), mul),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
            p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(nat + 32 * g), p8);
        }
        sf_xq256_from_quants(&out[b], nat);
    }
#endif
}


/* The eight 6-bit scales (bytes 0..7 of the result) and mins (bytes 8..15) of a Q4_K block, from its
 * 12 packed bytes taken as three little-endian words u0, u1, u2 (byte-wise, in one SSE register):
 *   sc[0..3] = u0 & 63,  mn[0..3] = u1 & 63  (per byte)
 *   sc[4..7] = (u2 & 15) | (u0 >> 6) << 4,  mn[4..7] = (u2 >> 4 & 15) | (u1 >> 6) << 4
 * The register holds the block's first 16 bytes (d, dmin, the 12 packed bytes), so u0 is bytes 4..7. The
 * shuffles gather the dwords a = (u0, u2, u1, u2) for the low bits and b = (-, u0, -, u1) for the top two
 * bits of sc/mn[0..3]; q4k_float_scales4 runs the same on four blocks, one per 128-bit lane. */
#define Q4K_SM_A 4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15
#define Q4K_SM_B 4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 11
/* From the shuffles a and b, in any register width (P the intrinsics' prefix: _mm, _mm256, _mm512; S the integer
 * suffix: si128, si256, si512), the three candidates each lane's dword picks from: low6 (sc/mn[0..3]), lo4 and hi4
 * (sc and mn[4..7]) */
#define Q4K_SM_PARTS(P, S, a, b, low6, lo4, hi4)                                                               \
    const __typeof__(a) m4_ = P##_set1_epi8(0x0f);                                                            \
    const __typeof__(a) top_ = P##_slli_epi16(P##_and_##S(P##_srli_epi16(b, 6), P##_set1_epi8(0x03)), 4);      \
    const __typeof__(a) low6 = P##_and_##S(a, P##_set1_epi8(0x3f));                                           \
    const __typeof__(a) lo4 = P##_or_##S(P##_and_##S(a, m4_), top_);                                          \
    const __typeof__(a) hi4 = P##_or_##S(P##_and_##S(P##_srli_epi16(a, 4), m4_), top_);
ALWAYS_INLINE __m128i q4k_scales_mins(const b_q4_k *w) {
    const __m128i v = _mm_loadu_si128((const __m128i *)w);
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(Q4K_SM_A));
    const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(Q4K_SM_B));
    Q4K_SM_PARTS(_mm, si128, a, b, low6, lo4, hi4)
    return _mm_blend_epi32(_mm_blend_epi32(low6, lo4, 0x2), hi4, 0x8);
}

/* An empty asm that takes an accumulator in a register: the sums then run in the order written. Without
 * it GCC re-associates the int16 sums into a tree whose many live partial sums spill to the stack. */
#define KEEP(v) __asm__("" : "+x"(v))

ALWAYS_INLINE __m256i loadx(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* A Q4_K block's sub-block scales and mins in fp32, once per weight block for every activation row:
 * fd[u] = d * sc[u], fm[u] = dmin * mn[u] */
ALWAYS_INLINE void q4k_float_scales(const b_q4_k *w, __m256 *fd, __m256 *fm) {
    const __m128i sm = q4k_scales_mins(w);
    *fd = _mm256_mul_ps(_mm256_set1_ps(h2f(w->d)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
    *fm = _mm256_mul_ps(_mm256_set1_ps(h2f(w->dmin)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
}

#ifdef SF_VNNI512
/* q4k_float_scales for two blocks (w0 -> fd[0], fm[0]; w1 -> fd[1], fm[1]): their first 16 bytes in the two
 * 128-bit lanes of one register, where q4k_scales_mins' shuffles and masks run on both at once, and d, dmin of
 * both converted in one instruction; the same integer scales and the same fp32 multiplies, so the same fd, fm.
 * The activation rows of a verification share a block's decoding, and at 2-5 rows that decoding was a sixth
 * to a quarter of a row-by-row product's work (Zen 4, in cache: 12.5 -> 11.2 cycles a block and row at 2 rows,
 * 10.1 -> 9.3 at 3). */
ALWAYS_INLINE void q4k_float_scales2(const b_q4_k *w0, const b_q4_k *w1, __m256 *fd, __m256 *fm) {
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)w0)),
                                              _mm_loadu_si128((const __m128i *)w1), 1);
    const __m256i a = _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(_mm_setr_epi8(Q4K_SM_A)));
    const __m256i b = _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(_mm_setr_epi8(Q4K_SM_B)));
    Q4K_SM_PARTS(_mm256, si256, a, b, low6, lo4, hi4)
    const __m256i sm = _mm256_blend_epi32(_mm256_blend_epi32(low6, lo4, 0x22), hi4, 0x88);
    /* (d, dmin) of block 0 is dword 0 of the register, of block 1 dword 4: d0, dmin0, d1, dmin1 in fp32 */
    const __m256i heads = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    const __m256 dd = _mm256_castps128_ps256(_mm_cvtph_ps(_mm256_castsi256_si128(heads)));
    for (int i = 0; i < 2; i++) {
        const __m128i smi = i ? _mm256_extracti128_si256(sm, 1) : _mm256_castsi256_si128(sm);
        fd[i] = _mm256_mul_ps(_mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(2 * i)),
                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(smi)));
        fm[i] = _mm256_mul_ps(_mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(2 * i + 1)),
                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(smi, 8))));
    }
}
#endif

/* One Q4_K block of one activation row into its 8-lane accumulator, from the 8 sub-block totals of
 * weight quant x activation quant (exact int32, whichever ISA summed them):
 * acc += d_x * (tot * fd - fsum * fm), fsum[u] the sum of the activation quants of sub-block u. Every
 * path ends a block with these instructions, so every path gives the same bits. */
ALWAYS_INLINE __m256 q4k_block_acc(__m256i tot, __m256 fd, __m256 fm, const xq256 *xb, __m256 acc) {
    const __m256 v = _mm256_fnmadd_ps(fm, _mm256_load_ps(xb->fsum), _mm256_mul_ps(_mm256_cvtepi32_ps(tot), fd));
    return _mm256_fmadd_ps(_mm256_set1_ps(xb->d), v, acc);
}

/* the top two bits of Q6_K/x register 4g + i, from qh word h of group g, moved to bits 4..5 of each byte */
ALWAYS_INLINE __m256i q6_top(__m256i h, int i) {
    const __m256i m = _mm256_set1_epi8(0x30);
    switch (i) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 4), m);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 2), m);
    case 2: return _mm256_and_si256(h, m);
    default: return _mm256_and_si256(_mm256_srli_epi16(h, 2), m);
    }
}

#ifdef SF_VNNI
/* per block of a VNNI path: the sub-block totals of one activation row (lane u: sub-block u, 8 lanes),
 * from the weight quants already unpacked into the registers the path uses */
#ifdef SF_VNNI512
typedef __m512i wreg;
#define NREG 4 /* 512-bit registers per 256 weights: registers (0,1), (2,3), (4,5), (6,7) */
ALWAYS_INLINE wreg wload(const void *p) { return _mm512_loadu_si512(p); }
ALWAYS_INLINE wreg wand(wreg a, wreg b) { return _mm512_and_si512(a, b); }
ALWAYS_INLINE wreg wor(wreg a, wreg b) { return _mm512_or_si512(a, b); }
ALWAYS_INLINE wreg wsrl4(wreg a) { return _mm512_srli_epi16(a, 4); }
ALWAYS_INLINE wreg wset8(char c) { return _mm512_set1_epi8(c); }
ALWAYS_INLINE wreg wzero(void) { return _mm512_setzero_si512(); }
ALWAYS_INLINE wreg wdp(wreg acc, wreg u, wreg s) { return _mm512_dpbusd_epi32(acc, u, s); }
/* lane u + lane u + 8: the two registers side by side belong to the same sub-blocks */
ALWAYS_INLINE __m256i wfold(wreg v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }
#else
typedef __m256i wreg;
#define NREG 8
ALWAYS_INLINE wreg wload(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
ALWAYS_INLINE wreg wand(wreg a, wreg b) { return _mm256_and_si256(a, b); }
ALWAYS_INLINE wreg wor(wreg a, wreg b) { return _mm256_or_si256(a, b); }
ALWAYS_INLINE wreg wsrl4(wreg a) { return _mm256_srli_epi16(a, 4); }
ALWAYS_INLINE wreg wset8(char c) { return _mm256_set1_epi8(c); }
ALWAYS_INLINE wreg wzero(void) { return _mm256_setzero_si256(); }
ALWAYS_INLINE wreg wdp(wreg acc, wreg u, wreg s) { return dpbusd256(acc, u, s); }
ALWAYS_INLINE __m256i wfold(wreg v) { return v; }
#endif
#define RW (256 / NREG) /* bytes of activation quants per register */

/* Q4_K: registers in activation order (the quants of register j pair with x->q[RW * j ...]) */
ALWAYS_INLINE void q4k_regs(const b_q4_k *w, wreg *q) {
    const wreg m4 = wset8(0x0f);
    for (int j = 0; j < NREG / 2; j++) { /* qs: low nibbles the first half of the registers, high the second */
        const wreg v = wload(w->qs + RW * j);
        q[j] = wand(v, m4);
        q[j + NREG / 2] = wand(wsrl4(v), m4);
    }
}

/* block b of a weight row (scales fd, fm) against R activation rows, into their accumulators */
ALWAYS_INLINE void q4k_block_rows(const b_q4_k *wb, __m256 fd, __m256 fm, const xq256 *const *x, int64_t b, int R,
                                  __m256 *acc) {
    wreg q[NREG];
    q4k_regs(wb, q);
    for (int r = 0; r < R; r++) {
        const xq256 *xb = &x[r][b];
        wreg s = wdp(wzero(), q[0], wload(xb->q));
        for (int j = 1; j < NREG; j++) s = wdp(s, q[j], wload(xb->q + RW * j));
        acc[r] = q4k_block_acc(wfold(s), fd, fm, xb, acc[r]);
    }
}

ALWAYS_INLINE void dot_q4_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q4_k *w = (const b_q4_k *)wrow;
    int64_t b = 0;
#ifdef SF_VNNI512
    /* blocks in order, their scales decoded two at a time (with 32 registers; the 16 of the 256-bit paths
     * would spill what the second block's scales keep) */
    for (; b + 2 <= nb; b += 2) {
        stream_ahead(&w[b], 2 * sizeof(b_q4_k), R);
        __m256 fd[2], fm[2];
        q4k_float_scales2(&w[b], &w[b + 1], fd, fm);
        q4k_block_rows(&w[b], fd[0], fm[0], x, b, R, acc);
        q4k_block_rows(&w[b + 1], fd[1], fm[1], x, b + 1, R, acc);
    }
#endif
    for (; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q4_k), R);
        __m256 fd, fm;
        q4k_float_scales(&w[b], &fd, &fm);
        q4k_block_rows(&w[b], fd, fm, x, b, R, acc);
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

#ifdef SF_VNNI512
/* Two weight rows at once for several activation rows (the columns loop's pairs): a 512-bit register
 * holds register t of row n in its low half and of row n + 1 in its high half, and the activation's
 * register t is loaded into both halves. So a vpdpbusd serves two weight rows, the sub-block totals need
 * no folding, and each block's fp32 epilogue runs once for both rows; lane by lane it is the one-row
 * epilogue (q4k_block_acc), so a row's bits do not depend on whether it was paired. */
ALWAYS_INLINE void dot2_q4_k(const uint8_t *row0, const uint8_t *row1, int64_t nb, const xq256 *const *x, int R,
                             float *out0, float *out1) {
    __m512 acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const b_q4_k *w0 = (const b_q4_k *)row0, *w1 = (const b_q4_k *)row1;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead_grouped(&w0[b], sizeof(b_q4_k));
        stream_ahead_grouped(&w1[b], sizeof(b_q4_k));
        __m256 fd2[2], fm2[2];
        q4k_float_scales2(&w0[b], &w1[b], fd2, fm2);
        const __m512 fd = pair_f(fd2[0], fd2[1]), fm = pair_f(fm2[0], fm2[1]);
        __m512i q[8];
        for (int c = 0; c < 4; c++) {
            const __m512i v = pair_i(_mm256_loadu_si256((const __m256i *)(w0[b].qs + 32 * c)),
                                     _mm256_loadu_si256((const __m256i *)(w1[b].qs + 32 * c)));
            q[c] = _mm512_and_si512(v, m4);
            q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            /* two independent chains of four (the int32 totals are exact in any order) */
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], both_i(xb->q));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[4], both_i(xb->q + 128));
            for (int t = 1; t < 4; t++) {
                s0 = _mm512_dpbusd_epi32(s0, q[t], both_i(xb->q + 32 * t));
                s1 = _mm512_dpbusd_epi32(s1, q[4 + t], both_i(xb->q + 128 + 32 * t));
            }
            const __m512i s = _mm512_add_epi32(s0, s1);
            const __m512 v = _mm512_fnmadd_ps(fm, both_f(xb->fsum), _mm512_mul_ps(_mm512_cvtepi32_ps(s), fd));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb->d), v, acc[r]);
        }
    }
    pair_out(acc, R, out0, out1);
}

/* The sub-block scales and mins of four Q4_K blocks (one per weight row) in fp32 for two row pairs:
 * fd01 = [d0 * sc0[0..7] | d1 * sc1[0..7]], fm01 likewise with dmin and the mins, fd23 / fm23 for rows 2
 * and 3. The four blocks' first 16 bytes (d | dmin | scales[12]) go into one register's four 128-bit
 * lanes, where q4k_scales_mins' shuffles and masks run on all four at once; each lane then holds what
 * q4k_float_scales computes for its row (the same integer scales, the same fp32 multiplies). */
ALWAYS_INLINE void q4k_float_scales4(const b_q4_k *w0, const b_q4_k *w1, const b_q4_k *w2, const b_q4_k *w3,
                                     __m512 *fd01, __m512 *fm01, __m512 *fd23, __m512 *fm23) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)w0));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)w1), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)w2), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)w3), 3);
    /* q4k_scales_mins in every lane */
    const __m512i a = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(Q4K_SM_A)));
    const __m512i b = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(Q4K_SM_B)));
    Q4K_SM_PARTS(_mm512, si512, a, b, low6, lo4, hi4)
    const __m512i sm = _mm512_mask_blend_epi32(0x8888, _mm512_mask_blend_epi32(0x2222, low6, lo4), hi4);
    /* qwords: the scales of rows 0..3, then their mins */
    const __m512i g = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), sm);
    const __m512 sc01 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(g)));
    const __m512 sc23 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(g, 1)));
    const __m512 mn01 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(g, 2)));
    const __m512 mn23 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(g, 3)));
    /* d and dmin of the four rows: halves (d0, dmin0, d1, dmin1, ...) from dword 0 of each lane */
    const __m256 dd = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v)));
    const __m512 d5 = _mm512_castps256_ps512(dd);
    const __m512i lo = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i one = _mm512_set1_epi32(1), four = _mm512_set1_epi32(4);
    *fd01 = _mm512_mul_ps(_mm512_permutexvar_ps(lo, d5), sc01);
    *fm01 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(lo, one), d5), mn01);
    *fd23 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(lo, four), d5), sc23);
    *fm23 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(lo, _mm512_set1_epi32(5)), d5), mn23);
}

/* Four weight rows at once (DEFINE_COLUMNS_QUAD): two pairs as dot2_q4_k lays them out, the four blocks'
 * scales decoded together and each activation register loaded once for both pairs. Lane by lane the
 * same integer totals and the same fp32 epilogue as dot2_q4_k and dot_q4_k, so the same bits. */
ALWAYS_INLINE void dot4_q4_k(const uint8_t *row0, int64_t row_bytes, int64_t nb, const xq256 *const *x, int R,
                             float *const *out) {
    __m512 acc[2][QUAD_TILE];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    const b_q4_k *w0 = (const b_q4_k *)row0, *w1 = (const b_q4_k *)(row0 + row_bytes);
    const b_q4_k *w2 = (const b_q4_k *)(row0 + 2 * row_bytes), *w3 = (const b_q4_k *)(row0 + 3 * row_bytes);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead_grouped(&w0[b], sizeof(b_q4_k));
        stream_ahead_grouped(&w1[b], sizeof(b_q4_k));
        stream_ahead_grouped(&w2[b], sizeof(b_q4_k));
        stream_ahead_grouped(&w3[b], sizeof(b_q4_k));
        __m512 fd[2], fm[2];
        q4k_float_scales4(&w0[b], &w1[b], &w2[b], &w3[b], &fd[0], &fm[0], &fd[1], &fm[1]);
        __m512i q[2][8];
        for (int c = 0; c < 4; c++) {
            const __m512i v0 = pair_i(_mm256_loadu_si256((const __m256i *)(w0[b].qs + 32 * c)),
                                      _mm256_loadu_si256((const __m256i *)(w1[b].qs + 32 * c)));
            const __m512i v1 = pair_i(_mm256_loadu_si256((const __m256i *)(w2[b].qs + 32 * c)),
                                      _mm256_loadu_si256((const __m256i *)(w3[b].qs + 32 * c)));
            q[0][c] = _mm512_and_si512(v0, m4);
            q[0][c + 4] = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
            q[1][c] = _mm512_and_si512(v1, m4);
            q[1][c + 4] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
        }
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            __m512i s0[2], s1[2];
            for (int p = 0; p < 2; p++) {
                s0[p] = _mm512_setzero_si512();
                s1[p] = _mm512_setzero_si512();
            }
            for (int t = 0; t < 4; t++) {
                const __m512i xa = both_i(xb->q + 32 * t), xh = both_i(xb->q + 128 + 32 * t);
                for (int p = 0; p < 2; p++) {
                    s0[p] = _mm512_dpbusd_epi32(s0[p], q[p][t], xa);
                    s1[p] = _mm512_dpbusd_epi32(s1[p], q[p][4 + t], xh);
                }
            }
            const __m512 fs = both_f(xb->fsum), dx = _mm512_set1_ps(xb->d);
            for (int p = 0; p < 2; p++) {
                const __m512i s = _mm512_add_epi32(s0[p], s1[p]);
                const __m512 v = _mm512_fnmadd_ps(fm[p], fs, _mm512_mul_ps(_mm512_cvtepi32_ps(s), fd[p]));
                acc[p][r] = _mm512_fmadd_ps(dx, v, acc[p][r]);
            }
        }
    }
    pair_out(acc[0], R, out[0], out[1]);
    pair_out(acc[1], R, out[2], out[3]);
}
#endif

/* Q6_K: registers in activation order; the first half (x registers 0..3) holds the first 16 weights
 * of every sub-block of 32 (Q6_K scale 2u), the second half the last 16 (scale 2u + 1) */
ALWAYS_INLINE void q6k_regs(const b_q6_k *w, wreg *q) {
    const wreg m4 = wset8(0x0f);
#ifdef SF_VNNI512
    const wreg m30 = wset8(0x30);
    /* qh group g in both halves; the top bits of register 4g + i sit at bits 2i..2i+1: shifted to 4..5
     * by 4, 2 (registers 4g, 4g + 1: left) and 0, 2 (4g + 2, 4g + 3: right), per 256-bit half */
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    for (int g = 0; g < 2; g++) {
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w->qh + 32 * g)));
        const __m512i l01 = wload(w->ql), l23 = wload(w->ql + 64);
        const __m512i n01 = g ? wand(wsrl4(l01), m4) : wand(l01, m4), n23 = g ? wand(wsrl4(l23), m4) : wand(l23, m4);
        q[2 * g] = wor(n01, wand(_mm512_sllv_epi16(h, left), m30));
        q[2 * g + 1] = wor(n23, wand(_mm512_srlv_epi16(h, right), m30));
    }
#else
    for (int g = 0; g < 2; g++) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(w->qh + 32 * g));
        for (int i = 0; i < 4; i++) {
            const __m256i l = wload(w->ql + 32 * i);
            q[4 * g + i] = wor(g ? wand(wsrl4(l), m4) : wand(l, m4), q6_top(h, i));
        }
    }
#endif
}

ALWAYS_INLINE void dot_q6_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q6_k *w = (const b_q6_k *)wrow;
    const __m128i even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    const __m128i odd = _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q6_k), R);
        const float d = h2f(w[b].d);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)w[b].scales);
        const __m256i s_first = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc8, even));
        const __m256i s_last = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc8, odd));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        wreg q[NREG];
        q6k_regs(&w[b], q);
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            wreg f = wdp(wzero(), q[0], wload(xb->q)), l = wdp(wzero(), q[NREG / 2], wload(xb->q + 128));
            for (int j = 1; j < NREG / 2; j++) {
                f = wdp(f, q[j], wload(xb->q + RW * j));
                l = wdp(l, q[NREG / 2 + j], wload(xb->q + 128 + RW * j));
            }
            const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(wfold(f), s_first), _mm256_mullo_epi32(wfold(l), s_last));
            const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)xb->bsum));
            const __m256i p = _mm256_sub_epi32(isum, _mm256_slli_epi32(off, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}
#ifdef SF_VNNI512
/* Two Q6_K blocks (weight rows n and n + 1) side by side in 512-bit registers, as the pair kernels use them:
 * the sub-block scales per dword for the first and last 16 weights, the scales as int16 for the -32 offset,
 * d, and the quants in activation order (q6_top's shifts on both rows at once) */
typedef struct { __m512i s_first, s_last, sc16, q[8]; __m512 dw; } q6k_pair;

ALWAYS_INLINE void q6k_pair_unpack(const b_q6_k *a, const b_q6_k *c, q6k_pair *o) {
    const __m128i even = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    const __m128i odd = _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __m128i sc0 = _mm_loadu_si128((const __m128i *)a->scales), sc1 = _mm_loadu_si128((const __m128i *)c->scales);
    o->s_first = pair_i(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc0, even)), _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc1, even)));
    o->s_last = pair_i(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc0, odd)), _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc1, odd)));
    o->sc16 = pair_i(_mm256_cvtepi8_epi16(sc0), _mm256_cvtepi8_epi16(sc1));
    o->dw = pair_f(_mm256_set1_ps(h2f(a->d)), _mm256_set1_ps(h2f(c->d)));
    __m512i l[4];
    for (int i = 0; i < 4; i++)
        l[i] = pair_i(_mm256_loadu_si256((const __m256i *)(a->ql + 32 * i)), _mm256_loadu_si256((const __m256i *)(c->ql + 32 * i)));
    for (int g = 0; g < 2; g++) {
        const __m512i h = pair_i(_mm256_loadu_si256((const __m256i *)(a->qh + 32 * g)),
                                 _mm256_loadu_si256((const __m256i *)(c->qh + 32 * g)));
        const __m512i top[4] = {_mm512_and_si512(_mm512_slli_epi16(h, 4), m30), _mm512_and_si512(_mm512_slli_epi16(h, 2), m30),
                                _mm512_and_si512(h, m30), _mm512_and_si512(_mm512_srli_epi16(h, 2), m30)};
        for (int i = 0; i < 4; i++)
            o->q[4 * g + i] = _mm512_or_si512(g ? _mm512_and_si512(_mm512_srli_epi16(l[i], 4), m4) : _mm512_and_si512(l[i], m4), top[i]);
    }
}

/* dot_q6_k's epilogue lane by lane for one activation block and a pair: f, l the int32 totals of the first
 * and last 16 weights of each sub-block */
ALWAYS_INLINE __m512 q6k_pair_acc(const q6k_pair *w, __m512i f, __m512i l, const xq256 *xb, __m512 acc) {
    const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(f, w->s_first), _mm512_mullo_epi32(l, w->s_last));
    const __m512i off = _mm512_madd_epi16(w->sc16, both_i(xb->bsum));
    const __m512i p = _mm512_sub_epi32(isum, _mm512_slli_epi32(off, 5));
    return _mm512_fmadd_ps(_mm512_mul_ps(w->dw, _mm512_set1_ps(xb->d)), _mm512_cvtepi32_ps(p), acc);
}

/* Q6_K two weight rows at once (see dot2_q4_k); the epilogue is dot_q6_k's, lane by lane */
ALWAYS_INLINE void dot2_q6_k(const uint8_t *row0, const uint8_t *row1, int64_t nb, const xq256 *const *x, int R,
                             float *out0, float *out1) {
    __m512 acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const b_q6_k *w0 = (const b_q6_k *)row0, *w1 = (const b_q6_k *)row1;
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead_grouped(&w0[b], sizeof(b_q6_k));
        stream_ahead_grouped(&w1[b], sizeof(b_q6_k));
        q6k_pair w;
        q6k_pair_unpack(&w0[b], &w1[b], &w);
        /* unrolled (R is a constant here): as a loop GCC kept the accumulators in memory and the rows'
         * dpbusd chains waited on each other; unrolled, the 1.5B's Q6_K ffn_down over 854 prompt rows ran
         * 1.4x faster in pairs (237 -> 321-343 GMAC/s, two threads, Zen 5), with the same instructions per
         * row. Pairs serve tiles of fewer than six rows and the weight rows left past the last four. */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            __m512i f = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.q[0], both_i(xb->q));
            __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.q[4], both_i(xb->q + 128));
            for (int t = 1; t < 4; t++) {
                f = _mm512_dpbusd_epi32(f, w.q[t], both_i(xb->q + 32 * t));
                l = _mm512_dpbusd_epi32(l, w.q[4 + t], both_i(xb->q + 128 + 32 * t));
            }
            acc[r] = q6k_pair_acc(&w, f, l, xb, acc[r]);
        }
    }
    pair_out(acc, R, out0, out1);
}

/* Q6_K four weight rows at once (DEFINE_COLUMNS_QUAD): two pairs as dot2_q6_k lays them out, each activation
 * register loaded once for both pairs. Lane by lane dot2_q6_k's integer totals and epilogue, so its bits. */
ALWAYS_INLINE void dot4_q6_k(const uint8_t *row0, int64_t row_bytes, int64_t nb, const xq256 *const *x, int R,
                             float *const *out) {
    __m512 acc[2][QUAD_TILE];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    const b_q6_k *w[4];
    for (int i = 0; i < 4; i++) w[i] = (const b_q6_k *)(row0 + i * row_bytes);
    for (int64_t b = 0; b < nb; b++) {
        for (int i = 0; i < 4; i++) stream_ahead_grouped(&w[i][b], sizeof(b_q6_k));
        q6k_pair p0, p1;
        q6k_pair_unpack(&w[0][b], &w[1][b], &p0);
        q6k_pair_unpack(&w[2][b], &w[3][b], &p1);
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            __m512i f0 = _mm512_setzero_si512(), l0 = f0, f1 = f0, l1 = f0;
            for (int t = 0; t < 4; t++) {
                const __m512i xa = both_i(xb->q + 32 * t), xh = both_i(xb->q + 128 + 32 * t);
                f0 = _mm512_dpbusd_epi32(f0, p0.q[t], xa);
                l0 = _mm512_dpbusd_epi32(l0, p0.q[4 + t], xh);
                f1 = _mm512_dpbusd_epi32(f1, p1.q[t], xa);
                l1 = _mm512_dpbusd_epi32(l1, p1.q[4 + t], xh);
            }
            acc[0][r] = q6k_pair_acc(&p0, f0, l0, xb, acc[0][r]);
            acc[1][r] = q6k_pair_acc(&p1, f1, l1, xb, acc[1][r]);
        }
    }
    pair_out(acc[0], R, out[0], out[1]);
    pair_out(acc[1], R, out[2], out[3]);
}

#endif
#else /* AVX2 */
/* Q4_K block b against activation rows r0 .. r0 + n - 1 (n <= 8, a constant where inlined) */
ALWAYS_INLINE void q4k_rows_avx2(const b_q4_k *wb, __m256 fd, __m256 fm, const xq256 *const *x, int64_t b, int r0,
                                 int n, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i p[TILE]; /* int16 sums over the block's registers, per activation row */
    for (int c = 0; c < 4; c++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(wb->qs + 32 * c));
        const __m256i lo = _mm256_and_si256(q, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        for (int r = 0; r < n; r++) {
            const int8_t *xq = x[r0 + r][b].q;
            const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, loadx(xq + 32 * c)),
                                               _mm256_maddubs_epi16(hi, loadx(xq + 128 + 32 * c)));
            p[r] = c ? _mm256_add_epi16(p[r], t) : t;
            KEEP(p[r]);
        }
    }
    for (int r = 0; r < n; r++) /* the int16 pairs of each dword summed: the sub-block totals */
        acc[r0 + r] = q4k_block_acc(_mm256_madd_epi16(p[r], _mm256_set1_epi16(1)), fd, fm, &x[r0 + r][b], acc[r0 + r]);
}

/* Up to WIDE_TILE activation rows (DEFINE_COLUMNS_WIDE) in one pass over the weights: up to 8 in one group, more in two
 * of at most 6 (the int16 sums of a group stay in registers), which share each block's scales; each group unpacks the
 * block's quants again (four loads and twelve logic instructions). In tiles of 8, 9-12 rows were a tile of 8 and one
 * of 1-4 rows, which decoded every block's scales again and whose few rows carried a block's whole set-up: on a Zen 3,
 * 9-12 rows of a 2048 x 1536 product take 0.83-0.98 of that time (benchmarks/RESULTS.md, session 42). Q6_K gained
 * nothing so (its unpacking is dearer, and a scheduled chunk's weight rows are still in L2 for a second tile) and keeps
 * tiles of 8. A row's instructions are the same in any group, so its bits do not depend on R. */
ALWAYS_INLINE void dot_q4_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    ACC_INIT_N(R, WIDE_TILE)
    const b_q4_k *w = (const b_q4_k *)wrow;
    const int G = R <= TILE ? R : (R + 1) / 2;
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q4_k), R);
        __m256 fd, fm;
        q4k_float_scales(&w[b], &fd, &fm);
        q4k_rows_avx2(&w[b], fd, fm, x, b, 0, G, acc);
        if (R > G) q4k_rows_avx2(&w[b], fd, fm, x, b, G, R - G, acc);
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

ALWAYS_INLINE void dot_q6_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    ACC_INIT(R)
    const b_q6_k *w = (const b_q6_k *)wrow;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    /* registers 0..3 hold the first 16 weights of each sub-block of 32 (Q6_K scale 2u), 4..7 the last 16 */
    const __m128i even = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
    const __m128i odd = _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15);
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q6_k), R);
        const float d = h2f(w[b].d);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)w[b].scales);
        const __m256i s_first = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, even));
        const __m256i s_last = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, odd));
        __m256i isum[TILE];
        for (int k = 0; k < 4; k++) { /* register pairs (2k, 2k + 1) */
            const int hi = k >= 2, c = 2 * (k & 1);
            const __m256i h = _mm256_loadu_si256((const __m256i *)(w[b].qh + 32 * hi));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(w[b].ql + 32 * c));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(w[b].ql + 32 * (c + 1)));
            const __m256i n0 = hi ? _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4) : _mm256_and_si256(l0, m4);
            const __m256i n1 = hi ? _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4) : _mm256_and_si256(l1, m4);
            const __m256i q0 = _mm256_or_si256(n0, q6_top(h, c)), q1 = _mm256_or_si256(n1, q6_top(h, c + 1));
            const __m256i s = hi ? s_last : s_first;
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r][b].q + 64 * k;
                const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(q0, loadx(xq)), _mm256_maddubs_epi16(q1, loadx(xq + 32)));
                const __m256i v = _mm256_madd_epi16(t, s);
                isum[r] = k ? _mm256_add_epi32(isum[r], v) : v;
                KEEP(isum[r]);
            }
        }
        /* the -32 offset: 32 * sum over sub-blocks of scale * (sum of the sub-block's activation quants) */
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)xb->bsum));
            const __m256i p = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(off, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

#endif /* SF_VNNI */

#if defined(SF_AMX)
DEFINE_COLUMNS_QUAD(cols_q4_k_vnni, dot_q4_k, dot2_q4_k, dot4_q4_k, xq256, 2)
DEFINE_COLUMNS_QUAD(cols_q6_k, dot_q6_k, dot2_q6_k, dot4_q6_k, xq256, 6)
#include "amx_k.h"
#elif defined(SF_VNNI512)
DEFINE_COLUMNS_QUAD(cols_q4_k, dot_q4_k, dot2_q4_k, dot4_q4_k, xq256, 2)
DEFINE_COLUMNS_QUAD(cols_q6_k, dot_q6_k, dot2_q6_k, dot4_q6_k, xq256, 6)
#elif defined(SF_VNNI)
DEFINE_COLUMNS(cols_q4_k, dot_q4_k, xq256)
DEFINE_COLUMNS(cols_q6_k, dot_q6_k, xq256)
#else
DEFINE_COLUMNS_WIDE(cols_q4_k, dot_q4_k, xq256)
DEFINE_COLUMNS(cols_q6_k, dot_q6_k, xq256)
#endif

SF_KQUANT_COLUMNS_TABLE
