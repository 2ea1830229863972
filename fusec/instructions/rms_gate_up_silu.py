"""rms_gate_up_silu: ``out = act(Wg @ n) * (Wu @ n)`` with ``n = RMSNorm(x)``, over rows.

Source: the SwiGLU MLP of Llama (Shazeer 2020, "GLU Variants Improve Transformer") with
HF ``LlamaRMSNorm`` in front; the norm is recomputed by every tile (x is a few KB). The gate's
activation (attr ``act``) is SiLU, or GELU (tanh approximation or exact) for Gemma's GeGLU;
the norm may be Gemma's (attr ``w_fp32``, :func:`fusec.ir.semantics.rms_normalize`).
Shapes: x [H], norm_w [H], Wg/Wu [F, H], out [F].
"""
from __future__ import annotations

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.instructions.base import Instruction, Tile, register
from fusec.instructions.matvec_rows import rms_prologue, rms_rows_cuda_args, row_tiles


#: gate activations, in the template's ACT order
ACTS = ("silu", "gelu_tanh", "gelu")


@register
class RmsGateUpSilu(Instruction):
    name = "rms_gate_up_silu"

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows = g.tensors[op.inputs["wg"]].shape[0]
        return row_tiles(op, g, want, [op.inputs["wg"], op.inputs["wu"]],
                         [op.inputs["x"], op.inputs["norm_w"]], [], op.outputs["out"], rows)

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        args = rms_rows_cuda_args(op, g, bufs, ("wg", "wu"))
        args["act"] = ACTS.index(op.attrs.get("act", "silu"))
        return args

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        return g.tensors[op.inputs["x"]].numel

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        r0, r1 = tile.params["rows"]
        dt = env.g.tensors[op.outputs["out"]].dtype
        n = rms_prologue(op, env)
        gate = (env.read(op.inputs["wg"])[r0:r1].float() @ n).to(dt).float()
        up = (env.read(op.inputs["wu"])[r0:r1].float() @ n).to(dt).float()
        act = op.attrs.get("act", "silu")
        if act == "silu":
            a = torch.nn.functional.silu(gate)
        else:   # GELU is its own op in PyTorch: rounded before the product
            a = torch.nn.functional.gelu(gate, approximate="tanh" if act == "gelu_tanh" else "none").to(dt).float()
        env.flat(op.outputs["out"])[r0:r1] = (a * up).to(dt)
