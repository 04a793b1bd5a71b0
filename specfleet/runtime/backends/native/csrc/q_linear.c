/* y[M, N] = x[M, K] @ W[N, K]^T for weights kept in llama.cpp's GGUF block formats: the entry points of
 * specfleet's block-format kernels (arch-free), built with one architecture's bodies (generic/,
 * arch/x86/, arch/arm/: the formats' column functions and quantizers) into one library on first use by
 * runtime/backends/native/kernels.py; the shared contract is in q_common.h.
 *
 * Work: each row of x is quantized to int8 once per call, on its own (rows in parallel from
 * SF_QUANT_PAR_ROWS of them). Then threads take chunks of SF_RCH weight rows (one-row products: sf_chunk_rows) as
 * they come free, one at a time or in guided runs (sf_schedule_guided; a thread that the OS deschedules on a shared
 * machine holds back no fixed share either way); within a chunk the rows of
 * x go SF_XCHUNK at a time (kept in L2) and each weight row is unpacked once per tile of up to TILE
 * activation rows. Which thread computes an output and which rows share its tile never change how
 * it is computed. */
#include <omp.h>

#include "q_common.h"

/* bytes of one quantized activation row, 0 for an unknown type */
int64_t specfleet_q_act_row_bytes(int type, int64_t K) { return sf_act_row_bytes(type, K); }

/* x fp32 [M, K] row-major; W [N, row_bytes] blocks; y fp32 [M, N] (written); act: scratch of
 * M * specfleet_q_act_row_bytes(type, K) bytes, 64-byte aligned. Returns 0, or -1 for an unknown type / bad K. */
int specfleet_q_linear(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K, const float *x,
                       int64_t M, float *y, void *act, int num_threads) {
    const int kq = sf_is_k(type);
    const int64_t qk = kq ? 256 : 32;
    const int64_t arb = specfleet_q_act_row_bytes(type, K);
    if (arb == 0 || K % qk != 0 || K <= 0 || ((uintptr_t)act & 63)) return -1; /* act: 64-byte aligned */
    const cols_fn cols = sfq_columns(type);
    if (num_threads < 1) num_threads = 1;
    const int64_t nb = K / qk;
    uint8_t *a = (uint8_t *)act;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= SF_QUANT_PAR_ROWS && num_threads > 1)
    for (int64_t m = 0; m < M; m++) sf_quantize_act(sf_act_kind(type), x + m * K, K, a + m * arb);
    const int64_t rch = sf_chunk_rows(row_bytes, M);
    const int64_t epoch = sf_new_epoch(), nchunks = (N + rch - 1) / rch;
    sf_row_schedule();
#pragma omp parallel for schedule(runtime) num_threads(num_threads) if (num_threads > 1 && nchunks > 1)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        const int64_t n0 = ch * rch, n1 = n0 + rch < N ? n0 + rch : N;
        sf_far_chunk(W, row_bytes, n0, n1, M);
        for (int64_t c0 = 0; c0 < M; c0 += SF_XCHUNK) {
            const int64_t c1 = c0 + SF_XCHUNK < M ? c0 + SF_XCHUNK : M;
            sf_call_epoch = epoch;
            cols(W, row_bytes, nb, a, arb, c0, c1, n0, n1, y, N, 0, 0);
            sf_call_epoch = 0;
        }
    }
    return 0;
}

/* Set how the products prefetch their weights (the body's sf_prefetch_bytes: for one activation row, for more
 * row by row, for weight rows in pairs and fours; and whether more rows prefetch into L2); negative keeps a
 * value. Changes no result. */
int64_t sf_prefetch_l2 = 0;
void specfleet_set_prefetch(int64_t one_row, int64_t many_rows, int64_t grouped, int64_t l2) {
    if (one_row >= 0 && one_row <= (1 << 20)) sf_prefetch_bytes[0] = one_row;
    if (many_rows >= 0 && many_rows <= (1 << 20)) sf_prefetch_bytes[1] = many_rows;
    if (grouped >= 0 && grouped <= (1 << 20)) sf_prefetch_bytes[2] = grouped;
    if (l2 >= 0) sf_prefetch_l2 = l2 != 0;
}

/* Set the far prefetch distances into L2 (q_common.h sf_prefetch_far) for one activation row and for more; 0 turns
 * one off, negative keeps it. Changes no result. */
int64_t sf_prefetch_far[2] = {0, 0};
_Thread_local uintptr_t sf_far_end = UINTPTR_MAX;
void specfleet_set_prefetch_far(int64_t one_row, int64_t many_rows) {
    if (one_row >= 0 && one_row <= (1 << 20)) sf_prefetch_far[0] = one_row;
    if (many_rows >= 0 && many_rows <= (1 << 20)) sf_prefetch_far[1] = many_rows;
}

/* Set how many bytes of weight rows a one-row product's chunks hold at least (q_common.h sf_chunk_rows; 0: SF_RCH
 * rows), negative keeps it. Which thread reads a weight row changes no result. */
int64_t sf_chunk_bytes = 0;
void specfleet_set_chunk_bytes(int64_t bytes) {
    if (bytes >= 0 && bytes <= (1 << 24)) sf_chunk_bytes = bytes;
}

/* Set how the products' chunks are handed to threads (q_common.h sf_schedule_guided): 0 one at a time, 1 guided, 2
 * (SF_SCHEDULE_SPLIT) one run a thread for fused products over few rows, else guided; negative keeps it, above 2 is
 * 2. Which thread reads a weight row changes no result. */
int64_t sf_schedule_guided = 0;
void specfleet_set_schedule(int64_t mode) {
    if (mode >= 0) sf_schedule_guided = mode > SF_SCHEDULE_SPLIT ? SF_SCHEDULE_SPLIT : mode;
}

/* The fewest activation rows for which the products take weight rows in pairs and fours (q_common.h), and the
 * activation bytes above which fewer rows (from 2) do too (0: never); fewer go row by row. Below 2 means 2,
 * negative bytes keep the value. Changes no result. */
int64_t sf_group_min_rows = 2;
int64_t sf_group_act_bytes = 0;
_Thread_local int64_t sf_grouped_ahead = 4096;
void specfleet_set_grouping(int64_t min_rows, int64_t act_bytes) {
    sf_group_min_rows = min_rows < 2 ? 2 : min_rows;
    if (act_bytes >= 0) sf_group_act_bytes = act_bytes;
}

/* The product calls' epochs (q_common.h) */
_Thread_local int64_t sf_call_epoch = 0;
static int64_t sf_epoch_last = 0;
int64_t sf_new_epoch(void) { return __atomic_add_fetch(&sf_epoch_last, 1, __ATOMIC_RELAXED); }

int specfleet_q_abi(void) { return 12; } /* runtime/backends/native/kernels.py ABI */

/* the ISA path this library was built for (the bodies' sfq_isa_name) */
const char *specfleet_q_isa(void) { return sfq_isa_name(); }
