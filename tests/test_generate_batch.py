"""fusec.generate with a batch of prompts [B, T] on the CPU simulator (issue 32): left-padded
prompts with their attention_mask, HF generate()'s greedy tokens, eos per sequence (pad after
it, early stop once all finished), sampling per row, argument errors, no fallback."""
from __future__ import annotations

import sys

import pytest
import torch

import fusec
import hf_tiny
from fusec.errors import FusecError
from fusec.fallbacks import FallbackWatch
from fusec.generation import arguments
from fusec.generation import batch as batch_state

OPTS = {"num_sms": 8}
FAST = {"num_sms": 8, "check_hazards": False}   # tests of the driver loop: skip the hazard check


@pytest.fixture
def gen_module():
    import fusec.generate  # noqa: F401 - the submodule (the package attribute is the function)
    return sys.modules["fusec.generate"]


def _llama(**kw):
    """Tiny Llama with an LM head of its own: with the tied embedding of ``hf_tiny.llama`` the
    residual stream dominates and greedy repeats the last prompt token forever, which would
    hide a sequence that reads another's positions or mask."""
    m = hf_tiny.llama(**kw)
    w = torch.randn(m.lm_head.weight.shape, generator=torch.Generator().manual_seed(11))
    m.lm_head.weight = torch.nn.Parameter(w, requires_grad=False)
    m.config.tie_word_embeddings = False
    return m


def _left_padded(model, lens, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lens`` tokens left-padded with token 0 to the longest, as a tokenizer
    with ``padding_side="left"`` makes them: (input_ids, attention_mask), int64 [B, T]."""
    t = max(lens)
    ids = torch.randint(1, model.config.vocab_size, (len(lens), t), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lens), t, dtype=torch.int64)
    for i, n in enumerate(lens):
        mask[i, t - n:] = 1
        ids[i, :t - n] = 0
    return ids, mask


def _hf(model, ids, mask, n, **kw):
    """HF's greedy generate() of the batch (its default cache), pad token 0."""
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def _attention_ops(g):
    return [o for o in g.ops for o in ([o] if o.kind != "chain" else o.attrs["ops"]) if o.kind.startswith("attention")]


@pytest.mark.parametrize("factory,lens", [(_llama, (5, 9, 2)), (hf_tiny.qwen3, (6, 3))],
                         ids=["llama-3", "qwen3-2"])
def test_batch_greedy_equals_hf_generate(factory, lens, steps):
    """Left-padded prompts of different lengths: the greedy tokens equal HF generate(input_ids,
    attention_mask)'s token for token; one fusec step of batch B (no fallback) whose split-KV
    attention reads the [B, 1, 1, L] mask the driver keeps on the device, and whose length is
    symbolic: a second call with a longer cache compiles nothing."""
    model = factory()
    ids, mask = _left_padded(model, lens, 3)
    ref = _hf(model, ids, mask, 12)
    assert len({tuple(r) for r in ref[:, ids.shape[1]:].tolist()}) == len(lens)   # the rows differ
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, ids, 12, attention_mask=mask, pad_token_id=0, options=FAST)
    assert not w.fallbacks and w.compiled == 1, w.fallbacks
    assert out.dtype == torch.int64 and out.shape == ref.shape == (len(lens), max(lens) + 12)
    assert torch.equal(out, ref)
    (step,) = steps
    assert step.calls == 11 and not step.fallen_back
    g = step.schedule.graph
    assert g.batch() == len(lens) and g.lengths   # one step for every cache length
    att = _attention_ops(g)
    assert len(att) == model.config.num_hidden_layers and all(o.kind == "attention_partial" for o in att)
    assert all(g.tensors[o.inputs["mask"]].shape[0] == len(lens) for o in att)
    # a cache of 128 rows (prompt + 60 new tokens): the same step
    ref2 = _hf(model, ids, mask, 60)
    with FallbackWatch() as w2:
        out2 = fusec.generate(model, ids, 60, attention_mask=mask, pad_token_id=0, options=FAST)
    torch._dynamo.reset()
    assert not w2.fallbacks and w2.compiled == 0, w2.fallbacks
    assert torch.equal(out2, ref2)


def test_batch_of_an_eager_attention_model_equals_hf_generate(steps):
    """A model whose attention is HF's eager one (``attn_implementation="eager"``) adds its mask to
    the scores: the complete bool mask of an SDPA model's batch would add 1.0 / 0.0 instead of
    masking (found by a try-to-break helper: other tokens than HF's). The batch passes its
    ``[B, L]`` padding mask, HF builds its float mask inside the step: greedy tokens equal HF
    generate()'s, one fusec step, no fallback."""
    model = hf_tiny.llama_eager()
    ids, mask = _left_padded(model, (9, 4, 7), 5)
    ref = _hf(model, ids, mask, 8)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, ids, 8, attention_mask=mask, pad_token_id=0, options=FAST)
    torch._dynamo.reset()
    assert not w.fallbacks and w.fallback_runs == 0 and w.compiled == 1, w.fallbacks
    assert torch.equal(out, ref)
    assert [s.schedule.graph.batch() for s in steps if s.schedule is not None] == [3]


@pytest.mark.parametrize("factory,batch", [(_llama, 2), (_llama, 4), (hf_tiny.qwen3, 3), (hf_tiny.qwen3, 4)])
def test_batch_sizes_compile_without_fallback(factory, batch, steps):
    """B = 2, 3, 4 (tiny Llama and Qwen3, one layer): one fusec step of that batch, no fallback,
    no hazard in the simulator's check (the step writes its positions and unfinished flags in
    place after reading them), HF generate()'s greedy tokens."""
    model = factory(layers=1)
    ids, mask = _left_padded(model, (4, 7, 1, 5)[:batch], 10 + batch)
    ref = _hf(model, ids, mask, 5, eos_token_id=int(ids[0, -1]))   # an eos: the step finishes sequences
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, ids, 5, attention_mask=mask, eos_token_id=int(ids[0, -1]), pad_token_id=0,
                             options=OPTS)
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled == 1, w.fallbacks
    assert torch.equal(out, ref)
    assert [s.schedule.graph.batch() for s in steps] == [batch]


def test_batch_sizes_in_one_process(steps):
    """B = 2, then 3, then 2 again on one model without resetting dynamo: each batch size its own
    trace at a fixed B (not a symbolic batch, which would be compiled per cache length), HF's
    tokens each time, the third call reusing the first step."""
    model = hf_tiny.qwen3(layers=1)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        for lens in ((5, 2), (3, 6, 1), (4, 2)):
            ids, mask = _left_padded(model, lens, len(lens))
            assert torch.equal(fusec.generate(model, ids, 4, attention_mask=mask, options=FAST),
                               _hf(model, ids, mask, 4)), lens
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled == 2, w.fallbacks
    assert [s.schedule.graph.batch() for s in steps] == [2, 3]
    assert all(s.schedule.graph.lengths for s in steps)


def test_batch_of_sliding_window_model(steps):
    """A tiny Mistral with a sliding window (its cache's sliding layers count positions on the
    host): the batch step takes the [B, L] padding mask and HF builds the layer's mask inside
    it; HF generate()'s greedy tokens, one fusec step of batch 2, no fallback."""
    model = hf_tiny.mistral_sw()
    ids, mask = _left_padded(model, (5, 9), 1)
    ref = _hf(model, ids, mask, 6)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, ids, 6, attention_mask=mask, pad_token_id=0, options=FAST)
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled == 1, w.fallbacks
    assert torch.equal(out, ref)
    (step,) = steps
    assert step.schedule.graph.batch() == 2 and step.calls == 5
    mask_in = [t for t in step.schedule.graph.inputs if step.schedule.graph.tensors[t].shape == (2, 64)]
    assert mask_in   # the [B, L] mask is a step input


def test_eos_per_sequence(gen_module, monkeypatch):
    """With chunks of 3 steps: a sequence that produced an eos continues with pad_token_id while
    the others go on (HF's unfinished_sequences); once every sequence has one, generation stops
    after the step of the last first eos. Both equal HF generate() with that eos_token_id."""
    monkeypatch.setattr(gen_module, "CHUNK", 3)
    model = hf_tiny.qwen3(layers=1)   # its tiny config has no eos
    ids, mask = _left_padded(model, (5, 9, 2), 1)
    n, t = 12, ids.shape[1]
    full = _hf(model, ids, mask, n)[:, t:].tolist()
    # eos: a token of row 0 (in its third chunk or later) that rows 1 and 2 never produce
    k, eos = next((k, tok) for k, tok in enumerate(full[0]) if k >= 4 and tok not in full[0][:k]
                  and tok not in full[1] and tok not in full[2])
    ref = _hf(model, ids, mask, n, eos_token_id=eos)
    assert ref.shape == (3, t + n) and ref[0, t + k + 1:].eq(0).all() and ref[1:, t:].tolist() == full[1:]
    # several eos ids, one met by each row: the output ends at the last row's first eos
    firsts = [next(tok for j, tok in enumerate(row) if j >= 1 and tok not in row[:j]) for row in full]
    ends = [next(j for j, tok in enumerate(row) if tok in firsts) for row in full]
    ref_all = _hf(model, ids, mask, n, eos_token_id=firsts)
    assert ref_all.shape[1] == t + max(ends) + 1 < t + n
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, ids, n, attention_mask=mask, eos_token_id=eos, pad_token_id=0, options=FAST)
        out_all = fusec.generate(model, ids, n, attention_mask=mask, eos_token_id=firsts, pad_token_id=0,
                                 options=FAST)
        # pad_token_id None: the generation config's (none here), else the first eos id, as HF
        model.generation_config.pad_token_id = None
        out_pad = fusec.generate(model, ids, n, attention_mask=mask, eos_token_id=[eos, 127], options=FAST)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert torch.equal(out, ref)
    assert torch.equal(out_all, ref_all)
    assert torch.equal(out_pad, model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                               eos_token_id=[eos, 127]))
    assert out_pad[0, t + k + 1:].eq(eos).all()


def test_batch_sampling_reproducible_and_top_k_1_is_greedy(gen_module, monkeypatch):
    """B = 2 sampling, per row: the same seed gives the same tokens (selection as torch ops after
    the step, with top-p; and inside the step, SAMPLE_IN_GRAPH, the same draws); top_k=1 equals
    HF's greedy tokens; no fallback."""
    model = hf_tiny.qwen3(layers=1)
    ids, mask = _left_padded(model, (4, 7), 5)
    greedy = _hf(model, ids, mask, 6)

    def run(seed, **kw):
        return fusec.generate(model, ids, 6, attention_mask=mask, do_sample=True, options=FAST,
                              generator=torch.Generator().manual_seed(seed), **kw)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        one = run(1, top_k=1, temperature=0.5)
        a, b, c = (run(s, temperature=1.3, top_k=50, top_p=0.9) for s in (5, 5, 6))
        outside = run(2, temperature=1.5, top_k=30)
        monkeypatch.setattr(gen_module, "SAMPLE_IN_GRAPH", True)
        inside = run(2, temperature=1.5, top_k=30)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert torch.equal(one, greedy)
    assert torch.equal(a, b) and a.shape == (2, 13) and torch.equal(a[:, :7], ids)
    assert not torch.equal(a, c) or not torch.equal(a, greedy)
    assert torch.equal(inside, outside)


def test_batch_1_keeps_its_step(steps):
    """B = 1 with an all-ones attention_mask is the batch-1 step (no mask input, argmax fused into
    the LM head); a single left-padded prompt takes the masked step and equals HF generate()."""
    model = hf_tiny.qwen3(layers=1)
    ids, mask = _left_padded(model, (7, 4), 8)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, ids[:1], 5, attention_mask=mask[:1], options=FAST)
        padded = fusec.generate(model, ids[1:], 5, attention_mask=mask[1:], options=FAST)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert torch.equal(out, _hf(model, ids[:1], None, 5))
    assert torch.equal(padded, _hf(model, ids[1:], mask[1:], 5))
    plain, masked = (s.schedule.graph for s in steps)
    assert "token" in next(o for o in plain.ops if o.kind == "rms_lm_head").outputs
    assert not [o for o in _attention_ops(plain) if "mask" in o.inputs]
    assert all("mask" in o.inputs for o in _attention_ops(masked))


def test_batch_argument_errors(caplog):
    model = hf_tiny.llama(layers=1)
    ids = torch.randint(1, 128, (2, 4))
    mask = torch.ones(2, 4, dtype=torch.int64)

    class Streamer:
        def put(self, t):
            pass

        def end(self):
            pass
    bad = [
        (dict(attention_mask=mask[:, :3]), r"attention_mask has shape \(2, 3\), input_ids \(2, 4\)"),
        (dict(attention_mask=mask[:1]), "attention_mask has shape"),
        (dict(attention_mask=mask.float()), "attention_mask must be an integer or bool tensor"),
        (dict(attention_mask=mask * 2), "only 0 .padding. and 1"),
        (dict(attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])), "row 1 is all zeros"),
        (dict(streamer=Streamer()), "a streamer takes batch 1 only"),
        (dict(input_ids=torch.randint(1, 128, (17, 4))), "a batch of 17 prompts .* must be 1 to 16"),
        (dict(input_ids=torch.randint(1, 128, (2, 2, 2))), r"expected \[batch, prompt_len\]"),
        (dict(pad_token_id="0"), "pad_token_id"),
        (dict(prompt_lookup_num_tokens=3), r"prompt_lookup_num_tokens takes one prompt without padding"),
        (dict(input_ids=ids[:1], attention_mask=torch.tensor([[0, 1, 1, 1]]), prompt_lookup_num_tokens=3),
         "attention_mask has zeros"),
    ]
    for kw, msg in bad:
        args = {"model": model, "input_ids": ids, "max_new_tokens": 4, **kw}
        with pytest.raises(FusecError, match=msg):
            fusec.generate(args.pop("model"), args.pop("input_ids"), args.pop("max_new_tokens"), **args)


def test_mask_checks(gen_module):
    """The mask as the step gets it: a right-padded row logs HF's warning and is kept; at batch 1
    an all-ones mask (int or bool) is no mask (the batch-1 step), a padded one is kept; a batch
    without a mask gets ones."""
    ids = torch.randint(1, 128, (2, 4))
    with FallbackWatch() as w:
        right = arguments.check_mask(torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]), ids)
    assert right.dtype == torch.int64 and right.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert len(w.warnings) == 1 and "right-padding" in w.warnings[0] and not w.fallbacks
    assert arguments.check_mask(torch.ones(1, 4, dtype=torch.bool), ids[:1]) is None
    assert arguments.check_mask(torch.tensor([0, 1, 1, 1]), ids[:1]).tolist() == [[0, 1, 1, 1]]
    model = hf_tiny.llama(layers=1)
    _, mask = arguments.check_args(ids, None, 4, False, 1.0, None, None, None, None, None, None,
                                   torch.device("cpu"))
    assert mask.tolist() == [[1] * 4] * 2
    assert batch_state.positions(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert arguments.pad_id(model, None, [5, 6]) == 5 and arguments.pad_id(model, 3, [5]) == 3
