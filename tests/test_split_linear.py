"""Views at an offset into a buffer (``TensorInfo.offset``) and the ``split_linear`` pass that makes
them (issue 31): a fused projection's pieces become linears over row views of its weight, so
Phi-3's fused qkv and gate_up take Llama's kinds. CPU: the IR arithmetic of a view, the pass
on hand-made graphs (what it splits and what it leaves), Phi-3's kinds and kernel, the artifact
cache's round trip of a graph with views."""
from __future__ import annotations

import pytest
import torch

import step_util
from fusec.errors import IRError
from fusec.instructions.base import Region
from fusec.ir import Graph, Op, Ref, Role, TensorInfo
from fusec.ir.env import Env
from fusec.ir.semantics import execute

A = torch.ops.aten


def _view_graph() -> Graph:
    """W [8, 4] fp32 weight; V = rows [2, 5) of W (a view at 8); U = row 1 of V (a view of a view)."""
    g = Graph()
    g.add_tensor(TensorInfo("W", (8, 4), torch.float32, Role.WEIGHT, input_index=0))
    g.add_tensor(TensorInfo("V", (3, 4), torch.float32, alias_of="W", offset=8))
    g.add_tensor(TensorInfo("U", (1, 4), torch.float32, alias_of="V", offset=4))
    g.add_tensor(TensorInfo("Vf", (12,), torch.float32, alias_of="V"))   # a whole alias of the view
    g.inputs = ["W"]
    return g


def test_a_view_covers_its_rows_of_the_root():
    g = _view_graph()
    g.check("test")
    assert g.root("V") == g.root("U") == "W"
    assert g.span("W") == ("W", 0, 32) and g.span("V") == ("W", 8, 20) and g.span("U") == ("W", 12, 16)
    assert g.span("Vf") == ("W", 8, 20) and g.is_view("Vf") and not g.is_view("W")
    assert Region.whole(g, "V") == Region("W", 8, 20)
    assert Region.of(g, "V", 4, 8) == Region("W", 12, 16)
    assert Region.of(g, "U", 0, 4) == Region("W", 12, 16)
    assert Region.whole(g, "W") == Region("W", 0, 32)
    w = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    env = Env(g, [w])
    assert torch.equal(env.read("V"), w[2:5]) and torch.equal(env.read("U"), w[3:4])
    assert torch.equal(env.read("Vf"), w[2:5].reshape(-1))
    assert torch.equal(env.flat("V"), w.reshape(-1)[8:20])
    assert g.tensors["V"].describe() == "float32[3,4] intermediate =W+8"
    assert "# views" in g.dump() and "V: float32[3,4] intermediate =W+8" in g.dump()


def test_the_kernel_points_at_a_view_and_the_checker_bounds_it():
    from fusec.cuda.codegen import Buffers
    g = _view_graph()
    bufs = Buffers(g)
    assert bufs.ptr("W") == "((const float*)bufs[0])"
    assert bufs.ptr("V") == "((const float*)bufs[0] + 8)" and bufs.ptr("U") == "((const float*)bufs[0] + 12)"
    assert bufs.names == ["W"]   # the pointer table holds the root only
    g.tensors["U"].offset = 9    # rows past the end of V
    with pytest.raises(IRError, match="does not fit"):
        g.check("test")
    g.tensors["U"].offset, g.tensors["U"].dtype = 4, torch.float16
    with pytest.raises(IRError, match="does not fit"):
        g.check("test")


def _fused_graph(pieces: str, bias: bool = True, n: int = 12, k: int = 8) -> Graph:
    """``y = addmm(b, x, permute(w))`` (or ``mm``) viewed ``[1, 1, n]``, then ``pieces``:
    ``split`` (split_with_sizes [4, 4, 4] on the last dim, outputs multiplied), ``slices``
    (two disjoint slices), ``overlap`` (two overlapping slices), ``heads`` (the view ``[1, 3, 4]``
    split on dim 1: three heads, each one row range, as Falcon-7B's multi-query q/k/v),
    ``interleaved`` (the view ``[1, 3, 4]`` split on dim 2 into [2, 2]: each piece three blocks
    of two rows, four apart, as GPT-NeoX's per-head q/k/v), ``whole`` (a slice and the whole
    output read)."""
    g = Graph()
    f = torch.float32
    ins = [TensorInfo("x", (1, k), f, Role.INPUT, input_index=0),
           TensorInfo("w", (n, k), f, Role.WEIGHT, input_index=1)]
    if bias:
        ins.append(TensorInfo("b", (n,), f, Role.WEIGHT, input_index=2))
    for t in ins:
        g.add_tensor(t)
    g.inputs = [t.name for t in ins]
    g.add_tensor(TensorInfo("wt", (k, n), f))
    g.add_tensor(TensorInfo("y", (1, n), f))
    ops = [Op("wt", "aten.permute.default", {"in0": "w"}, {"out": "wt"},
              attrs={"target": A.permute.default, "args": (Ref("in0"), [1, 0]), "kwargs": {}})]
    if bias:
        ops.append(Op("y", "aten.addmm.default", {"in0": "b", "in1": "x", "in2": "wt"}, {"out": "y"},
                      attrs={"target": A.addmm.default, "args": (Ref("in0"), Ref("in1"), Ref("in2")), "kwargs": {}}))
    else:
        ops.append(Op("y", "aten.mm.default", {"in0": "x", "in1": "wt"}, {"out": "y"},
                      attrs={"target": A.mm.default, "args": (Ref("in0"), Ref("in1")), "kwargs": {}}))
    shape = (1, 3, 4) if pieces in ("heads", "interleaved") else (1, 1, n)
    g.add_tensor(TensorInfo("yv", shape, f, alias_of="y"))

    def sl(name, a, e):
        g.add_tensor(TensorInfo(name, (1, 1, min(e, n) - a), f))
        return Op(name, "aten.slice.Tensor", {"in0": "yv"}, {"out": name},
                  attrs={"target": A.slice.Tensor, "args": (Ref("in0"), 2, a, e), "kwargs": {}})

    def mul(name, a, b_, shape):
        g.add_tensor(TensorInfo(name, shape, f, Role.OUTPUT))
        return Op(name, "aten.mul.Tensor", {"in0": a, "in1": b_}, {"out": name},
                  attrs={"target": A.mul.Tensor, "args": (Ref("in0"), Ref("in1")), "kwargs": {}})

    if pieces == "interleaved":
        for i in range(2):
            g.add_tensor(TensorInfo(f"s{i}", (1, 3, 2), f))
        ops.append(Op("split", "aten.split_with_sizes.default", {"in0": "yv"}, {"out0": "s0", "out1": "s1"},
                      attrs={"target": A.split_with_sizes.default, "args": (Ref("in0"), [2, 2], 2), "kwargs": {}}))
        ops.append(mul("z", "s0", "s1", (1, 3, 2)))
    elif pieces in ("split", "heads"):
        dim, sizes = (2, [4, 4, 4]) if pieces == "split" else (1, [1, 1, 1])
        outs = {f"out{i}": f"s{i}" for i in range(3)}
        for i in range(3):
            g.add_tensor(TensorInfo(f"s{i}", (1, 1, 4), f))
        ops.append(Op("split", "aten.split_with_sizes.default", {"in0": "yv"}, outs,
                      attrs={"target": A.split_with_sizes.default, "args": (Ref("in0"), sizes, dim), "kwargs": {}}))
        ops.append(mul("z", "s0", "s2", (1, 1, 4)))   # s1 unread: its rows are not computed
    elif pieces == "slices":
        ops += [sl("a", 0, 4), sl("c", 8, 2 ** 63 - 1), mul("z", "a", "c", (1, 1, 4))]
    elif pieces == "overlap":
        ops += [sl("a", 0, 8), sl("c", 4, 12), mul("z", "a", "c", (1, 1, 8))]
    elif pieces == "whole":
        ops += [sl("a", 0, 4), mul("z", "yv", "yv", (1, 1, n)), mul("z2", "a", "a", (1, 1, 4))]
    g.ops = ops
    g.outputs = [o.outputs["out"] for o in ops if o.kind == "aten.mul.Tensor"]
    g.check("test")
    return g


def _inputs(g: Graph):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(g.tensors[n].shape, generator=gen) for n in g.inputs]


@pytest.mark.parametrize("pieces,bias", [("split", True), ("split", False), ("slices", True), ("heads", True)])
def test_pieces_become_linears_over_row_views(pieces, bias):
    """The pass's linears read row views of w (and b); the values are the same, run by the
    reference executor and by the scheduled simulator (hazard check on), whose regions read
    exactly the rows each linear uses."""
    from fusec.passes import fuse, recognize, schedule, split_linear, tile
    from fusec.sim import Simulator
    g = _fused_graph(pieces, bias)
    flat = _inputs(g)
    want = execute(g.copy(), flat)
    s = split_linear.run(g.copy())
    s.check("split_linear")
    views = {t.name: (t.alias_of, t.offset) for t in s.tensors.values() if t.offset is not None}
    assert views == {"w_rows0": ("w", 0), "w_rows8": ("w", 64), **({"b_rows0": ("b", 0), "b_rows8": ("b", 8)}
                                                                    if bias else {})}
    assert not any(o.kind in ("aten.split_with_sizes.default", "aten.slice.Tensor") for o in s.ops)
    for got, ref in zip(execute(s.copy(), flat), want):
        assert torch.allclose(got, ref, atol=1e-6)
    r = recognize.run(s, {})
    lin = [o for o in r.ops if o.kind == "linear"]
    assert [o.inputs["w"] for o in lin] == ["w_rows0", "w_rows8"]
    sched = schedule.run(r, tile.run(r, 4), 4)
    reads = {(x.tensor, x.start, x.stop) for i in sched.instrs for x in i.tile.reads if x.tensor == "w"}
    assert reads and all(0 <= a and (e <= 32 or a >= 64) and e <= 96 for _, a, e in reads)   # rows 4..8 unread
    for got, ref in zip(Simulator(sched).step(flat), want):
        assert torch.allclose(got.reshape(ref.shape), ref, atol=1e-6)
    # fused: the two linears over one vector are one matvec_group reading both views
    f = fuse.run(r.copy(), 4)
    (grp,) = [o for o in f.ops if o.kind == "matvec_group"]
    assert (grp.inputs["w0"], grp.inputs["w1"]) == ("w_rows0", "w_rows8")
    sched = schedule.run(f, tile.run(f, 4), 4)
    for got, ref in zip(Simulator(sched).step(flat), want):
        assert torch.allclose(got.reshape(ref.shape), ref, atol=1e-6)


@pytest.mark.parametrize("pieces", ["overlap", "interleaved", "whole"])
def test_pieces_that_are_not_row_ranges_are_left_alone(pieces):
    from fusec.passes import split_linear
    g = _fused_graph(pieces)
    before = g.dump()
    assert split_linear.run(g).dump() == before


def test_conv1d_weight_is_not_split():
    """GPT-2's Conv1D: addmm(b, x, w) with w [K, N] (no permute): a piece is columns of w."""
    from fusec.passes import split_linear
    g = _fused_graph("split")
    wt = g.tensors.pop("wt")
    g.tensors["w"].shape = wt.shape
    g.ops = g.ops[1:]
    g.ops[0].inputs["in2"] = "w"
    g.check("test")
    before = g.dump()
    assert split_linear.run(g).dump() == before


def test_phi3_fused_projections_take_llama_kinds_and_compile():
    """Phi-3's qkv_proj + slices and gate_up_proj + chunk lower as Llama's layers do (kind counts
    of the tiny Llama but for nothing), reading row views of the fused weights; the kernel
    compiles with NVRTC without spills."""
    import test_families as fam
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    s = step_util.lowered(fam.phi3())
    g = s.graph
    assert g.count_kinds() == {"aten.copy_.default": 2, "attention_partial": 2, "embedding": 1,
                               "matvec_residual": 4, "rms_gate_up_silu": 2, "rms_lm_head": 1,
                               "rms_qkv_rope": 2, "table_lookup": 2}
    qkv = [o for o in g.ops if o.kind == "rms_qkv_rope"]
    for o in qkv:
        spans = [g.span(o.inputs[w]) for w in ("wq", "wk", "wv")]
        assert len({r for r, _, _ in spans}) == 1 and [(a, e) for _, a, e in spans] == \
            [(0, 64 * 64), (64 * 64, 96 * 64), (96 * 64, 128 * 64)]
    src = render(s).source
    assert "bufs[A[3]] + 4096)" in src or "+ 4096)" in src
    assert compile_cuda(src, "fusec_step.cu").resources["fusec_step"]["spill_store_bytes"] == 0


def test_artifact_entry_of_a_graph_with_views_round_trips():
    """A schedule whose graph has views encodes and decodes with its offsets; the key tells an
    offset apart."""
    from fusec.config import Options
    from fusec.passes import recognize, schedule, split_linear, tile
    from fusec.cache import artifacts
    g = recognize.run(split_linear.run(_fused_graph("split")), {})
    sched = schedule.run(g, tile.run(g, 4), 4)
    back = artifacts.loads(artifacts.dumps({"format": artifacts.FORMAT, "schedule": sched}))["schedule"]
    assert back.graph.tensors["w_rows8"].offset == 64 and back.graph.tensors["w_rows8"].alias_of == "w"
    assert back.graph.dump() == g.dump()
    assert artifacts.graph_text(back.graph) == artifacts.graph_text(g)
    opts = Options.from_dict({"num_sms": 4})
    key = artifacts.artifact_key(g, opts)
    g.tensors["w_rows8"].offset = 32
    assert artifacts.artifact_key(g, opts) != key
