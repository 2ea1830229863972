"""prologue: fold the small vector ops in front of a matvec kind into that kind's tiles.

After ``chain``, a post-norm and its residual add, a scaled residual or an embedding scale run
as one ``chain`` op (or one generic op) on one SM, a dependency level of its own, and the
matvec kind that reads their result waits for it. This pass makes them the consumer's
prologue (:mod:`fusec.instructions.prologue`): every tile of the consumer computes them from
their inputs in its shared memory, and one tile writes what later ops read.

Rule, for each op ``K`` of a kind with ``takes_prologue`` (program order): ``P``, the op that
creates the root of K's ``x`` (K has no prologue yet) or of one of its prologue's external
inputs (the *transitive* case: P's members go in front of the prologue's, and K's staged x stays
the prologue's result), is a ``chain`` or a single generic op, and

* every member of ``P`` may be a prologue member (:func:`fusec.instructions.prologue.can_member`),
  and so may K's own RMSNorm where K has one (it becomes the last member);
* ``x`` has the size and dtype of that root (a reshape of it at most; the transitive case stages
  what it staged);
* no op between ``P`` and ``K`` (program order) reads what ``P`` writes, or writes what ``P``
  reads or writes (``P``'s work moves to K's place); no member reads what K writes (a KV cache
  K updates in place: other tiles of K may have written it); K reads no member's output but ``x`` (its
  other inputs are read from global memory, where only K's writer tile writes them);
* every op outside ``P`` and ``K`` that reads an output of ``P`` reads something ``K`` makes too,
  directly or through other ops (it waits for ``K`` already: folding adds no level to its path),
  or is a *parallel reader* ``R`` (second sweep, below);
* the members' outputs and their external inputs fit
  :data:`fusec.instructions.prologue.MAX_SCRATCH_BYTES` of shared memory (``MAX_SCRATCH_BYTES_BATCH``
  for a batched consumer).

The transitive case takes what the ``chain`` pass leaves apart: an op split into output ranges
(Falcon-7B's residual sum ``x + (attn + mlp)``, 4544 elements) never joins the one-tile
LayerNorm after it, so the LayerNorm alone folded into the next layer's q/k/v and the sum stood
alone, a level of its own; now it folds in front of the LayerNorm. K is tried again after each
fold, until its prologue's inputs have no producer that may fold.

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

In a step of more than one activation row (:meth:`fusec.ir.Graph.rows`: B > 1 sequences or K > 1
query tokens, recorded on the graph when it was built, whatever ``fuse`` made of the attention)
only a batched consumer folds (a ``matvec``, ``rms_qkv_rope`` or ``rms_gate_up_silu`` with
attribute ``batch`` B equal to the step's rows, :func:`fusec.instructions.matvec_rows.seqs`;
docs/batch.md), and only where it stages all B inputs in one group
(:func:`fusec.instructions.matvec_rows.seq_group` == B for the staged x): its prologue then
computes the whole ``[B, K]`` x in shared memory, each member over its rows as its generic form
does (an RMSNorm normalises each sequence's row with that row's own sum of squares; the norm
weight is shared), and the template (``matvec_seqs``, ``rms_qkv_rope_seqs``,
``rms_gate_up_silu_seqs`` with ``STAGED``) skips its own staging. Its scratch is at most
``MAX_SCRATCH_BYTES_BATCH`` less what the kind's own shared memory takes past the staging budget
(a batched ``rms_qkv_rope``'s per-head scratch: :func:`_batch_limit`). A step of K > 1 query
tokens folds the same way into its batched matvecs of B·K rows. A consumer without ``batch``
(the other kinds stay batch-1 only) or a batch staged in several groups (its x would not fit
at once) folds nothing.

Expects: a graph after ``chain`` (or after ``fuse``, with chains off). Guarantees: the same
values; each folded ``P`` is gone and its members are K's ``pre`` (K's outputs ``x`` and
``pre_out*`` are their fresh outputs, ``pre_keep`` those read after K or returned); no
dependency level is added; every other op is untouched.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

from fusec.instructions.base import KINDS
from fusec.instructions.chain import step_name
from fusec.instructions.matvec_rows import STAGE_BYTES, batched, elt, normed, seq_group, seqs
from fusec.instructions.prologue import MAX_SCRATCH_BYTES, MAX_SCRATCH_BYTES_BATCH, can_member, externals, has, scratch_bytes
from fusec.ir import Graph, Op

log = logging.getLogger("fusec.passes.prologue")


def run(g: Graph) -> Graph:
    folded = 0
    for parallel in (False, True):
        k = 0
        while k < len(g.ops):
            op = g.ops[k]
            if _consumer(op, g) and any(_fold(g, op, t, parallel) for t in _staged(op)):
                folded += 1
                k = g.ops.index(op)
                continue   # again: the producer of what the grown prologue reads may fold too
            k += 1
    if folded:
        log.info("prologue: %d ops folded into the matvec kinds that read them", folded)
    return g


def _consumer(op: Op, g: Graph) -> bool:
    """Whether ``op`` may take a prologue: a kind with ``takes_prologue``; in a step of more than
    one row only one that computes all of them (a batched matvec, module docstring)."""
    cls = KINDS.get(op.kind)
    if g.rows() > 1 and seqs(op) != g.rows():
        return False
    return cls is not None and getattr(cls, "takes_prologue", False) and ("x" in op.inputs or "pre" in op.attrs)


def _staged(op: Op) -> list[str]:
    """What ``op`` stages whose producer may fold: its ``x``, or with a prologue already the
    prologue's external inputs (``pre_in*``, the transitive case)."""
    return externals(op) if has(op) else [op.inputs["x"]]


def _fold(g: Graph, op: Op, x: str, parallel: bool = False) -> bool:
    """Fold the producer of ``x`` (``op``'s x, or an external input of its prologue) into ``op``
    (module docstring); ``parallel``: also into the parallel readers. False (nothing changed)
    where a condition fails."""
    root = g.root(x)
    p = g.producers().get(root)
    if p is None or p is op:
        return False
    p_members = list(p.attrs["ops"]) if p.kind == "chain" else [p]
    final = g.tensors[root]
    transitive = has(op)
    if not all(can_member(m, g) for m in p_members) or not _movable(g, p, op) or (not transitive and (
            final.numel != g.tensors[x].numel or final.dtype != g.tensors[x].dtype)):
        return False
    attrs = dict(op.attrs)
    if transitive:   # P's members go in front of the prologue's; the staged x stays its result
        inputs = {s: t for s, t in op.inputs.items() if not s.startswith("pre_in")}
        norm = None
        members = p_members + list(op.attrs["pre"])
        x_root = g.root(op.outputs["x"])
    else:
        inputs = {s: t for s, t in op.inputs.items() if s != "x"}
        norm = _own_norm(g, op, x, inputs, attrs)   # over x as K reads it: its last dim is the norm's
        members = p_members + ([norm] if norm else [])
        x_root = norm.outputs["out"] if norm else root
    io = _prologue_io(g, op, members, x_root, inputs)
    # read after the fold by an op other than P, or returned: the writer tile keeps them
    users = g.users()
    inner = {p.name, op.name}
    graph_out = {g.root(t) for t in g.outputs}
    keep = [t for t in (io[2] if io else []) if t in graph_out or any(u.name not in inner for u in users.get(t, []))]
    # a kept output's other readers must wait for K already (they read what K makes, directly
    # or not): one that did not (a parallel block's MLP reading the LayerNorm that K's q/k/v
    # read too) would now wait for all of K, a level later than before, unless it is a parallel
    # reader that computes its own copy
    after = _downstream(g, op) if io else set()
    others = list({u.name: u for t in keep for u in users.get(t, []) if u.name not in inner and u.name not in after}
                  .values())
    replicas = [_replica(g, p, p_members, r) for r in others] if io and parallel else []
    if io is None or (others and (not parallel or None in replicas)):
        _drop(g, [norm.outputs["out"]] if norm else [])
        for plan in replicas:
            if plan is not None:
                _drop(g, plan.new)
        return False
    if others:   # what only the parallel readers read: they compute it themselves now
        names = inner | {r.name for r in others}
        keep = [t for t in keep if t in graph_out or any(u.name not in names for u in users.get(t, []))]
        for plan in replicas:
            plan.r.inputs, plan.r.outputs, plan.r.attrs = plan.inputs, plan.outputs, plan.attrs
    attrs.update(pre=members, pre_keep=keep, pre_steps=" > ".join(step_name(m) for m in members))
    op.inputs, op.outputs, op.attrs = io[0], io[1], attrs
    g.ops = [o for o in g.ops if o is not p]
    return True


def _own_norm(g: Graph, op: Op, x: str, inputs: dict[str, str], attrs: dict) -> Op | None:
    """The consumer's own RMSNorm over ``x`` as a new last member (``inputs`` and ``attrs`` made
    those of the kind without it), or None where the consumer norms nothing."""
    if "norm_w" not in op.inputs or not normed(op):
        return None
    norm = _norm_member(g, op, x)
    del inputs["norm_w"]
    attrs.pop("eps", None)
    attrs.update(norm=False, w_fp32=False)
    return norm


def _prologue_io(g: Graph, op: Op, pre: list[Op], x_root: str,
                 inputs: dict[str, str]) -> tuple[dict[str, str], dict[str, str], list[str]] | None:
    """(``op``'s inputs, its outputs and the members' fresh outputs) with the prologue ``pre``
    whose last result is its staged ``x_root``; ``inputs``: its other inputs. None where the
    prologue may not be: a member without a CUDA form, more shared memory than
    :data:`MAX_SCRATCH_BYTES`, a member reading what a later one writes, an input of ``op``
    that a member makes (only the writer tile writes it), or one that ``op`` updates in place
    (other tiles of ``op`` may have written it)."""
    ext, outs, written = _io(g, pre)
    writes = {g.root(w) for w in op.writes()}
    if batched(op) and seq_group(seqs(op), g.tensors[x_root].numel // seqs(op), elt(g, x_root)) != seqs(op):
        return None   # the batch's inputs are staged in several groups: not all at once in shared memory
    limit = _batch_limit(g, op) if batched(op) else MAX_SCRATCH_BYTES
    if not all(can_member(m, g) for m in pre) or scratch_bytes(g, pre, ext, x_root) > limit \
            or any(g.root(t) in written for t in ext) or any(g.root(t) in written for t in inputs.values()) \
            or any(g.root(t) in writes for t in ext):
        return None
    new_inputs = {**inputs, **{f"pre_in{i}": t for i, t in enumerate(ext)}}
    new_outputs = {s: t for s, t in op.outputs.items() if not s.startswith("pre_out") and s != "x"}
    new_outputs["x"] = x_root
    for i, t in enumerate(t for t in outs if g.root(t) != x_root):
        new_outputs[f"pre_out{i}"] = t
    return new_inputs, new_outputs, outs


def _batch_limit(g: Graph, op: Op) -> int:
    """A batched consumer's prologue scratch at most (bytes): :data:`MAX_SCRATCH_BYTES_BATCH`,
    less what the kind's own shared memory takes beyond the staging budget
    (:data:`fusec.instructions.matvec_rows.STAGE_BYTES`: a batched ``rms_qkv_rope``'s heads after
    its staged rows), so that the two stay within what a matvec's staged x and scratch take."""
    own = 4 * KINDS[op.kind].own_smem(op, g)
    return MAX_SCRATCH_BYTES_BATCH - max(0, own - STAGE_BYTES)


def _drop(g: Graph, tensors: list[str]) -> None:
    """Forget tensors a plan made and did not use."""
    for t in tensors:
        g.tensors.pop(t, None)


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


class _Replica(NamedTuple):
    """A parallel reader ``r``'s new inputs, outputs and attributes with a copy of ``P``'s
    members heading its prologue; ``new``: the tensors the copy made (dropped if not installed)."""
    r: Op
    new: list[str]
    inputs: dict[str, str]
    outputs: dict[str, str]
    attrs: dict


def _replica(g: Graph, p: Op, members: list[Op], r: Op) -> _Replica | None:
    """The plan that makes ``P``'s ``members`` the front of parallel reader ``r``'s prologue
    (module docstring), or None where ``r`` cannot take them."""
    if not _consumer(r, g) or not _movable(g, p, r, reads=False):
        return None
    made = {g.root(t) for m in members for t in m.fresh_outputs()}
    slots = [s for s, t in r.inputs.items() if g.root(t) in made]
    has_pre = "pre" in r.attrs
    if not slots or any(not (s.startswith("pre_in") if has_pre else s == "x") for s in slots):
        return None
    if not has_pre:
        xt = r.inputs["x"]
        if g.tensors[xt].numel != g.tensors[g.root(xt)].numel or g.tensors[xt].dtype != g.tensors[g.root(xt)].dtype:
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
    attrs = dict(r.attrs)
    inputs = {s: t for s, t in r.inputs.items() if not s.startswith("pre_in") and s != "x"}
    if has_pre:   # r's own members, reading the copy's tensors
        tail = [Op(m.name, m.kind, {s: mapped(t) for s, t in m.inputs.items()}, dict(m.outputs), m.attrs,
                   m.mutates, m.source, m.layer) for m in r.attrs["pre"]]
        x_root = g.root(r.outputs["x"])
    else:
        norm = _own_norm(g, r, mapped(r.inputs["x"]), inputs, attrs)
        tail, x_root = ([norm], norm.outputs["out"]) if norm else ([], g.root(mapped(r.inputs["x"])))
        if norm:
            new.append(x_root)
    # only what r uses: a copy member none of whose outputs r reads (the q/k/v's own LayerNorm in
    # GPT-NeoX's copy for the MLP) is left out, and so are its tensors
    needed = {x_root} | {g.root(t) for m in tail for t in m.reads()}
    for m in reversed(copies[:]):
        if any(g.root(t) in needed for t in m.fresh_outputs()):
            needed |= {g.root(t) for t in m.reads()}
        else:
            copies.remove(m)
    used: set[str] = set()
    for t in {t for m in copies + tail for t in m.reads() + m.writes()} | {x_root}:
        while t is not None and t not in used:   # a tensor and what it is a view of
            used.add(t)
            t = g.tensors[t].alias_of
    _drop(g, [t for t in new if t not in used])
    new = [t for t in new if t in used]
    io = _prologue_io(g, r, copies + tail, x_root, inputs)
    if io is None:
        _drop(g, new)
        return None
    attrs.update(pre=copies + tail, pre_keep=list(r.attrs.get("pre_keep", [])),
                 pre_steps=" > ".join(step_name(m) for m in copies + tail))
    return _Replica(r, new, io[0], io[1], attrs)


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
