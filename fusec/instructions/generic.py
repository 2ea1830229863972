"""Generic instruction kinds: any op that no fusion pattern claimed.

A generic instruction runs one op (an ATen op or an unfused semantic op) as a single tile
with that op's reference semantics. Its kind name says what it is, for the summary and for
the GPU back end: ``elementwise``, ``reduce``, ``matvec``, ``data`` (layout and indexing).

:func:`aten_category` is also the list of ATen ops fusec can place at all; capture sends a
graph with any other op to the fallback backend.
"""
from __future__ import annotations

from typing import Any

import torch

from fusec.ir.aten_exec import check_gather, substitute
from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.instructions.base import COST_ROWS, Instruction, Region, Tile, register, split_range

_ELEMENTWISE = {
    "add", "sub", "mul", "div", "true_divide", "neg", "exp", "rsqrt", "sqrt", "pow", "sigmoid", "silu", "tanh",
    "cos", "sin", "where", "eq", "ne", "le", "lt", "ge", "gt", "logical_not", "logical_and",
    "logical_or", "bitwise_not", "_to_copy", "full_like", "scalar_tensor", "arange", "full",
    "abs", "maximum", "minimum", "clamp", "reciprocal", "copy_", "erf", "gelu", "log", "expm1",
    "log1p", "zeros_like", "ones_like", "copy", "fill", "remainder", "fmod", "floor_divide", "sign",
    "bitwise_and", "bitwise_or", "bitwise_xor", "logical_xor", "clamp_min", "clamp_max", "relu",
    "leaky_relu",
}
_REDUCE = {"mean", "sum", "amax", "amin", "any", "_softmax", "max", "argmax", "var_mean", "prod",
           "native_layer_norm", "min", "argmin", "_log_softmax", "topk"}
_MATVEC = {"mm", "addmm", "bmm"}
_DATA = {
    "view", "_unsafe_view", "unsqueeze", "squeeze", "permute", "expand", "slice", "cat", "select",
    "alias", "index_put", "index", "embedding", "index_select", "gather", "clone", "t",
    "transpose", "lift_fresh_copy", "repeat", "split", "split_with_sizes", "constant_pad_nd",
    "index_copy", "slice_scatter", "select_scatter", "_unsafe_index", "narrow", "empty",
    "empty_strided", "detach",
}


#: ops whose CUDA form is one elementwise loop over their output (``fusec.cuda.gen.pointwise
#: .elementwise``), by ATen base name or semantic kind: :func:`ranged` may split them by ranges
_RANGE_ATEN = {"add", "sub", "mul", "div", "true_divide", "exp", "rsqrt", "sqrt", "pow", "sigmoid", "silu", "tanh",
               "cos", "sin", "erf", "log", "expm1", "log1p", "reciprocal", "gelu", "relu", "leaky_relu",
               "neg", "abs", "sign", "_to_copy", "convert_element_type", "clone"}
_RANGE_SEMANTIC = {"silu_mul", "gelu_mul"}
#: output elements per tile of a range-split op at least (4 per thread of a 512-thread CTA):
#: an op of fewer than twice as many stays one tile
RANGE_CHUNK = 2048


def ranged(op: Op, g: Graph) -> bool:
    """Whether the unfused ``op`` runs as tiles of output ranges (:meth:`Generic.tiles`): an
    elementwise op (its CUDA form one loop over its output) with one fresh output ``out`` of at
    least ``2 * RANGE_CHUNK`` elements, static sizes everywhere. A vocabulary-sized logits op
    (Gemma-2's final softcap: a division, a tanh and a multiplication over 256000 logits) took
    98-108 µs each on one SM of the H200 (2026-12-03), and an MLP's silu(gate) * up of 8192
    elements 5 µs; split over the SMs each is one wave of loads."""
    if op.kind in _RANGE_SEMANTIC:
        pass
    elif op.kind.startswith(("aten.", "prims.")) and op.kind.count(".") >= 1:
        if op.kind.split(".")[1] not in _RANGE_ATEN:
            return False
    else:
        return False
    if list(op.outputs) != ["out"] or op.mutates:
        return False
    out = g.tensors[op.outputs["out"]]
    if out.numel < 2 * RANGE_CHUNK or out.sym:
        return False
    return not any(g.tensors[t].sym for t in op.reads())


def range_splits(op: Op, g: Graph, want: int) -> list[tuple[int, int]]:
    """The output ranges of a :func:`ranged` op's tiles: about ``want`` (at least
    ``RANGE_CHUNK`` elements each), contiguous, in order."""
    n = g.tensors[op.outputs["out"]].numel
    return split_range(n, max(1, min(want, n // RANGE_CHUNK)))


def run_ranges(ops: list[Op], env: Env, key: str, lo: int, hi: int) -> None:
    """Elements ``[lo, hi)`` of the outputs of :func:`ranged` ``ops`` (one op, or a ranged
    chain's members, each reading an earlier one at the element it writes), as the kernel's tile
    writes them: the ops computed whole in order, once per step for all the tiles (``Env.memo``
    under ``key``), and only the range written; the rest of each output keeps what it held
    (poison at the first step)."""
    from fusec.ir.semantics import run_op
    full = env.memo.get(key)
    if full is None:
        full = {}
        with env.scratch([env.g.root(op.outputs["out"]) for op in ops]):
            for op in ops:
                run_op(op, env)
                full[op.name] = env.read(op.outputs["out"]).reshape(-1).clone()
        env.memo[key] = full
    for op in ops:
        env.flat(op.outputs["out"])[lo:hi] = full[op.name][lo:hi]


def aten_category(target: Any) -> str | None:
    """``'elementwise' | 'reduce' | 'matvec' | 'data' | 'attention'``, or None if unplaceable.

    Args:
        target: an ``OpOverload`` from an ATen FX graph.
    """
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "fusec":
        return "attention"
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return None
    base = target._opname
    if target.namespace == "prims":
        return "elementwise" if base == "convert_element_type" else None
    for cat, names in (("elementwise", _ELEMENTWISE), ("reduce", _REDUCE),
                       ("matvec", _MATVEC), ("data", _DATA)):
        if base in names:
            return cat
    return None


@register
class Generic(Instruction):
    """One op executed whole on one SM (fallback for anything not fused), or, for a large
    elementwise op (:func:`ranged`), ranges of its output on many SMs.

    The op keeps its own kind; ``generic_kind`` names the fallback class for summaries.
    Cost model: every byte the op (its tile) reads and writes, once.
    """

    name = "generic"

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        """One tile for the whole op; a :func:`ranged` op: about ``want`` tiles (at least
        ``RANGE_CHUNK`` elements each) over contiguous ranges of its output's flat elements,
        each reading the same range of every input of the output's element count and all of a
        broadcast one (params ``rows``: the range, the instruction word's p0, p1)."""
        if ranged(op, g):
            return cls._range_tiles(op, g, want)
        reads = [Region.whole(g, t) for t in dict.fromkeys(op.reads())]
        writes = [Region.whole(g, t) for t in op.writes()]

        def nbytes(r: Region) -> int:
            t = r.tensor   # (a root buffer: all of it, or a view's range of it)
            n = (r.stop - r.start) * g.tensors[t].dtype.itemsize
            if op.kind == "table_lookup" and t == g.root(op.inputs["table"]):   # one row is read: count
                rows = max(1, g.tensors[t].shape[0])                           # at most COST_ROWS of them
                n = n * min(rows, COST_ROWS) // rows
            return n
        wbytes = sum(nbytes(r) for r in reads if cls.is_weight(g, r.tensor))
        abytes = sum(nbytes(r) for r in reads + writes) - wbytes
        return [Tile(op.name, 0, {}, reads, writes, wbytes, abytes)]

    @classmethod
    def _range_tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        return [cls.range_tile(op, g, i, lo, hi) for i, (lo, hi) in enumerate(range_splits(op, g, want))]

    @classmethod
    def range_tile(cls, op: Op, g: Graph, i: int, lo: int, hi: int) -> Tile:
        """Tile ``i`` of a :func:`ranged` op: output elements ``[lo, hi)``, the same range of
        every input of the output's element count, all of a broadcast one."""
        out = op.outputs["out"]
        n = g.tensors[out].numel
        reads, wbytes, abytes = [], 0, 0
        for t in dict.fromkeys(op.reads()):
            info = g.tensors[t]
            r = Region.of(g, t, lo, hi) if info.numel == n else Region.whole(g, t)
            reads.append(r)
            b = (r.stop - r.start) * info.dtype.itemsize
            if cls.is_weight(g, t):
                wbytes += b
            else:
                abytes += b
        abytes += (hi - lo) * g.tensors[out].dtype.itemsize
        return Tile(op.name, i, {"rows": (lo, hi)}, reads, [Region.of(g, out, lo, hi)], wbytes, abytes)

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict[str, Any]:
        """Hand-written forms for ``table_lookup`` and a small same-dtype ``aten.copy_``
        (position counters); every other op gets a generated function (:mod:`fusec.cuda.gen`):
        the result's ``source`` (and ``helpers``) are emitted once by codegen before the
        dispatch switch, ``call`` is its case.

        Raises:
            NotImplementedError: no emitter for the op's kind.
            FallbackRequired: the op's semantics have no CUDA form (the message names it).
        """
        if op.kind == "table_lookup":
            out = op.outputs["out"]
            n = g.tensors[out].numel
            return {"fn": "table_lookup", "t": bufs.ctype(out), "N": n,
                    "P": g.tensors[op.inputs["table"]].numel // max(1, n),
                    "table": bufs.ptr(op.inputs["table"]), "pos": bufs.ptr(op.inputs["pos"]),
                    "out": bufs.ptr(out)}
        if op.kind == "aten.copy_.default":
            src, dst = op.inputs["in1"], op.outputs["mut0"]
            n = g.tensors[dst].numel
            if g.tensors[src].dtype == g.tensors[dst].dtype and g.tensors[src].numel == n and n <= 4096:
                return {"fn": "copy_small", "t": bufs.ctype(dst), "N": n, "src": bufs.ptr(src),
                        "dst": bufs.ptr(dst)}
        from fusec.cuda.gen import generate
        return generate(op, g, bufs, ranged=ranged(op, g))

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        """The op whole; an out-of-range index of a gather raises
        :class:`fusec.errors.IndexFaultError` where eager raises IndexError (the simulator's
        check; the reference executor and the position tables' ``vmap`` run the op as it is)."""
        from fusec.ir.semantics import run_op
        if op.kind.startswith("aten."):
            check_gather(op, substitute(op.attrs["args"], op, env), substitute(op.attrs["kwargs"], op, env))
        if "rows" not in tile.params:
            run_op(op, env)
            return
        run_ranges([op], env, op.name, *tile.params["rows"])


def generic_kind(op: Op) -> str:
    """Fallback class of an unfused op: elementwise, reduce, matvec, data or attention."""
    if op.kind.startswith(("aten.", "prims.", "fusec.")):
        return aten_category(op.attrs["target"]) or "data"
    return {"linear": "matvec", "rmsnorm": "reduce", "attention": "attention",
            "kv_write": "data", "table_lookup": "data"}.get(op.kind, "elementwise")
