/* quant_tiles.c's kernels for int8 activations, and the per-block rounding of x that the int16
   ones share (vector code from tile_vectors.h: AVX2 or AVX-512, VNNI where built; without VNNI
   also tile_q4a, Q4 tiles four rows at a time). Included by quant_tiles.c only. */
#ifndef TOKENBUS_TILES_INT8_H
#define TOKENBUS_TILES_INT8_H

/* ---- int8 dots' weights */
/* A tile-block's values as 8 chunk vectors, chunk c the 16 rows' values 4c..4c+3 a byte each, as
   the format keeps them: q8_chunk's (Q8_0, IQ4 table values, Q5 0..31, Q6_K -32..31), or Q4's
   nibbles (0..15). */
static inline __attribute__((always_inline)) void tile_chunks(int qtype, const uint8_t *tb, vi *w) {
    if (q8_chunks(qtype)) {
        for (int c = 0; c < 8; c++) w[c] = q8_chunk(qtype, tb, c);
        return;
    }
    const vi nibble = vi_set8(0xF);
    for (int c = 0; c < 4; c++) {
        const vi raw = vi_load(tb + 64 * c);
        w[c] = vi_and(raw, nibble);
        w[c + 4] = vi_and(vi_srli16(raw, 4), nibble);
    }
}

/* Where signed values w meet x biased to unsigned bytes (v + 128, VNNI): per half of a block
   sum w (v + 128) = sum w v + 128 sum w, so a dot chain over values 0-15 (lo) or 16-31 (hi)
   that starts from -128 sum w (these, from dots of 1 against w) ends at sum w v. */
static inline void bias_starts(const vi *w, vi *lo, vi *hi) {
    const vi ones = vi_set8(1);
    vi l = vi_zero(), h = vi_zero();
    for (int c = 0; c < 4; c++) {
        l = vi_dot(l, ones, w[c]);
        h = vi_dot(h, ones, w[c + 4]);
    }
    *lo = vi_sub32(vi_zero(), vi_slli32(l, 7));
    *hi = vi_sub32(vi_zero(), vi_slli32(h, 7));
}

/* ---- integer activations (int8, int16) */
/* Block b of row m of x rounded to multiples of da = max|x| / levels: v[32], and
   da[m * blocks + b], sa[...] = da * sum(v) (what the mins multiply). */
static inline void quantize_block(const float *xb, float levels, int *v, float *da, float *sa) {
#if defined(__AVX512F__)
    /* The same arithmetic 16 lanes at a time: the max is exact in any order, x * id is rounded
       by MXCSR's mode (nearest-even, as lrintf rounds), the integer sum is exact. A decode step
       rounds every value of x on the main thread while the other waits (the scalar loop showed
       in a batch-16 profile, benchmarks/step_breakdown.py under perf). */
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float id = amax > 0.0f ? levels / amax : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid)), hi = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
    _mm512_storeu_si512((void *)v, lo);
    _mm512_storeu_si512((void *)(v + 16), hi);
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
#elif defined(__AVX2__)
    /* The same in 8-lane halves: a prefill chunk on int16 tiles rounds every row of x, once
       per linear. */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 xv[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        xv[i] = _mm256_loadu_ps(xb + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, xv[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float id = amax > 0.0f ? levels / amax : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i total = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], vid));
        _mm256_storeu_si256((__m256i *)(v + 8 * i), q);
        total = _mm256_add_epi32(total, q);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const int sum = _mm_cvtsi128_si32(s4);
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
    const float id = amax > 0.0f ? levels / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        v[j] = (int)lrintf(xb[j] * id);
        sum += v[j];
    }
#endif
    *da = amax / levels;
    *sa = amax / levels * (float)sum;
}

/* From this many rows x is rounded by all the call's threads (each row independently, so the
   result does not depend on the split); below it the fork costs more than it saves. */
#define QUANTIZE_PARALLEL_ROWS 16

/* x as int8 per block, in order (qa[m * K + k]). */
static void quantize_rows_q8(const float *x, int64_t M, int64_t ldx, int64_t K, int8_t *qa, float *da, float *sa,
                             int num_threads) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= QUANTIZE_PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            int v[32];
            quantize_block(x + m * ldx + b * 32, 127.0f, v, da + m * blocks + b, sa + m * blocks + b);
            for (int j = 0; j < 32; j++) qa[m * K + b * 32 + j] = (int8_t)v[j];
        }
}

static void tile_q8a(int qtype, int qb, const uint8_t *tiles, int64_t blocks, int64_t tbb, const int8_t *qa,
                     const float *da, const float *sa, int64_t M, int64_t K, float *y, int64_t ldy, int64_t N,
                     int64_t t) {
    vf accd[MAX_M], accm[MAX_M];
    for (int64_t m = 0; m < M; m++) { accd[m] = vf_zero(); accm[m] = vf_zero(); }
    const vi bias = vi_set8((int8_t)0x80);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
        prefetch_ahead(tb, tbb);
        vf d, d1, mn;
        tile_scales(qtype, tb, b, tbb, (float)Q8_BIAS, &d, &d1, &mn);
        vi w[8];  /* w[c]: the quants that meet dword c of an activation block */
        tile_chunks(qtype, tb, w);  /* Q6_K signed, Q5 (0..31) and Q4 unsigned as they are */
        if (signed_bytes(qtype) && Q8_BIAS)
            for (int c = 0; c < 8; c++) w[c] = vi_xor(w[c], bias);
        for (int64_t m = 0; m < M; m++) {
            const int8_t *a = qa + m * K + b * 32;
            if (split_scales(qtype)) {  /* signed quants (no bias), two halves of their own scale */
                vi i0 = vi_zero(), i1 = vi_zero();
                for (int c = 0; c < 4; c++) {
                    i0 = vi_dot(i0, vi_abs8(w[c]), vi_sign(vi_bcast32(a + 4 * c), w[c]));
                    i1 = vi_dot(i1, vi_abs8(w[c + 4]), vi_sign(vi_bcast32(a + 4 * c + 16), w[c + 4]));
                }
                const vf dab = vf_set1(da[m * blocks + b]);
                accd[m] = vf_fma(vf_cvt(i1), vf_mul(d1, dab), vf_fma(vf_cvt(i0), vf_mul(d, dab), accd[m]));
                continue;
            }
            vi i0 = vi_zero(), i1 = vi_zero();  /* two chains: the dot latency is 5 cycles */
            for (int c = 0; c < 8; c += 2) {
                if (signed_bytes(qtype) && !Q8_BIAS) {
                    i0 = vi_dot(i0, vi_abs8(w[c]), vi_sign(vi_bcast32(a + 4 * c), w[c]));
                    i1 = vi_dot(i1, vi_abs8(w[c + 1]), vi_sign(vi_bcast32(a + 4 * c + 4), w[c + 1]));
                } else {
                    i0 = vi_dot(i0, w[c], vi_bcast32(a + 4 * c));
                    i1 = vi_dot(i1, w[c + 1], vi_bcast32(a + 4 * c + 4));
                }
            }
            accd[m] = vf_fma(vf_cvt(vi_add(i0, i1)), vf_mul(d, vf_set1(da[m * blocks + b])), accd[m]);
            accm[m] = vf_fma(mn, vf_set1(sa[m * blocks + b]), accm[m]);
        }
    }
    finish_tile(accd, accm, M, y, ldy, N, t);
}

/* Q4 under int8 activations without VNNI, rows Q4A_ROWS at a time. vi_dot is three instructions
   there (pair products, int16 pairs to int32, the add), two of them on the multiplier. A Q4 quant
   is at most 15 and |qa| <= 127, so an int16 lane of pair products is at most 2 * 15 * 127 = 3810
   and the 8 of a block sum to at most 30480: they are added as int16 and widened once per block,
   9 multiplier instructions per row and block instead of 16 (benchmarks/quant_linear.py --step
   --rows 64 under TOKENBUS_CPU_ISA=avx2 measures the gain). The sums are the same integers as
   vi_dot's, so every output is the same bits as tile_q8a's. A lone row would be one chain of
   dependent int16 adds (latency-bound), so tile_q8a keeps calls of fewer than 8 rows and the
   last M % Q4A_ROWS. */
#if !VI_DOT_VNNI
#define Q4A_ROWS 4
static void tile_q4a(int qtype, int qb, const uint8_t *tiles, int64_t blocks, int64_t tbb, const int8_t *qa,
                     const float *da, const float *sa, int64_t M, int64_t K, float *y, int64_t ldy, int64_t N,
                     int64_t t) {
    vf accd[MAX_M], accm[MAX_M];
    for (int64_t m = 0; m < M; m++) { accd[m] = vf_zero(); accm[m] = vf_zero(); }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
        prefetch_ahead(tb, tbb);
        vf d, d1, mn;
        tile_scales(qtype, tb, b, tbb, 0.0f, &d, &d1, &mn);
        vi w[8];  /* as tile_q8a's */
        tile_chunks(qtype, tb, w);
        for (int64_t m0 = 0; m0 + Q4A_ROWS <= M; m0 += Q4A_ROWS) {
            const int8_t *a = qa + m0 * K + b * 32;
            vi acc[Q4A_ROWS];  /* int16 pair sums per row */
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                vi wc = w[c];
                vi_keep(&wc);  /* in a register once for the rows, not a memory operand of each */
#pragma GCC unroll 4
                for (int r = 0; r < Q4A_ROWS; r++) {
                    const vi pairs = vi_pairs8(wc, vi_bcast32(a + r * K + 4 * c));
                    acc[r] = c ? vi_add16(acc[r], pairs) : pairs;
                    vi_keep(&acc[r]);
                }
            }
            for (int r = 0; r < Q4A_ROWS; r++) {
                const int64_t m = m0 + r;
                accd[m] = vf_fma(vf_cvt(vi_widen16(acc[r])), vf_mul(d, vf_set1(da[m * blocks + b])), accd[m]);
                accm[m] = vf_fma(mn, vf_set1(sa[m * blocks + b]), accm[m]);
            }
        }
    }
    finish_tile(accd, accm, M / Q4A_ROWS * Q4A_ROWS, y, ldy, N, t);
}
#endif

#endif
