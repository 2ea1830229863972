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


def happens_before(s: Schedule, extra: dict[int, list[int]] | None = None,
                   order: list[int] | None = None) -> list[int]:
    """Bitset per instruction id: bit p set iff instruction p happens before it.

    Args:
        extra: run-time edges, instruction id -> ids that happen before it (an atomic ticket
            taken by one tile after another: fence, atomic add, fence).
        order: the order the instructions ran in (a topological order of all edges); by
            default program order, where every static edge points backwards.

    Raises:
        HazardError: an edge points to an instruction that had not run before.
    """
    extra = extra or {}
    hb = [0] * len(s.instrs)
    prev_on_sm: dict[int, int] = {}
    for q in s.queues:
        for a, b in zip(q, q[1:]):
            prev_on_sm[b] = a
    done = [False] * len(s.instrs)
    for iid in (order if order is not None else range(len(s.instrs))):
        ins = s.instrs[iid]
        preds = list(ins.waits) + extra.get(iid, [])
        if iid in prev_on_sm:
            preds.append(prev_on_sm[iid])
        acc = 0
        for p in preds:
            if not done[p]:
                raise HazardError(f"{ins.describe()} depends on instruction #{p}, which runs later", [])
            acc |= hb[p] | (1 << p)
        hb[iid] = acc
        done[iid] = True
    return hb


def check_hazards(s: Schedule, regions: dict[int, tuple[list[Region], list[Region]]] | None = None,
                  limit: int = 20, extra: dict[int, list[int]] | None = None,
                  order: list[int] | None = None) -> None:
    """Raise :class:`HazardError` listing up to ``limit`` unordered conflicting pairs.

    Args:
        regions: instruction id -> (reads, writes) observed at run time; planned regions
            are used for instructions not in it.
        extra, order: run-time happens-before edges and the run order (:func:`happens_before`).
    """
    regions = regions or {}
    hb = happens_before(s, extra, order)
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
                if s.instrs[a].op == s.instrs[b].op and (hb[a] >> b) & 1:
                    continue  # tiles of one op ordered at run time (a ticket), in either order
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
