"""Regressions found in review (2026-12-01), on the CPU simulator: a float attention_mask and
inputs_embeds are read every step (caller tensors are INPUTs, never folded), token ids that
reach the embedding through an op are not position counters, a copy of an input the step
writes keeps the old value, and a mask decides over every cache row (rows past the position,
every row masked)."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch


def _prefilled(model, length, prompt, seed=3):
    gen = torch.Generator().manual_seed(seed)
    caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
    p = torch.randint(0, model.config.vocab_size, (1, prompt), generator=gen)
    with torch.no_grad():
        for c in caches:
            model(input_ids=p, past_key_values=c, use_cache=True)
    return caches, gen


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def test_float_attention_mask_is_read_every_step_not_frozen():
    """A float 2-D attention_mask (ones/zeros as float, as some callers pass it) is a float
    graph input, so from_fx gives it Role.WEIGHT; being small, position.dependence treats it as
    a known value, so the mask (now depending only on the new INPUT counter cache_position) is
    tabulated with the FIRST call's attention_mask. Later steps attend with a stale mask.
    (At 28004cf this graph fell back and was correct.)"""
    model = hf_tiny.llama()
    length = 24
    (ours, ref), gen = _prefilled(model, length, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 16})
    errs = []
    with FallbackWatch(), torch.no_grad():
        for i in range(4):
            tok = torch.randint(0, 128, (1, 1), generator=gen)
            am = torch.zeros(1, length, dtype=torch.float32)
            am[:, :5 + i] = 1
            a = compiled(input_ids=tok, past_key_values=ours, use_cache=True, attention_mask=am).logits
            b = model(input_ids=tok, past_key_values=ref, use_cache=True, attention_mask=am).logits
            errs.append(_rel(a, b))
    torch._dynamo.reset()
    assert max(errs) < 1e-4, errs


class _Int32Ids(torch.nn.Module):
    """A wrapper that takes int32 token ids and casts them (the ids reach the embedding
    through an op, not directly)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, cache):
        return self.model(input_ids=ids.long(), past_key_values=cache, use_cache=True).logits


def test_token_ids_that_reach_embedding_through_an_op_are_not_position_counters():
    """position.counters() now takes every 1-element integer INPUT that token_inputs() does not
    see as an embedding index. ids.long() hides the ids from token_inputs (it only looks at the
    embedding's direct input), so the ids become a 'position counter' and the embedding is
    tabulated over [0, L): a token >= L fails (IndexError in the simulator, an index fault on
    the GPU) and the simulator deadlocks at the next call. At 28004cf this worked."""
    model = hf_tiny.llama()
    (ours, ref), _ = _prefilled(model, 24, 4)
    torch._dynamo.reset()
    compiled = torch.compile(_Int32Ids(model), backend="fusec", options={"num_sms": 16})
    with torch.no_grad():
        for t in (3, 100, 5):   # 100 >= L = 24
            tok = torch.tensor([[t]], dtype=torch.int32)
            a = compiled(tok, ours)
            b = _Int32Ids(model)(tok, ref)
            assert _rel(a, b) < 1e-4, t
    torch._dynamo.reset()


class _ShiftTokens(torch.nn.Module):
    """Greedy step that keeps the previous token: prev <- tokens (old value), tokens <- next."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, prev, cache):
        logits = self.model(input_ids=tokens, past_key_values=cache, use_cache=True).logits
        nxt = logits[:, -1].argmax(-1)
        prev.copy_(tokens)
        tokens.copy_(nxt.view(1, 1))
        return nxt


def test_functional_copy_of_a_mutated_input_is_not_an_alias():
    """normalize aliases ``aten.copy(prev, tokens)`` to ``tokens``; the epilogue
    ``copy_(tokens, next)`` runs first (input order), so ``copy_(prev, <alias of tokens>)``
    then copies the NEW token: prev == tokens after every step, eager keeps the old one."""
    model = hf_tiny.qwen3()
    (ours, ref), _ = _prefilled(model, 24, 4)
    torch._dynamo.reset()
    compiled = torch.compile(_ShiftTokens(model), backend="fusec", options={"num_sms": 16})
    t1, t2 = torch.tensor([[17]]), torch.tensor([[17]])
    p1, p2 = torch.tensor([[0]]), torch.tensor([[0]])
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(3):
            compiled(t1, p1, ours)
            _ShiftTokens(model)(t2, p2, ref)
            assert int(t1) == int(t2)
            assert int(p1) == int(p2), (int(p1), int(p2))
    torch._dynamo.reset()
    assert not w.fallbacks


def test_inputs_embeds_are_not_folded_or_tabulated():
    """inputs_embeds [1, 1, H] is a float graph input -> Role.WEIGHT; with H <= 65536 it is a
    'small weight': fold_constants folds the first layer's RMSNorm arithmetic on it into
    constants taken at the first call (1e-2 relative error from the 2nd step on; the
    position tables already made it 4e-4 at 28004cf)."""
    model = hf_tiny.llama()
    (ours, ref), gen = _prefilled(model, 24, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 16})
    errs = []
    with FallbackWatch(), torch.no_grad():
        for _ in range(3):
            emb = torch.randn(1, 1, 64, generator=gen)
            a = compiled(inputs_embeds=emb, past_key_values=ours, use_cache=True).logits
            b = model(inputs_embeds=emb, past_key_values=ref, use_cache=True).logits
            errs.append(_rel(a, b))
    torch._dynamo.reset()
    assert max(errs) < 1e-4, errs


@pytest.mark.parametrize("kind", ["admits_rows_past_pos", "masks_every_row"])
def test_masked_attention_edge_rows(kind):
    """mask_kind 2 (a user's 4-D additive mask): rows past the written position are never read,
    so a mask that admits them (all zeros) differs from eager silently (25%); a mask that masks
    every row gives NaN where eager SDPA (safe softmax) gives zeros."""
    model = hf_tiny.llama(heads=8, kv_heads=2, head_dim=16)
    length = 40
    (ours, ref), gen = _prefilled(model, length, 20)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 64})
    with FallbackWatch() as w, torch.no_grad():
        tok = torch.randint(0, 128, (1, 1), generator=gen)
        m = torch.zeros(1, 1, 1, length) if kind == "admits_rows_past_pos" else \
            torch.full((1, 1, 1, length), float("-inf"))
        cp = torch.tensor([20])
        a = compiled(input_ids=tok, past_key_values=ours, use_cache=True, attention_mask=m, cache_position=cp).logits
        b = model(input_ids=tok, past_key_values=ref, use_cache=True, attention_mask=m, cache_position=cp).logits
    torch._dynamo.reset()
    assert not w.fallbacks
    assert not a.isnan().any() and _rel(a, b) < 1e-4, _rel(a, b)


def test_second_cache_length_is_fused_like_the_first(steps):
    """A second StaticCache length makes dynamo hand symbolic sizes, and fusec captures the
    graph again per concrete size: that capture must still see RoPE's ``inv_freq`` buffer as a
    weight (dynamo drops its sources once the backend returns), so the RoPE tables fold and
    every layer is ``rms_qkv_rope`` again, not a runtime ``cos``/``sin`` with separate matvecs
    (found by a new-user trial, 2026-12-02). Logits match eager at both lengths, no fallback."""
    model = hf_tiny.llama(layers=2)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
    with FallbackWatch() as w, torch.no_grad():
        for length in (32, 48):
            caches, gen = _prefilled(model, length, 3)
            for _ in range(2):
                tok = torch.randint(0, 128, (1, 1), generator=gen)
                a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
                b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
                assert _rel(a, b) < 1e-4
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert len(steps) == 2
    first, second = (s.schedule.graph.count_kinds() for s in steps)
    assert second == first and first["rms_qkv_rope"] == 2 and "aten.cos.default" not in second, (first, second)


def test_compiled_in_weight_written_in_place_rebuilds_the_step(caplog):
    """Gemma's norm weights are compiled into the step as ``1 + w``; written in place after the
    first compile (``load_state_dict``, an optimizer step), the next call sees the new version
    counter and digest, says so and builds the step again: tokens follow HF's new ones, not the
    stale kernel's (found in review, 2026-12-02)."""
    import logging

    import fusec
    caplog.set_level(logging.INFO, logger="fusec")
    model = hf_tiny.gemma(seed=1)
    prompt = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(4))

    def hf():
        return model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static",
                              pad_token_id=0, eos_token_id=None)
    old = hf()
    torch._dynamo.reset()
    with FallbackWatch() as w:
        assert torch.equal(fusec.generate(model, prompt, 6, eos_token_id=[], options={"num_sms": 8}), old)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(5)
            for name, weight in model.named_parameters():
                if name.endswith("norm.weight"):
                    weight.copy_(torch.randn(weight.shape, generator=gen) * 3)
        new = hf()
        assert not torch.equal(new, old)   # else a stale step would pass too
        assert torch.equal(fusec.generate(model, prompt, 6, eos_token_id=[], options={"num_sms": 8}), new)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert any("changed since the step was built" in r.getMessage() for r in caplog.records)
