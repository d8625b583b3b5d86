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
 * The cache holds float32 (kv_dtype 0), bfloat16 (1) or fp8 (2: each byte
 * widened through the 256-entry table lut, so e4m3 and e5m2 are one code path);
 * rows are widened to float32 as they are read.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include "vec_math.h"

#define MAX_BS 64
#define MAX_D 256
#define MAX_TASK_HEADS 32  /* query heads one task keeps running sums for */

static inline const float *row(const void *base, int64_t off, int kv_dtype, const float *lut, float *buf,
                               int64_t D) {
    if (kv_dtype == 0) return (const float *)base + off;
    if (kv_dtype == 1) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int64_t d = 0; d < D; d++) {
            uint32_t u = (uint32_t)p[d] << 16;
            memcpy(buf + d, &u, 4);
        }
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

/* s[t] = scale * (q . k_t) for t in [lo, hi). */
static inline void scores(const float *qg, const float *const *krows, int64_t lo, int64_t hi, int64_t D,
                          float scale, float *s) {
    int64_t t = lo;
#ifdef PAGEDLLM_AVX2
    if (D % 8 == 0) {  /* eight rows at a time, reduced together: no horizontal sum per dot */
        for (; t + 8 <= hi; t += 8) {
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + d);
                for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krows[t + i] + d), a[i]);
            }
            const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
            _mm256_storeu_ps(s + t, _mm256_mul_ps(dots, _mm256_set1_ps(scale)));
        }
    }
#endif
    for (; t < hi; t++) {
        const float *kt = krows[t];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += qg[d] * kt[d];
        s[t] = dot * scale;
    }
}

/* acc += sum over t in [lo, hi) of p[t] * v_t. */
static inline void accumulate(float *acc, const float *p, const float *const *vrows, int64_t lo, int64_t hi,
                              int64_t D) {
    int64_t d0 = 0;
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

void paged_decode_attention(const float *q, int64_t q_stride, const void *k, const void *v,
                            const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                            const int64_t *starts, float *out, int64_t nd, int64_t H, int64_t KVH, int64_t D,
                            int64_t bs, float scale, int kv_dtype, const float *lut) {
    const int64_t group = H / KVH, esize = kv_dtype == 0 ? 4 : kv_dtype == 1 ? 2 : 1;
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
        float acc[MAX_TASK_HEADS][MAX_D], m[MAX_TASK_HEADS], l[MAX_TASK_HEADS], s[MAX_TASK_HEADS][MAX_BS];
        float kbuf[MAX_BS][MAX_D], vbuf[MAX_BS][MAX_D];
        const float *qr = q + r * q_stride + kh0 * group * D;
        for (int64_t h = 0; h < nh; h++) {
            m[h] = -INFINITY;
            l[h] = 0.f;
            for (int64_t d = 0; d < D; d++) acc[h][d] = 0.f;
        }
        const int64_t len = seq_lens[r], start = starts[r];
        for (int64_t b0 = start - start % bs; b0 < len; b0 += bs) {
            const int64_t *table = block_tables + r * table_stride;
            const int64_t lo = b0 < start ? start - b0 : 0, hi = len - b0 < bs ? len - b0 : bs;
            if (b0 + bs < len)
                prefetch_block(k, v, (table[b0 / bs + 1] * bs * KVH + kh0) * D, bs, KVH * D, (kh1 - kh0) * D * esize,
                               esize);
            for (int64_t kh = kh0; kh < kh1; kh++) {
                const int64_t base = (table[b0 / bs] * bs * KVH + kh) * D;
                const float *krows[MAX_BS], *vrows[MAX_BS];
                for (int64_t t = lo; t < hi; t++) {
                    krows[t] = row(k, base + t * KVH * D, kv_dtype, lut, kbuf[t], D);
                    vrows[t] = row(v, base + t * KVH * D, kv_dtype, lut, vbuf[t], D);
                }
                for (int64_t h = (kh - kh0) * group; h < (kh - kh0 + 1) * group; h++) {
                    scores(qr + h * D, krows, lo, hi, D, scale, s[h]);
                    float bmax = m[h];
                    for (int64_t t = lo; t < hi; t++) bmax = s[h][t] > bmax ? s[h][t] : bmax;
                    if (bmax > m[h]) {
                        const float corr = expf(m[h] - bmax);  /* 0 on the first block (m = -inf) */
                        l[h] *= corr;
                        for (int64_t d = 0; d < D; d++) acc[h][d] *= corr;
                        m[h] = bmax;
                    }
                    l[h] += exp_shifted(s[h], m[h], s[h], lo, hi);  /* scores become weights in place */
                    accumulate(acc[h], s[h], vrows, lo, hi, D);
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
