/* The layer loop of specfleet's native models: every decoder layer of a step in one call (arch-free; the
 * products, attention and rotary are fused_linear.c's and attention.c's). */
#include "q_common.h"

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
        rc = sf_attend_rows(q, T, H, KVH, D, ly->k_cache, ly->v_cache, KVH * D, &plan, scale, o, num_threads);
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
