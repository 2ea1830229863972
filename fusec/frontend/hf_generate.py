"""HF ``generate()`` through fusec: one compile for every length, and no dynamo trace when warm.

transformers compiles generate()'s decode call as ``torch.compile(model.__call__,
**compile_config.to_dict())`` (``PreTrainedModel.get_compiled_call``). Under dynamo's defaults
that is a static trace at the first cache length, then a second trace with a symbolic length at
the second (each a fusec compile: 10.6 s and 14.4 s cold for Llama-3.2-1B on the H200), and a
dynamo trace in every new process (3.8 s warm). :func:`install` wraps ``get_compiled_call``: for
a :class:`~transformers.generation.CompileConfig` whose backend is fusec and whose ``dynamic``
is left at its default, the decode call becomes a :class:`HFDecodeCall`. On a static cache
(every layer a plain ``StaticLayer``) it makes the cache's length symbolic from the first call
(:func:`fusec.frontend.static_cache.length_symbolic`, as :func:`fusec.generate` does) and runs
through :class:`fusec.frontend.precompiled.PrecompiledStep`: one trace and one fusec step for
every prompt length and ``max_new_tokens``, stored so that a later process loads dynamo's
graph and guards instead of tracing. Any other call (a sliding-window cache, whose layers count
positions in Python; a precompile that fails, e.g. at a graph break) runs HF's own compiled call,
as without this module. ``CompileConfig(dynamic=True)`` or ``dynamic=False`` keeps HF's path
(the user asked for it).

``import fusec`` installs it (then transformers' ``modeling_utils`` need not be imported yet), and
so does the backend's import (which imports the ``fusec`` package first), which torch performs
inside the first ``get_compiled_call`` when fusec was never imported: that generate() call and
the later ones on the same model keep HF's path (its compiled call already exists); models
compiled after it take this one.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable

import torch

from fusec.frontend.mask_bound import causal_bound

log = logging.getLogger("fusec")


def is_fusec_backend(backend: Any) -> bool:
    """Whether a ``CompileConfig.backend`` names fusec (the registered name or its function)."""
    if isinstance(backend, str):
        return backend == "fusec"
    return getattr(backend, "__module__", "") == "fusec.frontend.backend" and \
        getattr(backend, "__name__", "") == "fusec_backend"


def compile_kwargs(compile_config: Any) -> dict[str, Any]:
    """``torch.compile``'s arguments for a fusec ``CompileConfig``: its ``to_dict()``, with
    ``mode`` moved into fusec's ``options`` when it has options (torch refuses both at once, so
    HF's default ``mode="reduce-overhead"`` with fusec options would raise; fusec reads the mode
    from its options as from torch's keyword: "reduce-overhead" replays its launch from a CUDA
    graph)."""
    kw = compile_config.to_dict()
    if kw.get("options") is not None and kw.get("mode") is not None:
        kw["options"] = {"mode": kw.pop("mode"), **kw["options"]}
    return kw


class _ModelCall(torch.nn.Module):
    """``model(**dict(zip(names, values)))`` called as ``module(*values)``, generate()'s 4-D mask
    ANDed with the causal row of the step (:func:`fusec.frontend.mask_bound.causal_bound`: the
    same values, and the attention reads rows up to the position only): the precompiled
    function's first argument. Positional values, not keywords: the precompile traces and
    checks guards on a positional signature (``fusec.generate``'s step has one too). Its
    ``names`` key the artifact cache entry with the model's class and configuration
    (:func:`fusec.frontend.precompiled.key`)."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model, self.names = model, tuple(names)

    def forward(self, *values: Any) -> Any:
        kw = dict(zip(self.names, values))
        if "attention_mask" in kw and "input_ids" in kw:   # the mask bounded by the position: same values
            kw["attention_mask"] = causal_bound(kw["attention_mask"], kw.get("past_key_values"),
                                                kw["input_ids"].shape[-1])
        return self.model(**kw)


class HFDecodeCall:
    """generate()'s decode call ``model(**model_inputs)`` for a fusec ``CompileConfig``.

    Args:
        model: the HF causal LM (``PreTrainedModel``).
        compile_config: generate()'s ``CompileConfig`` (backend fusec); its ``options`` are
            fusec's options.

    Calling it: as ``model(**kwargs)`` (generate() passes ``input_ids`` [1, 1] int64, the
    ``past_key_values`` cache, a 4-D ``attention_mask`` over the cache's rows, ``use_cache``,
    ``return_dict``; returns the model's output). A static cache goes through one precompiled
    step whose cache length is symbolic; anything else through HF's own compiled call.
    """

    def __init__(self, model: torch.nn.Module, compile_config: Any):
        # nothing here reads the config: dynamo unpickles this object with placeholders for
        # the values a saved step's guards do not need (:meth:`__reduce__`)
        self.model, self.compile_config = model, compile_config
        self._plain: Callable | None = None
        self._prepared: Any = None   # a weak reference to the cache made length-symbolic last
        self.steps: dict[tuple[str, ...], Any] = {}   # one precompiled step per set of argument names
        self.watch: Any = None   # the model's CodeWatch (_get_compiled_call; not here: see above)

    @property
    def options(self) -> dict[str, Any]:
        """fusec's options: the config's ``options`` and its ``mode`` (torch passes ``mode`` to
        a backend as a keyword; a precompiled step's backend gets only options, so the mode,
        HF's default "reduce-overhead": fusec replays the launch from a CUDA graph, travels
        among them)."""
        cc = self.compile_config
        return {**({"mode": cc.mode} if cc.mode is not None else {}), **(cc.options or {})}

    def step_for(self, names: tuple[str, ...]) -> Any:
        """The precompiled step of a call with keyword arguments ``names`` (in call order)."""
        from fusec.frontend.precompiled import PrecompiledStep
        from fusec.generation.steps import own_forward
        if names not in self.steps:
            module, kw = _ModelCall(self.model, names), compile_kwargs(self.compile_config)
            # without a precompiled step (the cache option off, a graph break under fullgraph):
            # the same call through torch.compile with generate()'s config; the marks still
            # make the cache's length symbolic from the first call
            self.steps[names] = PrecompiledStep(module, self.model, self.options,
                                                fallback=lambda: torch.compile(own_forward(module), **kw),
                                                before_trace=lambda args, _: _mark_masks(names, args))
        return self.steps[names]

    def __reduce__(self) -> tuple:
        """Pickles and copies (of the model that holds it) make a new call with nothing
        compiled: the loaded steps' guard managers cannot be pickled, and dynamo pickles the
        model's state when it saves a second precompiled step of the same model."""
        return (HFDecodeCall, (self.model, self.compile_config))

    def plain(self) -> Callable:
        """HF's own compiled call (``torch.compile(model.__call__, **compile_config.to_dict())``,
        :func:`compile_kwargs`)."""
        if self._plain is None:
            self._plain = torch.compile(self.model.__call__, **compile_kwargs(self.compile_config))
        return self._plain

    def __call__(self, **kwargs: Any) -> Any:
        from fusec.frontend.static_cache import length_symbolic
        cache = kwargs.get("past_key_values")
        if self._prepared is None or self._prepared() is not cache:   # a new cache: look at it once
            if cache is None or not _static_layers(cache):
                return self.plain()(**kwargs)
            length_symbolic(cache)
            self._prepared = weakref.ref(cache)
        return self.step_for(tuple(kwargs))(*kwargs.values())


def _mark_masks(names: tuple[str, ...], values: tuple) -> None:
    """Before a trace: generate()'s 4-D mask spans the cache's rows (a dict of them, one per layer
    type, for models with ``layer_types``: Qwen3, Gemma-2/3), so its length is the cache's symbol
    too (``maybe_mark_dynamic``)."""
    kw = dict(zip(names, values))
    rows, mask = kw["past_key_values"].layers[0].keys.shape[-2], kw.get("attention_mask")
    for m in (mask.values() if isinstance(mask, dict) else (mask,)):
        if isinstance(m, torch.Tensor) and m.dim() == 4 and m.shape[-1] == rows:
            torch._dynamo.maybe_mark_dynamic(m, 3)


def _static_layers(cache: Any) -> bool:
    """Whether every layer of ``cache`` is an initialized plain static layer (HF's
    ``StaticLayer`` or fusec's ``StaticLayerRows``): its length can be symbolic."""
    from transformers.cache_utils import StaticLayer

    from fusec.frontend.static_cache import StaticLayerRows
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in (StaticLayer, StaticLayerRows)
                                and isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers)


@functools.cache   # once per process
def install() -> None:
    """Wrap ``transformers.modeling_utils.PreTrainedModel.get_compiled_call`` (idempotent; a
    no-op without transformers): the compiled call for a fusec ``CompileConfig`` with
    ``dynamic`` unset is a :class:`HFDecodeCall` (kept while the config is equal, as HF keeps
    its own); every other call is HF's, as is a call HF made before this was installed."""
    try:
        from transformers.modeling_utils import PreTrainedModel
    except Exception:   # noqa: BLE001 - no transformers (or a broken one): nothing to wrap
        return
    from fusec.frontend.hf_patch import wrap_once

    def make(original: Callable) -> Callable:
        def get_compiled_call(self: Any, compile_config: Any) -> Callable:
            return _get_compiled_call(original, self, compile_config)
        return get_compiled_call
    wrap_once(PreTrainedModel, "get_compiled_call", make)


def _get_compiled_call(original: Callable, self: Any, compile_config: Any) -> Callable:
    """``get_compiled_call`` for fusec's configs (:func:`install`); ``original``: HF's."""
    mine = self.__dict__.get("_compiled_call")
    if compile_config is None or not is_fusec_backend(getattr(compile_config, "backend", None)) \
            or "llama4" in getattr(self.config, "model_type", ""):
        return original(self, compile_config)   # not ours
    from fusec.frontend.value_snapshot import check_at_next_call
    check_at_next_call()   # once per generate(): compiled-in weights written through .data, compared at the next step
    if mine is not None and not isinstance(mine, HFDecodeCall) and compile_config.dynamic is None \
            and getattr(self, "_last_compile_config", None) == compile_config:
        if not self.__dict__.get("_fusec_told"):   # HF's call, made before install(): keep it
            self.__dict__["_fusec_told"] = True
            log.info("fusec: this model's generate() decode call was compiled before fusec was imported: "
                     "a second prompt length compiles again; `import fusec` before the first "
                     "generate() gives one precompiled step for every length")
        return original(self, compile_config)
    if compile_config.dynamic is not None:   # HF's path, the user asked for it; mode and
        # fusec options together (compile_kwargs), which HF's own call would refuse
        if mine is None or self._last_compile_config != compile_config:
            self._last_compile_config = compile_config
            self._compiled_call = torch.compile(self.__call__, **compile_kwargs(compile_config))
        return self._compiled_call
    if not isinstance(mine, HFDecodeCall) or self._last_compile_config != compile_config:
        self._last_compile_config = compile_config
        self._compiled_call = HFDecodeCall(self, compile_config)
    call = self._compiled_call
    if call.watch is None:
        from fusec.frontend.code_fingerprint import CodeWatch
        call.watch = CodeWatch(self)
    call.watch.clear_if_changed(call.steps, "generate() step was")   # once per generate(): no kept guard sees it
    return call
