"""Per-head q/k RMSNorms in ``rms_qkv_rope`` take one eps and one weight order for q and k.

Gemma-3 norms each q and k head (``q_norm`` / ``k_norm``, HF's ``Gemma3RMSNorm``: the normed
value times ``1 + w`` in fp32, one rounding; ``recognize`` gives those ``rmsnorm`` ops
``w_fp32``). ``rms_qkv_rope`` takes the norms as its per-head epilogue and must apply the weight
as they do (attribute ``qk_w_fp32``, template ``QKW32``), as it does for OLMo-2's norms over the
whole projection; it used Llama's order (the normed value rounded, then the weight), about one
bf16 ulp off. q and k norms of another eps or another weight order are left unfused. Decode through
``torch.compile(backend="fusec")`` against the same step with ``rms_qkv_rope``'s rule off (the
norms then run as generic ``rmsnorm`` ops, whose semantics are eager's) bit for bit, and against
eager; the template's NVRTC compile at Gemma-3-1B's widths (head_dim 256)."""
from __future__ import annotations

import re

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch


def _gemma3():
    return hf_tiny.gemma3().to(torch.bfloat16)


def _decode(model, prompts=(1, 6, 19), steps: int = 3):
    """``steps`` decode steps after a random prompt of each length in ``prompts`` through
    ``torch.compile(model, backend="fusec")``, each prompt on its own 64-row StaticCache: (every
    step's logits, each prompt's caches after its steps, the FallbackWatch)."""
    gen = torch.Generator().manual_seed(5)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    logits, caches = [], []
    with FallbackWatch() as w, torch.no_grad():
        for n in prompts:
            cache = hf_tiny.static_cache(model, 64)
            model(input_ids=torch.randint(0, 128, (1, n), generator=gen), past_key_values=cache, use_cache=True)
            for _ in range(steps):
                tok = torch.randint(0, 128, (1, 1), generator=gen)
                logits.append(compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits)
            caches.append(cache)
    torch._dynamo.reset()
    return logits, caches, w


def _qkv_ops(steps) -> list:
    return [o for s in steps for o in s.schedule.graph.ops if o.kind == "rms_qkv_rope"]


def test_gemma3_head_norms_round_as_eager_in_rms_qkv_rope(steps, monkeypatch):
    """Gemma-3 (bf16): each layer's q/k/v, per-head q/k norms (``qk_w_fp32``), RoPE and KV writes
    are one ``rms_qkv_rope``, and the decode steps after prompts of 1, 6 and 19 tokens equal the
    steps with that kind's rule off (the norms generic ``rmsnorm`` ops) bit for bit: the logits
    and every KV cache row; both within bf16's tolerance of eager, no fallback."""
    import step_util
    from fusec.instructions.rms_qkv_rope import RmsQkvRope
    model = _gemma3()
    fused, fused_caches, w = _decode(model)
    assert not w.fallbacks and w.compiled, w.fallbacks
    qkv = _qkv_ops(steps)
    assert len(qkv) == model.config.num_hidden_layers
    assert all("q_norm_w" in o.inputs and "qk_norm" not in o.attrs for o in qkv)   # per head
    del steps[:]
    monkeypatch.setattr(RmsQkvRope, "rules", ())
    plain, plain_caches, w = _decode(model)
    assert not w.fallbacks and w.compiled, w.fallbacks
    members = [m for s in steps for o in s.schedule.graph.ops
               for m in (o.attrs["ops"] if o.kind == "chain" else [*o.attrs.get("pre", ()), o])]
    assert not _qkv_ops(steps) and any(m.kind == "rmsnorm" and m.attrs.get("w_fp32") for m in members)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    for ca, cb in zip(fused_caches, plain_caches):
        for la, lb in zip(ca.layers, cb.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    errs, w = step_util.prompts_against_eager(model, {}, (1, 6, 19))
    assert not w.fallbacks and max(errs.values()) < 2e-2, errs
    assert all(o.attrs.get("qk_w_fp32") for o in qkv)


@pytest.mark.parametrize("what", ["eps", "w_fp32"])
def test_q_and_k_head_norms_that_differ_stay_unfused(what, steps, monkeypatch):
    """Per-head q and k norms of different eps, or one of them with its weight in fp32 and the other
    not (``rms_qkv_rope`` has one ``qk_eps`` and one ``qk_w_fp32``): the q/k/v stay out of the kind
    (before, it took them with q's eps and Llama's order for both); eager's logits within bf16's
    tolerance, no fallback."""
    import step_util
    model = _gemma3()
    if what == "eps":
        for layer in model.model.layers:
            layer.self_attn.k_norm.eps = 1e-3
    else:   # k's norm as Llama's: recognize makes it an rmsnorm without w_fp32
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        for layer in model.model.layers:
            k = layer.self_attn.k_norm
            norm = LlamaRMSNorm(k.weight.shape[0], eps=k.eps).to(torch.bfloat16)
            with torch.no_grad():
                norm.weight.copy_(1 + k.weight)
            layer.self_attn.k_norm = norm
    errs, w = step_util.prompts_against_eager(model, {}, (1, 6))
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert max(errs.values()) < 2e-2, errs
    assert steps and not _qkv_ops(steps)


#: Gemma-3-1B's attention widths (benchmarks/families.py): hidden 1152, 4 heads of 256, 1 KV head
PUBLISHED = dict(hidden_size=1152, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 query_pre_attn_scalar=256, intermediate_size=256, num_hidden_layers=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_published_gemma3_template_compiles_without_spills(dtype, steps, tmp_path):
    """``rms_qkv_rope`` at Gemma-3-1B's widths with its per-head norms (bf16: ``QKW32``; fp32:
    both orders round alike, ``recognize`` keeps the plain one), lowered through
    ``torch.compile(backend="fusec")``, compiles with NVRTC for sm_90a with no stack frame and no
    spill, and the whole kernel uses no local memory."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from fusec.cuda.codegen import render
    model = hf_tiny._nonzero_norms(hf_tiny._small(Gemma3TextConfig, Gemma3ForCausalLM, **PUBLISHED)).to(dtype)
    _decode(model, prompts=(4,), steps=1)
    sched = steps[-1].schedule
    (qkv,) = [o for o in sched.graph.ops if o.kind == "rms_qkv_rope"]
    assert "q_norm_w" in qkv.inputs and qkv.attrs["head_dim"] == 256
    assert qkv.attrs["qk_w_fp32"] == (dtype == torch.bfloat16)
    src = render(sched).source
    assert "qkv_head_epilogue<TO, TC, THN, TT, D, QKW32>" in src
    targs = re.search(r"\brms_qkv_rope<([^()]*)>\(", src).group(1).split(", ")
    # QKW32, the 22nd: written out (true) in bf16; in fp32 the call stops at its defaults before it
    assert (len(targs) == 22 and targs[-1] == "true") if dtype == torch.bfloat16 else len(targs) < 22, targs
    import step_util
    step_util.compile_kind_without_spills(src, tmp_path)
