"""Warm start past dynamo: a decode step traced once, then loaded by later processes.

A warm ``torch.compile(model, backend="fusec")`` skips AOT autograd and every fusec stage
(:mod:`fusec.frontend.warm`, the artifact cache), but dynamo still traces the model's Python
in every new process before it calls the backend: 2.4-3.8 s of the Llama-3.2-1B's 4.4-5.1 s
warm start on the H200 machine (docs/compile-time.md). torch's ahead-of-time precompile
(``torch.compile(fn, fullgraph=True).aot_compile(...)``, experimental since torch 2.9) saves
dynamo's graph, guards and bytecode; a later process loads them without tracing. It needs a
backend that returns a :class:`torch._dynamo.aot_compile_types.SerializableCallable`:
:class:`SerializedStep`.

:class:`PrecompiledStep` is the decode step of :func:`fusec.generate`: on its first call with
a new set of inputs it looks in the artifact cache for a precompiled step under a key of the
model (class, configuration), the step's settings, the inputs' shapes, fusec's options and
the toolchain (:func:`key`; weight values are never part of it); it loads the entry if there is
one and its guards hold for the call's inputs, else traces with ``aot_compile``, stores the
result and uses it. Anything in that path that fails (a graph break under ``fullgraph``, a
guard that cannot be serialized, a torch without the API) logs one line and the step runs
through plain ``torch.compile(module, backend="fusec")`` instead: slower to start, never wrong.

Guards: torch drops guards on globals and those it cannot serialize (an object's identity;
for HF models, the code object inside a decorator of ``forward``), and dynamo does not guard
on module hooks. The key stands in for them: the model class, transformers' and torch's
versions, fusec's source, and a digest of the code the model's forward may run, its hooks and
transformers' attention registry (:mod:`fusec.frontend.code_fingerprint`: a patched
``forward``, a rebound module function, a registered attention function or a hook gives
another key; within one process, the steps kept for a model are dropped when such a change is
seen, :class:`fusec.frontend.code_fingerprint.CodeWatch`, and the next call traces again). What
that digest does not cover (a global flag the model's code reads, code in modules the model's
modules import nothing from) a loaded step does not see: set the ``cache`` option off
(``FUSEC_CACHE=0``) in a process that changes such state. The guards kept (every
tensor's shape, dtype, device and stride, the modules' ``training`` flags, the step's
settings) are checked before every call; a miss traces again for the new inputs.
"""
from __future__ import annotations

import builtins
import hashlib
import json
import logging
import pickle
import time
import types
import weakref
from typing import Any, Callable

import torch

from fusec.config import Options

log = logging.getLogger("fusec")

#: the artifact cache entry's ``kind``: a precompiled step (torch's serialized AOT function)
KIND = "precompiled"
#: precompiled steps kept per :class:`PrecompiledStep` (one per set of input shapes)
MAX_ENTRIES = 8


def serializable_guards(entries: list[Any]) -> list[bool]:
    """The ``guard_filter_fn`` of the precompile: keep a guard unless it is on a global or of a
    type torch cannot serialize (its own default filter also drops those whose *derived* type
    cannot be serialized: a ``CONSTANT_MATCH`` on a code object is an ``ID_MATCH``)."""
    from torch._dynamo.guards import CheckFunctionManager
    bad = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or e.guard_type in bad or any(t in bad for t in (e.derived_guard_types or ())))
            for e in entries]


try:
    from torch._dynamo.aot_compile_types import SerializableCallable as _Serializable
except ImportError:   # a torch without the precompile API: PrecompiledStep falls back
    _Serializable = object


class SerializedStep(_Serializable):
    """The backend's result under ``aot_compile``: dynamo's graph module and fusec's options,
    compiled by :func:`fusec.frontend.backend.fusec_backend` on the first call (with that call's
    real inputs; in a warm process the IR and the kernel come from fusec's caches).

    The graph module is kept as bytes (:func:`graph_bytes`): the first process compiles the same
    round-tripped graph as a later one, so both reach the same warm-start key. Which inputs are
    the model's weights ``capture.model_tensors`` reads from the placeholders' names, which
    spell dynamo's sources (``l_module_..._buffers_inv_freq_``) and survive serialization."""

    def __init__(self, gm_bytes: bytes, options: dict[str, Any]):
        self.gm_bytes, self.options = gm_bytes, dict(options)
        self.gm = graph_from_bytes(gm_bytes)
        self.step: Callable | None = None

    @classmethod
    def from_dynamo(cls, gm: torch.fx.GraphModule, example_inputs: list[Any],
                    options: dict[str, Any]) -> "SerializedStep":
        """The backend: wrap dynamo's ``gm`` (nothing is compiled until the first call)."""
        return cls(graph_bytes(gm), options)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "SerializedStep") -> bytes:
        return pickle.dumps({"gm": fn.gm_bytes, "options": fn.options})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "SerializedStep":
        d = pickle.loads(data)
        return cls(d["gm"], d["options"])

    def __call__(self, *args: Any) -> Any:
        if self.step is None:
            from torch._guards import TracingContext, tracing
            from torch._subclasses.fake_tensor import FakeTensorMode

            from fusec.frontend.backend import fusec_backend
            # AOT autograd records the graph's metadata in the tracing context, which dynamo
            # provides to a backend it calls; the warm-start check reads it there
            with tracing(TracingContext(FakeTensorMode())):
                self.step = fusec_backend(self.gm, list(args), self.options)
        return self.step(*args)


def graph_bytes(gm: torch.fx.GraphModule) -> bytes:
    """``gm`` serialized node by node (``torch.fx._graph_pickler.GraphPickler``; a plain pickle
    re-traces the generated code, which folds calls on constants such as ``torch.arange`` and
    drops ``torch._C._set_grad_enabled``). Each node's metadata keeps only its ``stack_trace``
    (error messages name the model's line) and its ``example_value`` as a meta tensor of the
    same shape, stride and dtype (``check_decode_step`` reads the attention's shapes); dynamo's
    fake tensors and input records hold weak references that do not pickle."""
    import copy

    import torch.utils._pytree as pytree
    from torch.fx._graph_pickler import GraphPickler, Options as PicklerOptions

    from fusec.frontend.symbolic import mark_symbolic
    from fusec.frontend.capture import MODEL_TENSOR

    def lite(v: Any) -> Any:
        if isinstance(v, torch.Tensor):   # symbolic sizes at their hints (mark_symbolic keeps which)
            return torch.empty_strided([_hint(d) for d in v.shape], [_hint(d) for d in v.stride()],
                                       dtype=v.dtype, device="meta")
        if isinstance(v, torch.SymInt):
            return _hint(v)
        return v if isinstance(v, (bool, int, float, str, type(None))) else None

    mark_symbolic(gm)
    g = copy.deepcopy(gm.graph)
    for n in g.nodes:
        meta = {k: n.meta[k] for k in ("stack_trace", "fusec_symbolic", MODEL_TENSOR) if k in n.meta}
        if "example_value" in n.meta:
            meta["example_value"] = pytree.tree_map(lite, n.meta["example_value"])
        n.meta = meta
    out = torch.fx.GraphModule(gm, g)
    out.meta = {}
    return GraphPickler.dumps(out, PicklerOptions(ops_filter=None))


def _hint(d: Any) -> int:
    """A size as an int: a symbolic one at its hint (the traced value)."""
    return int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)


def graph_from_bytes(data: bytes) -> torch.fx.GraphModule:
    """The graph module :func:`graph_bytes` serialized, callable: ``GraphPickler`` rebuilds the
    graph but not the module's generated ``forward``, which the eager fallback
    (``fusec.frontend.backend.fallback``) returns (without it, a step that fell back with
    ``fallback="eager"`` raised ``NotImplementedError: Module [GraphModuleImpl] is missing the
    required "forward" function`` at its first call)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    gm = GraphPickler.loads(data, FakeTensorMode())
    gm.recompile()
    return gm


def _run_code(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The function torch precompiles: the step module called on the step's inputs."""
    return module(*args, **kwargs)


#: the globals of the function torch precompiles: the builtins as plain entries. Its traced
#: bytecode may load a builtin by global name (``type``: HF's generate() path rebuilds a
#: ModelOutput); torch 2.13 saves such names with the step, torch 2.11 only checks that the
#: function's globals (after a trace) and the ``f_globals`` given at load hold every name the
#: bytecode loads, and a module's globals hold no builtin. Dynamo also installs the globals it
#: makes (``___module_collections_<id>_c0``) here. Except ``range``: dynamo rebuilds a range
#: object in a step's output by loading ``range`` by name and refuses a frame whose globals
#: shadow it (``'range' must not be shadowed in f_globals``: no precompiled step at all).
_RUN_GLOBALS: dict[str, Any] = {**{k: v for k, v in vars(builtins).items() if k != "range"},
                                "__name__": __name__, "__builtins__": builtins}
_run = types.FunctionType(_run_code.__code__, _RUN_GLOBALS, "_run")
_run.__doc__ = _run_code.__doc__


def _describe(x: Any) -> Any:
    """A JSON-able description of one step input for the key (shapes, not values; a dim marked
    dynamic, ``torch._dynamo.mark_dynamic``, as -1: the traced step serves every size there)."""
    if isinstance(x, torch.Tensor):
        dynamic = getattr(x, "_dynamo_dynamic_indices", set()) | getattr(x, "_dynamo_weak_dynamic_indices", set())
        return ["tensor", [-1 if i in dynamic else d for i, d in enumerate(x.shape)], str(x.dtype), x.device.type]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, dict):
        return {str(k): _describe(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_describe(v) for v in x]
    tensors = [v for v in vars(x).values() if isinstance(v, torch.Tensor)] if hasattr(x, "__dict__") else []
    layers = getattr(x, "layers", None)
    shapes = []
    for layer in layers if isinstance(layers, (list, tuple)) else ():
        shapes.append([_describe(v) for v in vars(layer).values() if isinstance(v, torch.Tensor)])
    return [f"{type(x).__module__}.{type(x).__qualname__}", [_describe(t) for t in tensors], shapes]


def key(module: torch.nn.Module, model: torch.nn.Module, args: tuple, options: dict[str, Any],
        kwargs: dict[str, Any] | None = None) -> str:
    """The cache key (hex sha256) of precompiling ``module(*args, **kwargs)``: the toolchain
    (:func:`fusec.cache.artifacts.toolchain`, transformers' version), the model's class and
    configuration (``config.to_json_string``), the code its forward may run and its hooks
    (:func:`fusec.frontend.code_fingerprint.model_code_digest`: dynamo's guards on them cannot
    be saved), the step module's class and its plain settings, each input's description (tensor
    shapes, dtypes, device types; a cache object's class and its tensors' shapes), the
    parameters' dtypes and devices, fusec's options and the global
    modes dynamo's tracing depends on. Not the weights' values."""
    from fusec.frontend.code_fingerprint import model_code_digest
    from fusec.frontend.warm import global_modes
    from fusec.cache.artifacts import toolchain
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:   # pragma: no cover - transformers is a requirement
        tf_version = None
    cfg = getattr(model, "config", None)
    settings = {k: repr(v) for k, v in vars(module).items() if not k.startswith("_")}
    params = sorted({(str(p.dtype), p.device.type) for p in model.parameters()})
    parts = {**toolchain(), "kind": KIND, "transformers": tf_version,
             "model": f"{type(model).__module__}.{type(model).__qualname__}",
             "config": cfg.to_json_string() if hasattr(cfg, "to_json_string") else repr(cfg),
             "code": model_code_digest(model),
             "module": f"{type(module).__module__}.{type(module).__qualname__}", "settings": settings,
             "args": [_describe(a) for a in args], "params": params,
             **({"kwargs": {k: _describe(v) for k, v in sorted(kwargs.items())}} if kwargs else {}),
             "options": repr(sorted(options.items())), "modes": global_modes()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def aot_compile(backend: Callable, args: tuple, kwargs: dict[str, Any] | None = None) -> Any:
    """``_run(*args, **kwargs)`` traced by dynamo (``fullgraph``, static shapes, :func:`serializable_guards`)
    for ``backend``: torch's ``AOTCompiledFunction``. ``torch.compile(...).aot_compile`` where
    the compiled function has it (torch 2.13), else ``torch._dynamo.aot_compile``'s
    ``aot_compile_fullgraph`` with the same hooks (torch 2.11 has no such attribute).

    Each trace runs a copy of ``_run`` of its own (:func:`fusec.generation.steps.own_function`):
    dynamo remembers per code the sizes and Python floats each trace saw and makes those that
    changed dynamic in the next (automatic dynamic shapes), so a second model in the process
    (another ``head_dim``: another SDPA scale) traced a float made dynamic, which fusec's
    capture cannot take there (``TensorifyScalarRestartAnalysis``: a fallback, and the entry
    stored for every later process).

    Raises: whatever dynamo raises (a graph break, a guard it cannot serialize)."""
    import inspect

    from fusec.generation.steps import own_function
    run = own_function(_run, _RUN_GLOBALS)
    # dynamic=None: static shapes but where the inputs mark a dim dynamic (fusec.generate marks
    # the cache's rows: one trace and one fusec step for every cache length)
    compiled = torch.compile(run, fullgraph=True, dynamic=None, backend=backend,
                             options={"guard_filter_fn": serializable_guards})
    if hasattr(compiled, "aot_compile"):
        return compiled.aot_compile((args, dict(kwargs or {})))
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks
    kw = {"dynamic": None} if "dynamic" in inspect.signature(aot_compile_fullgraph).parameters else {}
    return aot_compile_fullgraph(run, (args, dict(kwargs or {})), hooks=Hooks(guard_filter_fn=serializable_guards),
                                 backend=backend, **kw)


_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking")


class _Marks:
    """Dynamo's dim markings (``maybe_mark_dynamic``) taken off the step inputs' tensors, kept
    to be put back before a trace.

    torch (2.11-2.13) serializes a traced step's guards as if no input had been marked, so a
    loaded step's guards fail on a marked tensor ('present on runtime tensor but was absent at
    compile time'), while its shape guards are the symbolic ones of the trace; the guards of a
    step traced in this process hold with or without the marks. The marks matter only to a
    trace. So :class:`PrecompiledStep` takes them off once, when no kept step's guards hold for
    a marked input, and puts them back before it traces: a steady call pays one guard check
    and no walk over the inputs (the walk and the markings' removal and restoration at every
    call cost 0.17-0.37 ms per call on a 2-core CPU for a 16-layer model's StaticCache). One
    record for the process (:data:`_TAKEN`): a step that traces puts back the marks another
    step took off an input they share (HF generate()'s calls with other keyword arguments on
    one cache)."""

    def __init__(self) -> None:
        self.taken: list[tuple[Any, dict[str, Any]]] = []   # (weak reference to the tensor, its marks)

    def take(self, inputs: tuple) -> bool:
        """Take the marks off the tensors of ``inputs``; whether there were any."""
        self.taken = [(ref, kept) for ref, kept in self.taken if ref() is not None]
        found = False
        for t in _tensors(inputs):
            d = t.__dict__
            kept = {a: d.pop(a) for a in _MARKS if a in d}
            if kept:
                found = True
                self.taken.append((weakref.ref(t), kept))
        return found

    def restore(self) -> None:
        """Put back the marks taken off tensors that are still alive."""
        for ref, kept in self.taken:
            t = ref()
            if t is not None:
                t.__dict__.update(kept)
        self.taken.clear()


#: the marks taken off step inputs by every :class:`PrecompiledStep` of the process
_TAKEN = _Marks()


def _tensors(args: tuple) -> list[torch.Tensor]:
    """The tensors of step inputs: tensors, those in dicts, lists and tuples, and those an
    object or its ``layers`` hold."""
    out = []
    for x in args:
        if isinstance(x, torch.Tensor):
            out.append(x)
            continue
        if isinstance(x, (dict, list, tuple)):   # HF's masks per layer type: a dict of tensors
            out += _tensors(tuple(x.values() if isinstance(x, dict) else x))
            continue
        for obj in (x, *(getattr(x, "layers", None) or ())):
            if hasattr(obj, "__dict__"):
                out += [v for v in vars(obj).values() if isinstance(v, torch.Tensor)]
    return out


def _external_refs(fn: Any) -> dict[str, str]:
    """The names a traced function's bytecode loads that a later process must give it, as
    {global name: module name}: the modules dynamo installed by object id
    (``___module_collections_<id>_c0``, e.g. to rebuild an HF ``ModelOutput``), which exist only
    in the tracing process's :data:`_RUN_GLOBALS`, and the builtins it loads by name (module
    ``"builtins"``: torch 2.11 does not save them). :func:`_import_refs` makes them again."""
    env = getattr(getattr(fn, "_artifacts", None), "runtime_env", None)
    refs = getattr(env, "external_refs", None) or ()
    imported = getattr(env, "import_sources", {})
    used = getattr(env, "used_globals", {})
    out = {}
    for r in sorted(refs):
        if r in imported:
            continue
        if hasattr(builtins, r) and _RUN_GLOBALS.get(r) is getattr(builtins, r):
            out[r] = "builtins"
        elif r not in used and isinstance(_RUN_GLOBALS.get(r), types.ModuleType):
            out[r] = _RUN_GLOBALS[r].__name__
    return out


def _import_refs(refs: dict[str, str] | None) -> dict[str, Any] | None:
    """The globals :func:`_external_refs` recorded, made again (None when there are none)."""
    import importlib
    if not refs:
        return None
    return {r: getattr(builtins, r) if m == "builtins" else importlib.import_module(m) for r, m in refs.items()}


def _guard_failure(fn: Any, *args: Any, **kwargs: Any) -> str:
    """The first failing guard of a loaded precompiled function, as dynamo words it ('' if unknown)."""
    try:
        f_locals = fn.prepare_f_locals(*args, **kwargs)
        return str(fn._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts[:1])[:300]
    except Exception:   # noqa: BLE001 - private API: the reason is only for the log
        return "reason unknown"


class PrecompiledStep:
    """``module(*args, **kwargs)`` through a step precompiled once and loaded by later processes.

    Args:
        module: the step (``fusec.generate``'s ``DecodeStep``, or the HF model's call that
            :mod:`fusec.frontend.hf_generate` wraps for ``generate()``).
        model: the model inside it (its class and configuration key the entry).
        options: fusec options (:class:`fusec.config.Options`); with ``cache`` off or a
            ``dump_dir`` set, the step is the fallback below.
        fallback: makes the callable used when there is no precompiled step (the option off,
            a graph break under ``fullgraph``, a torch without the API); by default
            ``torch.compile(module, backend="fusec", options=options)``.
        before_trace: called with the call's ``(args, kwargs)`` before any trace (and before
            every call of the fallback): marks inputs' dims dynamic (``maybe_mark_dynamic``),
            which a loaded or traced step's calls need not pay for.

    Calling it: ``step(*args, **kwargs)``, as ``module(*args, **kwargs)``. The first call with
    new input shapes loads or traces (one stage line says which and its time); later calls
    check the kept guards and run the loaded function.
    """

    def __init__(self, module: torch.nn.Module, model: torch.nn.Module, options: dict[str, Any],
                 fallback: Callable[[], Callable] | None = None,
                 before_trace: Callable[[tuple, dict], None] | None = None):
        # the backend's import installs what dynamo's trace of an HF model needs (the RoPE and
        # SDPA polyfills, the sliding-window counters' dynamic sources); the precompile below
        # traces with a backend of its own, so nothing else would import it before the trace
        import fusec.frontend.backend  # noqa: F401
        self.module, self.model, self.options = module, model, dict(options)
        from fusec.generation.steps import own_forward   # graphs of its own (its docstring)
        self.fallback = fallback or (lambda: torch.compile(own_forward(module), backend="fusec", options=self.options))
        self.before_trace = before_trace or (lambda args, kwargs: None)
        self.entries: list[Any] = []        # loaded AOT functions, most recent first
        self.compiled: Callable | None = None   # the fallback, once the precompile failed
        self.marks = _TAKEN                     # dim markings taken off inputs (put back to trace)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is not None:   # torch.compile traces again when its guards fail
            self.before_trace(args, kwargs)
            return self.compiled(*args, **kwargs)
        for i, fn in enumerate(self.entries):
            if fn.guard_check(self.module, *args, **kwargs):
                if i:
                    self.entries.insert(0, self.entries.pop(i))
                return fn(self.module, *args, **kwargs)
        inputs = (*args, *kwargs.values())
        if self.entries and self.marks.take(inputs):   # a loaded step's guards fail on marks
            for i, fn in enumerate(self.entries):
                if fn.guard_check(self.module, *args, **kwargs):
                    if i:
                        self.entries.insert(0, self.entries.pop(i))
                    return fn(self.module, *args, **kwargs)
        self.marks.restore()   # the trace reads them
        fn = self._bind(args, kwargs)
        if fn is None:
            self.compiled = self.fallback()
            return self.compiled(*args, **kwargs)
        self.entries.insert(0, fn)
        del self.entries[MAX_ENTRIES:]
        self.marks.take(inputs)
        return fn(self.module, *args, **kwargs)

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A precompiled function whose guards hold for ``args`` and ``kwargs`` (its guard check
        then off: :meth:`__call__` checks first), loaded or traced and stored; None when the
        precompile is off or failed (one log line)."""
        self.before_trace(args, kwargs)   # before the key, which reads the marks of dynamic dims
        opts = Options.from_dict(self.options)
        if not opts.cache or opts.dump_dir:
            return None
        from fusec.cache.artifacts import FORMAT, ArtifactCache
        cache = ArtifactCache.for_options(opts)
        try:
            from torch._dynamo.aot_compile import AOTCompiledFunction
            k = key(self.module, self.model, args, self.options, kwargs)
        except Exception as e:   # noqa: BLE001 - no precompile API, or no key: the fallback
            log.info("fusec: no precompiled step (%s: %s); dynamo traces the model in every process",
                     type(e).__name__, str(e)[:200])
            return None
        inputs = (*args, *kwargs.values())
        t0 = time.perf_counter()
        art = cache.load(k, kind=KIND)
        if art is not None:
            try:
                fn = AOTCompiledFunction.deserialize(art["data"], f_globals=_import_refs(art.get("modules")))
                fn.disable_guard_check()
                marks = _Marks()
                marks.take(inputs)
                try:
                    held = fn.guard_check(self.module, *args, **kwargs)
                finally:
                    marks.restore()
                if held:
                    log.info("stage %-13s loaded %s (%.1f KiB): dynamo's trace skipped, %.2f s", "precompiled",
                             k[:12], len(art["data"]) / 1024, time.perf_counter() - t0)
                    return fn
                log.info("fusec: precompiled step %s: its guards do not hold for these inputs (%s); tracing again",
                         k[:12], _guard_failure(fn, self.module, *args, **kwargs))
            except Exception as e:   # noqa: BLE001 - a damaged or foreign entry: trace and rewrite it
                log.warning("fusec: precompiled step %s not loaded (%s: %s); tracing again", k[:12],
                            type(e).__name__, str(e)[:200])
        t0 = time.perf_counter()
        options = self.options
        try:
            from fusec.frontend.hf_sdpa import gqa_in_trace
            with gqa_in_trace():   # HF's SDPA without repeat_kv: 2x faster symbolic trace and AOT
                fn = aot_compile(lambda gm, ex: SerializedStep.from_dynamo(gm, ex, options),
                                 (self.module, *args), kwargs)
            data = AOTCompiledFunction.serialize(fn)
            data = getattr(data, "serialized_data", data)   # torch 2.13: a result object; older: bytes
        except Exception as e:   # noqa: BLE001 - a graph break, a guard or object torch cannot save
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            log.info("fusec: no precompiled step (%s: %s); dynamo traces the model in every process",
                     type(e).__name__, first[:200])
            return None
        stored = cache.store(k, {"format": FORMAT, "key": k, "kind": KIND, "data": data,
                                 "modules": _external_refs(fn)})
        log.info("stage %-13s traced %s in %.2f s%s", "precompiled", k[:12], time.perf_counter() - t0,
                       f", stored ({stored / 1024:.1f} KiB)" if stored else "")
        fn.disable_guard_check()
        return fn
