"""Small dependent standalone ops run as one ``chain`` instruction (passes/chain.py,
fusec/instructions/chain.py): the rule on hand-made graphs, the levels it removes from
published-shape families, their decode against eager on the simulator, the kernel through
NVRTC. The GPU runs chains in every family test (tests/test_gpu_families.py) and below."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
import step_util
from fusec.fallbacks import FallbackWatch
from fusec.ir import Graph, Op, Ref, Role, TensorInfo
from fusec.ir.semantics import execute


def _depth(g: Graph) -> int:
    """Dependency levels of ``g``: the longest path over RAW, WAR and WAW dependencies by
    root buffer (what the schedule's counters wait on), one per op."""
    last_write: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    depth: list[int] = []
    for op in g.ops:
        reads = {g.root(t) for t in op.reads()}
        writes = {g.root(t) for t in op.writes()}
        deps = [last_write[r] for r in reads | writes if r in last_write]
        deps += [x for r in writes for x in readers.get(r, ())]
        depth.append(1 + max((depth[d] for d in deps), default=0))
        for r in reads:
            readers.setdefault(r, []).append(len(depth) - 1)
        for r in writes:
            last_write[r], readers[r] = len(depth) - 1, []
    return max(depth)


def _unary(name: str, kind: str, src: str, dst: str) -> Op:
    target = getattr(torch.ops.aten, kind.split(".")[1]).default
    return Op(name, kind, {"in0": src}, {"out": dst},
              attrs={"target": target, "args": (Ref("in0"),), "kwargs": {}})


def _graph(mid_reader: bool) -> Graph:
    """x -> neg (a) -> [exp of a's output (c), if ``mid_reader``] -> sigmoid (b); fp32[64]."""
    g = Graph()
    g.add_tensor(TensorInfo("x", (64,), torch.float32, Role.INPUT, input_index=0))
    for t in ("y", "z", "w"):
        g.add_tensor(TensorInfo(t, (64,), torch.float32, Role.OUTPUT if t != "y" else Role.INTERMEDIATE))
    g.inputs = ["x"]
    g.ops = [_unary("a", "aten.neg.default", "x", "y")]
    if mid_reader:
        g.ops.append(_unary("c", "aten.exp.default", "y", "w"))
    g.ops.append(_unary("b", "aten.sigmoid.default", "y", "z"))
    g.outputs = ["z", "w"] if mid_reader else ["z"]
    if not mid_reader:
        del g.tensors["w"]
    return g


def test_dependent_ops_become_one_chain_with_the_same_values():
    from fusec.passes import chain
    g = _graph(mid_reader=False)
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    (want,) = execute(g.copy(), [x])
    g = chain.run(g)
    g.check("chain")
    assert [o.kind for o in g.ops] == ["chain"]
    assert [m.name for m in g.ops[0].attrs["ops"]] == ["a", "b"] and g.ops[0].attrs["steps"] == "neg > sigmoid"
    (got,) = execute(g, [x])
    assert torch.equal(got, want)


def test_a_reader_between_keeps_the_ops_apart():
    """``c`` reads ``a``'s output between ``a`` and ``b``: moving ``a`` to ``b``'s place would
    run ``c`` before its input exists; ``c`` itself joins ``a`` (its only dependency), and
    ``b`` then has the chain (a, c) as its deepest dependency but ``a``'s output is read by
    nothing between, so the three run as one chain in order a, c, b."""
    from fusec.passes import chain
    g = chain.run(_graph(mid_reader=True))
    g.check("chain")
    (op,) = g.ops
    assert [m.name for m in op.attrs["ops"]] == ["a", "c", "b"]


def test_two_dependencies_at_the_same_depth_start_no_chain():
    """``d = a_out + c_out`` with ``a`` and ``c`` both at depth 1: joining either would delay
    the other's readers, so ``d`` stands alone (and ``a``, ``c`` have nothing to join)."""
    from fusec.passes import chain
    g = Graph()
    g.add_tensor(TensorInfo("x", (64,), torch.float32, Role.INPUT, input_index=0))
    for t in ("y", "w", "z"):
        g.add_tensor(TensorInfo(t, (64,), torch.float32, Role.OUTPUT if t == "z" else Role.INTERMEDIATE))
    g.inputs, g.outputs = ["x"], ["z"]
    g.ops = [_unary("a", "aten.neg.default", "x", "y"), _unary("c", "aten.exp.default", "x", "w"),
             Op("d", "aten.add.Tensor", {"in0": "y", "in1": "w"}, {"out": "z"},
                attrs={"target": torch.ops.aten.add.Tensor, "args": (Ref("in0"), Ref("in1")), "kwargs": {}})]
    assert [o.kind for o in chain.run(g).ops] == ["aten.neg.default", "aten.exp.default", "aten.add.Tensor"]


def _olmo2_layers(chain: bool):
    """The lowered bf16 OLMo-2 of 2 layers, its post-norm chains left standing (``prologue``
    off: tests/test_prologue.py folds them)."""
    return step_util.lowered(hf_tiny.olmo2().to(torch.bfloat16), chain=chain, prologue=False)


def test_olmo2_post_norm_add_are_chains():
    """OLMo-2 (post-norms; its q/k norms over the whole projection, RoPE in fp32 and KV writes
    are ``rms_qkv_rope``, tests/test_olmo_rope.py): per layer each post-norm with its residual
    add is one chain; the step is 2 levels per layer shallower."""
    on, off = _olmo2_layers(True), _olmo2_layers(False)
    steps = [o.attrs["steps"] for o in on.graph.ops if o.kind == "chain"]
    assert steps == ["rmsnorm > add"] * 4, steps
    assert not any(o.kind == "chain" for o in off.graph.ops)
    assert _depth(on.graph) <= _depth(off.graph) - 2 * 2, (_depth(on.graph), _depth(off.graph))
    assert len(on.instrs) < len(off.instrs)


@pytest.mark.parametrize("factory", [hf_tiny.olmo2, hf_tiny.gemma2, hf_tiny.gemma3])
def test_chained_families_decode_like_eager(factory):
    """Eight decode steps through ``torch.compile(backend="fusec")`` (default options: chains
    on; the simulator checks hazards every step) against eager: relative logits error below
    1e-4, no fallback, chains in the step."""
    from transformers import StaticCache
    model = factory()
    gen = torch.Generator().manual_seed(5)
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    p = torch.randint(0, 128, (1, 4), generator=gen)
    with torch.no_grad():
        for c in caches:
            model(input_ids=p, past_key_values=c, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 16})
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(8):
            tok = torch.randint(0, 128, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            assert 0 < step_util.rel(a, b) < 1e-4
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks


def test_chain_kernel_calls_members_between_barriers_and_compiles():
    """The chain's dispatch case calls its members in order with a CTA barrier between them;
    the kernel compiles with NVRTC for sm_90a."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    s = _olmo2_layers(True)
    plan = render(s)
    cases = [line for line in plan.source.splitlines() if "__syncthreads(); gx_" in line]
    assert cases and all(line.count("__syncthreads()") >= 1 for line in cases)
    compile_cuda(plan.source, "fusec_step.cu")
