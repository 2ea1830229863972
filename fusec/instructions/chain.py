"""chain: small standalone ops that depend on each other, run one after another by one CTA.

Ops that no fused kind takes (a per-head or whole-projection RMSNorm, RoPE, a cast, a KV-cache
write, a post-norm's residual add, a LayerNorm) each run as one instruction on one SM, and each
is a dependency level of its own: every level costs a counter release, a poll and a prologue
(about 2-3 µs on the H200, docs/performance.md), while the op itself moves a few KB. A chain
runs a sequence of such ops in program order in ONE instruction: its members' device functions
are called one after the other by the whole CTA with ``__syncthreads()`` between them, so a
member reads what the one before it wrote (global memory, same CTA: the barrier orders it). The
``chain`` pass (:mod:`fusec.passes.chain`) decides which ops form a chain; this kind runs it.

A ranged chain (attr ``ranged``: the element count n) is a sequence of elementwise ops each split
into output ranges (:func:`fusec.instructions.generic.ranged`), all of n elements, where a
member reads what an earlier one wrote only at the element it writes (an input of n elements:
the same range). It is split into the same ranges as its members would be, and tile i runs every
member over range i: Phi-2's written-out tanh-GELU (eight ops over the MLP's 10240 elements) is
one level of five tiles instead of eight levels.

Source: the members' own semantics (each an ATen op or a semantic op, :mod:`fusec.ir.semantics`,
and its generated CUDA form, :mod:`fusec.cuda.gen`); numerics are the members' exactly (every
intermediate is still written in its own dtype). Shapes: the members'. Attributes: ``ops`` the
member ops in program order (their own inputs and outputs), ``steps`` their kinds for dumps.
"""
from __future__ import annotations

from typing import Any

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.instructions.base import Instruction, Region, Tile, register
from fusec.instructions.generic import Generic, generic_kind, range_splits, ranged, run_ranges
from fusec.instructions.layernorm import LayerNorm

#: a member moves at most this many bytes (its inputs but a mutated buffer, one row of a
#: looked-up table, its fresh outputs): a chain is for the few-KB ops between the fused kinds
MEMBER_MAX_BYTES = 128 * 1024
#: and a whole chain at most this many (the ops after it wait for all of it)
CHAIN_MAX_BYTES = 512 * 1024


def member_bytes(op: Op, g: Graph) -> int:
    """Bytes ``op`` moves at run time, as a chain member counts them: its inputs (but a buffer
    it updates in place: a KV-cache write moves one row), one row of a ``table_lookup``'s table,
    and its fresh outputs."""
    mutated = {g.root(op.outputs[s]) for s in op.mutates}
    n = 0
    for slot, t in op.inputs.items():
        info = g.tensors[g.root(t)]
        if info.name in mutated:
            continue
        if op.kind == "table_lookup" and slot == "table":
            n += info.nbytes // max(1, info.shape[0] if info.shape else 1)
        else:
            _, a, b = g.span(t)   # all of the root, or a view's range of it
            n += (b - a) * info.dtype.itemsize
    return n + sum(g.tensors[t].nbytes for t in op.fresh_outputs())


def can_join(op: Op, g: Graph) -> bool:
    """Whether ``op`` may be a chain member: a one-tile generic op (elementwise, reduction or
    data movement; not one split into output ranges, not a matvec or an attention run whole)
    or a ``layernorm``, moving at most :data:`MEMBER_MAX_BYTES`, with static sizes."""
    if op.kind == LayerNorm.name:
        pass
    elif op.kind.startswith(("aten.", "prims.", "fusec.")) or op.kind not in _kinds():
        if generic_kind(op) not in ("elementwise", "reduce", "data") or ranged(op, g):
            return False
    else:
        return False
    if any(g.tensors[t].sym for t in list(op.reads()) + list(op.writes())):
        return False
    return member_bytes(op, g) <= MEMBER_MAX_BYTES


def step_name(m: Op) -> str:
    """A member's kind as dumps name it: an ATen op's base name (``aten.mul.Tensor`` -> ``mul``)."""
    return m.kind.split(".")[1] if m.kind.count(".") >= 2 else m.kind


def range_class(op: Op, g: Graph) -> int | None:
    """The element count n of ``op`` if it may be a ranged chain's member (a :func:`ranged`
    elementwise op, one fresh output of n elements), else None."""
    return g.tensors[op.outputs["out"]].numel if ranged(op, g) else None


def _kinds() -> dict[str, Any]:
    from fusec.instructions.base import KINDS
    return KINDS


def _member_class(op: Op) -> type[Instruction]:
    return LayerNorm if op.kind == LayerNorm.name else Generic


def _member_tile(op: Op, g: Graph) -> Tile:
    (t,) = _member_class(op).tiles(op, g, 1)
    return t


@register
class Chain(Instruction):
    """A sequence of small ops run by one CTA in program order (module docstring). One tile:
    it reads what its members read from outside the chain and writes everything they write."""

    name = "chain"

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        if op.attrs.get("ranged"):
            return [cls._union(op, g, i, [Generic.range_tile(m, g, i, lo, hi) for m in op.attrs["ops"]])
                    for i, (lo, hi) in enumerate(range_splits(op.attrs["ops"][0], g, want))]
        return [cls._union(op, g, 0, [_member_tile(m, g) for m in op.attrs["ops"]])]

    @staticmethod
    def _union(op: Op, g: Graph, i: int, member_tiles: list[Tile]) -> Tile:
        """Tile ``i`` of the chain from its members' tiles: what they read from outside the
        chain, everything they write; a ranged chain's tile keeps its range (``rows``)."""
        reads: list[Region] = []
        writes: list[Region] = []
        written: set[str] = set()
        wbytes = abytes = 0
        for t in member_tiles:
            reads += [r for r in t.reads if r.tensor not in written and r not in reads]
            writes += [w for w in t.writes if w not in writes]
            written |= {w.tensor for w in t.writes}
            wbytes += t.weight_bytes
            abytes += t.act_bytes
        params = {"rows": member_tiles[0].params["rows"]} if op.attrs.get("ranged") else {}
        return Tile(op.name, i, params, reads, writes, wbytes, abytes)

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        if op.attrs.get("ranged"):   # every member's range of the members run whole, once per step
            run_ranges(op.attrs["ops"], env, op.name, *tile.params["rows"])
            return
        for m in op.attrs["ops"]:
            k = _member_class(m)
            k.run_tile(m, _member_tile(m, env.g), env)

    @classmethod
    def runtime_regions(cls, op: Op, tile: Tile, env: Env) -> tuple[list[Region], list[Region]]:
        if op.attrs.get("ranged"):   # static regions: the tile's own
            return tile.reads, tile.writes
        reads: list[Region] = []
        writes: list[Region] = []
        written: set[str] = set()
        for m in op.attrs["ops"]:
            r, w = _member_class(m).runtime_regions(m, _member_tile(m, env.g), env)
            reads += [x for x in r if x.tensor not in written]
            writes += w
            written |= {x.tensor for x in w}
        return reads, writes

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs: Any) -> dict[str, Any]:
        """``subs``: per member, ``{"text": call}`` (a kind with a declared call) or
        ``{"generic": args}`` (the generic template's call macro renders it); ``sources``: the
        generated functions the members call; ``uses``: the templates whose definitions the
        calls need (codegen emits each once)."""
        subs, sources, uses = [], [], []
        for m in op.attrs["ops"]:
            k = _member_class(m)
            args = k.cuda_args(m, g, bufs)
            if k.call is not None:
                subs.append({"text": k.call.text(m, args)})
            else:
                subs.append({"generic": args})
                if "source" in args:
                    sources.append(args)
            if k.name not in uses:
                uses.append(k.name)
        return {"subs": subs, "sources": sources, "uses": uses}

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        return max((_member_class(m).smem_floats(m, g) for m in op.attrs["ops"]), default=0)
