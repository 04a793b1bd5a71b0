/* y[M, N] = x[M, K] @ W[N, K]^T for weights kept in llama.cpp's GGUF block formats, on x86-64 CPUs
 * with AVX2, FMA and F16C: the entry points of specfleet's block-format kernels, built together with
 * q_legacy.c (Q4_0, Q4_1, Q5_0, Q8_0) and q_kquants.c (Q4_K, Q6_K) into one library on first use by
 * runtime/formats/qtensor.py (through runtime/backends/native/build.py); the shared contract is in q_common.h.
 *
 * Work: each row of x is quantized to int8 once per call, on its own (rows in parallel from
 * QUANT_PAR_ROWS of them). Then threads take chunks of RCH weight rows as they come free (a thread
 * that the OS deschedules on a shared machine holds back no fixed share); within a chunk the rows of
 * x go XCHUNK at a time (kept in L2) and each weight row is unpacked once per tile of up to TILE
 * activation rows. Which thread computes an output and which rows share its tile never change how
 * it is computed. */
#include <omp.h>

#include "q_common.h"

#define XCHUNK 64 /* activation rows swept per weight row before moving on */
#define RCH 64    /* weight rows per scheduled chunk: contiguous enough for the hardware prefetcher (16 streamed 15 % slower at one row) */
#define QUANT_PAR_ROWS 32 /* fewer rows are quantized on one thread: cheaper than another fork and join */

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
 * M * specfleet_q_act_row_bytes(type, K) bytes, 64-byte aligned. Returns 0, or -1 for an unknown type / bad K. */
int specfleet_q_linear(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K, const float *x,
                       int64_t M, float *y, void *act, int num_threads) {
    const int kq = is_k_type(type);
    const int64_t qk = kq ? 256 : 32;
    const int64_t arb = specfleet_q_act_row_bytes(type, K);
    if (arb == 0 || K % qk != 0 || K <= 0 || ((uintptr_t)act & 63)) return -1; /* act: 64-byte aligned */
    const cols_fn cols = kq ? sfq_kquant_columns(type) : sfq_legacy_columns(type);
    if (num_threads < 1) num_threads = 1;
    const int64_t nb = K / qk;
    uint8_t *a = (uint8_t *)act;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= QUANT_PAR_ROWS && num_threads > 1)
    for (int64_t m = 0; m < M; m++) {
        if (kq) sfq_quantize_row256(x + m * K, K, (xq256 *)(a + m * arb));
        else sfq_quantize_row32(x + m * K, K, (xq32 *)(a + m * arb));
    }
    const int64_t nchunks = (N + RCH - 1) / RCH;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && nchunks > 1)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        const int64_t n0 = ch * RCH, n1 = n0 + RCH < N ? n0 + RCH : N;
        for (int64_t c0 = 0; c0 < M; c0 += XCHUNK) {
            const int64_t c1 = c0 + XCHUNK < M ? c0 + XCHUNK : M;
            cols(W, row_bytes, nb, a, arb, c0, c1, n0, n1, y, N, 0, 0);
        }
    }
    return 0;
}

int specfleet_q_abi(void) { return 6; } /* runtime/backends/native/kernels.py ABI */

/* the ISA path this library was built for (q_common.h) */
const char *specfleet_q_isa(void) { return SF_ISA_NAME; }
