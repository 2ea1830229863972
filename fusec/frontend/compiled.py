"""The callable a compilation returns: at its first call it runs the compile stages through the
artifact cache (:func:`fusec.cache.artifacts.compile_graph`) and has the runtime load what they
made (:mod:`fusec.runtime.load`); then it runs the decode step on its target."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from fusec.cache.artifacts import compile_graph, tensor_digest
from fusec.config import Options
from fusec.errors import CapacityExceeded, FallbackRequired, FusecError, NotLengthPolymorphic
from fusec.fallbacks import LAUNCHED, note_compiled, ran_fallback, warn as warn_fallback
from fusec.ir import Graph
from fusec.pipeline import Dumper
from fusec.ir.schedule import Schedule
from fusec.frontend.value_snapshot import ValueSnapshot

if TYPE_CHECKING:
    from fusec.runtime.cuda_step import CudaStep

log = logging.getLogger("fusec")


def _version(x: torch.Tensor) -> int | None:
    """``x``'s version counter (moved by every in-place write through autograd's view of it), or
    None for an inference tensor (made under ``torch.inference_mode()``), which has none."""
    return None if x.is_inference() else x._version


def _under_aot_check() -> bool:
    """Whether the innermost Python dispatch mode is AOT autograd's check of custom ops'
    aliasing (``torch._functorch`` ``_AnalyzeCustomOpInputOutputMode``), under which AOT runs a
    compiled graph's first call. It sees every torch op the step itself runs: the CPU
    simulator's (about 1.2 s more for a 16-layer tiny Llama's first step), none of which is an
    op of the user's graph."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    return type(_get_current_dispatch_mode()).__name__ == "_AnalyzeCustomOpInputOutputMode"


def _no_dispatch_modes():
    """A context without the Python dispatch modes (:func:`_under_aot_check`'s among them)."""
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


class CompiledStep:
    """Runs one captured decode step; the passes run at the first call (real inputs needed).

    Called with the flat inputs of the ATen graph (parameters lifted), it returns the list of
    graph outputs and updates KV caches and position counters in place. On ``target="cuda"``
    the outputs are views of the kernel's own buffers; one still referenced at the next step is
    left to its holder and the kernel writes a new buffer (:mod:`fusec.runtime.outputs`), so
    outputs are never overwritten while held, as in eager (a captured CUDA graph's replays
    write the buffers of its capture).

    If lowering fails with a :class:`FusecError` at the first call (an op without a CUDA form,
    say), the step runs ``aten_gm`` eagerly from then on, with one log line: the captured ATen
    graph, or on a warm start (:mod:`fusec.frontend.warm`: dynamo's inputs are the flat inputs)
    dynamo's own graph.

    A graph with run-time lengths (``Graph.lengths``: a symbolic cache length) runs for caches
    of any length up to its capacity; a call with a longer cache builds the step again from
    ``rebuild(rows)`` (the IR for a larger capacity), with one log line. Its integer arguments
    (``Graph.skip_args``: the length, as dynamo passes it) are dropped before the step.
    """

    def __init__(self, aten_gm: Callable[..., Any], g: Graph, opts: Options, dump: Dumper, target: str,
                 rebuild: Callable[[int], Graph] | None = None):
        self.aten_gm = aten_gm
        self.graph = g
        self.rebuild = rebuild
        self._skip = frozenset(g.skip_args)
        self._keep: tuple[int, Callable[[tuple], tuple]] | None = None   # (argument count, its getter)
        self._rows_at = self._length_inputs(g)
        self._limits_of: Schedule | None = None              # the built step _limits_list is for
        self._limits_list: list[tuple[int, int, int, bool]] | None = None
        self.opts = opts
        self.dump = dump
        self.target = target
        self.schedule: Schedule | None = None
        self.engine: Callable[[list[Any]], list[torch.Tensor]] | None = None
        self.fallen_back = ""   # the fallback line, once the step runs its graph eagerly
        self.calls = 0
        self.profile_written = False
        self._cuda_step = None
        # (input index, version, data pointer, name, value of a 0-d CPU tensor or None)
        self._watched: list[tuple[int, int, int, str, Any]] = []
        self._snapshot: ValueSnapshot | None = None   # the compiled-in GPU tensors' bytes

    @staticmethod
    def _length_inputs(g: Graph) -> list[tuple[int, int, str]]:
        """(input index, dim, symbol) of one input per run-time length symbol (the capacity check)."""
        seen, out = set(), []
        for i, n in enumerate(g.inputs):
            for d, sym in g.tensors[n].sym.items():
                if sym not in seen:
                    seen.add(sym)
                    out.append((i, d, sym))
        return out

    def _grow(self, args: tuple) -> None:
        """Build the step again for a larger capacity when a cache is longer than its length's.

        Raises:
            CapacityExceeded: no ``rebuild``.
            FallbackRequired: the length's capacity is a bound of its attention's mask (a
                sliding window's rows, :meth:`_limits`), which no rebuild raises: this call
                runs eagerly."""
        over = [(int(args[i].shape[d]), cap, bound, i) for i, d, cap, bound in self._limits()
                if isinstance(args[i], torch.Tensor) and args[i].shape[d] > cap]
        if not over:
            return
        rows, cap, bound, i = max(over)
        if bound:
            raise FallbackRequired(f"a KV cache of {rows} rows (input {self.graph.inputs[i]}) is longer than "
                                   f"the {cap} rows below which its attention mask is causal (a sliding "
                                   "window's: HF's sliding layer holds at most that many)")
        if self.rebuild is None:
            raise CapacityExceeded(f"a KV cache of {rows} rows is longer than the {cap} this step was built for",
                                   rows)
        g = self.rebuild(rows)
        log.info("fusec: a KV cache of %d rows is longer than the step's capacity %d: building it again for %d "
                 "(option max_cache_len sets the capacity)", rows, cap, min(g.lengths.values()))
        self.graph, self.engine, self.schedule, self._watched, self._snapshot = g, None, None, [], None
        self._rows_at, self._limits_list = self._length_inputs(g), None

    def _limits(self) -> list[tuple[int, int, int, bool]]:
        """(input index, dim, the most rows it may have, whether the passes bounded that below
        the capacity the step was built for) per run-time length: from the built step's graph
        once there is one (``recognize``: a mask causal below a window only), worked out once
        per built step."""
        if self._limits_of is not self.schedule or self._limits_list is None:
            sg = self.schedule.graph if self.schedule is not None else self.graph
            out = []
            for i, d, sym in self._rows_at:
                cap = self.graph.lengths[sym]
                info = sg.tensors.get(self.graph.inputs[i])
                built = sg.lengths.get(info.sym.get(d), cap) if info is not None else cap
                out.append((i, d, min(cap, built), built < cap))
            self._limits_of, self._limits_list = self.schedule, out
        return self._limits_list

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        if self.fallen_back:
            LAUNCHED[0] = self
            ran_fallback(self.fallen_back)
            return self.aten_gm(*args)
        full = args
        if self._skip:   # the integer sizes dynamo passes for a symbolic length: not step inputs
            args = self._kept(args)
        if self._rows_at and not self._rows_fit(args):   # a cache longer than fusec's longest,
            return self.aten_gm(*full)                   # or than its mask's bound: this call only
        if self.engine is not None and self._watched and self._compiled_in_changed(args):
            self.engine = None
        if self.engine is None:
            try:
                t0 = time.perf_counter()
                # AOT autograd runs a step's first call under a Python dispatch mode of its own (a
                # check of custom ops' aliasing), which costs every torch op of the passes ~0.1 ms
                with _no_dispatch_modes():
                    self.engine = self._build(list(args))
                self._watched = self._watch(args)
                self._snapshot = self._gpu_snapshot(args)
                log.info("stage %-13s the step is ready: its first call built it in %.2f s (the stages "
                         "above; dynamo and AOT autograd, when they ran, before them: see the capture line)",
                         "compiled", time.perf_counter() - t0)
                note_compiled()
                if self._rows_at and not self._rows_fit(args):   # bounded by the passes (_limits)
                    return self.aten_gm(*full)
            except NotLengthPolymorphic:
                raise   # the caller compiles the graph per length instead
            except FusecError as e:
                self.fallen_back = warn_fallback("fusec: running this graph eagerly: %s", e)   # its line
                LAUNCHED[0] = self
                return self.aten_gm(*full)
        LAUNCHED[0] = self.engine
        with torch.no_grad(), (_no_dispatch_modes() if torch._C._len_torch_dispatch_stack() and _under_aot_check()
                               else contextlib.nullcontext()):
            out = self.engine(list(args))
        self.calls += 1
        if (self.opts.profile and not self.profile_written and self._cuda_step is not None
                and self.calls >= self.opts.profile_step and not torch.cuda.is_current_stream_capturing()):
            self.profile_written = True
            try:
                self._write_timeline()
            except (OSError, ValueError) as e:   # a profile must never break the step
                log.warning("fusec: timeline not written: %s", e)
        return out

    def _rows_fit(self, args: tuple) -> bool:
        """:meth:`_grow`; False (with one line) where this call must run eagerly."""
        try:
            self._grow(args)
            return True
        except FallbackRequired as e:
            LAUNCHED[0] = self
            warn_fallback("fusec: running this call eagerly: %s", e)
            return False

    def _kept(self, args: tuple) -> tuple:
        """``args`` without the :attr:`Graph.skip_args` (a getter made once per argument count:
        a decode step passes about 200 arguments at every call)."""
        if self._keep is None or self._keep[0] != len(args):
            keep = [i for i in range(len(args)) if i not in self._skip]
            self._keep = (len(args), (lambda a: tuple(a[i] for i in keep)) if len(keep) < 2 else
                          operator.itemgetter(*keep))
        return self._keep[1](args)

    def _watch(self, args: tuple) -> list[tuple[int, int, int, str, Any]]:
        """The inputs whose values the step compiled in, with their version counters, data
        pointers and (a 0-d CPU tensor) values now."""
        names = self.schedule.compiled_in if self.schedule is not None else {}
        index = {n: i for i, n in enumerate(self.graph.inputs)}
        return [(index[n], _version(x), x.data_ptr(), n, self._scalar(x)) for n in names
                if n in index and isinstance(x := args[index[n]], torch.Tensor)]

    def _gpu_snapshot(self, args: tuple) -> ValueSnapshot | None:
        """A :class:`ValueSnapshot` of the watched tensors not on the CPU (None: there are none)."""
        gpu = [(n, i) for i, _, _, n, _ in self._watched if args[i].device.type != "cpu"]
        return ValueSnapshot([n for n, _ in gpu], [i for _, i in gpu], [args[i] for _, i in gpu]) if gpu else None

    @staticmethod
    def _scalar(x: torch.Tensor) -> Any:
        """A 0-d CPU tensor's value (compared at every call by value: cheaper than a digest), else None."""
        return x.item() if x.device.type == "cpu" and x.dim() == 0 else None

    def _compiled_in_changed(self, args: tuple) -> bool:
        """Whether a weight whose value the step compiled in (``Schedule.compiled_in``) changed
        since the step was built: written in place (``load_state_dict``, an optimizer step: its
        version counter moved), another tensor passed in its place (its address moved: a
        parameter rebound through ``.data``), or, for a CPU tensor, any other value; and
        its digest differs. Then one log line, and the caller builds the step again. Checked at
        every call from Python; a CUDA graph's replays do not call.

        A compiled-in tensor on the CPU has its digest compared at every call (the simulator's
        step costs far more; a Python float that dynamo passes as a new 0-d tensor each call, a
        value written through ``.data``, which moves no version counter, are seen). On the GPU
        the version counter and the address are compared at every call (reading the values
        would synchronize), and the values themselves at the first call after
        :func:`fusec.frontend.value_snapshot.check_at_next_call` (once per ``fusec.generate``
        and HF ``generate()`` call: a value written through ``.data`` is seen there; in a plain
        loop, after the user calls it)."""
        snap = self._snapshot
        if snap is not None and snap.due():
            name = snap.changed(args)
            if name is not None:
                log.info("fusec: weight %s changed since the step was built (its bytes differ: compared once per "
                         "generate() call), and its value is compiled in; building the step again", name)
                return True
        for k, (i, version, ptr, name, value) in enumerate(self._watched):
            x = args[i]
            if value is not None:   # a Python float dynamo passes as a new 0-d tensor at every call
                if x.device.type == "cpu" and x.dim() == 0 and x.item() == value:
                    continue   # (a NaN never equals: its digest decides below)
            elif _version(x) == version and x.data_ptr() == ptr and x.device.type != "cpu":
                continue
            if tensor_digest(x) == self.schedule.compiled_in[name]:
                self._watched[k] = (i, _version(x), x.data_ptr(), name, self._scalar(x))
                continue
            if self.target == "cuda" and torch.cuda.is_current_stream_capturing():
                raise FusecError(f"weight {name} was changed after the step was built, and its value "
                                 "is compiled into the step: run one step outside the CUDA graph capture first")
            log.info("fusec: weight %s changed since the step was built, and its value is compiled in; "
                     "building the step again", name)
            return True
        return False

    def _write_timeline(self) -> None:
        """Write this step's per-SM timeline: trace.json (Perfetto), timeline.json, timeline.png."""
        from pathlib import Path

        from fusec.runtime.profile import MatplotlibMissing, Timeline
        out = Path(self.opts.profile_dir or "fusec_profile")
        out.mkdir(parents=True, exist_ok=True)
        tl = Timeline.from_records(self._cuda_step.profile_records(), self.schedule)
        tl.save(out / "timeline.json")
        tl.to_chrome_trace(out / "trace.json")
        try:
            tl.to_png(out / "timeline.png", title=f"fusec step {self.calls}")
        except MatplotlibMissing as e:
            log.info("fusec: no timeline.png (%s); draw it elsewhere with `fusec timeline %s`", e,
                     out / "timeline.json")
        log.info("fusec: timeline of step %d (span %.1f us) written to %s", self.calls,
                 tl.summary()["span_us"], out)

    def _build(self, args: list[Any]) -> Callable[[list[Any]], list[torch.Tensor]]:
        if self.target == "sim":
            from fusec.runtime import load
            if self.opts.profile:
                log.warning("fusec: profile records GPU timelines; the simulator target has none")
            self.schedule = compile_graph(self.graph, args, self.opts, self.dump).schedule
            return load.simulator(self.schedule, self.opts)
        g0 = self.graph
        dev = next(a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda)
        on_cpu = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device.type == "cpu"]

        def to_dev(a: list[Any]) -> list[Any]:
            """A small CPU tensor the step only reads (a fresh StaticCache's position counter, made
            on the CPU and moved inside its first call) is copied to the GPU, at every call."""
            out = list(a)
            for i, x in enumerate(a):
                if not (isinstance(x, torch.Tensor) and x.device.type == "cpu"):
                    continue
                name, info = g0.inputs[i], g0.tensors[g0.inputs[i]]
                if info.numel > 64 or info.role.value in ("kv_cache", "state"):
                    raise FusecError(f"input {name} ({info.role.value}, {info.numel} elements) lives on the "
                                     f"CPU; the megakernel reads and writes GPU memory: move it to {dev}")
                if torch.cuda.is_current_stream_capturing():
                    raise FusecError(f"input {name} lives on the CPU: a CUDA graph cannot capture its copy")
                out[i] = x.to(dev, non_blocking=True)
            return out
        step, self.schedule = build_cuda_step(g0, to_dev(args), self.opts, self.dump)
        self._cuda_step = step
        g = self.schedule.graph
        # a 4-D output made inside the step is new KV-cache storage (a StaticCache initialized
        # lazily in its first call): every call must return its own, not the kernel's buffer
        fresh = [i for i, t in enumerate(g.outputs)
                 if len(g.tensors[t].shape) >= 4 and g.root(t) not in g.inputs]
        if not fresh and not on_cpu:   # a CPU tensor arriving later fails the runtime's input guard
            return lambda a: step(*a)

        def run(a: list[Any]) -> list[torch.Tensor]:
            out = step(*to_dev(a))
            return [o.clone() if i in fresh else o for i, o in enumerate(out)]
        return run


def build_cuda_step(g: Graph, args: list[Any], opts: Options, dump: Dumper) -> tuple["CudaStep", Schedule]:
    """Compile ``g`` for the GPU of its inputs (:func:`~fusec.cache.artifacts.compile_graph`,
    target ``cuda``) and load it (:func:`fusec.runtime.load.cuda_step`); ``num_sms`` defaults to
    that GPU's SM count.

    Raises:
        FallbackRequired: an op has no CUDA form; JitError: NVRTC failed; CudaError, FusecError.
    """
    from fusec.runtime import load
    dev = next(a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda)
    if opts.num_sms is None:
        opts = dataclasses.replace(opts, num_sms=torch.cuda.get_device_properties(dev).multi_processor_count)
    made = compile_graph(g, args, opts, dump, target="cuda")
    return load.cuda_step(made.schedule, made.plan, made.kernel(), args, opts), made.schedule
