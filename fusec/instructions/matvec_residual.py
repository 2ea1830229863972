"""matvec_residual: ``out = residual + W @ x`` over a range of rows (O-proj, down-proj).

Source: a linear layer (``aten.mm`` with a transposed weight) followed by the residual add
of a pre-norm transformer block. Numerics follow PyTorch: the matvec is rounded to the
output dtype before the add. Shapes: x [K], W [N, K], residual [N], out [N].
"""
from __future__ import annotations

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.instructions.base import Instruction, Tile, register
from fusec.instructions.matvec_rows import row_tiles, rows_dot


@register
class MatvecResidual(Instruction):
    name = "matvec_residual"

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows = g.tensors[op.inputs["w"]].shape[0]
        return row_tiles(op, g, want, [op.inputs["w"]], [op.inputs["x"]], [op.inputs["residual"]],
                         op.outputs["out"], rows)

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        i, o = op.inputs, op.outputs
        return {"tx": bufs.ctype(i["x"]), "tw": bufs.ctype(i["w"]), "tr": bufs.ctype(i["residual"]),
                "to": bufs.ctype(o["out"]), "K": g.tensors[i["w"]].shape[1], "x": bufs.ptr(i["x"]),
                "w": bufs.ptr(i["w"]), "res": bufs.ptr(i["residual"]), "out": bufs.ptr(o["out"])}

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
