"""prologue: fold the small vector ops in front of a matvec kind into that kind's tiles.

After ``chain``, a post-norm and its residual add, a scaled residual or an embedding scale run
as one ``chain`` op (or one generic op) on one SM, a dependency level of its own, and the
matvec kind that reads their result waits for it. This pass makes them the consumer's
prologue (:mod:`fusec.instructions.prologue`): every tile of the consumer computes them from
their inputs in its shared memory, and one tile writes what later ops read.

Rule, for each op ``K`` of a kind with ``takes_prologue`` (program order) and no prologue yet:
``P``, the op that creates the root of K's ``x``, is a ``chain`` or a single generic op, and

* every member of ``P`` may be a prologue member (:func:`fusec.instructions.prologue.can_member`),
  and so may K's own RMSNorm where K has one (it becomes the last member);
* ``x`` has the size and dtype of that root (a reshape of it at most);
* no op between ``P`` and ``K`` (program order) reads what ``P`` writes, or writes what ``P``
  reads or writes (``P``'s work moves to K's place); no member reads what K writes (a KV cache
  K updates in place: other tiles of K may have written it); K reads no member's output but ``x`` (its
  other inputs are read from global memory, where only K's writer tile writes them);
* every op outside ``P`` and ``K`` that reads an output of ``P`` reads something ``K`` makes too,
  directly or through other ops (it waits for ``K`` already: folding adds no level to its path);
* the members' outputs and their external inputs fit
  :data:`fusec.instructions.prologue.MAX_SCRATCH_BYTES` of shared memory.

Expects: a graph after ``chain`` (or after ``fuse``, with chains off). Guarantees: the same
values; each folded ``P`` is gone and its members are K's ``pre`` (K's outputs ``x`` and
``pre_out*`` are their fresh outputs, ``pre_keep`` those read after K or returned); no
dependency level is added; every other op is untouched.
"""
from __future__ import annotations

import logging

from fusec.instructions.base import KINDS
from fusec.instructions.prologue import MAX_SCRATCH_BYTES, can_member, scratch_bytes
from fusec.ir import Graph, Op

log = logging.getLogger("fusec.passes.prologue")


def run(g: Graph) -> Graph:
    folded = 0
    k = 0
    while k < len(g.ops):
        op = g.ops[k]
        cls = KINDS.get(op.kind)
        if cls is not None and getattr(cls, "takes_prologue", False) and "pre" not in op.attrs \
                and "x" in op.inputs and _fold(g, op):
            folded += 1
            k = g.ops.index(op)
        k += 1
    if folded:
        log.info("prologue: %d ops folded into the matvec kinds that read them", folded)
    return g


def _fold(g: Graph, op: Op) -> bool:
    x = op.inputs["x"]
    root = g.root(x)
    prods = g.producers()
    p = prods.get(root)
    if p is None or p is op:
        return False
    members = list(p.attrs["ops"]) if p.kind == "chain" else [p]
    if not all(can_member(m, g) for m in members):
        return False
    final = g.tensors[root]
    if final.numel != g.tensors[x].numel or final.dtype != g.tensors[x].dtype:
        return False
    at_p, at_k = g.ops.index(p), g.ops.index(op)
    p_reads = {g.root(t) for t in p.reads()}
    p_writes = {g.root(t) for t in p.writes()}
    for between in g.ops[at_p + 1:at_k]:
        if {g.root(t) for t in between.reads()} & p_writes:
            return False
        if {g.root(t) for t in between.writes()} & (p_reads | p_writes):
            return False
    inputs = {s: t for s, t in op.inputs.items() if s != "x"}
    attrs = dict(op.attrs)
    norm = None
    if "norm_w" in op.inputs and attrs.get("norm", True):
        norm = _norm_member(g, op, x)   # over x as K reads it: its last dim is the norm's
        if not can_member(norm, g):
            g.tensors.pop(norm.outputs["out"], None)
            return False
        members.append(norm)
        root = norm.outputs["out"]
        del inputs["norm_w"]
        attrs.pop("eps", None)
        attrs.update(norm=False, w_fp32=False)
    written: set[str] = set()
    ext: list[str] = []
    outs: list[str] = []
    for m in members:
        for t in m.reads():
            if g.root(t) not in written and t not in ext:
                ext.append(t)
        for t in m.fresh_outputs():
            written.add(g.root(t))
            outs.append(t)
    # K's other inputs must be there before K: a member's output is written by K's writer tile only
    if scratch_bytes(g, members, ext, root) > MAX_SCRATCH_BYTES or any(g.root(t) in written for t in ext) \
            or any(g.root(t) in written for t in inputs.values()) \
            or any(g.root(t) in {g.root(w) for w in op.writes()} for t in ext):   # K updates it in place
        if norm is not None:
            g.tensors.pop(norm.outputs["out"], None)   # the norm member's output: unused
        return False
    # read after the fold by an op other than P, or returned: the writer tile keeps them
    users = g.users()
    inner = {p.name, op.name}
    graph_out = {g.root(t) for t in g.outputs}
    keep = [t for t in outs if t in graph_out or any(u.name not in inner for u in users.get(t, []))]
    # a kept output's other readers must wait for K already (they read what K makes, directly
    # or not): one that did not (a parallel block's MLP reading the LayerNorm that K's q/k/v
    # read too) would now wait for all of K, a level later than before
    after = _downstream(g, op)
    if any(u.name not in inner and u.name not in after for t in keep for u in users.get(t, [])):
        if norm is not None:
            g.tensors.pop(norm.outputs["out"], None)
        return False
    new_inputs = {**inputs, **{f"pre_in{i}": t for i, t in enumerate(ext)}}
    new_outputs = dict(op.outputs)
    new_outputs["x"] = root
    for i, t in enumerate(t for t in outs if t != root):
        new_outputs[f"pre_out{i}"] = t
    attrs.update(pre=members, pre_keep=keep,
                 pre_steps=" > ".join(m.kind.split(".")[1] if m.kind.count(".") >= 2 else m.kind for m in members))
    op.inputs, op.outputs, op.attrs = new_inputs, new_outputs, attrs
    g.ops = [o for o in g.ops if o is not p]
    return True


def _downstream(g: Graph, op: Op) -> set[str]:
    """Names of the ops after ``op`` (program order) that read what it writes, directly or
    through other such ops: those that wait for ``op`` already."""
    made = {g.root(t) for t in op.writes()}
    out: set[str] = set()
    for o in g.ops[g.ops.index(op) + 1:]:
        if any(g.root(t) in made for t in o.reads()):
            out.add(o.name)
            made |= {g.root(t) for t in o.writes()}
    return out


def _norm_member(g: Graph, op: Op, x: str) -> Op:
    """The consumer's own RMSNorm as an ``rmsnorm`` op over ``x`` (the consumer's input as it reads
    it: the norm is over its last dim, which a member's output of another shape need not share)
    into a new tensor of ``x``'s shape and the norm's output dtype (its ``norm_dtype``)."""
    info = g.tensors[x]
    out = g.new_tensor(f"{op.name}_normed", info.shape, op.attrs["norm_dtype"])
    return Op(g.fresh_name("rmsnorm"), "rmsnorm", {"x": x, "w": op.inputs["norm_w"]}, {"out": out},
              attrs={"eps": op.attrs["eps"], "w_fp32": op.attrs.get("w_fp32", False)},
              source=op.source, layer=op.layer)
