"""Split-KV attention at head dims whose 16-byte chunks per row (G = D / 8 in bf16, D / 4 in fp32)
are not a power of two: Phi-3's 96, Phi-2's 80, and 24, 40, 160.

The template rounds a row's lanes up to a power of two (``attention_lanes`` in
templates/attention_partial.cu.j2): the lanes past G load nothing and hold zeros, so the scores
and the value pass take the vector paths that power-of-two heads take. Before, such a head fell
to one thread per output element looping over every cache row with 2-byte loads (Phi-3's value
pass: 10 of its attention level's 17 µs on an H100). CPU: the kernels compile without spills and
the attention functions issue no 2-byte V loads; GPU: the logits against eager.
"""
from __future__ import annotations

import re

import pytest
import torch

import hf_tiny
import step_util

#: (head_dim, query heads, KV heads): Phi-3's 96 as MHA, Phi-2's 80 in GQA pairs; 24, 40, 160 (bf16 G 3, 5, 20)
SHAPES = [(96, 4, 4), (80, 4, 2), (24, 4, 1), (40, 8, 2), (160, 2, 2)]


def _model(head_dim, heads, kv_heads, layers=1):
    return hf_tiny.llama(hidden=64, heads=heads, kv_heads=kv_heads, head_dim=head_dim, layers=layers)


def _schedule(model, length=256, num_sms=32):
    cache = hf_tiny.static_cache(model, length)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
    kw = {"input_ids": torch.randint(0, 128, (1, 1)), "past_key_values": cache, "use_cache": True}
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    _, g, flat = step_util.capture(model, kw)
    return lower(g, flat, Options.from_dict({"num_sms": num_sms}), Dumper(None))


@pytest.mark.parametrize("head_dim,heads,kv_heads", [SHAPES[0], SHAPES[1]])
def test_padded_lanes_compile_without_scalar_value_loads(head_dim, heads, kv_heads, tmp_path):
    """bf16 at head_dim 96 and 80 (G 12, 10 -> 16 lanes): the kernel compiles for sm_90a without
    spills, and the split-KV functions load K and V in 16-byte chunks only (the one 2-byte load
    per thread left is q's, staged before the position; the scalar value pass had one per cache
    row and element); the op's shared memory holds the value pass's per-warp buffer (without it
    the padded lanes' sums were written past the CTA's shared memory: an illegal address on the
    GPU)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import kernel_ptx
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda, compile_ptx
    from fusec.instructions.attention import AttentionPartial
    sched = _schedule(_model(head_dim, heads, kv_heads).to(torch.bfloat16))
    ops = [o for o in sched.graph.ops if o.kind == "attention_partial"]
    assert ops
    for op in ops:   # the value pass's per-warp buffer [16 warps][min(REP, 4)][D] is in its smem
        rep, chunk = heads // kv_heads, op.attrs["chunk"]
        assert AttentionPartial.smem_floats(op, sched.graph) >= rep * (head_dim + chunk) + 16 * min(rep, 4) * head_dim
    source = render(sched).source
    compile_cuda(source, "fusec_step.cu", cache_dir=str(tmp_path)).assert_no_spills()
    bodies = {n: b for n, b in kernel_ptx.functions(compile_ptx(source)).items() if "attention_partial" in n}
    counts = {n[:60]: (len(re.findall(r"ld\.global\.cg\.v4", b)),
                       len(re.findall(r"ld\.global\.cg\.(?:b16|u16|s16)", b))) for n, b in bodies.items()}
    assert sum(w for w, _ in counts.values()) >= 2 and all(n <= 1 for _, n in counts.values()), counts


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim,heads,kv_heads", SHAPES)
def test_head_dims_match_eager_on_the_gpu(head_dim, heads, kv_heads, dtype):
    """H100/H200: a tiny Llama of the head shape (2 layers) over a 1024-row StaticCache with random
    contents at positions 5, 300 and 1000 (two steps each): the logits within fp32's 1e-4 or
    bf16's 5e-2 of eager's; no fallback."""
    from fusec.fallbacks import FallbackWatch
    model = _model(head_dim, heads, kv_heads, layers=2).to(device="cuda", dtype=dtype)
    gen = torch.Generator().manual_seed(head_dim)
    toks = [torch.randint(0, 128, (1, 1), generator=gen).cuda() for _ in range(2)]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"fallback": "eager"})
    with torch.no_grad(), FallbackWatch() as watch:
        for pos in (5, 300, 1000):
            for a, b in step_util.steps_at_position(model, compiled, toks, pos, gen):
                err = step_util.rel(a, b)
                assert torch.isfinite(a).all() and err < tol, (pos, err)
    torch._dynamo.reset()
    assert watch.compiled > 0 and not watch.fallbacks, watch.fallbacks


def test_scalar_scores_read_only_the_rows_chunks():
    """fp32 at head_dim 160: 40 chunks per row, 64 lanes past a warp, so the scores take the path of
    one thread per cache row, which loads the row's chunks unrolled: 40 16-byte K loads per copy
    of the loop (with the padded lane count as its bound it loaded 64, reading past the row into the next
    one, and past the last row's allocation)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import kernel_ptx
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_ptx
    sched = _schedule(_model(160, 2, 2))
    bodies = [b for n, b in kernel_ptx.functions(compile_ptx(render(sched).source)).items() if "attention_partial" in n]
    wide = sum(len(re.findall(r"ld\.global\.cg\.v4", b)) for b in bodies)
    # the split's rows in one block or in blocks (MB): two inlined copies of the row's 40 loads
    assert wide > 0 and wide % (160 // 4) == 0, wide
