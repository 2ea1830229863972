"""HF ``generate()``'s beam search through fusec's compiled decode step.

transformers 5.x compiles only ``_sample``'s and assisted decoding's decode call
(``get_compiled_call``); ``_beam_search`` calls the model's plain forward every step, so
``generate(num_beams=N, compile_config=CompileConfig(backend="fusec"))`` ran eagerly whatever the
backend. :func:`install` wraps ``GenerationMixin._beam_search``: with a fusec ``compile_config``,
where generate() would compile (``_valid_auto_compile_criteria``: a static cache, a device it
compiles on), HF's own beam search runs with :class:`_BeamModel` in the model's place, which
sends each decode step (B prompts times N beams, one token each: a batch step of B * N rows,
docs/batch.md) to the compiled call generate() uses for greedy search
(:class:`fusec.frontend.hf_generate.HFDecodeCall`: one precompiled step for every prompt length);
the prefill stays the plain forward, as in ``_sample``. Between steps beam search reorders the
cache rows by the beams it keeps: transformers' ``StaticLayer.reorder_cache`` rebinds each
layer's keys and values to new tensors (``index_select``), which would give the compiled step new
buffers every step (a CUDA graph replays fixed addresses); :meth:`_BeamModel._reorder_cache`
gathers them in place instead (the same values, the same tensors).

The tokens, scores and stopping are HF's: only the forward differs, and its logits equal eager's
to the step's rounding (``tests/test_hf_beam.py`` compares the sequences with eager beam search).
A fusec config that does not compile (no static cache, ``disable_compile``), ``synced_gpus``, an
encoder-decoder model or ``low_memory`` keep HF's beam search as it is. What the step does not
take falls back on its own with one line (more than 16 rows: ``fusec.config.MAX_QUERY_ROWS``).
"""
from __future__ import annotations

import functools
from typing import Any

import torch


class _BeamModel:
    """The model as ``_beam_search`` sees it: every attribute is the model's, calling it runs the
    compiled decode ``call``, and ``_reorder_cache`` gathers a static cache's rows in place.

    Args:
        model: the HF causal LM (``PreTrainedModel``) whose ``_beam_search`` runs.
        call: its compiled decode call (``model.get_compiled_call(compile_config)``), called as
            ``model(**model_inputs)`` with the ``[B * N, 1]`` step inputs.
    """

    def __init__(self, model: Any, call: Any):
        object.__setattr__(self, "_fusec_model", model)
        object.__setattr__(self, "_fusec_call", call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fusec_call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fusec_model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fusec_model, name, value)

    def _reorder_cache(self, cache: Any, beam_idx: torch.Tensor) -> Any:
        """``cache`` with its rows (dim 0: batch times beams) gathered by ``beam_idx`` (int64
        ``[B * N]``), as transformers' ``_beam_search`` would, whose first choice is the model
        class's own ``_reorder_cache`` where it has one (XLNet, RAG); else each static layer's
        keys and values in place (``torch.index_select`` then ``copy_``); else the cache's
        ``reorder_cache``."""
        own = getattr(self._fusec_model, "_reorder_cache", None)
        if own is not None:
            return own(cache, beam_idx)
        if _gatherable(cache):
            for layer in cache.layers:
                for t in (layer.keys, layer.values):
                    t.copy_(t.index_select(0, beam_idx.to(t.device)))
            return cache
        cache.reorder_cache(beam_idx)
        return cache


def _gatherable(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a transformers ``StaticLayer`` (or a subclass: the
    sliding-window one, fusec's ``StaticLayerRows``) whose keys and values are tensors and whose
    reorder is the base one (a gather of dim 0 of both, nothing else)."""
    from transformers.cache_utils import CacheLayerMixin, StaticLayer
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(
        isinstance(layer, StaticLayer) and type(layer).reorder_cache is CacheLayerMixin.reorder_cache
        and isinstance(getattr(layer, "keys", None), torch.Tensor)
        and isinstance(getattr(layer, "values", None), torch.Tensor) for layer in layers)


def _compiled_call(model: Any, generation_config: Any, synced_gpus: bool,
                   model_kwargs: dict[str, Any]) -> Any:
    """generate()'s compiled decode call for this beam search, or None where HF's plain forward
    stays (not a fusec ``compile_config``; a call generate() would not compile; synced GPUs, an
    encoder-decoder model, ``low_memory``)."""
    from fusec.frontend.hf_generate import is_fusec_backend
    cc = getattr(generation_config, "compile_config", None)
    if cc is None or not is_fusec_backend(getattr(cc, "backend", None)):
        return None
    if synced_gpus or model.config.is_encoder_decoder or getattr(generation_config, "low_memory", False):
        return None
    if not model._valid_auto_compile_criteria(model_kwargs, generation_config):
        return None
    return model.get_compiled_call(cc)


@functools.cache   # once per process
def install() -> None:
    """Wrap ``transformers.generation.utils.GenerationMixin._beam_search`` (idempotent; a no-op
    without transformers, or where transformers has no ``_beam_search``): with a fusec
    ``compile_config`` that generate() would compile, HF's beam search runs with each decode step
    through the compiled call (:class:`_BeamModel`); every other call is HF's unchanged."""
    try:
        from transformers.generation.utils import GenerationMixin
    except Exception:   # noqa: BLE001 - no transformers (or a broken one): nothing to wrap
        return
    from fusec.frontend.hf_patch import wrap_once

    def make(original: Any) -> Any:
        def _beam_search(self: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                         generation_config: Any, synced_gpus: bool = False, **model_kwargs: Any) -> Any:
            call = _compiled_call(self, generation_config, synced_gpus, model_kwargs)
            model = self if call is None else _BeamModel(self, call)
            return original(model, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, **model_kwargs)
        return _beam_search
    wrap_once(GenerationMixin, "_beam_search", make)
