"""rms_lm_head: ``out = W @ RMSNorm(x)`` over rows (final norm + LM head; any norm+linear).

Source: HF ``LlamaForCausalLM`` final ``norm`` and ``lm_head``. Shapes: x [H], norm_w [H],
W [V, H], out [V] (the logits).
"""
from __future__ import annotations

from ..env import Env
from ..ir import Graph, Op
from .base import Instruction, Tile, register
from .matvec_rows import rms_prologue, rms_rows_cuda_args, row_tiles


@register
class RmsLmHead(Instruction):
    name = "rms_lm_head"

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows = g.tensors[op.inputs["w"]].shape[0]
        return row_tiles(op, g, want, [op.inputs["w"]], [op.inputs["x"], op.inputs["norm_w"]], [],
                         op.outputs["out"], rows)

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        return rms_rows_cuda_args(op, g, bufs, ("w",))

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        return g.tensors[op.inputs["x"]].numel

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        r0, r1 = tile.params["rows"]
        dt = env.g.tensors[op.outputs["out"]].dtype
        n = rms_prologue(op, env)
        env.flat(op.outputs["out"])[r0:r1] = (env.read(op.inputs["w"])[r0:r1].float() @ n).to(dt)
