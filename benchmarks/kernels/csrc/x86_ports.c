/* How many of each AVX2 instruction the CPU issues a cycle, and which of them share a pipe with the integer
 * multiply (vpmaddubsw) that the AVX2 kernels' products are made of. benchmarks/kernels/ports.py builds and runs it.
 *
 * Each probe runs eight independent register chains of one instruction (or four of vpmaddubsw beside four of
 * another) for `iters` rounds and returns the seconds taken; the driver divides by the clock it measured
 * (sf_probe_clock: a chain of dependent scalar adds, one a cycle on every x86 core of the last decade). Eight chains
 * cover every latency these instructions have (3-5 cycles), so a figure below the chain count over the latency is
 * the issue rate. */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <immintrin.h>
#include <stdint.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
#define KEEP(v) __asm__ volatile("" : "+x"(v))
#define KEEP8 KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5); KEEP(a6); KEEP(a7);

/* seconds for 4 * iters dependent scalar adds */
double sf_probe_clock(int64_t iters) {
    int64_t x = 0;
    const double t = now();
    for (int64_t i = 0; i < iters; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    return now() - t;
}

#define OP_MADDUBS(a, x) a = _mm256_maddubs_epi16(a, x)
#define OP_MADD(a, x) a = _mm256_madd_epi16(a, x)
#define OP_PADDW(a, x) a = _mm256_add_epi16(a, x)
#define OP_PAND(a, x) a = _mm256_and_si256(a, x)
#define OP_PSHUFB(a, x) a = _mm256_shuffle_epi8(a, x)
#define OP_PSIGNB(a, x) a = _mm256_sign_epi8(a, x)
#define OP_PSRLW(a, x) a = _mm256_srli_epi16(a, 1)
#define OP_PMULLD(a, x) a = _mm256_mullo_epi32(a, x)
#define OP_CVT(a, x) a = _mm256_castps_si256(_mm256_cvtepi32_ps(a))
#define OP_FMA(a, x) a = _mm256_castps_si256(_mm256_fmadd_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(x), _mm256_castsi256_ps(x)))

#define PROBES(X) X(0, MADDUBS) X(1, MADD) X(2, PADDW) X(3, PAND) X(4, PSHUFB) X(5, PSIGNB) X(6, PSRLW) X(7, PMULLD) \
    X(8, CVT) X(9, FMA)

/* probe k alone (eight chains), or (mixed) four chains of vpmaddubsw beside four of probe k */
#define CASE(K, NAME)                                                                                   \
    case K:                                                                                            \
        if (mixed) /* the test outside the loops: a branch a round would cost more than the probes */  \
            for (int64_t i = 0; i < iters; i++) {                                                      \
                OP_MADDUBS(a0, x0); OP_MADDUBS(a1, x1); OP_MADDUBS(a2, x2); OP_MADDUBS(a3, x3);        \
                OP_##NAME(a4, x0); OP_##NAME(a5, x1); OP_##NAME(a6, x2); OP_##NAME(a7, x3);            \
                KEEP8                                                                                  \
            }                                                                                          \
        else                                                                                           \
            for (int64_t i = 0; i < iters; i++) {                                                      \
                OP_##NAME(a0, x0); OP_##NAME(a1, x1); OP_##NAME(a2, x2); OP_##NAME(a3, x3);            \
                OP_##NAME(a4, x0); OP_##NAME(a5, x1); OP_##NAME(a6, x2); OP_##NAME(a7, x3);            \
                KEEP8                                                                                  \
            }                                                                                          \
        break;

static const char *const names[] = {
#define NAME_OF(K, NAME) #NAME,
    PROBES(NAME_OF)
};
int sf_probe_count(void) { return (int)(sizeof names / sizeof names[0]); }
const char *sf_probe_name(int k) { return k >= 0 && k < sf_probe_count() ? names[k] : ""; }

/* seconds for iters rounds of probe k; -1 for an unknown k */
double sf_probe_run(int k, int mixed, int64_t iters) {
    __m256i x0 = _mm256_set1_epi8(1), x1 = _mm256_set1_epi8(2), x2 = _mm256_set1_epi8(3), x3 = _mm256_set1_epi8(4);
    __m256i a0 = x0, a1 = x1, a2 = x2, a3 = x3, a4 = x0, a5 = x1, a6 = x2, a7 = x3;
    static volatile int sink; /* keeps the chains live */
    const double t = now();
    switch (k) {
        PROBES(CASE)
    default: return -1.0;
    }
    const double dt = now() - t;
    sink = _mm256_extract_epi32(a0, 0) + _mm256_extract_epi32(a1, 0) + _mm256_extract_epi32(a2, 0) +
           _mm256_extract_epi32(a3, 0) + _mm256_extract_epi32(a4, 0) + _mm256_extract_epi32(a5, 0) +
           _mm256_extract_epi32(a6, 0) + _mm256_extract_epi32(a7, 0);
    (void)sink;
    return dt;
}
