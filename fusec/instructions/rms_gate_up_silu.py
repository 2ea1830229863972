"""rms_gate_up_silu: ``out = act(Wg @ n) * (Wu @ n)`` with ``n = RMSNorm(x)``, or ``n = x``, over rows.

Source: the SwiGLU MLP of Llama (Shazeer 2020, "GLU Variants Improve Transformer") with
HF ``LlamaRMSNorm`` in front; the norm is recomputed by every tile (x is a few KB). The gate's
activation (attr ``act``) is SiLU, or GELU (tanh approximation or exact) for Gemma's GeGLU;
the norm may be Gemma's (attr ``w_fp32``, :func:`fusec.ir.semantics.rms_normalize`). Without
the norm (attr ``norm`` False: no ``norm_w``, no ``eps``) the rows read x itself: the MLP of a
post-norm block (HF ``Olmo2DecoderLayer``: its MLP reads the residual stream), or of one whose
norm no fused kind takes (a LayerNorm's output, a norm shared with the attention's projections).
Shapes: x [H], norm_w [H], Wg/Wu [F, H], out [F]. In a step of R = B·K <= 16 activation rows (B
sequences of K query tokens each; docs/batch.md; attribute ``batch`` R, set by the rules where all
R rows fit shared memory at once: :func:`fusec.instructions.matvec_rows.fused_batch`) x [R, H]
and out [R, F] (``[B, K, H]`` and ``[B, K, F]`` row-major): template ``rms_gate_up_silu_seqs``
(templates/rms_gate_up_silu_seqs.cu.j2), each gate and up row loaded once for the R rows, each
row its own RMSNorm.
"""
from __future__ import annotations

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op, Role
from fusec.ir.pattern import ABSENT, sem, var
from fusec.instructions.base import Instruction, Tile, register
from fusec.instructions.call import P0, P1, RED, SMEM, Call, Expr, Float, Int, Ptr, Type
from fusec.instructions.matvec_rows import (HIDDEN, MAX_SEQS, NORM, WF32, batched, fused_batch, normed, pair_smem,
                                            rms_attrs, row_tiles, seqs, staged)
from fusec.instructions.prologue import STAGED, TakesPrologue, adjust_tiles, vec_inputs, xin
from fusec.instructions.rule import Rule


#: gate activations, in the template's ACT order
ACTS = ("silu", "gelu_tanh", "gelu")

_GLU = ("silu_mul", "gelu_mul")
_NORMED = sem("rmsnorm", "rms", x=var("x"), w=var("norm_w"))


def _normed_batch(g: Graph, m: dict) -> int:
    """The normed form's rows (:func:`fusec.instructions.matvec_rows.fused_batch`: 1 in a step of
    one row, the step's R = B·K where the R normed rows fit shared memory at once, 0 otherwise)."""
    return fused_batch(g, m["x"], g.tensors[m["wg"]].shape[-1], g.tensors[m["rms"].outputs["out"]].dtype.itemsize)


def _batch(b: int) -> dict:
    """The op's attribute ``batch`` at R = B·K > 1 rows (none at one row: the op of before)."""
    return {"batch": b} if b > 1 else {}


def _plain_ok(g: Graph, m: dict) -> bool:
    """The plain form's limits: gate and up read one vector (the same elements of one root
    buffer, each linear through its own view of them; the step's R = B·K rows of it where they
    fit shared memory at once, :func:`fusec.instructions.matvec_rows.fused_batch`: attribute
    ``batch`` R) that no op writes in place (the fused op
    reads it where the product was), with weights of the model of one shape [F, H] and dtype
    (H = x's elements, or a row's), and the linears' outputs and the product of one dtype
    (run_tile rounds both dots to it); no run-time lengths."""
    x, wg, wu = g.tensors[m["x"]], g.tensors[m["wg"]], g.tensors[m["wu"]]
    if g.span(m["x"]) != g.span(m["x_up"]) or len(wg.shape) != 2 or wg.shape != wu.shape or wg.dtype != wu.dtype:
        return False
    if not fused_batch(g, m["x"], wg.shape[1], x.dtype.itemsize) \
            or any(g.tensors[g.root(w)].role != Role.WEIGHT for w in (m["wg"], m["wu"])):
        return False
    out = g.tensors[m["_anchor"].outputs["out"]].dtype
    if g.tensors[m["gate"]].dtype != out or g.tensors[m["up"]].dtype != out:
        return False
    names = [m["x"], m["x_up"], m["wg"], m["wu"], m["gate"], m["up"], m["_anchor"].outputs["out"]]
    if any(g.tensors[t].sym for t in names):
        return False
    root = g.root(m["x"])
    return not any(g.root(o.outputs[s]) == root for o in g.ops for s in o.mutates)


def _staged(op: Op, g: Graph, bufs) -> str:
    """TN, the C type of the vector in shared memory that the rows dot with: the norm's output
    dtype, or x's own."""
    return bufs.cname(op.attrs["norm_dtype"]) if normed(op) else bufs.ctype(xin(op))


@register
class RmsGateUpSilu(TakesPrologue, Instruction):
    name = "rms_gate_up_silu"
    #: R = B·K <= 16 rows, B sequences of K query tokens (attribute ``batch`` R: docs/batch.md)
    max_rows = MAX_SEQS
    #: RMSNorm -> gate and up linears (no bias, one input) -> SiLU or GELU product (30); the
    #: same without the norm (35: a normed input keeps its norm in the op; a pair that reads a
    #: norm whose output is read elsewhere too takes the normed vector as x)
    rules = (Rule(sem(_GLU, gate=sem("linear", x=_NORMED, w=var("wg"), b=ABSENT),
                      up=sem("linear", x=_NORMED, w=var("wu"), b=ABSENT)),
                  inputs={"x": "x", "norm_w": "norm_w", "wg": "wg", "wu": "wu"}, outputs={"out": "_anchor.out"},
                  check=lambda g, m: _normed_batch(g, m) > 0,
                  attrs=lambda g, m: {**rms_attrs(g, m["rms"]), "act": m["_anchor"].attrs.get("act", "silu"),
                                      "w_fp32": m["rms"].attrs.get("w_fp32", False), **_batch(_normed_batch(g, m))},
                  priority=30),
             Rule(sem(_GLU, gate=sem("linear", bind="gate", x=var("x"), w=var("wg"), b=ABSENT),
                      up=sem("linear", bind="up", x=var("x_up"), w=var("wu"), b=ABSENT)),
                  inputs={"x": "x", "wg": "wg", "wu": "wu"}, outputs={"out": "_anchor.out"},
                  attrs=lambda g, m: {"act": m["_anchor"].attrs.get("act", "silu"), "norm": False,
                                      **_batch(g.rows())},
                  check=_plain_ok, priority=35))

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows = g.tensors[op.inputs["wg"]].shape[0]
        vec = vec_inputs(op, normed(op))
        return adjust_tiles(op, g, row_tiles(op, g, want, [op.inputs["wg"], op.inputs["wu"]], vec, [],
                                             op.outputs["out"], rows))

    #: without the norm: TNW float, TN = TX, norm_w nullptr, eps 0 (unused), NORM false
    #: a batch: ``rms_gate_up_silu_seqs`` with F (the rows) and B after H
    call = Call(lambda op: "rms_gate_up_silu_seqs" if batched(op) else "rms_gate_up_silu",
                targs=(Type("tx", "x"), Type("tnw", "norm_w", otherwise="float"), Expr("tn", _staged),
                       Type("tw", "wg"), Type("to", "out"), HIDDEN,
                       Int("F", lambda op, g: g.tensors[op.inputs["wg"]].shape[0], when=batched),
                       Int("B", lambda op, g: seqs(op), when=batched), WF32,
                       Int("act", lambda op, g: ACTS.index(op.attrs.get("act", "silu")), default=0),
                       NORM, STAGED),
                args=(Ptr("x"), Ptr("norm_w"), Float("eps", "eps", fallback=0.0), Ptr("wg"), Ptr("wu"), Ptr("out"),
                      P0, P1, SMEM, RED),
                numbering=("x", "norm_w", "out", "wg", "wu"))

    @classmethod
    def own_smem(cls, op: Op, g: Graph) -> int:
        """Floats: x's elements at batch 1; a batch's staged ``[B, H]`` in its dtype (the norm's
        output, or x's own), rounded up to 16 bytes, then the partial sums of its pairs of rows
        (:func:`fusec.instructions.matvec_rows.pair_smem`)."""
        if batched(op):
            e = (op.attrs["norm_dtype"] if normed(op) else g.tensors[xin(op)].dtype).itemsize   # TN (_staged)
            return -(-g.tensors[xin(op)].numel * e // 16) * 4 + pair_smem(op)
        return g.tensors[xin(op)].numel

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        args = super().cuda_args(op, g, bufs)
        if batched(op):   # the batched dot (matvec_seqs, seqs_rows) and the kind's batch template
            args["uses"] = ("matvec_seqs", "seqs_rows", "rms_gate_up_silu_seqs")
        return args

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        """Rows ``[r0, r1)``: each dot in fp32 over n (the normed vector in the norm's dtype, or
        x in its own: exact in fp32), rounded to the output dtype as each ``F.linear`` rounds;
        SiLU unrounded (as the ``silu_mul`` semantics), GELU rounded; the product rounded once."""
        r0, r1 = tile.params["rows"]
        dt = env.g.tensors[op.outputs["out"]].dtype
        n = env.once((op.name, "staged"), lambda: staged(op, env, normed(op)))   # alike for every tile
        if batched(op):
            return cls._run_seqs(op, env, n.view(seqs(op), -1), r0, r1, dt)
        gate = (env.read(op.inputs["wg"])[r0:r1].float() @ n).to(dt).float()
        up = (env.read(op.inputs["wu"])[r0:r1].float() @ n).to(dt).float()
        env.flat(op.outputs["out"])[r0:r1] = _product(op, gate, up, dt)

    @classmethod
    def _run_seqs(cls, op: Op, env: Env, n: torch.Tensor, r0: int, r1: int, dt: torch.dtype) -> None:
        """A batched op's rows ``[r0, r1)`` for each sequence: n [B, H] its staged rows (fp32);
        the same roundings as at batch 1, per sequence; out [B, F] at those rows."""
        gate = (n @ env.read(op.inputs["wg"])[r0:r1].float().T).to(dt).float()
        up = (n @ env.read(op.inputs["wu"])[r0:r1].float().T).to(dt).float()
        env.flat(op.outputs["out"]).view(seqs(op), -1)[:, r0:r1] = _product(op, gate, up, dt)


def _product(op: Op, gate: torch.Tensor, up: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``act(gate) * up`` rounded once to ``dt`` (gate and up: rounded dots, fp32): SiLU
    unrounded (as the ``silu_mul`` semantics), GELU rounded first (its own op in PyTorch)."""
    act = op.attrs.get("act", "silu")
    if act == "silu":
        a = torch.nn.functional.silu(gate)
    else:
        a = torch.nn.functional.gelu(gate, approximate="tanh" if act == "gelu_tanh" else "none").to(dt).float()
    return (a * up).to(dt)
