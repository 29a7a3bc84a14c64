/* quant_tiles.c's kernels for F16 and BF16 weights, in tiles of 16 rows like the block types'.

   A 16-bit float matrix has no blocks and no scales; its tiles hold the values themselves, so a
   decode step streams 2 bytes a weight instead of the 4 an fp32 copy would. A tile-block holds 32
   values of each of the 16 rows, value k of all 16 rows side by side (32 bytes at 32 k): one
   conversion (vcvtph2ps for F16, a 16-bit shift for BF16) gives value k of 16 outputs as fp32.
   The activations stay fp32 in the integer modes (int8, int16 and q8_k round x for integer
   products with quants; these weights are already the model's floats), so every output is a dot
   product in fp32, the same for a row whatever else shares its call. Only bf16 mode, where a bf16
   engine exists, goes to that engine instead (tiles_bf16.h: x and W rounded to bf16, at twice the
   FMA's multiply-adds per instruction), as it does for the block types. Included by
   quant_tiles.c only, where HAVE_TILES holds. */
#ifndef TOKENBUS_TILES_HALF_H
#define TOKENBUS_TILES_HALF_H

/* Value k (< 32) of a tile-block's 16 rows, as fp32 (k = 0: the 16 values at tb). */
static inline vf half_values(int qtype, const uint8_t *tb, int k) {
    return qtype == BF16 ? vf_bf16(tb + 2 * TR * k) : vf_half(tb + 2 * TR * k);
}

/* Value k of row r of a tile-block, as fp32. */
static inline float half_value(int qtype, const uint8_t *tb, int r, int k) {
    const uint8_t *p = tb + 2 * (TR * k + r);
    return qtype == BF16 ? bf16_value(p) : _cvtsh_ss((unsigned short)(p[0] | p[1] << 8));
}

/* Register blocking as dense_rows.c's: HALF_MR rows of x against HALF_NP tiles at a time, one
   accumulator per row and tile, so each k converts HALF_NP vectors of W once for HALF_MR rows and
   the FMAs (not the conversions or the broadcasts of x) bound the call. Every output is one FMA
   chain over k in order, whichever group its row or tile falls in: a row's result never depends
   on the call's other rows. */
#if defined(__AVX512F__)
#define HALF_MR 4 /* 12 accumulators, 3 W vectors and a broadcast of 32 zmm */
#define HALF_NP 3
#else
#define HALF_MR 4 /* each vf is two ymm: 8 accumulators and 2 W halves of AVX2's 16 */
#define HALF_NP 1
#endif

/* Rows [0, R) of x against tiles [t, t + P) (R, P constants after inlining): their 16P outputs
   below N. A tile is [K][16] values (its tile-blocks back to back), so value k of its 16 rows sits
   at 32 k bytes. */
static inline __attribute__((always_inline)) void half_block(int qtype, const uint8_t *tiles, int64_t tile_bytes,
                                                             int64_t K, const float *x, int64_t ldx, float *y,
                                                             int64_t ldy, int64_t N, int64_t t, const int R,
                                                             const int P) {
    vf acc[HALF_MR][HALF_NP];
    const uint8_t *tile = tiles + t * tile_bytes;
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = vf_zero();
    for (int64_t k = 0; k < K; k++) {
        vf w[HALF_NP];
        for (int p = 0; p < P; p++) {
            const uint8_t *at = tile + p * tile_bytes + 2 * TR * k;
            if (!(k & 1)) __builtin_prefetch(at + 2 * TR * 16); /* 16 values (8 lines) ahead */
            w[p] = half_values(qtype, at, 0);
        }
        for (int r = 0; r < R; r++) {
            const vf xv = vf_set1(x[r * ldx + k]);
            for (int p = 0; p < P; p++) acc[r][p] = vf_fma(xv, w[p], acc[r][p]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) {
            const int64_t n0 = (t + p) * TR, valid = N - n0 < TR ? N - n0 : TR;
            float out[TR];
            vf_store(out, acc[r][p]);
            memcpy(y + r * ldy + n0, out, sizeof(float) * (size_t)valid);
        }
}

/* Tiles [t, t + P) (P <= HALF_NP) for every row of x: HALF_MR rows at a time, then one by one. */
static inline __attribute__((always_inline)) void half_tiles(int qtype, const uint8_t *tiles, int64_t tile_bytes,
                                                             int64_t K, const float *x, int64_t ldx, int64_t M,
                                                             float *y, int64_t ldy, int64_t N, int64_t t,
                                                             const int P) {
    int64_t m = 0;
    for (; m + HALF_MR <= M; m += HALF_MR)
        half_block(qtype, tiles, tile_bytes, K, x + m * ldx, ldx, y + m * ldy, ldy, N, t, HALF_MR, P);
    for (; m < M; m++) half_block(qtype, tiles, tile_bytes, K, x + m * ldx, ldx, y + m * ldy, ldy, N, t, 1, P);
}

/* y[M, N] = x @ W^T for any M, over groups of tiles. A group of HALF_NP tiles shares each
   broadcast of x. A decode-sized call (M <= HALF_MR: streaming W bounds it, not the
   broadcasts) whose groups of HALF_NP would leave a thread fewer than 4 (a 512-row projection
   is 11 groups of 3: enough for 2 threads, not for 16) takes one tile a group instead; a
   longer x keeps the groups, whose register blocking it needs. The split changes no output's
   bits: each is one FMA chain whatever its group. */
static int half_matmul(int qtype, const uint8_t *tiles, int64_t ntiles, int64_t blocks, int64_t tbb, int64_t N,
                       const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int num_threads) {
    const int64_t K = blocks * 32, tile_bytes = blocks * tbb;
    const int64_t width = M > HALF_MR || ntiles >= (int64_t)HALF_NP * 4 * num_threads ? HALF_NP : 1;
    const int64_t groups = (ntiles + width - 1) / width;
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t t = g * width, left = ntiles - t < width ? ntiles - t : width;
        if (left == HALF_NP) half_tiles(qtype, tiles, tile_bytes, K, x, ldx, M, y, ldy, N, t, HALF_NP);
#if HALF_NP > 2
        else if (left == 2) half_tiles(qtype, tiles, tile_bytes, K, x, ldx, M, y, ldy, N, t, 2);
#endif
        else half_tiles(qtype, tiles, tile_bytes, K, x, ldx, M, y, ldy, N, t, 1);
    }
    return 0;
}

/* out [K, 16] (row stride ldo) = tile t of W, transposed, as fp32: tile_dequant_t_one's. */
static void tile_dequant_t_half(int qtype, const uint8_t *tiles, int64_t blocks, int64_t tbb, int64_t t,
                                float *out, int64_t ldo) {
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
        for (int k = 0; k < 32; k++) vf_store(out + (b * 32 + k) * ldo, half_values(qtype, tb, k));
    }
}

/* out [K] = row r of tile t, as fp32 (an embedding lookup): tile_dequant_rows' row. */
static void tile_dequant_row_half(int qtype, const uint8_t *tiles, int64_t blocks, int64_t tbb, int64_t t, int r,
                                  float *out) {
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
        for (int k = 0; k < 32; k++) out[b * 32 + k] = half_value(qtype, tb, r, k);
    }
}

#endif
