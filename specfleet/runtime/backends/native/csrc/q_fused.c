/* Fused per-layer work for specfleet's native GGUF models (fp32 activations on the CPU), built into the
 * same library as q_linear.c: a decoder layer of a native model is a handful of calls into this file
 * instead of dozens of small torch ops, which on a 2-core CPU were about a third of a decode step.
 *
 *   specfleet_q_linear_fused  one or more block-format weights that share their input (q/k/v, gate/up,
 *                             mixed formats allowed) in one call: each input row is optionally
 *                             transformed first (RMSNorm with a weight, or SiLU(gate) * up), quantized
 *                             once per activation format, and multiplied by every part in one OpenMP
 *                             loop; outputs land side by side in y (+ bias), or are added to y (a
 *                             residual add fused into the product).
 *   specfleet_rope_kv         rotary embedding of q and k from the fused q/k/v output, k and v written
 *                             to their KV cache slots.
 *   specfleet_attend          attention of query rows, each over the cached keys a key plan gives it
 *                             (a prefix of its request's rows, or a tree row's context and ancestors),
 *                             one (row, head) at a time with no mask.
 *
 * Batch invariance (q_common.h): every output row is computed by the same instruction sequence over the
 * same data in the same order whatever the number of rows in the call, which rows share a tile and which
 * thread runs it. RMSNorm and SiLU * mul are per row; attention is per (row, head), its keys being
 * exactly the row's own, read in its own order wherever they sit: a verification row (chain or tree) or a
 * prompt row computes bit for bit what the decode step of that token computes. */
#include <omp.h>
#include <stdlib.h>

#include "q_common.h"

#define FRCH 64           /* weight rows per scheduled chunk (as q_linear.c) */
#define FXCHUNK 64        /* activation rows swept per weight row before moving on */
#define FQUANT_PAR_ROWS 32 /* fewer rows are prepared and quantized on one thread */
#define MAX_PARTS 8
#ifndef ATTEND_PAR_WORK
#define ATTEND_PAR_WORK (1 << 16) /* multiply-adds from which attention forks threads (about 43 keys of the
                                     * 1.5B: bench_attention.py has two threads faster from 64 keys on) */
#endif

enum { PRE_NONE = 0, PRE_RMSNORM = 1, PRE_SILU_MUL = 2 };

typedef struct {
    int64_t type;
    const uint8_t *W;
    int64_t row_bytes;
    int64_t N;
    const float *bias; /* N floats, or 0 */
} sfq_part;

static int is_k(int64_t type) { return type == T_Q4_K || type == T_Q6_K; }

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

/* the same for a tail of t < 8 values (the lanes past t are computed from zeros and dropped) */
static void exp_tail(const float *x, int64_t t, float *out) {
    float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < t; i++) buf[i] = x[i];
    _mm256_storeu_ps(buf, exp8(_mm256_loadu_ps(buf)));
    for (int64_t i = 0; i < t; i++) out[i] = buf[i];
}

/* out = w * (x * r), r = 1 / sqrt(mean(x^2) + eps): sums of squares in 32 lanes, added in a fixed order */
static void rmsnorm_row(const float *x, int64_t K, const float *w, float eps, float *out) {
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
static void silu_mul_row(const float *g, const float *u, int64_t K, float *out) {
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

/* Rows x[m * ldx ...] (m < M; with PRE_SILU_MUL a row is gate[K] then up[K]) -> y[m * ldy + col], the
 * parts' outputs side by side. pre: PRE_NONE, PRE_RMSNORM (pre_w[K], eps) or PRE_SILU_MUL. Returns 0, or
 * -1 for bad arguments (an unknown format, K not a multiple of a format's block, too many parts), -2
 * when scratch memory could not be allocated. */
int specfleet_q_linear_fused(const sfq_part *parts, int64_t nparts, int64_t K, const float *x, int64_t ldx, int64_t M,
                             int64_t pre, const float *pre_w, float eps, float *y, int64_t ldy, int64_t accumulate,
                             int64_t num_threads) {
    if (nparts < 1 || nparts > MAX_PARTS || K <= 0 || M < 0 || pre < PRE_NONE || pre > PRE_SILU_MUL) return -1;
    if (pre == PRE_RMSNORM && !pre_w) return -1;
    int need256 = 0, need32 = 0;
    cols_fn cols[MAX_PARTS];
    int64_t start[MAX_PARTS + 1], col0[MAX_PARTS];
    start[0] = 0;
    int64_t col = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t t = parts[p].type;
        const int kq = is_k(t);
        cols[p] = kq ? sfq_kquant_columns((int)t) : sfq_legacy_columns((int)t);
        if (!cols[p] || K % (kq ? 256 : 32) != 0 || parts[p].N < 0) return -1;
        need256 |= kq;
        need32 |= !kq;
        start[p + 1] = start[p] + (parts[p].N + FRCH - 1) / FRCH;
        col0[p] = col;
        col += parts[p].N;
    }
    if (M == 0 || col == 0) return 0;
    const int nt = num_threads < 1 ? 1 : (int)num_threads;
    const int64_t arb256 = (K / 256) * (int64_t)sizeof(xq256), arb32 = (K / 32) * (int64_t)sizeof(xq32);
    /* 64-byte aligned: a 512-bit load of activation quants never straddles two cache lines */
    uint8_t *a256 = need256 ? (uint8_t *)aligned_alloc(64, (size_t)(M * arb256 + 63) / 64 * 64) : 0;
    uint8_t *a32 = need32 ? (uint8_t *)aligned_alloc(64, (size_t)(M * arb32 + 63) / 64 * 64) : 0;
    if ((need256 && !a256) || (need32 && !a32)) {
        free(a256);
        free(a32);
        return -2;
    }
    int failed = 0;
#pragma omp parallel num_threads(nt) if (M >= FQUANT_PAR_ROWS && nt > 1)
    {
        float *buf = pre != PRE_NONE ? (float *)malloc((size_t)K * sizeof(float)) : 0;
        if (pre != PRE_NONE && !buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (pre != PRE_NONE && !buf) continue;
            const float *row = x + m * ldx;
            if (pre == PRE_RMSNORM) {
                rmsnorm_row(row, K, pre_w, eps, buf);
                row = buf;
            } else if (pre == PRE_SILU_MUL) {
                silu_mul_row(row, row + K, K, buf);
                row = buf;
            }
            if (need256) sfq_quantize_row256(row, K, (xq256 *)(a256 + m * arb256));
            if (need32) sfq_quantize_row32(row, K, (xq32 *)(a32 + m * arb32));
        }
        free(buf);
    }
    if (failed) {
        free(a256);
        free(a32);
        return -2;
    }
    const int64_t nchunks = start[nparts];
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1 && nchunks > 1)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        int64_t p = 0;
        while (ch >= start[p + 1]) p++;
        const sfq_part *pt = &parts[p];
        const int kq = is_k(pt->type);
        const int64_t n0 = (ch - start[p]) * FRCH, n1 = n0 + FRCH < pt->N ? n0 + FRCH : pt->N;
        const uint8_t *a = kq ? a256 : a32;
        const int64_t arb = kq ? arb256 : arb32, nb = K / (kq ? 256 : 32);
        for (int64_t c0 = 0; c0 < M; c0 += FXCHUNK) {
            const int64_t c1 = c0 + FXCHUNK < M ? c0 + FXCHUNK : M;
            cols[p](pt->W, pt->row_bytes, nb, a, arb, c0, c1, n0, n1, y + col0[p], ldy, pt->bias, (int)accumulate);
        }
    }
    free(a256);
    free(a32);
    return 0;
}

/* out[d] = x[d] * cos[d] + rot[d] * sin[d], rot = (-x[D/2:], x[:D/2]): the arithmetic of Rotary.forward
 * in runtime/model/decoder.py (a product each, then the sum; no fused multiply-add), so it equals torch's. */
static void rope_head(const float *x, const float *c, const float *s, int64_t D, float *out) {
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

/* qkv [T, ldqkv] rows of q (H heads) | k (KVH heads) | v (KVH heads), head size D; cos/sin [*, D] tables
 * indexed by pos[t]. Writes rotated q to q_out [T, H, D], rotated k and v to rows slots[t] of the caches
 * [*, KVH, D]. */
void specfleet_rope_kv(const float *qkv, int64_t T, int64_t ldqkv, int64_t H, int64_t KVH, int64_t D,
                       const int64_t *pos, const float *cos_t, const float *sin_t, float *q_out, float *k_cache,
                       float *v_cache, const int64_t *slots) {
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * ldqkv, *c = cos_t + pos[t] * D, *s = sin_t + pos[t] * D;
        for (int64_t h = 0; h < H; h++) rope_head(row + h * D, c, s, D, q_out + (t * H + h) * D);
        float *kd = k_cache + slots[t] * KVH * D, *vd = v_cache + slots[t] * KVH * D;
        for (int64_t h = 0; h < KVH; h++) rope_head(row + (H + h) * D, c, s, D, kd + h * D);
        memcpy(vd, row + (H + KVH) * D, (size_t)(KVH * D) * sizeof(float));
    }
}

/* 8 sums of 8 lanes each -> one vector of the 8 sums (a fixed tree of horizontal adds) */
ALWAYS_INLINE __m256 hsum8x8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    /* ab: lanes 0-3 keys 0-3 (low halves), 4-7 keys 0-3 (high halves); cd likewise for keys 4-7 */
    const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
    return _mm256_add_ps(lo, hi);
}

#define AMAX_G 16 /* query heads per KV head handled together */
#define MAX_D 512 /* head sizes up to this */
#define MAX_GROUP 8 /* rows of one request whose attention shares key loads */
#ifndef VCHUNK
#define VCHUNK 64 /* keys whose values the weighted sum takes at a time */
#endif

#ifdef SF_VNNI512
/* o0[0 .. 16 nv) (and o1, the second head's, unless 0) += sum over keys j in [j0, j1) of p0[j] (p1[j]) times
 * the values of cache row krow[j] (v: those values at this part of D), in key order; the sums start from 0 at
 * j0 = 0 and from what o0/o1 hold after. nv (2 or 4 registers) is a constant at each call, so the loops unroll. */
ALWAYS_INLINE void values_chunk512(const float *v, const int64_t *krow, int64_t ldk, int64_t j0, int64_t j1,
                                   const float *p0, const float *p1, float *o0, float *o1, const int nv) {
    __m512 x0[4], x1[4];
    for (int u = 0; u < nv; u++) {
        x0[u] = j0 ? _mm512_loadu_ps(o0 + 16 * u) : _mm512_setzero_ps();
        x1[u] = j0 && o1 ? _mm512_loadu_ps(o1 + 16 * u) : _mm512_setzero_ps();
    }
    for (int64_t j = j0; j < j1; j++) {
        const float *vr = v + krow[j] * ldk;
        const __m512 b0 = _mm512_set1_ps(p0[j]), b1 = _mm512_set1_ps(p1[j]);
        for (int u = 0; u < nv; u++) {
            const __m512 vv = _mm512_loadu_ps(vr + 16 * u);
            x0[u] = _mm512_fmadd_ps(b0, vv, x0[u]);
            x1[u] = _mm512_fmadd_ps(b1, vv, x1[u]);
        }
    }
    for (int u = 0; u < nv; u++) {
        _mm512_storeu_ps(o0 + 16 * u, x0[u]);
        if (o1) _mm512_storeu_ps(o1 + 16 * u, x1[u]);
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
static void attend_group(const float *q, int64_t qs, int64_t m, int64_t G, const float *k, const float *v,
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
            for (int64_t a = 0; a < G; a += 2) {
                const float *qa = qp + (r * G2 + a) * D;
                __m512 acc[8];
                for (int u = 0; u < 8; u++) acc[u] = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 8) {
                    const __m512 qv = _mm512_load_ps(qa + 2 * d);
                    for (int u = 0; u < 8; u++) acc[u] = _mm512_fmadd_ps(qv, both_f8(kr[u] + d), acc[u]);
                }
                __m256 half[8];
                for (int u = 0; u < 8; u++) half[u] = lo8(acc[u]);
                _mm256_storeu_ps(s + a * L8 + j0, _mm256_mul_ps(hsum8x8(half), _mm256_set1_ps(scale)));
                if (a + 1 < G) {
                    for (int u = 0; u < 8; u++) half[u] = hi8(acc[u]);
                    _mm256_storeu_ps(s + (a + 1) * L8 + j0, _mm256_mul_ps(hsum8x8(half), _mm256_set1_ps(scale)));
                }
            }
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
            /* the AVX2 loop below with 16 lanes per register */
            for (int64_t a = 0; a < G; a += 2) {
                const int two = a + 1 < G;
                const float *p0 = sr + a * L8, *p1 = sr + (a + two) * L8;
                for (int64_t d = 0; d < D;) {
                    float *o0 = o + a * D + d, *o1 = two ? o + (a + 1) * D + d : 0;
                    if (D - d >= 64) { /* 64 values of D for both heads in 8 registers, else 32 in 4 */
                        values_chunk512(v + d, krow, ldk, j0, j1, p0, p1, o0, o1, 4);
                        d += 64;
                    } else {
                        values_chunk512(v + d, krow, ldk, j0, j1, p0, p1, o0, o1, 2);
                        d += 32;
                    }
                }
            }
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

/* A step's key plan (runtime/step/plan.py): which cached keys each query row attends to, in order.
 * Row i sees nkeys[i] keys. Its key j has the layout index (a request's token order: its context, then
 * its new tokens) j when j < plen[i], else extras[xoff[i] + j - plen[i]] (a tree row's ancestors, a
 * level-drafted row's visible keys); the layout index x is the cache row slots[base[i] + x]. */
typedef struct {
    const int64_t *slots, *base, *plen, *xoff, *nkeys, *extras;
} sf_key_plan;

/* Rows of q [n, H, D] attending, unmasked, to the keys the plan gives each; out [n, H, D]. Consecutive rows
 * of one request that see a prefix of its keys (decode rows, a chain's rows, a prompt chunk's rows; not
 * tree rows with gathered keys) go together, up to MAX_GROUP, sharing their key loads (attend_group);
 * a task is one group and one KV head, whole on one thread. */
static int attend_rows(const float *q, int64_t n, int64_t H, int64_t KVH, int64_t D, const float *k, const float *v,
                       int64_t ldk, const sf_key_plan *plan, float scale, float *out, int64_t num_threads) {
    if (n < 0 || H <= 0 || KVH <= 0 || H % KVH != 0 || D <= 0 || D % 32 != 0 || D > MAX_D || H / KVH > AMAX_G) return -1;
    int64_t lmax = 1, work = 0;
    for (int64_t i = 0; i < n; i++) {
        if (plan->nkeys[i] < 1 || plan->plen[i] < 0 || plan->plen[i] > plan->nkeys[i]) return -1;
        lmax = plan->nkeys[i] > lmax ? plan->nkeys[i] : lmax;
        work += plan->nkeys[i] * H * D;
    }
    int64_t *gstart = (int64_t *)malloc((size_t)(n + 1) * sizeof(int64_t)), ngroups = 0;
    if (!gstart) return -2;
    for (int64_t i = 0; i < n;) {
        int64_t e = i + 1;
        if (plan->plen[i] == plan->nkeys[i])
            while (e < n && e - i < MAX_GROUP && plan->plen[e] == plan->nkeys[e] && plan->base[e] == plan->base[i]) e++;
        gstart[ngroups++] = i;
        i = e;
    }
    gstart[ngroups] = n;
    const int64_t G = H / KVH, G2 = (G + 1) / 2 * 2, tasks = ngroups * KVH, l8 = (lmax + 7) / 8 * 8;
    const int nt = num_threads < 1 ? 1 : (int)num_threads;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && work >= ATTEND_PAR_WORK && tasks > 1)
    {
        float *sc = (float *)malloc((size_t)(MAX_GROUP * G * l8) * sizeof(float));
        float *qp = (float *)aligned_alloc(64, (size_t)(MAX_GROUP * G2 * D) * sizeof(float));
        int64_t *krow = (int64_t *)malloc((size_t)l8 * sizeof(int64_t));
        int64_t krow_of = -1; /* the group whose keys krow holds */
        if (!sc || !krow || !qp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!sc || !krow || !qp) continue;
            const int64_t gi = t / KVH, g = t % KVH, i0 = gstart[gi], m = gstart[gi + 1] - i0;
            int64_t L = 0;
            for (int64_t r = 0; r < m; r++) L = plan->nkeys[i0 + r] > L ? plan->nkeys[i0 + r] : L;
            if (krow_of != gi) {
                /* a group's rows see a prefix of the layout (all of the longest row's L keys); a lone row may
                 * also have gathered keys past its prefix */
                const int64_t p = plan->plen[i0] == plan->nkeys[i0] ? L : plan->plen[i0];
                const int64_t *sl = plan->slots + plan->base[i0], *x = plan->extras + plan->xoff[i0] - p;
                for (int64_t j = 0; j < L; j++) krow[j] = sl[j < p ? j : x[j]];
                krow_of = gi;
            }
            attend_group(q + (i0 * H + g * G) * D, H * D, m, G, k + g * D, v + g * D, ldk, krow, plan->nkeys + i0, D,
                         scale, sc, (L + 7) / 8 * 8, qp, out + (i0 * H + g * G) * D);
        }
        free(sc);
        free(qp);
        free(krow);
    }
    free(gstart);
    return failed ? -2 : 0;
}

/* q [n, H, D]; keys and values of head g for cache row r at k[r * ldk + g * D], v likewise; row i attends
 * to the keys of the plan (see sf_key_plan) with no mask; out [n, H, D]. H must be a multiple of KVH
 * (query heads h share KV head h / (H / KVH)). Returns 0, -1 for bad arguments, -2 when scratch memory
 * could not be allocated. */
int specfleet_attend(const float *q, int64_t n, int64_t H, int64_t KVH, int64_t D, const float *k, const float *v,
                     int64_t ldk, const int64_t *slots, const int64_t *base, const int64_t *plen, const int64_t *xoff,
                     const int64_t *nkeys, const int64_t *extras, float scale, float *out, int64_t num_threads) {
    const sf_key_plan plan = {slots, base, plen, xoff, nkeys, extras};
    return attend_rows(q, n, H, KVH, D, k, v, ldk, &plan, scale, out, num_threads);
}

/* One decoder layer of a native model (runtime/model/decoder.py `_forward_native`): its four products, its
 * norms' weights and its KV cache. */
typedef struct {
    const sfq_part *qkv, *o, *gate_up, *down;
    int64_t n_qkv, n_o, n_gate_up, n_down;
    const float *norm1, *norm2; /* input_layernorm, post_attention_layernorm weights [hidden] */
    double eps1, eps2;
    float *k_cache, *v_cache; /* [slots, KVH, D] */
} sfq_layer;

/* Every decoder layer over T rows of any kind (decode rows, prompt chunks, verification rows of a chain or
 * tree, level-drafted rows): per layer RMSNorm + q/k/v (+ bias), rotary + KV cache write at slots,
 * attention of each row over the keys the plan gives it (sf_key_plan), o product added to h, RMSNorm + gate/up, SiLU * up + down
 * added to h; h [T, hidden] is updated in place. The same kernels as the per-layer calls, so every
 * result is bit for bit what they give. Scratch: qkv [T, qkv_width], q and o [T, H * D], gu [T, 2 * inter].
 * Returns 0, or the first failing call's code. */
int specfleet_decode_layers(const sfq_layer *layers, int64_t nlayers, int64_t T, float *h, int64_t hidden,
                            float *qkv, int64_t qkv_width, float *q, float *o, float *gu, int64_t inter, int64_t H,
                            int64_t KVH, int64_t D, const int64_t *pos, const float *cos_t, const float *sin_t,
                            const int64_t *slots, const int64_t *kslots, const int64_t *base, const int64_t *plen,
                            const int64_t *xoff, const int64_t *nkeys, const int64_t *extras, float scale,
                            int64_t num_threads) {
    const sf_key_plan plan = {kslots, base, plen, xoff, nkeys, extras};
    int rc;
    for (int64_t l = 0; l < nlayers; l++) {
        const sfq_layer *ly = &layers[l];
        rc = specfleet_q_linear_fused(ly->qkv, ly->n_qkv, hidden, h, hidden, T, PRE_RMSNORM, ly->norm1, (float)ly->eps1,
                                      qkv, qkv_width, 0, num_threads);
        if (rc) return rc;
        specfleet_rope_kv(qkv, T, qkv_width, H, KVH, D, pos, cos_t, sin_t, q, ly->k_cache, ly->v_cache, slots);
        rc = attend_rows(q, T, H, KVH, D, ly->k_cache, ly->v_cache, KVH * D, &plan, scale, o, num_threads);
        if (rc) return rc;
        rc = specfleet_q_linear_fused(ly->o, ly->n_o, H * D, o, H * D, T, PRE_NONE, 0, 0.0f, h, hidden, 1, num_threads);
        if (rc) return rc;
        rc = specfleet_q_linear_fused(ly->gate_up, ly->n_gate_up, hidden, h, hidden, T, PRE_RMSNORM, ly->norm2,
                                      (float)ly->eps2, gu, 2 * inter, 0, num_threads);
        if (rc) return rc;
        rc = specfleet_q_linear_fused(ly->down, ly->n_down, inter, gu, 2 * inter, T, PRE_SILU_MUL, 0, 0.0f, h, hidden,
                                      1, num_threads);
        if (rc) return rc;
    }
    return 0;
}
