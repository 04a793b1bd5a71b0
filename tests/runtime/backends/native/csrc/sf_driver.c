/* A test driver for specfleet's native kernels, linked with one family's bodies (tests/runtime/backends/native/test_arm_qemu.py
 * builds it for aarch64 twice, with csrc/arch/arm/ and with csrc/generic/, and runs both under
 * qemu-user). It reads records from argv[1] and writes each record's outputs to argv[2]; the test
 * compares the two builds' bytes and checks them against float64 references.
 *
 * A record: int64 cmd, int64 nparams, int64 params[nparams], int64 narrays, then per array int64 nbytes
 * and the bytes. Its output: int64 narrays, then per array int64 nbytes and the bytes.
 *   1 LINEAR  [type, N, K, M, row_bytes, threads]               (W, x)              -> y [M, N]
 *   2 ATTEND  [n, H, KVH, D, threads, scale bits]               (q, k, v, slots, base, plen, xoff, nkeys,
 *                                                                extras)            -> out [n, H, D]
 *   3 ROPE    [T, H, KVH, D, nslots]                            (qkv, pos, cos, sin, slots) -> q, k cache, v cache
 *   4 LAYER   [T, hidden, inter, H, KVH, D, threads, scale bits, eps bits, nslots, cache_from,
 *              type qkv, o, gate_up, down]                      (W qkv, b qkv, W o, W gate_up, W down, norm1,
 *                                                                norm2, h, pos, cos, sin, slots, kslots, base,
 *                                                                plen, xoff, nkeys, extras) -> h, k cache, v cache
 *      cache_from: -1 a zero cache, else the caches the LAYER record of that index left.
 *   5 FUSED   [K, M, pre, accumulate, threads, eps bits, type, N, row_bytes] (W, bias or empty, x, pre_w or
 *                                                                empty, y)          -> y */
#include <stdio.h>
#include <stdlib.h>

#include "q_common.h"

#define MAXA 24
#define MAXREC 4096

static FILE *in, *out;
static void die(const char *what) {
    fprintf(stderr, "sf_driver: %s\n", what);
    exit(2);
}
static int64_t rd64(void) {
    int64_t v;
    if (fread(&v, 8, 1, in) != 1) die("short read");
    return v;
}
static void *alloc(int64_t n) {
    void *p = aligned_alloc(64, (size_t)((n + 64) / 64 * 64));
    if (!p) die("out of memory");
    memset(p, 0, (size_t)((n + 64) / 64 * 64));
    return p;
}
static void put(const void *p, int64_t n) {
    fwrite(&n, 8, 1, out);
    if (n) fwrite(p, 1, (size_t)n, out);
}
static float f32(int64_t bits) {
    const int32_t b = (int32_t)bits;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static float *saved_k[MAXREC], *saved_v[MAXREC];

int main(int argc, char **argv) {
    if (argc != 3) die("usage: sf_driver IN OUT");
    in = fopen(argv[1], "rb");
    out = fopen(argv[2], "wb");
    if (!in || !out) die("cannot open the files");
    for (int64_t rec = 0;; rec++) {
        int64_t cmd;
        if (fread(&cmd, 8, 1, in) != 1) break;
        if (rec >= MAXREC) die("too many records");
        int64_t np = rd64(), P[32];
        if (np > 32) die("too many params");
        for (int64_t i = 0; i < np; i++) P[i] = rd64();
        int64_t na = rd64(), nbytes[MAXA];
        void *A[MAXA];
        if (na > MAXA) die("too many arrays");
        for (int64_t i = 0; i < na; i++) {
            nbytes[i] = rd64();
            A[i] = alloc(nbytes[i]);
            if (nbytes[i] && fread(A[i], 1, (size_t)nbytes[i], in) != (size_t)nbytes[i]) die("short array");
        }
        int rc = 0;
        if (cmd == 1) {
            const int64_t type = P[0], N = P[1], K = P[2], M = P[3], rb = P[4], nt = P[5];
            float *y = alloc(M * N * 4);
            void *act = alloc(M * specfleet_q_act_row_bytes((int)type, K) + 64);
            rc = specfleet_q_linear((int)type, A[0], rb, N, K, A[1], M, y, act, (int)nt);
            fwrite(&(int64_t){1}, 8, 1, out);
            put(y, M * N * 4);
            free(y);
            free(act);
        } else if (cmd == 2) {
            const int64_t n = P[0], H = P[1], KVH = P[2], D = P[3], nt = P[4];
            float *o = alloc(n * H * D * 4);
            rc = specfleet_attend(A[0], n, H, KVH, D, A[1], A[2], KVH * D, A[3], A[4], A[5], A[6], A[7], A[8],
                                  f32(P[5]), o, nt);
            fwrite(&(int64_t){1}, 8, 1, out);
            put(o, n * H * D * 4);
            free(o);
        } else if (cmd == 3) {
            const int64_t T = P[0], H = P[1], KVH = P[2], D = P[3], ns = P[4];
            float *q = alloc(T * H * D * 4), *kc = alloc(ns * KVH * D * 4), *vc = alloc(ns * KVH * D * 4);
            specfleet_rope_kv(A[0], T, (H + 2 * KVH) * D, H, KVH, D, A[1], A[2], A[3], q, kc, vc, A[4]);
            fwrite(&(int64_t){3}, 8, 1, out);
            put(q, T * H * D * 4);
            put(kc, ns * KVH * D * 4);
            put(vc, ns * KVH * D * 4);
            free(q);
            free(kc);
            free(vc);
        } else if (cmd == 4) {
            const int64_t T = P[0], hidden = P[1], inter = P[2], H = P[3], KVH = P[4], D = P[5], nt = P[6];
            const int64_t ns = P[9], from = P[10], wq = (H + 2 * KVH) * D;
            const int64_t cache = ns * KVH * D * 4;
            float *kc = alloc(cache), *vc = alloc(cache);
            if (from >= 0) {
                if (from >= rec || !saved_k[from]) die("cache_from names no earlier LAYER record");
                memcpy(kc, saved_k[from], (size_t)cache);
                memcpy(vc, saved_v[from], (size_t)cache);
            }
            sfq_part parts[4] = {
                {P[11], A[0], nbytes[0] / wq, wq, nbytes[1] ? A[1] : 0},
                {P[12], A[2], nbytes[2] / hidden, hidden, 0},
                {P[13], A[3], nbytes[3] / (2 * inter), 2 * inter, 0},
                {P[14], A[4], nbytes[4] / hidden, hidden, 0},
            };
            sfq_layer ly = {&parts[0], &parts[1], &parts[2], &parts[3], 1, 1, 1, 1, A[5], A[6],
                            (double)f32(P[8]), (double)f32(P[8]), kc, vc};
            float *h = A[7];
            float *qkv = alloc(T * wq * 4), *q = alloc(T * H * D * 4), *o = alloc(T * H * D * 4);
            float *gu = alloc(T * 2 * inter * 4);
            rc = specfleet_decode_layers(&ly, 1, T, h, hidden, qkv, wq, q, o, gu, inter, H, KVH, D, A[8], A[9], A[10],
                                         A[11], A[12], A[13], A[14], A[15], A[16], A[17], f32(P[7]), nt);
            fwrite(&(int64_t){3}, 8, 1, out);
            put(h, T * hidden * 4);
            put(kc, cache);
            put(vc, cache);
            saved_k[rec] = kc;
            saved_v[rec] = vc;
            free(qkv);
            free(q);
            free(o);
            free(gu);
        } else if (cmd == 5) {
            const int64_t K = P[0], M = P[1], N = P[7];
            sfq_part part = {P[6], A[0], P[8], N, nbytes[1] ? A[1] : 0};
            rc = specfleet_q_linear_fused(&part, 1, K, A[2], (P[2] == PRE_SILU_MUL ? 2 : 1) * K, M, P[2],
                                          nbytes[3] ? A[3] : 0, f32(P[5]), A[4], N, P[3], P[4]);
            fwrite(&(int64_t){1}, 8, 1, out);
            put(A[4], M * N * 4);
        } else {
            die("unknown command");
        }
        if (rc) {
            fprintf(stderr, "sf_driver: record %lld (command %lld) returned %d\n", (long long)rec, (long long)cmd, rc);
            return 3;
        }
        for (int64_t i = 0; i < na; i++) free(A[i]);
    }
    fclose(out);
    return 0;
}
