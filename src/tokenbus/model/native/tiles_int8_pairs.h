/* quant_tiles.c's int8-activation kernel for calls of many rows (a prefill chunk) on VNNI: tile_q8a's
   sums, two tiles at a time. Included by quant_tiles.c only, after tiles_int8.h.

   tile_q8a runs one tile against every row: per row and tile-block 8 activation dwords are
   broadcast for 8 dot products, and its quants take their type's branches on every row. Here the
   rows meet a pair of tiles: each broadcast serves both tiles' dot products, and the loop is
   compiled once per type (a constant qtype), so a row's body is the dots and the float steps
   alone. Two weight tiles' 16 chunk vectors stay in registers across the rows (a tile-block's
   quants are unpacked once per call and pair, as tile_q8a unpacks them once per tile).

   Q6_K's quants are signed (-32..31): tile_q8a dots them through |q| and x with q's sign (three
   instructions per dot). Here they go in as they are, against x biased to unsigned (a + 128,
   one xor per broadcast): per half of a block, sum q (a + 128) = sum q a + 128 sum q, so each
   chain starts from -128 sum q (per tile-block, from 8 dots of 1 against the quants) and ends
   at tile_q8a's integer. Every other type's integer is tile_q8a's own form (its unsigned
   quants against the signed x).

   The integers are exact in any order, and the float steps are tile_q8a's in its order
   (d da per row, the fma of each sum, the min's fma into a separate sum, added at the end), so
   each output is the same bits as tile_q8a's: which of the two a call runs (by its number of
   rows) never changes a row's result. */
#ifndef TOKENBUS_TILES_INT8_PAIRS_H
#define TOKENBUS_TILES_INT8_PAIRS_H

#if VI_DOT_VNNI
/* From this many rows an int8 call runs tile pairs; below it a tile-block's unpacking is shared by
   too few rows (tile_q8a). Q6_K from 2: tile_q8a's three instructions a dot cost more there.
   (Both timed per type at 2, 4, 8 and 16 rows of a 16384 x 2048 matrix, one thread.) */
#define Q8_PAIR_MIN_ROWS(qtype) (split_scales(qtype) ? 2 : 4)

/* A tile-block's 8 chunk vectors as the dots take them: tile_q8a's w (Q8_0 / IQ4 biased by 128,
   the others as their unsigned quants) but Q6_K's signed; and for Q6_K the chain starts of its
   two halves, -128 times the sum of a row's 16 quants in each. */
static inline __attribute__((always_inline)) void q8p_weights(const int qtype, const uint8_t *tb, vi *w,
                                                              vi *start_lo, vi *start_hi) {
    tile_chunks(qtype, tb, w);
    if (split_scales(qtype)) bias_starts(w, start_lo, start_hi);
    if (signed_bytes(qtype))
        for (int c = 0; c < 8; c++) w[c] = vi_xor(w[c], vi_set8((int8_t)0x80));
}

/* Rows [0, M) of qa against tiles t and t + 1 (t alone where !two: the pair's second tile is
   then the first again, its results dropped). */
static inline __attribute__((always_inline)) void q8_pair(const int qtype, const uint8_t *tiles, int64_t blocks,
                                                          int64_t tbb, const int8_t *qa, const float *da,
                                                          const float *sa, int64_t M, int64_t K, float *y,
                                                          int64_t ldy, int64_t N, int64_t t, int two) {
    vf accd[2][MAX_M], accm[2][MAX_M];
    for (int64_t m = 0; m < M; m++)
        for (int i = 0; i < 2; i++) { accd[i][m] = vf_zero(); accm[i][m] = vf_zero(); }
    const vi bias = vi_set8((int8_t)0x80);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb[2] = {tile_block(qtype, tiles, t, b, blocks, tbb),
                                tile_block(qtype, tiles, two ? t + 1 : t, b, blocks, tbb)};
        vf d[2], d1[2], mn[2];
        vi w[2][8], lo[2] = {vi_zero(), vi_zero()}, hi[2] = {vi_zero(), vi_zero()};
        for (int i = 0; i < 2; i++) {
            prefetch_ahead(tb[i], tbb);
            tile_scales(qtype, tb[i], b, tbb, (float)Q8_BIAS, &d[i], &d1[i], &mn[i]);
            q8p_weights(qtype, tb[i], w[i], &lo[i], &hi[i]);
        }
        for (int64_t m = 0; m < M; m++) {
            const int8_t *a = qa + m * K + b * 32;
            const vf dab = vf_set1(da[m * blocks + b]);
            if (split_scales(qtype)) {
                vi s0[2] = {lo[0], lo[1]}, s1[2] = {hi[0], hi[1]};
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const vi x0 = vi_xor(vi_bcast32(a + 4 * c), bias), x1 = vi_xor(vi_bcast32(a + 4 * c + 16), bias);
                    for (int i = 0; i < 2; i++) {
                        s0[i] = vi_dot(s0[i], x0, w[i][c]);
                        s1[i] = vi_dot(s1[i], x1, w[i][c + 4]);
                    }
                }
                for (int i = 0; i < 2; i++)
                    accd[i][m] = vf_fma(vf_cvt(s1[i]), vf_mul(d1[i], dab),
                                        vf_fma(vf_cvt(s0[i]), vf_mul(d[i], dab), accd[i][m]));
                continue;
            }
            vi s[2][2] = {{vi_zero(), vi_zero()}, {vi_zero(), vi_zero()}};
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const vi x = vi_bcast32(a + 4 * c);
                for (int i = 0; i < 2; i++) s[i][c % 2] = vi_dot(s[i][c % 2], w[i][c], x);
            }
            const vf sab = vf_set1(sa[m * blocks + b]);
            for (int i = 0; i < 2; i++) {
                accd[i][m] = vf_fma(vf_cvt(vi_add(s[i][0], s[i][1])), vf_mul(d[i], dab), accd[i][m]);
                accm[i][m] = vf_fma(mn[i], sab, accm[i][m]);
            }
        }
    }
    finish_tile(accd[0], accm[0], M, y, ldy, N, t);
    if (two) finish_tile(accd[1], accm[1], M, y, ldy, N, t + 1);
}

/* q8_pair for a run-time type: one compiled copy per type. */
static void tile_q8a_pair(int qtype, const uint8_t *tiles, int64_t blocks, int64_t tbb, const int8_t *qa,
                          const float *da, const float *sa, int64_t M, int64_t K, float *y, int64_t ldy, int64_t N,
                          int64_t t, int two) {
#define Q8P_CASE(type)                                                                        \
    case type: q8_pair(type, tiles, blocks, tbb, qa, da, sa, M, K, y, ldy, N, t, two); break;
    switch (qtype) {
        Q8P_CASE(Q8_0) Q8P_CASE(Q4_0) Q8P_CASE(Q4_1) Q8P_CASE(Q5_0) Q8P_CASE(Q5_1) Q8P_CASE(IQ4_NL)
        Q8P_CASE(Q4_K) Q8P_CASE(Q5_K) Q8P_CASE(Q6_K) Q8P_CASE(IQ4_XS) Q8P_CASE(MXFP4)
    }
#undef Q8P_CASE
}
#endif

#endif
