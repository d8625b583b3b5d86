/* Float32 weights (included by gguf_blocks.c after gguf_panels.h), three ways:
 *   - gguf_dequantize: W [N, K] as float32, gguf's values bit for bit (a repacked weight unpacked a row at a time);
 *   - gguf_matmul_f32, the "gguf-exact" mode's GEMV: each super-block (or 256 elements of 32-blocks) dequantized
 *     into a buffer on the stack as gguf_dequantize does it, bit for bit, then multiplied with FMAs: the float32
 *     function of the dequantized weights up to summation order;
 *   - gguf_matmul_half: float16 / bfloat16 weights as stored (an F16 or BF16 GGUF's), widened exactly in
 *     registers and multiplied in float32;
 *   - gguf_to_groups: the blocks as pagedllm's int4 / int8 groups (below).
 * What it reads: the file's blocks (gguf_types.h), as stored. */

/* ---- dequantization ------------------------------------------------------------------------------ */

/* elements [c * 256, c * 256 + 256) of one row (for the 32-element types: its 8 blocks; K a multiple of 256
 * there) as float32, gguf's values bit for bit */
static void dequant_chunk(int type, const uint8_t *row, int64_t c, int64_t n_elems, float *out) {
    if (type == Q4_K) {
        const uint8_t *b = row + c * 144;
        const float d = f16(b), dmin = f16(b + 2);
        uint64_t scw, mnw;
        k4_scales(b + 4, &scw, &mnw);
        for (int s = 0; s < 8; s++) {
            const float d1 = d * (float)((scw >> 8 * s) & 0xFF), m1 = dmin * (float)((mnw >> 8 * s) & 0xFF);
            const uint8_t *q = b + 16 + 32 * (s / 2);
            const int shift = 4 * (s & 1);
            float *o = out + 32 * s;
#ifdef GB_AVX512
            const __m128i m4 = _mm_set1_epi8(0x0F);
            for (int h = 0; h < 2; h++) {
                const __m128i qb = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * h)), shift), m4);
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qb)), _mm512_set1_ps(d1));
                __asm__("" : "+v"(t));  /* as rounded(): not fused with the subtraction */
                _mm512_storeu_ps(o + 16 * h, _mm512_sub_ps(t, _mm512_set1_ps(m1)));
            }
#else
            for (int l = 0; l < 32; l++) o[l] = rounded(d1 * (float)((q[l] >> shift) & 15)) - m1;
#endif
        }
    } else if (type == Q5_K) {  /* Q4_K's scales and nibbles, and bit s of qh[l] the fifth of sub-block s's l-th */
        const uint8_t *b = row + c * 176, *qh = b + 16;
        const float d = f16(b), dmin = f16(b + 2);
        uint64_t scw, mnw;
        k4_scales(b + 4, &scw, &mnw);
        for (int s = 0; s < 8; s++) {
            const float d1 = d * (float)((scw >> 8 * s) & 0xFF), m1 = dmin * (float)((mnw >> 8 * s) & 0xFF);
            const uint8_t *q = b + 48 + 32 * (s / 2);
            const int shift = 4 * (s & 1);
            for (int l = 0; l < 32; l++)
                out[32 * s + l] = rounded(d1 * (float)(((q[l] >> shift) & 15) | (((qh[l] >> s) & 1) << 4))) - m1;
        }
    } else if (type == Q2_K) {
        const uint8_t *b = row + c * 84, *qs = b + 16;
        const float d = f16(b + 80), dmin = f16(b + 82);
        for (int s = 0; s < 16; s++) {
            const float dl = d * (float)(b[s] & 15), ml = dmin * (float)(b[s] >> 4);
            const int h = s / 8, j = (s % 8) / 2;
            for (int i = 0; i < 16; i++)
                out[16 * s + i] = rounded(dl * (float)((qs[32 * h + 16 * (s % 2) + i] >> 2 * j) & 3)) - ml;
        }
    } else if (type == Q3_K) {
        const uint8_t *b = row + c * 110, *hm = b, *qs = b + 32, *scb = b + 96;
        const float d = f16(b + 108);
        for (int s = 0; s < 16; s++) {
            const int sc = ((scb[s % 8] >> 4 * (s / 8)) & 15) | (((scb[8 + s % 4] >> 2 * (s / 4)) & 3) << 4);
            const float dl = d * (float)(sc - 32);
            const int h = s / 8, j = (s % 8) / 2;
            for (int i = 0; i < 16; i++) {
                const int l = 16 * (s % 2) + i;
                const int q = ((qs[32 * h + l] >> 2 * j) & 3) - (((hm[l] >> (4 * h + j)) & 1) ? 0 : 4);
                out[16 * s + i] = dl * (float)q;
            }
        }
    } else if (type == IQ4_XS) {
        const uint8_t *b = row + c * 136;
        const float d = f16(b);
        const uint32_t sh = (uint32_t)b[2] | (uint32_t)b[3] << 8;
        for (int s = 0; s < 8; s++) {
            const int ls = ((b[4 + s / 2] >> 4 * (s & 1)) & 15) | (((sh >> 2 * s) & 3) << 4);
            const float dl = d * (float)(ls - 32);
            const uint8_t *q = b + 8 + 16 * s;
            for (int j = 0; j < 16; j++) {
                out[32 * s + j] = dl * (float)IQ4_NL_VALUES[q[j] & 15];
                out[32 * s + j + 16] = dl * (float)IQ4_NL_VALUES[q[j] >> 4];
            }
        }
    } else if (type == Q6_K) {
        const uint8_t *b = row + c * 210;
        const float d = f16(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
#ifdef GB_AVX512
        __m512i w[4];
        q6k_decode(b, w);
        for (int j = 0; j < 16; j++) {  /* group j of 16: bytes 16 (j % 4) .. of vector j / 4 */
            const __m128i q = _mm512_extracti32x4_epi32(w[j / 4], 0);
            const __m128i qj = j % 4 == 0 ? q
                               : j % 4 == 1 ? _mm512_extracti32x4_epi32(w[j / 4], 1)
                               : j % 4 == 2 ? _mm512_extracti32x4_epi32(w[j / 4], 2)
                                            : _mm512_extracti32x4_epi32(w[j / 4], 3);
            const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(qj), _mm512_set1_epi32(32)));
            _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[j]), v));
        }
#else
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            for (int l = 0; l < 32; l++) {
                const int q0 = (ql[l] & 15) | ((qh[l] & 3) << 4), q1 = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
                const int q2 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), q3 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                float *o = out + 128 * h + l;
                const int j = 8 * h + l / 16;
                o[0] = (d * (float)sc[j]) * (float)(q0 - 32);
                o[32] = (d * (float)sc[j + 2]) * (float)(q1 - 32);
                o[64] = (d * (float)sc[j + 4]) * (float)(q2 - 32);
                o[96] = (d * (float)sc[j + 6]) * (float)(q3 - 32);
            }
        }
#endif
    } else {
        const int64_t first = c * 8, last = first + 8 < n_elems / 32 ? first + 8 : n_elems / 32;
        for (int64_t g = first; g < last; g++) {
            float *o = out + 32 * (g - first);
            if (type == Q8_0) {
                const uint8_t *b = row + g * 34;
                const float d = f16(b);
                for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)b[2 + j] * d;
            } else if (type == Q4_0) {
                const uint8_t *b = row + g * 18;
                const float d = f16(b);
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)((int)(b[2 + j] & 15) - 8);
                    o[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
                }
            } else if (type == IQ4_NL) {
                const uint8_t *b = row + g * 18;
                const float d = f16(b);
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)IQ4_NL_VALUES[b[2 + j] & 15];
                    o[j + 16] = d * (float)IQ4_NL_VALUES[b[2 + j] >> 4];
                }
            } else if (type == Q4_1 || type == Q5_1) {  /* gguf's (d * q) + m, not fused */
                const uint8_t *b = row + g * block_bytes_any(type);
                const float d = f16(b), m = f16(b + 2);
                uint32_t qh = 0;
                if (type == Q5_1) memcpy(&qh, b + 4, 4);
                const uint8_t *qs = b + (type == Q5_1 ? 8 : 4);
                for (int j = 0; j < 16; j++) {
                    o[j] = rounded(d * (float)((qs[j] & 15) | (((qh >> j) & 1) << 4))) + m;
                    o[j + 16] = rounded(d * (float)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4))) + m;
                }
            } else {  /* Q5_0 */
                const uint8_t *b = row + g * 22;
                const float d = f16(b);
                uint32_t qh;
                memcpy(&qh, b + 2, 4);
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)((int)((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
                    o[j + 16] = d * (float)((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
                }
            }
        }
    }
}

/* W [N, K] as float32 into w [N, K]; 0, or -1 for a type these kernels do not read (the rows of a type read only in
 * panels otherwise, as the file stores them, are read here too: a panel's row looked up, an embedding's) */
int gguf_dequantize(int type, const uint8_t *raw, float *w, int64_t N, int64_t K) {
    if (!block_elems(type) && !panel_only(type)) return -1;
    const int64_t row_bytes = K / block_elems_any(base_type(type)) * block_bytes_any(base_type(type)), chunks = (K + QK - 1) / QK;
    if (type > PANEL) {  /* a row at a time as the file stores it */
        int failed = 0;
#pragma omp parallel
        {
            uint8_t *row = malloc(row_bytes);
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                if (!row) continue;
                unpack_row(type, raw, n, K, row);
                for (int64_t c = 0; c < chunks; c++) dequant_chunk(base_type(type), row, c, K, w + n * K + c * QK);
            }
            if (!row) {
#pragma omp atomic write
                failed = 1;
            }
            free(row);
        }
        return failed ? -2 : 0;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t len = K - c * QK < QK ? K - c * QK : QK;
            if (len == QK) {
                dequant_chunk(type, raw + n * row_bytes, c, K, w + n * K + c * QK);
            } else {  /* the last 32-blocks of a row not a multiple of 256 */
                float buf[QK];
                dequant_chunk(type, raw + n * row_bytes, c, K, buf);
                memcpy(w + n * K + c * QK, buf, len * sizeof(float));
            }
        }
    }
    return 0;
}

/* ---- float32 activations ------------------------------------------------------------------------------ */

/* y [M, N] = x [M, K] . W_dequantized^T, each chunk of 256 weights dequantized as gguf_dequantize does it and
 * multiplied in float32 (four chains a row); 0, or -1 for a type these kernels do not read */
int gguf_matmul_f32(int type, const float *x, const uint8_t *raw, float *y, int64_t M, int64_t N, int64_t K) {
    if (!block_elems(type) || type > PANEL) return -1;
    const int64_t row_bytes = K / block_elems(type) * block_bytes(type), chunks = (K + QK - 1) / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += COLS) {
        const int64_t n1 = n0 + COLS < N ? n0 + COLS : N;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = raw + n * row_bytes;
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int64_t mc = M - m0 < MR ? M - m0 : MR;
                float tot[MR] = {0.f};
                for (int64_t c = 0; c < chunks; c++) {
                    float w[QK] __attribute__((aligned(64)));
                    dequant_chunk(type, row, c, K, w);
                    const int64_t len = K - c * QK < QK ? K - c * QK : QK;
                    for (int64_t i = 0; i < mc; i++) {
                        const float *xc = x + (m0 + i) * K + c * QK;
#ifdef GB_AVX512
                        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                        for (int64_t k = 0; k < len; k += 16)
                            a[(k / 16) & 3] = _mm512_fmadd_ps(_mm512_load_ps(w + k), _mm512_loadu_ps(xc + k), a[(k / 16) & 3]);
                        tot[i] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
#elif defined(__AVX2__)
                        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                        for (int64_t k = 0; k < len; k += 8)
                            a[(k / 8) & 3] = _mm256_fmadd_ps(_mm256_load_ps(w + k), _mm256_loadu_ps(xc + k), a[(k / 8) & 3]);
                        tot[i] += hsum256(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
#else
                        float a = 0.f;
                        for (int64_t k = 0; k < len; k++) a += w[k] * xc[k];
                        tot[i] += a;
#endif
                    }
                }
                for (int64_t i = 0; i < mc; i++) y[(m0 + i) * N + n] = tot[i];
            }
        }
    }
    return 0;
}

/* ---- float16 / bfloat16 weights ---------------------------------------------------------------------- */

/* HALF lanes of a float16 (bf16 = 0) or bfloat16 (bf16 = 1) row from p, widened to float32 exactly */
#ifdef GB_AVX512
#define HALF 16
typedef __m512 halfvec;
static inline halfvec half_load(int bf16, const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return bf16 ? bf16x16_to_f32(h) : _mm512_cvtph_ps(h);
}
static inline halfvec half_fma(halfvec a, const float *x, halfvec w) { return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), a); }
static inline float half_sum(halfvec a, halfvec b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
#define HALF_ZERO _mm512_setzero_ps()
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HALF 8
typedef __m256 halfvec;
static inline halfvec half_load(int bf16, const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? bf16x8_to_f32(h) : _mm256_cvtph_ps(h);
}
static inline halfvec half_fma(halfvec a, const float *x, halfvec w) { return _mm256_fmadd_ps(w, _mm256_loadu_ps(x), a); }
static inline float half_sum(halfvec a, halfvec b) { return hsum256(_mm256_add_ps(a, b)); }
#define HALF_ZERO _mm256_setzero_ps()
#endif

static inline float half_to_float(int bf16, uint16_t h) { return bf16 ? bf16_to_f32(h) : f16((const uint8_t *)&h); }

/* out[0 .. MC) = rows 0 .. MC of x (K apart) . one weight row; MC and BF16 constants where it is inlined: two
 * chains of vectors a row of x, then the tail of K (K % (2 * HALF)) in order */
static inline __attribute__((always_inline)) void half_rows(const int BF16, const int MC, const uint16_t *row,
                                                            const float *x, int64_t K, float *out) {
    int64_t k = 0;
#ifdef HALF
    halfvec a[MR][2];
    for (int i = 0; i < MC; i++) a[i][0] = a[i][1] = HALF_ZERO;
    for (; k + 2 * HALF <= K; k += 2 * HALF) {
        const halfvec w0 = half_load(BF16, row + k), w1 = half_load(BF16, row + k + HALF);
        for (int i = 0; i < MC; i++) {
            a[i][0] = half_fma(a[i][0], x + i * K + k, w0);
            a[i][1] = half_fma(a[i][1], x + i * K + k + HALF, w1);
        }
    }
    for (int i = 0; i < MC; i++) out[i] = half_sum(a[i][0], a[i][1]);
#else
    for (int i = 0; i < MC; i++) out[i] = 0.f;
#endif
    for (int i = 0; i < MC; i++) {
        float t = 0.f;
        for (int64_t j = k; j < K; j++) t += half_to_float(BF16, row[j]) * x[i * K + j];
        out[i] += t;
    }
}

/* y [M, N] = x [M, K] . W^T, W [N, K] float16 (bf16 = 0) or bfloat16 (bf16 = 1) as the file stores it: each
 * weight widened exactly and multiplied in float32 (half_rows); each row of x alone, so a row's bits are the same
 * at every M */
int gguf_matmul_half(int bf16, const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += COLS) {
        const int64_t n1 = n0 + COLS < N ? n0 + COLS : N;
        for (int64_t n = n0; n < n1; n++) {
            const uint16_t *row = w + n * K;
            PREFETCH_AHEAD(row, 2 * K);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int64_t mc = M - m0 < MR ? M - m0 : MR;
                float out[MR];
#define HALF_CASE(BF)                                                         \
                switch (mc) {                                                 \
                    case 6: half_rows(BF, 6, row, x + m0 * K, K, out); break; \
                    case 5: half_rows(BF, 5, row, x + m0 * K, K, out); break; \
                    case 4: half_rows(BF, 4, row, x + m0 * K, K, out); break; \
                    case 3: half_rows(BF, 3, row, x + m0 * K, K, out); break; \
                    case 2: half_rows(BF, 2, row, x + m0 * K, K, out); break; \
                    default: half_rows(BF, 1, row, x + m0 * K, K, out); break; \
                }
                if (bf16) HALF_CASE(1) else HALF_CASE(0)
#undef HALF_CASE
                for (int64_t i = 0; i < mc; i++) y[(m0 + i) * N + n] = out[i];
            }
        }
    }
    return 0;
}

/* ---- bfloat16 weights in bfloat16 dot products (AVX512_BF16; the "gguf" mode) ----------------------------
 * W [N, K] bfloat16 repacked at load into panels of 16 rows (N a multiple of 16, K even): panel p, pair j holds
 * the 16 rows' elements 2j and 2j + 1 as 16 dwords (64 bytes, lane c: row 16p + c, element 2j low), the file's
 * bytes permuted. x is rounded to bfloat16 (to nearest even, as llama.cpp rounds it for a BF16 weight), and each
 * vdpbf16ps adds a pair's two products to a float32 lane, in order along K: a row's bits the same at every M. */

int gguf_has_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* W [N, K] (the file's rows) into panels as above, out as many bytes; 0, or -1 where it does not apply (N not a
 * multiple of 16, K odd, a build without AVX512_BF16) */
int gguf_pack_bf16(const uint16_t *w, uint16_t *out, int64_t N, int64_t K) {
#ifdef __AVX512BF16__
    if (N % 16 || K % 2) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / 16; p++)
        for (int64_t j = 0; j < K / 2; j++)
            for (int c = 0; c < 16; c++) {
                const uint16_t *src = w + (16 * p + c) * K + 2 * j;
                uint16_t *dst = out + p * 16 * K + j * 32 + 2 * c;
                dst[0] = src[0], dst[1] = src[1];
            }
    return 0;
#else
    (void)w, (void)out, (void)N, (void)K;
    return -1;
#endif
}

#ifdef __AVX512BF16__
#define BD_ROWS 6    /* rows of x a tile */
#define BD_PANELS 4  /* panels of W a tile (64 columns) */
/* y rows 0 .. R, columns of NQ panels (from panel, 16 columns each) = x pairs (K / 2 dwords a row) . panels */
static inline __attribute__((always_inline)) void bf16_tile(const int R, const int NQ, const uint32_t *xp,
                                                            const uint16_t *panel, int64_t K, float *y, int64_t ldy) {
    __m512 acc[BD_ROWS][BD_PANELS];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < NQ; q++) acc[r][q] = _mm512_setzero_ps();
    for (int64_t j = 0; j < K / 2; j++) {
        __m512bh w[BD_PANELS];
        for (int q = 0; q < NQ; q++) w[q] = (__m512bh)_mm512_loadu_si512(panel + q * 16 * K + j * 32);
        for (int r = 0; r < R; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)xp[r * (K / 2) + j]);
            for (int q = 0; q < NQ; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], w[q], b);
        }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < NQ; q++) _mm512_storeu_ps(y + r * ldy + 16 * q, acc[r][q]);
}
#endif

/* y [M, N] = bf16(x) [M, K] . W^T, W in gguf_pack_bf16's panels; 0, -1 on a build without AVX512_BF16, -2 when
 * memory ran out */
int gguf_matmul_bf16_dot(const float *x, const uint16_t *panels, float *y, int64_t M, int64_t N, int64_t K) {
#ifdef __AVX512BF16__
    if (N % 16 || K % 2) return -1;
    uint32_t *xp = aligned_alloc(64, (M * K * 2 + 63) / 64 * 64);
    if (!xp) return -2;
    for (int64_t m = 0; m < M; m++)  /* x rounded to bfloat16, to nearest even: pairs of elements a dword */
        round_bf16(x + m * K, K, (uint16_t *)(xp + m * (K / 2)));
    const int64_t groups = (N / 16 + BD_PANELS - 1) / BD_PANELS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t p0 = g * BD_PANELS, np = N / 16 - p0 < BD_PANELS ? N / 16 - p0 : BD_PANELS;
        const uint16_t *panel = panels + p0 * 16 * K;
        for (int64_t m0 = 0; m0 < M; m0 += BD_ROWS) {
            const int64_t r = M - m0 < BD_ROWS ? M - m0 : BD_ROWS;
            const uint32_t *xr = xp + m0 * (K / 2);
            float *yr = y + m0 * N + 16 * p0;
#define BD_CASE(NQ)                                                                  \
            switch (r) {                                                             \
                case 6: bf16_tile(6, NQ, xr, panel, K, yr, N); break;                \
                case 5: bf16_tile(5, NQ, xr, panel, K, yr, N); break;                \
                case 4: bf16_tile(4, NQ, xr, panel, K, yr, N); break;                \
                case 3: bf16_tile(3, NQ, xr, panel, K, yr, N); break;                \
                case 2: bf16_tile(2, NQ, xr, panel, K, yr, N); break;                \
                default: bf16_tile(1, NQ, xr, panel, K, yr, N); break;               \
            }
            if (np == 4) BD_CASE(4) else if (np == 3) BD_CASE(3) else if (np == 2) BD_CASE(2) else BD_CASE(1)
#undef BD_CASE
        }
    }
    free(xp);
    return 0;
#else
    (void)x, (void)panels, (void)y, (void)M, (void)N, (void)K;
    return -1;
#endif
}

/* ---------------------------------------------------------------------------------------------------------
 * A GGUF tensor's blocks in pagedllm's int4 / int8 group layout (pagedllm/layers/quantization.py), the
 * values gguf_loader._q_blocks computes with numpy, bit for bit, in one pass at the memory's speed: groups of
 * 32 weights w = q * scale + min, a float32 scale and min per group (Q6_K: a scale per 16, mins 0).
 *   int4 (Q4_0, Q4_1, Q4_K): q [N, K/2] bytes, byte j of a group holding element j (low) and j + 16 (high);
 *   int8 (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K): q [N, K] int8.
 * Q4_0 keeps q 0..15 with min -8d; Q5_0 and Q6_K subtract their offsets (16, 32) from q.
 * ------------------------------------------------------------------------------------------------------- */
static void k_scale_min(const uint8_t *p, int j, uint8_t *sc, uint8_t *m) {  /* llama.cpp's get_scale_min_k4 */
    if (j < 4) {
        *sc = p[j] & 63;
        *m = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 0xF) | ((p[j - 4] >> 6) << 4);
        *m = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

/* one row: K elements from src; q, scales and mins that row's outputs */
static void row_to_groups(int type, const uint8_t *src, int64_t K, uint8_t *q, float *scales, float *mins) {
    if (type == Q4_K || type == Q5_K) {
        const int bb = type == Q4_K ? 144 : 176;
        for (int64_t s = 0; s < K / 256; s++) {
            const uint8_t *b = src + s * bb, *qs = b + bb - 128;
            const float d = f16(b), dmin = f16(b + 2);
            for (int g = 0; g < 8; g++) {
                uint8_t sc, m;
                k_scale_min(b + 4, g, &sc, &m);
                scales[s * 8 + g] = d * (float)sc;
                mins[s * 8 + g] = -(dmin * (float)m);
                const uint8_t *chunk = qs + (g / 2) * 32;
                const int shift = (g & 1) * 4;
                if (type == Q4_K) {  /* byte j: element j's nibble (low), element j + 16's (high), 8 bytes a word */
                    const uint64_t low = 0x0F0F0F0F0F0F0F0Full;
                    for (int w = 0; w < 2; w++) {
                        uint64_t a, b;
                        memcpy(&a, chunk + 8 * w, 8);
                        memcpy(&b, chunk + 16 + 8 * w, 8);
                        const uint64_t v = ((a >> shift) & low) | (((b >> shift) & low) << 4);
                        memcpy(q + (s * 8 + g) * 16 + 8 * w, &v, 8);
                    }
                } else {
                    uint8_t *out = q + (s * 8 + g) * 32;
                    for (int l = 0; l < 32; l++)
                        out[l] = (uint8_t)(((chunk[l] >> shift) & 0xF) | (((b[16 + l] >> g) & 1) << 4));
                }
            }
        }
    } else if (type == Q6_K) {
        for (int64_t s = 0; s < K / 256; s++) {
            const uint8_t *b = src + s * 210;
            const float d = f16(b + 208);
            int8_t *out = (int8_t *)q + s * 256;
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                for (int l = 0; l < 32; l++) {
                    out[128 * h + l] = (int8_t)(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                    out[128 * h + l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    out[128 * h + l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    out[128 * h + l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
            for (int j = 0; j < 16; j++) scales[s * 16 + j] = d * (float)(int8_t)b[192 + j];
            for (int j = 0; j < 8; j++) mins[s * 8 + j] = 0.f;
        }
    } else {  /* the blocks of 32 */
        const int head = type == Q4_1 || type == Q5_1 ? 4 : 2;
        const int bb = block_bytes_any(type);
        for (int64_t g = 0; g < K / 32; g++) {
            const uint8_t *b = src + g * bb;
            const float d = f16(b);
            scales[g] = d;
            mins[g] = type == Q4_1 || type == Q5_1 ? f16(b + 2) : type == Q4_0 ? -8 * d : 0.f;
            if (type == Q4_0 || type == Q4_1) {
                memcpy(q + g * 16, b + head, 16);
            } else if (type == Q8_0) {
                memcpy(q + g * 32, b + 2, 32);
            } else {  /* Q5_0 / Q5_1 */
                uint32_t qh;
                memcpy(&qh, b + head, 4);
                const uint8_t *qs = b + head + 4;
                const int off = type == Q5_0 ? 16 : 0;
                int8_t *out = (int8_t *)q + g * 32;
                for (int j = 0; j < 16; j++) {
                    out[j] = (int8_t)(((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - off);
                    out[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
                }
            }
        }
    }
}

/* N rows of `type`'s blocks, K elements a row, into q, scales and mins (row-major, sized as above).
 * 0, or -1 for a type without a layout (or K not a whole number of blocks). */
int gguf_to_groups(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *q, float *scales, float *mins) {
    const int64_t elems = block_elems_any(type);
    if (!elems || K % elems) return -1;
    const int64_t row_bytes = K / elems * block_bytes_any(type);
    const int64_t q_row = type == Q4_0 || type == Q4_1 || type == Q4_K ? K / 2 : K;
    const int64_t s_row = type == Q6_K ? K / 16 : K / 32;
#pragma omp parallel for schedule(dynamic, 16)  /* rows, in chunks a thread takes when free: another thread (the tokenizer loading) may share its core */
    for (int64_t n = 0; n < N; n++)
        row_to_groups(type, src + n * row_bytes, K, q + n * q_row, scales + n * s_row, mins + n * (K / 32));
    return 0;
}
