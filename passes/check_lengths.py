"""check_lengths: a length-polymorphic graph depends on its cache length only through the caches.

Expects: a recognized graph (``kv_write`` and ``attention`` raised, the GQA expand of the caches
and a causal mask removed). A graph with no ``Graph.lengths`` passes unchanged.

Guarantees, for a graph with run-time lengths (``Graph.lengths``, ``TensorInfo.sym``, built by
:func:`fusec.frontend.from_fx.graph_from_aten` at the lengths' capacity): every op left reads or
writes a tensor with a run-time size only as a KV cache (``kv_write``'s ``cache``,
``attention``'s ``k`` and ``v``) or as the attention's mask over the cache rows (``mask``); no
op takes a size that depends on the length as an argument (``attrs["symbolic"]``); no graph
output has a run-time size; and each run-time size is one symbol of ``Graph.lengths`` at a KV
cache's rows (dim 2) or a mask's last dim, the K and V caches and the mask of one attention
sharing one symbol (SDPA requires their lengths equal). So one compiled step computes, for caches of any
length up to the capacity, what the graph computes for that length: the kernel and the
simulator read the rows of each call's caches at run time.

Raises:
    NotLengthPolymorphic: the first op or tensor that breaks this, named with its source line.
    The caller then compiles the graph per cache length.
"""
from __future__ import annotations

from fusec.errors import NotLengthPolymorphic
from fusec.ir import Graph, Role

#: (op kind, slot) pairs that read or write a tensor of run-time length: the kinds whose CUDA
#: form and Python semantics take the cache's rows at run time
ALLOWED = {("kv_write", "cache"), ("attention", "k"), ("attention", "v"), ("attention", "mask")}


def _where(op) -> str:
    return f"{op.name} ({op.kind}{', ' + op.source if op.source else ''})"


def _unify(g: Graph) -> None:
    """One symbol for the K and V caches and the mask of each attention: SDPA needs equal lengths
    there (dynamo may name them apart: ``s4`` for the keys, ``s40`` for the values)."""
    rename: dict[str, str] = {}

    def find(x: str) -> str:
        while x in rename:
            x = rename[x]
        return x
    for op in g.ops:
        if op.kind != "attention":
            continue
        syms = [find(s) for slot in ("k", "v", "mask") if slot in op.inputs
                for s in g.tensors[g.root(op.inputs[slot])].sym.values()]
        for s in syms[1:]:
            if s != syms[0]:
                rename[s] = syms[0]
    if not rename:
        return
    for t in g.tensors.values():
        t.sym = {d: find(s) for d, s in t.sym.items()}
    g.lengths = {find(s): cap for s, cap in g.lengths.items()}


def run(g: Graph) -> Graph:
    if not g.lengths:
        return g
    _unify(g)
    for op in g.ops:
        if op.attrs.get("symbolic"):
            raise NotLengthPolymorphic(f"op {_where(op)} takes a size computed from the cache length")
        for slot, t in (*op.inputs.items(), *op.outputs.items()):
            info = g.tensors[t]
            if not (info.sym or g.tensors[g.root(t)].sym):
                continue
            if (op.kind, slot) not in ALLOWED:
                raise NotLengthPolymorphic(f"op {_where(op)} reads or writes {t} {list(info.shape)}, whose size "
                                           "is the cache length, other than as a KV cache or its mask")
            root = g.tensors[g.root(t)]
            want = 2 if root.role == Role.KV_CACHE else len(root.shape) - 1 if root.role == Role.INPUT else None
            if want is None or set(root.sym) != {want} or root.sym[want] not in g.lengths:
                raise NotLengthPolymorphic(f"{t} (read by {_where(op)}) has run-time sizes {root.sym}; only a KV "
                                           "cache's rows or a mask's last dim may be the cache length")
    for t in g.outputs:
        if g.tensors[t].sym or g.tensors[g.root(t)].sym:
            raise NotLengthPolymorphic(f"graph output {t} {list(g.tensors[t].shape)} has the cache length as a size")
    return g
