/* Weight-only int4 / int8 matmuls for pagedllm (see pagedllm/layers/quantization.py).
 *
 * Activations stay float32: the result is W_dequantized . x up to float
 * summation order, so a quantized model computes the same function as float32
 * with the dequantized weights (for a GGUF's Q4 blocks: the very function the
 * float32 path computes). Weight bytes are what single-stream decode waits on;
 * these kernels read 4 or 8 bits per weight and widen them in registers.
 *
 * int4 layout: W is [N, K] in groups of 32 along K; group g of row n is
 *   W[n, 32g + j] = q * scale[n, g] + min[n, g],  q in 0..15,
 * packed as 16 bytes: byte j holds element j (low nibble) and j + 16 (high).
 * int8 layout: W[n, k] = q[n, k] * scale[n, g] + min[n, g] with g = k / 32, q in
 * -128..127: GGUF's Q8_0 is min = 0, and Q4_0 / Q4_1 widen into it exactly.
 * int8 with a scale per 16 (the *_g16 entry points, GGUF's Q6_K): scale[n, k / 16], min[n, k / 32].
 * mins may be NULL: every min 0 (GGUF's Q8_0 / Q5_0 / Q6_K), neither stored nor added.
 *
 * Rows n are split across OpenMP threads; the library is linked against the
 * libgomp PyTorch already loaded, so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define GROUP 32

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_hadd_ps(h, h);
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(h);
}
#endif

/* sum_g a[g] * b[g], eight lanes at a time: a scalar loop is one chain of dependent adds */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t g = 0;
    float t = 0.f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; g + 8 <= n; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g), acc);
    t = hsum(acc);
#endif
    for (; g < n; g++) t += a[g] * b[g];
    return t;
}

/* per row of x, the sum of each group of 32: what the groups' mins multiply */
static float *group_sums(const float *x, int64_t M, int64_t K) {
    const int64_t G = K / GROUP;
    float *xsum = malloc(M * G * sizeof(float));
    for (int64_t r = 0; r < M * G; r++) {
        float s = 0.f;
        for (int j = 0; j < GROUP; j++) s += x[r * GROUP + j];
        xsum[r] = s;
    }
    return xsum;
}

/* Group g of weight row n as 32 floats q (scale and min not applied): 4-bit nibbles or int8 bytes. */
#ifdef __AVX2__
static inline void unpack_group(const uint8_t *qw, int bits, int64_t n, int64_t g, int64_t K, __m256 w[4]) {
    if (bits == 4) {  /* bytes 0-7 and 8-15 widened to 32-bit lanes: low nibbles are elements j, high j + 16 */
        const uint8_t *p = qw + n * (K / 2) + g * 16;
        const __m256i low = _mm256_set1_epi32(0x0F);
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
        w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
        w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
        w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
        w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
    } else {
        const int8_t *p = (const int8_t *)qw + n * K + g * GROUP;
        for (int i = 0; i < 4; i++) w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))));
    }
}
#else
static inline void unpack_group(const uint8_t *qw, int bits, int64_t n, int64_t g, int64_t K, float w[GROUP]) {
    for (int j = 0; j < 16; j++) {
        if (bits == 4) {
            uint8_t b = qw[n * (K / 2) + g * 16 + j];
            w[j] = (float)(b & 15);
            w[j + 16] = (float)(b >> 4);
        } else {
            w[j] = (float)(int8_t)qw[n * K + g * GROUP + j];
            w[j + 16] = (float)(int8_t)qw[n * K + g * GROUP + j + 16];
        }
    }
}
#endif

#ifdef __AVX2__
/* q_g . x_g for one unpacked group, over two chains */
static inline __m256 group_dot(const __m256 w[4], const float *xg) {
    __m256 a = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
    __m256 b = _mm256_mul_ps(w[1], _mm256_loadu_ps(xg + 8));
    a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), a);
    b = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), b);
    return _mm256_add_ps(a, b);
}
#endif

#ifdef __AVX2__
/* q_h . x_h for half h (elements 16h .. 16h + 15) of one unpacked group: a weight with a scale per 16 */
static inline __m256 half_dot(const __m256 w[4], const float *xg, int h) {
    return _mm256_fmadd_ps(w[2 * h + 1], _mm256_loadu_ps(xg + 16 * h + 8), _mm256_mul_ps(w[2 * h], _mm256_loadu_ps(xg + 16 * h)));
}
#endif

/* y[m, n] = sum_g scale[n, g] * (q_g . x_g) + min[n, g] * sum(x_g), for 4- or 8-bit q; with sg = 2
 * scales per group (int8 only), each half of a group takes its own */
static inline void quant_matmul(int bits, int sg, const float *x, const uint8_t *qw, const float *scales,
                                const float *mins, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t G = K / GROUP;
    float *xsum = mins ? group_sums(x, M, K) : NULL;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *sc = scales + n * G * sg, *mn = mins ? mins + n * G : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {  /* up to 4 rows of x share each unpacked group */
            const int64_t mc = M - m0 < 4 ? M - m0 : 4;
            float dot[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef __AVX2__
            if (sg == 2) {  /* two sums a row of x, one per half of a group */
                __m256 acc[4][2];
                for (int64_t i = 0; i < mc; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
                for (int64_t g = 0; g < G; g++) {
                    __m256 w[4];
                    unpack_group(qw, bits, n, g, K, w);
                    const __m256 s0 = _mm256_set1_ps(sc[2 * g]), s1 = _mm256_set1_ps(sc[2 * g + 1]);
                    for (int64_t i = 0; i < mc; i++) {
                        const float *xg = x + (m0 + i) * K + g * GROUP;
                        acc[i][0] = _mm256_fmadd_ps(half_dot(w, xg, 0), s0, acc[i][0]);
                        acc[i][1] = _mm256_fmadd_ps(half_dot(w, xg, 1), s1, acc[i][1]);
                    }
                }
                for (int64_t i = 0; i < mc; i++) dot[i] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
            } else if (mc == 1) {  /* one row (single-stream decode): two sums in registers, even and odd groups */
                const float *xr = x + m0 * K;
                __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), w[4];
                int64_t g = 0;
                for (; g + 1 < G; g += 2) {
                    unpack_group(qw, bits, n, g, K, w);
                    acc0 = _mm256_fmadd_ps(group_dot(w, xr + g * GROUP), _mm256_set1_ps(sc[g]), acc0);
                    unpack_group(qw, bits, n, g + 1, K, w);
                    acc1 = _mm256_fmadd_ps(group_dot(w, xr + (g + 1) * GROUP), _mm256_set1_ps(sc[g + 1]), acc1);
                }
                if (g < G) {
                    unpack_group(qw, bits, n, g, K, w);
                    acc0 = _mm256_fmadd_ps(group_dot(w, xr + g * GROUP), _mm256_set1_ps(sc[g]), acc0);
                }
                dot[0] = hsum(_mm256_add_ps(acc0, acc1));
            } else {
                __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t g = 0; g < G; g++) {
                    __m256 w[4];
                    unpack_group(qw, bits, n, g, K, w);
                    const __m256 s = _mm256_set1_ps(sc[g]);
                    for (int64_t i = 0; i < mc; i++)
                        acc[i] = _mm256_fmadd_ps(group_dot(w, x + (m0 + i) * K + g * GROUP), s, acc[i]);
                }
                for (int64_t i = 0; i < mc; i++) dot[i] = hsum(acc[i]);
            }
#else
            for (int64_t g = 0; g < G; g++) {
                float w[GROUP];
                unpack_group(qw, bits, n, g, K, w);
                for (int64_t i = 0; i < mc; i++) {
                    const float *xg = x + (m0 + i) * K + g * GROUP;
                    float d[2] = {0.f, 0.f};
                    for (int j = 0; j < GROUP; j++) d[sg == 2 && j >= 16] += w[j] * xg[j];
                    dot[i] += sg == 2 ? d[0] * sc[2 * g] + d[1] * sc[2 * g + 1] : d[0] * sc[g];
                }
            }
#endif
            for (int64_t i = 0; i < mc; i++) {
                y[(m0 + i) * N + n] = mn ? dot[i] + dot_f32(mn, xsum + (m0 + i) * G, G) : dot[i];
            }
        }
    }
    free(xsum);
}

void int4_matmul(const float *x, const uint8_t *qw, const float *scales, const float *mins,
                 float *y, int64_t M, int64_t N, int64_t K) {
    quant_matmul(4, 1, x, qw, scales, mins, y, M, N, K);
}

void int8_matmul(const float *x, const int8_t *qw, const float *scales, const float *mins, float *y,
                 int64_t M, int64_t N, int64_t K) {
    quant_matmul(8, 1, x, (const uint8_t *)qw, scales, mins, y, M, N, K);
}

void int8_matmul_g16(const float *x, const int8_t *qw, const float *scales, const float *mins, float *y,
                     int64_t M, int64_t N, int64_t K) {
    quant_matmul(8, 2, x, (const uint8_t *)qw, scales, mins, y, M, N, K);
}

/* W as float32 [N, K]: q * scale + min, multiplied then added (not fused), as GGUF's reference does
 * (sg scales per group: 2, each half of a group its own) */
static inline void quant_dequantize(int bits, int sg, const uint8_t *qw, const float *scales, const float *mins,
                                    float *w, int64_t N, int64_t K) {
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            const float *s = scales + (n * G + g) * sg, mn = mins ? mins[n * G + g] : 0.f;
            float *o = w + n * K + g * GROUP;
#ifdef __AVX2__
            __m256 q[4];
            unpack_group(qw, bits, n, g, K, q);
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(q[i], _mm256_set1_ps(s[sg == 2 ? i / 2 : 0])),
                                                          _mm256_set1_ps(mn)));
#else
            float q[GROUP];
            unpack_group(qw, bits, n, g, K, q);
            for (int j = 0; j < GROUP; j++) o[j] = q[j] * s[sg == 2 ? j / 16 : 0] + mn;
#endif
        }
}

void int4_dequantize(const uint8_t *qw, const float *scales, const float *mins, float *w, int64_t N, int64_t K) {
    quant_dequantize(4, 1, qw, scales, mins, w, N, K);
}

void int8_dequantize(const int8_t *qw, const float *scales, const float *mins, float *w, int64_t N, int64_t K) {
    quant_dequantize(8, 1, (const uint8_t *)qw, scales, mins, w, N, K);
}

void int8_dequantize_g16(const int8_t *qw, const float *scales, const float *mins, float *w, int64_t N, int64_t K) {
    quant_dequantize(8, 2, (const uint8_t *)qw, scales, mins, w, N, K);
}

/* ---- int8 activations (quantization "w4a8") ----------------------------------------------------
 *
 * Each row of x is rounded per group of 32 to int8 as GGUF's Q8_0 rounds it: d = max|x_g| / 127,
 * q = round(x_g / d), so x is replaced by xr = q * d. The result is W_dequantized . xr up to float
 * summation order, whatever the number of rows (the batched path computes exactly that in float32):
 *   y[m, n] = sum_g scale[n, g] * d[m, g] * (q_w . q_x) + min[n, g] * d[m, g] * sum(q_x)
 * (GGUF's Q8_1 keeps d * sum(q) for the same min term). The integer dot runs on AVX2's maddubs
 * (unsigned 8-bit x signed 8-bit, adjacent pairs summed into int16) and madd (pairs of int16 into
 * int32): 32 products in two instructions, where float32 needs four FMAs and first has to widen every
 * nibble to a float. 4-bit weights (0..15) times activations (-127..127) sum to at most 2*15*127 = 3,810
 * a pair, int8 weights (|q| <= 128, sign moved onto the activation) to 32,512: neither saturates int16.
 * Integer dots are exact, and a row is summed in the same order whatever the number of rows, so its
 * result does not depend on its batch. A group holding NaN or infinity gets d = NaN: its row's
 * results are NaN, as float32's would be (or infinite) and never silently finite.
 */

/* x [M, K] -> qx [M, K] int8, d and d * sum(q) [M, K/32]; xr (if not NULL) [M, K] = q * d */
static void quantize_rows_q8(const float *x, int64_t M, int64_t K, int8_t *qx, float *d, float *xsum, float *xr) {
    const int64_t R = M * (K / GROUP);
#pragma omp parallel for schedule(static) if (R > 512)
    for (int64_t r = 0; r < R; r++) {
        const float *xg = x + r * GROUP;
        int8_t *q = qx + r * GROUP;
#ifdef __AVX2__
        __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xg + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]));
            sum = _mm256_add_ps(sum, v[i]);
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float s = hsum(sum);
        float dg = _mm_cvtss_f32(h) / 127.f;
#else
        float amax = 0.f, s = 0.f;
        for (int j = 0; j < GROUP; j++) {
            amax = fabsf(xg[j]) > amax ? fabsf(xg[j]) : amax;
            s += xg[j];
        }
        float dg = amax / 127.f;
#endif
        if (isnan(s) || isinf(s)) dg = NAN;  /* a NaN element or an infinity (the max drops NaN) */
        const float id = dg > 0.f ? 1.f / dg : 0.f;
        d[r] = dg;
#ifdef __AVX2__
        __m256i iq[4], isum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {  /* rounded to nearest, ties to even, as lrintf */
            iq[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
            isum = _mm256_add_epi32(isum, iq[i]);
            if (xr) _mm256_storeu_ps(xr + r * GROUP + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(iq[i]), _mm256_set1_ps(dg)));
        }
        /* packs work within 128-bit lanes: the permute puts the 32 bytes back in element order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)q, p);
        xsum[r] = dg * hsum(_mm256_cvtepi32_ps(isum));
#else
        int32_t isum = 0;
        for (int j = 0; j < GROUP; j++) {
            q[j] = (int8_t)lrintf(xg[j] * id);
            isum += q[j];
            if (xr) xr[r * GROUP + j] = (float)q[j] * dg;
        }
        xsum[r] = dg * (float)isum;
#endif
    }
}

#ifdef __AVX2__
/* group g of weight row n as 32 bytes: 4-bit values 0..15 in element order, or the int8 bytes */
static inline __m256i load_group_i8(const uint8_t *qw, int bits, int64_t n, int64_t g, int64_t K) {
    if (bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(qw + n * (K / 2) + g * 16));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
    }
    return _mm256_loadu_si256((const __m256i *)(qw + n * K + g * GROUP));
}

/* the 32 products of one group summed in eight int32 lanes, as floats */
static inline __m256 group_dot_i8(int bits, __m256i w, const int8_t *xg) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xg);
    const __m256i p = bits == 4 ? _mm256_maddubs_epi16(w, xv)
                                : _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

#define A8_ROWS 4   /* rows of x sharing each loaded weight group */
#define A8_COLS 16  /* weight rows a thread takes at a time: they and the 4 rows of x stay in L1 */

/* rows m0 .. m0+mc of y for weight row n; two chains (even and odd groups) per row */
static inline __attribute__((always_inline)) void a8_rows(
        int bits, int mc, const int8_t *qx, const float *dx, const float *xsum, const uint8_t *qw,
        const float *sc, const float *mn, float *y, int64_t m0, int64_t n, int64_t N, int64_t K) {
    const int64_t G = K / GROUP;
#ifdef __AVX2__
    __m256 acc0[A8_ROWS], acc1[A8_ROWS];  /* even and odd groups (indexing by g & 1 would keep them in memory) */
    for (int i = 0; i < mc; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 1 < G; g += 2) {
        const __m256i w0 = load_group_i8(qw, bits, n, g, K), w1 = load_group_i8(qw, bits, n, g + 1, K);
        for (int i = 0; i < mc; i++) {
            const int64_t r = (m0 + i) * G + g;
            acc0[i] = _mm256_fmadd_ps(group_dot_i8(bits, w0, qx + r * GROUP), _mm256_set1_ps(sc[g] * dx[r]), acc0[i]);
            acc1[i] = _mm256_fmadd_ps(group_dot_i8(bits, w1, qx + (r + 1) * GROUP),
                                      _mm256_set1_ps(sc[g + 1] * dx[r + 1]), acc1[i]);
        }
    }
    if (g < G) {
        const __m256i w0 = load_group_i8(qw, bits, n, g, K);
        for (int i = 0; i < mc; i++) {
            const int64_t r = (m0 + i) * G + g;
            acc0[i] = _mm256_fmadd_ps(group_dot_i8(bits, w0, qx + r * GROUP), _mm256_set1_ps(sc[g] * dx[r]), acc0[i]);
        }
    }
#endif
    for (int i = 0; i < mc; i++) {
        const int64_t row = (m0 + i) * G;
#ifdef __AVX2__
        float t = hsum(_mm256_add_ps(acc0[i], acc1[i]));
#else
        float t = 0.f;
        for (int64_t g = 0; g < G; g++) {
            int32_t dot = 0;
            for (int j = 0; j < GROUP; j++) {
                const int32_t wq = bits == 4 ? (qw[n * (K / 2) + g * 16 + (j & 15)] >> (j < 16 ? 0 : 4)) & 15
                                             : (int8_t)qw[n * K + g * GROUP + j];
                dot += wq * qx[(row + g) * GROUP + j];
            }
            t += (float)dot * (sc[g] * dx[row + g]);
        }
#endif
        y[(m0 + i) * N + n] = mn ? t + dot_f32(mn, xsum + row, G) : t;
    }
}

static void quant_matmul_a8(int bits, const float *x, const uint8_t *qw, const float *scales, const float *mins,
                            float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t G = K / GROUP;
    int8_t *qx = malloc(M * K + 32);
    float *dx = malloc(M * G * sizeof(float) + 4), *xsum = malloc(M * G * sizeof(float) + 4);
    quantize_rows_q8(x, M, K, qx, dx, xsum, NULL);
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += A8_COLS) {
        const int64_t n1 = n0 + A8_COLS < N ? n0 + A8_COLS : N;
        for (int64_t m0 = 0; m0 < M; m0 += A8_ROWS) {
            const int64_t mc = M - m0 < A8_ROWS ? M - m0 : A8_ROWS;
            for (int64_t n = n0; n < n1; n++) {
                const float *sc = scales + n * G, *mn = mins ? mins + n * G : NULL;
                switch (mc) {  /* a constant row count each: the loops over rows unroll */
                    case 4: a8_rows(bits, 4, qx, dx, xsum, qw, sc, mn, y, m0, n, N, K); break;
                    case 3: a8_rows(bits, 3, qx, dx, xsum, qw, sc, mn, y, m0, n, N, K); break;
                    case 2: a8_rows(bits, 2, qx, dx, xsum, qw, sc, mn, y, m0, n, N, K); break;
                    default: a8_rows(bits, 1, qx, dx, xsum, qw, sc, mn, y, m0, n, N, K); break;
                }
            }
        }
    }
    free(qx);
    free(dx);
    free(xsum);
}

void int4_matmul_a8(const float *x, const uint8_t *qw, const float *scales, const float *mins, float *y,
                    int64_t M, int64_t N, int64_t K) {
    quant_matmul_a8(4, x, qw, scales, mins, y, M, N, K);
}

void int8_matmul_a8(const float *x, const int8_t *qw, const float *scales, const float *mins, float *y,
                    int64_t M, int64_t N, int64_t K) {
    quant_matmul_a8(8, x, (const uint8_t *)qw, scales, mins, y, M, N, K);
}

/* x rounded as the kernels above round it: qx [M, K] int8 and d [M, K/32] (each may be NULL), and
 * xr [M, K] = q * d (may be NULL) */
void quantize_activations_q8(const float *x, int8_t *qx, float *d, float *xr, int64_t M, int64_t K) {
    const int64_t G = K / GROUP;
    int8_t *q = qx ? qx : malloc(M * K + 32);
    float *dd = d ? d : malloc(M * G * sizeof(float) + 4), *xsum = malloc(M * G * sizeof(float) + 4);
    quantize_rows_q8(x, M, K, q, dd, xsum, xr);
    if (!qx) free(q);
    if (!d) free(dd);
    free(xsum);
}

/* ---- float32 weights, few rows (decode) -----------------------------------------------------------
 * y [M, N] = x [M, K] . W^T for the handful of rows a decode step has. A BLAS GEMM spends more on its
 * set-up than a single row's bandwidth-bound work takes; this streams the weight once, laid out as
 * panels of 16 output rows ([ceil(N / 16), K, 16], zero padded: each panel one sequential read).
 *
 * Each y[m, n] is summed exactly as oneDNN's AVX2 GEMM sums it: a chain of FMAs over k in order within
 * blocks of 1024, the blocks' sums added in order (pagedllm.layers.linear checks this at start-up and
 * keeps oneDNN for every row count where it does not hold). So a row's result does not depend on
 * whether its batch went through this kernel or the GEMM. Chains run 8 lanes wide across n; a group of
 * panels (4 for one row, 2 for two, 1 for three or four) keeps 8 to 12 chains in flight.
 */
#define PANEL 16
#define KBLOCK 1024

static inline __attribute__((always_inline)) void f32_panels(int mc, int np, const float *x, const float *panels,
                                                             float *y, int64_t m0, int64_t p0, int64_t M, int64_t N,
                                                             int64_t K) {
#ifdef __AVX2__
    __m256 tot[4][4][2], acc[4][4][2];
    for (int64_t kb0 = 0; kb0 < K; kb0 += KBLOCK) {
        const int64_t kb1 = kb0 + KBLOCK < K ? kb0 + KBLOCK : K;
        for (int i = 0; i < mc; i++)
            for (int t = 0; t < np; t++) acc[i][t][0] = acc[i][t][1] = _mm256_setzero_ps();
        for (int64_t k = kb0; k < kb1; k++) {
            __m256 w[4][2];
            for (int t = 0; t < np; t++) {
                const float *pw = panels + ((p0 + t) * K + k) * PANEL;
                w[t][0] = _mm256_loadu_ps(pw);
                w[t][1] = _mm256_loadu_ps(pw + 8);
            }
            for (int i = 0; i < mc; i++) {
                const __m256 xb = _mm256_broadcast_ss(x + (m0 + i) * K + k);
                for (int t = 0; t < np; t++) {
                    acc[i][t][0] = _mm256_fmadd_ps(xb, w[t][0], acc[i][t][0]);
                    acc[i][t][1] = _mm256_fmadd_ps(xb, w[t][1], acc[i][t][1]);
                }
            }
        }
        for (int i = 0; i < mc; i++)
            for (int t = 0; t < np; t++)
                for (int h = 0; h < 2; h++)
                    tot[i][t][h] = kb0 == 0 ? acc[i][t][h] : _mm256_add_ps(tot[i][t][h], acc[i][t][h]);
    }
    for (int i = 0; i < mc; i++)
        for (int t = 0; t < np; t++) {
            float out[PANEL];
            _mm256_storeu_ps(out, tot[i][t][0]);
            _mm256_storeu_ps(out + 8, tot[i][t][1]);
            const int64_t n0 = (p0 + t) * PANEL;
            for (int j = 0; j < PANEL && n0 + j < N; j++) y[(m0 + i) * N + n0 + j] = out[j];
        }
#else
    for (int i = 0; i < mc; i++)
        for (int t = 0; t < np; t++)
            for (int j = 0; j < PANEL; j++) {
                const int64_t n = (p0 + t) * PANEL + j;
                if (n >= N) break;
                float total = 0.f;
                for (int64_t kb0 = 0; kb0 < K; kb0 += KBLOCK) {
                    float a = 0.f;
                    for (int64_t k = kb0; k < K && k < kb0 + KBLOCK; k++)
                        a = fmaf(x[(m0 + i) * K + k], panels[((p0 + t) * K + k) * PANEL + j], a);
                    total = kb0 == 0 ? a : total + a;
                }
                y[(m0 + i) * N + n] = total;
            }
#endif
}

void f32_matmul(const float *x, const float *panels, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t NP = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p0 = 0; p0 < NP; p0 += 4)
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mc = M - m0 < 4 ? M - m0 : 4, group = mc == 1 ? 4 : mc == 2 ? 2 : 1;
            for (int64_t p = p0; p < p0 + 4 && p < NP;) {
                if (group == 4 && p + 4 <= NP) { f32_panels(1, 4, x, panels, y, m0, p, M, N, K); p += 4; }
                else if (group == 2 && p + 2 <= NP) { f32_panels(2, 2, x, panels, y, m0, p, M, N, K); p += 2; }
                else {
                    switch (mc) {
                        case 1: f32_panels(1, 1, x, panels, y, m0, p, M, N, K); break;
                        case 2: f32_panels(2, 1, x, panels, y, m0, p, M, N, K); break;
                        case 3: f32_panels(3, 1, x, panels, y, m0, p, M, N, K); break;
                        default: f32_panels(4, 1, x, panels, y, m0, p, M, N, K); break;
                    }
                    p += 1;
                }
            }
        }
}
