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


def _strided(cache) -> None:
    """Each layer's keys as a strided view of the same values (every other element of a buffer
    twice as wide), as a cache sharing one buffer would hold them."""
    for layer in cache.layers:
        big = torch.zeros(*layer.keys.shape[:3], 2 * layer.keys.shape[3])
        big[..., ::2] = layer.keys
        layer.keys = big[..., ::2]


def test_a_strided_kv_cache_falls_back_with_a_line_that_names_it():
    """A StaticCache whose keys are a strided view at the first call (found by trying to break
    fusec, 2026-12-07: the simulator raised "buffer arg8_1 is not contiguous" at every call):
    one fallback line naming the cache input and its strides, logits equal to eager's."""
    model = hf_tiny.llama()
    (ours, ref), gen = _prefilled(model, 32, 6)
    _strided(ours)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(2):
            tok = torch.randint(0, 128, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=ours, use_cache=True).logits
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert _rel(a, b) < 1e-5, _rel(a, b)
    torch._dynamo.reset()
    assert len(w.fallbacks) == 1 and "past_key_values.layers[0].keys" in w.fallbacks[0] \
        and "strided view (strides [2048, 1024, 32, 2])" in w.fallbacks[0], w.fallbacks
    assert w.compiled == 0


def test_a_cache_made_strided_after_fusec_ran_is_an_error_that_names_it_and_loses_nothing():
    """Keys made a strided view after fusec's step was built: dynamo compiles again with
    symbolic strides, whose layout fusec cannot read at compile time, so the call is a
    FusecError naming the input, its role and strides, raised before the step runs; with the
    keys contiguous again, later steps equal eager's."""
    from fusec.errors import FusecError
    model = hf_tiny.llama()
    (ours, ref), gen = _prefilled(model, 32, 6)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    with FallbackWatch() as w, torch.no_grad():
        for step in range(4):
            tok = torch.randint(0, 128, (1, 1), generator=gen)
            if step == 1:
                saved = [layer.keys for layer in ours.layers]
                _strided(ours)
                with pytest.raises(FusecError, match=r"\(kv_cache, shape \[1, 2, 32, 16\]\): not contiguous "
                                                     r"\(strides \[2048, 1024, 32, 2\]\).*store the cache's tensors contiguous"):
                    compiled(input_ids=tok, past_key_values=ours, use_cache=True)
                for layer, k in zip(ours.layers, saved):
                    layer.keys = k
            a = compiled(input_ids=tok, past_key_values=ours, use_cache=True).logits
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert _rel(a, b) < 1e-5, (step, _rel(a, b))
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks


class _IntPositionAttention(torch.nn.Module):
    """A hand-written decode step whose position is a Python int (its own KV buffers, an SDPA
    over a mask of the rows up to the position)."""

    def __init__(self, d=32, heads=2, rows=16):
        super().__init__()
        self.h, self.hd, self.rows = heads, d // heads, rows
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.register_buffer("kc", torch.zeros(1, heads, rows, d // heads))
        self.register_buffer("vc", torch.zeros(1, heads, rows, d // heads))

    def forward(self, x, pos: int):
        q, k, v = self.qkv(x).view(1, 1, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        self.kc[:, :, pos:pos + 1] = k
        self.vc[:, :, pos:pos + 1] = v
        mask = torch.arange(self.rows).view(1, 1, 1, -1) <= pos
        a = torch.nn.functional.scaled_dot_product_attention(q, self.kc, self.vc, attn_mask=mask)
        return self.o(a.transpose(1, 2).reshape(1, 1, -1))


def test_an_int_position_compiled_per_value_says_so(caplog):
    """A Python int position that the step uses as a value compiles one step per value; past
    8 values the one warning names the integer input and says to pass the position as a tensor
    (found by trying to break fusec, 2026-12-07: it blamed a changing shape and an
    attention_mask); every output equals eager's."""
    import copy
    import logging
    torch.manual_seed(0)
    ours = _IntPositionAttention().eval().requires_grad_(False)
    ref = copy.deepcopy(ours)
    torch._dynamo.reset()
    step = torch.compile(ours, backend="fusec")
    with FallbackWatch() as w, torch.no_grad(), caplog.at_level(logging.WARNING, logger="fusec"):
        for pos in range(10):
            x = torch.randn(1, 1, 32)
            assert _rel(step(x, pos), ref(x, pos)) < 1e-5
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled == 10, (w.fallbacks, w.compiled)
    lines = [r.getMessage() for r in caplog.records if "input sizes or values seen" in r.getMessage()]
    assert len(lines) == 1 and "integer inputs l_pos_ take new values" in lines[0] \
        and "torch.tensor([pos])" in lines[0] and "attention_mask" not in lines[0], lines
