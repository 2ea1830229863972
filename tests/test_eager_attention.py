"""Eager attention (HF ``attn_implementation="eager"``) is recognized as SDPA
(``fusec.frontend.eager_attention``), Gemma-2's logit softcapping as fusec.sdpa's softcap: HF
models compile on the CPU simulator and match eager (fp32, 1e-4, no fallback); attention that
is not SDPA (weights returned, a tanh that is not a softcap) falls back with a line saying why."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import hf_tiny
from fusec.fallbacks import FallbackWatch
from fusec.frontend.eager_attention import find_eager_attention, rewrite_eager_attention


# ---- the rewrite on dynamo graphs of hand-written attention -------------------------------

def _repeat_kv(x, n):
    b, h, l, d = x.shape
    return x if n == 1 else x[:, :, None, :, :].expand(b, h, n, l, d).reshape(b, h * n, l, d)


class HFShape(torch.nn.Module):
    """HF's ``eager_attention_forward`` (older transformers: the mask sliced to the key length;
    ``@`` for the second matmul), GQA by ``repeat_kv``; ``returns_weights``: the weights are
    returned too (output_attentions=True); ``softcap``: Gemma-2's tanh logit softcapping
    (``mask_first``: the tanh after the mask, not a softcap)."""

    def __init__(self, n_rep=2, returns_weights=False, softcap=None, mask_first=False):
        super().__init__()
        self.n_rep, self.returns_weights, self.softcap, self.mask_first = n_rep, returns_weights, softcap, mask_first

    def forward(self, q, k, v, mask):
        ks, vs = _repeat_kv(k, self.n_rep), _repeat_kv(v, self.n_rep)
        w = torch.matmul(q, ks.transpose(2, 3)) * (q.shape[-1] ** -0.5)
        if self.mask_first:
            w = w + mask[:, :, :, : ks.shape[-2]]
        if self.softcap is not None:
            w = torch.tanh(w / self.softcap) * self.softcap
        if not self.mask_first:
            w = w + mask[:, :, :, : ks.shape[-2]]
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        w = F.dropout(w, p=0.1, training=self.training)
        o = (w @ vs).transpose(1, 2).contiguous()
        return (o, w) if self.returns_weights else o


class TensorScaleNoMask(torch.nn.Module):
    """MHA without a mask or ``repeat_kv``, the key transposed by (-1, -2), scaled by a 0-d
    buffer, the softmax as a tensor method with no dtype and no dropout."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.3))

    def forward(self, q, k, v):
        return torch.matmul((q @ k.transpose(-1, -2) * self.scale).softmax(-1), v)


class HFFunction(torch.nn.Module):
    """transformers' own ``eager_attention_forward`` (Llama), GQA."""
    num_key_value_groups = 2

    def forward(self, q, k, v, mask):
        from transformers.models.llama.modeling_llama import eager_attention_forward
        return eager_attention_forward(self, q, k, v, mask, scaling=0.2)[0]


def _inputs(seed, heads=4, kv_heads=2, s=3, l=8, d=16, mask_extra=5):
    """Random q [1, heads, s, d], k/v [1, kv_heads, l, d] and an additive mask [1, 1, s, l +
    mask_extra] (longer than the keys: HFShape slices it); no mask for ``mask_extra=None``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, s, d, generator=g)
    k, v = torch.randn(1, kv_heads, l, d, generator=g), torch.randn(1, kv_heads, l, d, generator=g)
    if mask_extra is None:
        return q, k, v
    return q, k, v, torch.randn(1, 1, s, l + mask_extra, generator=g) * 2.0


def _dynamo_graph(module, args):
    """The FX graph dynamo captures for ``module(*args)`` and its example inputs."""
    got = []

    def backend(gm, ex):
        got.append((gm, ex))
        return gm.forward
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module.eval(), backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    (gm, ex), = got
    return gm, ex


def _calls(gm, targets):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and n.target in targets]


@pytest.mark.parametrize("module,args", [(HFShape(), _inputs(1)), (TensorScaleNoMask(), _inputs(2, 4, 4, mask_extra=None)),
                                         (HFFunction(), _inputs(3, s=1, mask_extra=0))],
                         ids=["hf_shape_gqa_sliced_mask", "mha_tensor_scale_no_mask", "transformers_function"])
def test_rewrite_makes_one_sdpa_with_the_same_values(module, args):
    """One SDPA call replaces the matmuls and the softmax, and the rewritten graph computes what
    the module does (the scale, the mask and the GQA head mapping are right)."""
    gm, ex = _dynamo_graph(module, args)
    want = module(*args)
    attention_ops = {torch.matmul, operator.matmul, "matmul", "softmax", F.softmax}
    assert len(_calls(gm, attention_ops)) == 3
    assert rewrite_eager_attention(gm) == 1
    sdpa = _calls(gm, {F.scaled_dot_product_attention})
    assert len(sdpa) == 1 and not _calls(gm, attention_ops)
    assert sdpa[0].kwargs["enable_gqa"] is (args[0].shape[1] != args[1].shape[1])
    torch.testing.assert_close(_first(gm(*ex)), want, rtol=1e-5, atol=1e-6)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def test_rewrite_makes_a_softcapped_attention_one_fusec_sdpa():
    """Gemma-2's softcap (``tanh(w / c) * c`` between the scaling and the mask) becomes one
    fusec.sdpa with softcap c and the scale of the scores, computing the module's values (scores
    large enough that the tanh bends them)."""
    module, args = HFShape(softcap=5.0), _inputs(1)
    args = (args[0] * 6, args[1] * 6, *args[2:])
    gm, ex = _dynamo_graph(module, args)
    want = module(*args)
    assert rewrite_eager_attention(gm) == 1
    (call,) = _calls(gm, {torch.ops.fusec.sdpa.default})
    assert call.args[6] == pytest.approx(args[0].shape[-1] ** -0.5) and call.args[8] == 5.0
    assert not _calls(gm, {F.scaled_dot_product_attention, torch.tanh, "softmax", F.softmax})
    torch.testing.assert_close(_first(gm(*ex)), want, rtol=1e-5, atol=1e-6)
    plain = HFShape()(*args)
    assert ((plain - want).norm() / want.norm()).item() > 1e-2   # the softcap bends these scores


def test_rewrite_leaves_attention_that_is_not_sdpa():
    """Weights returned (output_attentions=True) and a tanh after the mask (not a softcap): no
    rewrite, and the refusal says why at the model line; the graph still computes the module's
    values."""
    for module, words, line in ((HFShape(returns_weights=True), "weights are returned (output_attentions=True)",
                                 "F.softmax(w, dim=-1"),
                                (HFShape(softcap=5.0, mask_first=True), "tanh that is not a logit softcap "
                                 "(the mask added before it)", "torch.tanh(w / self.softcap)")):
        args = _inputs(4)
        gm, ex = _dynamo_graph(module, args)
        found, refused = find_eager_attention(gm)
        assert found == [] and len(refused) == 1 and words in refused[0].reason
        assert line in refused[0].node.meta["stack_trace"]
        assert rewrite_eager_attention(gm) == 0
        assert not _calls(gm, {F.scaled_dot_product_attention})
        torch.testing.assert_close(_first(gm(*ex)), _first(module(*args)))


def test_rewrite_under_dynamic_shapes():
    """HF Llama under ``dynamic=True``: the scaling is the ``.item()`` of a 0-d tensor (a symbolic
    float, SDPA's scale) and a layer's KV heads are symbolic sizes dynamo specialized; every
    layer is rewritten."""
    from transformers import StaticCache
    model = _llama("eager")
    cache = StaticCache(config=model.config, max_cache_len=32)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 4), generator=gen), past_key_values=cache, use_cache=True)
    got = []

    def backend(gm, ex):
        got.append(gm)
        return gm.forward
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=True)(
            input_ids=torch.randint(0, 128, (1, 1), generator=gen), past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    (gm,) = got
    assert rewrite_eager_attention(gm) == 2
    sdpa = _calls(gm, {F.scaled_dot_product_attention})
    assert [n.kwargs["scale"].target for n in sdpa] == ["item", "item"]
    assert all(n.kwargs["enable_gqa"] for n in sdpa)


# ---- HF models on the CPU simulator ------------------------------------------------------

def _decode(model, n=5, seed=11, fallback="inductor", **call_kw):
    """``n`` decode steps of ``model`` compiled with fusec and of eager ``model``, each on its
    own StaticCache after the same random prompt: (each step's relative logits error, the
    FallbackWatch)."""
    from transformers import StaticCache
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    errs = []
    with torch.no_grad():
        p = torch.randint(0, vocab, (1, 5), generator=gen)
        for c in caches:
            model(input_ids=p, past_key_values=c, use_cache=True)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusec", options={"num_sms": 8, "fallback": fallback})
        with FallbackWatch() as w:
            for _ in range(n):
                tok = torch.randint(0, vocab, (1, 1), generator=gen)
                a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True, **call_kw).logits
                b = model(input_ids=tok, past_key_values=caches[1], use_cache=True, **call_kw).logits
                errs.append(((a - b).norm() / b.norm()).item())
    torch._dynamo.reset()
    return errs, w


def _llama(attn, kv_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM
    return hf_tiny._small(LlamaConfig, LlamaForCausalLM, 3, num_key_value_heads=kv_heads, attn_implementation=attn)


def test_llama_gqa_eager_compiles_as_the_sdpa_model_does(steps):
    """Llama, 4 heads over 2 KV heads, eager attention: matches eager with no fallback, and
    compiles to the same instruction kinds as the same model with SDPA attention: HF's eager
    mask (0 / finfo.min) is proven causal, so the attention reads rows 0..pos with no mask."""
    errs, w = _decode(_llama("eager"))
    assert w.fallbacks == [] and w.compiled >= 1
    assert max(errs) <= 1e-4 and min(errs) > 0, errs
    eager_kinds = dict(steps[-1].schedule.graph.count_kinds())
    assert eager_kinds["attention_partial"] == 2
    _, w2 = _decode(_llama("sdpa"), n=1)
    assert w2.fallbacks == [] and w2.compiled >= 1
    sdpa_kinds = dict(steps[-1].schedule.graph.count_kinds())
    assert eager_kinds == sdpa_kinds


@pytest.mark.parametrize("family", ["qwen2_mha", "gpt_neox"])
def test_eager_attention_family_matches_eager(family, steps):
    """MHA without ``repeat_kv`` work (Qwen2 with as many KV heads as heads: ``repeat_kv`` returns
    the tensor) and GPT-NeoX (no ``repeat_kv`` call, fused qkv, partial rotary)."""
    if family == "qwen2_mha":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        model = hf_tiny._small(Qwen2Config, Qwen2ForCausalLM, 5, num_key_value_heads=4, attn_implementation="eager")
    else:
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
        torch.manual_seed(6)
        model = GPTNeoXForCausalLM(GPTNeoXConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
            max_position_embeddings=256, rotary_pct=0.5, attn_implementation="eager")).eval().requires_grad_(False)
    assert model.config._attn_implementation == "eager"
    errs, w = _decode(model)
    assert w.fallbacks == [] and w.compiled >= 1
    assert max(errs) <= 1e-4 and min(errs) > 0, errs
    kinds = steps[-1].schedule.graph.count_kinds()
    assert kinds["attention_partial"] == 2 and not any("softmax" in k for k in kinds), kinds


def test_returned_weights_fall_back_with_the_reason():
    """output_attentions=True: the weights are an output, no SDPA; the step falls back with the
    reason and still gives eager's logits."""
    errs, w = _decode(_llama("eager"), n=2, fallback="eager", output_attentions=True)
    assert w.compiled == 0
    assert any("eager attention whose weights are returned (output_attentions=True) at modeling_llama.py:" in f
               for f in w.fallbacks), w.fallbacks
    assert max(errs) < 1e-6, errs


def test_gemma2_softcapped_eager_attention_compiles_and_matches_eager(steps):
    """Gemma-2's eager attention softcaps its logits (``* scaling; / c; tanh; * c``, then the
    mask): it becomes fusec.sdpa with ``softcap`` c, the split-KV kind applies ``c * tanh(s / c)``
    to its scaled scores, and the logits are eager's (fp32, 1e-4) with no fallback on both the
    sliding and the full layers (before: "attention logit softcapping is not supported", every
    step on the fallback)."""
    model = hf_tiny.gemma2_eager(seed=7)   # softcap 2.0, scores of several units, which it bends
    errs, w = _decode(model, n=3)
    assert w.fallbacks == [] and w.compiled >= 1, w.fallbacks
    assert max(errs) <= 1e-4 and min(errs) > 0, errs
    g = steps[-1].schedule.graph
    att = [o for o in g.ops if o.kind == "attention_partial"]
    assert len(att) == model.config.num_hidden_layers and all(o.attrs["softcap"] == 2.0 for o in att)
    # the softcap matters at this scale: eager without it gives other logits
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        capped = model(ids).logits
        model.config.attn_logit_softcapping = None
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        plain = model(ids).logits
    assert ((capped - plain).norm() / capped.norm()).item() > 2e-3   # 20x the 1e-4 fusec is held to


def test_a_softcap_changed_between_calls_falls_back_with_a_line_that_says_so():
    """Gemma-2's softcap set to another number between two fusec.generate calls: dynamo's
    automatic dynamic makes it a symbolic float, which fusec does not take; the call falls back
    (its tokens eager's) with a line that names the change (before, it named dynamic=True only,
    an option the user never set)."""
    import fusec
    model = hf_tiny.gemma2_eager(window=7)
    p = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(8))
    lines = []
    for cap in (2.0, 0.3):
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = cap
        ref = model.generate(p, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
        with FallbackWatch() as w:
            out = fusec.generate(model, p, 4, eos_token_id=[], options={"num_sms": 8})
        assert torch.equal(out, ref)
        lines.append(w.fallbacks)
    torch._dynamo.reset()
    assert lines[0] == [], lines[0]
    assert any("softcap by a tensor or symbolic factor" in f and "changed between two calls" in f
               for f in lines[1]), lines[1]


def test_gemma2_softcapped_attention_kernel_compiles_with_nvrtc():
    """The bf16 Gemma-2 eager-attention step's kernel: every attention call passes the softcap
    (template argument SC 1, the cap as its last argument) and NVRTC compiles it for sm_90a
    with no warning; a Llama step's calls name neither (its kernel text as before)."""
    pytest.importorskip("cuda.bindings")
    import re

    import step_util
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from transformers import Gemma2Config, Gemma2ForCausalLM
    model = hf_tiny._small(Gemma2Config, Gemma2ForCausalLM, 7, head_dim=16, sliding_window=128,
                           attn_implementation="eager", attn_logit_softcapping=50.0).to(torch.bfloat16)
    src = render(step_util.lowered(model)).source
    calls = [c for c in re.findall(r"attention_partial_merge<[^;]*;", src) if "bufs" in c]
    assert len(calls) == model.config.num_hidden_layers, calls
    assert all(re.search(r", 1>\(.*, 50\.0f\);$", c, re.S) for c in calls), calls
    kernel = compile_cuda(src, "fusec_step.cu")
    assert "warning" not in kernel.log, kernel.log
    llama = render(step_util.lowered(hf_tiny.llama().to(torch.bfloat16))).source
    assert not re.search(r"attention_partial_merge<[^;]*0\.0f\);", llama)


# ---- bool masks filled with -inf (nanoGPT's and GPT-2's hand-written attention) -----------

class BoolFilled(torch.nn.Module):
    """Scaled scores with a bool mask applied by filling: ``not``: ``masked_fill(~m, -inf)``
    (m: True attends); ``out``: ``masked_fill(m_out, lowest)`` (m_out: True masks out; the
    dtype's lowest value, as GPT-2's); ``where``: ``torch.where(m, w, -inf)``."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, k, v, m):
        w = (q @ _repeat_kv(k, 2).transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        if self.form == "not":
            w = w.masked_fill(~m, float("-inf"))
        elif self.form == "out":
            w = w.masked_fill(m, torch.finfo(w.dtype).min)
        else:
            w = torch.where(m, w, float("-inf"))
        return F.softmax(w, dim=-1) @ _repeat_kv(v, 2)


@pytest.mark.parametrize("form", ["not", "out", "where"])
def test_a_bool_mask_filled_with_lowest_scores_becomes_sdpas_bool_mask(form):
    """``masked_fill`` / ``torch.where`` of the scores with -inf (or the lowest value) under a
    bool mask (found by trying to break fusec, 2026-12-07: "the graph has no attention call"):
    one SDPA whose bool mask attends where the model's does, the same values."""
    q, k, v = _inputs(7, mask_extra=None)
    g = torch.Generator().manual_seed(8)
    m = torch.rand(1, 1, q.shape[2], k.shape[2], generator=g) < 0.6
    m[..., 0] = True   # every query row attends at least one key
    args = (q, k, v, ~m if form == "out" else m)
    module = BoolFilled(form)
    gm, ex = _dynamo_graph(module, args)
    want = module(*args)
    assert rewrite_eager_attention(gm) == 1
    (sdpa,) = _calls(gm, {F.scaled_dot_product_attention})
    assert not _calls(gm, {"masked_fill", torch.where, "softmax", F.softmax})
    assert sdpa.kwargs["attn_mask"].meta["example_value"].dtype == torch.bool
    torch.testing.assert_close(_first(gm(*ex)), want, rtol=1e-5, atol=1e-6)


class HandWrittenDecode(torch.nn.Module):
    """A hand-written decode step (its own KV buffers, a bool mask of the rows up to the
    position, ``form`` as :class:`BoolFilled`, the position a 1-element tensor)."""

    def __init__(self, form, d=64, heads=4, rows=16):
        super().__init__()
        self.form, self.h, self.hd, self.rows = form, heads, d // heads, rows
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.register_buffer("kc", torch.zeros(1, heads, rows, d // heads))
        self.register_buffer("vc", torch.zeros(1, heads, rows, d // heads))

    def forward(self, x, pos):
        q, k, v = self.qkv(x).view(1, 1, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        self.kc.index_copy_(2, pos, k)
        self.vc.index_copy_(2, pos, v)
        w = torch.matmul(q, self.kc.transpose(2, 3)) * self.hd ** -0.5
        keep = torch.arange(self.rows).view(1, 1, 1, -1) <= pos.view(1, 1, 1, 1)
        if self.form == "not":
            w = w.masked_fill(~keep, float("-inf"))
        elif self.form == "out":
            w = w.masked_fill(torch.arange(self.rows).view(1, 1, 1, -1) > pos.view(1, 1, 1, 1),
                              torch.finfo(w.dtype).min)
        else:
            w = torch.where(keep, w, float("-inf"))
        return self.o(torch.matmul(w.softmax(-1), self.vc).transpose(1, 2).reshape(1, 1, -1))


@pytest.mark.parametrize("form", ["not", "out", "where"])
def test_a_hand_written_decode_step_with_a_filled_bool_mask_compiles_and_matches_eager(form):
    """The hand-written step through ``torch.compile(backend="fusec")`` on the CPU simulator:
    one step compiled, no fallback, 5 positions equal to eager's (fp32, 1e-5)."""
    import copy
    torch.manual_seed(0)
    ours = HandWrittenDecode(form).eval().requires_grad_(False)
    ref = copy.deepcopy(ours)
    torch._dynamo.reset()
    step = torch.compile(ours, backend="fusec")
    with FallbackWatch() as w, torch.no_grad():
        for i in range(5):
            x, pos = torch.randn(1, 1, 64), torch.tensor([i])
            a, b = step(x, pos), ref(x, pos)
            assert ((a - b).norm() / b.norm()).item() < 1e-5, i
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled == 1, (w.fallbacks, w.compiled)


class UnmatchedSoftmax(HandWrittenDecode):
    """:class:`HandWrittenDecode` whose scores are masked by subtracting 1e4 where masked out
    (a form fusec does not match)."""

    def forward(self, x, pos):
        q, k, v = self.qkv(x).view(1, 1, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        self.kc.index_copy_(2, pos, k)
        self.vc.index_copy_(2, pos, v)
        w = torch.matmul(q, self.kc.transpose(2, 3)) * self.hd ** -0.5
        out = (torch.arange(self.rows).view(1, 1, 1, -1) > pos.view(1, 1, 1, 1)).float()
        w = (w - 1e4 * out).softmax(-1)
        return self.o(torch.matmul(w, self.vc).transpose(1, 2).reshape(1, 1, -1))


def test_attention_in_a_form_fusec_does_not_match_falls_back_naming_its_softmax():
    """A softmax over scores that fusec does not take for attention: the fallback line says the
    graph has no attention call fusec recognizes and names the softmax's source line (it said
    only "the graph has no attention call"); the values are eager's."""
    import copy
    torch.manual_seed(0)
    ours = UnmatchedSoftmax("not").eval().requires_grad_(False)
    ref = copy.deepcopy(ours)
    torch._dynamo.reset()
    step = torch.compile(ours, backend="fusec")
    with FallbackWatch() as w, torch.no_grad():
        x, pos = torch.randn(1, 1, 64), torch.tensor([3])
        torch.testing.assert_close(step(x, pos), ref(x, pos))
    torch._dynamo.reset()
    assert len(w.fallbacks) == 1 and "no attention call fusec recognizes (a softmax at" in w.fallbacks[0] \
        and "test_eager_attention.py" in w.fallbacks[0], w.fallbacks
