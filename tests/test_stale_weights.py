"""Values compiled into a step are not served stale (issue 30, item 4): RoPE's ``inv_freq``
(folded into the position tables) and Gemma's norm weights (folded as ``1 + w``) changed after
the first compile, through ``.data`` (no version counter moves) or by rebinding ``.data`` to
another tensor, make the step build again: its logits follow eager's new ones."""
from __future__ import annotations

import logging

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _inv_freq(model):
    return model.model.rotary_emb.inv_freq


def _norms(model):
    return [p for n, p in model.named_parameters() if n.endswith("norm.weight")]


@pytest.mark.parametrize("how", ["data_copy", "data_rebind"])
@pytest.mark.parametrize("factory,weights", [(hf_tiny.llama, lambda m: [_inv_freq(m)]),
                                             (hf_tiny.gemma, _norms)], ids=["llama-inv_freq", "gemma-norms"])
def test_a_compiled_in_value_changed_through_data_rebuilds_the_step(factory, weights, how, caplog):
    model = factory()
    gen = torch.Generator().manual_seed(9)
    caches = [hf_tiny.static_cache(model, 32) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
    with FallbackWatch() as w, torch.no_grad(), caplog.at_level(logging.INFO, logger="fusec"):
        prompt = torch.randint(1, model.config.vocab_size, (1, 4), generator=gen)
        for c in caches:
            model(input_ids=prompt, past_key_values=c, use_cache=True)
        tok = torch.randint(1, model.config.vocab_size, (1, 1), generator=gen)
        a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
        b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
        assert 0 < _rel(a, b) < 1e-4
        for p in weights(model):
            new = p.detach() * 1.5 + 0.1
            if how == "data_copy":
                version = p._version
                p.data.copy_(new)
                assert p._version == version   # nothing a version check could see
            else:
                p.data = new.clone()
        tok = torch.randint(1, model.config.vocab_size, (1, 1), generator=gen)
        a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
        b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
        assert 0 < _rel(a, b) < 1e-4, _rel(a, b)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert "changed since the step was built" in caplog.text


@pytest.mark.parametrize("how", ["data_copy", "data_rebind"])
def test_weights_read_through_views_are_read_at_run_time(how, caplog, steps):
    """Phi-3's fused qkv and gate_up weights, read through row views (``split_linear``,
    ``TensorInfo.offset``), are bound at run time like any weight: changed after the build
    (through ``.data``, or rebound), the next step reads the new values (no rebuild needed), and
    changing ``inv_freq`` as well (compiled in: a graph input, the root of no view) rebuilds as
    for Llama. The step's compiled-in values name graph inputs only."""
    model = hf_tiny.phi3_fused()
    gen = torch.Generator().manual_seed(9)
    caches = [hf_tiny.static_cache(model, 32) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
    fused = [p for n, p in model.named_parameters() if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]
    assert len(fused) == 2 * model.config.num_hidden_layers
    with FallbackWatch() as w, torch.no_grad(), caplog.at_level(logging.INFO, logger="fusec"):
        prompt = torch.randint(1, model.config.vocab_size, (1, 4), generator=gen)
        for c in caches:
            model(input_ids=prompt, past_key_values=c, use_cache=True)

        def step():
            tok = torch.randint(1, model.config.vocab_size, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            assert 0 < _rel(a, b) < 1e-4, _rel(a, b)
        step()
        g = steps[0].schedule.graph
        assert sum(t.offset is not None for t in g.tensors.values()) == 5 * model.config.num_hidden_layers
        assert set(steps[0].schedule.compiled_in) <= set(g.inputs)
        for p in fused:
            new = p.detach() * 1.5 + 0.01
            if how == "data_copy":
                p.data.copy_(new)
            else:
                p.data = new.clone()
        step()
        assert "changed since the step was built" not in caplog.text
        _inv_freq(model).data.copy_(_inv_freq(model) * 1.25)
        step()
        assert "changed since the step was built" in caplog.text
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


def test_a_model_made_under_inference_mode_compiles_and_its_compiled_in_values_are_watched(caplog):
    """A model built (or loaded) under ``torch.inference_mode()`` has inference tensors, which
    have no version counter: fusec.generate and HF generate() through fusec run it (reading
    ``_version`` raised "Inference tensors do not track version counter" in every path), inside
    and outside inference mode, with eager's tokens; a compiled-in value (RoPE's ``inv_freq``)
    changed in place under inference mode still rebuilds the step (on the CPU its digest is
    compared at every call) and its logits follow eager's."""
    import fusec
    from transformers.generation import CompileConfig
    with torch.inference_mode():
        model = hf_tiny.llama()
    model.generation_config.pad_token_id = 0
    assert _inv_freq(model).is_inference()
    ids = torch.randint(1, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    cc = CompileConfig(backend="fusec", options={"generate_loop": "hf"})
    cc._compile_all_devices = True   # HF compiles on CUDA only unless told (this machine has no GPU)
    with FallbackWatch() as w, caplog.at_level(logging.INFO, logger="fusec"):
        assert torch.equal(fusec.generate(model, ids, max_new_tokens=6), ref)
        with torch.inference_mode():
            assert torch.equal(fusec.generate(model, ids, max_new_tokens=6), ref)
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                                          compile_config=cc), ref)
        compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
        caches = [hf_tiny.static_cache(model, 32) for _ in range(2)]
        with torch.inference_mode():
            for c in caches:
                model(input_ids=ids, past_key_values=c, use_cache=True)
            for change in (False, True):
                if change:
                    _inv_freq(model).mul_(1.25)   # no version counter to move
                tok = torch.randint(1, model.config.vocab_size, (1, 1))
                a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
                b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
                assert 0 < _rel(a, b) < 1e-4, _rel(a, b)
                assert ("changed since the step was built" in caplog.text) == change
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert "changed since the step was built" in caplog.text
