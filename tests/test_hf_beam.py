"""HF generate()'s beam search with a fusec CompileConfig runs each decode step through fusec's
compiled step (fusec/frontend/hf_beam.py), on the CPU simulator: its sequences equal eager beam
search's for left-padded batches and several returned sequences, every decode step is the compiled
call, the static cache keeps its tensors (reordered in place), and a call generate() would not
compile keeps HF's plain forward."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch
from fusec.frontend import hf_generate


def _cc(**options):
    from transformers.generation import CompileConfig
    cc = CompileConfig(backend="fusec", options=options or None)
    cc._compile_all_devices = True   # HF compiles on CUDA only unless told (this machine has no GPU)
    return cc


class _Spy:
    """Counts the calls of HFDecodeCall (generate()'s compiled decode call) and records the
    first layer's key buffer of each call."""

    def __init__(self, monkeypatch):
        self.rows, self.keys = [], []
        original = hf_generate.HFDecodeCall.__call__

        def call(this, **kwargs):
            self.rows.append(tuple(kwargs["input_ids"].shape))
            layer = kwargs["past_key_values"].layers[0]
            self.keys.append((id(layer.keys), layer.keys.data_ptr()))
            return original(this, **kwargs)
        monkeypatch.setattr(hf_generate.HFDecodeCall, "__call__", call)


@pytest.mark.parametrize("beams,returned", [(3, 1), (2, 2)])
def test_beam_search_runs_its_decode_steps_through_fusec(monkeypatch, beams, returned):
    """Two prompts, one left-padded, ``num_beams`` beams each (a batch step of 2 * beams rows):
    the sequences (``num_return_sequences`` of them per prompt) equal eager beam search's on the
    same static cache implementation; no fallback, one compile; every decode step after the
    prefill is the compiled call on ``[2 * beams, 1]`` ids, and the cache's key buffer is the same
    tensor at the same address at every step (beams gathered in place)."""
    model = hf_tiny.llama()
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(3 + beams)
    prompt = torch.randint(1, 128, (2, 6), generator=gen)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    kw = dict(attention_mask=mask, num_beams=beams, num_return_sequences=returned, max_new_tokens=7,
              do_sample=False, cache_implementation="static", length_penalty=0.5)
    ref = model.generate(prompt, **kw)
    spy = _Spy(monkeypatch)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = model.generate(prompt, compile_config=_cc(), **kw)
    torch._dynamo.reset()
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())
    assert out.shape[0] == 2 * returned
    assert w.compiled == 1 and not w.fallbacks, (w.compiled, w.fallbacks)
    assert spy.rows == [(2 * beams, 1)] * 6, spy.rows   # 7 new tokens: the prefill's, then 6 steps
    assert len(set(spy.keys)) == 1, spy.keys


def test_beam_search_that_generate_would_not_compile_keeps_the_plain_forward(monkeypatch):
    """A fusec CompileConfig with a dynamic cache (not compileable): HF's beam search with its
    plain forward, as without fusec; the sequences equal eager's and nothing compiles."""
    model = hf_tiny.llama()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(9))
    kw = dict(num_beams=2, max_new_tokens=5, do_sample=False)
    ref = model.generate(prompt, **kw)
    spy = _Spy(monkeypatch)
    with FallbackWatch() as w:
        out = model.generate(prompt, compile_config=_cc(), **kw)
    assert torch.equal(out, ref)
    assert not spy.rows and not w.compiled


def test_reorder_gathers_a_static_cache_in_place():
    """``_BeamModel._reorder_cache`` on a static cache: each layer's keys and values hold the rows
    ``beam_idx`` names, in the tensors they were (what transformers' own reorder gives, in new
    tensors)."""
    from transformers import StaticCache

    from fusec.frontend.hf_beam import _BeamModel
    model = hf_tiny.llama()
    cache = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 128, (4, 3), generator=torch.Generator().manual_seed(1)),
              past_key_values=cache)
    ref = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        model(input_ids=torch.zeros(4, 1, dtype=torch.long), past_key_values=ref)
    for a, b in zip(ref.layers, cache.layers):
        a.keys.copy_(b.keys)
        a.values.copy_(b.values)
    idx = torch.tensor([2, 2, 0, 3])
    ref.reorder_cache(idx)
    before = [(layer.keys, layer.values) for layer in cache.layers]
    assert _BeamModel(model, call=None)._reorder_cache(cache, idx) is cache
    for (k, v), layer, r in zip(before, cache.layers, ref.layers):
        assert layer.keys is k and layer.values is v
        assert torch.equal(k, r.keys) and torch.equal(v, r.values)
