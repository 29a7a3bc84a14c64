/* 16-lane vectors for the tiled kernels (tokenbus, model/native): one __m512 on AVX-512, two
   __m256 halves (rows 0-7, 8-15) on AVX2: quant_tiles.c's kernels and paged_attention.c's
   long-query path are written once against these. Defines HAVE_TILES where the build has either. */
#ifndef TOKENBUS_TILE_VECTORS_H
#define TOKENBUS_TILE_VECTORS_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
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
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
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
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_TILES 1
typedef struct { __m256i a, b; } vi;
typedef struct { __m256 a, b; } vf;
static inline vi vi_load(const uint8_t *p) {
    vi r = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
    return r;
}
static inline vi vi_zero(void) { vi r = {_mm256_setzero_si256(), _mm256_setzero_si256()}; return r; }
static inline vi vi_set8(int8_t v) { vi r = {_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; return r; }
static inline vi vi_set32(int32_t v) { vi r = {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; return r; }
#define VI_BIN(name, op) static inline vi name(vi x, vi y) { vi r = {op(x.a, y.a), op(x.b, y.b)}; return r; }
VI_BIN(vi_and, _mm256_and_si256)
VI_BIN(vi_xor, _mm256_xor_si256)
VI_BIN(vi_add, _mm256_add_epi32)
VI_BIN(vi_sign, _mm256_sign_epi8)
#define VI_SHIFT(name, op) static inline vi name(vi x, int s) { vi r = {op(x.a, s), op(x.b, s)}; return r; }
VI_SHIFT(vi_srli16, _mm256_srli_epi16)
VI_SHIFT(vi_slli16, _mm256_slli_epi16)
VI_SHIFT(vi_srai16, _mm256_srai_epi16)
VI_SHIFT(vi_srli32, _mm256_srli_epi32)
VI_SHIFT(vi_slli32, _mm256_slli_epi32)
VI_SHIFT(vi_srai32, _mm256_srai_epi32)
static inline vi vi_bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    vi r = {_mm256_set1_epi32(v), _mm256_set1_epi32(v)};
    return r;
}
static inline __m256i dot8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
static inline vi vi_dot(vi acc, vi u, vi s) { vi r = {dot8(acc.a, u.a, s.a), dot8(acc.b, u.b, s.b)}; return r; }
#if defined(__AVXVNNI__)
#define VI_DOT_VNNI 1  /* vi_dot is one instruction */
#else
#define VI_DOT_VNNI 0
#endif
VI_BIN(vi_pairs8, _mm256_maddubs_epi16)
VI_BIN(vi_add16, _mm256_add_epi16)
static inline vi vi_widen16(vi x) {
    const __m256i one = _mm256_set1_epi16(1);
    vi r = {_mm256_madd_epi16(x.a, one), _mm256_madd_epi16(x.b, one)};
    return r;
}
static inline __m256i dot16(__m256i acc, __m256i w, __m256i a) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, w, a);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, a));
#endif
}
static inline vi vi_dot16(vi acc, vi w, vi a) { vi r = {dot16(acc.a, w.a, a.a), dot16(acc.b, w.b, a.b)}; return r; }
static inline vi vi_abs8(vi w) { vi r = {_mm256_abs_epi8(w.a), _mm256_abs_epi8(w.b)}; return r; }
static inline void vi_keep(vi *x) { __asm__("" : "+x"(x->a), "+x"(x->b)); }
static inline vf vf_cvt(vi x) { vf r = {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; return r; }
static inline vf vf_zero(void) { vf r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline vf vf_set1(float v) { vf r = {_mm256_set1_ps(v), _mm256_set1_ps(v)}; return r; }
static inline vf vf_add(vf x, vf y) { vf r = {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; return r; }
static inline vf vf_mul(vf x, vf y) { vf r = {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; return r; }
static inline vf vf_fma(vf x, vf y, vf z) {
    vf r = {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
    return r;
}
static inline vf vf_half(const uint8_t *p) {
    vf r = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
    return r;
}
static inline vf vf_loadf(const float *p) { vf r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
static inline void vf_store_t(float *p, vf v, int64_t stride) {
    float tmp[16];
    vf_store(tmp, v);
    for (int r = 0; r < 16; r++) p[r * stride] = tmp[r];
}
#if defined(__AVXVNNI__)
#define Q8_BIAS 128
#else
#define Q8_BIAS 0
#endif
#endif

#endif
