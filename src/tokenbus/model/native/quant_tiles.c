/* GGUF weights (the 32-value types, the K-quants but Q2_K, F16 and BF16) repacked in tiles of 16
   rows, for decode-shaped matmuls (tokenbus, model/native).

   GGUF stores a matrix row by row, block by block. Dotting one row at a time leaves a GEMV
   latency-bound: one accumulator chain per row, a horizontal sum per output, a scalar scale per
   block. Here 16 rows are interleaved so that one 16-lane vector holds the same 4 quants of 16
   rows and the scales of a block are 16 fp16 values in a row: each instruction then works for
   16 outputs, and a tile's 16 results come out as one vector store.

   Layout, per tile of rows [16t, 16t + 16) and per block b of 32 values (tile-block): the quants
   in chunks of 16 rows x 4 bytes (4 of nibbles, or 8 of bytes), then the block's scales
   (tiles_repack.h). The 32-value types keep the bytes of the 16 GGUF blocks a tile-block
   replaces; the K-quants' sub-blocks take the same form, their super-block scales in a header
   per 8 tile-blocks. A matrix is ceil(N / 16) tiles of (K / 32) tile-blocks; rows past N are
   zero (d = 0). Q4_K runs as Q4_1 does (a scale and a min per block), Q6_K as Q8_0 with a
   second scale for values 16-31. F16 and BF16 tile-blocks hold the 16 rows' 32 values themselves,
   value k of the 16 rows side by side (no scales; tiles_half.h runs them).

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
   Also: repacking from GGUF rows (tiles_repack.h), and dequantizing (rows for embeddings; whole
   tiles as W^T for the prefill GEMM). Built like quant_matmul.c (-O3 -march=<cpu> -ffast-math, OpenMP over
   tiles, every thread writing only its own columns of y). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.h"
#include "kernels.h"

#define TR 16      /* rows per tile */
#define MAX_M 64   /* activation rows per call (QUANT_MAX_ROWS) */


/* A tile format's layout. */
typedef struct {
    int qb;          /* bytes of one row's quants in a tile-block: 16 (4-bit), 20 or 24 (planes), 32 */
    int64_t tbb;     /* bytes of a tile-block */
    int64_t header;  /* bytes of a K-quant group's header (0: 32-value types, no groups) */
} tile_type;

/* 0 if not a tile format. */
static int tile_info(int qtype, tile_type *tt) {
    switch (qtype) {
    case Q8_0: *tt = (tile_type){32, TR * 34, 0}; return 1;
    case Q4_0: case IQ4_NL: *tt = (tile_type){16, TR * 18, 0}; return 1;
    case MXFP4: *tt = (tile_type){16, TR * 17, 0}; return 1;
    case Q4_1: *tt = (tile_type){16, TR * 20, 0}; return 1;
    case Q5_0: *tt = (tile_type){20, TR * 22, 0}; return 1;
    case Q5_1: *tt = (tile_type){20, TR * 24, 0}; return 1;
    case Q4_K: *tt = (tile_type){16, TR * 18, 2 * TR * 2}; return 1;
    case Q5_K: *tt = (tile_type){20, TR * 22, 2 * TR * 2}; return 1;
    case Q6_K: *tt = (tile_type){24, TR * 26, TR * 2}; return 1;
    case IQ4_XS: *tt = (tile_type){16, TR * 17, TR * 2}; return 1;
    case F16: case BF16: *tt = (tile_type){HALF_BLOCK, TR * HALF_BLOCK, 0}; return 1;
    default: return 0;
    }
}

/* Bytes of one row's quants in a tile-block of this format (the block types'; F16 and BF16 tiles
   take tiles_half.h's own paths). */
static inline int quant_bytes(int qtype) {
    switch (qtype) {
    case Q8_0: return 32;
    case Q5_0: case Q5_1: case Q5_K: return 20;
    case Q6_K: return 24;
    default: return 16;
    }
}

/* The tile format a GGUF type is repacked into: its own, but Q3_K's (6-bit values, int8 scales
   per 16 and a super-block fp16 scale, as Q6_K: its values exactly). -1: not tiled. */
int tile_format(int qtype) {
    switch (qtype) {
    case Q8_0: case Q4_0: case Q4_1: case Q5_0: case Q5_1: case IQ4_NL: case MXFP4:
    case Q4_K: case Q5_K: case Q6_K: case IQ4_XS: case F16: case BF16: return qtype;
    case Q3_K: return Q6_K;
    default: return -1;
    }
}

/* Quants the kernels take as chunks of bytes (q8_chunk), all but Q4_0 / Q4_1 / Q4_K's nibbles
   (which their kernels take as nibbles): Q8_0's bytes, the 5- and 6-bit types' planes, the IQ4
   types' and MXFP4's nibbles through their tables. */
static inline int q8_chunks(int qtype) { return qtype != Q4_0 && qtype != Q4_1 && qtype != Q4_K; }

/* Signed bytes with one scale per tile-block (under int8 activations: biased by 128 on VNNI,
   their sign moved onto x otherwise). */
static inline int signed_bytes(int qtype) {
    return qtype == Q8_0 || qtype == IQ4_NL || qtype == IQ4_XS || qtype == MXFP4;
}

/* Two scales per tile-block, for values 0-15 and 16-31. */
static inline int split_scales(int qtype) { return qtype == Q6_K; }

/* K-quant formats: tile-blocks in groups of 8 behind a header. */
static inline int64_t group_header_bytes(int qtype) {
    return qtype == Q4_K || qtype == Q5_K ? 2 * TR * 2 : qtype == Q6_K || qtype == IQ4_XS ? TR * 2 : 0;
}

/* K-quants: a group of QK_GROUP tile-blocks (one 256-value super-block) shares a header. */
#define QK_GROUP 8

/* Tile-blocks the matrix has, the size of one, and of a whole tile; 0 tiles if the type or shape
   is not tiled. */
static int64_t tile_geometry(int qtype, int64_t N, int64_t K, int64_t *blocks, int64_t *tbb, int64_t *tile_bytes) {
    tile_type tt = {0};
    if (tile_format(qtype) != qtype || !tile_info(qtype, &tt) || K % (tt.header ? 32 * QK_GROUP : 32) || N <= 0) return 0;
    *blocks = K / 32;
    *tbb = tt.tbb;
    *tile_bytes = *blocks * tt.tbb + (tt.header ? *blocks / QK_GROUP * tt.header : 0);
    return (N + TR - 1) / TR;
}

/* Bytes of W's tiles, W of GGUF type qtype (in its tile_format). */
int64_t tile_nbytes(int qtype, int64_t N, int64_t K) {
    int64_t blocks, tbb, tile_bytes, tiles = tile_geometry(tile_format(qtype), N, K, &blocks, &tbb, &tile_bytes);
    return tiles * tile_bytes;
}

/* Tile-block b of tile t. 32-value types: tiles of `blocks` tile-blocks back to back. K-quants:
   per super-block a group, its header (the super-block's scales of the 16 rows) then its 8
   tile-blocks; a tile is blocks / 8 groups. */
static inline uint8_t *tile_block(int qtype, const uint8_t *tiles, int64_t t, int64_t b, int64_t blocks,
                                  int64_t tbb) {
    const int64_t header = group_header_bytes(qtype), group = header + QK_GROUP * tbb;
    if (!header) return (uint8_t *)tiles + (t * blocks + b) * tbb;
    return (uint8_t *)tiles + (t * (blocks / QK_GROUP) + b / QK_GROUP) * group + header + b % QK_GROUP * tbb;
}

/* The header of tile-block b's group (K-quants), from the tile-block's address. */
static inline const uint8_t *group_header(int qtype, const uint8_t *tb, int64_t b, int64_t tbb) {
    return tb - b % QK_GROUP * tbb - group_header_bytes(qtype);
}

#include "tiles_repack.h"

#include "tile_vectors.h"

/* Tile-blocks a thread asks the memory system for ahead of the one it multiplies: a decode
   step streams every weight once, and the hardware prefetcher alone did not keep it fed
   (benchmarks/cpu_speed.py's tg128 decides the distance). Prefetches never fault, so the
   last blocks' run past the end harmlessly (and a K-quant group's header is skipped: a
   header is 64 bytes in 2.3 KiB, which the hardware prefetcher picks up). */
#define PREFETCH_AHEAD 8
static inline void prefetch_ahead(const uint8_t *tb, int64_t tbb) {
    for (int64_t off = 0; off < tbb; off += 64) __builtin_prefetch(tb + PREFETCH_AHEAD * tbb + off);
}

#ifdef HAVE_TILES
/* Chunk c (< 8) of a q8_chunks tile-block: the 16 rows' values 4c..4c+3, a byte each. Past
   Q8_0's bytes, from the nibbles of chunk c % 4 (low for c < 4, high above): through the IQ4
   or MXFP4 table; with bit 4 from the plane's bit c (Q5); with bits 4-5 from plane c / 4's bits
   2 (c % 4), minus 32 (Q6_K). */
static inline vi q8_chunk(int qtype, const uint8_t *tb, int c) {
    if (qtype == Q8_0) return vi_load(tb + 64 * c);
    const vi raw = vi_load(tb + 64 * (c % 4)), low4 = vi_set8(0x0F);
    const vi low = c < 4 ? vi_and(raw, low4) : vi_and(vi_srli16(raw, 4), low4);
    if (qtype == IQ4_NL || qtype == IQ4_XS) return vi_lut16(kvalues_iq4nl, low);
    if (qtype == MXFP4) return vi_lut16(kvalues_mxfp4, low);
    if (qtype == Q6_K) {
        const vi h = vi_load(tb + 256 + 64 * (c / 4));
        const int s = 2 * (c % 4);  /* bits s, s + 1 of h to bits 4, 5 */
        const vi high = vi_and(s <= 4 ? vi_slli16(h, 4 - s) : vi_srli16(h, s - 4), vi_set8(0x30));
        return vi_sub8(vi_or(low, high), vi_set8(32));
    }
    const vi h = vi_load(tb + 256);  /* Q5: bit c to bit 4 */
    return vi_or(low, vi_and(c <= 4 ? vi_slli16(h, 4 - c) : vi_srli16(h, c - 4), vi_set8(0x10)));
}

/* The scale, second scale and min vectors of tile-block b (at tb): d for its values (values 0-15
   for Q6_K; 2^(e - 128) for MXFP4), d1 = d but for Q6_K's values 16-31, m = -8d for Q4_0,
   -Q8_BIAS d or 0 for Q8_0 (and the other signed bytes) under int8 activations, 0 for Q8_0
   under fp32 ones and for Q6_K. K-quants multiply out their super-block scale in fp32, as ggml's
   dequantization does. */
static inline void tile_scales(int qtype, const uint8_t *tb, int64_t b, int64_t tbb, float q8_bias, vf *d, vf *d1,
                               vf *m) {
    const uint8_t *sc = tb + quant_bytes(qtype) * TR;  /* the block's scales, after its quants */
    if (qtype == Q4_K || qtype == Q5_K) {
        const uint8_t *hdr = group_header(qtype, tb, b, tbb);
        *d = vf_mul(vf_half(hdr), vf_u8(sc));
        *m = vf_mul(vf_half(hdr + 2 * TR), vf_mul(vf_u8(sc + TR), vf_set1(-1.0f)));
        *d1 = *d;
        return;
    }
    if (qtype == Q6_K || qtype == IQ4_XS) {
        const vf dk = vf_half(group_header(qtype, tb, b, tbb));
        *d = vf_mul(dk, vf_s8(sc));
        *d1 = qtype == Q6_K ? vf_mul(dk, vf_s8(sc + TR)) : *d;
        *m = qtype == Q6_K ? vf_zero() : vf_mul(*d, vf_set1(-q8_bias));
        return;
    }
    *d = qtype == MXFP4 ? vf_e8m0_half(sc) : vf_half(sc);
    *d1 = *d;
    if (qtype == Q4_1 || qtype == Q5_1) *m = vf_half(sc + 2 * TR);
    else *m = vf_mul(*d, vf_set1(qtype == Q4_0 ? -8.0f : qtype == Q5_0 ? -16.0f : -q8_bias));
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
    const int nibble = low ? (byte & 0xF) : (byte >> 4);
    const uint8_t *plane = tb + 256 + r * 4 + k % 4;
    switch (qtype) {
    case IQ4_NL: case IQ4_XS: return kvalues_iq4nl[nibble];
    case MXFP4: return kvalues_mxfp4[nibble];
    case Q5_0: case Q5_1: case Q5_K: return nibble | ((plane[0] >> (k / 4)) & 1) << 4;
    case Q6_K: return (nibble | ((plane[64 * (k / 16)] >> (2 * (k / 4 % 4))) & 3) << 4) - 32;
    default: return nibble;
    }
}

#include "tiles_int8.h"
#include "tiles_int8_pairs.h"
#include "tiles_q8k.h"
#include "tiles_int16.h"
#include "tiles_fp32.h"
#include "tiles_half.h"
#endif

/* ---- bf16 activations: one file per engine (tiles_bf16.h: AVX512-BF16 dot products;
   tiles_amx.h: AMX tiles), each compiled where the build has its instructions, and a table of
   those this build has, best first. The first one available at run time takes ACT_BF16: a new
   engine adds a file and an entry, not a branch in tile_matmul. */
typedef int (*bf16_matmul_fn)(int qtype, int qb, const uint8_t *tiles, int64_t ntiles, int64_t blocks, int64_t tbb,
                              int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                              int num_threads);
typedef struct {
    int code;               /* BF16_ENGINE_* */
    int (*available)(void); /* whether it may run in this process (NULL: the end of the table) */
    bf16_matmul_fn matmul;
} bf16_engine;

#include "tiles_bf16.h"
#include "tiles_amx.h"

#ifdef HAVE_BF16_TILES
static int always(void) { return 1; }
#endif

static const bf16_engine BF16_ENGINES[] = {
#ifdef HAVE_AMX
    {BF16_ENGINE_AMX, amx_granted, amx_matmul}, /* never a tile instruction unpermitted */
#endif
#ifdef HAVE_BF16_TILES
    {BF16_ENGINE_AVX512_BF16, always, dp_matmul},
#endif
    {BF16_ENGINE_NONE, NULL, NULL},
};

/* The engine that runs ACT_BF16 here (the table's end, code BF16_ENGINE_NONE, for none). */
static const bf16_engine *bf16_engine_here(void) {
    const bf16_engine *e = BF16_ENGINES;
    while (e->available && !e->available()) e++;
    return e;
}

/* How tile_matmul takes bf16 activations here: BF16_ENGINE_*. */
int tile_bf16_engine(void) { return bf16_engine_here()->code; }

/* 1 when tile format `format` is in 256-value super-blocks (kernels.h: super_block_format). */
int tile_super_block(int64_t format) { return super_block_format(format); }

/* 1 when this build runs ACT_Q8_K (AVX-512 VNNI: tiles_q8k.h). */
int tile_q8_k(void) {
#ifdef HAVE_Q8K_TILES
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
    int64_t blocks, tbb, tile_bytes;
    if (!tile_geometry(qtype, N, K, &blocks, &tbb, &tile_bytes) || !tile_supported()) return 1;
#ifdef HAVE_TILES
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows * K > 65536)
    for (int64_t i = 0; i < num_rows; i++) {
        const int64_t t = rows[i] / TR;
        const int r = (int)(rows[i] % TR);
        if (half_type(qtype)) {
            tile_dequant_row_half(qtype, tiles, blocks, tbb, t, r, out + i * K);
            continue;
        }
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *tb = tile_block(qtype, tiles, t, b, blocks, tbb);
            vf dv, d1v, mv;
            float d[TR], d1[TR], m[TR];
            tile_scales(qtype, tb, b, tbb, 0.0f, &dv, &d1v, &mv);
            vf_store(d, dv);
            vf_store(d1, d1v);
            vf_store(m, mv);
            for (int k = 0; k < 32; k++)
                out[i * K + b * 32 + k] = (k < 16 ? d[r] : d1[r]) * (float)tile_quant(qtype, tb, r, k) + m[r];
        }
    }
    return 0;
#else
    (void)tiles; (void)rows; (void)num_rows; (void)out; (void)num_threads;
    return 1;
#endif
}


/* y[M, N] = x[M, K] @ W.T on tiles, x as fp32 (M <= MAX_M), or quantized per block to int8 or
   int16 first (any M: MAX_M rows at a time per tile), or (any M, where tile_bf16_engine() is not
   0) W and x rounded to bf16 (act: ACT_*). F16 and BF16 tiles take x as fp32 in every other
   mode, at any M (tiles_half.h). 0 on success; 1: not tiled here (or an unknown act);
   2: fp32 with M > MAX_M; 3: out of memory. */
int tile_matmul(int qtype, const uint8_t *tiles, int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx,
                float *y, int64_t ldy, int act, int num_threads) {
    if (act != ACT_FP32 && act != ACT_INT8 && act != ACT_INT16 && act != ACT_BF16 && act != ACT_Q8_K) return 1;
    int64_t blocks, tbb, tile_bytes, ntiles = tile_geometry(qtype, N, K, &blocks, &tbb, &tile_bytes);
    if (!ntiles || !tile_supported()) return 1;
    if (M > MAX_M && act == ACT_FP32 && !half_type(qtype)) return 2;
#ifdef HAVE_TILES
    if (half_type(qtype) && (act != ACT_BF16 || !bf16_engine_here()->matmul))
        return half_matmul(qtype, tiles, ntiles, blocks, tbb, N, x, M, ldx, y, ldy, num_threads);
    tile_type tt = {0};
    tile_info(qtype, &tt);
    const int qb = tt.qb;
    if (act == ACT_BF16) {
        const bf16_engine *engine = bf16_engine_here();
        return engine->matmul ? engine->matmul(qtype, qb, tiles, ntiles, blocks, tbb, N, K, x, M, ldx, y, ldy,
                                               num_threads)
                              : 1;
    }
    if (act == ACT_Q8_K) {
#ifdef HAVE_Q8K_TILES
        return q8k_matmul(qtype, tiles, ntiles, blocks, tbb, N, K, x, M, ldx, y, ldy, num_threads);
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
            int pairs = 0;  /* int8 on VNNI from Q8_PAIR_MIN_ROWS rows: tile_q8a_pair, by pairs of tiles */
#if VI_DOT_VNNI
            pairs = act == ACT_INT8 && rows >= Q8_PAIR_MIN_ROWS(qtype);
#endif
            const int64_t step = pairs ? 2 : 1;
#pragma omp for schedule(guided) nowait
            for (int64_t t = 0; t < ntiles; t += step) {
#if VI_DOT_VNNI
                if (pairs) {
                    tile_q8a_pair(qtype, tiles, blocks, tbb, (const int8_t *)qa + m0 * K, da + m0 * blocks,
                                  sa + m0 * blocks, rows, K, ys, ldy, N, t, t + 1 < ntiles);
                    continue;
                }
#endif
                if (act == ACT_INT16)
                    tile_q16a(qtype, qb, tiles, blocks, tbb, (const int16_t *)qa + m0 * K, da + m0 * blocks,
                              sa + m0 * blocks, rows, K, ys, ldy, N, t);
                else {
                    int64_t grouped = 0;  /* rows tile_q4a takes */
#if !VI_DOT_VNNI
                    /* From 8 rows: at 4 + 3 the second pass over the tile looked to cost more than
                       the first saved on AVX-512 without VNNI (an ad-hoc timing). */
                    grouped = q8_chunks(qtype) || rows < 2 * Q4A_ROWS ? 0 : rows / Q4A_ROWS * Q4A_ROWS;
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
    int64_t blocks, tbb, tile_bytes, ntiles = tile_geometry(qtype, N, K, &blocks, &tbb, &tile_bytes);
    if (!ntiles || !tile_supported() || first < 0 || first + count > ntiles || ldo < TR * count) return 1;
#ifdef HAVE_TILES
    tile_type tt = {0};
    tile_info(qtype, &tt);
    const int qb = tt.qb;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < count; i++) {
        if (half_type(qtype)) tile_dequant_t_half(qtype, tiles, blocks, tbb, first + i, out + i * TR, ldo);
        else tile_dequant_t_one(qtype, qb, tiles, blocks, tbb, first + i, out + i * TR, ldo);
    }
    return 0;
#else
    (void)tiles; (void)out; (void)num_threads;
    return 1;
#endif
}
