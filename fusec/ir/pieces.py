"""Pieces of a product: which elements of each row a slice, split, index or select takes.

A fused projection (Phi-3's ``qkv_proj``, Falcon's and GPT-NeoX's ``query_key_value``, GPT-2's
``c_attn``) computes q, k and v as one product ``y`` of ``N`` values per row, which the model
then views and cuts into pieces. Where the cut falls depends on the view:

* Phi-3, GPT-2: ``y[..., a:b]`` or ``y.split(E, dim=-1)``: one range of each row;
* Falcon-7B (multi-query): ``y.view(.., H + 2, D)`` then ``[..., :-2, :]``, ``[..., [-2], :]``,
  ``[..., [-1], :]``: still one range per piece, cut along a dim that is not the last;
* GPT-NeoX / Pythia, Falcon-RW: ``y.view(.., H, 3 * D)`` (or ``[.., H, 3, D]``) then
  ``chunk(3, -1)`` (or ``[..., j, :]``): per head, ``H`` blocks of ``D`` values, ``3 * D``
  apart: the weight is interleaved per head.

:func:`pieces` describes each output of such an op as :class:`Rows` (``count`` blocks of
``block`` consecutive elements, the first at ``start``, each ``stride`` after the one before),
from the op's arguments and its input's shape alone. The ``split_linear`` pass makes linears
over row views of the weight from contiguous pieces (one block); ``rms_qkv_rope`` reads
head-interleaved ones (one head per block) through a stride; ``matvec_cols`` writes contiguous
ones into a KV cache as its epilogue.

Expects a normalized graph (views are aliases). Piece kinds: ``aten.slice.Tensor`` (step 1),
``aten.split.Tensor`` / ``aten.split_with_sizes.default`` (``chunk`` decomposes to ``split``),
``aten.select.int``, and ``aten.index.Tensor`` with one index tensor, a compile-time constant
of consecutive ascending integers (HF's ``x[..., [-2], :]``). Source: PyTorch's view semantics
of these ops over a contiguous tensor.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from fusec.ir.graph import Graph, Op, Ref, Role

#: a view of a weight that a piece makes starts this many bytes (a multiple) from its root's
#: first: the kernels' 16-byte vector loads (the runtime aligns the weight itself)
ALIGN = 16

#: the op kinds that cut a tensor into pieces (:func:`pieces`)
PIECE_KINDS = ("aten.slice.Tensor", "aten.split_with_sizes.default", "aten.split.Tensor", "aten.select.int",
               "aten.index.Tensor")


@dataclasses.dataclass(frozen=True)
class Rows:
    """Elements of one row of ``N`` of a product that a piece takes: ``count`` blocks of
    ``block`` consecutive elements, block ``i`` at ``start + i * stride``. With ``count`` 1 the
    piece is the range ``[start, start + block)`` (``stride`` is then ``block``)."""

    start: int
    block: int
    stride: int
    count: int

    @property
    def size(self) -> int:
        """Elements per row of the product the piece takes."""
        return self.block * self.count

    @property
    def contiguous(self) -> bool:
        """Whether the piece is one range of the row."""
        return self.count == 1

    @property
    def stop(self) -> int:
        """One past the last element the piece takes (of the bounding range)."""
        return self.start + (self.count - 1) * self.stride + self.block

    def indices(self) -> list[int]:
        """The row's elements the piece takes, in the piece's order."""
        return [self.start + i * self.stride + j for i in range(self.count) for j in range(self.block)]


def _arg(op: Op, i: int, name: str, default):
    args, kwargs = op.attrs.get("args", ()), op.attrs.get("kwargs", {})
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _constant_ints(g: Graph, t: str) -> list[int] | None:
    """The values of a compile-time integer tensor ``t`` (a 1-D constant), else None."""
    root = g.tensors[g.root(t)]
    if root.role != Role.CONSTANT or root.value is None or root.value.dtype.is_floating_point \
            or root.value.dtype == torch.bool or g.tensors[t].numel != root.value.numel() \
            or len(g.tensors[t].shape) != 1:
        return None
    return [int(v) for v in root.value.reshape(-1).tolist()]


def _cut(op: Op, g: Graph, s: tuple[int, ...]) -> tuple[int, list[tuple[int, int, str]]] | None:
    """(dim, [(a, b, tensor), ...]): the dim the piece op cuts (of its input's shape ``s``) and
    its outputs as index ranges ``[a, b)`` along it, or None when ``op`` is not a piece op of a
    form :func:`pieces` takes."""
    nd = len(s)
    if op.kind == "aten.index.Tensor":
        idx = _arg(op, 1, "indices", None)
        if not isinstance(idx, (list, tuple)) or len(idx) > nd:
            return None
        given = [(d, i) for d, i in enumerate(idx) if i is not None]
        if len(given) != 1 or not isinstance(given[0][1], Ref) or given[0][1].slot not in op.inputs:
            return None
        d, ref = given[0]
        size = s[d]
        vals = _constant_ints(g, op.inputs[ref.slot])
        if not vals or any(v < -size or v >= size for v in vals):
            return None
        vals = [v % size for v in vals]
        if vals != list(range(vals[0], vals[0] + len(vals))):
            return None   # not consecutive ascending: a gather, not a range
        return d, [(vals[0], vals[0] + len(vals), op.outputs["out"])]
    if any(isinstance(a, Ref) for a in op.attrs.get("args", ())[1:]):
        return None
    dim = _arg(op, 1 if op.kind in ("aten.slice.Tensor", "aten.select.int") else 2, "dim", 0)
    if not isinstance(dim, int) or not -nd <= dim < nd:
        return None
    dim %= nd
    size = s[dim]
    if op.kind == "aten.slice.Tensor":
        start, end, step = _arg(op, 2, "start", None), _arg(op, 3, "end", None), _arg(op, 4, "step", 1)
        if step != 1 or not all(v is None or isinstance(v, int) for v in (start, end)):
            return None
        start = 0 if start is None else (start + size if start < 0 else start)
        end = size if end is None else (end + size if end < 0 else end)
        start, end = max(0, min(size, start)), max(0, min(size, end))
        return dim, [(start, max(start, end), op.outputs["out"])]
    if op.kind == "aten.select.int":
        i = _arg(op, 2, "index", None)
        if not isinstance(i, int) or not -size <= i < size:
            return None
        return dim, [(i % size, i % size + 1, op.outputs["out"])]
    if op.kind == "aten.split_with_sizes.default":
        sizes = _arg(op, 1, "split_sizes", None)
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(v, int) and v >= 0 for v in sizes) \
                or sum(sizes) != size:
            return None
    else:
        step = _arg(op, 1, "split_size", None)
        if not isinstance(step, int) or step <= 0:
            return None
        sizes = [min(step, size - a) for a in range(0, size, step)]
    out, a = [], 0
    for i, v in enumerate(sizes):
        t = op.outputs.get(f"out{i}")
        if t is not None:
            out.append((a, a + v, t))
        a += v
    return (dim, out) if len(op.outputs) == len(out) else None


def pieces(g: Graph, op: Op, n: int) -> list[tuple[Rows, str]] | None:
    """``[(rows, tensor), ...]``: what each output of the piece op ``op`` takes of each row of
    ``n`` elements of its input (a product ``[M, n]`` or an alias of it of any shape whose last
    dims hold the ``n``), or None when ``op`` is not a piece op (:data:`PIECE_KINDS`, literal
    arguments, one input ``in0``, for ``index`` the constant ``in1``), mutates, or cuts a dim
    outside one row (the rows' leading dims).

    The cut dim ``d`` of the input's shape ``s``: with ``j`` the last dim from which on the dims
    hold one row (``prod(s[j:]) == n``), a range ``[a, b)`` along ``d >= j`` takes
    ``prod(s[j:d])`` blocks of ``(b - a) * T`` elements, ``s[d] * T`` apart, the first at
    ``a * T`` (``T = prod(s[d + 1:])``): one range where ``prod(s[j:d])`` is 1 (or the range is
    all of dim ``d``)."""
    if op.kind not in PIECE_KINDS or op.mutates or "in0" not in op.inputs:
        return None
    if set(op.inputs) - ({"in0", "in1"} if op.kind == "aten.index.Tensor" else {"in0"}):
        return None
    args = op.attrs.get("args", ())
    if not args or args[0] != Ref("in0"):
        return None
    src = g.tensors[op.inputs["in0"]]
    s = tuple(int(v) for v in src.shape)
    if not s or src.sym or n <= 0 or src.numel % n:
        return None
    j = next((j for j in range(len(s), -1, -1) if math.prod(s[j:]) == n), None)
    cut = _cut(op, g, s)
    if j is None or cut is None or cut[0] < j:
        return None
    d = cut[0]
    inner, groups = math.prod(s[d + 1:]), math.prod(s[j:d])
    stride = s[d] * inner
    out = []
    for a, b, t in cut[1]:
        block = (b - a) * inner
        if groups == 1 or block == stride:   # one range of the row
            out.append((Rows(a * inner, block * groups, block * groups, 1), t))
        else:
            out.append((Rows(a * inner, block, stride, groups), t))
    return out


def piece_of(g: Graph, prods: dict[str, Op], t: str, n_of) -> tuple[Op, Op, Rows] | None:
    """``(piece op, product op, rows)`` when ``t`` (or its root) is a whole output of a piece
    op over (an alias of) the output of ``prods[...]``, a producing op for which ``n_of(op)``
    gives the elements per row (None: not a product); else None. ``prods``: root -> producer."""
    p = prods.get(g.root(t))
    if p is None or p.kind not in PIECE_KINDS or "in0" not in p.inputs:
        return None
    prod = prods.get(g.root(p.inputs["in0"]))
    n = n_of(prod) if prod is not None else None
    if not n:
        return None
    got = pieces(g, p, n)
    if got is None:
        return None
    for rows, out in got:
        if out == g.root(t):
            return p, prod, rows
    return None
