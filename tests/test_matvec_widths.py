"""Matvec rows that end past a warp's last full step of 32 x 16 bytes (templates/common.cuh
dot_rows): Falcon-7B's 4544, Qwen2.5-0.5B's 896, Gemma-3-1B's 1152, SmolLM2's 576 in bf16; 4544
and 4512 in fp32. Their kernels compile with NVRTC for sm_90a without spills (the lane chunks
past the full steps, held in registers through the batches, spilled at fp32 4544 in
rms_qkv_rope's two-row dot); the GPU compares them with eager in tests/test_gpu.py
(test_mid_size_matvec_paths_match_eager)."""
from __future__ import annotations

import pytest
import torch

import hf_tiny


@pytest.mark.parametrize("hidden,heads,kv_heads,head_dim,dtype", [
    (4544, 71, 1, 64, torch.float32), (4544, 8, 1, 128, torch.float32), (4512, 8, 1, 128, torch.float32),
    (4544, 71, 1, 64, torch.bfloat16), (896, 14, 2, 64, torch.bfloat16), (1152, 4, 1, 256, torch.bfloat16),
    (576, 9, 3, 64, torch.bfloat16),
])
def test_rows_past_a_warp_step_compile_without_spills(hidden, heads, kv_heads, head_dim, dtype, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from test_attention_split import _lowered

    def model():
        return hf_tiny.llama(hidden=hidden, inter=64, layers=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    sched = _lowered(model, dtype, 132, 512)
    assert any(o.kind == "rms_qkv_rope" for o in sched.graph.ops)   # the two-row dot over `hidden`
    compile_cuda(render(sched).source, "fusec_step.cu", cache_dir=str(tmp_path)).assert_no_spills()
