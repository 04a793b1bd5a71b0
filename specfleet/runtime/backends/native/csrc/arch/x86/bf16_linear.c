/* y[M, N] = x[M, K] @ W[N, K]^T for bf16 weights on x86-64 CPUs with AVX2 and FMA but no native bf16.
 *
 * Speculative verification multiplies every weight by a handful of rows (k+1 for k drafted tokens).
 * On such CPUs torch either emulates the bf16 product (compute-bound from two rows on) or, in
 * specfleet's earlier route, converts the weight to fp32 in slices and calls BLAS, which costs an
 * extra write and read of every weight. Here each bf16 weight is read from memory once, widened to
 * fp32 in registers (a 16-bit shift) and multiplied by all rows while it is in cache, so a few rows
 * cost about what one row does: the product stays bound by reading the weights.
 *
 * Tiling: a thread owns a contiguous range of output columns (weight rows). For each pair (or four)
 * of weight rows it runs over the rows of x in chunks of up to 6, keeping NR x MR accumulators of 8
 * floats in registers (at most 12 + 2 weights + 1 activation = 15 of the 16 AVX2 registers); the
 * weight rows of a pair stay in L1/L2 between chunks. Sums are fp32 throughout. Written for specfleet;
 * compiled on first use by runtime/backends/native/build.py; the generic
 * body (../../generic/bf16_linear.c) computes the same bits. */
#include <omp.h>

#include "x86.h"

ALWAYS_INLINE __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

ALWAYS_INLINE float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

/* nr weight rows x mr activation rows; nr and mr are constants at every call site, so the compiler
 * unrolls these loops and keeps acc in registers. */
ALWAYS_INLINE void tile(const float *x, int64_t ldx, int mr, const uint16_t *w, int64_t K, int nr,
                        float *y, int64_t ldy) {
    __m256 acc[4][6];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) acc[r][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[4];
        for (int r = 0; r < nr; r++) wv[r] = load_bf16x8(w + r * K + k);
        for (int m = 0; m < mr; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
            for (int r = 0; r < nr; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) {
            float s = hsum8(acc[r][m]);
            for (int64_t t = k; t < K; t++) s += x[m * ldx + t] * bf16_to_f32(w[r * K + t]);
            y[m * ldy + r] = s;
        }
}

#define TILE_CASES(NR)                                                   \
    switch (mr) {                                                        \
    case 1: tile(xm, K, 1, wn, K, NR, ym, N); break;                     \
    case 2: tile(xm, K, 2, wn, K, NR, ym, N); break;                     \
    case 3: tile(xm, K, 3, wn, K, NR, ym, N); break;                     \
    case 4: tile(xm, K, 4, wn, K, NR, ym, N); break;                     \
    case 5: tile(xm, K, 5, wn, K, NR, ym, N); break;                     \
    default: tile(xm, K, 6, wn, K, NR, ym, N); break;                    \
    }

/* Columns [n0, n1) of y for all M rows. */
static void columns(const float *x, int64_t M, int64_t K, const uint16_t *W, int64_t N, float *y,
                    int64_t n0, int64_t n1) {
    /* four weight rows per tile when at most two activation rows (more loads in flight for a
     * bandwidth-bound product), else two, so NR x MR accumulators fit in registers */
    const int nr_main = M <= 2 ? 4 : 2;
    int64_t n = n0;
    for (; n + nr_main <= n1; n += nr_main) {
        const uint16_t *wn = W + n * K;
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            int mr = (int)(M - m0 < 6 ? M - m0 : 6);
            const float *xm = x + m0 * K;
            float *ym = y + m0 * N + n;
            if (nr_main == 4) {
                TILE_CASES(4)
            } else {
                TILE_CASES(2)
            }
        }
    }
    for (; n < n1; n++) {
        const uint16_t *wn = W + n * K;
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            int mr = (int)(M - m0 < 6 ? M - m0 : 6);
            const float *xm = x + m0 * K;
            float *ym = y + m0 * N + n;
            TILE_CASES(1)
        }
    }
}

/* x: fp32 [M, K] row-major; W: bf16 bits [N, K] row-major; y: fp32 [M, N] row-major (written).
 * Columns are split into equal contiguous ranges, one per thread, aligned to 4 rows. */
void specfleet_bf16_linear(const float *x, int64_t M, int64_t K, const uint16_t *W, int64_t N, float *y,
                           int num_threads) {
    if (num_threads < 1) num_threads = 1;
    int64_t per = (N + num_threads - 1) / num_threads;
    per = (per + 3) / 4 * 4;
    if (num_threads == 1 || N < 64) {
        columns(x, M, K, W, N, y, 0, N);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        int64_t t = omp_get_thread_num();
        int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        if (n0 < n1) columns(x, M, K, W, N, y, n0, n1);
    }
}

