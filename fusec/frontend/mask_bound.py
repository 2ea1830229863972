"""generate()'s attention mask bounded by the step's position (:func:`causal_bound`): the same
values, in a form fusec proves from the step's graph, so that a masked decode step reads the
cache's rows up to its position rather than all of them."""
from __future__ import annotations

from typing import Any

import torch


def causal_bound(mask: Any, cache: Any, query_tokens: int) -> Any:
    """generate()'s 4-D bool ``mask`` ``[B, 1, 1, L]`` over a static ``cache``'s L rows (or a
    dict of them, one per layer type), AND the causal mask ``row <= p`` of the row ``p`` the
    step writes (the first layer's ``cumulative_length``, HF's device counter of the rows written).

    The same values: HF's mask of a decode step (causal, AND the prompt's padding) and
    :class:`fusec.generation.batch.Batch`'s have no True past ``p``. What it adds is what fusec
    can prove from the step's graph (:func:`fusec.ir.mask_proofs.bounded_by_positions`, then
    :func:`~fusec.ir.mask_proofs.without_causal_term`): the attention reads rows ``0 .. p``
    under the mask instead of all L rows (the mask, a graph input, is otherwise any mask), and
    its tile set follows the position (:mod:`fusec.instructions.attention_sets`). Anything else
    (``query_tokens`` > 1, a float mask, a cache without the counter) is returned as it is.

    Args:
        mask: the ``attention_mask`` the model is called with.
        cache: its ``past_key_values``.
        query_tokens: the new tokens of the step (``input_ids.shape[-1]``).
    """
    if isinstance(mask, dict):
        return {k: causal_bound(m, cache, query_tokens) for k, m in mask.items()}
    layers = getattr(cache, "layers", None)
    counter = getattr(layers[0], "cumulative_length", None) if layers else None
    if query_tokens != 1 or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4 \
            or mask.shape[-2] != 1 or not isinstance(counter, torch.Tensor) \
            or not isinstance(getattr(layers[0], "keys", None), torch.Tensor) \
            or mask.shape[-1] != layers[0].keys.shape[-2]:
        return mask
    return mask & (torch.arange(mask.shape[-1], device=mask.device) <= counter.to(mask.device))
