"""The rest of a batch-B decode layer across the SMs (docs/batch.md, issue 32).

At B > 1 the RMSNorms before q/k/v and gate/up are the batched fused kinds' own
(tests/test_batch_fused.py), the final norm the batched lm_head matvec's prologue; a norm in
front of a batched matvec folds into it as its prologue (``passes/prologue.py``: each tile
computes the B normed rows in its shared memory, each row with its own sum of squares, and the
template ``matvec_seqs`` with ``STAGED`` skips its staging), instead of one generic op on one SM. Checked against eager per
sequence through ``torch.compile(model, backend="fusec")`` with default options, no fallback,
and by NVRTC compiles of the batch kernel at Llama-3.2-1B's widths without spills."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import hf_tiny
from test_batch_decode import batch_steps_against_eager
from fusec.instructions.prologue import xin

_spec = importlib.util.spec_from_file_location("layer_ops", Path(__file__).resolve().parent.parent / "tools" / "layer_ops.py")
layer_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layer_ops)


def _normed_matvecs(g) -> list:
    """The batched matvec ops whose folded prologue ends in an RMSNorm."""
    return [o for o in g.ops if o.kind == "matvec" and o.attrs.get("batch", 1) > 1
            and o.attrs.get("pre") and o.attrs["pre"][-1].kind == "rmsnorm"]


@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_batch_norms_are_in_the_fused_kinds_and_the_lm_head_prologue(factory, batch, steps):
    """A batch of left-padded prompts, 4 decode steps through ``torch.compile(backend="fusec")``
    (default options) against eager, every sequence on its own (< 1e-5 fp32), no fallback; no
    RMSNorm of the hidden state is left as an op of its own: each layer's two norms are the
    batched fused kinds' own (``rms_qkv_rope``, ``rms_gate_up_silu``: each tile norms the B rows,
    tests/test_batch_fused.py), and the final norm is the prologue of the batched lm_head
    matvec, over the B rows."""
    model = factory(layers=2)
    errs, w, _ = batch_steps_against_eager(model, batch, 300 + 10 * batch + (factory is hf_tiny.qwen3))
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert steps and not any(s.fallen_back for s in steps)
    layers = model.config.num_hidden_layers
    hidden = model.config.hidden_size
    for s in steps:
        g = s.schedule.graph
        assert g.batch() == batch
        normed = _normed_matvecs(g)   # the lm_head
        assert len(normed) == 1 and g.tensors[xin(normed[0])].numel == batch * hidden, [o.name for o in normed]
        fused = [o for o in g.ops if o.kind in ("rms_qkv_rope", "rms_gate_up_silu")]
        assert len(fused) == 2 * layers and all(o.attrs["batch"] == batch and "norm_w" in o.inputs for o in fused)
        # the hidden state's norms are gone as ops of their own (Qwen3's q/k norms over the heads
        # are the rms_qkv_rope's per-head norms)
        top = [o for o in g.ops if o.kind == "rmsnorm"]
        assert not top, [o.name for o in top]
        # layer 0 as tools/layer_ops.py lists it (docs/batch.md, "What stays one tile"): only the
        # cache counter's table_lookup is left of one tile
        rows = layer_ops.layer_rows(s.schedule, 0)
        assert "rmsnorm" not in [k for k, _, _ in rows]
        assert [(k, w) for k, n, w in rows if n == 1] == [("table_lookup", "")], rows


def test_query_token_norms_are_in_the_fused_kinds_and_the_lm_head_prologue(steps):
    """A step of K = 4 query tokens (batch 1, option ``query_tokens``) is a step of 4 rows: as
    at B = 4, each layer's two RMSNorms are the fused kinds' own (``rms_qkv_rope`` and
    ``rms_gate_up_silu`` of the 4 rows, tests/test_batch_tokens_fused.py checks their values)
    and the final norm the prologue of the lm_head's batched matvec of the 4 rows; no RMSNorm
    is left as an op of its own."""
    import step_util
    model = hf_tiny.llama(layers=2)
    gen = torch.Generator().manual_seed(4)
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 100, (1, 5), generator=gen), past_key_values=cache, use_cache=True)
        torch._dynamo.reset()
        torch.compile(model, backend="fusec", options={"query_tokens": 4})(
            input_ids=torch.randint(1, 100, (1, 4), generator=gen), past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    assert steps
    g = steps[-1].schedule.graph
    assert g.query_tokens() == 4
    layers = model.config.num_hidden_layers
    normed = _normed_matvecs(g)   # the lm_head
    assert len(normed) == 1 and normed[0].attrs["batch"] == 4, [o.name for o in normed]
    fused = [o for o in g.ops if o.kind in ("rms_qkv_rope", "rms_gate_up_silu")]
    assert len(fused) == 2 * layers and all(o.attrs["batch"] == 4 and "norm_w" in o.inputs for o in fused)
    assert not any(o.kind == "rmsnorm" for o in g.ops)   # none on its own


def _norm_qkv_graph(batch: int, dtype: torch.dtype):
    """An IR graph of Llama-3.2-1B's q/k/v widths at batch ``batch``: h [B, 2048] normed by a
    semantic ``rmsnorm`` (weight [2048]) and read by three batched matvecs (2048 -> 2048, 512,
    512). (graph, flat inputs)"""
    from fusec.ir import Graph, Op, Role, TensorInfo
    g, flat = Graph(), []

    def inp(name, shape, role):
        g.add_tensor(TensorInfo(name, shape, dtype, role, input_index=len(flat)))
        flat.append(torch.empty(*shape, dtype=dtype))
    inp("h", (batch, 2048), Role.INPUT)
    inp("nw", (2048,), Role.WEIGHT)
    g.add_tensor(TensorInfo("hn", (batch, 2048), dtype, Role.INTERMEDIATE))
    g.ops.append(Op("norm", "rmsnorm", {"x": "h", "w": "nw"}, {"out": "hn"}, attrs={"eps": 1e-5}))
    for name, n in (("q", 2048), ("k", 512), ("v", 512)):
        inp(f"w_{name}", (n, 2048), Role.WEIGHT)
        g.add_tensor(TensorInfo(f"y_{name}", (batch, n), dtype, Role.OUTPUT))
        g.ops.append(Op(name, "matvec", {"x": "hn", "w": f"w_{name}"}, {"out": f"y_{name}"}, attrs={"batch": batch}))
    g.inputs = [t for t, info in g.tensors.items() if info.input_index is not None]
    g.outputs = ["y_q", "y_k", "y_v"]
    g.batch_size = batch
    return g, flat


#: whether the norm folds at Llama-3.2-1B's widths: all B normed rows fit the staging budget
#: with the staged h (fp32 at B = 16: 128 KiB of x and 128 KiB of h do not)
FOLDS = {(4, torch.bfloat16): True, (8, torch.bfloat16): True, (16, torch.bfloat16): True,
         (16, torch.float32): False}


@pytest.mark.parametrize("batch,dtype", list(FOLDS))
def test_batch_prologue_compiles_without_spills_at_llama_1b_widths(batch, dtype, tmp_path):
    """The RMSNorm before Llama-3.2-1B's q/k/v folds into the three batched matvecs (q the
    writer, k and v parallel readers with their own copy) for B = 4, 8, 16 in bf16, and the kernel
    (``matvec_seqs`` with ``STAGED`` true, the norm's generated function over B rows in shared
    memory) compiles with NVRTC for sm_90a without spills, within the CTA's shared memory. B = 16
    in fp32 does not fold (the staged x and h exceed shared memory) and compiles as before."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.config import Options
    from fusec.cuda.codegen import MAX_SMEM_BYTES, render
    from fusec.cuda.jit import compile_cuda
    from fusec.instructions import KINDS
    from fusec.pipeline import Dumper, lower
    g, flat = _norm_qkv_graph(batch, dtype)
    sched = lower(g, flat, Options.from_dict({"num_sms": 132}), Dumper(None))
    ops = [o for o in sched.graph.ops if o.kind == "matvec"]
    folded = [o for o in ops if o.attrs.get("pre")]
    assert len(folded) == (3 if FOLDS[batch, dtype] else 0)
    assert ("rmsnorm" in sched.graph.count_kinds(members=False)) != FOLDS[batch, dtype]
    src = render(sched).source
    calls = re.findall(r"matvec_seqs<[^()]*>\(", src)
    assert calls and all(c.endswith("true>(") == FOLDS[batch, dtype] for c in calls), calls
    kernel = compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path))
    kernel.assert_no_spills()
    assert 4 * max(KINDS[o.kind].smem_floats(o, sched.graph) for o in sched.graph.ops if o.kind in KINDS) <= MAX_SMEM_BYTES


def _bf16_logits(model, options: dict | None) -> torch.Tensor:
    """3 decode steps of a batch of 4 left-padded prompts of ``model`` (bf16) through
    ``torch.compile(backend="fusec")`` with ``options``: the logits [3, 4, 1, V] in fp32."""
    from test_batch_decode import _left_padded
    from fusec.fallbacks import FallbackWatch
    gen = torch.Generator().manual_seed(7)
    ids, mask = _left_padded(model, 4, gen)
    cache = hf_tiny.static_cache(model, 24)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", **({"options": options} if options else {}))
    out = []
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(3):
            tok = torch.randint(1, model.config.vocab_size, (4, 1), generator=gen)
            mask = torch.cat([mask, torch.ones(4, 1, dtype=torch.long)], 1)
            full = torch.zeros(4, 24, dtype=torch.long)
            full[:, : mask.shape[1]] = mask
            out.append(compiled(input_ids=tok, past_key_values=cache, attention_mask=full,
                                position_ids=mask.sum(-1, keepdim=True) - 1, use_cache=True).logits.float())
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
    return torch.stack(out)


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_batch_prologue_in_bf16_equals_the_fold_off_run(factory, steps):
    """In bf16 at B = 4 the folded norms round as the generic ones (each member's output rounded
    to its dtype, in shared memory instead of global memory): the logits equal those of the run
    with option ``prologue`` off, bit for bit, and the default run did fold."""
    model = factory().to(torch.bfloat16)
    folded = _bf16_logits(model, None)
    assert any(_normed_matvecs(s.schedule.graph) for s in steps)
    off = _bf16_logits(model, {"prologue": False})
    assert torch.equal(folded, off)
