"""One compiled step for every KV-cache length (issue 29), on the CPU simulator, the way users
call it: a plain loop over StaticCaches of several lengths, HF generate() with several prompt
lengths, fusec.generate; each against eager, with no fallback, counting the steps fusec built."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import hf_tiny
from fusec.fallbacks import FallbackWatch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _loop(model, compiled, length, n, gen):
    """``n`` decode steps on a prefilled StaticCache of ``length`` rows, compiled and eager side
    by side; returns the largest relative error of the logits."""
    caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
    prompt = torch.randint(0, model.config.vocab_size, (1, 3), generator=gen)
    for c in caches:
        model(input_ids=prompt, past_key_values=c, use_cache=True)
    worst = 0.0
    for _ in range(n):
        tok = torch.randint(0, model.config.vocab_size, (1, 1), generator=gen)
        a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
        b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
        rel = _rel(a, b)
        assert rel > 0   # 0 would mean eager ran
        worst = max(worst, rel)
    return worst


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_plain_loop_serves_every_cache_length_with_one_step(kv_heads, steps):
    """torch.compile(model, backend="fusec") called on StaticCaches of five lengths: the first
    length compiles a static step, the second makes dynamo's sizes symbolic and fusec builds ONE
    step for every later length (no third compile), and every step matches eager. MHA models
    (query heads == KV heads) crashed on the second length before (issue 30, item 1)."""
    gen = torch.Generator().manual_seed(5)
    model = hf_tiny.llama(heads=4, kv_heads=kv_heads)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 16, "max_cache_len": 256})
    with FallbackWatch() as w, torch.no_grad():
        for length in (24, 40, 57, 130, 200):
            assert _loop(model, compiled, length, 2, gen) < 1e-4, length
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert len(steps) == 2, [s.graph.lengths for s in steps]
    static, poly = steps
    assert not static.graph.lengths and static.calls == 2
    assert set(poly.graph.lengths.values()) == {256} and poly.calls == 8
    assert len(poly.schedule.graph.lengths) == 1   # the K and V caches' symbols unified (check_lengths)
    kinds = poly.schedule.graph.count_kinds()
    assert kinds["attention_partial"] == kinds["rms_qkv_rope"] == model.config.num_hidden_layers


def _cc(**kw):
    from transformers.generation import CompileConfig
    cc = CompileConfig(backend="fusec", **kw)
    cc._compile_all_devices = True   # HF compiles on CUDA only unless told
    return cc


def _hf_generate_equals_eager(model, cc, calls, seed: int) -> FallbackWatch:
    """HF generate() through ``cc`` for each ``(prompt tokens, new tokens)`` of ``calls``, each
    against HF's eager greedy generate() (tokens equal); the watch over all calls."""
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(seed)
    with FallbackWatch() as w:
        for plen, new in calls:
            prompt = torch.randint(1, 128, (1, plen), generator=gen)
            ref = model.generate(prompt, max_new_tokens=new, do_sample=False, cache_implementation="static")
            out = model.generate(prompt, max_new_tokens=new, do_sample=False, cache_implementation="static",
                                 compile_config=cc)
            assert torch.equal(out, ref), (plen, new)
    return w


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "default"])
def test_hf_generate_with_new_prompt_lengths_compiles_once(dynamic, steps):
    """HF generate() with four prompt lengths and max_new_tokens (each a new StaticCache length):
    tokens equal eager's and fusec builds one step in all: with CompileConfig(dynamic=True)
    through HF's compiled call, with HF's default through fusec's precompiled decode call
    (fusec.frontend.hf_generate: the cache's length symbolic from the first call)."""
    torch._dynamo.reset()
    cc = _cc(dynamic=dynamic, mode=None, options={"num_sms": 16, "max_cache_len": 512})
    w = _hf_generate_equals_eager(hf_tiny.llama(), cc, ((5, 6), (37, 9), (12, 20), (90, 5)), seed=11)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert len(steps) == 1, [s.graph.lengths for s in steps]
    assert steps[-1].graph.lengths and not steps[-1].fallen_back


@pytest.mark.parametrize("lookup", [0, 3], ids=["greedy", "prompt-lookup"])
def test_fusec_generate_one_step_for_every_length(lookup, steps):
    """fusec.generate with several prompt lengths and max_new_tokens (each a new StaticCache
    length): one traced graph and one step (its cache's length is symbolic), tokens equal HF's
    eager greedy generate(). With prompt lookup (``lookup`` N: steps of K = N + 1 query tokens;
    prompts that repeat, so that drafts are found) likewise: HF's causal mask of the K tokens,
    built from the cache's rows, is proven ``row <= pos[k]`` and replaced by the K write
    positions (``mask_kind`` 3, passes/recognize.py), which leaves no length outside the caches."""
    import fusec
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(13 + lookup)
    cases = ((4, 5), (70, 6), (9, 12), (150, 4)) if not lookup else ((6, 5), (75, 6), (20, 7))
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    with FallbackWatch() as w:
        for plen, new in cases:
            prompt = torch.randint(0, 128, (1, plen), generator=gen)
            if lookup:
                prompt[0, plen // 2:] = prompt[0, : plen - plen // 2].clone()   # repeats: drafts to look up
            out = fusec.generate(model, prompt, max_new_tokens=new, eos_token_id=[],
                                 options={"num_sms": 16, "max_cache_len": 512}, **extra)
            ref = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 cache_implementation="static")
            assert torch.equal(out, ref), (plen, new)
    assert not w.fallbacks, w.fallbacks
    assert len(steps) == 1 and steps[0].graph.lengths, [s.graph.lengths for s in steps]
    if lookup:
        att = [o for o in steps[0].schedule.graph.ops if o.kind == "attention_partial"]
        assert att and all(o.attrs["mask_kind"] == 3 and o.inputs["mask"] == o.inputs["pos"] for o in att)


class _Toy(torch.nn.Module):
    """A decode step over a static KV cache with a causal mask built from the cache's length;
    ``scale_by_length`` also multiplies the output by the length (a use of the length as a value
    that one compiled step cannot serve for every length)."""

    def __init__(self, scale_by_length: bool):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))
        self.scale_by_length = scale_by_length

    def forward(self, x, pos, kc, vc):
        q = self.q(x).view(1, 1, 1, 16)
        kc.index_copy_(2, pos, self.k(x).view(1, 1, 1, 16))
        vc.index_copy_(2, pos, self.v(x).view(1, 1, 1, 16))
        mask = (torch.arange(kc.shape[2]) <= pos).view(1, 1, 1, -1)
        o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        return o * kc.shape[2] if self.scale_by_length else o


@pytest.mark.parametrize("scale_by_length", [False, True], ids=["polymorphic", "length-as-value"])
def test_a_step_using_its_length_as_a_value_compiles_per_length(scale_by_length, steps, caplog):
    """dynamic=True from the first call: a step whose length only sizes the cache (and a causal
    mask, proven causal at the capacity) is one compiled step; one that also multiplies by the
    length falls back to one step per length (check_lengths names the op), and both match eager."""
    model = _Toy(scale_by_length)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", dynamic=True, options={"num_sms": 8, "max_cache_len": 128})
    gen = torch.Generator().manual_seed(2)
    with FallbackWatch() as w, torch.no_grad(), caplog.at_level(logging.INFO, logger="fusec"):
        for length in (20, 33, 60):
            caches = [torch.randn(1, 1, length, 16, generator=gen) for _ in range(2)]
            for p in (0, length // 2, length - 1):
                x, pos = torch.randn(1, 1, 16, generator=gen), torch.tensor([p])
                a = compiled(x, pos, *caches[:2])
                b = model(x, pos, *[c.clone() for c in caches])
                assert _rel(a, b) < 1e-5, (length, p)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    per_length = "no single step for every cache length" in caplog.text
    assert per_length == scale_by_length
    assert len(steps) == (1 + 3 if scale_by_length else 1)   # the symbolic one refused, then one per length


def test_a_mask_grown_each_step_compiles_per_length_and_says_which_input(steps, caplog):
    """A batch's ``attention_mask`` grown by a column each step (``[B, T + s]``, HF's usual idiom
    outside generate()) has a size that is not the cache's rows: fusec compiles one step per
    length, every call matching eager, and its log line names the caller's input and what to pass
    instead (the mask over the cache's full length), not only the ATen graph's names."""
    model = hf_tiny.llama(layers=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    gen = torch.Generator().manual_seed(5)
    b, t, length = 2, 4, 32
    caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
    mask = torch.ones(b, length, dtype=torch.long)
    prompt = torch.randint(1, 100, (b, t), generator=gen)
    with torch.no_grad():
        for c in caches:
            model(input_ids=prompt, attention_mask=mask[:, :t], past_key_values=c, use_cache=True)
        with FallbackWatch() as w, caplog.at_level(logging.INFO, logger="fusec"):
            for s in range(2):
                kw = dict(input_ids=torch.randint(1, 100, (b, 1), generator=gen), attention_mask=mask[:, :t + s + 1],
                          use_cache=True)
                a = compiled(past_key_values=caches[0], **kw).logits
                e = model(past_key_values=caches[1], **kw).logits
                assert 0 < _rel(a, e) < 1e-5
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
    line = next(r.getMessage() for r in caplog.records if "no single step for every cache length" in r.getMessage())
    assert "attention_mask" in line and "full length" in line, line


def test_a_longer_cache_than_the_capacity_builds_the_step_again(steps, caplog):
    """max_cache_len 64: caches of 24 and 40 rows share one step; a 100-row cache builds it again
    for a larger capacity (one log line) and still matches eager."""
    gen = torch.Generator().manual_seed(8)
    model = hf_tiny.llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", dynamic=True, options={"num_sms": 16, "max_cache_len": 64})
    with FallbackWatch() as w, torch.no_grad(), caplog.at_level(logging.INFO, logger="fusec"):
        for length in (24, 40, 100):
            assert _loop(model, compiled, length, 2, gen) < 1e-4, length
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert "longer than the step's capacity 64" in caplog.text
    (step,) = steps
    assert min(step.graph.lengths.values()) >= 100


# --- a breaker's repros (review of issue 29) ---------------------------------------------------

def test_a_sliding_window_family_at_new_cache_lengths_stays_in_fusec(steps):
    """Mistral with a sliding window (never full here) on StaticCaches of three lengths: dynamo's
    second trace has the cache length symbolic beside the layers' Python position counters. The
    host split used to refuse such a graph (the ``Sym(s53)`` inputs taken for host scalars), and
    every length after the first ran eagerly ("graph output is not a tensor"). The counters are
    split off again (the sizes stay in the tensor graph) and each step runs in fusec."""
    gen = torch.Generator().manual_seed(21)
    model = hf_tiny.mistral_sw(window=128)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 16, "max_cache_len": 256})
    with FallbackWatch() as w, torch.no_grad():
        for length in (33, 40, 60):
            assert _loop(model, compiled, length, 2, gen) < 1e-4, length
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert steps and not any(s.fallen_back for s in steps)


def test_hf_generate_on_a_sliding_window_family_with_dynamic_true_compiles_once(steps):
    """Gemma-2 (sliding and full layers) under HF generate() with CompileConfig(dynamic=True) and
    three prompt lengths: one step in all, tokens equal eager's (before: every step fell back)."""
    torch._dynamo.reset()
    cc = _cc(dynamic=True, mode=None, options={"num_sms": 16, "max_cache_len": 128})
    w = _hf_generate_equals_eager(hf_tiny.gemma2(), cc, ((5, 6), (40, 5), (20, 9)), seed=23)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert len(steps) == 1 and steps[0].graph.lengths, [s.graph.lengths for s in steps]


def test_a_step_compiled_per_length_under_dynamic_true_keeps_its_floats(steps):
    """dynamic=True with a 2-D attention_mask of the cache's length (zeros in it): the mask makes
    the step one per length, and each per-length capture runs outside dynamo, where the .item()
    of the floats dynamo passes as 0-d tensors (RMSNorm's eps) raised DataDependentOutputException
    and the graph fell back to eager. Now each length compiles in fusec and matches eager."""
    import copy
    gen = torch.Generator().manual_seed(25)
    model = hf_tiny.llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", dynamic=True, options={"num_sms": 16, "max_cache_len": 256})
    with FallbackWatch() as w, torch.no_grad():
        for length in (40, 33):
            ca = hf_tiny.static_cache(model, length)
            mask = torch.ones(1, length, dtype=torch.long)
            mask[0, :2] = 0
            model(input_ids=torch.randint(0, 128, (1, 8), generator=gen), attention_mask=mask[:, :8],
                  past_key_values=ca, use_cache=True)
            cb = copy.deepcopy(ca)
            for p in (8, 9):
                tok = torch.randint(0, 128, (1, 1), generator=gen)
                kw = dict(attention_mask=mask, cache_position=torch.tensor([p]), position_ids=torch.tensor([[p - 2]]))
                a = compiled(input_ids=tok, past_key_values=ca, use_cache=True, **kw).logits
                b = model(input_ids=tok, past_key_values=cb, use_cache=True, **kw).logits
                assert 0 < _rel(a, b) < 1e-4, (length, p)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert len(steps) >= 2 and not any(s.fallen_back for s in steps)


class _TwoCaches(torch.nn.Module):
    """Two attentions over two caches whose lengths dynamo keeps apart (A and B)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))

    def _att(self, x, pos, kc, vc, q, k, v):
        kc.index_copy_(2, pos, k(x).view(1, 1, 1, 16))
        vc.index_copy_(2, pos, v(x).view(1, 1, 1, 16))
        mask = (torch.arange(kc.shape[2]) <= pos).view(1, 1, 1, -1)
        return F.scaled_dot_product_attention(q(x).view(1, 1, 1, 16), kc, vc, attn_mask=mask)

    def forward(self, x, pos, k1, v1, k2, v2):
        a = self._att(x, pos, k1, v1, *self.lin[:3])
        return self._att(a.view(1, 1, 16), pos, k2, v2, *self.lin[3:])


def test_a_recapture_keeps_apart_the_lengths_dynamo_keeps_apart(tmp_path, monkeypatch, steps):
    """A warm-started step (artifact cache on) meeting a longer cache captures again over fake
    inputs made from that call. With duck sizing, two lengths that dynamo keeps apart but that
    are equal at that call (A = B = 100) became one symbol, and the next call with A != B raised
    FusecError ("every tensor of one length must agree"). The fakes now take dynamo's symbols."""
    monkeypatch.setenv("FUSEC_CACHE", "1")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    model = _TwoCaches()
    gen = torch.Generator().manual_seed(4)

    def run(compiled, lengths):
        for a_len, b_len in lengths:
            caches = [torch.randn(1, 1, n, 16, generator=gen) for n in (a_len, a_len, b_len, b_len)]
            x, pos = torch.randn(1, 1, 16, generator=gen), torch.tensor([min(a_len, b_len) - 1])
            ref = model(x, pos, *[c.clone() for c in caches])
            assert _rel(compiled(x, pos, *caches), ref) < 1e-5, (a_len, b_len)

    opts = {"num_sms": 8, "max_cache_len": 64}
    with FallbackWatch() as w, torch.no_grad():
        for lengths in (((20, 30),), ((20, 30), (100, 100), (20, 30), (40, 90))):   # cold, then warm
            torch._dynamo.reset()
            run(torch.compile(model, backend="fusec", dynamic=True, options=opts), lengths)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert len(steps) == 3   # cold, warm start, the recapture at the larger capacity
    assert len(steps[-1].graph.lengths) == 2 and min(steps[-1].graph.lengths.values()) >= 100


def test_values_of_another_head_size_than_the_keys():
    """K head size 16, V head size 8 (HF's StaticLayer keeps k_head_dim and v_head_dim apart): the
    fused attention kinds take one head size, so such an attention stays a generic op (the
    simulator crashed in attention_partial before: "The expanded size of the tensor (16) must
    match the existing size (8)"); static and symbolic lengths match eager."""
    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.q, self.k, self.v = torch.nn.Linear(32, 64), torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)
            self.o = torch.nn.Linear(32, 32)

        def forward(self, x, pos, kc, vc):
            kc.index_copy_(2, pos, self.k(x).view(1, 1, 2, 16).transpose(1, 2))
            vc.index_copy_(2, pos, self.v(x).view(1, 1, 2, 8).transpose(1, 2))
            mask = (torch.arange(kc.shape[2]) <= pos).view(1, 1, 1, -1)
            q = self.q(x).view(1, 1, 4, 16).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
            return self.o(o.transpose(1, 2).reshape(1, 1, 32))

    model = Step()
    gen = torch.Generator().manual_seed(6)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8, "max_cache_len": 64})
    with FallbackWatch() as w, torch.no_grad():
        for length in (20, 33, 40):
            caches = [torch.randn(1, 2, length, 16, generator=gen), torch.randn(1, 2, length, 8, generator=gen)]
            for p in (0, length - 1):
                x, pos = torch.randn(1, 1, 32, generator=gen), torch.tensor([p])
                ref = model(x, pos, *[c.clone() for c in caches])
                assert _rel(compiled(x, pos, *caches), ref) < 1e-5, (length, p)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


@pytest.mark.parametrize("family", ["phi2", "gpt2"])
def test_gelu_new_under_dynamic_true_stays_in_fusec(family, steps):
    """GPT-2 and Phi-2 (gelu_new: math.sqrt(2.0 / math.pi)) with dynamic=True: dynamo passes the
    float as a 0-d tensor and divides it with aten.true_divide.Tensor, which fusec did not accept:
    the whole step fell back to inductor at every length. Phi-2 is now one step for every length;
    GPT-2 one per length (its mask stays a computed input: the position counter also indexes the
    learned position embedding)."""
    gen = torch.Generator().manual_seed(27)
    model = getattr(hf_tiny, family)()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", dynamic=True, options={"num_sms": 16, "max_cache_len": 128})
    with FallbackWatch() as w, torch.no_grad():
        for length in (33, 40):
            assert _loop(model, compiled, length, 2, gen) < 1e-4, length
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert steps and not any(s.fallen_back for s in steps)
    if family == "phi2":
        assert len(steps) == 1 and steps[0].graph.lengths


class _ParityMask(torch.nn.Module):
    """A decode step whose mask uses the cache length as a value (``ar >= L % 2``): causal at
    an even capacity, not at an odd length (a reviewer's contrived case)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x, pos, kc, vc):
        q = self.q(x).view(1, 1, 1, 16)
        kc.index_copy_(2, pos, self.k(x).view(1, 1, 1, 16))
        vc.index_copy_(2, pos, self.v(x).view(1, 1, 1, 16))
        ar = torch.arange(kc.shape[2])
        mask = ((ar <= pos) & (ar >= kc.shape[2] % 2)).view(1, 1, 1, -1)
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)


def test_a_mask_using_the_length_as_a_value_is_not_proven_causal():
    """recognize proves a mask causal at the capacity only where the length merely sizes it
    (arange from 0, views): this mask's ``L % 2`` keeps it out, and odd lengths match eager."""
    model = _ParityMask()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", dynamic=True, options={"num_sms": 8, "max_cache_len": 128})
    gen = torch.Generator().manual_seed(3)
    with FallbackWatch() as w, torch.no_grad():
        for length in (20, 33, 61):
            caches = [torch.randn(1, 1, length, 16, generator=gen) for _ in range(2)]
            for p in (1, length - 1):
                x, pos = torch.randn(1, 1, 16, generator=gen), torch.tensor([p])
                a = compiled(x, pos, *caches[:2])
                b = model(x, pos, *[c.clone() for c in caches])
                assert _rel(a, b) < 1e-5, (length, p, _rel(a, b))
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3], ids=["llama", "qwen3"])
def test_precompiled_paths_pass_gqa_to_sdpa_and_equal_eager(factory, tmp_path, monkeypatch, steps):
    """With the artifact cache on (the default outside the tests), fusec.generate and HF
    generate() trace their decode step themselves (PrecompiledStep) with HF's SDPA taking
    grouped-query K and V (fusec.frontend.hf_sdpa: no repeat_kv, whose symbolic-size ops were
    half of the symbolic trace's time): the captured graph has no K/V expand, the step has the
    same fused kinds, and the tokens equal HF's eager greedy generate() over several lengths,
    with generate()'s 4-D mask too (its own loop, ``generate_loop="hf"``: by default generate()
    runs fusec.generate's step)."""
    import fusec
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    model = factory(layers=2)   # 4 query heads, 2 KV heads
    model.generation_config.pad_token_id = 0
    opts = {"num_sms": 16, "max_cache_len": 512, "cache": True}
    gen = torch.Generator().manual_seed(17)
    with FallbackWatch() as w:
        for plen, new in ((6, 5), (41, 4)):
            prompt = torch.randint(1, 128, (1, plen), generator=gen)
            ref = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 cache_implementation="static")
            out = fusec.generate(model, prompt, max_new_tokens=new, eos_token_id=[], options=opts)
            assert torch.equal(out, ref), ("fusec.generate", plen)
            out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 cache_implementation="static",
                                 compile_config=_cc(mode=None, options={**opts, "generate_loop": "hf"}))
            assert torch.equal(out, ref), ("HF generate", plen)
    assert not w.fallbacks, w.fallbacks
    assert len(steps) == 2, [s.graph.lengths for s in steps]   # one per path, every length
    for s in steps:
        sdpa = [o for o in s.graph.ops if o.kind == "fusec.sdpa.default"]
        assert [o.attrs["args"][-1] for o in sdpa] == [True, True]   # enable_gqa: no repeat_kv
        kinds = s.schedule.graph.count_kinds()
        assert kinds["attention_partial"] == kinds["rms_qkv_rope"] == model.config.num_hidden_layers
