"""GPU tests (H200) of the generated generic ops (fusec/cuda/gen): tiny HF models of several
families, fully fused and with nothing fused (``max_fusions=0``: every op a generic
instruction), 8 decode steps against eager in fp32; and the op zoo's kernel against PyTorch."""
from __future__ import annotations

import copy

import pytest
import torch

import generic_zoo
import hf_tiny
import step_util
from fusec.fallbacks import FallbackWatch

pytestmark = pytest.mark.gpu
FAMILIES = ["llama", "qwen3", "qwen2_bias", "gemma", "phi3_fused", "gpt_neox", "olmo2", "granite"]


@pytest.mark.parametrize("max_fusions", [0, None])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_decode_matches_eager(name, max_fusions):
    model, cache = step_util.tiny_on_gpu(getattr(hf_tiny, name), torch.float32)
    ref = copy.deepcopy(cache)
    torch._dynamo.reset()
    opts = {"fallback": "eager"} if max_fusions is None else {"fallback": "eager", "max_fusions": max_fusions}
    compiled = torch.compile(model, backend="fusec", options=opts)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad(), FallbackWatch() as watch:
        for step in range(8):
            tok = torch.randint(0, 128, (1, 1), generator=gen).cuda()
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.clone()
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert torch.isfinite(a).all()
            assert step_util.rel(a, b) < 1e-4, (step, step_util.rel(a, b))
    assert not watch.fallbacks, f"the kernel did not run: {watch.fallbacks}"
    for l1, l2 in zip(cache.layers, ref.layers):
        assert step_util.rel(l1.keys, l2.keys) < 1e-5 and step_util.rel(l1.values, l2.values) < 1e-5
        assert int(l1.cumulative_length) == int(l2.cumulative_length)
    torch._dynamo.reset()


def test_zoo_kernel_matches_torch():
    """Every zoo op as a generic instruction with 512 threads (warp reductions, barriers,
    scatters): the step's outputs against PyTorch's CUDA kernels."""
    inp = generic_zoo.inputs(device="cuda")
    _, g, flat = step_util.capture(generic_zoo.Zoo(), {k: v.clone() for k, v in inp.items()})
    ref_in = {k: v.clone() for k, v in inp.items()}
    with torch.no_grad():
        ref = generic_zoo.Zoo()(**ref_in)
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from fusec.passes import schedule, tile
    from fusec.runtime.cuda_step import CudaStep
    # the raw captured graph (no passes: nothing folds or fuses), every op generic, 16 SMs
    sched = schedule.run(g, tile.run(g, 16), 16)
    plan = render(sched)
    step = CudaStep(g, plan, compile_cuda(plan.source, "fusec_step.cu"), flat)
    outs = step(*flat)
    torch.cuda.synchronize()
    assert len(outs) >= len(ref)
    for k, (a, b) in enumerate(zip(outs, ref)):
        a, b = a.cpu().reshape(b.shape), b.cpu()
        if b.is_floating_point():
            scale = b.float().abs().max().clamp_min(1e-6)
            tol = 1e-4 if b.dtype == torch.float32 else 2e-2
            assert ((a.float() - b.float()).abs().max() / scale) <= tol, k
        else:
            assert torch.equal(a, b.to(a.dtype)), k
