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
from fusec.ir.pattern import ABSENT, sem, var
from fusec.instructions.base import Instruction, Tile, register
from fusec.instructions.call import P0, P1, RED, SMEM, Call, Float, Int, Ptr
from fusec.instructions.matvec_rows import HIDDEN, WF32, rms_attrs, rms_prologue, rms_types, row_tiles
from fusec.instructions.rule import Rule


#: gate activations, in the template's ACT order
ACTS = ("silu", "gelu_tanh", "gelu")


_NORMED = sem("rmsnorm", "rms", x=var("x"), w=var("norm_w"))


@register
class RmsGateUpSilu(Instruction):
    name = "rms_gate_up_silu"
    #: RMSNorm -> gate and up linears (no bias, one input) -> SiLU or GELU product
    rules = (Rule(sem(("silu_mul", "gelu_mul"), gate=sem("linear", x=_NORMED, w=var("wg"), b=ABSENT),
                      up=sem("linear", x=_NORMED, w=var("wu"), b=ABSENT)),
                  inputs={"x": "x", "norm_w": "norm_w", "wg": "wg", "wu": "wu"}, outputs={"out": "_anchor.out"},
                  attrs=lambda g, m: {**rms_attrs(g, m["rms"]), "act": m["_anchor"].attrs.get("act", "silu"),
                                      "w_fp32": m["rms"].attrs.get("w_fp32", False)},
                  priority=30),)

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows = g.tensors[op.inputs["wg"]].shape[0]
        return row_tiles(op, g, want, [op.inputs["wg"], op.inputs["wu"]],
                         [op.inputs["x"], op.inputs["norm_w"]], [], op.outputs["out"], rows)

    call = Call("rms_gate_up_silu",
                targs=(*rms_types("wg"), HIDDEN, WF32,
                       Int("act", lambda op, g: ACTS.index(op.attrs.get("act", "silu")), default=0)),
                args=(Ptr("x"), Ptr("norm_w"), Float("eps", "eps"), Ptr("wg"), Ptr("wu"), Ptr("out"),
                      P0, P1, SMEM, RED),
                numbering=("x", "norm_w", "out", "wg", "wu"))

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
