"""tile: split every op into tiles with exact read/write regions.

Expects: a fused graph. Guarantees: returns ``{op name: [Tile, ...]}`` in program order;
the tiles of an op write disjoint regions that together cover its fresh outputs (except a
last-tile merge's output, which every split-KV tile of a KV head declares and the one with the
last ticket writes); each tile's regions are exact flat element ranges of root buffers
(KV-cache rows that depend on the run-time position are declared as the whole head,
conservatively). Fused kinds aim at ``num_sms`` tiles so each op's bytes spread over all SMs;
generic ops are one tile.
"""
from __future__ import annotations

from fusec.instructions import kind_of
from fusec.instructions.base import Tile
from fusec.ir import Graph


def run(g: Graph, num_sms: int) -> dict[str, list[Tile]]:
    return {op.name: kind_of(op).tiles(op, g, num_sms) for op in g.ops}
