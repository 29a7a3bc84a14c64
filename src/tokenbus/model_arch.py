"""The shape of a decoder (L0): what config.json or a GGUF's metadata says the model is. The
loaders build it (loader/), the model and the worker read it; a rank's share of it under tensor
parallelism is a new one (model/parallel.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArch:
    """The shape of a Llama-family decoder, read from config.json or GGUF metadata."""

    architecture: str  # our family name: llama, qwen3, smollm3, gemma3, ... (model/registry.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 2 / Gemma 3 (model/gemma.py); the other families leave them at their defaults.
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    attn_logit_softcapping: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    # Each layer's sliding window in tokens (None: a global layer); (): no layer has one.
    sliding_windows: tuple[int | None, ...] = ()
    # RoPE base of the sliding-window layers where they have a table of their own, unscaled
    # (Gemma 3's rope_local_base_freq; OLMo 3's rope_theta, its rope_scaling being the global
    # layers'); None: every layer turns by rope_theta and rope_scaling.
    rope_local_theta: float | None = None
    # Dims of each head the rotary turns (the first ones; Phi-4-mini's partial_rotary_factor
    # 0.75); None: the whole head.
    rotary_dim: int | None = None
    # Layers whose queries and keys take no rotary at all (NoPE: SmolLM3's every fourth);
    # (): every layer turns.
    nope_layers: tuple[int, ...] = ()
    # Granite's multipliers (model/granite.py), 1 / None elsewhere: the embedding scaled, each
    # sublayer's output scaled before it joins the residual, the attention scale itself (None:
    # head_dim ** -0.5), the logits divided.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Sparse MoE (model/moe.py); 0 experts: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's gate/up width
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP instead
    # A shared expert beside the routed ones (its gate/up width; 0: none): behind a sigmoid gate
    # (Qwen2-MoE's) or added as it is (ERNIE 4.5's shared_experts)
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    # ERNIE 4.5's per-expert bias (moe_statics.e_score_correction_bias) added to the routing
    # probabilities to choose the top k, their weights the probabilities themselves
    moe_selection_bias: bool = False
    # How the router's logits become the experts' probabilities: a "softmax" over all of them,
    # or each its own "sigmoid" (LFM2-MoE's, GLM-4.5's); the chosen weights, renormalised (their
    # sum + moe_norm_eps the divisor: HF's LFM2-MoE 1e-6, GLM-4.5's 1e-20) or not, are then
    # scaled by routed_scaling_factor. PhiMoE's "sparsemixer" (model/moe.py) chooses two
    # experts one after the other, each weighed by a softmax over the logits within a relative
    # 2 * moe_jitter_eps (its router_jitter_noise) of the best one left.
    moe_scoring: str = "softmax"
    moe_norm_eps: float = 0.0
    moe_jitter_eps: float = 0.0
    routed_scaling_factor: float = 1.0
    # DeepSeek-V3's group-limited choice (GLM-4.5's n_group, topk_group): the experts in
    # moe_groups equal groups, each group scored by the sum of its two best choice scores, the
    # top k taken from the best moe_topk_groups groups only; 1 group: no limit.
    moe_groups: int = 1
    moe_topk_groups: int = 1
    # gpt-oss's clamped SwiGLU in its experts (model/gpt_oss.py): the gate clamped from above and
    # up to +-swiglu_limit, then gate * sigmoid(swiglu_alpha * gate) * (up + 1); None elsewhere.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # Llama 4's attention temperature (Ministral 3): (beta, length), each query scaled by
    # 1 + beta * ln(1 + floor(position / length)) after the rotary; None: none
    attn_temperature: tuple[float, int] | None = None
    # Recurrent layers (model/recurrent.py), which keep a state per request instead of K/V:
    # LFM2's gated short convolutions (model/short_conv.py), or Mamba2 mixers where mamba_heads
    # is set; (): every layer attends. Their causal convolution's taps (conv_L_cache,
    # mamba_d_conv), and its bias (LFM2's conv_bias also biases its projections).
    recurrent_layers: tuple[int, ...] = ()
    conv_kernel: int = 0
    conv_bias: bool = False
    # Mamba2 (model/mamba2.py): heads of mamba_head_dim channels, each with a state of
    # mamba_state per channel, B and C shared in mamba_groups groups of heads, scanned in
    # chunks of mamba_chunk tokens; the time step clamped to mamba_dt_limit.
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 1
    mamba_chunk: int = 256
    mamba_proj_bias: bool = False
    mamba_dt_limit: tuple[float, float] = (0.0, float("inf"))
    # Gated DeltaNet (model/gated_delta_net.py, Qwen3.5's linear attention): key heads of
    # delta_k_dim and value heads of delta_v_dim, each value head's state [delta_k_dim,
    # delta_v_dim]; conv_kernel is their conv's taps. Value heads share key heads in groups
    # (HF's order: value head j reads key head j // (V / K)) or tiled (llama.cpp's reordered
    # GGUF: key head j % K).
    delta_k_heads: int = 0
    delta_v_heads: int = 0
    delta_k_dim: int = 0
    delta_v_dim: int = 0
    delta_v_tiled: bool = False
    # Attention whose output is gated per channel by sigmoid(gate), the gate projected with the
    # queries (Qwen3.5's, Qwen3-Next's)
    attn_output_gate: bool = False
    # Attention whose heads' outputs are each scaled by one sigmoid(gate), a gate per head
    # projected from the layer's input beside q, k and v (LFM3's g_proj)
    attn_head_gate: bool = False
    # A bias on the LM head (PhiMoE's lm_head_bias)
    lm_head_bias: bool = False
    # q and k RMSNormed per head before the rotary where the config says so (GLM-4.5's
    # use_qk_norm); a family that always has them (Qwen3) says so in its model class
    attn_qk_norm: bool = False
    # Multi-head latent attention (model/mla.py: DeepSeek-V2's and its heirs'), where
    # kv_lora_rank is set: the queries through a rank-q_lora_rank bottleneck (0: one q_proj),
    # keys and values from one latent of kv_lora_rank values a token, each query/key head
    # qk_nope_head_dim unturned dims then rotary_dim turned ones, each value head v_head_dim.
    # The cache holds the latent and the turned shared key: head_dim is kv_lora_rank +
    # rotary_dim, in one KV head. Its rotary turns adjacent pairs (GPT-J's layout) or halves.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    mla_rope_interleaved: bool = True
    # Layers that are an MLP alone, with neither attention nor a state (Nemotron-H's "-"
    # blocks: model/nemotron_h.py); (): none
    mlp_only_layers: tuple[int, ...] = ()
    # Layers that attend an earlier layer's K/V instead of computing their own (Gemma 3n's last
    # num_kv_shared_layers): (layer, the layer whose K/V it reads) pairs, the owner of the same
    # window; such a layer holds no K/V (worker/kv_cache.py hands it its owner's tensor).
    # (): every attention layer its own.
    kv_shared_layers: tuple[tuple[int, int], ...] = ()
    # Each layer's (KV heads, head size) where layers differ (Gemma 4's global layers: wider
    # heads, fewer of them); (): every layer num_key_value_heads x head_dim. The paged cache
    # holds each layer's K/V in its own shape (worker/kv_cache.py).
    layer_kv_shapes: tuple[tuple[int, int], ...] = ()
    # Gemma 4 (model/gemma4.py): its global layers' values are their keys' projection (no
    # v_proj: attention_k_eq_v); each layer's MLP width where they differ (its double-wide MLP
    # on the layers reading another's K/V), (): every layer intermediate_size.
    attn_k_eq_v: bool = False
    layer_intermediate_sizes: tuple[int, ...] = ()
    # Gemma 3n (model/gemma3n.py): each layer also takes per_layer_input_size values of a
    # per-layer input (its own embedding of the first per_layer_vocab_size ids, joined with a
    # projection of the token's embedding); the hidden state is altup_inputs streams (AltUp),
    # the layer computing on stream 0 and predicting and correcting the others; a low-rank
    # residual of laurel_rank beside attention (LAuReL); each layer's MLP gate sparsified to
    # the values above mean + std * activation_sparsity_std[layer] (None: kept whole).
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    altup_inputs: int = 0
    altup_correct_scale: bool = True
    laurel_rank: int = 0
    activation_sparsity_std: tuple[float | None, ...] = ()

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of decoder layer `layer`'s K/V."""
        if self.layer_kv_shapes:
            return self.layer_kv_shapes[layer]
        return self.num_key_value_heads, self.head_dim

    @property
    def global_head_dim(self) -> int:
        """Head size of the global (full-attention) layers, which rope_theta and rope_scaling
        turn: head_dim, but where layer_kv_shapes gives them another (Gemma 4's)."""
        windows = self.sliding_windows or (None,) * self.num_hidden_layers
        first = next((i for i, window in enumerate(windows) if window is None), 0)
        return self.kv_shape(first)[1]

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that hold K/V (all but the recurrent, MLP-only and KV-sharing ones)."""
        no_kv = {*self.recurrent_layers, *self.mlp_only_layers}
        no_kv.update(layer for layer, _ in self.kv_shared_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in no_kv)

    def kv_owner(self, layer: int) -> int:
        """The layer whose K/V decoder layer `layer` attends (itself but for kv_shared_layers)."""
        return dict(self.kv_shared_layers).get(layer, layer)

    @property
    def state_size_per_request(self) -> int:
        """Elements of one request's recurrent state over all recurrent layers (multiply by the
        dtype size): a conv's held inputs, and Mamba2's or Gated DeltaNet's S of every head."""
        if self.mamba_heads:
            inner = self.mamba_heads * self.mamba_head_dim
            conv_dim = inner + 2 * self.mamba_groups * self.mamba_state
            per_layer = (self.conv_kernel - 1) * conv_dim + inner * self.mamba_state
        elif self.delta_v_heads:
            values = self.delta_v_heads * self.delta_v_dim
            conv_dim = 2 * self.delta_k_heads * self.delta_k_dim + values
            per_layer = (self.conv_kernel - 1) * conv_dim + values * self.delta_k_dim
        else:
            per_layer = (self.conv_kernel - 1) * self.hidden_size
        return len(self.recurrent_layers) * per_layer

    @property
    def num_kv_layers(self) -> int:
        """The layers that hold K/V (all but the recurrent, MLP-only and KV-sharing ones)."""
        no_kv = len(self.recurrent_layers) + len(self.mlp_only_layers) + len(self.kv_shared_layers)
        return self.num_hidden_layers - no_kv

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in elements (multiply by the dtype size)."""
        return sum(2 * heads * dim for heads, dim in map(self.kv_shape, self.kv_layers))
