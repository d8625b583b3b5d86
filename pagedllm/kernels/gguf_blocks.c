/* GGUF's quantized blocks run as the file stores them (see pagedllm/layers/gguf_linear.py).
 *
 * A weight W [N, K] is N rows of blocks, row n's blocks contiguous: exactly the bytes of the file (a
 * read-only mmap is fine, nothing is written or converted). The types, by ggml id:
 *
 *   Q4_K (12)  144 bytes / 256: f16 d, f16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8], 128 bytes
 *              of nibbles: byte l of chunk c (32 bytes) holds element 64c + l (low) and 64c + 32 + l (high).
 *              w = (d * sc[s]) * q - dmin * m[s] for sub-block s (32 elements), q 0..15.
 *   Q6_K (14)  210 bytes / 256: ql[128], qh[64], int8 scales[16], f16 d. Half h (128 elements): byte l of
 *              ql[64h ..] holds elements l (low nibble) and l + 64 (high), byte l of qh[32h ..] the top two
 *              bits of elements l, l + 32, l + 64, l + 96 (l < 32). w = (d * sc[e / 16]) * (q - 32), q 0..63.
 *   Q5_K (13)  176 bytes / 256: Q4_K's d, dmin and 12 bytes of scales, qh[32] (bit s of byte l: the fifth bit of
 *              sub-block s's element l), then 128 bytes of nibbles as Q4_K's; q 0..31. Read in panels only.
 *   Q8_0 (8)   34 bytes / 32: f16 d, int8 q[32]; w = q * d.
 *   Q4_0 (2)   18 bytes / 32: f16 d, 16 bytes of nibbles (element j low, j + 16 high); w = d * (q - 8), q 0..15.
 *              Read in panels only.
 *   IQ4_NL (20) Q4_0's bytes, each nibble i an index into 16 int8 values: w = d * IQ4_NL_VALUES[i]. In panels
 *              only, multiplied as Q8_0's bytes (the values + 128, unsigned, looked up by vpshufb).
 *   Q2_K (10)  84 bytes / 256: sixteen bytes of a 4-bit scale (low) and min (high) per 16, qs[64], f16 d and dmin.
 *              Element 128h + 32j + l is bits 2j of qs[32h + l]: w = (d * sc) * q - dmin * m, q 0..3. In panels
 *              only (Q4_K's arithmetic per 16: the mins times the plain sums of x per 16).
 *   Q3_K (11)  110 bytes / 256: hmask[32], qs[64], 12 bytes of sixteen 6-bit scales, f16 d. Element 128h + 32j + l
 *              (h < 2, j < 4, l < 32) is bits 2j of qs[32h + l] plus 4 where bit 4h + j of hmask[l] is set, less 4:
 *              w = (d * (sc[e / 16] - 32)) * (q - 4), q 0..7. In panels only (Q6_K's arithmetic, offset 4).
 *   IQ4_XS (23) 136 bytes / 256: f16 d, u16 scales_h, 4 bytes scales_l, then IQ4_NL's 16 bytes of nibbles for each
 *              sub-block s of 32: w = (d * (ls - 32)) * IQ4_NL_VALUES[i], ls = the low (s even) or high nibble of
 *              scales_l[s / 2] and bits 2s, 2s + 1 of scales_h above it. In panels only (integer sums per
 *              sub-block times ls - 32, one float multiply-add per super-block, as the K-quants).
 *   Q5_0 (6)   22 bytes / 32: f16 d, u32 qh (bit j: element j's fifth bit), 16 bytes of nibbles (element j
 *              low, j + 16 high); w = d * (q - 16), q 0..31.
 *
 * Integer activations (the "gguf" mode, llama.cpp's arithmetic): each row of x is rounded to int8 per block of
 * 256 (Q8_K, for the K-quants) or 32 (Q8_0, for Q8_0 / Q5_0): d = 1 / (127 / max|x|), q = round(x / d) ties
 * to even, with the sums of q per 16 (bsums). A super-block's products are then summed in integers:
 *   Q4_K: y += dx * (d * sum_s sc[s] * (q_w . q_x)_s  -  dmin * sum_s m[s] * sum(q_x)_s)
 *   Q6_K: y += dx * d * sum_j sc[j] * ((q_w . q_x)_j - 32 * sum(q_x)_j)      (j: groups of 16)
 * one float multiply-add per super-block and row. Integer sums are exact, so the result is
 * W_dequantized . x_rounded up to float summation order, at any number of rows (the batched path of
 * GGUFLinear computes exactly that with a float GEMM).
 *
 * AVX-512 (VNNI + BW) path: a super-block is decoded once into four vectors of 64 unsigned bytes, elements
 * 64t .. 64t + 63 in order (Q4_K's two nibble halves recombined by a 128-bit lane shuffle, Q6_K's high
 * bits by variable shifts of qh), and four vectors of the scales that apply to each int32 lane. Per row
 * of x, vpdpbusd takes 4 products a lane (unsigned weights x signed activations, at most 4 * 63 * 127 in
 * magnitude: an int16) and vpdpwssd multiplies each lane by its scale into the super-block's int32 sum:
 * two instructions per 64 weights. The mins (Q4_K) and the -32 offset (Q6_K) come from the bsums. The
 * AVX2 path does the same 32 weights at a time with maddubs (pairs into int16) and madd (by the scales,
 * pairs into int32); the plain C path the same in scalar integers.
 *
 * Float activations (the "gguf-exact" mode): each super-block (or 256 elements of 32-blocks) is
 * dequantized into a buffer on the stack as gguf_dequantize does it, bit for bit, then multiplied with
 * FMAs: the float32 function of the dequantized weights up to summation order.
 *
 * Panels (gguf_pack_panels): where the level has AVX2, weights of whole panels of 16 rows are repacked at load so
 * that one kernel multiplies every row count (a row's bits never depend on what shares its call): the AVX-512
 * VNNI kernels below, or gguf_panels_avx2.h's on 256-bit registers, which compute the same bits.
 *
 * Weight rows are split across OpenMP threads, COLS at a time; rows of x (up to 6 at once: a verification
 * step of speculative decoding with k = 5) share each decoded super-block.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "vec_math.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GB_AVX512 1
#endif
/* the repacked panels (gguf_pack_panels) and their one kernel at every row count: AVX-512 VNNI's, and below it
 * the same panels read as two halves of 8 rows on AVX2's 256-bit registers (the same bits: see the AVX2 section) */
#if defined(GB_AVX512) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define GB_PANELS 1
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       IQ4_NL = 20, IQ4_XS = 23 };

/* the 16 values IQ4_NL's nibbles index (llama.cpp's kvalues_iq4nl) */
static const int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#define QK 256   /* elements of a K-quant super-block, and of a chunk the float path dequantizes */
#define COLS 16  /* weight rows a thread takes at a time */
/* The one-row kernels read a weight row's blocks in order and ask for the cache lines PF_AHEAD bytes on
 * (rows lie one after the other, so past a row's end come the next row's). The hardware prefetchers stop at
 * each 4 KiB page, whose successor lies anywhere in physical memory; a decode step streams ~1 GB of blocks
 * through them. All of the 1.5B's linears in one pass (M = 1, two threads, the same bits): 17.1 GB/s without,
 * 18.7 / 19.3 / 18.9 / 18.0 GB/s 2 / 3 / 4 / 8 KiB ahead (medians of 20, alternated in one process). */
#ifndef PF_AHEAD
#define PF_AHEAD 3072
#endif
#define PREFETCH_AHEAD(b, bytes)                                              \
    do {                                                                      \
        for (int pf_ = 0; PF_AHEAD && pf_ < (bytes); pf_ += 64)               \
            __builtin_prefetch((const char *)(b) + PF_AHEAD + pf_, 0, 3);     \
    } while (0)
#define MR 6     /* rows of x sharing each decoded super-block */

/* elements and bytes of a block of the eight types gguf_to_groups converts (0: another type) */
static int block_elems_any(int type) {
    switch (type) {
        case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case IQ4_NL: return 32;
        case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: case IQ4_XS: return 256;
        default: return 0;
    }
}

static int block_bytes_any(int type) {
    switch (type) {
        case Q4_0: case IQ4_NL: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        case IQ4_XS: return 136;
        case Q3_K: return 110;
        case Q2_K: return 84;
        default: return 0;
    }
}

/* The types repacked into panels of 16 rows (gguf_pack_panels, AVX2 and AVX-512 VNNI builds): Q2_K to Q6_K, Q8_0,
 * Q5_0, Q4_0, IQ4_NL and IQ4_XS; their type ids PANEL + the file's. The same bytes a row as the file's type, so a
 * weight keeps its shape [N, bytes a row]. */
enum { PANEL = 100, P_Q4_K = PANEL + Q4_K, P_Q6_K = PANEL + Q6_K, P_Q8_0 = PANEL + Q8_0, P_Q5_0 = PANEL + Q5_0,
       P_Q5_K = PANEL + Q5_K, P_Q4_0 = PANEL + Q4_0, P_IQ4_NL = PANEL + IQ4_NL, P_IQ4_XS = PANEL + IQ4_XS,
       P_Q3_K = PANEL + Q3_K, P_Q2_K = PANEL + Q2_K };
static int base_type(int type) { return type > PANEL ? type - PANEL : type; }

/* PACKED(T, XP) (defined where this is used) with T the repacked type ptype as a constant, XP 1 where ex holds its
 * words expanded for every tile of rows; xps: the types whose words a level expands (XP_*, a constant: the other
 * types' expanded kernels are not compiled) */
enum { XP_Q5_K = 1, XP_Q6_K = 2, XP_IQ4_XS = 4, XP_Q3_K = 8, XP_Q2_K = 16 };
#define BY_PANEL_TYPE(ptype, ex, xps)                                                              \
    do {                                                                                           \
        if ((ptype) == P_Q4_K) { PACKED(P_Q4_K, 0) }                                               \
        else if ((ptype) == P_Q5_K && ((xps) & XP_Q5_K) && (ex)) { PACKED(P_Q5_K, 1) }             \
        else if ((ptype) == P_Q5_K) { PACKED(P_Q5_K, 0) }                                          \
        else if ((ptype) == P_Q6_K && ((xps) & XP_Q6_K) && (ex)) { PACKED(P_Q6_K, 1) }             \
        else if ((ptype) == P_Q6_K) { PACKED(P_Q6_K, 0) }                                          \
        else if ((ptype) == P_Q8_0) { PACKED(P_Q8_0, 0) }                                          \
        else if ((ptype) == P_Q4_0) { PACKED(P_Q4_0, 0) }                                          \
        else if ((ptype) == P_IQ4_NL) { PACKED(P_IQ4_NL, 0) }                                      \
        else if ((ptype) == P_IQ4_XS && ((xps) & XP_IQ4_XS) && (ex)) { PACKED(P_IQ4_XS, 1) }       \
        else if ((ptype) == P_IQ4_XS) { PACKED(P_IQ4_XS, 0) }                                      \
        else if ((ptype) == P_Q3_K && ((xps) & XP_Q3_K) && (ex)) { PACKED(P_Q3_K, 1) }             \
        else if ((ptype) == P_Q3_K) { PACKED(P_Q3_K, 0) }                                          \
        else if ((ptype) == P_Q2_K && ((xps) & XP_Q2_K) && (ex)) { PACKED(P_Q2_K, 1) }             \
        else if ((ptype) == P_Q2_K) { PACKED(P_Q2_K, 0) }                                          \
        else { PACKED(P_Q5_0, 0) }                                                                 \
    } while (0)

/* the file's types the matmul kernels read as stored; those they read in panels only; of both, those whose panels
 * hold their blocks in pairs (blocks of 32: a row of a multiple of 64 weights) */
static int reads_stored(int type) { return type == Q4_K || type == Q6_K || type == Q8_0 || type == Q5_0; }
static int panel_only(int type) {
    return type == Q5_K || type == Q4_0 || type == IQ4_NL || type == IQ4_XS || type == Q3_K || type == Q2_K;
}
static int paired(int type) { return type == Q8_0 || type == Q5_0 || type == Q4_0 || type == IQ4_NL; }

/* the same for the types the matmul kernels read (0: a type they do not read): four as stored, ten repacked */
static int reads(int type) {
#ifdef GB_PANELS
    if (type > PANEL) return reads_stored(base_type(type)) || panel_only(base_type(type));
#endif
    return reads_stored(type);
}
static int block_elems(int type) { return reads(type) ? block_elems_any(base_type(type)) : 0; }
static int block_bytes(int type) { return reads(type) ? block_bytes_any(base_type(type)) : 0; }

/* elements of one block of the activations' rounding: 256 for the K-quants (Q8_K), 32 else (Q8_0) */
static int act_block(int type) { return block_elems(type); }

int gguf_block_elems(int type) { return block_elems(type); }
int gguf_block_bytes(int type) { return block_bytes(type); }

#if defined(__AVX2__)
/* IQ4_NL_VALUES + 128 (unsigned bytes, as Q8_0's panels hold q + 128), a nibble's value by vpshufb */
static inline __m128i iq4nl_table(void) {
    return _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181,
                         (char)197, (char)217, (char)241);
}
#endif

static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Q8_0, Q5_0 and Q4_0 in panels (K a multiple of 64) hold their blocks in pairs: pair P (blocks 2P, 2P + 1) of a
 * panel's 16 rows is 11 vectors of 64 bytes (Q8_0: 17; Q4_0: 9), lane c (4 bytes) row c's; for block 2P + h:
 *   vector 0                  both blocks' d, 16 f16 each (block 2P + h's at bytes 32h + 2c);
 *   Q8_0, vectors 1 + 8h + j  word j (j < 8) of q ^ 0x80: elements 4j .. 4j + 3, unsigned q + 128;
 *   Q5_0, vector 1 + h        the fifth bits as 8 masks of 64 bits (mask j, bit 4c + i: that of row c's
 *                             element 4j + i, i < 4);
 *         vectors 3 + 4h + w  nibble word w (w < 4) as the file has it: elements 4w .. 4w + 3 in the low
 *                             nibbles, 16 + 4w .. in the high ones;
 *   Q4_0, vectors 1 + 4h + w  nibble word w as Q5_0's, without fifth bits (IQ4_NL: the same, its nibbles indices).
 * So element 4j + i of a block is byte i of word j's lane (Q5_0: of word j % 4's low (j < 4) or high nibbles,
 * plus 16 where its mask j's bit is set). The file's bytes, transposed and their bits permuted: a panel holds
 * its rows' bytes, no more (pairs, not single blocks, so that each vector starts on a line of 64 bytes). */
#ifdef GB_PANELS
static void repack_panel_q32(int type, const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *dst) {
    const int bytes = block_bytes_any(type);
    for (int64_t g = 0; g < nb; g++) {
        uint8_t *pair = dst + (g / 2) * 32 * bytes;
        const int h = (int)(g & 1);
        uint64_t mask[8] = {0};
        for (int c = 0; c < 16; c++) {
            const uint8_t *b = rows + c * row_bytes + g * bytes;
            memcpy(pair + 32 * h + 2 * c, b, 2);
            if (type == Q8_0) {
                for (int j = 0; j < 8; j++) {
                    const uint32_t w = load32(b + 2 + 4 * j) ^ 0x80808080u;
                    memcpy(pair + (1 + 8 * h + j) * 64 + 4 * c, &w, 4);
                }
            } else if (type == Q4_0 || type == IQ4_NL) {
                for (int w = 0; w < 4; w++) memcpy(pair + (1 + 4 * h + w) * 64 + 4 * c, b + 2 + 4 * w, 4);
            } else {
                const uint32_t qh = load32(b + 2);
                for (int j = 0; j < 8; j++) mask[j] |= (uint64_t)((qh >> 4 * j) & 0xF) << 4 * c;
                for (int w = 0; w < 4; w++) memcpy(pair + (3 + 4 * h + w) * 64 + 4 * c, b + 6 + 4 * w, 4);
            }
        }
        if (type == Q5_0) memcpy(pair + (1 + h) * 64, mask, 64);
    }
}
#endif

/* row c of a Q8_0 / Q5_0 / Q4_0 panel (nb blocks) as the file stores it, into out */
static void unpack_row_q32(int type, const uint8_t *panel, int c, int64_t nb, uint8_t *out) {
    const int bytes = block_bytes_any(type);
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *pair = panel + (g / 2) * 32 * bytes;
        const int h = (int)(g & 1);
        uint8_t *o = out + g * bytes;
        memcpy(o, pair + 32 * h + 2 * c, 2);
        if (type == Q8_0) {
            for (int j = 0; j < 8; j++) {
                const uint32_t w = load32(pair + (1 + 8 * h + j) * 64 + 4 * c) ^ 0x80808080u;
                memcpy(o + 2 + 4 * j, &w, 4);
            }
        } else if (type == Q4_0 || type == IQ4_NL) {
            for (int w = 0; w < 4; w++) memcpy(o + 2 + 4 * w, pair + (1 + 4 * h + w) * 64 + 4 * c, 4);
        } else {
            uint32_t qh = 0;
            for (int j = 0; j < 8; j++) {
                uint64_t m;
                memcpy(&m, pair + (1 + h) * 64 + 8 * j, 8);
                qh |= (uint32_t)((m >> 4 * c) & 0xF) << 4 * j;
            }
            memcpy(o + 2, &qh, 4);
            for (int w = 0; w < 4; w++) memcpy(o + 6 + 4 * w, pair + (3 + 4 * h + w) * 64 + 4 * c, 4);
        }
    }
}

/* row n of a repacked weight (type PANEL + t, K elements a row) as the file stores it, into out */
static void unpack_row(int type, const uint8_t *packed, int64_t n, int64_t K, uint8_t *out) {
    const int bytes = block_bytes(type), words = bytes / 4;
    const int64_t nsb = K / QK, c = n % 16;
    const uint8_t *panel = packed + (n / 16) * 16 * (K / block_elems(type)) * bytes;
    if (paired(base_type(type))) {
        unpack_row_q32(base_type(type), panel, (int)c, K / 32, out);
        return;
    }
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *s = panel + sb * 16 * bytes;
        uint8_t *o = out + sb * bytes;
        for (int w = 0; w < words; w++) memcpy(o + 4 * w, s + (w * 16 + c) * 4, 4);
        if (bytes % 4) memcpy(o + 4 * words, s + words * 64 + c * (bytes % 4), bytes % 4);
    }
}

/* rows ids[0 .. n - 1] of a repacked weight (type PANEL + t, K elements a row) as the file stores them, into
 * out [n, bytes a row]; 0, or -1 for a type that is not a repacked one */
int gguf_unpack_rows(int type, const uint8_t *packed, const int64_t *ids, int64_t n, int64_t K, uint8_t *out) {
    if (type < PANEL || !reads(type)) return -1;
    const int64_t row_bytes = K / block_elems(type) * block_bytes(type);
    for (int64_t i = 0; i < n; i++) unpack_row(type, packed, ids[i], K, out + i * row_bytes);
    return 0;
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  /* subnormal: exact in float32 */
        const float v = (float)man * (1.f / 16777216.f);
        memcpy(&bits, &v, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* v as rounded to float: keeps GCC (-ffp-contract=fast) from fusing a product with the subtraction after
 * it, which gguf's dequantization rounds twice */
static inline float rounded(float v) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+x"(v));
#else
    volatile float t = v;
    v = t;
#endif
    return v;
}

/* Q4_K's 12 bytes of 6-bit scales and mins: sc[0..7] and m[0..7] as bytes of two u64 */
static inline void k4_scales(const uint8_t *p, uint64_t *sc, uint64_t *mn) {
    uint32_t u[3];
    memcpy(u, p, 12);
    const uint32_t s_lo = u[0] & 0x3F3F3F3Fu, m_lo = u[1] & 0x3F3F3F3Fu;
    const uint32_t s_hi = (u[2] & 0x0F0F0F0Fu) | ((u[0] >> 2) & 0x30303030u);
    const uint32_t m_hi = ((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 2) & 0x30303030u);
    *sc = s_lo | (uint64_t)s_hi << 32;
    *mn = m_lo | (uint64_t)m_hi << 32;
}

#ifdef GB_AVX512
/* a Q6_K super-block's weights q (0..63, unsigned: the -32 not applied) as four vectors of 64 bytes, vector t
 * holding elements 64t .. 64t + 63 in order */
static inline __attribute__((always_inline)) void q6k_decode(const uint8_t *b, __m512i w[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3);
    /* qh's shifts for the top bits of ql's low nibbles (bytes 0-31: elements l, 32-63: l + 32) and high ones */
    const __m512i sh_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i sh_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    for (int h = 0; h < 2; h++) {
        const __m512i l = _mm512_loadu_si512(b + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        const __m512i top_lo = _mm512_and_si512(_mm512_srlv_epi16(qh, sh_lo), m3);
        const __m512i top_hi = _mm512_and_si512(_mm512_srlv_epi16(qh, sh_hi), m3);
        w[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_slli_epi16(top_lo, 4));
        w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), _mm512_slli_epi16(top_hi, 4));
    }
}
#endif

/* ---- dequantization ------------------------------------------------------------------------------ */

/* elements [c * 256, c * 256 + 256) of one row (for the 32-element types: its 8 blocks; K a multiple of 256
 * there) as float32, gguf's values bit for bit */
static void dequant_chunk(int type, const uint8_t *row, int64_t c, int64_t n_elems, float *out) {
    if (type == Q4_K) {
        const uint8_t *b = row + c * 144;
        const float d = f16(b), dmin = f16(b + 2);
        uint64_t scw, mnw;
        k4_scales(b + 4, &scw, &mnw);
        for (int s = 0; s < 8; s++) {
            const float d1 = d * (float)((scw >> 8 * s) & 0xFF), m1 = dmin * (float)((mnw >> 8 * s) & 0xFF);
            const uint8_t *q = b + 16 + 32 * (s / 2);
            const int shift = 4 * (s & 1);
            float *o = out + 32 * s;
#ifdef GB_AVX512
            const __m128i m4 = _mm_set1_epi8(0x0F);
            for (int h = 0; h < 2; h++) {
                const __m128i qb = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * h)), shift), m4);
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qb)), _mm512_set1_ps(d1));
                __asm__("" : "+v"(t));  /* as rounded(): not fused with the subtraction */
                _mm512_storeu_ps(o + 16 * h, _mm512_sub_ps(t, _mm512_set1_ps(m1)));
            }
#else
            for (int l = 0; l < 32; l++) o[l] = rounded(d1 * (float)((q[l] >> shift) & 15)) - m1;
#endif
        }
    } else if (type == Q5_K) {  /* Q4_K's scales and nibbles, and bit s of qh[l] the fifth of sub-block s's l-th */
        const uint8_t *b = row + c * 176, *qh = b + 16;
        const float d = f16(b), dmin = f16(b + 2);
        uint64_t scw, mnw;
        k4_scales(b + 4, &scw, &mnw);
        for (int s = 0; s < 8; s++) {
            const float d1 = d * (float)((scw >> 8 * s) & 0xFF), m1 = dmin * (float)((mnw >> 8 * s) & 0xFF);
            const uint8_t *q = b + 48 + 32 * (s / 2);
            const int shift = 4 * (s & 1);
            for (int l = 0; l < 32; l++)
                out[32 * s + l] = rounded(d1 * (float)(((q[l] >> shift) & 15) | (((qh[l] >> s) & 1) << 4))) - m1;
        }
    } else if (type == Q2_K) {
        const uint8_t *b = row + c * 84, *qs = b + 16;
        const float d = f16(b + 80), dmin = f16(b + 82);
        for (int s = 0; s < 16; s++) {
            const float dl = d * (float)(b[s] & 15), ml = dmin * (float)(b[s] >> 4);
            const int h = s / 8, j = (s % 8) / 2;
            for (int i = 0; i < 16; i++)
                out[16 * s + i] = rounded(dl * (float)((qs[32 * h + 16 * (s % 2) + i] >> 2 * j) & 3)) - ml;
        }
    } else if (type == Q3_K) {
        const uint8_t *b = row + c * 110, *hm = b, *qs = b + 32, *scb = b + 96;
        const float d = f16(b + 108);
        for (int s = 0; s < 16; s++) {
            const int sc = ((scb[s % 8] >> 4 * (s / 8)) & 15) | (((scb[8 + s % 4] >> 2 * (s / 4)) & 3) << 4);
            const float dl = d * (float)(sc - 32);
            const int h = s / 8, j = (s % 8) / 2;
            for (int i = 0; i < 16; i++) {
                const int l = 16 * (s % 2) + i;
                const int q = ((qs[32 * h + l] >> 2 * j) & 3) - (((hm[l] >> (4 * h + j)) & 1) ? 0 : 4);
                out[16 * s + i] = dl * (float)q;
            }
        }
    } else if (type == IQ4_XS) {
        const uint8_t *b = row + c * 136;
        const float d = f16(b);
        const uint32_t sh = (uint32_t)b[2] | (uint32_t)b[3] << 8;
        for (int s = 0; s < 8; s++) {
            const int ls = ((b[4 + s / 2] >> 4 * (s & 1)) & 15) | (((sh >> 2 * s) & 3) << 4);
            const float dl = d * (float)(ls - 32);
            const uint8_t *q = b + 8 + 16 * s;
            for (int j = 0; j < 16; j++) {
                out[32 * s + j] = dl * (float)IQ4_NL_VALUES[q[j] & 15];
                out[32 * s + j + 16] = dl * (float)IQ4_NL_VALUES[q[j] >> 4];
            }
        }
    } else if (type == Q6_K) {
        const uint8_t *b = row + c * 210;
        const float d = f16(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
#ifdef GB_AVX512
        __m512i w[4];
        q6k_decode(b, w);
        for (int j = 0; j < 16; j++) {  /* group j of 16: bytes 16 (j % 4) .. of vector j / 4 */
            const __m128i q = _mm512_extracti32x4_epi32(w[j / 4], 0);
            const __m128i qj = j % 4 == 0 ? q
                               : j % 4 == 1 ? _mm512_extracti32x4_epi32(w[j / 4], 1)
                               : j % 4 == 2 ? _mm512_extracti32x4_epi32(w[j / 4], 2)
                                            : _mm512_extracti32x4_epi32(w[j / 4], 3);
            const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(qj), _mm512_set1_epi32(32)));
            _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[j]), v));
        }
#else
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            for (int l = 0; l < 32; l++) {
                const int q0 = (ql[l] & 15) | ((qh[l] & 3) << 4), q1 = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
                const int q2 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), q3 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                float *o = out + 128 * h + l;
                const int j = 8 * h + l / 16;
                o[0] = (d * (float)sc[j]) * (float)(q0 - 32);
                o[32] = (d * (float)sc[j + 2]) * (float)(q1 - 32);
                o[64] = (d * (float)sc[j + 4]) * (float)(q2 - 32);
                o[96] = (d * (float)sc[j + 6]) * (float)(q3 - 32);
            }
        }
#endif
    } else {
        const int64_t first = c * 8, last = first + 8 < n_elems / 32 ? first + 8 : n_elems / 32;
        for (int64_t g = first; g < last; g++) {
            float *o = out + 32 * (g - first);
            if (type == Q8_0) {
                const uint8_t *b = row + g * 34;
                const float d = f16(b);
                for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)b[2 + j] * d;
            } else if (type == Q4_0) {
                const uint8_t *b = row + g * 18;
                const float d = f16(b);
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)((int)(b[2 + j] & 15) - 8);
                    o[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
                }
            } else if (type == IQ4_NL) {
                const uint8_t *b = row + g * 18;
                const float d = f16(b);
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)IQ4_NL_VALUES[b[2 + j] & 15];
                    o[j + 16] = d * (float)IQ4_NL_VALUES[b[2 + j] >> 4];
                }
            } else {  /* Q5_0 */
                const uint8_t *b = row + g * 22;
                const float d = f16(b);
                uint32_t qh;
                memcpy(&qh, b + 2, 4);
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)((int)((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
                    o[j + 16] = d * (float)((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
                }
            }
        }
    }
}

/* W [N, K] as float32 into w [N, K]; 0, or -1 for a type these kernels do not read (the rows of a type read only in
 * panels otherwise, as the file stores them, are read here too: a panel's row looked up, an embedding's) */
int gguf_dequantize(int type, const uint8_t *raw, float *w, int64_t N, int64_t K) {
    if (!block_elems(type) && !panel_only(type)) return -1;
    const int64_t row_bytes = K / block_elems_any(base_type(type)) * block_bytes_any(base_type(type)), chunks = (K + QK - 1) / QK;
    if (type > PANEL) {  /* a row at a time as the file stores it */
        int failed = 0;
#pragma omp parallel
        {
            uint8_t *row = malloc(row_bytes);
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                if (!row) continue;
                unpack_row(type, raw, n, K, row);
                for (int64_t c = 0; c < chunks; c++) dequant_chunk(base_type(type), row, c, K, w + n * K + c * QK);
            }
            if (!row) {
#pragma omp atomic write
                failed = 1;
            }
            free(row);
        }
        return failed ? -2 : 0;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t len = K - c * QK < QK ? K - c * QK : QK;
            if (len == QK) {
                dequant_chunk(type, raw + n * row_bytes, c, K, w + n * K + c * QK);
            } else {  /* the last 32-blocks of a row not a multiple of 256 */
                float buf[QK];
                dequant_chunk(type, raw + n * row_bytes, c, K, buf);
                memcpy(w + n * K + c * QK, buf, len * sizeof(float));
            }
        }
    }
    return 0;
}

/* ---- activations rounded to int8 ------------------------------------------------------------------ */

/* one block of x (`block` elements, a multiple of 16) rounded to int8; any output may be NULL. A block holding
 * NaN or infinity gets d = NaN and q = 0 (its rows' results NaN, never silently finite). */
static inline void quantize_block(const float *xb, int block, int8_t *q, float *d, int16_t *bsums, float *xr) {
#ifdef __AVX512F__
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int j = 0; j < block; j += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xb + j));
        vmax = _mm512_max_ps(vmax, a);
        bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ); /* NaN or infinite */
    }
    const float amax = _mm512_reduce_max_ps(vmax);
#else
    float amax = 0.f;
    int bad = 0;
    for (int j = 0; j < block; j++) {
        const float a = fabsf(xb[j]);
        amax = a > amax ? a : amax;
        bad |= !(a <= FLT_MAX);
    }
#endif
    const float iscale = amax > 0.f ? 127.f / amax : 0.f;
    const float db = bad ? NAN : amax > 0.f ? 1.f / iscale : 0.f;
    if (d) *d = db;
    if (bad) {
        if (q) memset(q, 0, block);
        if (bsums) memset(bsums, 0, block / 16 * sizeof(int16_t));
        if (xr)
            for (int j = 0; j < block; j++) xr[j] = 0.f * db;
        return;
    }
#ifdef __AVX512F__
    const __m512 vs = _mm512_set1_ps(iscale), vd = _mm512_set1_ps(db);
    for (int j = 0; j < block; j += 16) {
        /* the product rounded to float, then to the nearest integer, ties to even (llama.cpp's nearest_int) */
        __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + j), vs));
        qi = _mm512_max_epi32(_mm512_min_epi32(qi, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        if (q) _mm_storeu_si128((__m128i *)(q + j), _mm512_cvtepi32_epi8(qi));
        if (bsums) bsums[j / 16] = (int16_t)_mm512_reduce_add_epi32(qi);
        if (xr) _mm512_storeu_ps(xr + j, _mm512_mul_ps(_mm512_cvtepi32_ps(qi), vd));
    }
#else
    for (int g = 0; g < block / 16; g++) {
        int32_t t = 0;
        for (int j = 16 * g; j < 16 * g + 16; j++) {
            const int32_t qi = (int32_t)nearbyintf(xb[j] * iscale);
            const int8_t qj = (int8_t)(qi > 127 ? 127 : qi < -127 ? -127 : qi);
            t += qj;
            if (q) q[j] = qj;
            if (xr) xr[j] = (float)qj * db;
        }
        if (bsums) bsums[g] = (int16_t)t;
    }
#endif
}

/* each row of x [M, K] per block of `block` (256 or 32): qx [M, K] int8, d [M, K / block], bsums [M, K / 16]
 * int16 (the sums of q per 16), xr [M, K] = q * d; any output may be NULL. */
void gguf_quantize_q8(const float *x, int64_t M, int64_t K, int block, int8_t *qx, float *d, int16_t *bsums,
                      float *xr) {
    const int64_t R = M * (K / block);
#pragma omp parallel for schedule(static) if (R * block > 65536)
    for (int64_t r = 0; r < R; r++)
        quantize_block(x + r * block, block, qx ? qx + r * block : NULL, d ? d + r : NULL,
                       bsums ? bsums + r * (block / 16) : NULL, xr ? xr + r * block : NULL);
}

/* ---- integer dot products, one weight row against mc rows of x ---------------------------------------
 * x rows: qx K bytes apart, d K / block floats apart, bsums K / 16 apart; out[i] = row i's sum. */

#ifdef __AVX2__
static inline float hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* unsigned bytes u times signed bytes s, each 4 adjacent products summed into an int32 lane */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

static inline __attribute__((always_inline)) void q4k_rows(int mc, const uint8_t *row, int64_t nsb,
                                                           const int8_t *qx, const float *dx, const int16_t *bs,
                                                           int64_t K, float *out) {
#ifdef GB_AVX512
    const __m512i m4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[MR];
    __m256 accm[MR];
    for (int i = 0; i < mc; i++) acc[i] = _mm512_setzero_ps(), accm[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + sb * 144;
        PREFETCH_AHEAD(b, 144);
        const float d = f16(b), dmin = f16(b + 2);
        uint64_t scw, mnw;
        k4_scales(b + 4, &scw, &mnw);
        const __m512i q0 = _mm512_loadu_si512(b + 16), q1 = _mm512_loadu_si512(b + 80);
        const __m512i l0 = _mm512_and_si512(q0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
        const __m512i l1 = _mm512_and_si512(q1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
        /* chunk c's low nibbles are elements 64c .. 64c + 31, its high ones the next 32 */
        const __m512i w[4] = {_mm512_shuffle_i64x2(l0, h0, 0x44), _mm512_shuffle_i64x2(l0, h0, 0xEE),
                              _mm512_shuffle_i64x2(l1, h1, 0x44), _mm512_shuffle_i64x2(l1, h1, 0xEE)};
        /* vector t's lanes 0-7 are sub-block 2t, lanes 8-15 sub-block 2t + 1: scales as int32 (high half 0) */
        const __m512i s32 = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scw));
        __m512i s[4];
        for (int t = 0; t < 4; t++) s[t] = _mm512_permutexvar_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(2 * t)), s32);
        const __m128i m8 = _mm_cvtsi64_si128((long long)mnw);
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));  /* m[s] for both bsums of s */
        for (int i = 0; i < mc; i++) {
            const int8_t *x = qx + i * K + sb * QK;
            __m512i a = zero;
            for (int t = 0; t < 4; t++)
                a = _mm512_dpwssd_epi32(a, _mm512_dpbusd_epi32(zero, w[t], _mm512_loadu_si512(x + 64 * t)), s[t]);
            const float dxi = dx[i * nsb + sb];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(d * dxi), acc[i]);
            const __m256i mb = _mm256_madd_epi16(m16, _mm256_loadu_si256((const __m256i *)(bs + i * (K / 16) + sb * 16)));
            accm[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mb), _mm256_set1_ps(dmin * dxi), accm[i]);
        }
    }
    for (int i = 0; i < mc; i++) out[i] = _mm512_reduce_add_ps(acc[i]) - hsum256(accm[i]);
#elif defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MR], accm[MR];
    for (int i = 0; i < mc; i++) acc[i] = accm[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + sb * 144;
        PREFETCH_AHEAD(b, 144);
        const float d = f16(b), dmin = f16(b + 2);
        uint64_t scw, mnw;
        k4_scales(b + 4, &scw, &mnw);
        __m256i w[8], s[8];
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
            w[2 * c] = _mm256_and_si256(q, m4);
            w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        }
        for (int t = 0; t < 8; t++) s[t] = _mm256_set1_epi16((short)((scw >> 8 * t) & 0xFF));
        const __m128i m8 = _mm_cvtsi64_si128((long long)mnw);
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        for (int i = 0; i < mc; i++) {
            const int8_t *x = qx + i * K + sb * QK;
            __m256i a = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {  /* pairs into int16 (at most 2 * 15 * 127), then by the scale */
                const __m256i p = _mm256_maddubs_epi16(w[t], _mm256_loadu_si256((const __m256i *)(x + 32 * t)));
                a = _mm256_add_epi32(a, _mm256_madd_epi16(p, s[t]));
            }
            const float dxi = dx[i * nsb + sb];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(d * dxi), acc[i]);
            const __m256i mb = _mm256_madd_epi16(m16, _mm256_loadu_si256((const __m256i *)(bs + i * (K / 16) + sb * 16)));
            accm[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mb), _mm256_set1_ps(dmin * dxi), accm[i]);
        }
    }
    for (int i = 0; i < mc; i++) out[i] = hsum256(acc[i]) - hsum256(accm[i]);
#else
    for (int i = 0; i < mc; i++) out[i] = 0.f;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + sb * 144;
        const float d = f16(b), dmin = f16(b + 2);
        uint64_t scw, mnw;
        k4_scales(b + 4, &scw, &mnw);
        for (int i = 0; i < mc; i++) {
            const int8_t *x = qx + i * K + sb * QK;
            const int16_t *bsi = bs + i * (K / 16) + sb * 16;
            int32_t sum = 0, msum = 0;
            for (int s = 0; s < 8; s++) {
                const uint8_t *q = b + 16 + 32 * (s / 2);
                int32_t dot = 0;
                for (int l = 0; l < 32; l++) dot += ((q[l] >> 4 * (s & 1)) & 15) * x[32 * s + l];
                sum += (int32_t)((scw >> 8 * s) & 0xFF) * dot;
                msum += (int32_t)((mnw >> 8 * s) & 0xFF) * (bsi[2 * s] + bsi[2 * s + 1]);
            }
            const float dxi = dx[i * nsb + sb];
            out[i] += (d * dxi) * (float)sum - (dmin * dxi) * (float)msum;
        }
    }
#endif
}

static inline __attribute__((always_inline)) void q6k_rows(int mc, const uint8_t *row, int64_t nsb,
                                                           const int8_t *qx, const float *dx, const int16_t *bs,
                                                           int64_t K, float *out) {
#ifdef GB_AVX512
    const __m512i zero = _mm512_setzero_si512();
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc[MR];
    for (int i = 0; i < mc; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + sb * 210;
        PREFETCH_AHEAD(b, 210);
        const float d = f16(b + 208);
        __m512i w[4];
        q6k_decode(b, w);
        /* vector t's lane j (elements 64t + 4j ..) takes scale 4t + j / 4: int32 with the high half 0 */
        const __m128i s8 = _mm_loadu_si128((const __m128i *)(b + 192));
        const __m512i s32 = _mm512_and_si512(_mm512_cvtepi8_epi32(s8), _mm512_set1_epi32(0xFFFF));
        __m512i s[4];
        for (int t = 0; t < 4; t++) s[t] = _mm512_permutexvar_epi32(_mm512_add_epi32(quarter, _mm512_set1_epi32(4 * t)), s32);
        const __m256i s16 = _mm256_cvtepi8_epi16(s8);
        for (int i = 0; i < mc; i++) {
            const int8_t *x = qx + i * K + sb * QK;
            __m512i a = zero;
            for (int t = 0; t < 4; t++)
                a = _mm512_dpwssd_epi32(a, _mm512_dpbusd_epi32(zero, w[t], _mm512_loadu_si512(x + 64 * t)), s[t]);
            /* the -32 of every weight: 32 * sum_j sc[j] * bsum[j] */
            const __m256i off = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)(bs + i * (K / 16) + sb * 16)));
            a = _mm512_sub_epi32(a, _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(d * dx[i * nsb + sb]), acc[i]);
        }
    }
    for (int i = 0; i < mc; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
#elif defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    __m256 acc[MR];
    for (int i = 0; i < mc; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + sb * 210;
        PREFETCH_AHEAD(b, 210);
        const float d = f16(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        __m256i w[8], s[8];
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i lows[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                                     _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                     _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
            for (int v = 0; v < 4; v++) {  /* elements 128h + 32v .. + 31 */
                const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * v), m3);
                w[4 * h + v] = _mm256_or_si256(lows[v], _mm256_slli_epi16(top, 4));
                const int j = 8 * h + 2 * v;  /* int16 lanes 0-7: group j, 8-15: group j + 1 */
                s[4 * h + v] = _mm256_set_m128i(_mm_set1_epi16(sc[j + 1]), _mm_set1_epi16(sc[j]));
            }
        }
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        for (int i = 0; i < mc; i++) {
            const int8_t *x = qx + i * K + sb * QK;
            __m256i a = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {  /* pairs into int16 (at most 2 * 63 * 127), then by the scales */
                const __m256i p = _mm256_maddubs_epi16(w[t], _mm256_loadu_si256((const __m256i *)(x + 32 * t)));
                a = _mm256_add_epi32(a, _mm256_madd_epi16(p, s[t]));
            }
            const __m256i off = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)(bs + i * (K / 16) + sb * 16)));
            a = _mm256_sub_epi32(a, _mm256_slli_epi32(off, 5));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(d * dx[i * nsb + sb]), acc[i]);
        }
    }
    for (int i = 0; i < mc; i++) out[i] = hsum256(acc[i]);
#else
    (void)bs;  /* the offset -32 is applied to each weight here */
    for (int i = 0; i < mc; i++) out[i] = 0.f;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + sb * 210;
        const float d = f16(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int i = 0; i < mc; i++) {
            const int8_t *x = qx + i * K + sb * QK;
            int32_t sum = 0;
            for (int h = 0; h < 2; h++)
                for (int v = 0; v < 4; v++) {
                    int32_t dot[2] = {0, 0};
                    for (int l = 0; l < 32; l++) {
                        const uint8_t lo = b[64 * h + 32 * (v & 1) + l];
                        const int q = ((v < 2 ? lo & 15 : lo >> 4) | (((b[128 + 32 * h + l] >> 2 * v) & 3) << 4)) - 32;
                        dot[l / 16] += q * x[128 * h + 32 * v + l];
                    }
                    sum += sc[8 * h + 2 * v] * dot[0] + sc[8 * h + 2 * v + 1] * dot[1];
                }
            out[i] += (d * dx[i * nsb + sb]) * (float)sum;
        }
    }
#endif
}

/* Q8_0 and Q5_0 against Q8_0 activations: an integer dot and a float multiply-add per block of 32 */
static inline __attribute__((always_inline)) void q32_rows(int type, int mc, const uint8_t *row, int64_t nb,
                                                           const int8_t *qx, const float *dx, const int16_t *bs,
                                                           int64_t K, float *out) {
#if defined(__AVX2__)
    const int bb = block_bytes(type);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MR];
    for (int i = 0; i < mc; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *b = row + g * bb;
        PREFETCH_AHEAD(b, 1);  /* one line a block: blocks of at most 34 bytes ask for every line */
        const float d = f16(b);
        __m256i w;
        if (type == Q8_0) {
            w = _mm256_loadu_si256((const __m256i *)(b + 2));
        } else {
            uint32_t qh;
            memcpy(&qh, b + 2, 4);
            const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 6));
            w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), m4);
#ifdef GB_AVX512
            const __m256i fifth = _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(0x10));
#else  /* byte j gets byte j / 8 of qh, then tests its bit j % 8 */
            const __m256i spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32((int)qh), _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
            const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
            const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
#endif
            w = _mm256_or_si256(w, fifth);  /* q 0..31, unsigned: the -16 comes off through the bsums */
        }
        for (int i = 0; i < mc; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qx + i * K + g * 32));
            __m256i dot;
            if (type == Q8_0) {  /* signed x signed: the weight's sign moved onto x */
                dot = dot_u8s8(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
            } else {
                const int16_t *bsi = bs + i * (K / 16) + 2 * g;
                dot = _mm256_sub_epi32(dot_u8s8(w, x), _mm256_setr_epi32(16 * (bsi[0] + bsi[1]), 0, 0, 0, 0, 0, 0, 0));
            }
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * dx[i * nb + g]), acc[i]);
        }
    }
    for (int i = 0; i < mc; i++) out[i] = hsum256(acc[i]);
#else
    (void)bs;  /* the offset -16 is applied to each weight here */
    const int bb = block_bytes(type);
    for (int i = 0; i < mc; i++) out[i] = 0.f;
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *b = row + g * bb;
        const float d = f16(b);
        int q[32];
        if (type == Q8_0) {
            for (int j = 0; j < 32; j++) q[j] = (int8_t)b[2 + j];
        } else {
            uint32_t qh;
            memcpy(&qh, b + 2, 4);
            for (int j = 0; j < 16; j++) {
                q[j] = (int)((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16;
                q[j + 16] = (int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
            }
        }
        for (int i = 0; i < mc; i++) {
            int32_t dot = 0;
            for (int j = 0; j < 32; j++) dot += q[j] * qx[i * K + g * 32 + j];
            out[i] += (d * dx[i * nb + g]) * (float)dot;
        }
    }
#endif
}

/* M(T) with T the constant among the types these kernels read that equals type: the kernels inline per type */
#define BY_TYPE(type, M)            \
    do {                            \
        if ((type) == Q4_K) {       \
            M(Q4_K)                 \
        } else if ((type) == Q6_K) { \
            M(Q6_K)                 \
        } else if ((type) == Q8_0) { \
            M(Q8_0)                 \
        } else {                    \
            M(Q5_0)                 \
        }                           \
    } while (0)

/* more rows of x than this (half as many again for Q6_K) go to the panel GEMM (AVX-512), fewer to the row kernels;
 * a variable so that tests can run both paths */
int gguf_gemm_min_rows = 16;

/* 1 where the panel GEMM is built (AVX-512 VNNI); else many rows go through the row kernels, MR at a time */
int gguf_has_gemm(void) {
#ifdef GB_AVX512
    return 1;
#else
    return 0;
#endif
}

/* 1 where weights are repacked into panels of 16 rows (gguf_pack_panels) and one kernel multiplies them at every
 * row count (AVX2 and AVX-512 VNNI builds) */
int gguf_has_panels(void) {
#ifdef GB_PANELS
    return 1;
#else
    return 0;
#endif
}

#ifdef GB_PANELS
#define NP 16  /* columns of a panel: one per int32 lane (AVX2: of its two halves' lanes) */
static int group_elems(int type) { return type == Q6_K || type == Q3_K || type == Q2_K ? 16 : 32; }

/* The sums of the rounded x the panel kernels take off their integer dots, from the sums per 16 (bsums): xs [M,
 * K / G] those per group of G (group_elems) times the offset of the weights' unsigned bytes (Q6_K 32, Q8_0 and
 * the i-quants 128, Q5_0 16, Q4_0 8, Q3_K 4; Q4_K and Q2_K none: the plain sums, which their mins multiply), and *xs2 [M, K / G / 2] the plain sums of groups 2k and 2k + 1 as the two int16 of word k
 * (for Q4_K's mins, and AVX2's Q6_K: at most 32 * 127 in magnitude). NULL when memory ran out; free both. */
static int32_t *group_sums(int type, const int16_t *bsums, int64_t M, int64_t K, int32_t **xs2_out) {
    const int G = group_elems(type);
    const int64_t ng = K / G;
    int off = 1;
    switch (type) {
        case Q6_K: off = 32; break;
        case Q8_0: case IQ4_NL: case IQ4_XS: off = 128; break;
        case Q5_0: off = 16; break;
        case Q4_0: off = 8; break;
        case Q3_K: off = 4; break;
        default: break;
    }
    int32_t *xs = malloc(M * ng * sizeof(int32_t) + 64);
    int32_t *xs2 = malloc(M * (ng / 2 + 1) * sizeof(int32_t) + 64);
    if (!xs || !xs2) {
        free(xs), free(xs2);
        return NULL;
    }
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0, prev = 0; g < ng; g++) {
            int32_t t = 0;
            for (int h = 0; h < G / 16; h++) t += bsums[i * (K / 16) + g * (G / 16) + h];
            xs[i * ng + g] = off * t;
            if (g & 1) xs2[i * (ng / 2) + g / 2] = (int32_t)(((uint32_t)prev & 0xFFFF) | (uint32_t)t << 16);
            prev = t;
        }
    *xs2_out = xs2;
    return xs;
}

static int gguf_gemm_q8(int type, const int8_t *qx, const float *dx, const int16_t *bsums, const uint8_t *raw,
                        float *y, int64_t ldy, int64_t M, int64_t N, int64_t K);

/* a thread's buffer of `bytes` (a multiple of 64) for a panel's expanded words where `wanted`, else NULL; *failed
 * set where it cannot be had */
static uint8_t *expand_buffer(int wanted, size_t bytes, int *failed) {
    uint8_t *b = wanted ? aligned_alloc(64, bytes) : NULL;
    if (wanted && !b) {
#pragma omp atomic write
        *failed = 1;
    }
    return b;
}
#endif

#ifdef GB_AVX512
/* more rows than this take the GEMM: Q6_K's panels cost more to decode (its top bits put back), so it pays
 * from half as many rows again (measured, the 1.5B's Q6_K tensors: 83 / 89 / 105 / 134 GMAC/s at 16 / 24 / 32
 * / 48 rows against the row kernels' 99 / 92 / 98 / 94) */
static int64_t gemm_min_rows(int type) {
    return type == Q6_K ? 3 * (int64_t)gguf_gemm_min_rows / 2 : gguf_gemm_min_rows;
}
#endif

/* one weight row against rows m0 .. m0 + mc - 1 (mc a constant in each case: the loops over rows unroll) */
static inline __attribute__((always_inline)) void dot_rows(int type, int mc, const uint8_t *row, const int8_t *qx,
                                                           const float *dx, const int16_t *bs, int64_t K, float *out) {
    if (type == Q4_K) q4k_rows(mc, row, K / QK, qx, dx, bs, K, out);
    else if (type == Q6_K) q6k_rows(mc, row, K / QK, qx, dx, bs, K, out);
    else q32_rows(type, mc, row, K / 32, qx, dx, bs, K, out);
}

/* y [M, N] (rows ldy floats apart) = x_rounded [M, K] . W^T from x already rounded (gguf_quantize_q8 with the
 * type's block); 0, or -1 for a type these kernels do not read */
static int matmul_q8(int type, const int8_t *qx, const float *dx, const int16_t *bsums, const uint8_t *raw, float *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if (!block_elems(type)) return -1;
#ifdef GB_AVX512
    if (type > PANEL || M > gemm_min_rows(type))  /* a repacked weight: the one kernel at every row count */
        return gguf_gemm_q8(type, qx, dx, bsums, raw, y, ldy, M, N, K);
#elif defined(GB_PANELS)
    if (type > PANEL) return gguf_gemm_q8(type, qx, dx, bsums, raw, y, ldy, M, N, K);
#endif
    const int64_t row_bytes = K / block_elems(type) * block_bytes(type), ab = act_block(type);
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += COLS) {
        const int64_t n1 = n0 + COLS < N ? n0 + COLS : N;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = raw + n * row_bytes;
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int64_t mc = M - m0 < MR ? M - m0 : MR;
                const int8_t *q = qx + m0 * K;
                const float *d = dx + m0 * (K / ab);
                const int16_t *bs = bsums + m0 * (K / 16);
                float out[MR];
#define ROWS_CASES(T)                                                    \
                switch (mc) {                                            \
                    case 6: dot_rows(T, 6, row, q, d, bs, K, out); break; \
                    case 5: dot_rows(T, 5, row, q, d, bs, K, out); break; \
                    case 4: dot_rows(T, 4, row, q, d, bs, K, out); break; \
                    case 3: dot_rows(T, 3, row, q, d, bs, K, out); break; \
                    case 2: dot_rows(T, 2, row, q, d, bs, K, out); break; \
                    default: dot_rows(T, 1, row, q, d, bs, K, out); break; \
                }
                BY_TYPE(type, ROWS_CASES);
#undef ROWS_CASES
                for (int64_t i = 0; i < mc; i++) y[(m0 + i) * ldy + n] = out[i];
            }
        }
    }
    return 0;
}

int gguf_matmul_q8(int type, const int8_t *qx, const float *dx, const int16_t *bsums, const uint8_t *raw, float *y,
                   int64_t M, int64_t N, int64_t K) {
    return matmul_q8(type, qx, dx, bsums, raw, y, N, M, N, K);
}

#ifdef GB_AVX512
/* ---- many rows of x: a GEMM over panels of decoded weights --------------------------------------------
 * Past a few rows the per-row cost of the kernels above (two instructions and a horizontal sum per 64
 * weights and row) dominates. Here NP = 16 weight rows (output columns) are decoded at a time into a panel
 * of unsigned bytes laid out for vpdpbusd: word j of column c holds the column's elements 4j .. 4j + 3,
 * and the 16 columns' words for one j are one vector. A row of x then costs one vpdpbusd (its 4 int8
 * broadcast to every lane) per 64 products and no horizontal sums. Each type's weights are u 0..255
 * unsigned (Q6_K: q; Q5_0: q; Q8_0: q + 128), so a group's integer dot is (u . q_x) less the offset
 * (Q6_K: 32; Q5_0: 16; Q8_0: 128) times sum(q_x); a super-block's groups are summed in int32 by their
 * integer scales (vpmulld), and the super-block's (a 32-block's) sum then goes into y with one float
 * multiply-add (Q4_K: a second for its mins, whose sum is an integer under 2^24 and so exact in floats):
 * the row kernels' integers, a quarter of the float work of a multiply-add per group, the float sums in
 * another order than the row kernels' lanes. Tiles are two panels by RT2 rows where there are two panels
 * (each row's 4 bytes of x broadcast once for 32 columns), and Q4_K's mins are summed at the start of each
 * super-block, off the dots' critical path: 15-18 % faster than one panel by RT rows at 100-512 rows. */
#define RT 8   /* rows of x per register tile */
#define RT2 5  /* the same for a tile of two panels (its integer sums fill the registers) */

/* A panel's numbers besides its bytes, for column c (group g at [g * NP + c], super-block or block b at
 * [b * NP + c]): sc the integer scale of a group (Q4_K's 6 bits, Q6_K's int8; 1 for Q8_0 / Q5_0), mn Q4_K's
 * 6-bit mins of groups 2k and 2k + 1 as the two int16 of word k (for vpdpwssd), d the scale of a super-block
 * (Q8_0 / Q5_0: of a block), dmin Q4_K's. */
typedef struct {
    uint32_t *u;
    int32_t *sc, *mn;
    float *d, *dmin;
} panel_t;

/* column c of a panel: row `row` of W decoded into p's u (word j at u[j * NP + c]) and numbers */
static void pack_column(int type, const uint8_t *row, int64_t K, int c, const panel_t *p) {
    uint32_t *u = p->u;
    if (type == Q4_K) {
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t *b = row + sb * 144;
            p->d[sb * NP + c] = f16(b), p->dmin[sb * NP + c] = f16(b + 2);
            uint64_t scw, mnw;
            k4_scales(b + 4, &scw, &mnw);
            for (int t = 0; t < 8; t++) p->sc[(sb * 8 + t) * NP + c] = (int32_t)((scw >> 8 * t) & 0xFF);
            for (int k = 0; k < 4; k++)
                p->mn[(sb * 4 + k) * NP + c] = (int32_t)(((mnw >> 16 * k) & 0xFF) | ((mnw >> 16 * k) & 0xFF00) << 8);
            for (int cc = 0; cc < 4; cc++)  /* chunk cc: low nibbles elements 64cc + l, high ones 64cc + 32 + l */
                for (int j = 0; j < 8; j++) {
                    const uint32_t w = load32(b + 16 + 32 * cc + 4 * j);
                    u[(sb * 64 + 16 * cc + j) * NP + c] = w & 0x0F0F0F0Fu;
                    u[(sb * 64 + 16 * cc + 8 + j) * NP + c] = (w >> 4) & 0x0F0F0F0Fu;
                }
        }
    } else if (type == Q6_K) {
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t *b = row + sb * 210;
            p->d[sb * NP + c] = f16(b + 208);
            const int8_t *sc = (const int8_t *)(b + 192);
            for (int t = 0; t < 16; t++) p->sc[(sb * 16 + t) * NP + c] = sc[t];
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                uint32_t *o = u + (sb * 64 + 32 * h) * NP + c;  /* word of elements 128h + 4j .. */
                for (int j = 0; j < 8; j++) {
                    const uint32_t lo = load32(ql + 4 * j), lo32 = load32(ql + 32 + 4 * j), hi = load32(qh + 4 * j);
                    o[j * NP] = (lo & 0x0F0F0F0Fu) | ((hi << 4) & 0x30303030u);
                    o[(8 + j) * NP] = (lo32 & 0x0F0F0F0Fu) | ((hi << 2) & 0x30303030u);
                    o[(16 + j) * NP] = ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0x30303030u);
                    o[(24 + j) * NP] = ((lo32 >> 4) & 0x0F0F0F0Fu) | ((hi >> 2) & 0x30303030u);
                }
            }
        }
    } else {
        for (int64_t g = 0; g < K / 32; g++) {
            uint8_t q[32];
            if (type == Q8_0) {
                const uint8_t *b = row + g * 34;
                p->d[g * NP + c] = f16(b);
                for (int j = 0; j < 4; j++) {  /* int8 q + 128 */
                    uint64_t v;
                    memcpy(&v, b + 2 + 8 * j, 8);
                    v ^= 0x8080808080808080ull;
                    memcpy(q + 8 * j, &v, 8);
                }
            } else {  /* Q5_0 */
                const uint8_t *b = row + g * 22;
                const uint32_t qh = load32(b + 2);
                p->d[g * NP + c] = f16(b);
                for (int h = 0; h < 2; h++) {  /* 8 nibbles a time, each with its fifth bit from qh */
                    uint64_t lo, nib;
                    memcpy(&lo, b + 6 + 8 * h, 8);
                    for (int hi = 0; hi < 2; hi++) {
                        nib = hi ? (lo >> 4) & 0x0F0F0F0F0F0F0F0Full : lo & 0x0F0F0F0F0F0F0F0Full;
                        const uint32_t bits = (qh >> (16 * hi + 8 * h)) & 0xFF;
#ifdef __BMI2__
                        nib |= _pdep_u64(bits, 0x0101010101010101ull) << 4;
#else
                        for (int j = 0; j < 8; j++) nib |= (uint64_t)((bits >> j) & 1) << (8 * j + 4);
#endif
                        memcpy(q + 16 * hi + 8 * h, &nib, 8);
                    }
                }
            }
            for (int j = 0; j < 8; j++) u[(g * 8 + j) * NP + c] = load32(q + 4 * j);
        }
    }
}

/* k4_scales on 16 rows at once, from words 1-3 (u0, u1, u2) of their super-blocks (the 12 bytes of scales,
 * lane c row c's): bytes 0-3 of sl are sc[0..3], of sh sc[4..7] */
static inline __attribute__((always_inline)) void q4k_scales16(__m512i u0, __m512i u2, __m512i *sl, __m512i *sh) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m6 = _mm512_set1_epi8(0x3F), top = _mm512_set1_epi8(0x30);
    *sl = _mm512_and_si512(u0, m6);
    *sh = _mm512_or_si512(_mm512_and_si512(u2, m4), _mm512_and_si512(_mm512_srli_epi32(u0, 2), top));
}

/* and the mins: mn[k] those of groups 2k and 2k + 1 as the two int16 of a lane (for vpdpwssd) */
static inline __attribute__((always_inline)) void q4k_mins16(__m512i u1, __m512i u2, __m512i mn[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m6 = _mm512_set1_epi8(0x3F), top = _mm512_set1_epi8(0x30);
    const __m512i ff = _mm512_set1_epi32(0xFF), hi16 = _mm512_set1_epi32(0xFF0000);
    const __m512i ml = _mm512_and_si512(u1, m6);
    const __m512i mh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m4), _mm512_and_si512(_mm512_srli_epi32(u1, 2), top));
    for (int k = 0; k < 2; k++) {
        const __m512i lo = _mm512_srli_epi32(ml, 16 * k), hi = _mm512_srli_epi32(mh, 16 * k);
        mn[k] = _mm512_or_si512(_mm512_and_si512(lo, ff), _mm512_and_si512(_mm512_slli_epi32(lo, 8), hi16));
        mn[2 + k] = _mm512_or_si512(_mm512_and_si512(hi, ff), _mm512_and_si512(_mm512_slli_epi32(hi, 8), hi16));
    }
}

/* q5: the fifth bit of each of chunk cc's bytes from a Q5_K panel's qh word h, at bit 4 (16 where it is set):
 * bit 2cc (the low nibbles, hi = 0) or 2cc + 1 (the high ones) */
static inline __attribute__((always_inline)) __m512i q5_bits(__m512i h, int cc, int hi) {
    const __m512i b = _mm512_srl_epi16(h, _mm_cvtsi32_si128(2 * cc + hi));
    return _mm512_and_si512(_mm512_slli_epi16(b, 4), _mm512_set1_epi8(0x10));
}

/* a whole panel of 16 Q4_K rows, repacked (gguf_pack_panels' layout: a vector a word of the 16 rows), as
 * pack_column packs each row: vector 0 d | dmin, 1-3 the 12 bytes of scales, 4-35 the nibbles. q5: a Q5_K panel
 * (qh in vectors 4-11, the nibbles in 12-43), its weights q 0..31, for the same arithmetic as Q4_K's */
static void pack_panel_q4k(int q5, const uint8_t *panel, int64_t K, const panel_t *p) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), ff = _mm512_set1_epi32(0xFF);
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *pb = panel + sb * NP * (q5 ? 176 : 144);
        const __m512i w0 = _mm512_load_si512(pb), u0 = _mm512_load_si512(pb + 64);
        const __m512i u1 = _mm512_load_si512(pb + 128), u2 = _mm512_load_si512(pb + 192);
        _mm512_store_ps(p->d + sb * NP, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w0)));
        _mm512_store_ps(p->dmin + sb * NP, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w0, 16))));
        __m512i sl, sh, mn[4];
        q4k_scales16(u0, u2, &sl, &sh);
        q4k_mins16(u1, u2, mn);
        for (int t = 0; t < 4; t++) {
            _mm512_store_si512(p->sc + (sb * 8 + t) * NP, _mm512_and_si512(_mm512_srli_epi32(sl, 8 * t), ff));
            _mm512_store_si512(p->sc + (sb * 8 + 4 + t) * NP, _mm512_and_si512(_mm512_srli_epi32(sh, 8 * t), ff));
        }
        for (int k = 0; k < 4; k++) _mm512_store_si512(p->mn + (sb * 4 + k) * NP, mn[k]);
        for (int w = 0; w < 32; w++) {  /* nibble word w = 8cc + j: chunk cc's j-th */
            const __m512i v = _mm512_load_si512(pb + ((q5 ? 12 : 4) + w) * 64);
            const int cc = w / 8, j = w % 8;
            __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            if (q5) {  /* Q5_K: each weight's fifth bit from qh word j */
                const __m512i h = _mm512_load_si512(pb + (4 + j) * 64);
                lo = _mm512_or_si512(lo, q5_bits(h, cc, 0)), hi = _mm512_or_si512(hi, q5_bits(h, cc, 1));
            }
            _mm512_store_si512(p->u + (sb * 64 + 16 * cc + j) * NP, lo);
            _mm512_store_si512(p->u + (sb * 64 + 16 * cc + 8 + j) * NP, hi);
        }
    }
}

/* Q6_K's word t (0-3: elements 32t + 4j .. of a half, word j) of every row from a panel's ql words lo (word j)
 * and lo32 (word j + 8) and qh word hi (word j): pack_panel_q6k's bit operations */
static inline __attribute__((always_inline)) __m512i q6k_word(__m512i lo, __m512i lo32, __m512i hi, int t) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
    const __m512i low = _mm512_and_si512(t < 2 ? (t == 0 ? lo : lo32) : _mm512_srli_epi32(t == 2 ? lo : lo32, 4), m4);
    const __m512i top = t == 0 ? _mm512_slli_epi32(hi, 4) : t == 1 ? _mm512_slli_epi32(hi, 2) : t == 2 ? hi : _mm512_srli_epi32(hi, 2);
    return _mm512_or_si512(low, _mm512_and_si512(top, m2));
}

/* the same for a repacked panel of 16 Q6_K rows (vectors 0-31 ql's words, 32-47 qh's, 48-51 the scales, then
 * d): pack_column's bit operations on a word of every row at once */
static void pack_panel_q6k(const uint8_t *panel, int64_t K, const panel_t *p) {
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *pb = panel + sb * NP * 210;
        _mm512_store_ps(p->d + sb * NP, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pb + 52 * 64))));
        for (int q = 0; q < 4; q++) {  /* scales 4q .. 4q + 3, each sign-extended from its byte */
            const __m512i w = _mm512_loadu_si512(pb + (48 + q) * 64);
            for (int t = 0; t < 4; t++)
                _mm512_store_si512(p->sc + (sb * 16 + 4 * q + t) * NP, _mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * t), 24));
        }
        for (int h = 0; h < 2; h++) {
            uint32_t *o = p->u + (sb * 64 + 32 * h) * NP;
            for (int j = 0; j < 8; j++) {
                const __m512i lo = _mm512_loadu_si512(pb + (16 * h + j) * 64), lo32 = _mm512_loadu_si512(pb + (16 * h + 8 + j) * 64);
                const __m512i hi = _mm512_loadu_si512(pb + (32 + 8 * h + j) * 64);
                for (int t = 0; t < 4; t++) _mm512_store_si512(o + (8 * t + j) * NP, q6k_word(lo, lo32, hi, t));
            }
        }
    }
}

/* word j (0-7) of block h (0, 1) of a Q8_0 / Q5_0 pair of a repacked panel (repack_panel_q32's layout), as
 * the panel GEMM reads its words: elements 4j .. 4j + 3 of the 16 rows, unsigned (Q8_0: q + 128; Q5_0: q) */
static inline __attribute__((always_inline)) __m512i q32_word(int type, const uint8_t *pair, int h, int j) {
    if (type == Q8_0) return _mm512_loadu_si512(pair + (1 + 8 * h + j) * 64);
    if (type == Q4_0 || type == IQ4_NL) {
        const __m512i v = _mm512_loadu_si512(pair + (1 + 4 * h + (j & 3)) * 64);
        const __m512i nib = _mm512_and_si512(j < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
        return type == Q4_0 ? nib : _mm512_shuffle_epi8(_mm512_broadcast_i32x4(iq4nl_table()), nib);
    }
    const __m512i v = _mm512_loadu_si512(pair + (3 + 4 * h + (j & 3)) * 64);
    const __m512i nib = _mm512_and_si512(j < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
    return _mm512_mask_add_epi8(nib, _load_mask64((__mmask64 *)(pair + (1 + h) * 64 + 8 * j)), nib, _mm512_set1_epi8(0x10));
}

/* a whole repacked panel of 16 Q8_0 / Q5_0 rows expanded as pack_column expands each row */
static void pack_panel_q32(int type, const uint8_t *panel, int64_t K, const panel_t *p) {
    for (int64_t g = 0; g < K / 32; g++) {
        const uint8_t *pair = panel + (g / 2) * 32 * block_bytes_any(type);
        const int h = (int)(g & 1);
        _mm512_store_ps(p->d + g * NP, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pair + 32 * h))));
        for (int j = 0; j < 8; j++) _mm512_store_si512(p->u + (g * 8 + j) * NP, q32_word(type, pair, h, j));
    }
}

/* a[q][r] = the integer dots of group g (G elements) of panel q (of np) with rows 0 .. rt - 1 of x (K bytes
 * apart): each row's 4 bytes broadcast once for both panels */
static inline __attribute__((always_inline)) void group_dots(int np, int rt, int G, int64_t K, const panel_t *p, int64_t g,
                                                             const int8_t *qx, __m512i a[2][RT]) {
    for (int q = 0; q < np; q++)
        for (int r = 0; r < rt; r++) a[q][r] = _mm512_setzero_si512();
    const int8_t *xg = qx + g * G;
    for (int j = 0; j < G / 4; j++) {
        __m512i w[2];
        for (int q = 0; q < np; q++) w[q] = _mm512_load_si512(p[q].u + (g * (G / 4) + j) * NP);
        for (int r = 0; r < rt; r++) {
            int32_t x4;
            memcpy(&x4, xg + r * K + 4 * j, 4);
            const __m512i xb = _mm512_set1_epi32(x4);
            for (int q = 0; q < np; q++) a[q][r] = _mm512_dpbusd_epi32(a[q][r], w[q], xb);
        }
    }
}

/* rows 0 .. rt - 1 of y against np (1 or 2) panels side by side (their columns the lanes; panel q's at y + q *
 * NP, mask[q] of them). x's rows K bytes apart; xs (sums of q_x per group, times the weights' offset) ng apart,
 * xs2 (Q4_K: the plain sums of groups 2k and 2k + 1 as the two int16 of word k) ng / 2 apart, dx (x's scales)
 * ndx apart. */
static inline __attribute__((always_inline)) void panel_rows(int type, int np, int rt, int64_t K, int64_t ng,
                                                             const panel_t *p, const int8_t *qx, const int32_t *xs,
                                                             const int32_t *xs2, const float *dx, int64_t ndx, float *y,
                                                             int64_t ldy, const __mmask16 *mask) {
    float accm[2 * RT * NP] __attribute__((aligned(64)));  /* in memory: the registers hold the integer sums */
    __m512i a[2][RT], is[2][RT];
    for (int q = 0; q < np; q++)
        for (int r = 0; r < rt; r++) _mm512_store_ps(accm + (q * RT + r) * NP, _mm512_setzero_ps());
#define acc_at(q, r) (accm + ((q) * RT + (r)) * NP)
    if (type == Q4_K || type == Q6_K) {
        const int G = type == Q4_K ? 32 : 16, per = 256 / G;
        for (int64_t sb = 0; sb < K / 256; sb++) {
            __m512i msm[2][RT];  /* Q4_K: the mins' integer sums first, off the dots' critical path */
            if (type == Q4_K)
                for (int q = 0; q < np; q++) {
                    __m512i mn[4];
                    for (int k = 0; k < 4; k++) mn[k] = _mm512_load_si512(p[q].mn + (sb * 4 + k) * NP);
                    for (int r = 0; r < rt; r++) {  /* two groups a vpdpwssd (|sum(q_x)| <= 32 * 127: an int16) */
                        __m512i ms = _mm512_setzero_si512();
                        for (int k = 0; k < 4; k++) ms = _mm512_dpwssd_epi32(ms, mn[k], _mm512_set1_epi32(xs2[r * (ng / 2) + sb * 4 + k]));
                        msm[q][r] = ms;
                    }
                }
            for (int q = 0; q < np; q++)
                for (int r = 0; r < rt; r++) is[q][r] = _mm512_setzero_si512();
            for (int64_t g = sb * per; g < (sb + 1) * per; g++) {
                group_dots(np, rt, G, K, p, g, qx, a);
                for (int q = 0; q < np; q++) {
                    const __m512i sv = _mm512_load_si512(p[q].sc + g * NP);
                    for (int r = 0; r < rt; r++) {
                        const __m512i t = type == Q4_K ? a[q][r] : _mm512_sub_epi32(a[q][r], _mm512_set1_epi32(xs[r * ng + g]));
                        is[q][r] = _mm512_add_epi32(is[q][r], _mm512_mullo_epi32(t, sv));
                    }
                }
            }
            for (int q = 0; q < np; q++) {
                const __m512 dv = _mm512_load_ps(p[q].d + sb * NP);
                for (int r = 0; r < rt; r++) {
                    const __m512 dxv = _mm512_set1_ps(dx[r * ndx + sb]);
                    __m512 ar = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[q][r]), _mm512_mul_ps(dv, dxv), _mm512_load_ps(acc_at(q, r)));
                    if (type == Q4_K)
                        ar = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msm[q][r]), _mm512_mul_ps(_mm512_load_ps(p[q].dmin + sb * NP), dxv), ar);
                    _mm512_store_ps(acc_at(q, r), ar);
                }
            }
        }
    } else {  /* Q8_0 (weights stored + 128) and Q5_0 (q 0..31): the offset times sum(q_x) comes off */
        for (int64_t g = 0; g < ng; g++) {
            group_dots(np, rt, 32, K, p, g, qx, a);
            for (int q = 0; q < np; q++) {
                const __m512 dv = _mm512_load_ps(p[q].d + g * NP);
                for (int r = 0; r < rt; r++) {
                    const __m512i t = _mm512_sub_epi32(a[q][r], _mm512_set1_epi32(xs[r * ng + g]));
                    _mm512_store_ps(acc_at(q, r), _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * ndx + g])), _mm512_load_ps(acc_at(q, r))));
                }
            }
        }
    }
    for (int q = 0; q < np; q++)
        for (int r = 0; r < rt; r++) _mm512_mask_storeu_ps(y + r * ldy + q * NP, mask[q], _mm512_load_ps(acc_at(q, r)));
#undef acc_at
}

/* ---- repacked weights: one kernel at every row count ------------------------------------------------
 * gguf_pack_panels lays a Q4_K or Q6_K weight (N a multiple of 16) out as the kernels below read it: panel p
 * (rows 16p .. 16p + 15) holds its super-blocks in order, and super-block sb of a panel holds word w (4 bytes)
 * of each row's block sb as one 64-byte vector (lane c: row 16p + c), w = 0 .. bytes / 4 - 1; Q6_K's two last
 * bytes (d) follow as 16 pairs. The file's bytes permuted, nothing widened: a row's 144 (210) bytes a super-block
 * stay 144 (210). The kernels decode a panel's words where they lie (a mask, a shift) instead of decoding it
 * into a buffer first, so one decode row costs no more than a row kernel's pass and a prefill chunk no more than
 * the GEMM above; and they compute each row of y as panel_rows does (the same integers, the same float
 * multiply-adds in the same order), so its bits never depend on how many rows share the call. llama.cpp
 * repacks Q4_K for the same reasons. */

/* words [w0, w0 + 16) of the blocks of 16 rows (row c at src + c * row_bytes) into vectors w0 .. w0 + 15 */
static inline __attribute__((always_inline)) void pack_words(const uint8_t *src, int64_t row_bytes, int w0, uint8_t *dst) {
    __m512i v[16];
    for (int c = 0; c < NP; c++) v[c] = _mm512_loadu_si512(src + c * row_bytes + 4 * w0);
    transpose16(v);
    for (int w = 0; w < 16; w++) _mm512_storeu_si512(dst + (w0 + w) * 64, v[w]);
}

/* one panel: 16 rows of a Q4_K, Q5_K or Q6_K weight (row_bytes apart, nsb super-blocks) repacked into dst */
static void repack_panel(int type, const uint8_t *rows, int64_t row_bytes, int64_t nsb, uint8_t *dst) {
    const int bytes = block_bytes_any(type), words = bytes / 4;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *src = rows + sb * bytes;
        uint8_t *d = dst + sb * NP * bytes;
        for (int w0 = 0; w0 + 16 <= words; w0 += 16) pack_words(src, row_bytes, w0, d);
        if (words % 16) pack_words(src, row_bytes, words - 16, d);  /* the last 16 words: some twice */
        for (int c = 0; c < NP && bytes % 4; c++) memcpy(d + words * 64 + c * (bytes % 4), src + c * row_bytes + 4 * words, bytes % 4);
    }
}

/* vpdpbusd with x's 4 bytes as an embedded broadcast ({1to16}): GCC folds no _mm512_set1_epi32 of a load into
 * this instruction, and its broadcast registers and copies left an 8-row tile spilling (ffn_up at 8 rows:
 * 472 -> 612 GMAC/s with this and the integer sums in memory) */
typedef int32_t __attribute__((may_alias)) x4_t;
static inline __attribute__((always_inline)) __m512i dpbusd_b(__m512i acc, __m512i w, const void *x4) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const x4_t *)x4));
    return acc;
}

/* rows 0 .. rt - 1 of y against one repacked Q4_K panel pb: panel_rows(Q4_K, ...) on the panel's words. q5: a
 * Q5_K panel (176 bytes a block: Q4_K's d, dmin and scales in words 0-3, then qh in words 4-11 and the nibbles in
 * 12-43), its weights q 0..31, nibble | fifth bit * 16; else the same arithmetic */
static inline __attribute__((always_inline)) void packed_q4k(int q5, int rt, int64_t K, const uint8_t *pb, const int8_t *qx,
                                                             const int32_t *xs2, const float *dx, float *y, int64_t ldy) {
    const int64_t nsb = K / QK, npair = K / 64;
    const int bytes = q5 ? 176 : 144;
    const __m512i m4 = _mm512_set1_epi8(0x0F), ff = _mm512_set1_epi32(0xFF);
    float accm[RT * NP] __attribute__((aligned(64)));
    for (int r = 0; r < rt; r++) _mm512_store_ps(accm + r * NP, _mm512_setzero_ps());
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = pb + sb * NP * bytes;
        /* vector 0: d | dmin; 1-3: the 12 bytes of scales, as pack_panel_q4k reads them */
        const __m512i w0 = _mm512_load_si512(b), u0 = _mm512_load_si512(b + 64);
        const __m512i u1 = _mm512_load_si512(b + 128), u2 = _mm512_load_si512(b + 192);
        __m512i sl, sh, mn[4];
        q4k_scales16(u0, u2, &sl, &sh);
        PREFETCH_AHEAD(b, NP * bytes);
        int32_t ism[RT * NP] __attribute__((aligned(64)));  /* the integer sums in memory: the registers hold the dots */
        for (int r = 0; r < rt; r++) _mm512_store_si512(ism + r * NP, _mm512_setzero_si512());
        for (int cc = 0; cc < 4; cc++) {  /* chunk cc: sub-blocks 2cc (low nibbles) and 2cc + 1 (high) */
            const uint8_t *q = b + (q5 ? 12 : 4) * 64 + cc * 8 * 64;
            const uint8_t *xc = (const uint8_t *)qx + sb * QK + 64 * cc;
            const __m512i svl = _mm512_and_si512(_mm512_srli_epi32(cc < 2 ? sl : sh, 16 * (cc & 1)), ff);
            const __m512i svh = _mm512_and_si512(_mm512_srli_epi32(cc < 2 ? sl : sh, 16 * (cc & 1) + 8), ff);
            /* integer sums in chains enough for the latency of vpdpbusd: two a row, four for one or two rows */
            const int split = rt <= 2 ? 2 : 1;
            __m512i al[2][RT], ah[2][RT];
            for (int e = 0; e < split; e++)
                for (int r = 0; r < rt; r++) al[e][r] = ah[e][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m512i v = _mm512_load_si512(q + 64 * j);
                __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if (q5) {
                    const __m512i h = _mm512_load_si512(b + (4 + j) * 64);
                    lo = _mm512_or_si512(lo, q5_bits(h, cc, 0)), hi = _mm512_or_si512(hi, q5_bits(h, cc, 1));
                }
                const int e = j % split;
                for (int r = 0; r < rt; r++) {
                    al[e][r] = dpbusd_b(al[e][r], lo, xc + r * K + 4 * j);
                    ah[e][r] = dpbusd_b(ah[e][r], hi, xc + r * K + 32 + 4 * j);
                }
            }
            for (int r = 0; r < rt; r++) {
                const __m512i l = split == 2 ? _mm512_add_epi32(al[0][r], al[1][r]) : al[0][r];
                const __m512i h = split == 2 ? _mm512_add_epi32(ah[0][r], ah[1][r]) : ah[0][r];
                _mm512_store_si512(ism + r * NP, _mm512_add_epi32(_mm512_load_si512(ism + r * NP),
                                   _mm512_add_epi32(_mm512_mullo_epi32(l, svl), _mm512_mullo_epi32(h, svh))));
            }
        }
        q4k_mins16(u1, u2, mn);  /* after the dots: their registers are free again */
        const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w0));
        const __m512 dminv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w0, 16)));
        for (int r = 0; r < rt; r++) {
            const __m512 dxv = _mm512_set1_ps(dx[r * nsb + sb]);
            __m512 ar = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ism + r * NP)), _mm512_mul_ps(dv, dxv), _mm512_load_ps(accm + r * NP));
            __m512i ms = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) ms = _mm512_dpwssd_epi32(ms, mn[k], _mm512_set1_epi32(xs2[r * npair + sb * 4 + k]));
            ar = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(dminv, dxv), ar);
            _mm512_store_ps(accm + r * NP, ar);
        }
    }
    for (int r = 0; r < rt; r++) _mm512_storeu_ps(y + r * ldy, _mm512_load_ps(accm + r * NP));
}

/* the same for a repacked Q6_K panel: panel_rows(Q6_K, ...) on the panel's words */
static inline __attribute__((always_inline)) void packed_q6k(int rt, int64_t K, const uint8_t *pb, const int8_t *qx,
                                                             const int32_t *xs, const float *dx, float *y, int64_t ldy) {
    const int64_t nsb = K / QK, ng = K / 16;
    float accm[RT * NP] __attribute__((aligned(64)));
    __m512i a[RT], is[RT];
    for (int r = 0; r < rt; r++) _mm512_store_ps(accm + r * NP, _mm512_setzero_ps());
    for (int64_t sb = 0; sb < nsb; sb++) {
        /* vectors 0-31: ql's words (half h: 16h ..), 32-47 qh's (half h: 32 + 8h ..), 48-51 the scales; then d */
        const uint8_t *b = pb + sb * NP * 210;
        PREFETCH_AHEAD(b, NP * 210);
        for (int r = 0; r < rt; r++) is[r] = _mm512_setzero_si512();
        if (rt <= 2) {  /* a word's four outputs at once: four chains a row for the latency of vpdpbusd */
            for (int h = 0; h < 2; h++)
                for (int jj = 0; jj < 2; jj++) {
                    __m512i a4[4][2];
                    for (int t = 0; t < 4; t++)
                        for (int r = 0; r < rt; r++) a4[t][r] = _mm512_setzero_si512();
                    for (int j = 4 * jj; j < 4 * jj + 4; j++) {
                        const __m512i lo = _mm512_loadu_si512(b + (16 * h + j) * 64), lo32 = _mm512_loadu_si512(b + (16 * h + 8 + j) * 64);
                        const __m512i hi = _mm512_loadu_si512(b + (32 + 8 * h + j) * 64);
                        const __m512i v[4] = {q6k_word(lo, lo32, hi, 0), q6k_word(lo, lo32, hi, 1), q6k_word(lo, lo32, hi, 2),
                                              q6k_word(lo, lo32, hi, 3)};
                        for (int t = 0; t < 4; t++)
                            for (int r = 0; r < rt; r++)
                                a4[t][r] = dpbusd_b(a4[t][r], v[t], (const uint8_t *)qx + r * K + sb * QK + 128 * h + 32 * t + 4 * j);
                    }
                    for (int t = 0; t < 4; t++) {
                        const int g = 8 * h + 2 * t + jj;
                        const __m512i sw = _mm512_loadu_si512(b + (48 + g / 4) * 64);
                        const __m512i sv = _mm512_srai_epi32(_mm512_slli_epi32(sw, 24 - 8 * (g % 4)), 24);
                        for (int r = 0; r < rt; r++) {
                            const __m512i t32 = _mm512_sub_epi32(a4[t][r], _mm512_set1_epi32(xs[r * ng + sb * 16 + g]));
                            is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(t32, sv));
                        }
                    }
                }
        } else {  /* one output at a time: the rows' own chains are enough, and their sums fill the registers */
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)  /* elements 128h + 32t + 4j of word j: groups 8h + 2t and 8h + 2t + 1 */
                for (int jj = 0; jj < 2; jj++) {
                    for (int r = 0; r < rt; r++) a[r] = _mm512_setzero_si512();
                    for (int j = 4 * jj; j < 4 * jj + 4; j++) {
                        const __m512i l = _mm512_loadu_si512(b + (16 * h + 8 * (t & 1) + j) * 64);  /* ql word j or j + 8 */
                        const __m512i v = q6k_word(l, l, _mm512_loadu_si512(b + (32 + 8 * h + j) * 64), t);
                        for (int r = 0; r < rt; r++)
                            a[r] = dpbusd_b(a[r], v, (const uint8_t *)qx + r * K + sb * QK + 128 * h + 32 * t + 4 * j);
                    }
                    const int g = 8 * h + 2 * t + jj;
                    const __m512i sw = _mm512_loadu_si512(b + (48 + g / 4) * 64);
                    const __m512i sv = _mm512_srai_epi32(_mm512_slli_epi32(sw, 24 - 8 * (g % 4)), 24);
                    for (int r = 0; r < rt; r++) {
                        const __m512i t32 = _mm512_sub_epi32(a[r], _mm512_set1_epi32(xs[r * ng + sb * 16 + g]));
                        is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(t32, sv));
                    }
                }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 52 * 64)));
        for (int r = 0; r < rt; r++) {
            const __m512 dxv = _mm512_set1_ps(dx[r * nsb + sb]);
            _mm512_store_ps(accm + r * NP, _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(dv, dxv), _mm512_load_ps(accm + r * NP)));
        }
    }
    for (int r = 0; r < rt; r++) _mm512_storeu_ps(y + r * ldy, _mm512_load_ps(accm + r * NP));
}

/* the same for a repacked Q8_0 / Q5_0 panel (type the file's): panel_rows(type, ...) on the panel's words */
static inline __attribute__((always_inline)) void packed_q32(int type, int rt, int64_t K, const uint8_t *pb, const int8_t *qx,
                                                             const int32_t *xs, const float *dx, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    const int pair_bytes = 32 * block_bytes_any(type);
    __m512 acc[RT];
    for (int r = 0; r < rt; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < nb; g0 += 2) {
        const uint8_t *pair = pb + (g0 / 2) * pair_bytes;
        PREFETCH_AHEAD(pair, pair_bytes);
        for (int h = 0; h < 2; h++) {
            const int64_t g = g0 + h;
            __m512i v[8];
            for (int j = 0; j < 8; j++) v[j] = q32_word(type, pair, h, j);
            /* integer sums in chains enough for the latency of vpdpbusd: two a row for one or two rows */
            const int split = rt <= 2 ? 2 : 1;
            __m512i a[2][RT];
            for (int e = 0; e < split; e++)
                for (int r = 0; r < rt; r++) a[e][r] = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++)
                for (int r = 0; r < rt; r++) a[j % split][r] = dpbusd_b(a[j % split][r], v[j], qx + r * K + g * 32 + 4 * j);
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pair + 32 * h)));
            for (int r = 0; r < rt; r++) {
                const __m512i s = split == 2 ? _mm512_add_epi32(a[0][r], a[1][r]) : a[0][r];
                const __m512i t = _mm512_sub_epi32(s, _mm512_set1_epi32(xs[r * nb + g]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * nb + g])), acc[r]);
            }
        }
    }
    for (int r = 0; r < rt; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* up to this many rows of x, a repacked weight's panels are read where they lie, each decoded once per tile of
 * RT rows; more rows expand each panel into bytes once (pack_panel_*), then panel_rows: the same bits. Two
 * layers of the 1.5B, in place against expanded: 447 / 438 GMAC/s at 24 rows, 465 / 460 at 40, 477 / 495 at 48 */
#ifndef PACKED_DIRECT_ROWS
#define PACKED_DIRECT_ROWS 40
#endif

/* the same for a repacked IQ4_XS panel, at every row count (no expanded form): per super-block, word 0 (d | scales_h)
 * and word 1 (scales_l), then sub-block s's nibbles in words 2 + 4s .. 5 + 4s (repack_panel's layout); each nibble's
 * value + 128 looked up (vpshufb), each sub-block's dot less 128 sum(q_x) times its ls - 32, summed in int32, then
 * one multiply-add by d dx */
static inline __attribute__((always_inline)) void packed_iq4xs(int rt, int64_t K, const uint8_t *pb, const int8_t *qx,
                                                               const int32_t *xs, const float *dx, float *y, int64_t ldy) {
    const int64_t nsb = K / QK, ng = K / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0F), table = _mm512_broadcast_i32x4(iq4nl_table());
    __m512 acc[RT];
    for (int r = 0; r < rt; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = pb + sb * NP * 136;
        PREFETCH_AHEAD(b, NP * 136);
        const __m512i w0 = _mm512_load_si512(b), w1 = _mm512_load_si512(b + 64);
        __m512i is[RT];
        for (int r = 0; r < rt; r++) is[r] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            const __m512i lo4 = _mm512_and_si512(_mm512_srli_epi32(w1, 4 * s), _mm512_set1_epi32(15));
            const __m512i hi2 = _mm512_and_si512(_mm512_srli_epi32(w0, 16 + 2 * s), _mm512_set1_epi32(3));
            const __m512i sv = _mm512_sub_epi32(_mm512_or_si512(lo4, _mm512_slli_epi32(hi2, 4)), _mm512_set1_epi32(32));
            const uint8_t *xc = (const uint8_t *)qx + sb * QK + 32 * s;
            __m512i a[2][RT];
            for (int r = 0; r < rt; r++) a[0][r] = a[1][r] = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_load_si512(b + (2 + 4 * s + j) * 64);
                const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, m4));
                const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                for (int r = 0; r < rt; r++) {
                    a[0][r] = dpbusd_b(a[0][r], lo, xc + r * K + 4 * j);
                    a[1][r] = dpbusd_b(a[1][r], hi, xc + r * K + 16 + 4 * j);
                }
            }
            for (int r = 0; r < rt; r++) {
                const __m512i t = _mm512_sub_epi32(_mm512_add_epi32(a[0][r], a[1][r]), _mm512_set1_epi32(xs[r * ng + sb * 8 + s]));
                is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(t, sv));
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w0));
        for (int r = 0; r < rt; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * nsb + sb])), acc[r]);
    }
    for (int r = 0; r < rt; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* the same for a repacked Q3_K (q3) or Q2_K panel, at every row count, from repack_panel's words of a super-block.
 * Q3_K: words 0-7 hmask, 8-23 qs, 24-26 the scales, d after the words as 16 pairs; Q2_K: words 0-3 the scales and
 * mins (byte g: group g's), 4-19 qs, 20 d | dmin. Word w (< 4) of group g (16 weights: half h = g / 8, shift
 * j = g % 8 / 2, elements l = 16 (g % 2) + 4w ..) is qs word (Q3_K 8, Q2_K 4) + 8h + 4 (g % 2) + w's bits 2j, and
 * for Q3_K hmask word 4 (g % 2) + w's bit 4h + j at bit 2: q + 4, 0..7. Each group's dot (Q3_K: less 4 sum(q_x))
 * times its scale (Q3_K: its 6 bits less 32) and, for Q2_K, its min times the plain sum of x over it, summed in
 * int32; then one multiply-add by d dx (Q2_K: less dmin dx times the mins' sum, as Q4_K) */
static inline __attribute__((always_inline)) __m512i q3k_scale16(const __m512i s0, const __m512i s1, const __m512i s2, int g) {
    const __m512i lo = _mm512_srli_epi32(g % 8 < 4 ? s0 : s1, 8 * (g % 4) + 4 * (g / 8));
    const __m512i hi = _mm512_srli_epi32(s2, 8 * (g % 4) + 2 * (g / 4));
    const __m512i sc = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(15)),
                                       _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(3)), 4));
    return _mm512_sub_epi32(sc, _mm512_set1_epi32(32));
}

/* where xp, the weights' words (q + 4 / q), scales and mins come from ex instead, decoded once for all the row tiles
 * (expand_k23's layout: word w of group g of super-block sb at vector (16 sb + g) 4 + w, then the scales' and the
 * mins' int32 vectors, one a group) */
static inline __attribute__((always_inline)) void packed_k23(int q3, int xp, int rt, int64_t K, const uint8_t *pb,
                                                             const uint8_t *ex, const int8_t *qx, const int32_t *xs,
                                                             const float *dx, float *y, int64_t ldy) {
    const int64_t nsb = K / QK, ng = K / 16;
    const int bytes = q3 ? 110 : 84, qw = q3 ? 8 : 4;  /* Q3_K: 1,760 bytes a super-block, every other one off a line */
    const __m512i m2 = _mm512_set1_epi8(3), m1 = _mm512_set1_epi8(1), m4 = _mm512_set1_epi32(15);
    __m512 acc[RT];
    for (int r = 0; r < rt; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = pb + sb * NP * bytes;
        if (!xp) PREFETCH_AHEAD(b, NP * bytes);
        /* Q3_K's scales (read only there: a Q2_K super-block is 21 vectors) */
        const __m512i zero = _mm512_setzero_si512();
        const __m512i s0 = q3 && !xp ? _mm512_loadu_si512(b + 24 * 64) : zero;
        const __m512i s1 = q3 && !xp ? _mm512_loadu_si512(b + 25 * 64) : zero;
        const __m512i s2 = q3 && !xp ? _mm512_loadu_si512(b + 26 * 64) : zero;
        __m512i is[RT], ms[RT];
        for (int r = 0; r < rt; r++) is[r] = ms[r] = _mm512_setzero_si512();
        for (int g = 0; g < 16; g++) {
            const int h = g / 8, j = (g % 8) / 2, half = g % 2;
            const uint8_t *xc = (const uint8_t *)qx + sb * QK + 16 * g;
            const uint8_t *eg = ex + (sb * 16 + g) * 4 * 64;  /* where xp: this group's words */
            const __m512i sm = q3 || xp ? zero : _mm512_srli_epi32(_mm512_loadu_si512(b + (g / 4) * 64), 8 * (g % 4));
            const __m512i sv = xp ? _mm512_load_si512(ex + (size_t)K * 16 + (sb * 16 + g) * 64)
                                  : q3 ? q3k_scale16(s0, s1, s2, g) : _mm512_and_si512(sm, m4);
            const __m512i mv = xp ? (q3 ? zero : _mm512_load_si512(ex + (size_t)K * 20 + (sb * 16 + g) * 64))
                                  : _mm512_and_si512(_mm512_srli_epi32(sm, 4), m4);
            __m512i a[RT];
            for (int r = 0; r < rt; r++) a[r] = _mm512_setzero_si512();
            for (int w = 0; w < 4; w++) {
                __m512i u;
                if (xp) {
                    u = _mm512_load_si512(eg + w * 64);
                } else {
                    u = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(b + (qw + 8 * h + 4 * half + w) * 64), 2 * j), m2);
                    if (q3) {
                        const __m512i hb = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(b + (4 * half + w) * 64), 4 * h + j), m1);
                        u = _mm512_or_si512(u, _mm512_slli_epi16(hb, 2));
                    }
                }
                for (int r = 0; r < rt; r++) a[r] = dpbusd_b(a[r], u, xc + r * K + 4 * w);
            }
            for (int r = 0; r < rt; r++) {
                const __m512i xsv = _mm512_set1_epi32(xs[r * ng + sb * 16 + g]);
                is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(q3 ? _mm512_sub_epi32(a[r], xsv) : a[r], sv));
                if (!q3) ms[r] = _mm512_add_epi32(ms[r], _mm512_mullo_epi32(xsv, mv));
            }
        }
        const __m512i w20 = q3 ? zero : _mm512_loadu_si512(b + 20 * 64);  /* Q2_K's d | dmin */
        const __m512 dv = q3 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 27 * 64)))
                             : _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w20));
        const __m512 dminv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w20, 16)));
        for (int r = 0; r < rt; r++) {
            const __m512 dxv = _mm512_set1_ps(dx[r * nsb + sb]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(dv, dxv), acc[r]);
            if (!q3) acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms[r]), _mm512_mul_ps(dminv, dxv), acc[r]);
        }
    }
    for (int r = 0; r < rt; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* a repacked Q3_K (q3) or Q2_K panel's words, scales and mins as packed_k23 decodes them, into ex (K * 24 bytes,
 * 64-aligned), once for every tile of rows of a large call: the same bits. Taken for Q3_K (a [8960, 1536] weight,
 * medians of 8 calls alternated in one process: 367 GMAC/s at 40 rows in place, 446 at 48 and 581 at 512 expanded);
 * not for Q2_K, whose words cost two instructions to decode (369 / 378 / 408 expanded, 341 / 359 / 373 in place) */
static void expand_k23(int q3, const uint8_t *pb, int64_t K, uint8_t *ex) {
    const int bytes = q3 ? 110 : 84, qw = q3 ? 8 : 4;
    const __m512i m2 = _mm512_set1_epi8(3), m1 = _mm512_set1_epi8(1), m4 = _mm512_set1_epi32(15);
    for (int64_t sb = 0; sb < K / QK; sb++) {
        const uint8_t *b = pb + sb * NP * bytes;
        const __m512i s0 = _mm512_loadu_si512(b + (q3 ? 24 : 0) * 64), s1 = _mm512_loadu_si512(b + (q3 ? 25 : 0) * 64);
        const __m512i s2 = _mm512_loadu_si512(b + (q3 ? 26 : 0) * 64);
        for (int g = 0; g < 16; g++) {
            const int h = g / 8, j = (g % 8) / 2, half = g % 2;
            const __m512i sm = _mm512_srli_epi32(_mm512_loadu_si512(b + (q3 ? 0 : g / 4) * 64), 8 * (g % 4));
            _mm512_store_si512(ex + (size_t)K * 16 + (sb * 16 + g) * 64, q3 ? q3k_scale16(s0, s1, s2, g) : _mm512_and_si512(sm, m4));
            _mm512_store_si512(ex + (size_t)K * 20 + (sb * 16 + g) * 64, _mm512_and_si512(_mm512_srli_epi32(sm, 4), m4));
            for (int w = 0; w < 4; w++) {
                __m512i u = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(b + (qw + 8 * h + 4 * half + w) * 64), 2 * j), m2);
                if (q3) {
                    const __m512i hb = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(b + (4 * half + w) * 64), 4 * h + j), m1);
                    u = _mm512_or_si512(u, _mm512_slli_epi16(hb, 2));
                }
                _mm512_store_si512(ex + ((sb * 16 + g) * 4 + w) * 64, u);
            }
        }
    }
}

/* rows 0 .. rt - 1 of y against repacked panel pb (a repacked type); ex: Q3_K's / Q2_K's words expanded (expand_k23),
 * where xp */
static inline __attribute__((always_inline)) void packed_rows(int type, int xp, int rt, int64_t K, const uint8_t *pb,
                                                              const uint8_t *ex, const int8_t *qx, const int32_t *xs,
                                                              const int32_t *xs2, const float *dx, float *y, int64_t ldy) {
    if (type == P_Q4_K || type == P_Q5_K) packed_q4k(type == P_Q5_K, rt, K, pb, qx, xs2, dx, y, ldy);
    else if (type == P_Q6_K) packed_q6k(rt, K, pb, qx, xs, dx, y, ldy);
    else if (type == P_IQ4_XS) packed_iq4xs(rt, K, pb, qx, xs, dx, y, ldy);
    else if (type == P_Q3_K || type == P_Q2_K) packed_k23(type == P_Q3_K, xp, rt, K, pb, ex, qx, xs, dx, y, ldy);
    else packed_q32(base_type(type), rt, K, pb, qx, xs, dx, y, ldy);
}

/* gguf_matmul_q8 for many rows: the same integer products, the float sums in another order */
static int gguf_gemm_q8(int ptype, const int8_t *qx, const float *dx, const int16_t *bsums, const uint8_t *raw,
                        float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    const int type = base_type(ptype), G = group_elems(type), ab = act_block(ptype);
    const int64_t ng = K / G, ndx = K / ab, row_bytes = K / block_elems(ptype) * block_bytes(ptype);
    int32_t *xs2, *xs = group_sums(type, bsums, M, K, &xs2);
    if (!xs) return -2;
    int failed = 0;
    const int k23 = ptype == P_Q3_K || ptype == P_Q2_K, direct_only = ptype == P_IQ4_XS || k23;  /* no panel_t form */
    if (ptype > PANEL && (M <= PACKED_DIRECT_ROWS || direct_only)) {  /* repacked: each panel's words in place */
        const int expands = ptype == P_Q3_K && M > PACKED_DIRECT_ROWS;  /* Q3_K: its words decoded once a panel */
#pragma omp parallel
        {
        uint8_t *ex = expand_buffer(expands, (size_t)K * 24, &failed);
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += NP) {
            if (expands && !ex) continue;
            if (ex) expand_k23(ptype == P_Q3_K, raw + n0 * row_bytes, K, ex);
            for (int64_t m0 = 0; m0 < M; m0 += RT) {
                const int rt = M - m0 < RT ? (int)(M - m0) : RT;
                const uint8_t *pb = raw + n0 * row_bytes;
                const int8_t *q = qx + m0 * K;
                const int32_t *xsr = xs + m0 * ng, *xs2r = xs2 + m0 * (ng / 2);
                const float *dxr = dx + m0 * ndx;
                float *yr = y + m0 * ldy + n0;
#define PACKED(T, XP)                                                                            \
                switch (rt) {                                                                    \
                    case 8: packed_rows(T, XP, 8, K, pb, ex, q, xsr, xs2r, dxr, yr, ldy); break;  \
                    case 7: packed_rows(T, XP, 7, K, pb, ex, q, xsr, xs2r, dxr, yr, ldy); break;  \
                    case 6: packed_rows(T, XP, 6, K, pb, ex, q, xsr, xs2r, dxr, yr, ldy); break;  \
                    case 5: packed_rows(T, XP, 5, K, pb, ex, q, xsr, xs2r, dxr, yr, ldy); break;  \
                    case 4: packed_rows(T, XP, 4, K, pb, ex, q, xsr, xs2r, dxr, yr, ldy); break;  \
                    case 3: packed_rows(T, XP, 3, K, pb, ex, q, xsr, xs2r, dxr, yr, ldy); break;  \
                    case 2: packed_rows(T, XP, 2, K, pb, ex, q, xsr, xs2r, dxr, yr, ldy); break;  \
                    default: packed_rows(T, XP, 1, K, pb, ex, q, xsr, xs2r, dxr, yr, ldy); break; \
                }
                BY_PANEL_TYPE(ptype, ex, XP_Q3_K);
#undef PACKED
            }
        }
        free(ex);
        }
        free(xs), free(xs2);
        return failed ? -2 : 0;
    }
#pragma omp parallel
    {
        const size_t nums = (size_t)ng * NP * 4, ubytes = (size_t)K / 4 * NP * 4;
        panel_t p[2];
        int ok = 1;
        for (int i = 0; i < 2; i++) {
            p[i] = (panel_t){aligned_alloc(64, ubytes), aligned_alloc(64, nums), aligned_alloc(64, nums),
                             aligned_alloc(64, nums), aligned_alloc(64, nums)};
            ok = ok && p[i].u && p[i].sc && p[i].mn && p[i].d && p[i].dmin;
        }
        /* a full panel of the file's Q4_K / Q6_K rows is repacked here first, then expanded as a repacked one */
        const int repacks = ptype < PANEL && (type == Q4_K || type == Q6_K);
        uint8_t *tmp = repacks ? aligned_alloc(64, (NP * row_bytes + 63) / 64 * 64) : NULL;
        ok = ok && (tmp || !repacks);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* two panels at a time: each row of x's bytes broadcast once for 32 columns */
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += 2 * NP) {
            if (!ok) continue;
            const int np = N - n0 > NP ? 2 : 1;
            __mmask16 mask[2];
            for (int i = 0; i < np; i++) {
                const int64_t c0 = n0 + i * NP;
                const int nc = N - c0 < NP ? (int)(N - c0) : NP;
                mask[i] = (__mmask16)((1u << nc) - 1);
                if (nc < NP) {
                    memset(p[i].u, 0, ubytes);
                    memset(p[i].sc, 0, nums), memset(p[i].mn, 0, nums), memset(p[i].d, 0, nums), memset(p[i].dmin, 0, nums);
                }
                const uint8_t *panel = ptype > PANEL ? raw + c0 * row_bytes : NULL;
                if (repacks && nc == NP) {
                    repack_panel(type, raw + c0 * row_bytes, row_bytes, K / QK, tmp);
                    panel = tmp;
                }
                if (panel && paired(type))  /* expanded into bytes once for all of M's tiles */
                    pack_panel_q32(type, panel, K, &p[i]);
                else if (panel && type == Q6_K)
                    pack_panel_q6k(panel, K, &p[i]);
                else if (panel)
                    pack_panel_q4k(type == Q5_K, panel, K, &p[i]);
                else
                    for (int c = 0; c < nc; c++) pack_column(type, raw + (c0 + c) * row_bytes, K, c, &p[i]);
            }
            const int tile = np == 2 ? RT2 : RT;
            for (int64_t m0 = 0; m0 < M; m0 += tile) {
                const int rt = M - m0 < tile ? (int)(M - m0) : tile;
                const int8_t *q = qx + m0 * K;
                const int32_t *xsr = xs + m0 * ng;
                const int32_t *xs2r = xs2 + m0 * (ng / 2);
                const float *dxr = dx + m0 * ndx;
                float *yr = y + m0 * ldy + n0;
#define TILE(T, NPAN, R) panel_rows(T, NPAN, R, K, ng, p, q, xsr, xs2r, dxr, ndx, yr, ldy, mask)
#define TILES(T)                                                       \
                if (np == 2) {                                         \
                    switch (rt) { /* RT2 rows at most */               \
                        case 5: TILE(T, 2, 5); break;                  \
                        case 4: TILE(T, 2, 4); break;                  \
                        case 3: TILE(T, 2, 3); break;                  \
                        case 2: TILE(T, 2, 2); break;                  \
                        default: TILE(T, 2, 1); break;                 \
                    }                                                  \
                } else {                                               \
                    switch (rt) {                                      \
                        case 8: TILE(T, 1, 8); break;                  \
                        case 7: TILE(T, 1, 7); break;                  \
                        case 6: TILE(T, 1, 6); break;                  \
                        case 5: TILE(T, 1, 5); break;                  \
                        case 4: TILE(T, 1, 4); break;                  \
                        case 3: TILE(T, 1, 3); break;                  \
                        case 2: TILE(T, 1, 2); break;                  \
                        default: TILE(T, 1, 1); break;                 \
                    }                                                  \
                }
                BY_TYPE(type == Q5_K ? Q4_K : type, TILES);  /* Q5_K expanded: Q4_K's arithmetic; Q4_0, IQ4_NL: Q5_0's */
#undef TILES
#undef TILE
            }
        }
        for (int i = 0; i < 2; i++) free(p[i].u), free(p[i].sc), free(p[i].mn), free(p[i].d), free(p[i].dmin);
        free(tmp);
    }
    free(xs), free(xs2);
    return failed ? -2 : 0;
}
#endif

#include "gguf_panels_avx2.h"

/* W [N, K] of type Q2_K to Q6_K, Q8_0, Q5_0, Q4_0, IQ4_NL or IQ4_XS (the file's rows, raw) repacked into out (as
 * many bytes) for the kernels above; the repacked type's id (PANEL + type), or -1 where it does not apply: another
 * type, N not a multiple of 16, K not a multiple of 256 (Q8_0 / Q5_0 / Q4_0 / IQ4_NL: 64), or a build without the
 * panels (below AVX2) */
int gguf_pack_panels(int type, const uint8_t *raw, uint8_t *out, int64_t N, int64_t K) {
#ifdef GB_PANELS
    const int q32 = paired(type);
    if (!(reads_stored(type) || panel_only(type)) || N % NP || K % (q32 ? 64 : QK))
        return -1;
    const int64_t row_bytes = K / block_elems_any(type) * block_bytes_any(type);
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NP) {
        if (q32) repack_panel_q32(type, raw + n0 * row_bytes, row_bytes, K / 32, out + n0 * row_bytes);
        else repack_panel(type, raw + n0 * row_bytes, row_bytes, K / QK, out + n0 * row_bytes);
    }
    return PANEL + type;
#else
    (void)type, (void)raw, (void)out, (void)N, (void)K;
    return -1;
#endif
}

/* y [M, N_0 + ... + N_{n-1}] = x [M, K] . [W_0; ...; W_{n-1}]^T, W_p [N_p, K] of type types[p] (a fused
 * projection whose shards the file stores in different types): part p's columns of y are gguf_matmul_a8 of
 * W_p, bit for bit, with x rounded once per block size the parts use; 0, -1 for a type these kernels do not
 * read, -2 when memory ran out */
int gguf_matmul_a8_parts(int n, const int *types, const uint8_t *const *raws, const int64_t *Ns, const float *x,
                         float *y, int64_t M, int64_t K) {
    int64_t ldy = 0;
    for (int p = 0; p < n; p++) {
        if (!block_elems(types[p])) return -1;
        ldy += Ns[p];
    }
    int8_t *qx[2] = {NULL, NULL};
    float *dx[2] = {NULL, NULL};
    int16_t *bs[2] = {NULL, NULL};
    int rc = 0;
    for (int64_t p = 0, col = 0; p < n && !rc; col += Ns[p], p++) {
        const int ab = act_block(types[p]), b = ab == QK;
        if (!qx[b]) {
            qx[b] = malloc(M * K + 64);
            dx[b] = malloc(M * (K / ab) * sizeof(float) + 64);
            bs[b] = malloc(M * (K / 16) * sizeof(int16_t) + 64);
            if (!qx[b] || !dx[b] || !bs[b]) {
                rc = -2;
                break;
            }
            gguf_quantize_q8(x, M, K, ab, qx[b], dx[b], bs[b], NULL);
        }
        rc = matmul_q8(types[p], qx[b], dx[b], bs[b], raws[p], y + col, ldy, M, Ns[p], K);
    }
    for (int b = 0; b < 2; b++) free(qx[b]), free(dx[b]), free(bs[b]);
    return rc;
}

/* gguf_matmul_q8 from float x: rounds it (per 256 for the K-quants, per 32 for Q8_0 / Q5_0), then the GEMV */
int gguf_matmul_a8(int type, const float *x, const uint8_t *raw, float *y, int64_t M, int64_t N, int64_t K) {
    return gguf_matmul_a8_parts(1, &type, &raw, &N, x, y, M, K);
}

/* ---- float32 activations ------------------------------------------------------------------------------ */

/* y [M, N] = x [M, K] . W_dequantized^T, each chunk of 256 weights dequantized as gguf_dequantize does it and
 * multiplied in float32 (four chains a row); 0, or -1 for a type these kernels do not read */
int gguf_matmul_f32(int type, const float *x, const uint8_t *raw, float *y, int64_t M, int64_t N, int64_t K) {
    if (!block_elems(type) || type > PANEL) return -1;
    const int64_t row_bytes = K / block_elems(type) * block_bytes(type), chunks = (K + QK - 1) / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += COLS) {
        const int64_t n1 = n0 + COLS < N ? n0 + COLS : N;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = raw + n * row_bytes;
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int64_t mc = M - m0 < MR ? M - m0 : MR;
                float tot[MR] = {0.f};
                for (int64_t c = 0; c < chunks; c++) {
                    float w[QK] __attribute__((aligned(64)));
                    dequant_chunk(type, row, c, K, w);
                    const int64_t len = K - c * QK < QK ? K - c * QK : QK;
                    for (int64_t i = 0; i < mc; i++) {
                        const float *xc = x + (m0 + i) * K + c * QK;
#ifdef GB_AVX512
                        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                        for (int64_t k = 0; k < len; k += 16)
                            a[(k / 16) & 3] = _mm512_fmadd_ps(_mm512_load_ps(w + k), _mm512_loadu_ps(xc + k), a[(k / 16) & 3]);
                        tot[i] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
#elif defined(__AVX2__)
                        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                        for (int64_t k = 0; k < len; k += 8)
                            a[(k / 8) & 3] = _mm256_fmadd_ps(_mm256_load_ps(w + k), _mm256_loadu_ps(xc + k), a[(k / 8) & 3]);
                        tot[i] += hsum256(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
#else
                        float a = 0.f;
                        for (int64_t k = 0; k < len; k++) a += w[k] * xc[k];
                        tot[i] += a;
#endif
                    }
                }
                for (int64_t i = 0; i < mc; i++) y[(m0 + i) * N + n] = tot[i];
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * A GGUF tensor's blocks in pagedllm's int4 / int8 group layout (pagedllm/layers/quantization.py), the
 * values gguf_loader._q_blocks computes with numpy, bit for bit, in one pass at the memory's speed: groups of
 * 32 weights w = q * scale + min, a float32 scale and min per group (Q6_K: a scale per 16, mins 0).
 *   int4 (Q4_0, Q4_1, Q4_K): q [N, K/2] bytes, byte j of a group holding element j (low) and j + 16 (high);
 *   int8 (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K): q [N, K] int8.
 * Q4_0 keeps q 0..15 with min -8d; Q5_0 and Q6_K subtract their offsets (16, 32) from q.
 * ------------------------------------------------------------------------------------------------------- */
static void k_scale_min(const uint8_t *p, int j, uint8_t *sc, uint8_t *m) {  /* llama.cpp's get_scale_min_k4 */
    if (j < 4) {
        *sc = p[j] & 63;
        *m = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 0xF) | ((p[j - 4] >> 6) << 4);
        *m = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

/* one row: K elements from src; q, scales and mins that row's outputs */
static void row_to_groups(int type, const uint8_t *src, int64_t K, uint8_t *q, float *scales, float *mins) {
    if (type == Q4_K || type == Q5_K) {
        const int bb = type == Q4_K ? 144 : 176;
        for (int64_t s = 0; s < K / 256; s++) {
            const uint8_t *b = src + s * bb, *qs = b + bb - 128;
            const float d = f16(b), dmin = f16(b + 2);
            for (int g = 0; g < 8; g++) {
                uint8_t sc, m;
                k_scale_min(b + 4, g, &sc, &m);
                scales[s * 8 + g] = d * (float)sc;
                mins[s * 8 + g] = -(dmin * (float)m);
                const uint8_t *chunk = qs + (g / 2) * 32;
                const int shift = (g & 1) * 4;
                if (type == Q4_K) {  /* byte j: element j's nibble (low), element j + 16's (high), 8 bytes a word */
                    const uint64_t low = 0x0F0F0F0F0F0F0F0Full;
                    for (int w = 0; w < 2; w++) {
                        uint64_t a, b;
                        memcpy(&a, chunk + 8 * w, 8);
                        memcpy(&b, chunk + 16 + 8 * w, 8);
                        const uint64_t v = ((a >> shift) & low) | (((b >> shift) & low) << 4);
                        memcpy(q + (s * 8 + g) * 16 + 8 * w, &v, 8);
                    }
                } else {
                    uint8_t *out = q + (s * 8 + g) * 32;
                    for (int l = 0; l < 32; l++)
                        out[l] = (uint8_t)(((chunk[l] >> shift) & 0xF) | (((b[16 + l] >> g) & 1) << 4));
                }
            }
        }
    } else if (type == Q6_K) {
        for (int64_t s = 0; s < K / 256; s++) {
            const uint8_t *b = src + s * 210;
            const float d = f16(b + 208);
            int8_t *out = (int8_t *)q + s * 256;
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                for (int l = 0; l < 32; l++) {
                    out[128 * h + l] = (int8_t)(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                    out[128 * h + l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    out[128 * h + l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    out[128 * h + l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
            for (int j = 0; j < 16; j++) scales[s * 16 + j] = d * (float)(int8_t)b[192 + j];
            for (int j = 0; j < 8; j++) mins[s * 8 + j] = 0.f;
        }
    } else {  /* the blocks of 32 */
        const int head = type == Q4_1 || type == Q5_1 ? 4 : 2;
        const int bb = block_bytes_any(type);
        for (int64_t g = 0; g < K / 32; g++) {
            const uint8_t *b = src + g * bb;
            const float d = f16(b);
            scales[g] = d;
            mins[g] = type == Q4_1 || type == Q5_1 ? f16(b + 2) : type == Q4_0 ? -8 * d : 0.f;
            if (type == Q4_0 || type == Q4_1) {
                memcpy(q + g * 16, b + head, 16);
            } else if (type == Q8_0) {
                memcpy(q + g * 32, b + 2, 32);
            } else {  /* Q5_0 / Q5_1 */
                uint32_t qh;
                memcpy(&qh, b + head, 4);
                const uint8_t *qs = b + head + 4;
                const int off = type == Q5_0 ? 16 : 0;
                int8_t *out = (int8_t *)q + g * 32;
                for (int j = 0; j < 16; j++) {
                    out[j] = (int8_t)(((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - off);
                    out[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
                }
            }
        }
    }
}

/* N rows of `type`'s blocks, K elements a row, into q, scales and mins (row-major, sized as above).
 * 0, or -1 for a type without a layout (or K not a whole number of blocks). */
int gguf_to_groups(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *q, float *scales, float *mins) {
    const int64_t elems = block_elems_any(type);
    if (!elems || K % elems) return -1;
    const int64_t row_bytes = K / elems * block_bytes_any(type);
    const int64_t q_row = type == Q4_0 || type == Q4_1 || type == Q4_K ? K / 2 : K;
    const int64_t s_row = type == Q6_K ? K / 16 : K / 32;
#pragma omp parallel for schedule(dynamic, 16)  /* rows, in chunks a thread takes when free: another thread (the tokenizer loading) may share its core */
    for (int64_t n = 0; n < N; n++)
        row_to_groups(type, src + n * row_bytes, K, q + n * q_row, scales + n * s_row, mins + n * (K / 32));
    return 0;
}
