/* tile_vectors.h on AVX-512 (F, BW; F16C): vi and vf are one zmm register each. VNNI, where
   the build has it, makes vi_dot and vi_dot16 one instruction. Included by tile_vectors.h only. */
#ifndef TOKENBUS_VEC_AVX512_H
#define TOKENBUS_VEC_AVX512_H

#include <immintrin.h>
#define HAVE_TILES 1
typedef __m512i vi;
typedef __m512 vf;
static inline vi vi_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set8(int8_t v) { return _mm512_set1_epi8(v); }
static inline vi vi_set32(int32_t v) { return _mm512_set1_epi32(v); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_sub8(vi a, vi b) { return _mm512_sub_epi8(a, b); }
/* Each byte of idx (0-15) replaced by that entry of the 16-byte table t. */
static inline vi vi_lut16(const int8_t *t, vi idx) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t)), idx);
}
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_sub32(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vi vi_srli16(vi a, int s) { return _mm512_srli_epi16(a, s); }
static inline vi vi_slli16(vi a, int s) { return _mm512_slli_epi16(a, s); }
static inline vi vi_srai16(vi a, int s) { return _mm512_srai_epi16(a, s); }
/* acc + per lane: the sum of its two int16 x int16 products. */
static inline vi vi_dot16(vi acc, vi w, vi a) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, a);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, a));
#endif
}
static inline vi vi_srli32(vi a, int s) { return _mm512_srli_epi32(a, s); }
static inline vi vi_slli32(vi a, int s) { return _mm512_slli_epi32(a, s); }
static inline vi vi_srai32(vi a, int s) { return _mm512_srai_epi32(a, s); }
static inline vi vi_bcast32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
/* acc + per lane: sum of 4 products u8 (u) x s8 (s). */
static inline vi vi_dot(vi acc, vi u, vi s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
/* Without VNNI, int8 dots in three steps that a caller can split: per int16 lane the sum of its
   two u8 x s8 products (saturating: callers keep |sum| <= 32767), int16 adds, and per int32
   lane the sum of its two int16. */
#if defined(__AVX512VNNI__)
#define VI_DOT_VNNI 1  /* vi_dot is one instruction */
#else
#define VI_DOT_VNNI 0
#endif
static inline vi vi_pairs8(vi u, vi s) { return _mm512_maddubs_epi16(u, s); }
static inline vi vi_add16(vi a, vi b) { return _mm512_add_epi16(a, b); }
static inline vi vi_widen16(vi a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
/* s with the sign of w (0 where w is 0): vpsignb has no 512-bit form. */
static inline vi vi_sign(vi s, vi w) {
    const __mmask64 neg = _mm512_movepi8_mask(w), zero = _mm512_cmpeq_epi8_mask(w, _mm512_setzero_si512());
    return _mm512_maskz_mov_epi8(~zero, _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s));
}
static inline vi vi_abs8(vi w) { return _mm512_abs_epi8(w); }
/* An accumulator pinned in a register at this point (no code): keeps GCC from re-associating a
   chain of integer dot-adds into a tree whose partial products it then spills. */
static inline void vi_keep(vi *x) { __asm__("" : "+v"(*x)); }
static inline vf vf_cvt(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float v) { return _mm512_set1_ps(v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_half(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vf_bf16(const uint8_t *p) {  /* 16 bf16 values: each an fp32's top 16 bits */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_u8(const uint8_t *p) {  /* 16 unsigned bytes */
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vf_s8(const uint8_t *p) {  /* 16 signed bytes */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 16 E8M0 bytes e as 2^(e - 128), bit for bit gguf_blocks.h's e8m0_half: the exponent field
   e - 1, or for e < 2 the subnormal 0x00200000 << e. */
static inline vf vf_e8m0_half(const uint8_t *p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 small = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, tiny));
}
static inline vf vf_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline void vf_store_t(float *p, vf v, int64_t stride) {  /* lane r to p[r * stride] */
    float tmp[16];
    _mm512_storeu_ps(tmp, v);
    for (int r = 0; r < 16; r++) p[r * stride] = tmp[r];
}
#if defined(__AVX512VNNI__)
#define Q8_BIAS 128  /* Q8_0 quants go in as q + 128 (u8) */
#else
#define Q8_BIAS 0    /* Q8_0 quants go in as |q|, their sign moved onto x */
#endif

#endif
