"""embedding: ``out = table[token]`` (token row gather), ``aten.embedding``.

Shapes: table [V, H], ids [1] int64, out [H]. One tile: the row is a few KB.
"""
from __future__ import annotations

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.instructions.base import Instruction, Region, Tile, register
from fusec.instructions.matvec_rows import elt


@register
class Embedding(Instruction):
    name = "embedding"

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        h = g.tensors[op.inputs["table"]].shape[1]
        reads = [Region.whole(g, op.inputs["table"]), Region.whole(g, op.inputs["ids"])]
        return [Tile(op.name, 0, {}, reads, [Region.whole(g, op.outputs["out"])],
                     h * elt(g, op.inputs["table"]), 2 * h * elt(g, op.outputs["out"]))]

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        i = op.inputs
        return {"tw": bufs.ctype(i["table"]), "to": bufs.ctype(op.outputs["out"]),
                "H": g.tensors[i["table"]].shape[1], "V": g.tensors[i["table"]].shape[0], "table": bufs.ptr(i["table"]),
                "ids": bufs.ptr(i["ids"]), "out": bufs.ptr(op.outputs["out"])}

    @classmethod
    def runtime_regions(cls, op, tile, env):
        h = env.g.tensors[op.inputs["table"]].shape[1]
        tok = int(env.read(op.inputs["ids"]).reshape(-1)[0])
        return ([Region.of(env.g, op.inputs["table"], tok * h, (tok + 1) * h),
                 Region.whole(env.g, op.inputs["ids"])], tile.writes)

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        tok = int(env.read(op.inputs["ids"]).reshape(-1)[0])
        env.flat(op.outputs["out"])[:] = env.read(op.inputs["table"])[tok]
