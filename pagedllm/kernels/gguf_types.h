/* GGUF's block types as the file stores them, and what every GGUF kernel file shares (included by gguf_blocks.c).
 *
 * What it describes: a weight W [N, K] is N rows of blocks, row n's blocks contiguous: exactly the bytes of the file
 * (a read-only mmap is fine, nothing is written or converted). The types, by ggml id:
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
 *   Q4_1 (3)   20 bytes / 32: f16 d, f16 m, then Q4_0's nibbles; w = d * q + m, q 0..15. In panels only (a float
 *              multiply-add more a block: m times the sum of x over it).
 *   Q5_1 (7)   24 bytes / 32: f16 d, f16 m, then Q5_0's qh and nibbles; w = d * q + m, q 0..31. In panels only.
 *
 * The kernel files, in the order gguf_blocks.c includes them (each one's comment says what it reads):
 *   gguf_types.h          this: the types, their sizes, the helpers every kernel uses (f16, a Q4_K's scales, ...)
 *   gguf_panels.h         the panel layout: weights repacked at load, 16 rows at a time; the sums of x they take off
 *   gguf_dequant.h        float32 weights: gguf's dequantization, the gguf-exact GEMV, the int4 / int8 groups
 *   gguf_rows.h           int8 activations (Q8_K / Q8_0) and the row kernels: a weight row read as stored
 *   gguf_panels_avx512.h  the panel GEMM on AVX-512 VNNI: one kernel at every row count
 *   gguf_panels_amx.h     its integer dots on AMX tiles past 16 rows of x, the same bits (the amx level)
 *   gguf_panels_avx2.h    the same panels and bits on AVX2's 256-bit registers
 *   gguf_blocks.c         the entry points: which kernel a type, a row count and the level take
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
/* the amx level: the panel GEMM's dots on AMX tiles (gguf_panels_amx.h) */
#if defined(GB_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define GB_AMX 1
#endif
/* the repacked panels (gguf_pack_panels) and their one kernel at every row count: AVX-512 VNNI's, and below it
 * the same panels read as two halves of 8 rows on AVX2's 256-bit registers (the same bits: see gguf_panels_avx2.h) */
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
/* part i of n of the lines PF_AHEAD bytes on from a block at b (bytes long): c lines from line i * c (c = bytes / n,
 * in lines, rounded up; the last parts may reach past the block, into the next one's lines), for a kernel that asks
 * for a block's lines a few at a time through its loop over the block. Asked for all at the block's start, the
 * requests beyond the core's miss buffers wait, and the kernel with them. On an AMD EPYC (Zen 3, AVX2 only;
 * 2026-12-01), all of the 1.5B's linears at one row, two threads, spread against at once (the AVX2 panels read in
 * place; medians of 16, alternated in one process): Q6_K 0.77x the time, Q5_K_M 0.83x, Q4_K_M 0.84x, IQ4_XS 0.85x,
 * Q3_K_M 0.94x, Q4_0 and Q2_K 0.96-0.97x, Q8_0 and IQ4_NL 1.0x; without any software prefetch Q6_K took 1.8x. The
 * bounds of each part computed from i took IQ4_NL to 1.24x and Q3_K_M to 1.04-1.15x where GCC keeps the loop (i not
 * a constant) */
static inline __attribute__((always_inline)) void prefetch_part(const void *b, int bytes, int i, int n) {
    const int c = (bytes + 64 * n - 1) / (64 * n);  /* lines a part: a constant, so i may vary at no cost */
    for (int l = 0; PF_AHEAD && l < c; l++) __builtin_prefetch((const char *)b + PF_AHEAD + (i * c + l) * 64, 0, 3);
}
/* the lines of a block's bytes PF_AHEAD on, all at once: its one part */
#define PREFETCH_AHEAD(b, bytes) prefetch_part((b), (int)(bytes), 0, 1)
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
 * Q5_0, Q4_0, Q4_1, Q5_1, IQ4_NL and IQ4_XS; their type ids PANEL + the file's. The same bytes a row as the file's type, so a
 * weight keeps its shape [N, bytes a row]. */
enum { PANEL = 100, P_Q4_K = PANEL + Q4_K, P_Q6_K = PANEL + Q6_K, P_Q8_0 = PANEL + Q8_0, P_Q5_0 = PANEL + Q5_0,
       P_Q5_K = PANEL + Q5_K, P_Q4_0 = PANEL + Q4_0, P_IQ4_NL = PANEL + IQ4_NL, P_IQ4_XS = PANEL + IQ4_XS,
       P_Q3_K = PANEL + Q3_K, P_Q2_K = PANEL + Q2_K, P_Q4_1 = PANEL + Q4_1, P_Q5_1 = PANEL + Q5_1 };
static int base_type(int type) { return type > PANEL ? type - PANEL : type; }

/* PACKED(T, XP) (defined where this is used) with T the repacked type ptype as a constant, XP 1 where ex holds its
 * words expanded for every tile of rows; xps: the types whose words a level expands (XP_*, a constant: the other
 * types' expanded kernels are not compiled) */
enum { XP_Q5_K = 1, XP_Q6_K = 2, XP_IQ4_XS = 4, XP_Q3_K = 8, XP_Q2_K = 16, XP_Q4_K = 32, XP_Q4_0 = 64, XP_Q4_1 = 128,
       XP_Q5_0 = 256, XP_Q5_1 = 512, XP_IQ4_NL = 1024 };
#define BY_PANEL_TYPE(ptype, ex, xps)                                                              \
    do {                                                                                           \
        if ((ptype) == P_Q4_K && ((xps) & XP_Q4_K) && (ex)) { PACKED(P_Q4_K, 1) }                  \
        else if ((ptype) == P_Q4_K) { PACKED(P_Q4_K, 0) }                                          \
        else if ((ptype) == P_Q5_K && ((xps) & XP_Q5_K) && (ex)) { PACKED(P_Q5_K, 1) }             \
        else if ((ptype) == P_Q5_K) { PACKED(P_Q5_K, 0) }                                          \
        else if ((ptype) == P_Q6_K && ((xps) & XP_Q6_K) && (ex)) { PACKED(P_Q6_K, 1) }             \
        else if ((ptype) == P_Q6_K) { PACKED(P_Q6_K, 0) }                                          \
        else if ((ptype) == P_Q8_0) { PACKED(P_Q8_0, 0) }                                          \
        else if ((ptype) == P_Q4_0 && ((xps) & XP_Q4_0) && (ex)) { PACKED(P_Q4_0, 1) }             \
        else if ((ptype) == P_Q4_0) { PACKED(P_Q4_0, 0) }                                          \
        else if ((ptype) == P_Q4_1 && ((xps) & XP_Q4_1) && (ex)) { PACKED(P_Q4_1, 1) }             \
        else if ((ptype) == P_Q4_1) { PACKED(P_Q4_1, 0) }                                          \
        else if ((ptype) == P_Q5_1 && ((xps) & XP_Q5_1) && (ex)) { PACKED(P_Q5_1, 1) }             \
        else if ((ptype) == P_Q5_1) { PACKED(P_Q5_1, 0) }                                          \
        else if ((ptype) == P_IQ4_NL && ((xps) & XP_IQ4_NL) && (ex)) { PACKED(P_IQ4_NL, 1) }       \
        else if ((ptype) == P_IQ4_NL) { PACKED(P_IQ4_NL, 0) }                                      \
        else if ((ptype) == P_IQ4_XS && ((xps) & XP_IQ4_XS) && (ex)) { PACKED(P_IQ4_XS, 1) }       \
        else if ((ptype) == P_IQ4_XS) { PACKED(P_IQ4_XS, 0) }                                      \
        else if ((ptype) == P_Q3_K && ((xps) & XP_Q3_K) && (ex)) { PACKED(P_Q3_K, 1) }             \
        else if ((ptype) == P_Q3_K) { PACKED(P_Q3_K, 0) }                                          \
        else if ((ptype) == P_Q2_K && ((xps) & XP_Q2_K) && (ex)) { PACKED(P_Q2_K, 1) }             \
        else if ((ptype) == P_Q2_K) { PACKED(P_Q2_K, 0) }                                          \
        else if ((ptype) == P_Q5_0 && ((xps) & XP_Q5_0) && (ex)) { PACKED(P_Q5_0, 1) }             \
        else { PACKED(P_Q5_0, 0) }                                                                 \
    } while (0)

/* the file's types the matmul kernels read as stored; those they read in panels only; of both, those whose panels
 * hold their blocks in pairs (blocks of 32: a row of a multiple of 64 weights) */
static int reads_stored(int type) { return type == Q4_K || type == Q6_K || type == Q8_0 || type == Q5_0; }
static int panel_only(int type) {
    return type == Q5_K || type == Q4_0 || type == Q4_1 || type == Q5_1 || type == IQ4_NL || type == IQ4_XS ||
           type == Q3_K || type == Q2_K;
}
static int paired(int type) {
    return type == Q8_0 || type == Q5_0 || type == Q4_0 || type == Q4_1 || type == Q5_1 || type == IQ4_NL;
}
/* the paired types with a min a block (w = d * q + m): a float multiply-add more a block, m times x's sum */
static int has_min(int type) { return type == Q4_1 || type == Q5_1; }
/* the paired types with a fifth bit a weight (u32 qh after d, and m where they have one) */
static int has_fifth(int type) { return type == Q5_0 || type == Q5_1; }
/* where a pair of blocks of a paired type's panel (gguf_panels.h) holds the nibbles (vector nibble_vec + 4h + w of
 * block h), and the fifth bits' masks (vector fifth_vec + h) */
static int nibble_vec(int type) { return type == Q5_0 ? 3 : type == Q4_1 ? 2 : type == Q5_1 ? 4 : 1; }
static int fifth_vec(int type) { return type == Q5_1 ? 2 : 1; }

/* the same for the types the matmul kernels read (0: a type they do not read): four as stored, twelve repacked */
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
