"""The compiler pipeline as one list of named stages.

``build_ir`` (capture -> IR) runs when dynamo hands over a graph; :func:`stages` lists what runs
after it, at the first call, with the real input values: normalize -> fold_constants ->
split_linear -> recognize -> check_lengths -> fold_position -> fuse -> chain -> prologue -> tile -> schedule,
then for the ``cuda`` target render -> nvrtc (started on a thread). :func:`run` runs them, each
with its ``stage <name>`` log line; the artifact cache wraps that run once
(:func:`fusec.cache.artifacts.compile_graph`). The IR checker runs after every graph pass and
names the pass that broke an invariant. With ``dump_dir`` set (or ``FUSEC_DUMP``), every stage
writes its artifact there: ``00_aten.txt``, ``01_ir.txt``, ``02_normalize.txt`` ...
``schedule.json``, ``11_kernel.cu``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from fusec.ir import position
from fusec.config import Options
from fusec.frontend.from_fx import graph_from_aten
from fusec.ir import Graph, Role
from fusec.ir.schedule import Schedule

if TYPE_CHECKING:
    from fusec.cuda.codegen import KernelPlan
    from fusec.cuda.jit import CompiledKernel

log = logging.getLogger("fusec")


class Dumper:
    """Writes stage artifacts to ``dump_dir`` (no-op when unset). ``text`` and ``json`` take the
    content or a function making it, called only when dumping (a 1B schedule's JSON takes
    0.3 s to build). The first graph a process compiles dumps into ``dump_dir`` itself, each
    later one (another size, a prefill graph) into ``dump_dir/graph2``, ``graph3`` ..., so that
    none overwrites another. A folder or file it cannot write is a FusecError naming ``dump_dir``
    and the OS error (the options check the folder first: :class:`fusec.config.Options`)."""

    _graphs: dict[Path, int] = {}   # dump folder -> graphs dumped there by this process

    def __init__(self, dump_dir: str | None):
        self.dir = Path(dump_dir) if dump_dir else None
        self.n = 0
        if self.dir:
            root = self.dir.resolve()
            k = Dumper._graphs[root] = Dumper._graphs.get(root, 0) + 1
            if k > 1:
                self.dir = self.dir / f"graph{k}"
                log.info("fusec: dumping this graph's stages into %s", self.dir)
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise self._error(self.dir, e) from None

    @staticmethod
    def _error(path: Path, e: OSError) -> Exception:
        from fusec.errors import FusecError
        return FusecError(f"dump_dir: cannot write {str(path)!r} ({type(e).__name__}: {e}); give a "
                          f"writable folder or leave dump_dir (FUSEC_DUMP) unset")

    def _write(self, path: Path, text: str) -> None:
        try:
            path.write_text(text)
        except OSError as e:
            raise self._error(path, e) from None

    def text(self, name: str, text: str | Callable[[], str]) -> None:
        if self.dir:
            self._write(self.dir / f"{self.n:02d}_{name}", text() if callable(text) else text)
            self.n += 1

    def json(self, name: str, obj: Any) -> None:
        """``obj`` as compact JSON (:func:`fusec.jsonfmt.dumps`: one line per element of the top
        levels, as the CLI writes ``schedule.json``)."""
        if self.dir:
            from fusec import jsonfmt
            self._write(self.dir / name, jsonfmt.dumps(obj() if callable(obj) else obj) + "\n")


def build_ir(aten_gm: torch.fx.GraphModule, example_inputs: list[Any], dump: Dumper,
             capacity_for: Callable[[int], int] | None = None) -> Graph:
    """Stage ``build_ir``: the ATen graph as IR (raises UnsupportedOpError for unplaceable ops;
    a graph with a symbolic cache length is built at ``capacity_for(rows)``: see
    :func:`fusec.frontend.from_fx.graph_from_aten`)."""
    t0 = time.perf_counter()
    dump.text("aten.txt", lambda: aten_gm.print_readable(print_output=False))
    g = graph_from_aten(aten_gm, example_inputs, capacity_for)
    g.check("capture")
    dump.text("ir.txt", g.dump)
    log.info("stage %-13s %4d ops, %d inputs%s  (%.2f s)", "build_ir", len(g.ops), len(g.inputs),
             "".join(f", cache length {k} run-time, up to {v}" for k, v in g.lengths.items()),
             time.perf_counter() - t0)
    return g


class ValueReads(Mapping):
    """The small weights' values handed to the passes, recording which ones a pass read.

    Reading a value (``weights[name]``, ``.get``, ``.items()``, ``.values()``, ``dict(...)``,
    ``dict.update``) records its name in :attr:`read`; membership and iteration over the names
    record nothing (which weights are small is structure, not value). The artifact cache keeps a
    digest of exactly these tensors: their values are folded into the schedule (position tables,
    Gemma's ``1 + w``), so an artifact is valid for another model only where they are equal.
    """

    def __init__(self, values: dict[str, torch.Tensor]):
        self._values = values
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        v = self._values[name]
        self.read.add(name)
        return v

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (restored after, if it was on).

    Lowering and loading a schedule make ~10^5-10^6 small objects (tiles, regions, waits), and
    each collection of the oldest generation walks every live object, the model's included: on
    a 2-core CPU the Llama-3.2-1B's passes took 1.0 s with it on and 0.51 s off, and loading its
    artifact 0.6 s and 0.22 s. The cycles made meanwhile are collected afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage after ``build_ir``: ``run`` takes the previous stage's product and returns its
    own; ``report`` dumps that product (``dump_dir``) and returns the text of its ``stage`` log
    line, or None where the stage logs itself (``nvrtc``, from its thread, when NVRTC is done)."""
    name: str
    run: Callable[[Any], Any]
    report: Callable[[Any, Dumper], str | None]


@dataclasses.dataclass
class Lowered:
    """What the stages made for a graph: its schedule and, for the ``cuda`` target, the kernel's
    plan (source, buffers, instruction words) and ``kernel``, a function that waits for NVRTC's
    CUBIN (compiling on a thread since the kernel was rendered)."""
    schedule: Schedule
    plan: "KernelPlan | None" = None
    kernel: "Callable[[], CompiledKernel] | None" = None


def stages(opts: Options, target: str = "sim", weights: Mapping[str, torch.Tensor] | None = None) -> list[Stage]:
    """The stages after ``build_ir``, in order: the graph passes, ``tile`` and ``schedule``, and for
    the ``cuda`` target ``render`` (the kernel's source) and ``nvrtc`` (CUBIN, started on a thread).
    ``weights``: the small weights' values the graph passes fold (:class:`ValueReads`)."""
    from fusec.passes import (chain, check_lengths, fold_constants, fold_position, fuse, normalize, prologue,
                              recognize, schedule, split_linear, tile)
    num_sms = opts.num_sms or 132
    w = weights if weights is not None else {}
    graph_passes: list[tuple[str, Callable[[Graph], Graph]]] = [
        ("normalize", normalize.run),
        ("fold_constants", lambda g: fold_constants.run(g, w)),
        ("split_linear", split_linear.run),
        ("recognize", lambda g: recognize.run(g, w)),
        ("check_lengths", check_lengths.run),
        ("fold_position", lambda g: fold_position.run(g, w, opts.position_rows)),
        ("fuse", lambda g: fuse.run(g, num_sms, opts.max_fusions, opts.attention_merge, opts.defines)),
        ("chain", lambda g: chain.run(g) if opts.chain and opts.max_fusions is None else g),
        ("prologue", lambda g: prologue.run(g) if opts.prologue and opts.max_fusions is None else g),
    ]
    out = [Stage(name, _checked(name, fn), _graph_report(name)) for name, fn in graph_passes]
    out += [Stage("tile", lambda g: (g, tile.run(g, num_sms)), _tiles_report),
            Stage("schedule", lambda gt: schedule.run(gt[0], gt[1], num_sms), _schedule_report)]
    if target == "cuda":
        out += [Stage("render", lambda sched: _render(sched, opts), _plan_report),
                Stage("nvrtc", lambda plan: nvrtc_started(plan), lambda kernel, dump: None)]
    return out


def run(x: Any, opts: Options, dump: Dumper, *, target: str = "sim", first: str = "normalize",
        args: list[Any] | None = None, value_reads: set[str] | None = None) -> dict[str, Any]:
    """Run :func:`stages` from ``first`` on ``x`` (that stage's input: the IR graph for
    ``normalize``, a schedule for ``render``, a plan for ``nvrtc``); returns each stage's product
    by name. Each stage logs one ``stage <name>`` line with its time.

    Args:
        args: the real input tensors (from ``normalize`` on): weights are read to fold position
            tables and to evaluate attention masks.
        value_reads: if given, receives the names of the weights whose values the passes read
            (:class:`ValueReads`).
    """
    weights = ValueReads({})
    if first == "normalize":
        g = x = x.copy()
        # small weights (inv_freq ...) on the CPU: position tables and masks are evaluated there
        weights = ValueReads({n: a.detach().cpu() for n, a in zip(g.inputs, args or [])
                              if g.tensors[n].role == Role.WEIGHT and g.tensors[n].numel <= position.MAX_KNOWN_WEIGHT})
    todo = stages(opts, target, weights)
    names = [s.name for s in todo]
    products: dict[str, Any] = {}
    with gc_paused():   # the passes' and the rendering's many small objects (gc_paused)
        for stage in todo[names.index(first):]:
            t0 = time.perf_counter()
            x = products[stage.name] = stage.run(x)
            line = stage.report(x, dump)
            if line is not None:
                log.info("stage %-13s %s  (%.2f s)", stage.name, line, time.perf_counter() - t0)
    if value_reads is not None:
        value_reads |= weights.read
    return products


def lower(g: Graph, flat_args: list[Any], opts: Options, dump: Dumper,
          value_reads: set[str] | None = None) -> Schedule:
    """The stages from ``normalize`` to ``schedule`` on ``g`` (a copy is made), without the cache;
    returns the schedule (arguments: :func:`run`)."""
    return run(g, opts, dump, args=flat_args, value_reads=value_reads)["schedule"]


def _checked(name: str, fn: Callable[[Graph], Graph]) -> Callable[[Graph], Graph]:
    def checked(g: Graph) -> Graph:
        g = fn(g)
        g.check(name)
        return g
    return checked


def _graph_report(name: str) -> Callable[[Graph, Dumper], str]:
    def report(g: Graph, dump: Dumper) -> str:
        dump.text(f"{name}.txt", g.dump)
        return f"{len(g.ops):4d} ops  {_top(g)}"
    return report


def _tiles_report(gt: tuple[Graph, dict[str, list[Any]]], dump: Dumper) -> str:
    tiles = gt[1]
    return f"{sum(map(len, tiles.values())):4d} tiles of {len(tiles)} ops"


def _schedule_report(sched: Schedule, dump: Dumper) -> str:
    dump.json("schedule.json", sched.to_json)
    return (f"{len(sched.instrs):4d} instructions on {sched.num_sms} SMs, "
            f"{sum(len(i.wait_ops) for i in sched.instrs)} counter waits")


def _render(sched: Schedule, opts: Options) -> "KernelPlan":
    """Stage ``render``: the megakernel's CUDA source and buffer layout.

    Raises:
        FallbackRequired: an op has no CUDA form."""
    from fusec.cuda.codegen import render
    return render(sched, profile=opts.profile, defines=opts.defines)


def _plan_report(plan: "KernelPlan", dump: Dumper) -> str:
    from fusec.cuda.codegen import describe
    dump.text("kernel.cu", plan.source)
    d = describe(plan)
    return (f"{d['instructions']} instructions, {d['waits']} counter waits, {d['buffers']} buffers, "
            f"{d['smem_bytes']} B dynamic shared memory, {d['threads']} threads, "
            f"{len(plan.source.splitlines())} lines of CUDA")


def nvrtc_compile(plan: "KernelPlan") -> "CompiledKernel":
    """Stage ``nvrtc``'s work: ``plan``'s source compiled for sm_90a by NVRTC, or found in its disk
    cache; logs the stage's line.

    Raises:
        JitError: NVRTC failed.
    """
    from fusec.cuda.jit import compile_cuda
    t0 = time.perf_counter()
    kernel = compile_cuda(plan.source, "fusec_step.cu")
    res = kernel.resources.get("fusec_step", {})
    if res.get("registers") is None:   # NVRTC 12.9+ found it in its own cache (CUDA_CACHE_PATH)
        what = "no ptxas report (NVRTC's own cache)"
    else:
        what = (f"{res.get('registers')} registers, {res.get('stack_frame_bytes')} B stack, "
                f"{res.get('spill_store_bytes')} B spills")
    log.info("stage %-13s NVRTC %s: %s  (%.2f s%s)", "nvrtc", ".".join(map(str, kernel.nvrtc_version)), what,
             time.perf_counter() - t0, ", cached" if kernel.cache_hit else "")
    return kernel


def nvrtc_started(plan: "KernelPlan") -> "Callable[[], CompiledKernel]":
    """Stage ``nvrtc``: :func:`nvrtc_compile` started on a thread of its own; returns a function
    that waits for it and returns the kernel. NVRTC releases the GIL while it compiles, so the
    caller meanwhile does other work (the artifact entry of the step, 0.6 s for Llama-3.2-1B on
    the H200, beside NVRTC's 1.6 s).

    Raises (from the returned function): what :func:`nvrtc_compile` raises."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusec-nvrtc")
    future = pool.submit(nvrtc_compile, plan)
    pool.shutdown(wait=False)   # the thread ends with the compile
    return future.result


def _top(g: Graph) -> str:
    kinds = g.count_kinds(members=False)
    top = sorted(kinds.items(), key=lambda kv: -kv[1])[:4]
    return ", ".join(f"{k}×{v}" for k, v in top)
