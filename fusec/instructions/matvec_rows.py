"""Shared row tiling for matvec-based instruction kinds (rows of ``W @ x``)."""
from __future__ import annotations

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.semantics import rms_normalize
from fusec.instructions.base import Region, Tile, split_range
from fusec.instructions.call import Expr, Flag, Int, Type
from fusec.instructions import prologue


def elt(g: Graph, t: str) -> int:
    """Bytes per element of tensor ``t``."""
    info = g.tensors[g.root(t)]
    return info.nbytes // max(1, info.numel)


def row_tiles(op: Op, g: Graph, want: int, weights: list[str], vec_inputs: list[str],
              row_inputs: list[str], out: str, rows: int, align: int = 1) -> list[Tile]:
    """Tiles over output rows ``[r0, r1)``: each streams rows of every weight in ``weights``.

    Args:
        weights: [rows, K] weight tensors read row-wise.
        vec_inputs: tensors read whole by every tile (the input vector, norm weight).
        row_inputs: [rows] tensors read at the tile's rows (residual).
        out: [rows] output written at the tile's rows.
    """
    tiles = []
    for i, (r0, r1) in enumerate(split_range(rows, want, align)):
        reads, wbytes, abytes = [], 0, 0
        for w in weights:
            k = g.tensors[w].shape[-1]
            reads.append(Region.of(g, w, r0 * k, r1 * k))
            wbytes += (r1 - r0) * k * elt(g, w)
        for v in vec_inputs:
            reads.append(Region.whole(g, v))
            abytes += g.tensors[v].nbytes
        for r in row_inputs:
            reads.append(Region.of(g, r, r0, r1))
            abytes += (r1 - r0) * elt(g, r)
        abytes += (r1 - r0) * elt(g, out)
        tiles.append(Tile(op.name, i, {"rows": [r0, r1]}, reads, [Region.of(g, out, r0, r1)],
                          wbytes, abytes))
    return tiles


def rows_dot(op: Op, env: Env, r0: int, r1: int) -> torch.Tensor:
    """``W[r0:r1] @ x`` in fp32 (unrounded) for a row-tiled matvec kind (inputs ``w``, ``x``)."""
    return env.read(op.inputs["w"])[r0:r1].float() @ staged(op, env, False)


def staged(op: Op, env: Env, norm: bool) -> torch.Tensor:
    """The vector a row-tiled kind stages, fp32 [H]: its folded prologue's result
    (:mod:`fusec.instructions.prologue`), else RMSNorm(x) (``norm``), else x."""
    if prologue.has(op):
        return prologue.run(op, env)
    if norm:
        return rms_prologue(op, env)
    return env.read(op.inputs["x"]).reshape(-1).float()


def rms_attrs(g: Graph, rms: Op) -> dict:
    """The attributes a fused kind takes from the ``rmsnorm`` op it absorbs (its eps and the
    dtype its output had)."""
    return {"eps": rms.attrs["eps"], "norm_dtype": g.tensors[rms.outputs["out"]].dtype}


def rms_types(w: str, out: str = "out") -> tuple:
    """The template arguments the RMSNorm-prologue kinds start with: TX, TNW, TN (the norm's
    output dtype), TW (weight ``w``), TO (output ``out``)."""
    return (Type("tx", "x"), Type("tnw", "norm_w", otherwise="float"), Expr("tn", lambda op, g, bufs: bufs.cname(op.attrs["norm_dtype"])),
            Type("tw", w), Type("to", out))


#: H: the hidden size (elements of x)
HIDDEN = Int("H", lambda op, g: g.tensors[prologue.xin(op)].numel)


#: WF32: the norm weight applied in fp32 (Gemma); C++ default false
WF32 = Flag("wf32", fn=lambda op: op.attrs.get("w_fp32", False), default="false")


def normed(op: Op) -> bool:
    """Whether an RMSNorm-prologue kind norms x itself (attr ``norm``, default True): False where
    no RMSNorm makes its input (a post-norm MLP, a LayerNorm folded in as its prologue)."""
    return op.attrs.get("norm", True)


#: NORM: the kind norms x itself (:func:`normed`); false: x staged as it is; C++ default true
NORM = Flag("norm", fn=normed, default="true")


def rms_prologue(op: Op, env: Env):
    """RMSNorm of ``op.inputs["x"]`` with ``norm_w``/``eps``, recomputed per tile; fp32 [H]."""
    x = env.read(op.inputs["x"]).reshape(-1)
    return rms_normalize(x, env.read(op.inputs["norm_w"]), op.attrs["eps"], op.attrs["norm_dtype"],
                         op.attrs.get("w_fp32", False)).float()
