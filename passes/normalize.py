"""normalize: turn byte-preserving views into aliases and drop what has no effect.

Expects: a graph fresh from capture (``aten.*`` ops, functionalized, mutations as
``copy_`` into graph inputs). Guarantees: no op is a pure reshape of contiguous bytes
(``view``, ``_unsafe_view``, ``unsqueeze``, ``squeeze``, ``alias``, ``clone``, ``expand``
without broadcasting, ``permute``/``transpose`` that only move size-1 dims, a ``slice`` that
keeps every element, a ``select`` of a size-1 dim, ``aten.copy`` that neither casts nor
broadcasts, a ``cat`` of one non-empty tensor); such outputs
are aliases of their input. Dead ops are removed. Values are unchanged.
"""
from __future__ import annotations

from fusec.ir import Graph, Op, Ref

from fusec.passes import dce

_RESHAPES = {"aten.view.default", "aten._unsafe_view.default", "aten.unsqueeze.default",
             "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.alias.default",
             "aten.clone.default", "aten.reshape.default", "aten.lift_fresh_copy.default"}
_PERMUTES = {"aten.permute.default", "aten.transpose.int", "aten.t.default"}


def _order_preserving(g: Graph, op: Op) -> bool:
    if len(op.inputs) != 1 or len(op.outputs) != 1 or op.mutates:
        return False
    src = g.tensors[op.inputs["in0"]]
    dst = g.tensors[op.outputs["out"]]
    if src.numel != dst.numel or src.dtype != dst.dtype:
        return False
    if op.kind in _RESHAPES:
        return True
    if op.kind == "aten.expand.default":
        return tuple(src.shape) == tuple(dst.shape) or [s for s in src.shape if s != 1] == \
            [s for s in dst.shape if s != 1]
    if op.kind == "aten.slice.Tensor":   # a slice that keeps every element (logits_to_keep=1)
        return tuple(src.shape) == tuple(dst.shape)
    if op.kind == "aten.select.int":     # selecting the only index of a size-1 dim
        return src.numel == dst.numel
    if op.kind in _PERMUTES:
        if op.kind == "aten.permute.default":
            perm = list(op.attrs["args"][1])
        elif op.kind == "aten.t.default":
            perm = [1, 0][: len(src.shape)]
        else:
            d0, d1 = op.attrs["args"][1] % len(src.shape), op.attrs["args"][2] % len(src.shape)
            perm = list(range(len(src.shape)))
            perm[d0], perm[d1] = perm[d1], perm[d0]
        moved = [p for p in perm if src.shape[p] != 1]
        return moved == sorted(moved)
    return False


def _functional_copy(g: Graph, op: Op) -> str | None:
    """The source of ``aten.copy(dst, src)`` (the functional form of ``dst.copy_(src)``) when its
    result is exactly src's bytes: same element count and dtype, so nothing is cast or broadcast."""
    if op.kind != "aten.copy.default" or "in1" not in op.inputs or op.mutates:
        return None
    src, out = g.tensors[op.inputs["in1"]], g.tensors[op.outputs["out"]]
    return op.inputs["in1"] if src.numel == out.numel and src.dtype == out.dtype else None


def _drop_empty_cat_inputs(g: Graph, op: Op) -> None:
    """``cat`` of an empty tensor (the pass-through part of a full rotary, Phi-3's
    ``q[..., rot:]``) drops it: an op never reads a tensor of no elements."""
    if op.kind != "aten.cat.default":
        return
    parts = list(op.attrs["args"][0])
    keep = [a for a in parts if not (isinstance(a, Ref) and g.tensors[op.inputs[a.slot]].numel == 0)]
    if len(keep) == len(parts) or not keep:
        return
    used = {a.slot for a in keep if isinstance(a, Ref)}
    for a in parts:
        if isinstance(a, Ref) and a.slot not in used:
            op.inputs.pop(a.slot, None)
    op.attrs["args"] = (keep, *op.attrs["args"][1:])


_COPIES = {"aten.clone.default", "aten.copy.default", "aten.lift_fresh_copy.default", "aten.alias.default"}


def _alias_source(g: Graph, op: Op, written: set[str]) -> str | None:
    """The tensor whose bytes ``op``'s output is, or None when the op must stay."""
    if op.kind in _COPIES and any(g.root(t) in written for t in op.inputs.values()):
        return None   # a copy of an input written later in the step keeps the old value
    if op.kind == "aten.cat.default":
        _drop_empty_cat_inputs(g, op)
        if len(op.attrs["args"][0]) == 1 and len(op.inputs) == 1:
            only = next(iter(op.inputs.values()))
            return only if g.tensors[only].numel == g.tensors[op.outputs["out"]].numel else None
        return None
    return op.inputs.get("in0") if _order_preserving(g, op) else _functional_copy(g, op)


def run(g: Graph) -> Graph:
    # inputs the step writes in place (``prev.copy_(tokens); tokens.copy_(next)``): a copy of one
    # stays a real copy, never an alias
    written = {g.root(op.outputs[s]) for op in g.ops for s in op.mutates} & set(g.inputs)
    kept = []
    for op in g.ops:
        src = _alias_source(g, op, written)
        if src is not None:
            g.tensors[op.outputs["out"]].alias_of = src
            continue
        kept.append(op)
    g.ops = kept
    return dce.run(g)
