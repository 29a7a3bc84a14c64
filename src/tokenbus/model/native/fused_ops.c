/* The elementwise steps of a decoder layer in fp32, one C call each (tokenbus, model/native).

   At decode sizes (a few rows of 576 values) torch spends more time dispatching than computing:
   F.rms_norm alone is six ATen ops, the rotate-half rotary five, SiLU
   times up three. Each of these is one loop here. Built like the other kernels (-O3
   -march=<cpu> -ffast-math): the sums are reordered, so results match torch to rounding, not bit
   for bit. Rows are independent; OpenMP splits them when there are enough (prefill).

   add_rms_norm:  residual_out = x + residual (or x), out = residual_out / rms * weight
   rope_inplace:  rotate-half rotary (HF Llama) of the first `num_rot_heads` heads of each row
                  of qkv, in place, by row t of cos / sin [T, head_dim / 2]
   silu_mul:      out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]
   gelu_tanh_mul: out[t, i] = gelu(gate_up[t, i]) * gate_up[t, I + i], gelu's tanh approximation
                  (GeGLU: HF's gelu_pytorch_tanh)
   clamped_swiglu_mul: gpt-oss's experts, g = min(gate, limit), u = clamp(up, -limit, limit),
                  out = g * sigmoid(alpha * g) * (u + 1)
   ssm_decode_step: one token of each of n requests through Mamba2's recurrence (model/mamba2.py),
                  each request's state S [H, P, N] updated in place in its row of the pool, read
                  and written once: per head h (B, C of group h / (H / G)) and channel p,
                  S[p, :] = S[p, :] * exp(dt A[h]) + dt x[p] B[:], y[p] = S[p, :] . C + D[h] x[p]
   gated_delta_rule: T tokens through Gated DeltaNet's recurrence (model/gated_delta_net.py), in
                  order, token t's state S [dk, dv] of value head h in row rows[t] of the pool:
                  S *= exp(g), S += k (beta (v - S^T k))^T, out = S^T q; S read twice a token
*/

#include <math.h>
#include <stdint.h>

#include "kernels.h"

#define PARALLEL_MIN_VALUES 65536  /* below this, one thread: the fork/join costs more */

void add_rms_norm(const float *x, int64_t ldx, const float *residual, int64_t ldr, float *residual_out,
                  const float *weight, float *out, int64_t T, int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * H >= PARALLEL_MIN_VALUES)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *r = residual_out + t * H, *o = out + t * H;
        float ss = 0.0f;
        if (residual) {
            const float *rr = residual + t * ldr;
            for (int64_t i = 0; i < H; i++) { r[i] = xr[i] + rr[i]; ss += r[i] * r[i]; }
        } else {
            for (int64_t i = 0; i < H; i++) { r[i] = xr[i]; ss += r[i] * r[i]; }
        }
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) o[i] = r[i] * inv * weight[i];
    }
}

void rope_inplace(float *qkv, int64_t ld, int64_t T, const float *cos, const float *sin, int64_t num_rot_heads,
                  int64_t head_dim, int64_t rotary_dim, int num_threads) {
    const int64_t half = rotary_dim / 2; /* partial rotary (rotary_dim < head_dim): the rest stays */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * num_rot_heads * head_dim >= PARALLEL_MIN_VALUES)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_rot_heads; h++) {
            float *x1 = qkv + t * ld + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

void silu_mul(const float *gate_up, int64_t T, int64_t I, float *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I >= PARALLEL_MIN_VALUES)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

void clamped_swiglu_mul(const float *gate_up, int64_t T, int64_t I, float limit, float alpha, float *out,
                        int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I >= PARALLEL_MIN_VALUES)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) {
            const float gate = fminf(g[i], limit), up = fminf(fmaxf(u[i], -limit), limit);
            o[i] = gate / (1.0f + expf(-alpha * gate)) * (up + 1.0f);
        }
    }
}

void gelu_tanh_mul(const float *gate_up, int64_t T, int64_t I, float *out, int num_threads) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I >= PARALLEL_MIN_VALUES)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) {
            const float x = g[i];
            o[i] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * u[i];
        }
    }
}

void ssm_decode_step(float *states, int64_t row_stride, const int64_t *rows, int64_t n, const float *x, int64_t ldx,
                     const float *dt, const float *A, const float *B, const float *C, int64_t ldbc, const float *D,
                     float *y, int64_t H, int64_t G, int64_t P, int64_t N, int num_threads) {
    const int64_t heads_per_group = H / G;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (n * H * P * N >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t g = h / heads_per_group;
            const float step = dt[r * H + h], decay = expf(step * A[h]);
            const float *b = B + r * ldbc + g * N, *c = C + r * ldbc + g * N;
            const float *xr = x + r * ldx + h * P;
            float *s = states + rows[r] * row_stride + h * P * N, *out = y + (r * H + h) * P;
            for (int64_t p = 0; p < P; p++, s += N) {
                const float u = step * xr[p];
                float acc = 0.0f;
                for (int64_t k = 0; k < N; k++) {
                    s[k] = s[k] * decay + u * b[k];
                    acc += s[k] * c[k];
                }
                out[p] = acc + D[h] * xr[p];
            }
        }
    }
}

void gated_delta_rule(float *states, int64_t row_stride, const int64_t *rows, int64_t T, const float *q,
                      const float *k, const float *v, const float *g, const float *beta, float *out, int64_t Hk,
                      int64_t Hv, int64_t dk, int64_t dv, int64_t tiled, int num_threads) {
    const int64_t per_key = Hv / Hk;
    /* Heads are independent; a head's tokens run in order (a request's tokens are consecutive,
       so each sees the state its predecessor left). */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * Hv * dk * dv >= PARALLEL_MIN_VALUES)
    for (int64_t h = 0; h < Hv; h++) {
        const int64_t kh = tiled ? h % Hk : h / per_key;
        float delta[dv];
        for (int64_t t = 0; t < T; t++) {
            float *S = states + rows[t] * row_stride + h * dk * dv;
            const float *qt = q + (t * Hk + kh) * dk, *kt = k + (t * Hk + kh) * dk;
            const float *vt = v + (t * Hv + h) * dv;
            float *o = out + (t * Hv + h) * dv;
            const float decay = expf(g[t * Hv + h]), b = beta[t * Hv + h];
            for (int64_t j = 0; j < dv; j++) delta[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) { /* decay, and S^T k into delta */
                float *s = S + i * dv;
                const float ki = kt[i];
                for (int64_t j = 0; j < dv; j++) { s[j] *= decay; delta[j] += s[j] * ki; }
            }
            for (int64_t j = 0; j < dv; j++) { delta[j] = (vt[j] - delta[j]) * b; o[j] = 0.0f; }
            for (int64_t i = 0; i < dk; i++) { /* the rank-one update, and S^T q */
                float *s = S + i * dv;
                const float ki = kt[i], qi = qt[i];
                for (int64_t j = 0; j < dv; j++) { s[j] += ki * delta[j]; o[j] += s[j] * qi; }
            }
        }
    }
}
