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
from fusec.instructions.base import COST_ROWS, Instruction, Region, Tile, register

_ELEMENTWISE = {
    "add", "sub", "mul", "div", "true_divide", "neg", "exp", "rsqrt", "sqrt", "pow", "sigmoid", "silu", "tanh",
    "cos", "sin", "where", "eq", "ne", "le", "lt", "ge", "gt", "logical_not", "logical_and",
    "logical_or", "bitwise_not", "_to_copy", "full_like", "scalar_tensor", "arange", "full",
    "abs", "maximum", "minimum", "clamp", "reciprocal", "copy_", "erf", "gelu", "log", "expm1",
    "log1p", "zeros_like", "ones_like", "copy", "fill", "remainder", "floor_divide", "sign",
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
    """One op executed whole on one SM (fallback for anything not fused).

    The op keeps its own kind; ``generic_kind`` names the fallback class for summaries.
    Cost model: every byte the op reads and writes, once.
    """

    name = "generic"

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        reads = [Region.whole(g, t) for t in dict.fromkeys(op.reads())]
        writes = [Region.whole(g, t) for t in op.writes()]

        def nbytes(t: str) -> int:
            n = g.tensors[g.root(t)].nbytes
            if op.kind == "table_lookup" and t == g.root(op.inputs["table"]):   # one row is read: count
                rows = max(1, g.tensors[t].shape[0])                           # at most COST_ROWS of them
                n = n * min(rows, COST_ROWS) // rows
            return n
        wbytes = sum(nbytes(r.tensor) for r in reads if cls.is_weight(g, r.tensor))
        abytes = sum(nbytes(r.tensor) for r in reads + writes) - wbytes
        return [Tile(op.name, 0, {}, reads, writes, wbytes, abytes)]

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
        return generate(op, g, bufs)

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        """The op whole; an out-of-range index of a gather raises
        :class:`fusec.errors.IndexFaultError` where eager raises IndexError (the simulator's
        check; the reference executor and the position tables' ``vmap`` run the op as it is)."""
        from fusec.ir.semantics import run_op
        if op.kind.startswith("aten."):
            check_gather(op, substitute(op.attrs["args"], op, env), substitute(op.attrs["kwargs"], op, env))
        run_op(op, env)


def generic_kind(op: Op) -> str:
    """Fallback class of an unfused op: elementwise, reduce, matvec, data or attention."""
    if op.kind.startswith(("aten.", "prims.", "fusec.")):
        return aten_category(op.attrs["target"]) or "data"
    return {"linear": "matvec", "rmsnorm": "reduce", "attention": "attention",
            "kv_write": "data", "table_lookup": "data"}.get(op.kind, "elementwise")
