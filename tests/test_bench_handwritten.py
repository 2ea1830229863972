"""The benchmark's hand-written decode step (benchmarks/gptfast_llama.py) against HF eager.

CPU, fp32, a tiny Llama with llama3 RoPE scaling and grouped-query attention: at several
positions, with the same random StaticCache contents, the hand-written step's logits and the
K/V row it writes must match the HF model's.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hf_tiny

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gptfast_llama  # noqa: E402

MAX_LEN = 48


def _fill(cache, position: int, seed: int) -> None:
    """Fresh random K/V contents in every layer (never zeros) and the position counter."""
    gen = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
        layer.cumulative_length.fill_(position)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def model_and_cache():
    model = hf_tiny.llama(hidden=64, inter=96, layers=2, heads=8, kv_heads=2, head_dim=16, vocab=128)
    cache = hf_tiny.static_cache(model, MAX_LEN)
    with torch.no_grad():   # allocates the cache layers
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
    return model, cache


@pytest.mark.parametrize("attention,fuse",
                         [(a, False) for a in gptfast_llama.ATTENTION_MODES] + [("math", True)])
def test_handwritten_step_matches_hf_eager(model_and_cache, attention, fuse):
    model, cache = model_and_cache
    step = gptfast_llama.HandwrittenLlamaDecode(model, cache, attention=attention, fuse=fuse)
    assert gptfast_llama.shares_weights(step, model)
    assert step.layers[0].wq is model.model.layers[0].self_attn.q_proj.weight
    assert step.layers[0].k_cache is cache.layers[0].keys
    for i, pos in enumerate([0, 1, 17, MAX_LEN - 1]):
        tok = torch.tensor([[(37 * i + 5) % 128]])
        _fill(cache, pos, seed=i)
        with torch.no_grad():
            ref = model(input_ids=tok, past_key_values=cache, use_cache=True).logits.clone()
        ref_kv = [(c.keys.clone(), c.values.clone()) for c in cache.layers]
        _fill(cache, pos, seed=i)
        with torch.no_grad():
            got = step(tok, torch.tensor([pos]))
        assert got.shape == ref.shape == (1, 1, 128)
        assert _rel(got, ref) < 1e-4, (attention, fuse, pos)
        for c, (k, v) in zip(cache.layers, ref_kv):
            assert _rel(c.keys, k) < 1e-5 and _rel(c.values, v) < 1e-5
            assert int(c.cumulative_length) == pos          # the step leaves HF's counter alone


@pytest.mark.parametrize("attention", gptfast_llama.ATTENTION_MODES)
def test_handwritten_step_is_position_sensitive(model_and_cache, attention):
    """The mask and RoPE really depend on input_pos (a wrong position must show)."""
    model, cache = model_and_cache
    step = gptfast_llama.HandwrittenLlamaDecode(model, cache, attention=attention)
    tok = torch.tensor([[9]])
    outs = []
    for pos in (10, 11):
        _fill(cache, 20, seed=5)
        with torch.no_grad():
            outs.append(step(tok, torch.tensor([pos])))
    assert _rel(outs[0], outs[1]) > 1e-3


def test_rejects_unallocated_cache():
    model = hf_tiny.llama()
    with pytest.raises(ValueError, match="not allocated"):
        gptfast_llama.HandwrittenLlamaDecode(model, hf_tiny.static_cache(model, 16))
