"""A Hugging Face ``StaticCache`` whose length dynamo sees as symbolic (``fusec.generate``).

HF's ``StaticLayer`` tells the attention mask its length as the Python int ``max_cache_len``,
on which dynamo guards: every cache length would be a new trace and a new graph. The layers of
a cache passed to :func:`length_symbolic` report their K tensor's rows instead
(:class:`StaticLayerRows`), and those rows are marked dynamic: dynamo traces one graph with a
symbolic length, and fusec compiles one step for every length
(:class:`fusec.frontend.backend.SymbolicStep`).
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer


def _one_length(layer: Any) -> None:
    """Tell dynamo that ``layer``'s V cache rows are its K cache's (``torch._check``), before
    HF's update: the two marked tensors would otherwise keep a length symbol each unless some op
    equates them (HF's ``repeat_kv`` and the mask did for K; with SDPA taking grouped-query
    inputs nothing does for V), and fusec needs one length per layer."""
    torch._check(layer.values.shape[-2] == layer.keys.shape[-2])


class StaticLayerRows(StaticLayer):
    """HF's ``StaticLayer`` whose attention-mask length is its cache tensor's rows
    (``keys.shape[-2]``: symbolic when marked dynamic) rather than the int ``max_cache_len``.
    Same values: the rows are ``max_cache_len`` once the layer is initialized."""

    def get_mask_sizes(self, query_length: int) -> tuple[Any, int]:
        return self.keys.shape[-2], 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        _one_length(self)
        return super().update(key_states, value_states, *args, **kwargs)


class SlidingLayerRows(StaticSlidingWindowLayer):
    """HF's ``StaticSlidingWindowLayer`` whose ``max_cache_len`` (its rows: the window, or a
    shorter cache's length) reads its K tensor's rows once it is initialized (symbolic when
    marked dynamic), so that its mask sizes, its ``is_full`` branch and its window offset follow
    the tensor's length rather than a Python int dynamo would specialize on. Same values."""

    @property
    def max_cache_len(self) -> Any:
        keys = self.__dict__.get("keys")
        return keys.shape[-2] if isinstance(keys, torch.Tensor) else self.__dict__["max_cache_len"]

    @max_cache_len.setter
    def max_cache_len(self, value: int) -> None:
        self.__dict__["max_cache_len"] = value

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        _one_length(self)
        return super().update(key_states, value_states, *args, **kwargs)


def length_symbolic(cache: Any, sliding_window: int | None = None) -> bool:
    """Make the (initialized) static ``cache``'s length symbolic for dynamo: its full-attention
    layers become :class:`StaticLayerRows` and their K and V rows are marked dynamic
    (``torch._dynamo.maybe_mark_dynamic``). A sliding-window layer shorter than the model's
    ``sliding_window`` (a cache shorter than the window: its rows are the cache's length, which
    changes with each call's) becomes :class:`SlidingLayerRows`, marked the same way; one of
    the window's rows (or any, without ``sliding_window``) is left as it is: its length is the
    window, and its rolled step (past the window) is traced for it. Returns whether every
    layer was changed."""
    layers = getattr(cache, "layers", ())
    done = 0
    for layer in layers:
        if not isinstance(getattr(layer, "keys", None), torch.Tensor):
            continue
        if type(layer) in (StaticLayer, StaticLayerRows):
            layer.__class__ = StaticLayerRows
        elif type(layer) in (StaticSlidingWindowLayer, SlidingLayerRows) and sliding_window is not None \
                and layer.keys.shape[-2] < sliding_window:
            layer.__class__ = SlidingLayerRows
        else:
            continue
        torch._dynamo.maybe_mark_dynamic(layer.keys, 2)
        torch._dynamo.maybe_mark_dynamic(layer.values, 2)
        done += 1
    return bool(layers) and done == len(layers)
