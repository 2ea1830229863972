"""embedding: ``out = table[token]`` (token row gather), ``aten.embedding``.

Shapes: table [V, H], ids [1] int64, out [H]. One tile: the row is a few KB.
"""
from __future__ import annotations

from fusec.abi import Fault
from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.pattern import op, var
from fusec.instructions.base import Instruction, Region, Tile, register
from fusec.instructions.call import Call, Int, Ptr, Type
from fusec.instructions.matvec_rows import elt
from fusec.instructions.rule import Rule


@register
class Embedding(Instruction):
    name = "embedding"
    #: ``aten.embedding(table, ids[, padding_idx, ...])`` of one token (the rest is training-only)
    rules = (Rule(op("aten.embedding.default", var("table"), var("ids"), partial=True),
                  inputs={"table": "table", "ids": "ids"}, outputs={"out": "_anchor.out"},
                  check=lambda g, m: g.tensors[m["ids"]].numel == 1, priority=80, keep_name=True),)

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        h = g.tensors[op.inputs["table"]].shape[1]
        reads = [Region.whole(g, op.inputs["table"]), Region.whole(g, op.inputs["ids"])]
        return [Tile(op.name, 0, {}, reads, [Region.whole(g, op.outputs["out"])],
                     h * elt(g, op.inputs["table"]), 2 * h * elt(g, op.outputs["out"]))]

    call = Call("embedding", targs=(Type("tw", "table"), Type("to", "out"),
                                    Int("H", lambda op, g: g.tensors[op.inputs["table"]].shape[1]),
                                    Int("V", lambda op, g: g.tensors[op.inputs["table"]].shape[0])),
                args=(Ptr("table"), Ptr("ids"), Ptr("out")))

    @staticmethod
    def token(op: Op, env: Env) -> int:
        """The token id, checked as eager's ``aten.embedding`` checks it: in ``[0, V)`` (a
        negative id is no row from the end), else :class:`fusec.errors.IndexFaultError`
        (``Fault.TOKEN_ID``, as the kernel's ``index_ok`` records it)."""
        tok = int(env.read(op.inputs["ids"]).reshape(-1)[0])
        vocab = env.g.tensors[op.inputs["table"]].shape[0]
        if not 0 <= tok < vocab:
            from fusec.ir.aten_exec import index_fault
            raise index_fault(op, "token id (embedding row)", tok, vocab, Fault.TOKEN_ID)
        return tok

    @classmethod
    def runtime_regions(cls, op, tile, env):
        h = env.g.tensors[op.inputs["table"]].shape[1]
        tok = cls.token(op, env)
        return ([Region.of(env.g, op.inputs["table"], tok * h, (tok + 1) * h),
                 Region.whole(env.g, op.inputs["ids"])], tile.writes)

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        tok = cls.token(op, env)
        env.flat(op.outputs["out"])[:] = env.read(op.inputs["table"])[tok]
