"""HF's SDPA attention traced with ``enable_gqa`` in fusec's own traces (symbolic cache length).

transformers' ``sdpa_attention_forward`` repeats K and V to the query heads (``repeat_kv``:
index, expand, reshape) unless ``use_gqa_in_sdpa`` says SDPA may take grouped-query inputs
itself, which it says only without a mask. With a symbolic cache length each of those ops
costs 5-28 ms in dynamo's and AOT autograd's fake-tensor propagation instead of about 0.3 ms
(an expanded ``[1, 8, 4, s, 64]`` tensor cannot be reshaped as a view: torch computes its
strides with symbolic sizes, then clones): on Llama-3.2-1B (16 layers, 8 KV heads; CPU, torch
2.13) 1.8 of the symbolic trace's 2.6 s of op propagation and 1.8 s of AOT autograd. The step
fusec builds is the same either way (``scaled_dot_product_attention(..., enable_gqa=True)`` is
the same attention: fusec's split-KV tiles read each KV head once for its query heads).

:func:`install` registers a dynamo polyfill (``torch.compiler.substitute_in_graph``) of
``use_gqa_in_sdpa`` that answers True, with a mask too, while :func:`gqa_in_trace` is open (when
head dims allow it: key and value head dim equal, at most 256, as HF's own rule) and as HF does
otherwise. fusec opens it around the traces it makes itself (:class:`fusec.frontend.precompiled.
PrecompiledStep`: ``fusec.generate`` and HF ``generate()``'s decode call, whose cache length is
symbolic); a plain ``torch.compile`` of the same process (inductor's too) keeps HF's choice,
since SDPA with ``enable_gqa`` and a mask runs PyTorch's math kernel on CUDA. Eager calls never
run the polyfill. Source: ``torch.nn.functional.scaled_dot_product_attention``'s ``enable_gqa``
(PyTorch 2.5+).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch

log = logging.getLogger("fusec")

#: whether the trace running now is fusec's own (:func:`gqa_in_trace`); read by the polyfill
_IN_TRACE = False


@contextlib.contextmanager
def gqa_in_trace() -> Iterator[None]:
    """While open, dynamo's traces of HF's SDPA attention pass grouped-query K and V to SDPA
    (``enable_gqa=True``) instead of repeating them (:func:`install` must have run)."""
    global _IN_TRACE
    before, _IN_TRACE = _IN_TRACE, True
    try:
        yield
    finally:
        _IN_TRACE = before


@functools.cache   # once per process
def install() -> None:
    """Register the polyfill (idempotent; a no-op without transformers' SDPA integration)."""
    try:
        from transformers.integrations import sdpa_attention
    except Exception:   # noqa: BLE001 - no transformers (or a broken one): nothing to patch
        return
    original = sdpa_attention.use_gqa_in_sdpa
    xpu = bool(getattr(sdpa_attention, "_is_torch_xpu_available", False))
    xpu_ok = bool(getattr(sdpa_attention, "_is_torch_greater_or_equal_than_2_8", False))

    def use_gqa_in_sdpa(attention_mask: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor) -> bool:
        if xpu:
            return xpu_ok
        heads_ok = key.shape[-1] == value.shape[-1] <= 256
        return heads_ok and (_IN_TRACE or attention_mask is None)

    try:
        torch.compiler.substitute_in_graph(original, skip_signature_check=True)(use_gqa_in_sdpa)
    except (TypeError, ValueError, AttributeError) as e:   # another torch: HF's repeat_kv stays
        log.info("fusec: HF's use_gqa_in_sdpa not substituted (%s); symbolic traces repeat K and V", e)
