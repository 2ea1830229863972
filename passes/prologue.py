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
  directly or through other ops (it waits for ``K`` already: folding adds no level to its path),
  or is a *parallel reader* ``R`` (second sweep, below);
* the members' outputs and their external inputs fit
  :data:`fusec.instructions.prologue.MAX_SCRATCH_BYTES` of shared memory.

Parallel readers (a second sweep over the ops the first left): a parallel block's q/k/v and MLP
both read one normed vector (Cohere, Falcon), or its MLP's own LayerNorm reads the residual sum
that the q/k/v's LayerNorm reads too (GPT-NeoX). Folded into ``K`` alone, ``R`` would wait for all
of ``K``. Where every such ``R`` is itself a consumer kind that reads ``P``'s outputs only as its
``x`` (no prologue yet) or through its prologue's inputs, ``P`` folds into ``K`` (whose writer
tile writes what later ops read) and a copy of its members, on tensors of their own, becomes the
front of each ``R``'s prologue (its tiles compute them too and write nothing of them; a member
whose outputs ``R`` does not use is left out of the copy). The same
conditions hold between ``P`` and each ``R`` as between ``P`` and ``K``; what is read after both
stays written by ``K``, so every other reader must still wait for ``K``.

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
    for parallel in (False, True):
        k = 0
        while k < len(g.ops):
            op = g.ops[k]
            if _consumer(op) and "pre" not in op.attrs and _fold(g, op, parallel):
                folded += 1
                k = g.ops.index(op)
            k += 1
    if folded:
        log.info("prologue: %d ops folded into the matvec kinds that read them", folded)
    return g


def _consumer(op: Op) -> bool:
    cls = KINDS.get(op.kind)
    return cls is not None and getattr(cls, "takes_prologue", False) and ("x" in op.inputs or "pre" in op.attrs)


def _fold(g: Graph, op: Op, parallel: bool = False) -> bool:
    """Fold the producer of ``op``'s x into ``op`` (module docstring); ``parallel``: also into
    the parallel readers. False (nothing changed) where a condition fails."""
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
    if not _movable(g, p, op):
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
    ext, outs, written = _io(g, members)
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
    others = list({u.name: u for t in keep for u in users.get(t, []) if u.name not in inner and u.name not in after}
                  .values())
    replicas = [_replica(g, p, members[:len(members) - (norm is not None)], r) for r in others] \
        if parallel else [None]
    if others and (not parallel or any(r is None for r in replicas)):
        if norm is not None:
            g.tensors.pop(norm.outputs["out"], None)
        for plan in replicas:
            if plan is not None:
                plan.discard(g)
        return False
    if others:   # what only the parallel readers read: they compute it themselves now
        names = {r.name for r in others}
        keep = [t for t in keep if t in graph_out or any(u.name not in inner | names for u in users.get(t, []))]
        for plan in replicas:
            plan.install(g)
    new_inputs = {**inputs, **{f"pre_in{i}": t for i, t in enumerate(ext)}}
    new_outputs = dict(op.outputs)
    new_outputs["x"] = root
    for i, t in enumerate(t for t in outs if t != root):
        new_outputs[f"pre_out{i}"] = t
    attrs.update(pre=members, pre_keep=keep,
                 pre_steps=" > ".join(_step_name(m) for m in members))
    op.inputs, op.outputs, op.attrs = new_inputs, new_outputs, attrs
    g.ops = [o for o in g.ops if o is not p]
    return True


def _movable(g: Graph, p: Op, consumer: Op, reads: bool = True) -> bool:
    """Whether ``p``'s work may run at ``consumer``'s place: no op between them (program order)
    reads what ``p`` writes (with ``reads``; a parallel reader's copy writes tensors of its own,
    and the other readers of ``p``'s outputs wait for the writer), or writes what ``p`` reads or
    writes."""
    at_p, at_k = g.ops.index(p), g.ops.index(consumer)
    p_reads = {g.root(t) for t in p.reads()}
    p_writes = {g.root(t) for t in p.writes()}
    for between in g.ops[at_p + 1:at_k]:
        if reads and {g.root(t) for t in between.reads()} & p_writes:
            return False
        if {g.root(t) for t in between.writes()} & (p_reads | p_writes):
            return False
    return True


class _Replica:
    """A copy of ``P``'s members for a parallel reader ``r``, on tensors of their own, planned
    (tensors made) but not installed: :meth:`install` makes them the front of ``r``'s prologue,
    :meth:`discard` drops the tensors."""

    def __init__(self, r: Op, members: list[Op], new: list[str], inputs: dict[str, str],
                 outputs: dict[str, str], attrs: dict):
        self.r, self.members, self.new = r, members, new
        self.inputs, self.outputs, self.attrs = inputs, outputs, attrs

    def install(self, g: Graph) -> None:
        self.r.inputs, self.r.outputs, self.r.attrs = self.inputs, self.outputs, self.attrs

    def discard(self, g: Graph) -> None:
        for t in self.new:
            g.tensors.pop(t, None)


def _replica(g: Graph, p: Op, members: list[Op], r: Op) -> _Replica | None:
    """The plan that makes ``P``'s ``members`` the front of parallel reader ``r``'s prologue
    (module docstring), or None where ``r`` cannot take them."""
    if not _consumer(r) or not _movable(g, p, r, reads=False):
        return None
    made = {g.root(t) for m in members for t in m.fresh_outputs()}
    slots = [s for s, t in r.inputs.items() if g.root(t) in made]
    has_pre = "pre" in r.attrs
    if not slots or any(not (s.startswith("pre_in") if has_pre else s == "x") for s in slots):
        return None
    new: list[str] = []
    names: dict[str, str] = {}

    def mapped(t: str) -> str:
        """``t`` on the copy's tensors (a member output, or a view of one, gets a new tensor)."""
        if g.root(t) not in made:
            return t
        if t not in names:
            info = g.tensors[t]
            base = None if info.alias_of is None else mapped(info.alias_of)
            names[t] = g.new_tensor(f"{r.name}_{t}", info.shape, info.dtype,
                                    **({} if base is None else {"alias_of": base, "offset": info.offset}))
            new.append(names[t])
        return names[t]
    copies = [Op(g.fresh_name(f"{r.name}_{m.name}"), m.kind, {s: mapped(t) for s, t in m.inputs.items()},
                 {s: mapped(t) for s, t in m.outputs.items()}, dict(m.attrs), m.mutates, m.source, r.layer)
              for m in members]
    plan = _Replica(r, [], new, {}, {}, {})
    attrs = dict(r.attrs)
    inputs = {s: t for s, t in r.inputs.items() if not s.startswith("pre_in") and s != "x"}
    if has_pre:
        tail = [Op(m.name, m.kind, {s: mapped(t) for s, t in m.inputs.items()}, dict(m.outputs), m.attrs,
                   m.mutates, m.source, m.layer) for m in r.attrs["pre"]]
        x_root = g.root(r.outputs["x"])
    else:
        xt = r.inputs["x"]
        if g.tensors[xt].numel != g.tensors[g.root(xt)].numel or g.tensors[xt].dtype != g.tensors[g.root(xt)].dtype:
            plan.discard(g)
            return None
        tail, x_root = [], g.root(mapped(xt))
        if "norm_w" in r.inputs and attrs.get("norm", True):
            norm = _norm_member(g, r, mapped(xt))
            new.append(norm.outputs["out"])
            tail, x_root = [norm], norm.outputs["out"]
            inputs.pop("norm_w")
            attrs.pop("eps", None)
            attrs.update(norm=False, w_fp32=False)
    # only what r uses: a copy member none of whose outputs r reads (the q/k/v's own LayerNorm in
    # GPT-NeoX's copy for the MLP) is left out
    needed = {x_root} | {g.root(t) for m in tail for t in m.reads()}
    kept_copies: list[Op] = []
    for m in reversed(copies):
        if any(g.root(t) in needed for t in m.fresh_outputs()):
            kept_copies.insert(0, m)
            needed |= {g.root(t) for t in m.reads()}
    used: set[str] = set()
    for t in {t for m in kept_copies + tail for t in m.reads() + m.writes()} | {x_root}:
        while t is not None and t not in used:   # a tensor and what it is a view of
            used.add(t)
            t = g.tensors[t].alias_of
    for t in [t for t in new if t not in used]:
        new.remove(t)
        g.tensors.pop(t, None)
    pre = kept_copies + tail
    copies = kept_copies
    ext, outs, written = _io(g, pre)
    r_writes = {g.root(w) for w in r.writes()}
    if not all(can_member(m, g) for m in copies) or scratch_bytes(g, pre, ext, x_root) > MAX_SCRATCH_BYTES \
            or any(g.root(t) in written for t in ext) or any(g.root(t) in written for t in inputs.values()) \
            or any(g.root(t) in r_writes for t in ext):
        plan.discard(g)
        return None
    plan.inputs = {**inputs, **{f"pre_in{i}": t for i, t in enumerate(ext)}}
    plan.outputs = {s: t for s, t in r.outputs.items() if not s.startswith("pre_out") and s != "x"}
    plan.outputs["x"] = x_root
    for i, t in enumerate(t for t in outs if g.root(t) != x_root):
        plan.outputs[f"pre_out{i}"] = t
    attrs.update(pre=pre, pre_keep=list(r.attrs.get("pre_keep", [])),
                 pre_steps=" > ".join(_step_name(m) for m in pre))
    plan.attrs = attrs
    return plan


def _io(g: Graph, members: list[Op]) -> tuple[list[str], list[str], set[str]]:
    """(what the members read from outside, in order; their fresh outputs, in order; the roots
    of those outputs)."""
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
    return ext, outs, written


def _step_name(m: Op) -> str:
    return m.kind.split(".")[1] if m.kind.count(".") >= 2 else m.kind


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
