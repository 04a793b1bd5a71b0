/* Q4_K products over many activation rows (a prompt) on AMX's int8 tile unit: the "amx" path, included by
 * quants_k.c after the 512-bit VNNI kernels it falls back to. Fewer than AMX_MIN_ROWS activation rows (decode,
 * verification), the weight rows past the last group of 16, and a process the OS refuses the tile state go through
 * the VNNI kernels. Every row gets the VNNI kernels' bits either way:
 *
 * TDPBSSD multiplies A (16 rows x 32 int8) by B (32 x 16) into C (16 x 16 int32). A holds one sub-block (32
 * weights) of 16 weight rows, B the same sub-block of 16 activation rows, so C holds exactly the int32 sub-block
 * totals the VNNI kernels fold into their lanes (integer sums are exact in any order); the fp32 epilogue then runs
 * q4k_block_acc's instructions on each (weight row, sub-block) with the 16 activation rows in the lanes, and the
 * last sum over the 8 sub-blocks follows hsum8's tree. For A, a block's quants are unpacked as the VNNI kernels
 * unpack them (the interleaved order, q_common.h) and their dwords transposed to sub-block order; for B, each
 * thread lays a call's activation rows out once (16 rows' dwords side by side) and keeps that for the call's
 * other weight rows (amx_layout).
 *
 * Why not for verification rows: a first version put the activation rows in B block-diagonally (two rows per
 * tile, 8 sub-blocks in the columns) and ran 1.6-1.9x slower than the VNNI kernels at 2-12 rows. A tile load of
 * 1 KB takes ~8 cycles and the unpack into memory ~12 cycles a block and row, where a VNNI row costs ~3 cycles a
 * block (benchmarks/RESULTS.md, session 43). The tile unit pays where 16 activation rows share each tile. */
#include <stdlib.h>

#define AMX_ROWS 16     /* weight rows per A tile, activation rows per B tile */
#define AMX_PASSES 4    /* activation tiles per call (SF_XCHUNK = 64 rows) */
#define AMX_MIN_ROWS 32 /* fewer activation rows go through the VNNI kernels (at 16 the two ran level) */

/* The OS must grant a process the tile state (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) before its
 * first tile instruction: 1 when it did, 0 when it refused (then the VNNI kernels run everything). Asked once. */
static int amx_state = -1;
static int amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        long ret; /* arch_prctl (158), ARCH_REQ_XCOMP_PERM (0x1023), XFEATURE_XTILEDATA (18): a raw syscall */
        __asm__ volatile("syscall" : "=a"(ret) : "a"(158L), "D"(0x1023L), "S"(18L) : "rcx", "r11", "memory");
        s = ret == 0;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* tile 0: A (16 weight rows x 32 quants), tile 1: B (8 rows of 16 activation rows' dwords), tiles 2..5: C */
static void amx_configure(void) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.colsb[0] = 32;
    c.rows[0] = 16;
    c.colsb[1] = 64;
    c.rows[1] = 8;
    for (int t = 2; t < 6; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* A call's activation rows laid out for B, per thread: tile (pass q, block b, sub-block u) is 8 rows (4 quants
 * each of the sub-block) x 16 activation rows; per (q, b) the rows' fsum by sub-block and their d, 16 lanes each
 * (zeros for rows past the call's last). The drivers hand a thread weight rows 64 at a time (SF_RCH), and laying
 * out 64 activation rows again for each took as long as a fifth of the products (the 1.5B's ffn_gate, 64 rows, one
 * thread: 192 against 162 TSC cycles a weight-row block). So a thread keeps each 64-row chunk's layout in a slot
 * ((m0 / 64) % AMX_SLOTS: a step's 512 prompt rows fill eight) for the rest of the call (its epoch, q_common.h). */
#define AMX_SLOTS 8
typedef struct {
    size_t cap;
    int8_t *mem;
    const uint8_t *a; /* the key: rows [m0, m0 + R) of `a` in the call of `epoch`; epoch 0 never matches */
    int64_t epoch, m0;
    int R;
} amx_buf;
static _Thread_local amx_buf amx_slots[AMX_SLOTS];

ALWAYS_INLINE int8_t *amx_b_tile(int8_t *base, int64_t nb, int q, int64_t b, int u) {
    return base + (((size_t)q * nb + b) * 8 + u) * 512;
}
ALWAYS_INLINE float *amx_b_fsum(float *base, int64_t nb, int q, int64_t b) { return base + ((size_t)q * nb + b) * 144; }

/* 16 Q4_K weight rows (w, row_bytes apart) against Q activation tiles: out[q][n] = 16 lanes, activation rows.
 * Blocks go AMX_CHUNK at a time: their tile products first, then the epilogue weight row by weight row with its
 * 8 sub-block accumulators in registers over the chunk (the same operations in the same order as block by block
 * with the accumulators in memory, which loaded and stored them once a block): 1.03-1.07x at 2 blocks (one thread,
 * the 1.5B's shapes, 33-64 rows); 3 or 4 blocks ran 17-33 % slower than block by block, for reasons not found) */
#define AMX_CHUNK 2
static void amx_q4_k_group(const uint8_t *w, int64_t row_bytes, int64_t nb, int8_t *bt, float *bf, int Q,
                           __m512 out[AMX_PASSES][AMX_ROWS]) {
    _Alignas(64) static _Thread_local int8_t A[AMX_CHUNK][AMX_ROWS][256];
    _Alignas(64) static _Thread_local int32_t C[AMX_CHUNK][8][AMX_ROWS][16];
    _Alignas(64) static _Thread_local float fd[AMX_CHUNK][AMX_ROWS][8], fm[AMX_CHUNK][AMX_ROWS][8];
    static _Thread_local __m512 acc[AMX_PASSES][AMX_ROWS][8]; /* 32 KB: per thread, not on the stack */
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    /* sub-block order from the unpacked registers Z0..Z3 (lane l of Zj: register 2j + l / 8, dword l % 8 = sub-block):
     * output k, lane l = register t = l % 8 of sub-block 2k + l / 8, from Z0|Z1 (t < 4) or Z2|Z3 (t >= 4) */
    __m512i lo_idx[4], hi_idx[4];
    for (int k = 0; k < 4; k++) {
        int32_t li[16], hi[16];
        for (int l = 0; l < 16; l++) {
            const int t = l & 7, u = 2 * k + (l >> 3);
            li[l] = ((t >> 1) & 1) * 16 + (t & 1) * 8 + u;
            hi[l] = (((t - 4) >> 1) & 1) * 16 + (t & 1) * 8 + u;
        }
        lo_idx[k] = _mm512_loadu_si512(li);
        hi_idx[k] = _mm512_loadu_si512(hi);
    }
    for (int64_t b0 = 0; b0 < nb; b0 += AMX_CHUNK) {
        const int nc = nb - b0 < AMX_CHUNK ? (int)(nb - b0) : AMX_CHUNK;
        for (int c = 0; c < nc; c++) {
            const int64_t b = b0 + c;
            for (int n = 0; n < AMX_ROWS; n += 4) {
                const b_q4_k *wb[4];
                for (int i = 0; i < 4; i++) {
                    wb[i] = (const b_q4_k *)(w + (n + i) * row_bytes) + b;
                    stream_ahead(wb[i], sizeof(b_q4_k), 2);
                    const __m512i v0 = _mm512_loadu_si512(wb[i]->qs), v1 = _mm512_loadu_si512(wb[i]->qs + 64);
                    const __m512i z0 = _mm512_and_si512(v0, m4), z1 = _mm512_and_si512(v1, m4);
                    const __m512i z2 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
                    const __m512i z3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
                    for (int k = 0; k < 4; k++)
                        _mm512_store_si512(A[c][n + i] + 64 * k,
                                           _mm512_mask_blend_epi32(0xF0F0, _mm512_permutex2var_epi32(z0, lo_idx[k], z1),
                                                                   _mm512_permutex2var_epi32(z2, hi_idx[k], z3)));
                }
                __m512 fd01, fm01, fd23, fm23;
                q4k_float_scales4(wb[0], wb[1], wb[2], wb[3], &fd01, &fm01, &fd23, &fm23);
                _mm512_store_ps(fd[c][n], fd01);
                _mm512_store_ps(fm[c][n], fm01);
                _mm512_store_ps(fd[c][n + 2], fd23);
                _mm512_store_ps(fm[c][n + 2], fm23);
            }
        }
        for (int q = 0; q < Q; q++) {
            for (int c = 0; c < nc; c++)
                for (int h = 0; h < 8; h += 4) { /* sub-blocks h .. h + 3 in C tiles 2..5 */
#define AMX_SUB(i_, tc_) /* tile numbers are immediates */                        \
                    _tile_zero(tc_);                                             \
                    _tile_loadd(0, A[c][0] + 32 * (h + i_), 256);                \
                    _tile_loadd(1, amx_b_tile(bt, nb, q, b0 + c, h + i_), 64);   \
                    _tile_dpbssd(tc_, 0, 1);                                     \
                    _tile_stored(tc_, C[c][h + i_], 64);
                    AMX_SUB(0, 2) AMX_SUB(1, 3) AMX_SUB(2, 4) AMX_SUB(3, 5)
#undef AMX_SUB
                }
            for (int n = 0; n < AMX_ROWS; n++) { /* q4k_block_acc, lane by lane */
                __m512 a[8];
                for (int u = 0; u < 8; u++) a[u] = b0 ? acc[q][n][u] : _mm512_setzero_ps();
                for (int c = 0; c < nc; c++) {
                    const float *fs = amx_b_fsum(bf, nb, q, b0 + c);
                    const __m512 dx = _mm512_load_ps(fs + 128);
                    for (int u = 0; u < 8; u++) {
                        const __m512 tot = _mm512_cvtepi32_ps(_mm512_load_si512(C[c][u][n]));
                        const __m512 v = _mm512_fnmadd_ps(_mm512_set1_ps(fm[c][n][u]), _mm512_load_ps(fs + 16 * u),
                                                          _mm512_mul_ps(tot, _mm512_set1_ps(fd[c][n][u])));
                        a[u] = _mm512_fmadd_ps(dx, v, a[u]);
                    }
                }
                if (b0 + nc < nb)
                    for (int u = 0; u < 8; u++) acc[q][n][u] = a[u];
                else /* hsum8's tree over the sub-blocks: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)) */
                    out[q][n] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                                              _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
            }
        }
    }
}

/* the B tiles and epilogue vectors of activation rows [m0, m0 + R) (R <= AMX_PASSES * 16) of `a` in the call of
 * `epoch`: the thread's kept layout where it has one for exactly these rows, else made in its slot; 0 without memory */
static int amx_layout(const uint8_t *a, int64_t arb, int64_t nb, int64_t m0, int R, int64_t epoch, int8_t **bt,
                      float **bf) {
    const int Q = (R + AMX_ROWS - 1) / AMX_ROWS;
    const size_t tiles = (size_t)Q * nb * 8 * 512, need = tiles + (size_t)Q * nb * 144 * sizeof(float);
    amx_buf *s = &amx_slots[(m0 / (AMX_PASSES * AMX_ROWS)) % AMX_SLOTS];
    if (epoch && s->epoch == epoch && s->a == a && s->m0 == m0 && s->R == R) {
        *bt = s->mem;
        *bf = (float *)(s->mem + tiles);
        return 1;
    }
    s->epoch = 0; /* unkeyed until laid out */
    if (need > s->cap) {
        free(s->mem);
        s->mem = (int8_t *)aligned_alloc(64, (need + 63) / 64 * 64);
        s->cap = s->mem ? need : 0;
        if (!s->mem) return 0;
    }
    *bt = s->mem;
    *bf = (float *)(s->mem + tiles);
    for (int q = 0; q < Q; q++) {
        const int rows = R - 16 * q < 16 ? R - 16 * q : 16;
        const __mmask16 valid = (__mmask16)((1u << rows) - 1);
        /* dword 8t + u of row m's block (its register t, sub-block u) -> tile u, row t, lane m */
        const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)(arb / 4)));
        const int32_t *base = (const int32_t *)(a + (m0 + 16 * q) * arb);
        for (int64_t b = 0; b < nb; b++) {
            const int32_t *blk = base + b * (int64_t)(sizeof(xq256) / 4);
            for (int u = 0; u < 8; u++) {
                int8_t *t = amx_b_tile(*bt, nb, q, b, u);
                for (int r = 0; r < 8; r++)
                    _mm512_store_si512(t + 64 * r,
                                       _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, idx, blk + 8 * r + u, 4));
            }
            float *fs = amx_b_fsum(*bf, nb, q, b);
            const float *xf = (const float *)blk;
            const int fsum_at = (int)(offsetof(xq256, fsum) / 4), d_at = (int)(offsetof(xq256, d) / 4);
            for (int u = 0; u < 8; u++)
                _mm512_store_ps(fs + 16 * u, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, idx, xf + fsum_at + u, 4));
            _mm512_store_ps(fs + 128, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, idx, xf + d_at, 4));
        }
    }
    s->a = a, s->epoch = epoch, s->m0 = m0, s->R = R;
    return 1;
}

static void cols_q4_k(const uint8_t *W, int64_t row_bytes, int64_t nb, const uint8_t *a, int64_t arb, int64_t c0,
                      int64_t c1, int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t groups = (n1 - n0) / AMX_ROWS, n_end = n0 + groups * AMX_ROWS;
    if (c1 - c0 < AMX_MIN_ROWS || groups == 0 || !amx_ready()) {
        cols_q4_k_vnni(W, row_bytes, nb, a, arb, c0, c1, n0, n1, y, ldy, bias, accumulate);
        return;
    }
    amx_configure();
    const int64_t epoch = sf_call_epoch;
    for (int64_t m0 = c0; m0 < c1; m0 += AMX_PASSES * AMX_ROWS) {
        const int R = (int)(c1 - m0 < AMX_PASSES * AMX_ROWS ? c1 - m0 : AMX_PASSES * AMX_ROWS);
        int8_t *bt;
        float *bf;
        if (R < AMX_MIN_ROWS || !amx_layout(a, arb, nb, m0, R, epoch, &bt, &bf)) { /* a short rest, or no memory */
            cols_q4_k_vnni(W, row_bytes, nb, a, arb, m0, m0 + R, n0, n_end, y, ldy, bias, accumulate);
            continue;
        }
        const int Q = (R + AMX_ROWS - 1) / AMX_ROWS;
        for (int64_t n = n0; n < n_end; n += AMX_ROWS) {
            __m512 out[AMX_PASSES][AMX_ROWS];
            amx_q4_k_group(W + n * row_bytes, row_bytes, nb, bt, bf, Q, out);
            for (int q = 0; q < Q; q++) {
                const int rows = R - 16 * q < 16 ? R - 16 * q : 16;
                for (int i = 0; i < AMX_ROWS; i++) {
                    _Alignas(64) float o[16];
                    _mm512_store_ps(o, out[q][i]);
                    for (int r = 0; r < rows; r++) {
                        float v = o[r];
                        if (bias) v += bias[n + i];
                        float *dst = y + (m0 + 16 * q + r) * ldy + n + i;
                        *dst = accumulate ? *dst + v : v;
                    }
                }
            }
        }
    }
    _tile_release();
    if (n_end < n1) /* the weight rows past the last group */
        cols_q4_k_vnni(W, row_bytes, nb, a, arb, c0, c1, n_end, n1, y, ldy, bias, accumulate);
}

/* 1 where this process runs the tile kernels (the OS granted the tile state), else 0; for the tests, which must
 * know that the bits they compare came from the tiles and not from the VNNI kernels behind them */
int specfleet_amx_tiles(void) { return amx_ready(); }
