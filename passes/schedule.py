"""schedule: place tiles on SMs and derive the counter waits.

Expects: a fused graph and its tiles (``passes.tile``). Guarantees:

* every tile is one :class:`fusec.ir.schedule.Instr` on one SM; each SM's queue is in program
  order of the ops, so every queue is a linear extension of the DAG and the schedule cannot
  deadlock (the earliest unfinished instruction is always at the head of its queue with its
  producers done);
* placement is list scheduling on a simulated clock: tiles are taken in program order
  (within an op, largest first) and each goes to the SM that becomes free earliest. A tile
  starts at ``max(SM free, latest producer finish)`` and lasts ``INSTR_OVERHEAD_US + bytes /
  SM_BYTES_PER_US`` (cost model measured on the H200, docs/performance.md). So small tiles
  that wait on a whole level (split-KV reduce) spread over SMs instead of queueing behind
  each other. It balances predicted finish times, not bytes: a layer's bytes per SM stay
  close to even but not exact (the 1B test bounds the max/mean at 1.10);
* an instruction waits for every tile, on *other* SMs, of each earlier op that has a tile whose
  regions conflict with its own: written regions it reads (RAW), and regions it overwrites
  that an earlier tile read or wrote (WAR, WAW). Same-SM order needs no counter. Waits are
  per producer op because the kernel counts per op (:meth:`Schedule.counter_waits`): a
  consumer needs one counter per dependency, not one per producer tile.
"""
from __future__ import annotations

import heapq

from fusec.instructions.base import Region, Tile
from fusec.ir import Graph
from fusec.ir.schedule import Instr, Schedule, TileIndex

_LAYER_START = "rms_qkv_rope"

# Cost model of one instruction on one SM (H200 timeline, Llama-3.2-1B step at position 2047):
# ~2 us of fixed cost (counter waits, the template's prologue, the load pipeline's ramp) plus
# the bytes it moves at the SM's share of the read bandwidth (4.2 TB/s / 132 SMs).
INSTR_OVERHEAD_US = 2.0
SM_BYTES_PER_US = 32e3


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


def tile_cost_us(t: Tile) -> float:
    """Predicted time of tile ``t`` on one SM in microseconds (the placement cost model)."""
    return INSTR_OVERHEAD_US + t.bytes / SM_BYTES_PER_US


def run(g: Graph, tiles: dict[str, list[Tile]], num_sms: int) -> Schedule:
    assign_layers(g)
    instrs: list[Instr] = []
    op_tiles: dict[str, list[int]] = {}                  # op -> its instruction ids (contiguous)
    for op in g.ops:
        for t in sorted(tiles[op.name], key=lambda t: -t.bytes):
            op_tiles.setdefault(op.name, []).append(len(instrs))
            instrs.append(Instr(len(instrs), op.name, op.kind, t, -1, op.layer))
    producers = _producer_ops(instrs)
    free = [(0.0, sm) for sm in range(num_sms)]          # heap of (time the SM is free, SM)
    done: dict[str, float] = {}                          # op -> latest finish of its tiles so far
    for ins, ops in zip(instrs, producers):
        t_free, ins.sm = heapq.heappop(free)
        # every tile of a producer op is placed before its consumers (program order), so the
        # latest producer finish is the latest finish of the producer ops
        ready = max((done[o] for o in ops), default=0.0)
        finish = max(t_free, ready) + tile_cost_us(ins.tile)
        done[ins.op] = max(done.get(ins.op, 0.0), finish)
        heapq.heappush(free, (finish, ins.sm))
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    sm_of = [ins.sm for ins in instrs]
    index = TileIndex(op_tiles, sm_of)
    for ins, ops in zip(instrs, producers):              # queues in program order
        queues[ins.sm].append(ins.id)
        sm = ins.sm
        # producer ops in program order with a tile on another SM (each op's ids ascending:
        # the tile waits made from them come out sorted)
        ins.wait_ops = [o for o in ops if any(sm_of[p] != sm for p in op_tiles[o])]
        ins.index = index
    return Schedule(num_sms, instrs, queues, g)


def _producer_ops(instrs: list[Instr]) -> list[list[str]]:
    """Per instruction, the earlier ops it must follow (independent of placement), in program
    order: an op with a tile that wrote what it reads (RAW), or read or wrote what it writes
    (WAR, WAW). The kernel has one counter per op (each tile adds 1; a consumer waits for tiles
    x epoch), so a consumer that needs one tile of an op waits for all of them."""
    order = {}
    for ins in instrs:
        order.setdefault(ins.op, len(order))
    return [sorted(ops, key=order.__getitem__) for ops in _producers(instrs)]


def _producers(instrs: list[Instr]) -> list[set[str]]:
    """Per instruction, the names of the earlier ops with a tile it must follow: RAW on what it
    reads, WAW and WAR on what it writes. (The overlap test is inlined: these loops run
    instructions x accesses times, about 2 million for the Llama-3.2-1B.)"""
    reads: dict[str, list[tuple[Region, str]]] = {}    # tensor -> (region, op) accesses still visible
    writes: dict[str, list[tuple[Region, str]]] = {}
    out: list[set[str]] = []
    start = 0
    while start < len(instrs):
        end = start
        while end < len(instrs) and instrs[end].op == instrs[start].op:
            end += 1
        group = instrs[start:end]
        for ins in group:
            need: set[str] = set()
            for r in ins.tile.reads:
                a, b = r.start, r.stop
                need.update([w for wr, w in writes.get(r.tensor, ()) if wr.start < b and a < wr.stop])
            for r in ins.tile.writes:
                a, b = r.start, r.stop
                need.update([w for wr, w in writes.get(r.tensor, ()) if wr.start < b and a < wr.stop])
                need.update([x for rr, x in reads.get(r.tensor, ()) if rr.start < b and a < rr.stop])
            out.append(need)
        # a write of this op supersedes older (earlier-op) accesses it covers completely:
        # the writer is ordered after them, so later accesses ordered after it are too
        for ins in group:
            for r in ins.tile.writes:
                reads[r.tensor] = [(rr, x) for rr, x in reads.get(r.tensor, ())
                                   if not (r.start <= rr.start and rr.stop <= r.stop)]
                writes[r.tensor] = [(wr, w) for wr, w in writes.get(r.tensor, ())
                                    if not (r.start <= wr.start and wr.stop <= r.stop)]
        for ins in group:
            for r in ins.tile.reads:
                reads.setdefault(r.tensor, []).append((r, ins.op))
            for r in ins.tile.writes:
                writes.setdefault(r.tensor, []).append((r, ins.op))
        start = end
    return out
