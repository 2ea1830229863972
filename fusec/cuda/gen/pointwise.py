"""Elementwise ATen ops with broadcasting, dtype casts and tensor creation.

Each op is ``out[i] = f(operands at the broadcast offset of i)`` over the output's static
shape, one element per thread, in the op's compute type (fp32 for floating outputs, int64 for
integer ones, bool for logical ops; comparisons in the promoted type of their operands).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from fusec.ir import Ref
from fusec.cuda.gen import emitter
from fusec.cuda.gen.core import FLOATS, Ctx, broadcast_strides, compute_type, literal, offset


@dataclasses.dataclass
class Operand:
    """A tensor read under broadcasting (``tensor``) or a C expression (``expr``), as ``ctype``
    (None: the tensor's own element type)."""

    tensor: str | None = None
    expr: str | None = None
    ctype: str | None = None


def operand(ctx: Ctx, v: Any, ctype: str) -> Operand:
    """A tensor argument (``Ref``) or a Python scalar, as ``ctype``."""
    if isinstance(v, Ref):
        return Operand(tensor=ctx.op.inputs[v.slot], ctype=ctype)
    if v is None:
        raise ctx.fail("missing operand")
    return Operand(expr=literal(v, ctype), ctype=ctype)


def elementwise(ctx: Ctx, operands: list[Operand], ctype: str, expr: Callable[..., str],
                out: str | None = None) -> None:
    """Emit ``out[i] = expr(*operand values)`` (value in ``ctype``) over ``out``'s shape (over
    its flat elements ``[gx_lo, gx_hi)`` when ``ctx.ranged``: a tile of a range-split op)."""
    out = out or ctx.out
    oshape = ctx.shape(out)
    ix = ctx.index_type()
    if ctx.ranged and out == ctx.out and not ctx.range_used:
        ctx.range_used = True
        ctx.emit(f"for ({ix} i = ({ix})gx_lo + threadIdx.x; i < ({ix})gx_hi; i += GX_NTHREADS) {{")
    else:
        ctx.emit(ctx.loop(ctx.numel(out), "i", ix))
    coords = None
    vals = []
    for o in operands:
        if o.tensor is None:
            vals.append(o.expr)
            continue
        if ctx.numel(o.tensor) == ctx.numel(out):
            off = "i"    # same elements: same flat order (contiguous; semantic ops read views)
        else:
            try:
                st = broadcast_strides(ctx.shape(o.tensor), oshape)
            except ValueError as e:
                raise ctx.fail(str(e)) from None
            if not any(st):
                off = "0"    # a broadcast scalar: no coordinates (they would be unused variables)
            else:
                if coords is None:
                    coords = ctx.coords(oshape, "i", ix)
                off = offset(coords, st)
        v = ctx.fresh("a")
        if o.ctype is None:
            ctx.emit(f"const {ctx.ctype(o.tensor)} {v} = {ctx.load(o.tensor, off)};")
        else:
            ctx.emit(f"const {o.ctype} {v} = {ctx.load_as(o.tensor, off, o.ctype)};")
        vals.append(v)
    ctx.emit(f"  {ctx.store(out, 'i', expr(*vals), ctype)}", "}")


def out_ct(ctx: Ctx) -> str:
    try:
        return compute_type(ctx.dtype(ctx.out))
    except Exception:
        raise ctx.fail(f"dtype {ctx.dtype(ctx.out)} of the output") from None


def promoted_ct(ctx: Ctx, *vals: Any) -> str:
    """Compute type of a comparison: float if any operand is floating, else int64."""
    for v in vals:
        if isinstance(v, Ref):
            if ctx.dtype(ctx.op.inputs[v.slot]) in FLOATS:
                return "float"
            ctx.ctype(ctx.op.inputs[v.slot])
        elif isinstance(v, float):
            return "float"
    return "i64"


# --- binary arithmetic -------------------------------------------------------------------------
def _alpha(ctx: Ctx, ct: str) -> str | None:
    a = ctx.args.get("alpha", 1)
    if a is None or a == 1:
        return None
    return literal(a, ct)


@emitter("aten.add", "aten.sub")
def _add_sub(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    sign = "+" if ctx.op.kind.startswith("aten.add") else "-"
    al = _alpha(ctx, ct)
    ops = [operand(ctx, ctx.args["self"], ct), operand(ctx, ctx.args["other"], ct)]
    if ct == "bool":
        if sign == "-":
            raise ctx.fail("subtraction of bool tensors")
        elementwise(ctx, ops, ct, lambda a, b: f"({a} || {b})")
    elif al is None:
        elementwise(ctx, ops, ct, lambda a, b: f"{a} {sign} {b}")
    else:
        elementwise(ctx, ops, ct, lambda a, b: f"{a} {sign} {al} * {b}")


@emitter("aten.mul")
def _mul(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    ops = [operand(ctx, ctx.args["self"], ct), operand(ctx, ctx.args["other"], ct)]
    elementwise(ctx, ops, ct, (lambda a, b: f"({a} && {b})") if ct == "bool" else (lambda a, b: f"{a} * {b}"))


@emitter("aten.div", "aten.true_divide")   # true_divide: dynamo's float division (dynamic=True)
def _div(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    mode = ctx.args.get("rounding_mode")
    if ct == "bool":
        raise ctx.fail("division into a bool tensor")
    ops = [operand(ctx, ctx.args["self"], ct), operand(ctx, ctx.args["other"], ct)]
    if mode is None:
        if ct != "float":
            raise ctx.fail("true division with an integer output")
        elementwise(ctx, ops, ct, lambda a, b: f"{a} / {b}")
    elif mode == "trunc":
        elementwise(ctx, ops, ct, lambda a, b: f"gx_truncdiv({a}, {b})")
    elif mode == "floor":
        elementwise(ctx, ops, ct, lambda a, b: f"gx_floordiv({a}, {b})")
    else:
        raise ctx.fail(f"rounding_mode {mode!r}")


@emitter("aten.floor_divide")
def _floor_divide(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    ops = [operand(ctx, ctx.args["self"], ct), operand(ctx, ctx.args["other"], ct)]
    elementwise(ctx, ops, ct, lambda a, b: f"gx_floordiv({a}, {b})")


def _in_out_dtype(ctx: Ctx, v: Any) -> Any:
    """A Python float operand as PyTorch's remainder and fmod kernels take it: rounded to the
    output's dtype first (bf16 ``fmod(x, 0.7)`` divides by 0.69921875)."""
    dt = ctx.dtype(ctx.out)
    if isinstance(v, float) and dt in (torch.bfloat16, torch.float16):
        return float(torch.tensor(v, dtype=dt).float())
    return v


def _modulo(ctx: Ctx, fn: str) -> None:
    ct = out_ct(ctx)
    ops = [operand(ctx, _in_out_dtype(ctx, ctx.args["self"]), ct),
           operand(ctx, _in_out_dtype(ctx, ctx.args["other"]), ct)]
    elementwise(ctx, ops, ct, lambda a, b: f"{fn}({a}, {b})")


@emitter("aten.remainder")
def _remainder(ctx: Ctx) -> None:
    _modulo(ctx, "gx_remainder")   # the sign of the divisor


@emitter("aten.fmod")
def _fmod(ctx: Ctx) -> None:
    _modulo(ctx, "gx_fmod")        # the sign of the dividend


def _pow_scalar_exp(ct: str, e: Any) -> Callable[[str], str]:
    """torch's pow(tensor, scalar) special cases (ATen pow_tensor_scalar_optimized_kernel)."""
    if ct == "i64":
        return lambda a: f"gx_ipow({a}, {literal(e, 'i64')})"
    special = {2: "{a} * {a}", 3: "{a} * {a} * {a}", 0.5: "sqrtf({a})", -0.5: "rsqrtf({a})",
               -1: "1.f / {a}", -2: "1.f / ({a} * {a})", 1: "{a}", 0: "1.f"}
    if not isinstance(e, bool) and e in special:
        return lambda a: special[e].format(a=a)
    return lambda a: f"powf({a}, {literal(e, 'float')})"


@emitter("aten.pow")
def _pow(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    if ct == "bool":
        raise ctx.fail("pow into a bool tensor")
    base, exp = ctx.args["self"], ctx.args["exponent"]
    if isinstance(exp, Ref):
        ops = [operand(ctx, base, ct), operand(ctx, exp, ct)]
        fn = "gx_ipow" if ct == "i64" else "powf"
        elementwise(ctx, ops, ct, lambda a, b: f"{fn}({a}, {b})")
    else:
        elementwise(ctx, [operand(ctx, base, ct)], ct, _pow_scalar_exp(ct, exp))


@emitter("aten.maximum", "aten.minimum", "aten.max.other", "aten.min.other")
def _maxmin(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    fn = "gx_max" if ("maximum" in ctx.op.kind or ".max." in ctx.op.kind) else "gx_min"
    ops = [operand(ctx, ctx.args["self"], ct), operand(ctx, ctx.args["other"], ct)]
    elementwise(ctx, ops, ct, lambda a, b: f"{fn}({a}, {b})")


@emitter("aten.clamp", "aten.clamp_min", "aten.clamp_max")
def _clamp(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    lo = ctx.args.get("min")
    hi = ctx.args.get("max")
    ops = [operand(ctx, ctx.args["self"], ct)]
    parts = []
    for v, fn in ((lo, "gx_max"), (hi, "gx_min")):
        if v is not None:
            ops.append(operand(ctx, v, ct))
            parts.append(fn)

    def expr(a, *bounds):
        # torch: NaN input stays NaN; min(max(x, lo), hi)
        for fn, b in zip(parts, bounds):
            a = f"{fn}({a}, {b})" if ct != "float" else f"({a} != {a} ? {a} : {fn}({a}, {b}))"
        return a
    elementwise(ctx, ops, ct, expr)


# --- bitwise / logical / comparisons ------------------------------------------------------------
@emitter("aten.bitwise_and", "aten.bitwise_or", "aten.bitwise_xor")
def _bitwise(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    if ct == "float":
        raise ctx.fail("bitwise op on a floating tensor")
    sym = {"and": "&", "or": "|", "xor": "^"}[ctx.op.kind.split(".")[1].split("_")[1]]
    if ct == "bool":
        sym = {"&": "&&", "|": "||", "^": "!="}[sym]
    ops = [operand(ctx, ctx.args["self"], ct), operand(ctx, ctx.args["other"], ct)]
    elementwise(ctx, ops, ct, lambda a, b: f"({a} {sym} {b})")


@emitter("aten.bitwise_not")
def _bitwise_not(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    if ct == "float":
        raise ctx.fail("bitwise_not of a floating tensor")
    elementwise(ctx, [operand(ctx, ctx.args["self"], ct)], ct,
                (lambda a: f"!{a}") if ct == "bool" else (lambda a: f"~{a}"))


@emitter("aten.logical_and", "aten.logical_or", "aten.logical_xor")
def _logical(ctx: Ctx) -> None:
    sym = {"and": "&&", "or": "||", "xor": "!="}[ctx.op.kind.split(".")[1].split("_")[1]]
    ops = [operand(ctx, ctx.args["self"], "bool"), operand(ctx, ctx.args["other"], "bool")]
    elementwise(ctx, ops, "bool", lambda a, b: f"({a} {sym} {b})")


@emitter("aten.logical_not")
def _logical_not(ctx: Ctx) -> None:
    elementwise(ctx, [operand(ctx, ctx.args["self"], "bool")], "bool", lambda a: f"!{a}")


_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


@emitter(*(f"aten.{k}" for k in _CMP))
def _compare(ctx: Ctx) -> None:
    sym = _CMP[ctx.op.kind.split(".")[1]]
    a, b = ctx.args["self"], ctx.args["other"]
    ct = promoted_ct(ctx, a, b)
    elementwise(ctx, [operand(ctx, a, ct), operand(ctx, b, ct)], "bool", lambda x, y: f"({x} {sym} {y})")


@emitter("aten.where")
def _where(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    ops = [operand(ctx, ctx.args["condition"], "bool"), operand(ctx, ctx.args["self"], ct),
           operand(ctx, ctx.args["other"], ct)]
    elementwise(ctx, ops, ct, lambda c, a, b: f"({c} ? {a} : {b})")


# --- unary -------------------------------------------------------------------------------------
_UNARY_FLOAT = {
    "exp": "expf({a})", "rsqrt": "rsqrtf({a})", "sqrt": "sqrtf({a})", "sigmoid": "gx_sigmoid({a})",
    "silu": "gx_silu({a})", "tanh": "tanhf({a})", "cos": "cosf({a})", "sin": "sinf({a})",
    "erf": "erff({a})", "log": "logf({a})", "expm1": "expm1f({a})", "log1p": "log1pf({a})",
    "reciprocal": "1.f / {a}",
}


@emitter(*(f"aten.{k}" for k in _UNARY_FLOAT))
def _unary_float(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    if ct != "float":
        raise ctx.fail("a floating function with a non-floating output")
    form = _UNARY_FLOAT[ctx.op.kind.split(".")[1]]
    elementwise(ctx, [operand(ctx, ctx.args["self"], ct)], ct, lambda a: form.format(a=a))


@emitter("aten.gelu")
def _gelu(ctx: Ctx) -> None:
    approx = ctx.args.get("approximate") or "none"
    fn = {"none": "gx_gelu", "tanh": "gx_gelu_tanh"}.get(approx)
    if fn is None:
        raise ctx.fail(f"gelu approximate={approx!r}")
    elementwise(ctx, [operand(ctx, ctx.args["self"], "float")], "float", lambda a: f"{fn}({a})")


@emitter("aten.relu", "aten.leaky_relu")
def _relu(ctx: Ctx) -> None:
    """``aten.relu`` (OPT's MLP, ReLU-squared MLPs) and ``aten.leaky_relu`` (``negative_slope``,
    default 0.01): a NaN passes through, as in PyTorch (``x < 0`` is false for it)."""
    ct = out_ct(ctx)
    if ct == "bool":
        raise ctx.fail(f"{ctx.op.kind} of a bool tensor")
    zero = "0.f" if ct == "float" else "0"
    if ctx.op.kind.startswith("aten.relu"):
        form = lambda a: f"({a} < {zero} ? {zero} : {a})"  # noqa: E731
    else:
        if ct != "float":
            raise ctx.fail("leaky_relu of an integer tensor")
        slope = literal(float(ctx.args.get("negative_slope", 0.01)), "float")
        form = lambda a: f"({a} < 0.f ? {a} * {slope} : {a})"  # noqa: E731
    elementwise(ctx, [operand(ctx, ctx.args["self"], ct)], ct, form)


@emitter("aten.neg", "aten.abs", "aten.sign")
def _neg_abs_sign(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    k = ctx.op.kind.split(".")[1]
    if ct == "bool":
        if k == "neg":
            raise ctx.fail("neg of a bool tensor")
        elementwise(ctx, [operand(ctx, ctx.args["self"], ct)], ct, lambda a: a)
        return
    form = {"neg": "-{a}", "abs": "fabsf({a})" if ct == "float" else "({a} < 0 ? -{a} : {a})",
            "sign": "gx_sign({a})"}[k]
    elementwise(ctx, [operand(ctx, ctx.args["self"], ct)], ct, lambda a: form.format(a=a))


# --- casts and copies --------------------------------------------------------------------------
@emitter("aten._to_copy", "prims.convert_element_type", "aten.clone", "aten.lift_fresh_copy",
         "aten.alias", "aten.detach")
def _cast(ctx: Ctx) -> None:
    src = ctx.arg_tensor("self" if "self" in ctx.args else "a")
    if ctx.numel(src) != ctx.numel(ctx.out):
        raise ctx.fail("a copy that changes the number of elements")
    elementwise(ctx, [Operand(tensor=src)], ctx.ctype(src), lambda a: a)


@emitter("aten.copy", "aten.copy_")
def _copy(ctx: Ctx) -> None:
    """copy(self, src) / copy_(dst, src): ``src`` broadcast to the destination's shape, cast."""
    src = ctx.arg_tensor("src")
    elementwise(ctx, [Operand(tensor=src)], ctx.ctype(src), lambda a: a)


# --- creation ----------------------------------------------------------------------------------
def _fill(ctx: Ctx, value: Any) -> None:
    ct = out_ct(ctx)
    elementwise(ctx, [operand(ctx, value, ct)], ct, lambda a: a)


@emitter("aten.full", "aten.full_like")
def _full(ctx: Ctx) -> None:
    _fill(ctx, ctx.args["fill_value"])


@emitter("aten.zeros_like", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.zeros",
         "aten.new_empty", "aten.new_zeros")
def _zeros(ctx: Ctx) -> None:
    _fill(ctx, 0)     # empty: defined contents (zeros) instead of garbage


@emitter("aten.ones_like", "aten.ones")
def _ones(ctx: Ctx) -> None:
    _fill(ctx, 1)


@emitter("aten.scalar_tensor")
def _scalar_tensor(ctx: Ctx) -> None:
    _fill(ctx, ctx.args["s"])


@emitter("aten.fill")
def _fill_op(ctx: Ctx) -> None:
    _fill(ctx, ctx.args["value"])


@emitter("aten.arange")
def _arange(ctx: Ctx) -> None:
    ct = out_ct(ctx)
    start = ctx.args.get("start", 0) if "start" in ctx.args else 0
    step = ctx.args.get("step", 1) if "step" in ctx.args else 1
    start = 0 if start is None else start
    step = 1 if step is None else step
    s, d = literal(start, ct), literal(step, ct)
    elementwise(ctx, [], ct, lambda: f"{s} + {d} * ({ct})i")
