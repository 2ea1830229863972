"""The device state of a batch's decode loop (:class:`Batch`): positions, the attention mask over
the cache's rows, the unfinished flags; the prefill's positions of left-padded prompts; which
caches count positions on the host."""
from __future__ import annotations

from typing import Any

import torch


def positions(mask: torch.Tensor) -> torch.Tensor:
    """The prefill's ``position_ids`` [B, n] of left-padded prompts, as HF's generate()
    (``GenerationMixin._prepare_position_ids_for_generation``, transformers 5.17): the mask's
    cumulative sum minus 1, the padding's positions 0."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def host_counted(cache: Any) -> bool:
    """Whether ``cache`` has layers that count positions in a Python ``int`` (HF's
    ``StaticSlidingWindowLayer``: Mistral with a sliding window, Gemma-2, Gemma-3, StarCoder2). Their decode
    step takes that integer each call (fusec.frontend.host_scalars), so it can be neither replayed
    from a CUDA graph (the count would stay at its captured value) nor precompiled (dynamo guards
    on the value)."""
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))


def full_attention(model: torch.nn.Module, cache: Any) -> bool:
    """Whether :class:`Batch` may keep the complete bool mask on the device: every layer attends
    causally to the whole cache (no sliding window, no chunked attention: the cache has no
    sliding-window layers and the config's ``layer_types``, where it has them, are all
    ``"full_attention"``), so a decode step's mask is the padding and the causal bound; and the
    model's attention reads a bool mask as a mask (SDPA). HF's eager attention adds its mask to the
    scores: a bool one would add 1.0 and 0.0 (wrong tokens, 2026-12-07); it gets the ``[B, L]``
    padding mask, from which HF builds its float mask inside the step."""
    config = getattr(model, "config", None)
    types = getattr(config, "layer_types", None) or ("full_attention",)
    sdpa = getattr(config, "_attn_implementation", "sdpa") in ("sdpa", None)
    return sdpa and not host_counted(cache) and all(t == "full_attention" for t in types)


class Batch:
    """The device state of :class:`fusec.generation.steps.BatchDecodeStep` for prompts ``[B, n]`` with their 0/1 mask
    ``[B, n]``, a cache of ``rows`` rows and prefill positions ``pos0`` [B, n] (:func:`positions`).

    Attributes:
        positions: int64 ``[B, 1]``, the next token's position per sequence (the prompt's last
            position + 1, as HF's ``_update_model_kwargs_for_generation``); the step advances it.
        mask: with ``complete`` the bool ``[B, 1, 1, rows]`` mask: the prompt's mask, then False;
            :meth:`advance` sets the column of the row the next step writes (``col``, an int64
            ``[1]`` device counter) before each step, so a step attends to its own row and those
            before it, as HF's causal mask with the padding of generate()'s 2-D mask. Without
            ``complete``: int64 ``[B, rows]``, the prompt's mask, then 1 (HF's causal and
            sliding-window parts hide the later columns inside the step).
        unfinished: int64 ``[B, 1]`` ones (:func:`finish`).
        eos, pad: the eos ids and the pad id.

    Every tensor's dim 0 is marked static (``torch._dynamo.mark_static``): another batch size is
    another trace at a fixed B, never a symbolic batch (which fusec does not compile as one step
    for every cache length); the mask's length dim is marked dynamic, as the cache's rows.
    """

    def __init__(self, mask: torch.Tensor, pos0: torch.Tensor, rows: int, complete: bool,
                 eos: tuple[int, ...], pad: int):
        b, n = mask.shape
        dev = mask.device
        self.positions = pos0[:, -1:] + 1
        self.complete = complete
        if complete:
            self.mask = torch.zeros(b, 1, 1, rows, dtype=torch.bool, device=dev)
            self.mask[:, 0, 0, :n] = mask.bool()
            self.col = torch.full((1,), n, dtype=torch.int64, device=dev)
        else:
            self.mask = torch.ones(b, rows, dtype=torch.int64, device=dev)
            self.mask[:, :n] = mask
            self.col = None
        torch._dynamo.maybe_mark_dynamic(self.mask, self.mask.dim() - 1)
        self.unfinished = torch.ones(b, 1, dtype=torch.int64, device=dev)
        self.eos, self.pad = tuple(eos), int(pad)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The step's inputs after the tokens: positions, mask, unfinished."""
        return self.positions, self.mask, self.unfinished

    def advance(self) -> None:
        """Before a step (complete mask): attend to the row it writes. Two device ops, no host read."""
        if self.col is not None:
            self.mask.index_fill_(-1, self.col, True)
            self.col.add_(1)


def static_batch(*objs: Any) -> None:
    """Mark dim 0 (the batch) of the tensors of ``objs`` (tensors, and the K and V tensors of a
    cache's layers) static for dynamo (:class:`Batch`)."""
    for x in objs:
        for t in (x,) if isinstance(x, torch.Tensor) else \
                [v for layer in getattr(x, "layers", ()) for v in vars(layer).values() if isinstance(v, torch.Tensor)]:
            if t.dim() and t.shape[0] > 1:
                torch._dynamo.mark_static(t, 0)
