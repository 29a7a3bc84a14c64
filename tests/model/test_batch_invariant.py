"""--batch-invariant's kernels: a row's result the same bits whatever else shares its call.

Linears (dense_rows.c, the GGUF tile and row kernels under TileModes.row_invariant) at every
number of rows and row position; attention (model/batch_invariant.py) for a query alone, in any
chunk of its prompt, after a cached prefix or with other requests; and, through the engine on
tiny models, greedy tokens and logprobs across prefix caching, batch mates and chunk sizes.
tests/e2e/test_batch_invariant_smollm2.py does the last on the real model.
"""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_gguf import random_k_quant_blocks, write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

from tokenbus.model.attention_backend import NativeAttentionBackend, select_attention_backend
from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.kernel_plan import quant_activation_modes
from tokenbus.model.layers.linear import make_linear_kernel
from tokenbus.model.layers.quantized import QuantizedLinearKernel
from tokenbus.model.native import load_paged_attention, load_quant_kernels
from tokenbus.model.native.dense_rows import load_dense_rows
from tokenbus.utils.cpu import CpuFeatures, _capped

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the native kernels cannot be built here",
)
DETECTED = CpuFeatures.detect()
# Row counts across every threshold the default modes switch at (16, 32, 64) and past the 64 a
# block kernel takes at once.
ROWS = (1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 130)


def capped(cap: str) -> CpuFeatures:
    if cap != "native" and not DETECTED.is_x86:
        pytest.skip("ISA caps apply to x86-64 only")
    if cap == "avx512" and DETECTED.isa != "avx512":
        pytest.skip(f"an AVX-512 build needs AVX-512; this CPU is {DETECTED.describe()}")
    return CpuFeatures(_capped(DETECTED.flags, cap), cap)


def assert_rows_invariant(linear, num_cols: int, seed: int = 0) -> None:
    """linear(x) row i is the same bits alone, at every row count and at another row position."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(ROWS), num_cols, generator=g)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(6)])
    for rows in ROWS:
        n = min(rows, 6)
        assert torch.equal(linear(x[:rows])[:n], alone[:n]), f"{rows} rows"
    mixed = torch.randn(40, num_cols, generator=g)
    mixed[37] = x[0]
    assert torch.equal(linear(mixed)[37], alone[0])


@pytest.mark.parametrize("cap", ["native", "avx2", "baseline"])
def test_dense_rows_kernel_is_row_invariant_and_a_matmul(cap):
    kernel = load_dense_rows(capped(cap))
    g = torch.Generator().manual_seed(1)
    for rows, cols in ((576, 576), (40, 96), (37, 64)):  # whole and partial panels
        weight, bias = torch.randn(rows, cols, generator=g), torch.randn(rows, generator=g)
        panels = kernel.pack(weight)

        def linear(x, panels=panels, rows=rows, bias=bias):
            out = torch.empty(x.shape[0], rows)
            kernel.matmul(panels, rows, x, out)
            return out + bias

        assert_rows_invariant(linear, cols)
        x = torch.randn(70, cols, generator=g)
        torch.testing.assert_close(linear(x), x @ weight.T + bias, rtol=1e-5, atol=1e-4)


def test_rows_linear_backend_wraps_dense_rows():
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(200, 128, generator=g), torch.randn(200, generator=g)
    linear = make_linear_kernel(weight, bias, "rows")
    assert_rows_invariant(linear, 128)
    x = torch.randn(3, 5, 128, generator=g)  # any leading shape
    torch.testing.assert_close(linear(x), x @ weight.T + bias, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="float32"):
        make_linear_kernel(weight.bfloat16(), None, "rows")


def _quant_blocks(qtype: Q, rows: int, cols: int) -> torch.Tensor:
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        data = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(data, qtype))
    return torch.from_numpy(random_k_quant_blocks(qtype.name, rows, cols, rows))


class _Shard:
    def __init__(self, qtype: Q, data: torch.Tensor, cols: int) -> None:
        self.qtype, self.data, self.cols = int(qtype), data, cols

    @property
    def rows(self) -> int:
        return self.data.shape[0]


@pytest.mark.parametrize("cap", ["native", "avx2"])
@pytest.mark.parametrize("activations", ["auto", "int16", "int8", "fp32", "bf16"])
def test_gguf_linears_are_row_invariant(activations, cap):
    """A fused q/k/v-like linear of a tiled type and a K-quant (GGUF rows) shard: under
    row-invariant modes no call switches mode or kernel with its rows."""
    kernels = load_quant_kernels(capped(cap))
    if activations == "bf16" and not kernels.bf16_engine:
        pytest.skip(f"no bf16 engine in the {cap} build on {DETECTED.describe()}")
    cols = 256  # K-quants take K in blocks of 256
    shards = [_Shard(Q.Q4_1, _quant_blocks(Q.Q4_1, 48, cols), cols)]
    shards.append(_Shard(Q.Q4_K, _quant_blocks(Q.Q4_K, 24, cols), cols))
    linear = QuantizedLinearKernel(kernels, shards, torch.randn(72))
    linear.modes = quant_activation_modes(activations, kernels, row_invariant=True)
    assert linear.modes.row_invariant and not linear.modes.gemm_from_rows
    assert linear.modes.activations == ("int16" if activations == "auto" else activations)
    assert_rows_invariant(linear, cols)


# ---- attention


def _attention_case(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype, seed: int = 0):
    """A cache holding K/V for every position of 3 requests (so any step may read them), and a
    query row per request and position: (kv, tables, queries)."""
    g = torch.Generator().manual_seed(seed)
    bs, max_len = 16, 300
    blocks = -(-max_len // bs)
    kv = torch.randn(2, 3 * blocks + 1, bs, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    order = (torch.randperm(3 * blocks, generator=g) + 1).view(3, blocks)
    queries = torch.randn(3, max_len, num_heads, head_dim, generator=g)
    return kv, order, queries


def _run_step(backend, kv, tables, queries, step):
    """step: (request, first position, q_len) each; the output rows by (request, position)."""
    starts, seq_lens, rows = [0], [], []
    for req, first, q_len in step:
        starts.append(starts[-1] + q_len)
        seq_lens.append(first + q_len)
        rows += [(req, pos) for pos in range(first, first + q_len)]
    ctx = ForwardContext(
        positions=torch.tensor([pos for _, pos in rows]),
        slot_mapping=torch.zeros(len(rows), dtype=torch.int64),  # no write: K/V are in place
        kv_caches=[kv],
        block_size=kv.shape[2],
        query_start_loc=starts,
        seq_lens=seq_lens,
        seq_lens_t=torch.tensor(seq_lens),
        block_tables=tables[[req for req, _, _ in step]],
        num_decodes=sum(q_len == 1 for _, _, q_len in step),
    )
    plan = backend.build_metadata(ctx)
    assert plan.native_long is None and plan.prefills == [] and plan.decode_tiles == []
    q = torch.stack([queries[req, pos] for req, pos in rows])
    out = torch.zeros_like(q)
    plan.native.run(q, kv, q.shape[-1] ** -0.5, out)
    return dict(zip(rows, out))


@pytest.mark.parametrize("cap", ["native", "avx2"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,kv_dtype",
    [
        (9, 3, 64, torch.float16),  # SmolLM2's shape, the default fp16 K/V
        (9, 3, 64, torch.float32),
        (32, 2, 128, torch.float32),  # 16 query heads a KV head: the generic path on AVX-512
    ],
)
def test_attention_rows_do_not_depend_on_the_step(heads, kv_heads, head_dim, kv_dtype, cap):
    kernel = load_paged_attention(capped(cap))
    backend = NativeAttentionBackend(torch.float32, kernel, row_invariant=True)
    kv, tables, queries = _attention_case(heads, kv_heads, head_dim, kv_dtype)
    length = 200
    # Request 0's prompt: one chunk; chunks of 64 (the later ones after a "cached" prefix); one
    # chunk of 37 after 150 positions cached, with a decode and a 100-query chunk of others.
    whole = _run_step(backend, kv, tables, queries, [(0, 0, length)])
    chunked = {}
    for first in range(0, length, 64):
        step = [(0, first, min(64, length - first))]
        chunked.update(_run_step(backend, kv, tables, queries, step))
    mixed = _run_step(backend, kv, tables, queries, [(1, 40, 1), (0, 150, 37), (2, 0, 100)])
    for pos in (0, 1, 15, 16, 17, 63, 64, 150, 151, 186, 199):
        alone = _run_step(backend, kv, tables, queries, [(0, pos, 1)])[(0, pos)]
        assert torch.equal(whole[(0, pos)], alone), pos
        assert torch.equal(chunked[(0, pos)], alone), pos
        if 150 <= pos < 187:
            assert torch.equal(mixed[(0, pos)], alone), pos
    # The kernel computes attention: request 0's last row against softmax(q K^T) V.
    last = queries[0, length - 1].view(kv_heads, heads // kv_heads, head_dim)
    keys = kv[:, tables[0]].reshape(2, -1, kv_heads, head_dim)[:, :length].float()
    scores = torch.einsum("hgd,thd->hgt", last, keys[0]) * head_dim**-0.5
    want = torch.einsum("hgt,thd->hgd", scores.softmax(-1), keys[1]).reshape(heads, head_dim)
    torch.testing.assert_close(whole[(0, length - 1)], want, rtol=1e-4, atol=1e-4)


def test_row_invariant_attention_needs_the_native_kernel():
    with pytest.raises(ValueError, match="native attention kernel"):
        select_attention_backend("torch", torch.device("cpu"), torch.float32, row_invariant=True)


# ---- through the engine, on tiny models


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    hf = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", "Q4_1")


def _greedy(llm, prompts, max_tokens=8):
    from tokenbus import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=0
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        )
        for o in outs
    ]


@pytest.mark.parametrize("kind", ["gguf", "dense"])
def test_engine_outputs_do_not_depend_on_batch_cache_or_chunks(kind, tiny_gguf):
    model = tiny_gguf if kind == "gguf" else cached_tiny_model("llama")
    prefix = random_prompts(1, 70, 70, seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(6, 3, 30, seed=4)]
    others = random_prompts(5, 10, 120, seed=5)
    results = []
    for caching, budget in ((True, 2048), (False, 2048), (False, 24)):
        llm = make_llm(
            model,
            batch_invariant=True,
            enable_prefix_caching=caching,
            max_num_batched_tokens=budget,
            max_model_len=256,
        )
        together = _greedy(llm, others[:2] + prompts + others[2:])[2:-3]
        alone = [_greedy(llm, [p])[0] for p in prompts[:3]]
        results.append((together, alone))
        assert_engine_clean(llm)
    first_together, first_alone = results[0]
    assert first_alone == first_together[:3]  # bitwise logprobs too: floats compared exactly
    for together, alone in results[1:]:
        assert together == first_together and alone == first_alone


def test_resolution_makes_auto_int16_and_refuses_what_it_cannot_keep(tiny_gguf):
    from tokenbus.engine.setup import resolve_config
    from tokenbus.engine_args import EngineArgs
    from tokenbus.loader import resolve_model

    source = resolve_model(str(tiny_gguf))

    def resolved(**kwargs):
        args = EngineArgs(model=str(tiny_gguf), batch_invariant=True, **kwargs)
        return resolve_config(args.to_config(256), source)

    assert resolved().model.quant_activations == "int16"
    assert resolved(quant_activations="fp32").model.quant_activations == "fp32"
    for kwargs, name in (
        ({"dtype": "bfloat16"}, "dtype"),
        ({"attention_backend": "torch"}, "attention_backend"),
        ({"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype"),
        ({"enable_lora": True}, "enable_lora"),
    ):
        with pytest.raises(ValueError, match=name):
            resolved(**kwargs)
