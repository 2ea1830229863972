"""Hazard check: every two conflicting accesses must be ordered by counters, queue order or
atomic tickets.

Happens-before is the transitive closure of three kinds of edges: SM queue order, a wait on a
counter (the producer's stores happen before the consumer's loads), and an atomic ticket (an
instruction that takes a ticket after another one does: an acquire-release atomic). A ticket
orders only what comes *after* it: an instruction that takes one has two phases, the accesses
before its ticket (``pre``) and the ones after (``post``, e.g. the last-tile merge of split-KV
attention), and a ticket edge X -> Y orders X's ``pre`` phase (and what was before it) before
Y's ``post`` phase only. Queue and counter successors of an instruction follow both phases.

Two accesses conflict when they touch overlapping elements of one buffer, at least one writes,
and they belong to different instructions. Tiles of one op are compared only with the regions
observed at run time: their planned KV-cache regions (the whole head, since the row is chosen
at run time) overlap without conflicting. For every conflicting pair (a before b in program
order) ``a``'s access must happen before ``b``'s (for two tiles of one op, ordered at run time
by a ticket, either order will do); otherwise the pair is a hazard: RAW (b reads what a
wrote), WAR (b overwrites what a read) or WAW.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from fusec.errors import HazardError
from fusec.instructions.base import Region
from fusec.ir.schedule import Schedule

Regions = dict[int, tuple[list[Region], list[Region]]]


@dataclasses.dataclass
class HappensBefore:
    """Per instruction id, bitsets over phases (bit ``2p`` = instruction p's ``pre`` phase,
    bit ``2p + 1`` = its ``post`` phase): ``pre[i]`` holds the phases that happen before i
    starts, ``post[i]`` those before i's post-ticket phase (a superset)."""

    pre: list[int]
    post: list[int]

    def ordered(self, a: int, a_post: bool, b: int, b_post: bool) -> bool:
        """Whether the access of instruction ``a`` (in its post phase if ``a_post``) happens
        before the access of ``b`` (in its post phase if ``b_post``)."""
        return bool(((self.post[b] if b_post else self.pre[b]) >> (2 * a + a_post)) & 1)


def happens_before(s: Schedule, extra: dict[int, list[int]] | None = None,
                   order: list[int] | None = None) -> HappensBefore:
    """Happens-before of the instructions' phases (:class:`HappensBefore`).

    Args:
        extra: ticket edges, instruction id -> the instructions that took the same ticket just
            before it; they order only its post-ticket phase.
        order: the order the instructions ran in (a topological order of all edges); by
            default program order, where every static edge points backwards.

    Raises:
        HazardError: an edge points to an instruction that had not run before.
    """
    extra = extra or {}
    n = len(s.instrs)
    pre, post, full, tick = [0] * n, [0] * n, [0] * n, [0] * n
    prev_on_sm: dict[int, int] = {}
    for q in s.queues:
        for a, b in zip(q, q[1:]):
            prev_on_sm[b] = a
    done = [False] * n
    for iid in (order if order is not None else range(n)):
        ins = s.instrs[iid]
        preds = list(ins.waits) + ([prev_on_sm[iid]] if iid in prev_on_sm else [])
        acc = 0
        for p in preds + extra.get(iid, []):
            if not done[p]:
                raise HazardError(f"{ins.describe()} depends on instruction #{p}, which runs later", [])
        for p in preds:
            acc |= full[p]
        pre[iid] = acc
        # what happens before this instruction takes its ticket: its own pre phase, and what
        # happened before the tickets taken before it
        t = acc | (1 << (2 * iid))
        for x in extra.get(iid, []):
            t |= tick[x]
        tick[iid] = t
        post[iid] = t
        full[iid] = t | (1 << (2 * iid + 1))
        done[iid] = True
    return HappensBefore(pre, post)


#: accesses to one buffer from which the candidates of each write are found with numpy
_VECTOR_MIN = 48
#: schedules of up to this many instructions have their happens-before as a bit matrix (two
#: bytes arrays of n x n/4 bytes: 8 MB at 4096), which screens the pairs with numpy
_MATRIX_MAX = 4096


def _overlapping(lst: list[tuple[int, bool, bool, Region]], only: set[int] | None = None):
    """Per write access of ``lst`` (one buffer's accesses, in program order; ``only``: those at
    these positions of ``lst``): (its instruction, its post phase, its region, the accesses of
    other instructions that overlap it, in ``lst``'s order, less the writes of later
    instructions: each pair of writes is seen once, from the later one). A long list is scanned
    with numpy, one comparison of all its regions per write (the 1B schedule's check compared 14
    million pairs in Python); a short one in Python."""
    writers = [x for j, x in enumerate(lst) if x[1] and (only is None or j in only)]
    if len(lst) < _VECTOR_MIN:
        for wid, _, wpost, wreg in writers:
            yield wid, wpost, wreg, [x for x in lst if x[0] != wid and wreg.overlaps(x[3])
                                     and not (x[1] and x[0] > wid)]
        return
    n = len(lst)
    ids = np.fromiter((x[0] for x in lst), np.int64, n)
    writes = np.fromiter((x[1] for x in lst), np.bool_, n)
    starts = np.fromiter((x[3].start for x in lst), np.int64, n)
    stops = np.fromiter((x[3].stop for x in lst), np.int64, n)
    for wid, _, wpost, wreg in writers:
        hit = (starts < wreg.stop) & (stops > wreg.start) & (ids != wid) & ~(writes & (ids > wid))
        yield wid, wpost, wreg, [lst[j] for j in np.flatnonzero(hit).tolist()]


def _bit_matrix(hb: HappensBefore, n: int) -> np.ndarray:
    """``hb`` as bytes: [2, n, ceil(2n / 8)] uint8, ``[0]`` the ``pre`` sets and ``[1]`` the
    ``post`` sets of the n instructions, bit ``k`` of a set at byte ``k >> 3``, bit ``k & 7``."""
    nb = (2 * n + 7) // 8
    return np.stack([np.frombuffer(b"".join(x.to_bytes(nb, "little") for x in sets), np.uint8).reshape(n, nb)
                     for sets in (hb.pre, hb.post)])


def _suspects(lst: list[tuple[int, bool, bool, Region]], hbm: np.ndarray) -> set[int]:
    """The positions in ``lst`` (one buffer's accesses) of the writes that overlap an access of
    another instruction (less the writes of later ones, as :func:`_overlapping`) whose phase is
    not ordered before it in program order by the happens-before matrix ``hbm``
    (:func:`_bit_matrix`): every pair at once with numpy. The other writes have no hazard; these
    the exact check looks at (the accesses of one op's tiles may be exempt)."""
    n = len(lst)
    ids = np.fromiter((x[0] for x in lst), np.int64, n)
    writes = np.fromiter((x[1] for x in lst), np.bool_, n)
    posts = np.fromiter((x[2] for x in lst), np.int64, n)
    starts = np.fromiter((x[3].start for x in lst), np.int64, n)
    stops = np.fromiter((x[3].stop for x in lst), np.int64, n)
    wj = np.flatnonzero(writes)
    wid, wpo = ids[wj, None], posts[wj, None]
    hit = (starts < stops[wj, None]) & (stops > starts[wj, None]) & (ids != wid) & ~(writes & (ids > wid))
    r, c = np.nonzero(hit)
    if not len(r):
        return set()
    oid, opo, w, wp = ids[c], posts[c], wid[r, 0], wpo[r, 0]
    lower = oid < w   # the earlier access in program order: a (phase ap); the later: b (bp)
    a, ap = np.where(lower, oid, w), np.where(lower, opo, wp)
    b, bp = np.where(lower, w, oid), np.where(lower, wp, opo)
    bit = 2 * a + ap
    ordered = (hbm[bp, b, bit >> 3] >> (bit & 7)) & 1
    return {int(wj[x]) for x in np.unique(r[ordered == 0])}


def check_hazards(s: Schedule, regions: Regions | None = None, limit: int = 20,
                  extra: dict[int, list[int]] | None = None, order: list[int] | None = None,
                  post_regions: Regions | None = None) -> None:
    """Raise :class:`HazardError` listing up to ``limit`` unordered conflicting pairs.

    Args:
        regions: instruction id -> (reads, writes) observed at run time; planned regions
            are used for instructions not in it.
        extra, order: ticket edges and the run order (:func:`happens_before`).
        post_regions: instruction id -> (reads, writes) after its ticket (the last-tile merge).
    """
    regions = regions or {}
    post_regions = post_regions or {}
    hb = happens_before(s, extra, order)
    acc: dict[str, list[tuple[int, bool, bool, Region]]] = {}   # (id, write, post phase, region)
    for ins in s.instrs:
        phases = [(False, regions.get(ins.id, (ins.tile.reads, ins.tile.writes)))]
        if ins.id in post_regions:
            phases.append((True, post_regions[ins.id]))
        for post, (rd, wr) in phases:
            for r in rd:
                acc.setdefault(r.tensor, []).append((ins.id, False, post, r))
            for r in wr:
                acc.setdefault(r.tensor, []).append((ins.id, True, post, r))
    found = []
    op_of = [ins.op for ins in s.instrs]
    pre, post = hb.pre, hb.post
    hbm = _bit_matrix(hb, len(s.instrs)) if len(s.instrs) <= _MATRIX_MAX else None
    for buf, lst in acc.items():
        only = None
        if hbm is not None and len(lst) >= _VECTOR_MIN:   # the writes with a pair that is not ordered
            only = _suspects(lst, hbm)
            if not only:
                continue
        for wid, wpost, wreg, others in _overlapping(lst, only):
            wop = op_of[wid]
            wbit = 2 * wid + wpost
            wmask = post[wid] if wpost else pre[wid]   # the phases before the write's
            wknown = wid in regions
            for oid, owrite, opost, oreg in others:
                # ordered (program order a before b): a's phase happens before b's, i.e. its bit
                # is in b's happens-before set (HappensBefore.ordered, inlined: the hot loop)
                if oid < wid:
                    if (wmask >> (2 * oid + opost)) & 1:
                        continue
                elif ((post[oid] if opost else pre[oid]) >> wbit) & 1:
                    continue
                same_op = op_of[oid] == wop
                if same_op and (not wknown or oid not in regions):
                    continue  # planned regions of one op's tiles may overlap (KV row chosen at run time)
                (a, ap), (b, bp) = ((oid, opost), (wid, wpost)) if oid < wid else ((wid, wpost), (oid, opost))
                if same_op and hb.ordered(b, bp, a, ap):
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
