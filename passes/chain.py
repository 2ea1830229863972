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

Expects: a fused graph (after ``fuse``). Guarantees: the same values; every group of two or more
ops is one ``chain`` op at the place of its last member, its members in program order in
``attrs["ops"]``, its inputs what they read from outside the chain, its outputs everything they
write (in-place updates stay in-place); no dependency level is added; other ops are untouched.
"""
from __future__ import annotations

import logging

from fusec.instructions.chain import CHAIN_MAX_BYTES, Chain, can_join, member_bytes
from fusec.ir import Graph, Op

log = logging.getLogger("fusec.passes.chain")

#: how far back (ops in program order) a group's last member may be from a joining op
MAX_GAP = 64


class _Group:
    def __init__(self, first: int, depth: int, joinable: bool, nbytes: int):
        self.members = [first]
        self.depth = depth
        self.joinable = joinable
        self.nbytes = nbytes
        self.reads: set[str] = set()    # roots the group reads / writes
        self.writes: set[str] = set()


def run(g: Graph) -> Graph:
    ops = g.ops
    group_of: list[_Group] = []
    last_write: dict[str, _Group] = {}          # root -> the group that wrote it last
    readers: dict[str, list[_Group]] = {}       # root -> groups that read it since that write
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
        joinable = can_join(op, g)
        nbytes = member_bytes(op, g) if joinable else 0
        target = _target(ops, i, op, g, list(deps.values()), reads, writes, nbytes) if joinable else None
        if target is None:
            target = _Group(i, 1 + max((d.depth for d in deps.values()), default=0), joinable, nbytes)
        else:
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


def _target(ops: list[Op], i: int, op: Op, g: Graph, deps: list[_Group], reads: set[str],
            writes: set[str], nbytes: int) -> _Group | None:
    """The group ``op`` joins, or None (module docstring, "Rule")."""
    if not deps:
        return None
    deepest = max(d.depth for d in deps)
    top = [d for d in deps if d.depth == deepest]
    if len(top) != 1:
        return None
    gr = top[0]
    last = gr.members[-1]
    if not gr.joinable or i - last > MAX_GAP or gr.nbytes + nbytes > CHAIN_MAX_BYTES:
        return None
    for between in ops[last + 1:i]:
        b_reads = {g.root(t) for t in between.reads()}
        b_writes = {g.root(t) for t in between.writes()}
        if b_reads & gr.writes or b_writes & (gr.reads | gr.writes):
            return None
    return gr


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
    steps = " > ".join(m.kind.split(".")[1] if m.kind.count(".") >= 2 else m.kind for m in members)
    return Op(g.fresh_name(Chain.name), Chain.name, inputs, outputs,
              attrs={"ops": members, "steps": steps}, mutates=tuple(mutates), source=members[0].source)
