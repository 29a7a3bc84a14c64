/* quant_tiles.c's kernels for fp32 activations (weight-only: results match dequantize-then-matmul
   to rounding), and whole tiles dequantized as W^T for the prefill GEMM. Included by quant_tiles.c
   only. */
#ifndef TOKENBUS_TILES_FP32_H
#define TOKENBUS_TILES_FP32_H

/* ---- fp32 activations */
/* The 32 quants of a tile-block as fp32: quant k of the 16 rows in q[k]. */
static inline void unpack_fp32(int qtype, const uint8_t *tb, vf *q) {
    if (q8_chunks(qtype)) {
        for (int c = 0; c < 8; c++) {  /* byte j of each lane, sign-extended */
            const vi raw = q8_chunk(qtype, tb, c);
            q[4 * c + 0] = vf_cvt(vi_srai32(vi_slli32(raw, 24), 24));
            q[4 * c + 1] = vf_cvt(vi_srai32(vi_slli32(raw, 16), 24));
            q[4 * c + 2] = vf_cvt(vi_srai32(vi_slli32(raw, 8), 24));
            q[4 * c + 3] = vf_cvt(vi_srai32(raw, 24));
        }
        return;
    }
    const vi nibble = vi_set32(0xF);
    for (int c = 0; c < 4; c++) {  /* nibble 2j of each lane is value 4c+j, nibble 2j+1 value 16+4c+j */
        const vi raw = vi_load(tb + 64 * c);
        for (int j = 0; j < 4; j++) {
            q[4 * c + j] = vf_cvt(vi_and(vi_srli32(raw, 8 * j), nibble));
            q[16 + 4 * c + j] = vf_cvt(vi_and(vi_srli32(raw, 8 * j + 4), nibble));
        }
    }
}

/* xsum[m * blocks + b]: the sum of block b of x row m (for the mins). */
static void tile_fp32(int qtype, int qb, const uint8_t *tiles, int64_t blocks, int64_t tbb, const float *x,
                      int64_t ldx, const float *xsum, int64_t M, float *y, int64_t ldy, int64_t N, int64_t t) {
    vf accd[MAX_M], accm[MAX_M], q[32];
    for (int64_t m = 0; m < M; m++) { accd[m] = vf_zero(); accm[m] = vf_zero(); }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
        vf d, d1, mn;
        tile_scales(qtype, tb, b, tbb, 0.0f, &d, &d1, &mn);
        unpack_fp32(qtype, tb, q);
        for (int64_t m = 0; m < M; m++) {
            const float *xb = x + m * ldx + b * 32;
            vf s[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};  /* four chains: FMA latency */
            if (split_scales(qtype)) {  /* values 0-15 and 16-31 under their own scales */
                for (int k = 0; k < 32; k++) s[k / 16 * 2 + k % 2] = vf_fma(q[k], vf_set1(xb[k]), s[k / 16 * 2 + k % 2]);
                accd[m] = vf_fma(vf_add(s[2], s[3]), d1, vf_fma(vf_add(s[0], s[1]), d, accd[m]));
                continue;
            }
            for (int k = 0; k < 32; k++) s[k % 4] = vf_fma(q[k], vf_set1(xb[k]), s[k % 4]);
            accd[m] = vf_fma(vf_add(vf_add(s[0], s[1]), vf_add(s[2], s[3])), d, accd[m]);
            accm[m] = vf_fma(mn, vf_set1(xsum[m * blocks + b]), accm[m]);
        }
    }
    finish_tile(accd, accm, M, y, ldy, N, t);
}

/* out [K, 16 * count] (row stride ldo) = W^T for tiles [first, first + count): the prefill GEMM
   reads it as x @ out. Rows past N come out 0. */
static void tile_dequant_t_one(int qtype, int qb, const uint8_t *tiles, int64_t blocks, int64_t tbb, int64_t t,
                               float *out, int64_t ldo) {
    vf q[32];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
        vf d, d1, mn;
        tile_scales(qtype, tb, b, tbb, 0.0f, &d, &d1, &mn);
        unpack_fp32(qtype, tb, q);
        for (int k = 0; k < 32; k++) vf_store(out + (b * 32 + k) * ldo, vf_fma(q[k], k < 16 ? d : d1, mn));
    }
}

#endif
