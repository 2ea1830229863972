"""generate()'s attention masks bounded by the step's position (fusec/frontend/mask_bound.py,
``fusec.ir.mask_proofs.without_causal_term``).

HF's own decode loop (what generate() runs through fusec for sampling, logits processors,
``output_logits`` ...) passes its 4-D mask over the cache's rows into the step, and
``fusec.generate``'s padded batches pass theirs: a graph input that any mask could be, so the
attention read all L rows under it, and its tile set (fusec/instructions/attention_sets.py)
followed L, not the position. Both callers now AND it with the causal mask of the row the step
writes (the same values: their masks attend no later row); recognize proves the bound and
leaves the causal term out, so the attention reads the input mask over rows 0 .. p only."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
import step_util
from fusec.fallbacks import FallbackWatch


def _attentions(steps):
    """Every split-KV attention op of the steps fusec built, with its graph."""
    return [(o, s.schedule.graph) for s in steps for o in s.schedule.graph.ops if o.kind.startswith("attention")]


def _assert_bounded_by_the_input_mask(steps):
    att = _attentions(steps)
    assert att
    for o, g in att:
        mask = o.inputs.get("mask")
        assert o.attrs.get("mask_kind") == 1 and o.attrs.get("mask_bound"), (o.name, o.attrs)
        assert mask in g.inputs, mask   # the caller's mask itself: no AND left in the step
    for s in steps:
        kinds = s.schedule.graph.count_kinds()
        assert not any(k in kinds for k in ("aten.bitwise_and.Tensor", "aten.le.Tensor", "aten.arange.default")), kinds


def test_hf_generates_own_loop_reads_rows_up_to_the_position(steps):
    """HF generate()'s own loop (``output_logits=True`` keeps it) through a fusec CompileConfig,
    one prompt and a left-padded batch of two, three prompt lengths: the logits equal eager
    generate()'s at every step, the tokens too, no fallback, and every attention reads
    generate()'s mask bounded by the position."""
    from transformers.generation import CompileConfig
    model = hf_tiny.llama()
    cc = CompileConfig(backend="fusec")
    cc._compile_all_devices = True
    gen = torch.Generator().manual_seed(5)
    kw = dict(max_new_tokens=5, do_sample=False, cache_implementation="static", pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad(), FallbackWatch() as w:
        for length in (7, 19, 3):
            ids = torch.randint(1, model.config.vocab_size, (2, length), generator=gen)
            mask = torch.ones(2, length, dtype=torch.long)
            mask[1, :2] = 0
            for b in (1, 2):
                a = model.generate(ids[:b], attention_mask=mask[:b], compile_config=cc, **kw)
                e = model.generate(ids[:b], attention_mask=mask[:b], disable_compile=True, **kw)
                assert len(a.logits) == len(e.logits) == 5
                errs = [step_util.rel(x, y) for x, y in zip(a.logits, e.logits)]
                assert max(errs) < 1e-5, (length, b, errs)
                assert torch.equal(a.sequences, e.sequences)
    assert not w.fallbacks and w.compiled == 2, (w.fallbacks, w.compiled)   # batch 1 and 2: one step each
    _assert_bounded_by_the_input_mask(steps)


def test_fusec_generates_padded_batch_reads_rows_up_to_the_position(steps):
    """``fusec.generate`` with left-padded prompts (its complete mask, :class:`fusec.generation.
    batch.Batch`): greedy tokens equal eager generate()'s, and its attention reads its mask
    bounded by the position."""
    import fusec
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(1, model.config.vocab_size, (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :1] = 0
    with torch.no_grad(), FallbackWatch() as w:
        out = fusec.generate(model, ids, 6, attention_mask=mask)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want)
    assert not w.fallbacks and w.compiled, w.fallbacks
    _assert_bounded_by_the_input_mask(steps)


def test_a_mask_that_attends_past_the_position_is_read_whole(steps):
    """A plain loop whose caller passes its own 4-D mask attending every cache row (rows past the
    position included, as eager SDPA reads them): nothing bounds it, the attention reads all L
    rows under it, and the logits equal eager's."""
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(7)
    rows = 24
    ids = torch.randint(1, model.config.vocab_size, (1, 5), generator=gen)
    caches = [hf_tiny.static_cache(model, rows) for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            model(input_ids=ids, past_key_values=c, use_cache=True)
    compiled = torch.compile(model, backend="fusec")
    full = torch.ones(1, 1, 1, rows, dtype=torch.bool)
    with torch.no_grad(), FallbackWatch() as w:
        for _ in range(3):
            tok = torch.randint(1, model.config.vocab_size, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], attention_mask=full).logits
            e = model(input_ids=tok, past_key_values=caches[1], attention_mask=full).logits
            assert step_util.rel(a, e) < 1e-5
    assert not w.fallbacks and w.compiled
    att = _attentions(steps)
    assert att and all(o.attrs.get("mask_kind") == 1 and not o.attrs.get("mask_bound") for o, _ in att)


def test_causal_bound_values():
    """:func:`fusec.frontend.mask_bound.causal_bound`: the mask AND ``row <= p`` (p the first
    layer's counter), a dict of masks each; a float mask, a K-token step's, and one over another
    length than the cache's come back as they were."""
    from fusec.frontend.mask_bound import causal_bound
    model = hf_tiny.llama()
    cache = hf_tiny.static_cache(model, 16)
    with torch.no_grad():
        model(input_ids=torch.ones(1, 6, dtype=torch.long), past_key_values=cache, use_cache=True)
    gen = torch.Generator().manual_seed(8)
    mask = torch.rand(2, 1, 1, 16, generator=gen) < 0.7
    got = causal_bound(mask, cache, 1)
    want = mask.clone()
    want[..., 7:] = False   # the step writes row 6
    assert torch.equal(got, want)
    assert torch.equal(causal_bound({"full_attention": mask}, cache, 1)["full_attention"], want)
    add = torch.zeros(1, 1, 1, 16)
    assert causal_bound(add, cache, 1) is add
    assert causal_bound(mask, cache, 2) is mask
    short = mask[..., :8]
    assert causal_bound(short, cache, 1) is short
