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


def split_factory(family):
    """The models of tests/test_gpu.py's split-rows test: a 4104-wide down projection (whole warp
    steps and a chunk past them) over 896 output rows (Llama: ``matvec_residual``) or 64
    (OLMo-2's post-norm MLP: ``matvec``)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM
    if family == "llama":
        return hf_tiny.llama(layers=2, hidden=896, inter=4104, heads=8, kv_heads=2, head_dim=64, vocab=256)
    return hf_tiny._small(Olmo2Config, Olmo2ForCausalLM, intermediate_size=4104)


@pytest.mark.parametrize("family,kind", [("llama", "matvec_residual"), ("olmo2", "matvec")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_last_round_tiles_and_kernels(family, kind, dtype, tmp_path):
    """The GPU test of the split rows (tests/test_gpu.py) runs what it says: on 132 SMs the down
    projection is ``kind`` with K = 4104, its tiles hold at most 8 rows (no full round of the 16
    warps, and at most half of them: every row split along K, matvec_split.cuh
    matvec_split_rows), and the kernel compiles with NVRTC without spills with the split
    (default) and without it (FUSEC_SPLIT_LAST_ROUND 0)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    import re
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from test_attention_split import _lowered
    sched = _lowered(lambda: split_factory(family), dtype, 132, 64)
    g = sched.graph
    downs = [o for o in g.ops if o.kind == kind and g.tensors[o.inputs["w"]].shape[-1] == 4104]
    assert len(downs) == 2, [o.kind for o in g.ops]
    names = {o.name for o in downs}
    rows = [i.tile.params["rows"][1] - i.tile.params["rows"][0] for i in sched.instrs if i.op in names]
    assert rows and max(rows) <= 8, rows   # at most half of the 16 warps: every row split
    src = render(sched).source
    assert re.search(r"#define FUSEC_SPLIT_LAST_ROUND 1\b", src)
    for v in (1, 0):
        k = compile_cuda(src.replace("#define FUSEC_SPLIT_LAST_ROUND 1", f"#define FUSEC_SPLIT_LAST_ROUND {v}"),
                         "fusec_step.cu", cache_dir=str(tmp_path))
        k.assert_no_spills()


@pytest.mark.parametrize("one_batch", [12, 0])
def test_short_rows_load_in_one_batch(one_batch, tmp_path):
    """A warp's rows of at most FUSEC_ONE_BATCH_STEPS 16-byte loads per lane in all load in one
    batch (templates/common.cuh ``MatvecBatch``): Gemma-2's 2304-wide rows 9 (they were a batch
    of 8 and one after it, two dependent round trips), Qwen3-0.6B's 3072-wide down projection 12,
    SmolLM2-360M's 2560 10; Llama-3.2-1B's two-row dot over 2048 (16 in all) and its 8192-wide
    rows keep batches of FUSEC_LOADS_IN_FLIGHT / R. With the knob at 0, every row takes those.
    Checked by the compiler itself (static_assert in the rendered kernel, NVRTC for sm_90a)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    import step_util
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    defines = {"FUSEC_ONE_BATCH_STEPS": one_batch}
    sched = step_util.lowered(hf_tiny.llama().to(torch.bfloat16), defines=defines)
    lif = 8
    want = {(2304, 1): (9 if one_batch else lif, 1), (3072, 1): (12 if one_batch else lif, 1),
            (2560, 1): (10 if one_batch else lif, 1), (2048, 2): (lif // 2, 2), (8192, 1): (lif, 4),
            (2048, 1): (8, 1)}
    checks = "".join(f'static_assert(MatvecBatch<__nv_bfloat16, {k}, {r}>::B == {b} && '
                     f'MatvecBatch<__nv_bfloat16, {k}, {r}>::NB == {nb}, "K {k} R {r}");\n'
                     for (k, r), (b, nb) in want.items())
    source = render(sched, defines=defines).source + "\n" + checks
    compile_cuda(source, "fusec_step.cu", cache_dir=str(tmp_path))
