/* The panels (included by gguf_blocks.c after gguf_types.h): where the level has AVX2, a weight's rows are
 * repacked at load 16 at a time (NP), so that one kernel multiplies every row count and a row's bits never depend
 * on what shares its call. A panel holds its 16 rows' bytes, no more, permuted:
 *   - the K-quants and IQ4_XS (super-blocks of 256): super-block sb of a panel is its rows' blocks sb, word w (4
 *     bytes) of the 16 rows' blocks as one 64-byte vector (lane c: row c), w = 0 .. bytes / 4 - 1, and the bytes
 *     past the last whole word as 16 runs (repack_panel, in gguf_panels_avx512.h and gguf_panels_avx2.h);
 *   - the types of 32-blocks (Q8_0, Q5_0, Q4_0, Q4_1, Q5_1, IQ4_NL) in pairs of blocks, below (repack_panel_q32).
 * Here too: a panel's row unpacked to the file's bytes (an embedding's lookup, the float path), and the sums of the
 * rounded x that the panel kernels take off their integer dots (group_sums). */

/* Q8_0, Q5_0, Q4_0, Q4_1 and Q5_1 in panels (K a multiple of 64) hold their blocks in pairs: pair P (blocks 2P,
 * 2P + 1) of a panel's 16 rows is as many vectors of 64 bytes as a block has bytes / 2 (Q8_0: 17, Q5_1: 12, Q5_0:
 * 11, Q4_1: 10, Q4_0: 9), lane c (4 bytes) row c's; for block 2P + h:
 *   vector 0                  both blocks' d, 16 f16 each (block 2P + h's at bytes 32h + 2c);
 *   Q4_1, Q5_1: vector 1      both blocks' m, as d;
 *   Q8_0, vectors 1 + 8h + j  word j (j < 8) of q ^ 0x80: elements 4j .. 4j + 3, unsigned q + 128;
 *   Q5_0 / Q5_1, vector f + h the fifth bits as 8 masks of 64 bits (mask j, bit 4c + i: that of row c's
 *                             element 4j + i, i < 4), f = fifth_vec (1; Q5_1: 2);
 *   the nibbles, vectors n + 4h + w   nibble word w (w < 4) as the file has it: elements 4w .. 4w + 3 in the low
 *                             nibbles, 16 + 4w .. in the high ones, n = nibble_vec (Q4_0 and IQ4_NL, whose
 *                             nibbles are indices: 1; Q4_1: 2; Q5_0: 3; Q5_1: 4).
 * So element 4j + i of a block is byte i of word j's lane (Q5_0 / Q5_1: of word j % 4's low (j < 4) or high
 * nibbles, plus 16 where its mask j's bit is set). The file's bytes, transposed and their bits permuted: a panel
 * holds its rows' bytes, no more (pairs, not single blocks, so that each vector starts on a line of 64 bytes). */
#ifdef GB_PANELS
static void repack_panel_q32(int type, const uint8_t *rows, int64_t row_bytes, int64_t nb, uint8_t *dst) {
    const int bytes = block_bytes_any(type), head = has_min(type) ? 4 : 2, fifth = has_fifth(type);
    for (int64_t g = 0; g < nb; g++) {
        uint8_t *pair = dst + (g / 2) * 32 * bytes;
        const int h = (int)(g & 1);
        uint64_t mask[8] = {0};
        for (int c = 0; c < 16; c++) {
            const uint8_t *b = rows + c * row_bytes + g * bytes;
            memcpy(pair + 32 * h + 2 * c, b, 2);
            if (has_min(type)) memcpy(pair + 64 + 32 * h + 2 * c, b + 2, 2);
            if (type == Q8_0) {
                for (int j = 0; j < 8; j++) {
                    const uint32_t w = load32(b + 2 + 4 * j) ^ 0x80808080u;
                    memcpy(pair + (1 + 8 * h + j) * 64 + 4 * c, &w, 4);
                }
                continue;
            }
            if (fifth) {
                const uint32_t qh = load32(b + head);
                for (int j = 0; j < 8; j++) mask[j] |= (uint64_t)((qh >> 4 * j) & 0xF) << 4 * c;
            }
            const uint8_t *nib = b + head + 4 * fifth;
            for (int w = 0; w < 4; w++) memcpy(pair + (nibble_vec(type) + 4 * h + w) * 64 + 4 * c, nib + 4 * w, 4);
        }
        if (fifth) memcpy(pair + (fifth_vec(type) + h) * 64, mask, 64);
    }
}
#endif

/* row c of a paired type's panel (nb blocks) as the file stores it, into out */
static void unpack_row_q32(int type, const uint8_t *panel, int c, int64_t nb, uint8_t *out) {
    const int bytes = block_bytes_any(type), head = has_min(type) ? 4 : 2, fifth = has_fifth(type);
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *pair = panel + (g / 2) * 32 * bytes;
        const int h = (int)(g & 1);
        uint8_t *o = out + g * bytes;
        memcpy(o, pair + 32 * h + 2 * c, 2);
        if (has_min(type)) memcpy(o + 2, pair + 64 + 32 * h + 2 * c, 2);
        if (type == Q8_0) {
            for (int j = 0; j < 8; j++) {
                const uint32_t w = load32(pair + (1 + 8 * h + j) * 64 + 4 * c) ^ 0x80808080u;
                memcpy(o + 2 + 4 * j, &w, 4);
            }
            continue;
        }
        if (fifth) {
            uint32_t qh = 0;
            for (int j = 0; j < 8; j++) {
                uint64_t m;
                memcpy(&m, pair + (fifth_vec(type) + h) * 64 + 8 * j, 8);
                qh |= (uint32_t)((m >> 4 * c) & 0xF) << 4 * j;
            }
            memcpy(o + head, &qh, 4);
        }
        for (int w = 0; w < 4; w++) memcpy(o + head + 4 * fifth + 4 * w, pair + (nibble_vec(type) + 4 * h + w) * 64 + 4 * c, 4);
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

#ifdef GB_PANELS
#define NP 16  /* columns of a panel: one per int32 lane (AVX2: of its two halves' lanes) */
static int group_elems(int type) { return type == Q6_K || type == Q3_K || type == Q2_K ? 16 : 32; }

/* The sums of the rounded x the panel kernels take off their integer dots, from the sums per 16 (bsums): xs [M,
 * K / G] those per group of G (group_elems) times the offset of the weights' unsigned bytes (Q6_K 32, Q8_0 and
 * the i-quants 128, Q5_0 16, Q4_0 8, Q3_K 4; Q4_K, Q2_K, Q4_1 and Q5_1 none: the plain sums, which their mins
 * multiply), and *xs2 [M, K / G / 2] the plain sums of groups 2k and 2k + 1 as the two int16 of word k
 * (for Q4_K's mins, AVX2's Q6_K read in place and the expanded Q2_K / Q3_K: at most 32 * 127 in magnitude). NULL
 * when memory ran out; free both. */
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
/* slice i of `tiles` of the `bytes` at next (a panel a thread multiplies next) into L2, a slice as each tile of this
 * panel starts: where a panel's words are expanded (or packed) once for all its tiles, that expansion is the only
 * reader of the weight's bytes from memory, and without this it waits on them (a Q6_K file's 512-token prefill at
 * avx2: 5 % of its time in expand_panel's loads). Nothing where next is NULL */
static inline __attribute__((always_inline)) void prefetch_slice(const uint8_t *next, int64_t bytes, int64_t tiles,
                                                                 int64_t i) {
    if (!next) return;
    const int64_t per = ((bytes + tiles - 1) / tiles + 63) / 64 * 64, end = (i + 1) * per < bytes ? (i + 1) * per : bytes;
    for (int64_t o = i * per; o < end; o += 64) __builtin_prefetch(next + o, 0, 2);
}

/* tiles_T_XP: one panel's columns of y (y + the panel's first column) for all M rows of x, in tiles of TILE rows, for
 * the repacked type T (XP 1 where ex holds its words expanded), a function each: inlined into one function, every
 * type's kernels made GCC compile some of them slower (AVX2's Q3_K at avx2-vnni 98 -> 76 GMAC/s, one thread, 512 x
 * 8960 x 1536, when the paired types' expanded kernels joined them). A level defines TILE and TILE_CASES(T, XP),
 * its cases of rows above 1 (TILE_ROWS(T, XP, R) each), then DEFINE_TILES for each (T, XP) BY_PANEL_TYPE names.
 * Where XP, the next panel's bytes (next, next_bytes: NULL where none) come into L2 as its tiles run (prefetch_slice) */
#define TILE_ROWS(T, XP, R) \
    case R: packed_rows(T, XP, R, K, pb, ex, q, xsr, xs2r, dxr, yr, ldy); break;
#define DEFINE_TILES(T, XP)                                                                                          \
    static __attribute__((noinline)) void tiles_##T##_##XP(int64_t M, int64_t K, const uint8_t *pb, const uint8_t *ex, \
                                                          const int8_t *qx, const int32_t *xs, const int32_t *xs2,     \
                                                          const float *dx, float *y, int64_t ldy, const uint8_t *next, \
                                                          int64_t next_bytes) {                                        \
        const int64_t ng = K / group_elems(base_type(T)), ndx = K / act_block(T), nt = (M + TILE - 1) / TILE;          \
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {                                                                     \
            if (XP) prefetch_slice(next, next_bytes, nt, m0 / TILE);                                                   \
            const int8_t *q = qx + m0 * K;                                                                             \
            const int32_t *xsr = xs + m0 * ng, *xs2r = xs2 + m0 * (ng / 2);                                            \
            const float *dxr = dx + m0 * ndx;                                                                          \
            float *yr = y + m0 * ldy;                                                                                  \
            switch (M - m0 < TILE ? (int)(M - m0) : TILE) {                                                            \
                TILE_CASES(T, XP)                                                                                      \
                default: packed_rows(T, XP, 1, K, pb, ex, q, xsr, xs2r, dxr, yr, ldy); break;                          \
            }                                                                                                          \
        }                                                                                                              \
    }
#endif
