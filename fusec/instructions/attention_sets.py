"""Two tile sets in one split-KV op, chosen by the step's rows at run time.

The query-head cut of :func:`~fusec.instructions.attention_rules.auto_q_groups` that is fastest
depends on how many cache rows a step reads: with few KV heads, a cut into more tile groups
of fewer heads wins while each tile's K and V stay small, and loses once they grow with the
position (Qwen2.5-0.5B: 14 groups of one head 10-16% faster than 2 groups of 7 at positions
100-3000, 14% slower at 16000; docs/performance.md "The rule at a run-time length"). A
length-polymorphic step (HF ``generate()``, ``fusec.generate``: a capacity of 32768 rows) meets
both. So an ``attention_partial`` op whose capacity passes
:data:`~fusec.instructions.attention_rules.REFERENCE_ROWS` may carry a second tile set (attr
``long_set``, :func:`~fusec.instructions.attention_rules.long_set`: its ``q_groups``,
``n_chunks``, ``chunk`` and ``switch_rows``; outputs ``o_part_long``, ``ml_part_long``: its own
partials) besides the one of its attrs (the short set).

The op has ``max(short tiles, long tiles)`` tiles. Tile ``i`` is tile ``i`` of each set
(params ``group``/``chunk`` of the short set, ``long_group``/``long_chunk`` of the long one; -1
where the set has fewer tiles), and declares the union of both tiles' reads and writes, so the
schedule's counters (and the o projection waiting on the output) hold for either. At run time
every tile reads the position and takes the long set where the step reads more than
``switch_rows`` rows (the last row it reads, :meth:`AttentionPartial._pos`, at or past
``switch_rows``; the template's ``attention_long_set``), the same choice in every tile of the
step; a tile without a tile in the chosen set does nothing and still signals its counter.
Each set keeps its own tickets (spare counters) for its last-tile merge, so the merge is the
one of a single set. This is a run-time choice of which tile runs, the kind that a
mixture-of-experts step needs for which weights a tile reads.

Each set is computed by :class:`~fusec.instructions.attention.AttentionPartial`'s code of one
set, given a *view* of the op (:func:`tile_set`): the op with that set's attrs and partials (and,
for the long set, the name ``<op>.long``: its tickets and spare counters are its own).
"""
from __future__ import annotations

import re
from typing import Any

from fusec.ir import Op
from fusec.instructions.base import Region, Tile
from fusec.instructions.call import Call

#: the short set's tile parameters in the instruction word (p0, p1: group, split); the long set's
#: are p2, p3
_SHORT_PARAMS = re.compile(r"\bin\.p([01])\b")


def has_sets(op: Op) -> bool:
    """Whether ``op`` (an ``attention_partial``) carries a second tile set (attr ``long_set``)."""
    return "long_set" in op.attrs


def tile_set(op: Op, long: bool) -> Op:
    """The view of ``op`` that computes one tile set: ``op`` itself without a second set; else
    ``op`` with that set's attrs (``q_groups``, ``n_chunks``, ``chunk``) and partials
    (``o_part``, ``ml_part``), without ``long_set`` and the other set's partials; the long set's
    view is named ``<op>.long``."""
    if not has_sets(op):
        return op
    attrs = {k: v for k, v in op.attrs.items() if k != "long_set"}
    outputs = {k: v for k, v in op.outputs.items() if k not in ("o_part_long", "ml_part_long")}
    name = op.name
    if long:
        ls = op.attrs["long_set"]
        attrs.update(q_groups=ls["q_groups"], n_chunks=ls["n_chunks"], chunk=ls["chunk"])
        outputs.update(o_part=op.outputs["o_part_long"], ml_part=op.outputs["ml_part_long"])
        name = f"{op.name}.long"
    return Op(name, op.kind, dict(op.inputs), outputs, attrs, op.mutates, op.source, op.layer)


def views(op: Op) -> list[Op]:
    """The views of ``op``'s tile sets: ``[op]``, or ``[short, long]``."""
    return [tile_set(op, False), tile_set(op, True)] if has_sets(op) else [op]


def runs_long(op: Op, last_row: int) -> bool:
    """Whether a step whose split-KV tiles read cache rows ``[0, last_row]`` runs the long set."""
    return has_sets(op) and last_row >= op.attrs["long_set"]["switch_rows"]


def merged_tiles(op: Op, short: list[Tile], long: list[Tile]) -> list[Tile]:
    """The op's tiles from its sets' (each set's tile ``i`` becomes tile ``i``, with both
    sets' group and split, -1 where a set has no tile ``i``): the union of their regions, the
    larger of their costs."""
    out = []
    for i in range(max(len(short), len(long))):
        a, b = (short[i] if i < len(short) else None), (long[i] if i < len(long) else None)
        params = {"group": a.params["group"] if a else -1, "chunk": a.params["chunk"] if a else -1,
                  "long_group": b.params["group"] if b else -1, "long_chunk": b.params["chunk"] if b else -1}
        reads = _union([*(a.reads if a else []), *(b.reads if b else [])])
        writes = _union([*(a.writes if a else []), *(b.writes if b else [])])
        cost = max(t.act_bytes for t in (a, b) if t is not None)
        out.append(Tile(op.name, i, params, reads, writes, 0, cost))
    return out


def _union(regions: list[Region]) -> list[Region]:
    """``regions`` without repeats, in order."""
    seen, out = set(), []
    for r in regions:
        if r not in seen:
            seen.add(r)
            out.append(r)
    return out


def chosen(op: Op, tile: Tile, last_row: int) -> tuple[Op, int, int] | None:
    """(the view of the set a step reading rows ``[0, last_row]`` runs, the tile's group and
    split in it), or None where that set has no tile ``tile.index``."""
    if not runs_long(op, last_row):
        view, g, c = tile_set(op, False), tile.params["group"], tile.params["chunk"]
    else:
        view, g, c = tile_set(op, True), tile.params["long_group"], tile.params["long_chunk"]
    return (view, g, c) if g >= 0 else None


def set_tile(view: Op, tile: Tile, g: int, c: int) -> Tile:
    """``tile`` as the tile of group ``g``, split ``c`` of ``view``'s set (the params that
    set's code reads; the regions as declared)."""
    return Tile(view.name, tile.index, {"group": g, "chunk": c}, tile.reads, tile.writes,
                tile.weight_bytes, tile.act_bytes)


class SetsCall(Call):
    """The device call of an op with two tile sets: ``if (<long>) { if (in.p2 >= 0) <long
    set's call>; } else if (in.p0 >= 0) <short set's call>``, each set's the one
    :class:`~fusec.instructions.call.Call` makes (the long one from its view's values, arg
    ``long``, with every ``in.p0``, ``in.p1`` its arguments name, a mask row's included, read
    as ``in.p2``, ``in.p3``); an op of one set gets the plain call. ``<long>`` is the values'
    ``long_when`` (the template's ``attention_long_set``)."""

    def text(self, op: Op, values: dict[str, Any]) -> str:
        if "long" not in values:
            return super().text(op, values)
        short = super().text(tile_set(op, False), values)
        long = _SHORT_PARAMS.sub(lambda m: f"in.p{int(m.group(1)) + 2}", super().text(tile_set(op, True), values["long"]))
        return f"if ({values['long_when']}) {{ if (in.p2 >= 0) {long}; }} else if (in.p0 >= 0) {short}"
