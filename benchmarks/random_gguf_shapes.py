"""The real models' shapes benchmarks/make_random_gguf.py writes random-weight GGUFs of: llama.cpp's
architecture names, the ModelShape of a config, and CONFIGS (the published config.json values;
"-8l": a model's first 8 layers)."""

from __future__ import annotations

from dataclasses import dataclass

GEMMA = ("gemma2", "gemma3")  # sandwich norms: post_attention_norm and post_ffw_norm too
POST_NORM_ONLY = ("olmo2",)  # post_attention_norm and post_ffw_norm, no attn_norm / ffn_norm
# gpt-oss: biases on q/k/v, attn_output, the router and the experts; a sink per query head; its
# pre-MLP norm named post_attention_norm
GPT_OSS = "gpt-oss"
ERNIE_MOE = "ernie4_5-moe"
LFM2_MOE = "lfm2moe"  # LFM2's layers, sigmoid-scored experts chosen with a bias
# Qwen3.5: Gated DeltaNet layers (attn_qkv, attn_gate, ssm_*) among gated attention layers
# (attn_q holds each head's queries and gate), post_attention_norm before each MLP
QWEN35 = "qwen35"
QWEN35_MOE = "qwen35moe"  # Qwen3.5's layers, every MLP experts and a gated shared expert
QWEN35_ARCHS = (QWEN35, QWEN35_MOE)
# GLM-4.5: q/k/v biases, half of each head turning, leading dense layers, then experts chosen
# by sigmoid score + bias (exp_probs_b) beside an ungated shared expert; its pre-MLP norm named
# post_attention_norm
GLM4_MOE = "glm4moe"
# MiniMax-M2: q/k norms over the whole projection, half of each head turning, every MLP experts
# chosen by sigmoid score + bias (exp_probs_b), no shared expert
MINIMAX_M2 = "minimax-m2"
# DeepSeek-V2/V3: latent attention (attn_q or attn_q_a/_norm/_b, attn_kv_a_mqa, attn_kv_a_norm,
# attn_k_b, attn_v_b), leading dense layers, then experts beside an ungated shared MLP
DEEPSEEK2 = "deepseek2"
# Gemma 3n: Gemma 3's attention (q/k norms; four local layers, then a global) and sandwich norms,
# four AltUp streams, LAuReL of rank 64, per-layer inputs (per_layer_token_embd), the last
# kv_shared layers without K/V of their own
GEMMA3N = "gemma3n"
GEMMA3N_ALTUP, GEMMA3N_LAUREL = 4, 64
# Gemma 4: Gemma 3n's attention (q/k norms, five local layers then a global one), sandwich norms
# and per-layer inputs without AltUp or LAuReL; the global layers' heads of global_head_dim over
# global_kv_heads, their proportional rope as rope_freqs; each layer's layer_output_scale
GEMMA4 = "gemma4"


@dataclass(frozen=True)
class ModelShape:
    architecture: str  # llama.cpp's general.architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    context: int
    rms_eps: float
    tied: bool
    qkv_bias: bool = False
    # Llama 3 rope scaling (factor, low_freq_factor, high_freq_factor, original context)
    llama3_rope: tuple[float, float, float, int] | None = None
    # Sparse MoE (qwen3moe): experts stacked per layer as ffn_{gate,up,down}_exps
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # a shared expert (ffn_*_shexp), 0: none
    dense_lead: int = 0  # ERNIE's leading dense layers before the MoE ones
    head_dim_override: int = 0  # Qwen3's head_dim != hidden / heads
    qk_norm: bool = False  # Qwen3's attn_q_norm / attn_k_norm
    # Gemma 3: the local layers' window (llama.cpp fixes the pattern, five local then a global,
    # and the local RoPE base, 10k); its sandwich norms (post_attention_norm, post_ffw_norm)
    # come with the architecture.
    sliding_window: int = 0
    # Gemma 2: soft-caps of the attention scores and of the final logits (its pattern: local and
    # global layers alternate; sandwich norms as Gemma 3's, no q/k norms)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    yarn: tuple[float, int] | None = None  # YaRN's factor and original context
    # LFM2: its gated short convolutions' layers (shortconv.*, no attention, head_count_kv 0
    # there) and their taps; the final norm named token_embd_norm
    conv_layers: tuple[int, ...] = ()
    conv_kernel: int = 0
    # Granite 4.0-H (granitehybrid): its Mamba2 layers (ssm_* tensors, head_count_kv 0 there),
    # their heads of ssm_head_dim, state size and B/C groups; conv_kernel is their conv's taps
    ssm_layers: tuple[int, ...] = ()
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state: int = 0
    ssm_groups: int = 1
    # Qwen3.5's Gated DeltaNet layers: key and value heads of delta_dim (conv_kernel taps)
    delta_layers: tuple[int, ...] = ()
    delta_k_heads: int = 0
    delta_v_heads: int = 0
    delta_dim: int = 0
    # Latent attention (deepseek2): the latent's and the queries' ranks (0: attn_q), each head's
    # unturned and turned dims, its value's; head_dim_override is the cache's kv_lora_rank +
    # qk_rope_head_dim and kv_heads 1, as the converter writes them
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # Gemma 3n: per-layer inputs of per_layer_input values a layer; the last kv_shared layers
    # read earlier layers' K/V; the first sparse_layers MLPs sparse at 0.95
    per_layer_input: int = 0
    kv_shared: int = 0
    sparse_layers: int = 0
    # Gemma 4: the global layers' head size and KV heads
    global_head_dim: int = 0
    global_kv_heads: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads


# The published models' config.json values.
CONFIGS = {
    "llama-3.2-1b": ModelShape(
        "llama", 2048, 16, 32, 8, 8192, 128256, 500000.0, 131072, 1e-5, True,
        llama3_rope=(32.0, 1.0, 4.0, 8192),
    ),
    "llama-3.2-3b": ModelShape(
        "llama", 3072, 28, 24, 8, 8192, 128256, 500000.0, 131072, 1e-5, True,
        llama3_rope=(32.0, 1.0, 4.0, 8192),
    ),
    "llama-3.1-8b": ModelShape(
        "llama", 4096, 32, 32, 8, 14336, 128256, 500000.0, 131072, 1e-5, False,
        llama3_rope=(8.0, 1.0, 4.0, 8192),
    ),
    "smollm3-3b": ModelShape(
        "smollm3", 2048, 36, 16, 4, 11008, 128256, 5000000.0, 65536, 1e-6, True,
    ),
    "qwen2.5-0.5b": ModelShape(
        "qwen2", 896, 24, 14, 2, 4864, 151936, 1000000.0, 32768, 1e-6, True, qkv_bias=True
    ),
    # Qwen3-30B-A3B's layer (2048 wide, 32/4 heads of 128, 128 experts of 768, top 8) at 8 of
    # its 48 layers: the whole model is ~61 GB at F16 and ~18 GB at Q4_K_M, past a 24 GiB box;
    # 8 layers keep every per-token kernel shape (the expert step, attention, the LM head) and
    # weigh ~11 GB at F16, ~3 GB at Q4_K_M.
    "qwen3-30b-a3b-8l": ModelShape(
        "qwen3moe", 2048, 8, 32, 4, 6144, 151936, 1000000.0, 40960, 1e-6, False,
        experts=128, experts_used=8, expert_intermediate=768, head_dim_override=128,
        qk_norm=True,
    ),
    # OLMo 2 1B (OLMo-2-0425-1B): 16 heads of 128 without GQA, q/k norms over the whole
    # projection ([2048] each), post-norms only, untied.
    "olmo-2-1b": ModelShape(
        "olmo2", 2048, 16, 16, 16, 8192, 100352, 500000.0, 4096, 1e-6, False, qk_norm=True,
    ),
    # OLMoE-1B-7B (OLMoE-1B-7B-0924): 64 experts of 1024, top 8, in every layer; q/k norms over
    # the whole projection, pre-norms; llama.cpp reads the experts' width as feed_forward_length.
    "olmoe-1b-7b": ModelShape(
        "olmoe", 2048, 16, 16, 16, 1024, 50304, 10000.0, 4096, 1e-5, False,
        experts=64, experts_used=8, expert_intermediate=1024, qk_norm=True,
    ),
    # Granite 3.0 3B-A800M: 1536 wide, 32 layers of 24 / 8 heads, 40 experts of 512 with 8 used
    # (3.3 B parameters, 0.8 B active), a 49k vocabulary, tied. Its multipliers stay 1 here: they
    # scale activations, not the work of a token.
    "granite-3b-a800m": ModelShape(
        "granitemoe", 1536, 32, 24, 8, 512, 49155, 10000.0, 4096, 1e-6, True,
        experts=40, experts_used=8, expert_intermediate=512,
    ),
    # gpt-oss-20b: 2880 wide, 64 / 8 heads of 64, 32 experts of 2880 with 4 used, a 201k
    # vocabulary, untied, windows of 128 on the even layers, YaRN 32 over 4096. The whole model
    # is 21 B parameters (42 GB at F16, past this disk's room beside the quantized copy); 8 of
    # its 24 layers keep every per-token kernel shape and weigh ~16 GB at F16, ~5 GB once
    # llama.cpp's MXFP4_MOE recipe makes the experts MXFP4 and the rest Q8_0, as the released
    # GGUF has them.
    "gpt-oss-20b-8l": ModelShape(
        GPT_OSS, 2880, 8, 64, 8, 2880, 201088, 150000.0, 131072, 1e-5, False, qkv_bias=True,
        experts=32, experts_used=4, expert_intermediate=2880, head_dim_override=64,
        sliding_window=128, yarn=(32.0, 4096),
    ),
    # Qwen1.5-MoE-A2.7B: 2048 wide, 16 heads of 128 without GQA, q/k/v biases, 60 experts of
    # 1408 with 4 used beside a shared expert of 5632, a 152k vocabulary, untied. The whole
    # model is 14.3 B parameters (29 GB at F16, past this disk's room beside its quantized copy);
    # 8 of its 24 layers keep every per-token kernel shape.
    "qwen1.5-moe-a2.7b-8l": ModelShape(
        "qwen2moe", 2048, 8, 16, 16, 5632, 151936, 1000000.0, 8192, 1e-6, False, qkv_bias=True,
        experts=60, experts_used=4, expert_intermediate=1408, shared_intermediate=5632,
    ),
    # ERNIE-4.5-21B-A3B: 2560 wide, 20 / 4 heads of 128, a dense first layer (12288), then 64
    # experts of 1536 with 6 used (chosen with a per-expert bias) beside an ungated shared MLP
    # of two experts' width, a 103k vocabulary, tied. The whole model is 21.8 B parameters (44
    # GB at F16); 8 of its 28 layers keep every per-token kernel shape.
    "ernie-4.5-21b-a3b-8l": ModelShape(
        "ernie4_5-moe", 2560, 8, 20, 4, 12288, 103424, 500000.0, 131072, 1e-5, True,
        experts=64, experts_used=6, expert_intermediate=1536, shared_intermediate=3072,
        head_dim_override=128, dense_lead=1,
    ),
    # Gemma 2B (gemma-2b): 2048 wide, 18 layers of 8 query heads of 256 over one KV head, GeGLU
    # of 16384, a 256k vocabulary tied to the LM head; Llama's two norms a layer.
    # LFM2-1.2B: 2048 wide, 16 layers, ten gated short convolutions of 3 taps and six
    # attention layers (32 / 8 heads of 64, per-head q/k norms), an MLP of 8192, a 65k
    # vocabulary, tied.
    "lfm2-1.2b": ModelShape(
        "lfm2", 2048, 16, 32, 8, 8192, 65536, 1000000.0, 128000, 1e-5, True, qk_norm=True,
        conv_layers=(0, 1, 3, 4, 6, 7, 9, 11, 13, 15), conv_kernel=3,
    ),
    # LFM2-8B-A1B: LFM2's layers 2048 wide (attention, 32 / 8 heads of 64, in 6 of its 24:
    # 2, 6, 10, 14, 18, 21), dense MLPs of 7168 in the first two, then 32 experts of 1792, top 4
    # (sigmoid scores, chosen with a bias), a 65k vocabulary, tied; 8.3 B parameters, 1.5 B
    # active. Its first 8 layers here (attention in 2 and 6).
    "lfm2-8b-a1b-8l": ModelShape(
        "lfm2moe", 2048, 8, 32, 8, 7168, 65536, 1000000.0, 128000, 1e-5, True, qk_norm=True,
        conv_layers=(0, 1, 3, 4, 5, 7), conv_kernel=3, experts=32, experts_used=4,
        expert_intermediate=1792, dense_lead=2,
    ),
    # Granite-4.0-H-1B: 1536 wide, 40 layers, 36 Mamba2 mixers (48 heads of 64, a state of 128,
    # one B/C group, 4 taps) and four attention layers (12 / 4 heads of 128, no rotary), a
    # shared MLP of 4096, a 100k vocabulary, tied.
    "granite-4.0-h-1b": ModelShape(
        "granitehybrid", 1536, 40, 12, 4, 4096, 100352, 10000.0, 131072, 1e-5, True,
        ssm_layers=tuple(i for i in range(40) if i not in (5, 15, 25, 35)), ssm_heads=48,
        ssm_head_dim=64, ssm_state=128, conv_kernel=4,
    ),
    # Qwen3.5-9B (transformers' Qwen3_5TextConfig defaults): 4096 wide, 32 layers, three Gated
    # DeltaNet layers (16 key and 32 value heads of 128, 4 taps) to one gated attention layer
    # (16 / 4 heads of 256, a quarter of each turning), an MLP of 12288, a 248k vocabulary,
    # untied. Its first 8 layers here (attention in the fourth and eighth).
    "qwen3.5-9b-8l": ModelShape(
        QWEN35, 4096, 8, 16, 4, 12288, 248320, 10000000.0, 262144, 1e-6, False,
        head_dim_override=256, delta_layers=(0, 1, 2, 4, 5, 6), delta_k_heads=16,
        delta_v_heads=32, delta_dim=128, conv_kernel=4,
    ),
    # Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults): 2048 wide, 40 layers, Qwen3.5's
    # three Gated DeltaNet layers (16 key and 32 value heads of 128) to one gated attention layer
    # (16 / 2 heads of 256), every MLP 256 experts of 512 (8 a token) and a gated shared expert of
    # 512, a 248k vocabulary, untied: 34.7 B parameters. Its first 8 layers here.
    "qwen3.5-35b-a3b-8l": ModelShape(
        QWEN35_MOE, 2048, 8, 16, 2, 0, 248320, 10000000.0, 262144, 1e-6, False,
        head_dim_override=256, delta_layers=(0, 1, 2, 4, 5, 6), delta_k_heads=16,
        delta_v_heads=32, delta_dim=128, conv_kernel=4, experts=256, experts_used=8,
        expert_intermediate=512, shared_intermediate=512,
    ),
    # GLM-4.5-Air (transformers' Glm4MoeConfig defaults): 4096 wide, 46 layers of 96 / 8 heads
    # of 128 (q/k/v biases, half of each head turning), a dense first layer (10944), then 128
    # experts of 1408 (8 a token, sigmoid scores chosen with a bias) beside a shared expert of
    # 1408, a 152k vocabulary, untied: 106.9 B parameters. Its first 4 layers here (the dense one
    # and three with experts): 8.5 B parameters, 17 GB at F16.
    "glm-4.5-air-4l": ModelShape(
        GLM4_MOE, 4096, 4, 96, 8, 10944, 151552, 1000000.0, 131072, 1e-5, False, qkv_bias=True,
        experts=128, experts_used=8, expert_intermediate=1408, shared_intermediate=1408,
        head_dim_override=128, dense_lead=1,
    ),
    # MiniMax-M2 (transformers' MiniMaxM2Config defaults): 3072 wide, 62 layers of 48 / 8 heads
    # of 128 (q/k norms over the whole projection, 64 of each head's dims turning), every MLP 256
    # experts of 1536 (8 a token, sigmoid scores chosen with a bias), a 200k vocabulary, untied:
    # 228.7 B parameters. Its first 8 layers here with 32 of the 256 experts each: a token's work
    # (attention, 8 experts a layer, the LM head) is the real model's layer for layer; only the
    # router's rows and the file shrink (5.2 B parameters, 10 GB at F16).
    "minimax-m2-8l-32e": ModelShape(
        MINIMAX_M2, 3072, 8, 48, 8, 1536, 200064, 5000000.0, 196608, 1e-6, False, qk_norm=True,
        experts=32, experts_used=8, expert_intermediate=1536, head_dim_override=128,
    ),
    # DeepSeek-V2-Lite: 2048 wide, 27 layers of 16 query heads over a latent of 512 (heads of
    # 128 + 64 turned, values of 128; no query bottleneck), YaRN x40 over 4096 (mscale 0.707),
    # the first layer dense (10944), then 64 experts of 1408 (6 a token, softmax) and a shared
    # MLP two experts wide; a 102k vocabulary, untied: 15.7 B parameters. All 27 layers (llama.cpp
    # knows V2-Lite, whose queries have no bottleneck, by its layer count), with 16 of the 64
    # experts each: a token's work (attention, 6 experts a layer, the LM head) is the real
    # model's; only the router's rows and the file shrink (4.9 B parameters, 9.8 GB at F16).
    "deepseek-v2-lite-16e": ModelShape(
        DEEPSEEK2, 2048, 27, 16, 1, 10944, 102400, 10000.0, 163840, 1e-6, False,
        experts=16, experts_used=6, expert_intermediate=1408, shared_intermediate=2816,
        dense_lead=1, head_dim_override=576, yarn=(40.0, 4096), kv_lora_rank=512,
        qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
    ),
    # Gemma 3n E2B: 2048 wide, 30 layers of 8 / 2 heads of 256 (four local layers of 512, then
    # a global one), GeGLU of 8192, a 262k vocabulary, tied; per-layer inputs of 256 from a
    # 262k x 30 x 256 table, four AltUp streams, LAuReL of 64, the first ten MLPs sparse, the
    # last ten layers reading layers 18's and 19's K/V: 4.4 B parameters stored (2 B of them
    # the per-layer table, read a row per token), 2 B read per token.
    "gemma-3n-e2b": ModelShape(
        GEMMA3N, 2048, 30, 8, 2, 8192, 262400, 1000000.0, 32768, 1e-6, True,
        head_dim_override=256, qk_norm=True, sliding_window=512, final_softcap=30.0,
        per_layer_input=256, kv_shared=10, sparse_layers=10,
    ),
    # Gemma 4 as transformers' Gemma4TextConfig() defaults make it: 2304 wide, 30 layers of 8
    # query heads, five local layers (4 KV heads of 256, window 512) then a global one (4 KV
    # heads of 512, a quarter of its angles turning), GeGLU of 9216, a 262k vocabulary, tied;
    # per-layer inputs of 256 from a 262k x 30 x 256 table: 5.1 B parameters stored (2 B of
    # them the per-layer table, read a row per token).
    "gemma-4-config-defaults": ModelShape(
        GEMMA4, 2304, 30, 8, 4, 9216, 262144, 1000000.0, 131072, 1e-6, True,
        head_dim_override=256, qk_norm=True, sliding_window=512, per_layer_input=256,
        global_head_dim=512, global_kv_heads=4,
    ),
    "gemma-2b": ModelShape(
        "gemma", 2048, 18, 8, 1, 16384, 256000, 10000.0, 8192, 1e-6, True, head_dim_override=256,
    ),
    "gemma-2-2b": ModelShape(
        "gemma2", 2304, 26, 8, 4, 9216, 256000, 10000.0, 8192, 1e-6, True,
        head_dim_override=256, sliding_window=4096, attn_softcap=50.0, final_softcap=30.0,
    ),
    # Gemma 3 1B: 1152 wide (not a multiple of 256, so K-quant recipes fall back to other types
    # for some tensors, as in the real files), 4/1 heads of 256, a 262k vocabulary, tied.
    "gemma-3-1b": ModelShape(
        "gemma3", 1152, 26, 4, 1, 6912, 262144, 1000000.0, 32768, 1e-6, True,
        head_dim_override=256, qk_norm=True, sliding_window=512,
    ),
}  # fmt: skip
