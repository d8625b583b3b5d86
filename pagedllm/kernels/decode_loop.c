/* A Llama-family decode step's layer loop in C (see pagedllm/models/fused_decode.py).
 *
 * Single-stream decode spends about a third of each step in Python and PyTorch dispatch between
 * kernels that each take tens of microseconds. When every linear of the model runs on our kernels
 * (quantized, or float32 through f32_matmul) and every row of the step is a decode, the whole loop (norms, projections, rotary,
 * the KV write, paged attention, SiLU) runs here, calling the very kernels the Python loop calls on
 * the same inputs in the same order: the result is bit for bit the Python loop's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the kernels of quant_matmul.c, elementwise.c and paged_attention.c */
void int4_matmul(const float *x, const uint8_t *qw, const float *scales, const float *mins, float *y, int64_t M,
                 int64_t N, int64_t K);
void int8_matmul(const float *x, const int8_t *qw, const float *scales, const float *mins, float *y, int64_t M,
                 int64_t N, int64_t K);
void int4_matmul_a8(const float *x, const uint8_t *qw, const float *scales, const float *mins, float *y,
                    int64_t M, int64_t N, int64_t K, int digits);
void int8_matmul_a8(const float *x, const int8_t *qw, const float *scales, const float *mins, float *y,
                    int64_t M, int64_t N, int64_t K, int digits);
void int8_matmul_g16(const float *x, const int8_t *qw, const float *scales, const float *mins, float *y,
                     int64_t M, int64_t N, int64_t K);
void f32_matmul(const float *x, const float *panels, float *y, int64_t M, int64_t N, int64_t K);
void add_rms_norm(float *x, const float *residual, const float *weight, float *out, int64_t rows, int64_t n,
                  float eps);
void silu_mul(const float *gu, float *out, int64_t rows, int64_t inter);
void rotary(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out, int64_t T,
            int64_t heads, int64_t D);
void paged_decode_attention(const float *q, int64_t q_stride, const void *k, const void *v,
                            const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
                            const int64_t *starts, float *out, int64_t nd, int64_t H, int64_t KVH, int64_t D,
                            int64_t BS, float scale, int kv_dtype, const float *fp8_lut);

int gguf_matmul_a8(int type, const float *x, const uint8_t *raw, float *y, int64_t M, int64_t N, int64_t K);
int gguf_matmul_a8_parts(int n, const int *types, const uint8_t *const *raws, const int64_t *Ns, const float *x,
                         float *y, int64_t M, int64_t K);
int gguf_matmul_f32(int type, const float *x, const uint8_t *raw, float *y, int64_t M, int64_t N, int64_t K);

/* one linear: kind 0 int4, 1 int8, 2 int4 with int8 activations, 3 int8 with int8 activations, 6 and 7 the
 * same with int16 activations, 5 int8 with a scale per 16 (quant_matmul.c's q, scales, mins), 4 float32
 * (qweight its panels, see f32_matmul); GGUF_A8 + t and GGUF_F32 + t: a GGUF's blocks of ggml type t as the
 * file stores them (qweight the rows; gguf_blocks.c; t may be a repacked type, 100 + the file's), int8 or float32
 * activations. n_parts > 0: the outputs
 * of parts[0 .. n_parts) side by side (a fused projection whose shards have different types); bias after. */
#define GGUF_A8 100
#define GGUF_F32 400
typedef struct QLinear {
    const void *qweight;
    const float *scales, *mins, *bias; /* bias may be NULL */
    int64_t n, k, kind;
    const struct QLinear *parts;
    int64_t n_parts;
} QLinear;

typedef struct {
    QLinear qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    void *k_cache, *v_cache; /* the layer's [num_blocks, block_size, kv_heads, head_dim (int8: + 4)] halves */
    int64_t sliding_window;  /* 0: none */
    int64_t kv_dtype;        /* 0 float32, 1 bfloat16, 3 int8 (paged_decode_attention's codes) */
} DecodeLayer;

/* float32 to bfloat16, rounding to nearest even (PyTorch's conversion; a NaN stays a NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* one token's K or V row (kv_heads heads of D) into its cache slot, in the cache's dtype; int8: each head's
 * D values round(x * 127 / max|x|) and its scale max|x| / 127 after them (attention/kv_int8.py's bytes) */
static void store_kv(void *cache, int64_t kv_dtype, int64_t slot, const float *row, int64_t kv_heads, int64_t D) {
    const int64_t n = kv_heads * D;
    if (kv_dtype == 0) {
        memcpy((float *)cache + slot * n, row, n * sizeof(float));
        return;
    }
    if (kv_dtype == 3) {
        int8_t *dst = (int8_t *)cache + slot * kv_heads * (D + 4);
        for (int64_t h = 0; h < kv_heads; h++, dst += D + 4, row += D) {
            float amax = 0.f;
            for (int64_t i = 0; i < D; i++) amax = fabsf(row[i]) > amax ? fabsf(row[i]) : amax;
            const float inv = amax > 0.f ? 127.f / amax : 0.f, s = amax / 127.f;
            for (int64_t i = 0; i < D; i++) {
                const float r = nearbyintf(row[i] * inv);
                dst[i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
            }
            memcpy(dst + D, &s, 4);
        }
        return;
    }
    uint16_t *dst = (uint16_t *)cache + slot * n;
    for (int64_t i = 0; i < n; i++) dst[i] = to_bf16(row[i]);
}

static int linear(const QLinear *l, const float *x, float *y, int64_t T);

#define MAX_PARTS 8

/* the parts' outputs into their columns of y [T, l->n]: GGUF blocks with int8 activations in one call (x
 * rounded once, each part's columns written in place; the same numbers as a call a part) */
static int stacked(const QLinear *l, const float *x, float *y, int64_t T) {
    int a8 = l->n_parts <= MAX_PARTS;
    for (int64_t p = 0; p < l->n_parts && a8; p++)
        a8 = l->parts[p].kind >= GGUF_A8 && l->parts[p].kind < GGUF_F32 && !l->parts[p].n_parts && !l->parts[p].bias;
    if (a8) {
        int types[MAX_PARTS];
        const uint8_t *raws[MAX_PARTS];
        int64_t ns[MAX_PARTS];
        for (int64_t p = 0; p < l->n_parts; p++)
            types[p] = (int)(l->parts[p].kind - GGUF_A8), raws[p] = l->parts[p].qweight, ns[p] = l->parts[p].n;
        return gguf_matmul_a8_parts((int)l->n_parts, types, raws, ns, x, y, T, l->k) ? -1 : 0;
    }
    int64_t widest = 0, col = 0;
    for (int64_t p = 0; p < l->n_parts; p++) widest = l->parts[p].n > widest ? l->parts[p].n : widest;
    float *tmp = malloc(T * widest * sizeof(float));
    if (!tmp) return -1;
    for (int64_t p = 0; p < l->n_parts; p++) {
        const QLinear *part = l->parts + p;
        linear(part, x, tmp, T);
        for (int64_t t = 0; t < T; t++) memcpy(y + t * l->n + col, tmp + t * part->n, part->n * sizeof(float));
        col += part->n;
    }
    free(tmp);
    return 0;
}

static int linear(const QLinear *l, const float *x, float *y, int64_t T) {
    if (l->n_parts) {
        if (stacked(l, x, y, T)) return -1;
    } else if (l->kind >= GGUF_F32) {
        gguf_matmul_f32((int)(l->kind - GGUF_F32), x, l->qweight, y, T, l->n, l->k);
    } else if (l->kind >= GGUF_A8) {
        gguf_matmul_a8((int)(l->kind - GGUF_A8), x, l->qweight, y, T, l->n, l->k);
    } else switch (l->kind) {
        case 0: int4_matmul(x, l->qweight, l->scales, l->mins, y, T, l->n, l->k); break;
        case 1: int8_matmul(x, l->qweight, l->scales, l->mins, y, T, l->n, l->k); break;
        case 2: int4_matmul_a8(x, l->qweight, l->scales, l->mins, y, T, l->n, l->k, 1); break;
        case 3: int8_matmul_a8(x, l->qweight, l->scales, l->mins, y, T, l->n, l->k, 1); break;
        case 6: int4_matmul_a8(x, l->qweight, l->scales, l->mins, y, T, l->n, l->k, 2); break;
        case 7: int8_matmul_a8(x, l->qweight, l->scales, l->mins, y, T, l->n, l->k, 2); break;
        case 5: int8_matmul_g16(x, l->qweight, l->scales, l->mins, y, T, l->n, l->k); break;
        default: f32_matmul(x, l->qweight, y, T, l->n, l->k); break;
    }
    if (l->bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < l->n; i++) y[t * l->n + i] += l->bias[i];
    return 0;
}

/* x [T, hidden]: the step's embeddings (read only); out [T, hidden]: the final norm's output.
 * cos, sin [T, head_dim / 2]; slots [T]: where each token's K/V goes; block_tables [>= T, bt_stride],
 * seq_lens [T]. Returns 0, or -1 when a buffer could not be allocated (the step's results are then void). */
int decode_layers(const DecodeLayer *layers, int64_t n_layers, const float *x, float *out, int64_t T,
                  int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, float eps,
                  const float *final_norm, const float *cos, const float *sin, const int64_t *slots,
                  const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens, int64_t block_size,
                  float scale) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_n = q_size + 2 * kv_size;
    float *nrm = malloc(T * hidden * sizeof(float)), *qkv = malloc(T * qkv_n * sizeof(float));
    float *qk = malloc(T * (q_size + kv_size) * sizeof(float)), *att = malloc(T * q_size * sizeof(float));
    float *o = malloc(T * hidden * sizeof(float)), *mlp = malloc(T * hidden * sizeof(float));
    float *gu = malloc(T * 2 * inter * sizeof(float)), *act = malloc(T * inter * sizeof(float));
    int64_t *starts = malloc(T * sizeof(int64_t));
    int rc = 0;
    if (!nrm || !qkv || !qk || !att || !o || !mlp || !gu || !act || !starts) {
        rc = -1;
        goto done;
    }
    /* the residual stream: the embeddings, then alternately o and mlp (as the Python loop's buffers) */
    const float *residual = x;
    for (int64_t l = 0; l < n_layers; l++) {
        const DecodeLayer *L = layers + l;
        if (l == 0)
            add_rms_norm((float *)x, NULL, L->input_norm, nrm, T, hidden, eps); /* reads x only */
        else {
            add_rms_norm(mlp, residual, L->input_norm, nrm, T, hidden, eps);
            residual = mlp;
        }
        if (linear(&L->qkv, nrm, qkv, T)) {
            rc = -1;
            goto done;
        }
        rotary(qkv, qkv_n, cos, sin, qk, T, heads + kv_heads, head_dim); /* q and k heads together */
        for (int64_t t = 0; t < T; t++) {                                /* every new K/V before any read */
            store_kv(L->k_cache, L->kv_dtype, slots[t], qk + t * (q_size + kv_size) + q_size, kv_heads, head_dim);
            store_kv(L->v_cache, L->kv_dtype, slots[t], qkv + t * qkv_n + q_size + kv_size, kv_heads, head_dim);
        }
        for (int64_t t = 0; t < T; t++) {
            const int64_t s = L->sliding_window > 0 ? seq_lens[t] - L->sliding_window : 0;
            starts[t] = s > 0 ? s : 0;
        }
        paged_decode_attention(qk, q_size + kv_size, L->k_cache, L->v_cache, block_tables, bt_stride, seq_lens,
                               starts, att, T, heads, kv_heads, head_dim, block_size, scale, (int)L->kv_dtype, NULL);
        if (linear(&L->o, att, o, T)) {
            rc = -1;
            goto done;
        }
        add_rms_norm(o, residual, L->post_norm, nrm, T, hidden, eps);
        residual = o;
        if (linear(&L->gate_up, nrm, gu, T)) {
            rc = -1;
            goto done;
        }
        silu_mul(gu, act, T, inter);
        if (linear(&L->down, act, mlp, T)) {
            rc = -1;
            goto done;
        }
    }
    add_rms_norm(mlp, residual, final_norm, out, T, hidden, eps);
done:
    free(nrm);
    free(qkv);
    free(qk);
    free(att);
    free(o);
    free(mlp);
    free(gu);
    free(act);
    free(starts);
    return rc;
}
