"""Sibling linears over one input vector as one ``matvec_group`` op
(fusec/instructions/matvec_group.py): which linears group, the op's tiles, the step against
eager on the simulator, the kernel through NVRTC. The GPU runs groups in the family tests."""
from __future__ import annotations

import torch

import step_util
from fusec.instructions.matvec_group import MatvecGroup


def _cohere():
    """Tiny Cohere, fp32: its RoPE is interleaved (no ``rms_qkv_rope``), so its q/k/v over the
    LayerNorm's output stay a group (OLMo-2's, the example before, are ``rms_qkv_rope`` now)."""
    import test_families
    return test_families.cohere()


def test_cohere_qkv_are_groups_placed_at_the_first_linear():
    """Cohere (interleaved RoPE: no norm-fused kind takes its q/k/v): per layer q/k/v is one
    group of three (gate/up go to rms_gate_up_silu); the group sits where q's linear was and
    every reader of a member output comes after it; O and down are matvec_residual."""
    s = step_util.lowered(_cohere(), prologue=False)
    g = s.graph
    groups = [o for o in g.ops if o.kind == "matvec_group"]
    H, KV = 64, 32   # 4 query heads and 2 KV heads of 16
    assert [o.attrs["rows"] for o in groups] == [[H, KV, KV]] * 2
    assert sum(o.kind == "rms_gate_up_silu" for o in g.ops) == 2
    assert sum(o.kind == "matvec_residual" for o in g.ops) == 4   # O and down, two layers
    pos = {name: i for i, o in enumerate(g.ops) for name in [o.name]}
    for grp in groups:   # every reader of a member output comes after the group
        outs = {g.root(t) for t in grp.outputs.values()}
        for o in g.ops[:pos[grp.name]]:
            assert not outs & {g.root(t) for t in o.reads()}


def test_group_tiles_cover_every_row_once_across_weights():
    s = step_util.lowered(_cohere(), prologue=False)
    g = s.graph
    assert any(o.kind == "matvec_group" for o in g.ops)
    for grp in (o for o in g.ops if o.kind == "matvec_group"):
        tiles = MatvecGroup.tiles(grp, g, 7)
        written = {}
        for t in tiles:
            for w in t.writes:
                written.setdefault(w.tensor, []).append((w.start, w.stop))
        for j, n in enumerate(grp.attrs["rows"]):
            spans = sorted(written[g.root(grp.outputs[f"out{j}"])])
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert sum(t.weight_bytes for t in tiles) == sum(g.tensors[grp.inputs[f"w{j}"]].nbytes
                                                         for j in range(len(grp.attrs["rows"])))


def test_group_tiles_compute_each_linear():
    """A group's tiles (ranges crossing from one weight to the next) compute each linear's
    ``W_j @ x`` (fresh random x and weights; fp32, so up to the order of the sums)."""
    from fusec.ir.env import Env
    s = step_util.lowered(_cohere(), prologue=False)
    g = s.graph
    grp = next(o for o in g.ops if o.kind == "matvec_group")
    gen = torch.Generator().manual_seed(3)
    env = Env(g, [None] * len(g.inputs))
    env.bufs[g.root(grp.inputs["x"])] = torch.randn(g.tensors[grp.inputs["x"]].numel, generator=gen)
    for j in range(3):
        w = grp.inputs[f"w{j}"]
        env.bufs[g.root(w)] = torch.randn(g.tensors[w].shape, generator=gen)
    for t in MatvecGroup.tiles(grp, g, 5):
        MatvecGroup.run_tile(grp, t, env)
    for j in range(3):
        want = env.read(grp.inputs[f"w{j}"]).float() @ env.read(grp.inputs["x"]).reshape(-1).float()
        got = env.read(grp.outputs[f"out{j}"]).reshape(-1)
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5)   # fp32: summation order


def test_group_kernel_compiles():
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    plan = render(step_util.lowered(_cohere().to(torch.bfloat16)))
    assert "matvec_group<" in plan.source
    compile_cuda(plan.source, "fusec_step.cu")
