"""A standalone RMSNorm over few long rows (OLMo-2's q/k norm over the whole projection, the
post-norms: one row of the hidden size) runs one row at a time over the whole CTA with a block
reduction instead of one warp per row (22 µs per norm on one warp of the H200, 4 per layer).

CPU: the choice, the generated body on the host against PyTorch, the kernel through NVRTC.
GPU: the compiled step of an OLMo-2 whose norms take the CTA path against eager fp32."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.cuda.gen.semantic import cta_per_row


def _olmo2_wide(seed=0):
    """An OLMo-2 whose q/k norms and post-norms are one row of 512 (the CTA path), fp32, its
    norm weights drawn from [0.5, 1.5)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM
    m = hf_tiny._small(Olmo2Config, Olmo2ForCausalLM, seed, hidden_size=512, intermediate_size=256,
                       num_attention_heads=8, num_key_value_heads=8)
    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return m


def test_few_long_rows_take_the_cta_and_many_short_rows_a_warp_each():
    assert cta_per_row(1, 2048) and cta_per_row(1, 512) and cta_per_row(8, 2048)
    assert not cta_per_row(16, 128) and not cta_per_row(32, 128) and not cta_per_row(1, 64)


def test_olmo2_norms_render_the_block_reduction_and_match_on_the_host(tmp_path):
    """The lowered OLMo-2 with the prologue fold off keeps its post-norms as standalone one-row
    norms (its q/k norms are inside ``rms_qkv_rope``: tests/test_olmo_rope.py); their generated
    functions use the block reduction, compile with NVRTC for sm_90a, and compute what PyTorch
    does (host run of the same body, one thread)."""
    from fusec.api import compile_model
    from fusec.config import Options
    from fusec.cuda.codegen import render
    from gen_host import check_graph, compiler
    from fusec.cuda.jit import compile_cuda
    from fusec.pipeline import Dumper, lower
    import step_util

    model = _olmo2_wide()
    cache = hf_tiny.static_cache(model, 32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 4), generator=gen), past_key_values=cache, use_cache=True)
    kw = {"input_ids": torch.randint(0, 128, (1, 1), generator=gen), "past_key_values": cache, "use_cache": True}
    res = compile_model(model, (), kw, {"num_sms": 16, "prologue": False})
    ops = [m for o in res.graph.ops for m in (o.attrs["ops"] if o.kind == "chain" else [o])]
    norms = [o for o in ops if o.kind == "rmsnorm"]
    assert norms and all(res.graph.tensors[o.inputs["x"]].numel == 512 for o in norms)
    plan = render(res.schedule)
    assert "gx_block_reduce(ss, GxSum())" in plan.source
    compile_cuda(plan.source, "fusec_step.cu")
    if compiler() is None:
        pytest.skip("no host C++ compiler for the host check")
    _, g, flat = step_util.capture(model, kw)
    low = lower(g, flat, Options.from_dict({"num_sms": 16, "prologue": False}), Dumper(None)).graph
    with torch.no_grad():
        checks = check_graph(low, flat, workdir=tmp_path)
    low_ops = [m for o in low.ops for m in (o.attrs["ops"] if o.kind == "chain" else [o])]
    normed = [r for r in checks if r.op in {o.name for o in low_ops if o.kind == "rmsnorm"}]
    assert normed and all(r.max_err <= 1e-5 for r in checks), checks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_olmo2_cta_norms_on_the_gpu_match_eager():
    """Six decode steps of the compiled OLMo-2 (fp32, default options, one megakernel) against
    eager: relative logits error ≤ 1e-4, no fallback."""
    import step_util
    errs, w = step_util.steps_against_eager(_olmo2_wide().cuda(), 128, seed=2)
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    assert max(errs) <= 1e-4, errs
