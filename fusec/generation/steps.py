"""The decode steps that ``fusec.generate`` compiles: one model step that selects its next token
on the device and writes it back in place (:class:`DecodeStep`, batch 1), and the masked step of
a batch of left-padded sequences (:class:`BatchDecodeStep`)."""
from __future__ import annotations

import itertools
import types
from typing import Any

import torch

from fusec.frontend.mask_bound import causal_bound
from fusec.generation.selection import finish, select


def takes(model: torch.nn.Module, name: str) -> bool:
    """Whether the model's ``forward`` has a parameter ``name`` (HF's generate() passes
    ``position_ids`` only to a forward that has it)."""
    import inspect
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


_COPIES = itertools.count(1)


def own_function(fn: Any, globals_: dict[str, Any] | None = None) -> Any:
    """A copy of the function ``fn`` whose code object dynamo sees as code of its own: the same
    bytecode, ``fn``'s globals (or ``globals_``), defaults and closure, named ``<name>_c<n>``.

    dynamo keeps its compiled graphs per code object, at most
    ``torch._dynamo.config.recompile_limit`` (8), then runs the frame eagerly with a one-time
    torch warning and no backend call; and it remembers per code (file, first line, name) the
    sizes and Python floats each trace saw, making those that changed dynamic in the next
    (automatic dynamic shapes). Steps that are traced from one shared function (each model,
    query length, batch size, sampling setting) would share both: the ninth ran without fusec,
    and a second model's SDPA scale (another ``head_dim``) became a dynamic float, which fusec's
    capture cannot take (a fallback). A copy per step keeps each step's graphs and sizes its own."""
    name = f"{fn.__name__}_c{next(_COPIES)}"
    code = fn.__code__.replace(co_name=name, co_qualname=name) if hasattr(fn.__code__, "co_qualname") \
        else fn.__code__.replace(co_name=name)
    own = types.FunctionType(code, fn.__globals__ if globals_ is None else globals_, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    own.__doc__, own.__kwdefaults__ = fn.__doc__, fn.__kwdefaults__
    return own


def own_forward(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its own copy of its class's ``forward`` (:func:`own_function`, an
    instance attribute), returned for chaining: each ``torch.compile`` of a wrapper module a
    step of its own to dynamo."""
    own = own_function(type(module).forward)
    object.__setattr__(module, "forward", types.MethodType(own, module))
    return module


class DecodeStep(torch.nn.Module):
    """One decode step that picks its next token on the device and feeds it back in place.

    ``forward(tokens, cache[, noise])``: ``tokens`` is the int64 ``[1, 1]`` device tensor of
    the current token; the step runs the model on it, selects the next token (see
    :func:`select`; ``noise``: Gumbel samples ``[1, V]`` when sampling), writes it into
    ``tokens`` and returns it. With ``select_in_graph`` False (sampling, see
    :func:`fusec.generate._selection_in_graph`), it returns the last logits ``[1, V]`` instead and the caller
    selects and writes the token.
    """

    def __init__(self, model: torch.nn.Module, sample: bool, temperature: float, top_k: int | None,
                 select_in_graph: bool):
        super().__init__()
        self.model = model
        self.sample = sample
        self.temperature = float(temperature)
        self.top_k = top_k
        self.select_in_graph = select_in_graph

    def forward(self, tokens: torch.Tensor, cache: Any, noise: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[:, -1]
        if not self.select_in_graph:
            return logits
        nxt = select(logits, noise if self.sample else None, self.temperature, self.top_k, None)
        tokens.copy_(nxt.view(1, 1))
        return nxt


class BatchDecodeStep(DecodeStep):
    """One decode step of a batch of B sequences (left-padded prompts), fed back in place.

    ``forward(tokens, positions, mask, unfinished, cache[, noise])``:

    - ``tokens``: int64 ``[B, 1]``, each sequence's current token;
    - ``positions``: int64 ``[B, 1]``, each sequence's RoPE position (``position_ids``): the step
      adds 1 in place after the model read it;
    - ``mask``: the attention mask over the cache's L rows, either the complete bool mask
      ``[B, 1, 1, L]`` that SDPA reads (True: attend; the caller sets the current row's column
      before each step, :class:`fusec.generation.batch.Batch`) or the int64 ``[B, L]`` padding mask from which HF
      builds the per-layer masks inside the step (for caches with sliding-window layers);
    - ``unfinished``: int64 ``[B, 1]``, 1 while a sequence has produced no end-of-sequence token
      (:func:`finish`; untouched when there are no eos ids);
    - ``noise``: Gumbel samples ``[B, V]`` when sampling in the step.

    It runs the model on ``tokens``, selects each sequence's next token (:func:`select`, row
    by row), replaces the tokens of finished sequences by ``pad`` (:func:`finish`), writes them
    into ``tokens`` and returns them (``[B]``). With ``select_in_graph`` False it returns the
    last logits ``[B, V]`` instead; the caller selects, finishes and writes.
    """

    def __init__(self, model: torch.nn.Module, sample: bool, temperature: float, top_k: int | None,
                 select_in_graph: bool, eos: tuple[int, ...], pad: int):
        super().__init__(model, sample, temperature, top_k, select_in_graph)
        self.eos = tuple(eos)   # plain settings: part of the precompiled step's key
        self.pad = int(pad)
        self.position_ids = takes(model, "position_ids")

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, unfinished: torch.Tensor,
                cache: Any, noise: torch.Tensor | None = None) -> torch.Tensor:
        if mask.dim() == 4:   # the mask spans the cache's rows: one length symbol for both
            torch._check(mask.shape[-1] == cache.layers[0].keys.shape[-2])
            mask = causal_bound(mask, cache, tokens.shape[-1])   # rows 0 .. the position read, same values
        pos = {"position_ids": positions} if self.position_ids else {}
        logits = self.model(input_ids=tokens, attention_mask=mask, past_key_values=cache, use_cache=True,
                            **pos).logits[:, -1]
        if self.position_ids:
            positions.add_(1)
        if not self.select_in_graph:
            return logits
        nxt = select(logits, noise if self.sample else None, self.temperature, self.top_k, None)
        if self.eos:
            nxt = finish(nxt, unfinished, self.eos, self.pad)
        tokens.copy_(nxt.view(tokens.shape))
        return nxt
