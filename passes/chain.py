"""chain: run small dependent standalone ops as one instruction (a ``chain``), one level deep.

After ``fuse``, what no fused kind took runs as one instruction per op, and each op whose input
comes from the op before it is a dependency level of its own: OLMo-2's q/k RMSNorm -> RoPE ->
cast -> KV write is four levels, its post-norm -> residual add two, each level paying the fixed
cost of a counter release, a poll and a prologue for a few KB of work. This pass merges such
ops into :class:`fusec.instructions.chain.Chain` ops, which one CTA runs member after member.

Rule (one pass over the ops in program order): an op that may join a chain
(:func:`fusec.instructions.chain.can_join`) joins the group of its deepest dependency when

* that group is a chain candidate (every member may join) and is the ONLY dependency at that
  depth: every other dependency is strictly shallower, so it is done before the group can
  start and joining delays neither the group's start nor anything that reads the group's
  outputs beyond the new member's own work (depth: the longest path of RAW, WAR and WAW
  dependencies, counting one per group);
* no op between the group's last member and the op (program order) reads what the group
  writes or writes what the group reads or writes: the group moves to the op's place;
* the chain stays within :data:`fusec.instructions.chain.CHAIN_MAX_BYTES`.

Ranged chains: ops split into output ranges (:func:`fusec.instructions.chain.range_class`: an
elementwise op of n output elements) group by the same rule among themselves, never with the
one-tile ops: an op joins a group of the same n that it reads only at the element it writes
(every input the group wrote has n elements, its root too: the same range), with no byte bound
(each tile moves its range's share, as the ops did). Where its deepest dependencies are several
such groups of the same n, they merge into one with the op when every group but the one whose
last member is latest is read by nothing but the op (Phi-2's ``0.5 * x`` beside the ``pow >
... > tanh > add`` run, both read by the final multiplication): they move to the op's place,
and no reader waits longer. The chain keeps the ops' ranges: the levels go, the tiles stay.

Expects: a fused graph (after ``fuse``). Guarantees: the same values; every group of two or more
ops is one ``chain`` op at the place of its last member, its members in program order in
``attrs["ops"]``, its inputs what they read from outside the chain, its outputs everything they
write (in-place updates stay in-place); no dependency level is added; other ops are untouched.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

from fusec.instructions.chain import CHAIN_MAX_BYTES, Chain, can_join, member_bytes, range_class, step_name
from fusec.ir import Graph, Op

log = logging.getLogger("fusec.passes.chain")

#: how far back (ops in program order) a group's last member may be from a joining op
MAX_GAP = 64


class _Join(NamedTuple):
    """How an op may join a chain: as a one-tile member (``one_tile``), as a ranged member of
    ``ranged`` > 0 output elements, or not at all (neither). Groups join only their own class:
    equal ``_Join``s."""
    one_tile: bool = False
    ranged: int = 0

    @property
    def ok(self) -> bool:
        return self.one_tile or self.ranged > 0


class _Group:
    def __init__(self, first: int, depth: int, join: _Join, nbytes: int):
        self.members = [first]
        self.depth = depth
        self.join = join                # its members' class (one-tile, ranged of n, or none)
        self.nbytes = nbytes
        self.reads: set[str] = set()    # roots the group reads / writes
        self.writes: set[str] = set()


def run(g: Graph) -> Graph:
    ops = g.ops
    group_of: list[_Group] = []
    last_write: dict[str, _Group] = {}          # root -> the group that wrote it last
    readers: dict[str, list[_Group]] = {}       # root -> groups that read it since that write
    read_by: dict[str, set[int]] = {}           # root -> every op that reads it (program order)
    for k, op in enumerate(ops):
        for t in op.reads():
            read_by.setdefault(g.root(t), set()).add(k)
    outs = {g.root(t) for t in g.outputs}
    for i, op in enumerate(ops):
        reads = {g.root(t) for t in op.reads()}
        writes = {g.root(t) for t in op.writes()}
        deps: dict[int, _Group] = {}
        for r in reads | writes:
            w = last_write.get(r)
            if w is not None:
                deps[id(w)] = w
        for r in writes:
            for x in readers.get(r, ()):
                deps[id(x)] = x
        join = _joinable(op, g)
        nbytes = member_bytes(op, g) if join.one_tile else 0
        found = _target(ops, i, op, g, list(deps.values()), join, nbytes) if join.ok else None
        if found is not None and len(found) > 1 and not _only_read_by(found[1:], i, read_by, outs):
            found = None
        if found is None:
            target = _Group(i, 1 + max((d.depth for d in deps.values()), default=0), join, nbytes)
        else:
            target = found[0]
            for other in found[1:]:   # a ranged group merged in: its members now run in target
                _absorb(target, other, group_of, last_write, readers)
            target.members.append(i)
            target.nbytes += nbytes
        target.reads |= reads
        target.writes |= writes
        group_of.append(target)
        for r in reads:
            readers.setdefault(r, []).append(target)
        for r in writes:
            last_write[r] = target
            readers[r] = []
    chains = {id(gr): gr for gr in group_of if len(gr.members) > 1}
    if not chains:
        return g
    new_ops: list[Op] = []
    for i, op in enumerate(ops):
        gr = group_of[i]
        if len(gr.members) == 1:
            new_ops.append(op)
        elif i == gr.members[-1]:
            new_ops.append(_chain_op(g, [ops[k] for k in gr.members]))
    g.ops = new_ops
    log.info("chain: %d chains of %d ops", len(chains), sum(len(c.members) for c in chains.values()))
    return g


def _target(ops: list[Op], i: int, op: Op, g: Graph, deps: list[_Group], join: _Join,
            nbytes: int) -> list[_Group] | None:
    """The group ``op`` (which may join: ``join.ok``) joins, then the ranged groups merged into
    it (their readers unchecked: :func:`_only_read_by`), or None (module docstring, "Rule")."""
    if not deps:
        return None
    deepest = max(d.depth for d in deps)
    top = [d for d in deps if d.depth == deepest]
    if len(top) != 1 and (join.one_tile or any(d.join != join for d in top)):
        return None
    top.sort(key=lambda d: d.members[-1], reverse=True)   # the group of the latest member first
    if sum(d.nbytes for d in top) + nbytes > CHAIN_MAX_BYTES:
        return None
    for gr in top:
        last = gr.members[-1]
        if gr.join != join or i - last > MAX_GAP:
            return None
        if join.ranged:   # ranged: what the group wrote is read at the element written
            n = join.ranged
            if any(g.root(t) in gr.writes and (g.tensors[t].numel != n or g.tensors[g.root(t)].numel != n)
                   for t in op.reads()):
                return None
        for between in ops[last + 1:i]:
            b_reads = {g.root(t) for t in between.reads()}
            b_writes = {g.root(t) for t in between.writes()}
            if b_reads & gr.writes or b_writes & (gr.reads | gr.writes):
                return None
    return top


def _only_read_by(groups: list[_Group], i: int, read_by: dict[str, set[int]], outs: set[str]) -> bool:
    """Whether what ``groups`` write is read only by their own members and op ``i``, and is no
    graph output: merged into op ``i``'s chain, no other reader waits longer."""
    for gr in groups:
        own = set(gr.members) | {i}
        if any(r in outs or read_by.get(r, set()) - own for r in gr.writes):
            return False
    return True


def _absorb(target: _Group, other: _Group, group_of: list[_Group], last_write: dict[str, _Group],
            readers: dict[str, list[_Group]]) -> None:
    """Merge ``other`` into ``target`` (members in program order) and point every record of
    ``other`` at ``target``."""
    target.members = sorted(target.members + other.members)
    target.nbytes += other.nbytes
    target.reads |= other.reads
    target.writes |= other.writes
    for k in other.members:
        group_of[k] = target
    for r, w in last_write.items():
        if w is other:
            last_write[r] = target
    for r, xs in readers.items():
        readers[r] = [target if x is other else x for x in xs]


def _joinable(op: Op, g: Graph) -> _Join:
    """How ``op`` may join a chain: a one-tile member, a ranged member of n elements, or not."""
    if can_join(op, g):
        return _Join(one_tile=True)
    return _Join(ranged=range_class(op, g) or 0)


def _chain_op(g: Graph, members: list[Op]) -> Op:
    """One ``chain`` op running ``members`` (program order)."""
    written: set[str] = set()
    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}
    mutates: list[str] = []
    for k, m in enumerate(members):
        for t in m.reads():
            if g.root(t) not in written and t not in inputs.values():
                inputs[f"in{len(inputs)}"] = t
        for slot, t in m.outputs.items():
            outputs[f"m{k}_{slot}"] = t
            if slot in m.mutates:
                mutates.append(f"m{k}_{slot}")
            written.add(g.root(t))
    steps = " > ".join(step_name(m) for m in members)
    attrs = {"ops": members, "steps": steps}
    n = range_class(members[0], g)
    if n is not None:   # a ranged chain (every member ranged alike: the pass groups no others)
        attrs["ranged"] = n
    return Op(g.fresh_name(Chain.name), Chain.name, inputs, outputs,
              attrs=attrs, mutates=tuple(mutates), source=members[0].source)
