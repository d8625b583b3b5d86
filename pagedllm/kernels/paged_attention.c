/* Decode attention straight from the paged KV cache (see pagedllm/attention/cpu_paged.py).
 *
 * One query token per request. A task (a request, or one kv head of it when there
 * are too few requests to keep the threads busy) walks the request's blocks in
 * place, scoring a whole block for every query head, then folds it into a
 * running softmax (max, sum, weighted V). K and V are read once, where they lie:
 * no gathered copy, no padding to the longest request; the next block's rows are
 * prefetched while this one is scored. Tasks are spread over PyTorch's OpenMP
 * threads. With AVX2, eight scores are reduced at once, softmax weights come from
 * a polynomial exp, and 64 output sums stay in registers over a block.
 *
 * Layout: q [nd, H, D] with row stride q_stride; k, v [num_blocks, bs, KVH, D];
 * block_tables [nd, table_stride]; positions [start[r], seq_len[r]) are attended.
 * The cache holds float32 (kv_dtype 0), bfloat16 (1), fp8 (2: each byte
 * widened through the 256-entry table lut, so e4m3 and e5m2 are one code path)
 * or int8 (3: a row's D values q, then its float32 scale s in 4 bytes: rows are
 * D + 4 bytes apart, and a value is q * s; see pagedllm/attention/kv_int8.py);
 * rows are widened to float32 as they are read.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vec_math.h"

#define MAX_BS 64
#define MAX_D 256
#define MAX_TASK_HEADS 32  /* query heads one task keeps running sums for */
#define PF_TOKENS 32  /* a prefill task's queries */
#define PF_KEYS 16    /* keys a tile (see the scores below) */
#define PF_ROWS (PF_TOKENS * MAX_TASK_HEADS)
/* rows the score kernels take at once: their sums in registers (AVX-512: 8 chains, as many as keep both FMA units
 * busy) */
#if defined(__AVX512F__)
#define SCORE_ROWS 8
#define ROWS_8_TO_5(CALL) case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; case 5: CALL(5); break;
#elif defined(PAGEDLLM_AVX2)  /* 6 rows x 2 registers of sums, the tile's 2 and a broadcast: 15 of 16 */
#define SCORE_ROWS 6
#define ROWS_8_TO_5(CALL) case 6: CALL(6); break; case 5: CALL(5); break;
#else
#define SCORE_ROWS 4
#define ROWS_8_TO_5(CALL)
#endif
/* CALL(r) with the row count r a constant in each case, so that a kernel's sums stay in registers: up to
 * SCORE_ROWS rows (the scores), or up to 6 (the weighted V: 6 rows x 4 registers) */
#define ROWS_4_TO_1(CALL) case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; default: CALL(1); break;
#define BY_SCORE_ROWS(n, CALL) switch (n) { ROWS_8_TO_5(CALL) ROWS_4_TO_1(CALL) }
#define BY_SIX_ROWS(n, CALL) switch (n) { case 6: CALL(6); break; case 5: CALL(5); break; ROWS_4_TO_1(CALL) }

/* elements from one cache row to the next of the same token: D, or D + 4 for int8's scale */
static inline int64_t row_elems(int kv_dtype, int64_t D) { return kv_dtype == 3 ? D + 4 : D; }

/* an int8 row's scale, the 4 bytes after its D values */
static inline float row_scale(const void *row, int64_t D) {
    float s;
    memcpy(&s, (const int8_t *)row + D, 4);
    return s;
}

/* the keys [*jlo, returned) of the tile at k0 (nk keys) that the query at pos sees: at or before it, within the
 * window (if any); none where *jlo is not below the returned end */
static inline int64_t keys_seen(int64_t pos, int64_t k0, int64_t nk, int64_t window, int64_t *jlo) {
    const int64_t lo = window > 0 ? pos - window + 1 - k0 : 0;
    *jlo = lo > 0 ? lo : 0;
    return pos - k0 + 1 < nk ? pos - k0 + 1 : nk;
}

static inline const float *row(const void *base, int64_t off, int kv_dtype, const float *lut, float *buf,
                               int64_t D) {
    if (kv_dtype == 0) return (const float *)base + off;
    if (kv_dtype == 3) {  /* q * s, float32 */
        const int8_t *p = (const int8_t *)base + off;
        const float s = row_scale(p, D);
        int64_t d = 0;
#if defined(__AVX512F__)
        const __m512 vs = _mm512_set1_ps(s);
        for (; d + 16 <= D; d += 16)
            _mm512_storeu_ps(buf + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(p + d)))), vs));
#elif defined(PAGEDLLM_AVX2)
        const __m256 vs = _mm256_set1_ps(s);
        for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(buf + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(p + d)))), vs));
#endif
        for (; d < D; d++) buf[d] = (float)p[d] * s;
        return buf;
    }
    if (kv_dtype == 1) {  /* a bfloat16 is a float32's upper half */
        const uint16_t *p = (const uint16_t *)base + off;
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= D; d += 16) _mm512_storeu_ps(buf + d, bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(p + d))));
#elif defined(PAGEDLLM_AVX2)
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(buf + d, bf16x8_to_f32(_mm_loadu_si128((const __m128i *)(p + d))));
#endif
        for (; d < D; d++) buf[d] = bf16_to_f32(p[d]);
    } else {
        const uint8_t *p = (const uint8_t *)base + off;
        for (int64_t d = 0; d < D; d++) buf[d] = lut[p[d]];
    }
    return buf;
}

/* Ask for the next block's K and V rows of a task's heads (bs rows of row_bytes, stride elements apart)
 * while this block is scored: blocks lie anywhere in the cache, which the hardware prefetcher does not
 * follow. */
static inline void prefetch_block(const void *k, const void *v, int64_t off, int64_t bs, int64_t stride,
                                  int64_t row_bytes, int64_t esize) {
    for (int64_t t = 0; t < bs; t++) {
        const int64_t at = (off + t * stride) * esize;
        for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch((const char *)k + at + b, 0, 3);
            __builtin_prefetch((const char *)v + at + b, 0, 3);
        }
    }
}

/* p[t] = e^(s[t] - m) for t in [lo, hi); returns their sum. */
static inline float exp_shifted(const float *s, float m, float *p, int64_t lo, int64_t hi) {
    float sum = 0.f;
    int64_t t = lo;
#if defined(__AVX512F__)
    if (hi - lo == 16) {  /* a whole tile at once: the 8-wide loop's very values and sum */
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + lo), _mm512_set1_ps(m)));
        _mm512_storeu_ps(p + lo, e);
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(_mm512_castps512_ps256(e), _mm512_extractf32x8_ps(e, 1)));
        for (int i = 0; i < 8; i++) sum += lanes[i];
        return sum;
    }
#endif
#ifdef PAGEDLLM_AVX2
    __m256 vsum = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m);
    for (; t + 8 <= hi; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
        _mm256_storeu_ps(p + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vsum);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; t < hi; t++) {
        p[t] = expf(s[t] - m);
        sum += p[t];
    }
    return sum;
}

#if defined(__AVX512F__)
/* an int8 row's 16 values from p: q * s, as row() widens them */
static inline __m512 i8x16(const int8_t *p, float s) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))), _mm512_set1_ps(s));
}

/* V row t's 16 elements from d: float32 rows (kind 0), bfloat16 (1) or int8 with their scales vs (3), widened in
 * registers to row()'s values */
static inline __m512 v16(const void *const *vrows, int kind, const float *vs, int64_t t, int64_t d) {
    if (kind == 1)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)vrows[t] + d))), 16));
    if (kind == 3) return i8x16((const int8_t *)vrows[t] + d, vs[t]);
    return _mm512_loadu_ps((const float *)vrows[t] + d);
}

/* nr rows' 64 running sums from acc (rows lda apart) into registers, and back */
static inline __attribute__((always_inline)) void sums_load(int nr, const float *acc, int64_t lda, __m512 a[6][4]) {
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < 4; c++) a[i][c] = _mm512_loadu_ps(acc + i * lda + 16 * c);
}

static inline __attribute__((always_inline)) void sums_store(int nr, float *acc, int64_t lda, __m512 a[6][4]) {
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + i * lda + 16 * c, a[i][c]);
}

/* accumulate() on elements [0, D) (D a multiple of 64) for rows i0 .. i0 + nr - 1 at once (acc rows lda apart,
 * their weights p rows PF_KEYS apart, the same keys [lo, hi)): each V row read once for all of them, the same
 * multiply-adds in the same order per row */
static inline __attribute__((always_inline)) void accumulate_nr(int nr, int i0, float *acc, int64_t lda, const float *p,
                                                                 const void *const *vrows, int kind, const float *vs,
                                                                 int64_t lo, int64_t hi, int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 a[6][4];
        sums_load(nr, acc + i0 * lda + d0, lda, a);
        for (int64_t t = lo; t < hi; t++) {
            __m512 vt[4];
            for (int c = 0; c < 4; c++) vt[c] = v16(vrows, kind, vs, t, d0 + 16 * c);
            for (int i = 0; i < nr; i++) {
                const __m512 pt = _mm512_set1_ps(p[(i0 + i) * PF_KEYS + t]);
                for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(pt, vt[c], a[i][c]);
            }
        }
        sums_store(nr, acc + i0 * lda + d0, lda, a);
    }
}

static inline void accumulate_rows(int n, float *acc, int64_t lda, const float *p, const void *const *vrows, int kind,
                                   const float *vs,
                                   int64_t lo, int64_t hi, int64_t D) {
    for (int i0 = 0; i0 < n; i0 += 6) {  /* six rows' 4 x 16 sums in registers at a time */
#define ACC(NR) accumulate_nr(NR, i0, acc, lda, p, vrows, kind, vs, lo, hi, D)
        BY_SIX_ROWS(n - i0 < 6 ? n - i0 : 6, ACC)
#undef ACC
    }
}
#elif defined(PAGEDLLM_AVX2)
#define V_ROWS 3  /* AVX2: 3 rows x 4 registers of sums, 3 broadcasts and a V register: all 16 */
/* accumulate() on elements [0, D) (D a multiple of 32) for rows i0 .. i0 + nr - 1 at once (acc rows lda apart,
 * their weights p rows PF_KEYS apart, the same keys [lo, hi)), float32 V rows: each read once for all of them,
 * the same multiply-adds in the same order per row */
static inline __attribute__((always_inline)) void accumulate_nr(int nr, int i0, float *acc, int64_t lda, const float *p,
                                                                 const float *const *vrows, int64_t lo, int64_t hi,
                                                                 int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m256 a[V_ROWS][4];
        for (int i = 0; i < nr; i++)
            for (int c = 0; c < 4; c++) a[i][c] = _mm256_loadu_ps(acc + (i0 + i) * lda + d0 + 8 * c);
        for (int64_t t = lo; t < hi; t++) {
            __m256 pt[V_ROWS];
            for (int i = 0; i < nr; i++) pt[i] = _mm256_set1_ps(p[(i0 + i) * PF_KEYS + t]);
            for (int c = 0; c < 4; c++) {
                __m256 vt = _mm256_loadu_ps(vrows[t] + d0 + 8 * c);
                __asm__("" : "+x"(vt));  /* one load for the rows, not one each folded into their multiply-adds */
                for (int i = 0; i < nr; i++) a[i][c] = _mm256_fmadd_ps(pt[i], vt, a[i][c]);
            }
        }
        for (int i = 0; i < nr; i++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + (i0 + i) * lda + d0 + 8 * c, a[i][c]);
    }
}

static inline void accumulate_rows(int n, float *acc, int64_t lda, const float *p, const void *const *vrows, int kind,
                                   const float *vs, int64_t lo, int64_t hi, int64_t D) {
    (void)kind, (void)vs;  /* float32 rows only */
    for (int i0 = 0, nr; i0 < n; i0 += nr) {
        /* rows 3 at a time, or 2 where 3 would leave one row alone (4 multiply-add chains: half the FMA units) */
        nr = n - i0 <= V_ROWS ? n - i0 : (n - i0) % V_ROWS == 1 ? 2 : V_ROWS;
#define ACC(NR) accumulate_nr(NR, i0, acc, lda, p, (const float *const *)vrows, lo, hi, D)
        switch (nr) { case 3: ACC(3); break; case 2: ACC(2); break; default: ACC(1); break; }
#undef ACC
    }
}
#endif

/* acc += sum over t in [lo, hi) of p[t] * v_t. */
static inline void accumulate(float *acc, const float *p, const float *const *vrows, int64_t lo, int64_t hi,
                              int64_t D) {
    int64_t d0 = 0;
#if defined(__AVX512F__)  /* the same sums, element by element, 16 lanes wide */
    d0 = D - D % 64;
    accumulate_nr(1, 0, acc, D, p, (const void *const *)vrows, 0, NULL, lo, hi, d0);
#endif
#ifdef PAGEDLLM_AVX2
    for (; d0 + 64 <= D; d0 += 64) {  /* 64 sums held in registers over the block's rows */
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(acc + d0 + 8 * i);
        for (int64_t t = lo; t < hi; t++) {
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vrows[t] + d0 + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
    }
#endif
    for (int64_t t = lo; t < hi; t++) {
        const float pt = p[t];
        const float *vt = vrows[t];
#pragma omp simd
        for (int64_t d = d0; d < D; d++) acc[d] += pt * vt[d];
    }
}

/* One query row's online softmax, before its weighted V: the running max m and sum l take scores s[lo, hi)
 * in, acc [D] rescaled where the max grew; the scores become the weights in place. */
static inline void fold_weights(float *s, int64_t lo, int64_t hi, int64_t D, float *m, float *l, float *acc) {
    float bmax = *m;
#if defined(__AVX512F__)
    if (hi - lo == 16) {
        const float tmax = _mm512_reduce_max_ps(_mm512_loadu_ps(s + lo));
        bmax = tmax > bmax ? tmax : bmax;
    } else
#elif defined(PAGEDLLM_AVX2)
    if (hi - lo == 16) {
        const __m256 m8 = _mm256_max_ps(_mm256_loadu_ps(s + lo), _mm256_loadu_ps(s + lo + 8));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float tmax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        bmax = tmax > bmax ? tmax : bmax;
    } else
#endif
        for (int64_t t = lo; t < hi; t++) bmax = s[t] > bmax ? s[t] : bmax;
    if (bmax > *m) {
        const float corr = expf(*m - bmax);  /* 0 on the first keys (m = -inf) */
        *l *= corr;
        for (int64_t d = 0; d < D; d++) acc[d] *= corr;
        *m = bmax;
    }
    *l += exp_shifted(s, *m, s, lo, hi);
}

/* fold_weights, then the weighted V rows vrows[lo, hi) into acc */
static inline void fold_scores(float *s, const float *const *vrows, int64_t lo, int64_t hi, int64_t D, float *m,
                               float *l, float *acc) {
    fold_weights(s, lo, hi, D, m, l, acc);
    accumulate(acc, s, vrows, lo, hi, D);
}

/* ---- the scores of 16 keys at a time, shared by decode and prefill -------------------------------------
 * Decode and prefill give a query row the same bits: both walk its keys in tiles of PF_KEYS at positions
 * that are multiples of PF_KEYS (the first tile the one holding the row's first key), score a tile with
 * tile_scores (the query pre-scaled, one multiply-add chain over d a key) and fold it with fold_weights and
 * its weighted V (fold_scores; accumulate_rows for the rows that share their keys, the same sums). So a
 * token's attention does not depend on how its prompt was cut into chunks, on what the prefix cache held,
 * or on whether it is the last token of a chunk (a decode) or not. */

/* s[i][0..16) = q_i . kt[., 0..16) for rows i < mr (q rows D apart, kt [D][16]); mr a constant where inlined */
static inline __attribute__((always_inline)) void scores_rows(int mr, const float *q, const float *kt, int64_t D,
                                                              float (*s)[PF_KEYS]) {
#if defined(__AVX512F__)
    __m512 a[SCORE_ROWS];  /* a row's 16 scores in one register */
    for (int i = 0; i < mr; i++) a[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 kv = _mm512_loadu_ps(kt + d * PF_KEYS);
        for (int i = 0; i < mr; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * D + d]), kv, a[i]);
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(s[i], a[i]);
#elif defined(PAGEDLLM_AVX2)
    __m256 a[SCORE_ROWS][2];
    const float *qr[SCORE_ROWS];
    for (int i = 0; i < mr; i++) a[i][0] = a[i][1] = _mm256_setzero_ps(), qr[i] = q + i * D;
    for (int64_t d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * PF_KEYS), k1 = _mm256_loadu_ps(kt + d * PF_KEYS + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 qb = _mm256_set1_ps(qr[i][d]);
            a[i][0] = _mm256_fmadd_ps(qb, k0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(qb, k1, a[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(s[i], a[i][0]);
        _mm256_storeu_ps(s[i] + 8, a[i][1]);
    }
#else
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < PF_KEYS; j++) {
            float t = 0.f;
            for (int64_t d = 0; d < D; d++) t += q[i * D + d] * kt[d * PF_KEYS + j];
            s[i][j] = t;
        }
#endif
}

/* scores_rows with the row count (at most SCORE_ROWS) a constant in each case (the rows' sums then stay in
 * registers); each row's sums are the same whatever rows share the call */
static inline void tile_scores(int mr, const float *q, const float *kt, int64_t D, float (*s)[PF_KEYS]) {
#define F32(NR) scores_rows(NR, q, kt, D, s)
    BY_SCORE_ROWS(mr, F32)
#undef F32
}

/* kt [D][16] = the rows krows[0 .. nk) side by side (key j in column j), zeros past nk */
static inline void keys_tile(const float *const *krows, int64_t nk, int64_t D, float *kt) {
    int64_t d0 = 0;
#if defined(__AVX512F__)
    for (; d0 + 16 <= D; d0 += 16) {  /* 16 x 16 at a time */
        __m512i r[16];
        for (int64_t j = 0; j < 16; j++)
            r[j] = j < nk ? _mm512_loadu_si512(krows[j] + d0) : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(kt + (d0 + i) * PF_KEYS, r[i]);
    }
#elif defined(PAGEDLLM_AVX2)
    for (; d0 + 8 <= D; d0 += 8)  /* 8 x 8 at a time, each half of the keys */
        for (int64_t j0 = 0; j0 < PF_KEYS; j0 += 8) {
            __m256 r[8];
            for (int64_t j = 0; j < 8; j++) r[j] = j0 + j < nk ? _mm256_loadu_ps(krows[j0 + j] + d0) : _mm256_setzero_ps();
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (d0 + i) * PF_KEYS + j0, r[i]);
        }
#endif
    for (int64_t d = d0; d < D; d++)
        for (int64_t j = 0; j < PF_KEYS; j++) kt[d * PF_KEYS + j] = j < nk ? krows[j][d] : 0.f;
}

#if defined(__AVX512F__)
/* keys_tile from a bfloat16 cache's rows in place: each widened in registers on its way into the transpose
 * (the values row() widens to) */
static inline void keys_tile_bf16(const uint16_t *const *krows, int64_t nk, int64_t D, float *kt) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512i r[16];
        for (int64_t j = 0; j < 16; j++)
            r[j] = j < nk ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(krows[j] + d0))), 16)
                          : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(kt + (d0 + i) * PF_KEYS, r[i]);
    }
}

#endif

/* ---- int8 caches: scores in integers -------------------------------------------------------------------
 * With an int8 cache a query row is rounded to int8 as a cache row is (its own scale max |q| / 127; the query
 * pre-scaled as above), and a tile's scores are the exact integer dot products of the two rows' int8 values
 * times both scales: s = (float)(sum q k) * (sq * sk). An integer sum has one value in whatever order it is
 * added, so decode and prefill, and every instruction-set level, give a row the same scores. (The keys are
 * stored + 128 for VNNI's unsigned-by-signed product; the query's sum times 128 is taken off again.) */

/* a query row q [D] as int8 values qi, its scale and the sum of its values (attention/kv_int8.py's rounding) */
static inline void quantize_query(const float *q, int64_t D, int8_t *qi, float *qscale, int32_t *qsum) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; d++) amax = fabsf(q[d]) > amax ? fabsf(q[d]) : amax;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t d = 0; d < D; d++) {
        const float r = nearbyintf(q[d] * inv);
        qi[d] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
        sum += qi[d];
    }
    *qscale = amax / 127.f;
    *qsum = sum;
}

static inline uint32_t load32(const int8_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
}

/* k8 [D / 4][16][4] = the int8 rows krows[0 .. nk) + 128, four values of key j in dword j of each 64 bytes (zeros
 * past nk, stored as 128); D a multiple of 4 */
static inline void keys_tile_q8(const int8_t *const *krows, int64_t nk, int64_t D, uint8_t *k8) {
    int64_t d0 = 0;
#if defined(__AVX512BW__)
    for (; d0 + 64 <= D; d0 += 64) {  /* 16 keys x 16 dwords at a time */
        __m512i r[16];
        for (int64_t j = 0; j < 16; j++) r[j] = j < nk ? _mm512_loadu_si512(krows[j] + d0) : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; i++)
            _mm512_storeu_si512(k8 + (d0 + 4 * i) * PF_KEYS, _mm512_xor_si512(r[i], _mm512_set1_epi8((char)0x80)));
    }
#endif
    for (int64_t c = d0 / 4; c < D / 4; c++)
        for (int64_t j = 0; j < PF_KEYS; j++) {
            const uint32_t u = (j < nk ? load32(krows[j] + 4 * c) : 0u) ^ 0x80808080u;
            memcpy(k8 + (c * PF_KEYS + j) * 4, &u, 4);
        }
}

/* s[i][0..16) = the scores of query rows i < mr (qi rows D apart, their scales and sums) against the tile k8 of
 * keys with scales ks; mr a constant where inlined */
static inline __attribute__((always_inline)) void scores_q8_rows(int mr, const int8_t *qi, const float *qscale,
                                                                 const int32_t *qsum, const uint8_t *k8,
                                                                 const float *ks, int64_t D, float (*s)[PF_KEYS]) {
#if defined(__AVX512VNNI__)
    __m512i a[SCORE_ROWS];
    for (int i = 0; i < mr; i++) a[i] = _mm512_setzero_si512();
    for (int64_t c = 0; c < D / 4; c++) {
        const __m512i kv = _mm512_loadu_si512(k8 + c * 64);
        for (int i = 0; i < mr; i++) a[i] = _mm512_dpbusd_epi32(a[i], kv, _mm512_set1_epi32((int)load32(qi + i * D + 4 * c)));
    }
    const __m512 kscale = _mm512_loadu_ps(ks);
    for (int i = 0; i < mr; i++) {
        const __m512i dot = _mm512_sub_epi32(a[i], _mm512_set1_epi32(128 * qsum[i]));
        _mm512_storeu_ps(s[i], _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(qscale[i]), kscale)));
    }
#elif defined(PAGEDLLM_AVX2)
    __m256i a[SCORE_ROWS][2];
    for (int i = 0; i < mr; i++) a[i][0] = a[i][1] = _mm256_setzero_si256();
    for (int64_t c = 0; c < D / 4; c++) {
        const __m256i k0 = _mm256_loadu_si256((const __m256i *)(k8 + c * 64));
        const __m256i k1 = _mm256_loadu_si256((const __m256i *)(k8 + c * 64 + 32));
#if defined(__AVXVNNI__)
        for (int i = 0; i < mr; i++) {
            const __m256i qb = _mm256_set1_epi32((int)load32(qi + i * D + 4 * c));
            a[i][0] = _mm256_dpbusd_avx_epi32(a[i][0], k0, qb);
            a[i][1] = _mm256_dpbusd_avx_epi32(a[i][1], k1, qb);
        }
#else  /* |k| times q with k's sign: byte pairs summed to int16 (at most 2 * 127 * 127), then to int32 */
        (void)qsum;
        const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
        const __m256i s0 = _mm256_xor_si256(k0, flip), s1 = _mm256_xor_si256(k1, flip);
        const __m256i u0 = _mm256_abs_epi8(s0), u1 = _mm256_abs_epi8(s1);
        for (int i = 0; i < mr; i++) {
            const __m256i qb = _mm256_set1_epi32((int)load32(qi + i * D + 4 * c));
            a[i][0] = _mm256_add_epi32(a[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(qb, s0)), ones));
            a[i][1] = _mm256_add_epi32(a[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(qb, s1)), ones));
        }
#endif
    }
    for (int i = 0; i < mr; i++) {
#if defined(__AVXVNNI__)
        const __m256i off = _mm256_set1_epi32(128 * qsum[i]);
#else
        const __m256i off = _mm256_setzero_si256();
#endif
        const __m256 qs = _mm256_set1_ps(qscale[i]);
        _mm256_storeu_ps(s[i], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a[i][0], off)),
                                             _mm256_mul_ps(qs, _mm256_loadu_ps(ks))));
        _mm256_storeu_ps(s[i] + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a[i][1], off)),
                                                 _mm256_mul_ps(qs, _mm256_loadu_ps(ks + 8))));
    }
#else
    (void)qsum;  /* the sums below are of k itself, not k + 128 */
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < PF_KEYS; j++) {
            int32_t dot = 0;
            for (int64_t d = 0; d < D; d++) dot += (int32_t)qi[i * D + d] * ((int32_t)k8[((d / 4) * PF_KEYS + j) * 4 + d % 4] - 128);
            s[i][j] = (float)dot * (qscale[i] * ks[j]);
        }
#endif
}

/* scores_q8_rows with the row count a constant in each case */
static inline void tile_scores_q8(int mr, const int8_t *qi, const float *qscale, const int32_t *qsum, const uint8_t *k8,
                                  const float *ks, int64_t D, float (*s)[PF_KEYS]) {
#define Q8(NR) scores_q8_rows(NR, qi, qscale, qsum, k8, ks, D, s)
    BY_SCORE_ROWS(mr, Q8)
#undef Q8
}

/* ---- bfloat16 caches at avx512-bf16: products of bfloat16 pairs (vdpbf16ps) ---------------------------
 * A query row is rounded to bfloat16 (after the softmax scale) and a score is one chain of pair products into
 * float32, two dimensions a step; the weights are rounded to bfloat16 and multiply V two keys a step (keys
 * 2c, 2c + 1 of a tile; a weight outside a row's keys is 0). Decode and prefill run these same steps for a row,
 * so they still agree bit for bit. D a multiple of 64. */
#if defined(__AVX512BF16__)
#define BF16_PAIRS 1

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

/* kt2 [D / 2][16] = the bfloat16 rows krows[0 .. nk) in place, dimensions d, d + 1 of key j in dword j (zeros past
 * nk) */
static inline void keys_pairs_bf16(const uint16_t *const *krows, int64_t nk, int64_t D, uint32_t *kt2) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m512i r[16];
        for (int64_t j = 0; j < 16; j++) r[j] = j < nk ? _mm512_loadu_si512(krows[j] + d0) : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(kt2 + (d0 / 2 + i) * PF_KEYS, r[i]);
    }
}

/* vp [8][D] = the bfloat16 rows vrows[0 .. nk) in pairs: dword d of pair c holds keys 2c and 2c + 1's value d */
static inline void values_pairs_bf16(const uint16_t *const *vrows, int64_t nk, int64_t D, uint32_t *vp) {
    for (int64_t c = 0; c < PF_KEYS / 2; c++)
        for (int64_t d = 0; d < D; d += 16) {
            const __m512i a = 2 * c < nk ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vrows[2 * c] + d)))
                                         : _mm512_setzero_si512();
            const __m512i b = 2 * c + 1 < nk
                                  ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vrows[2 * c + 1] + d)))
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + c * D + d, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
}

/* s[i][0..16) = qb_i . kt2 for rows i < mr (qb rows D apart); mr a constant where inlined */
static inline __attribute__((always_inline)) void scores_bf16_rows(int mr, const uint16_t *qb, const uint32_t *kt2,
                                                                   int64_t D, float (*s)[PF_KEYS]) {
    __m512 a[SCORE_ROWS];
    for (int i = 0; i < mr; i++) a[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D / 2; c++) {
        const __m512bh kv = as_bh(_mm512_loadu_si512(kt2 + c * PF_KEYS));
        for (int i = 0; i < mr; i++) {
            uint32_t pair;
            memcpy(&pair, qb + i * D + 2 * c, 4);
            a[i] = _mm512_dpbf16_ps(a[i], kv, as_bh(_mm512_set1_epi32((int)pair)));
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(s[i], a[i]);
}

static inline void tile_scores_bf16(int mr, const uint16_t *qb, const uint32_t *kt2, int64_t D, float (*s)[PF_KEYS]) {
#define BF16(NR) scores_bf16_rows(NR, qb, kt2, D, s)
    BY_SCORE_ROWS(mr, BF16)
#undef BF16
}

/* pb [8] = a row's weights w[lo, hi) rounded to bfloat16 in pairs, 0 elsewhere */
static inline void weights_bf16(const float *w, int64_t lo, int64_t hi, uint32_t *pb) {
    const __mmask16 keep = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
    _mm256_storeu_si256((__m256i *)pb, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, w)));
}

/* acc rows i0 .. i0 + nr - 1 (lda apart) += their weights pb (rows 8 dwords apart) times V's pairs c0 .. c1 - 1 */
static inline __attribute__((always_inline)) void accumulate_pairs_nr(int nr, int i0, float *acc, int64_t lda,
                                                                      const uint32_t *pb, const uint32_t *vp,
                                                                      int64_t c0, int64_t c1, int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 a[6][4];
        sums_load(nr, acc + i0 * lda + d0, lda, a);
        for (int64_t p = c0; p < c1; p++) {
            __m512bh vt[4];
            for (int c = 0; c < 4; c++) vt[c] = as_bh(_mm512_loadu_si512(vp + p * D + d0 + 16 * c));
            for (int i = 0; i < nr; i++) {
                const __m512bh w = as_bh(_mm512_set1_epi32((int)pb[(i0 + i) * 8 + p]));
                for (int c = 0; c < 4; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], vt[c], w);
            }
        }
        sums_store(nr, acc + i0 * lda + d0, lda, a);
    }
}

/* the weighted V of keys [lo, hi) into n rows of acc: the pairs holding them */
static inline void accumulate_pairs(int n, float *acc, int64_t lda, const uint32_t *pb, const uint32_t *vp, int64_t lo,
                                    int64_t hi, int64_t D) {
    const int64_t c0 = lo / 2, c1 = (hi + 1) / 2;
    for (int i0 = 0; i0 < n; i0 += 6) {
#define PAIRS(NR) accumulate_pairs_nr(NR, i0, acc, lda, pb, vp, c0, c1, D)
        BY_SIX_ROWS(n - i0 < 6 ? n - i0 : 6, PAIRS)
#undef PAIRS
    }
}
#else
#define BF16_PAIRS 0
#endif

void paged_decode_attention(const float *q, int64_t q_stride, const void *k, const void *v,
                            const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                            const int64_t *starts, float *out, int64_t nd, int64_t H, int64_t KVH, int64_t D,
                            int64_t bs, float scale, int kv_dtype, const float *lut) {
    const int64_t group = H / KVH, esize = kv_dtype == 0 ? 4 : kv_dtype == 1 ? 2 : 1, Dr = row_elems(kv_dtype, D);
    /* A task is one request's run of kv heads. With requests enough to share out, a task takes as many
     * heads as its buffers hold, so that it reads each block's rows whole (heads lie side by side in a
     * row); with few requests, one kv head a task keeps every thread busy. */
    int64_t per_task = 1;
    if (nd >= 2 * omp_get_max_threads()) {
        per_task = MAX_TASK_HEADS / group < KVH ? MAX_TASK_HEADS / group : KVH;
        if (per_task < 1) per_task = 1;
    }
    const int64_t splits = (KVH + per_task - 1) / per_task;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < nd * splits; task++) {
        const int64_t r = task / splits, kh0 = (task % splits) * per_task;
        const int64_t kh1 = kh0 + per_task < KVH ? kh0 + per_task : KVH, nh = (kh1 - kh0) * group;
        float acc[MAX_TASK_HEADS][MAX_D], m[MAX_TASK_HEADS], l[MAX_TASK_HEADS];
        float qs[MAX_TASK_HEADS * MAX_D], kt[MAX_D * PF_KEYS], kbuf[PF_KEYS][MAX_D], vbuf[PF_KEYS][MAX_D];
        int8_t qi[MAX_TASK_HEADS * MAX_D];  /* int8 caches: the queries as int8, their scales and sums */
        float qscale[MAX_TASK_HEADS], ks[PF_KEYS];
        int32_t qsum[MAX_TASK_HEADS];
        uint8_t k8[MAX_D * PF_KEYS];
#if BF16_PAIRS
        const int pairs = kv_dtype == 1 && D % 64 == 0;  /* bfloat16 pair products */
        uint16_t qb[MAX_TASK_HEADS * MAX_D];
        uint32_t kt2[MAX_D * PF_KEYS / 2], vp[PF_KEYS / 2 * MAX_D], pb[MAX_TASK_HEADS * 8];
#endif
        const float *qr = q + r * q_stride + kh0 * group * D;
        for (int64_t h = 0; h < nh; h++) {
            m[h] = -INFINITY;
            l[h] = 0.f;
            for (int64_t d = 0; d < D; d++) acc[h][d] = 0.f, qs[h * D + d] = qr[h * D + d] * scale;
            if (kv_dtype == 3) quantize_query(qs + h * D, D, qi + h * D, &qscale[h], &qsum[h]);
#if BF16_PAIRS
            if (pairs) round_bf16(qs + h * D, D, qb + h * D);
#endif
        }
        const int64_t len = seq_lens[r], start = starts[r];
        const int64_t *table = block_tables + r * table_stride;
        for (int64_t k0 = start - start % PF_KEYS; k0 < len; k0 += PF_KEYS) {  /* as the prefill tiles them */
            const int64_t jlo = k0 < start ? start - k0 : 0, nk = len - k0 < PF_KEYS ? len - k0 : PF_KEYS;
            const int64_t next = k0 + PF_KEYS;  /* a new block after this tile: ask for its rows meanwhile */
            if (next < len && next % bs == 0)
                prefetch_block(k, v, (table[next / bs] * bs * KVH + kh0) * Dr, bs, KVH * Dr,
                               (kh1 - kh0) * Dr * esize, esize);
            for (int64_t kh = kh0; kh < kh1; kh++) {
                const int64_t h0 = (kh - kh0) * group;
#if BF16_PAIRS
                if (pairs) {  /* rows read in place */
                    const uint16_t *krows[PF_KEYS], *vrows[PF_KEYS];
                    for (int64_t j = 0; j < nk; j++) {
                        const int64_t pos = k0 + j, at = ((table[pos / bs] * bs + pos % bs) * KVH + kh) * Dr;
                        krows[j] = (const uint16_t *)k + at;
                        vrows[j] = (const uint16_t *)v + at;
                    }
                    keys_pairs_bf16(krows, nk, D, kt2);
                    values_pairs_bf16(vrows, nk, D, vp);
                    float s[MAX_TASK_HEADS][PF_KEYS];
                    for (int64_t h = h0; h < h0 + group; h += SCORE_ROWS)
                        tile_scores_bf16(h0 + group - h < SCORE_ROWS ? (int)(h0 + group - h) : SCORE_ROWS, qb + h * D,
                                         kt2, D, s + (h - h0));
                    for (int64_t h = h0; h < h0 + group; h++) {
                        fold_weights(s[h - h0], jlo, nk, D, &m[h], &l[h], acc[h]);
                        weights_bf16(s[h - h0], jlo, nk, pb + (h - h0) * 8);
                    }
                    accumulate_pairs((int)group, acc[h0], MAX_D, pb, vp, jlo, nk, D);
                    continue;
                }
#endif
#if defined(__AVX512F__)
                if (kv_dtype != 2 && D % 64 == 0) {  /* rows read in place, V once for all the group's queries */
                    const void *krows[PF_KEYS], *vrows[PF_KEYS];
                    float vs[PF_KEYS];  /* int8 V rows' scales */
                    for (int64_t j = 0; j < nk; j++) {
                        const int64_t pos = k0 + j, at = ((table[pos / bs] * bs + pos % bs) * KVH + kh) * Dr;
                        krows[j] = (const char *)k + at * esize;
                        vrows[j] = (const char *)v + at * esize;
                        if (kv_dtype == 3) {
                            ks[j] = row_scale(krows[j], D);
                            vs[j] = row_scale(vrows[j], D);
                        }
                    }
                    for (int64_t j = nk; j < PF_KEYS; j++) ks[j] = 0.f;  /* lanes past the keys: scored, never read */
                    if (kv_dtype == 1) keys_tile_bf16((const uint16_t *const *)krows, nk, D, kt);
                    else if (kv_dtype == 3) keys_tile_q8((const int8_t *const *)krows, nk, D, k8);
                    else keys_tile((const float *const *)krows, nk, D, kt);
                    float s[MAX_TASK_HEADS][PF_KEYS];
                    for (int64_t h = h0; h < h0 + group; h += SCORE_ROWS) {
                        const int mr = h0 + group - h < SCORE_ROWS ? (int)(h0 + group - h) : SCORE_ROWS;
                        if (kv_dtype == 3)
                            tile_scores_q8(mr, qi + h * D, qscale + h, qsum + h, k8, ks, D, s + (h - h0));
                        else
                            tile_scores(mr, qs + h * D, kt, D, s + (h - h0));
                    }
                    for (int64_t h = h0; h < h0 + group; h++) fold_weights(s[h - h0], jlo, nk, D, &m[h], &l[h], acc[h]);
                    accumulate_rows((int)group, acc[h0], MAX_D, s[0], vrows, kv_dtype, vs, jlo, nk, D);
                    continue;
                }
#endif
                const float *krows[PF_KEYS], *vrows[PF_KEYS];
                const int8_t *k8rows[PF_KEYS];
                for (int64_t j = 0; j < nk; j++) {
                    const int64_t pos = k0 + j, at = ((table[pos / bs] * bs + pos % bs) * KVH + kh) * Dr;
                    if (kv_dtype == 3) {
                        k8rows[j] = (const int8_t *)k + at;
                        ks[j] = row_scale(k8rows[j], D);
                    } else {
                        krows[j] = row(k, at, kv_dtype, lut, kbuf[j], D);
                    }
                    vrows[j] = row(v, at, kv_dtype, lut, vbuf[j], D);
                }
                for (int64_t j = nk; j < PF_KEYS; j++) ks[j] = 0.f;
                if (kv_dtype == 3) keys_tile_q8(k8rows, nk, D, k8);
                else keys_tile(krows, nk, D, kt);
                for (int64_t h = h0; h < h0 + group; h += SCORE_ROWS) {
                    const int mr = h0 + group - h < SCORE_ROWS ? (int)(h0 + group - h) : SCORE_ROWS;
                    float s[SCORE_ROWS][PF_KEYS];
                    if (kv_dtype == 3) tile_scores_q8(mr, qi + h * D, qscale + h, qsum + h, k8, ks, D, s);
                    else tile_scores(mr, qs + h * D, kt, D, s);
                    for (int i = 0; i < mr; i++) fold_scores(s[i], vrows, jlo, nk, D, &m[h + i], &l[h + i], acc[h + i]);
                }
            }
        }
        for (int64_t h = 0; h < nh; h++) {
            float *o = out + (r * H + kh0 * group + h) * D;
            const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
            for (int64_t d = 0; d < D; d++) o[d] = acc[h][d] * inv;
        }
    }
}

/* ---- prefill: many queries of one request, flash-style ------------------------------------------------
 * The queries of one request (a prompt, or a chunk of it after ctx cached tokens) at positions ctx ..
 * ctx + Q - 1 attend the keys at or before their own position (and within the sliding window, if any),
 * read in place from the paged cache: no gathered copy of the context, no mask tensor. A task is one kv
 * head and a tile of PF_TOKENS queries, i.e. PF_TOKENS * group rows that share every K / V row it
 * reads. It walks the blocks its tile can see (causal and window skips: blocks past its last query or
 * before its first query's window are never read), 16 keys at a time: the keys are transposed once, a
 * register-blocked product scores 8 rows (AVX2: 6) x 16 keys, scores past a row's own position or window become
 * -inf, and each row folds them into its running max, sum and weighted V (online softmax). */

/* k, v: the cache's halves, token rows k_stride / v_stride elements apart (KVH * D, int8's KVH * (D + 4)); or a chunk's own fresh
 * K/V when nothing was cached before it (ctx 0), as one block of bs >= Q rows (table {0}). */
void paged_prefill_attention(const float *q, int64_t q_stride, const void *k, const void *v, int64_t k_stride,
                             int64_t v_stride, const int64_t *table, int64_t ctx, int64_t Q, float *out,
                             int64_t out_stride, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale,
                             int64_t window, int kv_dtype, const float *lut) {
    const int64_t group = H / KVH, tiles = (Q + PF_TOKENS - 1) / PF_TOKENS, Dr = row_elems(kv_dtype, D);
#pragma omp parallel
    {
        float *qt = malloc(PF_TOKENS * group * D * sizeof(float)), *acc = malloc(PF_TOKENS * group * D * sizeof(float));
        float *kt = malloc(D * PF_KEYS * sizeof(float)), *vt = malloc(PF_KEYS * D * sizeof(float));
        float m[PF_ROWS], l[PF_ROWS];
        float kbuf[PF_KEYS * MAX_D];
        float(*sbuf)[PF_KEYS] = malloc(PF_ROWS * PF_KEYS * sizeof(float));  /* the tile's scores, a row each */
        int8_t *qi = malloc(PF_TOKENS * group * D);  /* int8 caches: the rows' queries as int8, scales, sums */
        float qscale[PF_ROWS], ks[PF_KEYS];
        int32_t qsum[PF_ROWS];
        uint8_t k8[MAX_D * PF_KEYS];
        const int8_t *k8rows[PF_KEYS];
#if BF16_PAIRS
        const int pairs = kv_dtype == 1 && D % 64 == 0;  /* bfloat16 pair products */
        uint16_t *qb = malloc(PF_TOKENS * group * D * sizeof(uint16_t));
        uint32_t *pb = malloc(PF_ROWS * 8 * sizeof(uint32_t)), kt2[MAX_D * PF_KEYS / 2], vp[PF_KEYS / 2 * MAX_D];
#endif
        const float *vrows[PF_KEYS];
        for (int64_t j = 0; j < PF_KEYS; j++) vrows[j] = vt + j * D;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < KVH * tiles; task++) {
            /* the last tiles see the most keys: hand them out first */
            const int64_t tile = tiles - 1 - task / KVH, kh = task % KVH;
            const int64_t t0 = tile * PF_TOKENS, nt = Q - t0 < PF_TOKENS ? Q - t0 : PF_TOKENS, rows = nt * group;
            for (int64_t t = 0; t < nt; t++)  /* row t * group + h: query token t0 + t, head kh * group + h */
                for (int64_t h = 0; h < group; h++) {
                    const float *src = q + (t0 + t) * q_stride + (kh * group + h) * D;
                    float *dst = qt + (t * group + h) * D;
                    for (int64_t d = 0; d < D; d++) dst[d] = src[d] * scale;
                    if (kv_dtype == 3) {
                        const int64_t r = t * group + h;
                        quantize_query(dst, D, qi + r * D, &qscale[r], &qsum[r]);
                    }
#if BF16_PAIRS
                    if (pairs) round_bf16(dst, D, qb + (t * group + h) * D);
#endif
                }
            for (int64_t r = 0; r < rows; r++) {
                m[r] = -INFINITY;
                l[r] = 0.f;
                for (int64_t d = 0; d < D; d++) acc[r * D + d] = 0.f;
            }
            const int64_t first = ctx + t0, last = ctx + t0 + nt - 1;  /* the tile's query positions */
            int64_t lo = window > 0 ? first - window + 1 : 0;
            if (lo < 0) lo = 0;
            lo -= lo % PF_KEYS;  /* tiles at multiples of PF_KEYS, as decode's */
            for (int64_t k0 = lo; k0 <= last; k0 += PF_KEYS) {  /* no tile before the first query's window is read */
                const int64_t nk = last + 1 - k0 < PF_KEYS ? last + 1 - k0 : PF_KEYS;
#if BF16_PAIRS
                if (pairs) {  /* rows read in place; a token's rows (its query heads) share the keys */
                    const uint16_t *k16[PF_KEYS], *v16rows[PF_KEYS];
                    for (int64_t j = 0; j < nk; j++) {
                        const int64_t pos = k0 + j, slot = table[pos / bs] * bs + pos % bs;
                        k16[j] = (const uint16_t *)k + slot * k_stride + kh * Dr;
                        v16rows[j] = (const uint16_t *)v + slot * v_stride + kh * Dr;
                    }
                    keys_pairs_bf16(k16, nk, D, kt2);
                    values_pairs_bf16(v16rows, nk, D, vp);
                    for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS)
                        tile_scores_bf16(rows - r0 < SCORE_ROWS ? (int)(rows - r0) : SCORE_ROWS, qb + r0 * D, kt2, D,
                                         sbuf + r0);
                    for (int64_t t = 0; t < nt; t++) {
                        const int64_t pos = first + t, r = t * group;
                        int64_t jlo;
                        const int64_t hi = keys_seen(pos, k0, nk, window, &jlo);
                        if (jlo >= hi) continue;
                        for (int64_t i = r; i < r + group; i++) {
                            fold_weights(sbuf[i], jlo, hi, D, &m[i], &l[i], acc + i * D);
                            weights_bf16(sbuf[i], jlo, hi, pb + i * 8);
                        }
                        accumulate_pairs((int)group, acc + r * D, D, pb + r * 8, vp, jlo, hi, D);
                    }
                    continue;
                }
#endif
                const float *krows[PF_KEYS];
                for (int64_t j = 0; j < nk; j++) {  /* K transposed, V as rows */
                    const int64_t pos = k0 + j, slot = table[pos / bs] * bs + pos % bs;
                    if (kv_dtype == 3) {
                        k8rows[j] = (const int8_t *)k + slot * k_stride + kh * Dr;
                        ks[j] = row_scale(k8rows[j], D);
                    } else {
                        krows[j] = row(k, slot * k_stride + kh * Dr, kv_dtype, lut, kbuf + j * D, D);
                    }
                    const float *vr = row(v, slot * v_stride + kh * Dr, kv_dtype, lut, vt + j * D, D);
                    if (vr != vt + j * D) memcpy(vt + j * D, vr, D * sizeof(float));
                }
                for (int64_t j = nk; j < PF_KEYS; j++) ks[j] = 0.f;
                if (kv_dtype == 3) keys_tile_q8(k8rows, nk, D, k8);
                else keys_tile(krows, nk, D, kt);
/* rows r0 .. r0 + mr - 1's scores into S: in integers from an int8 cache */
#define SCORES(MR, R0, S)                                                                        \
    (kv_dtype == 3 ? tile_scores_q8(MR, qi + (R0) * D, qscale + (R0), qsum + (R0), k8, ks, D, S) \
                   : tile_scores(MR, qt + (R0) * D, kt, D, S))
#if defined(__AVX512F__) || defined(PAGEDLLM_AVX2)
                if (D % 64 == 0) {  /* a token's rows (its query heads) share their keys: V read once for them */
                    for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS)
                        SCORES(rows - r0 < SCORE_ROWS ? (int)(rows - r0) : SCORE_ROWS, r0, sbuf + r0);
                    for (int64_t t = 0; t < nt; t++) {
                        const int64_t pos = first + t, r = t * group;
                        int64_t jlo;
                        const int64_t hi = keys_seen(pos, k0, nk, window, &jlo);
                        if (jlo >= hi) continue;
                        for (int64_t i = r; i < r + group; i++) fold_weights(sbuf[i], jlo, hi, D, &m[i], &l[i], acc + i * D);
                        accumulate_rows((int)group, acc + r * D, D, sbuf[r], (const void *const *)vrows, 0, NULL, jlo,
                                        hi, D);
                    }
                    continue;
                }
#endif
                for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
                    const int mr = rows - r0 < SCORE_ROWS ? (int)(rows - r0) : SCORE_ROWS;
                    float s[SCORE_ROWS][PF_KEYS];
                    SCORES(mr, r0, s);
                    for (int i = 0; i < mr; i++) {
                        const int64_t r = r0 + i, pos = first + r / group;  /* this row's query position */
                        int64_t jlo;
                        const int64_t hi = keys_seen(pos, k0, nk, window, &jlo);
                        if (jlo < hi) fold_scores(s[i], vrows, jlo, hi, D, &m[r], &l[r], acc + r * D);
                    }
                }
#undef SCORES
            }
            for (int64_t t = 0; t < nt; t++)
                for (int64_t h = 0; h < group; h++) {
                    const int64_t r = t * group + h;
                    float *o = out + (t0 + t) * out_stride + (kh * group + h) * D;
                    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
                    for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
                }
        }
        free(qt);
        free(acc);
        free(kt);
        free(vt);
        free(sbuf);
        free(qi);
#if BF16_PAIRS
        free(qb);
        free(pb);
#endif
    }
}
