"""Reductions (sum, mean, amax, amin, any, prod, max/min with indices, argmax/argmin,
var_mean), softmax / log_softmax and topk over any dims: one warp per output row, lanes
stride over the reduced elements (fp32 accumulation for floating inputs, int64 for integers),
then a warp shuffle reduction."""
from __future__ import annotations

from typing import Any, Sequence

from fusec.cuda.gen import emitter
from fusec.cuda.gen.core import Ctx, contiguous_strides, literal, offset
from fusec.cuda.gen.pointwise import out_ct


def norm_dims(dims: Any, ndim: int) -> list[int]:
    """Reduced dims as sorted non-negative ints; None or [] means every dim (PyTorch)."""
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    dims = list(dims)
    if not dims:
        return list(range(ndim))
    return sorted({d % max(ndim, 1) for d in dims}) if ndim else []


def split_dims(shape: Sequence[int], dims: list[int]):
    """(kept sizes, kept strides, reduced sizes, reduced strides) of a contiguous ``shape``."""
    st = contiguous_strides(shape)
    kept = [d for d in range(len(shape)) if d not in dims]
    return ([shape[d] for d in kept], [st[d] for d in kept], [shape[d] for d in dims],
            [st[d] for d in dims])


class Rows:
    """Warp-per-row iteration of a reduction of ``x`` over ``dims``: emits the row loop and
    gives the C expressions of the row's base offset and of the offset of reduced element r."""

    def __init__(self, ctx: Ctx, x: str, dims: list[int]):
        self.ctx = ctx
        shape = list(ctx.shape(x))
        self.ks, self.kst, self.rs, self.rst = split_dims(shape, dims)
        self.M = 1
        for s in self.ks:
            self.M *= s
        self.R = 1
        for s in self.rs:
            self.R *= s
        self.ix = ctx.index_type()
        # reduced dims are the trailing ones: element r of row o is at o * R + r
        self.trailing = dims == list(range(len(shape) - len(dims), len(shape)))

    def open(self, row: str = "o") -> str:
        ctx = self.ctx
        ctx.emit(f"for ({self.ix} {row} = GX_WARP; {row} < {self.M}; {row} += GX_NWARPS) {{")
        base = ctx.fresh("base")
        if self.trailing:
            ctx.emit(f"const {self.ix} {base} = {row} * {self.R};")
        else:
            ctx.emit(f"const {self.ix} {base} = {offset(ctx.coords(self.ks, row, self.ix), self.kst)};")
        return base

    def elem(self, base: str, r: str) -> str:
        """Emit (inside a loop over r) the offset of reduced element ``r``; returns its name."""
        ctx = self.ctx
        if self.trailing:
            return f"{base} + {r}"
        v = ctx.fresh("off")
        ctx.emit(f"const {self.ix} {v} = {offset(ctx.coords(self.rs, r, self.ix), self.rst, base)};")
        return v

    def lanes(self, r: str = "r") -> str:
        return f"for ({self.ix} {r} = GX_LANE; {r} < {self.R}; {r} += GX_NLANES) {{"


def _init(kind: str, ct: str) -> str:
    if kind in ("sum", "any"):
        return literal(0, ct) if ct != "int" else "0"
    if kind == "prod":
        return literal(1, ct)
    big = "gx_inf()" if ct == "float" else "(i64)9223372036854775807LL"
    small = "(-gx_inf())" if ct == "float" else "(i64)(-9223372036854775807LL - 1)"
    return small if kind == "max" else big


_FUNCTOR = {"sum": "GxSum", "prod": "GxProd", "max": "GxMax", "min": "GxMin", "any": "GxOr"}


def simple_reduce(ctx: Ctx, kind: str, x: str, dims: list[int], out: str, mean: bool = False) -> None:
    """out[o] = reduce over the ``dims`` of x (kind: sum, prod, max, min, any)."""
    if kind == "any":
        ct = "int"
    elif mean:
        ct = "float"
    else:
        ct = out_ct(ctx) if kind in ("sum", "prod") else ("float" if ctx.dtype(x).is_floating_point else "i64")
    if ct == "bool":
        ct = "i64"
    rows = Rows(ctx, x, dims)
    base = rows.open()
    acc = ctx.fresh("acc")
    ctx.emit(f"{ct} {acc} = {_init(kind, ct)};", rows.lanes())
    off = rows.elem(base, "r")
    val = ctx.load_as(x, off, ct)
    if kind in ("max", "min"):
        ctx.emit(f"  {acc} = gx_{kind}({acc}, {val});")
    elif kind == "any":
        ctx.emit(f"  {acc} |= (int){ctx.load_as(x, off, 'bool')};")
    else:
        ctx.emit(f"  {acc} = {acc} {'+' if kind == 'sum' else '*'} {val};")
    ctx.emit("}", f"{acc} = gx_warp_reduce({acc}, {_FUNCTOR[kind]}());")
    res = f"{acc} * (float)(1.0 / {rows.R})" if mean else acc
    ctx.emit(f"if (GX_LANE == 0) {ctx.store(out, 'o', res, ct)}", "}")


def _dims_arg(ctx: Ctx, x: str) -> list[int]:
    return norm_dims(ctx.args.get("dim"), len(ctx.shape(x)))


@emitter("aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.prod", "aten.any",
         "aten.max.default", "aten.min.default")
def _reduce(ctx: Ctx) -> None:
    k = ctx.op.kind.split(".")[1]
    x = ctx.arg_tensor("self")
    kind = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min", "prod": "prod",
            "any": "any", "max": "max", "min": "min"}[k]
    dims = _dims_arg(ctx, x) if "dim" in ctx.args or "dims" in ctx.args else norm_dims(None, len(ctx.shape(x)))
    if "dims" in ctx.args:
        dims = norm_dims(ctx.args.get("dims"), len(ctx.shape(x)))
    simple_reduce(ctx, kind, x, dims, ctx.out, mean=(k == "mean"))


def _arg_reduce(ctx: Ctx, x: str, dims: list[int], largest: bool, vals: str | None, idx: str | None) -> None:
    ct = "float" if ctx.dtype(x).is_floating_point else "i64"
    rows = Rows(ctx, x, dims)
    base = rows.open()
    b, bi = ctx.fresh("best"), ctx.fresh("bi")
    ctx.emit(f"{ct} {b} = {_init('max' if largest else 'min', ct)}; i64 {bi} = {rows.R};", rows.lanes())
    off = rows.elem(base, "r")
    v = ctx.fresh("v")
    ctx.emit(f"  const {ct} {v} = {ctx.load_as(x, off, ct)};",
             f"  if ({bi} == {rows.R} || gx_better({v}, (i64)r, {b}, {bi}, {'true' if largest else 'false'})) "
             f"{{ {b} = {v}; {bi} = r; }}", "}",
             f"gx_warp_argbest({b}, {bi}, {'true' if largest else 'false'});",
             "if (GX_LANE == 0) {")
    if vals:
        ctx.emit(f"  {ctx.store(vals, 'o', b, ct)}")
    if idx:
        ctx.emit(f"  {ctx.store(idx, 'o', bi, 'i64')}")
    ctx.emit("}", "}")


@emitter("aten.max.dim", "aten.min.dim")
def _max_dim(ctx: Ctx) -> None:
    x = ctx.arg_tensor("self")
    o = ctx.op.outputs
    _arg_reduce(ctx, x, norm_dims(ctx.args["dim"], len(ctx.shape(x))), ".max." in ctx.op.kind,
                o.get("out0"), o.get("out1"))


@emitter("aten.argmax", "aten.argmin")
def _argmax(ctx: Ctx) -> None:
    x = ctx.arg_tensor("self")
    _arg_reduce(ctx, x, norm_dims(ctx.args.get("dim"), len(ctx.shape(x))), "argmax" in ctx.op.kind,
                None, ctx.out)


@emitter("aten.var_mean")
def _var_mean(ctx: Ctx) -> None:
    x = ctx.arg_tensor("self")
    corr = ctx.args.get("correction")
    if corr is None:
        corr = 1 if ctx.args.get("unbiased", True) else 0
    var, mean = ctx.op.outputs["out0"], ctx.op.outputs["out1"]
    rows = Rows(ctx, x, _dims_arg(ctx, x))
    base = rows.open()
    ctx.emit("float s = 0.f;", rows.lanes())
    off = rows.elem(base, "r")
    ctx.emit(f"  s += {ctx.load_as(x, off, 'float')};", "}",
             f"const float mu = gx_warp_reduce(s, GxSum()) / (float){rows.R};", "float q = 0.f;", rows.lanes())
    off = rows.elem(base, "r")
    ctx.emit(f"  const float d = {ctx.load_as(x, off, 'float')} - mu;", "  q += d * d;", "}",
             "q = gx_warp_reduce(q, GxSum());",
             f"const float dof = (float){rows.R} - (float)({float(corr)!r});",
             "if (GX_LANE == 0) {",
             f"  {ctx.store(var, 'o', 'q / (dof > 0.f ? dof : 0.f)', 'float')}",
             f"  {ctx.store(mean, 'o', 'mu', 'float')}", "}", "}")


@emitter("aten._softmax", "aten._log_softmax")
def _softmax(ctx: Ctx) -> None:
    """softmax: exp(x - max) / sum; log_softmax: x - max - log(sum), fp32, per row."""
    x = ctx.arg_tensor("self")
    out = ctx.out
    dims = norm_dims(ctx.args["dim"], len(ctx.shape(x)))
    rows = Rows(ctx, x, dims)
    base = rows.open()
    ctx.emit("float m = -gx_inf();", rows.lanes())
    off = rows.elem(base, "r")
    ctx.emit(f"  m = gx_max(m, {ctx.load_as(x, off, 'float')});", "}",
             "m = gx_warp_reduce(m, GxMax());", "float s = 0.f;", rows.lanes())
    off = rows.elem(base, "r")
    ctx.emit(f"  s += expf({ctx.load_as(x, off, 'float')} - m);", "}",
             "s = gx_warp_reduce(s, GxSum());", rows.lanes())
    off = rows.elem(base, "r")
    val = ctx.load_as(x, off, "float")
    res = f"{val} - m - logf(s)" if "log_softmax" in ctx.op.kind else f"expf({val} - m) / s"
    ctx.emit(f"  {ctx.store(out, off, res, 'float')}", "}", "}")


@emitter("aten.topk")
def _topk(ctx: Ctx) -> None:
    """topk(x, k, dim, largest, sorted): k passes per row, each picking the best element that
    comes after the previous pick in (value, index) order; sorted output, ties to the lower
    index."""
    x = ctx.arg_tensor("self")
    nd = len(ctx.shape(x))
    dim = (ctx.args.get("dim", -1) if ctx.args.get("dim") is not None else -1) % max(nd, 1)
    k = int(ctx.args["k"])
    largest = "true" if ctx.args.get("largest", True) else "false"
    vals, idx = ctx.op.outputs["out0"], ctx.op.outputs["out1"]
    ct = "float" if ctx.dtype(x).is_floating_point else "i64"
    rows = Rows(ctx, x, [dim] if nd else [])
    oshape = list(ctx.shape(vals))
    _, okst, _, orst = split_dims(oshape, [dim] if nd else [])
    base = rows.open()
    obase = ctx.fresh("ob")
    ctx.emit(f"const {rows.ix} {obase} = {offset(ctx.coords(rows.ks, 'o', rows.ix), okst)};")
    ostride = orst[0] if orst else 1
    ctx.emit(f"{ct} pv = {_init('max' if largest == 'true' else 'min', ct)}; i64 pi = -1;",
             f"for (int j = 0; j < {k}; ++j) {{",
             f"  {ct} b = pv; i64 bi = -1;", "  " + rows.lanes())
    off = rows.elem(base, "r")
    ctx.emit(f"    const {ct} v = {ctx.load_as(x, off, ct)};",
             f"    const bool after = pi < 0 || gx_better(pv, pi, v, (i64)r, {largest});",
             f"    if (after && (bi < 0 || gx_better(v, (i64)r, b, bi, {largest}))) {{ b = v; bi = r; }}",
             "  }",
             f"  gx_warp_argbest_valid(b, bi, {largest});",
             f"  if (GX_LANE == 0) {{ {ctx.store(vals, f'{obase} + j * {ostride}', 'b', ct)} "
             f"{ctx.store(idx, f'{obase} + j * {ostride}', 'bi', 'i64')} }}",
             "  pv = b; pi = bi;", "}", "}")


@emitter("aten.native_layer_norm")
def _layer_norm(ctx: Ctx) -> None:
    """native_layer_norm(x, normalized_shape, w, b, eps) -> (out, mean, rstd) over the last
    len(normalized_shape) dims: biased variance, fp32, one warp per row."""
    x = ctx.arg_tensor("input")
    n = len(ctx.args["normalized_shape"])
    nd = len(ctx.shape(x))
    w, b = ctx.tensor(ctx.args.get("weight")), ctx.tensor(ctx.args.get("bias"))
    eps = literal(float(ctx.args["eps"]), "float")
    o = ctx.op.outputs
    rows = Rows(ctx, x, list(range(nd - n, nd)))
    base = rows.open()
    ctx.emit("float s = 0.f;", rows.lanes(), f"  s += {ctx.load_as(x, f'{base} + r', 'float')};", "}",
             f"const float mu = gx_warp_reduce(s, GxSum()) / (float){rows.R};", "float q = 0.f;", rows.lanes(),
             f"  const float d = {ctx.load_as(x, f'{base} + r', 'float')} - mu;", "  q += d * d;", "}",
             f"const float rs = rsqrtf(gx_warp_reduce(q, GxSum()) / (float){rows.R} + {eps});", rows.lanes())
    y = f"({ctx.load_as(x, f'{base} + r', 'float')} - mu) * rs"
    if w is not None:
        y = f"{y} * {ctx.load_as(w, 'r', 'float')}"
    if b is not None:
        y = f"{y} + {ctx.load_as(b, 'r', 'float')}"
    ctx.emit(f"  {ctx.store(o['out0'], f'{base} + r', y, 'float')}", "}")
    stats = [f"{ctx.store(o[s], 'o', v, 'float')}" for s, v in (("out1", "mu"), ("out2", "rs")) if s in o]
    ctx.emit(f"if (GX_LANE == 0) {{ {' '.join(stats)} }}", "}")
