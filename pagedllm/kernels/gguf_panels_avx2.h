/* The GGUF panels on AVX2 (included by gguf_blocks.c after gguf_panels_avx512.h; the types from gguf_types.h, the
 * panel layout and group_sums from gguf_panels.h; built where the level has AVX2 + FMA + F16C but not AVX-512 VNNI).
 *
 * What it reads: a weight repacked by gguf_pack_panels, panels of 16 rows (NP), each a run of the rows' blocks
 * with word w (4 bytes) of the 16 rows' block as one 64-byte vector (lane c: row c), and for the types of 32-blocks
 * pairs of blocks (repack_panel_q32's layout, described in gguf_panels.h). Per row of x: the int8 activations qx (K
 * bytes), their scales dx (per 256 or per 32) and their sums per group (group_sums: xs, xs2; for Q6_K's expanded
 * tiles without AVX-VNNI, q6k_offsets' table in xs's place).
 *
 * What it computes: y's 16 columns of a panel, for tiles of up to RTA rows of x, as gguf_gemm_q8 of the AVX-512
 * section does (bit for bit: tests/test_gguf_kernels.py compares the levels), at every row count. */
#if defined(GB_PANELS) && !defined(GB_AVX512)
/* ---- AVX2: the repacked panels on 256-bit registers ---------------------------------------------------
 * The panels are AVX-512's (gguf_pack_panels: the same bytes at every level), read as two halves: bytes 0-31 of
 * each 64-byte vector hold rows 0-7 of the panel, bytes 32-63 rows 8-15. Each half is a pass of the kernels
 * below over the panel's words (the second pass finds them in L2), and computes in its 8 lanes exactly what the
 * AVX-512 kernels compute in theirs: the same integer sums, then the same float multiply-adds in the same order,
 * so a row's bits are those of an AVX-512 VNNI build, at every row count. The 4-byte dot products are AVX-VNNI's
 * vpdpbusd where the CPU has it; else vpmaddubsw (pairs of unsigned x signed bytes into int16, saturating) and
 * vpmaddwd by ones. The pairs stay under 2^15 for every type but Q8_0's bytes (q + 128, up to 255): there the
 * signed q multiplies x with its sign moved onto x (|q| . sign(x, q), at most 2 * 128 * 127), which is the same
 * integer as (q + 128) . x - 128 * sum(x); so do IQ4_NL's values (at most 127 in magnitude). */
#define RTA 4  /* rows of x per tile: AVX2 has 16 vector registers */

/* bytes from one (half, super-block)'s expanded words to the next (expand_panel): its 64 words of 32 bytes, then
 * what the kernels would decode from the block for each tile besides (Q4_K's / Q5_K's q4k_consts, 14 vectors;
 * Q6_K's 16 scales from q6k_scales16, without the pairs that only the kernels read in place take), so a panel's
 * tiles take them with a load */
#define XP_STRIDE_Q4_K (2048 + 14 * 32)
static inline int64_t xp_stride(int ptype) { return ptype == P_Q6_K ? 2048 + 16 * 32 : XP_STRIDE_Q4_K; }

static inline __attribute__((always_inline)) __m256i dp8(__m256i acc, __m256i u, __m256i s) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
    __asm__("" : "+x"(acc));  /* a chain, not a tree of products in memory (add_maddubs) */
    return acc;
#endif
}

/* acc + v in int32, kept a chain: GCC otherwise reassociates a run of such sums into a tree whose terms wait in
 * memory (Q6_K's GEMM: 1.25-1.3x the time) */
static inline __attribute__((always_inline)) __m256i add32(__m256i acc, __m256i v) {
    acc = _mm256_add_epi32(acc, v);
    __asm__("" : "+x"(acc));
    return acc;
}

/* acc + vpmaddwd(a, b): with AVX-VNNI one vpdpwssd, else the two instructions kept a chain (add32) */
static inline __attribute__((always_inline)) __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return add32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* sum over k < n of pairs k (stride bytes apart: two groups' int16 factors a lane) times x's sums of those two
 * groups (xs2[k]): Q4_K's mins, Q6_K's offset, Q2_K's mins and Q3_K's offset, two groups a madd_acc */
static inline __attribute__((always_inline)) __m256i pairs_dot(const void *pairs, int stride, const int32_t *xs2, int n) {
    __m256i t = _mm256_setzero_si256();
    for (int k = 0; k < n; k++)
        t = madd_acc(t, _mm256_load_si256((const __m256i *)((const uint8_t *)pairs + k * stride)), _mm256_set1_epi32(xs2[k]));
    return t;
}

static inline __attribute__((always_inline)) __m256i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* acc + vpmaddubsw(u, x's 4 bytes at x4 in every lane), int16 pairs. The empty asm keeps the sum a chain: GCC
 * otherwise reassociates a chain of int16 adds into a tree whose products wait in memory (the 8 words of a Q4_K
 * sub-block, 4 rows: 191 GMAC/s with the tree, 2 rows of x spilled each product) */
static inline __attribute__((always_inline)) __m256i add_maddubs(__m256i acc, __m256i u, const void *x4) {
    acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, bcast4(x4)));
    __asm__("" : "+x"(acc));
    return acc;
}

/* the low (hi = 0) or high (hi = 1) float16 of each of 8 int32 lanes, as floats */
static inline __attribute__((always_inline)) __m256 f16_lanes(__m256i w, int hi) {
    const __m256i h = hi ? _mm256_srli_epi32(w, 16) : _mm256_and_si256(w, _mm256_set1_epi32(0xFFFF));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);  /* the 8 halves in order */
    return _mm256_cvtph_ps(_mm256_castsi256_si128(p));
}

/* one panel: 16 rows of a Q4_K, Q5_K, Q6_K or IQ4_XS weight (row_bytes apart, nsb super-blocks) repacked into dst: word w of
 * row c at dst + (w * 16 + c) * 4, a block's last bytes (Q6_K's d) after its words as 16 pairs */
static void repack_panel(int type, const uint8_t *rows, int64_t row_bytes, int64_t nsb, uint8_t *dst) {
    const int bytes = block_bytes_any(type), words = bytes / 4;
    for (int64_t sb = 0; sb < nsb; sb++) {
        uint8_t *d = dst + sb * NP * bytes;
        for (int c = 0; c < NP; c++) {
            const uint8_t *src = rows + c * row_bytes + sb * bytes;
            for (int w = 0; w < words; w++) memcpy(d + (w * NP + c) * 4, src + 4 * w, 4);
            if (bytes % 4) memcpy(d + words * 64 + c * (bytes % 4), src + 4 * words, bytes % 4);
        }
    }
}

/* q5_bits of AVX-512 on 8 lanes: the fifth bits of chunk cc's bytes (bit 2cc + hi of the qh word h) at bit 4 */
static inline __attribute__((always_inline)) __m256i q5_bits8(__m256i h, int cc, int hi) {
    const __m256i b = _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * cc + hi));
    return _mm256_and_si256(_mm256_slli_epi16(b, 4), _mm256_set1_epi8(0x10));
}

/* chunk cc's low (hi = 0) or high nibbles of word j of a Q5_K super-block's half b, each with its fifth bit; or
 * where xp the same word expanded already (ex: 64 words of 32 bytes in the order (cc, hi, j): expand_panel) */
static inline __attribute__((always_inline)) __m256i q5k_word_at(int xp, const uint8_t *b, const uint8_t *ex, int cc, int hi, int j) {
    if (xp) return _mm256_load_si256((const __m256i *)(ex + ((2 * cc + hi) * 8 + j) * 32));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(b + (12 + 8 * cc + j) * 64));
    const __m256i n = _mm256_and_si256(hi ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(n, q5_bits8(_mm256_loadu_si256((const __m256i *)(b + (4 + j) * 64)), cc, hi));
}

/* what half_q4k takes from a Q4_K / Q5_K super-block's half b (8 rows) besides its words, into out: 0-7 the
 * sub-blocks' scales by chunk cc, low then high nibbles (2cc + hi: AVX-VNNI's as int32 for vpmulld, else in both
 * int16 of each lane for vpmaddwd), 8-11 the mins of groups 2k and 2k + 1 as the two int16 of a lane (k: groups
 * 0-1, 2-3 of the low half, then of the high one, as below), 12-13 d and dmin as floats. expand_panel keeps them
 * after each super-block's expanded words; decoded in place, half_q4k takes them from here */
static inline __attribute__((always_inline)) void q4k_consts(const uint8_t *b, __m256i *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi8(0x3F), top = _mm256_set1_epi8(0x30);
    const __m256i ff = _mm256_set1_epi32(0xFF), hi16 = _mm256_set1_epi32(0xFF0000);
    /* vector 0: d | dmin; 1-3: the 12 bytes of scales (k4_scales on 8 rows at once) */
    const __m256i u0 = _mm256_loadu_si256((const __m256i *)(b + 64)), u1 = _mm256_loadu_si256((const __m256i *)(b + 128));
    const __m256i u2 = _mm256_loadu_si256((const __m256i *)(b + 192));
    const __m256i sl = _mm256_and_si256(u0, m6);
    const __m256i sh = _mm256_or_si256(_mm256_and_si256(u2, m4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), top));
    for (int cc = 0; cc < 4; cc++)
        for (int hi = 0; hi < 2; hi++) {
            const __m256i sv = _mm256_and_si256(_mm256_srli_epi32(cc < 2 ? sl : sh, 16 * (cc & 1) + 8 * hi), ff);
#ifdef __AVXVNNI__
            out[2 * cc + hi] = sv;
#else
            out[2 * cc + hi] = _mm256_or_si256(sv, _mm256_slli_epi32(sv, 16));
#endif
        }
    const __m256i ml = _mm256_and_si256(u1, m6);
    const __m256i mh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4), _mm256_and_si256(_mm256_srli_epi32(u1, 2), top));
    for (int k = 0; k < 2; k++) {
        const __m256i lo = _mm256_srli_epi32(ml, 16 * k), hi = _mm256_srli_epi32(mh, 16 * k);
        out[8 + k] = _mm256_or_si256(_mm256_and_si256(lo, ff), _mm256_and_si256(_mm256_slli_epi32(lo, 8), hi16));
        out[10 + k] = _mm256_or_si256(_mm256_and_si256(hi, ff), _mm256_and_si256(_mm256_slli_epi32(hi, 8), hi16));
    }
    const __m256i w0 = _mm256_loadu_si256((const __m256i *)b);
    out[12] = _mm256_castps_si256(f16_lanes(w0, 0)), out[13] = _mm256_castps_si256(f16_lanes(w0, 1));
}

/* rows 0 .. rt - 1 of y (8 columns: half hf of a repacked Q4_K panel pb, or of a Q5_K one where q5, its weights
 * from ex where xp: expand_panel's) as packed_q4k of AVX-512 computes them. Like every half_* kernel, it takes
 * halves hf0 .. hf0 + nh - 1 (hf below), nh 2 for both in one pass (packed_rows) */
static inline __attribute__((always_inline)) void half_q4k(int q5, int xp, int rt, int64_t K, const uint8_t *pb, const uint8_t *ex,
                                                           int hf0, int nh, const int8_t *qx, const int32_t *xs2, const float *dx,
                                                           float *y, int64_t ldy) {
    const int64_t nsb = K / QK, npair = K / 64;
    const int bytes = q5 ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    float accms[2][RTA * 8] __attribute__((aligned(32)));
    for (int hh = 0; hh < nh; hh++)
        for (int r = 0; r < rt; r++) _mm256_store_ps(accms[hh] + r * 8, _mm256_setzero_ps());
    for (int64_t sb = 0; sb < nsb; sb++)
    for (int hh = 0; hh < nh; hh++) {
        const int hf = hf0 + hh;
        float *accm = accms[hh];
        const uint8_t *b = pb + sb * NP * bytes + 32 * hf;
        const uint8_t *eb = xp ? ex + (hf * nsb + sb) * XP_STRIDE_Q4_K : NULL;
        __m256i cb[14];
        const __m256i *cs = cb;  /* q4k_consts' */
        if (xp) cs = (const __m256i *)(eb + 2048);
        else q4k_consts(b, cb);
        int32_t ism[RTA * 8] __attribute__((aligned(32)));
        for (int r = 0; r < rt; r++) _mm256_store_si256((__m256i *)(ism + r * 8), _mm256_setzero_si256());
        for (int cc = 0; cc < 4; cc++) {  /* chunk cc: sub-blocks 2cc (low nibbles) and 2cc + 1 (high) */
            if (!hf0 && !xp) prefetch_part(pb + sb * NP * bytes, NP * bytes, 4 * hh + cc, 4 * nh);
            const uint8_t *q = b + (q5 ? 12 : 4) * 64 + cc * 8 * 64;
            const uint8_t *xc = (const uint8_t *)qx + sb * QK + 64 * cc;
#ifndef __AVXVNNI__
            /* a sub-block's pairs of products summed in int16 (Q4_K: all 8 words, at most 8 * 2 * 15 * 127 = 30480;
             * Q5_K: 4 words at a time, 4 * 2 * 31 * 127 = 31496), then times its scale (in both int16 of a lane) by
             * vpmaddwd: the integer AVX-512 gets, a third fewer instructions */
            const __m256i sl16 = _mm256_load_si256(cs + 2 * cc), sh16 = _mm256_load_si256(cs + 2 * cc + 1);
            const int run = q5 ? 4 : 8;
            for (int j0 = 0; j0 < 8; j0 += run) {
                __m256i pl[RTA], ph[RTA];
                for (int r = 0; r < rt; r++) pl[r] = ph[r] = _mm256_setzero_si256();
                if (xp) {
                    /* expanded: the run's low words against every row, then its high words. Each word is loaded once
                     * and the registers hold a tile's sums of one kind; both words of a step at once, GCC ran out of
                     * registers and loaded each word again for every row (Q5_K: 60 loads a run of 4 words at 4 rows,
                     * 40 now). The same sums, each in the same order */
#pragma GCC unroll 8
                    for (int j = j0; j < j0 + run; j++) {
                        const __m256i lo = q5k_word_at(1, b, eb, cc, 0, j);
                        for (int r = 0; r < rt; r++) pl[r] = add_maddubs(pl[r], lo, xc + r * K + 4 * j);
                    }
#pragma GCC unroll 8
                    for (int j = j0; j < j0 + run; j++) {
                        const __m256i hi = q5k_word_at(1, b, eb, cc, 1, j);
                        for (int r = 0; r < rt; r++) ph[r] = add_maddubs(ph[r], hi, xc + r * K + 32 + 4 * j);
                    }
                } else {  /* read in place: both words of a step, decoded from the same bytes */
#pragma GCC unroll 8
                    for (int j = j0; j < j0 + run; j++) {
                        __m256i lo, hi;
                        if (q5) {
                            lo = q5k_word_at(0, b, eb, cc, 0, j), hi = q5k_word_at(0, b, eb, cc, 1, j);
                        } else {
                            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * j));
                            lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        }
                        for (int r = 0; r < rt; r++) {
                            pl[r] = add_maddubs(pl[r], lo, xc + r * K + 4 * j);
                            ph[r] = add_maddubs(ph[r], hi, xc + r * K + 32 + 4 * j);
                        }
                    }
                }
                for (int r = 0; r < rt; r++) {
                    __m256i *s = (__m256i *)(ism + r * 8);
                    _mm256_store_si256(s, _mm256_add_epi32(_mm256_load_si256(s), _mm256_add_epi32(_mm256_madd_epi16(pl[r], sl16), _mm256_madd_epi16(ph[r], sh16))));
                }
            }
#else
            const int split = rt <= 2 ? 2 : 1;
            __m256i al[2][RTA], ah[2][RTA];
            for (int e = 0; e < split; e++)
                for (int r = 0; r < rt; r++) al[e][r] = ah[e][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m256i lo, hi;
                if (q5 || xp) {
                    lo = q5k_word_at(xp, b, eb, cc, 0, j), hi = q5k_word_at(xp, b, eb, cc, 1, j);
                } else {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * j));
                    lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
                const int e = j % split;
                for (int r = 0; r < rt; r++) {
                    al[e][r] = dp8(al[e][r], lo, bcast4(xc + r * K + 4 * j));
                    ah[e][r] = dp8(ah[e][r], hi, bcast4(xc + r * K + 32 + 4 * j));
                }
            }
            for (int r = 0; r < rt; r++) {
                const __m256i l = split == 2 ? _mm256_add_epi32(al[0][r], al[1][r]) : al[0][r];
                const __m256i h = split == 2 ? _mm256_add_epi32(ah[0][r], ah[1][r]) : ah[0][r];
                __m256i *s = (__m256i *)(ism + r * 8);
                _mm256_store_si256(s, _mm256_add_epi32(_mm256_load_si256(s), _mm256_add_epi32(_mm256_mullo_epi32(l, _mm256_load_si256(cs + 2 * cc)),
                                                                                           _mm256_mullo_epi32(h, _mm256_load_si256(cs + 2 * cc + 1)))));
            }
#endif
        }
        const __m256 dv = _mm256_castsi256_ps(_mm256_load_si256(cs + 12)), dminv = _mm256_castsi256_ps(_mm256_load_si256(cs + 13));
        /* the mins: cs[8 + k] those of groups 2k and 2k + 1 as the two int16 of a lane */
        for (int r = 0; r < rt; r++) {
            const __m256 dxv = _mm256_set1_ps(dx[r * nsb + sb]);
            __m256 ar = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(ism + r * 8))), _mm256_mul_ps(dv, dxv), _mm256_load_ps(accm + r * 8));
            const __m256i ms = pairs_dot(cs + 8, 32, xs2 + r * npair + sb * 4, 4);
            ar = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(dminv, dxv), ar);
            _mm256_store_ps(accm + r * 8, ar);
        }
    }
    for (int hh = 0; hh < nh; hh++)
        for (int r = 0; r < rt; r++) _mm256_storeu_ps(y + r * ldy + 8 * (hf0 + hh), _mm256_load_ps(accms[hh] + r * 8));
}

/* Q6_K's word t (0-3) of 8 rows from ql words lo (word j) and lo32 (word j + 8) and qh word hi: q6k_word's bits */
static inline __attribute__((always_inline)) __m256i q6k_word8(__m256i lo, __m256i lo32, __m256i hi, int t) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m256i low = _mm256_and_si256(t < 2 ? (t == 0 ? lo : lo32) : _mm256_srli_epi32(t == 2 ? lo : lo32, 4), m4);
    const __m256i top = t == 0 ? _mm256_slli_epi32(hi, 4) : t == 1 ? _mm256_slli_epi32(hi, 2) : t == 2 ? hi : _mm256_srli_epi32(hi, 2);
    return _mm256_or_si256(low, _mm256_and_si256(top, m2));
}

/* word j of elements 128h + 32t + 4j of a Q6_K super-block's half b (8 rows), or where xp of its expanded words ex
 * (64 words of 32 bytes in the order (h, t, j): expand_panel). xp a constant at each call: one kernel for each */
static inline __attribute__((always_inline)) __m256i q6k_word_at(int xp, const uint8_t *b, const uint8_t *ex, int h, int t, int j) {
    if (xp) return _mm256_load_si256((const __m256i *)(ex + ((4 * h + t) * 8 + j) * 32));
    const __m256i l = _mm256_loadu_si256((const __m256i *)(b + (16 * h + 8 * (t & 1) + j) * 64));
    return q6k_word8(l, l, _mm256_loadu_si256((const __m256i *)(b + (32 + 8 * h + j) * 64)), t);
}

/* the Q4_K word of q5k_word_at: chunk cc's low (hi = 0) or high nibbles of word j of a super-block's half b */
static inline __attribute__((always_inline)) __m256i q4k_word(const uint8_t *b, int cc, int hi, int j) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(b + (4 + 8 * cc + j) * 64));
    return _mm256_and_si256(hi ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

/* a Q6_K super-block's 16 scales (half b of a repacked panel, 8 rows) as q6k_sums takes them: with AVX-VNNI each
 * sign-extended to int32 (out 0-15, for vpmulld); else each in both int16 of its lanes (out 0-15), then where pairs
 * scales 2k and 2k + 1 as the two int16 of a lane (out 16-23), for the offset's vpmaddwd of the kernels read in
 * place (the expanded ones start their sums from the offset instead) */
static inline __attribute__((always_inline)) void q6k_scales16(const uint8_t *b, __m256i *out, int pairs) {
    #pragma GCC unroll 8
    for (int q = 0; q < 4; q++) {
        const __m256i sw = _mm256_loadu_si256((const __m256i *)(b + (48 + q) * 64));
        #pragma GCC unroll 8
        for (int t = 0; t < 4; t++) {
            const __m256i v = _mm256_srai_epi32(_mm256_slli_epi32(sw, 24 - 8 * t), 24);
#ifdef __AVXVNNI__
            out[4 * q + t] = v;
#else
            out[4 * q + t] = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
#endif
        }
    }
#ifndef __AVXVNNI__
    for (int k = 0; k < 8 && pairs; k++) out[16 + k] = _mm256_blend_epi16(out[2 * k], out[2 * k + 1], 0xAA);
#else
    (void)pairs;
#endif
}

/* a repacked Q4_K, Q5_K or Q6_K panel's (ptype's) words decoded once, q 0..15, 0..31 or 0..63, for the tiles of many
 * rows of x that each read them: both halves, half hf's super-block sb at ex + (hf * K / 256 + sb) * xp_stride, its 64
 * words in the order half_q4k / q6k_word_at read them (word a * 8 + j: Q4_K's and Q5_K's a = 2cc + hi, Q6_K's
 * a = 4h + t). Q4_K's cost a load where each tile's decoding took three vector operations */
static void expand_panel(int ptype, const uint8_t *pb, int64_t K, uint8_t *ex) {
    const int64_t nsb = K / QK, bytes = ptype == P_Q4_K ? 144 : ptype == P_Q5_K ? 176 : 210;
    for (int hf = 0; hf < 2; hf++)
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *b = pb + sb * NP * bytes + 32 * hf;
            uint8_t *o = ex + (hf * nsb + sb) * xp_stride(ptype);
            if (ptype == P_Q6_K) q6k_scales16(b, (__m256i *)(o + 2048), 0);
            else q4k_consts(b, (__m256i *)(o + 2048));
            for (int a = 0; a < 8; a++)
                for (int j = 0; j < 8; j++)
                    _mm256_store_si256((__m256i *)(o + (a * 8 + j) * 32),
                                       ptype == P_Q4_K   ? q4k_word(b, a / 2, a % 2, j)
                                       : ptype == P_Q5_K ? q5k_word_at(0, b, NULL, a / 2, a % 2, j)
                                                         : q6k_word_at(0, b, NULL, a / 4, a % 4, j));
        }
}

#ifdef __AVXVNNI__
/* is[r] = super-block sb's integer sum for row r of x, sum_g sc_g * ((q_w . q_x)_g - 32 sum(q_x)_g), of half b of
 * a repacked Q6_K panel: AVX-512's integers and order, vpdpbusd on 8 lanes */
static inline __attribute__((always_inline)) void q6k_sums(int xp, int rt, int64_t K, const uint8_t *b, const uint8_t *ex, int64_t sb,
                                                           const int8_t *qx, const int32_t *xs, const int32_t *xs2, __m256i *is,
                                                           const uint8_t *pf, int pfi, int pfn) {
    const int64_t ng = K / 16;
    __m256i a[RTA];
    (void)xs2;
    for (int r = 0; r < rt; r++) is[r] = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int h = 0; h < 2; h++)
        #pragma GCC unroll 8
        for (int t = 0; t < 4; t++)  /* elements 128h + 32t + 4j of word j: groups 8h + 2t and 8h + 2t + 1 */
            #pragma GCC unroll 8
            for (int jj = 0; jj < 2; jj++) {
                if (pf) prefetch_part(pf, NP * 210, 16 * pfi + 4 * h + 2 * t + jj, 16 * pfn);
                for (int r = 0; r < rt; r++) a[r] = _mm256_setzero_si256();
                #pragma GCC unroll 8
                for (int j = 4 * jj; j < 4 * jj + 4; j++) {
                    const __m256i v = q6k_word_at(xp, b, ex, h, t, j);
                    for (int r = 0; r < rt; r++) a[r] = dp8(a[r], v, bcast4(qx + r * K + sb * QK + 128 * h + 32 * t + 4 * j));
                }
                const int g = 8 * h + 2 * t + jj;
                const __m256i sv = xp ? _mm256_load_si256((const __m256i *)(ex + 2048) + g)
                                      : _mm256_srai_epi32(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(b + (48 + g / 4) * 64)),
                                                                            24 - 8 * (g % 4)), 24);
                for (int r = 0; r < rt; r++) {
                    const __m256i t32 = _mm256_sub_epi32(a[r], _mm256_set1_epi32(xs[r * ng + sb * 16 + g]));
                    is[r] = add32(is[r], _mm256_mullo_epi32(t32, sv));
                }
            }
}
#else
/* the same integers without vpdpbusd: sum_g sc_g * (q_w . q_x)_g less 32 sum_g sc_g * sum(q_x)_g. Read in place,
 * the products are summed two words at a time in int16 (at most 2 * 2 * 63 * 127 = 32004), then times the group's
 * scale (in both int16 of a lane) by vpmaddwd; the offset's part comes from pairs of scales by pairs of x's sums
 * (xs2), 8 vpmaddwd a super-block; no vpmulld. Up to two rows, each word's four outputs at once (fewer loads and
 * decodes a product). Expanded (xp), a group's int16 sums start from -32 times x's (xs: q6k_offsets'), so they
 * end at (q - 32) . x, all four words of it: one vpmaddwd a group, and none for the offset. Each partial sum is 8
 * terms of (q - 32) x or -32 x, at most 32 * 127 each: within int16 (32,512) at every step. */
static inline __attribute__((always_inline)) void q6k_sums(int xp, int rt, int64_t K, const uint8_t *b, const uint8_t *ex, int64_t sb,
                                                           const int8_t *qx, const int32_t *xs, const int32_t *xs2, __m256i *is,
                                                           const uint8_t *pf, int pfi, int pfn) {
    const int64_t ng = K / 16;
    __m256i scb[24] __attribute__((aligned(32)));
    const __m256i *sc16 = scb, *pairs = scb + 16;  /* q6k_scales16's: the scales from ex's where xp */
    if (xp) sc16 = (const __m256i *)(ex + 2048);
    else q6k_scales16(b, scb, 1);
    __asm__("" ::"r"(scb) : "memory");  /* in memory: the registers hold the sums (one load a vpmaddwd) */
    const int8_t *xb = qx + sb * QK;
    if (xp) {  /* the words decoded already: each a load */
        __m256i p[RTA];
        for (int r = 0; r < rt; r++) is[r] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int h = 0; h < 2; h++)
            #pragma GCC unroll 8
            for (int t = 0; t < 4; t++)
                #pragma GCC unroll 8
                for (int jj = 0; jj < 2; jj++) {  /* group 8h + 2t + jj: words 4jj .. 4jj + 3 */
                    const int g = 8 * h + 2 * t + jj;
                    for (int r = 0; r < rt; r++) p[r] = _mm256_set1_epi32(xs[r * ng + sb * 16 + g]);
                    #pragma GCC unroll 8
                    for (int j = 4 * jj; j < 4 * jj + 4; j++) {
                        const __m256i v = q6k_word_at(1, b, ex, h, t, j);
                        for (int r = 0; r < rt; r++) p[r] = add_maddubs(p[r], v, xb + r * K + 128 * h + 32 * t + 4 * j);
                    }
                    for (int r = 0; r < rt; r++) is[r] = madd_acc(is[r], p[r], sc16[g]);
                }
        return;
    }
    for (int r = 0; r < rt; r++) {
        /* scales 2k, 2k + 1 as the two int16 of a lane, by x's sums of the two */
        const __m256i off = pairs_dot(pairs, 32, xs2 + r * (ng / 2) + sb * 8, 8);
        is[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5));
    }
    if (rt <= 2) {
        #pragma GCC unroll 8
        for (int h = 0; h < 2; h++)
            #pragma GCC unroll 8
            for (int jj = 0; jj < 2; jj++)
                #pragma GCC unroll 8
                for (int e = 0; e < 2; e++) {  /* words j = 4jj + 2e and the next of groups 8h + 2t + jj */
                    if (pf) prefetch_part(pf, NP * 210, 8 * pfi + 4 * h + 2 * jj + e, 8 * pfn);
                    __m256i p[4][2];
                    #pragma GCC unroll 8
                    for (int t = 0; t < 4; t++)
                        for (int r = 0; r < rt; r++) p[t][r] = _mm256_setzero_si256();
                    #pragma GCC unroll 8
                    for (int j = 4 * jj + 2 * e; j < 4 * jj + 2 * e + 2; j++) {
                        const __m256i lo = _mm256_loadu_si256((const __m256i *)(b + (16 * h + j) * 64));
                        const __m256i lo32 = _mm256_loadu_si256((const __m256i *)(b + (16 * h + 8 + j) * 64));
                        const __m256i hi = _mm256_loadu_si256((const __m256i *)(b + (32 + 8 * h + j) * 64));
                        #pragma GCC unroll 8
                        for (int t = 0; t < 4; t++) {
                            const __m256i v = q6k_word8(lo, lo32, hi, t);
                            for (int r = 0; r < rt; r++)
                                p[t][r] = add_maddubs(p[t][r], v, xb + r * K + 128 * h + 32 * t + 4 * j);
                        }
                    }
                    #pragma GCC unroll 8
                    for (int t = 0; t < 4; t++)
                        for (int r = 0; r < rt; r++) is[r] = madd_acc(is[r], p[t][r], sc16[8 * h + 2 * t + jj]);
                }
        return;
    }
    __m256i p[2][RTA];  /* words t and t + 2 at once: they share ql's word (its two nibbles) and qh's */
    #pragma GCC unroll 8
    for (int h = 0; h < 2; h++)
        #pragma GCC unroll 8
        for (int t = 0; t < 2; t++)
            #pragma GCC unroll 8
            for (int jj = 0; jj < 2; jj++)
                #pragma GCC unroll 8
                for (int e = 0; e < 2; e++) {
                    if (pf) prefetch_part(pf, NP * 210, 16 * pfi + 8 * h + 4 * t + 2 * jj + e, 16 * pfn);
                    for (int r = 0; r < rt; r++) p[0][r] = p[1][r] = _mm256_setzero_si256();
                    #pragma GCC unroll 8
                    for (int j = 4 * jj + 2 * e; j < 4 * jj + 2 * e + 2; j++) {
                        const __m256i l = _mm256_loadu_si256((const __m256i *)(b + (16 * h + 8 * t + j) * 64));
                        const __m256i hi = _mm256_loadu_si256((const __m256i *)(b + (32 + 8 * h + j) * 64));
                        const __m256i v0 = q6k_word8(l, l, hi, t), v2 = q6k_word8(l, l, hi, t + 2);
                        for (int r = 0; r < rt; r++) {
                            p[0][r] = add_maddubs(p[0][r], v0, xb + r * K + 128 * h + 32 * t + 4 * j);
                            p[1][r] = add_maddubs(p[1][r], v2, xb + r * K + 128 * h + 32 * (t + 2) + 4 * j);
                        }
                    }
                    for (int r = 0; r < rt; r++) {
                        is[r] = madd_acc(is[r], p[0][r], sc16[8 * h + 2 * t + jj]);
                        is[r] = madd_acc(is[r], p[1][r], sc16[8 * h + 2 * (t + 2) + jj]);
                    }
                }
}
#endif

/* the same for half hf of a repacked Q6_K panel: packed_q6k of AVX-512 (its words from ex where not NULL:
 * expand_panel's) */
static inline __attribute__((always_inline)) void half_q6k(int xp, int rt, int64_t K, const uint8_t *pb, const uint8_t *ex, int hf0, int nh,
                                                           const int8_t *qx, const int32_t *xs, const int32_t *xs2,
                                                           const float *dx, float *y, int64_t ldy) {
    const int64_t nsb = K / QK;
    float accms[2][RTA * 8] __attribute__((aligned(32)));
    __m256i is[RTA];
    for (int hh = 0; hh < nh; hh++)
        for (int r = 0; r < rt; r++) _mm256_store_ps(accms[hh] + r * 8, _mm256_setzero_ps());
    for (int64_t sb = 0; sb < nsb; sb++)
    for (int hh = 0; hh < nh; hh++) {
        const int hf = hf0 + hh;
        float *accm = accms[hh];
        /* vectors 0-31: ql's words (half h: 16h ..), 32-47 qh's (half h: 32 + 8h ..), 48-51 the scales; then d */
        const uint8_t *b = pb + sb * NP * 210;
        q6k_sums(xp, rt, K, b + 32 * hf, xp ? ex + (hf * nsb + sb) * xp_stride(P_Q6_K) : NULL, sb, qx, xs, xs2, is,
                 !hf0 && !xp ? b : NULL, hh, nh);
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 52 * 64 + 16 * hf)));
        for (int r = 0; r < rt; r++) {
            const __m256 dxv = _mm256_set1_ps(dx[r * nsb + sb]);
            _mm256_store_ps(accm + r * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(dv, dxv), _mm256_load_ps(accm + r * 8)));
        }
    }
    for (int hh = 0; hh < nh; hh++)
        for (int r = 0; r < rt; r++) _mm256_storeu_ps(y + r * ldy + 8 * (hf0 + hh), _mm256_load_ps(accms[hh] + r * 8));
}

/* word j (0-7) of block h of a paired type's pair, half hf (8 rows), as q32_word reads it (Q8_0: q + 128; IQ4_NL:
 * its values + 128) */
static inline __attribute__((always_inline)) __m256i q32_word8(int type, const uint8_t *pair, int hf, int h, int j) {
    if (type == Q8_0) return _mm256_loadu_si256((const __m256i *)(pair + (1 + 8 * h + j) * 64 + 32 * hf));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(pair + (nibble_vec(type) + 4 * h + (j & 3)) * 64 + 32 * hf));
    const __m256i nib = _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
    if (type == IQ4_NL) return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(iq4nl_table()), nib);
    if (!has_fifth(type)) return nib;
    /* the fifth bits: bit 4c + i of the 32 bits of this half's mask j is byte 4c + i's; 16 where it is set */
    const __m256i m = _mm256_shuffle_epi8(bcast4(pair + (fifth_vec(type) + h) * 64 + 8 * j + 4 * hf),
                                          _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(m, bit), bit);
    return _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

/* a paired type's panel's words as q32_word8 reads them into ex (K * 16 bytes: word j of block g at (8 g + j) 64,
 * both halves), once for every tile of rows of a large call: the nibbles, fifth bits and IQ4_NL's values looked up
 * once; the same bits */
static void expand_q32(int type, const uint8_t *pb, int64_t K, uint8_t *ex) {
    const int pair_bytes = 32 * block_bytes_any(type);
    for (int64_t g = 0; g < K / 32; g++)
        for (int hf = 0; hf < 2; hf++)
            for (int j = 0; j < 8; j++)
                _mm256_store_si256((__m256i *)(ex + (8 * g + j) * 64 + 32 * hf), q32_word8(type, pb + (g / 2) * pair_bytes, hf, g % 2, j));
}

/* word j of block h of the pair (block g of the panel), half hf: from ex where xp (expand_q32), else decoded */
static inline __attribute__((always_inline)) __m256i q32_word_at(int type, int xp, const uint8_t *pair, const uint8_t *ex,
                                                                 int64_t g, int hf, int h, int j) {
    if (xp) return _mm256_load_si256((const __m256i *)(ex + (8 * g + j) * 64 + 32 * hf));
    return q32_word8(type, pair, hf, h, j);
}

/* the same for halves hf0 .. hf0 + nh - 1 of a repacked panel of a paired type (the file's): packed_q32 of AVX-512
 * (nh 2: both halves in one pass, packed_rows) */
static inline __attribute__((always_inline)) void half_q32(int type, int xp, int rt, int64_t K, const uint8_t *pb, int hf0, int nh,
                                                           const uint8_t *ex, const int8_t *qx, const int32_t *xs,
                                                           const float *dx, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    const int pair_bytes = 32 * block_bytes_any(type);
#ifdef __AVXVNNI__
    const int signs = 0;  /* vpdpbusd takes Q8_0's q + 128 whole */
#else
    const int signs = type == Q8_0 || type == IQ4_NL;  /* |q| . sign(x, q): vpmaddubsw's pairs stay under 2^15 */
#endif
    __m256 accs[2][RTA];
    for (int hh = 0; hh < nh; hh++)
        for (int r = 0; r < rt; r++) accs[hh][r] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < nb; g0 += 2) {
        const uint8_t *pair = pb + (g0 / 2) * pair_bytes;
        for (int h = 0; h < 2; h++)
        for (int hh = 0; hh < nh; hh++) {
            const int hf = hf0 + hh;
            if (!hf0 && !xp) prefetch_part(pair, pair_bytes, nh * h + hh, 2 * nh);
            __m256 *acc = accs[hh];
            const int64_t g = g0 + h;
            const int split = rt <= 2 ? 2 : 1;
            __m256i a[2][RTA];
            for (int e = 0; e < split; e++)
                for (int r = 0; r < rt; r++) a[e][r] = _mm256_setzero_si256();
#ifndef __AVXVNNI__
            if (type != Q8_0 && type != IQ4_NL) {  /* four words' pairs summed in int16 (at most 4 * 2 * 31 * 127 = 31496) */
                for (int w0 = 0; w0 < 8; w0 += 4) {
                    __m256i p[RTA];
                    for (int r = 0; r < rt; r++) p[r] = _mm256_setzero_si256();
                    for (int j = w0; j < w0 + 4; j++) {
                        const __m256i v = q32_word_at(type, xp, pair, ex, g, hf, h, j);
                        for (int r = 0; r < rt; r++) p[r] = add_maddubs(p[r], v, qx + r * K + g * 32 + 4 * j);
                    }
                    for (int r = 0; r < rt; r++) a[0][r] = add32(a[0][r], _mm256_madd_epi16(p[r], _mm256_set1_epi16(1)));
                }
            }
            for (int j = 0; j < 8 && (type == Q8_0 || type == IQ4_NL); j++) {
#else
            for (int j = 0; j < 8; j++) {
#endif
                __m256i v = q32_word_at(type, xp, pair, ex, g, hf, h, j);
                if (signs) {
                    const __m256i q = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
                    v = _mm256_abs_epi8(q);
                    for (int r = 0; r < rt; r++)
                        a[j % split][r] = dp8(a[j % split][r], v, _mm256_sign_epi8(bcast4(qx + r * K + g * 32 + 4 * j), q));
                } else {
                    for (int r = 0; r < rt; r++) a[j % split][r] = dp8(a[j % split][r], v, bcast4(qx + r * K + g * 32 + 4 * j));
                }
            }
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pair + 32 * h + 16 * hf)));
            const __m256 mv = has_min(type) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pair + 64 + 32 * h + 16 * hf))) : dv;
            for (int r = 0; r < rt; r++) {
                const __m256i s = split == 2 ? _mm256_add_epi32(a[0][r], a[1][r]) : a[0][r];
                const __m256i t = signs || has_min(type) ? s : _mm256_sub_epi32(s, _mm256_set1_epi32(xs[r * nb + g]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * nb + g])), acc[r]);
                if (has_min(type)) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(dx[r * nb + g] * (float)xs[r * nb + g]), acc[r]);
            }
        }
    }
    for (int hh = 0; hh < nh; hh++)
        for (int r = 0; r < rt; r++) _mm256_storeu_ps(y + r * ldy + 8 * (hf0 + hh), accs[hh][r]);
}

#ifndef __AVXVNNI__
/* half_q32's sums without AVX-VNNI for the paired types' expanded words (expand_q32: Q4_0, Q4_1, Q5_0, Q5_1,
 * IQ4_NL), both halves of the panel in one pass: each broadcast of x's 4 bytes meets the 16 columns, where a pass a
 * half broadcast it twice (a broadcast is a vector operation on Zen 3, and these tiles are held by the count of
 * vector operations: about 4 a vpmaddubsw, llvm-mca's four FP pipes full). The unsigned values' words are summed in
 * int16, all 8 of a block for the nibbles (at most 16 * 15 * 127 = 30480 a lane), 4 at a time with the fifth bit
 * (31496), so the nibbles take one vpmaddwd a block where half_q32 takes two; IQ4_NL's signed values take a vpmaddwd
 * a word (|q| . sign(x, q), as half_q32). (Q8_0's words, read in place, took 1.04x the time this way at 128 rows:
 * not used.) The float sums stay in memory (the registers hold the 2 * rt integer sums); each takes the same integer
 * and the same float operations in the same order as in half_q32: the same bits */
static inline __attribute__((always_inline)) void both_q32(int type, int rt, int64_t K, const uint8_t *pb,
                                                           const uint8_t *ex, const int8_t *qx, const int32_t *xs,
                                                           const float *dx, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    const int pair_bytes = 32 * block_bytes_any(type), run = has_fifth(type) ? 4 : 8;
    const int signs = type == IQ4_NL;
    float accs[2][RTA * 8] __attribute__((aligned(32)));
    for (int hf = 0; hf < 2; hf++)
        for (int r = 0; r < rt; r++) _mm256_store_ps(accs[hf] + r * 8, _mm256_setzero_ps());
    __asm__("" ::"r"(accs) : "memory");  /* in memory: the registers hold the integer sums */
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *pair = pb + (g / 2) * pair_bytes;
        const int h = g % 2;
        __m256i a[2][RTA];
        if (signs) {
            for (int hf = 0; hf < 2; hf++)
                for (int r = 0; r < rt; r++) a[hf][r] = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256i q0 = _mm256_xor_si256(q32_word_at(type, 1, pair, ex, g, 0, h, j), _mm256_set1_epi8((char)0x80));
                const __m256i q1 = _mm256_xor_si256(q32_word_at(type, 1, pair, ex, g, 1, h, j), _mm256_set1_epi8((char)0x80));
                const __m256i u0 = _mm256_abs_epi8(q0), u1 = _mm256_abs_epi8(q1);
                for (int r = 0; r < rt; r++) {
                    const __m256i x = bcast4(qx + r * K + g * 32 + 4 * j);
                    a[0][r] = dp8(a[0][r], u0, _mm256_sign_epi8(x, q0));
                    a[1][r] = dp8(a[1][r], u1, _mm256_sign_epi8(x, q1));
                }
            }
        } else {
            for (int w0 = 0; w0 < 8; w0 += run) {
                __m256i p[2][RTA];
                for (int hf = 0; hf < 2; hf++)
                    for (int r = 0; r < rt; r++) p[hf][r] = _mm256_setzero_si256();
                #pragma GCC unroll 8
                for (int j = w0; j < w0 + run; j++) {
                    const __m256i v0 = q32_word_at(type, 1, pair, ex, g, 0, h, j);
                    const __m256i v1 = q32_word_at(type, 1, pair, ex, g, 1, h, j);
                    for (int r = 0; r < rt; r++) {
                        const __m256i x = bcast4(qx + r * K + g * 32 + 4 * j);
                        p[0][r] = _mm256_add_epi16(p[0][r], _mm256_maddubs_epi16(v0, x));
                        p[1][r] = _mm256_add_epi16(p[1][r], _mm256_maddubs_epi16(v1, x));
                        __asm__("" : "+x"(p[0][r]), "+x"(p[1][r]));  /* chains (add_maddubs) */
                    }
                }
                for (int hf = 0; hf < 2; hf++)
                    for (int r = 0; r < rt; r++) {
                        const __m256i s = _mm256_madd_epi16(p[hf][r], _mm256_set1_epi16(1));
                        a[hf][r] = w0 ? add32(a[hf][r], s) : s;
                    }
            }
        }
        for (int hf = 0; hf < 2; hf++) {
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pair + 32 * h + 16 * hf)));
            const __m256 mv = has_min(type) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pair + 64 + 32 * h + 16 * hf))) : dv;
            for (int r = 0; r < rt; r++) {
                const __m256i t = signs || has_min(type) ? a[hf][r] : _mm256_sub_epi32(a[hf][r], _mm256_set1_epi32(xs[r * nb + g]));
                __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * nb + g])),
                                             _mm256_load_ps(accs[hf] + r * 8));
                if (has_min(type)) acc = _mm256_fmadd_ps(mv, _mm256_set1_ps(dx[r * nb + g] * (float)xs[r * nb + g]), acc);
                _mm256_store_ps(accs[hf] + r * 8, acc);
            }
        }
    }
    for (int hf = 0; hf < 2; hf++)
        for (int r = 0; r < rt; r++) _mm256_storeu_ps(y + r * ldy + 8 * hf, _mm256_load_ps(accs[hf] + r * 8));
}
#endif

/* half hf of a repacked IQ4_XS panel as packed_iq4xs of AVX-512 computes it. With AVX-VNNI the values + 128 (vpdpbusd)
 * less 128 sum(q_x); without, the signed values with their signs moved onto x (vpmaddubsw pairs of at most
 * 2 * 127 * 127): the same integer per sub-block */
static inline __attribute__((always_inline)) __m256i iq4_table8(void) {
#ifdef __AVXVNNI__
    return _mm256_broadcastsi128_si256(iq4nl_table());  /* the values + 128, for vpdpbusd */
#else
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));  /* signed, signs onto x */
#endif
}

/* an IQ4_XS sub-block's scale (its low 4 and high 2 bits, lo4 and hi2) less 32: with AVX-VNNI as int32 (vpmulld of
 * the sub-block's sum), else in both int16 of each lane, the factor of the vpmaddwd that sums each word's pairs (a
 * lane at most 2 * 2 * 127 * 127 * 32: the same integer as the sub-block's sum times the scale, one vpmulld fewer) */
static inline __attribute__((always_inline)) __m256i iq4xs_scale8(__m256i lo4, __m256i hi2) {
    const __m256i sv = _mm256_sub_epi32(_mm256_or_si256(lo4, _mm256_slli_epi32(hi2, 4)), _mm256_set1_epi32(32));
#ifdef __AVXVNNI__
    return sv;
#else
    return _mm256_or_si256(_mm256_and_si256(sv, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sv, 16));
#endif
}

/* where xp, the words' values and the sub-blocks' scales come from ex (expand_iq4xs: word j of sub-block s of
 * super-block sb, low then high nibbles, at vectors ((8 sb + s) 4 + j) 2 + 0 / 1, then the scales as iq4xs_scale8
 * gives them) */
static inline __attribute__((always_inline)) void half_iq4xs(int xp, int rt, int64_t K, const uint8_t *pb, int hf0, int nh,
                                                             const uint8_t *ex, const int8_t *qx, const int32_t *xs,
                                                             const float *dx, float *y, int64_t ldy) {
    const int64_t nsb = K / QK, ng = K / 32;
    (void)ng, (void)xs;  /* without AVX-VNNI no offset comes off */
    const __m256i m4 = _mm256_set1_epi8(0x0F), table = iq4_table8();
    __m256 accs[2][RTA];
    for (int hh = 0; hh < nh; hh++)
        for (int r = 0; r < rt; r++) accs[hh][r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++)
    for (int hh = 0; hh < nh; hh++) {
        const int hf = hf0 + hh;
        __m256 *acc = accs[hh];
        const uint8_t *b = pb + sb * NP * 136 + 32 * hf;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)b), w1 = _mm256_loadu_si256((const __m256i *)(b + 64));
        __m256i is[RTA];
        for (int r = 0; r < rt; r++) is[r] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            if (!hf0 && !xp) prefetch_part(b - 32 * hf, NP * 136, 8 * hh + s, 8 * nh);
            const __m256i lo4 = _mm256_and_si256(_mm256_srli_epi32(w1, 4 * s), _mm256_set1_epi32(15));
            const __m256i hi2 = _mm256_and_si256(_mm256_srli_epi32(w0, 16 + 2 * s), _mm256_set1_epi32(3));
            const __m256i sv = xp ? _mm256_load_si256((const __m256i *)(ex + (size_t)K * 16 + (sb * 8 + s) * 64 + 32 * hf))
                                  : iq4xs_scale8(lo4, hi2);
            const int8_t *xc = qx + sb * QK + 32 * s;
#ifdef __AVXVNNI__
            __m256i a[2][RTA];
            for (int r = 0; r < rt; r++) a[0][r] = a[1][r] = _mm256_setzero_si256();
#endif
            for (int j = 0; j < 4; j++) {
                __m256i lo, hi;
                if (xp) {
                    const uint8_t *e = ex + (((sb * 8 + s) * 4 + j) * 2) * 64 + 32 * hf;
                    lo = _mm256_load_si256((const __m256i *)e), hi = _mm256_load_si256((const __m256i *)(e + 64));
                } else {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(b + (2 + 4 * s + j) * 64));
                    lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, m4));
                    hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                }
                for (int r = 0; r < rt; r++) {
#ifdef __AVXVNNI__
                    a[0][r] = dp8(a[0][r], lo, bcast4(xc + r * K + 4 * j));
                    a[1][r] = dp8(a[1][r], hi, bcast4(xc + r * K + 16 + 4 * j));
#else  /* each word's pairs times the scale (sv: in both int16 of a lane) by the vpmaddwd that sums them */
                    is[r] = madd_acc(is[r], _mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(bcast4(xc + r * K + 4 * j), lo)), sv);
                    is[r] = madd_acc(is[r], _mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(bcast4(xc + r * K + 16 + 4 * j), hi)), sv);
#endif
                }
            }
#ifdef __AVXVNNI__
            for (int r = 0; r < rt; r++) {
                const __m256i t = _mm256_sub_epi32(_mm256_add_epi32(a[0][r], a[1][r]), _mm256_set1_epi32(xs[r * ng + sb * 8 + s]));
                is[r] = add32(is[r], _mm256_mullo_epi32(t, sv));
            }
#endif
        }
        const __m256 dv = f16_lanes(w0, 0);
        for (int r = 0; r < rt; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * nsb + sb])), acc[r]);
    }
    for (int hh = 0; hh < nh; hh++)
        for (int r = 0; r < rt; r++) _mm256_storeu_ps(y + r * ldy + 8 * (hf0 + hh), accs[hh][r]);
}

/* half hf of a repacked Q3_K (q3) or Q2_K panel as packed_k23 of AVX-512 computes it (without VNNI a group's 4 words'
 * vpmaddubsw pairs summed in int16: at most 4 * 2 * 7 * 127 = 7112) */
static inline __attribute__((always_inline)) __m256i q3k_scale8(const __m256i s0, const __m256i s1, const __m256i s2, int g) {
    const __m256i lo = _mm256_srli_epi32(g % 8 < 4 ? s0 : s1, 8 * (g % 4) + 4 * (g / 8));
    const __m256i hi = _mm256_srli_epi32(s2, 8 * (g % 4) + 2 * (g / 4));
    const __m256i sc = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)),
                                       _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
    return _mm256_sub_epi32(sc, _mm256_set1_epi32(32));
}

/* word w of group g's half (half) of a Q3_K (q3) or Q2_K super-block's half b (8 rows), its values 0-7 (0-3): the two
 * low bits at bit 2j of qw's word, and Q3_K's high bit (bit 4h + j of each byte of hv) moved to bit 2 of its byte by
 * one shift; h = g / 8, j = (g % 8) / 2, half = g % 2 (k23_group reads it in place, expand_k23 once a panel) */
static inline __attribute__((always_inline)) __m256i k23_word8(int q3, const uint8_t *b, int h, int j, int half, int w) {
    const int qw = q3 ? 8 : 4;
    const __m256i qv = _mm256_loadu_si256((const __m256i *)(b + (qw + 8 * h + 4 * half + w) * 64));
    const __m256i u = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * j), _mm256_set1_epi8(3));
    if (!q3) return u;
    const __m256i hv = _mm256_loadu_si256((const __m256i *)(b + (4 * half + w) * 64));
    const int at = 4 * h + j;
    const __m256i hb = at >= 2 ? _mm256_srli_epi16(hv, at - 2) : _mm256_slli_epi16(hv, 2 - at);
    return _mm256_or_si256(u, _mm256_and_si256(hb, _mm256_set1_epi8(4)));
}

/* group g (16 elements) of super-block sb of half_k23's half hf (b: its bytes; s0-s2 Q3_K's scales): into is[r] its
 * integer sum times its scale, and Q2_K's mins' part into ms[r] (read in place) */
static inline __attribute__((always_inline)) void k23_group(int q3, int xp, int rt, int g, int64_t K, int64_t sb, int hf, int hh,
                                                            int hf0, int nh, const uint8_t *b, const uint8_t *ex, const int8_t *qx,
                                                            const int32_t *xs, __m256i s0, __m256i s1, __m256i s2, __m256i *is,
                                                            __m256i *ms) {
    const int64_t ng = K / 16;
    const int bytes = q3 ? 110 : 84;
    const __m256i m4 = _mm256_set1_epi32(15), zero = _mm256_setzero_si256();
    if (!hf0 && !xp) prefetch_part(b - 32 * hf, NP * bytes, 16 * hh + g, 16 * nh);
    const int h = g / 8, j = (g % 8) / 2, half = g % 2;
    const int8_t *xc = qx + sb * QK + 16 * g;
    /* where xp, from expand_k23's layout (ex): this group's words and scale, this half's lanes */
    const uint8_t *eg = ex + (sb * 16 + g) * 4 * 64 + 32 * hf;
    const __m256i sm = q3 || xp ? zero : _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(b + (g / 4) * 64)), 8 * (g % 4));
    const __m256i sv = xp ? _mm256_load_si256((const __m256i *)(ex + (size_t)K * 16 + (sb * 16 + g) * 64 + 32 * hf))
                          : q3 ? q3k_scale8(s0, s1, s2, g) : _mm256_and_si256(sm, m4);
    const __m256i mv = xp ? zero : _mm256_and_si256(_mm256_srli_epi32(sm, 4), m4);
    const __m256i sv16 = q3 && !xp ? _mm256_and_si256(sv, _mm256_set1_epi32(0xFFFF)) : sv;  /* Q3_K's may be < 0 */
    __m256i a[RTA];
    for (int r = 0; r < rt; r++) a[r] = _mm256_setzero_si256();
    for (int w = 0; w < 4; w++) {
        const __m256i u = xp ? _mm256_load_si256((const __m256i *)(eg + w * 64)) : k23_word8(q3, b, h, j, half, w);
        for (int r = 0; r < rt; r++) {
#ifdef __AVXVNNI__
            a[r] = dp8(a[r], u, bcast4(xc + r * K + 4 * w));
#else
            a[r] = add_maddubs(a[r], u, xc + r * K + 4 * w);  /* int16 pairs, summed as int16 */
#endif
        }
    }
    for (int r = 0; r < rt; r++) {
        if (xp) {  /* times the scale by one madd_acc (expand_k23's form); the offset's part after the groups */
            is[r] = madd_acc(is[r], a[r], sv);
            continue;
        }
#ifndef __AVXVNNI__
        a[r] = _mm256_madd_epi16(a[r], _mm256_set1_epi16(1));
#endif
        /* each int32 here fits in its low int16 (at most 16 * 7 * 127 + 4 * 16 * 127): vpmaddwd by a factor in
         * the low int16 of a lane (the high one 0) is vpmulld's product; with the add, madd_acc (one vpdpwssd
         * with AVX-VNNI) */
        const __m256i xsv = _mm256_set1_epi32(xs[r * ng + sb * 16 + g]);
        is[r] = madd_acc(is[r], q3 ? _mm256_sub_epi32(a[r], xsv) : a[r], sv16);
        if (!q3) ms[r] = madd_acc(ms[r], xsv, mv);
    }
}

static inline __attribute__((always_inline)) void half_k23(int q3, int xp, int rt, int64_t K, const uint8_t *pb, int hf0, int nh,
                                                           const uint8_t *ex, const int8_t *qx, const int32_t *xs,
                                                           const int32_t *xs2, const float *dx, float *y, int64_t ldy) {
    const int64_t nsb = K / QK, ng = K / 16;
    const int bytes = q3 ? 110 : 84;
    const __m256i zero = _mm256_setzero_si256();
    __m256 accs[2][RTA];
    for (int hh = 0; hh < nh; hh++)
        for (int r = 0; r < rt; r++) accs[hh][r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++)
    for (int hh = 0; hh < nh; hh++) {
        const int hf = hf0 + hh;
        __m256 *acc = accs[hh];
        const uint8_t *b = pb + sb * NP * bytes + 32 * hf;
        const __m256i s0 = q3 && !xp ? _mm256_loadu_si256((const __m256i *)(b + 24 * 64)) : zero;
        const __m256i s1 = q3 && !xp ? _mm256_loadu_si256((const __m256i *)(b + 25 * 64)) : zero;
        const __m256i s2 = q3 && !xp ? _mm256_loadu_si256((const __m256i *)(b + 26 * 64)) : zero;
        __m256i is[RTA], ms[RTA];
        for (int r = 0; r < rt; r++) is[r] = ms[r] = _mm256_setzero_si256();
        if (rt <= 2 && !xp) {  /* a decode step: the groups unrolled, their shifts constants (Q2_K's 1.5B at one row:
                                 * 0.9x the time); for more rows, or expanded, the loop (1.2-1.5x the time unrolled) */
            #pragma GCC unroll 16
            for (int g = 0; g < 16; g++) k23_group(q3, xp, rt, g, K, sb, hf, hh, hf0, nh, b, ex, qx, xs, s0, s1, s2, is, ms);
        } else {
            for (int g = 0; g < 16; g++) k23_group(q3, xp, rt, g, K, sb, hf, hh, hf0, nh, b, ex, qx, xs, s0, s1, s2, is, ms);
        }
        if (xp) {  /* Q2_K's mins, or Q3_K's scales for its offset of 4, times x's sums per 16: two groups a madd_acc */
            const uint8_t *pairs = ex + (size_t)K * 20 + sb * 8 * 64 + 32 * hf;
            for (int r = 0; r < rt; r++) {
                const __m256i t = pairs_dot(pairs, 64, xs2 + r * (ng / 2) + sb * 8, 8);
                if (q3) is[r] = _mm256_sub_epi32(is[r], _mm256_slli_epi32(t, 2));
                else ms[r] = t;
            }
        }
        const __m256i w20 = q3 ? zero : _mm256_loadu_si256((const __m256i *)(b + 20 * 64));
        const __m256 dv = q3 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b - 32 * hf + 27 * 64 + 16 * hf)))
                             : f16_lanes(w20, 0);
        const __m256 dminv = f16_lanes(w20, 1);
        for (int r = 0; r < rt; r++) {
            const __m256 dxv = _mm256_set1_ps(dx[r * nsb + sb]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(dv, dxv), acc[r]);
            if (!q3) acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms[r]), _mm256_mul_ps(dminv, dxv), acc[r]);
        }
    }
    for (int hh = 0; hh < nh; hh++)
        for (int r = 0; r < rt; r++) _mm256_storeu_ps(y + r * ldy + 8 * (hf0 + hh), accs[hh][r]);
}

/* a repacked IQ4_XS panel's values (as half_iq4xs looks them up) and sub-block scales into ex (K * 18 bytes), once for
 * every tile of rows of a large call: the same bits */
static void expand_iq4xs(const uint8_t *pb, int64_t K, uint8_t *ex) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), table = iq4_table8();
    for (int64_t sb = 0; sb < K / QK; sb++)
        for (int hf = 0; hf < 2; hf++) {
            const uint8_t *b = pb + sb * NP * 136 + 32 * hf;
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)b), w1 = _mm256_loadu_si256((const __m256i *)(b + 64));
            for (int s = 0; s < 8; s++) {
                const __m256i lo4 = _mm256_and_si256(_mm256_srli_epi32(w1, 4 * s), _mm256_set1_epi32(15));
                const __m256i hi2 = _mm256_and_si256(_mm256_srli_epi32(w0, 16 + 2 * s), _mm256_set1_epi32(3));
                _mm256_store_si256((__m256i *)(ex + (size_t)K * 16 + (sb * 8 + s) * 64 + 32 * hf), iq4xs_scale8(lo4, hi2));
                for (int j = 0; j < 4; j++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(b + (2 + 4 * s + j) * 64));
                    uint8_t *e = ex + (((sb * 8 + s) * 4 + j) * 2) * 64 + 32 * hf;
                    _mm256_store_si256((__m256i *)e, _mm256_shuffle_epi8(table, _mm256_and_si256(v, m4)));
                    _mm256_store_si256((__m256i *)(e + 64), _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)));
                }
            }
        }
}

/* a Q3_K's or Q2_K's words into ex as AVX-512's expand_k23 lays them (K * 16 bytes, both halves), then the groups'
 * scales in vpmaddwd's form (K * 4) and pairs of groups' Q2_K mins or Q3_K scales as two int16 (K * 2) */
static void expand_k23(int q3, const uint8_t *pb, int64_t K, uint8_t *ex) {
    const int bytes = q3 ? 110 : 84;
    const __m256i m4 = _mm256_set1_epi32(15);
    for (int64_t sb = 0; sb < K / QK; sb++)
        for (int hf = 0; hf < 2; hf++) {
            const uint8_t *b = pb + sb * NP * bytes + 32 * hf;
            const __m256i s0 = _mm256_loadu_si256((const __m256i *)(b + (q3 ? 24 : 0) * 64));
            const __m256i s1 = _mm256_loadu_si256((const __m256i *)(b + (q3 ? 25 : 0) * 64));
            const __m256i s2 = _mm256_loadu_si256((const __m256i *)(b + (q3 ? 26 : 0) * 64));
            for (int g = 0; g < 16; g++) {
                const int h = g / 8, j = (g % 8) / 2, half = g % 2;
                const __m256i sm = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(b + (q3 ? 0 : g / 4) * 64)), 8 * (g % 4));
                uint8_t *e = ex + (sb * 16 + g) * 64 + 32 * hf;
                const __m256i sv = q3 ? q3k_scale8(s0, s1, s2, g) : _mm256_and_si256(sm, m4);
                /* the pairs' word: Q2_K's min, or Q3_K's scale, of group g as int16 g % 2 of word g / 2 */
                const __m256i pv = q3 ? sv : _mm256_and_si256(_mm256_srli_epi32(sm, 4), m4);
                __m256i *pair = (__m256i *)(ex + (size_t)K * 20 + (sb * 8 + g / 2) * 64 + 32 * hf);
                if (g % 2 == 0) _mm256_store_si256(pair, _mm256_and_si256(pv, _mm256_set1_epi32(0xFFFF)));
                else _mm256_store_si256(pair, _mm256_or_si256(_mm256_load_si256(pair), _mm256_slli_epi32(pv, 16)));
                /* the scale for vpmaddwd: with VNNI a group's int32 sum fits in its low int16 (at most 16 * 7 * 127),
                 * so the scale is that int16's and the high one's is 0; without, in both int16 of the lane (the
                 * int16 pairs of vpmaddubsw) */
                const __m256i lo16 = _mm256_and_si256(sv, _mm256_set1_epi32(0xFFFF));
#ifdef __AVXVNNI__
                _mm256_store_si256((__m256i *)(e + (size_t)K * 16), lo16);
#else
                _mm256_store_si256((__m256i *)(e + (size_t)K * 16), _mm256_or_si256(lo16, _mm256_slli_epi32(sv, 16)));
#endif
                for (int w = 0; w < 4; w++)
                    _mm256_store_si256((__m256i *)(ex + ((sb * 16 + g) * 4 + w) * 64 + 32 * hf), k23_word8(q3, b, h, j, half, w));
            }
        }
}

#ifndef __AVXVNNI__
/* for expanded Q6_K panels without AVX-VNNI (q6k_sums): for each row of x and group of 16, -32 times x's sums of
 * the group's elements 4w and 4w + 1 (w < 4) as the low int16 of an int32, of 4w + 2 and 4w + 3 as the high one,
 * [M, K / 16] as group_sums' xs (each at most 32 * 8 * 127 in magnitude: x's bytes are within +-127, as the
 * quantizer writes them; a -128 would wrap); NULL when memory ran out */
static int32_t *q6k_offsets(const int8_t *qx, int64_t M, int64_t K) {
    int32_t *xc = malloc(M * K / 16 * sizeof(int32_t) + 64);
    if (!xc) return NULL;
    for (int64_t i = 0; i < M * K / 32; i++) {  /* two groups a vector (rows are whole groups) */
        const __m256i v = _mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256((const __m256i *)(qx + 32 * i)));
        __m256i t = _mm256_add_epi16(v, _mm256_shuffle_epi32(v, 0x4E));
        t = _mm256_add_epi16(t, _mm256_shuffle_epi32(t, 0xB1));  /* lane 0 of each 128 bits: its 4 lanes' sums */
        t = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(t, 5));
        xc[2 * i] = _mm256_extract_epi32(t, 0), xc[2 * i + 1] = _mm256_extract_epi32(t, 4);
    }
    return xc;
}
#endif

/* rows of x up to this take a panel's two halves in one pass (a decode step, a verification of one draft token):
 * the panel is read once from memory instead of a second time from L2. Each half's lanes take the same operations
 * in the same order either way (the same bits). */
#ifndef BOTH_ROWS
#define BOTH_ROWS 2
#endif

/* rows 0 .. rt - 1 of y (16 columns) against repacked panel pb (a repacked type): its two halves (their words, and
 * the K-quants' and IQ4_XS's scales, from ex where xp: expand_panel's, expand_iq4xs's, expand_k23's or
 * expand_q32's) */
static inline __attribute__((always_inline)) void packed_rows(int type, int xp, int rt, int64_t K, const uint8_t *pb, const uint8_t *ex,
                                                              const int8_t *qx, const int32_t *xs, const int32_t *xs2,
                                                              const float *dx, float *y, int64_t ldy) {
    const int nh = rt <= BOTH_ROWS && !xp ? 2 : 1;  /* halves a pass: both in one, or one each */
#ifndef __AVXVNNI__
    if (xp && (type == P_Q4_0 || type == P_Q4_1 || type == P_Q5_0 || type == P_Q5_1 || type == P_IQ4_NL)) {
        both_q32(base_type(type), rt, K, pb, ex, qx, xs, dx, y, ldy);
        return;
    }
#endif
    for (int hf = 0; hf < 2; hf += nh) {
        if (type == P_Q4_K || type == P_Q5_K) half_q4k(type == P_Q5_K, xp, rt, K, pb, ex, hf, nh, qx, xs2, dx, y, ldy);
        else if (type == P_Q6_K) half_q6k(xp, rt, K, pb, ex, hf, nh, qx, xs, xs2, dx, y, ldy);
        else if (type == P_IQ4_XS) half_iq4xs(xp, rt, K, pb, hf, nh, ex, qx, xs, dx, y, ldy);
        else if (type == P_Q3_K || type == P_Q2_K) half_k23(type == P_Q3_K, xp, rt, K, pb, hf, nh, ex, qx, xs, xs2, dx, y, ldy);
        else half_q32(base_type(type), xp, rt, K, pb, hf, nh, ex, qx, xs, dx, y, ldy);
    }
}

/* more rows of x than this decode each Q4_K / Q5_K / Q6_K panel's words once (expand_panel; IQ4_XS's, Q3_K's,
 * Q2_K's, Q5_0's and Q5_1's their own way) for all their tiles: the same bits */
#ifndef EXPAND_ROWS
#define EXPAND_ROWS 8
#endif

/* the same for Q4_0's, Q4_1's and IQ4_NL's panels (expand_q32) with AVX-VNNI (without it: below). Measured before
 * both_q32, two threads, 1536 x 8960, in place against expanded, avx2 / avx2-vnni: Q4_0 155 / 116 and 182 / 138
 * GMAC/s at 9 rows, 145 / 141 and 183 / 180 at 24, 145 / 145 and 178 / 181 at 32, 139 / 149 and 183 / 195 at 48;
 * IQ4_NL about even to 24 rows, 169 / 188 at 32 with VNNI. Q5_0 and Q5_1 gain from 9 rows: Q5_0 80 / 107 and
 * 115 / 119 at 9, 85 / 131 and 130 / 161 at 16 */
#ifndef Q32_EXPAND_ROWS
#define Q32_EXPAND_ROWS 32
#endif

/* without AVX-VNNI the expanded tiles are both_q32's, which pay from fewer rows. All the 1.5B's linears read in
 * place took, against expanded (alternated, 2026-12-01, Zen 3): a Q4_0 file's 0.91x the time at 9 and 12 rows, 1.10x
 * at 16, 1.14x at 24, 1.20x at 32; an IQ4_NL file's 1.11x at 9, 1.34x at 12, 1.46x at 24, 1.52x at 32 (so
 * EXPAND_ROWS) */
#ifndef Q4_EXPAND_ROWS
#define Q4_EXPAND_ROWS 12
#endif

/* rows of x above which a paired type's panels are expanded (expand_q32): Q8_0's never (its words are bytes) */
static inline int q32_expand_rows(int type) {
#ifndef __AVXVNNI__
    if (type == Q4_0 || type == Q4_1) return Q4_EXPAND_ROWS;
    if (type == IQ4_NL) return EXPAND_ROWS;
#endif
    return has_fifth(type) ? EXPAND_ROWS : Q32_EXPAND_ROWS;
}

/* tiles_T_XP (gguf_panels.h) for every type and XP here: tiles of RTA rows */
#define TILE RTA
#define TILE_CASES(T, XP) TILE_ROWS(T, XP, 4) TILE_ROWS(T, XP, 3) TILE_ROWS(T, XP, 2)
DEFINE_TILES(P_Q4_K, 0) DEFINE_TILES(P_Q4_K, 1) DEFINE_TILES(P_Q5_K, 0) DEFINE_TILES(P_Q5_K, 1)
DEFINE_TILES(P_Q6_K, 0) DEFINE_TILES(P_Q6_K, 1) DEFINE_TILES(P_Q8_0, 0) DEFINE_TILES(P_Q4_0, 0)
DEFINE_TILES(P_Q4_0, 1) DEFINE_TILES(P_Q4_1, 0) DEFINE_TILES(P_Q4_1, 1) DEFINE_TILES(P_Q5_0, 0)
DEFINE_TILES(P_Q5_0, 1) DEFINE_TILES(P_Q5_1, 0) DEFINE_TILES(P_Q5_1, 1) DEFINE_TILES(P_IQ4_NL, 0)
DEFINE_TILES(P_IQ4_NL, 1) DEFINE_TILES(P_IQ4_XS, 0) DEFINE_TILES(P_IQ4_XS, 1) DEFINE_TILES(P_Q3_K, 0)
DEFINE_TILES(P_Q3_K, 1) DEFINE_TILES(P_Q2_K, 0) DEFINE_TILES(P_Q2_K, 1)
#undef TILE_CASES
#undef TILE

/* y = x . W^T for a repacked W (ptype), every row count: tiles of RTA rows of x against each panel */
static int gguf_gemm_q8(int ptype, const int8_t *qx, const float *dx, const int16_t *bsums, const uint8_t *raw,
                        float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    const int type = base_type(ptype);
    const int64_t row_bytes = K / block_elems(ptype) * block_bytes(ptype);
    int32_t *xs2, *xs = group_sums(type, bsums, M, K, &xs2);
    if (!xs) return -2;
    const int k23 = ptype == P_Q3_K || ptype == P_Q2_K;
    /* Q8_0's words are bytes already; Q4_0's, Q4_1's and IQ4_NL's cost two or three instructions each, so with
     * AVX-VNNI their expansion pays from more rows than Q5_0's and Q5_1's (fifth bits): q32_expand_rows */
    const int q32 = paired(type) && type != Q8_0 && M > q32_expand_rows(type);
    const int expands = (ptype == P_Q4_K || ptype == P_Q5_K || ptype == P_Q6_K || ptype == P_IQ4_XS || k23 || q32) && M > EXPAND_ROWS;
    int failed = 0;
    const int32_t *xsa = xs;  /* what the tiles take as xs */
#ifndef __AVXVNNI__
    const int offsets = ptype == P_Q6_K && expands;  /* q6k_sums' expanded tiles take q6k_offsets' table as xs */
    int32_t *xc = offsets ? q6k_offsets(qx, M, K) : NULL;
    if (offsets && !xc) {
        free(xs), free(xs2);
        return -2;
    }
    if (offsets) xsa = xc;
#endif
#pragma omp parallel
    {
    uint8_t *ex = expand_buffer(expands, (size_t)K * 24, &failed);  /* every expansion's bytes: at most 24 a column */
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NP) {
        if (expands && !ex) continue;
        if (ex && k23) expand_k23(ptype == P_Q3_K, raw + n0 * row_bytes, K, ex);
        else if (ex && ptype == P_IQ4_XS) expand_iq4xs(raw + n0 * row_bytes, K, ex);
        else if (ex && q32) expand_q32(type, raw + n0 * row_bytes, K, ex);
        else if (ex) expand_panel(ptype, raw + n0 * row_bytes, K, ex);
        const uint8_t *pb = raw + n0 * row_bytes, *next = n0 + NP < N ? pb + NP * row_bytes : NULL;
#define PACKED(T, XP) tiles_##T##_##XP(M, K, pb, ex, qx, xsa, xs2, dx, y + n0, ldy, next, NP * row_bytes);
        BY_PANEL_TYPE(ptype, ex, XP_Q4_K | XP_Q5_K | XP_Q6_K | XP_IQ4_XS | XP_Q3_K | XP_Q2_K | XP_Q4_0 | XP_Q4_1 | XP_Q5_0 |
                                 XP_Q5_1 | XP_IQ4_NL);
#undef PACKED
    }
    free(ex);
    }
    free(xs), free(xs2);
#ifndef __AVXVNNI__
    free(xc);
#endif
    return failed ? -2 : 0;
}
#endif
