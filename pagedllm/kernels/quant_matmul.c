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
 *
 * Rows n are split across OpenMP threads; the library is linked against the
 * libgomp PyTorch already loaded, so both share one thread pool.
 */
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

/* y[m, n] = sum_g scale[n, g] * (q_g . x_g) + min[n, g] * sum(x_g), for 4- or 8-bit q */
static inline void quant_matmul(int bits, const float *x, const uint8_t *qw, const float *scales,
                                const float *mins, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t G = K / GROUP;
    float *xsum = group_sums(x, M, K);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *sc = scales + n * G, *mn = mins + n * G;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {  /* up to 4 rows of x share each unpacked group */
            const int64_t mc = M - m0 < 4 ? M - m0 : 4;
            float dot[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef __AVX2__
            if (mc == 1) {  /* one row (single-stream decode): two sums in registers, even and odd groups */
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
                    float d = 0.f;
                    for (int j = 0; j < GROUP; j++) d += w[j] * xg[j];
                    dot[i] += d * sc[g];
                }
            }
#endif
            for (int64_t i = 0; i < mc; i++) {
                const float *xs = xsum + (m0 + i) * G;
                float t = dot[i];
                for (int64_t g = 0; g < G; g++) t += mn[g] * xs[g];
                y[(m0 + i) * N + n] = t;
            }
        }
    }
    free(xsum);
}

void int4_matmul(const float *x, const uint8_t *qw, const float *scales, const float *mins,
                 float *y, int64_t M, int64_t N, int64_t K) {
    quant_matmul(4, x, qw, scales, mins, y, M, N, K);
}

void int8_matmul(const float *x, const int8_t *qw, const float *scales, const float *mins, float *y,
                 int64_t M, int64_t N, int64_t K) {
    quant_matmul(8, x, (const uint8_t *)qw, scales, mins, y, M, N, K);
}

/* W as float32 [N, K]: q * scale + min, multiplied then added (not fused), as GGUF's reference does */
static inline void quant_dequantize(int bits, const uint8_t *qw, const float *scales, const float *mins, float *w,
                                    int64_t N, int64_t K) {
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            const float s = scales[n * G + g], mn = mins[n * G + g];
            float *o = w + n * K + g * GROUP;
#ifdef __AVX2__
            __m256 q[4];
            unpack_group(qw, bits, n, g, K, q);
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(q[i], _mm256_set1_ps(s)), _mm256_set1_ps(mn)));
#else
            float q[GROUP];
            unpack_group(qw, bits, n, g, K, q);
            for (int j = 0; j < GROUP; j++) o[j] = q[j] * s + mn;
#endif
        }
}

void int4_dequantize(const uint8_t *qw, const float *scales, const float *mins, float *w, int64_t N, int64_t K) {
    quant_dequantize(4, qw, scales, mins, w, N, K);
}

void int8_dequantize(const int8_t *qw, const float *scales, const float *mins, float *w, int64_t N, int64_t K) {
    quant_dequantize(8, (const uint8_t *)qw, scales, mins, w, N, K);
}
