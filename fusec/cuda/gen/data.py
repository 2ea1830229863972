"""Layout and indexing ops: views materialized as copies (permute, transpose, expand, slice,
select, split ...), cat, repeat, constant_pad_nd, advanced indexing (index, index_select,
embedding, gather) and scatters (index_put, index_copy, slice_scatter, select_scatter).

A view's element map is taken from PyTorch itself: the op runs on a ``meta`` tensor of the
input's shape, and the result's strides and storage offset say where each output element
comes from (``out[i] = x[storage_offset + sum(coord_d(i) * stride_d)]``).
"""
from __future__ import annotations

from typing import Any

import torch

from fusec.abi import Fault
from fusec.ir import Ref
from fusec.cuda.gen import emitter
from fusec.cuda.gen.core import Ctx, broadcast_strides, contiguous_strides, literal, offset
from fusec.cuda.gen.pointwise import Operand, elementwise


def _meta_call(ctx: Ctx, fn: Any, metas: dict[str, torch.Tensor]) -> Any:
    def sub(a):
        if isinstance(a, Ref):
            return metas[ctx.op.inputs[a.slot]]
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a
    return fn(*sub(tuple(ctx.op.attrs["args"])), **{k: sub(v) for k, v in ctx.op.attrs["kwargs"].items()})


def meta_of(ctx: Ctx, t: str) -> torch.Tensor:
    return torch.empty(ctx.shape(t), dtype=ctx.dtype(t), device="meta")


def view_map(ctx: Ctx, view: torch.Tensor, base: torch.Tensor) -> tuple[list[int], int]:
    """(strides, storage offset) of ``view`` (a meta view of ``base``) in ``base``'s elements."""
    if view is not base and not view._is_view():
        raise ctx.fail("the op's result is not a view of its input")
    return list(view.stride()), int(view.storage_offset())


def strided_copy(ctx: Ctx, src: str, out: str, strides: list[int], base: int) -> None:
    """out[i] = src[base + sum(coord_d(i) * strides[d])] over out's shape (cast to out's dtype)."""
    ix = ctx.index_type()
    shape = ctx.shape(out)
    ctx.emit(ctx.loop(ctx.numel(out), "i", ix))
    if strides == contiguous_strides(shape) or ctx.numel(out) == 1:
        off = offset(["i"], [1], base) if ctx.numel(out) > 1 else str(base)
    else:
        off = offset(ctx.coords(shape, "i", ix), strides, base)
    ctx.emit(f"  {ctx.store(out, 'i', ctx.load(src, off), ctx.ctype(src))}", "}")


@emitter("aten.permute", "aten.transpose", "aten.t", "aten.expand", "aten.slice", "aten.select",
         "aten.narrow", "aten.unsqueeze", "aten.squeeze", "aten.view", "aten._unsafe_view",
         "aten.split", "aten.split_with_sizes", "aten.unfold", "aten.diagonal", "aten.as_strided",
         "aten.reshape", "aten.unbind", "aten.expand_as", "aten.view_as")
def _view(ctx: Ctx) -> None:
    """A view op, materialized: each output's element map comes from the op on a meta tensor."""
    ins = list(dict.fromkeys(ctx.op.inputs.values()))
    if len(ins) != 1:
        raise ctx.fail("a view of more than one tensor")
    x = ins[0]
    mx = meta_of(ctx, x)
    res = _meta_call(ctx, ctx.op.attrs["target"], {x: mx})
    res = [res] if isinstance(res, torch.Tensor) else list(res)
    outs = list(ctx.op.outputs.values())
    if len(res) != len(outs):
        raise ctx.fail(f"{len(res)} results for {len(outs)} outputs")
    for r, o in zip(res, outs):
        if tuple(r.shape) != ctx.shape(o):
            raise ctx.fail(f"meta result shape {tuple(r.shape)} differs from {ctx.shape(o)}")
        strides, base = view_map(ctx, r, mx)
        strided_copy(ctx, x, o, strides, base)


@emitter("aten.cat")
def _cat(ctx: Ctx) -> None:
    """cat(tensors, dim): each input copied (cast) into its slice of the output."""
    out = ctx.out
    oshape = list(ctx.shape(out))
    dim = ctx.args.get("dim", 0) % max(len(oshape), 1)
    ost = contiguous_strides(oshape)
    ix = ctx.index_type()
    pos = 0
    for ref in ctx.args["tensors"]:
        t = ctx.tensor(ref)
        if t is None:
            raise ctx.fail("a cat input is not a tensor")
        shape = ctx.shape(t)
        if ctx.numel(t) == 0:
            continue
        if len(shape) != len(oshape):
            raise ctx.fail(f"cat input of shape {shape} into {tuple(oshape)}")
        ctx.emit(ctx.loop(ctx.numel(t), "i", ix))
        coords = ctx.coords(shape, "i", ix)
        ctx.emit(f"  {ctx.store(out, offset(coords, ost, pos * ost[dim]), ctx.load(t, 'i'), ctx.ctype(t))}", "}")
        pos += shape[dim]
    if pos != oshape[dim]:
        raise ctx.fail(f"cat inputs cover {pos} of {oshape[dim]} rows")


@emitter("aten.repeat")
def _repeat(ctx: Ctx) -> None:
    x, out = ctx.arg_tensor("self"), ctx.out
    xs, oshape = list(ctx.shape(x)), list(ctx.shape(out))
    pad = len(oshape) - len(xs)
    ix = ctx.index_type()
    xst = contiguous_strides(xs)
    ctx.emit(ctx.loop(ctx.numel(out), "i", ix))
    coords = ctx.coords(oshape, "i", ix)
    src = [f"({coords[pad + d]} % {xs[d]})" if coords[pad + d] != "0" and xs[d] != oshape[pad + d]
           else coords[pad + d] for d in range(len(xs))]
    ctx.emit(f"  {ctx.store(out, 'i', ctx.load(x, offset(src, xst)), ctx.ctype(x))}", "}")


@emitter("aten.constant_pad_nd")
def _pad(ctx: Ctx) -> None:
    x, out = ctx.arg_tensor("self"), ctx.out
    xs, oshape = list(ctx.shape(x)), list(ctx.shape(out))
    pads = list(ctx.args["pad"])
    value = ctx.args.get("value", 0) or 0
    before = [0] * len(xs)
    for j in range(len(pads) // 2):
        before[len(xs) - 1 - j] = pads[2 * j]
    ix = ctx.index_type()
    xst = contiguous_strides(xs)
    ct = ctx.ctype(out)
    vt = "float" if ctx.dtype(out).is_floating_point else ("bool" if ct == "bool" else "i64")
    ctx.emit(ctx.loop(ctx.numel(out), "i", ix))
    coords = ctx.coords(oshape, "i", ix)
    conds, src = [], []
    for d in range(len(xs)):
        c = coords[d] if before[d] == 0 else f"({coords[d]} - {before[d]})"
        src.append(c)
        if before[d] > 0 or oshape[d] - before[d] > xs[d]:
            conds.append(f"{c} >= 0 && {c} < {xs[d]}")
    cond = " && ".join(conds) or "true"
    ctx.emit(f"  if ({cond}) {ctx.store(out, 'i', ctx.load(x, offset(src, xst)), ctx.ctype(x))}",
             f"  else {ctx.store(out, 'i', literal(value, vt), vt)}", "}")


# --- advanced indexing ---------------------------------------------------------------------------
class Indexing:
    """x[indices] with PyTorch's advanced-indexing rules: ``indices`` lists one entry per
    leading dim of x, None (the whole dim) or an integer tensor; the index tensors broadcast
    to a shape B, which replaces the indexed dims in the result when they are adjacent and
    leads the result otherwise."""

    def __init__(self, ctx: Ctx, x: str, indices: list[str | None], code: Fault = Fault.INDEX, wrap: bool = True):
        self.ctx, self.x, self.code, self.wrap = ctx, x, code, wrap
        self.xs = list(ctx.shape(x))
        self.idx = list(indices) + [None] * (len(self.xs) - len(indices))
        for t in self.idx:
            if t is not None and ctx.dtype(t) not in (torch.int64, torch.int32):
                raise ctx.fail(f"index tensor of dtype {ctx.dtype(t)} (only int64/int32 indices have a CUDA form)")
        self.P = [d for d, t in enumerate(self.idx) if t is not None]
        self.B = list(torch.broadcast_shapes(*[ctx.shape(self.idx[d]) for d in self.P])) if self.P else []
        self.adjacent = self.P == list(range(self.P[0], self.P[-1] + 1)) if self.P else True
        rest = [d for d in range(len(self.xs)) if d not in self.P]
        if self.adjacent and self.P:
            self.lead = [d for d in rest if d < self.P[0]]
            self.tail = [d for d in rest if d > self.P[-1]]
        else:
            self.lead, self.tail = [], rest
        self.shape = [self.xs[d] for d in self.lead] + self.B + [self.xs[d] for d in self.tail]

    def x_offset(self, rc: list[str], ok: str, ix: str) -> str:
        """Emit the x offset of result coordinates ``rc`` (``ok`` cleared on a bad index);
        returns the name of the offset variable."""
        ctx = self.ctx
        xst = contiguous_strides(self.xs)
        nl, nb = len(self.lead), len(self.B)
        bc = rc[nl:nl + nb]
        terms = [(c, xst[d]) for c, d in zip(rc[:nl], self.lead)] + \
                [(c, xst[d]) for c, d in zip(rc[nl + nb:], self.tail)]
        xo = ctx.fresh("xo")
        ctx.emit(f"i64 {xo} = {offset([c for c, _ in terms], [s for _, s in terms])};")
        for d in self.P:
            t = self.idx[d]
            v = ctx.fresh("ix")
            off = offset(bc, broadcast_strides(ctx.shape(t), self.B))
            ctx.emit(f"i64 {v} = {ctx.load_as(t, off, 'i64')};")
            if self.wrap:
                ctx.emit(f"if ({v} < 0) {v} += {self.xs[d]};")
            ctx.emit(f"if (!index_ok({v}, {self.xs[d]}, {int(self.code)})) {ok} = false;",
                     f"{xo} += {v} * {xst[d]};")
        return xo


def gather_rows(ctx: Ctx, ind: Indexing, out: str) -> None:
    """out = x[indices] (out has the indexing result's shape); a bad index writes 0."""
    if list(ctx.shape(out)) != ind.shape:
        raise ctx.fail(f"index result shape {ind.shape} differs from {list(ctx.shape(out))}")
    ix = ctx.index_type()
    ctx.emit(ctx.loop(ctx.numel(out), "i", ix))
    rc = ctx.coords(ind.shape, "i", ix)
    ctx.emit("bool ok = true;")
    xo = ind.x_offset(rc, "ok", ix)
    val = f"ok ? {ctx.load(ind.x, xo)} : gx_cast<{ctx.ctype(ind.x)}>(0)"
    ctx.emit(ctx.store(out, "i", val, ctx.ctype(ind.x)), "}")


def _index_list(ctx: Ctx, v: Any) -> list[str | None]:
    return [None if a is None else ctx.tensor(a) for a in v]


@emitter("aten.index", "aten._unsafe_index")
def _index(ctx: Ctx) -> None:
    gather_rows(ctx, Indexing(ctx, ctx.arg_tensor("self"), _index_list(ctx, ctx.args["indices"])), ctx.out)


@emitter("aten.index_select")
def _index_select(ctx: Ctx) -> None:
    x = ctx.arg_tensor("self")
    dim = ctx.args["dim"] % max(len(ctx.shape(x)), 1)
    idx = ctx.arg_tensor("index")
    # no negative index: eager raises for one (index_select does not count from the end)
    gather_rows(ctx, Indexing(ctx, x, [None] * dim + [idx], wrap=False), ctx.out)


@emitter("aten.embedding")
def _embedding(ctx: Ctx) -> None:
    """embedding(weight, ids, padding_idx, ...): weight[ids] (padding_idx only matters to the
    gradient); an out-of-range id is an index fault (TOKEN_ID) and gives a zero row."""
    gather_rows(ctx, Indexing(ctx, ctx.arg_tensor("weight"), [ctx.arg_tensor("indices")], Fault.TOKEN_ID,
                              wrap=False), ctx.out)


@emitter("aten.gather")
def _gather(ctx: Ctx) -> None:
    """gather(x, dim, index): out[c] = x[c with c[dim] = index[c]] (out has index's shape); an
    index outside ``[0, x.shape[dim])`` (a negative one too, as eager raises) is an index fault
    (INDEX) and gives 0."""
    x, idx, out = ctx.arg_tensor("self"), ctx.arg_tensor("index"), ctx.out
    xs = list(ctx.shape(x))
    dim = ctx.args["dim"] % max(len(xs), 1)
    xst = contiguous_strides(xs)
    ix = ctx.index_type()
    ctx.emit(ctx.loop(ctx.numel(out), "i", ix))
    rc = ctx.coords(ctx.shape(out), "i", ix)
    ctx.emit(f"i64 v = {ctx.load_as(idx, 'i', 'i64')};",
             f"const bool ok = index_ok(v, {xs[dim]}, {int(Fault.INDEX)});")
    terms = [c for d, c in enumerate(rc) if d != dim]
    sts = [xst[d] for d in range(len(xs)) if d != dim]
    val = f"ok ? {ctx.load(x, 'xo')} : gx_cast<{ctx.ctype(x)}>(0)"
    ctx.emit(f"const i64 xo = {offset(terms, sts)} + v * {xst[dim]};",
             ctx.store(out, "i", val, ctx.ctype(x)), "}")


def _copy_self(ctx: Ctx, x: str, out: str) -> None:
    """out = x (the functional scatters start from a copy), then a CTA barrier."""
    if ctx.g.root(x) != ctx.g.root(out):
        elementwise(ctx, [Operand(tensor=x)], ctx.ctype(x), lambda a: a, out=out)
        ctx.emit("GX_SYNC();")


def scatter_rows(ctx: Ctx, ind: Indexing, values: str, out: str, accumulate: bool) -> None:
    """out[indices] = values (or += with ``accumulate``), values broadcast to the indexing
    result's shape. Threads own the non-indexed positions and walk the index entries in order,
    so duplicate indices are deterministic (the last one wins; accumulation is race-free)."""
    ix = ctx.index_type(*ind.shape)
    nl, nb = len(ind.lead), len(ind.B)
    rest = [ind.shape[d] for d in range(len(ind.shape)) if not nl <= d < nl + nb]
    nrest = 1
    for s in rest:
        nrest *= s
    nB = 1
    for s in ind.B:
        nB *= s
    try:
        vst = broadcast_strides(ctx.shape(values), ind.shape)
    except ValueError as e:
        raise ctx.fail(str(e)) from None
    ctx.emit(ctx.loop(nrest, "q", ix))
    qc = ctx.coords(rest, "q", ix)
    ctx.emit(f"for ({ix} b = 0; b < {nB}; ++b) {{")
    bc = ctx.coords(ind.B, "b", ix)
    rc = qc[:nl] + bc + qc[nl:]
    ctx.emit("bool ok = true;")
    xo = ind.x_offset(rc, "ok", ix)
    ot = ctx.ctype(out)
    val = ctx.load(values, offset(rc, vst))
    if accumulate:
        ct = "float" if ctx.dtype(out).is_floating_point else ("bool" if ot == "bool" else "i64")
        op = "||" if ct == "bool" else "+"
        acc = f"gx_cast<{ct}>({ctx.load(out, xo)}) {op} gx_cast<{ct}>({val})"
        ctx.emit(f"if (ok) {ctx.store(out, xo, acc, ct)}")
    else:
        ctx.emit(f"if (ok) {ctx.store(out, xo, val, ctx.ctype(values))}")
    ctx.emit("}", "}")


@emitter("aten.index_put")
def _index_put(ctx: Ctx) -> None:
    x, out = ctx.arg_tensor("self"), ctx.out
    ind = Indexing(ctx, x, _index_list(ctx, ctx.args["indices"]))
    _copy_self(ctx, x, out)
    scatter_rows(ctx, ind, ctx.arg_tensor("values"), out, bool(ctx.args.get("accumulate")))


@emitter("aten.index_copy")
def _index_copy(ctx: Ctx) -> None:
    x, out = ctx.arg_tensor("self"), ctx.out
    dim = ctx.args["dim"] % max(len(ctx.shape(x)), 1)
    ind = Indexing(ctx, x, [None] * dim + [ctx.arg_tensor("index")])
    _copy_self(ctx, x, out)
    scatter_rows(ctx, ind, ctx.arg_tensor("source"), out, False)


@emitter("aten.slice_scatter", "aten.select_scatter")
def _view_scatter(ctx: Ctx) -> None:
    """out = self with its slice (select) view replaced by src (cast to out's dtype)."""
    x, src, out = ctx.arg_tensor("self"), ctx.arg_tensor("src"), ctx.out
    mx = meta_of(ctx, out)
    a = ctx.args
    if "slice" in ctx.op.kind:
        v = torch.ops.aten.slice.Tensor(mx, a.get("dim", 0), a.get("start"), a.get("end"), a.get("step", 1) or 1)
    else:
        v = torch.ops.aten.select.int(mx, a["dim"], a["index"])
    strides, base = view_map(ctx, v, mx)
    if tuple(v.shape) != ctx.shape(src):
        raise ctx.fail(f"src shape {ctx.shape(src)} differs from the view's {tuple(v.shape)}")
    _copy_self(ctx, x, out)
    ix = ctx.index_type()
    ctx.emit(ctx.loop(ctx.numel(src), "i", ix))
    off = offset(ctx.coords(ctx.shape(src), "i", ix), strides, base)
    ctx.emit(f"  {ctx.store(out, off, ctx.load(src, 'i'), ctx.ctype(src))}", "}")
