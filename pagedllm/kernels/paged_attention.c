/* Decode attention straight from the paged KV cache (see pagedllm/attention/cpu_paged.py).
 *
 * One query token per request. For each (request, kv head) the kernel walks the
 * request's blocks in place, scoring a whole block for every query head of the
 * group, then folds it into a running softmax (max, sum, weighted V). K and V
 * are read once, where they lie: no gathered copy, no padding to the longest
 * request. Tasks are spread over PyTorch's OpenMP threads.
 *
 * Layout: q [nd, H, D] with row stride q_stride; k, v [num_blocks, bs, KVH, D];
 * block_tables [nd, table_stride]; positions [start[r], seq_len[r]) are attended.
 * The cache holds float32 (kv_dtype 0), bfloat16 (1) or fp8 (2: each byte
 * widened through the 256-entry table lut, so e4m3 and e5m2 are one code path);
 * rows are widened to float32 as they are read.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_BS 64
#define MAX_D 256

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

void paged_decode_attention(const float *q, int64_t q_stride, const void *k, const void *v,
                            const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                            const int64_t *starts, float *out, int64_t nd, int64_t H, int64_t KVH, int64_t D,
                            int64_t bs, float scale, int kv_dtype, const float *lut) {
    const int64_t group = H / KVH;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t r = 0; r < nd; r++) {
        for (int64_t kh = 0; kh < KVH; kh++) {
            float acc[MAX_GROUP][MAX_D], m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BS];
            float kbuf[MAX_BS][MAX_D], vbuf[MAX_D];
            const float *qr = q + r * q_stride + kh * group * D;
            for (int64_t g = 0; g < group; g++) {
                m[g] = -INFINITY;
                l[g] = 0.f;
                for (int64_t d = 0; d < D; d++) acc[g][d] = 0.f;
            }
            const int64_t len = seq_lens[r], start = starts[r];
            for (int64_t b0 = start - start % bs; b0 < len; b0 += bs) {
                const int64_t block = block_tables[r * table_stride + b0 / bs];
                const int64_t lo = b0 < start ? start - b0 : 0, hi = len - b0 < bs ? len - b0 : bs;
                const int64_t base = (block * bs * KVH + kh) * D;
                const float *krows[MAX_BS];
                for (int64_t t = lo; t < hi; t++) krows[t] = row(k, base + t * KVH * D, kv_dtype, lut, kbuf[t], D);
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qr + g * D;
                    float bmax = m[g];
                    for (int64_t t = lo; t < hi; t++) {
                        const float *kt = krows[t];
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < D; d++) dot += qg[d] * kt[d];
                        s[g][t] = dot * scale;
                        bmax = s[g][t] > bmax ? s[g][t] : bmax;
                    }
                    const float corr = expf(m[g] - bmax);  /* 0 on the first block (m = -inf) */
                    l[g] *= corr;
                    for (int64_t d = 0; d < D; d++) acc[g][d] *= corr;
                    m[g] = bmax;
                }
                for (int64_t t = lo; t < hi; t++) {  /* V rows once per block, for every head of the group */
                    const float *vt = row(v, base + t * KVH * D, kv_dtype, lut, vbuf, D);
                    for (int64_t g = 0; g < group; g++) {
                        const float p = expf(s[g][t] - m[g]);
                        l[g] += p;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) acc[g][d] += p * vt[d];
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float *o = out + (r * H + kh * group + g) * D;
                const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
                for (int64_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;
            }
        }
    }
}
