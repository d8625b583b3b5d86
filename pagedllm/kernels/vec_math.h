/* Vector math shared by the kernels. */
#ifndef PAGEDLLM_VEC_MATH_H
#define PAGEDLLM_VEC_MATH_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1

/* e^x, eight at a time: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor
 * polynomial (relative error about 2e-7, as close to expf as a softmax or SiLU needs). x is clamped
 * to [-87, 88], so e^x below e^-87 comes out as 1.6e-38 rather than 0. */
static inline __m256 exp8(__m256 x) {
    /* the constant first: max/min return their second operand for a NaN, so NaN stays NaN */
    x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
/* exp8's e^x sixteen at a time: the same operations lane by lane, so the same bits */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.f), _mm512_max_ps(_mm512_set1_ps(-87.f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

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
