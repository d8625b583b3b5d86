/* The panel GEMM on AVX-512 VNNI (included by gguf_blocks.c after gguf_rows.h; built at the avx512-vnni level and
 * above). What it reads: a weight as stored, decoded at each call into panels of 16 rows (gguf_gemm_q8 on Q4_K,
 * Q6_K, Q8_0, Q5_0 past a few rows), or repacked at load (gguf_panels.h's layout, every panel type); the int8
 * activations of gguf_rows.h and their sums per group (group_sums). What it computes: y's 16 columns of a panel
 * for tiles of rows of x, one kernel at every row count. */

#ifdef GB_AVX512
/* ---- many rows of x: a GEMM over panels of decoded weights --------------------------------------------
 * Past a few rows the per-row cost of the row kernels (gguf_rows.h: two instructions and a horizontal sum per 64
 * weights and row) dominates. Here NP = 16 weight rows (output columns) are decoded at a time into a panel
 * of unsigned bytes laid out for vpdpbusd: word j of column c holds the column's elements 4j .. 4j + 3,
 * and the 16 columns' words for one j are one vector. A row of x then costs one vpdpbusd (its 4 int8
 * broadcast to every lane) per 64 products and no horizontal sums. Each type's weights are u 0..255
 * unsigned (Q6_K: q; Q5_0, Q4_0: q; Q8_0: q + 128; IQ4_NL: its values + 128), so a group's integer dot is
 * (u . q_x) less the offset (Q6_K: 32; Q5_0: 16; Q4_0: 8; Q8_0, IQ4_NL: 128) times sum(q_x); a super-block's
 * groups are summed in int32 by their integer scales (vpmulld), and the super-block's (a 32-block's) sum then
 * goes into y with one float multiply-add (Q4_K: a second for its mins, whose sum is an integer under 2^24 and so
 * exact in floats; Q4_1 / Q5_1, whose q has no offset: a second for m times dx sum(q_x)):
 * the row kernels' integers, a quarter of the float work of a multiply-add per group, the float sums in
 * another order than the row kernels' lanes. Tiles are two panels by RT2 rows where there are two panels
 * (each row's 4 bytes of x broadcast once for 32 columns), and Q4_K's mins are summed at the start of each
 * super-block, off the dots' critical path: 15-18 % faster than one panel by RT rows at 100-512 rows. */
#define RT 8   /* rows of x per register tile */
#define RT2 5  /* the same for a tile of two panels (its integer sums fill the registers) */

/* A panel's numbers besides its bytes, for column c (group g at [g * NP + c], super-block or block b at
 * [b * NP + c]): sc the integer scale of a group (Q4_K's 6 bits, Q6_K's int8; 1 for Q8_0 / Q5_0), mn Q4_K's
 * 6-bit mins of groups 2k and 2k + 1 as the two int16 of word k (for vpdpwssd), d the scale of a super-block
 * (Q8_0 / Q5_0: of a block), dmin Q4_K's (Q4_1 / Q5_1: a block's m). */
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

/* word j (0-7) of block h (0, 1) of a pair of a paired type's repacked panel (repack_panel_q32's layout), as the
 * panel GEMM reads its words: elements 4j .. 4j + 3 of the 16 rows, unsigned (Q8_0: q + 128; IQ4_NL: its values +
 * 128; the others q) */
static inline __attribute__((always_inline)) __m512i q32_word(int type, const uint8_t *pair, int h, int j) {
    if (type == Q8_0) return _mm512_loadu_si512(pair + (1 + 8 * h + j) * 64);
    const __m512i v = _mm512_loadu_si512(pair + (nibble_vec(type) + 4 * h + (j & 3)) * 64);
    const __m512i nib = _mm512_and_si512(j < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
    if (type == IQ4_NL) return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(iq4nl_table()), nib);
    if (!has_fifth(type)) return nib;
    const __mmask64 fifth = _load_mask64((__mmask64 *)(pair + (fifth_vec(type) + h) * 64 + 8 * j));
    return _mm512_mask_add_epi8(nib, fifth, nib, _mm512_set1_epi8(0x10));
}

/* a whole repacked panel of 16 rows of a paired type expanded as pack_column expands each row (Q4_1 / Q5_1: m in
 * dmin) */
static void pack_panel_q32(int type, const uint8_t *panel, int64_t K, const panel_t *p) {
    for (int64_t g = 0; g < K / 32; g++) {
        const uint8_t *pair = panel + (g / 2) * 32 * block_bytes_any(type);
        const int h = (int)(g & 1);
        _mm512_store_ps(p->d + g * NP, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pair + 32 * h))));
        if (has_min(type))
            _mm512_store_ps(p->dmin + g * NP, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pair + 64 + 32 * h))));
        for (int j = 0; j < 8; j++) _mm512_store_si512(p->u + (g * 8 + j) * NP, q32_word(type, pair, h, j));
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

/* a[q][r] = the integer dots of group g (G elements) of panel q (of np) with rows 0 .. rt - 1 of x (K bytes
 * apart), less off[r * ng + g] where off is not NULL (the weights' offset times the sum of the group's q_x: the
 * dots start from it, a vpsubd fewer a dot; Q6_K's GEMM 4 % faster at 512 rows and 6 % at 48, the paired types'
 * 0-3 %; the kernels read in place, up to 40 rows, were 4-6 % slower so): each row's 4 bytes an embedded
 * broadcast of each panel's vpdpbusd, or for Q6_K's groups of 16 one
 * broadcast register shared by the two panels (on the Intel Xeon of 2026-11-30 the register took 1.03-1.30x the
 * time of the Q4_K, Q8_0 and Q4_0 GEMMs at 128 and 512 rows and 0.99-1.08x Q5_K's, the embedded broadcast
 * 1.01-1.06x Q6_K's) */
static inline __attribute__((always_inline)) void group_dots(int np, int rt, int G, int64_t K, const panel_t *p, int64_t g,
                                                             const int8_t *qx, const int32_t *off, int64_t ng,
                                                             __m512i a[2][RT]) {
    for (int q = 0; q < np; q++)
        for (int r = 0; r < rt; r++) a[q][r] = off ? _mm512_set1_epi32(-off[r * ng + g]) : _mm512_setzero_si512();
    const int8_t *xg = qx + g * G;
    for (int j = 0; j < G / 4; j++) {
        __m512i w[2];
        for (int q = 0; q < np; q++) w[q] = _mm512_load_si512(p[q].u + (g * (G / 4) + j) * NP);
        for (int r = 0; r < rt; r++) {
            if (G == 16) {
                int32_t x4;
                memcpy(&x4, xg + r * K + 4 * j, 4);
                const __m512i xb = _mm512_set1_epi32(x4);
                for (int q = 0; q < np; q++) a[q][r] = _mm512_dpbusd_epi32(a[q][r], w[q], xb);
            } else {
                for (int q = 0; q < np; q++) a[q][r] = dpbusd_b(a[q][r], w[q], xg + r * K + 4 * j);
            }
        }
    }
}

/* rows 0 .. rt - 1 of y against np (1 or 2) panels side by side (their columns the lanes; panel q's at y + q *
 * NP, mask[q] of them). x's rows K bytes apart; xs (sums of q_x per group, times the weights' offset; the plain
 * sums for Q4_1 / Q5_1) ng apart,
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
                group_dots(np, rt, G, K, p, g, qx, type == Q6_K ? xs : NULL, ng, a);  /* Q6_K: less its offset */
                for (int q = 0; q < np; q++) {
                    const __m512i sv = _mm512_load_si512(p[q].sc + g * NP);
                    for (int r = 0; r < rt; r++) {
                        is[q][r] = _mm512_add_epi32(is[q][r], _mm512_mullo_epi32(a[q][r], sv));
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
    } else {  /* Q8_0 (weights stored + 128), Q5_0 (q 0..31), Q4_0: the offset times sum(q_x) comes off; Q4_1 (its
               * arithmetic Q5_1's too): a second multiply-add, m times the block's sum of x (dx sum(q_x)) */
        for (int64_t g = 0; g < ng; g++) {
            group_dots(np, rt, 32, K, p, g, qx, has_min(type) ? NULL : xs, ng, a);  /* less the offset's part */
            for (int q = 0; q < np; q++) {
                const __m512 dv = _mm512_load_ps(p[q].d + g * NP);
                for (int r = 0; r < rt; r++) {
                    __m512 ar = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[q][r]), _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * ndx + g])), _mm512_load_ps(acc_at(q, r)));
                    if (has_min(type))
                        ar = _mm512_fmadd_ps(_mm512_load_ps(p[q].dmin + g * NP), _mm512_set1_ps(dx[r * ndx + g] * (float)xs[r * ng + g]), ar);
                    _mm512_store_ps(acc_at(q, r), ar);
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

/* the same for a repacked panel of a paired type (the file's): panel_rows(type, ...) on the panel's words (Q4_1 /
 * Q5_1: panel_rows(Q4_1, ...)) */
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
            const __m512 mv = has_min(type) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pair + 64 + 32 * h))) : dv;
            for (int r = 0; r < rt; r++) {
                const __m512i s = split == 2 ? _mm512_add_epi32(a[0][r], a[1][r]) : a[0][r];
                const __m512i t = has_min(type) ? s : _mm512_sub_epi32(s, _mm512_set1_epi32(xs[r * nb + g]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * nb + g])), acc[r]);
                if (has_min(type)) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(dx[r * nb + g] * (float)xs[r * nb + g]), acc[r]);
            }
        }
    }
    for (int r = 0; r < rt; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* up to this many rows of x, a repacked weight's panels are read where they lie, each decoded once per tile of
 * RT rows; more rows expand each panel into bytes once (pack_panel_*), then panel_rows: the same bits. Two
 * layers of the 1.5B, in place against expanded: 447 / 438 GMAC/s at 24 rows, 465 / 460 at 40, 477 / 495 at 48.
 * The same where AMX multiplies the expanded panels (the 1.5B's four linear shapes, an Intel Xeon with AMX, in place
 * against AMX: 0.83-0.89x the time at 16 and 24 rows, 0.85-1.18x at 32, 0.94-1.14x at 40) */
#ifndef PACKED_DIRECT_ROWS
#define PACKED_DIRECT_ROWS 40  /* Q3_K's and Q2_K's panels, read in place or expanded: K23_EXPAND_ROWS */
#endif

/* more rows of x than this decode each Q3_K / Q2_K panel's words, scales and pairs once (expand_k23) for all the
 * tiles: one thread, 1536 x 1536, in place against expanded: Q2_K 99 / 120 GMAC/s at 9 rows, 111 / 145 at 16, 112 /
 * 165 at 40; Q3_K 77 / 98, 100 / 125, 100 / 155. Two threads, 1536 x 8960: Q2_K 191 / 189 at 9 rows, 213 / 231 at
 * 16; Q3_K 148 / 159 and 190 / 220 */
#ifndef K23_EXPAND_ROWS
#define K23_EXPAND_ROWS 8
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

/* where xp, the weights' words (q + 4 / q) and scales come from ex instead, decoded once for all the row tiles
 * (expand_k23's layout: word w of group g of super-block sb at vector (16 sb + g) 4 + w, then the scales, one vector
 * a group, then the pairs: Q2_K's mins or Q3_K's scales of groups 2k and 2k + 1 as the two int16 of a lane, which
 * multiply x's sums per 16 (xs2) two groups a vpdpwssd once a super-block's groups are done) */
static inline __attribute__((always_inline)) void packed_k23(int q3, int xp, int rt, int64_t K, const uint8_t *pb,
                                                             const uint8_t *ex, const int8_t *qx, const int32_t *xs,
                                                             const int32_t *xs2, const float *dx, float *y, int64_t ldy) {
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
            const __m512i mv = xp ? zero : _mm512_and_si512(_mm512_srli_epi32(sm, 4), m4);
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
            /* each int32 here fits in its low int16 (at most 16 * 7 * 127 + 4 * 16 * 127): vpdpwssd by a factor in
             * the low int16 of a lane (the high one 0: Q3_K's scales masked, Q2_K's and the mins are 0..15; ex holds
             * them so) adds vpmulld's product in one instruction instead of three */
            const __m512i sv16 = q3 && !xp ? _mm512_and_si512(sv, _mm512_set1_epi32(0xFFFF)) : sv;
            for (int r = 0; r < rt; r++) {
                if (xp) {  /* Q3_K's offset and Q2_K's mins after the groups, by pairs */
                    is[r] = _mm512_dpwssd_epi32(is[r], a[r], sv16);
                    continue;
                }
                const __m512i xsv = _mm512_set1_epi32(xs[r * ng + sb * 16 + g]);
                is[r] = _mm512_dpwssd_epi32(is[r], q3 ? _mm512_sub_epi32(a[r], xsv) : a[r], sv16);
                if (!q3) ms[r] = _mm512_dpwssd_epi32(ms[r], xsv, mv);
            }
        }
        if (xp) {  /* Q2_K's mins, or Q3_K's scales for its offset of 4, times x's sums per 16: two groups a vpdpwssd */
            const uint8_t *pairs = ex + (size_t)K * 20 + sb * 8 * 64;
            __m512i t[RT];
            for (int r = 0; r < rt; r++) t[r] = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++) {
                const __m512i pv = _mm512_load_si512(pairs + k * 64);
                for (int r = 0; r < rt; r++) t[r] = _mm512_dpwssd_epi32(t[r], pv, _mm512_set1_epi32(xs2[r * (ng / 2) + sb * 8 + k]));
            }
            for (int r = 0; r < rt; r++) {
                if (q3) is[r] = _mm512_sub_epi32(is[r], _mm512_slli_epi32(t[r], 2));
                else ms[r] = t[r];
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

/* a repacked Q3_K (q3) or Q2_K panel's words, scales and pairs as packed_k23 takes them, into ex (K * 24 bytes,
 * 64-aligned; AVX2's expand_k23 lays them the same way, its scales in both int16 of a lane without VNNI), once for
 * every tile of rows of a large call: the same bits. With the scales by vpdpwssd and the mins / Q3_K's offset by
 * pairs, one thread, 1536 x 1536 at 512 rows: Q2_K 106 -> 161 GMAC/s, Q3_K 148 -> 166 */
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
            const __m512i sv = q3 ? q3k_scale16(s0, s1, s2, g) : _mm512_and_si512(sm, m4);
            /* the scale in the low int16 of its lane (vpdpwssd's form); the pairs' word: Q2_K's min, or Q3_K's scale,
             * of group g as int16 g % 2 of word g / 2 */
            _mm512_store_si512(ex + (size_t)K * 16 + (sb * 16 + g) * 64, _mm512_and_si512(sv, _mm512_set1_epi32(0xFFFF)));
            const __m512i pv = _mm512_and_si512(q3 ? sv : _mm512_srli_epi32(sm, 4), _mm512_set1_epi32(q3 ? 0xFFFF : 15));
            uint8_t *pair = ex + (size_t)K * 20 + (sb * 8 + g / 2) * 64;
            _mm512_store_si512(pair, g % 2 ? _mm512_or_si512(_mm512_load_si512(pair), _mm512_slli_epi32(pv, 16)) : pv);
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
    else if (type == P_Q3_K || type == P_Q2_K) packed_k23(type == P_Q3_K, xp, rt, K, pb, ex, qx, xs, xs2, dx, y, ldy);
    else packed_q32(base_type(type), rt, K, pb, qx, xs, dx, y, ldy);
}

#include "gguf_panels_amx.h"  /* amx_rows: panel_rows' tiles of 16 rows on AMX, at the amx level */

#ifdef GB_AMX
/* 1 where a call's tiles of 16 rows of x take AMX (tile data granted); a variable so that tests and benchmarks can
 * compare the two in one build */
int gguf_use_amx = 1;
#endif

/* tiles_T_XP (gguf_panels.h) for the types read in place here (Q3_K's and Q2_K's also expanded): tiles of RT rows */
#define TILE RT
#define TILE_CASES(T, XP)                                                                                      \
    TILE_ROWS(T, XP, 8) TILE_ROWS(T, XP, 7) TILE_ROWS(T, XP, 6) TILE_ROWS(T, XP, 5) TILE_ROWS(T, XP, 4) \
    TILE_ROWS(T, XP, 3) TILE_ROWS(T, XP, 2)
DEFINE_TILES(P_Q4_K, 0) DEFINE_TILES(P_Q5_K, 0) DEFINE_TILES(P_Q6_K, 0) DEFINE_TILES(P_Q8_0, 0)
DEFINE_TILES(P_Q4_0, 0) DEFINE_TILES(P_Q4_1, 0) DEFINE_TILES(P_Q5_0, 0) DEFINE_TILES(P_Q5_1, 0)
DEFINE_TILES(P_IQ4_NL, 0) DEFINE_TILES(P_IQ4_XS, 0) DEFINE_TILES(P_Q3_K, 0) DEFINE_TILES(P_Q3_K, 1)
DEFINE_TILES(P_Q2_K, 0) DEFINE_TILES(P_Q2_K, 1)
#undef TILE_CASES
#undef TILE
/* the types expanded at AVX2 only: BY_PANEL_TYPE names them, never taken here (XP_Q3_K | XP_Q2_K) */
#define tiles_P_Q4_K_1 tiles_P_Q4_K_0
#define tiles_P_Q5_K_1 tiles_P_Q5_K_0
#define tiles_P_Q6_K_1 tiles_P_Q6_K_0
#define tiles_P_Q4_0_1 tiles_P_Q4_0_0
#define tiles_P_Q4_1_1 tiles_P_Q4_1_0
#define tiles_P_Q5_0_1 tiles_P_Q5_0_0
#define tiles_P_Q5_1_1 tiles_P_Q5_1_0
#define tiles_P_IQ4_NL_1 tiles_P_IQ4_NL_0
#define tiles_P_IQ4_XS_1 tiles_P_IQ4_XS_0

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
        const int expands = k23 && M > K23_EXPAND_ROWS;  /* Q3_K's and Q2_K's words decoded once a panel */
#pragma omp parallel
        {
        uint8_t *ex = expand_buffer(expands, (size_t)K * 24, &failed);
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += NP) {
            if (expands && !ex) continue;
            if (ex) expand_k23(ptype == P_Q3_K, raw + n0 * row_bytes, K, ex);
            const uint8_t *pb = raw + n0 * row_bytes, *next = n0 + NP < N ? pb + NP * row_bytes : NULL;
#define PACKED(T, XP) tiles_##T##_##XP(M, K, pb, ex, qx, xs, xs2, dx, y + n0, ldy, next, NP * row_bytes);
            BY_PANEL_TYPE(ptype, ex, XP_Q3_K | XP_Q2_K);
#undef PACKED
        }
        free(ex);
        }
        free(xs), free(xs2);
        return failed ? -2 : 0;
    }
#ifdef GB_AMX
    const int amx = gguf_use_amx && M >= AMX_ROWS && amx_offset(type) && amx_granted();
#endif
#pragma omp parallel
    {
        int ok = 1;
#ifdef GB_AMX
        amx_pad_t pad = {0};
        if (amx) amx_configure(), ok = M % AMX_ROWS ? amx_pad(&pad, K) : 1;  /* a short last tile's rows */
#endif
        const size_t nums = (size_t)ng * NP * 4, ubytes = (size_t)K / 4 * NP * 4;
        panel_t p[2];
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
#ifdef GB_AMX
                if (amx) amx_signed(&p[i], K, amx_offset(type));  /* read by AMX only */
#endif
            }
            const int tile = np == 2 ? RT2 : RT;
            /* above PACKED_DIRECT_ROWS, the next two panels' bytes into L2 as this pair's tiles run (prefetch_slice):
             * packing them waits less */
            const int64_t left = N - n0 - 2 * NP, nn = M > PACKED_DIRECT_ROWS && left > 0 ? (left < 2 * NP ? left : 2 * NP) : 0;
            int64_t step = tile;
#ifdef GB_AMX
            if (amx) step = AMX_ROWS;
#endif
            for (int64_t m0 = 0, rt; m0 < M; m0 += rt) {
                prefetch_slice(nn ? raw + (n0 + 2 * NP) * row_bytes : NULL, nn * row_bytes, (M + step - 1) / step, m0 / step);
#ifdef GB_AMX
                if (amx) {  /* 16 rows on AMX, a panel at a time (the last tile padded): the same bits */
                    rt = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
                    const int8_t *q = qx + m0 * K;
                    const float *dxr = dx + m0 * ndx;
                    if (rt < AMX_ROWS) amx_pad_rows(&pad, (int)rt, K, q, dxr), q = pad.qx, dxr = pad.dx;
                    for (int i = 0; i < np; i++)
                        amx_rows((int)rt, K, &p[i], q, dxr, y + m0 * ldy + n0 + i * NP, ldy, mask[i]);
                    continue;
                }
#endif
                rt = M - m0 < tile ? (int)(M - m0) : tile;
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
                if (has_min(type)) {  /* Q5_1 expanded: Q4_1's arithmetic */
                    TILES(Q4_1)
                } else {
                    BY_TYPE(type == Q5_K ? Q4_K : type, TILES);  /* Q5_K expanded: Q4_K's arithmetic; Q4_0, IQ4_NL: Q5_0's */
                }
#undef TILES
#undef TILE
            }
        }
        for (int i = 0; i < 2; i++) free(p[i].u), free(p[i].sc), free(p[i].mn), free(p[i].d), free(p[i].dmin);
        free(tmp);
#ifdef GB_AMX
        if (amx) _tile_release(), amx_pad_free(&pad);  /* the tile state let go: a core holding none sleeps deeper */
#endif
    }
    free(xs), free(xs2);
    return failed ? -2 : 0;
}
#endif
