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
are model weights (root role ``weight``) and whose output is read only by pieces along its last
dim is replaced by one ``permute`` + ``mm``/``addmm`` per piece that anything reads, over the
views ``w[r0:r1]`` (``[r1 - r0, K]`` at offset ``r0 * K``) and ``b[r0:r1]``; each piece's tensor
becomes an alias of its new linear's output. A piece is a ``slice`` with step 1,
``split_with_sizes`` or ``split`` (``chunk`` decomposes to ``split``) over the linear's output
or a whole alias of it whose last dim is N; the pieces are disjoint, non-empty, and every view
starts at a 16-byte-aligned offset (the kernels' vector loads; the runtime aligns the weight
itself). Anything else is left alone: a linear whose output is also read whole or is a graph
output, overlapping pieces, pieces along another dim or of a view that is not ``[..., N]``
(GPT-NeoX's qkv: a view to heads, then a split along a non-last dim; Falcon's: the same; the
pieces are not contiguous row ranges), GPT-2's ``Conv1D`` (``addmm`` without the permute: its
weight is ``[K, N]``, a piece is columns), an activation or constant as the weight. Dead ops
are removed.
"""
from __future__ import annotations

import logging

from fusec.ir import Graph, Op, Ref, Role, TensorInfo
from fusec.ir.pattern import Matcher
from fusec.passes import dce

log = logging.getLogger("fusec.passes.split_linear")

_PIECE_KINDS = ("aten.slice.Tensor", "aten.split_with_sizes.default", "aten.split.Tensor")
#: a view's first byte is a multiple of this from its root's (as the root's is, in memory)
ALIGN = 16


def _arg(op: Op, i: int, name: str, default):
    args, kwargs = op.attrs.get("args", ()), op.attrs.get("kwargs", {})
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _pieces(g: Graph, op: Op, n: int) -> list[tuple[int, int, str]] | None:
    """``(start, stop, tensor)`` of each output of the piece op ``op`` over a tensor whose last
    dim is the linear's ``n`` outputs, or None when ``op`` is not such a piece."""
    if op.kind not in _PIECE_KINDS or op.mutates or len(op.inputs) != 1 or "in0" not in op.inputs:
        return None
    args = op.attrs.get("args", ())
    if not args or args[0] != Ref("in0") or any(isinstance(a, Ref) for a in args[1:]):
        return None
    src = g.tensors[op.inputs["in0"]]
    if not src.shape or src.shape[-1] != n or src.sym:
        return None
    nd = len(src.shape)
    default_dim = 0
    dim = _arg(op, 1 if op.kind == "aten.slice.Tensor" else 2, "dim", default_dim)
    if not isinstance(dim, int) or dim % nd != nd - 1:
        return None
    if op.kind == "aten.slice.Tensor":
        start, end, step = _arg(op, 2, "start", None), _arg(op, 3, "end", None), _arg(op, 4, "step", 1)
        if step != 1 or not all(v is None or isinstance(v, int) for v in (start, end)):
            return None
        start = 0 if start is None else (start + n if start < 0 else start)
        end = n if end is None else (end + n if end < 0 else end)
        start, end = max(0, min(n, start)), max(0, min(n, end))
        return [(start, end, op.outputs["out"])]
    if op.kind == "aten.split_with_sizes.default":
        sizes = _arg(op, 1, "split_sizes", None)
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in sizes) \
                or sum(sizes) != n:
            return None
    else:
        size = _arg(op, 1, "split_size", None)
        if not isinstance(size, int) or size <= 0:
            return None
        sizes = [min(size, n - a) for a in range(0, n, size)]
    out, a = [], 0
    for i, s in enumerate(sizes):
        t = op.outputs.get(f"out{i}")
        if t is not None:
            out.append((a, a + s, t))
        a += s
    return out if len(op.outputs) == len(out) else None


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
        got = _pieces(g, r, n) if src is not None and g.root(src) == root else None
        if got is None:
            return None
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
