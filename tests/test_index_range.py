"""Run-time indices are checked as eager PyTorch checks them (issue 30, item 3).

Eager ``aten.embedding`` raises IndexError for a token id outside ``[0, vocab)``, a negative one
included; ``aten.index`` counts a negative index from the end (down to ``-n``); ``index_select``
and ``gather`` take ``[0, n)`` only. The simulator raises :class:`fusec.errors.IndexFaultError`
(code, value and bound, as the kernel records them) where eager raises, for the fused
``embedding`` kind and for the generic ops alike; the generated CUDA forms reject the same
indices (``index_ok``, which records the fault and skips the access).
"""
from __future__ import annotations

import ctypes

import pytest
import torch

import hf_tiny
from fusec.errors import IndexFaultError
from fusec.fallbacks import FallbackWatch
from fusec.ir import Graph, Op, Ref, Role, TensorInfo
from fusec.passes import schedule, tile
from fusec.sim import Simulator

A = torch.ops.aten
V, H = 10, 4


def _graph(kind: str, x_shape, idx_shape, out_shape, args, idx_dtype=torch.int64) -> Graph:
    """One op reading ``x`` (a weight) and ``idx`` (an input) into ``y``."""
    g = Graph()
    g.add_tensor(TensorInfo("x", tuple(x_shape), torch.float32, Role.WEIGHT, input_index=0))
    g.add_tensor(TensorInfo("idx", tuple(idx_shape), idx_dtype, Role.INPUT, input_index=1))
    g.add_tensor(TensorInfo("y", tuple(out_shape), torch.float32, Role.OUTPUT))
    g.inputs, g.outputs = ["x", "idx"], ["y"]
    if kind == "embedding":   # the fused kind
        g.ops = [Op("emb", "embedding", {"table": "x", "ids": "idx"}, {"out": "y"})]
    else:
        base = kind.removeprefix("aten.")
        target = getattr(A, base).default if base != "index" else A.index.Tensor
        g.ops = [Op("op", str(target), {"in0": "x", "in1": "idx"}, {"out": "y"},
                    attrs={"target": target, "args": args, "kwargs": {}})]
    return g


def _simulate(g: Graph, flat):
    s = schedule.run(g, tile.run(g, 2), 2)
    return Simulator(s, seed=0).step(flat)[0]


X = torch.arange(V * H, dtype=torch.float32).reshape(V, H)
#: (op, ATen args with the index tensor as Ref("in1"), index shape, eager call)
CASES = {
    "embedding": ((Ref("in0"), Ref("in1")), (1,), lambda i: A.embedding.default(X, i)),
    "aten.embedding": ((Ref("in0"), Ref("in1")), (1,), lambda i: A.embedding.default(X, i)),
    "index": ((Ref("in0"), [Ref("in1")]), (1,), lambda i: A.index.Tensor(X, [i])),
    "index_select": ((Ref("in0"), 0, Ref("in1")), (1,), lambda i: A.index_select.default(X, 0, i)),
    "gather": ((Ref("in0"), 0, Ref("in1")), (1, H), lambda i: A.gather.default(X, 0, i)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("value", [3, 0, V - 1, -1, -V, -V - 1, V, V + 7])
def test_gather_index_range_matches_eager(case, value):
    """Same values where eager succeeds; IndexFaultError naming the index and the bound where
    eager raises (before the fix the fused embedding returned row V-1 for id -1, and the
    generic ops raised PyTorch's own error)."""
    args, ishape, eager = CASES[case]
    idx = torch.full(ishape, value, dtype=torch.int64)
    try:
        want = eager(idx)
    except (IndexError, RuntimeError):
        want = None
    g = _graph(case, X.shape, ishape, (1, H), args)
    if want is not None:
        torch.testing.assert_close(_simulate(g, [X, idx]), want, rtol=0, atol=0)
        return
    with pytest.raises(IndexFaultError) as e:
        _simulate(g, [X, idx])
    assert (e.value.value, e.value.bound) == (value, V)
    assert e.value.code == (1 if "embedding" in case else 2)
    assert str(value) in str(e.value) and str(V) in str(e.value)


@pytest.mark.parametrize("max_fusions", [None, 0], ids=["fused", "unfused"])
def test_negative_token_id_under_torch_compile_raises_and_writes_no_cache_row(max_fusions):
    """A tiny HF Llama on the simulator: a token id of -1 raises IndexFaultError, an IndexError
    as eager raises (code that catches eager's error catches fusec's), and no KV-cache row is
    written (before: vocab-1's logits, its K/V row in the cache)."""
    model = hf_tiny.llama(layers=1)
    cache = hf_tiny.static_cache(model, 16)
    opts = {"target": "sim", "num_sms": 4}
    if max_fusions is not None:
        opts["max_fusions"] = max_fusions
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options=opts, fullgraph=True)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
        with pytest.raises(IndexError):
            model(input_ids=torch.tensor([[-1]]), past_key_values=cache, use_cache=True)
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        with pytest.raises(IndexFaultError) as e:
            compiled(input_ids=torch.tensor([[-1]]), past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    assert (e.value.code, e.value.value, e.value.bound) == (1, -1, model.config.vocab_size)
    assert isinstance(e.value, IndexError)
    for (k, v), layer in zip(kv, cache.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)


def test_a_position_past_the_position_tables_names_option_position_rows():
    """``position_ids`` past the cache's rows (the cache position inside them): eager computes
    RoPE at any position and does not raise; fusec's RoPE tables cover the cache's rows, so
    the step raises IndexFaultError naming option ``position_rows`` (it claimed "eager PyTorch
    raises IndexError"), and with that option the step gives eager's logits."""
    model = hf_tiny.llama(layers=1)
    caches = [hf_tiny.static_cache(model, 16) for _ in range(3)]
    tok, pos, cp = torch.tensor([[5]]), torch.tensor([[40]]), torch.tensor([3])
    with torch.no_grad():
        for c in caches:
            model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=c, use_cache=True)
        ref = model(input_ids=tok, past_key_values=caches[0], position_ids=pos, cache_position=cp).logits
        for rows in (None, 41):
            torch._dynamo.reset()
            opts = {"target": "sim", "num_sms": 4, **({"position_rows": rows} if rows else {})}
            compiled = torch.compile(model, backend="fusec", options=opts, fullgraph=True)
            with FallbackWatch() as w:
                if rows is None:
                    with pytest.raises(IndexFaultError) as e:
                        compiled(input_ids=tok, past_key_values=caches[1], position_ids=pos, cache_position=cp)
                else:
                    out = compiled(input_ids=tok, past_key_values=caches[2], position_ids=pos, cache_position=cp)
            assert not w.fallbacks, w.fallbacks
    torch._dynamo.reset()
    assert (e.value.code, e.value.value, e.value.bound) == (3, 40, 16)
    assert "position_rows=41" in str(e.value) and "raises IndexError" not in str(e.value), str(e.value)
    assert ((out.logits - ref).norm() / ref.norm()).item() < 1e-4


def test_out_of_range_token_id_in_a_batch_row_raises():
    """A batch of 3 sequences whose third token id is the vocabulary size: IndexFaultError naming
    it (the embedding kind gathers each row's token in a tile of its own and checks each), as
    eager raises IndexError; a batch of valid ids then runs."""
    model = hf_tiny.llama(layers=1)
    cache = hf_tiny.static_cache(model, 16)
    v = model.config.vocab_size
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 4})
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2], [3, 4], [5, 6]]), past_key_values=cache, use_cache=True)
        with pytest.raises(IndexError):
            model(input_ids=torch.tensor([[1], [2], [v]]), past_key_values=cache, use_cache=True,
                  cache_position=torch.tensor([2]))
        with pytest.raises(IndexFaultError) as e:
            compiled(input_ids=torch.tensor([[1], [2], [v]]), past_key_values=cache, use_cache=True,
                     cache_position=torch.tensor([2]))
        out = compiled(input_ids=torch.tensor([[1], [2], [3]]), past_key_values=cache, use_cache=True,
                       cache_position=torch.tensor([2]))
    torch._dynamo.reset()
    assert (e.value.code, e.value.value, e.value.bound) == (1, v, v)
    assert out.logits.shape == (3, 1, v) and torch.isfinite(out.logits).all()


# ---- the generated CUDA forms (run on the host; compiled with NVRTC) ----

def _host_run(g: Graph, flat, tmp_path):
    """Run the op's generated function on the host: (output, gx_fault words)."""
    from fusec.cuda.codegen import Buffers
    from fusec.cuda.gen import generate
    from gen_host import build
    gen = generate(g.ops[0], g, Buffers(g))
    lib = build([gen], tmp_path)
    bufs = {"x": flat[0].clone(), "idx": flat[1].clone(),
            "y": torch.full(g.tensors["y"].shape, float("nan"))}
    tensors = [bufs[r] for r in gen["roots"]]
    arr = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    lib.gx_run_0(arr)
    return bufs["y"], list((ctypes.c_longlong * 4).in_dll(lib, "gx_fault"))


@pytest.mark.parametrize("case", ["aten.embedding", "index", "index_select", "gather"])
def test_generated_cuda_rejects_what_eager_rejects(case, tmp_path):
    """A negative index of index_select and gather is a fault (code 2) and gives zeros, as of
    embedding (code 1); aten.index counts it from the end (before, the CUDA forms of
    index_select and gather wrapped -1 to the last row, where eager raises)."""
    from gen_host import compiler
    if compiler() is None:
        pytest.skip("needs a host C++ compiler")
    args, ishape, eager = CASES[case]
    idx = torch.full(ishape, -1, dtype=torch.int64)
    g = _graph(case, X.shape, ishape, (1, H), args)
    y, fault = _host_run(g, [X, idx], tmp_path)
    if case == "index":
        assert fault[0] == 0
        torch.testing.assert_close(y, eager(idx))
    else:
        assert fault == [1, 1 if case == "aten.embedding" else 2, -1, V]
        assert torch.equal(y, torch.zeros(1, H))


def test_gather_kernel_compiles_with_nvrtc():
    """The four gathers with their index checks, scheduled as generic instructions into one
    megakernel: NVRTC compiles it for sm_90a without warnings."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    g = Graph()
    g.add_tensor(TensorInfo("x", (V, H), torch.float32, Role.WEIGHT, input_index=0))
    g.add_tensor(TensorInfo("idx", (1,), torch.int64, Role.INPUT, input_index=1))
    g.add_tensor(TensorInfo("i2", (1, H), torch.int64, Role.INPUT, input_index=2))
    g.inputs = ["x", "idx", "i2"]
    specs = [("embedding", A.embedding.default, (Ref("in0"), Ref("in1")), "idx"),
             ("index", A.index.Tensor, (Ref("in0"), [Ref("in1")]), "idx"),
             ("index_select", A.index_select.default, (Ref("in0"), 0, Ref("in1")), "idx"),
             ("gather", A.gather.default, (Ref("in0"), 0, Ref("in1")), "i2")]
    for k, (name, target, args, ix) in enumerate(specs):
        g.add_tensor(TensorInfo(f"y{k}", (1, H), torch.float32, Role.OUTPUT))
        g.ops.append(Op(f"op{k}", str(target), {"in0": "x", "in1": ix}, {"out": f"y{k}"},
                        attrs={"target": target, "args": args, "kwargs": {}}))
    g.outputs = [f"y{k}" for k in range(len(specs))]
    plan = render(schedule.run(g, tile.run(g, 4), 4))
    assert plan.source.count("index_ok(") >= 4
    k = compile_cuda(plan.source, "fusec_step.cu")
    assert "warning" not in k.log, k.log


@pytest.mark.parametrize("options", [{"target": "sim", "num_sms": 4}, {}], ids=["4-sms", "default"])
def test_a_step_past_a_full_cache_says_the_cache_is_full(options):
    """A decode step at the position after a 12-row cache's last row (the cache is full; eager
    raises IndexError writing that row): IndexFaultError says so and names a longer cache (it
    advised option ``position_rows``, with which the step then faulted at the KV write), whichever
    index faults first (the position table's, or with the default options the fused
    ``rms_qkv_rope``'s RoPE position)."""
    model = hf_tiny.llama(layers=1)
    caches = [hf_tiny.static_cache(model, 12) for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            model(input_ids=torch.arange(1, 12).view(1, 11), past_key_values=c, use_cache=True)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusec", options=options)
        compiled(input_ids=torch.tensor([[3]]), past_key_values=caches[0])   # row 11, the last
        with pytest.raises(IndexFaultError) as e:
            compiled(input_ids=torch.tensor([[4]]), past_key_values=caches[0])
        model(input_ids=torch.tensor([[3]]), past_key_values=caches[1])
        with pytest.raises(IndexError):
            model(input_ids=torch.tensor([[4]]), past_key_values=caches[1])
    torch._dynamo.reset()
    assert e.value.value == e.value.bound == 12, (e.value.value, e.value.bound)
    assert "12 rows is full" in str(e.value) and "max_cache_len" in str(e.value), str(e.value)
