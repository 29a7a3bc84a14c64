/* quant_matmul.c's per-row kernels for the types whose 32 values unpack to int8 with byte
   shuffles (Q5_0, Q5_1, IQ4_NL, MXFP4; the 32-value sub-blocks of Q3_K, Q6_K, IQ4_XS), on AVX2 or
   AVX-512. Included by quant_matmul.c only, after its vector layer (vec, HAVE_SIMD). */
#ifndef TOKENBUS_ROWS_SUB32_H
#define TOKENBUS_ROWS_SUB32_H

#ifdef HAVE_SIMD
/* ---------------------------------------------------------------- 32-value sub-blocks, SIMD
   Q5_0, Q5_1, IQ4_NL and MXFP4 blocks, and the eight 32-value sub-blocks of a Q3_K, Q6_K or IQ4_XS
   block, run as Q8_0's blocks do: 32 weights d * q_j + m, q_j unpacked to int8 with byte
   shuffles (SSSE3, which every AVX2 and AVX-512 CPU has) and converted to floats once for all
   M rows of x, with m * (sum of x) for Q5_1's min. The two 16-value halves of a Q3_K or Q6_K
   sub-block have scales of their own: they are applied to the floats (d = 1). */
static inline int is_sub32_type(int qtype) {
    return qtype == Q5_0 || qtype == Q5_1 || qtype == IQ4_NL || qtype == MXFP4 || qtype == Q3_K ||
           qtype == Q6_K || qtype == IQ4_XS;
}

static inline __m128i load16(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }

static inline void nibbles16(const uint8_t *qs, __m128i *lo, __m128i *hi) {  /* weights 0-15, 16-31 */
    const __m128i b = load16(qs), mask = _mm_set1_epi8(0xF);
    *lo = _mm_and_si128(b, mask);
    *hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
}

/* Bits 0-15 of `bits` as 16 bytes, `value` where the bit is set and 0 where not. */
static inline __m128i bits16(uint32_t bits, char value) {
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits), _mm_set_epi64x(0x0101010101010101LL, 0));
    const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ULL);  /* byte k: 1 << k % 8 */
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(value));
}

/* Q3_K's quants 16 l .. 16 l + 15 of sub-block ib: 2 bits at 2 (ib % 4) of qs, minus 4 where
   bit ib of hmask is clear. */
static inline __m128i q3_k_quants16(const uint8_t *qs, const uint8_t *hmask, int ib) {
    const __m128i low = _mm_and_si128(_mm_srl_epi16(load16(qs), _mm_cvtsi32_si128(2 * (ib % 4))), _mm_set1_epi8(3));
    const __m128i bit = _mm_set1_epi8((char)(1 << ib));
    const __m128i clear = _mm_cmpeq_epi8(_mm_and_si128(load16(hmask), bit), _mm_setzero_si128());
    return _mm_sub_epi8(low, _mm_and_si128(clear, _mm_set1_epi8(4)));
}

/* Q6_K's quants 16 l .. 16 l + 15 of sub-block ib (of 8; 128 n + 32 g with n = ib / 4,
   g = ib % 4): 4 low bits in the low (g < 2) or high nibbles of ql[64 n + 32 (g % 2) + l], 2
   high bits at bit 2g of qh[32 n + l], offset by 32. */
static inline __m128i q6_k_quants16(const uint8_t *ql, const uint8_t *qh, int ib) {
    const int g = ib % 4;
    const __m128i low = _mm_and_si128(_mm_srl_epi16(load16(ql), _mm_cvtsi32_si128(4 * (g / 2))), _mm_set1_epi8(0xF));
    const __m128i high = _mm_and_si128(_mm_srl_epi16(load16(qh), _mm_cvtsi32_si128(2 * g)), _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
}

/* 16 + 16 int8 quants (weights 0-15, 16-31) as two vectors of floats, as quants32 makes them. */
static inline void int8_quants32(__m128i lo8, __m128i hi8, vec *lo, vec *hi) {
#if defined(__AVX512F__)
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo8));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi8));
#else
    lo->a = cvt8(lo8, 1);
    lo->b = cvt8(_mm_unpackhi_epi64(lo8, lo8), 1);
    hi->a = cvt8(hi8, 1);
    hi->b = cvt8(_mm_unpackhi_epi64(hi8, hi8), 1);
#endif
}

/* Sub-block ib of block b (0 for the 32-value types): its 32 weights as d * (lo, hi) + m. */
static inline void sub32_quants(int qtype, const uint8_t *b, int ib, vec *qlo, vec *qhi, float *d, float *m) {
    __m128i lo, hi;
    *m = 0.0f;
    if (qtype == Q3_K) {  /* hmask[32], qs[64], scales[12], d */
        const uint8_t *qs = b + 32 + 32 * (ib / 4);
        const float d_all = fp16_to_fp32(b + 108);
        int8_quants32(q3_k_quants16(qs, b, ib), q3_k_quants16(qs + 16, b + 16, ib), qlo, qhi);
        *qlo = vfma_scalar(d_all * q3_k_scale(b + 96, 2 * ib), *qlo, vzero());
        *qhi = vfma_scalar(d_all * q3_k_scale(b + 96, 2 * ib + 1), *qhi, vzero());
        *d = 1.0f;
        return;
    }
    if (qtype == Q6_K) {  /* ql[128], qh[64], int8 scales[16], d */
        const int n = ib / 4;
        const uint8_t *ql = b + 64 * n + 32 * (ib % 2), *qh = b + 128 + 32 * n;
        const int8_t *sc = (const int8_t *)(b + 192) + 2 * ib;  /* 8 n + 2 g */
        const float d_all = fp16_to_fp32(b + 208);
        int8_quants32(q6_k_quants16(ql, qh, ib), q6_k_quants16(ql + 16, qh + 16, ib), qlo, qhi);
        *qlo = vfma_scalar(d_all * sc[0], *qlo, vzero());
        *qhi = vfma_scalar(d_all * sc[1], *qhi, vzero());
        *d = 1.0f;
        return;
    }
    if (qtype == MXFP4) {  /* e, qs[16]: IQ4_NL's nibbles through its own table */
        *d = e8m0_half(b[0]);
        nibbles16(b + 1, &lo, &hi);
        const __m128i table = load16((const uint8_t *)kvalues_mxfp4);
        int8_quants32(_mm_shuffle_epi8(table, lo), _mm_shuffle_epi8(table, hi), qlo, qhi);
        return;
    }
    *d = fp16_to_fp32(b);
    if (qtype == Q5_0 || qtype == Q5_1) {
        const int q5_1 = qtype == Q5_1;  /* Q5_1: d, m, qh, qs; Q5_0: d, qh, qs and m = -16 d */
        const uint32_t qh = load_u32(b + 2 + 2 * q5_1);
        nibbles16(b + 6 + 2 * q5_1, &lo, &hi);
        const __m128i offset = _mm_set1_epi8(q5_1 ? 0 : 16);  /* Q5_0's as int8: q - 16 */
        lo = _mm_sub_epi8(_mm_or_si128(lo, bits16(qh, 16)), offset);
        hi = _mm_sub_epi8(_mm_or_si128(hi, bits16(qh >> 16, 16)), offset);
        if (q5_1) *m = fp16_to_fp32(b + 2);
    } else {  /* IQ4_NL, IQ4_XS: each nibble indexes kvalues_iq4nl */
        const __m128i table = load16((const uint8_t *)kvalues_iq4nl);
        nibbles16(qtype == IQ4_XS ? b + 8 + 16 * ib : b + 2, &lo, &hi);
        lo = _mm_shuffle_epi8(table, lo);
        hi = _mm_shuffle_epi8(table, hi);
        if (qtype == IQ4_XS) *d *= iq4_xs_scale(b, ib);
    }
    int8_quants32(lo, hi, qlo, qhi);
}

/* Row n of W against M rows of x, per 32-value sub-block s; xsum[m * subs + s] = sum of
   sub-block s of x's row m (Q5_1's only). Always inlined with a constant qtype, so each type's
   loop is compiled on its own (with a run-time qtype GCC vectorised across m instead, 4-6x
   slower at M = 1). */
static inline __attribute__((always_inline)) void sub32_row(const int qtype, const int qk, int bytes,
                                                            const uint8_t *row, int64_t blocks, const float *x,
                                                            int64_t M, int64_t ldx, const float *xsum, float *y,
                                                            int64_t ldy, int64_t n) {
    vec acc[MAX_M];
    float macc[MAX_M];
    for (int64_t m = 0; m < M; m++) { acc[m] = vzero(); macc[m] = 0.0f; }
    const int per_block = qk / 32;
    const int64_t subs = blocks * per_block;
    for (int64_t s = 0; s < subs; s++) {
        float d, mn;
        vec lo, hi;
        sub32_quants(qtype, row + s / per_block * bytes, (int)(s % per_block), &lo, &hi, &d, &mn);
        for (int64_t m = 0; m < M; m++) {
            acc[m] = vfma_scalar(d, block_dot(lo, hi, x + m * ldx + s * 32), acc[m]);
            if (qtype == Q5_1) macc[m] += mn * xsum[m * subs + s];
        }
    }
    for (int64_t m = 0; m < M; m++) y[m * ldy + n] = vsum(acc[m]) + macc[m];
}

static void matmul_sub32_simd(int qtype, int bytes, const uint8_t *row, int64_t blocks, const float *x,
                              int64_t M, int64_t ldx, const float *xsum, float *y, int64_t ldy, int64_t n) {
    switch (qtype) {
    case Q5_0: sub32_row(Q5_0, 32, bytes, row, blocks, x, M, ldx, xsum, y, ldy, n); break;
    case Q5_1: sub32_row(Q5_1, 32, bytes, row, blocks, x, M, ldx, xsum, y, ldy, n); break;
    case IQ4_NL: sub32_row(IQ4_NL, 32, bytes, row, blocks, x, M, ldx, xsum, y, ldy, n); break;
    case MXFP4: sub32_row(MXFP4, 32, bytes, row, blocks, x, M, ldx, xsum, y, ldy, n); break;
    case Q3_K: sub32_row(Q3_K, QK_K, bytes, row, blocks, x, M, ldx, xsum, y, ldy, n); break;
    case Q6_K: sub32_row(Q6_K, QK_K, bytes, row, blocks, x, M, ldx, xsum, y, ldy, n); break;
    default: sub32_row(IQ4_XS, QK_K, bytes, row, blocks, x, M, ldx, xsum, y, ldy, n); break;
    }
}

static void deq_sub32_simd(int qtype, int qk, const uint8_t *b, float *y) {
    float q[32];
    for (int ib = 0; ib < qk / 32; ib++, y += 32) {
        float d, mn;
        vec lo, hi;
        sub32_quants(qtype, b, ib, &lo, &hi, &d, &mn);
        vstore(q, lo);
        vstore(q + 16, hi);
        for (int j = 0; j < 32; j++) y[j] = d * q[j] + mn;
    }
}

static int quant_matmul_sub32(int qtype, int qk, int bytes, const uint8_t *w, int64_t N, int64_t K,
                              const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int num_threads) {
    const int64_t blocks = K / qk, row_bytes = blocks * bytes, subs = K / 32;
    float *xsum = NULL;
    if (qtype == Q5_1) {  /* the only one with a min */
        xsum = malloc(sizeof(float) * (size_t)(M * subs));
        if (!xsum) return 3;
        for (int64_t m = 0; m < M; m++)
            for (int64_t s = 0; s < subs; s++) {
                float sum = 0.0f;
                for (int j = 0; j < 32; j++) sum += x[m * ldx + s * 32 + j];
                xsum[m * subs + s] = sum;
            }
    }
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++)
        matmul_sub32_simd(qtype, bytes, w + n * row_bytes, blocks, x, M, ldx, xsum, y, ldy, n);
    free(xsum);
    return 0;
}
#endif

#endif
