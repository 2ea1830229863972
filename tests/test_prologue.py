"""The small vector ops in front of a matvec kind fold into it (passes/prologue.py,
fusec/instructions/prologue.py): which ops fold in the post-norm and scaled-residual families,
that the fold changes no value (the simulator against the same step with the fold off, and
against eager), that Llama's kernel is untouched, and the folded kernel through NVRTC. The GPU
runs the folds in every family test (tests/test_gpu_families.py)."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
import step_util
from fusec.fallbacks import FallbackWatch
from fusec.instructions import KINDS


def _folds(s) -> list[tuple[str, str]]:
    return [(o.kind, o.attrs["pre_steps"]) for o in s.graph.ops if "pre" in o.attrs]


@pytest.mark.parametrize("factory, want", [
    # post-norm: h = r + RMSNorm(o) before the MLP (norm off) and before the next layer's q/k/v;
    # the last one before the final norm and the LM head (its norm the prologue's last member)
    (hf_tiny.olmo2, [("rms_gate_up_silu", "rmsnorm > add"), ("rms_qkv_rope", "rmsnorm > add"),
                     ("rms_gate_up_silu", "rmsnorm > add"), ("rms_lm_head", "rmsnorm > add > rmsnorm")]),
    # pre- and post-norms: the embedding scale and the input norm before layer 0's q/k/v, each
    # post-norm, its add and the next pre-norm before the MLP and the next q/k/v
    (hf_tiny.gemma2, [("matvec_group", "mul > rmsnorm")]
     + [("rms_gate_up_silu", "rmsnorm > add > rmsnorm"), ("matvec_group", "rmsnorm > add > rmsnorm")]
     + [("rms_gate_up_silu", "rmsnorm > add > rmsnorm"), ("rms_lm_head", "rmsnorm > add > rmsnorm")]),
    # the embedding multiplier before layer 0's norm, and a scaled residual h = r + o * m before
    # each norm (rms_qkv_rope's, rms_gate_up_silu's, the final one)
    (hf_tiny.granite, [("rms_qkv_rope", "mul > rmsnorm")]
     + [("rms_gate_up_silu", "mul > add > rmsnorm"), ("rms_qkv_rope", "mul > add > rmsnorm")]
     + [("rms_gate_up_silu", "mul > add > rmsnorm"), ("rms_lm_head", "mul > add > rmsnorm")]),
])
def test_residual_ops_fold_into_the_matvec_that_reads_them(factory, want):
    """2-layer bf16 models: the ops between two fused kinds are the reading kind's prologue (in
    program order), and no chain of them is left; with ``prologue`` off they stay chains."""
    on = step_util.lowered(factory().to(torch.bfloat16))
    off = step_util.lowered(factory().to(torch.bfloat16), prologue=False)
    assert _folds(on) == want
    assert not _folds(off)
    assert len(on.graph.ops) == len(off.graph.ops) - len(want)
    # the residual stream the later ops read is written by one tile: the one whose instruction
    # word's p0 (its first row or unit) is 0
    for op in on.graph.ops:
        if "pre" in op.attrs and op.attrs["pre_keep"]:
            writers = [t for t in on.instrs if t.op == op.name and op.attrs["pre_keep"][0] in
                       {w.tensor for w in t.tile.writes}]
            assert len(writers) == 1 and KINDS[op.kind].encode(op, writers[0].tile)[0] == 0


def test_llama_has_nothing_to_fold_and_its_kernel_is_unchanged():
    """Llama's layer is its fused kinds only: no fold, and the rendered kernel is the same text
    with the fold on and off."""
    from fusec.cuda.codegen import render
    on = step_util.lowered(hf_tiny.llama().to(torch.bfloat16))
    off = step_util.lowered(hf_tiny.llama().to(torch.bfloat16), prologue=False)
    assert not _folds(on)
    assert render(on).source == render(off).source


@pytest.mark.parametrize("factory", [hf_tiny.olmo2, hf_tiny.gemma3, hf_tiny.granite])
def test_folded_steps_equal_the_unfolded_ones_and_eager(factory):
    """Six decode steps through ``torch.compile(backend="fusec")`` on the simulator (hazards
    checked every step), bf16, default options against ``prologue`` off: the same logits bit for
    bit (each member is the same op with the same rounding), both within bf16 tolerance of
    eager, no fallback."""
    step_util.assert_option_changes_no_value(factory().to(torch.bfloat16), {"prologue": False}, seed=11)


def test_folded_kernel_stages_its_inputs_once_and_compiles():
    """The folded op's case, in its shared-memory form (the ``#else`` of FUSEC_PROLOGUE_REGS;
    the register form: tests/test_prologue_registers.py), stages the members' inputs into shared
    memory in one loop, calls the members on shared memory, copies the residual out on the tile
    whose rows start at 0; then the case calls its kind with ``STAGED``; the kernel compiles with
    NVRTC for sm_90a in both forms."""
    import re
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    plan = render(step_util.lowered(hf_tiny.gemma2().to(torch.bfloat16)))
    cases = re.findall(r"\n#else\n(.*gx_rmsnorm.*)\n#endif\n(rms_gate_up_silu<.*)", plan.source)
    assert cases, "no folded rms_gate_up_silu case"
    pre, call = cases[0]
    assert pre.index("__ldcg(reinterpret_cast<const uint4*>") < pre.index("gx_rmsnorm")
    assert "(char*)smem +" in pre and "if (in.p0 == 0)" in pre
    assert ", true>(" in call   # STAGED
    compile_cuda(plan.source, "fusec_step.cu")
    compile_cuda(plan.source.replace("#define FUSEC_PROLOGUE_REGS 1", "#define FUSEC_PROLOGUE_REGS 0"), "fusec_step.cu")


def test_a_reader_between_keeps_the_ops_where_they_are():
    """An op between the chain and its matvec reads the chain's output: folding would move the
    chain's work after that reader, so it stays (checked on OLMo-2 with a reader inserted)."""
    from fusec.ir import Op, Ref
    from fusec.passes import prologue
    s = step_util.lowered(hf_tiny.olmo2().to(torch.float32), prologue=False)
    g = s.graph
    k = next(i for i, o in enumerate(g.ops) if o.kind == "rms_gate_up_silu")
    x = g.ops[k].inputs["x"]
    out = g.new_tensor("probe", g.tensors[x].shape, g.tensors[x].dtype)
    g.ops.insert(k, Op("probe_neg", "aten.neg.default", {"in0": x}, {"out": out},
                       attrs={"target": torch.ops.aten.neg.default, "args": (Ref("in0"),), "kwargs": {}}))
    g.outputs.append(out)
    prologue.run(g)
    g.check("prologue")
    assert "pre" not in g.ops[k + 1].attrs and g.ops[k + 1].kind == "rms_gate_up_silu"


def test_a_norm_over_a_reshaped_member_output_norms_the_consumers_last_dim():
    """The consumer's own RMSNorm folds in as a member over ``x`` as the consumer reads it: a
    member whose output has another shape (here ``[.., 4, H/4]``, reshaped to ``[.., H]`` for the
    final norm) must not make the norm run over its last dim (H/4). Llama with a scale in front
    of its final norm, fp32, two steps: folded, unfolded and eager agree."""
    from torch import nn
    from transformers import StaticCache

    class ScaledNorm(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def forward(self, x):
            return self.norm((x.view(*x.shape[:-1], 4, x.shape[-1] // 4) * 2.0).view(x.shape))

    model = hf_tiny.llama()
    model.model.norm.weight.data.normal_(generator=torch.Generator().manual_seed(2))
    model.model.norm = ScaledNorm(model.model.norm)
    on = step_util.lowered(model)
    assert _folds(on)[-1] == ("rms_lm_head", "mul > rmsnorm")
    norm = next(o for o in on.graph.ops if o.kind == "rms_lm_head").attrs["pre"][-1]
    assert on.graph.tensors[norm.outputs["out"]].shape[-1] == 64
    gen = torch.Generator().manual_seed(4)
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(3)]
    p = torch.randint(0, 128, (1, 5), generator=gen)
    toks = [torch.randint(0, 128, (1, 1), generator=gen) for _ in range(2)]
    outs = []
    with FallbackWatch() as w, torch.no_grad():
        for c in caches:
            model(input_ids=p, past_key_values=c)
        for cache, opts in ((caches[0], {"num_sms": 4}), (caches[1], {"num_sms": 4, "prologue": False})):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="fusec", options=opts)
            outs.append([compiled(input_ids=t, past_key_values=cache).logits for t in toks])
        eager = [model(input_ids=t, past_key_values=caches[2]).logits for t in toks]
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled >= 2, w.fallbacks
    for a, b, e in zip(*outs, eager):
        assert torch.equal(a, b) and step_util.rel(a, e) < 1e-5


def test_a_consumer_reading_a_member_output_besides_x_keeps_the_ops_where_they_are():
    """K reads a member's output through another input (here a matvec's bias is the post-norm's
    output, its x the residual add's): only K's writer tile would write it, while every tile
    reads it, so nothing folds (before, the fold left K reading it before any op wrote it)."""
    from fusec.ir import Op
    from fusec.passes import prologue
    s = step_util.lowered(hf_tiny.olmo2().to(torch.float32), prologue=False)
    g = s.graph
    k = next(i for i, o in enumerate(g.ops) if o.kind == "rms_gate_up_silu")
    x = g.ops[k].inputs["x"]
    chain = g.producers()[g.root(x)]
    normed = next(m.outputs["out"] for m in chain.attrs["ops"] if m.kind == "rmsnorm")
    w = next(o.inputs["w"] for o in g.ops if o.kind == "matvec" and g.tensors[o.inputs["w"]].shape == (64, 64))
    out = g.new_tensor("probe_out", (1, 1, 64), torch.float32)
    g.ops.insert(k, Op("probe_mv", "matvec", {"x": x, "w": w, "b": normed}, {"out": out}))
    g.outputs.append(out)
    prologue.run(g)
    g.check("prologue")
    assert "pre" not in g.ops[k].attrs and g.ops[k].name == "probe_mv"
