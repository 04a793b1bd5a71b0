/* Attention and rotary for specfleet's native models: the arch-free drivers. specfleet_rope_kv rotates
 * q and k of the fused q/k/v output and writes k and v to their KV cache slots; specfleet_attend (and the
 * layer loop, layers.c) attends query rows, each over the cached keys a key plan gives it (a prefix of its
 * request's rows, or a tree row's context and ancestors), one (group of rows, KV head) per task with no
 * mask. The per-head arithmetic is the bodies' (sfq_rope_head, sfq_attend_group; q_common.h).
 *
 * Batch invariance: attention is per (row, head), its keys exactly the row's own, read in its own order
 * wherever they sit: a verification row (chain or tree) or a prompt row computes bit for bit what the
 * decode step of that token computes. */
#include <omp.h>
#include <stdlib.h>

#include "q_common.h"

#ifndef ATTEND_PAR_WORK
#define ATTEND_PAR_WORK (1 << 16) /* multiply-adds from which attention forks threads (about 43 keys of the
                                     * 1.5B: bench_attention.py has two threads faster from 64 keys on) */
#endif


/* qkv [T, ldqkv] rows of q (H heads) | k (KVH heads) | v (KVH heads), head size D; cos/sin [*, D] tables
 * indexed by pos[t]. Writes rotated q to q_out [T, H, D], rotated k and v to rows slots[t] of the caches
 * [*, KVH, D]. */
void specfleet_rope_kv(const float *qkv, int64_t T, int64_t ldqkv, int64_t H, int64_t KVH, int64_t D,
                       const int64_t *pos, const float *cos_t, const float *sin_t, float *q_out, float *k_cache,
                       float *v_cache, const int64_t *slots) {
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * ldqkv, *c = cos_t + pos[t] * D, *s = sin_t + pos[t] * D;
        for (int64_t h = 0; h < H; h++) sfq_rope_head(row + h * D, c, s, D, q_out + (t * H + h) * D);
        float *kd = k_cache + slots[t] * KVH * D, *vd = v_cache + slots[t] * KVH * D;
        for (int64_t h = 0; h < KVH; h++) sfq_rope_head(row + (H + h) * D, c, s, D, kd + h * D);
        memcpy(vd, row + (H + KVH) * D, (size_t)(KVH * D) * sizeof(float));
    }
}

/* Set up the attention of rows of q [n, H, D] to the keys the plan gives each (what q_common.h's sf_attn holds):
 * consecutive rows of one request that see a prefix of its keys (decode rows, a chain's rows, a prompt chunk's rows;
 * not tree rows with gathered keys) go together, up to MAX_GROUP, sharing their key loads (attend_group); a task is
 * one group and one KV head, whole on one thread. Layer-free: the layer loop sets it up once for every layer.
 * Returns 0, -1 for bad arguments, -2 when memory could not be allocated; sf_attn_free frees it. */
int sf_attn_setup(sf_attn *a, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t ldk, const sf_key_plan *plan,
                  float scale, int64_t num_threads) {
    a->gstart = 0;
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
    const int64_t G = H / KVH;
    *a = (sf_attn){.plan = plan, .n = n, .H = H, .KVH = KVH, .D = D, .ldk = ldk, .scale = scale, .gstart = gstart,
                   .tasks = ngroups * KVH, .l8 = (lmax + 7) / 8 * 8, .G = G, .G2 = (G + 1) / 2 * 2};
    a->par = num_threads > 1 && work >= ATTEND_PAR_WORK && a->tasks > 1;
    return 0;
}

void sf_attn_free(sf_attn *a) {
    free(a->gstart);
    a->gstart = 0;
}

/* Floats of a thread's score and query scratch (sf_attn_task's sc and qp), and int64s of its key rows (krow) */
int64_t sf_attn_sc_floats(const sf_attn *a) { return MAX_GROUP * a->G * a->l8; }
int64_t sf_attn_qp_floats(const sf_attn *a) { return MAX_GROUP * a->G2 * a->D; }
int64_t sf_attn_krows(const sf_attn *a) { return a->l8; }

/* Task t of the attention of q over the cache k, v into out (q_common.h says what the scratch is); *krow_of: the
 * group whose key rows krow holds (-1: none), which holds for every layer of one set-up. */
void sf_attn_task(const sf_attn *a, int64_t t, const float *q, const float *k, const float *v, float *out, float *sc,
                  float *qp, int64_t *krow, int64_t *krow_of) {
    const sf_key_plan *plan = a->plan;
    const int64_t H = a->H, KVH = a->KVH, D = a->D, G = a->G;
    const int64_t gi = t / KVH, g = t % KVH, i0 = a->gstart[gi], m = a->gstart[gi + 1] - i0;
    int64_t L = 0;
    for (int64_t r = 0; r < m; r++) L = plan->nkeys[i0 + r] > L ? plan->nkeys[i0 + r] : L;
    if (*krow_of != gi) {
        /* a group's rows see a prefix of the layout (all of the longest row's L keys); a lone row may also have
         * gathered keys past its prefix */
        const int64_t p = plan->plen[i0] == plan->nkeys[i0] ? L : plan->plen[i0];
        const int64_t *sl = plan->slots + plan->base[i0], *x = plan->extras + plan->xoff[i0] - p;
        for (int64_t j = 0; j < L; j++) krow[j] = sl[j < p ? j : x[j]];
        *krow_of = gi;
    }
    sfq_attend_group(q + (i0 * H + g * G) * D, H * D, m, G, k + g * D, v + g * D, a->ldk, krow, plan->nkeys + i0, D,
                     a->scale, sc, (L + 7) / 8 * 8, qp, out + (i0 * H + g * G) * D);
}

/* Rows of q [n, H, D] attending, unmasked, to the keys the plan gives each; out [n, H, D] (sf_attn_setup says how
 * the work is split). */
int sf_attend_rows(const float *q, int64_t n, int64_t H, int64_t KVH, int64_t D, const float *k, const float *v,
                   int64_t ldk, const sf_key_plan *plan, float scale, float *out, int64_t num_threads) {
    sf_attn a;
    const int rc = sf_attn_setup(&a, n, H, KVH, D, ldk, plan, scale, num_threads);
    if (rc) return rc;
    const int nt = num_threads < 1 ? 1 : (int)num_threads;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (a.par)
    {
        float *sc = (float *)malloc((size_t)sf_attn_sc_floats(&a) * sizeof(float));
        float *qp = (float *)aligned_alloc(64, (size_t)sf_attn_qp_floats(&a) * sizeof(float));
        int64_t *krow = (int64_t *)malloc((size_t)sf_attn_krows(&a) * sizeof(int64_t));
        int64_t krow_of = -1;
        if (!sc || !krow || !qp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < a.tasks; t++)
            if (sc && krow && qp) sf_attn_task(&a, t, q, k, v, out, sc, qp, krow, &krow_of);
        free(sc);
        free(qp);
        free(krow);
    }
    sf_attn_free(&a);
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
    return sf_attend_rows(q, n, H, KVH, D, k, v, ldk, &plan, scale, out, num_threads);
}
