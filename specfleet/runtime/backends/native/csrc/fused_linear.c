/* Fused products for specfleet's native GGUF models (fp32 activations on the CPU): one or more
 * block-format weights that share their input (q/k/v, gate/up; mixed formats allowed) in one call. Each
 * input row is optionally transformed first (RMSNorm with a weight, or SiLU(gate) * up), quantized once
 * per activation format, and multiplied by every part in one OpenMP loop; outputs land side by side in y
 * (+ bias), or are added to y (a residual add fused into the product). A decoder layer is a handful of
 * such calls (layers.c) instead of dozens of small torch ops, which on a 2-core CPU were about a third of
 * a decode step. Arch-free: the row ops, quantizers and column functions are the bodies' (q_common.h).
 *
 * Batch invariance (q_common.h): every output row is computed by the same instruction sequence over the
 * same data in the same order whatever the number of rows in the call, which rows share a tile and which
 * thread runs it. */
#include <omp.h>
#include <stdlib.h>

#include "q_common.h"

#define MAX_PARTS 8

/* Rows x[m * ldx ...] (m < M; with PRE_SILU_MUL a row is gate[K] then up[K]) -> y[m * ldy + col], the
 * parts' outputs side by side. pre: PRE_NONE, PRE_RMSNORM (pre_w[K], eps) or PRE_SILU_MUL. Returns 0, or
 * -1 for bad arguments (an unknown format, K not a multiple of a format's block, too many parts), -2
 * when scratch memory could not be allocated. */
int specfleet_q_linear_fused(const sfq_part *parts, int64_t nparts, int64_t K, const float *x, int64_t ldx, int64_t M,
                             int64_t pre, const float *pre_w, float eps, float *y, int64_t ldy, int64_t accumulate,
                             int64_t num_threads) {
    if (nparts < 1 || nparts > MAX_PARTS || K <= 0 || M < 0 || pre < PRE_NONE || pre > PRE_SILU_MUL) return -1;
    if (pre == PRE_RMSNORM && !pre_w) return -1;
    int need[SF_ACT_KINDS] = {0, 0, 0};
    cols_fn cols[MAX_PARTS];
    int64_t start[MAX_PARTS + 1], col0[MAX_PARTS], rch[MAX_PARTS];
    start[0] = 0;
    int64_t col = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t t = parts[p].type;
        cols[p] = sfq_columns(t);
        if (!cols[p] || K % (sf_is_k(t) ? 256 : 32) != 0 || parts[p].N < 0) return -1;
        need[sf_act_kind(t)] = 1;
        rch[p] = sf_chunk_rows(parts[p].row_bytes, M);
        start[p + 1] = start[p] + (parts[p].N + rch[p] - 1) / rch[p];
        col0[p] = col;
        col += parts[p].N;
    }
    if (M == 0 || col == 0) return 0;
    const int nt = num_threads < 1 ? 1 : (int)num_threads;
    /* one activation buffer per kind the parts need; 64-byte aligned: a 512-bit load of activation quants
     * never straddles two cache lines */
    const int64_t kind_type[SF_ACT_KINDS] = {T_Q4_K, T_Q4_0, T_Q4_1};
    int64_t arb[SF_ACT_KINDS];
    uint8_t *act[SF_ACT_KINDS] = {0, 0, 0};
    int nomem = 0;
    for (int k = 0; k < SF_ACT_KINDS; k++) {
        arb[k] = sf_act_row_bytes(kind_type[k], K);
        if (need[k] && !(act[k] = (uint8_t *)aligned_alloc(64, (size_t)(M * arb[k] + 63) / 64 * 64))) nomem = 1;
    }
    if (nomem) {
        for (int k = 0; k < SF_ACT_KINDS; k++) free(act[k]);
        return -2;
    }
    int failed = 0;
#pragma omp parallel num_threads(nt) if (M >= SF_QUANT_PAR_ROWS && nt > 1)
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
                sfq_rmsnorm_row(row, K, pre_w, eps, buf);
                row = buf;
            } else if (pre == PRE_SILU_MUL) {
                sfq_silu_mul_row(row, row + K, K, buf);
                row = buf;
            }
            for (int k = 0; k < SF_ACT_KINDS; k++)
                if (need[k]) sf_quantize_act(k, row, K, act[k] + m * arb[k]);
        }
        free(buf);
    }
    if (failed) {
        for (int k = 0; k < SF_ACT_KINDS; k++) free(act[k]);
        return -2;
    }
    const int64_t epoch = sf_new_epoch(), nchunks = start[nparts];
    sf_row_schedule();
#pragma omp parallel for schedule(runtime) num_threads(nt) if (nt > 1 && nchunks > 1)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        int64_t p = 0;
        while (ch >= start[p + 1]) p++;
        const sfq_part *pt = &parts[p];
        const int kind = sf_act_kind(pt->type);
        const int64_t n0 = (ch - start[p]) * rch[p], n1 = n0 + rch[p] < pt->N ? n0 + rch[p] : pt->N;
        const int64_t nb = K / (kind == SF_ACT_256 ? 256 : 32);
        sf_far_chunk((const uint8_t *)pt->W, pt->row_bytes, n0, n1, M);
        for (int64_t c0 = 0; c0 < M; c0 += SF_XCHUNK) {
            const int64_t c1 = c0 + SF_XCHUNK < M ? c0 + SF_XCHUNK : M;
            sf_call_epoch = epoch;
            cols[p](pt->W, pt->row_bytes, nb, act[kind], arb[kind], c0, c1, n0, n1, y + col0[p], ldy, pt->bias,
                    (int)accumulate);
            sf_call_epoch = 0;
        }
    }
    for (int k = 0; k < SF_ACT_KINDS; k++) free(act[k]);
    return 0;
}
