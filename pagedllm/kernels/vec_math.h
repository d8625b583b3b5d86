/* Vector math shared by the kernels. */
#ifndef PAGEDLLM_VEC_MATH_H
#define PAGEDLLM_VEC_MATH_H
#include <stdint.h>
#include <string.h>

/* a bfloat16 is a float32's upper half: widened exactly */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1

/* e^x, W / 32 at a time (W: 256 or 512 bits): 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2] and a degree-6
 * Taylor polynomial (relative error about 2e-7, as close to expf as a softmax or SiLU needs). x is clamped to
 * [-87, 88], so e^x below e^-87 comes out as 1.6e-38 rather than 0. The same operations lane by lane at either
 * width, so exp8 and exp16 give a value the same bits. (The constant first in min/max: they return their second
 * operand for a NaN, so NaN stays NaN.) */
#define DEFINE_EXP(NAME, W, ROUND)                                                                          \
    static inline __m##W NAME(__m##W x) {                                                                   \
        x = _mm##W##_min_ps(_mm##W##_set1_ps(88.f), _mm##W##_max_ps(_mm##W##_set1_ps(-87.f), x));          \
        const __m##W n = ROUND(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504f)),                           \
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                              \
        __m##W r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693145752f), x);                                \
        r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(1.42860677e-6f), r);                                     \
        __m##W p = _mm##W##_set1_ps(1.f / 720);                                                             \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.f / 120));                                           \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.f / 24));                                            \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.f / 6));                                             \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(0.5f));                                                \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.f));                                                 \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.f));                                                 \
        const __m##W##i e =                                                                                 \
            _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23); \
        return _mm##W##_mul_ps(p, _mm##W##_castsi##W##_ps(e));                                              \
    }
DEFINE_EXP(exp8, 256, _mm256_round_ps)

/* 8 bfloat16 widened to float32 */
static inline __m256 bf16x8_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* r[i] holds 8 floats of row i; after, r[j] holds element j of every row (lane i: row i's) */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int g = 0; g < 8; g += 4) {  /* s[g + e], 128-bit lane k: rows g .. g + 3 at element 4k + e */
        s[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
        s[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xEE);
        s[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        s[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
    }
    for (int e = 0; e < 4; e++) {  /* then the 2 x 2 transpose of 128-bit lanes */
        r[e] = _mm256_permute2f128_ps(s[e], s[4 + e], 0x20);
        r[4 + e] = _mm256_permute2f128_ps(s[e], s[4 + e], 0x31);
    }
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
DEFINE_EXP(exp16, 512, _mm512_roundscale_ps)

/* 16 bfloat16 widened to float32 */
static inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#if defined(__AVX512BF16__)
/* out [n] = x [n] rounded to bfloat16, to nearest even (AVX512_BF16's conversion) */
static inline void round_bf16(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
    for (; i < n; i++) {
        const __m128bh h = _mm_cvtneps_pbh(_mm_set_ss(x[i]));
        memcpy(out + i, &h, 2);
    }
}
#endif

/* r[i] holds 16 int32 of row i; after, r[j] holds element j of every row (lane i: row i's) */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16], s[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) {  /* s[g + e], 128-bit lane k: rows g .. g + 3 at element 4k + e */
        s[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        s[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        s[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        s[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int e = 0; e < 4; e++) {  /* then the 4 x 4 transpose of 128-bit lanes */
        const __m512i u0 = _mm512_shuffle_i32x4(s[e], s[4 + e], 0x44), u1 = _mm512_shuffle_i32x4(s[e], s[4 + e], 0xEE);
        const __m512i u2 = _mm512_shuffle_i32x4(s[8 + e], s[12 + e], 0x44);
        const __m512i u3 = _mm512_shuffle_i32x4(s[8 + e], s[12 + e], 0xEE);
        r[e] = _mm512_shuffle_i32x4(u0, u2, 0x88), r[4 + e] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(u1, u3, 0x88), r[12 + e] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
    }
}
#endif
#endif
