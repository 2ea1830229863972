"""matvec: ``out = W @ x (+ b)`` over a range of rows: any linear layer no other fusion took.

Source: ``torch.nn.functional.linear`` (``aten.mm`` / ``aten.addmm`` with a transposed weight).
Numerics follow PyTorch: the fp32 dot plus the bias, rounded once to the output dtype
(``addmm``); with an activation epilogue (attr ``act``: a GELU over the output,
:mod:`fusec.instructions.activation`) that activation of the rounded result, rounded again.
Shapes: x [K], W [N, K], b [N], out [N]; in a step of a batch of B <= 16 sequences
(docs/batch.md) x [B, K] and out [B, N] (attribute ``batch``: template ``matvec_seqs``, each
weight row loaded once for the B sequences; in bf16 and fp16 on the tensor cores, ``MMA``).
Rows are spread over every SM like the fused matvec kinds, so a model whose norm or
activation has no fused kind (Gemma's GeGLU, a LayerNorm family) still streams its weights at
full width.
"""
from __future__ import annotations

import dataclasses

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.pattern import opt, sem, var
from fusec.instructions import activation
from fusec.instructions.base import Instruction, Tile, register
from fusec.instructions.call import P0, P1, SMEM, Call, Flag, Int, Ptr, Type
from fusec.instructions.matvec_rows import (MAX_SEQS, MMA, SEQ_ARGS, batch_attrs, batch_rows, batched, row_tiles,
                                            rows_dot, seq_fn, seq_smem, seq_uses, seqs, single)
from fusec.instructions.prologue import STAGED, TakesPrologue, adjust_tiles, vec_inputs
from fusec.instructions.rule import Rule


def _one_vector(g: Graph, m: dict) -> bool:
    """W is [N, K], x has K elements (or B·K in a step of batch B <= 16: ``batch_rows``), the
    bias N."""
    w = g.tensors[m["w"]]
    return batch_rows(g, m) > 0 and ("b" not in m or g.tensors[m["b"]].numel == w.shape[0])


@register
class Matvec(TakesPrologue, Instruction):
    name = "matvec"
    max_rows = MAX_SEQS
    #: any linear layer no other rule took (it keeps the linear's name)
    rules = (Rule(sem("linear", x=var("x"), w=var("w"), b=opt(var("b"))), inputs={"x": "x", "w": "w", "b": "b"},
                  outputs={"out": "_anchor.out"}, check=_one_vector, attrs=batch_attrs, priority=70,
                  keep_name=True),
             # a GELU over its output as its epilogue (fusec/instructions/activation.py)
             *activation.epilogue_rules("matvec", 75))

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows = g.tensors[op.inputs["w"]].shape[0]
        return adjust_tiles(op, g, row_tiles(op, g, want, [op.inputs["w"]], vec_inputs(op, False),
                                             [op.inputs["b"]] if "b" in op.inputs else [], op.outputs["out"], rows))

    #: batch 1: ``matvec``; a batch (B > 1): ``matvec_seqs`` (templates/matvec_seqs.cu.j2, no residual)
    call = Call(seq_fn("matvec"),
                targs=(Type("tx", "x"), Type("tw", "w"), Type("tb", "b", "w"), Type("tr", "out", when=batched),
                       Type("to", "out"), Int("K", lambda op, g: g.tensors[op.inputs["w"]].shape[1]), *SEQ_ARGS,
                       Flag("bias", has="b"), Flag("add_res", fn=lambda op: False, when=batched), MMA,
                       dataclasses.replace(STAGED, when=single), activation.ACT,
                       dataclasses.replace(STAGED, when=batched)),
                args=(Ptr("x"), Ptr("w"), Ptr("b"), Ptr("res", "residual", when=batched), Ptr("out"), P0, P1, SMEM))

    @classmethod
    def own_smem(cls, op: Op, g: Graph) -> int:
        return seq_smem(op, g)

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        return seq_uses(op, super().cuda_args(op, g, bufs))

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        r0, r1 = tile.params["rows"]
        dt = env.g.tensors[op.outputs["out"]].dtype
        y = rows_dot(op, env, r0, r1)   # [B, r1 - r0]: each sequence's rows (B = 1 at batch 1)
        if "b" in op.inputs:
            y = y + env.read(op.inputs["b"]).reshape(-1)[r0:r1].float()
        env.flat(op.outputs["out"]).view(seqs(op), -1)[:, r0:r1] = activation.apply(activation.act_of(op), y, dt).to(dt)
