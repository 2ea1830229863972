"""A parallel block's residual sum and a non-gated MLP's GELU stop standing alone (issue 31).

* The residual sum ``x + (attn + mlp)`` of Falcon-7B's layer (4544 elements: an op split into
  output ranges, which the ``chain`` pass never groups with the one-tile LayerNorm after it)
  folds into the next layer's ``rms_qkv_rope`` (its q/k/v, row views of ``query_key_value``:
  tests/test_fused_qkv_views.py) and MLP up projection in front of the LayerNorm that each
  one's prologue already holds (the prologue's parallel readers: each computes its own copy):
  the ``prologue`` pass folds transitively, the producer of a prologue's external input too
  (passes/prologue.py).
* The GELU over the MLP's up projection (18176 wide in Falcon-7B: over the prologue's limits
  for the down projection) is the up projection's epilogue (``act``; ``matvec_group``: on the
  output it applies to, ``act_outs``; fusec/instructions/activation.py): Falcon's
  ``aten.gelu``, StarCoder2's tanh GELU, GPT-NeoX's GELU, Phi-2's ``gelu_new`` chain (its fc1 a
  ``matvec`` beside the ``rms_qkv_rope`` that takes its q/k/v, as Falcon-7B's).

CPU: decode through ``torch.compile(backend="fusec")`` with default options against eager
after several prompt lengths (simulator), no fallback, the folds in the schedule. Ranged ops
start at 2 * RANGE_CHUNK elements (``fusec.instructions.generic``); the tiny models' residual
sums (64 elements) are ranged as Falcon-7B's are where the test lowers RANGE_CHUNK. Falcon-7B's
layer at its published widths (hidden 4544, 71 heads of 64, one KV head, MLP 18176) compiles
with NVRTC for sm_90a without spills, bf16 and fp32.
"""
from __future__ import annotations

import re

import pytest
import torch

import hf_tiny
import step_util

PROMPTS = (1, 6, 19)


def _gelu_ops(ops):
    """The GELU ops a schedule still runs: standalone, in a chain or in a prologue."""
    members = [m for o in ops for m in o.attrs.get("ops", []) + o.attrs.get("pre", [])]
    return [o.kind for o in ops + members if o.kind in ("aten.gelu.default", "aten.tanh.default")]


def _epilogues(ops):
    return [(o.kind, o.attrs["act"], o.attrs.get("act_outs")) for o in ops if "act" in o.attrs]


def test_falcon7b_residual_sum_and_gelu_fold(steps, monkeypatch):
    """Falcon-7B's layer shape (one LayerNorm, multi-query, parallel block), its residual sums
    ranged as at the published width: decode like eager, no fallback; every layer after the first
    has its residual sum and LayerNorm in the prologue of its ``rms_qkv_rope`` and of its MLP up
    projection (``add > layernorm``; the LM head's too), no ``add`` op stands alone, and the GELU
    is the up projection's epilogue, nowhere else."""
    import fusec.instructions.generic as generic
    monkeypatch.setattr(generic, "RANGE_CHUNK", 16)
    model = hf_tiny.falcon_7b()
    errs, w = step_util.prompts_against_eager(model, {}, PROMPTS)
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert all(e < 1e-4 for e in errs.values()), errs
    assert steps
    layers = model.config.num_hidden_layers
    for step in steps:
        ops = step.schedule.graph.ops
        want = ["layernorm"] + ["add > layernorm"] * (layers - 1)
        assert [o.attrs.get("pre_steps") for o in ops if o.kind == "rms_qkv_rope"] == want
        ups = [o for o in ops if o.kind == "matvec" and "act" in o.attrs]
        assert [o.attrs.get("pre_steps") for o in ups] == want
        head = [o for o in ops if o.kind == "matvec" and o.attrs.get("pre_steps") and "act" not in o.attrs]
        assert [o.attrs["pre_steps"] for o in head] == ["add > layernorm"]
        assert not [o for o in ops if o.kind == "matvec_group"]
        assert not [o for o in ops if o.kind.startswith("aten.add") or (o.kind == "chain" and "add" in o.attrs["steps"])]
        assert _epilogues(ops) == [("matvec", "gelu", None)] * layers
        assert not _gelu_ops(ops)


@pytest.mark.parametrize("factory, kind, act", [
    (hf_tiny.falcon_7b, "matvec", "gelu"),           # beside the rms_qkv_rope of its q/k/v views
    (hf_tiny.falcon, "matvec", "gelu"),              # new decoder architecture: ln_mlp's own matvec
    (hf_tiny.gpt_neox, "matvec", "gelu"),
    (hf_tiny.starcoder2, "matvec", "gelu_tanh"),
    (hf_tiny.phi2, "matvec", "gelu_new"),            # HF's NewGELUActivation: eight ATen ops
])
def test_gelu_is_the_up_projections_epilogue(factory, kind, act, steps):
    """Each family's MLP GELU is its up projection's epilogue, one per layer, in no prologue or
    chain; decode like eager after several prompt lengths, no fallback."""
    model = factory()
    errs, w = step_util.prompts_against_eager(model, {}, PROMPTS)
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert all(e < 1e-4 for e in errs.values()), errs
    layers = model.config.num_hidden_layers
    for step in steps:
        ops = step.schedule.graph.ops
        ep = _epilogues(ops)
        assert len(ep) == layers and all(k == kind and a == act for k, a, _ in ep), ep
        assert not _gelu_ops(ops), [(o.kind, o.attrs.get("steps") or o.attrs.get("pre_steps")) for o in ops]


@pytest.mark.parametrize("factory", [hf_tiny.falcon_7b, hf_tiny.phi2, hf_tiny.starcoder2])
def test_bf16_decodes_like_eager(factory, monkeypatch):
    """bf16, residual sums ranged: the epilogue rounds the product to bf16 before the activation
    and the activation after it (each of gelu_new's ops too), as eager's separate ops do, and
    the folded residual sum and LayerNorm round as eager's ops: six decode steps within bf16
    tolerance of eager, and bit for bit those of the step without the ``prologue`` pass (the
    residual sum and LayerNorm standalone), no fallback."""
    import fusec.instructions.generic as generic
    monkeypatch.setattr(generic, "RANGE_CHUNK", 16)
    model = factory().to(torch.bfloat16)
    s = step_util.lowered(model)
    assert _epilogues(s.graph.ops) and not _gelu_ops(s.graph.ops)
    step_util.assert_option_changes_no_value(model, {"prologue": False}, seed=3)


def test_a_second_activation_over_an_epilogue_stays_apart():
    """``gelu(gelu(W @ x))``: the first GELU is the matvec's epilogue, the second stands alone
    (one activation per op); the step equals PyTorch."""
    from fusec.sim import Simulator
    from test_matvec_cols import _lowered

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 96)

        def forward(self, x):
            return torch.nn.functional.gelu(torch.nn.functional.gelu(self.lin(x)), approximate="tanh")
    m = M().eval().requires_grad_(False)
    x = torch.randn(1, 64)
    aten_gm, flat, sched = _lowered(m, x)
    assert _epilogues(sched.graph.ops) == [("matvec", "gelu", None)]
    assert _gelu_ops(sched.graph.ops) == ["aten.gelu.default"]
    with torch.no_grad():
        ref = aten_gm(*flat)
        got = Simulator(sched).step(list(flat))
    for a, b in zip(got, ref):
        assert step_util.rel(a.reshape(b.shape).float(), b.float()) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_falcon7b_layer_compiles_without_spills(dtype, tmp_path):
    """One Falcon-7B layer at its published widths (hidden 4544, 71 heads of 64, one KV head,
    MLP 18176): the ``rms_qkv_rope`` over row views of ``query_key_value`` (71 q heads, 1 KV
    head, its LayerNorm staged by the prologue: NORM false, STAGED), the MLP up ``matvec`` with
    the GELU epilogue (ACT 2) and the next ``add > layernorm`` prologue render and compile with
    NVRTC for sm_90a without spills; ``rms_qkv_rope``'s device function has no stack frame."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from test_attention_split import _lowered
    sched = _lowered(hf_tiny.without_hf_init(lambda: hf_tiny.falcon_7b(hidden=4544, heads=71, layers=1)),
                     dtype, 132, 256)
    assert _epilogues(sched.graph.ops) == [("matvec", "gelu", None)]
    src = render(sched).source
    qkv = re.findall(r"rms_qkv_rope<([^>]*)>\(", src)
    assert len(qkv) == 1 and qkv[0].replace(" ", "").split(",")[8:13] == ["4544", "71", "1", "64", "256"], qkv
    ups = re.findall(r"matvec<([^>]*)>\(", src)
    assert any(c.replace(" ", "").endswith("4544,false,true,2") for c in ups), ups
    kernel = compile_cuda(src, "fusec_step.cu", options=("-Xptxas", "-v"), cache_dir=str(tmp_path))
    kernel.assert_no_spills()
    lines = kernel.log.splitlines()
    props = [lines[i + 1] for i, line in enumerate(lines) if "Function properties for _Z12rms_qkv_rope" in line]
    assert len(props) == 1 and "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in props[0], props
