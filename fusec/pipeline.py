"""The compiler pipeline as one list of named stages.

``build_ir`` (capture -> IR) runs when dynamo hands over a graph; ``lower`` runs the passes
with the real input values at the first call: normalize -> fold_constants -> split_linear -> recognize ->
check_lengths -> fold_position -> fuse -> chain -> tile -> schedule. The IR checker runs after every pass and names the pass that
broke an invariant. With ``dump_dir`` set (or ``FUSEC_DUMP``), every stage writes its
artifact there: ``00_aten.txt``, ``01_ir.txt``, ``02_normalize.txt`` ... ``schedule.json``.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from fusec.ir import position
from fusec.config import Options
from fusec.frontend.from_fx import graph_from_aten
from fusec.ir import Graph, Role
from fusec.ir.schedule import Schedule

log = logging.getLogger("fusec")


def _passes():
    from fusec.passes import (chain, check_lengths, fold_constants, fold_position, fuse, normalize, recognize,
                              schedule, split_linear, tile)
    return normalize, fold_constants, split_linear, recognize, check_lengths, fold_position, fuse, chain, tile, schedule


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


def lower(g: Graph, flat_args: list[Any], opts: Options, dump: Dumper,
          value_reads: set[str] | None = None) -> Schedule:
    """Run the passes on ``g`` (a copy is made); returns the schedule.

    Args:
        flat_args: real input tensors (weights are read to fold position tables and to
            evaluate attention masks).
        value_reads: if given, receives the names of the weights whose values the passes read
            (:class:`ValueReads`).
    """
    (normalize, fold_constants, split_linear, recognize, check_lengths, fold_position, fuse, chain, tile,
     schedule) = _passes()
    g = g.copy()
    num_sms = opts.num_sms or 132
    # small weights (inv_freq ...) on the CPU: position tables and masks are evaluated there
    weights = ValueReads({n: a.detach().cpu() for n, a in zip(g.inputs, flat_args)
                          if g.tensors[n].role == Role.WEIGHT and g.tensors[n].numel <= position.MAX_KNOWN_WEIGHT})
    stages: list[tuple[str, Callable[[Graph], Graph]]] = [
        ("normalize", normalize.run),
        ("fold_constants", lambda g: fold_constants.run(g, weights)),
        ("split_linear", split_linear.run),
        ("recognize", lambda g: recognize.run(g, weights)),
        ("check_lengths", check_lengths.run),
        ("fold_position", lambda g: fold_position.run(g, weights)),
        ("fuse", lambda g: fuse.run(g, num_sms, opts.max_fusions, opts.attention_merge, opts.defines)),
        ("chain", lambda g: chain.run(g) if opts.chain and opts.max_fusions is None else g),
    ]
    for name, fn in stages:
        t0 = time.perf_counter()
        g = fn(g)
        g.check(name)
        dump.text(f"{name}.txt", g.dump)
        log.info("stage %-13s %4d ops  %s  (%.2f s)", name, len(g.ops), _top(g), time.perf_counter() - t0)
    t0 = time.perf_counter()
    tiles = tile.run(g, num_sms)
    sched = schedule.run(g, tiles, num_sms)
    log.info("stage %-13s %4d instructions on %d SMs, %d counter waits  (%.2f s)", "tile+schedule",
             len(sched.instrs), num_sms, sum(len(i.wait_ops) for i in sched.instrs), time.perf_counter() - t0)
    dump.json("schedule.json", sched.to_json)
    if value_reads is not None:
        value_reads |= weights.read
    return sched


def _top(g: Graph) -> str:
    kinds = g.count_kinds(members=False)
    top = sorted(kinds.items(), key=lambda kv: -kv[1])[:4]
    return ", ".join(f"{k}×{v}" for k, v in top)
