/* quant_tiles.c's kernels for int16 activations (the decode default). Included by quant_tiles.c
   only, after tiles_int8.h (quantize_block). */
#ifndef TOKENBUS_TILES_INT16_H
#define TOKENBUS_TILES_INT16_H

/* ---- int16 activations
   As int8, with x rounded to int16 per 32-value block (da = max|x| / 32767: 258x finer) and
   int16 x int16 pair products (vpdpwssd on VNNI, vpmaddwd
   otherwise): twice the int8 kernel's dot instructions, no saturation anywhere (a lane sums 32
   products of |qa| <= 32767 and |q| <= 128: < 2^31), no bias on Q8_0.
   A lane's 4 bytes are values k..k+3; as int16 pairs they are (k, k+2) and (k+1, k+3), so each
   group of 4 activations is stored (a0, a2, a1, a3): the two pairs are two broadcast dwords. */
/* A block's 32 rounded values (|v| <= 32767) as int16 in that order: each group of 4 swaps its
   middle two (a shuffle within 128-bit lanes, then a narrowing that keeps the order). Vector
   code because the scalar stores showed up in a c16 run's profile (benchmarks/step_breakdown.py
   under perf). */
static inline void store_q16(const int *v, int16_t *dst) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int i = 0; i < 2; i++) {
        const __m512i q = _mm512_shuffle_epi32(_mm512_loadu_si512((const void *)(v + 16 * i)), _MM_PERM_DBCA);
        _mm256_storeu_si256((__m256i *)(dst + 16 * i), _mm512_cvtepi32_epi16(q));
    }
#elif defined(__AVX2__)
    for (int i = 0; i < 2; i++) {
        const __m256i a = _mm256_shuffle_epi32(_mm256_loadu_si256((const __m256i *)(v + 16 * i)), 0xD8),
                      b = _mm256_shuffle_epi32(_mm256_loadu_si256((const __m256i *)(v + 16 * i + 8)), 0xD8);
        /* packs: 64-bit chunks a0-3, b0-3, a4-7, b4-7; the permute puts them in order */
        _mm256_storeu_si256((__m256i *)(dst + 16 * i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
#else
    static const int order[4] = {0, 2, 1, 3};
    for (int j = 0; j < 32; j++) dst[(j & ~3) + order[j & 3]] = (int16_t)v[j];
#endif
}

static void quantize_rows_q16(const float *x, int64_t M, int64_t ldx, int64_t K, int16_t *qa, float *da, float *sa,
                              int num_threads) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= QUANTIZE_PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            int v[32];
            quantize_block(x + m * ldx + b * 32, 32767.0f, v, da + m * blocks + b, sa + m * blocks + b);
            store_q16(v, qa + m * K + b * 32);
        }
}

/* Q16_ROWS rows of x (R <= Q16_ROWS; a constant where inlined) against P (16, or 8: half of a
   Q6_K tile-block) of a tile-block's int16 weight groups w: out[r] = the integer dots of row r (a, row stride lda bytes). The rows
   go R at a time so that each w[p] is read once per R rows, not once per row: on AVX2 the 16
   groups are 32 ymm, twice the register file, and a row at a time spent more load slots than
   dot products (slower than the int8 kernel: quant_linear.py --step --rows 16). Q16_ROWS
   chains in all, C per row: vpdpwssd (VNNI) has 5 cycles of latency on its accumulator. */
#define Q16_ROWS 4
static inline __attribute__((always_inline)) void q16_dots(const vi *w, const int8_t *a, int64_t lda, int R,
                                                           int P, vi *out) {
    const int C = R == 1 ? 4 : R == 2 ? 2 : 1;
    vi acc[Q16_ROWS];
    for (int i = 0; i < R * C; i++) acc[i] = vi_zero();
#pragma GCC unroll 16
    for (int p = 0; p < P; p++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[r * C + p % C] = vi_dot16(acc[r * C + p % C], w[p], vi_bcast32(a + r * lda + 4 * p));
            vi_keep(&acc[r * C + p % C]);
        }
    for (int r = 0; r < R; r++) {  /* integer sums: exact in any order */
        out[r] = acc[r * C];
        for (int c = 1; c < C; c++) out[r] = vi_add(out[r], acc[r * C + c]);
    }
}

/* Of a tile-block's 64-byte chunk c (`raw`), its j-th int16 weight group: for Q8_0 j 0-1, the
   groups 2c, 2c + 1 (each int16 lane's low byte, its high byte, sign-extended); for Q4_0/Q4_1
   j 0-3, the groups 2c, 2c + 1 (low nibbles) and 8 + 2c, 9 + 2c (high nibbles). */
static inline __attribute__((always_inline)) vi q16_group(int qtype, vi raw, int j) {
    const vi low4 = vi_set32(0x000F000F);
    if (q8_chunks(qtype)) return j == 0 ? vi_srai16(vi_slli16(raw, 8), 8) : vi_srai16(raw, 8);
    switch (j) {
    case 0: return vi_and(raw, low4);
    case 1: return vi_and(vi_srli16(raw, 8), low4);
    case 2: return vi_and(vi_srli16(raw, 4), low4);
    default: return vi_srli16(raw, 12);
    }
}

/* One row of x against a tile-block straight from its bytes: each chunk is unpacked into its
   int16 groups just before they are used, so no group outlives its dot product (as a whole
   unpacked w[16], 32 ymm on AVX2, it would be spilled to the stack and read back).
   For Q4 the nibbles at bits 8-11 and 4-7 of each int16 lane are only masked, not also shifted
   down: their chains sum products 256x and 16x too large and are shifted back once at the end,
   one instruction per group where it was two. Exact: every product in those chains is a multiple
   of 256 (16), and a lane of a chain sums 8 products of |q << 8| <= 3840 and |qa| <= 32767
   (< 2^30), so the integer sums are those of the shifted groups. Groups 0 and 3 (unscaled)
   share a chain: three chains in all, so that on AVX2 they, the chunk and the masks stay in the
   16 registers. */
static inline __attribute__((always_inline)) vi q16_dots_row(int qtype, const uint8_t *tb, const int8_t *a,
                                                             vi *hi) {
    if (q8_chunks(qtype)) {  /* chains 0-1 take values 0-15 (chunks 0-3), 2-3 values 16-31 */
        vi acc[4] = {vi_zero(), vi_zero(), vi_zero(), vi_zero()};
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const vi raw = q8_chunk(qtype, tb, c);
            const int i = 2 * (c / 4);
            acc[i] = vi_dot16(acc[i], q16_group(qtype, raw, 0), vi_bcast32(a + 8 * c));
            acc[i + 1] = vi_dot16(acc[i + 1], q16_group(qtype, raw, 1), vi_bcast32(a + 8 * c + 4));
            vi_keep(&acc[i]);
            vi_keep(&acc[i + 1]);
        }
        if (split_scales(qtype)) {  /* the halves have their own scales */
            *hi = vi_add(acc[2], acc[3]);
            return vi_add(acc[0], acc[1]);
        }
        return vi_add(vi_add(acc[0], acc[1]), vi_add(acc[2], acc[3]));
    }
    const vi bits8 = vi_set32(0x0F000F00), bits4 = vi_set32(0x00F000F0);
    vi acc1 = vi_zero(), acc256 = vi_zero(), acc16 = vi_zero();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const vi raw = vi_load(tb + 64 * c);
        acc1 = vi_dot16(acc1, q16_group(qtype, raw, 0), vi_bcast32(a + 8 * c));
        acc256 = vi_dot16(acc256, vi_and(raw, bits8), vi_bcast32(a + 8 * c + 4));   /* 256 x group 1 */
        acc16 = vi_dot16(acc16, vi_and(raw, bits4), vi_bcast32(a + 32 + 8 * c));    /* 16 x group 2 */
        acc1 = vi_dot16(acc1, q16_group(qtype, raw, 3), vi_bcast32(a + 32 + 8 * c + 4));
        vi_keep(&acc1);
        vi_keep(&acc256);
        vi_keep(&acc16);
    }
    return vi_add(acc1, vi_add(vi_srai32(acc256, 8), vi_srai32(acc16, 4)));
}

/* tile_q16a for one row of x (a decode step of one stream), in a function of its own per
   quant type, so that the compiler allocates registers for this loop alone (inside tile_q16a it
   hoisted the chunk loads and the broadcasts it shares with the many-row path, then moved the
   chains through the stack). */
static inline __attribute__((always_inline)) void q16a_one(const int qtype, int qb, const uint8_t *tiles,
                                                           int64_t blocks, int64_t tbb, const int16_t *qa,
                                                           const float *da, const float *sa, float *y, int64_t N,
                                                           int64_t t) {
    vf accd = vf_zero(), accm = vf_zero();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
        prefetch_ahead(tb, tbb);
        vf d, d1, mn;
        tile_scales(qtype, tb, b, tbb, 0.0f, &d, &d1, &mn);
        vi hi;
        const vi dots = q16_dots_row(qtype, tb, (const int8_t *)(qa + b * 32), &hi);
        const vf dab = vf_set1(da[b]);
        accd = vf_fma(vf_cvt(dots), vf_mul(d, dab), accd);
        if (split_scales(qtype)) accd = vf_fma(vf_cvt(hi), vf_mul(d1, dab), accd);
        else accm = vf_fma(mn, vf_set1(sa[b]), accm);
    }
    finish_tile(&accd, &accm, 1, y, 0, N, t);
}

static __attribute__((noinline)) void tile_q16a_one(int qtype, int qb, const uint8_t *tiles, int64_t blocks,
                                                    int64_t tbb, const int16_t *qa, const float *da,
                                                    const float *sa, float *y, int64_t N, int64_t t) {
    switch (qtype) {  /* a constant type in each copy */
    case Q8_0: q16a_one(Q8_0, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    case Q4_0: q16a_one(Q4_0, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    case Q4_K: q16a_one(Q4_K, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    case Q6_K: q16a_one(Q6_K, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    case IQ4_XS: q16a_one(IQ4_XS, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    case IQ4_NL: q16a_one(IQ4_NL, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    case MXFP4: q16a_one(MXFP4, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    case Q5_0: q16a_one(Q5_0, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    case Q5_1: q16a_one(Q5_1, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    case Q5_K: q16a_one(Q5_K, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    default: q16a_one(Q4_1, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    }
}

static void tile_q16a(int qtype, int qb, const uint8_t *tiles, int64_t blocks, int64_t tbb, const int16_t *qa,
                      const float *da, const float *sa, int64_t M, int64_t K, float *y, int64_t ldy, int64_t N,
                      int64_t t) {
    if (M == 1) {
        tile_q16a_one(qtype, qb, tiles, blocks, tbb, qa, da, sa, y, N, t);
        return;
    }
    vf accd[MAX_M], accm[MAX_M];
    for (int64_t m = 0; m < M; m++) { accd[m] = vf_zero(); accm[m] = vf_zero(); }
    const int64_t lda = 2 * K;  /* bytes per row of qa */
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
        vf d, d1, mn;
        tile_scales(qtype, tb, b, tbb, 0.0f, &d, &d1, &mn);
        const int8_t *a = (const int8_t *)(qa + b * 32);
        prefetch_ahead(tb, tbb);
        vi w[16];  /* w[2p], w[2p + 1]: int16 pairs (k, k+2), (k+1, k+3) of activation group p */
        if (q8_chunks(qtype)) {
            for (int c = 0; c < 8; c++) {
                const vi raw = q8_chunk(qtype, tb, c);
                w[2 * c] = q16_group(Q8_0, raw, 0);
                w[2 * c + 1] = q16_group(Q8_0, raw, 1);
            }
        } else {  /* groups 0-3: low nibbles of chunks 0-3; groups 4-7: their high nibbles */
            for (int c = 0; c < 4; c++) {
                const vi raw = vi_load(tb + 64 * c);
                for (int j = 0; j < 4; j++) w[(j / 2) * 8 + 2 * c + j % 2] = q16_group(qtype, raw, j);
            }
        }
        for (int64_t m0 = 0; m0 < M; m0 += Q16_ROWS) {
            vi dots[Q16_ROWS], his[Q16_ROWS];
            const int64_t R = M - m0 < Q16_ROWS ? M - m0 : Q16_ROWS;
            const int8_t *am = a + m0 * lda;
            if (split_scales(qtype)) {  /* groups 0-7 are values 0-15, 8-15 values 16-31: two scales */
                switch (R) {
                case 4: q16_dots(w, am, lda, 4, 8, dots); q16_dots(w + 8, am + 32, lda, 4, 8, his); break;
                case 3: q16_dots(w, am, lda, 3, 8, dots); q16_dots(w + 8, am + 32, lda, 3, 8, his); break;
                case 2: q16_dots(w, am, lda, 2, 8, dots); q16_dots(w + 8, am + 32, lda, 2, 8, his); break;
                default: q16_dots(w, am, lda, 1, 8, dots); q16_dots(w + 8, am + 32, lda, 1, 8, his); break;
                }
                for (int64_t r = 0; r < R; r++) {
                    const int64_t m = m0 + r;
                    const vf dab = vf_set1(da[m * blocks + b]);
                    accd[m] = vf_fma(vf_cvt(his[r]), vf_mul(d1, dab), vf_fma(vf_cvt(dots[r]), vf_mul(d, dab), accd[m]));
                }
                continue;
            }
            switch (R) {  /* constant R: the row loops unrolled, the accumulators in registers */
            case 4: q16_dots(w, am, lda, 4, 16, dots); break;
            case 3: q16_dots(w, am, lda, 3, 16, dots); break;
            case 2: q16_dots(w, am, lda, 2, 16, dots); break;
            default: q16_dots(w, am, lda, 1, 16, dots); break;
            }
            for (int64_t r = 0; r < R; r++) {
                const int64_t m = m0 + r;
                accd[m] = vf_fma(vf_cvt(dots[r]), vf_mul(d, vf_set1(da[m * blocks + b])), accd[m]);
                accm[m] = vf_fma(mn, vf_set1(sa[m * blocks + b]), accm[m]);
            }
        }
    }
    finish_tile(accd, accm, M, y, ldy, N, t);
}

#endif
