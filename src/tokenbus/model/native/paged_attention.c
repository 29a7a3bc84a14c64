/* Paged attention for CPU that reads K/V in place through the block tables.

   The torch path (attention.py) has to copy each request's blocks out of the cache before
   SDPA can read them; at decode that copy is most of the step (every key is read, written and
   read again). Here every key and value is read once, straight from its block.

   Element types: q and out fp32 or bf16 (the same), kv the same or, under fp32 q, fp16, fp8
   (e4m3, e5m2) or q8_0 (kv_quant.h: a decode step reads mostly K/V, and these are half or a
   quarter of its bytes; --kv-cache-dtype); scores and sums are always fp32. Quantized rows are
   converted to fp32 in registers or a row-sized buffer as they are read. fp8's per-tensor scales:
   k_scale multiplies the query scale, v_scale the softmax's 1 / sum.
   Shapes (row-major):
     q      [*, Hq, D]           token t's head x at q + t * q_tok_stride + x * D
     kv     [2, NB, bs, Hkv, D]  K then V; token j of block b, KV head h at row (b * bs + j) * Hkv + h
                                 (a row: D values, kv_row_bytes(D) bytes; offsets below count D
                                 elements a row whatever the type: kv_quant.h)
     tables [*, table_stride]    int64 block ids of each request
     out    [*, Hq, D]           token t's head x at out + t * out_tok_stride + x * D
   Request r (one of reqs[0..num_reqs)) owns query rows query_start[r] .. query_start[r + 1] and
   has seq_lens[r] keys in the cache, this step's included. Query i of a request with q_len
   queries sees keys 0 .. seq_len - q_len + i (causal, aligned to the end); with a sliding
   `window` > 0 only the last `window` of them (HF's sliding_window_overlay: key > query - window),
   and the blocks before the first key it sees are never read (they may be the null block).
   `sinks` [Hq] fp32 (gpt-oss's attention sinks; NULL: none): query head x's softmax takes one
   more logit, sinks[x], in its max and its sum, with no value: out = sum_j e^(s_j) v_j /
   (e^sinks[x] + sum_j e^(s_j)). It is neither scaled nor soft-capped.

   paged_prefill_attention (at the end) takes requests of any query count by a flash path;
   attention.py sends it those of more than NATIVE_MAX_QUERY_LEN queries.

   Work item = (request, KV head): the G = Hq / Hkv query heads sharing a KV head and all
   q_len query tokens of the request form R = q_len * G rows that go over the keys together,
   so each key and value is loaded from memory once per work item. On AVX-512 (head size 64,
   fp32 queries, G <= 8) each query token instead runs as a decode of the keys it sees
   (attend_decode64), reading them once per query token: a row's bits never depend on how many
   queries its request has.

   Built with -O3 -march=native -ffast-math: the dot products and the exp are vectorised
   (libmvec). fast-math is safe here because no infinity or NaN is ever produced: masked keys
   are skipped by the loop bounds, never set to -inf. */

#include <math.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kv_quant.h"
#include "tile_vectors.h"

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The first key a query whose last key is `last` sees: last + 1 - window under a sliding window
   (window > 0), else 0. */
static inline int64_t first_key(int64_t last, int64_t window) {
    return window > 0 && last + 1 > window ? last + 1 - window : 0;
}

/* Gemma 2's soft-cap of a score (attn_logit_softcapping): softcap * tanh(s / softcap), before
   the softmax, as HF's eager attention computes it; 0: none. */
static inline __attribute__((always_inline)) float soft_cap(float s, float softcap) {
    return softcap > 0.f ? softcap * tanhf(s / softcap) : s;
}

/* Softmax of row[0 .. n) in place (the scores become probabilities, unnormalised); returns
   1 / their sum. `sink` (NULL: none): the row's attention sink (gpt-oss's), a logit that joins
   the max and the sum but carries no value; it is neither scaled nor soft-capped. */
static inline __attribute__((always_inline)) float softmax_row(float *row, int64_t n, float softcap,
                                                               const float *sink) {
    if (softcap > 0.f) {
#pragma omp simd
        for (int64_t t = 0; t < n; t++) row[t] = soft_cap(row[t], softcap);
    }
    float m = row[0], sum = 0.f;
    for (int64_t t = 1; t < n; t++) m = row[t] > m ? row[t] : m;
    if (sink) {
        m = *sink > m ? *sink : m;
        sum = expf(*sink - m);
    }
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        row[t] = expf(row[t] - m);
        sum += row[t];
    }
    return 1.f / sum;
}

/* One work item: request with q_len queries and seq_len keys, KV heads [h0, h1). Its rows are
   ordered (KV head, query, group member): row ((h - h0) * q_len + i) * G + g is query i, head
   h * G + g, and sees keys first_key(ctx_len + i, window) .. ctx_len + i: for key t, the queries
   [t - ctx_len, t - ctx_len + window) (clamped to the request's). Keys are visited in cache order (block by block,
   token by token, then head) so memory is read sequentially within each block.
   Scratch: qf [rows, D] (the queries in fp32), scores [rows, seq_len], acc [rows, D],
   inv_sum [rows].
   Always inlined into attend_any with a constant D and element type, so the inner loops are
   fully unrolled vector code. Offsets below are in elements. */
static inline __attribute__((always_inline)) void attend(
        const void *q, int64_t q_tok_stride, const void *kv, int64_t v_offset, const int64_t *table,
        int64_t seq_len, int64_t q_len, int64_t window, int64_t h0, int64_t h1, int64_t G, int64_t bs,
        int64_t hkv, const int64_t D, const int elem, const int kv_elem, float scale, float v_scale, float softcap,
        const float *sinks, void *out, int64_t out_tok_stride, float *qf, float *scores, float *acc, float *inv_sum) {
    const int64_t ctx_len = seq_len - q_len, rows_per_head = q_len * G, R = (h1 - h0) * rows_per_head;
    const int64_t lo = first_key(ctx_len, window);  /* query 0's first key: no query sees one before */

    for (int64_t r = 0; r < R; r++) {
        const int64_t h = h0 + r / rows_per_head, i = (r % rows_per_head) / G, g = r % G;
        const int64_t base = i * q_tok_stride + (h * G + g) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) qf[r * D + d] = load(q, base + d, elem) * scale;
    }

    /* Pass 1: scores. */
    for (int64_t b = lo / bs, t0 = b * bs; t0 < seq_len; t0 += bs, b++) {
        const int64_t nt = min64(bs, seq_len - t0);
        for (int64_t j = t0 < lo ? lo - t0 : 0; j < nt; j++) {
            const int64_t t = t0 + j, first_query = t > ctx_len ? t - ctx_len : 0;
            const int64_t end_query = window > 0 ? min64(q_len, t - ctx_len + window) : q_len;
            const int64_t key = (table[b] * bs + j) * hkv * D;
            for (int64_t h = h0; h < h1; h++) {
                float converted[D];  /* the key row as fp32, read by its G rows (fp32: in place) */
                const float *kr = (const float *)kv + key + h * D;
                if (kv_elem != ELEM_F32) {
                    load_row(kv, key + h * D, D, kv_elem, converted);
                    kr = converted;
                }
                for (int64_t r = (h - h0) * rows_per_head + first_query * G; r < (h - h0) * rows_per_head + end_query * G; r++) {
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
        const int64_t last = ctx_len + (r % rows_per_head) / G, first = first_key(last, window);
        const float *sink = sinks ? sinks + (h0 + r / rows_per_head) * G + r % G : NULL;
        inv_sum[r] = softmax_row(scores + r * seq_len + first, last + 1 - first, softcap, sink) * v_scale;
    }

    /* Pass 2: probability-weighted values. */
    memset(acc, 0, (size_t)(R * D) * sizeof(float));
    for (int64_t b = lo / bs, t0 = b * bs; t0 < seq_len; t0 += bs, b++) {
        const int64_t nt = min64(bs, seq_len - t0);
        for (int64_t j = t0 < lo ? lo - t0 : 0; j < nt; j++) {
            const int64_t t = t0 + j, first_row = (t > ctx_len ? t - ctx_len : 0) * G;
            const int64_t end_row = (window > 0 ? min64(q_len, t - ctx_len + window) : q_len) * G;
            const int64_t value = v_offset + (table[b] * bs + j) * hkv * D;
            for (int64_t h = h0; h < h1; h++) {
                float v[D];
                load_row(kv, value + h * D, D, kv_elem, v);
                for (int64_t r = (h - h0) * rows_per_head + first_row; r < (h - h0) * rows_per_head + end_row; r++) {
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

#include "attention_avx512.h"

/* Specialisations for the common head sizes and each element-type pair, and the generic fallback. */
#define ATTEND_ARGS q, q_tok_stride, kv, v_offset, table, seq_len, q_len, window, h0, h1, G, bs, hkv
#define ATTEND_TAIL scale, v_scale, softcap, sinks, out, out_tok_stride, qf, scores, acc, inv_sum
#define ATTEND_D(elem, kv_elem)                                                                  \
    switch (D) {                                                                                  \
        case 64: attend(ATTEND_ARGS, 64, elem, kv_elem, ATTEND_TAIL); break;                     \
        case 128: attend(ATTEND_ARGS, 128, elem, kv_elem, ATTEND_TAIL); break;                   \
        default: attend(ATTEND_ARGS, D, elem, kv_elem, ATTEND_TAIL); break;                      \
    }
static void attend_any(const void *q, int64_t q_tok_stride, const void *kv, int64_t v_offset,
                       const int64_t *table, int64_t seq_len, int64_t q_len, int64_t window, int64_t h0,
                       int64_t h1, int64_t G, int64_t bs, int64_t hkv, int64_t D, int elem, int kv_elem, float scale,
                       float v_scale, float softcap, const float *sinks, void *out, int64_t out_tok_stride,
                       float *qf, float *scores, float *acc, float *inv_sum) {
#if defined(HAVE_DECODE64)
    /* Every query token as a decode of the keys it sees: a row's arithmetic must not depend on
       how many queries its request has this step (a speculative verification's rows must give
       what decoding them one by one gives, bit for bit), and attend() sums in another order. */
    if (D == 64 && elem == ELEM_F32 && G >= 1 && G <= 8 && seq_len >= q_len && q_len > 0) {
        for (int64_t i = 0; i < q_len; i++) {
            const int64_t keys = seq_len - q_len + i + 1;
            attend_decode((const float *)q + i * q_tok_stride, kv, v_offset, table, keys,
                          first_key(keys - 1, window), h0, h1, G, bs, hkv, kv_elem, scale, v_scale, softcap,
                          sinks, (float *)out + i * out_tok_stride, scores, qf);
        }
        return;
    }
#endif
    if (elem == ELEM_BF16) {
        ATTEND_D(ELEM_BF16, ELEM_BF16)
    } else {
        switch (kv_elem) {
            case ELEM_F16: ATTEND_D(ELEM_F32, ELEM_F16) break;
            case ELEM_FP8_E4M3: ATTEND_D(ELEM_F32, ELEM_FP8_E4M3) break;
            case ELEM_FP8_E5M2: ATTEND_D(ELEM_F32, ELEM_FP8_E5M2) break;
            case ELEM_Q8_0: ATTEND_D(ELEM_F32, ELEM_Q8_0) break;
            default: ATTEND_D(ELEM_F32, ELEM_F32) break;
        }
    }
}

/* Whether the kernels take queries of type elem over K/V of type kv_elem at head size D: fp32
   queries over fp32, fp16, fp8 or q8_0 (D a multiple of its 32-value blocks) K/V; bf16 over bf16. */
static int takes_types(int elem, int kv_elem, int64_t D) {
    if (elem == ELEM_BF16) return kv_elem == ELEM_BF16;
    if (elem != ELEM_F32) return 0;
    if (kv_elem == ELEM_Q8_0) return D % Q8_0_VALUES == 0;
    return kv_elem == ELEM_F32 || kv_elem == ELEM_F16 || kv_is_fp8(kv_elem);
}

/* Returns 0, -1 when scratch memory could not be allocated (out is then incomplete), or -2
   for element types it does not take (takes_types). k_scale and v_scale: fp8 K/V's per-tensor
   scales (1 for the other types); window: the sliding window (0: none); softcap: the scores'
   soft-cap (soft_cap; 0: none); sinks: [hq] fp32, each query head's attention sink (softmax_row;
   NULL: none).
   heads_per_item KV heads form one work item: all of them (each
   key row read as one contiguous run) when there are enough requests to keep the threads
   busy, else one. */
int paged_attention(const void *q, int64_t q_tok_stride, const void *kv, int64_t num_blocks,
                    int64_t bs, int64_t hkv, int64_t D, int64_t hq, const int64_t *tables,
                    int64_t table_stride, const int64_t *query_start, const int64_t *seq_lens,
                    const int64_t *reqs, int64_t num_reqs, float scale, float k_scale, float v_scale,
                    void *out, int64_t out_tok_stride, int elem, int kv_elem, int num_threads, int64_t window,
                    float softcap, const float *sinks) {
    if (!takes_types(elem, kv_elem, D)) return -2;
    scale *= k_scale * kv_unit(kv_elem);  /* q . (k_scale k) = (k_scale q) . k; rows read / kv_unit */
    v_scale *= kv_unit(kv_elem);
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
                           tables + r * table_stride, seq_lens[r], query_start[r + 1] - start, window, h0,
                           h0 + heads_per_item, G, bs, hkv, D, elem, kv_elem, scale, v_scale, softcap, sinks,
                           (char *)out + start * out_tok_stride * elem_size, out_tok_stride,
                           rows, scores, rows + max_rows * D, rows + 2 * max_rows * D);
            }
        }
        free(scores);
        free(rows);
    }
    return failed ? -1 : 0;
}

/* ---- Long queries (prefill chunks): flash attention, PF_KEYS keys at a time.
   The path above keeps every row's scores for all seq_len keys and computes each score as its
   own dot product; torch's SDPA, which long queries took before, runs GEMMs too small to pay
   for themselves at head size 64. Here a work item is (request, KV head, PF_TOKENS query
   tokens): its R = n * G rows (row (i - i0) * G + g: query i, head h * G + g) go over the keys
   that item's last query sees, 16 at a time, with an online softmax (each row's running max m,
   sums l, and output o rescaled by exp(m_old - m_new) when the max grows). A chunk's keys are
   converted to fp32 and transposed once (kt [D][16]: lane j = key t0 + j), so a row's 16
   scores are D vector FMAs with its query values broadcast; its values (vb [16][D]) are
   then added into o with the 16 probabilities broadcast. PF_ROWS rows share each load of kt
   and vb. Masked keys score PF_MASKED, whose exp() against any row max is 0: no infinity
   ever appears (the build uses -ffast-math). A row with an attention sink starts from it as
   if it were a key of no value: m = sink, l = e^(sink - m) = 1, o = 0; each rescale by
   e^(m_old - m_new) then keeps its term e^(sink - m) in l exactly as it does the keys'.
   The sums run in another order than attend_decode's, so these rows' bits depend on the
   chunking; queries up to NATIVE_MAX_QUERY_LEN (attention.py) never come here. */
#if defined(HAVE_TILES)
#define PF_KEYS 16
#define PF_TOKENS 32
#define PF_MAX_D 256
#define PF_MASKED (-1e30f)
#if defined(__AVX512F__) && defined(__AVX512BW__)  /* as tile_vectors.h: vf is one zmm */
#define PF_ROWS 8  /* 8 independent FMA chains of one zmm each: 2 FMAs a cycle at 4 cycles' latency */
#define PF_WIDE_CASES(call) \
    case 8: call(8); break; \
    case 7: call(7); break; \
    case 6: call(6); break; \
    case 5: call(5); break;
#else
#define PF_ROWS 4  /* each vf is two ymm: 8 chains, and 8 + 2 + 1 of AVX2's 16 registers */
#define PF_WIDE_CASES(call)
#endif

/* sc[r][0..16) = qf[r] . kt (the 16 keys), for n (constant after inlining) rows. */
static inline __attribute__((always_inline)) void pf_scores(const float *qf, const float *kt, const int64_t D,
                                                            const int n, float *sc) {
    vf acc[PF_ROWS];
    for (int r = 0; r < n; r++) acc[r] = vf_zero();
    for (int64_t d = 0; d < D; d++) {
        const vf k = vf_loadf(kt + d * PF_KEYS);
        for (int r = 0; r < n; r++) acc[r] = vf_fma(vf_set1(qf[r * D + d]), k, acc[r]);
    }
    for (int r = 0; r < n; r++) vf_store(sc + r * PF_KEYS, acc[r]);
}

/* o[r] = o[r] * alpha[r] + sum_j p[r][j] vb[j] over the chunk's nt keys, for n rows. */
static inline __attribute__((always_inline)) void pf_values(float *o, const float *p, const float *alpha,
                                                            const float *vb, const int64_t D, const int n,
                                                            const int64_t nt) {
    for (int64_t c = 0; c < D; c += 16) {
        vf acc[PF_ROWS];
        for (int r = 0; r < n; r++) acc[r] = vf_mul(vf_loadf(o + r * D + c), vf_set1(alpha[r]));
        for (int64_t j = 0; j < nt; j++) {
            const vf v = vf_loadf(vb + j * D + c);
            for (int r = 0; r < n; r++) acc[r] = vf_fma(vf_set1(p[r * PF_KEYS + j]), v, acc[r]);
        }
        for (int r = 0; r < n; r++) vf_store(o + r * D + c, acc[r]);
    }
}

#define PF_BLOCKS(call)                                                                        \
    for (int64_t r0 = r_first; r0 < r_end; r0 += PF_ROWS) {                                     \
        switch (r_end - r0 < PF_ROWS ? r_end - r0 : PF_ROWS) { /* constant n: unrolled, in registers */ \
        PF_WIDE_CASES(call)                                                                    \
        case 4: call(4); break;                                                                \
        case 3: call(3); break;                                                                \
        case 2: call(2); break;                                                                \
        default: call(1); break;                                                               \
        }                                                                                      \
    }

/* Floats of scratch one work item of R rows needs. */
static inline int64_t pf_scratch(int64_t R, int64_t D) { return 2 * R * D + 2 * R * PF_KEYS + 2 * R + 2 * PF_KEYS * D; }

/* Queries i0 .. i1 of a request (q_len queries, seq_len keys), KV head h. q and out are fp32. */
static void pf_item(const float *q, int64_t q_tok_stride, const void *kv, int64_t v_offset, const int64_t *table,
                    int64_t seq_len, int64_t q_len, int64_t window, int64_t i0, int64_t i1, int64_t h, int64_t G, int64_t bs,
                    int64_t hkv, const int64_t D, const int kv_elem, float scale, float v_scale, float softcap,
                    const float *sinks, float *out, int64_t out_tok_stride, float *scratch) {
    const int64_t ctx_len = seq_len - q_len, R = (i1 - i0) * G, keys = ctx_len + i1;
    float *qf = scratch, *o = qf + R * D, *sc = o + R * D, *l = sc + R * PF_KEYS, *m = l + R * PF_KEYS;
    float *alpha = m + R, *kt = alpha + R, *vb = kt + PF_KEYS * D;
    for (int64_t r = 0; r < R; r++) {
        const float *qr = q + (i0 + r / G) * q_tok_stride + (h * G + r % G) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) qf[r * D + d] = qr[d] * scale;
    }
    memset(o, 0, (size_t)(R * D) * sizeof(float));
    memset(l, 0, (size_t)(R * PF_KEYS) * sizeof(float));
    for (int64_t r = 0; r < R; r++) {  /* the running max and sum before any key: the sink's */
        m[r] = sinks ? sinks[h * G + r % G] : PF_MASKED;
        l[r * PF_KEYS] = sinks ? 1.f : 0.f;
    }
    /* From query i0's first key (under a window the later queries' first keys come later). */
    for (int64_t t0 = first_key(ctx_len + i0, window); t0 < keys; t0 += PF_KEYS) {
        const int64_t nt = min64(PF_KEYS, keys - t0);
        for (int64_t j = 0; j < PF_KEYS; j++) {
            float k[PF_MAX_D];
            if (j < nt) {
                const int64_t t = t0 + j, row = ((table[t / bs] * bs + t % bs) * hkv + h) * D;
                load_row(kv, row, D, kv_elem, k);
                load_row(kv, v_offset + row, D, kv_elem, vb + j * D);
            } else {  /* past the last key: zeros (their scores are masked anyway) */
                memset(k, 0, (size_t)D * sizeof(float));
                memset(vb + j * D, 0, (size_t)D * sizeof(float));
            }
            for (int64_t d = 0; d < D; d++) kt[d * PF_KEYS + j] = k[d];
        }
        /* Rows of queries before t0 - ctx_len see none of these keys: they are left as they are. */
        const int64_t r_first = (t0 - ctx_len > i0 ? t0 - ctx_len - i0 : 0) * G;
        /* Under a window, rows of queries from t0 + nt - 1 - ctx_len + window on see none either
           (their first key is past the chunk): every row in [r_first, r_end) sees one key at least. */
        const int64_t r_end = window > 0 ? min64(i1, t0 + nt - 1 - ctx_len + window) * G - i0 * G : R;
#define PF_SCORES(n) pf_scores(qf + r0 * D, kt, D, n, sc + r0 * PF_KEYS)
        PF_BLOCKS(PF_SCORES)
        /* Each row's new max; then, vectorised across rows, its rescale factor; then its
           probabilities. l keeps 16 partial sums a row (added up at the end): no horizontal sum
           per chunk. */
        for (int64_t r = r_first; r < r_end; r++) {
            float *s = sc + r * PF_KEYS;
            const int64_t last = ctx_len + i0 + r / G;
            const int64_t visible = last - t0 + 1;  /* of this chunk's keys, >= 1 here */
            const int64_t hidden = first_key(last, window) - t0;  /* keys before the window */
            float mx = m[r];
#pragma omp simd reduction(max : mx)
            for (int64_t j = 0; j < PF_KEYS; j++) {
                s[j] = j < visible && j >= hidden ? soft_cap(s[j], softcap) : PF_MASKED;
                mx = s[j] > mx ? s[j] : mx;
            }
            alpha[r] = mx;  /* the new max, until the loop below */
        }
#pragma omp simd
        for (int64_t r = r_first; r < r_end; r++) {
            const float mx = alpha[r];
            alpha[r] = expf(m[r] - mx);
            m[r] = mx;
        }
        for (int64_t r = r_first; r < r_end; r++) {
            float *s = sc + r * PF_KEYS, *lr = l + r * PF_KEYS;
            const float mx = m[r], a = alpha[r];
#pragma omp simd
            for (int64_t j = 0; j < PF_KEYS; j++) {
                s[j] = expf(s[j] - mx);
                lr[j] = lr[j] * a + s[j];
            }
        }
#define PF_VALUES(n) pf_values(o + r0 * D, sc + r0 * PF_KEYS, alpha + r0, vb, D, n, nt)
        PF_BLOCKS(PF_VALUES)
#undef PF_SCORES
#undef PF_VALUES
    }
    for (int64_t r = 0; r < R; r++) {
        float *outr = out + (i0 + r / G) * out_tok_stride + (h * G + r % G) * D;
        float sum = 0.f;
        for (int64_t j = 0; j < PF_KEYS; j++) sum += l[r * PF_KEYS + j];
        const float inv = v_scale / sum;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) outr[d] = o[r * D + d] * inv;
    }
}

/* D a constant where it is a common head size: the loops over it unroll. */
static void pf_item_any(const float *q, int64_t q_tok_stride, const void *kv, int64_t v_offset,
                        const int64_t *table, int64_t seq_len, int64_t q_len, int64_t window, int64_t i0, int64_t i1,
                        int64_t h,
                        int64_t G, int64_t bs, int64_t hkv, int64_t D, int kv_elem, float scale, float v_scale,
                        float softcap, const float *sinks, float *out, int64_t out_tok_stride, float *scratch) {
#define PF_ITEM(d, e) pf_item(q, q_tok_stride, kv, v_offset, table, seq_len, q_len, window, i0, i1, h, G, bs, hkv, d, e, \
                              scale, v_scale, softcap, sinks, out, out_tok_stride, scratch)
#define PF_D(e)                                \
    if (D == 64) PF_ITEM(64, e);               \
    else if (D == 128) PF_ITEM(128, e);        \
    else PF_ITEM(D, e);
    switch (kv_elem) {
        case ELEM_F16: PF_D(ELEM_F16) break;
        case ELEM_FP8_E4M3: PF_D(ELEM_FP8_E4M3) break;
        case ELEM_FP8_E5M2: PF_D(ELEM_FP8_E5M2) break;
        case ELEM_Q8_0: PF_D(ELEM_Q8_0) break;
        default: PF_D(ELEM_F32) break;
    }
#undef PF_D
#undef PF_ITEM
}
#endif

/* 1 where paged_prefill_attention runs for these element types and head size here. */
int paged_prefill_supported(int elem, int kv_elem, int64_t D) {
#if defined(HAVE_TILES)
    return elem == ELEM_F32 && takes_types(elem, kv_elem, D) && D % 16 == 0 && D > 0 && D <= PF_MAX_D;
#else
    (void)elem, (void)kv_elem, (void)D;
    return 0;
#endif
}

/* paged_attention's contract, for requests of any query count, by the flash path above. Within
   a request the work items go longest first (its later queries see more keys); requests go in
   the order given. Returns 0, -1 when scratch memory could not be allocated, -2 where
   paged_prefill_supported says no. */
int paged_prefill_attention(const void *q, int64_t q_tok_stride, const void *kv, int64_t num_blocks,
                            int64_t bs, int64_t hkv, int64_t D, int64_t hq, const int64_t *tables,
                            int64_t table_stride, const int64_t *query_start, const int64_t *seq_lens,
                            const int64_t *reqs, int64_t num_reqs, float scale, float k_scale, float v_scale,
                            void *out, int64_t out_tok_stride, int elem, int kv_elem, int num_threads,
                            int64_t window, float softcap, const float *sinks) {
    if (!paged_prefill_supported(elem, kv_elem, D)) return -2;
#if defined(HAVE_TILES)
    scale *= k_scale * kv_unit(kv_elem);
    v_scale *= kv_unit(kv_elem);
    const int64_t G = hq / hkv, v_offset = num_blocks * bs * hkv * D;
    /* Item k of request n: query tile tiles[n] - 1 - k / hkv, KV head k % hkv; item_start[n] is
       the first item of request n. */
    int64_t *item_start = malloc((size_t)(num_reqs + 1) * sizeof(int64_t));
    if (!item_start) return -1;
    item_start[0] = 0;
    for (int64_t n = 0; n < num_reqs; n++) {
        const int64_t r = reqs[n], q_len = query_start[r + 1] - query_start[r];
        item_start[n + 1] = item_start[n] + (q_len + PF_TOKENS - 1) / PF_TOKENS * hkv;
    }
    const int64_t items = item_start[num_reqs];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc((size_t)pf_scratch(PF_TOKENS * G, D) * sizeof(float));
        int64_t n = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!scratch) {
                failed = 1;
                continue;
            }
            /* The item's request: n moves either way (a nonmonotonic schedule, libomp's, may hand a
               thread a lower item than its last). */
            while (item < item_start[n]) n--;
            while (item >= item_start[n + 1]) n++;
            const int64_t r = reqs[n], start = query_start[r], q_len = query_start[r + 1] - start;
            const int64_t k = item - item_start[n], tiles = (item_start[n + 1] - item_start[n]) / hkv;
            const int64_t i0 = (tiles - 1 - k / hkv) * PF_TOKENS, i1 = min64(i0 + PF_TOKENS, q_len);
            pf_item_any((const float *)q + start * q_tok_stride, q_tok_stride, kv, v_offset,
                        tables + r * table_stride, seq_lens[r], q_len, window, i0, i1, k % hkv, G, bs, hkv, D, kv_elem,
                        scale, v_scale, softcap, sinks, (float *)out + start * out_tok_stride, out_tok_stride,
                        scratch);
        }
        free(scratch);
    }
    free(item_start);
    return failed ? -1 : 0;
#else
    (void)q, (void)q_tok_stride, (void)kv, (void)num_blocks, (void)bs, (void)hkv, (void)hq, (void)tables;
    (void)table_stride, (void)query_start, (void)seq_lens, (void)reqs, (void)num_reqs, (void)scale, (void)out;
    (void)k_scale, (void)v_scale, (void)out_tok_stride, (void)num_threads, (void)window, (void)softcap, (void)sinks;
    return -2;
#endif
}

/* ---- Row conversions alone, for tests of kv_quant.h against model/kv_quant.py: `rows` rows of D
   fp32 values at src -> the cache type at dst (kv_store_rows: 0, or 4 for a type this build
   cannot write), and back (load_row, as the attention reads them: 0, or -2 for a type it does
   not read). */
int kv_quantize_rows(void *dst, const float *src, int64_t rows, int64_t D, int kv_elem, float inv_scale) {
    if (kv_elem == ELEM_BF16 || (kv_elem == ELEM_Q8_0 && D % Q8_0_VALUES)) return 4;
    return kv_store_rows(dst, src, rows, D, kv_elem, inv_scale);
}

int kv_dequantize_rows(const void *src, int64_t rows, int64_t D, int kv_elem, float *dst) {
    if (!takes_types(ELEM_F32, kv_elem, D)) return -2;
    for (int64_t r = 0; r < rows; r++) {
        load_row(src, r * D, D, kv_elem, dst + r * D);
        for (int64_t d = 0; d < D; d++) dst[r * D + d] *= kv_unit(kv_elem);
    }
    return 0;
}
