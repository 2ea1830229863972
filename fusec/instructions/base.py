"""Instruction kinds: the unit of work of the megakernel.

An instruction kind is a Python class (this module's :class:`Instruction` subclasses) that
knows how to split one fused op into tiles with exact read/write regions, what each tile
costs in bytes, and what a tile computes (its Python semantics, used by the simulator and
as the oracle for the GPU template of the same name).

Regions are flat element ranges ``[start, stop)`` of a root buffer (see
:meth:`fusec.ir.Graph.root`). A region whose place depends on the position at run time (a
KV-cache row) is declared conservatively at plan time and exactly by :meth:`Instruction.runtime_regions`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

from fusec.ir import Graph, Op, Role, semantics
from fusec.ir.env import Env

KINDS: dict[str, type["Instruction"]] = {}

#: Threads per CTA of the megakernel (16 warps); templates may size shared memory by it.
CTA_THREADS = 512
#: The cost model counts at most this many rows of a KV cache or of a position table: a
#: length-polymorphic step's capacity (32768 rows) is not its usual length, and its tables'
#: size would distort the schedule (a ``table_lookup`` reads one row at run time).
COST_ROWS = 4096


def register(cls: type["Instruction"]) -> type["Instruction"]:
    """Class decorator: make an instruction kind known by its ``name``, with its fusion rules
    (stamped with the kind unless a rule names another)."""
    if cls.name in KINDS:
        raise ValueError(f"instruction kind {cls.name} registered twice")
    cls.rules = tuple(r if r.kind else dataclasses.replace(r, kind=cls.name) for r in cls.rules)
    KINDS[cls.name] = cls
    semantics.WHOLE[cls.name] = functools.partial(_run_whole, cls)
    return cls


def _run_whole(cls: type["Instruction"], op: Op, env: Any) -> None:
    """One op of kind ``cls`` run whole, as its tiling into one tile (the reference executor)."""
    for tile in cls.tiles(op, env.g, 1):
        cls.run_tile(op, tile, env)


@dataclasses.dataclass(frozen=True)
class Region:
    """Elements ``[start, stop)`` of the flattened root buffer ``tensor``."""

    tensor: str
    start: int
    stop: int

    @staticmethod
    def whole(g: Graph, t: str) -> "Region":
        """All of ``t``: its root's elements for a whole-buffer alias, a view's own range of its
        root (:meth:`fusec.ir.Graph.span`)."""
        return Region(*g.span(t))

    @staticmethod
    def of(g: Graph, t: str, start: int, stop: int) -> "Region":
        """Elements [start, stop) of ``t`` (an alias shares its root's flat indexing; a view's
        are shifted by its offset into the root, :meth:`fusec.ir.Graph.span`)."""
        r, off, _ = g.span(t)
        return Region(r, off + int(start), off + int(stop))

    def overlaps(self, o: "Region") -> bool:
        return self.tensor == o.tensor and self.start < o.stop and o.start < self.stop

    def to_json(self) -> list[Any]:
        return [self.tensor, self.start, self.stop]


@dataclasses.dataclass
class Tile:
    """One instruction on one SM: part ``index`` of op ``op``.

    Attributes:
        params: kind-specific tile parameters (row range, head range, KV chunk ...).
        reads, writes: regions, as planned (conservative for position-dependent places).
        weight_bytes: bytes of weights the tile streams (HBM reads that depend on nothing).
        act_bytes: other bytes read or written (activations, KV cache).
    """

    op: str
    index: int
    params: dict[str, Any]
    reads: list[Region]
    writes: list[Region]
    weight_bytes: int
    act_bytes: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.act_bytes

    @property
    def key(self) -> str:
        return f"{self.op}#{self.index}"


class Instruction:
    """Base class of instruction kinds; subclasses set ``name`` and override the methods.

    ``rules``: how subgraphs fuse into this kind (:class:`fusec.instructions.rule.Rule`), applied
    by the ``fuse`` pass; a kind without rules runs only ops already of its kind. ``call``: the
    device call its template's function takes (:class:`fusec.instructions.call.Call`), from
    which codegen makes the arguments dict and the dispatch case; without it the template's
    ``call(a)`` macro writes the case from ``cuda_args``. ``max_rows``: the most activation rows
    one op of the kind computes: a step's ``B * K`` (B sequences of K query tokens each,
    :meth:`fusec.ir.Graph.rows`); the ``fuse`` pass applies none of its rules to a step of more
    rows (those ops stay generic, whose semantics take any B and K: docs/batch.md). A kind whose
    op tells sequences from query tokens (attention, RoPE, a KV write) and raises ``max_rows``
    checks the shapes it takes in its rule."""

    name: ClassVar[str] = ""
    rules: ClassVar[tuple[Any, ...]] = ()
    call: ClassVar[Any] = None
    max_rows: ClassVar[int] = 1

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        """Split ``op`` into about ``want`` tiles with exact regions and byte costs."""
        raise NotImplementedError

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        """Compute ``tile`` of ``op``: read inputs from ``env``, write its output regions."""
        raise NotImplementedError

    @classmethod
    def runtime_regions(cls, op: Op, tile: Tile, env: Env) -> tuple[list[Region], list[Region]]:
        """Exact (reads, writes) of ``tile`` given run-time values (default: the planned ones)."""
        return tile.reads, tile.writes

    @classmethod
    def ticket_regions(cls, op: Op, tile: Tile, env: Env) -> tuple[list[Region], list[Region]]:
        """(reads, writes) ``tile`` makes after taking an atomic ticket (:meth:`Env.take_ticket`),
        given run-time values and the tickets taken so far; called before :meth:`run_tile`.
        Only these accesses are ordered by the ticket (default: none)."""
        return [], []

    @classmethod
    def encode(cls, op: Op, tile: Tile) -> list[int]:
        """Up to 4 int32 tile parameters for the instruction word (p0..p3); by default the
        tile's first range parameter (rows, units or heads)."""
        for key in ("rows", "units", "heads"):
            if key in tile.params:
                return list(tile.params[key])
        return []

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs: Any) -> dict[str, Any]:
        """Arguments the kind template's macros read: C types, shapes, pointer expressions
        (``bufs`` is a :class:`fusec.cuda.codegen.Buffers`); by default those of the class's
        ``call`` declaration. Raises FallbackRequired if the op has no CUDA form."""
        if cls.call is None:
            raise NotImplementedError(f"{cls.name} has no CUDA template")
        return cls.call.values(op, g, bufs)

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        """Dynamic shared memory the template needs, in floats."""
        return 0

    @staticmethod
    def is_weight(g: Graph, t: str) -> bool:
        return g.tensors[g.root(t)].role in (Role.WEIGHT, Role.CONSTANT)


def split_range(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Split ``range(n)`` into at most ``parts`` contiguous ranges, multiples of ``align``.

    Ranges differ in length by at most ``align``; empty ranges are dropped.
    """
    units = -(-n // align)
    parts = max(1, min(parts, units))
    out = []
    for i in range(parts):
        a = (units * i) // parts * align
        b = min(n, (units * (i + 1)) // parts * align)
        if b > a:
            out.append((a, b))
    return out
