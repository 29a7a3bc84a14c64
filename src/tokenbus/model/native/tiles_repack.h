/* quant_tiles.c's repacking: GGUF rows into tiles of 16 rows (tile_repack), the layout its
   kernels read. Included by quant_tiles.c only, after the tile geometry it uses. */
#ifndef TOKENBUS_TILES_REPACK_H
#define TOKENBUS_TILES_REPACK_H

/* ---- Repacking. Per tile-block, chunk c is 16 rows x 4 bytes, row r's being bytes [4c, 4c + 4)
   of its quants, then the block's scales (each row's at r). The quants, by format:
     Q8_0               the file's int8 bytes (chunk c: values 4c..4c+3)
     Q4_0, Q4_1, Q4_K   nibbles, 16 bytes a row (byte i: value i low, value 16 + i high)
     IQ4_NL, IQ4_XS     the same nibbles, which index the IQ4 table
     MXFP4              the same nibbles, which index the MXFP4 table
     Q5_0, Q5_1, Q5_K   those nibbles, then a plane of 4 bytes a row laid out as a Q8_0 chunk:
                        bit c of the byte of value 4c + i is that value's fifth bit
     Q6_K (and Q3_K)    nibbles of q + 32 (0..63), then two such planes of its top 2 bits: value
                        4c + i's in bits 2 (c % 4) of plane c / 4
   and the scales: fp16 d (Q8_0, Q4_0, Q5_0, IQ4_NL) and m (Q4_1, Q5_1); the K-quants' sub-block
   scales as bytes (Q4_K, Q5_K: 6-bit scale and min; Q6_K: int8 scales of values 0-15 and 16-31;
   IQ4_XS: its int8 scale) with the super-block's fp16 d (and dmin) in a header per 8
   tile-blocks. MXFP4 keeps its E8M0 byte e as the file has it, and its scale 2^(e - 128) is made
   in fp32 at run time (vf_e8m0_half), exactly: fp16 would hold that power of two only for e in
   104..143, and gguf writes e = 0 for an all-zero block. The K-quants' values are d sc q
   (- dmin m), multiplied out in fp32 at run time as ggml's dequantization does. Bytes per 256
   values and row: the file's for the 32-value types (MXFP4's included); Q4_K 148 (144), Q5_K 180 (176), Q6_K 210 (210), IQ4_XS 138 (136), Q3_K 210 (110). */

/* Row r's 32 values q of a tile-block (Q6_K: -32..31; IQ4, MXFP4: table indices 0..15), as the
   format keeps them. */
static void put_values(int fmt, uint8_t *tb, int r, const int8_t *q) {
    if (fmt == Q8_0) {
        for (int c = 0; c < 8; c++) memcpy(tb + c * 64 + r * 4, q + 4 * c, 4);
        return;
    }
    const int planes = fmt == Q6_K ? 2 : fmt == Q5_0 || fmt == Q5_1 || fmt == Q5_K ? 1 : 0;
    uint8_t u[32], bytes[16], high[2][4] = {{0}};
    for (int k = 0; k < 32; k++) u[k] = (uint8_t)(fmt == Q6_K ? q[k] + 32 : q[k]);
    for (int i = 0; i < 16; i++) bytes[i] = (uint8_t)((u[i] & 0xF) | (u[i + 16] & 0xF) << 4);
    for (int c = 0; c < 4; c++) memcpy(tb + c * 64 + r * 4, bytes + 4 * c, 4);
    for (int k = 0; k < 32 && planes; k++)  /* chunk k / 4's bits, at byte k % 4 of row r's 4 */
        high[planes == 2 ? k / 16 : 0][k % 4] |= (uint8_t)((u[k] >> 4) << (planes == 2 ? 2 * (k / 4 % 4) : k / 4));
    for (int p = 0; p < planes; p++) memcpy(tb + 256 + 64 * p + r * 4, high[p], 4);
}

/* Values and bytes of one GGUF block of a type tiles take. */
static int source_block(int qtype, int *values, int *bytes) {
    switch (qtype) {
    case Q8_0: *values = 32; *bytes = Q8_0_BLOCK; return 1;
    case Q4_0: *values = 32; *bytes = Q4_0_BLOCK; return 1;
    case Q4_1: *values = 32; *bytes = Q4_1_BLOCK; return 1;
    case Q5_0: *values = 32; *bytes = Q5_0_BLOCK; return 1;
    case Q5_1: *values = 32; *bytes = Q5_1_BLOCK; return 1;
    case IQ4_NL: *values = 32; *bytes = IQ4_NL_BLOCK; return 1;
    case MXFP4: *values = 32; *bytes = MXFP4_BLOCK; return 1;
    case Q3_K: *values = QK_K; *bytes = Q3_K_BLOCK; return 1;
    case Q4_K: *values = QK_K; *bytes = Q4_K_BLOCK; return 1;
    case Q5_K: *values = QK_K; *bytes = Q5_K_BLOCK; return 1;
    case Q6_K: *values = QK_K; *bytes = Q6_K_BLOCK; return 1;
    case IQ4_XS: *values = QK_K; *bytes = IQ4_XS_BLOCK; return 1;
    case F16: case BF16: *values = 32; *bytes = HALF_BLOCK; return 1;
    default: return 0;
    }
}

/* Row r of one 32-value GGUF block (src) into tile-block tb (of the same format). */
static void repack_block32(int qtype, const uint8_t *src, uint8_t *tb, int r) {
    if (half_type(qtype)) {  /* value k of the 16 rows side by side (tiles_half.h) */
        for (int k = 0; k < 32; k++) memcpy(tb + 2 * (TR * k + r), src + 2 * k, 2);
        return;
    }
    const int qb = quant_bytes(qtype);
    if (qtype == MXFP4) {  /* e, qs[16]: the file's nibbles, then e as the row's scale byte */
        for (int c = 0; c < 4; c++) memcpy(tb + c * 64 + r * 4, src + 1 + 4 * c, 4);
        tb[qb * TR + r] = src[0];
        return;
    }
    if (qtype == Q8_0 || qtype == Q4_0 || qtype == Q4_1 || qtype == IQ4_NL) {  /* the file's bytes */
        const int qoff = qtype == Q4_1 ? 4 : 2;
        for (int c = 0; c < qb / 4; c++) memcpy(tb + c * 64 + r * 4, src + qoff + 4 * c, 4);
    } else {  /* Q5_0, Q5_1: d, (m,) qh[4], qs[16] */
        int8_t q[32];
        q5_values(src + (qtype == Q5_1 ? 4 : 2), src + (qtype == Q5_1 ? 8 : 6), q);
        put_values(qtype, tb, r, q);
    }
    memcpy(tb + qb * TR + 2 * r, src, 2);
    if (qtype == Q4_1 || qtype == Q5_1) memcpy(tb + qb * TR + 2 * TR + 2 * r, src + 2, 2);
}

/* Row r of one 256-value GGUF super-block (src) into tile t's group s of format fmt. */
static void repack_super(int qtype, int fmt, const uint8_t *src, uint8_t *out, int64_t t, int64_t s,
                         int64_t blocks, int64_t tbb, int r) {
    uint8_t *hdr = tile_block(fmt, out, t, s * QK_GROUP, blocks, tbb) - group_header_bytes(fmt);
    int8_t q[QK_K];
    int scales[16];  /* Q6_K format: per 16 values */
    switch (qtype) {
    case Q4_K: case Q5_K:  /* d, dmin, scales[12], (Q5_K: qh[32],) qs[128] */
        memcpy(hdr + 2 * r, src, 2);
        memcpy(hdr + 2 * TR + 2 * r, src + 2, 2);
        for (int j = 0; j < QK_GROUP; j++) {
            uint8_t *tb = tile_block(fmt, out, t, s * QK_GROUP + j, blocks, tbb);
            const int qb = quant_bytes(fmt);
            if (qtype == Q4_K) {  /* sub-block j's nibbles: the low (j even) or high ones of 32 bytes */
                const uint8_t *qs = src + 16 + 32 * (j / 2);
                uint8_t bytes[16];
                for (int i = 0; i < 16; i++)
                    bytes[i] = j % 2 ? (uint8_t)((qs[i] >> 4) | (qs[i + 16] & 0xF0))
                                     : (uint8_t)((qs[i] & 0xF) | (qs[i + 16] & 0xF) << 4);
                for (int c = 0; c < 4; c++) memcpy(tb + c * 64 + r * 4, bytes + 4 * c, 4);
            } else {
                k_sub_values(src + 48, src + 16, j, q);
                put_values(fmt, tb, r, q);
            }
            k4_scale_min(j, src + 4, tb + qb * TR + r, tb + qb * TR + TR + r);
        }
        return;
    case Q6_K:  /* ql[128], qh[64], scales[16], d */
        q6_k_values(src, q);
        for (int i = 0; i < 16; i++) scales[i] = (int8_t)src[192 + i];
        memcpy(hdr + 2 * r, src + 208, 2);
        break;
    case Q3_K:  /* hmask[32], qs[64], scales[12], d */
        q3_k_values(src, q);
        for (int i = 0; i < 16; i++) scales[i] = q3_k_scale(src + 96, i);
        memcpy(hdr + 2 * r, src + 108, 2);
        break;
    default:  /* IQ4_XS: d, scales_h, scales_l[4], qs[128] (the file's nibbles); a scale per 32 */
        memcpy(hdr + 2 * r, src, 2);
        for (int j = 0; j < QK_GROUP; j++) {
            uint8_t *tb = tile_block(fmt, out, t, s * QK_GROUP + j, blocks, tbb);
            for (int c = 0; c < 4; c++) memcpy(tb + c * 64 + r * 4, src + 8 + 16 * j + 4 * c, 4);
            tb[16 * TR + r] = (uint8_t)(int8_t)iq4_xs_scale(src, j);
        }
        return;
    }
    for (int j = 0; j < QK_GROUP; j++) {  /* Q6_K's format */
        uint8_t *tb = tile_block(fmt, out, t, s * QK_GROUP + j, blocks, tbb);
        put_values(fmt, tb, r, q + 32 * j);
        tb[24 * TR + r] = (uint8_t)(int8_t)scales[2 * j];
        tb[24 * TR + TR + r] = (uint8_t)(int8_t)scales[2 * j + 1];
    }
}

/* out (tile_nbytes) <- W of GGUF type qtype, in rows, as tiles of its tile_format. 0 on
   success, 1: not tiled. Rows are independent (each writes its own bytes of every tile-block). */
int tile_repack(int qtype, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    const int fmt = tile_format(qtype);
    int values, bytes;
    int64_t blocks, tbb, tile_bytes, tiles = tile_geometry(fmt, N, K, &blocks, &tbb, &tile_bytes);
    if (!tiles || !source_block(qtype, &values, &bytes) || K % values) return 1;
    const int64_t per_row = K / values;
    /* Tiles zeroed (rows past N stay 0) by all threads, then filled by rows: a tile's 16 rows may
       fall to two threads, which write different bytes of it. Both passes in parallel: the first
       touch of each page of `out` is its page fault. */
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) memset(out + t * tile_bytes, 0, (size_t)tile_bytes);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t i = 0; i < per_row; i++) {
                const uint8_t *src = w + (n * per_row + i) * bytes;
                if (values == QK_K) repack_super(qtype, fmt, src, out, n / TR, i, blocks, tbb, (int)(n % TR));
                else repack_block32(qtype, src, tile_block(fmt, out, n / TR, i, blocks, tbb), (int)(n % TR));
            }
    }
    return 0;
}

#endif
