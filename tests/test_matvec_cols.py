"""The ``matvec_cols`` kind: ``x @ W (+ b)`` with the weight stored [in, out] (HF's ``Conv1D``,
GPT-2's ``addmm(bias, x, weight)``), tiled over the columns on every SM.

CPU: the rules take ``addmm`` / ``mm`` of a 2-D weight (with the residual add or gelu_new after
it) and not their look-alikes; the simulator against eager (GPT-2, and products whose last tile
ends mid-group); the kernels render and compile with NVRTC for sm_90a. GPU (``gpu`` marker): the
same products and GPT-2 against eager, bf16, default options and 5 SMs (several tiles per SM)."""
from __future__ import annotations

import math

import pytest
import torch

import hf_tiny
import step_util
from fusec.fallbacks import FallbackWatch
from fusec.instructions.matvec_cols import chunks_per_group
from test_families import _decode_against_eager


class Conv1DProducts(torch.nn.Module):
    """h = gelu_new(addmm(b1, x, W1)) (Conv1D and GPT-2's NewGELUActivation, as HF writes it),
    y = mm(h, W2) (no bias), o = x + addmm(b3, y, W3) (the residual add after it), and
    z = mm(o, o.t()), whose mat2 is an activation (stays generic). W1 [K, N1], W2 [N1, N2],
    W3 [N2, K]. N1 = 1032 bf16 columns are 64.5 groups of 16: the last tile ends mid-group."""

    def __init__(self, K=96, N1=1032, N2=136):
        super().__init__()
        g = torch.Generator().manual_seed(3)

        def p(*shape, scale=1.0):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * scale, requires_grad=False)
        self.w1, self.b1 = p(K, N1, scale=K ** -0.5), p(N1)
        self.w2 = p(N1, N2, scale=N1 ** -0.5)
        self.w3, self.b3 = p(N2, K, scale=N2 ** -0.5), p(K)

    def forward(self, x):
        a = torch.addmm(self.b1, x.view(-1, x.shape[-1]), self.w1)
        h = 0.5 * a * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * torch.pow(a, 3.0))))
        y = torch.mm(h, self.w2)
        o = x + torch.addmm(self.b3, y, self.w3)
        return o, torch.mm(o, o.t()), h


def _fused_cols(step):
    """The matvec_cols ops of a step fusec built (the ``steps`` fixture's CompiledStep)."""
    return [o for o in step.schedule.graph.ops if o.kind == "matvec_cols"]


def _lowered(m, x, num_sms=8):
    """(aten graph module, flat inputs, schedule) of ``m(x)`` through fusec's passes."""
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    aten_gm, g, flat = step_util.capture(m, {"x": x})
    return aten_gm, flat, lower(g, flat, Options.from_dict({"num_sms": num_sms}), Dumper(None))


def test_rule_takes_weight_products_only():
    """addmm and mm of a [K, N] weight become matvec_cols (the residual add after an addmm
    too), tiled over several SMs; the product with an activation as mat2 stays generic; the
    simulated step matches PyTorch (fp32)."""
    from fusec.sim import Simulator
    m = Conv1DProducts()
    aten_gm, flat, sched = _lowered(m, torch.randn(1, 96))
    fused = [o for o in sched.graph.ops if o.kind == "matvec_cols"]
    assert [("b" in o.inputs, "residual" in o.inputs) for o in fused] == [(True, False), (False, False),
                                                                           (True, True)]
    assert [o.attrs.get("act") for o in fused] == ["gelu_new", None, None]
    assert not {"aten.add.Tensor", "aten.tanh.default", "aten.pow.Tensor_Scalar"} & set(sched.graph.count_kinds())
    assert sched.graph.count_kinds().get("aten.mm.default") == 1
    per_op: dict = {}
    for ins in sched.instrs:
        per_op.setdefault(ins.op, set()).add(ins.sm)
    assert all(len(per_op[o.name]) > 1 for o in fused)
    with torch.no_grad():
        ref = aten_gm(*flat)
        got = Simulator(sched).step(list(flat))
    for a, b in zip(got, ref):
        assert step_util.rel(a.reshape(b.shape), b) < 1e-5


class NotFused(torch.nn.Module):
    """Look-alikes the rules must leave alone: a residual add of the product to itself, and a
    gelu_new chain whose three uses of y are three products (one with beta 3)."""

    def __init__(self, K=64, N=96):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.w = torch.nn.Parameter(torch.randn(K, N, generator=g) / K ** 0.5, requires_grad=False)
        self.b = torch.nn.Parameter(torch.randn(N, generator=g), requires_grad=False)

    def forward(self, x):
        y = torch.addmm(self.b, x, self.w)
        y2 = torch.addmm(self.b, x, self.w, beta=3.0)
        g = 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y2 + 0.044715 * torch.pow(y2, 3.0))))
        return y + y, g


def test_look_alikes_are_not_fused_and_stay_correct():
    """``y + y`` keeps its add (the fused op would read its own output), the chain over two
    different products keeps its ops; the simulated step matches PyTorch (fp32)."""
    from fusec.sim import Simulator
    aten_gm, flat, sched = _lowered(NotFused(), torch.randn(1, 64))
    kinds = sched.graph.count_kinds()
    assert kinds["matvec_cols"] == 1 and kinds["aten.add.Tensor"] >= 2 and "aten.tanh.default" in kinds
    assert all("residual" not in o.inputs and "act" not in o.attrs for o in sched.graph.ops if o.kind == "matvec_cols")
    with torch.no_grad():
        ref = aten_gm(*flat)
        got = Simulator(sched).step(list(flat))
    for a, b in zip(got, ref):
        assert step_util.rel(a.reshape(b.shape), b) < 1e-5


@pytest.mark.parametrize("n,elt,nch", [(192, 2, 1), (2304, 2, 4), (3072, 2, 4), (768, 4, 2), (6400, 2, 8)])
def test_chunks_per_group(n, elt, nch):
    """NCH: the power of two that keeps the column groups of 16 * NCH bytes at most 128."""
    from fusec.ir import Graph, Role
    from fusec.ir.graph import TensorInfo
    g = Graph()
    g.add_tensor(TensorInfo("w", (64, n), torch.bfloat16 if elt == 2 else torch.float32, Role.WEIGHT))
    assert chunks_per_group(g, "w") == nch


def test_gpt2_conv1d_is_matvec_cols_and_matches_eager(steps):
    """GPT-2's four Conv1D projections per layer are matvec_cols (no generic addmm left; the
    two after which the residual is added take the add, the MLP's first its gelu_new), and 8
    decode steps match eager (fp32, simulator) with one kernel and no fallback."""
    _decode_against_eager(hf_tiny.gpt2())
    (step,) = steps
    ops = step.schedule.graph.ops
    kinds = step.schedule.graph.count_kinds()
    assert kinds["matvec_cols"] == 4 * 2 and "aten.addmm.default" not in kinds
    assert sum("residual" in o.inputs for o in ops if o.kind == "matvec_cols") == 2 * 2
    assert sum(o.attrs.get("act") == "gelu_new" for o in ops if o.kind == "matvec_cols") == 2
    assert "aten.tanh.default" not in kinds


#: GPT-2's ``activation_function`` -> the epilogue's ``act`` (fusec/instructions/activation.py)
GPT2_ACTS = {"gelu_new": "gelu_new", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


@pytest.mark.parametrize("function,dtype", [("gelu_new", torch.float32), ("gelu", torch.float32),
                                            ("gelu_pytorch_tanh", torch.float32), ("gelu", torch.bfloat16)])
def test_gpt2_activation_is_c_fc_epilogue(function, dtype, steps):
    """GPT-2 with ``activation_function`` gelu_new (its default: eight ATen ops), gelu (exact,
    ``aten.gelu``) or gelu_pytorch_tanh: the MLP's activation is the epilogue (``act``) of the
    ``matvec_cols`` of c_fc, by the rules ``matvec`` takes too (before, only gelu_new had a rule of
    its own and the others stayed a generic op); decode after prompts of 1, 6 and 19 tokens
    matches eager (fp32: 1e-5, bf16: its tolerance), no fallback, no GELU op left."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256, attn_implementation="sdpa",
                     activation_function=function)
    model = GPT2LMHeadModel(cfg).eval().requires_grad_(False).to(dtype)
    errs, w = step_util.prompts_against_eager(model, {}, (1, 6, 19))
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert max(errs.values()) < (1e-5 if dtype == torch.float32 else 2e-2), errs
    g = steps[-1].schedule.graph
    kinds = g.count_kinds()
    assert not {"aten.gelu.default", "aten.tanh.default", "aten.pow.Tensor_Scalar"} & set(kinds), kinds
    cols = [o for o in g.ops if o.kind == "matvec_cols"]
    assert len(cols) == 4 * 2
    acts = [o for o in cols if "act" in o.attrs]
    assert len(acts) == 2 and all(o.attrs["act"] == GPT2_ACTS[function] and "residual" not in o.inputs for o in acts)
    assert all(g.tensors[o.inputs["w"]].shape == (64, 4 * 64) for o in acts)   # c_fc: [n_embd, 4 n_embd]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_compiles(dtype):
    """The products' kernel renders and compiles with NVRTC for sm_90a, no spills."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    m = Conv1DProducts().to(dtype)
    _, _, sched = _lowered(m, torch.randn(1, 96, dtype=dtype))
    plan = render(sched)
    assert "matvec_cols<" in plan.source
    k = compile_cuda(plan.source, "fusec_step.cu")
    assert k.resources["fusec_step"]["spill_store_bytes"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("num_sms", [None, 5])
def test_products_and_gpt2_on_the_gpu(num_sms, steps):
    """bf16 on the GPU, default options (and 5 SMs: several tiles per SM): the products at
    GPT-2's widths built as a step of their own (``step_util.build``, they are no decode step)
    against PyTorch (1e-2 relative: bf16 outputs of fp32 sums in another order), then GPT-2
    decode steps through ``torch.compile`` against eager (5e-2 on the logits), with no fallback
    and the products as matvec_cols."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    opts = {} if num_sms is None else {"num_sms": num_sms}
    for K, N1, N2 in ((96, 1032, 136), (768, 2304, 768), (3072, 768, 3072)):
        m = Conv1DProducts(K, N1, N2).cuda().bfloat16()
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        aten_gm, g, flat = step_util.capture(m, {"x": x})
        step, sched = step_util.build(g, flat, **opts)
        assert len([o for o in sched.graph.ops if o.kind == "matvec_cols"]) == 3
        with torch.no_grad():
            got, ref = step(*flat), aten_gm(*flat)
        for a, b in zip(got, ref):
            assert step_util.rel(a.reshape(b.shape), b) < 1e-2, (K, N1, N2)
    model, cache = step_util.tiny_on_gpu(hf_tiny.gpt2, torch.bfloat16, max_len=64, prompt=5)
    import copy
    ref_cache = copy.deepcopy(cache)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options=opts)
    gen = torch.Generator().manual_seed(8)
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(6):
            tok = torch.randint(0, 128, (1, 1), generator=gen).cuda()
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.float()
            b = model(input_ids=tok, past_key_values=ref_cache, use_cache=True).logits.float()
            assert step_util.rel(a, b) < 5e-2
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert len(_fused_cols(steps[-1])) == 4 * 2
