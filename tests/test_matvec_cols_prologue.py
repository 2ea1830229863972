"""``matvec_cols`` with a folded prologue (fusec/instructions/prologue.py, the ``prologue`` pass):
GPT-2's two LayerNorms per layer (``ln_1`` before ``c_attn``, ``ln_2`` before ``c_fc``, weight
and bias) and an RMSNorm in front of a ``Conv1D``-style product are recomputed by every column
tile into its staged x instead of standing alone as a one-SM dependency level.

CPU: GPT-2 decode through ``torch.compile(backend="fusec")`` (simulator) against eager after
several prompt lengths, no fallback, no standalone ``layernorm`` op; bf16 decode with the fold
equals the unfolded step bit for bit (the prologue rounds the norm as eager does); products
after a LayerNorm and an RMSNorm against PyTorch; the kernels at GPT-2's (768) and GPT-2-XL's
(1600, MLP 6400) widths compile with NVRTC for sm_90a without spills, bf16 and fp32."""
from __future__ import annotations

import re

import pytest
import torch

import hf_tiny
import step_util


def _cols(sched):
    return [o for o in sched.graph.ops if o.kind == "matvec_cols"]


def test_gpt2_layernorms_fold_into_matvec_cols_and_decode_like_eager(steps):
    """GPT-2 (fp32, simulator), prompts of 1, 6 and 19 tokens, two decode steps each, against
    eager: no fallback, and every LayerNorm in front of a Conv1D (both per layer) is the
    prologue of its ``matvec_cols`` (c_attn, c_fc): no ``layernorm`` op stands alone."""
    model = hf_tiny.gpt2()
    errs, w = step_util.prompts_against_eager(model, {}, (1, 6, 19))
    assert not w.fallbacks, w.fallbacks
    assert all(e < 1e-4 for e in errs.values()), errs
    assert steps
    layers = model.config.n_layer
    for step in steps:
        ops = step.schedule.graph.ops
        assert "layernorm" not in step.schedule.graph.count_kinds(members=False)
        folded = [o for o in ops if o.kind == "matvec_cols" and "pre" in o.attrs]
        assert len(folded) == 2 * layers, [(o.name, o.attrs.get("pre_steps")) for o in ops]
        # the first c_attn's prologue also takes the embeddings' sum (wte + wpe) before ln_1
        assert all(o.attrs["pre_steps"].endswith("layernorm") for o in folded)
        # c_attn (out 3 * n_embd) and c_fc (out 4 * n_embd, gelu_new)
        assert sorted(o.attrs.get("act") or "-" for o in folded) == ["-"] * layers + ["gelu_new"] * layers


def test_gpt2_bf16_fold_changes_no_value():
    """bf16 GPT-2: six decode steps with the LayerNorms folded into the column tiles equal the
    step with ``prologue`` off (the standalone LayerNorm op) bit for bit, and eager within bf16
    tolerance: the prologue's norm is rounded to bf16 as PyTorch's is."""
    model = hf_tiny.gpt2().to(torch.bfloat16)
    s = step_util.lowered(model)
    assert sum("pre" in o.attrs for o in _cols(s)) == 2 * model.config.n_layer
    step_util.assert_option_changes_no_value(model, {"prologue": False}, seed=11)


class NormedConv1D(torch.nn.Module):
    """Two Conv1D-style products (``addmm(b, x, W)``, W [K, N]) behind a norm each:
    ``y1 = addmm(b1, LayerNorm(x; w, b), W1)`` and ``y2 = mm(RMSNorm(2 * x; g), W2)``
    (the RMSNorm as HF's LlamaRMSNorm writes it: fp32 statistics, rounded to x's dtype, times
    the weight)."""

    def __init__(self, K=128, N1=384, N2=256):
        super().__init__()
        gen = torch.Generator().manual_seed(6)

        def p(*shape, scale=1.0, shift=0.0):
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) * scale + shift, requires_grad=False)
        self.K = K
        self.ln = torch.nn.LayerNorm(K)
        self.ln.weight, self.ln.bias = p(K, scale=0.2, shift=1.0), p(K, scale=0.2)
        self.w1, self.b1 = p(K, N1, scale=K ** -0.5), p(N1)
        self.g = p(K, scale=0.2, shift=1.0)
        self.w2 = p(K, N2, scale=K ** -0.5)

    def forward(self, x):
        y1 = torch.addmm(self.b1, self.ln(x).view(-1, self.K), self.w1)
        h = x * 2.0
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        n = self.g * v.to(h.dtype)
        return y1, torch.mm(n, self.w2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_layernorm_and_rmsnorm_prologues_against_pytorch(dtype, tol):
    """Both products are matvec_cols with their norm as the prologue (no standalone norm op),
    and the simulated step matches PyTorch; bf16 matches the step with the fold off bit for bit."""
    from fusec.sim import Simulator
    from test_matvec_cols import _lowered
    m = NormedConv1D().to(dtype)
    x = torch.randn(1, 128, dtype=dtype)
    aten_gm, flat, sched = _lowered(m, x)
    cols = _cols(sched)
    assert len(cols) == 2 and all("pre" in o.attrs for o in cols), [(o.kind, o.attrs.get("pre_steps")) for o in sched.graph.ops]
    assert "layernorm" in cols[0].attrs["pre_steps"]
    assert not {"layernorm", "aten.rsqrt.default", "rmsnorm"} & set(sched.graph.count_kinds(members=False))
    with torch.no_grad():
        ref = aten_gm(*flat)
        got = Simulator(sched).step(list(flat))
    for a, b in zip(got, ref):
        assert step_util.rel(a.reshape(b.shape).float(), b.float()) < tol
    _, _, off = _lowered_opts(m, x, prologue=False)
    assert not any("pre" in o.attrs for o in _cols(off))
    with torch.no_grad():
        unfolded = Simulator(off).step(list(flat))
    for a, b in zip(got, unfolded):
        assert torch.equal(a, b)


def _lowered_opts(m, x, **options):
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    aten_gm, g, flat = step_util.capture(m, {"x": x})
    return aten_gm, flat, lower(g, flat, Options.from_dict({"num_sms": 8, **options}), Dumper(None))


def _gpt2(width, heads):
    """One GPT-2 layer at a published width (MLP 4 * width), a 128-token vocabulary."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_embd=width, n_layer=1, n_head=heads, n_positions=256, attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg).eval().requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width,heads", [(768, 12), (1600, 25)])
def test_kernel_compiles_without_spills_at_published_widths(width, heads, dtype, tmp_path):
    """GPT-2 (768) and GPT-2-XL (1600, MLP 6400): the step with the LayerNorms folded into
    c_attn's and c_fc's column tiles renders (``matvec_cols<..., true, ...>``: x staged by the
    prologue; c_attn's KV-cache epilogue after it) and compiles with NVRTC for sm_90a without
    spills."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from test_attention_split import _lowered
    sched = _lowered(lambda: _gpt2(width, heads), dtype, 132, 256)
    folded = [o for o in _cols(sched) if "pre" in o.attrs]
    assert len(folded) == 2 and "layernorm" not in sched.graph.count_kinds(members=False)
    src = render(sched).source
    calls = re.findall(r"matvec_cols<([^>]*)>\(", src)
    staged = [c for c in calls if c.replace(" ", "").split(",")[11:12] == ["true"]]   # STAGED, the 12th argument
    assert len(calls) == 4 and len(staged) == 2, calls
    compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path)).assert_no_spills()
