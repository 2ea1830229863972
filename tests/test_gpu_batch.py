"""GPU: a bf16 batch step's linears on the tensor cores (docs/batch.md "Speed", issue 32).

At B > 1 the batched ``matvec`` / ``matvec_residual`` ops of a bf16 step render ``matvec_seqs``
with ``MMA`` true (``mma.sync`` m16n8k16, fp32 accumulators: tests/test_batch_mma.py emulates
its fragments and compiles it on the CPU). Here it runs: a tiny Llama and a 2-layer Llama at
Llama-3.2-1B's published widths (hidden 2048, intermediate 8192, 32 query / 8 KV heads of 64,
vocabulary 128256), B = 4, 8 and 16 left-padded prompts, decode steps through
``torch.compile(backend="fusec")`` against eager in bf16, every sequence on its own (the bound
of the batch GPU test in tests/test_gpu.py: 3e-2), no fallback. Passed on the H200 (2026-12-05).
Likewise steps of K query tokens (option ``query_tokens``) through the batched fused kinds
(``rms_qkv_rope`` with ``tokens`` K, ``rms_gate_up_silu``: their pairs of rows on the tensor cores,
templates/seqs_rows.cu.j2 ``mma_pairs``), their logits and the K cache rows they write.
"""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from test_batch_decode import batch_steps_against_eager
from test_batch_mma import mma_flags
from test_batch_tokens_fused import assert_fused_k, k_step_against_eager

pytestmark = pytest.mark.gpu


def _tiny_llama():
    """The tiny Llama with two decoder layers (hf_tiny.llama builds one unless asked): the fused-
    kind checks (assert_fused_k) read layer 0's one-tile ops, which in a one-layer model are the
    last layer's (with the counters' copy_)."""
    return hf_tiny.llama(layers=2)


def _published_llama():
    """Two decoder layers of Llama-3.2-1B's shape (random weights, fp32 on the CPU)."""
    return hf_tiny.llama(hidden=2048, inter=8192, layers=2, heads=32, kv_heads=8, head_dim=64, vocab=128256)


@pytest.mark.parametrize("batch", [4, 8, 16])
@pytest.mark.parametrize("factory", [_tiny_llama, _published_llama], ids=["tiny", "published"])
def test_bf16_batch_step_on_the_tensor_cores_matches_eager(factory, batch, steps):
    """B left-padded prompts, 4 decode steps of the bf16 model on the GPU through
    ``torch.compile(backend="fusec")`` (default options) against eager: every sequence's logits
    within 3e-2 (relative L2), finite, no fallback; the step's every batched matvec took the
    tensor-core path (its call passes ``MMA`` true)."""
    from fusec.cuda.codegen import render
    model = factory().to(device="cuda", dtype=torch.bfloat16)
    errs, w, _ = batch_steps_against_eager(model, batch, 500 + batch, n=4, device="cuda")
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert all(e == e for e in errs) and max(errs) < 3e-2, errs
    assert steps and not any(s.fallen_back for s in steps)
    g = steps[-1].schedule.graph
    assert g.batch() == batch
    layers = model.config.num_hidden_layers
    kinds = g.count_kinds()   # the layer's q/k/v and gate/up in the batched fused kinds, o/down and the head matvecs
    assert (kinds.get("rms_qkv_rope"), kinds.get("rms_gate_up_silu")) == (layers, layers), kinds
    assert sum(o.kind in ("matvec", "matvec_residual") for o in g.ops) == 2 * layers + 1, kinds
    flags = mma_flags(render(steps[-1].schedule).source)
    assert flags and set(flags) == {"true"}, flags


@pytest.mark.parametrize("batch,k", [(1, 4), (1, 8), (2, 4)])
@pytest.mark.parametrize("factory", [_tiny_llama, _published_llama], ids=["tiny", "published"])
def test_bf16_k_token_step_on_the_tensor_cores_matches_eager(factory, batch, k, steps):
    """One step of K query tokens per sequence (B = 1, and 2 left-padded prompts with HF
    generate()'s positions) of the bf16 model on the GPU through ``torch.compile(backend="fusec",
    options={"query_tokens": K})`` against eager: every (sequence, token) row's logits and the K
    cache rows written within 3e-2 (relative L2), the other cache rows untouched, no fallback;
    the layers are the batched fused kinds of B·K rows (tests/test_batch_tokens_fused.py)."""
    model = factory().to(device="cuda", dtype=torch.bfloat16)
    err, rows_err, rest_equal, w = k_step_against_eager(model, batch, k, 700 + 10 * batch + k, device="cuda")
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert err == err and err < 3e-2 and rows_err < 3e-2 and rest_equal, (err, rows_err, rest_equal)
    assert steps and not any(s.fallen_back for s in steps)
    assert_fused_k(steps[-1], model, batch, k)


def test_a_batch_size_that_varies_runs_a_step_per_size_on_the_gpu():
    """A plain loop over batches of 2, 5 and 2 again (a StaticCache each) through one
    ``torch.compile(model, backend="fusec")`` on the GPU (bf16, the tiny Llama): the second size
    makes dynamo's batch symbolic, fusec compiles a kernel per batch size (no fallback), and every
    sequence's logits are within 3e-2 of eager's (tests/test_hf_decode.py's CPU test)."""
    from fusec.fallbacks import FallbackWatch
    model = hf_tiny.llama(layers=2).to(device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    gen = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad(), FallbackWatch() as w:
        for b in (2, 5, 2):
            caches = [hf_tiny.static_cache(model, 32) for _ in range(2)]
            prompt = torch.randint(1, 128, (b, 6), device="cuda", generator=gen)
            for c in caches:
                model(input_ids=prompt, past_key_values=c, use_cache=True)
            for _ in range(3):
                ids = torch.randint(1, 128, (b, 1), device="cuda", generator=gen)
                a = compiled(input_ids=ids, past_key_values=caches[0], use_cache=True).logits.double()
                e = model(input_ids=ids, past_key_values=caches[1], use_cache=True).logits.double()
                errs = [((a[i] - e[i]).norm() / e[i].norm()).item() for i in range(b)]
                assert all(x == x for x in errs) and max(errs) < 3e-2, (b, errs)
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled >= 2, (w.fallbacks, w.compiled)


@pytest.mark.parametrize("batch", [4, 8])
@pytest.mark.parametrize("factory", [_tiny_llama, _published_llama], ids=["tiny", "published"])
def test_rms_rows_a_warp_per_row_matches_eager(factory, batch, steps):
    """The knob ``FUSEC_RMS_ROWS_CTA`` 0 (the batched fused kinds' RMSNorms a warp per row, the
    path the default takes only where a thread would have more than 4 chunks): B left-padded
    prompts, 4 bf16 decode steps against eager, every sequence within 3e-2, no fallback (the
    default, a CTA per row set, is test_bf16_batch_step_on_the_tensor_cores_matches_eager's)."""
    model = factory().to(device="cuda", dtype=torch.bfloat16)
    errs, w, _ = batch_steps_against_eager(model, batch, 700 + batch, n=4, device="cuda",
                                           options={"defines": {"FUSEC_RMS_ROWS_CTA": 0}})
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert all(e == e for e in errs) and max(errs) < 3e-2, errs
