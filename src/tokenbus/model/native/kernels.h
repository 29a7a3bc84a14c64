/* The C ABI of tokenbus's native CPU kernels (model/native): every function Python calls through
   ctypes, the codes its int arguments take, and the structs decode_layer.c reads. Every .c here
   includes it, so the compiler checks each definition against its prototype; signatures.py holds
   the ctypes side in one table, and tests/model/test_native_abi.py checks that table (and
   decode_layer.py's ctypes structs) against this file. Keep one declaration per line group, in
   the plain `type name(args);` form that test parses. */
#ifndef TOKENBUS_KERNELS_H
#define TOKENBUS_KERNELS_H

#include <stdint.h>

/* ---- codes */
/* GGML tensor types (gguf's GGMLQuantizationType): the weights' block formats. */
enum {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9, Q2_K = 10, Q3_K = 11,
    Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30, MXFP4 = 39
};
/* Tile formats in 256-value super-blocks (the K-quants; Q3_K is repacked as Q6_K): the calls on
   them take their own activation mode (decode_layer.c's step.k_activations; tile_super_block). */
static inline int super_block_format(int64_t format) {
    return format == Q4_K || format == Q5_K || format == Q6_K || format == IQ4_XS;
}
/* Element types of queries and the KV cache (kv_quant.h has their row layouts). */
enum { ELEM_F32 = 0, ELEM_BF16 = 1, ELEM_F16 = 2, ELEM_FP8_E4M3 = 3, ELEM_FP8_E5M2 = 4, ELEM_Q8_0 = 5 };
/* How tile_matmul takes its activations: as they are, rounded per 32 values first (int8, int16),
   rounded to bf16, or to int8 per 256 values (Q8_K: tiles_q8k.h). */
enum { ACT_FP32 = 0, ACT_INT8 = 1, ACT_INT16 = 2, ACT_BF16 = 3, ACT_Q8_K = 4 };
/* What runs tile_matmul's ACT_BF16 (tile_bf16_engine). */
enum { BF16_ENGINE_NONE = 0, BF16_ENGINE_AVX512_BF16 = 1, BF16_ENGINE_AMX = 2 };

/* ---- paged_attention.c: attention over K/V read in place through block tables */
int paged_attention(const void *q, int64_t q_tok_stride, const void *kv, int64_t num_blocks, int64_t bs, int64_t hkv, int64_t D, int64_t hq, const int64_t *tables, int64_t table_stride, const int64_t *query_start, const int64_t *seq_lens, const int64_t *reqs, int64_t num_reqs, float scale, float k_scale, float v_scale, void *out, int64_t out_tok_stride, int elem, int kv_elem, int num_threads, int64_t window, float softcap, const float *sinks);
int paged_prefill_attention(const void *q, int64_t q_tok_stride, const void *kv, int64_t num_blocks, int64_t bs, int64_t hkv, int64_t D, int64_t hq, const int64_t *tables, int64_t table_stride, const int64_t *query_start, const int64_t *seq_lens, const int64_t *reqs, int64_t num_reqs, float scale, float k_scale, float v_scale, void *out, int64_t out_tok_stride, int elem, int kv_elem, int num_threads, int64_t window, float softcap, const float *sinks);
int paged_prefill_supported(int elem, int kv_elem, int64_t D);
int kv_quantize_rows(void *dst, const float *src, int64_t rows, int64_t D, int kv_elem, float inv_scale);
int kv_dequantize_rows(const void *src, int64_t rows, int64_t D, int kv_elem, float *dst);

/* ---- quant_matmul.c: GGUF blocks row by row, fp32 activations */
int quant_matmul(int qtype, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int num_threads);
int quant_dequant_rows(int qtype, const uint8_t *w, int64_t K, const int64_t *rows, int64_t num_rows, float *out, int num_threads);

/* ---- quant_tiles.c: GGUF blocks repacked in 16-row tiles */
int tile_supported(void);
int tile_bf16_engine(void);
int tile_q8_k(void);
int tile_super_block(int64_t format);
int tile_format(int qtype);
int64_t tile_nbytes(int qtype, int64_t N, int64_t K);
int tile_repack(int qtype, const uint8_t *w, int64_t N, int64_t K, uint8_t *out);
int tile_matmul(int qtype, const uint8_t *tiles, int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int act, int num_threads);
int tile_dequant_rows(int qtype, const uint8_t *tiles, int64_t N, int64_t K, const int64_t *rows, int64_t num_rows, float *out, int num_threads);
int tile_dequant_t(int qtype, const uint8_t *tiles, int64_t N, int64_t K, int64_t first, int64_t count, float *out, int64_t ldo, int num_threads);

/* ---- fused_ops.c: a decoder layer's elementwise steps */
void add_rms_norm(const float *x, int64_t ldx, const float *residual, int64_t ldr, float *residual_out, const float *weight, float *out, int64_t T, int64_t H, float eps, int num_threads);
void rope_inplace(float *qkv, int64_t ld, int64_t T, const float *cos, const float *sin, int64_t num_rot_heads, int64_t head_dim, int64_t rotary_dim, int num_threads);
void silu_mul(const float *gate_up, int64_t T, int64_t I, float *out, int num_threads);
void gelu_tanh_mul(const float *gate_up, int64_t T, int64_t I, float *out, int num_threads);
void clamped_swiglu_mul(const float *gate_up, int64_t T, int64_t I, float limit, float alpha, float *out, int num_threads);
void ssm_decode_step(float *states, int64_t row_stride, const int64_t *rows, int64_t n, const float *x, int64_t ldx, const float *dt, const float *A, const float *B, const float *C, int64_t ldbc, const float *D, float *y, int64_t H, int64_t G, int64_t P, int64_t N, int num_threads);
void gated_delta_rule(float *states, int64_t row_stride, const int64_t *rows, int64_t T, const float *q, const float *k, const float *v, const float *g, const float *beta, float *out, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t tiled, int num_threads);

/* ---- dense_rows.c: fp32 weights in row panels, batch-invariant */
int64_t dense_panel_floats(int64_t N, int64_t K);
void dense_pack(const float *w, int64_t N, int64_t K, float *out);
int dense_matmul(const float *panels, int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int num_threads);

/* ---- decode_layer.c: a decoder layer of a decode step in one call, through these pointers */
typedef int (*tile_matmul_fn)(int, const uint8_t *, int64_t, int64_t, const float *, int64_t, int64_t, float *, int64_t, int, int);
typedef int (*attention_fn)(const void *, int64_t, const void *, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t *, int64_t, const int64_t *, const int64_t *, const int64_t *, int64_t, float, float, float, void *, int64_t, int, int, int, int64_t, float, const float *);
typedef void (*norm_fn)(const float *, int64_t, const float *, int64_t, float *, const float *, float *, int64_t, int64_t, float, int);
typedef void (*rope_fn)(float *, int64_t, int64_t, const float *, const float *, int64_t, int64_t, int64_t, int);
typedef void (*gated_act_fn)(const float *, int64_t, int64_t, float *, int);
typedef int (*dense_matmul_fn)(const float *, int64_t, int64_t, const float *, int64_t, int64_t, float *, int64_t, int);
typedef void (*clamped_act_fn)(const float *, int64_t, int64_t, float, float, float *, int);

typedef struct {
    tile_matmul_fn matmul;
    attention_fn attention;
    norm_fn add_rms_norm;
    rope_fn rope;
    gated_act_fn silu_mul, gelu_tanh_mul;
    dense_matmul_fn dense_matmul; /* dense_rows.c's: MoE routers; NULL where no layer has one */
    clamped_act_fn clamped_swiglu_mul;
} kernels;

/* One tiled GGUF shard of a linear: `rows` of its outputs in one block type. */
typedef struct {
    int64_t qtype;
    const uint8_t *tiles;
    int64_t rows;
} shard;

typedef struct {
    /* Shards in order, their outputs side by side in y (a Q4_K_M q/k/v: q and k Q4_K, v Q6_K). */
    const shard *shards;
    int64_t num_shards;
    int64_t rows, cols; /* rows: all shards' */
    const float *bias; /* NULL: none */
    /* LoRA slots (model/lora.py), NULL: none. Slot s holds rows [s * W, (s + 1) * W) of both:
       lora_a [slots * W, cols] (its A, zero-padded) and lora_b [slots * W, rows] (scaling · Bᵀ). */
    const float *lora_a, *lora_b;
    int64_t lora_width;
} linear;

/* The gated MLP's activation: act(gate) * up; gpt-oss's experts clamp both first (MLP_CLAMPED_SWIGLU:
   fused_ops.c's clamped_swiglu_mul). */
enum { MLP_SILU = 0, MLP_GELU_TANH = 1, MLP_CLAMPED_SWIGLU = 2 };

/* A sparse MoE MLP (model/moe.py): the router's packed rows (and bias), and expert e's two linears;
   a shared expert every token runs, scaled by the sigmoid of its gate (Qwen2-MoE's). The routing
   rule's parts as SparseMoeBlock.route has them: the scores, the groups, the weights' epsilon and
   scale. */
typedef struct {
    const float *router;          /* [E, hidden] in dense_pack's panels (dense_rows.c) */
    const float *router_bias;     /* [E], added to the logits; NULL: none */
    const float *selection_bias;  /* [E], added to the probabilities to choose the top k (ERNIE's); NULL: none */
    const linear *gate_up, *down; /* [E] each */
    int64_t num_experts, top_k, norm_topk_prob;
    int64_t activation;           /* MLP_SILU, MLP_CLAMPED_SWIGLU or MLP_GELU_TANH (Gemma 4's) */
    float swiglu_limit, swiglu_alpha; /* MLP_CLAMPED_SWIGLU's */
    const linear *shared_gate_up, *shared_down; /* the shared expert (SiLU); NULL: none */
    const float *shared_gate;     /* [1, hidden] in dense_pack's panels: its gate's logit; NULL: ungated */
    int64_t shared_intermediate;
    int64_t sigmoid_scores;       /* 1: each expert's sigmoid (GLM-4.5's, MiniMax-M2's); 0: the softmax over all */
    int64_t groups, topk_groups;  /* the choice within the best topk_groups of `groups` groups; 1 group: no limit */
    float norm_eps, scale;        /* weights / (their sum + norm_eps) where renormalised, then * scale */
    /* Gemma 4's router reads its input RMS-normed without a weight (router_in_eps), times router_in_scale
       [hidden] per channel, times router_in_mult; NULL: the input as it is */
    const float *router_in_scale;
    float router_in_eps, router_in_mult;
    const float *expert_scale;    /* [E]: each chosen expert's weight times its own, last (Gemma 4's); NULL: none */
} moe;

/* Multi-head latent attention (model/mla.py): the queries through q_a (a bottleneck, RMS-normed by
   q_a_norm) then q_b, or q_b alone (q_a without shards: the q projection); kv_a gives each token's
   latent (kv_lora_rank values, RMS-normed by kv_a_norm) and its shared key's rope_dim turned dims.
   w_uk [H, nope, c] and w_uv [H, v, c] (fp32) turn each head's query into the latent and its
   attention's latent sum into its value. The cache holds one KV head of c + rope_dim values (the
   layer's head_dim), the values being the keys; the layer's qkv is unused, its o the output. */
typedef struct {
    linear q_a, q_b, kv_a;
    const float *q_a_norm, *kv_a_norm;
    const float *w_uk, *w_uv;
    int64_t q_lora_rank, kv_lora_rank, nope_dim, rope_dim, v_head_dim;
    int64_t interleaved; /* 1: the rotary turns adjacent pairs (DeepSeek's); 0: halves */
    float latent_eps;
} mla;

/* A per-layer input joined after the MLP (Gemma 3n's, Gemma 4's): x += norm(proj(gelu_tanh(gate(x))
   * the layer's slice of the step's per-layer inputs)). */
typedef struct {
    linear gate, proj; /* gate [P, hidden], proj [hidden, P] */
    const float *norm; /* [hidden] */
} per_layer_input;

typedef struct {
    linear qkv, o, gate_up, down; /* gate_up and down unused where moe is set (but with experts_in_norm) */
    /* post_norm: the norm before the MLP. NULL: none there, the sublayer takes the residual
       stream itself (OLMo 2's post-norm layers have neither) */
    const float *input_norm, *post_norm;
    /* Gemma's sandwich norms: the attention's output normed before it joins the residual, the
       MLP's output normed last; NULL: none (a pre-norm layer) */
    const float *post_attn_norm, *post_mlp_norm;
    const float *q_norm, *k_norm; /* [head_dim] each: an RMSNorm of every q / k head before the rotary; NULL: none */
    int64_t qk_norm_whole; /* 1: q_norm / k_norm are [Hq * D] / [Hkv * D] instead, each token's heads normed at once (OLMo 2's) */
    int64_t qk_norm_after_rope; /* 1: the q / k heads are normed after the rotary instead (HunYuan's) */
    float eps, scale;
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate; /* intermediate: the dense MLP's, else an expert's */
    int64_t window; /* a sliding window: each query sees its last `window` keys; 0: all */
    float softcap; /* the attention scores' soft-cap (Gemma 2's); 0: none */
    const float *sinks; /* [num_heads] fp32: each query head's attention sink (gpt-oss's); NULL: none */
    float residual_scale; /* each sublayer's output times this before it joins the residual (Granite's); 1: none */
    int64_t mlp_act; /* MLP_* */
    int64_t rope_table; /* which of the step's stacked rotary tables this layer turns by */
    const moe *moe; /* NULL: the dense MLP */
    const mla *mla; /* NULL: the attention above (qkv, the q/k norms, sinks) */
    const float *v_norm; /* [head_dim]: an RMSNorm of every value head before it is written (Gemma 4's, weightless: ones); NULL: none */
    int64_t k_eq_v; /* 1: qkv projects q and k only, the values being the keys as projected, before k's norm and rotary (Gemma 4's global layers) */
    int64_t kv_reader; /* 1: qkv projects q only, and the layer attends the K/V another layer wrote to the same cache this step (Gemma 4's shared K/V) */
    const per_layer_input *per_layer_input; /* NULL: none */
    /* 1: x_out is the layer's whole output, residual + the MLP's output with the per-layer input joined, times
       layer_scalar (Gemma 4's), and residual_out is zeroed; 0: the two apart, the next layer adding them */
    int64_t whole_output;
    float layer_scalar;
    /* Gemma 4's experts beside the dense MLP (moe and gate_up / down both set): the MLP's output RMS-normed by
       mlp_out_norm, the experts' input by experts_in_norm from the residual stream (which their router reads),
       their output by experts_out_norm, the two summed; NULL: the one MLP */
    const float *mlp_out_norm, *experts_in_norm, *experts_out_norm;
} layer;

/* One KV group's view of a step (a hybrid KV cache gives each attention window its own block
   tables over the same buffers: core/kv/hybrid.py); a plain cache has one. */
typedef struct {
    const int64_t *slots; /* [T] */
    const int64_t *block_tables;
    int64_t table_stride;
} kv_group;

typedef struct {
    int64_t num_tokens;
    const float *cos, *sin; /* [R, T, rotary_dim / 2]: R tables (Gemma 3: global, local) */
    int64_t rotary_dim;     /* the first rotary_dim of each head's D values turn (D: all) */
    int64_t rope_stride;    /* values from one table to the next */
    /* [R] each: table r at cos + rope_offsets[r], [T, rope_dims[r] / 2] (Gemma 4's, of two head sizes);
       NULL: at r * rope_stride, each rotary_dim */
    const int64_t *rope_offsets, *rope_dims;
    const kv_group *groups; /* [the step's KV groups] */
    const int64_t *layer_groups; /* [layers]: the group each layer reads; NULL: all group 0 */
    const int64_t *query_start, *seq_lens, *reqs;
    int64_t num_reqs, num_blocks, block_size, activations, num_threads; /* activations: ACT_* */
    int64_t k_activations;      /* ACT_* of the calls on K-quant shards (Q4_K, Q5_K, Q6_K, IQ4_XS) */
    int64_t kv_elem;            /* the cache's element type (ELEM_*): fp32, fp16, fp8 or q8_0 */
    float k_scale, v_scale;     /* fp8 K/V's per-tensor scales (1 for the other types) */
    const int64_t *lora_slots;  /* [T]: each row's LoRA slot, -1 for none; NULL: no row has one */
    const float *q_scale;       /* [T]: each token's query scale after the rotary (Llama 4's temperature); NULL: none */
    const float *per_layer_inputs; /* [T, L, P]: layer i's of token t at t * per_layer_stride + i * P; NULL: none */
    int64_t per_layer_stride;
} step;

int decode_layer(const kernels *k, const layer *w, int64_t index, const step *s, void *kv_cache, const float *x, const float *residual, float *x_out, float *residual_out);
int decode_layers(const kernels *k, const layer *const *w, int64_t n, const step *s, void *const *kv_caches, float *x, float *residual);

#endif
