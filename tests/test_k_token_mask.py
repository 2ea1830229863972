"""A K-token step's causal mask (issue 32, docs/batch.md "How it lowers"): HF builds it from the
cache's rows (``kv_idx <= q_idx``), which would tie the step to one cache length and make the
attention read every row; passes/recognize.py proves it equal to ``row <= pos[k]`` for the K write
positions and gives the attention those positions instead (``mask_kind`` 3). CPU: the simulator
against eager, NVRTC for the kernels."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch

@pytest.mark.parametrize("fusions,batch", [(0, 1), (None, 1), (None, 2)], ids=["generic", "fused", "fused-b2"])
def test_k_token_causal_mask_becomes_the_write_positions(fusions, batch, steps):
    """A K = 4 step of one sequence (and of two without padding, whose mask HF repeats per
    sequence): HF's causal mask ``[B, 1, 4, L]`` (built from the cache's rows, ``kv_idx <=
    q_idx``) is proven ``row <= pos[k]`` and replaced by the K write positions (``mask_kind`` 3;
    passes/recognize.py ``_token_positions``), so its ops leave the step; the step equals eager
    at two prompt lengths, with the attention a fused ``attention_partial`` and with nothing fused
    (``max_fusions=0``: the generic attention of fusec/cuda/gen/semantic.py), and the kernels
    compile with NVRTC."""
    from fusec.cuda.codegen import render
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(23)
    for plen in (5, 12):
        caches = [hf_tiny.static_cache(model, 32) for _ in range(2)]
        prompt = torch.randint(0, 128, (batch, plen), generator=gen)
        tok = torch.randint(0, 128, (batch, 4), generator=gen)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusec", options={"query_tokens": 4, "max_fusions": fusions})
        with FallbackWatch() as w, torch.no_grad():
            for c in caches:
                model(input_ids=prompt, past_key_values=c, use_cache=True)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
        assert not w.fallbacks and w.compiled, w.fallbacks
        assert ((a - b).norm() / b.norm()).item() < 1e-5
        g = steps[-1].schedule.graph
        att = [o for o in g.ops if o.kind in ("attention", "attention_partial")]
        assert att and all(o.attrs["mask_kind"] == 3 and o.inputs["mask"] == o.inputs["pos"]
                           and g.tensors[o.inputs["mask"]].numel == 4 for o in att), [o.attrs for o in att]
        assert all(o.kind == ("attention" if fusions == 0 else "attention_partial") for o in att)
        assert not [o for o in g.ops if o.kind.startswith(("aten.le", "aten.arange"))], "the mask's ops are left"
    torch._dynamo.reset()
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.jit import compile_cuda
    compile_cuda(render(steps[-1].schedule).source, "fusec_step.cu").assert_no_spills()
