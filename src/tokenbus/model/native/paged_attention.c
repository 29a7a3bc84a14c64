/* Paged attention for CPU that reads K/V in place through the block tables.

   The torch path (attention.py) has to copy each request's blocks out of the cache before
   SDPA can read them; at decode that copy is most of the step (every key is read, written and
   read again). Here every key and value is read once, straight from its block.

   Element types: q and out fp32 or bf16 (the same), kv the same or, under fp32 q, fp16 (half the
   bytes a decode step reads: K/V is most of a batch's traffic); scores and sums are always fp32.
   Shapes (row-major):
     q      [*, Hq, D]           token t's head x at q + t * q_tok_stride + x * D
     kv     [2, NB, bs, Hkv, D]  K then V; token j of block b, KV head h at (b * bs + j) * Hkv + h
     tables [*, table_stride]    int64 block ids of each request
     out    [*, Hq, D]           token t's head x at out + t * out_tok_stride + x * D
   Request r (one of reqs[0..num_reqs)) owns query rows query_start[r] .. query_start[r + 1] and
   has seq_lens[r] keys in the cache, this step's included. Query i of a request with q_len
   queries sees keys 0 .. seq_len - q_len + i (causal, aligned to the end).

   Work item = (request, KV head): the G = Hq / Hkv query heads sharing a KV head and all
   q_len query tokens of the request form R = q_len * G rows that go over the keys together,
   so each key and value is loaded from memory once per work item.

   Built with -O3 -march=native -ffast-math: the dot products and the exp are vectorised
   (libmvec). fast-math is safe here because no infinity or NaN is ever produced: masked keys
   are skipped by the loop bounds, never set to -inf. */

#include <math.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ELEM_F32 = 0, ELEM_BF16 = 1, ELEM_F16 = 2 };

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* IEEE half -> fp32: F16C where the CPU has it, else by hand (no _Float16: GCC < 12 lacks it). */
static inline __attribute__((always_inline)) float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {  /* zero or subnormal: mant * 2^-24 */
        const float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7F800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Element i of a tensor of the given type, as fp32 (bf16 is the top half of an fp32). */
static inline __attribute__((always_inline)) float load(const void *p, int64_t i, const int elem) {
    if (elem == ELEM_F32) return ((const float *)p)[i];
    if (elem == ELEM_F16) return half_to_float(((const uint16_t *)p)[i]);
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* D elements from offset on, as fp32, into out. fp16 converts 16 or 8 at a time with F16C: the
   element-wise load above is not vectorised for it. */
static inline __attribute__((always_inline)) void load_row(const void *p, int64_t offset, const int64_t D,
                                                           const int elem, float *out) {
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

/* One work item: request with q_len queries and seq_len keys, KV heads [h0, h1). Its rows are
   ordered (KV head, query, group member): row ((h - h0) * q_len + i) * G + g is query i, head
   h * G + g, and sees keys 0 .. ctx_len + i. Keys are visited in cache order (block by block,
   token by token, then head) so memory is read sequentially within each block.
   Scratch: qf [rows, D] (the queries in fp32), scores [rows, seq_len], acc [rows, D],
   inv_sum [rows].
   Always inlined into attend_any with a constant D and element type, so the inner loops are
   fully unrolled vector code. Offsets below are in elements. */
static inline __attribute__((always_inline)) void attend(
        const void *q, int64_t q_tok_stride, const void *kv, int64_t v_offset, const int64_t *table,
        int64_t seq_len, int64_t q_len, int64_t h0, int64_t h1, int64_t G, int64_t bs, int64_t hkv,
        const int64_t D, const int elem, const int kv_elem, float scale, void *out, int64_t out_tok_stride,
        float *qf, float *scores, float *acc, float *inv_sum) {
    const int64_t ctx_len = seq_len - q_len, rows_per_head = q_len * G, R = (h1 - h0) * rows_per_head;

    for (int64_t r = 0; r < R; r++) {
        const int64_t h = h0 + r / rows_per_head, i = (r % rows_per_head) / G, g = r % G;
        const int64_t base = i * q_tok_stride + (h * G + g) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) qf[r * D + d] = load(q, base + d, elem) * scale;
    }

    /* Pass 1: scores. */
    for (int64_t t0 = 0, b = 0; t0 < seq_len; t0 += bs, b++) {
        const int64_t nt = min64(bs, seq_len - t0);
        for (int64_t j = 0; j < nt; j++) {
            const int64_t t = t0 + j, first_query = t > ctx_len ? t - ctx_len : 0;
            const int64_t key = (table[b] * bs + j) * hkv * D;
            for (int64_t h = h0; h < h1; h++) {
                float converted[D];  /* the key row as fp32, read by its G rows (fp32: in place) */
                const float *kr = (const float *)kv + key + h * D;
                if (kv_elem != ELEM_F32) {
                    load_row(kv, key + h * D, D, kv_elem, converted);
                    kr = converted;
                }
                for (int64_t r = (h - h0) * rows_per_head + first_query * G; r < (h - h0 + 1) * rows_per_head; r++) {
                    const float *qr = qf + r * D;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; d++) s += qr[d] * kr[d];
                    scores[r * seq_len + t] = s;
                }
            }
        }
    }

    /* Softmax over each row's visible keys; the probabilities overwrite the scores. */
    for (int64_t r = 0; r < R; r++) {
        const int64_t visible = ctx_len + (r % rows_per_head) / G + 1;
        float *row = scores + r * seq_len, m = row[0], sum = 0.f;
        for (int64_t t = 1; t < visible; t++) m = row[t] > m ? row[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < visible; t++) {
            row[t] = expf(row[t] - m);
            sum += row[t];
        }
        inv_sum[r] = 1.f / sum;
    }

    /* Pass 2: probability-weighted values. */
    memset(acc, 0, (size_t)(R * D) * sizeof(float));
    for (int64_t t0 = 0, b = 0; t0 < seq_len; t0 += bs, b++) {
        const int64_t nt = min64(bs, seq_len - t0);
        for (int64_t j = 0; j < nt; j++) {
            const int64_t t = t0 + j, first_row = (t > ctx_len ? t - ctx_len : 0) * G;
            const int64_t value = v_offset + (table[b] * bs + j) * hkv * D;
            for (int64_t h = h0; h < h1; h++) {
                float v[D];
                load_row(kv, value + h * D, D, kv_elem, v);
                for (int64_t r = (h - h0) * rows_per_head + first_row; r < (h - h0 + 1) * rows_per_head; r++) {
                    const float p = scores[r * seq_len + t];
                    float *a = acc + r * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] += p * v[d];
                }
            }
        }
    }

    for (int64_t r = 0; r < R; r++) {
        const int64_t h = h0 + r / rows_per_head, i = (r % rows_per_head) / G, g = r % G;
        const int64_t base = i * out_tok_stride + (h * G + g) * D;
        const float *a = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) store(out, base + d, a[d] * inv_sum[r], elem);
    }
}

/* Specialisations for the common head sizes and each element-type pair, and the generic fallback. */
#define ATTEND_ARGS q, q_tok_stride, kv, v_offset, table, seq_len, q_len, h0, h1, G, bs, hkv
#define ATTEND_TAIL scale, out, out_tok_stride, qf, scores, acc, inv_sum
#define ATTEND_D(elem, kv_elem)                                                                  \
    switch (D) {                                                                                  \
        case 64: attend(ATTEND_ARGS, 64, elem, kv_elem, ATTEND_TAIL); break;                     \
        case 128: attend(ATTEND_ARGS, 128, elem, kv_elem, ATTEND_TAIL); break;                   \
        default: attend(ATTEND_ARGS, D, elem, kv_elem, ATTEND_TAIL); break;                      \
    }
static void attend_any(const void *q, int64_t q_tok_stride, const void *kv, int64_t v_offset,
                       const int64_t *table, int64_t seq_len, int64_t q_len, int64_t h0, int64_t h1,
                       int64_t G, int64_t bs, int64_t hkv, int64_t D, int elem, int kv_elem, float scale,
                       void *out, int64_t out_tok_stride, float *qf, float *scores, float *acc, float *inv_sum) {
    if (elem == ELEM_BF16) {
        ATTEND_D(ELEM_BF16, ELEM_BF16)
    } else if (kv_elem == ELEM_F16) {
        ATTEND_D(ELEM_F32, ELEM_F16)
    } else {
        ATTEND_D(ELEM_F32, ELEM_F32)
    }
}

/* Returns 0, -1 when scratch memory could not be allocated (out is then incomplete), or -2
   for an element-type pair it does not take (q/out fp32 with kv fp32 or fp16; bf16 with bf16).
   heads_per_item KV heads form one work item: all of them (each
   key row read as one contiguous run) when there are enough requests to keep the threads
   busy, else one. */
int paged_attention(const void *q, int64_t q_tok_stride, const void *kv, int64_t num_blocks,
                    int64_t bs, int64_t hkv, int64_t D, int64_t hq, const int64_t *tables,
                    int64_t table_stride, const int64_t *query_start, const int64_t *seq_lens,
                    const int64_t *reqs, int64_t num_reqs, float scale, void *out,
                    int64_t out_tok_stride, int elem, int kv_elem, int num_threads) {
    if (!((elem == ELEM_F32 && (kv_elem == ELEM_F32 || kv_elem == ELEM_F16)) ||
          (elem == ELEM_BF16 && kv_elem == ELEM_BF16)))
        return -2;
    const int64_t G = hq / hkv, v_offset = num_blocks * bs * hkv * D;
    const int64_t heads_per_item = num_reqs >= 4 * num_threads ? hkv : 1, splits = hkv / heads_per_item;
    int64_t max_scores = 0, max_rows = 0;
    for (int64_t n = 0; n < num_reqs; n++) {
        const int64_t r = reqs[n], rows = (query_start[r + 1] - query_start[r]) * G * heads_per_item;
        if (rows * seq_lens[r] > max_scores) max_scores = rows * seq_lens[r];
        if (rows > max_rows) max_rows = rows;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc((size_t)max_scores * sizeof(float));
        float *rows = malloc((size_t)((2 * D + 1) * max_rows) * sizeof(float));  /* qf, acc, inv_sum */
        /* Every thread must reach the worksharing loop, so a failed allocation skips items. */
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t n = 0; n < num_reqs; n++) {
            for (int64_t split = 0; split < splits; split++) {
                if (!scores || !rows) {
                    failed = 1;
                    continue;
                }
                const int64_t r = reqs[n], start = query_start[r], h0 = split * heads_per_item;
                const size_t elem_size = elem == ELEM_F32 ? 4 : 2;
                attend_any((const char *)q + start * q_tok_stride * elem_size, q_tok_stride, kv, v_offset,
                           tables + r * table_stride, seq_lens[r], query_start[r + 1] - start, h0,
                           h0 + heads_per_item, G, bs, hkv, D, elem, kv_elem, scale,
                           (char *)out + start * out_tok_stride * elem_size, out_tok_stride,
                           rows, scores, rows + max_rows * D, rows + 2 * max_rows * D);
            }
        }
        free(scores);
        free(rows);
    }
    return failed ? -1 : 0;
}
