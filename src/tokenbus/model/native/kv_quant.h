/* The paged K/V cache's element types (tokenbus, model/native): a K or V row (one token, one KV
   head: D values) as paged_attention.c reads it, converted straight from the cache into fp32
   inside its loops (no dequantized copy of the cache is ever made), and as decode_layer.c writes
   it. model/kv_quant.py is the torch twin of every conversion here, bit for bit
   (tests/model/test_kv_quant.py holds the two equal).

     type            bytes per row   a value
     ELEM_F32        4 D             fp32
     ELEM_BF16       2 D             the top half of an fp32
     ELEM_F16        2 D             IEEE half
     ELEM_FP8_E4M3   D               scale * e4m3fn (OCP: 4 exponent bits, bias 7, no inf, max 448)
     ELEM_FP8_E5M2   D               scale * e5m2 (OCP: the top byte of an IEEE half, max 57344)
     ELEM_Q8_0       D / 32 * 34     D / 32 of llama.cpp's block_q8_0, each {fp16 d; int8 q[32]}:
                                     value 32 b + i of the row = d_b * q_b[i]

   fp8 has one scale per tensor (vLLM's k_scale / v_scale): the attention kernel folds k_scale
   into the query scale and v_scale into the softmax's 1 / sum, so rows convert without it. q8_0
   carries a scale per 32 values and takes no per-tensor one.

   Readers return e4m3 values divided by 256 (kv_unit): an e4m3 byte moved into an IEEE half's
   bit positions reads as exactly that, and the kernel folds the 256 into the same two scales
   (powers of two: the sums come out bit for bit as over the true values) instead of a multiply
   per value.

   Offsets are in elements, as if every row held D elements (paged_attention.c computes them so:
   ((block * bs + token) * Hkv + head) * D, plus num_blocks * bs * Hkv * D for V). Element
   offset o of a row's first value is row o / D, which starts at byte (o / D) * kv_row_bytes(D);
   for the 1-byte fp8 types that is byte o, for q8_0 byte (o / D) * (D / 32) * 34. */
#ifndef TOKENBUS_KV_QUANT_H
#define TOKENBUS_KV_QUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels.h" /* ELEM_* */

#define Q8_0_VALUES 32     /* values per block_q8_0 */
#define Q8_0_BYTES 34      /* its bytes: the fp16 scale, then the 32 quants */
#define FP8_E4M3_MAX 448.f /* the largest finite values: larger ones are clamped to them */
#define FP8_E5M2_MAX 57344.f

static inline int kv_is_fp8(int elem) { return elem == ELEM_FP8_E4M3 || elem == ELEM_FP8_E5M2; }

/* A stored value = kv_unit * what the readers below return. */
static inline float kv_unit(int elem) { return elem == ELEM_FP8_E4M3 ? 256.f : 1.f; }

/* Bytes of one row of D values (q8_0: D a multiple of 32). */
static inline int64_t kv_row_bytes(int64_t D, int elem) {
    if (elem == ELEM_Q8_0) return D / Q8_0_VALUES * Q8_0_BYTES;
    if (kv_is_fp8(elem)) return D;
    return elem == ELEM_F32 ? 4 * D : 2 * D;
}

/* The first byte of the row whose first element offset is `offset` (a multiple of D). */
static inline __attribute__((always_inline)) const uint8_t *kv_row(const void *p, int64_t offset, int64_t D,
                                                                   int elem) {
    return (const uint8_t *)p + offset / D * kv_row_bytes(D, elem);
}

static inline __attribute__((always_inline)) float bits_to_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* IEEE half -> fp32: F16C where the CPU has it, else by hand (no _Float16: GCC < 12 lacks it). */
static inline __attribute__((always_inline)) float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        const float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return bits_to_float(exp == 31 ? sign | 0x7F800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13));
#endif
}

/* An fp8 byte as the IEEE half bits of the same value, divided by kv_unit. e5m2 is a half's top
   byte. e4m3's exponent and mantissa (7 bits) shifted into place under a half's exponent field
   read as a half 2^8 smaller than the e4m3 value (bias 15 against 7), subnormals included (both
   types' subnormals have exponent field 0). */
static inline __attribute__((always_inline)) uint16_t fp8_half_bits(uint8_t b, int elem) {
    if (elem == ELEM_FP8_E5M2) return (uint16_t)(b << 8);
    return (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
}

/* An fp8 byte's value / kv_unit. */
static inline __attribute__((always_inline)) float fp8_to_float(uint8_t b, int elem) {
    return half_to_float(fp8_half_bits(b, elem));
}

/* A block_q8_0's scale (2 bytes, not necessarily aligned). */
static inline __attribute__((always_inline)) float q8_scale(const uint8_t *block) {
    uint16_t d;
    memcpy(&d, block, sizeof d);
    return half_to_float(d);
}

/* Element i of a tensor of the fp32 / bf16 / fp16 types, as fp32 (bf16 is the top half of an fp32). */
static inline __attribute__((always_inline)) float load(const void *p, int64_t i, const int elem) {
    if (elem == ELEM_F32) return ((const float *)p)[i];
    if (elem == ELEM_F16) return half_to_float(((const uint16_t *)p)[i]);
    return bits_to_float((uint32_t)((const uint16_t *)p)[i] << 16);
}

/* Store fp32 x as element i; bf16 rounds to nearest even (x is finite here). */
static inline __attribute__((always_inline)) void store(void *p, int64_t i, float x, const int elem) {
    if (elem == ELEM_F32) {
        ((float *)p)[i] = x;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

/* ---- Vectors of converted values: 16 lanes on AVX-512, 8 on AVX2 + F16C. */
#if defined(__AVX512F__)
/* 16 fp8 bytes -> fp32 (/ kv_unit). e4m3: sign-extended to 16 bits and shifted left 7, the
   sign lands in bits 15 and 14 and exponent and mantissa in 13..7; clearing bit 14 leaves
   fp8_half_bits. */
static inline __attribute__((always_inline)) __m512 fp8x16(const uint8_t *p, int elem) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (elem == ELEM_FP8_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
    const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(x, _mm256_set1_epi16((short)0xBF80)));
}

/* 16 int8 quants times their block's scale. */
static inline __attribute__((always_inline)) __m512 q8x16(const int8_t *q, float d) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))),
                         _mm512_set1_ps(d));
}

/* Values offset .. offset + 15 (offset % 16 == 0) of rows of D values, as fp32 (/ kv_unit): fp32,
   fp16, fp8 or q8_0 (whose 16 values lie in one half of one block). */
static inline __attribute__((always_inline)) __m512 kv_load16(const void *p, int64_t offset, const int64_t D,
                                                              const int elem) {
    if (elem == ELEM_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + offset)));
    if (kv_is_fp8(elem)) return fp8x16((const uint8_t *)p + offset, elem);
    if (elem == ELEM_Q8_0) {
        const int64_t col = offset % D;
        const uint8_t *block = kv_row(p, offset - col, D, elem) + col / Q8_0_VALUES * Q8_0_BYTES;
        return q8x16((const int8_t *)(block + 2) + col % Q8_0_VALUES, q8_scale(block));
    }
    return _mm512_loadu_ps((const float *)p + offset);
}

/* The 64 values of the row at element offset `offset` (a multiple of 64), as four vectors: one
   address computation and, for q8_0, one conversion of each of the row's two scales. */
static inline __attribute__((always_inline)) void kv_load64(const void *p, int64_t offset, const int elem,
                                                            __m512 v[4]) {
    if (elem == ELEM_Q8_0) {
        const uint8_t *row = kv_row(p, offset, 64, elem);
        for (int b = 0; b < 2; b++) {
            const __m512 d = _mm512_set1_ps(q8_scale(row + b * Q8_0_BYTES));
            const int8_t *q = (const int8_t *)(row + b * Q8_0_BYTES + 2);
            for (int h = 0; h < 2; h++)
                v[2 * b + h] = _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * h)))), d);
        }
        return;
    }
    for (int c = 0; c < 4; c++) v[c] = kv_load16(p, offset + 16 * c, 64, elem);
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
static inline __attribute__((always_inline)) __m256 fp8x8(const uint8_t *p, int elem) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    if (elem == ELEM_FP8_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
    const __m128i x = _mm_slli_epi16(_mm_cvtepi8_epi16(b), 7);
    return _mm256_cvtph_ps(_mm_and_si128(x, _mm_set1_epi16((short)0xBF80)));
}

static inline __attribute__((always_inline)) __m256 q8x8(const int8_t *q, float d) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))),
                         _mm256_set1_ps(d));
}
#endif

/* The D fp8 values at p, as fp32 (/ kv_unit), into out. */
static inline __attribute__((always_inline)) void fp8_row(const uint8_t *p, const int64_t D, const int elem,
                                                          float *out) {
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= D; d += 16) _mm512_storeu_ps(out + d, fp8x16(p + d, elem));
#endif
#if defined(__AVX2__) && defined(__F16C__)
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(out + d, fp8x8(p + d, elem));
#endif
    for (; d < D; d++) out[d] = fp8_to_float(p[d], elem);
}

/* The D / 32 blocks at p, as D fp32 values, into out. */
static inline __attribute__((always_inline)) void q8_row(const uint8_t *p, const int64_t D, float *out) {
    for (int64_t b = 0; b < D / Q8_0_VALUES; b++, p += Q8_0_BYTES, out += Q8_0_VALUES) {
        const float d = q8_scale(p);
        const int8_t *q = (const int8_t *)(p + 2);
#if defined(__AVX512F__)
        _mm512_storeu_ps(out, q8x16(q, d));
        _mm512_storeu_ps(out + 16, q8x16(q + 16, d));
#elif defined(__AVX2__) && defined(__F16C__)
        for (int i = 0; i < Q8_0_VALUES; i += 8) _mm256_storeu_ps(out + i, q8x8(q + i, d));
#else
        for (int i = 0; i < Q8_0_VALUES; i++) out[i] = (float)q[i] * d;
#endif
    }
}

/* The row at element offset `offset` (a multiple of D), as D fp32 values (/ kv_unit), into out. fp16
   converts 16 or 8 at a time with F16C: the element-wise load above is not vectorised for it. */
static inline __attribute__((always_inline)) void load_row(const void *p, int64_t offset, const int64_t D,
                                                           const int elem, float *out) {
    if (kv_is_fp8(elem)) {
        fp8_row((const uint8_t *)p + offset, D, elem, out);
        return;
    }
    if (elem == ELEM_Q8_0) {
        q8_row(kv_row(p, offset, D, elem), D, out);
        return;
    }
#if defined(__F16C__)
    if (elem == ELEM_F16) {
        const uint16_t *h = (const uint16_t *)p + offset;
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= D; d += 16)
            _mm512_storeu_ps(out + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + d))));
#endif
        for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
        for (; d < D; d++) out[d] = half_to_float(h[d]);
        return;
    }
#endif
#pragma omp simd
    for (int64_t d = 0; d < D; d++) out[d] = load(p, offset + d, elem);
}

/* ---- Writing: fp32 -> a cache row. Compiled without -ffast-math (the build's flag): the
   rounding here must be IEEE's, exactly as torch rounds (no reciprocal for / 127, no contracted
   multiply-adds), or K/V written here and by model/kv_quant.py would differ. */
#if defined(__clang__)
#pragma float_control(precise, on, push)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
#endif

/* fp32 -> fp8, rounded to nearest even, as torch's float8 casts (c10's fp8e4m3fn_from_fp32_value
   and fp8e5m2_from_fp32_value, whose steps these are). x is finite and within the type's range
   (callers clamp). Normal results round on the fp32 bits: add half an fp8 ulp less one, plus the
   kept mantissa's last bit (ties to even), and shift; subnormal results let an fp32 addition
   round, to a number whose fp32 ulp is the fp8 subnormal step. */
static inline uint32_t round_subnormal(uint32_t bits, uint32_t denorm) {
    float x, d;
    memcpy(&x, &bits, sizeof x);
    memcpy(&d, &denorm, sizeof d);
    x += d;
    memcpy(&bits, &x, sizeof bits);
    return bits - denorm;
}

static inline uint8_t float_to_fp8(float x, int elem) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint32_t r;
    if (elem == ELEM_FP8_E4M3) {
        if (bits >= 1087u << 20) { /* |x| >= 480, past the clamp: e4m3fn's NaN */
            r = 0x7F;
        } else if (bits < 121u << 23) { /* |x| < 2^-6: subnormal steps of 2^-9 */
            r = round_subnormal(bits, 141u << 23); /* 2^14, whose fp32 ulp is 2^-9 */
        } else {
            bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((bits >> 20) & 1u);
            r = bits >> 20;
        }
    } else {
        if (bits >= 143u << 23) { /* |x| >= 2^16, past the clamp */
            r = bits > 255u << 23 ? 0x7F : 0x7C;
        } else if (bits < 113u << 23) { /* |x| < 2^-14: subnormal steps of 2^-16 */
            r = round_subnormal(bits, 134u << 23); /* 2^7, whose fp32 ulp is 2^-16 */
        } else {
            bits += ((uint32_t)(15 - 127) << 23) + 0xFFFFFu + ((bits >> 21) & 1u);
            r = bits >> 21;
        }
    }
    return (uint8_t)(r | sign >> 24);
}

#if defined(__F16C__)
/* 32 values -> one block_q8_0, as llama.cpp's quantize_row_q8_0_ref (and gguf-py's Q8_0): d =
   max |x| / 127, q = round-half-away(x / d) computed as x * (1 / d); d stored as fp16. */
static inline void quantize_q8_0(const float *x, uint8_t *block) {
    float amax = 0.f;
    for (int i = 0; i < Q8_0_VALUES; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const uint16_t h = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    memcpy(block, &h, sizeof h);
    int8_t *q = (int8_t *)(block + 2);
    for (int i = 0; i < Q8_0_VALUES; i++) q[i] = (int8_t)roundf(x[i] * id);
}
#endif

/* `rows` rows of D fp32 values (contiguous) -> rows of the cache type at dst (contiguous);
   fp8 stores x * inv_scale (1 / the tensor's scale), clamped to the type's finite range. fp16 and
   fp8 round to nearest even (as torch's casts), q8_0 as quantize_q8_0. Returns 0, or 4 for a type
   this build cannot write (fp16 and q8_0 need F16C; bf16 is never written here). */
static inline int kv_store_rows(void *dst, const float *src, int64_t rows, int64_t D, int elem, float inv_scale) {
    const int64_t n = rows * D;
    if (elem == ELEM_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return 0;
    }
    if (kv_is_fp8(elem)) {
        const float max = elem == ELEM_FP8_E4M3 ? FP8_E4M3_MAX : FP8_E5M2_MAX;
        uint8_t *out = dst;
        for (int64_t i = 0; i < n; i++) {
            const float x = src[i] * inv_scale;
            out[i] = float_to_fp8(x > max ? max : x < -max ? -max : x, elem);
        }
        return 0;
    }
#if defined(__F16C__)
    if (elem == ELEM_F16) {
        uint16_t *half = dst;
        for (int64_t i = 0; i < n; i++) half[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
        return 0;
    }
    if (elem == ELEM_Q8_0 && D % Q8_0_VALUES == 0) {
        for (int64_t b = 0; b < n / Q8_0_VALUES; b++)
            quantize_q8_0(src + b * Q8_0_VALUES, (uint8_t *)dst + b * Q8_0_BYTES);
        return 0;
    }
#endif
    return 4;
}

#if defined(__clang__)
#pragma float_control(pop)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif
