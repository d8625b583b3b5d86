/* Fused elementwise ops of a decoder layer, float32 (see pagedllm/layers/fused.py).
 *
 * PyTorch runs each of these as five to eight separate ops, each a pass over
 * memory and a dispatch; on a 64-token decode batch that cost about 0.25 ms per
 * RMSNorm. Here each is one pass over the rows, rows shared out over PyTorch's
 * OpenMP threads when there are enough of them. Results match PyTorch's up to
 * summation order and (for SiLU) an exp polynomial within 2e-7 relative error.
 */
#include <math.h>
#include <stdint.h>
#include "vec_math.h"

#define PARALLEL_ROWS 16 /* fewer rows than this run on one thread: forking costs more than it saves */

/* x += residual (x becomes the new residual stream), then out = weight * x / rms(x). residual may be
 * NULL (no add). Rows are n floats, contiguous. */
void add_rms_norm(float *x, const float *residual, const float *weight, float *out, int64_t rows, int64_t n,
                  float eps) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n;
        float *o = out + r * n;
        float ss = 0.f;
        if (residual) {
            const float *rr = residual + r * n;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) {
                xr[i] += rr[i];
                ss += xr[i] * xr[i];
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        }
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}


/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: gate and up halves of one fused projection. */
void silu_mul(const float *gu, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#ifdef PAGEDLLM_AVX2
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Rotate-half RoPE: out[t, h] = (x1 cos - x2 sin, x2 cos + x1 sin) for the halves x1, x2 of x[t, h], with
 * per-token tables cos, sin [T, D/2]. x rows are x_stride floats apart (a view into the fused q|k|v
 * projection); heads within a row are D apart. out is [T, heads, D], contiguous. */
void rotary(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out, int64_t T,
            int64_t heads, int64_t D) {
    const int64_t half = D / 2;
#pragma omp parallel for if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = x + t * x_stride + h * D, *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * D, *o2 = o1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    }
}
