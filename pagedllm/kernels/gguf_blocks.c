/* GGUF's quantized blocks run as the file stores them (see pagedllm/layers/gguf_linear.py): the entry points.
 *
 * This file holds the entry points and which kernel each takes; the kernels are in the headers included below
 * (gguf_types.h lists them, with the block types' layouts). Two modes:
 *   "gguf"        int8 activations times the blocks as stored, in integers (gguf_rows.h, and the panels of
 *                 gguf_panels.h: gguf_panels_avx512.h / gguf_panels_avx2.h from AVX2 up);
 *   "gguf-exact"  float32 activations times the weights gguf dequantizes to (gguf_dequant.h).
 * Where the level has AVX2, weights are repacked into panels at load (gguf_pack_panels) and one kernel takes every
 * row count; below it, the row kernels MR rows at a time.
 */
#include "gguf_types.h"
#include "gguf_panels.h"
#include "gguf_dequant.h"
#include "gguf_rows.h"
#include "gguf_panels_avx512.h"  /* which includes gguf_panels_amx.h for its GEMM */
#include "gguf_panels_avx2.h"

/* more rows of x than this (half as many again for Q6_K) go to the panel GEMM (AVX-512), fewer to the row kernels;
 * a variable so that tests can run both paths */
int gguf_gemm_min_rows = 16;

/* 1 where the panel GEMM is built (AVX-512 VNNI); else many rows go through the row kernels, MR at a time */
int gguf_has_gemm(void) {
#ifdef GB_AVX512
    return 1;
#else
    return 0;
#endif
}

/* 1 where weights are repacked into panels of 16 rows (gguf_pack_panels) and one kernel multiplies them at every
 * row count (AVX2 and AVX-512 VNNI builds) */
int gguf_has_panels(void) {
#ifdef GB_PANELS
    return 1;
#else
    return 0;
#endif
}

#ifdef GB_AVX512
/* more rows than this take the GEMM: Q6_K's panels cost more to decode (its top bits put back), so it pays
 * from half as many rows again (measured, the 1.5B's Q6_K tensors: 83 / 89 / 105 / 134 GMAC/s at 16 / 24 / 32
 * / 48 rows against the row kernels' 99 / 92 / 98 / 94) */
static int64_t gemm_min_rows(int type) {
    return type == Q6_K ? 3 * (int64_t)gguf_gemm_min_rows / 2 : gguf_gemm_min_rows;
}
#endif

/* y [M, N] (rows ldy floats apart) = x_rounded [M, K] . W^T from x already rounded (gguf_quantize_q8 with the
 * type's block); 0, or -1 for a type these kernels do not read */
static int matmul_q8(int type, const int8_t *qx, const float *dx, const int16_t *bsums, const uint8_t *raw, float *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if (!block_elems(type)) return -1;
#ifdef GB_AVX512
    if (type > PANEL || M > gemm_min_rows(type))  /* a repacked weight: the one kernel at every row count */
        return gguf_gemm_q8(type, qx, dx, bsums, raw, y, ldy, M, N, K);
#elif defined(GB_PANELS)
    if (type > PANEL) return gguf_gemm_q8(type, qx, dx, bsums, raw, y, ldy, M, N, K);
#endif
    const int64_t row_bytes = K / block_elems(type) * block_bytes(type), ab = act_block(type);
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += COLS) {
        const int64_t n1 = n0 + COLS < N ? n0 + COLS : N;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = raw + n * row_bytes;
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int64_t mc = M - m0 < MR ? M - m0 : MR;
                const int8_t *q = qx + m0 * K;
                const float *d = dx + m0 * (K / ab);
                const int16_t *bs = bsums + m0 * (K / 16);
                float out[MR];
#define ROWS_CASES(T)                                                    \
                switch (mc) {                                            \
                    case 6: dot_rows(T, 6, row, q, d, bs, K, out); break; \
                    case 5: dot_rows(T, 5, row, q, d, bs, K, out); break; \
                    case 4: dot_rows(T, 4, row, q, d, bs, K, out); break; \
                    case 3: dot_rows(T, 3, row, q, d, bs, K, out); break; \
                    case 2: dot_rows(T, 2, row, q, d, bs, K, out); break; \
                    default: dot_rows(T, 1, row, q, d, bs, K, out); break; \
                }
                BY_TYPE(type, ROWS_CASES);
#undef ROWS_CASES
                for (int64_t i = 0; i < mc; i++) y[(m0 + i) * ldy + n] = out[i];
            }
        }
    }
    return 0;
}

int gguf_matmul_q8(int type, const int8_t *qx, const float *dx, const int16_t *bsums, const uint8_t *raw, float *y,
                   int64_t M, int64_t N, int64_t K) {
    return matmul_q8(type, qx, dx, bsums, raw, y, N, M, N, K);
}

/* W [N, K] of type Q2_K to Q6_K, Q8_0, Q5_0, Q4_0, Q4_1, Q5_1, IQ4_NL or IQ4_XS (the file's rows, raw) repacked into
 * out (as many bytes) for the kernels above; the repacked type's id (PANEL + type), or -1 where it does not apply:
 * another type, N not a multiple of 16, K not a multiple of 256 (the types of 32-blocks: 64), or a build without
 * the panels (below AVX2) */
int gguf_pack_panels(int type, const uint8_t *raw, uint8_t *out, int64_t N, int64_t K) {
#ifdef GB_PANELS
    const int q32 = paired(type);
    if (!(reads_stored(type) || panel_only(type)) || N % NP || K % (q32 ? 64 : QK))
        return -1;
    const int64_t row_bytes = K / block_elems_any(type) * block_bytes_any(type);
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NP) {
        if (q32) repack_panel_q32(type, raw + n0 * row_bytes, row_bytes, K / 32, out + n0 * row_bytes);
        else repack_panel(type, raw + n0 * row_bytes, row_bytes, K / QK, out + n0 * row_bytes);
    }
    return PANEL + type;
#else
    (void)type, (void)raw, (void)out, (void)N, (void)K;
    return -1;
#endif
}

/* y [M, N_0 + ... + N_{n-1}] = x [M, K] . [W_0; ...; W_{n-1}]^T, W_p [N_p, K] of type types[p] (a fused
 * projection whose shards the file stores in different types): part p's columns of y are gguf_matmul_a8 of
 * W_p, bit for bit, with x rounded once per block size the parts use; 0, -1 for a type these kernels do not
 * read, -2 when memory ran out */
int gguf_matmul_a8_parts(int n, const int *types, const uint8_t *const *raws, const int64_t *Ns, const float *x,
                         float *y, int64_t M, int64_t K) {
    int64_t ldy = 0;
    for (int p = 0; p < n; p++) {
        if (!block_elems(types[p])) return -1;
        ldy += Ns[p];
    }
    int8_t *qx[2] = {NULL, NULL};
    float *dx[2] = {NULL, NULL};
    int16_t *bs[2] = {NULL, NULL};
    int rc = 0;
    for (int64_t p = 0, col = 0; p < n && !rc; col += Ns[p], p++) {
        const int ab = act_block(types[p]), b = ab == QK;
        if (!qx[b]) {
            qx[b] = malloc(M * K + 64);
            dx[b] = malloc(M * (K / ab) * sizeof(float) + 64);
            bs[b] = malloc(M * (K / 16) * sizeof(int16_t) + 64);
            if (!qx[b] || !dx[b] || !bs[b]) {
                rc = -2;
                break;
            }
            gguf_quantize_q8(x, M, K, ab, qx[b], dx[b], bs[b], NULL);
        }
        rc = matmul_q8(types[p], qx[b], dx[b], bs[b], raws[p], y + col, ldy, M, Ns[p], K);
    }
    for (int b = 0; b < 2; b++) free(qx[b]), free(dx[b]), free(bs[b]);
    return rc;
}

/* gguf_matmul_q8 from float x: rounds it (per 256 for the K-quants, per 32 for Q8_0 / Q5_0), then the GEMV */
int gguf_matmul_a8(int type, const float *x, const uint8_t *raw, float *y, int64_t M, int64_t N, int64_t K) {
    return gguf_matmul_a8_parts(1, &type, &raw, &N, x, y, M, K);
}
