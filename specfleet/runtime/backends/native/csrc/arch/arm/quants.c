/* The GGUF block formats on AArch64 with NEON and the dot product: the activation quantizers and the six
 * formats' column functions (Q4_0, Q4_1, Q5_0, Q8_0; Q4_K, Q6_K in the interleaved order of
 * ../../q_common.h), the generic bodies' bits (../../generic/quants.c).
 *
 * vdotq_s32 sums four int8 x int8 products into each int32 lane: for a 32-byte register of the contract
 * (eight lanes) that is two 16-byte registers, lanes 0-3 and 4-7 (for the grouped formats, blocks 0-3 and 4-7
 * of a group). The sums are exact (|q| <= 127 for the
 * activations, weight quants below 64 or Q8_0's int8), so they equal every other body's integers; the
 * fp32 epilogue per block is the generic body's, lane by lane (vfmaq_f32 for its fmaf). */
#include "arm.h"

int64_t sf_prefetch_bytes[3] = {0, 0, 0}; /* this body issues no prefetches (see arch/x86/quants_k.c) */

const char *sfq_isa_name(void) { return "neondot"; }

/* float lanes -> int8 with round half to even (vcvtnq), returns the int32 lanes' sum; quants lie in
 * [-127, 127], so the narrowing saturates nothing */
ALWAYS_INLINE int32_t quant_lanes(const float *x, int n, float id, int8_t *q) {
    const float32x4_t mul = vdupq_n_f32(id);
    int32x4_t sum = vdupq_n_s32(0);
    for (int i = 0; i < n; i += 16) {
        int32x4_t v[4];
        for (int j = 0; j < 4; j++) {
            v[j] = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(x + i + 4 * j), mul));
            sum = vaddq_s32(sum, v[j]);
        }
        const int16x8_t a = vcombine_s16(vqmovn_s32(v[0]), vqmovn_s32(v[1]));
        const int16x8_t b = vcombine_s16(vqmovn_s32(v[2]), vqmovn_s32(v[3]));
        vst1q_s8(q + i, vcombine_s8(vqmovn_s16(a), vqmovn_s16(b)));
    }
    return vaddvq_s32(sum);
}

ALWAYS_INLINE float absmax(const float *x, int n) {
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int i = 0; i < n; i += 4) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + i)));
    return vmaxvq_f32(m); /* the maximum is exact in any order */
}

/* 32 floats -> 32 int8 with scale d = amax / 127; returns the quants' sum */
ALWAYS_INLINE int32_t quant32(const float *x, int8_t *q, float *d) {
    const float mx = absmax(x, 32);
    *d = mx / 127.0f;
    return quant_lanes(x, 32, mx > 0.0f ? 127.0f / mx : 0.0f, q);
}

void sfq_quantize_row32(const float *x, int64_t K, xq32 *out) {
    for (int64_t b = 0; b < K / 32; b++) out[b].sum = quant32(x + 32 * b, out[b].q, &out[b].d);
}

SF_DEFINE_QUANTIZE_ROW32G(quant32)

void sfq_quantize_row256(const float *x, int64_t K, xq256 *out) {
    for (int64_t b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        const float mx = absmax(xb, 256);
        const float id = mx > 0.0f ? 127.0f / mx : 0.0f;
        out[b].d = mx / 127.0f;
        int8_t nat[256]; /* the block's quants in element order */
        for (int s = 0; s < 16; s++) out[b].bsum[s] = (int16_t)quant_lanes(xb + 16 * s, 16, id, nat + 16 * s);
        for (int u = 0; u < 8; u++) out[b].fsum[u] = (float)(out[b].bsum[2 * u] + out[b].bsum[2 * u + 1]);
        /* the interleaved order: register t, dword u <- element dword 8u + t (an 8 x 8 dword transpose) */
        const int32_t *src = (const int32_t *)nat;
        int32_t *dst = (int32_t *)out[b].q;
        for (int t = 0; t < 8; t++)
            for (int u = 0; u < 8; u++) dst[8 * t + u] = src[8 * u + t];
    }
}

/* Q5_0's fifth bits of weights 16h..16h+15 (h = 0, 1) as 0x10 per byte, from qh bytes 2h, 2h + 1 */
ALWAYS_INLINE uint8x16_t fifth_bits(const uint8_t *qh, int h) {
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t v = vcombine_u8(vdup_n_u8(qh[2 * h]), vdup_n_u8(qh[2 * h + 1]));
    return vandq_u8(vtstq_u8(v, vld1q_u8(bit)), vdupq_n_u8(0x10));
}

/* Q4_1 (the one 32-weight format kept in the file's order) against R activation rows: w0 (weights 0-15) and
 * w1 (16-31) */
ALWAYS_INLINE void dot_q4_1(const uint8_t *wrow, int64_t nb, const xq32 *const *x, int R, float *out) {
    float32x4_t lo[TILE], hi[TILE];
    float cacc[TILE];
    for (int r = 0; r < R; r++) {
        lo[r] = hi[r] = vdupq_n_f32(0.0f);
        cacc[r] = 0.0f;
    }
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const b_q4_1 *w = (const b_q4_1 *)(wrow + b * (int64_t)sizeof(b_q4_1));
        stream_ahead(w, sizeof(b_q4_1));
        const uint8x16_t v = vld1q_u8(w->qs);
        const int8x16_t w0 = vreinterpretq_s8_u8(vandq_u8(v, m4)), w1 = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        const float d = h2f(w->d), m = h2f(w->m);
        for (int r = 0; r < R; r++) {
            const xq32 *xb = &x[r][b];
            const int32x4_t p0 = vdotq_s32(vdupq_n_s32(0), w0, vld1q_s8(xb->q));
            const int32x4_t p1 = vdotq_s32(vdupq_n_s32(0), w1, vld1q_s8(xb->q + 16));
            const float32x4_t s = vdupq_n_f32(d * xb->d);
            lo[r] = vfmaq_f32(lo[r], s, vcvtq_f32_s32(p0));
            hi[r] = vfmaq_f32(hi[r], s, vcvtq_f32_s32(p1));
            cacc[r] += m * (xb->d * (float)xb->sum);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(lo[r], hi[r]) + cacc[r];
}


/* ---- The grouped formats Q4_0, Q5_0, Q8_0 (../../q_common.h): byte c = 4 (nt k + j) + t of a group is weight
 * 4k + t of block j, so in a full group the 16-byte chunk 2k holds blocks 0-3 and chunk 2k + 1 blocks 4-7
 * (lanes lo and hi of the contract), and in a group of four chunk k holds blocks 0-3. vdotq_s32 adds the
 * chunks lane by lane into the blocks' totals; one fp32 epilogue per four blocks. ---- */

/* 16-byte chunk i of a group's quants (nt blocks; 2 * nt chunks), offsets not applied */
ALWAYS_INLINE int8x16_t g32_chunk(int type, const uint8_t *grp, int nt, int i) {
    const uint8_t *p = grp + 2 * nt;
    if (type == T_Q8_0) return vld1q_s8((const int8_t *)p + 16 * i);
    const uint8_t *qs = type == T_Q5_0 ? p + 4 * nt : p;
    const uint8x16_t v = vld1q_u8(qs + 16 * (i % nt)); /* qs[n]: byte n low, byte n + 16 nt high */
    uint8x16_t u = i < nt ? vandq_u8(v, vdupq_n_u8(0x0f)) : vshrq_n_u8(v, 4);
    if (type == T_Q5_0) u = vorrq_u8(u, fifth_bits(p, i)); /* bits 16i..16i+15: qh bytes 2i, 2i + 1 */
    return vreinterpretq_s8_u8(u);
}

/* four blocks' epilogue: lanes P (totals), scales at dw (4 halves), activation scales and sums at xd, xs */
ALWAYS_INLINE float32x4_t g32_acc4(int type, int32x4_t P, const uint8_t *dw, const float *xd, const int32_t *xs,
                                   float32x4_t acc) {
    const int32_t off = sf_g32_offset(type);
    if (off) P = vsubq_s32(P, vmulq_n_s32(vld1q_s32(xs), off));
    const float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(dw)));
    return vfmaq_f32(acc, vmulq_f32(d, vld1q_f32(xd)), vcvtq_f32_s32(P));
}

ALWAYS_INLINE void dot_g32(int type, const uint8_t *wrow, int64_t nb, const xq32g *const *x, int R, float *out) {
    float32x4_t lo[TILE], hi[TILE];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = vdupq_n_f32(0.0f);
    const int64_t gbytes = 8 * sf_g32_block_bytes(type), ng = nb / 8;
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *grp = wrow + g * gbytes;
        stream_ahead(grp, gbytes);
        int8x16_t w[16];
        for (int i = 0; i < 16; i++) w[i] = g32_chunk(type, grp, 8, i);
        for (int r = 0; r < R; r++) {
            const xq32g *xg = x[r] + g;
            int32x4_t pl = vdupq_n_s32(0), ph = vdupq_n_s32(0);
            for (int k = 0; k < 8; k++) {
                pl = vdotq_s32(pl, w[2 * k], vld1q_s8(xg->q + 32 * k));
                ph = vdotq_s32(ph, w[2 * k + 1], vld1q_s8(xg->q + 32 * k + 16));
            }
            lo[r] = g32_acc4(type, pl, grp, xg->d, xg->sum, lo[r]);
            hi[r] = g32_acc4(type, ph, grp + 8, xg->d + 4, xg->sum + 4, hi[r]);
        }
    }
    const int nt = (int)(nb - 8 * ng);
    const uint8_t *grp = wrow + ng * gbytes;
    if (nt == 4) {
        int8x16_t w[8];
        for (int i = 0; i < 8; i++) w[i] = g32_chunk(type, grp, 4, i);
        for (int r = 0; r < R; r++) {
            const xq32g *xg = x[r] + ng;
            int32x4_t p = vdupq_n_s32(0);
            for (int k = 0; k < 8; k++) p = vdotq_s32(p, w[k], vld1q_s8(xg->q + 16 * k));
            lo[r] = g32_acc4(type, p, grp, xg->d, xg->sum, lo[r]);
        }
    } else if (nt) {
        float a[TILE][8];
        const xq32g *xg[TILE];
        for (int r = 0; r < R; r++) {
            vst1q_f32(a[r], lo[r]);
            vst1q_f32(a[r] + 4, hi[r]);
            xg[r] = x[r] + ng;
        }
        sf_g32_group(type, grp, nt, xg, R, a);
        for (int r = 0; r < R; r++) {
            lo[r] = vld1q_f32(a[r]);
            hi[r] = vld1q_f32(a[r] + 4);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(lo[r], hi[r]);
}
ALWAYS_INLINE void dot_q4_0(const uint8_t *w, int64_t nb, const xq32g *const *x, int R, float *out) { dot_g32(T_Q4_0, w, nb, x, R, out); }
ALWAYS_INLINE void dot_q5_0(const uint8_t *w, int64_t nb, const xq32g *const *x, int R, float *out) { dot_g32(T_Q5_0, w, nb, x, R, out); }
ALWAYS_INLINE void dot_q8_0(const uint8_t *w, int64_t nb, const xq32g *const *x, int R, float *out) { dot_g32(T_Q8_0, w, nb, x, R, out); }

ALWAYS_INLINE void dot_q4_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    float32x4_t lo[TILE], hi[TILE];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = vdupq_n_f32(0.0f);
    const b_q4_k *w = (const b_q4_k *)wrow;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q4_k));
        const uint8_t *s = w[b].scales;
        float fd[8], fm[8];
        const float d = h2f(w[b].d), dmin = h2f(w[b].dmin);
        for (int j = 0; j < 4; j++) {
            fd[j] = d * (float)(s[j] & 63);
            fm[j] = dmin * (float)(s[j + 4] & 63);
            fd[j + 4] = d * (float)((s[j + 8] & 15) | (s[j] >> 6) << 4);
            fm[j + 4] = dmin * (float)((s[j + 8] >> 4) | (s[j + 4] >> 6) << 4);
        }
        int8x16_t q[8][2];
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) {
                const uint8x16_t v = vld1q_u8(w[b].qs + 32 * c + 16 * h);
                q[c][h] = vreinterpretq_s8_u8(vandq_u8(v, m4));
                q[c + 4][h] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
            }
        const float32x4_t fd0 = vld1q_f32(fd), fd1 = vld1q_f32(fd + 4), fm0 = vld1q_f32(fm), fm1 = vld1q_f32(fm + 4);
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            int32x4_t t0 = vdupq_n_s32(0), t1 = vdupq_n_s32(0);
            for (int t = 0; t < 8; t++) {
                t0 = vdotq_s32(t0, q[t][0], vld1q_s8(xb->q + 32 * t));
                t1 = vdotq_s32(t1, q[t][1], vld1q_s8(xb->q + 32 * t + 16));
            }
            const float32x4_t v0 = vfmsq_f32(vmulq_f32(vcvtq_f32_s32(t0), fd0), fm0, vld1q_f32(xb->fsum));
            const float32x4_t v1 = vfmsq_f32(vmulq_f32(vcvtq_f32_s32(t1), fd1), fm1, vld1q_f32(xb->fsum + 4));
            const float32x4_t xd = vdupq_n_f32(xb->d);
            lo[r] = vfmaq_f32(lo[r], xd, v0);
            hi[r] = vfmaq_f32(hi[r], xd, v1);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(lo[r], hi[r]);
}

/* Q6_K: registers 0-3 hold the first 16 weights of each sub-block (scale 2u), 4-7 the last 16 (2u + 1) */
ALWAYS_INLINE void dot_q6_k(const uint8_t *wrow, int64_t nb, const xq256 *const *x, int R, float *out) {
    float32x4_t lo[TILE], hi[TILE];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = vdupq_n_f32(0.0f);
    const b_q6_k *w = (const b_q6_k *)wrow;
    const uint8x16_t m4 = vdupq_n_u8(0x0f), m3 = vdupq_n_u8(0x03);
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(&w[b], sizeof(b_q6_k));
        const int8_t *sc = w[b].scales;
        const float d = h2f(w[b].d);
        int8x16_t q[8][2];
        for (int t = 0; t < 8; t++)
            for (int h = 0; h < 2; h++) {
                const uint8x16_t l = vld1q_u8(w[b].ql + 32 * (t & 3) + 16 * h);
                const uint8x16_t hb = vld1q_u8(w[b].qh + 32 * (t >> 2) + 16 * h);
                const uint8x16_t low = t < 4 ? vandq_u8(l, m4) : vshrq_n_u8(l, 4);
                uint8x16_t top;
                switch (t & 3) {
                case 0: top = vandq_u8(hb, m3); break;
                case 1: top = vandq_u8(vshrq_n_u8(hb, 2), m3); break;
                case 2: top = vandq_u8(vshrq_n_u8(hb, 4), m3); break;
                default: top = vshrq_n_u8(hb, 6); break;
                }
                q[t][h] = vreinterpretq_s8_u8(vorrq_u8(low, vshlq_n_u8(top, 4)));
            }
        int32_t se[8], so[8];
        for (int u = 0; u < 8; u++) {
            se[u] = sc[2 * u];
            so[u] = sc[2 * u + 1];
        }
        const int32x4_t se0 = vld1q_s32(se), se1 = vld1q_s32(se + 4), so0 = vld1q_s32(so), so1 = vld1q_s32(so + 4);
        for (int r = 0; r < R; r++) {
            const xq256 *xb = &x[r][b];
            int32x4_t f0 = vdupq_n_s32(0), f1 = vdupq_n_s32(0), l0 = vdupq_n_s32(0), l1 = vdupq_n_s32(0);
            for (int t = 0; t < 4; t++) {
                f0 = vdotq_s32(f0, q[t][0], vld1q_s8(xb->q + 32 * t));
                f1 = vdotq_s32(f1, q[t][1], vld1q_s8(xb->q + 32 * t + 16));
                l0 = vdotq_s32(l0, q[t + 4][0], vld1q_s8(xb->q + 128 + 32 * t));
                l1 = vdotq_s32(l1, q[t + 4][1], vld1q_s8(xb->q + 128 + 32 * t + 16));
            }
            /* bsum pairs (2u, 2u + 1) split into even and odd */
            const int16x8x2_t bs = vld2q_s16(xb->bsum);
            const int32x4_t be0 = vmovl_s16(vget_low_s16(bs.val[0])), be1 = vmovl_s16(vget_high_s16(bs.val[0]));
            const int32x4_t bo0 = vmovl_s16(vget_low_s16(bs.val[1])), bo1 = vmovl_s16(vget_high_s16(bs.val[1]));
            const int32x4_t off0 = vaddq_s32(vmulq_s32(se0, be0), vmulq_s32(so0, bo0));
            const int32x4_t off1 = vaddq_s32(vmulq_s32(se1, be1), vmulq_s32(so1, bo1));
            const int32x4_t p0 = vsubq_s32(vaddq_s32(vmulq_s32(f0, se0), vmulq_s32(l0, so0)), vshlq_n_s32(off0, 5));
            const int32x4_t p1 = vsubq_s32(vaddq_s32(vmulq_s32(f1, se1), vmulq_s32(l1, so1)), vshlq_n_s32(off1, 5));
            const float32x4_t s = vdupq_n_f32(d * xb->d);
            lo[r] = vfmaq_f32(lo[r], s, vcvtq_f32_s32(p0));
            hi[r] = vfmaq_f32(hi[r], s, vcvtq_f32_s32(p1));
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(lo[r], hi[r]);
}

SF_COLUMNS_FROM_DOTS
