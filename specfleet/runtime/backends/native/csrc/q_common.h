/* The arch-free contract of specfleet's native kernels: what every architecture's bodies (csrc/generic/,
 * csrc/arch/x86/, csrc/arch/arm/) implement and what the drivers (q_linear.c, fused_linear.c,
 * attention.c, layers.c, k_pack.c) call. Plain C11: no intrinsics, so any C compiler builds it.
 *
 * Activations are quantized per row to int8 before any product, one scale per 32 values (xq32 for Q4_1,
 * xq32g groups for Q4_0, Q5_0 and Q8_0) or per 256 with the sums of every 16 quants (xq256, for the K formats):
 * x[i] ~= d * q[i], d = amax / 127, q = round-half-even(x[i] * 127 / amax); an xq256 holds its quants
 * in the K kernels' interleaved order (arch/x86/quants_k.c describes it). The inner products are then
 * integer: exact in every body, whatever instructions sum them.
 *
 * The numerical contract every body keeps (so every path gives the generic path's bits; tests/
 * test_csrc_generic.py and tests/runtime/backends/native/test_arm_qemu.py hold it): the integer sums of a block are grouped as
 * eight 32-bit lanes (lane j: Q4_1's weights 4j..4j+3; the K formats' sub-block j); each block adds lane
 * by lane into eight fp32 accumulators with one fused multiply-add; the grouped formats Q4_0, Q5_0 and Q8_0
 * sum each block whole and add block b into lane b % 8 (see xq32g below); a row ends with sf_hsum8's
 * fixed tree. Row ops, attention and exp are lane-exact likewise (see generic/). Every build
 * uses -ffp-contract=off, so only the fused multiply-adds written as such are fused.
 *
 * Batch invariance: an output y[m, n] is always computed by the same instruction sequence over the
 * same blocks in the same order, whatever M is, which rows share a tile and which thread runs it
 * (threads split weight rows only; K is never split). Speculative verification therefore gives each
 * verified row bit for bit what decoding it alone gives. */
#ifndef SPECFLEET_Q_COMMON_H
#define SPECFLEET_Q_COMMON_H
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The work split, shared by every product (q_linear.c, fused_linear.c). Which values they take changes
 * speed only, never a result. */
/* the fewest activation rows a call must have for the weight rows to go two or four at a time
 * (DEFINE_COLUMNS_PAIRED / _QUAD below); fewer go row by row, unless the rows' activation quants (rows x arb bytes)
 * exceed sf_group_act_bytes (0: never): then from 2 rows. Settable at run time (specfleet_set_grouping): on a Zen 4,
 * where 512-bit work runs in two halves, pairs and fours made 2-5 rows cost far more than row by row where the
 * activations are short (K = 1536), and less where they are long (K = 8960: row by row, every weight row reads
 * 13 KB of activation quants a row again, which L1 does not hold). */
extern int64_t sf_group_min_rows;
extern int64_t sf_group_act_bytes;
/* each body's prefetch distances: one activation row, more rows row by row, weight rows in pairs and fours */
extern int64_t sf_prefetch_bytes[3];
/* nonzero: prefetches for more than one activation row go to L2 rather than L1 (x86 stream_ahead), so weights
 * read once do not push out of L1 the activation quants that every weight row reads again */
extern int64_t sf_prefetch_l2;
/* a second, further distance for one activation row ([0]) and for more ([1]) whose lines go into L2 only (0: none).
 * The near prefetch then finds its lines in L2 and holds an L1 fill buffer for a short L2 hit rather than a trip to
 * memory, so more of the stream is in flight than the L1's fill buffers alone allow (x86 stream_ahead). */
extern int64_t sf_prefetch_far[2];
/* Where the weight rows of the chunk a thread is reading end (the drivers set it for every chunk: sf_far_chunk): the
 * far prefetch stops there, as the rows past it are a chunk another thread may be reading already */
extern _Thread_local uintptr_t sf_far_end;
/* A driver's chunk of weight rows [n0, n1) of W (row_bytes each) for M activation rows: its end as sf_far_end, and
 * with a far distance set, its first that-many bytes into L2 (the far prefetch of the blocks before would have asked
 * for them, had the chunk followed them on this thread). Changes no result. */
ALWAYS_INLINE void sf_far_chunk(const uint8_t *W, int64_t row_bytes, int64_t n0, int64_t n1, int64_t M) {
    const int64_t far = sf_prefetch_far[M > 1], len = (n1 - n0) * row_bytes;
    const uint8_t *p = W + n0 * row_bytes;
    sf_far_end = (uintptr_t)(p + len);
    for (int64_t o = 0; o < (far < len ? far : len); o += 64) __builtin_prefetch(p + o, 0, 1);
}
/* the fewest activation rows of `arb` bytes each that take weight rows in pairs and fours: sf_group_min_rows, or
 * fewer (from 2) where that many rows' quants exceed sf_group_act_bytes. (A row count the callers compare with, as
 * they compared with sf_group_min_rows: a yes/no function in its place made GCC lay out the one-row loops so that
 * a Zen 4's decode through Q6_K ran 5-20 % slower.) */
ALWAYS_INLINE int64_t sf_group_rows(int64_t arb) {
    const int64_t by_bytes = sf_group_act_bytes > 0 && arb > 0 ? sf_group_act_bytes / arb + 1 : sf_group_min_rows;
    const int64_t rows = by_bytes < sf_group_min_rows ? by_bytes : sf_group_min_rows;
    return rows < 2 ? 2 : rows;
}
/* How far ahead the kernels that take weight rows in pairs and fours prefetch, in the pass under way (each thread
 * sets it before such a pass): sf_prefetch_bytes[2] where the activation rows are long (two exceed
 * sf_group_act_bytes), else [1]. On a Zen 4 the long down product read fastest 16 KB ahead in groups, the
 * 1536-wide products 4 KB ahead (16 KB made 9-16 rows of them 10-18 % slower). */
extern _Thread_local int64_t sf_grouped_ahead;
ALWAYS_INLINE int64_t sf_grouped_distance(int64_t arb) {
    return sf_group_act_bytes > 0 && 2 * arb > sf_group_act_bytes ? sf_prefetch_bytes[2] : sf_prefetch_bytes[1];
}
/* A product call's epoch (q_linear.c): a driver takes a fresh one (sf_new_epoch: never reused, never 0) once its
 * activation rows are written, and each thread that runs its bodies has it in sf_call_epoch while it does (0 outside
 * them). A body may keep per thread what it derives from the call's rows (the amx path's tile layout) for the call's
 * other weight rows while sf_call_epoch is the epoch it was derived under, so what it keeps never serves the rows of
 * another call, whichever threads or concurrent calls run. */
extern _Thread_local int64_t sf_call_epoch;
int64_t sf_new_epoch(void);
#define TILE 8            /* activation rows multiplied by each unpacked weight row at once */
/* the same for DEFINE_COLUMNS_QUAD (four weight rows unpacked at once): 16 rows share each unpack, which made the
 * 1.5B's Q4_K products over 854 prompt rows 6-13 % faster and a 9-row verification product 10 % faster than 8
 * (Zen 5, 512-bit VNNI); the pair kernels keep 8 (Q6_K pairs over 16 rows ran slower) */
#define QUAD_TILE 16
/* DEFINE_COLUMNS_WIDE (Q4_K on the AVX2 path) takes the last up to WIDE_TILE activation rows in one pass, the
 * rest in tiles of TILE: a verification of 9-12 rows (a tree of 8-11 nodes and its root) is one pass over the weights.
 * In tiles of 8 it was a pass of 8 rows and a second one for the rest, whose rows paid a whole weight row's unpacking
 * and scales each. Past 12 rows the activations of one pass outgrow L1 (12 x 6 blocks x 384 B at the 1.5B's 1536-wide
 * products), and tiles of 8 ran faster (benchmarks/RESULTS.md, session 42, Zen 3). */
#define WIDE_TILE 12
#define SF_RCH 64         /* weight rows per scheduled chunk: contiguous enough for the hardware prefetcher */
/* The weight rows of a scheduled chunk for a product over M activation rows of weight rows of row_bytes each: SF_RCH,
 * or for one activation row (decode), where sf_chunk_bytes is set, the fewest multiple of SF_RCH rows that hold that
 * many bytes. A thread reads its chunk's rows as one stream; where a chunk ends, the stream it prefetched ahead is
 * another thread's, and the next chunk starts cold (sf_far_chunk). Which thread reads a row changes no result. */
extern int64_t sf_chunk_bytes;
ALWAYS_INLINE int64_t sf_chunk_rows(int64_t row_bytes, int64_t M) {
    if (M > 1 || row_bytes <= 0 || sf_chunk_bytes <= 0) return SF_RCH;
    const int64_t per = SF_RCH * row_bytes;
    return SF_RCH * ((sf_chunk_bytes + per - 1) / per);
}
/* How the products' chunks are handed to threads (specfleet_set_schedule; 0 compiled): 0 one chunk at a time
 * (schedule(dynamic, 1)), 1 guided: a thread takes a run of consecutive chunks, half of what is left over the
 * threads, then less and less. Handed one at a time, the two threads of a 2-core machine alternate chunks, so each
 * jumps over the other's rows every chunk and what it prefetched past its chunk is the other's; guided, each streams
 * long runs of rows and the runs left at the end are short. The drivers set it before every product loop that says
 * schedule(runtime) (sf_row_schedule). Which thread reads a row changes no result. */
extern int64_t sf_schedule_guided;
/* 2: as guided, but a fused product over fewer than SF_QUANT_PAR_ROWS activation rows (decode, verification) gives
 * each thread one run of its weight rows, of equal bytes (fused_linear.c fused_split) */
#define SF_SCHEDULE_SPLIT 2
ALWAYS_INLINE void sf_row_schedule(void) { omp_set_schedule(sf_schedule_guided ? omp_sched_guided : omp_sched_dynamic, 1); }
#define SF_XCHUNK 64      /* activation rows swept per weight row before moving on (kept in L2) */
#define SF_QUANT_PAR_ROWS 32 /* fewer rows are prepared and quantized on one thread: cheaper than a fork and join */

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 }; /* GGMLQuantizationType */
ALWAYS_INLINE int sf_is_k(int64_t type) { return type == T_Q4_K || type == T_Q6_K; }

/* ggml's block layouts, as the GGUF file stores them ("fp16" is IEEE half; values w[i]):
 *   Q4_0  32 weights, 18 B: fp16 d | u8 qs[16]        w[i] = d * (q[i] - 8)
 *   Q4_1  32 weights, 20 B: fp16 d | fp16 m | qs[16]  w[i] = d * q[i] + m
 *   (in Q4_0, Q4_1 and Q5_0, qs[j] low nibble is q[j], high nibble is q[j + 16])
 *   Q5_0  32 weights, 22 B: fp16 d | u8 qh[4] | qs[16] w[i] = d * ((q[i] | h[i] << 4) - 16),
 *         h[i] = bit i of the little-endian 32-bit qh
 *   Q8_0  32 weights, 34 B: fp16 d | i8 qs[32]        w[i] = d * qs[i]
 *   Q4_K  256 weights, 144 B: fp16 d | fp16 dmin | u8 scales[12] | u8 qs[128]
 *   Q6_K  256 weights, 210 B: u8 ql[128] | u8 qh[64] | i8 scales[16] | fp16 d
 * The K formats' quants are kept in the kernels' interleaved order (k_pack.c, runtime/formats/
 * kquant_order.py): weight e = 32u + 4t + b of a block (u, t in 0..7, b in 0..3) is byte 4u + b of
 * 32-byte register t; Q4_K qs[32c + p]: low nibble register c, high nibble register c + 4; Q6_K
 * ql[32c + p]: low 4 bits of registers c (low nibble) and c + 4 (high nibble), qh[32g + p] bits 2i..2i+1
 * the top 2 bits of register 4g + i. */
typedef struct { uint16_t d; uint8_t qs[16]; } b_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[16]; } b_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } b_q5_0;
typedef struct { uint16_t d; int8_t qs[32]; } b_q8_0;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } b_q4_k;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } b_q6_k;

typedef struct { _Alignas(32) int8_t q[32]; float d; int32_t sum; } xq32; /* 64 B: q never straddles a cache line */
/* 384 B, q 64-byte aligned (activation buffers are too: a 512-bit load never straddles two cache lines);
 * bsum: sums of every 16 quants in element order; fsum[u]: the sum of sub-block u's 32 quants in fp32 */
typedef struct { _Alignas(64) int8_t q[256]; float fsum[8]; int16_t bsum[16]; float d; } xq256;

/* An xq256 block from its 256 quants in element order: the 16-sums, the per-sub-block float sums and the
 * kernels' interleaved order (register t, dword u <- element dword 8u + t: an 8 x 8 dword transpose).
 * Integer work only, so every body that uses it gives the same block. */
static inline void sf_xq256_from_quants(xq256 *o, const int8_t *nat) {
    for (int s = 0; s < 16; s++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += nat[16 * s + i];
        o->bsum[s] = (int16_t)sum;
    }
    for (int u = 0; u < 8; u++) o->fsum[u] = (float)(o->bsum[2 * u] + o->bsum[2 * u + 1]);
    for (int t = 0; t < 8; t++)
        for (int u = 0; u < 8; u++) memcpy(o->q + 32 * t + 4 * u, nat + 32 * u + 4 * t, 4);
}

/* IEEE half -> float, exact (every half is a float); the bodies may use an instruction for it */
static inline float sf_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    uint32_t bits;
    if (e == 31) bits = sign | 0x7f800000u | (m << 13);
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) bits = sign;
    else { /* subnormal half: normalize */
        int s = 0;
        uint32_t mm = m;
        while (!(mm & 1024)) { mm <<= 1; s++; }
        bits = sign | ((uint32_t)(113 - s) << 23) | ((mm & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The grouped 32-weight formats (Q4_0, Q5_0, Q8_0; not Q4_1): a weight row's blocks are kept in groups of
 * eight (the last group of a row holds the nb % 8 blocks left, nt = 1..8 of them), re-ordered once at load
 * (k_pack.c `specfleet_g32_pack`, runtime/formats/group32_order.py) so that one register of quants holds
 * the same four weights of every block of its group. Within a group of nt blocks, quant byte
 *     c = 4 * (nt * k + j) + t   is weight 4k + t (k in 0..7, t in 0..3) of block j (j < nt),
 * so each 32-bit lane of a register belongs to one block. A group is its nt fp16 scales d[j], then (Q5_0)
 * the fifth bits (bit c of the little-endian bytes qh[4 * nt]: quant byte c), then the quants: Q4_0 / Q5_0
 * nibbles qs[16 * nt] (qs[n] low nibble: byte n, high nibble: byte n + 16 * nt), Q8_0 int8 qs[32 * nt].
 * A group keeps the file's size (nt * 18, 22 or 34 bytes), so a row keeps its size too.
 * The activation rows of these formats are xq32g groups: the same byte order over the same groups, each
 * block's scale and quant sum. Per block b of a row (in order) the contract is:
 *     P = sum of (w quant * x quant) - off * x sum      (off: Q4_0 8, Q5_0 16, Q8_0 0; exact integers)
 *     acc[b % 8] = fmaf(d_w * d_x, (float)P, acc[b % 8]),  and a row ends with sf_hsum8(acc).
 * One epilogue serves eight blocks here (a lane per block), where the file's order needs one per block. */
typedef struct { _Alignas(64) int8_t q[256]; float d[8]; int32_t sum[8]; } xq32g; /* 320 B */
ALWAYS_INLINE int sf_is_g32(int64_t type) { return type == T_Q4_0 || type == T_Q5_0 || type == T_Q8_0; }
ALWAYS_INLINE int sf_g32_offset(int type) { return type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0; }
ALWAYS_INLINE int64_t sf_g32_block_bytes(int type) { return type == T_Q4_0 ? 18 : type == T_Q5_0 ? 22 : 34; }

/* Store block j's 32 quants (element order) into its group's byte order (nt blocks in the group) */
static inline void sf_xq32g_put(xq32g *g, int nt, int j, const int8_t *nat) {
    for (int k = 0; k < 8; k++) memcpy(g->q + 4 * (nt * k + j), nat + 4 * k, 4);
}

/* sfq_quantize_row32g for a body whose QUANT32(x, q, &d) quantizes 32 floats to q (element order), writes the
 * scale to d and returns the quants' sum: each block so, its dwords then placed in its group's order (the
 * scales and sums past a short group's blocks zeroed). One definition of the group loop for every body. */
#define SF_DEFINE_QUANTIZE_ROW32G(QUANT32)                                                          \
    void sfq_quantize_row32g(const float *x, int64_t K, xq32g *out) {                               \
        const int64_t nb = K / 32;                                                                   \
        for (int64_t g = 0; 8 * g < nb; g++) {                                                       \
            const int nt = nb - 8 * g < 8 ? (int)(nb - 8 * g) : 8;                                   \
            xq32g *o = out + g;                                                                      \
            if (nt < 8) {                                                                            \
                memset(o->d, 0, sizeof o->d);                                                        \
                memset(o->sum, 0, sizeof o->sum);                                                    \
            }                                                                                        \
            for (int j = 0; j < nt; j++) {                                                           \
                _Alignas(32) int8_t nat[32];                                                         \
                o->sum[j] = QUANT32(x + 32 * (8 * g + j), nat, &o->d[j]);                            \
                sf_xq32g_put(o, nt, j, nat);                                                         \
            }                                                                                        \
        }                                                                                            \
    }

/* A weight group's nt scales (as floats) and its quants in the group's byte order (offsets not applied) */
static inline void sf_g32_unpack(int type, const uint8_t *grp, int nt, float *d, int8_t *q) {
    for (int j = 0; j < nt; j++) d[j] = sf_half_to_float((uint16_t)(grp[2 * j] | grp[2 * j + 1] << 8));
    const uint8_t *p = grp + 2 * nt;
    const int n = 32 * nt;
    if (type == T_Q8_0) {
        memcpy(q, p, (size_t)n);
        return;
    }
    const uint8_t *qh = p, *qs = type == T_Q5_0 ? p + 4 * nt : p;
    for (int c = 0; c < n / 2; c++) {
        q[c] = (int8_t)(qs[c] & 15);
        q[c + n / 2] = (int8_t)(qs[c] >> 4);
    }
    if (type == T_Q5_0)
        for (int c = 0; c < n; c++) q[c] = (int8_t)(q[c] | ((qh[c >> 3] >> (c & 7)) & 1) << 4);
}

/* The contract on one group for R activation rows (x[r]: that row's group), in plain C: the generic body,
 * and the vector bodies' path for a group size they have no registers for */
static inline void sf_g32_group(int type, const uint8_t *grp, int nt, const xq32g *const *x, int R, float (*acc)[8]) {
    float d[8];
    int8_t q[256];
    sf_g32_unpack(type, grp, nt, d, q);
    const int32_t off = sf_g32_offset(type);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nt; j++) {
            int32_t p = 0;
            for (int k = 0; k < 8; k++)
                for (int t = 0; t < 4; t++) {
                    const int c = 4 * (nt * k + j) + t;
                    p += (int32_t)q[c] * (int32_t)x[r]->q[c];
                }
            p -= off * x[r]->sum[j];
            acc[r][j] = fmaf(d[j] * x[r]->d[j], (float)p, acc[r][j]);
        }
}

/* ---- The scalar definitions of the contract's floating-point steps (the generic bodies use them; a
 * vector body computes each lane as these do) ---- */

/* the fixed tree every body sums eight lanes with: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)) */
static inline float sf_hsum8(const float *v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* an attention score's eight lanes: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) */
static inline float sf_hsum8_pairs(const float *v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* float -> int32 as the vector conversions do it: round half to even, INT32_MIN where out of range or NaN */
static inline int32_t sf_round_i32(float v) {
    const float r = rintf(v);
    return (r >= -2147483648.0f && r < 2147483648.0f) ? (int32_t)r : INT32_MIN;
}
static inline int8_t sf_sat8(int32_t v) { return (int8_t)(v < -128 ? -128 : v > 127 ? 127 : v); }

/* exp(x): x clamped to [-87.3, 88.3], 2^n * p(r) with r = x - n ln 2 (|r| <= ln2 / 2) and p the degree-7
 * Taylor-like polynomial of Cephes' expf (relative error about 2e-7); each step one rounding, the
 * multiply-adds fused */
static inline float sf_exp(float x) {
    x = x > -87.3f ? x : -87.3f; /* NaN: the bound, as the vector max and min give it */
    x = x < 88.3f ? x : 88.3f;
    const float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(-n, 0.693359375f, x);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r + 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float e;
    memcpy(&e, &bits, 4);
    return p * e;
}

/* The column function of one format: weight rows [n0, n1) against quantized activation rows [c0, c1)
 * (each arb bytes from a), into y[m * ldy + n]: v = dot (+ bias[n] when bias is not 0), then y = v, or
 * y = y + v with accumulate (a residual add fused into the product). The epilogue is the same whatever
 * M is. */
typedef void (*cols_fn)(const uint8_t *W, int64_t row_bytes, int64_t nb, const uint8_t *a, int64_t arb,
                        int64_t c0, int64_t c1, int64_t n0, int64_t n1, float *y, int64_t ldy,
                        const float *bias, int accumulate);

/* ---- What each architecture's bodies provide (one definition each per library; build.py picks the
 * files: csrc/generic/ everywhere, csrc/arch/<family>/ where that family's path is built) ---- */
const char *sfq_isa_name(void);       /* the path's name, as runtime/backends/native/kernels.py calls it */
cols_fn sfq_legacy_columns(int type); /* Q4_0, Q4_1, Q5_0, Q8_0; 0 for another type */
cols_fn sfq_kquant_columns(int type); /* Q4_K, Q6_K (interleaved); 0 for another type */
/* The two tables above, over the column functions cols_q4_0 ... cols_q8_0 / cols_q4_k, cols_q6_k that a
 * family's bodies define (with DEFINE_COLUMNS): one definition of the table for every family. */
#define SF_LEGACY_COLUMNS_TABLE                                                                   \
    cols_fn sfq_legacy_columns(int type) {                                                        \
        switch (type) {                                                                           \
        case T_Q4_0: return cols_q4_0;                                                            \
        case T_Q4_1: return cols_q4_1;                                                            \
        case T_Q5_0: return cols_q5_0;                                                            \
        case T_Q8_0: return cols_q8_0;                                                            \
        default: return 0;                                                                        \
        }                                                                                         \
    }
#define SF_KQUANT_COLUMNS_TABLE                                                                   \
    cols_fn sfq_kquant_columns(int type) {                                                        \
        switch (type) {                                                                           \
        case T_Q4_K: return cols_q4_k;                                                            \
        case T_Q6_K: return cols_q6_k;                                                            \
        default: return 0;                                                                        \
        }                                                                                         \
    }
/* A family whose bodies define all six dot products as dot_q4_0 ... dot_q6_k: their column functions and
 * both tables in one line (x86 spreads its bodies over two files and defines them there instead). */
#define SF_COLUMNS_FROM_DOTS                                                                      \
    DEFINE_COLUMNS(cols_q4_0, dot_q4_0, xq32g)                                                    \
    DEFINE_COLUMNS(cols_q4_1, dot_q4_1, xq32)                                                     \
    DEFINE_COLUMNS(cols_q5_0, dot_q5_0, xq32g)                                                    \
    DEFINE_COLUMNS(cols_q8_0, dot_q8_0, xq32g)                                                    \
    DEFINE_COLUMNS(cols_q4_k, dot_q4_k, xq256)                                                    \
    DEFINE_COLUMNS(cols_q6_k, dot_q6_k, xq256)                                                    \
    SF_LEGACY_COLUMNS_TABLE                                                                       \
    SF_KQUANT_COLUMNS_TABLE

void sfq_quantize_row32(const float *x, int64_t K, xq32 *out);
void sfq_quantize_row32g(const float *x, int64_t K, xq32g *out); /* the grouped formats' activations */
void sfq_quantize_row256(const float *x, int64_t K, xq256 *out);
/* out = w * (x * r), r = 1 / sqrt(mean(x^2) + eps) */
void sfq_rmsnorm_row(const float *x, int64_t K, const float *w, float eps, float *out);
/* out = silu(g) * u = g / (1 + exp(-g)) * u */
void sfq_silu_mul_row(const float *g, const float *u, int64_t K, float *out);
/* out[d] = x[d] * cos[d] + rot[d] * sin[d], rot = (-x[D/2:], x[:D/2]): a product each, then the sum */
void sfq_rope_head(const float *x, const float *c, const float *s, int64_t D, float *out);
/* attention of m rows' G query heads over one KV head (attention.c says what each argument is) */
void sfq_attend_group(const float *q, int64_t qs, int64_t m, int64_t G, const float *k, const float *v,
                      int64_t ldk, const int64_t *krow, const int64_t *L, int64_t D, float scale, float *sc,
                      int64_t L8, float *qp, float *out);

/* The activation row of a format: bytes (0 for an unknown type) and the quantizer. Three kinds: xq256 (the K
 * formats), xq32g groups (Q4_0, Q5_0, Q8_0) and xq32 blocks (Q4_1). */
static inline int64_t sf_act_row_bytes(int64_t type, int64_t K) {
    if (sf_is_k(type)) return (K / 256) * (int64_t)sizeof(xq256);
    if (sf_is_g32(type)) return (K / 32 + 7) / 8 * (int64_t)sizeof(xq32g);
    return type == T_Q4_1 ? (K / 32) * (int64_t)sizeof(xq32) : 0;
}
enum { SF_ACT_256 = 0, SF_ACT_32G = 1, SF_ACT_32 = 2, SF_ACT_KINDS = 3 };
static inline int sf_act_kind(int64_t type) { return sf_is_k(type) ? SF_ACT_256 : sf_is_g32(type) ? SF_ACT_32G : SF_ACT_32; }
static inline void sf_quantize_act(int kind, const float *x, int64_t K, void *out) {
    if (kind == SF_ACT_256) sfq_quantize_row256(x, K, (xq256 *)out);
    else if (kind == SF_ACT_32G) sfq_quantize_row32g(x, K, (xq32g *)out);
    else sfq_quantize_row32(x, K, (xq32 *)out);
}

/* the column function of a format (the table the drivers dispatch on) */
static inline cols_fn sfq_columns(int64_t type) {
    return sf_is_k(type) ? sfq_kquant_columns((int)type) : sfq_legacy_columns((int)type);
}

#define AMAX_G 16   /* query heads per KV head handled together */
#define MAX_D 512   /* head sizes up to this */
#define MAX_GROUP 8 /* rows of one request whose attention shares key loads */

/* One weight of a fused product */
typedef struct {
    int64_t type;
    const uint8_t *W;
    int64_t row_bytes;
    int64_t N;
    const float *bias; /* N floats, or 0 */
} sfq_part;

enum { PRE_NONE = 0, PRE_RMSNORM = 1, PRE_SILU_MUL = 2 };

/* A step's key plan (runtime/step/plan.py): which cached keys each query row attends to, in order.
 * Row i sees nkeys[i] keys. Its key j has the layout index (a request's token order: its context, then
 * its new tokens) j when j < plen[i], else extras[xoff[i] + j - plen[i]] (a tree row's ancestors, a
 * level-drafted row's visible keys); the layout index x is the cache row slots[base[i] + x]. */
typedef struct {
    const int64_t *slots, *base, *plen, *xoff, *nkeys, *extras;
} sf_key_plan;

/* The library's entry points that C callers other than ctypes use too (the test driver under qemu,
 * tests/runtime/backends/native/csrc/sf_driver.c): declared once, here. */
int specfleet_q_linear(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K, const float *x,
                       int64_t M, float *y, void *act, int num_threads);
int64_t specfleet_q_act_row_bytes(int type, int64_t K);
int specfleet_attend(const float *q, int64_t n, int64_t H, int64_t KVH, int64_t D, const float *k, const float *v,
                     int64_t ldk, const int64_t *slots, const int64_t *base, const int64_t *plen, const int64_t *xoff,
                     const int64_t *nkeys, const int64_t *extras, float scale, float *out, int64_t num_threads);
/* One decoder layer of a native model (runtime/model/decoder.py `_forward_native`): its four products, its
 * norms' weights and its KV cache. */
typedef struct {
    const sfq_part *qkv, *o, *gate_up, *down;
    int64_t n_qkv, n_o, n_gate_up, n_down;
    const float *norm1, *norm2; /* input_layernorm, post_attention_layernorm weights [hidden] */
    double eps1, eps2;
    float *k_cache, *v_cache; /* [slots, KVH, D] */
} sfq_layer;
int specfleet_decode_layers(const sfq_layer *layers, int64_t nlayers, int64_t T, float *h, int64_t hidden,
                            float *qkv, int64_t qkv_width, float *q, float *o, float *gu, int64_t inter, int64_t H,
                            int64_t KVH, int64_t D, const int64_t *pos, const float *cos_t, const float *sin_t,
                            const int64_t *slots, const int64_t *kslots, const int64_t *base, const int64_t *plen,
                            const int64_t *xoff, const int64_t *nkeys, const int64_t *extras, float scale,
                            int64_t num_threads);

/* drivers shared between files */
int specfleet_q_linear_fused(const sfq_part *parts, int64_t nparts, int64_t K, const float *x, int64_t ldx, int64_t M,
                             int64_t pre, const float *pre_w, float eps, float *y, int64_t ldy, int64_t accumulate,
                             int64_t num_threads);
/* A fused product set up once (fused_linear.c: sf_fused_setup) and run by the threads of a team (sf_fused_team), in
 * the layer loop's team (layers.c) or in specfleet_q_linear_fused's own */
#define SF_MAX_PARTS 8
typedef struct {
    const sfq_part *parts;
    int64_t nparts, K, M; /* M 0: nothing to compute */
    const float *x;
    int64_t ldx, pre;
    const float *pre_w;
    float eps;
    float *y;
    int64_t ldy, accumulate;
    cols_fn cols[SF_MAX_PARTS];
    int64_t start[SF_MAX_PARTS + 1], col0[SF_MAX_PARTS], rch[SF_MAX_PARTS]; /* chunks: part p's are start[p].. */
    int need[SF_ACT_KINDS];
    int64_t arb[SF_ACT_KINDS];  /* activation row bytes of each kind at K */
    uint8_t *act[SF_ACT_KINDS]; /* the caller's: shared activation rows (from SF_QUANT_PAR_ROWS rows) */
} sf_fused;
int sf_fused_setup(sf_fused *f, const sfq_part *parts, int64_t nparts, int64_t K, const float *x, int64_t ldx,
                   int64_t M, int64_t pre, const float *pre_w, float eps, float *y, int64_t ldy, int64_t accumulate);
int64_t sf_fused_act_layout(const sf_fused *fs, int64_t n, int64_t *off);
void sf_fused_team(sf_fused *f, float *buf, uint8_t *const *own);
void specfleet_rope_kv(const float *qkv, int64_t T, int64_t ldqkv, int64_t H, int64_t KVH, int64_t D,
                       const int64_t *pos, const float *cos_t, const float *sin_t, float *q_out, float *k_cache,
                       float *v_cache, const int64_t *slots);
/* Attention set up once for a step's rows (attention.c: sf_attn_setup) and run task by task (sf_attn_task), in the
 * layer loop's team (layers.c) or in sf_attend_rows's own. A thread's scratch: sc sf_attn_sc_floats floats, qp
 * sf_attn_qp_floats floats (64-byte aligned), krow sf_attn_krows int64s. */
typedef struct {
    const sf_key_plan *plan;
    int64_t n, H, KVH, D, ldk;
    float scale;
    int64_t *gstart; /* the row groups: group i is rows gstart[i] .. gstart[i + 1] */
    int64_t tasks, l8, G, G2;
    int par; /* worth more than one thread */
} sf_attn;
int sf_attn_setup(sf_attn *a, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t ldk, const sf_key_plan *plan,
                  float scale, int64_t num_threads);
void sf_attn_free(sf_attn *a);
int64_t sf_attn_sc_floats(const sf_attn *a);
int64_t sf_attn_qp_floats(const sf_attn *a);
int64_t sf_attn_krows(const sf_attn *a);
void sf_attn_task(const sf_attn *a, int64_t t, const float *q, const float *k, const float *v, float *out, float *sc,
                  float *qp, int64_t *krow, int64_t *krow_of);
int sf_attend_rows(const float *q, int64_t n, int64_t H, int64_t KVH, int64_t D, const float *k, const float *v,
                   int64_t ldk, const sf_key_plan *plan, float scale, float *out, int64_t num_threads);

/* Output columns [n0, n1) for activation rows [c0, c1) of one format: FN is inlined with a constant
 * tile height, so the loops over a weight row's blocks carry no dispatch. */
/* The column function NAME over FN: activation rows in tiles of TILE, the last up to LAST rows in one (CASES: FN's
 * calls with R = 1 .. LAST, constants so that FN inlines for each) */
#define SF_ROWS_CASE(FN, R_) case R_: FN(wrow, nb, xs, R_, out); break;
#define SF_CASES_TILE(FN)                                                                         \
    SF_ROWS_CASE(FN, 1) SF_ROWS_CASE(FN, 2) SF_ROWS_CASE(FN, 3) SF_ROWS_CASE(FN, 4)              \
    SF_ROWS_CASE(FN, 5) SF_ROWS_CASE(FN, 6) SF_ROWS_CASE(FN, 7)                                  \
    default: FN(wrow, nb, xs, TILE, out); break;
#define SF_CASES_WIDE(FN)                                                                         \
    SF_ROWS_CASE(FN, 1) SF_ROWS_CASE(FN, 2) SF_ROWS_CASE(FN, 3) SF_ROWS_CASE(FN, 4)              \
    SF_ROWS_CASE(FN, 5) SF_ROWS_CASE(FN, 6) SF_ROWS_CASE(FN, 7) SF_ROWS_CASE(FN, 8)              \
    SF_ROWS_CASE(FN, 9) SF_ROWS_CASE(FN, 10) SF_ROWS_CASE(FN, 11)                                \
    default: FN(wrow, nb, xs, WIDE_TILE, out); break;
#define DEFINE_COLUMNS_UPTO(NAME, FN, XT, LAST, CASES)                                            \
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
        for (int64_t m0 = c0; m0 < c1;) {                                                         \
            const int R = (int)(c1 - m0 <= LAST ? c1 - m0 : TILE);                                \
            const XT *xs[LAST];                                                                   \
            for (int r = 0; r < R; r++) xs[r] = (const XT *)(a + (m0 + r) * arb);                 \
            for (int64_t n = n0; n < n1; n++) {                                                   \
                const uint8_t *wrow = W + n * row_bytes;                                          \
                float out[LAST];                                                                  \
                switch (R) { CASES(FN) }                                                          \
                for (int r = 0; r < R; r++) {                                                     \
                    float v = out[r];                                                             \
                    if (bias) v += bias[n];                                                       \
                    float *dst = y + (m0 + r) * ldy + n;                                          \
                    *dst = accumulate ? *dst + v : v;                                             \
                }                                                                                 \
            }                                                                                     \
            m0 += R;                                                                              \
        }                                                                                         \
    }
#define DEFINE_COLUMNS(NAME, FN, XT) DEFINE_COLUMNS_UPTO(NAME, FN, XT, TILE, SF_CASES_TILE)
/* DEFINE_COLUMNS with a last tile of up to WIDE_TILE activation rows: FN takes R = 1 .. WIDE_TILE (a row's bits do
 * not depend on R, so the tiling changes no result) */
#define DEFINE_COLUMNS_WIDE(NAME, FN, XT) DEFINE_COLUMNS_UPTO(NAME, FN, XT, WIDE_TILE, SF_CASES_WIDE)

/* The same with weight rows taken two at a time where an activation tile has more than one row: FN2
 * (rows n and n + 1, one pass over both) must give each row the bits FN gives it alone (the odd last
 * row of a range and one-row calls take FN). */
#define DEFINE_COLUMNS_PAIRED(NAME, FN, FN2, XT)                                                  \
    DEFINE_COLUMNS(NAME##_single, FN, XT)                                                         \
    static void NAME(const uint8_t *W, int64_t row_bytes, int64_t nb, const uint8_t *a, int64_t arb,  \
                     int64_t c0, int64_t c1, int64_t n0, int64_t n1, float *y, int64_t ldy,          \
                     const float *bias, int accumulate) {                                         \
        int64_t n = n0;                                                                           \
        sf_grouped_ahead = sf_grouped_distance(arb);                                              \
        if (c1 - c0 >= sf_group_rows(arb)) /* (>= 2); else row by row */                         \
            for (int64_t m0 = c0; m0 < c1; m0 += TILE) {                                          \
                const int R = (int)(c1 - m0 < TILE ? c1 - m0 : TILE);                             \
                const XT *xs[TILE];                                                               \
                for (int r = 0; r < R; r++) xs[r] = (const XT *)(a + (m0 + r) * arb);             \
                for (n = n0; n + 1 < n1; n += 2) {                                                \
                    const uint8_t *w0 = W + n * row_bytes, *w1 = w0 + row_bytes;                  \
                    float o0[TILE], o1[TILE];                                                     \
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

/* The same with weight rows taken four at a time where an activation tile has more than one row: FN4
 * (rows n .. n + 3, one pass over all four; out[i] receives row n + i) must give each row the bits FN
 * gives it alone; fewer than four rows left at the end of a range take the paired function, and a
 * one-row call (decode) goes weight row by weight row through FN as the paired function does (four weight
 * rows at once made the 1.5B's decode step 9 % slower on a Zen 5). Activation rows go QUAD_TILE at a time; a
 * tile of fewer than QMIN rows goes through the paired function too (for Q6_K, 2 and 5 rows of the 1.5B's
 * layer cost 1.00-1.10 and 1.62-1.72 decode steps of one core in pairs against 1.13-1.24 and 1.68-1.88 in fours). */
#define DEFINE_COLUMNS_QUAD(NAME, FN, FN2, FN4, XT, QMIN)                                          \
    DEFINE_COLUMNS_PAIRED(NAME##_pair, FN, FN2, XT)                                                \
    static void NAME(const uint8_t *W, int64_t row_bytes, int64_t nb, const uint8_t *a, int64_t arb, \
                     int64_t c0, int64_t c1, int64_t n0, int64_t n1, float *y, int64_t ldy,        \
                     const float *bias, int accumulate) {                                          \
        if (c1 - c0 < sf_group_rows(arb)) { /* decode (one row) reads fastest row by row */      \
            NAME##_pair(W, row_bytes, nb, a, arb, c0, c1, n0, n1, y, ldy, bias, accumulate);       \
            return;                                                                                \
        }                                                                                          \
        sf_grouped_ahead = sf_grouped_distance(arb);                                               \
        for (int64_t m0 = c0; m0 < c1; m0 += QUAD_TILE) {                                          \
            const int R = (int)(c1 - m0 < QUAD_TILE ? c1 - m0 : QUAD_TILE);                        \
            int64_t n = n0;                                                                        \
            if (R >= QMIN) { /* fewer rows than QMIN run faster in pairs (the format's choice) */  \
                const XT *xs[QUAD_TILE];                                                           \
                for (int r = 0; r < R; r++) xs[r] = (const XT *)(a + (m0 + r) * arb);              \
                for (; n + 3 < n1; n += 4) {                                                       \
                    float o[4][QUAD_TILE];                                                         \
                    float *const op[4] = {o[0], o[1], o[2], o[3]};                                 \
                    const uint8_t *w0 = W + n * row_bytes;                                         \
                    switch (R) {                                                                   \
                    case 1: FN4(w0, row_bytes, nb, xs, 1, op); break;                              \
                    case 2: FN4(w0, row_bytes, nb, xs, 2, op); break;                              \
                    case 3: FN4(w0, row_bytes, nb, xs, 3, op); break;                              \
                    case 4: FN4(w0, row_bytes, nb, xs, 4, op); break;                              \
                    case 5: FN4(w0, row_bytes, nb, xs, 5, op); break;                              \
                    case 6: FN4(w0, row_bytes, nb, xs, 6, op); break;                              \
                    case 7: FN4(w0, row_bytes, nb, xs, 7, op); break;                              \
                    case 8: FN4(w0, row_bytes, nb, xs, 8, op); break;                              \
                    default: FN4(w0, row_bytes, nb, xs, R, op); break; /* 9 .. QUAD_TILE */        \
                    }                                                                              \
                    for (int r = 0; r < R; r++) {                                                  \
                        float *dst = y + (m0 + r) * ldy + n;                                       \
                        for (int i = 0; i < 4; i++) {                                              \
                            float v = o[i][r];                                                     \
                            if (bias) v += bias[n + i];                                            \
                            dst[i] = accumulate ? dst[i] + v : v;                                  \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            /* the tile's weight rows not taken in fours */                                        \
            if (n < n1) NAME##_pair(W, row_bytes, nb, a, arb, m0, m0 + R, n, n1, y, ldy, bias, accumulate); \
        }                                                                                          \
    }

#endif
