/* The panel GEMM's integer dots on AMX tiles (included by gguf_blocks.c after gguf_panels_avx512.h; built at the
 * amx level: AVX-512 VNNI + BF16 and AMX-INT8, where the OS grants this process tile data).
 *
 * What it reads: a panel expanded into panel_t (gguf_panels_avx512.h: pack_panel_* / pack_column), whose words are
 * already AMX's B layout: word j of the panel (elements 4j .. 4j + 3 of its 16 columns) is one 64-byte row of a
 * tile, so a 32-block's words (8 of them) are a tile of 8 rows; and 16 rows of the int8 activations, the block's
 * 32 bytes of each (an A tile, rows K bytes apart).
 *
 * What it computes: y's 16 columns of a panel for 16 rows of x, as panel_rows does (bit for bit): AMX's tile
 * multiplies (tdpbssd: 16 x 16 int32 sums of 4-byte dot products) give each block's integer dots, the
 * very integers vpdpbusd sums, and the float multiply-adds after them are panel_rows' own, in its order. So a row's
 * bits are those of the avx512-vnni level, at every row count (tests/test_gguf_kernels.py compares the levels).
 *
 * Each block's 16 x 16 sums leave the tiles through memory (tilestored, 1 KiB) and take panel_rows' float
 * multiply-add there: that AVX-512 work (where AVX-512 VNNI spends eight vpdpbusd and it), not the multiplies, bounds
 * the speed. So AMX takes the types whose work after the tiles is that one multiply-add a block: Q8_0, Q5_0, Q4_0
 * and IQ4_NL (amx_offset says which, and why not the others: they keep gguf_panels_avx512.h's tiles at this level),
 * for a call's tiles of 16 rows past 16 rows of x (the file's layout) or 40 (repacked panels: fewer rows read them in
 * place, faster here too). */
#ifdef GB_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16  /* rows of x a tile holds */

/* AMX's tile configuration (ldtilecfg's 64 bytes, palette 1) */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* 1 where the OS grants this process tile data (asked once, as AMX code must ask before its first tile
 * instruction: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); pagedllm.kernels.isa asks it first and builds
 * this level only where granted, so this is a second guard, not the choice */
static int amx_granted(void) {
    static int state;  /* 0: not asked yet; 1 granted; -1 refused */
    int s;
#pragma omp atomic read
    s = state;
    if (!s) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
#pragma omp atomic write
        state = s;
    }
    return s > 0;
}

/* the offset a type's unsigned words carry in panel_t (Q8_0 and IQ4_NL 128, Q5_0 16, Q4_0 8), or 0 for a type AMX
 * does not take. AMX multiplies signed bytes by signed bytes (tdpbssd), so on it a panel's words lose their offset
 * first (amx_signed) and its dots need no sum of x taken off: the same integers.
 *
 * The types AMX takes are those a prefill measured faster with (the 1.5B's files, an Intel Xeon granting tile data,
 * two threads, TTFT of 128 / 512 tokens against the avx512-bf16 level, separate processes alternated): Q8_0
 * 0.87-0.91x / 0.89-0.90x, Q4_0 0.86-0.91x / 0.84-0.91x. Not the K-quants: Q4_K's GEMM alone was 0.82-0.96x the
 * time on tiles (its integer scales taken in exact float chunks), but a Q4_K_M file's prefill 1.01-1.08x (its Q6_K
 * linears and attention around the tiles' run slower; Q6_K on tiles, with a scale every 16 weights, was 0.95-1.16x
 * alone); nor Q4_1 / Q5_1 (a second multiply-add a block after the tiles: 1.01-1.11x), nor the types without
 * panel_t's form (Q2_K, Q3_K, IQ4_XS). */
static int amx_offset(int type) {
    switch (type) {
        case Q8_0: case IQ4_NL: return 128;
        case Q5_0: return 16;
        case Q4_0: return 8;
        default: return 0;
    }
}

/* panel p's words (K / 4 vectors) less the type's offset, as signed bytes (Q8_0's own q, Q4_0's q - 8, ...) */
static void amx_signed(const panel_t *p, int64_t K, int off) {
    const __m512i o = _mm512_set1_epi8((char)off);
    for (int64_t w = 0; w < K / 4; w++) {
        __m512i *v = (__m512i *)(p->u + w * NP);
        _mm512_store_si512(v, _mm512_sub_epi8(_mm512_load_si512(v), o));
    }
}

/* this thread's tiles: four 16 x 16 int32 sums (0-3), two 16 x 32 bytes of x (4-5), two 8 x 64 of words (6-7) */
static void amx_configure(void) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < 6 ? AMX_ROWS : 8;
        c.colsb[t] = t < 4 || t >= 6 ? 64 : 32;
    }
    _tile_loadconfig(&c);
}

/* 32-block g's dots of rows x (K bytes apart) with panel p's signed words into tile c, x in tile a, the words in
 * tile b (literal numbers: the intrinsics name the tiles in the instruction) */
#define AMX_DOTS(c, a, b, x, K, p, g)                                      \
    do {                                                                   \
        _tile_zero(c);                                                     \
        _tile_loadd(a, (x) + (g) * 32, (K));                               \
        _tile_loadd(b, (const uint8_t *)((p)->u + (g) * 8 * NP), 64);      \
        _tile_dpbssd(c, a, b);                                             \
    } while (0)

/* blocks g0 .. g0 + 3 (those below nb) into tiles 0-3 */
#define AMX_DOTS4(x, K, p, g0, nb)                                   \
    do {                                                             \
        AMX_DOTS(0, 4, 6, x, K, p, g0);                              \
        if ((g0) + 1 < (nb)) AMX_DOTS(1, 5, 7, x, K, p, (g0) + 1);   \
        if ((g0) + 2 < (nb)) AMX_DOTS(2, 4, 6, x, K, p, (g0) + 2);   \
        if ((g0) + 3 < (nb)) AMX_DOTS(3, 5, 7, x, K, p, (g0) + 3);   \
    } while (0)

/* rows 0 .. rt - 1 (of 16 given: rows past rt are padding) of y against panel p of a type AMX takes (its words
 * signed: amx_signed; its columns under mask), as panel_rows(Q5_0, 1, ...) computes them: per 32-block, y +=
 * float(dot) * (d * dx). The tiles configured by amx_configure. Four blocks are in the tiles at a time: their
 * multiplies run while AVX-512 takes the four before. */
static inline __attribute__((always_inline)) void amx_rows(int rt, int64_t K, const panel_t *p, const int8_t *qx,
                                                           const float *dx, float *y, int64_t ldy, __mmask16 mask) {
    const int64_t nb = K / 32;  /* any count: the last four may be fewer (the file's layout, an odd count) */
    int32_t dots[4][AMX_ROWS * NP] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    AMX_DOTS4(qx, K, p, 0, nb);
    for (int64_t g0 = 0; g0 < nb; g0 += 4) {
        const int n = nb - g0 < 4 ? (int)(nb - g0) : 4;
        _tile_stored(0, dots[0], 64);
        if (n > 1) _tile_stored(1, dots[1], 64);
        if (n > 2) _tile_stored(2, dots[2], 64);
        if (n > 3) _tile_stored(3, dots[3], 64);
        if (g0 + 4 < nb) AMX_DOTS4(qx, K, p, g0 + 4, nb);
        for (int h = 0; h < n; h++) {  /* a block's dots (less the offset already) into y, as panel_rows */
            const int64_t g = g0 + h;
            const __m512 dv = _mm512_load_ps(p->d + g * NP);
            for (int r = 0; r < AMX_ROWS; r++) {
                const __m512 t = _mm512_cvtepi32_ps(_mm512_load_si512(dots[h] + r * NP));
                acc[r] = _mm512_fmadd_ps(t, _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * nb + g])), acc[r]);
            }
        }
    }
    for (int r = 0; r < rt; r++) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}
#undef AMX_DOTS4
#undef AMX_DOTS

/* a thread's copy of rows m0 .. M - 1 (fewer than 16) of x and their scales, padded to 16 rows with zeros: a last
 * tile for amx_rows (which gives a row the same bits in any tile) */
typedef struct {
    int8_t *qx;
    float *dx;
} amx_pad_t;

static int amx_pad(amx_pad_t *t, int64_t K) {
    t->qx = calloc(AMX_ROWS * K, 1), t->dx = calloc(AMX_ROWS * (K / 32) + 16, 4);
    return t->qx && t->dx;
}

static void amx_pad_rows(const amx_pad_t *t, int rt, int64_t K, const int8_t *qx, const float *dx) {
    memcpy(t->qx, qx, rt * K), memcpy(t->dx, dx, rt * (K / 32) * 4);
}

static void amx_pad_free(amx_pad_t *t) { free(t->qx), free(t->dx); }
#endif
