"""Shared row tiling for matvec-based instruction kinds (rows of ``W @ x``)."""
from __future__ import annotations

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.semantics import rms_normalize
from fusec.instructions.base import Region, Tile, split_range


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
    x = env.read(op.inputs["x"]).reshape(-1).float()
    return env.read(op.inputs["w"])[r0:r1].float() @ x


def rms_rows_cuda_args(op: Op, g: Graph, bufs, weights: tuple[str, ...]) -> dict:
    """Template arguments shared by the RMSNorm + row-matvec kinds (x, norm, weights, out)."""
    i, o = op.inputs, op.outputs
    args = {"tx": bufs.ctype(i["x"]), "tnw": bufs.ctype(i["norm_w"]), "tn": bufs.cname(op.attrs["norm_dtype"]),
            "tw": bufs.ctype(i[weights[0]]), "to": bufs.ctype(o["out"]), "H": g.tensors[i["x"]].numel,
            "x": bufs.ptr(i["x"]), "norm_w": bufs.ptr(i["norm_w"]), "eps": repr(float(op.attrs["eps"])),
            "out": bufs.ptr(o["out"]), "wf32": "true" if op.attrs.get("w_fp32") else "false"}
    args.update({w: bufs.ptr(i[w]) for w in weights})
    return args


def rms_prologue(op: Op, env: Env):
    """RMSNorm of ``op.inputs["x"]`` with ``norm_w``/``eps``, recomputed per tile; fp32 [H]."""
    x = env.read(op.inputs["x"]).reshape(-1)
    return rms_normalize(x, env.read(op.inputs["norm_w"]), op.attrs["eps"], op.attrs["norm_dtype"],
                         op.attrs.get("w_fp32", False)).float()
