"""Rendering and NVRTC compile-check of small megakernels (CPU only: NVRTC needs no GPU)."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.api import compile_model
from fusec.codegen import WORD, render
from fusec.jit import compile_cuda


@pytest.mark.parametrize("factory,dtype", [(hf_tiny.llama, torch.bfloat16), (hf_tiny.qwen3, torch.float32)])
def test_tiny_kernel_renders_and_compiles(factory, dtype, tmp_path):
    model = factory().to(dtype)
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
    res = compile_model(model, (), {"input_ids": torch.randint(0, 128, (1, 1)),
                                    "past_key_values": cache, "use_cache": True}, {"num_sms": 12})
    plan = render(res.schedule)
    s = res.schedule
    assert len(plan.words) == WORD * len(s.instrs)
    # every instruction word: op index, its counter id, and its wait list as scheduled
    for q, sm_queue in enumerate(s.queues):
        for k, iid in enumerate(sm_queue):
            w = plan.words[(plan.queue_off[q] + k) * WORD:(plan.queue_off[q] + k + 1) * WORD]
            assert w[7] == iid and res.graph.ops[w[0]].name == s.instrs[iid].op
            assert plan.waits[w[5]:w[5] + w[6]] == s.instrs[iid].waits
    for kind in ("rms_qkv_rope", "attention_partial", "matvec_residual", "rms_gate_up_silu", "rms_lm_head"):
        assert f"{kind}<" in plan.source
    k = compile_cuda(plan.source, "fusec_step.cu", cache_dir=str(tmp_path))
    k.assert_no_spills()
