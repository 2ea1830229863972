"""matvec_residual: ``out = residual + W @ x`` over a range of rows (O-proj, down-proj).

Source: a linear layer (``aten.mm`` with a transposed weight) followed by the residual add
of a pre-norm transformer block. Numerics follow PyTorch: the matvec is rounded to the
output dtype before the add. Shapes: x [K], W [N, K], residual [N], out [N]; in a step of a
batch of B <= 16 sequences (docs/batch.md) x [B, K], residual and out [B, N] (attribute
``batch``: template ``matvec_seqs``, each weight row loaded once for the B sequences; in bf16
and fp16 on the tensor cores, ``MMA``).
"""
from __future__ import annotations

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.pattern import ABSENT, op, sem, var
from fusec.instructions.base import Instruction, Tile, register
from fusec.instructions.call import P0, P1, SMEM, Call, Flag, Int, Ptr, Type
from fusec.instructions.matvec_rows import (MAX_SEQS, MMA, SEQ_ARGS, batch_attrs, batch_rows, batched, row_tiles,
                                            rows_dot, seq_fn, seq_smem, seq_uses, seqs)
from fusec.instructions.rule import Rule


def _same_size(g: Graph, m: dict) -> bool:
    """Two tensor operands, alpha 1, the residual not the linear's own output, and residual,
    linear output and sum of one size (no broadcasting); the linear's x one vector, or one per
    sequence of the step's batch (``batch_rows``)."""
    add = m["_anchor"]
    if not batch_rows(g, m):
        return False
    n = g.tensors[add.outputs["out"]].numel
    return "in0" in add.inputs and "in1" in add.inputs and add.attrs["kwargs"].get("alpha", 1) == 1 \
        and g.root(m["residual"]) != g.root(m["y"]) and g.tensors[m["residual"]].numel == n \
        and g.tensors[m["y"]].numel == n


@register
class MatvecResidual(Instruction):
    name = "matvec_residual"
    max_rows = MAX_SEQS
    #: linear (no bias) + residual ``aten.add``, either operand order
    rules = (Rule(op("aten.add.Tensor", var("residual"), sem("linear", bind="y", x=var("x"), w=var("w"), b=ABSENT),
                     commutative=True),
                  inputs={"x": "x", "w": "w", "residual": "residual"}, outputs={"out": "_anchor.out"},
                  check=_same_size, attrs=batch_attrs, priority=40),)

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows = g.tensors[op.inputs["w"]].shape[0]
        return row_tiles(op, g, want, [op.inputs["w"]], [op.inputs["x"]], [op.inputs["residual"]],
                         op.outputs["out"], rows)

    #: batch 1: ``matvec_residual``; a batch (B > 1): ``matvec_seqs`` (templates/matvec_seqs.cu.j2,
    #: the residual added, no bias)
    call = Call(seq_fn("matvec_residual"),
                targs=(Type("tx", "x"), Type("tw", "w"), Type("tb", "w", when=batched), Type("tr", "residual"),
                       Type("to", "out"), Int("K", lambda op, g: g.tensors[op.inputs["w"]].shape[1]), *SEQ_ARGS,
                       Flag("bias", fn=lambda op: False, when=batched), Flag("add_res", fn=lambda op: True, when=batched),
                       MMA),
                args=(Ptr("x"), Ptr("w"), Ptr("b", when=batched), Ptr("res", "residual"), Ptr("out"), P0, P1, SMEM))

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        return seq_smem(op, g)

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        return seq_uses(op, super().cuda_args(op, g, bufs))

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        r0, r1 = tile.params["rows"]
        dt = env.g.tensors[op.outputs["out"]].dtype
        y = rows_dot(op, env, r0, r1).to(dt).float()   # [B, r1 - r0] (B = 1 at batch 1)
        res = env.read(op.inputs["residual"]).reshape(seqs(op), -1)[:, r0:r1].float()
        env.flat(op.outputs["out"]).view(seqs(op), -1)[:, r0:r1] = (res + y).to(dt)
