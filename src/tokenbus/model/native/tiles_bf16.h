/* quant_tiles.c's bf16-activation engine on AVX512-BF16 (no AMX, or AMX not granted): Cooper
   Lake, AMD Zen 4 and later. Defines HAVE_BF16_TILES and dp_matmul where the build has the
   instructions; tiles_amx.h reuses its packed blocks. Included by quant_tiles.c only, after the
   tiled kernels it builds on (tile_scales, unpack_fp32). */
#ifndef TOKENBUS_TILES_BF16_H
#define TOKENBUS_TILES_BF16_H

/* ---- bf16 activations: any number of rows, on AMX tiles or (no AMX) AVX512-BF16 dot products
   A weight tile is dequantized once per call (exactly as tile_dequant_t: d q + m in fp32), rounded
   to bf16 and laid out per tile-block (32 values) as 16 rows of 64 bytes (an AMX B tile, or 16
   zmm vectors): row p holds, for each of the 16 weight rows n, the pair (W[n][2p], W[n][2p + 1]).
   x is rounded to bf16 once per call. Both engines sum pairs of bf16 products in fp32 over all K
   (no per-block scales left to apply), so y = x W^T with both rounded to bf16 and nothing else. */
#if defined(HAVE_TILES) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_BF16_TILES 1

/* Tile-block tb as 16 packed pair rows: bt[p * 32 + 2n + j] = bf16(W[n][2p + j]) for its 16 rows n. */
static inline void bf16_pack_block(int qtype, const uint8_t *tiles, int64_t t, int64_t b, int64_t blocks,
                                   int64_t tbb, __m512i interleave, uint16_t *bt) {
    const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
    vf q[32], d, d1, mn;
    if (half_type(qtype)) {  /* the values themselves: BF16's exactly, F16's rounded */
        for (int k = 0; k < 32; k++) q[k] = half_values(qtype, tb, k);
        d = d1 = vf_set1(1.0f);
        mn = vf_zero();
    } else {
        tile_scales(qtype, tb, b, tbb, 0.0f, &d, &d1, &mn);
        unpack_fp32(qtype, tb, q);
    }
    for (int p = 0; p < 16; p++) {  /* words 0-15: W[.][2p], 16-31: W[.][2p + 1]; then paired per row */
        const vf dp = p < 8 ? d : d1;  /* Q6_K: values 16-31 have their own scale */
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(vf_fma(q[2 * p + 1], dp, mn), vf_fma(q[2 * p], dp, mn));
        _mm512_storeu_si512((void *)(bt + p * 32), _mm512_permutexvar_epi16(interleave, both));
    }
}

static inline __m512i bf16_pair_order(void) {
    static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_loadu_si512((const void *)pairs);
}

/* x [M, K] (row stride ldx) rounded to bf16, rows [M, Mpad) zero: a fresh [Mpad, K] buffer, or NULL. */
static uint16_t *bf16_round_rows(const float *x, int64_t M, int64_t ldx, int64_t K, int64_t Mpad) {
    uint16_t *xb = aligned_alloc(64, (size_t)(Mpad * K) * sizeof(uint16_t) + 64);
    if (!xb) return NULL;
    for (int64_t m = 0; m < Mpad; m++)
        for (int64_t k = 0; k < K; k += 16) {  /* K % 32 == 0 */
            const __m512 v = m < M ? _mm512_loadu_ps(x + m * ldx + k) : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i *)(xb + m * K + k), (__m256i)_mm512_cvtneps_pbh(v));
        }
    return xb;
}
#endif

#ifdef HAVE_BF16_TILES
/* AVX512-BF16 without AMX (Cooper Lake, AMD Zen 4 and later): the same packed blocks as 16 zmm
   rows each, and vdpbf16ps: one instruction adds, for the 16 weight rows of a tile, the products
   of their pair p with x's pair p of one row (a broadcast dword). A register block is DP_ROWS
   rows of x by two weight tiles: 2 * DP_ROWS accumulators, and per pair 2 weight loads and
   DP_ROWS broadcasts for 2 * DP_ROWS dot products (vdpbf16ps' latency is ~6 cycles: 16
   independent chains keep it busy). */
#define DP_ROWS 8

/* R (<= DP_ROWS) rows of xb (bf16, row stride K) times packed tiles bt0 (and bt1 when `two`)
   over all K, to y's columns [n0, n0 + valid0) (and the next tile's valid1). Inlined with R and
   `two` constant, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dp_rows(const uint16_t *bt0, const uint16_t *bt1, const int two,
                                                          const uint16_t *xb, int64_t K, int64_t blocks, const int R,
                                                          float *y, int64_t ldy, int64_t n0, __mmask16 valid0,
                                                          __mmask16 valid1) {
    __m512 acc0[DP_ROWS], acc1[DP_ROWS];
    for (int r = 0; r < R; r++) { acc0[r] = _mm512_setzero_ps(); acc1[r] = _mm512_setzero_ps(); }
    for (int64_t b = 0; b < blocks; b++)
        for (int p = 0; p < 16; p++) {
            const __m512bh w0 = (__m512bh)_mm512_load_si512((const void *)(bt0 + b * 512 + p * 32));
            const __m512bh w1 = two ? (__m512bh)_mm512_load_si512((const void *)(bt1 + b * 512 + p * 32)) : w0;
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, xb + r * K + b * 32 + 2 * p, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                acc0[r] = _mm512_dpbf16_ps(acc0[r], w0, xv);
                if (two) acc1[r] = _mm512_dpbf16_ps(acc1[r], w1, xv);
            }
        }
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(y + r * ldy + n0, valid0, acc0[r]);
        if (two) _mm512_mask_storeu_ps(y + r * ldy + n0 + TR, valid1, acc1[r]);
    }
}

/* dp_rows for a run-time R: one inlined copy per (R, two). */
static void dp_rows_any(const uint16_t *bt0, const uint16_t *bt1, int two, const uint16_t *xb, int64_t K,
                        int64_t blocks, int R, float *y, int64_t ldy, int64_t n0, __mmask16 v0, __mmask16 v1) {
#define DP_CASE(n)                                                                            \
    case n:                                                                                   \
        if (two) dp_rows(bt0, bt1, 1, xb, K, blocks, n, y, ldy, n0, v0, v1);                  \
        else dp_rows(bt0, bt1, 0, xb, K, blocks, n, y, ldy, n0, v0, v1);                      \
        break;
    switch (R) { DP_CASE(1) DP_CASE(2) DP_CASE(3) DP_CASE(4) DP_CASE(5) DP_CASE(6) DP_CASE(7) DP_CASE(8) }
#undef DP_CASE
}

static inline __mmask16 dp_valid(int64_t N, int64_t t) {
    const int64_t left = N - t * TR;
    return left >= TR ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* 0 on success, 3 out of memory. Each thread packs a pair of weight tiles (all K) into its bt,
   then runs every row of x against it, DP_ROWS at a time. */
static int dp_matmul(int qtype, int qb, const uint8_t *tiles, int64_t ntiles, int64_t blocks, int64_t tbb,
                     int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                     int num_threads) {
    uint16_t *xb = bf16_round_rows(x, M, ldx, K, M);
    if (!xb) return 3;
    const __m512i interleave = bf16_pair_order();
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint16_t *bt = aligned_alloc(64, (size_t)blocks * 2048 + 64);
        failed = !bt;
#pragma omp for schedule(guided)
        for (int64_t pair = 0; pair < (ntiles + 1) / 2; pair++) {
            if (!bt) continue;
            const int64_t t = 2 * pair;
            const int two = t + 1 < ntiles;
            uint16_t *bt1 = bt + blocks * 512;
            for (int64_t b = 0; b < blocks; b++) {
                bf16_pack_block(qtype, tiles, t, b, blocks, tbb, interleave, bt + b * 512);
                if (two) bf16_pack_block(qtype, tiles, t + 1, b, blocks, tbb, interleave, bt1 + b * 512);
            }
            const __mmask16 v0 = dp_valid(N, t), v1 = two ? dp_valid(N, t + 1) : 0;
            for (int64_t m0 = 0; m0 < M; m0 += DP_ROWS) {
                const int R = M - m0 < DP_ROWS ? (int)(M - m0) : DP_ROWS;
                dp_rows_any(bt, bt1, two, xb + m0 * K, K, blocks, R, y + m0 * ldy, ldy, t * TR, v0, v1);
            }
        }
        free(bt);
    }
    free(xb);
    return failed ? 3 : 0;
}
#endif

#endif
