/* tile_vectors.h on AVX2 + FMA + F16C: vi and vf are pairs of ymm registers (lanes 0-7, 8-15).
   AVX-VNNI, where the build has it, makes vi_dot and vi_dot16 one instruction each half.
   Included by tile_vectors.h only. */
#ifndef TOKENBUS_VEC_AVX2_H
#define TOKENBUS_VEC_AVX2_H

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
VI_BIN(vi_or, _mm256_or_si256)
VI_BIN(vi_sub8, _mm256_sub_epi8)
/* Each byte of idx (0-15) replaced by that entry of the 16-byte table t. */
static inline vi vi_lut16(const int8_t *t, vi idx) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
    vi r = {_mm256_shuffle_epi8(table, idx.a), _mm256_shuffle_epi8(table, idx.b)};
    return r;
}
VI_BIN(vi_add, _mm256_add_epi32)
VI_BIN(vi_sub32, _mm256_sub_epi32)
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
static inline __m256 bf16x8(const uint8_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_bf16(const uint8_t *p) {  /* 16 bf16 values: each an fp32's top 16 bits */
    vf r = {bf16x8(p), bf16x8(p + 16)};
    return r;
}
static inline vf vf_u8(const uint8_t *p) {  /* 16 unsigned bytes */
    vf r = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
    return r;
}
static inline vf vf_s8(const uint8_t *p) {  /* 16 signed bytes */
    vf r = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
    return r;
}
/* 8 E8M0 bytes e as 2^(e - 128), bit for bit gguf_blocks.h's e8m0_half: the exponent field
   e - 1, or for e < 2 the subnormal 0x00200000 << e. */
static inline __m256 e8m0_half8(__m128i bytes) {
    const __m256i e = _mm256_cvtepu8_epi32(bytes);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
}
static inline vf vf_e8m0_half(const uint8_t *p) {  /* 16 E8M0 bytes */
    vf r = {e8m0_half8(_mm_loadl_epi64((const __m128i *)p)), e8m0_half8(_mm_loadl_epi64((const __m128i *)(p + 8)))};
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
