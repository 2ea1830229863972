"""The buffers a :func:`fusec.generate` call keeps on its model for the next call.

A call's device state is its static KV cache, the decoder's inputs (the token, or prompt
lookup's history and length) and, on CUDA, the graph of :data:`fusec.generate.CHUNK` captured
decode steps, which holds the addresses of all of them. Capturing costs a call its host time
for ``CHUNK`` step launches while the GPU waits (on an H100 host, Llama-3.2-1B: 23 ms before
the first replay, about 17 steps' worth), and a new cache costs its allocation. A later call
whose step is the same (the same settings and options: the session's ``key``), whose rows fit
the kept cache (``max_len``), on the same device, with the model's parameters and buffers where
they were (``ptrs``: the graph reads them there), resets the kept buffers in place and replays
the kept graph. A call that does not fit drops the kept session before allocating its own.

A model keeps one session per kind of call (greedy/sampled decoding, prompt lookup) in its
``_fusec_generate_steps`` dict (:class:`fusec.generate._StepCache`), under the names below.
While a call runs on a session it is ``busy`` (:func:`take`, :func:`release`): a call that starts meanwhile on the same model (a
streamer's ``put`` that generates, another thread) neither takes it nor drops it, and runs on
buffers of its own that it does not keep. A kept graph replays the engine its capture launched
(``graph_engine``, :data:`fusec.fallbacks.LAUNCHED`): a call whose warm-up steps launched another
one (dynamo's guards picked another compiled step: a module attribute or config changed back,
nothing compiled) captures again, as after a compile or a fallback (:func:`graph_current`).
"""
from __future__ import annotations

from typing import Any

import torch

#: the names of the kept sessions in a model's ``_fusec_generate_steps``
DECODE = "decode_session"
PROMPT_LOOKUP = "prompt_lookup_session"


class Session:
    """One kind of call's kept buffers (module docstring).

    Attributes:
        key: what the step was compiled for (settings, options, batch rows); a call with
            another key cannot replay the graph.
        max_len: the kept static cache's rows (a call needing more gets a new session).
        ptrs: :func:`weight_ptrs` of the model when the graph was captured.
        device: where the buffers live.
        cache: the static KV cache (``transformers.StaticCache``), reset in place per call.
        busy: a call runs on these buffers now (from their making, or :func:`take`, to
            :func:`release`).
        graph_engine: what :data:`fusec.fallbacks.LAUNCHED` held after the graph's capture.
        inference: whether the buffers were made under ``torch.inference_mode()`` (inference
            tensors, which no write outside it may touch: a call in the other mode makes its own).

    A kind of call adds its decoder state and its captured graph (None on the CPU, after a
    failed capture, or before the first).
    """

    def __init__(self, key: tuple, max_len: int, ptrs: tuple, device: torch.device, cache: Any):
        self.key, self.max_len, self.ptrs, self.device, self.cache = key, max_len, ptrs, device, cache
        self.busy = True   # made by the call that runs on it
        self.graph_engine: Any = None
        self.inference = torch.is_inference_mode_enabled()


def weight_ptrs(model: torch.nn.Module) -> tuple:
    """Where each parameter and buffer of ``model`` lives: ``(data_ptr, dtype, shape)`` per
    tensor (a captured graph reads them at these addresses)."""
    return tuple((t.data_ptr(), t.dtype, t.shape) for t in (*model.parameters(), *model.buffers()))


def take(steps: dict, name: str, key: tuple | None, model: torch.nn.Module, max_len: int,
         device: torch.device) -> tuple[Session | None, bool]:
    """What a call starting now runs on: ``(session, keep)``.

    ``session``: the one kept under ``name``, now ``busy``, if the call can run on it (the same
    ``key``, at least ``max_len`` cache rows, on ``device``, the weights where they were, made
    in the same ``torch.inference_mode()`` state: an inference tensor is not written outside it), else
    None. ``keep``: whether the call keeps the buffers it makes (under ``name``, made busy, and
    given back by :func:`release`). A call made while another runs on the kept session (from its
    streamer) leaves it alone and keeps nothing; otherwise a kept session that does not fit, or
    any with ``key`` None (a call that keeps nothing: a batch's), is dropped before the call
    allocates its own."""
    s = steps.get(name)
    if s is not None and s.busy:
        return None, False
    if s is not None and (key is None or s.key != key or s.max_len < max_len or s.device != device
                          or s.ptrs != weight_ptrs(model) or s.inference != torch.is_inference_mode_enabled()):
        del steps[name]
        s = None
    if s is not None:
        s.busy = True
    return s, key is not None


def cache_of(s: Session | None, model: torch.nn.Module, max_len: int) -> Any:
    """The static KV cache a call runs on: ``s``'s, reset in place (keys, values and positions
    zeroed; a kept CUDA graph's pointers stay valid), or a new ``transformers.StaticCache`` of
    ``max_len`` rows where ``s`` is None."""
    if s is not None:
        s.cache.reset()
        return s.cache
    from transformers import StaticCache
    return StaticCache(config=model.config, max_cache_len=max_len)


def release(steps: dict, name: str) -> None:
    """The end of a call that keeps its buffers (:func:`take`): the next call may take them."""
    s = steps.get(name)
    if s is not None:
        s.busy = False


def graph_current(s: Session, watch: Any) -> bool:
    """Whether ``s``'s kept graph still launches what the call's plain warm-up steps ran:
    nothing compiled and no fallback while ``watch`` (a :class:`fusec.fallbacks.FallbackWatch`)
    was open, and the last engine launched is the one the graph captured."""
    from fusec.fallbacks import LAUNCHED
    return not watch.compiled and not watch.fallbacks and LAUNCHED[0] is s.graph_engine
