"""Hazard check: every two conflicting accesses must be ordered by counters or queue order.

Happens-before is the transitive closure of two kinds of edges: SM queue order, and a wait
on a counter (the producer's stores happen before the consumer's loads). Two accesses
conflict when they touch overlapping elements of one buffer, at least one writes, and they
belong to different instructions. Tiles of one op are compared only with the regions
observed at run time: their planned KV-cache regions (the whole head, since the row is
chosen at run time) overlap without conflicting. For every conflicting pair (a before b in program order)
``a`` must happen before ``b``; otherwise the pair is a hazard: RAW (b reads what a wrote),
WAR (b overwrites what a read) or WAW.
"""
from __future__ import annotations

from ..errors import HazardError
from ..instructions.base import Region
from ..schedule import Schedule


def happens_before(s: Schedule) -> list[int]:
    """Bitset per instruction id: bit p set iff instruction p happens before it."""
    hb = [0] * len(s.instrs)
    prev_on_sm: dict[int, int] = {}
    for q in s.queues:
        for a, b in zip(q, q[1:]):
            prev_on_sm[b] = a
    for ins in s.instrs:
        preds = list(ins.waits)
        if ins.id in prev_on_sm:
            preds.append(prev_on_sm[ins.id])
        acc = 0
        for p in preds:
            if p >= ins.id:
                raise HazardError(f"{ins.describe()} depends on a later instruction #{p}", [])
            acc |= hb[p] | (1 << p)
        hb[ins.id] = acc
    return hb


def check_hazards(s: Schedule, regions: dict[int, tuple[list[Region], list[Region]]] | None = None,
                  limit: int = 20) -> None:
    """Raise :class:`HazardError` listing up to ``limit`` unordered conflicting pairs.

    Args:
        regions: instruction id -> (reads, writes) observed at run time; planned regions
            are used for instructions not in it.
    """
    regions = regions or {}
    hb = happens_before(s)
    acc: dict[str, list[tuple[int, bool, Region]]] = {}
    for ins in s.instrs:
        rd, wr = regions.get(ins.id, (ins.tile.reads, ins.tile.writes))
        for r in rd:
            acc.setdefault(r.tensor, []).append((ins.id, False, r))
        for r in wr:
            acc.setdefault(r.tensor, []).append((ins.id, True, r))
    found = []
    for buf, lst in acc.items():
        ws = [x for x in lst if x[1]]
        for wid, _, wreg in ws:
            for oid, owrite, oreg in lst:
                if oid == wid or not wreg.overlaps(oreg) or (owrite and oid > wid):
                    continue
                if s.instrs[oid].op == s.instrs[wid].op and (oid not in regions or wid not in regions):
                    continue  # planned regions of one op's tiles may overlap (KV row chosen at run time)
                a, b = (oid, wid) if oid < wid else (wid, oid)
                if (hb[b] >> a) & 1:
                    continue
                if oid < wid:
                    kind = "WAW" if owrite else "WAR"
                else:
                    kind = "RAW"
                found.append({"kind": kind, "buffer": buf, "first": s.instrs[a].describe(),
                              "second": s.instrs[b].describe(),
                              "region": [max(wreg.start, oreg.start), min(wreg.stop, oreg.stop)]})
                if len(found) >= limit:
                    break
    if found:
        lines = "\n".join(f"  {h['kind']} on {h['buffer']}{h['region']}: {h['first']} is not ordered "
                          f"before {h['second']}" for h in found)
        raise HazardError(f"{len(found)} hazard(s) in the schedule:\n{lines}", found)
