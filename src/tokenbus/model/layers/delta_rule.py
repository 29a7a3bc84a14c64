"""Gated DeltaNet's recurrence in torch (model/gated_delta_net.py; TorchOps.gated_delta_rule_):
the path off CPU fp32, where fused_ops.c's token loop runs instead.

Per value head, token t: S = exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t.

The step's tokens come request after request (token_rows: each token's state row). A request
with one token (a decode) joins the others' in one batched update; a longer run (a chunk)
takes the chunked form in pieces of CHUNK tokens, the delta rule's updates within a piece
folded into a unit lower-triangular solve (the WY / UT form of DeltaNet):

    within a piece, a_t = g_1 + ... + g_t (the decay since the piece's start, in log space),
    L[t, u] = beta_t k_t . k_u exp(a_t - a_u) for u < t (strictly lower), and
    (I + L) U = beta v, (I + L) W = beta k exp(a)   (one triangular solve each)
    give each token's correction  V = U - W S  against the state S the piece starts from; then
    o_t = exp(a_t) q_t^T S + sum_{u <= t} exp(a_t - a_u) (q_t . k_u) V_u,
    S' = exp(a_n) S + sum_u exp(a_n - a_u) k_u V_u^T.
"""

from __future__ import annotations

import torch

CHUNK = 64  # tokens a piece: its [CHUNK, CHUNK] solve against CHUNK sequential steps


def delta_rule(
    states: torch.Tensor,
    token_rows: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """out [T, H, dv] of the step's tokens (q / k [T, H, dk]: each value head's own, already
    expanded; v [T, H, dv]; g / beta [T, H]), in q's dtype; each row of `states` [rows, H, dk,
    dv] the tokens name advanced past them in place."""
    out = torch.empty_like(v)
    runs = _runs(token_rows.tolist())
    single = [start for start, length in runs if length == 1]
    if single:  # the decodes: one token of each of their rows at once
        index = torch.tensor(single, device=v.device)
        rows = token_rows[index]
        s = states[rows].to(q.dtype)
        out[index], s = _step(s, q[index], k[index], v[index], g[index], beta[index])
        states[rows] = s.to(states.dtype)
    for start, length in runs:
        if length == 1:
            continue
        run, row = slice(start, start + length), token_rows[start]
        s = states[row].to(q.dtype)
        for piece in range(start, start + length, CHUNK):
            mine = slice(piece, min(piece + CHUNK, run.stop))
            out[mine], s = _chunk(s, q[mine], k[mine], v[mine], g[mine], beta[mine])
        states[row] = s.to(states.dtype)
    return out


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive tokens of one row: a request's tokens."""
    runs: list[tuple[int, int]] = []
    for t, row in enumerate(rows):
        if runs and rows[t - 1] == row:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((t, 1))
    return runs


def _step(s, q, k, v, g, beta):
    """One token of each of n states: s [n, H, dk, dv], q / k [n, H, dk], v [n, H, dv], g /
    beta [n, H] -> (out [n, H, dv], s after it)."""
    s = s * torch.exp(g)[..., None, None]
    recalled = torch.einsum("nhij,nhi->nhj", s, k)
    s = s + k[..., None] * ((v - recalled) * beta[..., None])[..., None, :]
    return torch.einsum("nhij,nhi->nhj", s, q), s


def _chunk(s, q, k, v, g, beta):
    """One piece of one request's tokens: s [H, dk, dv], q / k [n, H, dk], v [n, H, dv], g /
    beta [n, H] -> (out [n, H, dv], s after them); see the module docstring."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, n, d]
    a = torch.cumsum(g.transpose(0, 1), dim=-1)  # [H, n]
    n = a.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((a[..., :, None] - a[..., None, :]).masked_fill(~causal, float("-inf")))
    kb = k * beta.transpose(0, 1)[..., None]
    lower = (kb @ k.transpose(-1, -2) * decay).tril(-1)
    unit = lower + torch.eye(n, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(unit, v * beta.transpose(0, 1)[..., None], upper=False)
    w = torch.linalg.solve_triangular(unit, kb * torch.exp(a)[..., None], upper=False)
    corrections = u - w @ s  # [H, n, dv]
    out = (q * torch.exp(a)[..., None]) @ s + (q @ k.transpose(-1, -2) * decay) @ corrections
    to_end = torch.exp(a[..., -1:] - a)[..., None]  # [H, n, 1]
    s = s * torch.exp(a[..., -1])[..., None, None] + (k * to_end).transpose(-1, -2) @ corrections
    return out.transpose(0, 1), s
