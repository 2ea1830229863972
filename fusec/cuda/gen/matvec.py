"""Matrix products at decode sizes: ``mm``, ``addmm``, ``bmm`` and the semantic ``linear``
(fp32 accumulation, one rounding at the output)."""
from __future__ import annotations

from fusec.cuda.gen import emitter
from fusec.cuda.gen.core import Ctx, broadcast_strides, literal, offset

#: at least this many outputs: one thread per output (coalesced over N); fewer: one warp each
THREAD_PER_OUTPUT = 256


def _product(ctx: Ctx, a: str, b: str, batch: int, M: int, K: int, N: int,
             bias: str | None = None, beta=1, alpha=1) -> None:
    out = ctx.out
    ct = "float" if ctx.dtype(out).is_floating_point else "i64"
    ix = ctx.index_type()
    total = batch * M * N
    if total >= THREAD_PER_OUTPUT:
        ctx.emit(ctx.loop(total, "o", ix), f"  {ct} acc = 0;")
        kloop = f"for ({ix} k = 0; k < {K}; ++k) {{"
    else:
        ctx.emit(f"for ({ix} o = GX_WARP; o < {total}; o += GX_NWARPS) {{", f"  {ct} acc = 0;")
        kloop = f"for ({ix} k = GX_LANE; k < {K}; k += GX_NLANES) {{"
    ctx.emit(f"const {ix} n = o % {N}; const {ix} m = (o / {N}) % {M}; const {ix} bb = o / {M * N};")
    av = ctx.load_as(a, f"(bb * {M} + m) * {K} + k", ct)
    bv = ctx.load_as(b, f"(bb * {K} + k) * {N} + n", ct)
    ctx.emit(kloop, f"  acc = {'fmaf(' + av + ', ' + bv + ', acc)' if ct == 'float' else f'acc + {av} * {bv}'};", "}")
    if total < THREAD_PER_OUTPUT:
        ctx.emit("acc = gx_warp_reduce(acc, GxSum());", "if (GX_LANE == 0) {")
    else:
        ctx.emit("{")
    res = "acc"
    if alpha != 1:
        res = f"{literal(alpha, ct)} * {res}"
    if bias is not None and beta != 0:
        try:
            st = broadcast_strides(ctx.shape(bias), [batch, M, N] if len(ctx.shape(bias)) == 3 else [M, N])
        except ValueError as e:
            raise ctx.fail(str(e)) from None
        coords = ["bb", "m", "n"] if len(st) == 3 else ["m", "n"]
        bv = ctx.load_as(bias, offset(coords, st), ct)
        res = f"{bv} + {res}" if beta == 1 else f"{literal(beta, ct)} * {bv} + {res}"
    ctx.emit(f"  {ctx.store(out, 'o', res, ct)}", "}", "}")


@emitter("aten.mm")
def _mm(ctx: Ctx) -> None:
    a, b = ctx.arg_tensor("self"), ctx.arg_tensor("mat2")
    (M, K), (_, N) = ctx.shape(a), ctx.shape(b)
    _product(ctx, a, b, 1, M, K, N)


@emitter("aten.bmm")
def _bmm(ctx: Ctx) -> None:
    a, b = ctx.arg_tensor("self"), ctx.arg_tensor("mat2")
    (B, M, K), (_, _, N) = ctx.shape(a), ctx.shape(b)
    _product(ctx, a, b, B, M, K, N)


@emitter("aten.addmm")
def _addmm(ctx: Ctx) -> None:
    bias, a, b = ctx.arg_tensor("self"), ctx.arg_tensor("mat1"), ctx.arg_tensor("mat2")
    (M, K), (_, N) = ctx.shape(a), ctx.shape(b)
    _product(ctx, a, b, 1, M, K, N, bias, ctx.args.get("beta", 1), ctx.args.get("alpha", 1))


@emitter("linear")
def _linear(ctx: Ctx) -> None:
    """linear(x, w[, b]): out[m, n] = sum_k w[n, k] * x[m, k] (+ b[n]), x [M, K] flattened (M = 1:
    one vector; M = B: a decode step's batch), one warp per output (lanes stride over k:
    coalesced weight reads)."""
    op = ctx.op
    x, w, out = op.inputs["x"], op.inputs["w"], ctx.out
    N, K = ctx.shape(w)
    M = ctx.numel(x) // K if K else 0
    if M < 1 or ctx.numel(x) != M * K or ctx.numel(out) != M * N:
        raise ctx.fail(f"linear of x {ctx.shape(x)} by w {(N, K)} into {ctx.shape(out)}")
    ix = ctx.index_type()
    ctx.emit(f"for ({ix} o = GX_WARP; o < {M * N}; o += GX_NWARPS) {{",
             f"  const {ix} n = o % {N}, m = o / {N};", "  float acc = 0.f;",
             f"  for ({ix} k = GX_LANE; k < {K}; k += GX_NLANES)",
             f"    acc = fmaf({ctx.load_as(w, f'n * {K} + k', 'float')}, "
             f"{ctx.load_as(x, f'm * {K} + k', 'float')}, acc);",
             "  acc = gx_warp_reduce(acc, GxSum());")
    res = "acc"
    if "b" in op.inputs:
        res = f"acc + {ctx.load_as(op.inputs['b'], 'n', 'float')}"
    ctx.emit(f"  if (GX_LANE == 0) {ctx.store(out, 'o', res, 'float')}", "}")
