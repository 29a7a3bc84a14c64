/* quant_tiles.c's ACT_Q8_K kernel: x rounded to int8 with one scale per 256 values (llama.cpp's
   Q8_K activations), for calls of many rows (prefill chunks) on AVX-512 VNNI. Included by
   quant_tiles.c only, after the tiled kernels it builds on (tile_scales, q8_chunk).

   Why another int8 kernel. With a scale per 32 values (ACT_INT8), every row, tile and block
   costs three float instructions beside its 8 dot products (d da, its fma, the min's fma), and
   they issue on the pipes vpdpbusd issues on: 3 of every 11 issue slots go to them. With one
   scale da per 256 values, the block's d (the K-quants' d sc) multiplies the integer sum alone,
   and da multiplies a whole group's sum once: per row, tile and block one fma (two with mins).

   Layout. A pair of weight tiles is unpacked Q8K_CHUNK blocks at a time into a thread's
   buffer, per tile-block: each tile's 8 chunks of signed values (16 rows x 4 bytes each, as
   q8_chunk's), the chain start, d (and d1: Q6_K's values 16-31), and the mins. The values are the tile's
   quants with the offsets that are multiples of d folded in (Q4_0: q - 8, Q5_0: q - 16), so
   only Q4_1, Q5_1, Q4_K, Q5_K have mins. x goes in biased to unsigned bytes (v + 128): per
   block sum q (v + 128) = sum q v + 128 sum q, so each chain starts from -128 sum q (a
   weight-side constant, computed at unpacking) and ends at sum q v exactly.

   Then every row of x runs over those blocks, Q8K_ROWS rows at a time with their sums in
   registers (per chunk two weight loads, a broadcast per row, two dot products per row), each
   group's sum scaled by da into the rows' 32 sums in a per-thread buffer, stored to y once the
   pair's last chunk is done.

   Per row: y = sum_g da_g (sum_{b in g} d_b (q . v)_b + mn_b s_b), s_b the block's integer sum
   of v (the min multiplies x's sum). A row's result does not depend on the other rows of the
   call (row-local), only on this rounding of x. */
#ifndef TOKENBUS_TILES_Q8K_H
#define TOKENBUS_TILES_Q8K_H

#if defined(HAVE_TILES) && defined(__AVX512F__) && VI_DOT_VNNI
#define HAVE_Q8K_TILES 1

#define Q8K_GROUP 8  /* blocks of 32 per activation scale: 256 values */
/* Blocks of K unpacked at a time (whole groups): a pair's unpacked chunk (~23 KiB) stays in L1
   while every row passes it, where all of K (~90 KiB at K 2048) streamed from L2 for each row
   group. */
#define Q8K_CHUNK 16
/* Rows per pass: their dot sums and group sums stay in the register file (Q6_K: 16 + 8 of
   32, with 4 weight chunks and 2 broadcasts). */
#define Q8K_ROWS 4
#define Q8K_MAX_ROWS Q8K_ROWS

/* Whether the format has mins (a second sum per block). */
static inline int q8k_mins(int qtype) { return qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K; }

/* Bytes of one tile's unpacked block: 8 chunks, start(s), d (d1), mins. */
static inline int64_t q8k_tile_block_bytes(int qtype) {
    const int halves = split_scales(qtype) ? 2 : 1;
    return 512 + 64 * halves + 64 * halves + (q8k_mins(qtype) ? 64 : 0);
}

/* ---- x: per row, K bytes of v + 128 (v = round(x / da), |v| <= 127), da per group of up to 8
   blocks, and each block's sum of v (as float, for the mins). */
static void quantize_rows_q8k(const float *x, int64_t M, int64_t ldx, int64_t K, uint8_t *xu, float *da,
                              float *bsum, int num_threads) {
    const int64_t blocks = K / 32, groups = (blocks + Q8K_GROUP - 1) / Q8K_GROUP;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= QUANTIZE_PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t b0 = g * Q8K_GROUP, nb = blocks - b0 < Q8K_GROUP ? blocks - b0 : Q8K_GROUP;
            const float *xg = x + m * ldx + b0 * 32;
            __m512 mx = _mm512_setzero_ps();
            for (int64_t i = 0; i < nb * 32; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xg + i)));
            const float amax = _mm512_reduce_max_ps(mx), id = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512 vid = _mm512_set1_ps(id);
            da[m * groups + g] = amax / 127.0f;
            for (int64_t b = 0; b < nb; b++) {
                const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + 32 * b), vid)),
                              hi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + 32 * b + 16), vid));
                bsum[m * blocks + b0 + b] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
                const __m128i bias = _mm_set1_epi8((char)0x80);
                uint8_t *dst = xu + m * K + (b0 + b) * 32;
                _mm_storeu_si128((__m128i *)dst, _mm_xor_si128(_mm512_cvtepi32_epi8(lo), bias));
                _mm_storeu_si128((__m128i *)(dst + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(hi), bias));
            }
        }
}

/* ---- unpacking: tile t's block b into out (q8k_tile_block_bytes) */
static inline __attribute__((always_inline)) void q8k_unpack(const int qtype, const uint8_t *tiles, int64_t t,
                                                             int64_t b, int64_t blocks, int64_t tbb, uint8_t *out) {
    const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
    vi w[8], lo, hi;
    tile_chunks(qtype, tb, w);
    const int offset = qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : 0;  /* the value is d (q - offset) */
    for (int c = 0; c < 8; c++) {
        if (offset) w[c] = vi_sub8(w[c], vi_set8((int8_t)offset));
        _mm512_store_si512((void *)(out + 64 * c), w[c]);
    }
    uint8_t *p = out + 512;
    bias_starts(w, &lo, &hi);
    if (split_scales(qtype)) {  /* a start per half */
        _mm512_store_si512((void *)p, lo);
        _mm512_store_si512((void *)(p + 64), hi);
        p += 128;
    } else {
        _mm512_store_si512((void *)p, vi_add(lo, hi));
        p += 64;
    }
    vf d, d1, mn;
    tile_scales(qtype, tb, b, tbb, 0.0f, &d, &d1, &mn);
    _mm512_store_ps((float *)p, d);
    p += 64;
    if (split_scales(qtype)) {
        _mm512_store_ps((float *)p, d1);
        p += 64;
    }
    if (q8k_mins(qtype)) _mm512_store_ps((float *)p, mn);
}

/* ---- R rows of xu against the unpacked blocks [c0, c1) of a pair (pk): each row's 32 sums (the
   pair's columns) accumulated in acc (row stride 32 floats), group by group. The sums go
   through a per-thread buffer, not y: y's rows are a whole output row apart (64 KiB at N
   16384), and a read-modify-write of one per group and row is a page walk each. */
static inline __attribute__((always_inline)) void q8k_rows(const int qtype, const int R, const uint8_t *pk,
                                                           int64_t c0, int64_t c1, int64_t blocks,
                                                           const uint8_t *xu, int64_t K, const float *da,
                                                           const float *bsum, float *acc) {
    const int split = split_scales(qtype), mins = q8k_mins(qtype);
    const int64_t tbytes = q8k_tile_block_bytes(qtype), groups = (blocks + Q8K_GROUP - 1) / Q8K_GROUP;
    for (int64_t g = c0 / Q8K_GROUP; g * Q8K_GROUP < c1; g++) {
        const int64_t b0 = g * Q8K_GROUP, b1 = b0 + Q8K_GROUP < blocks ? b0 + Q8K_GROUP : blocks;
        __m512 gs[Q8K_MAX_ROWS][2];  /* the group's sums, before da */
        for (int r = 0; r < R; r++) gs[r][0] = gs[r][1] = _mm512_setzero_ps();
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t *blk[2] = {pk + 2 * (b - c0) * tbytes, pk + (2 * (b - c0) + 1) * tbytes};
            const int8_t *x = (const int8_t *)xu + b * 32;
            if (split) {  /* Q6_K: values 0-15 and 16-31 under scales of their own */
                __m512i lo[Q8K_MAX_ROWS][2], hi[Q8K_MAX_ROWS][2];
                for (int i = 0; i < 2; i++) {
                    const __m512i s0 = _mm512_load_si512((const void *)(blk[i] + 512)),
                                  s1 = _mm512_load_si512((const void *)(blk[i] + 576));
                    for (int r = 0; r < R; r++) { lo[r][i] = s0; hi[r][i] = s1; }
                }
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    __m512i w0 = _mm512_load_si512((const void *)(blk[0] + 64 * c)),
                            w1 = _mm512_load_si512((const void *)(blk[1] + 64 * c)),
                            h0 = _mm512_load_si512((const void *)(blk[0] + 256 + 64 * c)),
                            h1 = _mm512_load_si512((const void *)(blk[1] + 256 + 64 * c));
                    vi_keep(&w0);  /* loaded once for the R rows, not a memory operand of each dot */
                    vi_keep(&w1);
                    vi_keep(&h0);
                    vi_keep(&h1);
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const __m512i xl = vi_bcast32(x + r * K + 4 * c), xh = vi_bcast32(x + r * K + 16 + 4 * c);
                        lo[r][0] = _mm512_dpbusd_epi32(lo[r][0], xl, w0);
                        lo[r][1] = _mm512_dpbusd_epi32(lo[r][1], xl, w1);
                        hi[r][0] = _mm512_dpbusd_epi32(hi[r][0], xh, h0);
                        hi[r][1] = _mm512_dpbusd_epi32(hi[r][1], xh, h1);
                    }
                }
                for (int i = 0; i < 2; i++) {
                    const __m512 d = _mm512_load_ps((const float *)(blk[i] + 640)),
                                 d1 = _mm512_load_ps((const float *)(blk[i] + 704));
                    for (int r = 0; r < R; r++)
                        gs[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r][i]), d1,
                                                   _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[r][i]), d, gs[r][i]));
                }
                continue;
            }
            __m512i s[Q8K_MAX_ROWS][2];
            for (int i = 0; i < 2; i++) {
                const __m512i start = _mm512_load_si512((const void *)(blk[i] + 512));
                for (int r = 0; r < R; r++) s[r][i] = start;
            }
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                __m512i w0 = _mm512_load_si512((const void *)(blk[0] + 64 * c)),
                        w1 = _mm512_load_si512((const void *)(blk[1] + 64 * c));
                vi_keep(&w0);
                vi_keep(&w1);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m512i xv = vi_bcast32(x + r * K + 4 * c);
                    s[r][0] = _mm512_dpbusd_epi32(s[r][0], xv, w0);
                    s[r][1] = _mm512_dpbusd_epi32(s[r][1], xv, w1);
                }
            }
            for (int i = 0; i < 2; i++) {
                const __m512 d = _mm512_load_ps((const float *)(blk[i] + 576));
                for (int r = 0; r < R; r++) gs[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][i]), d, gs[r][i]);
                if (mins) {
                    const __m512 mn = _mm512_load_ps((const float *)(blk[i] + 640));
                    for (int r = 0; r < R; r++)
                        gs[r][i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(bsum[r * blocks + b]), gs[r][i]);
                }
            }
        }
        for (int r = 0; r < R; r++) {  /* acc += da_g x the group's sums (the first group: =) */
            const __m512 dag = _mm512_set1_ps(da[r * groups + g]);
            float *ar = acc + 32 * r;
            for (int i = 0; i < 2; i++)
                _mm512_store_ps(ar + 16 * i, _mm512_fmadd_ps(gs[r][i], dag, g ? _mm512_load_ps(ar + 16 * i)
                                                                              : _mm512_setzero_ps()));
        }
    }
}

/* Every row of x against the unpacked blocks [c0, c1), Q8K_ROWS at a time (the last pass fewer):
   one compiled copy per (type, R). */
static inline __attribute__((always_inline)) void q8k_pair(const int qtype, const uint8_t *pk, int64_t c0,
                                                           int64_t c1, int64_t blocks, const uint8_t *xu, int64_t M,
                                                           int64_t K, const float *da, const float *bsum,
                                                           float *acc) {
    const int64_t groups = (blocks + Q8K_GROUP - 1) / Q8K_GROUP;
    for (int64_t m = 0; m < M; m += Q8K_ROWS) {
        const uint8_t *x = xu + m * K;
        const float *dm = da + m * groups, *bm = bsum + m * blocks;
        float *am = acc + 32 * m;
        switch (M - m < Q8K_ROWS ? M - m : Q8K_ROWS) {
        case 4: q8k_rows(qtype, 4, pk, c0, c1, blocks, x, K, dm, bm, am); break;
        case 3: q8k_rows(qtype, 3, pk, c0, c1, blocks, x, K, dm, bm, am); break;
        case 2: q8k_rows(qtype, 2, pk, c0, c1, blocks, x, K, dm, bm, am); break;
        default: q8k_rows(qtype, 1, pk, c0, c1, blocks, x, K, dm, bm, am); break;
        }
    }
}

static inline __mmask16 q8k_valid(int64_t N, int64_t t) {
    const int64_t left = N - t * TR;
    return left >= TR ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

/* Tiles t and t + 1 (t again where t + 1 is past the last: its columns masked off) against every
   row: unpacked Q8K_CHUNK blocks at a time into pk, the sums in acc, then into y. */
static inline __attribute__((always_inline)) void q8k_tile_pair(const int qtype, const uint8_t *tiles,
                                                                int64_t ntiles, int64_t blocks, int64_t tbb,
                                                                int64_t N, int64_t t, uint8_t *pk, float *acc,
                                                                const uint8_t *xu, int64_t M, int64_t K,
                                                                const float *da, const float *bsum, float *y,
                                                                int64_t ldy) {
    const int64_t tbytes = q8k_tile_block_bytes(qtype), t1 = t + 1 < ntiles ? t + 1 : t;
    for (int64_t c0 = 0; c0 < blocks; c0 += Q8K_CHUNK) {
        const int64_t c1 = c0 + Q8K_CHUNK < blocks ? c0 + Q8K_CHUNK : blocks;
        for (int64_t b = c0; b < c1; b++) {
            q8k_unpack(qtype, tiles, t, b, blocks, tbb, pk + 2 * (b - c0) * tbytes);
            q8k_unpack(qtype, tiles, t1, b, blocks, tbb, pk + (2 * (b - c0) + 1) * tbytes);
        }
        q8k_pair(qtype, pk, c0, c1, blocks, xu, M, K, da, bsum, acc);
    }
    const __mmask16 v0 = q8k_valid(N, t), v1 = t1 == t ? (__mmask16)0 : q8k_valid(N, t1);
    for (int64_t m = 0; m < M; m++) {
        _mm512_mask_storeu_ps(y + m * ldy + t * TR, v0, _mm512_load_ps(acc + 32 * m));
        _mm512_mask_storeu_ps(y + m * ldy + t * TR + TR, v1, _mm512_load_ps(acc + 32 * m + 16));
    }
}

static void q8k_tile_pair_any(int qtype, const uint8_t *tiles, int64_t ntiles, int64_t blocks, int64_t tbb,
                              int64_t N, int64_t t, uint8_t *pk, float *acc, const uint8_t *xu, int64_t M,
                              int64_t K, const float *da, const float *bsum, float *y, int64_t ldy) {
#define Q8K_CASE(type)                                                                                        \
    case type: q8k_tile_pair(type, tiles, ntiles, blocks, tbb, N, t, pk, acc, xu, M, K, da, bsum, y, ldy); break;
    switch (qtype) {
        Q8K_CASE(Q8_0) Q8K_CASE(Q4_0) Q8K_CASE(Q4_1) Q8K_CASE(Q5_0) Q8K_CASE(Q5_1) Q8K_CASE(IQ4_NL)
        Q8K_CASE(Q4_K) Q8K_CASE(Q5_K) Q8K_CASE(Q6_K) Q8K_CASE(IQ4_XS) Q8K_CASE(MXFP4)
    }
#undef Q8K_CASE
}

/* y = x W^T under ACT_Q8_K. 0 on success, 3 out of memory. */
static int q8k_matmul(int qtype, const uint8_t *tiles, int64_t ntiles, int64_t blocks, int64_t tbb, int64_t N,
                      int64_t K, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int num_threads) {
    const int64_t groups = (blocks + Q8K_GROUP - 1) / Q8K_GROUP;
    uint8_t *xu = aligned_alloc(64, (size_t)(M * K) + sizeof(float) * (size_t)(M * (groups + blocks)) + 64);
    if (!xu) return 3;
    float *da = (float *)(((uintptr_t)xu + (size_t)(M * K) + 63) & ~(uintptr_t)63), *bsum = da + M * groups;
    quantize_rows_q8k(x, M, ldx, K, xu, da, bsum, num_threads);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint8_t *pk = aligned_alloc(64, (size_t)(2 * Q8K_CHUNK * q8k_tile_block_bytes(qtype)) + 64);
        float *acc = aligned_alloc(64, sizeof(float) * 32 * (size_t)M + 64);
        failed = !pk || !acc;
        /* guided, as tile_matmul's loops: a pair's columns are one thread's whole */
#pragma omp for schedule(guided)
        for (int64_t pair = 0; pair < (ntiles + 1) / 2; pair++)
            if (!failed)
                q8k_tile_pair_any(qtype, tiles, ntiles, blocks, tbb, N, 2 * pair, pk, acc, xu, M, K, da, bsum, y, ldy);
        free(pk);
        free(acc);
    }
    free(xu);
    return failed ? 3 : 0;
}
#endif

#endif
