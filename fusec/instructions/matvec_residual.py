"""matvec_residual: ``out = residual + W @ x`` over a range of rows (O-proj, down-proj).

Source: a linear layer (``aten.mm`` with a transposed weight) followed by the residual add
of a pre-norm transformer block. Numerics follow PyTorch: the matvec is rounded to the
output dtype before the add. Shapes: x [K], W [N, K], residual [N], out [N].
"""
from __future__ import annotations

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.pattern import ABSENT, op, sem, var
from fusec.instructions.base import Instruction, Tile, register
from fusec.instructions.call import P0, P1, SMEM, Call, Int, Ptr, Type
from fusec.instructions.matvec_rows import row_tiles, rows_dot
from fusec.instructions.rule import Rule


def _same_size(g: Graph, m: dict) -> bool:
    """Two tensor operands, alpha 1, the residual not the linear's own output, and residual,
    linear output and sum of one size (no broadcasting)."""
    add = m["_anchor"]
    n = g.tensors[add.outputs["out"]].numel
    return "in0" in add.inputs and "in1" in add.inputs and add.attrs["kwargs"].get("alpha", 1) == 1 \
        and g.root(m["residual"]) != g.root(m["y"]) and g.tensors[m["residual"]].numel == n \
        and g.tensors[m["y"]].numel == n


@register
class MatvecResidual(Instruction):
    name = "matvec_residual"
    #: linear (no bias) + residual ``aten.add``, either operand order
    rules = (Rule(op("aten.add.Tensor", var("residual"), sem("linear", bind="y", x=var("x"), w=var("w"), b=ABSENT),
                     commutative=True),
                  inputs={"x": "x", "w": "w", "residual": "residual"}, outputs={"out": "_anchor.out"},
                  check=_same_size, priority=40),)

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows = g.tensors[op.inputs["w"]].shape[0]
        return row_tiles(op, g, want, [op.inputs["w"]], [op.inputs["x"]], [op.inputs["residual"]],
                         op.outputs["out"], rows)

    call = Call("matvec_residual",
                targs=(Type("tx", "x"), Type("tw", "w"), Type("tr", "residual"), Type("to", "out"),
                       Int("K", lambda op, g: g.tensors[op.inputs["w"]].shape[1])),
                args=(Ptr("x"), Ptr("w"), Ptr("res", "residual"), Ptr("out"), P0, P1, SMEM))

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        return g.tensors[op.inputs["w"]].shape[1]

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        r0, r1 = tile.params["rows"]
        dt = env.g.tensors[op.outputs["out"]].dtype
        y = rows_dot(op, env, r0, r1).to(dt).float()
        res = env.read(op.inputs["residual"]).reshape(-1)[r0:r1].float()
        env.flat(op.outputs["out"])[r0:r1] = (res + y).to(dt)
