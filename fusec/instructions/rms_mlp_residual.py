"""rms_mlp_residual: a whole MLP block in one level, ``out = residual + Wd @ (act(Wg @ n) * (Wu @ n))``
with ``n = RMSNorm(x)`` (option ``mlp_merge="last_tile"``; experimental, not yet measured on a GPU).

Source: the SwiGLU / GeGLU MLP of Llama and Gemma (Shazeer 2020, "GLU Variants Improve
Transformer") with HF ``LlamaRMSNorm`` in front and the residual add of a pre-norm block
behind; the split of the down-projection along its input dimension is split-K (as in
cuBLAS's split-K GEMM and stream-K, Osama et al. 2023) with the reduction done by fp32 atomic
adds and finished by the last tile, found with an atomic ticket (as the split-KV merge of
:mod:`fusec.instructions.attention`).

Each tile owns rows ``[r0, r1)`` of the intermediate vector: it computes them as
``rms_gate_up_silu`` does (rounded to the intermediate dtype, as PyTorch rounds the product),
keeps them in shared memory, streams the matching columns ``Wd[:, r0:r1]`` (a 16-byte aligned
segment of every row) and adds its H partial sums to an fp32 accumulator (spare counters, zero
at load, 16-byte aligned; ``red.global.add.v4.f32`` over four rows, ``FUSEC_MLP_RED_V4=0``: one
``red.global.add.f32`` per row). Then it takes the op's ticket; the tile with the step's last
ticket rounds the sums to the down-projection's dtype, adds the residual, writes ``out`` and
clears the accumulator for the next step. The gate/up -> down level of ``rms_gate_up_silu`` +
``matvec_residual`` is gone; the sums' order differs from run to run (fp32).

Shapes: x [H], norm_w [H], Wg/Wu [F, H], Wd [H, F], residual [H], out [H]; F a multiple of
16 bytes of Wd's elements.
"""
from __future__ import annotations

import torch

from fusec.ir import Graph, Op
from fusec.ir.env import Env
from fusec.ir.pattern import ABSENT, op, sem, var
from fusec.instructions.base import Instruction, Region, Tile, register, split_range
from fusec.instructions.call import P0, P1, P2, RED, SMEM, Call, Expr, Float, Int, Ptr, Type
from fusec.instructions.matvec_rows import HIDDEN, WF32, elt, rms_attrs
from fusec.instructions.rms_gate_up_silu import ACTS, glu_rows
from fusec.instructions.rule import Rule


_NORMED = sem("rmsnorm", "rms", x=var("x"), w=var("norm_w"))
_ACT = sem(("silu_mul", "gelu_mul"), "act", gate=sem("linear", x=_NORMED, w=var("wg"), b=ABSENT),
           up=sem("linear", x=_NORMED, w=var("wu"), b=ABSENT))


def _fits(g: Graph, m: dict) -> bool:
    """A plain residual add of the MLP's size (alpha 1, no broadcasting), Wd [H, F] with F a
    whole number of 16-byte chunks, and the norm's input the size of the output."""
    add = m["_anchor"]
    if "in0" not in add.inputs or "in1" not in add.inputs or add.attrs["kwargs"].get("alpha", 1) != 1:
        return False
    h = g.tensors[add.outputs["out"]].numel
    wd, wg = g.tensors[m["wd"]], g.tensors[m["wg"]]
    if len(wd.shape) != 2 or len(wg.shape) != 2:
        return False
    f = wg.shape[0]
    return (g.tensors[m["residual"]].numel == h and g.tensors[m["y"]].numel == h and wd.shape == (h, f)
            and g.tensors[m["x"]].numel == wg.shape[1] and (f * elt(g, m["wd"])) % 16 == 0)


@register
class RmsMlpResidual(Instruction):
    name = "rms_mlp_residual"
    #: RMSNorm -> gate and up linears -> SiLU/GELU product -> down linear -> residual add, with
    #: ``mlp_merge="last_tile"`` (before rms_gate_up_silu, 30, and matvec_residual, 40, take the parts)
    rules = (Rule(op("aten.add.Tensor", var("residual"), sem("linear", bind="y", x=_ACT, w=var("wd"), b=ABSENT),
                     commutative=True),
                  inputs={"x": "x", "norm_w": "norm_w", "wg": "wg", "wu": "wu", "wd": "wd", "residual": "residual"},
                  outputs={"out": "_anchor.out"},
                  attrs=lambda g, m: {**rms_attrs(g, m["rms"]), "act": m["act"].attrs.get("act", "silu"),
                                      "w_fp32": m["rms"].attrs.get("w_fp32", False),
                                      "act_dtype": g.tensors[m["act"].outputs["out"]].dtype,
                                      "y_dtype": g.tensors[m["y"]].dtype},
                  check=_fits, priority=25, when=lambda o: o.get("mlp_merge") == "last_tile"),)

    @staticmethod
    def _dims(op: Op, g: Graph) -> tuple[int, int]:
        """(H, F): the hidden and the intermediate size."""
        f, h = g.tensors[op.inputs["wg"]].shape
        return h, f

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        h, f = cls._dims(op, g)
        spans = split_range(f, want, 16 // elt(g, op.inputs["wd"]))
        vec = [Region.whole(g, op.inputs[s]) for s in ("x", "norm_w")]
        vbytes = sum(g.tensors[op.inputs[s]].nbytes for s in ("x", "norm_w"))
        tail = [Region.whole(g, op.inputs["residual"])]   # the last tile's (any tile may be last)
        tiles = []
        for i, (r0, r1) in enumerate(spans):
            reads = [Region.of(g, op.inputs[w], r0 * h, r1 * h) for w in ("wg", "wu")]
            reads += [Region.whole(g, op.inputs["wd"])] + vec + tail
            wbytes = (r1 - r0) * h * (2 * elt(g, op.inputs["wg"]) + elt(g, op.inputs["wd"]))
            last = h * (4 + elt(g, op.inputs["residual"]) + elt(g, op.outputs["out"])) // len(spans)
            tiles.append(Tile(op.name, i, {"rows": [r0, r1], "n_tiles": len(spans)}, reads,
                              [Region.whole(g, op.outputs["out"])], wbytes, vbytes + 4 * h + last))
        return tiles

    @classmethod
    def encode(cls, op: Op, tile: Tile) -> list[int]:
        return [*tile.params["rows"], tile.params["n_tiles"]]

    call = Call("rms_mlp_residual",
                targs=(Type("tx", "x"), Type("tnw", "norm_w"),
                       Expr("tn", lambda op, g, bufs: bufs.cname(op.attrs["norm_dtype"])), Type("tw", "wg"),
                       Expr("ta", lambda op, g, bufs: bufs.cname(op.attrs["act_dtype"])), Type("tr", "residual"),
                       Expr("td", lambda op, g, bufs: bufs.cname(op.attrs["y_dtype"])), Type("ty", "out"),
                       HIDDEN, Int("F", lambda op, g: g.tensors[op.inputs["wg"]].shape[0]), WF32,
                       Int("act", lambda op, g: ACTS.index(op.attrs.get("act", "silu")), default=0)),
                args=(Ptr("x"), Ptr("norm_w"), Float("eps", "eps"), Ptr("wg"), Ptr("wu"), Ptr("wd"),
                      Ptr("res", "residual"), Ptr("out"),
                      Expr("acc", lambda op, g, bufs: "reinterpret_cast<float*>"
                           + bufs.counters(op.name + "/acc", g.tensors[op.outputs["out"]].numel, align=4)),
                      Expr("ticket", lambda op, g, bufs: bufs.counters(op.name, 1)),
                      P0, P1, P2, SMEM, RED),
                numbering=("x", "norm_w", "out", "wg", "wu", "wd", "res"))

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        h, f = cls._dims(op, g)
        return h + f   # the normed input, then the tile's intermediate rows (fp32)

    @classmethod
    def runtime_regions(cls, op, tile, env):
        """Before its ticket a tile reads its weights and the input, and writes no tensor (its
        sums go to the accumulator)."""
        return tile.reads[:-1], []

    @classmethod
    def ticket_regions(cls, op, tile, env):
        """The last tile of the step reads the residual and writes ``out``."""
        if not cls._is_last(op, env, tile.params["n_tiles"], peek=True):
            return [], []
        return tile.reads[-1:], tile.writes

    @staticmethod
    def _is_last(op: Op, env: Env, n: int, peek: bool = False) -> bool:
        t = env.peek_ticket(op.name) if peek else env.take_ticket(op.name)
        return t % n == n - 1

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        r0, r1 = tile.params["rows"]
        h, f = cls._dims(op, env.g)
        mid = glu_rows(op, env, r0, r1, op.attrs["act_dtype"]).float()   # as rms_gate_up_silu
        acc = env.accumulators.setdefault(op.name, torch.zeros(h, dtype=torch.float32))
        acc += env.read(op.inputs["wd"])[:, r0:r1].float() @ mid
        if cls._is_last(op, env, tile.params["n_tiles"]):
            y = acc.to(op.attrs["y_dtype"]).float()
            res = env.read(op.inputs["residual"]).reshape(-1).float()
            env.flat(op.outputs["out"])[:h] = (res + y).to(env.g.tensors[op.outputs["out"]].dtype)
            acc.zero_()
