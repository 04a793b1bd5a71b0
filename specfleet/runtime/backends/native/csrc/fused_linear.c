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

/* Set up a fused product (what q_common.h's sf_fused holds): the parts' column functions, their chunks of weight
 * rows and the activation kinds they need. Returns 0, or -1 for bad arguments (an unknown format, K not a multiple
 * of a format's block, too many parts). */
int sf_fused_setup(sf_fused *f, const sfq_part *parts, int64_t nparts, int64_t K, const float *x, int64_t ldx,
                   int64_t M, int64_t pre, const float *pre_w, float eps, float *y, int64_t ldy, int64_t accumulate) {
    if (nparts < 1 || nparts > SF_MAX_PARTS || K <= 0 || M < 0 || pre < PRE_NONE || pre > PRE_SILU_MUL) return -1;
    if (pre == PRE_RMSNORM && !pre_w) return -1;
    *f = (sf_fused){.parts = parts, .nparts = nparts, .K = K, .M = M, .x = x, .ldx = ldx, .pre = pre,
                    .pre_w = pre_w, .eps = eps, .y = y, .ldy = ldy, .accumulate = accumulate};
    f->start[0] = 0;
    int64_t col = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t t = parts[p].type;
        f->cols[p] = sfq_columns(t);
        if (!f->cols[p] || K % (sf_is_k(t) ? 256 : 32) != 0 || parts[p].N < 0) return -1;
        f->need[sf_act_kind(t)] = 1;
        f->rch[p] = sf_chunk_rows(parts[p].row_bytes, M);
        f->start[p + 1] = f->start[p] + (parts[p].N + f->rch[p] - 1) / f->rch[p];
        f->col0[p] = col;
        col += parts[p].N;
    }
    const int64_t kind_type[SF_ACT_KINDS] = {T_Q4_K, T_Q4_0, T_Q4_1};
    for (int k = 0; k < SF_ACT_KINDS; k++) f->arb[k] = sf_act_row_bytes(kind_type[k], K);
    if (col == 0) f->M = 0; /* nothing to compute */
    return 0;
}

/* One set of activation buffers for the fused products fs[0..n), which run one after another: each kind the parts
 * of any of them need, as large as the largest of them needs, 64-byte aligned (a 512-bit load of activation quants
 * never straddles two cache lines). Writes each kind's offset in the set to off and returns the set's bytes. */
int64_t sf_fused_act_layout(const sf_fused *fs, int64_t n, int64_t *off) {
    int64_t per = 0;
    for (int k = 0; k < SF_ACT_KINDS; k++) {
        int64_t bytes = 0;
        for (int64_t i = 0; i < n; i++)
            if (fs[i].need[k] && fs[i].M * fs[i].arb[k] > bytes) bytes = fs[i].M * fs[i].arb[k];
        off[k] = per;
        per += (bytes + 63) / 64 * 64;
    }
    return per;
}

/* Activation row m of a fused product, transformed (f->pre) and quantized into act[kind] for every kind the parts
 * need; buf: K floats of scratch. */
static void fused_prepare_row(const sf_fused *f, int64_t m, float *buf, uint8_t *const *act) {
    const float *row = f->x + m * f->ldx;
    if (f->pre == PRE_RMSNORM) {
        sfq_rmsnorm_row(row, f->K, f->pre_w, f->eps, buf);
        row = buf;
    } else if (f->pre == PRE_SILU_MUL) {
        sfq_silu_mul_row(row, row + f->K, f->K, buf);
        row = buf;
    }
    for (int k = 0; k < SF_ACT_KINDS; k++)
        if (f->need[k]) sf_quantize_act(k, row, f->K, act[k] + m * f->arb[k]);
}

/* The first row of part p (starting at byte pb of the parts laid end to end, rb bytes a row, N rows) at or past byte
 * b, rounded up to a multiple of SF_SPLIT_ROWS rows, at most N */
#define SF_SPLIT_ROWS 16
static int64_t split_row(int64_t b, int64_t pb, int64_t rb, int64_t N) {
    if (b <= pb || rb <= 0) return 0;
    const int64_t r = ((b - pb + rb - 1) / rb + SF_SPLIT_ROWS - 1) / SF_SPLIT_ROWS * SF_SPLIT_ROWS;
    return r < N ? r : N;
}

/* Thread tid's share of a product's weight rows in one contiguous run (SF_SCHEDULE_SPLIT): the parts' rows laid end
 * to end are cut into nth runs of equal bytes, each edge at a multiple of SF_SPLIT_ROWS rows, and thread tid computes
 * the tid-th, part by part. One stream a thread, no hand-out, and no thread finishing a chunk ahead of another's
 * last (handed out in chunks, the 0.5B's 1152-row q/k/v product was 4 chunks: one thread took 896 of its rows). The
 * runs tile the rows whatever nth is, and which thread computes a row changes no result. */
static void fused_split(const sf_fused *f, uint8_t *const *act, int64_t epoch, int tid, int nth) {
    int64_t total = 0;
    for (int64_t p = 0; p < f->nparts; p++) total += f->parts[p].N * f->parts[p].row_bytes;
    const int64_t b0 = total / nth * tid + total % nth * tid / nth;
    const int64_t b1 = total / nth * (tid + 1) + total % nth * (tid + 1) / nth;
    for (int64_t p = 0, pb = 0; p < f->nparts; pb += f->parts[p].N * f->parts[p].row_bytes, p++) {
        const sfq_part *pt = &f->parts[p];
        const int64_t n0 = split_row(b0, pb, pt->row_bytes, pt->N), n1 = split_row(b1, pb, pt->row_bytes, pt->N);
        if (n1 <= n0) continue;
        const int kind = sf_act_kind(pt->type);
        sf_far_chunk((const uint8_t *)pt->W, pt->row_bytes, n0, n1, f->M);
        sf_call_epoch = epoch;
        f->cols[p](pt->W, pt->row_bytes, f->K / (kind == SF_ACT_256 ? 256 : 32), act[kind], f->arb[kind], 0, f->M, n0,
                   n1, f->y + f->col0[p], f->ldy, pt->bias, (int)f->accumulate);
        sf_call_epoch = 0;
    }
}

/* A fused product run by every thread of the team that meets it (or by one thread outside a parallel region: the
 * worksharing below then runs whole on it); the schedule of its chunk loop is the one sf_row_schedule set before the
 * team began. buf: K floats of this thread's scratch. Fewer than SF_QUANT_PAR_ROWS activation rows are prepared by
 * every thread into its own buffers (own[kind]: M * f->arb[kind] bytes each, 64-byte aligned), which costs no more
 * than one thread preparing them while the others wait, and needs no barrier; more rows are prepared by the threads
 * together into f->act (and the loop's barrier publishes them). Returns after the team's barrier at the end of the
 * product, so the outputs are complete for every thread of the team. */
void sf_fused_team(sf_fused *f, float *buf, uint8_t *const *own) {
    if (f->M == 0) return;
    uint8_t *const *act = f->act;
    if (f->M < SF_QUANT_PAR_ROWS) {
        for (int64_t m = 0; m < f->M; m++) fused_prepare_row(f, m, buf, own);
        act = own;
    } else {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < f->M; m++) fused_prepare_row(f, m, buf, f->act);
    }
    /* each thread's own epoch (q_common.h): what a body keeps from the rows it read serves only this thread's part
     * of this call */
    const int64_t epoch = sf_new_epoch(), K = f->K, M = f->M;
    if (sf_schedule_guided == SF_SCHEDULE_SPLIT && M < SF_QUANT_PAR_ROWS) {
        fused_split(f, act, epoch, omp_get_thread_num(), omp_get_num_threads());
#pragma omp barrier
        return;
    }
#pragma omp for schedule(runtime)
    for (int64_t ch = 0; ch < f->start[f->nparts]; ch++) {
        int64_t p = 0;
        while (ch >= f->start[p + 1]) p++;
        const sfq_part *pt = &f->parts[p];
        const int kind = sf_act_kind(pt->type);
        const int64_t n0 = (ch - f->start[p]) * f->rch[p], n1 = n0 + f->rch[p] < pt->N ? n0 + f->rch[p] : pt->N;
        const int64_t nb = K / (kind == SF_ACT_256 ? 256 : 32);
        sf_far_chunk((const uint8_t *)pt->W, pt->row_bytes, n0, n1, M);
        for (int64_t c0 = 0; c0 < M; c0 += SF_XCHUNK) {
            const int64_t c1 = c0 + SF_XCHUNK < M ? c0 + SF_XCHUNK : M;
            sf_call_epoch = epoch;
            f->cols[p](pt->W, pt->row_bytes, nb, act[kind], f->arb[kind], c0, c1, n0, n1, f->y + f->col0[p], f->ldy,
                       pt->bias, (int)f->accumulate);
            sf_call_epoch = 0;
        }
    }
}

/* Rows x[m * ldx ...] (m < M; with PRE_SILU_MUL a row is gate[K] then up[K]) -> y[m * ldy + col], the
 * parts' outputs side by side. pre: PRE_NONE, PRE_RMSNORM (pre_w[K], eps) or PRE_SILU_MUL. Returns 0, or
 * -1 for bad arguments (an unknown format, K not a multiple of a format's block, too many parts), -2
 * when scratch memory could not be allocated. */
int specfleet_q_linear_fused(const sfq_part *parts, int64_t nparts, int64_t K, const float *x, int64_t ldx, int64_t M,
                             int64_t pre, const float *pre_w, float eps, float *y, int64_t ldy, int64_t accumulate,
                             int64_t num_threads) {
    sf_fused f;
    const int rc = sf_fused_setup(&f, parts, nparts, K, x, ldx, M, pre, pre_w, eps, y, ldy, accumulate);
    if (rc || f.M == 0) return rc;
    const int nt = num_threads < 1 ? 1 : (int)num_threads;
    const int shared = M >= SF_QUANT_PAR_ROWS;
    /* activation buffers: one shared set, or one set per thread (sf_fused_team); and K floats of scratch a thread */
    int64_t off[SF_ACT_KINDS];
    const int64_t per = sf_fused_act_layout(&f, 1, off);
    const int64_t copies = shared ? 1 : nt, bufs = (K * (int64_t)sizeof(float) + 63) / 64 * 64;
    uint8_t *mem = (uint8_t *)aligned_alloc(64, (size_t)(copies * per + nt * bufs));
    if (!mem) return -2;
    for (int k = 0; k < SF_ACT_KINDS; k++) f.act[k] = f.need[k] ? mem + off[k] : 0;
    sf_row_schedule();
#pragma omp parallel num_threads(nt) if (nt > 1 && (shared || f.start[f.nparts] > 1))
    {
        const int tid = omp_get_thread_num();
        uint8_t *own[SF_ACT_KINDS];
        for (int k = 0; k < SF_ACT_KINDS; k++) own[k] = f.need[k] ? mem + (shared ? 0 : tid) * per + off[k] : 0;
        sf_fused_team(&f, (float *)(mem + copies * per + tid * bufs), own);
    }
    free(mem);
    return 0;
}
