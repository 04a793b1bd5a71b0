/* The layer loop of specfleet's native models: every decoder layer of a step in one call (arch-free; the
 * products, attention and rotary are fused_linear.c's and attention.c's). */
#include <omp.h>
#include <stdlib.h>

#include "q_common.h"

#define PRODUCTS 4 /* a layer's: q/k/v, o, gate/up, down */

/* Every decoder layer over T rows of any kind (decode rows, prompt chunks, verification rows of a chain or
 * tree, level-drafted rows): per layer RMSNorm + q/k/v (+ bias), rotary + KV cache write at slots,
 * attention of each row over the keys the plan gives it (sf_key_plan), o product added to h, RMSNorm + gate/up, SiLU * up + down
 * added to h; h [T, hidden] is updated in place. The same kernels as the per-layer calls, so every
 * result is bit for bit what they give. Scratch: qkv [T, qkv_width], q and o [T, H * D], gu [T, 2 * inter].
 *
 * One team of threads runs every layer: the products and the attention share its threads, with a barrier between
 * one and the next, where separate calls would each start and end a parallel region (four products and the
 * attention a layer: about 120 regions a forward of the 0.5B, whose small products cost little more than a region's
 * start and end on two threads). Everything is set up before the team starts, so a refused argument or a failed
 * allocation returns before any layer runs. Returns 0, or the first failing set-up's code. */
int specfleet_decode_layers(const sfq_layer *layers, int64_t nlayers, int64_t T, float *h, int64_t hidden,
                            float *qkv, int64_t qkv_width, float *q, float *o, float *gu, int64_t inter, int64_t H,
                            int64_t KVH, int64_t D, const int64_t *pos, const float *cos_t, const float *sin_t,
                            const int64_t *slots, const int64_t *kslots, const int64_t *base, const int64_t *plen,
                            const int64_t *xoff, const int64_t *nkeys, const int64_t *extras, float scale,
                            int64_t num_threads) {
    if (nlayers < 0 || T < 0) return -1;
    if (nlayers == 0 || T == 0) return 0;
    const sf_key_plan plan = {kslots, base, plen, xoff, nkeys, extras};
    const int nt = num_threads < 1 ? 1 : (int)num_threads;
    sf_attn attn;
    int rc = sf_attn_setup(&attn, T, H, KVH, D, KVH * D, &plan, scale, nt);
    if (rc) return rc;
    sf_fused *F = (sf_fused *)malloc((size_t)(nlayers * PRODUCTS) * sizeof(sf_fused));
    if (!F) {
        sf_attn_free(&attn);
        return -2;
    }
    for (int64_t l = 0; l < nlayers && !rc; l++) {
        const sfq_layer *ly = &layers[l];
        sf_fused *f = F + l * PRODUCTS;
        rc = sf_fused_setup(f, ly->qkv, ly->n_qkv, hidden, h, hidden, T, PRE_RMSNORM, ly->norm1, (float)ly->eps1, qkv,
                            qkv_width, 0);
        if (!rc) rc = sf_fused_setup(f + 1, ly->o, ly->n_o, H * D, o, H * D, T, PRE_NONE, 0, 0.0f, h, hidden, 1);
        if (!rc)
            rc = sf_fused_setup(f + 2, ly->gate_up, ly->n_gate_up, hidden, h, hidden, T, PRE_RMSNORM, ly->norm2,
                                (float)ly->eps2, gu, 2 * inter, 0);
        if (!rc)
            rc = sf_fused_setup(f + 3, ly->down, ly->n_down, inter, gu, 2 * inter, T, PRE_SILU_MUL, 0, 0.0f, h, hidden,
                                1);
    }
    if (rc) {
        free(F);
        sf_attn_free(&attn);
        return rc;
    }
    /* Scratch, one allocation: each product's activation rows, for every thread where fewer than
     * SF_QUANT_PAR_ROWS rows are prepared by each thread (sf_fused_team), else shared (the products run one after
     * another, so one set serves them all); K floats a thread for the row transforms (RMSNorm over hidden, SiLU * up
     * over inter; the o product's rows go as they are); the attention's scratch a thread. Each piece 64-byte
     * aligned. */
    const int64_t kmax = hidden > inter ? hidden : inter;
    const int shared = T >= SF_QUANT_PAR_ROWS;
    int64_t off[SF_ACT_KINDS];
    const int64_t per = sf_fused_act_layout(F, nlayers * PRODUCTS, off);
#define SF_A64(n) (((int64_t)(n) + 63) / 64 * 64)
    const int64_t buf_b = SF_A64(kmax * sizeof(float)), sc_b = SF_A64(sf_attn_sc_floats(&attn) * sizeof(float)),
                  qp_b = SF_A64(sf_attn_qp_floats(&attn) * sizeof(float)),
                  kr_b = SF_A64(sf_attn_krows(&attn) * sizeof(int64_t)), thread_b = buf_b + sc_b + qp_b + kr_b;
#undef SF_A64
    const int64_t copies = shared ? 1 : nt;
    uint8_t *mem = (uint8_t *)aligned_alloc(64, (size_t)(copies * per + nt * thread_b));
    if (!mem) {
        free(F);
        sf_attn_free(&attn);
        return -2;
    }
    for (int64_t i = 0; i < nlayers * PRODUCTS; i++)
        for (int k = 0; k < SF_ACT_KINDS; k++) F[i].act[k] = F[i].need[k] ? mem + off[k] : 0;
    sf_row_schedule();
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int tid = omp_get_thread_num();
        uint8_t *own[SF_ACT_KINDS], *mine = mem + copies * per + tid * thread_b;
        for (int k = 0; k < SF_ACT_KINDS; k++) own[k] = mem + (shared ? 0 : tid) * per + off[k];
        float *buf = (float *)mine, *sc = (float *)(mine + buf_b), *qp = (float *)(mine + buf_b + sc_b);
        int64_t *krow = (int64_t *)(mine + buf_b + sc_b + qp_b), krow_of = -1;
        for (int64_t l = 0; l < nlayers; l++) {
            const sfq_layer *ly = &layers[l];
            sf_fused *f = F + l * PRODUCTS;
            sf_fused_team(f, buf, own); /* ends at the team's barrier: qkv complete */
#pragma omp single
            specfleet_rope_kv(qkv, T, qkv_width, H, KVH, D, pos, cos_t, sin_t, q, ly->k_cache, ly->v_cache, slots);
            if (attn.par) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t t = 0; t < attn.tasks; t++)
                    sf_attn_task(&attn, t, q, ly->k_cache, ly->v_cache, o, sc, qp, krow, &krow_of);
            } else {
#pragma omp single
                for (int64_t t = 0; t < attn.tasks; t++)
                    sf_attn_task(&attn, t, q, ly->k_cache, ly->v_cache, o, sc, qp, krow, &krow_of);
            }
            sf_fused_team(f + 1, buf, own);
            sf_fused_team(f + 2, buf, own);
            sf_fused_team(f + 3, buf, own);
        }
    }
    free(mem);
    free(F);
    sf_attn_free(&attn);
    return 0;
}
