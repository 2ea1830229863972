"""The row-tiled matvec kinds of a batch step (docs/batch.md): at B > 1 the linears of a decode step
are ``matvec`` / ``matvec_residual`` ops of ``batch`` B (template ``matvec_seqs``: each weight row
loaded once for the B sequences), tiled over many SMs, instead of generic linears on one SM;
their simulated tiles equal eager per sequence; a batch-1 step renders as before; the batched
template compiles with NVRTC without spills at Llama-3.2-1B's widths."""
from __future__ import annotations

import re

import pytest
import torch

import hf_tiny
from test_batch_decode import batch_steps_against_eager
from fusec.instructions import KINDS
from fusec.instructions.prologue import xin
from fusec.ir import Op

#: the kinds that take a batch in this increment
BATCHED = ("matvec", "matvec_residual")


def _tiles_per_op(step) -> dict[str, int]:
    n: dict[str, int] = {}
    for ins in step.schedule.instrs:
        n[ins.op] = n.get(ins.op, 0) + 1
    return n


@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_batch_linears_are_batched_matvec_tiles(factory, batch, steps):
    """A batch of left-padded prompts, 4 decode steps through ``torch.compile(backend="fusec")``
    against eager (every sequence on its own), no fallback; every linear of the step is a batched
    op spread over many SMs, none a generic ``linear``: o_proj and down_proj with their residual
    add and the lm_head batched matvecs, q/k/v and gate/up the batched fused kinds
    (``rms_qkv_rope``, ``rms_gate_up_silu``: tests/test_batch_fused.py)."""
    model = factory()
    errs, w, _ = batch_steps_against_eager(model, batch, 100 + 10 * batch + (factory is hf_tiny.qwen3))
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert steps and not any(s.fallen_back for s in steps)
    cfg = model.config
    for s in steps:
        g = s.schedule.graph
        assert g.batch() == batch
        kinds = g.count_kinds()
        assert "linear" not in kinds and "aten.mm.default" not in kinds
        layers = cfg.num_hidden_layers
        # per layer: o_proj and down_proj take the residual add; q/k/v and gate/up fused; the lm_head
        assert kinds["matvec_residual"] == 2 * layers and kinds["matvec"] == 1
        assert kinds["rms_qkv_rope"] == kinds["rms_gate_up_silu"] == layers
        tiles = _tiles_per_op(s)
        for o in g.ops:
            if o.kind in ("rms_qkv_rope", "rms_gate_up_silu"):
                assert o.attrs["batch"] == batch and tiles[o.name] >= 8, (o.name, tiles[o.name])
            if o.kind in BATCHED:
                assert o.attrs["batch"] == batch
                # x, or the folded prologue's result (the norm before q/k/v and gate/up: B rows)
                assert g.tensors[xin(o)].numel == batch * g.tensors[o.inputs["w"]].shape[1]
                assert tiles[o.name] >= 16, (o.name, tiles[o.name])   # rows spread over SMs
        head = [o for o in g.ops if o.kind == "matvec" and g.tensors[o.inputs["w"]].shape[0] == cfg.vocab_size]
        assert len(head) == 1 and tiles[head[0].name] >= 64
        # the tile writes each sequence's rows of out [B, N]
        t = next(i.tile for i in s.schedule.instrs if i.op == head[0].name)
        assert len(t.writes) == batch


def test_batch_step_folds_prologues_into_the_batched_matvecs(steps):
    """OLMo-2's post-norm and residual add before its MLP fold into the op that reads them at
    batch 1; at B = 2 they fold too, into the batched matvecs and the batched ``rms_gate_up_silu``
    of its MLP (the prologue computes the B rows, each normed on its own: docs/batch.md): eager's
    logits, no fallback."""
    errs, w, _ = batch_steps_against_eager(hf_tiny.olmo2(), 2, 5, n=2)
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    for s in steps:
        g = s.schedule.graph
        pre = [o for o in g.ops if "pre" in o.attrs]
        assert pre and all(o.kind in ("matvec", "rms_gate_up_silu") and o.attrs.get("batch") == 2 for o in pre)
        assert any(o.kind == "matvec" for o in pre)


@pytest.mark.parametrize("factory", [hf_tiny.phi2, hf_tiny.falcon])
def test_batch_gelu_is_the_batched_up_projections_epilogue(factory, steps, tmp_path):
    """Phi-2's and Falcon's MLP GELU (gelu_new, exact GELU) becomes the epilogue (``act``) of the
    batched up projection at B = 2, as at batch 1 (fusec/instructions/activation.py): eager's
    logits per sequence, no fallback, no GELU op left; the batch kernel (``matvec_seqs`` with its
    ``ACT``) compiles with NVRTC without spills."""
    errs, w, _ = batch_steps_against_eager(factory(), 2, 9, n=2)
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    for s in steps:
        g = s.schedule.graph
        up = [o for o in g.ops if o.kind == "matvec" and "act" in o.attrs]
        assert len(up) == factory().config.num_hidden_layers and all(o.attrs["batch"] == 2 for o in up)
        assert "aten.gelu.default" not in g.count_kinds() and "aten.tanh.default" not in g.count_kinds()
    # the batched call passes ACT (3: gelu_new, 2: exact GELU); its functions compile without
    # spills or a stack frame (the kernel itself has a 32-byte stack frame at B = 2 for these two
    # families with every linear generic too: one of the generic ops, not matvec_seqs)
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    src = render(steps[-1].schedule).source
    act = 3 if factory is hf_tiny.phi2 else 2
    assert re.search(rf"matvec_seqs<[^()]*, 2, 2, (true|false), false, false, {act}(, (true|false))?>\(", src)   # MMA false: fp32
    res = compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path)).resources
    seqs = {f: r for f, r in res.items() if "matvec_seqs" in f}
    assert len(seqs) >= 2
    assert all(r["stack_frame_bytes"] == r["spill_store_bytes"] == r["spill_load_bytes"] == 0 for r in seqs.values())


#: the dispatch calls of batch-1 steps before batches (docs/batch.md: batch 1 renders as before)
BATCH1_CALLS = {
    (hf_tiny.llama, torch.bfloat16): ["matvec_residual<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 64>(",
                                      "matvec_residual<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 96>("],
    (hf_tiny.gemma2, torch.bfloat16): ["matvec<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 64, false>(",
                                       "matvec<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 96, false>("],
    (hf_tiny.phi2, torch.float32): ["matvec<float, float, float, float, 64, true, true, 3>(",
                                    "matvec<float, float, float, float, 64, true, true>(",
                                    "matvec<float, float, float, float, 64, true>(",
                                    "matvec<float, float, float, float, 96, true>("],
}


@pytest.mark.parametrize("factory,dtype", list(BATCH1_CALLS))
def test_batch1_step_renders_as_before(factory, dtype):
    """A batch-1 step's matvec ops carry no ``batch`` and render the calls they did before batches
    (the same template arguments: ``B``, ``N``, ``SG`` are not passed), and the kernel holds no
    batched definition (``matvec_seqs`` comes in only with a batched op)."""
    from fusec.cuda.codegen import render
    from test_codegen import _tiny_decode_step
    res = _tiny_decode_step(factory, dtype, 12)
    ops = [o for o in res.graph.ops if o.kind in BATCHED]
    assert ops and not any("batch" in o.attrs for o in ops)
    src = render(res.schedule).source
    assert "matvec_seqs" not in src
    calls = sorted({m.group(0) for m in re.finditer(r"\bmatvec(?:_residual)?<[^()]*>\(", src)})
    assert calls == sorted(BATCH1_CALLS[factory, dtype])


@pytest.mark.parametrize("kind", BATCHED)
def test_batched_call_matches_the_template(kind):
    """The batched variant's template arguments are ``matvec_seqs``'s parameters, in order (the
    batch-1 variant is checked by tests/test_kind_rules.py)."""
    from test_kind_rules import _template_params
    call = KINDS[kind].call
    probe = Op("o", kind, {}, {}, attrs={"batch": 4})
    assert call.fn(probe) == "matvec_seqs"
    params = _template_params("matvec_seqs", "matvec_seqs")
    targs = [a for a in call.targs if a.when is None or a.when(probe)]
    names = ["tx", "tw", "tb", "tr", "to", "K", "N", "B", "SG", "bias", "add_res", "mma"]
    assert [a.name for a in targs] == names + (["ACT", "staged"] if kind == "matvec" else [])
    assert len(params) == len(names) + 2   # ACT, C++ default 0; STAGED, default false
    for a, p in zip(targs, params):
        if a.default is not None:
            assert p.split("=")[1].strip() == str(a.default), (a.name, p)


#: Llama-3.2-1B's matvec widths as batched ops: (name, K, N, kind): q_proj (2048 -> 2048),
#: down_proj with its residual (8192 -> 2048), lm_head (2048 -> 128256)
LLAMA_1B_WIDTHS = (("q", 2048, 2048, "matvec"), ("down", 8192, 2048, "matvec_residual"),
                   ("head", 2048, 128256, "matvec"))


def width_graph(batch: int, dtype: torch.dtype, widths=LLAMA_1B_WIDTHS):
    """An IR graph of ``widths`` ((name, K, N, kind) each) as batched ops of ``batch`` sequences
    (no weights read): x [B, K] inputs, out [B, N] outputs (``matvec_residual``: with its residual
    [B, N]). (graph, flat inputs)"""
    from fusec.ir import Graph, Op, Role, TensorInfo
    g, flat = Graph(), []

    def inp(name, shape, role):
        g.add_tensor(TensorInfo(name, shape, dtype, role, input_index=len(flat)))
        flat.append(torch.empty(*shape, dtype=dtype))
    for name, k, n, kind in widths:
        ins = {"x": f"x_{name}", "w": f"w_{name}"}
        inp(ins["x"], (batch, k), Role.INPUT)
        inp(ins["w"], (n, k), Role.WEIGHT)
        if kind == "matvec_residual":
            ins["residual"] = f"r_{name}"
            inp(ins["residual"], (batch, n), Role.INPUT)
        g.add_tensor(TensorInfo(f"y_{name}", (batch, n), dtype, Role.OUTPUT))
        g.ops.append(Op(name, kind, ins, {"out": f"y_{name}"}, attrs={"batch": batch}))
    g.inputs = [t for t, info in g.tensors.items() if info.input_index is not None]
    g.outputs = [f"y_{name}" for name, *_ in widths]
    g.batch_size = batch
    return g, flat


#: SG of the down projection (K = 8192) per (B, dtype): the fewest groups of at most 128 KiB of
#: inputs (:func:`fusec.instructions.matvec_rows.seq_group`), SG = ceil(B / groups)
SG_DOWN = {(2, torch.bfloat16): 2, (4, torch.bfloat16): 4, (8, torch.bfloat16): 8, (11, torch.bfloat16): 6,
           (13, torch.bfloat16): 7, (16, torch.bfloat16): 8, (16, torch.float32): 4}


@pytest.mark.parametrize("batch,dtype", list(SG_DOWN))
def test_batched_matvec_compiles_without_spills_at_llama_1b_widths(batch, dtype, tmp_path):
    """``matvec_seqs`` at Llama-3.2-1B's widths (2048 -> 2048, 8192 -> 2048 with the residual,
    2048 -> 128256) for B sequences compiles with NVRTC for sm_90a without spills or a stack
    frame; its staged inputs fit shared memory (in groups of SG sequences where B of them do not:
    fp32 B = 16 at K = 8192 stages 4 at a time); bf16 inputs that do not fit at once (B = 11, 13,
    16 at K = 8192) are read from L2 on the tensor-core path (SG 0, only its partial sums in shared
    memory), so the weights stream once."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.config import Options
    from fusec.cuda.codegen import MAX_SMEM_BYTES, render
    from fusec.cuda.jit import compile_cuda
    from fusec.instructions.matvec_rows import STAGE_BYTES, global_x, mma_smem, seq_group
    from fusec.pipeline import Dumper, lower
    g, flat = width_graph(batch, dtype)
    sched = lower(g, flat, Options.from_dict({"num_sms": 132}), Dumper(None))
    ops = sched.graph.op_by_name()
    elt = dtype.itemsize
    gx = dtype != torch.float32 and SG_DOWN[batch, dtype] < batch   # bf16 inputs that do not fit: from L2
    for name, k in (("q", 2048), ("down", 8192), ("head", 2048)):
        cls = KINDS[ops[name].kind]
        sg = SG_DOWN[batch, dtype] if name == "down" else batch
        assert seq_group(batch, k, elt) == sg
        floats = cls.smem_floats(ops[name], sched.graph)
        if name == "down" and gx:   # only the tensor-core path's partial sums (global_x)
            assert global_x(ops[name], sched.graph) and floats == mma_smem(ops[name], sched.graph)
        else:
            assert 4 * floats == sg * k * elt <= STAGE_BYTES
    src = render(sched).source
    calls = re.findall(r"matvec_seqs<[^()]*>\(", src)
    assert len(calls) == 3
    t = "__nv_bfloat16" if dtype == torch.bfloat16 else "float"
    mma = "false" if dtype == torch.float32 else "true"   # bf16: the tensor-core path (tests/test_batch_mma.py)
    sg_arg = 0 if gx else SG_DOWN[batch, dtype]
    assert f"matvec_seqs<{', '.join([t] * 5)}, 8192, 2048, {batch}, {sg_arg}, false, true, {mma}>(" in calls
    kernel = compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path))
    kernel.assert_no_spills()
    assert any("matvec_seqs" in f for f in kernel.resources)
    assert 4 * max(KINDS[o.kind].smem_floats(o, sched.graph) for o in sched.graph.ops) <= MAX_SMEM_BYTES


def test_staged_groups_are_the_fewest_that_fit():
    """The weights of a batched matvec are swept once per staged group: ceil(B * K * elt / 128 KiB)
    times where one input is a whole fraction of the budget (B = 9..16 at K = 8192 bf16: twice,
    where the largest divisor of B that fits made B = 11 and 13 sweep 11 and 13 times, B = 9
    three); fp32 K = 8192 (32 KiB each) at B = 5, 7: twice. The groups cover the batch in order,
    each fits the budget and none is larger than the first; inputs that cannot be staged (not a
    whole number of 16-byte chunks, or one larger than the budget) give 0 (the rule refuses)."""
    import math
    from fusec.instructions.matvec_rows import STAGE_BYTES, seq_group
    for batch in range(9, 17):
        sg = seq_group(batch, 8192, 2)
        assert math.ceil(batch / sg) == math.ceil(batch * 16384 / STAGE_BYTES) == 2, (batch, sg)
    for batch in (5, 7):
        assert math.ceil(batch / seq_group(batch, 8192, 4)) == 2
    from fusec.instructions.matvec_rows import seq_ranges
    for batch, k, e in [(b, k, e) for b in range(2, 17) for k in (64, 2048, 8192, 14336) for e in (2, 4)]:
        ranges = seq_ranges(batch, k, e)
        fit = STAGE_BYTES // (k * e)
        assert len(ranges) == math.ceil(batch / fit), (batch, k, e, ranges)
        assert [s for r in ranges for s in range(*r)] == list(range(batch))
        assert all((s1 - s0) * k * e <= STAGE_BYTES and s1 - s0 <= ranges[0][1] for s0, s1 in ranges)
    assert seq_group(2, 8196, 2) == 0 and seq_group(3, 62, 4) == 0   # 16392 and 248 bytes
    assert seq_group(2, STAGE_BYTES // 2 + 8, 2) == 0


@pytest.mark.parametrize("batch", [5, 7])
def test_batch_staged_in_groups_with_a_remainder_matches_eager(batch, steps, monkeypatch, tmp_path):
    """Tiny Llama (fp32) at B = 5 and 7 with the staging budget cut to 1152 bytes (three inputs
    of the down projection's 96, four of the others' 64): every batched matvec stages its inputs
    in the fewest groups that fit, the last one the rest (B = 5: 3 + 2; B = 7: 3 + 3 + 1 and 4 +
    3); the simulated steps equal eager per sequence, no fallback; the batch kernel (its
    ``matvec_seqs`` calls with that SG, the tail group's instantiation) compiles with NVRTC
    without spills."""
    import math
    from fusec.instructions import matvec_rows
    monkeypatch.setattr(matvec_rows, "STAGE_BYTES", 1152)
    errs, w, _ = batch_steps_against_eager(hf_tiny.llama(layers=2), batch, 70 + batch, n=2)
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert steps and not any(s.fallen_back for s in steps)
    g = steps[-1].schedule.graph
    ops = [o for o in g.ops if o.kind in BATCHED]
    assert len(ops) == 7 * 2 + 1
    sgs = set()
    for o in ops:
        k = g.tensors[o.inputs["w"]].shape[1]
        sg = matvec_rows.seq_group(batch, k, 4)
        assert math.ceil(batch / sg) == math.ceil(batch / (1152 // (k * 4))) > 1, (o.name, k, sg)
        assert 4 * KINDS[o.kind].smem_floats(o, g) == sg * k * 4 <= 1152
        sgs.add((k, sg))
    assert any(batch % sg for _, sg in sgs)   # a remainder group
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    src = render(steps[-1].schedule).source
    for k, sg in sgs:
        assert re.search(rf"matvec_seqs<[^()]*, {k}, \d+, {batch}, {sg}, ", src), (k, sg)
    kernel = compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path))
    seqs = {f: r for f, r in kernel.resources.items() if "matvec_seqs" in f}
    assert seqs and all(r["stack_frame_bytes"] == r["spill_store_bytes"] == r["spill_load_bytes"] == 0
                        for r in seqs.values()), seqs


def test_inputs_that_cannot_be_staged_stay_generic(steps):
    """A linear whose input rows are not whole 16-byte chunks (tiny Llama with a hidden size of
    62 in fp32: 248 bytes; two heads of 16) is left generic by the batched rule at B = 2
    (``matvec_seqs`` could not stage a later group of them aligned), where it used to become a
    batched op; the linears over 32 and 96 inputs (o_proj, down_proj) are batched; eager's logits,
    no fallback."""
    model = hf_tiny.llama(hidden=62, heads=2, kv_heads=1)
    errs, w, _ = batch_steps_against_eager(model, 2, 9, n=2)
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    g = steps[-1].schedule.graph
    layers = model.config.num_hidden_layers
    assert g.count_kinds()["linear"] == 5 * layers + 1   # q, k, v, gate, up; the lm_head
    assert all(g.tensors[o.inputs["w"]].shape[1] == 62 for o in g.ops if o.kind == "linear")
    batched = [o for o in g.ops if o.kind in BATCHED]
    assert len(batched) == 2 * layers and all(o.attrs["batch"] == 2 for o in batched)
