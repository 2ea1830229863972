"""HF's dynamic RoPE updates traced without a graph break (:func:`install`).

Source: Hugging Face's ``dynamic_rope_update`` decorator (transformers
``modeling_rope_utils.py``), which wraps the ``forward`` of every rotary-embedding class. Before
the RoPE angles are computed, it updates the module's ``inv_freq`` [head_dim * partial / 2, fp32]
from the step's positions:

- ``rope_type="longrope"`` (Phi-3/3.5/4-mini long-context checkpoints; Ding et al. 2024,
  "LongRoPE", §3): ``inv_freq`` is the long-factor table when ``max(position_ids) + 1`` exceeds
  ``original_max_position_embeddings``, else the short-factor one. A pure function of the
  positions.
- ``rope_type="dynamic"`` (dynamic NTK scaling, bloc97/emozilla): when ``max(position_ids) + 1``
  exceeds the largest length seen (``max_seq_len_cached``), ``inv_freq`` is recomputed for it
  (the base grows with the length) and the length remembered; back below the original length
  after growing, the original ``inv_freq`` returns. Stateful: it depends on the longest
  sequence seen, not on the position alone.

Both branch on a tensor (``if seq_len > ...``), which makes dynamo break the graph: the step's
graph is cut in three, two of them without attention (``not a decode step``, inductor), with a
device-to-host sync per step, and ``fusec compile`` (``fullgraph=True``) fails.

:func:`install` registers, for each decorated class, a dynamo polyfill
(``torch.compiler.substitute_in_graph``) of its wrapper that computes the same angles with
``torch.where`` instead of the branch. Eager calls never run it: dynamo uses a polyfill only while
it traces.

- LongRoPE: both tables are computed from the config (constants, which ``fold_constants`` folds;
  ``fold_position`` turns the choice by position into position tables), and HF's RoPE
  ``forward`` runs on a view of the module whose ``inv_freq`` is the chosen table: the module is
  not written (eager's update rewrites ``inv_freq`` at every call before it reads it, so no
  later call sees a difference), and whether an eager call made ``long_inv_freq`` is not a guard.
- Dynamic NTK: the state is written as eager writes it, as module attributes (dynamo replays the
  writes after each call): ``max_seq_len_cached`` becomes a 0-d float32 tensor of an integer value
  (HF's own growth stores an int64 tensor there; eager compares either) and ``inv_freq`` the table
  for it. Float, because fusec takes a one-element integer input for a position counter, bounded
  by the cache's rows, and this length starts at ``max_position_embeddings``.

Guarantees: the cos/sin of a compiled call are eager's (the same ops on the same table); after
it, a dynamic-NTK module's ``inv_freq`` and ``max_seq_len_cached`` hold the values an eager call
would leave. Classes defined later (a model module imported after this) are covered too: the
decorator itself is wrapped so that each new decoration registers its polyfill.
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

import torch

log = logging.getLogger("fusec.frontend.hf_rope")

#: ids of the ``dynamic_rope_update`` wrappers that have a polyfill (each registers once per process)
_REGISTERED: set[int] = set()


def _state(self: Any, layer_type: str | None) -> tuple[str, str, Any]:
    """(rope_type, attribute prefix, config section) of a rotary module for ``layer_type``, as
    HF's update functions read them."""
    if layer_type is None:
        return self.rope_type, "", self.config.rope_parameters
    return self.rope_type[layer_type], f"{layer_type}_", self.config.rope_parameters[layer_type]


def _init_fn(rope_type: str) -> Callable:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    return ROPE_INIT_FUNCTIONS[rope_type]


class _InvFreqView:
    """A rotary module seen with another ``inv_freq`` (attribute ``{prefix}inv_freq``); every other
    attribute is the module's. What HF's RoPE ``forward`` reads, without writing the module."""

    def __init__(self, module: Any, name: str, inv_freq: torch.Tensor):
        self._module, self._name, self._inv_freq = module, name, inv_freq

    def __getattr__(self, name: str) -> Any:
        if name == self._name:
            return self._inv_freq
        return getattr(self._module, name)


def longrope_inv_freq(self: Any, position_ids: torch.Tensor, device: Any, layer_type: str | None = None
                      ) -> tuple[str, torch.Tensor]:
    """(attribute name, table) of HF's ``longrope_frequency_update`` without the branch: the
    long-factor table where ``max(position_ids) + 1 > original_max_position_embeddings``, else
    the short-factor one, selected by ``torch.where``. Both tables are computed from the config
    (constants, folded by ``fold_constants``) in the dtype of ``original_inv_freq``."""
    rope_type, prefix, params = _state(self, layer_type)
    original_max = params["original_max_position_embeddings"]
    original = self.original_inv_freq if layer_type is None else getattr(self, f"{layer_type}_original_inv_freq")
    seq_len = torch.max(position_ids) + 1
    init = _init_fn(rope_type)
    long_inv_freq, _ = init(self.config, device, seq_len=original_max + 1, layer_type=layer_type)
    short_inv_freq, _ = init(self.config, device, seq_len=None, layer_type=layer_type)
    dtype = original.dtype
    return f"{prefix}inv_freq", torch.where(seq_len > original_max, long_inv_freq.to(dtype), short_inv_freq.to(dtype))


def traceable_dynamic_update(self: Any, position_ids: torch.Tensor, device: Any, layer_type: str | None = None):
    """HF's ``dynamic_frequency_update`` without the branches. The state is the remembered length
    ``max_seq_len_cached`` (M): growth (``seq_len > M``: M = seq_len) and reset (``seq_len <
    original_max_seq_len < M``: M = the original length) are selected by ``torch.where``, and
    ``inv_freq`` is what HF's growth computed for M (``rope_init_fn(config, seq_len=M)``, fp32)
    where M exceeds the original length, else ``original_inv_freq``: eager's table for that
    state, recomputed from M at every step rather than read from ``inv_freq``, so that the step
    does not read a buffer it writes (fusec would compile a read-only buffer's value in). Writes
    ``inv_freq`` and M (a 0-d float32 tensor) back to the module, as eager's growth does."""
    rope_type, prefix, _ = _state(self, layer_type)
    if layer_type is None:
        cached, original = self.max_seq_len_cached, self.original_inv_freq
    else:
        cached = getattr(self, f"{layer_type}_max_seq_len_cached", self.max_seq_len_cached)
        original = getattr(self, f"{layer_type}_original_inv_freq")
    base_len = self.original_max_seq_len
    seq_len = torch.max(position_ids) + 1
    # M as a float32 tensor (integers below 2**24 exactly): an integer one-element input would be
    # taken for a position counter (fold_position tables what depends on it over the cache's
    # rows, and M starts at max_position_embeddings, past them)
    cached = torch.as_tensor(cached, device=seq_len.device).to(torch.float32)
    grow = seq_len > cached
    reset = (seq_len < base_len) & (cached > base_len)
    length = torch.where(grow, seq_len.to(torch.float32),
                         torch.where(reset, torch.full((), float(base_len), dtype=torch.float32,
                                                       device=seq_len.device), cached))
    # the table as HF's growth computes it: from an int64 length
    grown, _ = _init_fn(rope_type)(self.config, device, seq_len=length.to(seq_len.dtype), layer_type=layer_type)
    _store(self, f"{prefix}inv_freq", torch.where(length > base_len, grown, original.to(device)))
    _store(self, f"{prefix}max_seq_len_cached", length)


def dynamic_state_as_tensors(model: torch.nn.Module) -> int:
    """Store the remembered lengths (``*max_seq_len_cached``) of ``model``'s dynamic-NTK rotary
    modules as the 0-d float32 tensors a compiled step stores (eager compares either), so that
    the first trace sees what every later one does: one compile instead of two (the first would
    see HF's Python int). For callers that hold the model before its first compiled call
    (``fusec.generate``). Returns how many were converted."""
    n = 0
    for m in model.modules():
        types = m.__dict__.get("rope_type")
        types = types.values() if isinstance(types, dict) else [types]
        if not any(isinstance(t, str) and "dynamic" in t for t in types):
            continue
        device = next((b.device for b in m.buffers()), None)
        for name in [k for k in vars(m) if k.endswith("max_seq_len_cached")]:
            v = vars(m)[name]
            if isinstance(v, int) or (isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype != torch.float32):
                object.__setattr__(m, name, torch.tensor(float(v), dtype=torch.float32, device=device))
                n += 1
    return n


def _store(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """``setattr(module, name, value)`` as ``nn.Module.__setattr__`` does it for a buffer (into
    ``_buffers``) or a plain attribute, without tracing ``__setattr__`` (whose ``isinstance``
    tests of the old value guard on which buffers are the same tensor)."""
    if name in module._buffers:
        module._buffers[name] = value
    else:
        object.__setattr__(module, name, value)


def _traceable_wrapper(rope_forward: Callable) -> Callable:
    """The polyfill of one ``dynamic_rope_update`` wrapper around ``rope_forward``."""
    def wrapper(self, x, position_ids, layer_type=None):
        rope_type = self.rope_type if layer_type is None else self.rope_type[layer_type]
        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        if "dynamic" in rope_type:
            traceable_dynamic_update(self, position_ids, device=x.device, **kwargs)
        elif rope_type == "longrope":
            name, inv_freq = longrope_inv_freq(self, position_ids, device=x.device, **kwargs)
            return rope_forward(_InvFreqView(self, name, inv_freq), x, position_ids, **kwargs)
        return rope_forward(self, x, position_ids, **kwargs)
    return wrapper


def _register(wrapper: Callable) -> None:
    """Register the polyfill of one ``dynamic_rope_update`` wrapper; an unexpected shape
    (another transformers version) keeps HF's graph break, with a log line."""
    code = getattr(wrapper, "__code__", None)
    if id(wrapper) in _REGISTERED or code is None or "rope_forward" not in code.co_freevars:
        return
    rope_forward = wrapper.__closure__[code.co_freevars.index("rope_forward")].cell_contents
    try:
        torch.compiler.substitute_in_graph(wrapper, skip_signature_check=True)(_traceable_wrapper(rope_forward))
    except (TypeError, ValueError) as e:
        log.info("fusec: %s keeps HF's dynamic RoPE graph break (%s)", wrapper.__qualname__, e)
        return
    _REGISTERED.add(id(wrapper))


def _decorated(forward: Any, code: Any) -> Callable | None:
    """The ``dynamic_rope_update`` wrapper inside a class's ``forward`` (through decorators that
    set ``__wrapped__``, e.g. ``torch.no_grad()``), or None."""
    seen = 0
    while forward is not None and seen < 8:
        if getattr(forward, "__code__", None) is code:
            return forward
        forward = getattr(forward, "__wrapped__", None)
        seen += 1
    return None


@functools.cache   # once per process
def install() -> None:
    """Register the polyfills for every rotary class of the transformers modules imported so far,
    and wrap ``transformers.modeling_rope_utils.dynamic_rope_update`` so that classes defined
    later register theirs. Idempotent; without transformers it does nothing."""
    try:
        from transformers import modeling_rope_utils
    except Exception:   # noqa: BLE001 - no transformers (or a broken one): nothing to patch
        return
    original = modeling_rope_utils.dynamic_rope_update
    if getattr(original, "_fusec", False):
        return
    code = original(lambda self, x, position_ids: None).__code__   # every wrapper's code object

    def dynamic_rope_update(rope_forward):
        wrapper = original(rope_forward)
        _register(wrapper)
        return wrapper
    dynamic_rope_update.__doc__ = original.__doc__
    dynamic_rope_update._fusec = True   # type: ignore[attr-defined]
    modeling_rope_utils.dynamic_rope_update = dynamic_rope_update
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, torch.nn.Module) and "forward" in vars(value):
                wrapper = _decorated(vars(value)["forward"], code)
                if wrapper is not None:
                    _register(wrapper)
