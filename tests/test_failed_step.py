"""A failed step loses nothing (issue 30, item 2): after an out-of-range token id (or a negative
one, item 3) or a decode past the cache's length, the simulator's step raises, the caller's cache
is as it was, and later steps, with the same cache or a fresh one and a new torch.compile
wrapper, run and match eager (no DeadlockError)."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.errors import FusecError
from fusec.fallbacks import FallbackWatch


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_a_bad_token_id_leaves_the_cache_and_the_step_as_they_were():
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(4)
    caches = [hf_tiny.static_cache(model, 32) for _ in range(2)]
    prompt = torch.randint(0, 128, (1, 4), generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
    with FallbackWatch() as w, torch.no_grad():
        for c in caches:
            model(input_ids=prompt, past_key_values=c, use_cache=True)
        tok = torch.randint(0, 128, (1, 1), generator=gen)
        a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
        b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
        assert 0 < _rel(a, b) < 1e-4
        before = [(l.keys.clone(), l.values.clone(), l.cumulative_length.clone()) for l in caches[0].layers]
        for bad in (128, -1, 10**6):
            with pytest.raises(FusecError, match="out of range"):
                compiled(input_ids=torch.tensor([[bad]]), past_key_values=caches[0], use_cache=True)
            with pytest.raises(IndexError):   # eager refuses it too
                model(input_ids=torch.tensor([[bad]]), past_key_values=caches[1], use_cache=True)
        for layer, (k, v, n) in zip(caches[0].layers, before):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
            assert torch.equal(layer.cumulative_length, n)
        for _ in range(3):
            tok = torch.randint(0, 128, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            assert 0 < _rel(a, b) < 1e-4
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


def test_a_decode_past_the_cache_length_does_not_poison_the_process():
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(6)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
    with torch.no_grad():
        cache = hf_tiny.static_cache(model, 8)
        model(input_ids=torch.randint(0, 128, (1, 6), generator=gen), past_key_values=cache, use_cache=True)
        for _ in range(2):   # rows 6 and 7: the cache is full
            compiled(input_ids=torch.randint(0, 128, (1, 1), generator=gen), past_key_values=cache, use_cache=True)
        with pytest.raises(FusecError, match="out of range"):
            compiled(input_ids=torch.randint(0, 128, (1, 1), generator=gen), past_key_values=cache, use_cache=True)
        caches = [hf_tiny.static_cache(model, 8) for _ in range(2)]
        prompt = torch.randint(0, 128, (1, 3), generator=gen)
        for c in caches:
            model(input_ids=prompt, past_key_values=c, use_cache=True)
        again = torch.compile(model, backend="fusec", options={"num_sms": 8})   # dynamo reuses the step
        for _ in range(2):
            tok = torch.randint(0, 128, (1, 1), generator=gen)
            a = again(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            assert 0 < _rel(a, b) < 1e-4
    torch._dynamo.reset()


def test_gpt2_decode_past_the_cache_length_faults_in_the_cache_epilogue(steps):
    """GPT-2's k/v cache rows are written by its c_attn ``matvec_cols`` tiles (the cache epilogue,
    fusec/instructions/kv_epilogue.py), not by a ``kv_write``: a decode past the cache's length is
    fault KV_POS there too (a clear error, the cache untouched), and the process goes on."""
    model = hf_tiny.gpt2()
    gen = torch.Generator().manual_seed(8)
    vocab = model.config.vocab_size
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
    with FallbackWatch() as w, torch.no_grad():
        caches = [hf_tiny.static_cache(model, 8) for _ in range(2)]
        prompt = torch.randint(0, vocab, (1, 6), generator=gen)
        for c in caches:
            model(input_ids=prompt, past_key_values=c, use_cache=True)
        for _ in range(2):   # rows 6 and 7: the cache is full
            tok = torch.randint(0, vocab, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            assert 0 < _rel(a, b) < 1e-4
        assert any(o.kind == "matvec_cols" and o.attrs.get("kv_cols") for s in steps for o in s.schedule.graph.ops), \
            "GPT-2's k/v rows are not written by the matvec_cols cache epilogue"
        before = [(l.keys.clone(), l.values.clone(), l.cumulative_length.clone()) for l in caches[0].layers]
        with pytest.raises(FusecError, match="KV-cache write position.*out of range"):
            compiled(input_ids=torch.randint(0, vocab, (1, 1), generator=gen), past_key_values=caches[0],
                     use_cache=True)
        for layer, (k, v, n) in zip(caches[0].layers, before):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
            assert torch.equal(layer.cumulative_length, n)
        fresh = [hf_tiny.static_cache(model, 8) for _ in range(2)]
        for c in fresh:
            model(input_ids=prompt[:, :3], past_key_values=c, use_cache=True)
        tok = torch.randint(0, vocab, (1, 1), generator=gen)
        a = compiled(input_ids=tok, past_key_values=fresh[0], use_cache=True).logits
        b = model(input_ids=tok, past_key_values=fresh[1], use_cache=True).logits
        assert 0 < _rel(a, b) < 1e-4
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
