/* Q8_0 / Q4_0 / Q4_1 weights repacked in tiles of 16 rows, for decode-shaped matmuls
   (tokenbus, model/native).

   GGUF stores a matrix row by row, block by block. Dotting one row at a time leaves a GEMV
   latency-bound: one accumulator chain per row, a horizontal sum per output, a scalar scale per
   block. Here 16 rows are interleaved so that one 16-lane vector holds the same 4 quants of 16
   rows and the scales of a block are 16 fp16 values in a row: each instruction then works for
   16 outputs, and a tile's 16 results come out as one vector store.

   Layout, per tile of rows [16t, 16t + 16) and per block b of 32 values (tile-block), in the
   same bytes as the 16 GGUF blocks it replaces (nothing is added):
       chunks: Q4_0/Q4_1 4, Q8_0 8; chunk c is 16 rows x 4 bytes, row r's being bytes
               [4c, 4c + 4) of that row's GGUF quants (for Q4: the low nibbles are values
               4c..4c+3, the high ones 16+4c..16+4c+3; for Q8_0 the bytes are values 4c..4c+3)
       d[16]:  fp16 scales, row r at 2r
       m[16]:  fp16 mins (Q4_1 only)
   A matrix is ceil(N / 16) tiles of (K / 32) tile-blocks; rows past N are zero (d = 0).

   Kernels per call shape, y[m, n] = sum_k x[m, k] W[n, k] (y row-strided: a column slice of a
   wider output), and with AVX512-BF16 (AMX or not) a third for any number of rows (bf16, below):
   - fp32 activations (weight-only): each quant is converted to fp32 and multiplied exactly as a
     dequantize-then-matmul would, so results match that reference to rounding;
   - int8 activations (llama.cpp's approach): each 32-value block of an x row is quantized to
     int8 with scale da = max|x| / 127, and a tile-block is 8 integer dot products of 4 bytes
     per lane (vpdpbusd on VNNI, vpmaddubsw + vpmaddwd otherwise):
         sum_j (d q_j + m) x_j  ~=  d da (q . qa) + m sa,   sa = da sum_j qa_j.
     Q4 nibbles are unsigned already. Q8_0's signed quants go in biased by 128 on VNNI (and
     the bias comes back out as m = -128 d) or as |q| with the sign moved onto qa otherwise.
     Q4_0 is Q4_1 with m = -8 d. The integer part is exact (|q| <= 128, |qa| <= 127: int16 pair
     sums stay below 32767); only the rounding of x differs from the fp32 kernel.
   Also: repacking from GGUF rows, and dequantizing (rows for embeddings; whole tiles as W^T
   for the prefill GEMM). Built like quant_matmul.c (-O3 -march=<cpu> -ffast-math, OpenMP over
   tiles, every thread writing only its own columns of y). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TR 16      /* rows per tile */
#define MAX_M 64   /* activation rows per call (QUANT_MAX_ROWS) */

enum { Q8_0 = 8, Q4_0 = 2, Q4_1 = 3 };  /* GGMLQuantizationType */
enum { ACT_FP32 = 0, ACT_INT8 = 1, ACT_INT16 = 2, ACT_BF16 = 3 };  /* how tile_matmul takes x */

/* Bytes of one GGUF block, of its quants, and whether it carries a min. 0 if not tiled. */
static int tile_info(int qtype, int *block_bytes, int *quant_bytes, int *has_min) {
    switch (qtype) {
    case Q8_0: *block_bytes = 34; *quant_bytes = 32; *has_min = 0; return 1;
    case Q4_0: *block_bytes = 18; *quant_bytes = 16; *has_min = 0; return 1;
    case Q4_1: *block_bytes = 20; *quant_bytes = 16; *has_min = 1; return 1;
    default: return 0;
    }
}

/* Tile-blocks the matrix has, and the size of one; 0 if the type or shape is not tiled. */
static int64_t tile_geometry(int qtype, int64_t N, int64_t K, int64_t *blocks, int64_t *tile_block_bytes) {
    int bb, qb, hm;
    if (!tile_info(qtype, &bb, &qb, &hm) || K % 32 || N <= 0) return 0;
    *blocks = K / 32;
    *tile_block_bytes = (int64_t)TR * bb;
    return (N + TR - 1) / TR;
}

int64_t tile_nbytes(int qtype, int64_t N, int64_t K) {
    int64_t blocks, tbb, tiles = tile_geometry(qtype, N, K, &blocks, &tbb);
    return tiles * blocks * tbb;
}

/* out (tile_nbytes) <- W in GGUF rows [N, K / 32 blocks]. 0 on success, 1: not tiled. */
int tile_repack(int qtype, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    int bb, qb, hm;
    int64_t blocks, tbb, tiles = tile_geometry(qtype, N, K, &blocks, &tbb);
    if (!tiles) return 1;
    tile_info(qtype, &bb, &qb, &hm);
    const int qoff = hm ? 4 : 2;
    memset(out, 0, (size_t)(tiles * blocks * tbb));
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n / TR, r = n % TR;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *src = w + (n * blocks + b) * bb;
            uint8_t *dst = out + (t * blocks + b) * tbb;
            for (int c = 0; c < qb / 4; c++) memcpy(dst + c * 64 + r * 4, src + qoff + 4 * c, 4);
            memcpy(dst + qb * TR + 2 * r, src, 2);
            if (hm) memcpy(dst + qb * TR + 2 * TR + 2 * r, src + 2, 2);
        }
    }
    return 0;
}

#include "tile_vectors.h"

/* Tile-blocks a thread asks the memory system for ahead of the one it multiplies: a decode
   step streams every weight once, and the hardware prefetcher alone did not keep it fed
   (benchmarks/cpu_speed.py's tg128 decides the distance). Prefetches never fault, so the
   last blocks' run past the end harmlessly. */
#define PREFETCH_AHEAD 8
static inline void prefetch_ahead(const uint8_t *tb, int64_t tbb) {
    for (int64_t off = 0; off < tbb; off += 64) __builtin_prefetch(tb + PREFETCH_AHEAD * tbb + off);
}

#ifdef HAVE_TILES
/* The d and m vectors of a tile-block (m = -8d for Q4_0, -Q8_BIAS d or 0 for Q8_0 under int8
   activations, 0 for Q8_0 under fp32 ones). */
static inline void tile_scales(int qtype, const uint8_t *tb, int qb, float q8_bias, vf *d, vf *m) {
    *d = vf_half(tb + qb * TR);
    if (qtype == Q4_1) *m = vf_half(tb + qb * TR + 2 * TR);
    else *m = vf_mul(*d, vf_set1(qtype == Q4_0 ? -8.0f : -q8_bias));
}

/* Tile t's 16 outputs (those below N) of M rows into y: the scaled dots plus the mins. */
static inline void finish_tile(const vf *accd, const vf *accm, int64_t M, float *y, int64_t ldy, int64_t N,
                               int64_t t) {
    const int64_t n0 = t * TR, valid = N - n0 < TR ? N - n0 : TR;
    for (int64_t m = 0; m < M; m++) {
        const vf acc = vf_add(accd[m], accm[m]);
        if (valid == TR) {
            vf_store(y + m * ldy + n0, acc);
        } else {
            float tmp[TR];
            vf_store(tmp, acc);
            memcpy(y + m * ldy + n0, tmp, sizeof(float) * (size_t)valid);
        }
    }
}

/* Value k (< 32) of row r in a tile-block, before scale and min. */
static int tile_quant(int qtype, const uint8_t *tb, int r, int k) {
    if (qtype == Q8_0) return (int8_t)tb[(k / 4) * 64 + r * 4 + k % 4];
    const int low = k < 16, kk = low ? k : k - 16;
    const uint8_t byte = tb[(kk / 4) * 64 + r * 4 + kk % 4];
    return low ? (byte & 0xF) : (byte >> 4);
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
    const vi nibble = vi_set8(0xF), bias = vi_set8((int8_t)0x80);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb = tiles + (t * blocks + b) * tbb;
        prefetch_ahead(tb, tbb);
        vf d, mn;
        tile_scales(qtype, tb, qb, (float)Q8_BIAS, &d, &mn);
        vi w[8];  /* w[c]: the quants that meet dword c of an activation block */
        if (qtype == Q8_0) {
            for (int c = 0; c < 8; c++) w[c] = Q8_BIAS ? vi_xor(vi_load(tb + 64 * c), bias) : vi_load(tb + 64 * c);
        } else {
            for (int c = 0; c < 4; c++) {
                const vi raw = vi_load(tb + 64 * c);
                w[c] = vi_and(raw, nibble);
                w[c + 4] = vi_and(vi_srli16(raw, 4), nibble);
            }
        }
        for (int64_t m = 0; m < M; m++) {
            const int8_t *a = qa + m * K + b * 32;
            vi i0 = vi_zero(), i1 = vi_zero();  /* two chains: the dot latency is 5 cycles */
            for (int c = 0; c < 8; c += 2) {
                if (qtype == Q8_0 && !Q8_BIAS) {
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
    const vi nibble = vi_set8(0xF);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *tb = tiles + (t * blocks + b) * tbb;
        prefetch_ahead(tb, tbb);
        vf d, mn;
        tile_scales(qtype, tb, qb, 0.0f, &d, &mn);
        vi w[8];  /* as tile_q8a's */
        for (int c = 0; c < 4; c++) {
            const vi raw = vi_load(tb + 64 * c);
            w[c] = vi_and(raw, nibble);
            w[c + 4] = vi_and(vi_srli16(raw, 4), nibble);
        }
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

/* Q16_ROWS rows of x (R <= Q16_ROWS; a constant where inlined) against one tile-block's 16
   int16 weight groups w: out[r] = the integer dots of row r (a, row stride lda bytes). The rows
   go R at a time so that each w[p] is read once per R rows, not once per row: on AVX2 the 16
   groups are 32 ymm, twice the register file, and a row at a time spent more load slots than
   dot products (slower than the int8 kernel: quant_linear.py --step --rows 16). Q16_ROWS
   chains in all, C per row: vpdpwssd (VNNI) has 5 cycles of latency on its accumulator. */
#define Q16_ROWS 4
static inline __attribute__((always_inline)) void q16_dots(const vi *w, const int8_t *a, int64_t lda, int R,
                                                           vi *out) {
    const int C = R == 1 ? 4 : R == 2 ? 2 : 1;
    vi acc[Q16_ROWS];
    for (int i = 0; i < R * C; i++) acc[i] = vi_zero();
#pragma GCC unroll 16
    for (int p = 0; p < 16; p++)
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
    if (qtype == Q8_0) return j == 0 ? vi_srai16(vi_slli16(raw, 8), 8) : vi_srai16(raw, 8);
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
static inline __attribute__((always_inline)) vi q16_dots_row(int qtype, const uint8_t *tb, const int8_t *a) {
    if (qtype == Q8_0) {
        vi acc[4] = {vi_zero(), vi_zero(), vi_zero(), vi_zero()};
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const vi raw = vi_load(tb + 64 * c);
            const int i = 2 * (c % 2);
            acc[i] = vi_dot16(acc[i], q16_group(Q8_0, raw, 0), vi_bcast32(a + 8 * c));
            acc[i + 1] = vi_dot16(acc[i + 1], q16_group(Q8_0, raw, 1), vi_bcast32(a + 8 * c + 4));
            vi_keep(&acc[i]);
            vi_keep(&acc[i + 1]);
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
        const uint8_t *tb = tiles + (t * blocks + b) * tbb;
        prefetch_ahead(tb, tbb);
        vf d, mn;
        tile_scales(qtype, tb, qb, 0.0f, &d, &mn);
        const vi dots = q16_dots_row(qtype, tb, (const int8_t *)(qa + b * 32));
        accd = vf_fma(vf_cvt(dots), vf_mul(d, vf_set1(da[b])), accd);
        accm = vf_fma(mn, vf_set1(sa[b]), accm);
    }
    finish_tile(&accd, &accm, 1, y, 0, N, t);
}

static __attribute__((noinline)) void tile_q16a_one(int qtype, int qb, const uint8_t *tiles, int64_t blocks,
                                                    int64_t tbb, const int16_t *qa, const float *da,
                                                    const float *sa, float *y, int64_t N, int64_t t) {
    switch (qtype) {  /* a constant type in each copy */
    case Q8_0: q16a_one(Q8_0, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
    case Q4_0: q16a_one(Q4_0, qb, tiles, blocks, tbb, qa, da, sa, y, N, t); break;
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
        const uint8_t *tb = tiles + (t * blocks + b) * tbb;
        vf d, mn;
        tile_scales(qtype, tb, qb, 0.0f, &d, &mn);
        const int8_t *a = (const int8_t *)(qa + b * 32);
        prefetch_ahead(tb, tbb);
        vi w[16];  /* w[2p], w[2p + 1]: int16 pairs (k, k+2), (k+1, k+3) of activation group p */
        if (qtype == Q8_0) {
            for (int c = 0; c < 8; c++) {
                const vi raw = vi_load(tb + 64 * c);
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
            vi dots[Q16_ROWS];
            const int64_t R = M - m0 < Q16_ROWS ? M - m0 : Q16_ROWS;
            switch (R) {  /* constant R: the row loops unrolled, the accumulators in registers */
            case 4: q16_dots(w, a + m0 * lda, lda, 4, dots); break;
            case 3: q16_dots(w, a + m0 * lda, lda, 3, dots); break;
            case 2: q16_dots(w, a + m0 * lda, lda, 2, dots); break;
            default: q16_dots(w, a + m0 * lda, lda, 1, dots); break;
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

/* ---- fp32 activations */
/* The 32 quants of a tile-block as fp32: quant k of the 16 rows in q[k]. */
static inline void unpack_fp32(int qtype, const uint8_t *tb, vf *q) {
    if (qtype == Q8_0) {
        for (int c = 0; c < 8; c++) {  /* byte j of each lane, sign-extended */
            const vi raw = vi_load(tb + 64 * c);
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
        const uint8_t *tb = tiles + (t * blocks + b) * tbb;
        vf d, mn;
        tile_scales(qtype, tb, qb, 0.0f, &d, &mn);
        unpack_fp32(qtype, tb, q);
        for (int64_t m = 0; m < M; m++) {
            const float *xb = x + m * ldx + b * 32;
            vf s[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};  /* four chains: FMA latency */
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
        const uint8_t *tb = tiles + (t * blocks + b) * tbb;
        vf d, mn;
        tile_scales(qtype, tb, qb, 0.0f, &d, &mn);
        unpack_fp32(qtype, tb, q);
        for (int k = 0; k < 32; k++) vf_store(out + (b * 32 + k) * ldo, vf_fma(q[k], d, mn));
    }
}
#endif

/* ---- bf16 activations: any number of rows, on AMX tiles or (no AMX) AVX512-BF16 dot products
   A weight tile is dequantized once per call (exactly as tile_dequant_t: d q + m in fp32), rounded
   to bf16 and laid out per tile-block (32 values) as 16 rows of 64 bytes (an AMX B tile, or 16
   zmm vectors): row p holds, for each of the 16 weight rows n, the pair (W[n][2p], W[n][2p + 1]).
   x is rounded to bf16 once per call. Both engines sum pairs of bf16 products in fp32 over all K
   (no per-block scales left to apply), so y = x W^T with both rounded to bf16 and nothing else. */
#if defined(HAVE_TILES) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_BF16_TILES 1

/* Tile-block tb as 16 packed pair rows: bt[p * 32 + 2n + j] = bf16(W[n][2p + j]) for its 16 rows n. */
static inline void bf16_pack_block(int qtype, int qb, const uint8_t *tb, __m512i interleave, uint16_t *bt) {
    vf q[32], d, mn;
    tile_scales(qtype, tb, qb, 0.0f, &d, &mn);
    unpack_fp32(qtype, tb, q);
    for (int p = 0; p < 16; p++) {  /* words 0-15: W[.][2p], 16-31: W[.][2p + 1]; then paired per row */
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(vf_fma(q[2 * p + 1], d, mn), vf_fma(q[2 * p], d, mn));
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

#if defined(HAVE_BF16_TILES) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023  /* Linux: ask for the AMX tile state (arch/x86 uapi) */
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0-3: C, 4-5: A, 6-7: B; all 16 rows of 64 bytes. Per thread: the config is thread state. */
static void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    _tile_loadconfig(&cfg);
}

/* C tile `reg` (rows [m0 + 16 rb, +16) of y, weight tile tt's columns) to y, or only the rows
   and columns that exist through a scratch copy. */
#define AMX_STORE(reg, rb, tt)                                                                          \
    do {                                                                                                \
        const int64_t r0 = m0 + 16 * (rb), nr = M - r0 < 16 ? M - r0 : 16, n0 = (tt) * TR;              \
        const int64_t valid = N - n0 < TR ? N - n0 : TR;                                                \
        if (nr == 16 && valid == TR) {                                                                  \
            _tile_stored(reg, y + r0 * ldy + n0, ldy * (int64_t)sizeof(float));                        \
        } else if (nr > 0) {                                                                            \
            _tile_stored(reg, scratch, 16 * sizeof(float));                                             \
            for (int64_t r = 0; r < nr; r++)                                                            \
                memcpy(y + (r0 + r) * ldy + n0, scratch + 16 * r, sizeof(float) * (size_t)valid);      \
        }                                                                                               \
    } while (0)

/* Weight tiles t and t + 1 (only t when `two` is 0) times all Mpad rows of xb into y, in groups
   of 32 rows: C tiles 0/1 take rows 0-15 of the group (weight tile t / t + 1), 2/3 rows 16-31;
   A tiles 4/5, B tiles 6/7. Each loaded A tile serves two B tiles and each B tile two A tiles
   (x is read from L2 once per two weight tiles). The first group packs each B tile one block
   ahead of using it (a decode-sized call reads it back from L1) into bt [2][blocks * 512],
   which the later groups reuse. */
static void amx_tile_pair(int qtype, int qb, const uint8_t *tiles, int64_t blocks, int64_t tbb, uint16_t *bt,
                          const uint16_t *xb, int64_t Mpad, int64_t K, float *y, int64_t ldy, int64_t M,
                          int64_t N, int64_t t, int two) {
    const __m512i interleave = bf16_pair_order();
    const int64_t lda = K * (int64_t)sizeof(uint16_t);
    uint16_t *bt1 = bt + blocks * 512;
    float scratch[256];
    for (int64_t m0 = 0; m0 < Mpad; m0 += 32) {
        const int two_rows = Mpad - m0 > 16;
        const uint16_t *a = xb + m0 * K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (m0 == 0 && blocks > 0) {
            bf16_pack_block(qtype, qb, tiles + t * blocks * tbb, interleave, bt);
            if (two) bf16_pack_block(qtype, qb, tiles + (t + 1) * blocks * tbb, interleave, bt1);
        }
        for (int64_t b = 0; b < blocks; b++) {
            /* One block ahead: a tile load waits for every store to the bytes it reads to reach
               L1 (no forwarding from the store buffer), so block b's stores drain while b - 1's
               tiles multiply. */
            if (m0 == 0 && b + 1 < blocks) {
                bf16_pack_block(qtype, qb, tiles + (t * blocks + b + 1) * tbb, interleave, bt + (b + 1) * 512);
                if (two)
                    bf16_pack_block(qtype, qb, tiles + ((t + 1) * blocks + b + 1) * tbb, interleave,
                                   bt1 + (b + 1) * 512);
            }
            _tile_loadd(6, bt + b * 512, 64);
            _tile_loadd(4, a + b * 32, lda);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, bt1 + b * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (two_rows) {
                _tile_loadd(5, a + 16 * K + b * 32, lda);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
        }
        AMX_STORE(0, 0, t);
        if (two) AMX_STORE(1, 0, t + 1);
        if (two_rows) AMX_STORE(2, 1, t);
        if (two_rows && two) AMX_STORE(3, 1, t + 1);
    }
}

/* 0 on success, 3 out of memory. */
static int amx_matmul(int qtype, int qb, const uint8_t *tiles, int64_t ntiles, int64_t blocks, int64_t tbb,
                      int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                      int num_threads) {
    const int64_t Mpad = (M + 15) / 16 * 16;  /* whole 16-row A tiles */
    uint16_t *xb = bf16_round_rows(x, M, ldx, K, Mpad);
    if (!xb) return 3;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint16_t *bt = aligned_alloc(64, (size_t)blocks * 2048);
        if (bt) amx_configure();
        else failed = 1;
#pragma omp for schedule(guided)
        for (int64_t pair = 0; pair < (ntiles + 1) / 2; pair++) {
            if (!bt) continue;
            amx_tile_pair(qtype, qb, tiles, blocks, tbb, bt, xb, Mpad, K, y, ldy, M, N, 2 * pair,
                          2 * pair + 1 < ntiles);
        }
        if (bt) _tile_release();
        free(bt);
    }
    free(xb);
    return failed ? 3 : 0;
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
                bf16_pack_block(qtype, qb, tiles + (t * blocks + b) * tbb, interleave, bt + b * 512);
                if (two) bf16_pack_block(qtype, qb, tiles + ((t + 1) * blocks + b) * tbb, interleave, bt1 + b * 512);
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

/* 1 when this is an AMX build on a kernel that grants this process the tile state. The grant
   is the process's: asked once, the answer kept (a race only asks twice). */
static int tile_amx_supported(void) {
#ifdef HAVE_AMX
    static int granted = -1;  /* -1: not asked yet */
    int answer = __atomic_load_n(&granted, __ATOMIC_ACQUIRE);
    if (answer < 0) {
        answer = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&granted, answer, __ATOMIC_RELEASE);
    }
    return answer;
#else
    return 0;
#endif
}

/* How tile_matmul takes bf16 activations here: 2 on AMX tiles, 1 by AVX512-BF16 dot products
   (an AVX512-BF16 build where AMX is not built or not granted), 0 not at all. */
int tile_bf16_engine(void) {
    if (tile_amx_supported()) return 2;
#ifdef HAVE_BF16_TILES
    return 1;
#else
    return 0;
#endif
}

/* 1 when this build has the tiled kernels (AVX2 + FMA + F16C, or AVX-512 BW). */
int tile_supported(void) {
#ifdef HAVE_TILES
    return 1;
#else
    return 0;
#endif
}

/* out[i, :] = row rows[i] of the tiled W as fp32 (embedding lookups; scalar: a row or a few
   per token). 0 on success. Tiles exist only where the tiled kernels do, so this too. */
int tile_dequant_rows(int qtype, const uint8_t *tiles, int64_t N, int64_t K, const int64_t *rows,
                      int64_t num_rows, float *out, int num_threads) {
    int bb, qb, hm;
    int64_t blocks, tbb;
    if (!tile_geometry(qtype, N, K, &blocks, &tbb) || !tile_supported()) return 1;
#ifdef HAVE_TILES
    tile_info(qtype, &bb, &qb, &hm);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows * K > 65536)
    for (int64_t i = 0; i < num_rows; i++) {
        const int64_t t = rows[i] / TR;
        const int r = (int)(rows[i] % TR);
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *tb = tiles + (t * blocks + b) * tbb;
            uint16_t h;
            memcpy(&h, tb + qb * TR + 2 * r, 2);
            const float d = _cvtsh_ss(h);
            float m = qtype == Q4_0 ? -8.0f * d : 0.0f;
            if (hm) { memcpy(&h, tb + qb * TR + 2 * TR + 2 * r, 2); m = _cvtsh_ss(h); }
            for (int k = 0; k < 32; k++) out[i * K + b * 32 + k] = d * (float)tile_quant(qtype, tb, r, k) + m;
        }
    }
    return 0;
#else
    (void)bb; (void)qb; (void)hm; (void)tiles; (void)rows; (void)num_rows; (void)out; (void)num_threads;
    return 1;
#endif
}


/* y[M, N] = x[M, K] @ W.T on tiles, x as fp32 (M <= MAX_M), or quantized per block to int8 or
   int16 first (any M: MAX_M rows at a time per tile), or (any M, where tile_bf16_engine() is not
   0) W and x rounded to bf16 (act: ACT_*). 0 on success; 1: not tiled here (or an unknown act);
   2: fp32 with M > MAX_M; 3: out of memory. */
int tile_matmul(int qtype, const uint8_t *tiles, int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx,
                float *y, int64_t ldy, int act, int num_threads) {
    if (act != ACT_FP32 && act != ACT_INT8 && act != ACT_INT16 && act != ACT_BF16) return 1;
    int64_t blocks, tbb, ntiles = tile_geometry(qtype, N, K, &blocks, &tbb);
    if (!ntiles || !tile_supported()) return 1;
    if (M > MAX_M && act == ACT_FP32) return 2;
#ifdef HAVE_TILES
    int bb, qb, hm;
    tile_info(qtype, &bb, &qb, &hm);
    if (act == ACT_BF16) {
#ifdef HAVE_AMX
        if (tile_amx_supported())  /* never a tile instruction unpermitted */
            return amx_matmul(qtype, qb, tiles, ntiles, blocks, tbb, N, K, x, M, ldx, y, ldy, num_threads);
#endif
#ifdef HAVE_BF16_TILES
        return dp_matmul(qtype, qb, tiles, ntiles, blocks, tbb, N, K, x, M, ldx, y, ldy, num_threads);
#else
        return 1;
#endif
    }
    if (act != ACT_FP32) {  /* x rounded per block first: qa (int8 or int16), then its scales */
        const size_t elem = act == ACT_INT16 ? sizeof(int16_t) : sizeof(int8_t);
        void *qa = malloc(elem * (size_t)(M * K) + 2 * sizeof(float) * (size_t)(M * blocks) + 64);
        if (!qa) return 3;
        float *da = (float *)(((uintptr_t)qa + elem * (size_t)(M * K) + 63) & ~(uintptr_t)63), *sa = da + M * blocks;
        if (act == ACT_INT16) quantize_rows_q16(x, M, ldx, K, qa, da, sa, num_threads);
        else quantize_rows_q8(x, M, ldx, K, qa, da, sa, num_threads);
        /* guided (here and in every matmul loop over tiles or GGUF rows): halving chunks, so a
           thread that shares its core with another process takes fewer tiles instead of holding
           the others at the barrier. A tile's sums are one thread's whole, so y does not depend
           on the split.
           Slices of MAX_M rows outer, tiles inner: a slice's rounded rows (72-192 KiB at
           SmolLM2's widths) stay in L1/L2 while every tile of W passes them once. Tiles outer
           re-read all M rows per 16-column tile: at 512 rows, 576 KiB a tile out of L2 (more
           than a Zen 3's whole L2). benchmarks/quant_linear.py --step --rows 512 --baseline REV
           compares the two orders.
           No barrier between slices (nowait): a slice's tiles write rows no other slice
           writes, so a thread done with its share of one slice goes on to the next.
           The loop body is the tiles-outer one's, unchanged: one loop over (slice, tile) pairs
           instead made GCC compile tile_q16a's many-row path slower (quant_linear.py --step). */
#pragma omp parallel num_threads(num_threads)
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            const int64_t rows = M - m0 < MAX_M ? M - m0 : MAX_M;
            float *ys = y + m0 * ldy;
#pragma omp for schedule(guided) nowait
            for (int64_t t = 0; t < ntiles; t++) {
                if (act == ACT_INT16)
                    tile_q16a(qtype, qb, tiles, blocks, tbb, (const int16_t *)qa + m0 * K, da + m0 * blocks,
                              sa + m0 * blocks, rows, K, ys, ldy, N, t);
                else {
                    int64_t grouped = 0;  /* rows tile_q4a takes */
#if !VI_DOT_VNNI
                    /* From 8 rows: at 4 + 3 the second pass over the tile looked to cost more than
                       the first saved on AVX-512 without VNNI (an ad-hoc timing). */
                    grouped = qtype == Q8_0 || rows < 2 * Q4A_ROWS ? 0 : rows / Q4A_ROWS * Q4A_ROWS;
                    if (grouped)
                        tile_q4a(qtype, qb, tiles, blocks, tbb, (const int8_t *)qa + m0 * K, da + m0 * blocks,
                                 sa + m0 * blocks, rows, K, ys, ldy, N, t);
#endif
                    if (rows > grouped)
                        tile_q8a(qtype, qb, tiles, blocks, tbb, (const int8_t *)qa + (m0 + grouped) * K,
                                 da + (m0 + grouped) * blocks, sa + (m0 + grouped) * blocks, rows - grouped, K,
                                 ys + grouped * ldy, ldy, N, t);
                }
            }
        }
        free(qa);
        return 0;
    }
    float *xsum = malloc(sizeof(float) * (size_t)(M * blocks));
    if (!xsum) return 3;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += x[m * ldx + b * 32 + j];
            xsum[m * blocks + b] = s;
        }
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int64_t t = 0; t < ntiles; t++) tile_fp32(qtype, qb, tiles, blocks, tbb, x, ldx, xsum, M, y, ldy, N, t);
    free(xsum);
    return 0;
#else
    (void)tiles; (void)x; (void)ldx; (void)y; (void)ldy; (void)num_threads;
    return 1;
#endif
}

/* out [K, ldo] columns [0, 16 * count) = (tiles [first, first + count) of W)^T as fp32. */
int tile_dequant_t(int qtype, const uint8_t *tiles, int64_t N, int64_t K, int64_t first, int64_t count,
                   float *out, int64_t ldo, int num_threads) {
    int64_t blocks, tbb, ntiles = tile_geometry(qtype, N, K, &blocks, &tbb);
    if (!ntiles || !tile_supported() || first < 0 || first + count > ntiles || ldo < TR * count) return 1;
#ifdef HAVE_TILES
    int bb, qb, hm;
    tile_info(qtype, &bb, &qb, &hm);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < count; i++) tile_dequant_t_one(qtype, qb, tiles, blocks, tbb, first + i, out + i * TR, ldo);
    return 0;
#else
    (void)tiles; (void)out; (void)num_threads;
    return 1;
#endif
}
