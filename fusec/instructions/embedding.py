"""embedding: ``out[b] = table[ids[b]]`` (token row gather), ``aten.embedding``.

Shapes: table [V, H], ids [B] int64 (B tokens: a batch of sequences, or K query tokens; any
shape of B elements), out [B, H]. One tile per token: a row is a few KB.
"""
from __future__ import annotations

import torch

from fusec.abi import Fault
from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.pattern import op, var
from fusec.instructions.base import Instruction, Region, Tile, register
from fusec.instructions.call import P0, Call, Int, Ptr, Type
from fusec.instructions.matvec_rows import MAX_SEQS, elt
from fusec.instructions.rule import Rule


@register
class Embedding(Instruction):
    name = "embedding"
    #: B·K tokens of a step, each its own tile (the rule checks the ids' count)
    max_rows = MAX_SEQS
    #: ``aten.embedding(table, ids[, padding_idx, ...])`` of up to 16 tokens (the rest of its
    #: arguments is training-only)
    rules = (Rule(op("aten.embedding.default", var("table"), var("ids"), partial=True),
                  inputs={"table": "table", "ids": "ids"}, outputs={"out": "_anchor.out"},
                  check=lambda g, m: 1 <= g.tensors[m["ids"]].numel <= MAX_SEQS
                  and g.tensors[m["ids"]].dtype == torch.int64, priority=80, keep_name=True),)

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        h = g.tensors[op.inputs["table"]].shape[1]
        return [Tile(op.name, b, {"rows": (b, b + 1)},
                     [Region.whole(g, op.inputs["table"]), Region.of(g, op.inputs["ids"], b, b + 1)],
                     [Region.of(g, op.outputs["out"], b * h, (b + 1) * h)],
                     h * elt(g, op.inputs["table"]), 2 * h * elt(g, op.outputs["out"]))
                for b in range(g.tensors[op.inputs["ids"]].numel)]

    call = Call("embedding", targs=(Type("tw", "table"), Type("to", "out"),
                                    Int("H", lambda op, g: g.tensors[op.inputs["table"]].shape[1]),
                                    Int("V", lambda op, g: g.tensors[op.inputs["table"]].shape[0])),
                args=(Ptr("table"), Ptr("ids"), Ptr("out"), P0))

    @staticmethod
    def token(op: Op, env: Env, b: int = 0) -> int:
        """Token ``b``'s id, checked as eager's ``aten.embedding`` checks it: in ``[0, V)`` (a
        negative id is no row from the end), else :class:`fusec.errors.IndexFaultError`
        (``Fault.TOKEN_ID``, as the kernel's ``index_ok`` records it)."""
        tok = int(env.read(op.inputs["ids"]).reshape(-1)[b])
        vocab = env.g.tensors[op.inputs["table"]].shape[0]
        if not 0 <= tok < vocab:
            from fusec.ir.aten_exec import index_fault
            raise index_fault(op, Fault.TOKEN_ID.doc, tok, vocab, Fault.TOKEN_ID)
        return tok

    @classmethod
    def runtime_regions(cls, op, tile, env):
        h = env.g.tensors[op.inputs["table"]].shape[1]
        tok = cls.token(op, env, tile.params["rows"][0])
        return [Region.of(env.g, op.inputs["table"], tok * h, (tok + 1) * h), tile.reads[1]], tile.writes

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        b = tile.params["rows"][0]
        h = env.g.tensors[op.inputs["table"]].shape[1]
        env.flat(op.outputs["out"])[b * h:(b + 1) * h] = env.read(op.inputs["table"])[cls.token(op, env, b)]
