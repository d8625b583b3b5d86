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
 * int8 with a scale and a min per 16 (the *_g16 entry points, GGUF's Q6_K, Q3_K, Q2_K): scale[n, k / 16],
 * min[n, k / 16].
 * mins may be NULL: every min 0 (GGUF's Q8_0 / Q5_0 / Q6_K), neither stored nor added.
 *
 * Rows n are split across OpenMP threads; the library is linked against the
 * libgomp PyTorch already loaded, so both share one thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

/* per row of x, the sum of each group of `size` (32, or 16 for a min per 16): what the groups' mins multiply */
static float *group_sums(const float *x, int64_t M, int64_t K, int size) {
    const int64_t G = K / size;
    float *xsum = malloc(M * G * sizeof(float));
    for (int64_t r = 0; r < M * G; r++) {
        float s = 0.f;
        for (int j = 0; j < size; j++) s += x[r * size + j];
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
 * scales and mins per group (int8 only), each half of a group takes its own */
static inline void quant_matmul(int bits, int sg, const float *x, const uint8_t *qw, const float *scales,
                                const float *mins, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t G = K / GROUP;
    float *xsum = mins ? group_sums(x, M, K, GROUP / sg) : NULL;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *sc = scales + n * G * sg, *mn = mins ? mins + n * G * sg : NULL;
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
                y[(m0 + i) * N + n] = mn ? dot[i] + dot_f32(mn, xsum + (m0 + i) * G * sg, G * sg) : dot[i];
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
 * (sg scales and mins per group: 2, each half of a group its own) */
static inline void quant_dequantize(int bits, int sg, const uint8_t *qw, const float *scales, const float *mins,
                                    float *w, int64_t N, int64_t K) {
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            const float *s = scales + (n * G + g) * sg, *mn = mins ? mins + (n * G + g) * sg : NULL;
            float *o = w + n * K + g * GROUP;
#ifdef __AVX2__
            __m256 q[4];
            unpack_group(qw, bits, n, g, K, q);
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(q[i], _mm256_set1_ps(s[sg == 2 ? i / 2 : 0])),
                                                          _mm256_set1_ps(mn ? mn[sg == 2 ? i / 2 : 0] : 0.f)));
#else
            float q[GROUP];
            unpack_group(qw, bits, n, g, K, q);
            for (int j = 0; j < GROUP; j++) o[j] = q[j] * s[sg == 2 ? j / 16 : 0] + (mn ? mn[sg == 2 ? j / 16 : 0] : 0.f);
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
 *
 * int16 activations (quantization "w4a16", digits = 2): a group is rounded to q in -32512..32512 with
 * d = max|x_g| / 32512 and kept as two int8 digits, q = 255 * hi + lo (both -127..127: base 255, not 256,
 * keeps -128 out, which the sign trick of int8 weights cannot negate), 32 bytes of hi then 32 of lo. Each
 * digit runs through the same integer dot, and q_w . q = 255 * (q_w . hi) + q_w . lo is still exact in
 * int32: two dot products for 16 bits, the float32 function to about 1e-5.
 */

/* x [M, K] -> qx [M, K * digits] int8 (per group: hi, then lo), d and d * sum(q) [M, K/32]; qsum (if not
 * NULL) [M, K/32] = sum(q); xr (if not NULL) [M, K] = q * d */
static void quantize_rows_q8(const float *x, int64_t M, int64_t K, int digits, int8_t *qx, float *d, float *xsum,
                             int32_t *qsum, float *xr) {
    const int64_t R = M * (K / GROUP);
    const float qmax = digits == 2 ? 32512.f : 127.f;
#pragma omp parallel for schedule(static) if (R > 512)
    for (int64_t r = 0; r < R; r++) {
        const float *xg = x + r * GROUP;
        int8_t *q = qx + r * GROUP * digits;
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
        float dg = _mm_cvtss_f32(h) / qmax;
#else
        float amax = 0.f, s = 0.f;
        for (int j = 0; j < GROUP; j++) {
            amax = fabsf(xg[j]) > amax ? fabsf(xg[j]) : amax;
            s += xg[j];
        }
        float dg = amax / qmax;
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
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        if (digits == 2) {
            __m256i hi[4], lo[4];
            for (int i = 0; i < 4; i++) {  /* hi = round(q / 255): no ties, q being an integer */
                hi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(iq[i]), _mm256_set1_ps(1.f / 255)));
                lo[i] = _mm256_sub_epi32(iq[i], _mm256_mullo_epi32(hi[i], _mm256_set1_epi32(255)));
            }
            const __m256i ph = _mm256_packs_epi16(_mm256_packs_epi32(hi[0], hi[1]), _mm256_packs_epi32(hi[2], hi[3]));
            const __m256i pl = _mm256_packs_epi16(_mm256_packs_epi32(lo[0], lo[1]), _mm256_packs_epi32(lo[2], lo[3]));
            _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(ph, order));
            _mm256_storeu_si256((__m256i *)(q + GROUP), _mm256_permutevar8x32_epi32(pl, order));
        } else {
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3]));
            _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, order));
        }
        const float qs = hsum(_mm256_cvtepi32_ps(isum));  /* exact: |sum(q)| <= 32 * 32512 < 2^24 */
        xsum[r] = dg * qs;
        if (qsum) qsum[r] = (int32_t)qs;
#else
        int32_t isum = 0;
        for (int j = 0; j < GROUP; j++) {
            const int32_t v = (int32_t)lrintf(xg[j] * id);
            if (digits == 2) {
                const int32_t hi = (int32_t)lrintf((float)v * (1.f / 255));
                q[j] = (int8_t)hi;
                q[GROUP + j] = (int8_t)(v - 255 * hi);
            } else {
                q[j] = (int8_t)v;
            }
            isum += v;
            if (xr) xr[r * GROUP + j] = (float)v * dg;
        }
        xsum[r] = dg * (float)isum;
        if (qsum) qsum[r] = isum;
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

/* the 32 products of one group with one digit of x summed in eight int32 lanes */
static inline __m256i digit_dot(int bits, __m256i w, const int8_t *xg) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xg);
    const __m256i u = bits == 4 ? w : _mm256_abs_epi8(w), v = bits == 4 ? xv : _mm256_sign_epi8(xv, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, v);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

/* the group's dot with x's digits (one, or hi and lo: 255 * hi + lo), as eight float lanes */
static inline __m256 group_dot_i8(int bits, int digits, __m256i w, const int8_t *xg) {
    __m256i t = digit_dot(bits, w, xg);
    if (digits == 2)
        t = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(t, 8), t), digit_dot(bits, w, xg + GROUP));
    return _mm256_cvtepi32_ps(t);
}
#endif

#define A8_ROWS 4   /* rows of x sharing each loaded weight group */
#define A8_COLS 16  /* weight rows a thread takes at a time: they and the 4 rows of x stay in L1 */

/* rows m0 .. m0+mc of y for weight row n; two chains (even and odd groups) per row */
static inline __attribute__((always_inline)) void a8_rows(
        int bits, int digits, int mc, const int8_t *qx, const float *dx, const float *xsum, const uint8_t *qw,
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
            acc0[i] = _mm256_fmadd_ps(group_dot_i8(bits, digits, w0, qx + r * GROUP * digits),
                                      _mm256_set1_ps(sc[g] * dx[r]), acc0[i]);
            acc1[i] = _mm256_fmadd_ps(group_dot_i8(bits, digits, w1, qx + (r + 1) * GROUP * digits),
                                      _mm256_set1_ps(sc[g + 1] * dx[r + 1]), acc1[i]);
        }
    }
    if (g < G) {
        const __m256i w0 = load_group_i8(qw, bits, n, g, K);
        for (int i = 0; i < mc; i++) {
            const int64_t r = (m0 + i) * G + g;
            acc0[i] = _mm256_fmadd_ps(group_dot_i8(bits, digits, w0, qx + r * GROUP * digits),
                                      _mm256_set1_ps(sc[g] * dx[r]), acc0[i]);
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
            const int8_t *xg = qx + (row + g) * GROUP * digits;
            for (int j = 0; j < GROUP; j++) {
                const int32_t wq = bits == 4 ? (qw[n * (K / 2) + g * 16 + (j & 15)] >> (j < 16 ? 0 : 4)) & 15
                                             : (int8_t)qw[n * K + g * GROUP + j];
                dot += wq * (digits == 2 ? 255 * xg[j] + xg[GROUP + j] : xg[j]);
            }
            t += (float)dot * (sc[g] * dx[row + g]);
        }
#endif
        y[(m0 + i) * N + n] = mn ? t + dot_f32(mn, xsum + row, G) : t;
    }
}

/* ---- int8 activations, many rows: a register-blocked integer GEMM -----------------------------------
 * Above A8_GEMM_ROWS rows (prefill, batched decode) the rows of x are rounded as above and multiplied
 * through a GEMM that keeps the products in integers, as llama.cpp's repacked Q4_0 GEMMs do. A thread
 * takes PANELS panels of PW weight rows (PW = 16 with AVX-512, else 8) and repacks them once per call into
 * its own buffer: for each group, 8 vectors, vector c holding elements 4c..4c+3 of each of the panel's
 * rows (one row a 32-bit lane; 4-bit values widened to bytes 0..15). One multiply-add of 4-byte dots
 * (VNNI's vpdpbusd, or AVX2's maddubs + madd) then takes each lane's 4 weights times 4 bytes of x
 * broadcast to every lane: PW outputs at once, no horizontal sum. A group's int32 dots are scaled once:
 *   y[m, n] += scale[n, g] * d[m, g] * dot + min[n, g] * d[m, g] * sum(q_x)
 * in group order, one chain per output, so a row's result does not depend on the other rows of its
 * batch (it may differ from the few-row kernel's above in the last bits: another summation order).
 * vpdpbusd multiplies unsigned by signed bytes: the weights are the unsigned side, int8 ones packed as
 * q_w + 128 (0..255), and 128 * sum(q_x) of each group then comes off the dot. Without VNNI, maddubs sums
 * those products in pairs into int16, which 2 * 255 * 127 would overflow: int8 weights keep the float
 * GEMM there (a8_gemm_available). */
#define A8_GEMM_ROWS 3  /* more rows than this take the GEMM (measured faster from 4 rows on) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define A8_VNNI 1
#define PW 16
#define GM 4
#define NPB 2  /* panels in a register block: GM x NPB int32 and float accumulators of 32 registers */
typedef __m512i vi_t;
typedef __m512 vf_t;
#define vi_zero() _mm512_setzero_si512()
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_set1(b) _mm512_set1_epi32(b)
#define vi_sub(a, b) _mm512_sub_epi32(a, b)
#define vi_slli(a, n) _mm512_slli_epi32(a, n)
#define vdp(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define vf_zero() _mm512_setzero_ps()
#define vf_load(p) _mm512_loadu_ps(p)
#define vf_store(p, v) _mm512_storeu_ps(p, v)
#define vf_set1(x) _mm512_set1_ps(x)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_cvt(a) _mm512_cvtepi32_ps(a)
#elif defined(__AVX2__)
#if defined(__AVXVNNI__)
#define A8_VNNI 1
#define vdp(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define vdp(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif
#define PW 8
#define GM 4
#define NPB 1  /* 16 registers */
typedef __m256i vi_t;
typedef __m256 vf_t;
#define vi_zero() _mm256_setzero_si256()
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_set1(b) _mm256_set1_epi32(b)
#define vi_sub(a, b) _mm256_sub_epi32(a, b)
#define vi_slli(a, n) _mm256_slli_epi32(a, n)
#define vf_zero() _mm256_setzero_ps()
#define vf_load(p) _mm256_loadu_ps(p)
#define vf_store(p, v) _mm256_storeu_ps(p, v)
#define vf_set1(x) _mm256_set1_ps(x)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_cvt(a) _mm256_cvtepi32_ps(a)
#endif
#define PANELS 4  /* panels a thread packs and then sweeps over every row block (a multiple of NPB) */

int a8_gemm_available(int bits) {
#if defined(A8_VNNI)
    return 1;
#elif defined(__AVX2__)
    return bits == 4;
#else
    (void)bits;
    return 0;
#endif
}

#ifdef __AVX2__
/* Rows n0 .. n0+7 (past N: zero weights, scales and mins) into a panel's lanes h*8 .. h*8+7: w [G][8][PW]
 * 32-bit lanes of unsigned bytes (int8 weights plus 128), sc / mn [G][PW] floats. */
static void pack_rows8(int bits, const uint8_t *qw, const float *scales, const float *mins, int64_t n0, int h,
                       int64_t N, int64_t K, uint8_t *w, float *sc, float *mn) {
    const int64_t G = K / GROUP;
    for (int64_t g = 0; g < G; g++) {
        __m256i r[8];
        for (int j = 0; j < 8; j++) {
            const int64_t n = n0 + j, at = g * PW + h * 8 + j;
            r[j] = n < N ? load_group_i8(qw, bits, n, g, K) : _mm256_setzero_si256();
            if (bits == 8) r[j] = _mm256_xor_si256(r[j], _mm256_set1_epi8((char)0x80));  /* q + 128 */
            sc[at] = n < N ? scales[n * G + g] : 0.f;
            mn[at] = n < N && mins ? mins[n * G + g] : 0.f;
        }
        /* 8 x 8 transpose of 32-bit elements: vector c, lane j = row j's bytes 4c..4c+3 */
        __m256i t[8], u[8];
        for (int j = 0; j < 8; j += 2) {
            t[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
            t[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
        }
        for (int j = 0; j < 8; j += 4) {
            u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);
            u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
            u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);
            u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
        }
        /* u[0..3] hold rows 0-3, u[4..7] rows 4-7, as elements (c, c + 4) in their 128-bit lanes */
        uint8_t *out = w + (g * 8 * PW + h * 8) * 4;
        for (int c = 0; c < 4; c++) {
            _mm256_storeu_si256((__m256i *)(out + c * PW * 4), _mm256_permute2x128_si256(u[c], u[c + 4], 0x20));
            _mm256_storeu_si256((__m256i *)(out + (c + 4) * PW * 4), _mm256_permute2x128_si256(u[c], u[c + 4], 0x31));
        }
    }
}

/* a[i][p] += one group's dots of np packed panels (their group at wg, P lanes apart) with one digit of rows
 * m0 .. m0+mc of x (xg: the digit's 32 bytes in row 0, rows ldx bytes apart) */
static inline __attribute__((always_inline)) void digit_pass(int mc, int np, vi_t a[GM][NPB], const uint8_t *wg,
                                                             int64_t P, const int8_t *xg, int64_t ldx, int64_t m0) {
    for (int c = 0; c < 8; c++) {
        vi_t wc[NPB];
        for (int p = 0; p < np; p++) wc[p] = vi_load(wg + p * P * 32 + c * PW * 4);
        for (int i = 0; i < mc; i++) {
            int32_t b;
            memcpy(&b, xg + (m0 + i) * ldx + 4 * c, 4);
            const vi_t xb = vi_set1(b);
            for (int p = 0; p < np; p++) a[i][p] = vdp(a[i][p], wc[p], xb);
        }
    }
}

/* y[m0 .. m0+mc, n0 .. n0+nc] from np (<= NPB) packed panels, P lanes apart; qsum[m, g] = sum(q_x), for int8
 * weights (stored + 128: 128 * sum(q_x) comes off each dot). */
static inline __attribute__((always_inline)) void gemm_block(
        int bits, int digits, int mc, int np, const uint8_t *w, const float *sc, const float *mn, const int32_t *qsum,
        int64_t P, int has_mins, const int8_t *qx, const float *dx, const float *xsum, float *y, int64_t m0,
        int64_t n0, int64_t N, int64_t K) {
    const int64_t G = K / GROUP;
    vf_t f[GM][NPB];
    for (int i = 0; i < mc; i++)
        for (int p = 0; p < np; p++) f[i][p] = vf_zero();
    for (int64_t g = 0; g < G; g++) {
        vi_t a[GM][NPB];
        for (int i = 0; i < mc; i++)
            for (int p = 0; p < np; p++) a[i][p] = vi_zero();
        const uint8_t *wg = w + g * 8 * PW * 4;
        digit_pass(mc, np, a, wg, P, qx + g * GROUP * digits, K * digits, m0);
        if (digits == 2) {  /* then lo: a = 255 * (w . hi) + w . lo */
            for (int i = 0; i < mc; i++)
                for (int p = 0; p < np; p++) a[i][p] = vi_sub(vi_slli(a[i][p], 8), a[i][p]);
            digit_pass(mc, np, a, wg, P, qx + g * GROUP * 2 + GROUP, K * 2, m0);
        }
        for (int p = 0; p < np; p++) {
            const vf_t s = vf_load(sc + p * P + g * PW);
            for (int i = 0; i < mc; i++) {
                const int64_t r = (m0 + i) * G + g;
                if (bits == 8) a[i][p] = vi_sub(a[i][p], vi_set1(128 * qsum[r]));
                f[i][p] = vf_fma(vf_cvt(a[i][p]), vf_mul(s, vf_set1(dx[r])), f[i][p]);
                if (has_mins) f[i][p] = vf_fma(vf_load(mn + p * P + g * PW), vf_set1(xsum[r]), f[i][p]);
            }
        }
    }
    for (int i = 0; i < mc; i++)
        for (int p = 0; p < np; p++) {
            const int64_t c0 = n0 + p * PW;
            float *yr = y + (m0 + i) * N + c0;
            if (c0 + PW <= N) {
                vf_store(yr, f[i][p]);
            } else {
                float lanes[PW];
                vf_store(lanes, f[i][p]);
                for (int64_t j = 0; c0 + j < N; j++) yr[j] = lanes[j];
            }
        }
}

static void gemm_a8(int bits, int digits, const int8_t *qx, const float *dx, const float *xsum, const int32_t *qsum,
                    const uint8_t *qw, const float *scales, const float *mins, float *y, int64_t M, int64_t N,
                    int64_t K) {
    const int64_t G = K / GROUP, P = G * PW, chunks = (N + PW * PANELS - 1) / (PW * PANELS);
    const int has_mins = mins != NULL;
    /* A unit of work is a chunk of columns and a share of the rows. Chunks alone would leave threads idle
     * where they do not divide evenly (576 columns: 9 chunks, 5 against 4 on two threads), so then, with
     * rows enough, each chunk's rows are split between the threads (each packs the panels it uses). A
     * row's result does not depend on the split: its sums run the same way in any block of rows. */
    const int64_t nt = omp_get_max_threads();
    const int64_t splits = chunks % nt != 0 && M >= 2 * GM * nt ? nt : 1;
    const int64_t rows_per = ((M + splits - 1) / splits + GM - 1) / GM * GM;
#pragma omp parallel
    {
        /* per panel: P * 32 bytes of weights, P floats of scales and of mins */
        uint8_t *w = malloc(PANELS * P * 32 + 64);
        float *sc = malloc(PANELS * P * sizeof(float)), *mn = malloc(PANELS * P * sizeof(float));
        int64_t packed = -1;  /* the chunk whose panels w holds */
        int np = 0;
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < chunks * splits; unit++) {
            const int64_t ch = unit / splits, nbase = ch * PW * PANELS;
            const int64_t m_begin = unit % splits * rows_per, m_end = m_begin + rows_per < M ? m_begin + rows_per : M;
            if (ch != packed) {
                for (np = 0; np < PANELS && nbase + PW * np < N; np++)
                    for (int h = 0; h < PW / 8; h++)
                        pack_rows8(bits, qw, scales, mins, nbase + PW * np + 8 * h, h, N, K, w + np * P * 32,
                                   sc + np * P, mn + np * P);
                packed = ch;
            }
            for (int64_t m0 = m_begin; m0 < m_end; m0 += GM) {
                const int mc = m_end - m0 < GM ? (int)(m_end - m0) : GM;
                for (int p = 0; p < np; p += NPB) {
                    const int nb = np - p < NPB ? np - p : NPB;
#define GEMM_ARGS w + p * P * 32, sc + p * P, mn + p * P, qsum, P, has_mins, qx, dx, xsum, y, m0, \
                  nbase + PW * p, N, K
                    const int full = mc == GM && nb == NPB;  /* the full block: its loops unrolled */
                    if (bits == 4 && digits == 1) full ? gemm_block(4, 1, GM, NPB, GEMM_ARGS) : gemm_block(4, 1, mc, nb, GEMM_ARGS);
                    else if (bits == 4) full ? gemm_block(4, 2, GM, NPB, GEMM_ARGS) : gemm_block(4, 2, mc, nb, GEMM_ARGS);
                    else if (digits == 1) full ? gemm_block(8, 1, GM, NPB, GEMM_ARGS) : gemm_block(8, 1, mc, nb, GEMM_ARGS);
                    else full ? gemm_block(8, 2, GM, NPB, GEMM_ARGS) : gemm_block(8, 2, mc, nb, GEMM_ARGS);
#undef GEMM_ARGS
                }
            }
        }
        free(w);
        free(sc);
        free(mn);
    }
}
#endif

static void quant_matmul_a8(int bits, int digits, const float *x, const uint8_t *qw, const float *scales,
                            const float *mins, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t G = K / GROUP;
    int8_t *qx = malloc(M * K * digits + 32);
    float *dx = malloc(M * G * sizeof(float) + 4), *xsum = malloc(M * G * sizeof(float) + 4);
    const int gemm = M > A8_GEMM_ROWS && a8_gemm_available(bits);
    int32_t *qsum = gemm && bits == 8 ? malloc(M * G * sizeof(int32_t)) : NULL;  /* the int8 GEMM's correction */
    quantize_rows_q8(x, M, K, digits, qx, dx, xsum, qsum, NULL);
#ifdef __AVX2__
    if (gemm) {
        gemm_a8(bits, digits, qx, dx, xsum, qsum, qw, scales, mins, y, M, N, K);
        free(qx);
        free(dx);
        free(xsum);
        free(qsum);
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += A8_COLS) {
        const int64_t n1 = n0 + A8_COLS < N ? n0 + A8_COLS : N;
        for (int64_t m0 = 0; m0 < M; m0 += A8_ROWS) {
            const int64_t mc = M - m0 < A8_ROWS ? M - m0 : A8_ROWS;
            for (int64_t n = n0; n < n1; n++) {
                const float *sc = scales + n * G, *mn = mins ? mins + n * G : NULL;
#define A8_ROWS_CASES(D)                                                                         \
                switch (mc) { /* a constant row count each: the loops over rows unroll */             \
                    case 4: a8_rows(bits, D, 4, qx, dx, xsum, qw, sc, mn, y, m0, n, N, K); break;     \
                    case 3: a8_rows(bits, D, 3, qx, dx, xsum, qw, sc, mn, y, m0, n, N, K); break;     \
                    case 2: a8_rows(bits, D, 2, qx, dx, xsum, qw, sc, mn, y, m0, n, N, K); break;     \
                    default: a8_rows(bits, D, 1, qx, dx, xsum, qw, sc, mn, y, m0, n, N, K); break;    \
                }
                if (digits == 2) {
                    A8_ROWS_CASES(2)
                } else {
                    A8_ROWS_CASES(1)
                }
#undef A8_ROWS_CASES
            }
        }
    }
    free(qx);
    free(dx);
    free(xsum);
}

void int4_matmul_a8(const float *x, const uint8_t *qw, const float *scales, const float *mins, float *y,
                    int64_t M, int64_t N, int64_t K, int digits) {
    quant_matmul_a8(4, digits, x, qw, scales, mins, y, M, N, K);
}

void int8_matmul_a8(const float *x, const int8_t *qw, const float *scales, const float *mins, float *y,
                    int64_t M, int64_t N, int64_t K, int digits) {
    quant_matmul_a8(8, digits, x, (const uint8_t *)qw, scales, mins, y, M, N, K);
}

/* x rounded as the kernels above round it: qx [M, K * digits] int8 and d [M, K/32] (each may be NULL), and
 * xr [M, K] = q * d (may be NULL) */
void quantize_activations_q8(const float *x, int8_t *qx, float *d, float *xr, int64_t M, int64_t K, int digits) {
    const int64_t G = K / GROUP;
    int8_t *q = qx ? qx : malloc(M * K * digits + 32);
    float *dd = d ? d : malloc(M * G * sizeof(float) + 4), *xsum = malloc(M * G * sizeof(float) + 4);
    quantize_rows_q8(x, M, K, digits, q, dd, xsum, NULL, xr);
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
