/* Weight-only quantized matmul on GGUF blocks, fp32 activations (tokenbus, model/native).

   y[m, n] = sum_k x[m, k] * W[n, k]  for m < M, n < N, k < K.

   W is row-major in GGUF's block layout: row n is K / QK blocks of `block_bytes` each, exactly
   as they sit in the file (ggml's block_q8_0, block_q4_K, ...). x is fp32 [M, K] with row
   stride ldx; y is fp32 [M, N] with row stride ldy (a slice of a wider output: fused q/k/v).

   Each weight block is dequantized once per call into a QK-float buffer on the stack and then
   dotted with all M activation rows, so the weights are read once whatever M is (M <= 64:
   decode batches; the caller dequantizes whole tiles and uses a GEMM for larger M). The work
   is split over rows of W (OpenMP, static), every thread writing only its own columns of y.

   Built with -O3 -march=<cpu> -ffast-math: the dequantization and dot loops are plain C that
   the compiler vectorises for the CPU it is built for (AVX2, AVX-512); -ffast-math lets it
   reorder the fp32 sums, so results match a dequantize-then-matmul reference to rounding, not
   bit for bit.

   Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 (32-value blocks); Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
   IQ4_XS (256-value super-blocks), each as ggml defines it (the gguf package's quants.py
   dequantizes every one of them in numpy: the tests' reference); F16 and BF16 taken 32 values at
   a time. Where the CPU has AVX2 or AVX-512, all but Q2_K, Q4_K, Q5_K, F16 and BF16 skip the float
   buffer (the "SIMD" sections below).

   Also quant_dequant_rows: rows of W as fp32 (embedding lookups, GEMM tiles).
*/

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.h"
#include "kernels.h"

#define MAX_M 64
#define LANES 32  /* accumulator lanes per activation row: every block size is a multiple */


#if defined(__F16C__)
#include <immintrin.h>
#endif

static float fp16_to_fp32(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---------------------------------------------------------------- one block → QK floats */
static void deq_q8_0(const uint8_t *b, float *y) {  /* d, int8 qs[32] */
    const float d = fp16_to_fp32(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = d * q[j];
}

static void deq_q4_0(const uint8_t *b, float *y) {  /* d, qs[16]: low nibbles 0-15, high 16-31 */
    const float d = fp16_to_fp32(b);
    const uint8_t *q = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * ((int)(q[j] & 0xF) - 8);
        y[j + 16] = d * ((int)(q[j] >> 4) - 8);
    }
}

static void deq_q4_1(const uint8_t *b, float *y) {  /* d, m, qs[16] */
    const float d = fp16_to_fp32(b), m = fp16_to_fp32(b + 2);
    const uint8_t *q = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (q[j] & 0xF) + m;
        y[j + 16] = d * (q[j] >> 4) + m;
    }
}

static void deq_q4_k(const uint8_t *b, float *y) {  /* d, dmin, scales[12], qs[128] */
    const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, q += 32) {
        uint8_t sc, m;
        k4_scale_min(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        k4_scale_min(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; l++) y[j + l] = d1 * (q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) y[j + 32 + l] = d2 * (q[l] >> 4) - m2;
    }
}

static void deq_q5_k(const uint8_t *b, float *y) {  /* d, dmin, scales[12], qh[32], qs[128] */
    const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
        uint8_t sc, m;
        k4_scale_min(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        k4_scale_min(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; l++) y[j + l] = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++) y[j + 32 + l] = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
}

static void deq_q6_k(const uint8_t *b, float *y) {  /* ql[128], qh[64], int8 scales[16], d */
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = fp16_to_fp32(b + 208);
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * sc[is] * q1;
            y[l + 32] = d * sc[is + 2] * q2;
            y[l + 64] = d * sc[is + 4] * q3;
            y[l + 96] = d * sc[is + 6] * q4;
        }
    }
}

static void deq_q2_k(const uint8_t *b, float *y) {  /* scales[16], qs[64], d, dmin */
    const uint8_t *scales = b, *q = b + 16;
    const float d = fp16_to_fp32(b + 80), dmin = fp16_to_fp32(b + 82);
    int is = 0;
    for (int n = 0; n < QK_K; n += 128, q += 32) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int half = 0; half < 2; half++) {
                const uint8_t s = scales[is++];
                const float dl = d * (s & 0xF), ml = dmin * (s >> 4);
                for (int l = 0; l < 16; l++) *y++ = dl * ((q[l + 16 * half] >> shift) & 3) - ml;
            }
        }
    }
}

/* Q5_0, Q5_1: weight j's fifth bit is bit j of qh, a little-endian uint32 (ggml's block_q5_0,
   block_q5_1); its low four bits are Q4_0's nibbles. */
static void deq_q5_0(const uint8_t *b, float *y) {  /* d, qh[4], qs[16]: d * (q - 16) */
    const float d = fp16_to_fp32(b);
    const uint32_t qh = load_u32(b + 2);
    const uint8_t *q = b + 6;
    for (int j = 0; j < 16; j++) {
        y[j] = d * ((int)((q[j] & 0xF) | ((qh >> j) & 1) << 4) - 16);
        y[j + 16] = d * ((int)((q[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
    }
}

static void deq_q5_1(const uint8_t *b, float *y) {  /* d, m, qh[4], qs[16]: d * q + m */
    const float d = fp16_to_fp32(b), m = fp16_to_fp32(b + 2);
    const uint32_t qh = load_u32(b + 4);
    const uint8_t *q = b + 8;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (int)((q[j] & 0xF) | ((qh >> j) & 1) << 4) + m;
        y[j + 16] = d * (int)((q[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
    }
}

static void deq_iq4_nl(const uint8_t *b, float *y) {  /* d, qs[16]: d * kvalues[nibble] */
    const float d = fp16_to_fp32(b);
    const uint8_t *q = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * kvalues_iq4nl[q[j] & 0xF];
        y[j + 16] = d * kvalues_iq4nl[q[j] >> 4];
    }
}

static void deq_mxfp4(const uint8_t *b, float *y) {  /* e, qs[16]: 2^(e - 128) * kvalues[nibble] */
    const float d = e8m0_half(b[0]);
    const uint8_t *q = b + 1;
    for (int j = 0; j < 16; j++) {
        y[j] = d * kvalues_mxfp4[q[j] & 0xF];
        y[j + 16] = d * kvalues_mxfp4[q[j] >> 4];
    }
}

static void deq_iq4_xs(const uint8_t *b, float *y) {  /* d, scales_h[2], scales_l[4], qs[128] */
    const float d = fp16_to_fp32(b);
    const uint8_t *q = b + 8;
    for (int ib = 0; ib < QK_K / 32; ib++, q += 16, y += 32) {  /* 32-value sub-blocks */
        const float dl = d * iq4_xs_scale(b, ib);
        for (int j = 0; j < 16; j++) {
            y[j] = dl * kvalues_iq4nl[q[j] & 0xF];
            y[j + 16] = dl * kvalues_iq4nl[q[j] >> 4];
        }
    }
}

static void deq_q3_k(const uint8_t *b, float *y) {  /* hmask[32], qs[64], scales[12], d */
    const uint8_t *hmask = b, *scales = b + 96;
    const float d = fp16_to_fp32(b + 108);
    float dl[16];
    for (int i = 0; i < 16; i++) dl[i] = d * q3_k_scale(scales, i);
    /* Value v = 128 h + 32 s + l (l < 32): 2 low bits at bit 2s of qs[32 h + l], the third at
       bit 4h + s of hmask[l], set meaning +0 and clear -4 (q in [-4, 3]); sub-block v / 16.
       Written as 32-value loops of constant shifts, which GCC vectorises (16-value loops, or a
       separate pass for the scales, it did one value at a time). */
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++) {
            const uint8_t *qs = b + 32 + 32 * h;
            const int bit = 4 * h + s;
            const float d0 = dl[8 * h + 2 * s], d1 = dl[8 * h + 2 * s + 1];
            float *out = y + 128 * h + 32 * s;
            for (int l = 0; l < 32; l++)
                out[l] = (l < 16 ? d0 : d1) *
                         (float)((int)((qs[l] >> (2 * s)) & 3) - (((hmask[l] >> bit) & 1) ^ 1) * 4);
        }
}

static void deq_f16(const uint8_t *b, float *y) {  /* 32 fp16 values */
    for (int j = 0; j < 32; j++) y[j] = fp16_to_fp32(b + 2 * j);
}

static void deq_bf16(const uint8_t *b, float *y) {  /* 32 bf16 values */
    for (int j = 0; j < 32; j++) y[j] = bf16_value(b + 2 * j);
}

typedef void (*dequant_fn)(const uint8_t *, float *);

/* Block size in values and bytes, and the dequantizer, of a type; 0 if unsupported. */
static int block_info(int qtype, int *qk, int *bytes, dequant_fn *fn) {
    switch (qtype) {
    case Q8_0: *qk = 32; *bytes = 34; *fn = deq_q8_0; return 1;
    case Q4_0: *qk = 32; *bytes = 18; *fn = deq_q4_0; return 1;
    case Q4_1: *qk = 32; *bytes = 20; *fn = deq_q4_1; return 1;
    case Q2_K: *qk = QK_K; *bytes = 84; *fn = deq_q2_k; return 1;
    case Q4_K: *qk = QK_K; *bytes = 144; *fn = deq_q4_k; return 1;
    case Q5_K: *qk = QK_K; *bytes = 176; *fn = deq_q5_k; return 1;
    case Q6_K: *qk = QK_K; *bytes = 210; *fn = deq_q6_k; return 1;
    case Q5_0: *qk = 32; *bytes = 22; *fn = deq_q5_0; return 1;
    case Q5_1: *qk = 32; *bytes = 24; *fn = deq_q5_1; return 1;
    case IQ4_NL: *qk = 32; *bytes = 18; *fn = deq_iq4_nl; return 1;
    case MXFP4: *qk = 32; *bytes = MXFP4_BLOCK; *fn = deq_mxfp4; return 1;
    case Q3_K: *qk = QK_K; *bytes = 110; *fn = deq_q3_k; return 1;
    case IQ4_XS: *qk = QK_K; *bytes = 136; *fn = deq_iq4_xs; return 1;
    case F16: *qk = 32; *bytes = HALF_BLOCK; *fn = deq_f16; return 1;
    case BF16: *qk = 32; *bytes = HALF_BLOCK; *fn = deq_bf16; return 1;
    default: return 0;
    }
}

/* ---------------------------------------------------------------- 32-value blocks, SIMD
   Q8_0, Q4_0 and Q4_1 need no dequantized buffer: with a block's scale d (and min m),
       sum_j (d*q_j + m) * x_j = d * (q . x) + m * sum_j x_j,
   so each block is one integer-to-float conversion of its quants, one dot with x accumulated
   into a vector with weight d, and a scalar m * (the block's sum of x, computed once per call).
   Q4_0 is Q4_1 with m = -8d. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
typedef __m512 vec;
#define VLEN 16
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
/* The 32 quants of a block as two vectors of 16 floats: weights 0-15 and 16-31. */
static inline void quants32(int qtype, const uint8_t *q, vec *lo, vec *hi) {
    if (qtype == Q8_0) {
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    } else {  /* 16 bytes of nibbles: low nibbles are weights 0-15, high ones 16-31 */
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
        *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    }
}
static inline vec block_dot(vec lo, vec hi, const float *x) {
    return _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
}
static inline vec vfma_scalar(float d, vec v, vec acc) { return _mm512_fmadd_ps(_mm512_set1_ps(d), v, acc); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
#define HAVE_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct { __m256 a, b; } vec;  /* 16 floats in two halves */
#define VLEN 16
static inline vec vzero(void) { vec v = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return v; }
static inline float vsum(vec v) {
    const __m256 s = _mm256_add_ps(v.a, v.b);
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}
static inline __m256 cvt8(__m128i bytes8, int is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}
static inline void quants32(int qtype, const uint8_t *q, vec *lo, vec *hi) {
    if (qtype == Q8_0) {
        lo->a = cvt8(_mm_loadl_epi64((const __m128i *)q), 1);
        lo->b = cvt8(_mm_loadl_epi64((const __m128i *)(q + 8)), 1);
        hi->a = cvt8(_mm_loadl_epi64((const __m128i *)(q + 16)), 1);
        hi->b = cvt8(_mm_loadl_epi64((const __m128i *)(q + 24)), 1);
    } else {
        const __m256i mask = _mm256_set1_epi32(0xF);
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
        lo->a = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
        lo->b = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
        hi->a = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
        hi->b = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
    }
}
static inline vec block_dot(vec lo, vec hi, const float *x) {
    vec r;
    r.a = _mm256_fmadd_ps(hi.a, _mm256_loadu_ps(x + 16), _mm256_mul_ps(lo.a, _mm256_loadu_ps(x)));
    r.b = _mm256_fmadd_ps(hi.b, _mm256_loadu_ps(x + 24), _mm256_mul_ps(lo.b, _mm256_loadu_ps(x + 8)));
    return r;
}
static inline vec vfma_scalar(float d, vec v, vec acc) {
    const __m256 dv = _mm256_set1_ps(d);
    acc.a = _mm256_fmadd_ps(dv, v.a, acc.a);
    acc.b = _mm256_fmadd_ps(dv, v.b, acc.b);
    return acc;
}
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
#define HAVE_SIMD 1
#endif

#ifdef HAVE_SIMD
/* Rows [n0, n1) of a Q8_0/Q4_0/Q4_1 W against M rows of x; xsum[m * blocks + b] = sum of block b of row m. */
static void matmul_32_simd(int qtype, int bytes, const uint8_t *w, int64_t row_bytes, int64_t blocks,
                           const float *x, int64_t M, int64_t ldx, const float *xsum, float *y, int64_t ldy,
                           int64_t n) {
    vec acc[MAX_M];
    float macc[MAX_M];
    for (int64_t m = 0; m < M; m++) { acc[m] = vzero(); macc[m] = 0.0f; }
    const uint8_t *row = w + n * row_bytes;
    const int qoff = qtype == Q4_1 ? 4 : 2;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + blk * bytes;
        const float d = fp16_to_fp32(b);
        const float mn = qtype == Q4_1 ? fp16_to_fp32(b + 2) : (qtype == Q4_0 ? -8.0f * d : 0.0f);
        vec lo, hi;
        quants32(qtype, b + qoff, &lo, &hi);
        for (int64_t m = 0; m < M; m++) {
            acc[m] = vfma_scalar(d, block_dot(lo, hi, x + m * ldx + blk * 32), acc[m]);
            macc[m] += mn * xsum[m * blocks + blk];
        }
    }
    for (int64_t m = 0; m < M; m++) y[m * ldy + n] = vsum(acc[m]) + macc[m];
}

/* One Q8_0/Q4_0/Q4_1 block as 32 floats: d * q + m. */
static void deq_32_simd(int qtype, const uint8_t *b, float *y) {
    const float d = fp16_to_fp32(b);
    const float mn = qtype == Q4_1 ? fp16_to_fp32(b + 2) : (qtype == Q4_0 ? -8.0f * d : 0.0f);
    vec lo, hi;
    quants32(qtype, b + (qtype == Q4_1 ? 4 : 2), &lo, &hi);
    float tmp[32];
    vstore(tmp, lo);
    vstore(tmp + 16, hi);
    for (int j = 0; j < 32; j++) y[j] = d * tmp[j] + mn;
}
#endif

#include "rows_sub32.h"

/* Rows of any supported W through its block dequantizer: sums in LANES lanes per activation
   row across the whole row of W (no horizontal add per block), added once at the end. */
static void matmul_generic(int qk, int bytes, dequant_fn deq, const uint8_t *w, int64_t row_bytes,
                           int64_t blocks, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                           int64_t n) {
    float tmp[QK_K], acc[MAX_M][LANES];
    memset(acc, 0, sizeof(float) * LANES * M);
    const uint8_t *row = w + n * row_bytes;
    for (int64_t blk = 0; blk < blocks; blk++) {
        deq(row + blk * bytes, tmp);
        const float *xb = x + blk * qk;
        for (int64_t m = 0; m < M; m++) {
            const float *xr = xb + m * ldx;
            float *a = acc[m];
            for (int c = 0; c < qk; c += LANES)
                for (int j = 0; j < LANES; j++) a[j] += tmp[c + j] * xr[c + j];
        }
    }
    for (int64_t m = 0; m < M; m++) {
        float s = 0.0f;
        for (int j = 0; j < LANES; j++) s += acc[m][j];
        y[m * ldy + n] = s;
    }
}

/* 0 on success; 1: unsupported type or shape; 2: M > MAX_M; 3: out of memory. */
int quant_matmul(int qtype, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M,
                 int64_t ldx, float *y, int64_t ldy, int num_threads) {
    int qk, bytes;
    dequant_fn deq;
    if (!block_info(qtype, &qk, &bytes, &deq) || K % qk) return 1;
    if (M > MAX_M) return 2;
    const int64_t blocks = K / qk, row_bytes = blocks * bytes;
#ifdef HAVE_SIMD
    if (is_sub32_type(qtype)) return quant_matmul_sub32(qtype, qk, bytes, w, N, K, x, M, ldx, y, ldy, num_threads);
    if (qk == 32 && !half_type(qtype)) {
        float *xsum = malloc(sizeof(float) * (size_t)(M * blocks));
        if (!xsum) return 3;
        for (int64_t m = 0; m < M; m++)
            for (int64_t blk = 0; blk < blocks; blk++) {
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += x[m * ldx + blk * 32 + j];
                xsum[m * blocks + blk] = s;
            }
#pragma omp parallel for schedule(guided) num_threads(num_threads)
        for (int64_t n = 0; n < N; n++)
            matmul_32_simd(qtype, bytes, w, row_bytes, blocks, x, M, ldx, xsum, y, ldy, n);
        free(xsum);
        return 0;
    }
#endif
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++)
        matmul_generic(qk, bytes, deq, w, row_bytes, blocks, x, M, ldx, y, ldy, n);
    return 0;
}

/* out[i, :] = row rows[i] of W as fp32 (K values each). 0 on success, 1: unsupported. */
int quant_dequant_rows(int qtype, const uint8_t *w, int64_t K, const int64_t *rows, int64_t num_rows,
                       float *out, int num_threads) {
    int qk, bytes;
    dequant_fn deq;
    if (!block_info(qtype, &qk, &bytes, &deq) || K % qk) return 1;
    const int64_t blocks = K / qk, row_bytes = blocks * bytes;
#ifdef HAVE_SIMD
    if (is_sub32_type(qtype)) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows * K > 65536)
        for (int64_t i = 0; i < num_rows; i++) {
            const uint8_t *row = w + rows[i] * row_bytes;
            for (int64_t blk = 0; blk < blocks; blk++) deq_sub32_simd(qtype, qk, row + blk * bytes, out + i * K + blk * qk);
        }
        return 0;
    }
    if (qk == 32 && !half_type(qtype)) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows * K > 65536)
        for (int64_t i = 0; i < num_rows; i++) {
            const uint8_t *row = w + rows[i] * row_bytes;
            for (int64_t blk = 0; blk < blocks; blk++) deq_32_simd(qtype, row + blk * bytes, out + i * K + blk * 32);
        }
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows * K > 65536)
    for (int64_t i = 0; i < num_rows; i++) {
        const uint8_t *row = w + rows[i] * row_bytes;
        for (int64_t blk = 0; blk < blocks; blk++) deq(row + blk * bytes, out + i * K + blk * qk);
    }
    return 0;
}
