/* Int8 activations and the row kernels (included by gguf_blocks.c after gguf_dequant.h): a weight read as the file
 * stores it (Q4_K, Q6_K, Q8_0, Q5_0), one weight row at a time against up to MR rows of x.
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
 * Weight rows are split across OpenMP threads, COLS at a time; rows of x (up to 6 at once: a verification
 * step of speculative decoding with k = 5) share each decoded super-block.
 */

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
#elif defined(__AVX2__)
    __m256 vmax = _mm256_setzero_ps(), vbad = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int j = 0; j < block; j += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(xb + j), absmask);
        vmax = _mm256_max_ps(vmax, a);
        vbad = _mm256_or_ps(vbad, _mm256_cmp_ps(a, _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ)); /* NaN or infinite */
    }
    const int bad = _mm256_movemask_ps(vbad);
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    float amax = 0.f;
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
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
#elif defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(iscale), vd = _mm256_set1_ps(db);
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    for (int g = 0; g < block / 16; g++) {
        /* nearbyintf's value in the default rounding mode: to nearest, ties to even */
        __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * g), vs));
        __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * g + 8), vs));
        q0 = _mm256_max_epi32(_mm256_min_epi32(q0, lim), nlim), q1 = _mm256_max_epi32(_mm256_min_epi32(q1, lim), nlim);
        if (q) {  /* 16 int32 to int8, in order */
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
            const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128((__m128i *)(q + 16 * g), b);
        }
        if (bsums) {
            const __m256i t = _mm256_add_epi32(q0, q1);
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
            bsums[g] = (int16_t)_mm_cvtsi128_si32(u);
        }
        if (xr) {
            _mm256_storeu_ps(xr + 16 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(q0), vd));
            _mm256_storeu_ps(xr + 16 * g + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(q1), vd));
        }
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

/* one weight row against rows m0 .. m0 + mc - 1 (mc a constant in each case: the loops over rows unroll) */
static inline __attribute__((always_inline)) void dot_rows(int type, int mc, const uint8_t *row, const int8_t *qx,
                                                           const float *dx, const int16_t *bs, int64_t K, float *out) {
    if (type == Q4_K) q4k_rows(mc, row, K / QK, qx, dx, bs, K, out);
    else if (type == Q6_K) q6k_rows(mc, row, K / QK, qx, dx, bs, K, out);
    else q32_rows(type, mc, row, K / 32, qx, dx, bs, K, out);
}
