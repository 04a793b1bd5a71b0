/* The GGUF block formats in plain C (any compiler, no intrinsics): the activation quantizers and the six
 * formats' column functions, the reference bodies of q_common.h's contract. Every other body (arch/x86/,
 * arch/arm/) gives these bits: the integer sums are exact whatever sums them, grouped in the same eight
 * lanes, and the fp32 steps after them are the same operations in the same order (one fmaf where a
 * body fuses a multiply-add; built with -ffp-contract=off so nothing else is fused).
 *
 * Lanes: Q4_1's lane j holds weights 4j..4j+3 of a block; the K formats' lane u holds sub-block u (32
 * weights); per block acc[j] = fmaf(d_w * d_x, (float)lane[j], acc[j]). The grouped formats (Q4_0, Q5_0,
 * Q8_0) sum a block whole (its offset times the activation sum taken off) into lane b % 8
 * (q_common.h's sf_g32_group). A row ends with sf_hsum8. */
#include "../q_common.h"

int64_t sf_prefetch_bytes[3] = {0, 0, 0}; /* these bodies issue no prefetches (see arch/x86/quants_k.c) */

const char *sfq_isa_name(void) { return "generic"; }

/* 32 floats -> 32 int8 (round half to even) with scale d = amax / 127; returns the quants' sum */
static int32_t quant32(const float *x, int8_t *q, float *d_out) {
    float mx = 0.0f;
    for (int i = 0; i < 32; i++) {
        const float a = fabsf(x[i]);
        mx = mx > a ? mx : a;
    }
    const float d = mx / 127.0f;
    const float id = mx > 0.0f ? 127.0f / mx : 0.0f;
    *d_out = d;
    int32_t sum = 0;
    for (int i = 0; i < 32; i++) {
        const int32_t v = sf_round_i32(x[i] * id);
        sum += v;
        q[i] = sf_sat8(v);
    }
    return sum;
}

void sfq_quantize_row32(const float *x, int64_t K, xq32 *out) {
    for (int64_t b = 0; b < K / 32; b++) out[b].sum = quant32(x + 32 * b, out[b].q, &out[b].d);
}

SF_DEFINE_QUANTIZE_ROW32G(quant32)

void sfq_quantize_row256(const float *x, int64_t K, xq256 *out) {
    for (int64_t b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        float mx = 0.0f;
        for (int i = 0; i < 256; i++) {
            const float a = fabsf(xb[i]);
            mx = mx > a ? mx : a;
        }
        const float mul = mx > 0.0f ? 127.0f / mx : 0.0f;
        out[b].d = mx / 127.0f;
        int8_t nat[256]; /* the block's quants in element order */
        for (int i = 0; i < 256; i++) nat[i] = sf_sat8(sf_round_i32(xb[i] * mul));
        sf_xq256_from_quants(&out[b], nat);
    }
}

/* lane j of a 32-weight block: sum of q[4j..4j+3] * x[4j..4j+3] */
static inline void lanes32(const int8_t *q, const int8_t *x, int32_t *p) {
    for (int j = 0; j < 8; j++) {
        int32_t s = 0;
        for (int b = 0; b < 4; b++) s += (int32_t)q[4 * j + b] * (int32_t)x[4 * j + b];
        p[j] = s;
    }
}

/* Q4_1 (the one 32-weight format kept in the file's order) against R activation rows: per block the eight
 * lanes scaled by d_w * d_x, and the m term m * d_x * sum beside them */
static inline void dot_q4_1(const uint8_t *wrow, int64_t nb, const xq32 *const *x, int R, float *out) {
    float acc[TILE][8], cacc[TILE];
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < 8; j++) acc[r][j] = 0.0f;
        cacc[r] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        const b_q4_1 *w = (const b_q4_1 *)(wrow + b * (int64_t)sizeof(b_q4_1));
        int8_t q[32];
        for (int i = 0; i < 16; i++) {
            q[i] = (int8_t)(w->qs[i] & 15);
            q[i + 16] = (int8_t)(w->qs[i] >> 4);
        }
        const float d = sf_half_to_float(w->d), m = sf_half_to_float(w->m);
        for (int r = 0; r < R; r++) {
            const xq32 *xb = &x[r][b];
            int32_t p[8];
            lanes32(q, xb->q, p);
            const float s = d * xb->d;
            for (int j = 0; j < 8; j++) acc[r][j] = fmaf(s, (float)p[j], acc[r][j]);
            cacc[r] += m * (xb->d * (float)xb->sum);
        }
    }
    for (int r = 0; r < R; r++) out[r] = sf_hsum8(acc[r]) + cacc[r];
}

/* one weight row of a grouped format (q_common.h) against R activation rows: the contract, group by group */
static inline void dot_g32(int type, const uint8_t *wrow, int64_t nb, const xq32g *const *x, int R, float *out) {
    float acc[TILE][8];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 8; j++) acc[r][j] = 0.0f;
    const int64_t gbytes = 8 * sf_g32_block_bytes(type);
    for (int64_t g = 0; 8 * g < nb; g++) {
        const int nt = nb - 8 * g < 8 ? (int)(nb - 8 * g) : 8;
        const xq32g *xg[TILE];
        for (int r = 0; r < R; r++) xg[r] = x[r] + g;
        sf_g32_group(type, wrow + g * gbytes, nt, xg, R, acc);
    }
    for (int r = 0; r < R; r++) out[r] = sf_hsum8(acc[r]);
}

static inline void dot_q4_0(const uint8_t *w, int64_t nb, const xq32g *const *x, int R, float *out) {
    dot_g32(T_Q4_0, w, nb, x, R, out);
}
static inline void dot_q5_0(const uint8_t *w, int64_t nb, const xq32g *const *x, int R, float *out) {
    dot_g32(T_Q5_0, w, nb, x, R, out);
}
static inline void dot_q8_0(const uint8_t *w, int64_t nb, const xq32g *const *x, int R, float *out) {
    dot_g32(T_Q8_0, w, nb, x, R, out);
}

/* the sub-block totals of a K block: lane u = sum over registers t in [t0, t1) of bytes 4u..4u+3 of
 * register t, weight quants (wq, 256 bytes in the interleaved order) times activation quants */
static inline void lanes256(const uint8_t *wq, const int8_t *xq, int t0, int t1, int32_t *p) {
    for (int u = 0; u < 8; u++) {
        int32_t s = 0;
        for (int t = t0; t < t1; t++)
            for (int b = 0; b < 4; b++) s += (int32_t)wq[32 * t + 4 * u + b] * (int32_t)xq[32 * t + 4 * u + b];
        p[u] = s;
    }
}

static inline void dot_q4_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    float acc[TILE][8];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 8; j++) acc[r][j] = 0.0f;
    const b_q4_k *w = (const b_q4_k *)wrow;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *s = w[b].scales;
        float fd[8], fm[8];
        const float d = sf_half_to_float(w[b].d), dmin = sf_half_to_float(w[b].dmin);
        for (int j = 0; j < 4; j++) {
            fd[j] = d * (float)(s[j] & 63);
            fm[j] = dmin * (float)(s[j + 4] & 63);
            fd[j + 4] = d * (float)((s[j + 8] & 15) | (s[j] >> 6) << 4);
            fm[j + 4] = dmin * (float)((s[j + 8] >> 4) | (s[j + 4] >> 6) << 4);
        }
        uint8_t wq[256];
        for (int c = 0; c < 4; c++)
            for (int p = 0; p < 32; p++) {
                wq[32 * c + p] = w[b].qs[32 * c + p] & 15;
                wq[32 * (c + 4) + p] = w[b].qs[32 * c + p] >> 4;
            }
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            int32_t tot[8];
            lanes256(wq, xb->q, 0, 8, tot);
            for (int u = 0; u < 8; u++) {
                const float v = fmaf(-fm[u], xb->fsum[u], (float)tot[u] * fd[u]);
                acc[r][u] = fmaf(xb->d, v, acc[r][u]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = sf_hsum8(acc[r]);
}

static inline void dot_q6_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    float acc[TILE][8];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 8; j++) acc[r][j] = 0.0f;
    const b_q6_k *w = (const b_q6_k *)wrow;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *sc = w[b].scales;
        const float d = sf_half_to_float(w[b].d);
        uint8_t wq[256];
        for (int t = 0; t < 8; t++)
            for (int p = 0; p < 32; p++) {
                const uint8_t l = w[b].ql[32 * (t & 3) + p];
                const uint8_t top = (w[b].qh[32 * (t >> 2) + p] >> (2 * (t & 3))) & 3;
                wq[32 * t + p] = (uint8_t)((t < 4 ? l & 15 : l >> 4) | top << 4);
            }
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            int32_t f[8], l[8];
            lanes256(wq, xb->q, 0, 4, f);
            lanes256(wq, xb->q, 4, 8, l);
            const float s = d * xb->d;
            for (int u = 0; u < 8; u++) {
                const int32_t isum = f[u] * sc[2 * u] + l[u] * sc[2 * u + 1];
                const int32_t off = sc[2 * u] * xb->bsum[2 * u] + sc[2 * u + 1] * xb->bsum[2 * u + 1];
                acc[r][u] = fmaf(s, (float)(isum - off * 32), acc[r][u]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = sf_hsum8(acc[r]);
}

SF_COLUMNS_FROM_DOTS
