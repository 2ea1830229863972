"""The ``torch.compile`` backend (entry point ``torch_dynamo_backends: fusec``).

``torch.compile(model, backend="fusec", options={...})``: a graph that is a decode step (at
most ``query_tokens`` query tokens per sequence, 1 by default) is captured to ATen and compiled
for the target; any other graph (a prefill, an op fusec cannot place, a target that is not
available) goes to the fallback backend with one log line saying why.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from typing import Any, Callable

import torch

from fusec.frontend import warm
from fusec.frontend.capture import (CONCRETE_SIZES, aten_capture, check_decode_step, concrete_sizes, dynamo_seconds,
                                    mark_model_tensors)
from fusec.frontend.host_scalars import HostSplit, split_host_scalars
from fusec.frontend import symbolic
from fusec.frontend import hf_rope, hf_sdpa
from fusec.frontend.counters import mark_cache_counters_dynamic
from fusec.frontend.compiled import CompiledStep
from fusec.config import DEFAULT_MAX_CACHE_LEN, Options
from fusec.errors import (BatchSizeVaries, CapacityExceeded, FallbackRequired, FusecError, NotLengthPolymorphic,
                          SimulatorWarning)
from fusec.fallbacks import FallbackRun, warn as warn_fallback
from fusec.pipeline import Dumper, build_ir

log = logging.getLogger("fusec")

mark_cache_counters_dynamic()
hf_rope.install()   # HF's dynamic/longrope RoPE updates without a graph break
hf_sdpa.install()   # HF's SDPA with enable_gqa, not repeat_kv, when the cache length is symbolic


#: whether this process was told its CPU steps run on the simulator (:func:`_step_target`; a flag,
#: not Python's default warning filter, which a ``warnings.catch_warnings`` block around a
#: compile, as torch's own, resets: the line came once per compile)
_SIMULATOR_TOLD = False


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside fusec, torch, transformers and the
    import machinery (the user's line that called the model), for a warning issued by the
    function that calls this one (its frame is level 1); 2 where every frame is theirs."""
    import os
    import sys
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # fusec/
    skip = [os.path.dirname(torch.__file__) + os.sep, package + os.sep, "<frozen"]
    tf = sys.modules.get("transformers")
    if tf is not None and getattr(tf, "__file__", None):
        skip.append(os.path.dirname(tf.__file__) + os.sep)
    prefixes = tuple(skip)
    f, level = sys._getframe(2), 2   # the caller of the warning's caller (level 2)
    while f is not None and f.f_code.co_filename.startswith(prefixes):
        f, level = f.f_back, level + 1
    return level if f is not None else 2


def _target(example_inputs: list[Any], opts: Options) -> str:
    if opts.target:
        return opts.target
    devs = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    return "cuda" if "cuda" in devs else "sim"


def _device_sms(example_inputs: list[Any]) -> int:
    """SMs of the GPU the step's CUDA tensors are on (the current device if none is): the
    megakernel's grid, one CTA per SM (an H100 PCIe has 114, an H200 132)."""
    dev = next((t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"),
               torch.device("cuda", torch.cuda.current_device()))
    return torch.cuda.get_device_properties(dev).multi_processor_count


def fusec_backend(gm: torch.fx.GraphModule, example_inputs: list[Any],
                  options: dict[str, Any] | None = None, **kwargs: Any) -> Callable:
    """Dynamo backend: compile ``gm`` with fusec, or fall back with one log line.

    Args:
        gm: the FX graph dynamo captured.
        example_inputs: dynamo's example inputs.
        options: see :class:`fusec.config.Options` (``target``, ``num_sms``, ``dump_dir`` ...).

    Raises:
        FusecError: only for invalid options; everything else falls back.
    """
    opts = Options.from_dict({**(options or {}), **kwargs})
    grads = sum(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
    if grads and torch.is_grad_enabled():   # AOT autograd would trace a backward fusec has no form for
        why = warn_fallback("fusec: %d inputs of the graph (the model's parameters) require grad and grad mode is on, "
                            "and fusec compiles inference steps only: call the model under torch.no_grad() or "
                            "torch.inference_mode() (generate() does), or model.requires_grad_(False); using %s",
                            grads, opts.fallback)
        return fallback(gm, example_inputs, opts.fallback, why)
    split = _host_split(gm)
    if split is not None:
        # a Python counter the model keeps (HF's sliding-window cache layers): the host computes
        # it per call, one kernel serves every value
        names = [p.name for p in gm.graph.nodes if p.op == "placeholder"]
        log.info("%d Python integer input(s) computed on the host each call (%s), %d of their values "
                 "passed to the kernel as positions: one kernel for all their values", len(split.host_inputs),
                 ", ".join(names[i] for i in split.host_inputs)[:200], len(split.derived_tensors))
        # its positions may pass every cache's rows (a rolled sliding window on every layer):
        # the position tables cover ``position_rows`` positions, the host checks each call's
        rows = opts.position_rows or opts.max_cache_len or DEFAULT_MAX_CACHE_LEN
        split.bound = max(split.bound, rows)
        opts = dataclasses.replace(opts, position_rows=rows)
        return split.wrap(_tensor_graph(split.tensor_gm, split.example_inputs(example_inputs), opts))
    return _tensor_graph(gm, example_inputs, opts)


def _tensor_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options) -> Callable:
    """The backend for a graph without host scalars: one step for every cache length when
    dynamo made the length symbolic (:class:`SymbolicStep`), else compiled once."""
    if symbolic.is_symbolic(gm) or _symbolic(example_inputs):
        # dynamo's dynamic shapes (a second cache length, dynamic=True, mark_dynamic)
        try:
            check_decode_step(gm, opts.query_tokens)
        except BatchSizeVaries as e:   # a step per batch size; each checked again with its sizes
            mark_model_tensors(gm, example_inputs)
            _specialize_floats(gm, example_inputs, opts)
            log.info("fusec: the batch size varies between calls (attention query of shape %s); compiling one "
                     "step per batch size", e.shape)
            return PerBatchStep(gm, opts, e.symbols)
        except FallbackRequired as e:   # one line for the graph, not one per shape
            why = warn_fallback("fusec: %s; using %s", e, opts.fallback)
            return fallback(gm, example_inputs, opts.fallback, why)
        mark_model_tensors(gm, example_inputs)   # before dynamo drops its sources
        symbolic.mark_symbolic(gm)
        return SymbolicStep(gm, example_inputs, opts)
    return _compile(gm, example_inputs, opts)


def _step_target(example_inputs: list[Any], opts: Options) -> tuple[str, Options]:
    """The target of a step over ``example_inputs`` and the options with ``num_sms`` set for it.

    Warns:
        SimulatorWarning: the step's tensors are on the CPU and no target was asked for (the
            simulator: once per process).

    Raises:
        FallbackRequired: target 'cuda' without a CUDA device.
    """
    global _SIMULATOR_TOLD
    target = _target(example_inputs, opts)
    if target == "sim" and not opts.target and not _SIMULATOR_TOLD:   # once per process
        _SIMULATOR_TOLD = True
        warnings.warn("fusec: the step's tensors are on the CPU, so it runs on fusec's CPU simulator, which "
                      "checks the kernel's schedule tile by tile in Python: 10-100x slower than eager, and a "
                      "full-depth model's first call compiles for tens of seconds. Move the model to a CUDA "
                      "device for the megakernel (option target='sim' says you mean it)", SimulatorWarning,
                      stacklevel=_caller_level())
    if target == "cuda" and not torch.cuda.is_available():
        raise FallbackRequired("target 'cuda' but no CUDA device is available")
    if target == "cuda" and opts.num_sms is None:   # one CTA per SM of the model's GPU
        opts = dataclasses.replace(opts, num_sms=_device_sms(example_inputs))
    return target, opts


class SymbolicStep:
    """The step of a graph with symbolic sizes: one compiled step for every cache length.

    At the first call, AOT autograd traces dynamo's graph over fake inputs whose cache length is
    symbolic (:mod:`fusec.frontend.symbolic`), and the IR is built at the length's capacity
    (option ``max_cache_len``); the pass ``check_lengths`` verifies that the step depends on the
    length only through the caches, and the kernel (or the simulator) reads each call's cache
    rows at run time. Later calls with any cache length run the same step; a cache longer than
    the capacity builds it again for twice the length. A graph that uses its length otherwise
    (:class:`NotLengthPolymorphic`: one log line saying where) is compiled per length instead
    (:class:`SpecializingStep`). No fallback happens for symbolic sizes.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options):
        self.gm, self.opts = gm, opts
        self.step: Callable | None = None
        self.per_length: SpecializingStep | None = None
        if _in_dynamo():   # capture now, in dynamo's tracing context (it may restart its analysis)
            self._capture(list(example_inputs), live=True)

    def _capture(self, args: list[Any], live: bool) -> None:
        try:
            self.step = _compile(self.gm, args, self.opts, symbolic_sizes=True, live=live)
        except NotLengthPolymorphic as e:
            self._per_length(e)

    def _per_length(self, why: Exception) -> None:
        log.info("fusec: no single step for every cache length (%s); compiling one per length", why)
        self.per_length = SpecializingStep(self.gm, self.opts)

    def __call__(self, *args: Any) -> Any:
        if self.per_length is None and self.step is None:
            self._capture(list(args), live=False)   # a graph loaded from the artifact cache
        if self.per_length is None:
            try:
                return self.step(*args)
            except NotLengthPolymorphic as e:   # found by the passes at the first call
                self._per_length(e)
            except CapacityExceeded as e:   # a warm-started step meets a longer cache than it was built for
                try:
                    cap = symbolic.capacity(None, symbolic.doubled(e.rows))
                except FallbackRequired as too_long:   # this call only: a shorter cache compiles
                    warn_fallback("fusec: running this call eagerly: %s", too_long)
                    return self.gm(*args)
                log.info("fusec: %s: capturing the graph again for a larger capacity", e)
                self.opts = dataclasses.replace(self.opts, max_cache_len=cap)
                self._capture(list(args), live=False)
                return self(*args)
        return self.per_length(*args)


class PerBatchStep:
    """The step of a decode graph whose batch size varies between calls (``BatchSizeVaries``): one
    step per batch size seen, built at its first call from ``gm`` with the batch made concrete
    (:func:`fusec.frontend.symbolic.fix_symbols`) and its other symbolic sizes kept: a
    :class:`SymbolicStep` (one step for every cache length, as at a fixed batch) where a cache
    length is symbolic too, else the graph compiled once. At most ``MAX_ENTRIES`` batch sizes are
    kept (every batch size a step takes, 1 to 16), the least recently used out."""

    MAX_ENTRIES = 16

    def __init__(self, gm: torch.fx.GraphModule, opts: Options, symbols: frozenset):
        self.gm, self.opts, self.symbols = gm, opts, sorted(symbols, key=str)
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.where = _symbol_places(self.placeholders, self.symbols)
        self.entries: dict[tuple, Callable] = {}

    def __call__(self, *args: Any) -> Any:
        if self.where is not None:   # per step: one shape read per batch symbol
            values = {s: int(args[i] if d is None else args[i].shape[d]) for s, (i, d) in zip(self.symbols, self.where)}
        else:
            sizes = concrete_sizes(self.placeholders, args)
            values = {s: sizes[s] for s in self.symbols if s in sizes}
        fn, _ = _lru(self.entries, tuple(values.get(s) for s in self.symbols), self.MAX_ENTRIES,
                     lambda: self._build(list(args), values))
        return fn(*args)

    def _build(self, args: list[Any], values: dict[Any, int]) -> Callable:
        module, keep = symbolic.fix_symbols(self.gm, args, values)
        module.meta[CONCRETE_SIZES] = dict(values)   # the decode check sees this batch size
        kept = [args[i] for i in keep]
        safe = _per_value_options(self.opts)
        if symbolic.is_symbolic(module):   # a cache length too: one step for every length at this batch
            log.info("fusec: compiling the step for a batch of %s (one step for every cache length)",
                     "/".join(map(str, values.values())))
            try:
                check_decode_step(module, safe.query_tokens)
                inner = SymbolicStep(module, kept, safe)
            except FallbackRequired as e:
                why = warn_fallback("fusec: %s; using %s", e, safe.fallback)
                inner = fallback(module, kept, safe.fallback, why)
        else:
            log.info("fusec: compiling the step for a batch of %s", "/".join(map(str, values.values())))
            inner = _compile(module, kept, safe, live=False)
        return lambda *a: inner(*[a[i] for i in keep])


def _symbol_places(placeholders: list[torch.fx.Node], symbols: list[Any]) -> list[tuple[int, int | None]] | None:
    """For each of ``symbols``, where a call's arguments hold its value: ``(argument index, dim)``
    of a tensor placeholder whose recorded size there is that symbol, or ``(index, None)`` for an
    integer placeholder that is it; None when one has no such place (then
    :func:`fusec.frontend.capture.concrete_sizes` reads every input)."""
    from fusec.frontend.capture import _val
    places: dict[Any, tuple[int, int | None]] = {}
    for i, node in enumerate(placeholders):
        v = _val(node)
        dims = list(enumerate(v.shape)) if isinstance(v, torch.Tensor) else [(None, v)] \
            if isinstance(v, torch.SymInt) else []
        for d, size in dims:
            if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
                places.setdefault(size.node.expr, (i, d))
    return [places[s] for s in symbols] if all(s in places for s in symbols) else None


def _specialize_floats(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options) -> None:
    """Where dynamo passes Python floats to ``gm`` as 0-d tensors (``dynamic=True``: RMSNorm's eps),
    a capture in dynamo's tracing context, now, makes it trace again with those floats
    specialized (``RestartAnalysis`` propagates), as :class:`SymbolicStep`'s first capture does: a
    step compiled per size at its first call, outside dynamo, could not read them
    (``TensorifyScalarRestartAnalysis``, a fallback). Nothing happens for a graph without them."""
    floats = [n for n in gm.graph.nodes if n.op == "placeholder"
              and getattr(n.meta.get("grapharg"), "pass_arg_as_tensor", False)]
    if not floats or not _in_dynamo():
        return
    from torch._dynamo.exc import RestartAnalysis
    try:   # AOT autograd's trace alone; its graph is not compiled
        aten_capture(gm, list(example_inputs), lambda aten_gm, ex: aten_gm.forward)
    except RestartAnalysis:
        raise
    except Exception as e:   # noqa: BLE001 - the per-size compile says what fails, if anything
        log.debug("fusec: the capture in dynamo's context failed (%s: %s)", type(e).__name__, e)


def _in_dynamo() -> bool:
    """Whether dynamo is compiling a frame now (its tracing context has a shape environment)."""
    from torch._guards import TracingContext
    ctx = TracingContext.try_get()
    return ctx is not None and getattr(ctx.fake_mode, "shape_env", None) is not None


def _compile(gm: torch.fx.GraphModule, args: list[Any], opts: Options, symbolic_sizes: bool = False,
             live: bool = True) -> Callable:
    """Capture ``gm`` to ATen and compile it for its target, or fall back (one log line).

    ``symbolic_sizes``: keep the graph's symbolic sizes (:class:`SymbolicStep`): the IR is built
    at the cache length's capacity, the warm-start key leaves the sizes out, and the step can
    rebuild itself for a longer cache. ``live``: called from dynamo with its example inputs (AOT
    uses dynamo's fake tensors and symbols; a float dynamo must specialize restarts its
    analysis); else ``args`` are a call's real inputs and the symbolic sizes are made again
    (:func:`symbolic.fake_inputs`). A graph of static sizes is checked to be a decode step first.

    Raises:
        NotLengthPolymorphic: a symbolic size that is not a cache length (from ``build_ir``).
        FusecError: invalid options; every other failure falls back.
    """
    import contextlib

    from torch._guards import TracingContext, tracing
    try:
        if not symbolic_sizes:
            check_decode_step(gm, opts.query_tokens)
        target, opts = _step_target(args, opts)
        dump = Dumper(opts.dump_dir)
        spec = symbolic.symbolic_dims(gm) if symbolic_sizes else None
        key = _warm_key(gm, args, opts, spec)
        if key is not None:
            found = warm.recall(key, opts)
            if found is not None:
                g, bump = found
                dynamo_s = dynamo_seconds()
                log.info("stage %-13s warm start: the IR of dynamo graph %s from the artifact cache%s, AOT "
                         "skipped%s", "capture", key[:12],
                         f" (cache length run-time, up to {'/'.join(map(str, g.lengths.values()))})"
                         if g.lengths else "", f"; dynamo {dynamo_s:.2f} s" if dynamo_s is not None else "")
                return warm.WarmStep(CompiledStep(gm.forward, g, opts, dump, target), bump)
        context, fakes, dynamo_vals = contextlib.nullcontext(), args, args
        if symbolic_sizes and live:   # AOT compares its inputs with dynamo's symbolic fakes
            dynamo_vals = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        elif symbolic_sizes or not live:
            # outside dynamo (a graph loaded from the artifact cache, a step compiled per length):
            # fakes in a shape environment of fusec's own, where the sizes symbolic in ``gm`` are
            # symbolic again, and the .item() of a float dynamo passes as a 0-d tensor
            # (dynamic=True) is a symbolic float, not a data-dependent error
            mode, fakes = symbolic.fake_inputs(gm, args)
            context, dynamo_vals = tracing(TracingContext(mode)), fakes
        capacity_for = (lambda rows: symbolic.capacity(opts.max_cache_len, rows)) if symbolic_sizes else None

        def compiler(aten_gm: torch.fx.GraphModule, ex: list[Any]) -> Callable:
            g = build_ir(aten_gm, ex, dump, capacity_for)
            if key is not None:
                why = warm.aot_identity_problem(gm, dynamo_vals, aten_gm, ex)
                if why is None:
                    warm.remember(key, g, warm.mutated_inputs(dynamo_vals), opts)
                else:
                    log.info("fusec: no warm start for this graph (AOT autograd must run each time: %s)", why)

            def rebuild(rows: int):   # a longer cache than the capacity: the IR for twice its rows
                return build_ir(aten_gm, ex, dump, lambda r: symbolic.capacity(None, max(r, symbolic.doubled(rows))))
            return CompiledStep(aten_gm, g, opts, dump, target, rebuild=rebuild if g.lengths else None)

        with context:
            return aten_capture(gm, fakes, compiler)
    except FallbackRequired as e:
        why = warn_fallback("fusec: %s; using %s", e, opts.fallback)
        return fallback(gm, args, opts.fallback, why)
    except FusecError:
        raise
    except Exception as e:   # AOT autograd could not trace the graph: never a crash
        from torch._dynamo.exc import RestartAnalysis
        if live and _in_dynamo() and isinstance(e, RestartAnalysis):
            raise   # dynamo traces again (a float it must specialize) and calls the backend again
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        why = warn_fallback("fusec: capturing the graph to ATen failed (%s: %s); using %s", type(e).__name__,
                            first[:200], opts.fallback)
        return fallback(gm, args, opts.fallback, why)


def _host_split(gm: torch.fx.GraphModule) -> HostSplit | None:
    """:func:`split_host_scalars` of ``gm``; None when it has no host scalars or cannot be split
    (then the integers are specialized on, as before)."""
    try:
        return split_host_scalars(gm)
    except Exception as e:   # noqa: BLE001 - an unusual graph: the specializing path handles its ints
        log.info("fusec: no host-scalar split (%s: %s)", type(e).__name__, str(e)[:200])
        return None


def _warm_key(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options,
              spec: list[Any] | None = None) -> str | None:
    """The warm-start key of ``gm`` (:mod:`fusec.frontend.warm`; ``spec``: its symbolic sizes,
    left out of the key, with the ``max_cache_len`` option in it), or None: cache off, a dump
    (every stage runs), or a graph with no stable key."""
    if not opts.cache or opts.dump_dir:
        return None
    try:
        if spec is not None:
            return warm.dynamo_key(gm, example_inputs, spec, extra={"max_cache_len": opts.max_cache_len})
        return warm.dynamo_key(gm, example_inputs)
    except Exception as e:   # noqa: BLE001 - a key that cannot be made: the full capture runs
        log.info("fusec: no warm start for this graph (%s: %s)", type(e).__name__, str(e)[:200])
        return None


def _symbolic(example_inputs: list[Any]) -> bool:
    """Whether dynamo handed symbolic sizes: a SymInt input or a tensor with a symbolic shape."""
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape):
            return True
    return False


class SpecializingStep:
    """The step for a graph with symbolic sizes that one step cannot serve for every value (a
    size that is not a cache length, a length used as a value: :class:`SymbolicStep` found
    ``NotLengthPolymorphic``): compiled once per set of concrete sizes, each checked as a decode
    step with its own sizes.

    Each call's concrete tensor shapes, dtypes, devices and integer values form a key; the first
    call with a new key captures ``gm`` again with those inputs and compiles it (a small
    per-shape kernel cache, at most ``MAX_ENTRIES`` keys, least recently used out). No fallback
    happens for symbolic sizes.
    """

    MAX_ENTRIES = 8

    def __init__(self, gm: torch.fx.GraphModule, opts: Options):
        self.gm, self.opts = gm, opts
        self.entries: dict[tuple, Callable] = {}
        self.warned = False

    @staticmethod
    def key(args: tuple) -> tuple:
        return tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else
                     (int(a) if isinstance(a, (int, torch.SymInt)) else type(a).__name__) for a in args)

    def __call__(self, *args: Any) -> Any:
        k = self.key(args)

        def build() -> Callable:
            log.info("fusec: compiling the step for concrete sizes %s",
                     [int(a) for a in args if isinstance(a, (int, torch.SymInt))])
            return _specialized(self.gm, args, self.opts)
        fn, old = _lru(self.entries, k, self.MAX_ENTRIES, build)
        if old is not None and not self.warned:
            self.warned = True
            moving = [i for i, (a, b) in enumerate(zip(old, k)) if a != b]
            names = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]

            def named(ids: list[int]) -> str:
                return ", ".join(names[i] if i < len(names) else str(i) for i in ids)[:300]
            values = [i for i in moving if isinstance(args[i], (int, torch.SymInt))]
            shapes = [i for i in moving if i not in values]
            why = []
            if values:
                why.append(f"the integer inputs {named(values)} take new values and the step uses them as "
                           f"values, not as a cache length: pass a position as a tensor, e.g. "
                           f"torch.tensor([pos]), which the step reads at run time")
            if shapes:
                why.append(f"the inputs {named(shapes)} keep changing shape: an attention_mask shorter than the "
                           f"static cache? pass one of the cache's full length, as generate() does")
            log.warning("fusec: more than %d input sizes or values seen; every new one compiles a new kernel "
                        "(%s)", self.MAX_ENTRIES, "; ".join(why))
        return fn(*args)


def _specialized(gm: torch.fx.GraphModule, args: tuple, opts: Options) -> Callable:
    """``gm`` compiled with its integer inputs replaced by the values in ``args``; the returned
    callable takes the full argument list and passes on the tensors."""
    g = copy.deepcopy(gm.graph)
    ints = [i for i, a in enumerate(args) if isinstance(a, (int, torch.SymInt))]
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    for i in ints:
        symbolic.replace_input(g, placeholders[i], int(args[i]))
    for node in g.nodes:   # the sizes are concrete now: no dims symbolic (symbolic.fake_inputs)
        if node.op == "placeholder":
            node.meta[symbolic.SYMBOLIC_META] = None
    keep = [i for i in range(len(args)) if i not in set(ints)]
    module = torch.fx.GraphModule(gm, g)
    # the checks that read dynamo's recorded shapes (check_decode_step) see this call's sizes
    module.meta[CONCRETE_SIZES] = concrete_sizes(placeholders, args)
    inner = _compile(module, [args[i] for i in keep], _per_value_options(opts), live=False)
    return lambda *a: inner(*[a[i] for i in keep])


def _per_value_options(opts: Options) -> Options:
    """``opts`` for a graph compiled per value of a size (:class:`SpecializingStep`,
    :class:`PerBatchStep`): one that fusec cannot take runs eagerly, not through inductor, which
    returned wrong values on such per-value graphs (a model computing ``arange // (count + 1)``
    from a Python counter: 0.24-0.72 relative error from the sixth value on, found 2026-12-02)."""
    return dataclasses.replace(opts, fallback="eager") if opts.fallback == "inductor" else opts


def _lru(entries: dict[tuple, Callable], key: tuple, limit: int,
         build: Callable[[], Callable]) -> tuple[Callable, tuple | None]:
    """``(entries[key], evicted)``: the entry, built where missing and made the most recently
    used; at most ``limit`` entries kept, the least recently used out (its key returned, else
    None)."""
    fn, evicted = entries.pop(key, None), None
    if fn is None:
        fn = build()
        if len(entries) >= limit:
            evicted = next(iter(entries))
            entries.pop(evicted)
    entries[key] = fn
    return fn, evicted


def fallback(gm: torch.fx.GraphModule, example_inputs: list[Any], kind: str, reason: str) -> Callable:
    """Compile ``gm`` with inductor (when ``kind == 'inductor'`` and it works) or run it eagerly;
    ``reason``: the fallback line logged for it. Each call of the result counts in the open
    :class:`fusec.fallbacks.FallbackWatch` objects (:class:`fusec.fallbacks.FallbackRun`)."""
    if kind == "inductor":
        try:
            from torch._inductor.compile_fx import compile_fx
            return FallbackRun(compile_fx(gm, example_inputs), reason)
        except Exception as e:  # inductor needs a C++ compiler; eager always works
            warn_fallback("fusec: inductor fallback failed (%s); running eagerly", type(e).__name__)
    return FallbackRun(gm.forward, reason)
