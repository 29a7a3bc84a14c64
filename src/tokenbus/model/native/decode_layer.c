/* One Llama-family decoder layer (dense or MoE) of a decode-sized step in one C call (tokenbus, model/native).

   At one stream the ~40 torch ops and ctypes calls around a layer's arithmetic cost about as
   much again in dispatch (benchmarks/decode_profile.py --layer-by-layer shows it). Here the
   layer is the same kernels in sequence, called through function pointers to the other native
   objects (quant_tiles.c, paged_attention.c, fused_ops.c), with no Python in between:

     h, residual = add_rms_norm(x, residual) * input_norm (no input_norm: h = residual = x + residual)
     qkv         = h @ Wqkv.T (+ bias)                  GGUF tiles, a shard per type; x fp32, int16, int8, bf16
                   (q and k only where the values are the keys, k_eq_v: v = k as projected; q only where
                   the layer reads another's K/V, kv_reader: Gemma 4's)
     q, k        each head RMS-normed over its D values, where the layer has q_norm / k_norm (Qwen3),
                 or each token's q and k normed whole (qk_norm_whole: OLMo 2); v's heads by v_norm
     q, k        rotated in place (rotate-half)
     K, V        written to the cache at the step's slots (fp32, or rounded to fp16, fp8 or q8_0:
                 kv_quant.h, as model/kv_quant.py rounds them); not by a reader
     attn        = paged attention of q over the cache (each request's rows; a sliding window's last keys)
                   with each head's attention sink, where the layer has them (gpt-oss)
                   (multi-head latent attention in place of the steps from qkv to here, where the layer has
                   it: latent_attention, model/mla.py's forward: q through its bottleneck, the latent and
                   its turned key as the one KV head, each head's query absorbed through W_UK, each head's
                   value through W_UV after the attention)
     o           = attn @ Wo.T (+ bias)
     o           = rms_norm(o) * post_attn_norm, where the layer has one (Gemma's sandwich norms)
     o           = o * residual_scale, where it is not 1 (Granite's residual_multiplier)
     h, residual = add_rms_norm(o, residual) * post_norm (no post_norm: h = residual = o + residual)
     x_out       = act(h @ Wgate.T) * (h @ Wup.T) @ Wdown.T (act: SiLU, or GeGLU's tanh gelu), or a
                   sparse MoE MLP of h (moe_mlp, decode_moe.h: the router's top k experts of each
                   token, each expert once over its tokens), or both, each output normed, summed
                   (Gemma 4's experts beside the MLP, on their own norm of the residual stream)
     x_out       = rms_norm(x_out) * post_mlp_norm, where the layer has one
     x_out       = x_out * residual_scale, where it is not 1
     x_out       = (residual_out + x_out, its per-layer input joined) * layer_scalar, residual_out = 0,
                   where the layer's output is whole (Gemma 4's: whole_output)

   Each layer turns q and k by its own rotary table (Gemma 3's local layers: their own base; Gemma 4's
   of their own head size) and reads its own KV group's block tables and slots (a hybrid KV cache: one
   group per window), with K/V heads of its own count and size.

   Each linear adds its LoRA side path for rows with an adapter (lora_add). Without adapters,
   exactly what decoder.DecoderLayer.forward (SandwichDecoderLayer.forward, Gemma4DecoderLayer.forward) computes on the
   same kernels (the eager path with the native attention backend): the same results, bit for bit (with them, the side
   path sums in another order than torch's GEMMs; an MoE's routing weights differ by float rounding: expf here, torch's
   softmax there, and Gemma 4's router input by its weightless norm: add_rms_norm's sum in order here, torch's mean and
   pow there). The caller checks the preconditions (fp32, every linear's
   shards tiled, only the native attention in the plan).
   x_out may alias x, residual_out may alias residual (both are read before they are written,
   element by element). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kv_quant.h"

/* y[t] += (A_s x[t]) · scaling Bᵀ_s for each row t with a slot s: what LinearLoRA adds in torch.
   Slot by slot, so that each adapter's A and B rows are read once for all its rows, not once per
   row (four adapters of rank 16 on every projection of a 135M model are ~116 MB of fp32: past
   the cache, what a step reads is what it costs). Rows are sorted by slot (order[], slot s's at
   [first[s], first[s + 1])); one parallel region splits (slot, A row) pairs, then (slot, block of
   B's columns) pairs: the same sums in the same order whatever the thread count.
   0, or 3 when out of memory. */
static int lora_add(const linear *l, const float *x, int64_t T, float *y, const int64_t *slots) {
    const int64_t W = l->lora_width, in = l->cols, out = l->rows, block = 64;
    int64_t num_slots = 0;
    for (int64_t t = 0; t < T; t++) num_slots = slots[t] + 1 > num_slots ? slots[t] + 1 : num_slots;
    if (!num_slots) return 0;
    int64_t *first = calloc((size_t)(num_slots + 1), sizeof(int64_t)), *order = malloc(sizeof(int64_t) * (size_t)T);
    float *h = malloc(sizeof(float) * (size_t)(T * W));
    if (!first || !order || !h) {
        free(first);
        free(order);
        free(h);
        return 3;
    }
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= 0) first[slots[t] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) first[s + 1] += first[s];
    for (int64_t t = 0, *next = first; t < T; t++)  /* counting sort, stable: rows keep their order */
        if (slots[t] >= 0) order[next[slots[t]]++] = t;
    for (int64_t s = num_slots; s > 0; s--) first[s] = first[s - 1];  /* next[] advanced first[] */
    first[0] = 0;
    const int64_t num_blocks = (out + block - 1) / block;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_slots * W; task++) {
            const int64_t s = task / W, r = task % W;
            const float *a = l->lora_a + (s * W + r) * in;
            for (int64_t p = first[s]; p < first[s + 1]; p++) {
                const float *xt = x + order[p] * in;
                float dot = 0.f;
                for (int64_t i = 0; i < in; i++) dot += a[i] * xt[i];
                h[p * W + r] = dot;
            }
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_slots * num_blocks; task++) {
            const int64_t s = task / num_blocks, o0 = task % num_blocks * block;
            const int64_t o1 = o0 + block < out ? o0 + block : out;
            const float *b = l->lora_b + s * W * out;
            for (int64_t p = first[s]; p < first[s + 1]; p++) {
                float *yt = y + order[p] * out;
                for (int64_t r = 0; r < W; r++) {
                    const float hr = h[p * W + r];
                    if (hr == 0.f) continue; /* a padding row, or a shard the adapter leaves alone */
                    for (int64_t o = o0; o < o1; o++) yt[o] += hr * b[r * out + o];
                }
            }
        }
    }
    free(first);
    free(order);
    free(h);
    return 0;
}

static int run_linear(const kernels *k, const linear *l, const float *x, int64_t T, float *y, const step *s) {
    for (int64_t i = 0, first = 0; i < l->num_shards; first += l->shards[i++].rows) {
        const shard *part = &l->shards[i];
        const int act = (int)(super_block_format(part->qtype) ? s->k_activations : s->activations);
        const int status = k->matmul((int)part->qtype, part->tiles, part->rows, l->cols, x, T, l->cols, y + first,
                                     l->rows, act, (int)s->num_threads);
        if (status) return status;
    }
    if (l->bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < l->rows; n++) y[t * l->rows + n] += l->bias[n];
    return l->lora_a && s->lora_slots ? lora_add(l, x, T, y, s->lora_slots) : 0;
}

/* Qwen3's q/k norm, in place: each query head of each token normed by q_norm, each key head by
   k_norm, through add_rms_norm with no residual (the heads of a token are rows of D values), as the
   layer-by-layer path calls it; OLMo 2's (qk_norm_whole) takes each token's q and k as one row. `out` may alias `x` there: a row is copied whole into residual_out
   (here `scratch`, one token's query heads) before it is written. */
static void head_norms(const kernels *k, const layer *w, float *qkv, int64_t T, int64_t qkv_n, float *scratch,
                       int threads) {
    const int64_t D = w->head_dim, hq = w->num_heads, hkv = w->num_kv_heads;
    if (w->qk_norm_whole) {
        /* OLMo 2's: row t's q (then k) as one row of Hq * D (Hkv * D) values, read in place
           (rows qkv_n apart), normed into scratch [T, Hq * D] and copied back */
        const int64_t widths[2] = {hq * D, hkv * D}, starts[2] = {0, hq * D};
        const float *weights[2] = {w->q_norm, w->k_norm};
        for (int part = 0; part < 2; part++) {
            float *first = qkv + starts[part];
            k->add_rms_norm(first, qkv_n, NULL, 0, scratch, weights[part], scratch, T, widths[part], w->eps, threads);
            for (int64_t t = 0; t < T; t++)
                memcpy(first + t * qkv_n, scratch + t * widths[part], sizeof(float) * (size_t)widths[part]);
        }
        return;
    }
    for (int64_t t = 0; t < T; t++) {
        float *q = qkv + t * qkv_n, *key = q + hq * D;
        k->add_rms_norm(q, D, NULL, 0, scratch, w->q_norm, q, hq, D, w->eps, threads);
        if (w->k_norm) /* none in a layer reading another's K/V */
            k->add_rms_norm(key, D, NULL, 0, scratch, w->k_norm, key, hkv, D, w->eps, threads);
    }
}

#include "decode_moe.h"

/* h, residual_out = add_rms_norm(x, residual) * norm; with no norm, both the sum x + residual (or x)
   itself, as decoder._add_and_norm adds it. */
static void add_norm(const kernels *k, const float *x, const float *residual, float *residual_out, const float *norm,
                     float *h, int64_t T, int64_t H, float eps, int threads) {
    if (norm) {
        k->add_rms_norm(x, H, residual, H, residual_out, norm, h, T, H, eps, threads);
        return;
    }
    for (int64_t i = 0; i < T * H; i++) {
        residual_out[i] = residual ? x[i] + residual[i] : x[i];
        h[i] = residual_out[i];
    }
}

/* Turn x's `rope` values by one row of cos/sin (rope / 2 each): pair i is (x[2i], x[2i + 1]) when
   interleaved, else (x[i], x[i + rope / 2]); each pair (a, b) -> (a cos - b sin, b cos + a sin). */
static void turn(float *x, const float *cos, const float *sin, int64_t rope, int64_t interleaved) {
    const int64_t half = rope / 2;
    for (int64_t i = 0; i < half; i++) {
        float *a = interleaved ? x + 2 * i : x + i, *b = interleaved ? x + 2 * i + 1 : x + i + half;
        const float x0 = *a, x1 = *b;
        *a = x0 * cos[i] - x1 * sin[i];
        *b = x1 * cos[i] + x0 * sin[i];
    }
}

/* Multi-head latent attention of a decode step (mla; model/mla.py's LatentAttention.forward):
   from h [T, hidden], each head's value [T, H * v] in out, and each token's latent and turned key
   written to the cache as its K and its V. 0, or a kernel's status (3: out of memory). */
static int latent_attention(const kernels *k, const layer *w, const step *s, const kv_group *group, void *kv_cache,
                            const float *h, int64_t T, float *out) {
    const mla *m = w->mla;
    const int64_t H = w->num_heads, c = m->kv_lora_rank, rope = m->rope_dim, nope = m->nope_dim, v = m->v_head_dim;
    const int64_t D = c + rope, qd = nope + rope, qa_n = m->q_lora_rank;
    const int threads = (int)s->num_threads;
    const int64_t norm_n = (qa_n > c ? qa_n : c) * T;
    float *buf = malloc(sizeof(float) * (size_t)(T * (qa_n + H * qd + D + c + 2 * H * D) + norm_n));
    if (!buf) return 3;
    float *qa = buf, *q = qa + T * qa_n, *latent = q + T * H * qd, *key = latent + T * D, *query = key + T * c,
          *attn = query + T * H * D, *scratch = attn + T * H * D;
    int status = 0;
    if (m->q_a.num_shards) {
        if ((status = run_linear(k, &m->q_a, h, T, qa, s))) goto done;
        k->add_rms_norm(qa, qa_n, NULL, 0, scratch, m->q_a_norm, qa, T, qa_n, m->latent_eps, threads);
        if ((status = run_linear(k, &m->q_b, qa, T, q, s))) goto done;
    } else if ((status = run_linear(k, &m->q_b, h, T, q, s))) {
        goto done;
    }
    if ((status = run_linear(k, &m->kv_a, h, T, latent, s))) goto done;
    /* each token's row of latent becomes its key (the one KV head): [kv_a_layernorm(c), turned k_pe] */
    k->add_rms_norm(latent, D, NULL, 0, scratch, m->kv_a_norm, key, T, c, m->latent_eps, threads);
    const float *cos = s->cos + w->rope_table * s->rope_stride, *sin = s->sin + w->rope_table * s->rope_stride;
    const int64_t half = s->rotary_dim / 2;
    for (int64_t t = 0; t < T; t++) {
        turn(latent + t * D + c, cos + t * half, sin + t * half, rope, m->interleaved);
        memcpy(latent + t * D, key + t * c, sizeof(float) * (size_t)c);
    }
    /* each head's query: W_UK_h^T q_nope (c values), then its turned q_pe (rope) */
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t hh = 0; hh < H; hh++) {
            float *qh = q + (t * H + hh) * qd, *dst = query + (t * H + hh) * D;
            turn(qh + nope, cos + t * half, sin + t * half, rope, m->interleaved);
            memset(dst, 0, sizeof(float) * (size_t)c);
            const float *wk = m->w_uk + hh * nope * c;
            for (int64_t i = 0; i < nope; i++) {
                const float a = qh[i];
                for (int64_t j = 0; j < c; j++) dst[j] += a * wk[i * c + j];
            }
            memcpy(dst + c, qh + nope, sizeof(float) * (size_t)rope);
            if (s->q_scale)
                for (int64_t j = 0; j < D; j++) dst[j] *= s->q_scale[t];
        }
    const int kv_elem = (int)s->kv_elem;
    const int64_t slot_bytes = kv_row_bytes(D, kv_elem), v_bytes = s->num_blocks * s->block_size * slot_bytes;
    for (int64_t t = 0; t < T; t++) {
        uint8_t *slot = (uint8_t *)kv_cache + group->slots[t] * slot_bytes;
        if ((status = kv_store_rows(slot, latent + t * D, 1, D, kv_elem, 1.f / s->k_scale)) ||
            (status = kv_store_rows(slot + v_bytes, latent + t * D, 1, D, kv_elem, 1.f / s->v_scale)))
            goto done;
    }
    memset(attn, 0, sizeof(float) * (size_t)(T * H * D));
    if ((status = k->attention(query, H * D, kv_cache, s->num_blocks, s->block_size, 1, D, H, group->block_tables,
                               group->table_stride, s->query_start, s->seq_lens, s->reqs, s->num_reqs, w->scale,
                               s->k_scale, s->v_scale, attn, H * D, ELEM_F32, kv_elem, threads, 0, 0.f, NULL)))
        goto done;
    /* each head's value: W_UV_h (its attention's sum of latents, the first c values) */
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t hh = 0; hh < H; hh++) {
            const float *sum = attn + (t * H + hh) * D, *wv = m->w_uv + hh * v * c;
            for (int64_t j = 0; j < v; j++) {
                float acc = 0.f;
                for (int64_t i = 0; i < c; i++) acc += wv[j * c + i] * sum[i];
                out[t * H * v + hh * v + j] = acc;
            }
        }
done:
    free(buf);
    return status;
}

/* out [T, H] = the dense MLP of h: act(h @ Wgate.T) * (h @ Wup.T) @ Wdown.T (gate_up [T, 2I] and act
   [T, I] the caller's scratch). 0, or a kernel's status. */
static int dense_mlp(const kernels *k, const layer *w, const float *h, int64_t T, float *gate_up, float *act,
                     float *out, const step *s) {
    int status = run_linear(k, &w->gate_up, h, T, gate_up, s);
    if (status) return status;
    (w->mlp_act == MLP_GELU_TANH ? k->gelu_tanh_mul : k->silu_mul)(gate_up, T, w->intermediate, act,
                                                                    (int)s->num_threads);
    return run_linear(k, &w->down, act, T, out, s);
}

/* Gemma 4's MLP with experts beside it (Gemma4DecoderLayer.forward, the 26B-A4B's): out =
   norm(mlp(h)) + norm(experts(norm(residual))), the experts routed by the residual stream itself.
   0, 3 when out of memory, or a kernel's status. */
static int mlp_beside_experts(const kernels *k, const layer *w, const float *h, const float *residual, int64_t T,
                              int64_t H, float *gate_up, float *act, float *out, const step *s) {
    const int threads = (int)s->num_threads;
    float *buf = malloc(sizeof(float) * (size_t)(3 * T * H));
    if (!buf) return 3;
    float *h2 = buf, *routed = h2 + T * H, *scratch = routed + T * H;
    int status = dense_mlp(k, w, h, T, gate_up, act, out, s);
    if (status) goto done;
    k->add_rms_norm(out, H, NULL, 0, scratch, w->mlp_out_norm, out, T, H, w->eps, threads);
    k->add_rms_norm(residual, H, NULL, 0, scratch, w->experts_in_norm, h2, T, H, w->eps, threads);
    if ((status = moe_mlp(k, w->moe, h2, residual, T, H, routed, s))) goto done;
    k->add_rms_norm(routed, H, NULL, 0, scratch, w->experts_out_norm, routed, T, H, w->eps, threads);
    for (int64_t i = 0; i < T * H; i++) out[i] += routed[i];
done:
    free(buf);
    return status;
}

/* x[i] *= by, one rounding each (torch's `h * residual_multiplier`); nothing when by is 1. */
static void scale_rows(float *x, int64_t n, float by) {
    if (by == 1.f) return;
    for (int64_t i = 0; i < n; i++) x[i] *= by;
}

/* The end of a layer whose output is whole (Gemma4DecoderLayer.forward's): x_out [T, H] (the MLP's
   output) becomes x = residual + x_out; then x += norm(proj(gelu_tanh(gate(x)) * its per-layer inputs)),
   where the layer joins them; then x *= layer_scalar. residual_out is zeroed: the next layer's add
   (x + 0) takes x as it is. The gate's outputs and the inputs side by side make gelu_tanh_mul's
   [gate | up] rows, so the activation is the op-by-op path's call. 0, 3 when out of memory, or a
   kernel's status. */
static int whole_output(const kernels *k, const layer *w, int64_t index, const step *s, float *x_out,
                        float *residual_out, int64_t T, int64_t H) {
    for (int64_t i = 0; i < T * H; i++) x_out[i] = residual_out[i] + x_out[i];
    const per_layer_input *p = w->per_layer_input;
    int status = 0;
    if (p) {
        const int64_t P = p->gate.rows;
        const int threads = (int)s->num_threads;
        float *buf = malloc(sizeof(float) * (size_t)(T * (4 * P + 2 * H)));
        if (!buf) return 3;
        float *gate = buf, *gate_up = gate + T * P, *act = gate_up + T * 2 * P, *joined = act + T * P,
              *scratch = joined + T * H;
        if ((status = run_linear(k, &p->gate, x_out, T, gate, s))) goto done;
        for (int64_t t = 0; t < T; t++) {
            memcpy(gate_up + t * 2 * P, gate + t * P, sizeof(float) * (size_t)P);
            memcpy(gate_up + t * 2 * P + P, s->per_layer_inputs + t * s->per_layer_stride + index * P,
                   sizeof(float) * (size_t)P);
        }
        k->gelu_tanh_mul(gate_up, T, P, act, threads);
        if ((status = run_linear(k, &p->proj, act, T, joined, s))) goto done;
        k->add_rms_norm(joined, H, NULL, 0, scratch, p->norm, joined, T, H, w->eps, threads);
        for (int64_t i = 0; i < T * H; i++) x_out[i] += joined[i];
    done:
        free(buf);
        if (status) return status;
    }
    scale_rows(x_out, T * H, w->layer_scalar);
    memset(residual_out, 0, sizeof(float) * (size_t)(T * H));
    return 0;
}

/* Layer `index` of the model (its KV group: s->layer_groups[index]). 0 on success; a kernel's
   status otherwise (3: out of memory, 4: a KV type it cannot write). */
int decode_layer(const kernels *k, const layer *w, int64_t index, const step *s, void *kv_cache, const float *x,
                 const float *residual, float *x_out, float *residual_out) {
    const int64_t T = s->num_tokens, H = w->hidden, D = w->head_dim, hq = w->num_heads, hkv = w->num_kv_heads;
    /* qkv's rows hold q, k and v (qkv_n values); the projection writes proj_n of them (q and k where the
       values are the keys, q alone where the layer reads another's K/V) */
    const int64_t qkv_n = (hq + 2 * hkv) * D, proj_n = w->qkv.rows, I = w->intermediate;
    const int threads = (int)s->num_threads;
    const kv_group *group = &s->groups[s->layer_groups ? s->layer_groups[index] : 0];
    /* scratch: one token's query heads for the q/k norms (all tokens' for whole ones), or a [T, H] copy for a sandwich norm
       (add_rms_norm without a residual writes its input there before it overwrites it) */
    const int64_t head_scratch = w->q_norm || w->v_norm ? (w->qk_norm_whole ? T : 1) * hq * D : 0;
    const int64_t row_scratch = w->post_attn_norm || w->post_mlp_norm ? T * H : 0;
    const int64_t scratch_n = head_scratch > row_scratch ? head_scratch : row_scratch;
    float *buf = malloc(sizeof(float) * (size_t)(T * (H + qkv_n + hq * D + H + 3 * I) + scratch_n));
    if (!buf) return 3;
    float *h = buf, *qkv = h + T * H, *attn = qkv + T * qkv_n, *o = attn + T * hq * D, *gate_up = o + T * H,
          *act = gate_up + T * 2 * I, *scratch = act + T * I;
    int status;
    add_norm(k, x, residual, residual_out, w->input_norm, h, T, H, w->eps, threads);
    if (w->mla) { /* attn: each head's value, [T, hq * v] */
        if ((status = latent_attention(k, w, s, group, kv_cache, h, T, attn))) goto done;
        goto attended;
    }
    if ((status = run_linear(k, &w->qkv, h, T, qkv, s))) goto done;
    /* rows proj_n apart moved to qkv_n apart, the last first (each moves up, onto rows already moved) */
    for (int64_t t = proj_n < qkv_n ? T - 1 : 0; t > 0; t--)
        memmove(qkv + t * qkv_n, qkv + t * proj_n, sizeof(float) * (size_t)proj_n);
    if (w->k_eq_v) /* v: the keys as projected, before their norm and rotary */
        for (int64_t t = 0; t < T; t++)
            memcpy(qkv + t * qkv_n + (hq + hkv) * D, qkv + t * qkv_n + hq * D, sizeof(float) * (size_t)(hkv * D));
    if (w->q_norm && !w->qk_norm_after_rope) head_norms(k, w, qkv, T, qkv_n, scratch, threads);
    if (w->v_norm && !w->kv_reader)
        for (int64_t t = 0; t < T; t++) {
            float *v = qkv + t * qkv_n + (hq + hkv) * D;
            k->add_rms_norm(v, D, NULL, 0, scratch, w->v_norm, v, hkv, D, w->eps, threads);
        }
    const int64_t table = s->rope_offsets ? s->rope_offsets[w->rope_table] : w->rope_table * s->rope_stride;
    const int64_t rotary_dim = s->rope_dims ? s->rope_dims[w->rope_table] : s->rotary_dim;
    k->rope(qkv, qkv_n, T, s->cos + table, s->sin + table, w->kv_reader ? hq : hq + hkv, D, rotary_dim, threads);
    if (w->q_norm && w->qk_norm_after_rope) head_norms(k, w, qkv, T, qkv_n, scratch, threads);
    if (s->q_scale) /* after the rotary, as CausalLM.query_scale's multiply */
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < hq * D; i++) qkv[t * qkv_n + i] *= s->q_scale[t];
    /* K and V of token t to its slot: [2, NB * bs, Hkv, row], a row D values in slot_bytes / Hkv bytes. */
    const int kv_elem = (int)s->kv_elem;
    const int64_t slot_bytes = hkv * kv_row_bytes(D, kv_elem), v_bytes = s->num_blocks * s->block_size * slot_bytes;
    for (int64_t t = 0; t < T && !w->kv_reader; t++) { /* a reader's K/V are its owner's, written already */
        uint8_t *slot = (uint8_t *)kv_cache + group->slots[t] * slot_bytes;
        if ((status = kv_store_rows(slot, qkv + t * qkv_n + hq * D, hkv, D, kv_elem, 1.f / s->k_scale)) ||
            (status = kv_store_rows(slot + v_bytes, qkv + t * qkv_n + (hq + hkv) * D, hkv, D, kv_elem,
                                    1.f / s->v_scale)))
            goto done;
    }
    memset(attn, 0, sizeof(float) * (size_t)(T * hq * D));
    if ((status = k->attention(qkv, qkv_n, kv_cache, s->num_blocks, s->block_size, hkv, D, hq, group->block_tables,
                               group->table_stride, s->query_start, s->seq_lens, s->reqs, s->num_reqs, w->scale,
                               s->k_scale, s->v_scale, attn, hq * D, ELEM_F32, kv_elem, threads, w->window,
                               w->softcap, w->sinks)))
        goto done;
attended:
    if ((status = run_linear(k, &w->o, attn, T, o, s))) goto done;
    if (w->post_attn_norm) k->add_rms_norm(o, H, NULL, 0, scratch, w->post_attn_norm, o, T, H, w->eps, threads);
    scale_rows(o, T * H, w->residual_scale);
    add_norm(k, o, residual_out, residual_out, w->post_norm, h, T, H, w->eps, threads);
    if (w->moe && w->experts_in_norm)
        status = mlp_beside_experts(k, w, h, residual_out, T, H, gate_up, act, x_out, s);
    else if (w->moe)
        status = moe_mlp(k, w->moe, h, NULL, T, H, x_out, s);
    else
        status = dense_mlp(k, w, h, T, gate_up, act, x_out, s);
    if (!status && w->post_mlp_norm)
        k->add_rms_norm(x_out, H, NULL, 0, scratch, w->post_mlp_norm, x_out, T, H, w->eps, threads);
    if (!status) scale_rows(x_out, T * H, w->residual_scale);
    if (!status && w->whole_output) status = whole_output(k, w, index, s, x_out, residual_out, T, H);
done:
    free(buf);
    return status;
}

/* Layers w[0 .. n) in order, each on its own cache kv_caches[i]: x (updated in place) and the
   residual stream (filled by layer 0, which has none coming in). One C call for the whole step's
   layers: no Python between them, and OpenMP's threads never wait long enough between two
   kernels to sleep. Stops at the first failing layer, with its status. */
int decode_layers(const kernels *k, const layer *const *w, int64_t n, const step *s, void *const *kv_caches,
                  float *x, float *residual) {
    for (int64_t i = 0; i < n; i++) {
        const int status = decode_layer(k, w[i], i, s, kv_caches[i], x, i ? residual : NULL, x, residual);
        if (status) return status;
    }
    return 0;
}
