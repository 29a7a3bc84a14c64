/* paged_attention.c's decode path on AVX-512 (attend_decode): one query token over its keys, head
   size 64. Defines HAVE_DECODE64 where the build has AVX-512 F. Included by paged_attention.c only,
   after the generic attend() and the helpers it shares. */
#ifndef TOKENBUS_ATTENTION_AVX512_H
#define TOKENBUS_ATTENTION_AVX512_H

#if defined(__AVX512F__)
#define HAVE_DECODE64 1
/* ---- Decode on AVX-512: one query token, head size 64, fp32 queries, G query heads per KV
   head known at compile time (the generic attend() keeps its sums in memory and reduces every
   dot product on its own). Per KV head: the G queries stay in registers (4 zmm each); pass 1
   takes keys 16 at a time, one zmm of partial products per key, and sums the 16 with one
   transposing reduction (45 instructions, instead of 16 horizontal sums); pass 2 keeps the G
   output rows in registers. fp16, fp8 and q8_0 K/V rows are converted once per key and head
   (kv_load16). */

/* Lane j of the result = the sum of v[j]'s 16 lanes. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: (v2i, v2i+1) partial sums interleaved */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: the four sums of v4i .. v4i+3 */
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* Across the four 128-bit lanes: u0..u3's lane sums land in lanes 0..3. */
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

/* Ask for the next block's rows of KV heads [h0, h1) (n <= 16 tokens) ahead of use. The block
   is token-major (token, head, value), so with every head this is one contiguous run. */
static inline __attribute__((always_inline)) void prefetch_block(const void *p, int64_t block, int64_t bs,
                                                                 int64_t hkv, int64_t h0, int64_t h1, int64_t n,
                                                                 const int kv_elem) {
    const int64_t row_bytes = kv_row_bytes(64, kv_elem);
    for (int64_t j = 0; j < n; j++) {
        const char *r = (const char *)p + ((block * bs + j) * hkv + h0) * row_bytes;
        for (int64_t o = 0; o < (h1 - h0) * row_bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
    }
}

/* Block-major: each block's K (then V) rows of every head of the item are used while the block
   is in L1, so a work item with all KV heads reads each block once, front to back, instead of
   once per head at a stride of hkv rows. A row's arithmetic is the same as head-major order
   (per key: the same dot product; per output: the same sequence of FMAs). Keys before `lo` (a
   sliding window's first key) are never read; their blocks may be the null block. */
static inline __attribute__((always_inline)) void attend_decode64(
        const float *q, const void *kv, int64_t v_offset, const int64_t *table, int64_t seq_len, int64_t lo,
        int64_t h0, int64_t h1, const int G, int64_t bs, int64_t hkv, const int kv_elem, float scale, float v_scale,
        float softcap, const float *sinks, float *out, float *scores, float *acc_mem) {
    enum { D = 64 };
    const __m512 zero = _mm512_setzero_ps();
    const int64_t H = h1 - h0;
    /* Rows as attend() orders them (q_len 1): row (h - h0) * G + g. */
    float *qs = acc_mem + H * G * D;  /* the queries, scaled */
    for (int64_t i = 0; i < H * G * D; i++) qs[i] = q[h0 * G * D + i] * scale;

    /* Pass 1: scores, 16 keys at a time (a chunk never spans two blocks). */
    for (int64_t b = lo / bs, t0 = b * bs; t0 < seq_len; t0 += bs, b++) {
        const int64_t nt = min64(bs, seq_len - t0);
        if (t0 + bs < seq_len) prefetch_block(kv, table[b + 1], bs, hkv, h0, h1, min64(bs, seq_len - t0 - bs), kv_elem);
        for (int64_t j0 = t0 < lo ? lo - t0 : 0; j0 < nt; j0 += 16) {
            const int n = (int)min64(16, nt - j0);
            for (int64_t h = h0; h < h1; h++) {
                __m512 k[16][4];
                for (int j = 0; j < 16; j++) {
                    const int64_t key = ((table[b] * bs + j0 + j) * hkv + h) * D;
                    if (j < n)
                        kv_load64(kv, key, kv_elem, k[j]);
                    else
                        for (int c = 0; c < 4; c++) k[j][c] = zero;
                }
                for (int g = 0; g < G; g++) {
                    const float *qr = qs + ((h - h0) * G + g) * D;
                    __m512 qv[4], v[16];
                    for (int c = 0; c < 4; c++) qv[c] = _mm512_loadu_ps(qr + 16 * c);
                    for (int j = 0; j < 16; j++) {
                        __m512 acc = _mm512_mul_ps(qv[0], k[j][0]);
                        for (int c = 1; c < 4; c++) acc = _mm512_fmadd_ps(qv[c], k[j][c], acc);
                        v[j] = acc;
                    }
                    _mm512_mask_storeu_ps(scores + ((h - h0) * G + g) * seq_len + t0 + j0,
                                          (__mmask16)((1u << n) - 1), sum16(v));
                }
            }
        }
    }

    /* Softmax over keys lo .. seq_len - 1 (one query: every one of them is visible); row r is
       query head h0 * G + r. */
    for (int64_t r = 0; r < H * G; r++)  /* qs: v_scale / sums now */
        qs[r] = softmax_row(scores + r * seq_len + lo, seq_len - lo, softcap, sinks ? sinks + h0 * G + r : NULL) *
                v_scale;

    /* Pass 2: per block and head, that head's G output rows in registers (kept in acc_mem between
       blocks). */
    for (int64_t i = 0; i < H * G * D; i++) acc_mem[i] = 0.f;
    const uint8_t *vbase = kv_row(kv, v_offset, D, kv_elem);
    for (int64_t b = lo / bs, t0 = b * bs; t0 < seq_len; t0 += bs, b++) {
        const int64_t nt = min64(bs, seq_len - t0);
        if (t0 + bs < seq_len) prefetch_block(vbase, table[b + 1], bs, hkv, h0, h1, min64(bs, seq_len - t0 - bs), kv_elem);
        for (int64_t h = h0; h < h1; h++) {
            const float *sc = scores + (h - h0) * G * seq_len;
            float *am = acc_mem + (h - h0) * G * D;
            __m512 acc[G][4];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < 4; c++) acc[g][c] = _mm512_loadu_ps(am + g * D + 16 * c);
            for (int64_t j = t0 < lo ? lo - t0 : 0; j < nt; j++) {
                const int64_t value = v_offset + ((table[b] * bs + j) * hkv + h) * D;
                __m512 v[4];
                kv_load64(kv, value, kv_elem, v);
                for (int g = 0; g < G; g++) {
                    const __m512 p = _mm512_set1_ps(sc[g * seq_len + t0 + j]);
                    for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(am + g * D + 16 * c, acc[g][c]);
        }
    }
    for (int64_t h = h0; h < h1; h++)
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) {
                const int64_t r = (h - h0) * G + g;
                _mm512_storeu_ps(out + (h * G + g) * D + 16 * c,
                                 _mm512_mul_ps(_mm512_loadu_ps(acc_mem + r * D + 16 * c), _mm512_set1_ps(qs[r])));
            }
}

/* 1 when it ran: one query of head size 64 under fp32 queries with G <= 8. scratch: 2 (h1 - h0) G 64
   floats (attend_any's qf and acc, which lie end to end). */
static int attend_decode(const float *q, const void *kv, int64_t v_offset, const int64_t *table, int64_t seq_len,
                         int64_t lo, int64_t h0, int64_t h1, int64_t G, int64_t bs, int64_t hkv, int kv_elem, float scale,
                         float v_scale, float softcap, const float *sinks, float *out, float *scores,
                         float *scratch) {
#define DECODE_E(g, e)                                                                                    \
    attend_decode64(q, kv, v_offset, table, seq_len, lo, h0, h1, g, bs, hkv, e, scale, v_scale, softcap, sinks, \
                    out, scores, scratch)
#define DECODE_G(g)                                                             \
    case g:                                                                     \
        switch (kv_elem) {                                                      \
            case ELEM_F16: DECODE_E(g, ELEM_F16); break;                        \
            case ELEM_FP8_E4M3: DECODE_E(g, ELEM_FP8_E4M3); break;              \
            case ELEM_FP8_E5M2: DECODE_E(g, ELEM_FP8_E5M2); break;              \
            case ELEM_Q8_0: DECODE_E(g, ELEM_Q8_0); break;                      \
            default: DECODE_E(g, ELEM_F32); break;                              \
        }                                                                       \
        return 1;
    switch (G) {
        DECODE_G(1) DECODE_G(2) DECODE_G(3) DECODE_G(4) DECODE_G(5) DECODE_G(6) DECODE_G(7) DECODE_G(8)
        default: return 0;
    }
#undef DECODE_G
#undef DECODE_E
}
#endif

#endif
