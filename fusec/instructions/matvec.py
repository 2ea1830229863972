"""matvec: ``out = W @ x (+ b)`` over a range of rows: any linear layer no other fusion took.

Source: ``torch.nn.functional.linear`` (``aten.mm`` / ``aten.addmm`` with a transposed weight)
at batch 1. Numerics follow PyTorch: the fp32 dot plus the bias, rounded once to the output
dtype (``addmm``). Shapes: x [K], W [N, K], b [N], out [N]. Rows are spread over every SM
like the fused matvec kinds, so a model whose norm or activation has no fused kind (Gemma's
GeGLU, a LayerNorm family) still streams its weights at full width.
"""
from __future__ import annotations

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.instructions.base import Instruction, Tile, register
from fusec.instructions.matvec_rows import row_tiles, rows_dot


@register
class Matvec(Instruction):
    name = "matvec"

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows = g.tensors[op.inputs["w"]].shape[0]
        return row_tiles(op, g, want, [op.inputs["w"]], [op.inputs["x"]],
                         [op.inputs["b"]] if "b" in op.inputs else [], op.outputs["out"], rows)

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        i, o = op.inputs, op.outputs
        return {"tx": bufs.ctype(i["x"]), "tw": bufs.ctype(i["w"]), "to": bufs.ctype(o["out"]),
                "tb": bufs.ctype(i["b"]) if "b" in i else bufs.ctype(i["w"]),
                "K": g.tensors[i["w"]].shape[1], "bias": "b" in i, "x": bufs.ptr(i["x"]),
                "w": bufs.ptr(i["w"]), "b": bufs.ptr(i["b"]) if "b" in i else "nullptr",
                "out": bufs.ptr(o["out"])}

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        return g.tensors[op.inputs["w"]].shape[1]

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        r0, r1 = tile.params["rows"]
        dt = env.g.tensors[op.outputs["out"]].dtype
        y = rows_dot(op, env, r0, r1)
        if "b" in op.inputs:
            y = y + env.read(op.inputs["b"]).reshape(-1)[r0:r1].float()
        env.flat(op.outputs["out"])[r0:r1] = y.to(dt)
