/* The sparse MoE MLP of decode_layer.c (model/moe.py's SparseMoeBlock): the router, each token's
   top k experts, each active expert once over its tokens, and a shared expert. Static functions,
   included by decode_layer.c after run_linear, which they call. */

#ifndef TOKENBUS_DECODE_MOE_H
#define TOKENBUS_DECODE_MOE_H

/* Experts outside the best `kept` of `groups` equal groups set to -inf in choice [E] (DeepSeek-V3's
   group limit, SparseMoeBlock._best_groups_only): a group scores the sum of its two best choices;
   the best groups first, ties to the lower index. `scratch`: 2 * groups floats. */
static void keep_best_groups(float *choice, int64_t E, int64_t groups, int64_t kept, float *scratch) {
    const int64_t n = E / groups;
    float *score = scratch, *keep = scratch + groups;
    for (int64_t g = 0; g < groups; g++) {
        const float *c = choice + g * n;
        float first = c[0] > c[1] ? c[0] : c[1], second = c[0] > c[1] ? c[1] : c[0];
        for (int64_t i = 2; i < n; i++) {
            if (c[i] > first) {
                second = first;
                first = c[i];
            } else if (c[i] > second) {
                second = c[i];
            }
        }
        score[g] = first + second;
        keep[g] = 0.f;
    }
    for (int64_t j = 0; j < kept; j++) {
        int64_t best = -1;
        for (int64_t g = 0; g < groups; g++)
            if (keep[g] == 0.f && (best < 0 || score[g] > score[best])) best = g;
        keep[best] = 1.f;
    }
    for (int64_t g = 0; g < groups; g++)
        if (keep[g] == 0.f)
            for (int64_t i = 0; i < n; i++) choice[g * n + i] = -INFINITY;
}

/* Token t's routing from its E logits, as SparseMoeBlock.route computes it: each expert's
   probability (the softmax over all E, or its own sigmoid); its top k experts, best first (ties to
   the lower index), chosen by probability, or by probability + the selection bias where there is
   one, within the best groups where there are several; their weights the chosen probabilities,
   (norm_topk_prob) divided by their sum + norm_eps, then times scale. `scratch`: 3E floats. */
static void route_token(const float *logits, const moe *m, float *scratch, int64_t *experts, float *weights) {
    const int64_t E = m->num_experts, K = m->top_k;
    float *probs = scratch, *choice = scratch + E, kept = 0.f;
    if (m->sigmoid_scores) {
        for (int64_t e = 0; e < E; e++) probs[e] = 1.f / (1.f + expf(-logits[e]));
    } else {
        float max = logits[0], sum = 0.f;
        for (int64_t e = 1; e < E; e++) max = logits[e] > max ? logits[e] : max;
        for (int64_t e = 0; e < E; e++) sum += expf(logits[e] - max);
        for (int64_t e = 0; e < E; e++) probs[e] = expf(logits[e] - max) / sum;
    }
    const float *by = probs;
    if (m->selection_bias || m->groups > 1) {
        for (int64_t e = 0; e < E; e++) choice[e] = m->selection_bias ? probs[e] + m->selection_bias[e] : probs[e];
        if (m->groups > 1) keep_best_groups(choice, E, m->groups, m->topk_groups, scratch + 2 * E);
        by = choice;
    }
    for (int64_t j = 0; j < K; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j && !taken; i++) taken = experts[i] == e;
            if (!taken && (best < 0 || by[e] > by[best])) best = e;
        }
        experts[j] = best;
        weights[j] = probs[best];
        kept += weights[j];
    }
    if (m->norm_topk_prob)
        for (int64_t j = 0; j < K; j++) weights[j] /= kept + m->norm_eps;
    if (m->scale != 1.f)
        for (int64_t j = 0; j < K; j++) weights[j] *= m->scale;
    if (m->expert_scale)
        for (int64_t j = 0; j < K; j++) weights[j] *= m->expert_scale[experts[j]];
}

/* out [T, H] += sigmoid(h . gate) * down(silu(gate_up(h))): the shared expert of every token, after
   the routed ones (SparseMoeBlock.forward); without a gate, its output as it is. The gate's logit
   by dense_rows.c on the same panels as the op-by-op path's. 0, 3 when out of memory, or a
   kernel's status. */
static int shared_expert(const kernels *k, const moe *m, const float *h, int64_t T, int64_t H, float *out,
                         const step *s) {
    const int64_t S = m->shared_intermediate;
    const int threads = (int)s->num_threads;
    float *buf = malloc(sizeof(float) * (size_t)(T * (3 * S + H + 1)));
    if (!buf) return 3;
    float *gate_up = buf, *act = gate_up + T * 2 * S, *ys = act + T * S, *logit = ys + T * H;
    int status;
    if ((status = run_linear(k, m->shared_gate_up, h, T, gate_up, s))) goto done;
    k->silu_mul(gate_up, T, S, act, threads);
    if ((status = run_linear(k, m->shared_down, act, T, ys, s))) goto done;
    if (!m->shared_gate) {
        for (int64_t i = 0; i < T * H; i++) out[i] += ys[i];
        goto done;
    }
    if ((status = k->dense_matmul(m->shared_gate, 1, H, h, T, H, logit, 1, threads))) goto done;
    for (int64_t t = 0; t < T; t++) {
        const float gate = 1.f / (1.f + expf(-logit[t]));
        float *o = out + t * H;
        const float *y = ys + t * H;
        for (int64_t c = 0; c < H; c++) o[c] += gate * y[c];
    }
done:
    free(buf);
    return status;
}

/* out [T, H] = the MoE MLP of h [T, H] (model/moe.py's SparseMoeBlock.forward): the router's
   logits by dense_rows.c on the same panels (the same sums as the op-by-op path) over h, or over
   `routed_by` where it is given (Gemma 4's: the residual stream, normed without a weight and
   scaled first where the moe has router_in_scale), each token's routing, then the T*k (token,
   expert) pairs counting-sorted by expert (stable: tokens ascending), and each active expert in
   ascending order once on its gathered rows, gate_up -> silu*up (or gpt-oss's clamped SwiGLU, or
   Gemma 4's GeGLU) -> down, its rows scaled by their weights and added to their tokens' outputs;
   a router bias joins the logits first. A shared expert then runs on every token and joins the
   sum scaled by sigmoid(its gate's logit) (shared_expert), as moe.py adds it. 0, 3 when out of
   memory, or a kernel's status. */
static int moe_mlp(const kernels *k, const moe *m, const float *h, const float *routed_by, int64_t T, int64_t H,
                   float *out, const step *s) {
    const int64_t E = m->num_experts, K = m->top_k, P = T * K, I = m->down[0].cols;
    const int threads = (int)s->num_threads;
    float *logits = malloc(sizeof(float) * (size_t)(T * E + 3 * E)), *weights = malloc(sizeof(float) * (size_t)P);
    float *rows = malloc(sizeof(float) * (size_t)(T * (H + 3 * I + H)));
    int64_t *experts = malloc(sizeof(int64_t) * (size_t)P), *order = malloc(sizeof(int64_t) * (size_t)P);
    int64_t *first = calloc((size_t)(E + 1), sizeof(int64_t));
    int status = 3;
    if (!logits || !weights || !rows || !experts || !order || !first) goto done;
    const float *router_in = routed_by ? routed_by : h;
    if (m->router_in_scale) {
        /* normed and scaled per channel into rows' first T * H values (its last T * H the norm's
           scratch: both overwritten by the experts' rows later), then times router_in_mult */
        k->add_rms_norm(router_in, H, NULL, 0, rows + T * (H + 3 * I), m->router_in_scale, rows, T, H,
                        m->router_in_eps, threads);
        for (int64_t i = 0; i < T * H; i++) rows[i] *= m->router_in_mult;
        router_in = rows;
    }
    if ((status = k->dense_matmul(m->router, E, H, router_in, T, H, logits, E, threads))) goto done;
    if (m->router_bias) /* after the whole sum, as dense_rows.py's RowInvariantLinear adds it */
        for (int64_t t = 0; t < T; t++)
            for (int64_t e = 0; e < E; e++) logits[t * E + e] += m->router_bias[e];
    float *scores = logits + T * E; /* route_token's scratch */
    for (int64_t t = 0; t < T; t++)
        route_token(logits + t * E, m, scores, experts + t * K, weights + t * K);
    for (int64_t p = 0; p < P; p++) first[experts[p] + 1]++;
    for (int64_t e = 0; e < E; e++) first[e + 1] += first[e];
    for (int64_t p = 0, *next = first; p < P; p++) order[next[experts[p]]++] = p; /* pair p is token p / K */
    for (int64_t e = E; e > 0; e--) first[e] = first[e - 1]; /* next[] advanced first[] */
    first[0] = 0;
    float *xs = rows, *gate_up = xs + T * H, *act = gate_up + T * 2 * I, *ys = act + T * I;
    memset(out, 0, sizeof(float) * (size_t)(T * H));
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = first[e + 1] - first[e], *pairs = order + first[e];
        if (!n) continue;
        for (int64_t i = 0; i < n; i++) memcpy(xs + i * H, h + pairs[i] / K * H, sizeof(float) * (size_t)H);
        if ((status = run_linear(k, &m->gate_up[e], xs, n, gate_up, s))) goto done;
        if (m->activation == MLP_CLAMPED_SWIGLU)
            k->clamped_swiglu_mul(gate_up, n, I, m->swiglu_limit, m->swiglu_alpha, act, threads);
        else
            (m->activation == MLP_GELU_TANH ? k->gelu_tanh_mul : k->silu_mul)(gate_up, n, I, act, threads);
        if ((status = run_linear(k, &m->down[e], act, n, ys, s))) goto done;
        for (int64_t i = 0; i < n; i++) {
            float *o = out + pairs[i] / K * H;
            const float *y = ys + i * H, w = weights[pairs[i]];
            for (int64_t c = 0; c < H; c++) o[c] += y[c] * w;
        }
    }
    status = m->shared_gate_up ? shared_expert(k, m, h, T, H, out, s) : 0;
done:
    free(logits);
    free(weights);
    free(rows);
    free(experts);
    free(order);
    free(first);
    return status;
}

#endif
