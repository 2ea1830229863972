"""Dead-code elimination.

Expects: a checked graph. Guarantees: every remaining op has an effect (writes a graph
output, mutates a buffer in place, or feeds such an op); tensors that no op or output
mentions are removed (graph inputs are kept).
"""
from __future__ import annotations

from fusec.ir import Graph


def run(g: Graph) -> Graph:
    live = {g.root(t) for t in g.outputs}
    keep = []
    for op in reversed(g.ops):
        outs = {g.root(t) for t in op.fresh_outputs()}
        if op.mutates or outs & live:
            keep.append(op)
            live |= {g.root(t) for t in op.reads()}
    g.ops = keep[::-1]
    used = set(g.inputs) | set(g.outputs)
    for op in g.ops:
        used |= set(op.reads()) | set(op.writes())
    changed = True
    while changed:
        changed = False
        for t in list(used):
            a = g.tensors[t].alias_of
            if a is not None and a not in used:
                used.add(a)
                changed = True
    g.tensors = {k: v for k, v in g.tensors.items() if k in used}
    return g
