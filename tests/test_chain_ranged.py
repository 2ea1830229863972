"""Ranged chains (passes/chain.py, fusec/instructions/chain.py): dependent elementwise ops split
into output ranges run as one ``chain`` of the same ranges, tile i running every member over
range i. The rule on hand-made graphs; HF's written-out tanh-GELU (gelu_new, over a vector no
matvec makes: in Phi-2 it is the up projection's epilogue) and Gemma-2's final logit softcap as
one level each; their values against PyTorch and Gemma-2's decode against eager on the
simulator; the kernel through NVRTC.
The GPU runs them in tests/test_range_tiles.py's GPU test and every Phi-2 / Gemma-2 family test."""
from __future__ import annotations

import pytest
import torch

from fusec.instructions.generic import RANGE_CHUNK, ranged as ranged_op
from fusec.ir import Graph, Op, Ref, Role, TensorInfo
from fusec.ir.semantics import execute

N = 4 * RANGE_CHUNK


def _op(name: str, kind: str, ins: list[str], dst: str) -> Op:
    target = getattr(torch.ops.aten, kind.split(".")[1]).__getattr__(kind.split(".")[2])
    return Op(name, kind, {f"in{k}": t for k, t in enumerate(ins)}, {"out": dst},
              attrs={"target": target, "args": tuple(Ref(f"in{k}") for k in range(len(ins))), "kwargs": {}})


def _graph(slice_reader: bool) -> Graph:
    """x [N] -> neg (a) -> y -> sigmoid (b) -> z, then c = z * (z or z's first half, broadcast
    over two rows when ``slice_reader``) -> w; fp32."""
    g = Graph()
    g.add_tensor(TensorInfo("x", (N,), torch.float32, Role.INPUT, input_index=0))
    for t in ("y", "z"):
        g.add_tensor(TensorInfo(t, (N,), torch.float32, Role.INTERMEDIATE))
    g.add_tensor(TensorInfo("w", (2, N // 2) if slice_reader else (N,), torch.float32, Role.OUTPUT))
    ops = [_op("a", "aten.neg.default", ["x"], "y"), _op("b", "aten.sigmoid.default", ["y"], "z")]
    if slice_reader:
        g.add_tensor(TensorInfo("z2", (2, N // 2), torch.float32, Role.INTERMEDIATE, alias_of="z"))
        g.add_tensor(TensorInfo("zh", (1, N // 2), torch.float32, Role.INTERMEDIATE, alias_of="z", offset=0))
        ops.append(_op("c", "aten.mul.Tensor", ["z2", "zh"], "w"))
    else:
        ops.append(_op("c", "aten.mul.Tensor", ["z", "z"], "w"))
    g.inputs, g.outputs, g.ops = ["x"], ["w"], ops
    return g


def test_dependent_ranged_ops_become_one_ranged_chain_with_the_same_values():
    from fusec.instructions.chain import Chain
    from fusec.passes import chain
    g = _graph(slice_reader=False)
    x = torch.randn(N, generator=torch.Generator().manual_seed(0))
    (want,) = execute(g.copy(), [x])
    g = chain.run(g)
    g.check("chain")
    (op,) = g.ops
    assert op.kind == "chain" and op.attrs["ranged"] == N and op.attrs["steps"] == "neg > sigmoid > mul"
    (got,) = execute(g, [x])
    assert torch.equal(got, want)
    tiles = Chain.tiles(op, g, 16)
    assert [t.params["rows"] for t in tiles] == [(i * RANGE_CHUNK, (i + 1) * RANGE_CHUNK) for i in range(4)]
    for t in tiles:   # reads x's range only (y, z are the chain's own), writes every member's range
        lo, hi = t.params["rows"]
        assert [(r.tensor, r.start, r.stop) for r in t.reads] == [("x", lo, hi)]
        assert sorted((r.tensor, r.start, r.stop) for r in t.writes) == [(n, lo, hi) for n in ("w", "y", "z")]


def test_a_member_that_reads_another_range_stays_out():
    """``c`` reads z's first half broadcast over both rows: its tile 3 would read what tile 0
    writes, so ``c`` runs as its own ranged op after the chain of a and b."""
    from fusec.passes import chain
    g = _graph(slice_reader=True)
    x = torch.randn(N, generator=torch.Generator().manual_seed(1))
    (want,) = execute(g.copy(), [x])
    g = chain.run(g)
    g.check("chain")
    assert [o.kind for o in g.ops] == ["chain", "aten.mul.Tensor"]
    assert [m.name for m in g.ops[0].attrs["ops"]] == ["a", "b"]
    (got,) = execute(g, [x])
    assert torch.equal(got, want)


class _GeluNew(torch.nn.Module):
    """HF's NewGELUActivation (gelu_new written out as eight ops: Phi-2's, GPT-2's) over an input
    vector of N elements. In Phi-2 it reads the MLP's up projection and is that matvec's
    epilogue (fusec/instructions/activation.py, tests/test_mlp_folds.py); over a vector no
    matvec makes it stays eight ranged ops, one ranged chain."""

    def __init__(self):
        super().__init__()
        from transformers.activations import NewGELUActivation
        self.act = NewGELUActivation()

    def forward(self, x):
        return self.act(x)


def _lowered_gelu_new(num_sms=16):
    """(aten graph module, flat inputs, schedule) of :class:`_GeluNew` on a random [1, N] fp32."""
    from test_matvec_cols import _lowered
    x = torch.randn(1, N, generator=torch.Generator().manual_seed(4))
    return _lowered(_GeluNew().eval(), x, num_sms=num_sms)


GELU_NEW_STEPS = "mul > pow > mul > add > mul > tanh > add > mul"


def test_gelu_new_runs_as_one_ranged_chain_with_the_same_values():
    """Lowered at 16 SMs: the eight ops are one ranged chain of 4 tiles, none left standing, and
    the simulated step equals PyTorch's (fp32, relative error <= 1e-6)."""
    import step_util
    from fusec.sim import Simulator
    aten_gm, flat, low = _lowered_gelu_new()
    ranged = [o for o in low.graph.ops if o.kind == "chain" and o.attrs.get("ranged")]
    assert [o.attrs["steps"] for o in ranged] == [GELU_NEW_STEPS]
    assert not any(ranged_op(o, low.graph) for o in low.graph.ops)
    assert sum(i.op == ranged[0].name for i in low.instrs) == N // RANGE_CHUNK
    with torch.no_grad():
        ref = aten_gm(*flat)
        got = Simulator(low).step(list(flat))
    for a, b in zip(got, ref):
        assert step_util.rel(a.reshape(b.shape).float(), b.float()) <= 1e-6


def _gemma2():
    from test_range_tiles import _gemma2 as gemma2
    return gemma2()


@pytest.mark.parametrize("name,factory,steps", [
    ("gemma2", _gemma2, "div > tanh > mul"),
])
def test_families_run_their_elementwise_sequences_as_one_level(name, factory, steps):
    """Lowered at 16 SMs: the sequence is one ranged chain of 4 tiles (no member left standing),
    and decode through torch.compile after prefills of 3 and 11 tokens equals eager (fp32,
    relative error <= 1e-4, hazard check on), no fallback."""
    import step_util
    model = factory()
    low = step_util.lowered(model, num_sms=16)
    ranged = [o for o in low.graph.ops if o.kind == "chain" and o.attrs.get("ranged")]
    assert any(o.attrs["steps"] == steps for o in ranged), [o.attrs["steps"] for o in ranged]
    assert not any(ranged_op(o, low.graph) for o in low.graph.ops)   # no range-split op stands alone
    assert all(sum(i.op == o.name for i in low.instrs) == min(16, o.attrs["ranged"] // RANGE_CHUNK)
               for o in ranged)
    errs, w = step_util.prompts_against_eager(model, {"num_sms": 16}, (3, 11), cache_len=32, seed=6)
    assert max(errs.values()) <= 1e-4, (name, errs)
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks


def test_ranged_chain_kernel_passes_the_range_to_every_member_and_compiles(tmp_path):
    """The gelu_new chain's case calls its eight generated functions with the instruction word's
    range (``in.p0, in.p1``) between barriers; the kernel compiles with NVRTC for sm_90a."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    _, _, low = _lowered_gelu_new()
    src = render(low).source
    calls = [line for line in src.split("\n") if "in.p0, in.p1); __syncthreads();" in line]
    assert calls and max(line.count("in.p0, in.p1)") for line in calls) == 8, calls
    compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path)).assert_no_spills()
