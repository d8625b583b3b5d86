/* The panel GEMM's integer dots on AMX tiles (included by gguf_blocks.c after gguf_panels_avx512.h; built at the
 * amx level: AVX-512 VNNI + BF16 and AMX-INT8, where the OS grants this process tile data).
 *
 * What it reads: a panel expanded into panel_t (gguf_panels_avx512.h: pack_panel_* / pack_column), whose words are
 * already AMX's B layout: word j of the panel (elements 4j .. 4j + 3 of its 16 columns) is one 64-byte row of a
 * tile, so group g's words (8 of them) are a tile of 8 rows; and 16 rows of the int8 activations, group g's 32
 * bytes of each (an A tile, rows K bytes apart).
 *
 * What it computes: y's 16 columns of a panel for 16 rows of x, as panel_rows does (bit for bit): AMX's tile
 * multiplies (tdpbssd / tdpbsud: 16 x 16 int32 sums of 4-byte dot products) give each group's integer dots, the
 * very integers vpdpbusd sums, and the float multiply-adds after them are panel_rows' own, in its order. So a row's
 * bits are those of the avx512-vnni level, at every row count (tests/test_gguf_kernels.py compares the levels).
 *
 * Each group's 16 x 16 sums leave the tiles through memory (tilestored, 1 KiB) and take panel_rows' scales there:
 * that AVX-512 work, a multiply-add per group where AVX-512 VNNI spends eight vpdpbusd and one, bounds the speed, so
 * AMX takes the types whose work after the tiles is one multiply-add a group (amx_takes; the others keep
 * gguf_panels_avx512.h's tiles at this level too). The types of 32-blocks in the tiles of 16 rows of a call past 16
 * rows (the file's layout) or 40 (repacked panels: fewer rows take them in place, faster here too). */
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

/* the types whose panels AMX multiplies: those where it was faster than AVX-512 VNNI (the 1.5B's four linear shapes
 * at 128 and 512 rows, the same bits, an Intel Xeon with AMX, two threads: Q4_K 0.82x the time, Q5_K 0.87-0.92x,
 * Q8_0 0.76-0.80x, Q5_0 0.70-0.75x, Q4_0 0.67-0.71x, IQ4_NL 0.71-0.75x). Not Q6_K (groups of 16: twice the work
 * after the tiles a product, 0.95-1.16x), Q4_1 / Q5_1 (a second multiply-add a block: 1.01-1.11x), nor the types
 * without panel_t's form (Q2_K, Q3_K, IQ4_XS). */
static int amx_takes(int type) {
    return type == Q4_K || type == Q5_K || type == Q8_0 || type == Q5_0 || type == Q4_0 || type == IQ4_NL;
}

/* the offset a type's unsigned words carry in panel_t (Q8_0 and IQ4_NL 128, Q5_0 16, Q4_0 8; Q4_K and Q5_K none:
 * their mins multiply the plain sums of x). AMX multiplies signed bytes by signed bytes too (tdpbssd), so on it a
 * panel's words lose their offset first (amx_signed) and its dots need no sum of x taken off: the same integers. */
static int amx_offset(int type) {
    switch (type) {
        case Q8_0: case IQ4_NL: return 128;
        case Q5_0: return 16;
        case Q4_0: return 8;
        default: return 0;
    }
}

/* panel p's words (K / 4 vectors) less the type's offset, as signed bytes (q: Q8_0's own, Q6_K's q - 32, ...) */
static void amx_signed(const panel_t *p, int64_t K, int off) {
    const __m512i o = _mm512_set1_epi8((char)off);
    for (int64_t w = 0; w < K / 4; w++) {
        __m512i *v = (__m512i *)(p->u + w * NP);
        _mm512_store_si512(v, _mm512_sub_epi8(_mm512_load_si512(v), o));
    }
}

/* this thread's tiles for groups of G bytes (32): four 16 x 16 int32 sums (0-3), two 16 x G of x (4-5), two G / 4 x
 * 64 of words (6-7) */
static void amx_configure(int G) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < 6 ? AMX_ROWS : (uint8_t)(G / 4);
        c.colsb[t] = t < 4 || t >= 6 ? 64 : (uint16_t)G;
    }
    _tile_loadconfig(&c);
}

/* group g's dots of rows x (K bytes apart) with panel p into tile c, x in tile a, the words in tile b (literal
 * numbers: the intrinsics name the tiles in the instruction); signed words (sgn) or unsigned */
#define AMX_DOTS(c, a, b, sgn, x, K, p, G, g)                                     \
    do {                                                                          \
        _tile_zero(c);                                                            \
        _tile_loadd(a, (x) + (g) * (G), (K));                                     \
        _tile_loadd(b, (const uint8_t *)((p)->u + (g) * ((G) / 4) * NP), 64);    \
        if (sgn) _tile_dpbssd(c, a, b);                                           \
        else _tile_dpbsud(c, a, b);                                               \
    } while (0)

/* groups g0 .. g0 + 3 (those below ng) into tiles 0-3 */
#define AMX_DOTS4(sgn, x, K, p, G, g0, ng)                                   \
    do {                                                                     \
        AMX_DOTS(0, 4, 6, sgn, x, K, p, G, g0);                              \
        if ((g0) + 1 < (ng)) AMX_DOTS(1, 5, 7, sgn, x, K, p, G, (g0) + 1);   \
        if ((g0) + 2 < (ng)) AMX_DOTS(2, 4, 6, sgn, x, K, p, G, (g0) + 2);   \
        if ((g0) + 3 < (ng)) AMX_DOTS(3, 5, 7, sgn, x, K, p, G, (g0) + 3);   \
    } while (0)

/* rows 0 .. rt - 1 (of 16 given: rows past rt are padding) of y against panel p (its columns under mask), as
 * panel_rows(type, 1, ...) computes them: type Q4_K (Q5_K's arithmetic too, q5) or Q5_0 (that of Q8_0, Q4_0 and
 * IQ4_NL: p's words signed, amx_signed). The tiles configured for 32-byte groups (amx_configure). Four groups are
 * in the tiles at a time: their multiplies run while AVX-512 takes the four before.
 *
 * Q4_K's groups take their integer scales in floats, where vpmulld (two micro-ops on one port of these cores) would
 * bound the speed: a chunk of groups' sum_g sc_g * dot_g is an integer under 2^24 in magnitude, so every float
 * product and partial sum of it is exact, and its conversion back is the int32 panel_rows sums (Q4_K: |dot| <=
 * 32 * 15 * 127, sc <= 63, four groups a chunk: 15,361,920; Q5_K's q up to 31: two groups, 15,873,984). */
static inline __attribute__((always_inline)) void amx_rows(int type, int q5, int rt, int64_t K, int64_t ng,
                                                           const panel_t *p, const int8_t *qx, const int32_t *xs2,
                                                           const float *dx, int64_t ndx, float *y, int64_t ldy,
                                                           __mmask16 mask) {
    const int kq = type == Q4_K, sgn = !kq, chunk = q5 ? 2 : 4, per = 8;  /* Q4_K: 8 groups a super-block */
    int32_t dots[4][AMX_ROWS * NP] __attribute__((aligned(64)));
    int32_t ism[AMX_ROWS * NP] __attribute__((aligned(64)));  /* Q4_K: a super-block's integer sum so far */
    float accm[AMX_ROWS * NP] __attribute__((aligned(64)));     /* Q4_K: y so far */
    __m512 acc[AMX_ROWS];  /* Q4_K: a chunk's sums (exact); the others: y so far */
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    if (kq)
        for (int r = 0; r < AMX_ROWS; r++) _mm512_store_ps(accm + r * NP, _mm512_setzero_ps());
    AMX_DOTS4(sgn, qx, K, p, 32, 0, ng);
    for (int64_t g0 = 0; g0 < ng; g0 += 4) {
        const int n = ng - g0 < 4 ? (int)(ng - g0) : 4;
        _tile_stored(0, dots[0], 64);
        if (n > 1) _tile_stored(1, dots[1], 64);
        if (n > 2) _tile_stored(2, dots[2], 64);
        if (n > 3) _tile_stored(3, dots[3], 64);
        if (g0 + 4 < ng) AMX_DOTS4(sgn, qx, K, p, 32, g0 + 4, ng);
        for (int h = 0; h < n; h++) {
            const int64_t g = g0 + h;
            const int32_t *a = dots[h];
            if (!kq) {  /* a block's dots (less the offset already) into y at once, as panel_rows */
                const __m512 dv = _mm512_load_ps(p->d + g * NP);
                for (int r = 0; r < AMX_ROWS; r++) {
                    const __m512 t = _mm512_cvtepi32_ps(_mm512_load_si512(a + r * NP));
                    acc[r] = _mm512_fmadd_ps(t, _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * ndx + g])), acc[r]);
                }
                continue;
            }
            const __m512 sf = _mm512_cvtepi32_ps(_mm512_load_si512(p->sc + g * NP));
            for (int r = 0; r < AMX_ROWS; r++) {
                const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(a + r * NP));
                acc[r] = g % chunk ? _mm512_fmadd_ps(v, sf, acc[r]) : _mm512_mul_ps(v, sf);
            }
            if ((g + 1) % chunk) continue;
            for (int r = 0; r < AMX_ROWS; r++) {  /* the chunk's integer into the super-block's */
                const __m512i c = _mm512_cvtps_epi32(acc[r]);
                _mm512_store_si512(ism + r * NP, g % per < chunk ? c : _mm512_add_epi32(_mm512_load_si512(ism + r * NP), c));
            }
            if ((g + 1) % per) continue;
            const int64_t sb = g / per;  /* the super-block's last group: panel_rows' float multiply-adds */
            const __m512 dv = _mm512_load_ps(p->d + sb * NP), dminv = _mm512_load_ps(p->dmin + sb * NP);
            for (int r = 0; r < AMX_ROWS; r++) {
                const __m512 dxv = _mm512_set1_ps(dx[r * ndx + sb]);
                __m512 ar = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ism + r * NP)), _mm512_mul_ps(dv, dxv),
                                            _mm512_load_ps(accm + r * NP));
                __m512i ms = _mm512_setzero_si512();  /* the mins: two groups a vpdpwssd, as panel_rows sums them */
                for (int k = 0; k < 4; k++)
                    ms = _mm512_dpwssd_epi32(ms, _mm512_load_si512(p->mn + (sb * 4 + k) * NP),
                                             _mm512_set1_epi32(xs2[r * (ng / 2) + sb * 4 + k]));
                _mm512_store_ps(accm + r * NP, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(dminv, dxv), ar));
            }
        }
    }
    if (!kq)
        for (int r = 0; r < AMX_ROWS; r++) _mm512_store_ps(accm + r * NP, acc[r]);
    for (int r = 0; r < rt; r++) _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_load_ps(accm + r * NP));
}
#undef AMX_DOTS4
#undef AMX_DOTS

/* a thread's copy of rows m0 .. M - 1 (fewer than 16) of x, their scales and Q4_K's sums of x, padded to 16 rows
 * with zeros: a last tile for amx_rows (which gives a row the same bits in any tile) */
typedef struct {
    int8_t *qx;
    int32_t *xs2;
    float *dx;
} amx_pad_t;

static int amx_pad(amx_pad_t *t, int64_t K, int64_t ng, int64_t ndx) {
    t->qx = calloc(AMX_ROWS * K, 1), t->xs2 = calloc(AMX_ROWS * (ng / 2) + 16, 4), t->dx = calloc(AMX_ROWS * ndx + 16, 4);
    return t->qx && t->xs2 && t->dx;
}

static void amx_pad_rows(const amx_pad_t *t, int rt, int64_t K, int64_t ng, int64_t ndx, const int8_t *qx,
                         const int32_t *xs2, const float *dx) {
    memcpy(t->qx, qx, rt * K), memcpy(t->xs2, xs2, rt * (ng / 2) * 4), memcpy(t->dx, dx, rt * ndx * 4);
}

static void amx_pad_free(amx_pad_t *t) { free(t->qx), free(t->xs2), free(t->dx); }
#endif
