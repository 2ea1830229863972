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


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "default"])
def test_hf_generate_with_new_prompt_lengths_compiles_once(dynamic, steps):
    """HF generate() with four prompt lengths and max_new_tokens (each a new StaticCache length):
    tokens equal eager's. With CompileConfig(dynamic=True) fusec builds one step in all; with
    HF's default, two (the first length's static graph, then one symbolic step)."""
    model = hf_tiny.llama()
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(11)
    torch._dynamo.reset()
    cc = _cc(dynamic=dynamic, mode=None, options={"num_sms": 16, "max_cache_len": 512})
    with FallbackWatch() as w:
        for plen, new in ((5, 6), (37, 9), (12, 20), (90, 5)):
            prompt = torch.randint(1, 128, (1, plen), generator=gen)
            ref = model.generate(prompt, max_new_tokens=new, do_sample=False, cache_implementation="static")
            out = model.generate(prompt, max_new_tokens=new, do_sample=False, cache_implementation="static",
                                 compile_config=cc)
            assert torch.equal(out, ref), (plen, new)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert len(steps) == (1 if dynamic else 2), [s.graph.lengths for s in steps]
    assert steps[-1].graph.lengths and not steps[-1].fallen_back


def test_fusec_generate_one_step_for_every_length(steps):
    """fusec.generate with four prompt lengths and max_new_tokens: one traced graph and one
    step (its cache's length is symbolic), tokens equal HF's eager greedy generate()."""
    import fusec
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(13)
    with FallbackWatch() as w:
        for plen, new in ((4, 5), (70, 6), (9, 12), (150, 4)):
            prompt = torch.randint(0, 128, (1, plen), generator=gen)
            out = fusec.generate(model, prompt, max_new_tokens=new, eos_token_id=[],
                                 options={"num_sms": 16, "max_cache_len": 512})
            ref = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 cache_implementation="static")
            assert torch.equal(out, ref), (plen, new)
    assert not w.fallbacks, w.fallbacks
    assert len(steps) == 1 and steps[0].graph.lengths, [s.graph.lengths for s in steps]


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
