"""rms_mlp_residual (option ``mlp_merge="last_tile"``): the whole MLP block as one level, the
down-projection split along its input with fp32 atomic sums and a last-tile residual add.
Simulator against eager through ``torch.compile`` (no fallback), NVRTC emission, and on a GPU
the kernel against eager."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch

OPTS = {"mlp_merge": "last_tile"}


def _decode_against_eager(model, num_sms, n=8, tol=1e-4, device="cpu", **options):
    """n decode steps of ``model`` compiled with fusec (OPTS, ``options``) against eager after a
    4-token prompt."""
    from transformers import StaticCache
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    p = torch.randint(0, vocab, (1, 4), generator=gen).to(device)
    with torch.no_grad():
        for c in caches:
            model(input_ids=p, past_key_values=c, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": num_sms, **OPTS, **options})
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(n):
            tok = torch.randint(0, vocab, (1, 1), generator=gen).to(device)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits.float()
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits.float()
            rel = ((a - b).norm() / b.norm()).item()
            assert torch.isfinite(a).all() and rel < tol, rel
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


@pytest.mark.parametrize("num_sms", [16, 3])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.gemma], ids=["llama", "gemma"])
def test_mlp_in_one_level_matches_eager_and_compiles(factory, num_sms, steps):
    """Every layer's MLP is one rms_mlp_residual op (no gate/up or down level left), the
    simulator matches eager over 8 steps (the accumulator is cleared by each step's last tile),
    and the kernel compiles without spills (either reduction). 3 SMs: tiles of more than 32
    chunks of Wd per row."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    model = factory()
    _decode_against_eager(model, num_sms)
    kinds = steps[0].schedule.graph.count_kinds()
    assert kinds.get("rms_mlp_residual") == model.config.num_hidden_layers, kinds
    assert "rms_gate_up_silu" not in kinds
    for defines in ({}, {"FUSEC_MLP_RED_V4": 0}):   # four rows per vector reduction, or one
        plan = render(steps[0].schedule, defines=defines)
        assert "rms_mlp_residual<" in plan.source
        compile_cuda(plan.source, "fusec_step.cu").assert_no_spills()


def test_default_keeps_the_down_projection_level(steps):
    """Without the option the MLP stays two levels (rms_gate_up_silu, then matvec_residual)."""
    from transformers import StaticCache
    model = hf_tiny.llama()
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
        torch._dynamo.reset()
        torch.compile(model, backend="fusec", options={"num_sms": 8})(
            input_ids=torch.randint(0, 128, (1, 1)), past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    kinds = steps[0].schedule.graph.count_kinds()
    assert "rms_mlp_residual" not in kinds and kinds["rms_gate_up_silu"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("v4", [1, 0], ids=["red-v4", "red-f32"])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.gemma], ids=["llama", "gemma"])
def test_mlp_in_one_level_on_the_gpu(factory, v4):
    """The kernel with mlp_merge="last_tile", bf16, against bf16 eager over 8 steps (5e-2: a
    gross-error bound, both round to bf16; the atomic sums' order varies), no fallback; the
    partial sums added four rows per vector reduction (default) and one row per reduction."""
    model = factory().to(torch.bfloat16).cuda()
    _decode_against_eager(model, 132, tol=5e-2, device="cuda", defines={"FUSEC_MLP_RED_V4": v4})
