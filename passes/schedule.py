"""schedule: place tiles on SMs and derive the counter waits.

Expects: a fused graph and its tiles (``passes.tile``). Guarantees:

* every tile is one :class:`fusec.schedule.Instr` on one SM; each SM's queue is in program
  order of the ops, so every queue is a linear extension of the DAG and the schedule cannot
  deadlock (the earliest unfinished instruction is always at the head of its queue with its
  producers done);
* placement is greedy by bytes (cost model: a tile costs the bytes it moves), each tile to the
  SM with the fewest bytes so far in the current layer, which balances every layer;
* an instruction waits for exactly the earlier instructions on *other* SMs whose regions
  conflict with its own: written regions it reads (RAW), and regions it overwrites that an
  earlier instruction read or wrote (WAR, WAW). Same-SM order needs no counter.
"""
from __future__ import annotations

import heapq

from fusec.instructions.base import Region, Tile
from fusec.ir import Graph
from fusec.schedule import Instr, Schedule

_LAYER_START = "rms_qkv_rope"


def assign_layers(g: Graph) -> None:
    """Set ``op.layer``: a decoder layer starts at each QKV op (or attention op when nothing
    fused); the ops after the last layer's final norm (``rms_lm_head``) form one more segment;
    ops before the first layer are segment -1."""
    kinds = {o.kind for o in g.ops}
    starts = {_LAYER_START} if _LAYER_START in kinds else {"attention", "attention_partial",
                                                           "fusec.sdpa.default"}
    layer = -1
    for op in g.ops:
        if op.kind in starts or (op.kind == "rms_lm_head" and layer >= 0):
            layer += 1
        op.layer = layer


def run(g: Graph, tiles: dict[str, list[Tile]], num_sms: int) -> Schedule:
    assign_layers(g)
    instrs: list[Instr] = []
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    load = [(0, sm) for sm in range(num_sms)]
    cur_layer = None
    for op in g.ops:
        if op.layer != cur_layer:
            cur_layer = op.layer
            load = [(0, sm) for sm in range(num_sms)]
        heap = list(load)
        heapq.heapify(heap)
        for t in sorted(tiles[op.name], key=lambda t: -t.bytes):
            b, sm = heapq.heappop(heap)
            heapq.heappush(heap, (b + t.bytes, sm))
            instrs.append(Instr(len(instrs), op.name, op.kind, t, sm, op.layer))
        load = heap
    # queues in program order (instrs are already in op order)
    for i in instrs:
        queues[i.sm].append(i.id)
    _waits(instrs)
    return Schedule(num_sms, instrs, queues, g)


def _waits(instrs: list[Instr]) -> None:
    reads: dict[str, list[tuple[Region, Instr]]] = {}
    writes: dict[str, list[tuple[Region, Instr]]] = {}
    start = 0
    while start < len(instrs):
        end = start
        while end < len(instrs) and instrs[end].op == instrs[start].op:
            end += 1
        group = instrs[start:end]
        for ins in group:
            need: set[int] = set()
            for r in ins.tile.reads:
                need |= {w.id for wr, w in writes.get(r.tensor, ()) if wr.overlaps(r)}
            for r in ins.tile.writes:
                need |= {w.id for wr, w in writes.get(r.tensor, ()) if wr.overlaps(r)}
                need |= {x.id for rr, x in reads.get(r.tensor, ()) if rr.overlaps(r)}
            ins.waits = sorted(p for p in need if instrs[p].sm != ins.sm)
        # a write of this op supersedes older (earlier-op) accesses it covers completely:
        # the writer waited on them, so later accesses ordered after it are ordered after them
        for ins in group:
            for r in ins.tile.writes:
                reads[r.tensor] = [(rr, x) for rr, x in reads.get(r.tensor, ())
                                   if not (r.start <= rr.start and rr.stop <= r.stop)]
                writes[r.tensor] = [(wr, w) for wr, w in writes.get(r.tensor, ())
                                    if not (r.start <= wr.start and wr.stop <= r.stop)]
        for ins in group:
            for r in ins.tile.reads:
                reads.setdefault(r.tensor, []).append((r, ins))
            for r in ins.tile.writes:
                writes.setdefault(r.tensor, []).append((r, ins))
        start = end
