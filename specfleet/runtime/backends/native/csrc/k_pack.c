/* The K formats' interleaved order (q_common.h) from ggml's, done once when a model loads: arch-free C. */
#include "q_common.h"

/* The kernels' order from ggml's (see q_common.h and arch/x86/quants_k.c) for nblocks blocks of Q4_K (type 12) or
 * Q6_K (14), src -> dst (not overlapping); runtime/formats/qtensor.py `pack_k` is the same in numpy. Returns 0,
 * or -1 for another type. */
int specfleet_k_pack(int type, const uint8_t *src, uint8_t *dst, int64_t nblocks, int num_threads) {
    if (type != T_Q4_K && type != T_Q6_K) return -1;
    const int64_t size = type == T_Q4_K ? 144 : 210;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) if (nblocks >= 4096)
    for (int64_t i = 0; i < nblocks; i++) {
        const uint8_t *s = src + i * size;
        uint8_t *o = dst + i * size;
        uint8_t q[256], v[8][32]; /* quants in element order; the registers */
        memcpy(o, s, (size_t)size);
        if (type == T_Q4_K) {
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    q[64 * c + l] = s[16 + 32 * c + l] & 15;
                    q[64 * c + 32 + l] = s[16 + 32 * c + l] >> 4;
                }
        } else {
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t *ql = s + 64 * h, hb = s[128 + 32 * h + l];
                    q[128 * h + l] = (ql[l] & 15) | (hb & 3) << 4;
                    q[128 * h + 32 + l] = (ql[l + 32] & 15) | (hb >> 2 & 3) << 4;
                    q[128 * h + 64 + l] = (ql[l] >> 4) | (hb >> 4 & 3) << 4;
                    q[128 * h + 96 + l] = (ql[l + 32] >> 4) | (hb >> 6 & 3) << 4;
                }
        }
        for (int t = 0; t < 8; t++)
            for (int u = 0; u < 8; u++)
                for (int b = 0; b < 4; b++) v[t][4 * u + b] = q[32 * u + 4 * t + b];
        if (type == T_Q4_K) {
            for (int c = 0; c < 4; c++)
                for (int p = 0; p < 32; p++) o[16 + 32 * c + p] = (uint8_t)(v[c][p] | v[c + 4][p] << 4);
        } else {
            for (int c = 0; c < 4; c++)
                for (int p = 0; p < 32; p++) o[32 * c + p] = (uint8_t)((v[c][p] & 15) | (v[c + 4][p] & 15) << 4);
            for (int g = 0; g < 2; g++)
                for (int p = 0; p < 32; p++) {
                    uint8_t hb = 0;
                    for (int i = 0; i < 4; i++) hb |= (uint8_t)((v[4 * g + i][p] >> 4 & 3) << (2 * i));
                    o[128 + 32 * g + p] = hb;
                }
        }
    }
    return 0;
}

/* The grouped 32-weight formats' order (q_common.h: groups of eight blocks, a lane per block) from ggml's,
 * for nrows rows of nb blocks of Q4_0 (type 2), Q5_0 (6) or Q8_0 (8), src -> dst (not overlapping);
 * runtime/formats/group32_order.py is the same in numpy, and its `unpack` the way back. Returns 0, or -1
 * for another type. */
int specfleet_g32_pack(int type, const uint8_t *src, uint8_t *dst, int64_t nrows, int64_t nb, int num_threads) {
    if (!sf_is_g32(type) || nb < 0 || nrows < 0) return -1;
    const int64_t bs = sf_g32_block_bytes(type), rb = nb * bs;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) if (nrows * nb >= 4096)
    for (int64_t n = 0; n < nrows; n++) {
        for (int64_t g = 0; 8 * g < nb; g++) {
            const int nt = nb - 8 * g < 8 ? (int)(nb - 8 * g) : 8;
            const uint8_t *sg = src + n * rb + 8 * g * bs;
            uint8_t *og = dst + n * rb + 8 * g * bs;
            uint8_t q[256]; /* the group's quants in its order (Q4_0 / Q5_0: unsigned, fifth bit included) */
            for (int j = 0; j < nt; j++) {
                const uint8_t *b = sg + j * bs;
                uint8_t nat[32];
                og[2 * j] = b[0];
                og[2 * j + 1] = b[1];
                if (type == T_Q8_0) {
                    memcpy(nat, b + 2, 32);
                } else {
                    const uint8_t *qs = b + (type == T_Q5_0 ? 6 : 2);
                    for (int i = 0; i < 16; i++) {
                        nat[i] = qs[i] & 15;
                        nat[i + 16] = qs[i] >> 4;
                    }
                    if (type == T_Q5_0) {
                        const uint32_t h = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
                        for (int i = 0; i < 32; i++) nat[i] |= (uint8_t)(((h >> i) & 1) << 4);
                    }
                }
                for (int k = 0; k < 8; k++) memcpy(q + 4 * (nt * k + j), nat + 4 * k, 4);
            }
            uint8_t *p = og + 2 * nt;
            const int nq = 32 * nt;
            if (type == T_Q8_0) {
                memcpy(p, q, (size_t)nq);
                continue;
            }
            uint8_t *qs = p;
            if (type == T_Q5_0) {
                memset(p, 0, (size_t)(4 * nt));
                for (int c = 0; c < nq; c++) p[c >> 3] |= (uint8_t)(((q[c] >> 4) & 1) << (c & 7));
                qs = p + 4 * nt;
            }
            for (int c = 0; c < nq / 2; c++) qs[c] = (uint8_t)((q[c] & 15) | (q[c + nq / 2] & 15) << 4);
        }
    }
    return 0;
}
