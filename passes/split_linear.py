"""split_linear: a fused projection becomes one linear per piece over row views of its weight.

Phi-3 (and any model with a fused projection) computes q/k/v as one ``qkv_proj`` whose output
it slices along the last dim, and gate/up as one ``gate_up_proj`` whose output it chunks. Piece
``[r0, r1)`` of ``W @ x (+ b)`` along the last dim is ``W[r0:r1] @ x (+ b[r0:r1])``, and
``W[r0:r1]`` is a contiguous block of ``W``'s memory: a *view* (``TensorInfo.offset``,
docs/ir.md "Views"). So each piece becomes its own linear, and the fusion rules of Llama's
separate projections (``rms_qkv_rope``, ``rms_gate_up_silu``, ``matvec_group`` ...) apply with no
kind of their own; a row range nothing reads is not computed at all.

Expects: a normalized graph (views are aliases), at the ATen level (before ``recognize``): a
linear is ``mm(x, permute(w, [1, 0]))`` or ``addmm(b, x, permute(w, [1, 0]))`` (default
``beta``/``alpha``), the patterns ``recognize`` raises to ``linear``.

Guarantees, with the same values: such a linear whose ``w`` ([N, K]) and ``b`` ([N], if any)
are model weights (root role ``weight``) and whose output is read only by pieces that each take
one range of every row of N is replaced by one ``permute`` + ``mm``/``addmm`` per piece that
anything reads, over the views ``w[r0:r1]`` (``[r1 - r0, K]`` at offset ``r0 * K``) and
``b[r0:r1]``; each piece's tensor becomes an alias of its new linear's output. A piece is an op
of :data:`fusec.ir.pieces.PIECE_KINDS` over the linear's output or an alias of it
(:func:`fusec.ir.pieces.pieces`): a ``slice`` with step 1, ``split_with_sizes``, ``split``
(``chunk`` decomposes to ``split``), ``select`` or an ``index`` by a constant of consecutive
integers, along the last dim or along a dim of a view to heads when the dims between the row's
start and it are of size 1 (Falcon-7B's multi-query ``view(.., H + 2, D)`` then
``[..., :-2, :]``, ``[..., [-2], :]``, ``[..., [-1], :]``: q, k and v are rows ``[0, H * D)``,
``[H * D, (H + 1) * D)``, ``[(H + 1) * D, (H + 2) * D)``); the pieces are disjoint, non-empty,
and every view starts at a 16-byte-aligned offset (the kernels' vector loads; the runtime aligns
the weight itself). Anything else is left alone: a linear whose output is also read whole or is a
graph output, overlapping pieces, a piece of several ranges of a row (GPT-NeoX's qkv, interleaved
per head: ``view(.., H, 3 * D)`` then ``chunk(3, -1)``; ``rms_qkv_rope`` reads those through a head
stride instead, :func:`fusec.instructions.qkv_match.match_qkv`), GPT-2's ``Conv1D`` (``addmm``
without the permute: its weight is ``[K, N]``, a piece is columns), an activation or constant as
the weight. Dead ops are removed.
"""
from __future__ import annotations

import logging

from fusec.ir import Graph, Op, Ref, Role, TensorInfo
from fusec.ir.pattern import Matcher
from fusec.ir.pieces import ALIGN, pieces as cut_pieces
from fusec.passes import dce

log = logging.getLogger("fusec.passes.split_linear")

def _plan(g: Graph, mm: Op, b: dict, users: dict[str, list[Op]], outputs: set[str]):
    """The pieces of linear ``mm`` (bindings ``b``) as ``(start, stop, tensor)`` sorted by
    start, and the piece ops to remove; None when it is not split (module docstring)."""
    w, bias = b["w"], b.get("b")
    winfo = g.tensors[w]
    if g.tensors[g.root(w)].role != Role.WEIGHT or len(winfo.shape) != 2 or winfo.sym:
        return None
    n, k = winfo.shape
    if bias is not None:
        binfo = g.tensors[bias]
        if g.tensors[g.root(bias)].role != Role.WEIGHT or tuple(binfo.shape) != (n,):
            return None
    if mm.kind == "aten.addmm.default" and (len(mm.attrs.get("args", ())) > 3 or mm.attrs.get("kwargs")):
        return None   # beta / alpha given
    root = g.root(mm.outputs["out"])
    if root in outputs:
        return None
    readers = users.get(root, [])
    pieces, piece_ops = [], []
    for r in readers:
        src = r.inputs.get("in0")
        cut = cut_pieces(g, r, n) if src is not None and g.root(src) == root else None
        if cut is None or not all(rows.contiguous for rows, _ in cut):
            return None   # not a piece op, or a piece of several ranges (rms_qkv_rope reads those)
        got = [(rows.start, rows.start + rows.block, t) for rows, t in cut]
        lead = g.tensors[src].numel // n
        if any(g.tensors[t].numel != lead * (e - a) or g.root(t) != t for a, e, t in got):
            return None   # not the piece's shape (or already an alias): leave it
        read = [(a, e, t) for a, e, t in got if users.get(g.root(t)) or g.root(t) in outputs]
        pieces += read
        piece_ops.append(r)
    if not pieces:
        return None
    pieces.sort()
    for (a, e, _), nxt in zip(pieces, pieces[1:] + [None]):
        if e <= a or (nxt is not None and nxt[0] < e):
            return None   # empty, or overlapping the next
        if (a * k * winfo.dtype.itemsize) % ALIGN or \
                (bias is not None and (a * g.tensors[bias].dtype.itemsize) % ALIGN):
            return None
    if len(pieces) == 1 and pieces[0][:2] == (0, n):
        return None   # the whole output: nothing to split
    return pieces, piece_ops


def _fresh(g: Graph, base: str, shape: tuple[int, ...], dtype) -> str:
    """A new intermediate tensor named as the op that makes it (FX's convention)."""
    name = g.fresh_name(base)
    g.add_tensor(TensorInfo(name, tuple(int(s) for s in shape), dtype))
    return name


def run(g: Graph) -> Graph:
    m = Matcher(g)
    from fusec.passes.recognize import LINEAR, LINEAR_BIAS
    users = g.users()
    outputs = {g.root(t) for t in g.outputs}
    drop: set[str] = set()
    new_ops: list[Op] = []
    split = 0
    for o in g.ops:
        b = None
        if o.kind == "aten.mm.default":
            b = m.match_op(LINEAR, o)
        elif o.kind == "aten.addmm.default":
            b = m.match_op(LINEAR_BIAS, o)
        plan = _plan(g, o, b, users, outputs) if b is not None else None
        if plan is None:
            if o.name not in drop:
                new_ops.append(o)
            continue
        pieces, piece_ops = plan
        drop |= {p.name for p in piece_ops}
        perm = next(p for p in b["_ops"] if p.kind == "aten.permute.default")
        w, bias = b["w"], b.get("b")
        k = g.tensors[w].shape[1]
        out = g.tensors[o.outputs["out"]]
        for a, e, t in pieces:
            rows = e - a
            wv = g.new_tensor(f"{w}_rows{a}", (rows, k), g.tensors[w].dtype, alias_of=w, offset=a * k)
            pv = _fresh(g, f"{perm.name}_rows{a}", (k, rows), g.tensors[perm.outputs["out"]].dtype)
            new_ops.append(Op(pv, perm.kind, {"in0": wv}, {"out": pv}, attrs=dict(perm.attrs), source=perm.source))
            inputs = {}
            for slot, x in o.inputs.items():
                if x == perm.outputs["out"]:
                    inputs[slot] = pv
                elif bias is not None and x == bias:
                    inputs[slot] = g.new_tensor(f"{bias}_rows{a}", (rows,), g.tensors[bias].dtype,
                                                alias_of=bias, offset=a)
                else:
                    inputs[slot] = x
            y = _fresh(g, f"{o.name}_rows{a}", (*out.shape[:-1], rows), out.dtype)
            new_ops.append(Op(y, o.kind, inputs, {"out": y}, attrs=dict(o.attrs), source=o.source))
            piece = g.tensors[t]
            piece.alias_of, piece.offset = y, None
        split += 1
    g.ops = new_ops
    if split:
        log.debug("split %d fused linears into row views", split)
    return dce.run(g)
