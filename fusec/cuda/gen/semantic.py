"""Semantic ops left unfused (reference semantics in :mod:`fusec.ir.semantics`): ``rmsnorm``,
``rope``, ``silu_mul``, ``gelu_mul``, ``kv_write``, ``attention``, and ``fusec.sdpa`` (PyTorch SDPA on
materialized K/V)."""
from __future__ import annotations

import math
import re

from fusec.abi import Fault
from fusec.ir.semantics import TOKEN_POSITIONS
from fusec.cuda.gen import emitter
from fusec.cuda.gen.core import Ctx, broadcast_strides, literal, offset
from fusec.cuda.gen.pointwise import Operand, elementwise
from fusec.instructions.base import CTA_THREADS


def cta_per_row(rows: int, h: int) -> bool:
    """Whether an RMSNorm of ``rows`` rows of ``h`` elements runs a row at a time over the whole
    CTA (a block reduction) rather than a row per warp: the one with the shorter chain of
    dependent L2 round trips per thread, counting a block reduction's two barriers as two. A
    norm over a whole projection (OLMo-2's q/k norm, a post-norm: one row of 2048) took 22 µs on
    one warp on the H200 (64 loads per lane in a row) and is 16 times shorter on the CTA."""
    warps = CTA_THREADS // 32
    per_warp = -(-rows // warps) * -(-h // 32)
    per_cta = rows * (-(-h // CTA_THREADS) + 2)
    return per_cta < per_warp


@emitter("rmsnorm")
def _rmsnorm(ctx: Ctx) -> None:
    """HF RMSNorm over the last dim (H = numel(w)):
    out = rnd<out>(w * rnd<x>(x * rsqrt(mean(x^2) + eps))); with attr ``w_fp32`` (Gemma)
    out = rnd<out>(x * rsqrt(mean(x^2) + eps) * w). One row, or few long rows
    (:func:`cta_per_row`): a row at a time over the whole CTA with a block reduction; else one
    warp per row. Loads are unrolled by 4 so that each thread has several in flight."""
    x, w, out = ctx.op.inputs["x"], ctx.op.inputs["w"], ctx.out
    H = ctx.numel(w)
    if ctx.numel(x) % H or ctx.numel(out) != ctx.numel(x):
        raise ctx.fail(f"rmsnorm of {ctx.shape(x)} by a weight of {H}")
    rows = ctx.numel(x) // H
    tx = ctx.ctype(x)
    eps = literal(float(ctx.op.attrs["eps"]), "float")
    w_fp32 = bool(ctx.op.attrs.get("w_fp32", False))
    if rows == 1:
        # one row over the CTA, whatever its width (a folded prologue's norm: its loops are the
        # register form's, Ctx.loop, where x, w and out are registers of the thread's elements,
        # and its shared-memory form sums in the same order)
        loop = ctx.loop(H, "k", "int", unroll=4)
        xv, wv = ctx.load_as(x, "k", "float"), ctx.load_as(w, "k", "float")
        y = xv + " * r" if w_fp32 else f"gx_f(gx_cast<{tx}>({xv} * r))"
        ctx.emit("float ss = 0.f;", loop, f"  const float v = {ctx.owned(xv, '0.f')};", "  ss += v * v;", "}",
                 f"const float r = rsqrtf(gx_block_reduce(ss, GxSum()) / {H}.f + {eps});",
                 loop, f"  const float y = {y};",
                 "  " + ctx.store(out, "k", f"y * {wv}" if w_fp32 else f"{wv} * y", "float"), "}")
        return
    wy = f"{ctx.load_as(w, 'k', 'float')} * y" if not w_fp32 else f"y * {ctx.load_as(w, 'k', 'float')}"
    if cta_per_row(rows, H):
        row_loop, k0, kstep, reduce = (f"for (int row = 0; row < {rows}; ++row) {{", "threadIdx.x",
                                       "GX_NTHREADS", "gx_block_reduce(ss, GxSum())")
    else:
        row_loop, k0, kstep, reduce = (f"for (int row = GX_WARP; row < {rows}; row += GX_NWARPS) {{", "GX_LANE",
                                       "GX_NLANES", "gx_warp_reduce(ss, GxSum())")
    ctx.emit(row_loop, "  float ss = 0.f;", "#pragma unroll 4",
             f"  for (int k = {k0}; k < {H}; k += {kstep}) {{",
             f"    const float v = {ctx.load_as(x, f'row * {H} + k', 'float')};", "    ss += v * v;", "  }",
             f"  const float r = rsqrtf({reduce} / {H}.f + {eps});", "#pragma unroll 4",
             f"  for (int k = {k0}; k < {H}; k += {kstep}) {{",
             f"    const float y = {'' if w_fp32 else f'gx_f(gx_cast<{tx}>('}"
             f"{ctx.load_as(x, f'row * {H} + k', 'float')} * r{'' if w_fp32 else '))'};",
             "    " + ctx.store(out, f"row * {H} + k", wy, "float"),
             "  }", "}")


@emitter("layernorm")
def _layernorm(ctx: Ctx) -> None:
    """The ``layernorm`` kind's op as a generated function (the form a folded prologue calls on
    shared memory, :mod:`fusec.instructions.prologue`): out = (x - mean) * rsqrt(var + eps)
    [* w] [+ b] over all of x (one row, :class:`fusec.instructions.layernorm.LayerNorm`), mean
    and biased variance in fp32 by block reductions, one rounding, as templates/layernorm.cu.j2."""
    x, out = ctx.op.inputs["x"], ctx.out
    w, b = ctx.op.inputs.get("w"), ctx.op.inputs.get("b")
    H = ctx.numel(x)
    if ctx.numel(out) != H or any(t is not None and ctx.numel(t) != H for t in (w, b)):
        raise ctx.fail(f"layernorm of {ctx.shape(x)} into {ctx.shape(out)}")
    eps = literal(float(ctx.op.attrs["eps"]), "float")
    loop = ctx.loop(H, "k", "int")   # before the loads (the register form knows k from it)
    xv = ctx.load_as(x, "k", "float")
    y = f"({xv} - mu) * rs"
    if w is not None:
        y = f"{y} * {ctx.load_as(w, 'k', 'float')}"
    if b is not None:
        y = f"{y} + {ctx.load_as(b, 'k', 'float')}"
    ctx.emit("float s = 0.f;", loop, f"  s += {ctx.owned(xv, '0.f')};", "}",
             f"const float mu = gx_block_reduce(s, GxSum()) / {H}.f;", "float q = 0.f;",
             loop, f"  const float d = {ctx.owned(f'{xv} - mu', '0.f')};",
             "  q += d * d;", "}", f"const float rs = rsqrtf(gx_block_reduce(q, GxSum()) / {H}.f + {eps});",
             loop, f"  {ctx.store(out, 'k', y, 'float')}", "}")


@emitter("rope")
def _rope(ctx: Ctx) -> None:
    """Half-split RoPE: out = x * cos + cat(-x2, x1) * sin (fp32), cos/sin broadcast to x. With
    ``rotary_dim`` rd < D (partial rotary): over the first rd values of each row (cos/sin of
    width rd, halves of rd / 2), the others copied."""
    x, c, s, out = ctx.op.inputs["x"], ctx.op.inputs["cos"], ctx.op.inputs["sin"], ctx.out
    xs = ctx.shape(x)
    D = xs[-1]
    rd = int(ctx.op.attrs.get("rotary_dim", D))
    h = rd // 2
    if ctx.numel(out) != ctx.numel(x) or rd % 2 or not 0 < rd <= D:
        raise ctx.fail(f"rope of x {xs} into {ctx.shape(out)} (rotary_dim {rd})")
    rs = (*xs[:-1], rd)   # the rotated part's shape: cos/sin broadcast to it
    try:
        cst, sst = broadcast_strides(ctx.shape(c), rs), broadcast_strides(ctx.shape(s), rs)
    except ValueError as e:
        raise ctx.fail(str(e)) from None
    ix = ctx.index_type()
    ctx.emit(ctx.loop(ctx.numel(x), "i", ix))
    co = ctx.coords(xs, "i", ix)
    d = co[-1]
    ctx.emit(f"const float xv = {ctx.load_as(x, 'i', 'float')};")
    if rd < D:
        ctx.emit("float y = xv;", f"if ({d} < {rd}) {{")
    ctx.emit(f"const float rot = {d} < {h} ? -{ctx.load_as(x, f'i + {h}', 'float')} : "
             f"{ctx.load_as(x, f'i - {h}', 'float')};",
             ("" if rd < D else "const float ") + f"y = xv * {ctx.load_as(c, offset(co, cst), 'float')} + "
             f"rot * {ctx.load_as(s, offset(co, sst), 'float')};")
    if rd < D:
        ctx.emit("}")
    ctx.emit(f"{ctx.store(out, 'i', 'y', 'float')}", "}")


@emitter("silu_mul")
def _silu_mul(ctx: Ctx) -> None:
    """out = silu(gate) * up in fp32, rounded once."""
    elementwise(ctx, [Operand(tensor=ctx.op.inputs["gate"], ctype="float"),
                      Operand(tensor=ctx.op.inputs["up"], ctype="float")], "float",
                lambda g, u: f"gx_silu({g}) * {u}")


@emitter("gelu_mul")
def _gelu_mul(ctx: Ctx) -> None:
    """out = rnd<gate>(gelu(gate)) * up in fp32, rounded once (attr ``act``: "gelu" or
    "gelu_tanh"); GELU is its own op in the model, so its result rounds to gate's dtype."""
    act = ctx.op.attrs.get("act", "gelu")
    fn = {"gelu": "gx_gelu", "gelu_tanh": "gx_gelu_tanh"}.get(act)
    if fn is None:
        raise ctx.fail(f"gelu_mul act={act!r}")
    tg = ctx.ctype(ctx.op.inputs["gate"])
    elementwise(ctx, [Operand(tensor=ctx.op.inputs["gate"], ctype="float"),
                      Operand(tensor=ctx.op.inputs["up"], ctype="float")], "float",
                lambda g, u: f"gx_f(gx_cast<{tg}>({fn}({g}))) * {u}")


@emitter("kv_write")
def _kv_write(ctx: Ctx) -> None:
    """cache[:, :, pos] = val (in place); an out-of-range pos is fault KV_POS, no write. With K
    positions (``pos`` [K], K query tokens per sequence) the K rows of val [B, H, K, D]. The
    cache's rows L may be a run-time length (:meth:`Ctx.length`)."""
    cache, pos, val = ctx.op.outputs["cache"], ctx.op.inputs["pos"], ctx.op.inputs["val"]
    B, H, _, D = ctx.shape(cache)
    K = ctx.numel(pos)   # K query tokens per sequence: K rows, val [B, H, K, D]
    if ctx.numel(val) != B * H * K * D:
        raise ctx.fail(f"kv_write of {ctx.shape(val)} into {ctx.shape(cache)}")
    ix = ctx.index_type()
    L = ctx.length(cache, 2)
    if K > 1:   # every position checked before any row is written (a fault writes nothing)
        ctx.emit(f"for (int k_ = 0; k_ < {K}; ++k_)",
                 f"  if (!index_ok({ctx.load_as(pos, 'k_', 'i64')}, {L}, {int(Fault.KV_POS)})) return;",
                 ctx.loop(B * H * K * D, "i", ix),
                 f"  const i64 p = {ctx.load_as(pos, f'i / {D} % {K}', 'i64')};",
                 f"  {ctx.store(cache, f'(i / {K * D} * {L} + p) * {D} + i % {D}', ctx.load(val, 'i'), ctx.ctype(val))}",
                 "}")
        return
    ctx.emit(f"const i64 p = {ctx.load_as(pos, '0', 'i64')};",
             f"if (!index_ok(p, {L}, {int(Fault.KV_POS)})) return;",
             ctx.loop(B * H * D, "i", ix),
             f"  {ctx.store(cache, f'(i / {D} * {L} + p) * {D} + i % {D}', ctx.load(val, 'i'), ctx.ctype(val))}",
             "}")


def _attend_rows(ctx: Ctx, *, rows: int, D: int, Dv: int, q_off: str, k_row: str, v_row: str, n_keys: str,
                 scale: float, out_off: str, q: str, k: str, v: str, mask_expr: str | None = None,
                 mask_kind: int = 0, setup: list[str] = (), skip: str | None = None, softcap: float = 0.0) -> None:
    """One warp per query row: online softmax over keys t < n_keys of scale * q.k (softcapped
    to ``softcap * tanh(s / softcap)`` when ``softcap`` is not 0: Gemma-2) (+ mask),
    out = sum p_t v_t / sum p_t (fp32). ``q_off``/``out_off`` are in terms of the row ``h``,
    ``k_row``/``v_row`` the element offsets of key/value row ``t``."""
    out = ctx.out
    ctx.emit(f"constexpr int PQ = ({D} + GX_NLANES - 1) / GX_NLANES, PV = ({Dv} + GX_NLANES - 1) / GX_NLANES;",
             f"for (int h = GX_WARP; h < {rows}; h += GX_NWARPS) {{", *[f"  {s}" for s in setup],
             "  float qv[PQ], acc[PV];",
             "  for (int j = 0; j < PQ; ++j) {",
             "    const int d = GX_LANE + j * GX_NLANES;",
             f"    qv[j] = d < {D} ? {ctx.load_as(q, f'{q_off} + d', 'float')} : 0.f;", "  }",
             "  for (int j = 0; j < PV; ++j) acc[j] = 0.f;",
             "  float m = -gx_inf(), l = 0.f;",
             f"  for (int t = 0; t < {n_keys}; ++t) {{")
    if skip:
        ctx.emit(f"    if ({skip}) continue;")
    ctx.emit("    float s = 0.f;",
             "    for (int j = 0; j < PQ; ++j) {",
             "      const int d = GX_LANE + j * GX_NLANES;",
             f"      if (d < {D}) s += qv[j] * {ctx.load_as(k, f'{k_row} + d', 'float')};", "    }",
             f"    s = gx_warp_reduce(s, GxSum()) * {literal(float(scale), 'float')};")
    if softcap:
        cap = literal(float(softcap), "float")
        ctx.emit(f"    s = {cap} * tanhf(s / {cap});")
    if mask_expr is not None:
        if mask_kind == 1:
            ctx.emit(f"    if (!{mask_expr}) continue;")
        else:
            ctx.emit(f"    s += {mask_expr};")
    ctx.emit("    if (s == -gx_inf()) continue;",
             "    const float mn = gx_max(m, s);",
             "    const float corr = m == -gx_inf() ? 0.f : expf(m - mn);",
             "    const float pe = expf(s - mn);",
             "    l = l * corr + pe;",
             "    for (int j = 0; j < PV; ++j) {",
             "      const int d = GX_LANE + j * GX_NLANES;",
             f"      acc[j] = acc[j] * corr + (d < {Dv} ? pe * {ctx.load_as(v, f'{v_row} + d', 'float')} : 0.f);",
             "    }",
             "    m = mn;", "  }",
             "  for (int j = 0; j < PV; ++j) {",
             "    const int d = GX_LANE + j * GX_NLANES;",
             f"    if (d < {Dv}) {ctx.store(out, f'{out_off} + d', 'l > 0.f ? acc[j] / l : 0.f', 'float')}", "  }", "}")


@emitter("attention")
def _attention(ctx: Ctx) -> None:
    """Decode attention over cache rows 0..pos (GQA), or over every row with a mask (mask_kind 1:
    bool, 2: additive; the mask decides), one warp per (sequence, query head); an out-of-range
    pos is fault ATTN_POS. A batch of B sequences: q [B, Hq, 1, D] over caches [B, Hkv, L, D],
    the mask one row of L for all or one per sequence ([B, 1, 1, L]). The cache's rows L may be
    a run-time length (:meth:`Ctx.length`)."""
    op = ctx.op
    q, k, v, pos = op.inputs["q"], op.inputs["k"], op.inputs["v"], op.inputs["pos"]
    kshape = ctx.shape(k)
    if len(kshape) != 4:
        raise ctx.fail(f"attention over a cache of shape {kshape}")
    qshape = ctx.shape(q)
    if len(qshape) == 4 and qshape[2] > 1:
        _attention_tokens(ctx)
        return
    B, hkv, _, D = kshape
    L = ctx.length(k, 2)
    hq = ctx.numel(q) // (B * D)
    if hq % hkv or ctx.numel(q) != B * hq * D or ctx.numel(ctx.out) != B * hq * D:
        raise ctx.fail(f"attention of q {ctx.shape(q)} over {kshape}")
    mask = op.inputs.get("mask")
    kind = int(op.attrs.get("mask_kind", 0)) if mask is not None else 0
    ctx.emit(f"const i64 p = {ctx.load_as(pos, '0', 'i64')};",
             f"if (!index_ok(p, {L}, {int(Fault.ATTN_POS)})) return;",
             f"const int n = {L if kind else '(int)p + 1'};")   # a mask decides over every row
    per_seq = B > 1 and mask is not None and ctx.numel(mask) != ctx.shape(mask)[-1]
    if per_seq and ctx.numel(mask) != B * ctx.shape(mask)[-1]:
        raise ctx.fail(f"attention mask {ctx.shape(mask)} for a batch of {B}")
    t = f"b_ * {L} + t" if per_seq else "t"
    mexpr = None
    if kind == 1:
        mexpr = ctx.load_as(mask, t, "bool")
    elif kind == 2:
        mexpr = ctx.load_as(mask, t, "float")
    Lv = ctx.length(v, 2)
    setup = [f"const int kh = h / {hq // hkv};"] if B == 1 else \
        [f"const int b_ = h / {hq}; const int kh = b_ * {hkv} + (h % {hq}) / {hq // hkv};"]
    _attend_rows(ctx, rows=B * hq, D=D, Dv=D, q_off=f"h * {D}", k_row=f"(kh * {L} + t) * {D}",
                 v_row=f"(kh * {Lv} + t) * {D}", n_keys="n", scale=op.attrs["scale"], out_off=f"h * {D}",
                 q=q, k=k, v=v, mask_expr=mexpr, mask_kind=kind, setup=setup, softcap=op.attrs.get("softcap", 0.0))


def _attention_tokens(ctx: Ctx) -> None:
    """Attention of K > 1 query tokens per sequence (speculative decoding's verification step):
    q [B, Hq, K, D] over caches [B, Hkv, L, D], one warp per (sequence, query head, token); the
    mask [Bm, 1, Km, L] (Bm 1 or B, Km 1 or K) decides over every cache row (mask_kind 1 or 2:
    HF's causal mask over the cache, token k attends rows <= pos0 + k). ``pos`` (the rows the
    step's KV write wrote) is checked at its first element (fault ATTN_POS) and orders the
    attention after the write. ``mask_kind`` 3: the mask is the K write positions themselves
    (fusec/ir/mask_proofs.py proved HF's mask equal to ``row <= pos[k]``): token k attends rows
    ``0 .. pos[k]``, rows up to ``pos[K - 1]`` (checked, fault ATTN_POS)."""
    op = ctx.op
    q, k, v, pos, mask = op.inputs["q"], op.inputs["k"], op.inputs["v"], op.inputs["pos"], op.inputs.get("mask")
    B, hkv, _, D = ctx.shape(k)
    K = ctx.shape(q)[2]
    L, Lv = ctx.length(k, 2), ctx.length(v, 2)
    hq = ctx.shape(q)[1]
    kind = int(op.attrs.get("mask_kind", 0)) if mask is not None else 0
    mshape = ctx.shape(mask) if mask is not None else ()
    if kind == TOKEN_POSITIONS:   # the mask is the K write positions: token k attends rows <= pos[k]
        bad = ctx.numel(mask) != K
    else:
        bad = kind not in (1, 2) or len(mshape) != 4 or mshape[0] not in (1, B) or mshape[2] not in (1, K) \
            or mshape[-1] != ctx.shape(k)[2]
    if bad or hq % hkv or tuple(ctx.shape(q)) != (B, hq, K, D) or ctx.numel(ctx.out) != B * hq * K * D:
        raise ctx.fail(f"attention of q {ctx.shape(q)} over {ctx.shape(k)} with mask {mshape} (kind {kind})")
    last = K - 1 if kind == TOKEN_POSITIONS else 0   # the row checked: every row read is at most it
    ctx.emit(f"const i64 p = {ctx.load_as(pos, str(last), 'i64')};",
             f"if (!index_ok(p, {L}, {int(Fault.ATTN_POS)})) return;")
    setup = [f"const int b_ = h / {hq * K}, k_ = h % {K}; (void)k_;",
             f"const int kh = b_ * {hkv} + (h / {K} % {hq}) / {hq // hkv};"]
    if kind == TOKEN_POSITIONS:
        setup.append(f"const i64 lim_ = {ctx.load_as(mask, 'k_', 'i64')};")
        mexpr, n_keys, kind = "(t <= lim_)", "(int)p + 1", 1
    else:
        mb = "b_" if mshape[0] > 1 else "0"
        mk = "k_" if mshape[2] > 1 else "0"
        mexpr = ctx.load_as(mask, f"({mb} * {mshape[2]} + {mk}) * {L} + t", "bool" if kind == 1 else "float")
        n_keys = str(L)
    _attend_rows(ctx, rows=B * hq * K, D=D, Dv=D, q_off=f"h * {D}", k_row=f"(kh * {L} + t) * {D}",
                 v_row=f"(kh * {Lv} + t) * {D}", n_keys=n_keys, scale=op.attrs["scale"], out_off=f"h * {D}",
                 q=q, k=k, v=v, mask_expr=mexpr, mask_kind=kind, setup=setup, softcap=op.attrs.get("softcap", 0.0))


@emitter("fusec.sdpa")
def _sdpa(ctx: Ctx) -> None:
    """fusec.sdpa(q [B,Hq,S,D], k [B,Hk,L,D], v [B,Hk,L,Dv], attn_mask, dropout_p, is_causal,
    scale, enable_gqa[, softcap]): PyTorch SDPA over all L keys (Gemma-2's softcap of the scaled
    scores first, where it is not 0); bool mask (False: excluded) or additive
    float mask, broadcast to [B,Hq,S,L]; is_causal keeps keys t <= s; one warp per (b, h, s)."""
    a = ctx.args
    q, k, v = ctx.arg_tensor("q"), ctx.arg_tensor("k"), ctx.arg_tensor("v")
    if a.get("dropout_p"):
        raise ctx.fail("SDPA with dropout")
    qs, ks, vs = ctx.shape(q), ctx.shape(k), ctx.shape(v)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise ctx.fail(f"SDPA of q {qs}, k {ks}, v {vs} (4-D only)")
    B, Hq, S, D = qs
    _, Hk, L, _ = ks
    Dv = vs[-1]
    if Hq % Hk:
        raise ctx.fail(f"SDPA with {Hq} query heads over {Hk} KV heads")
    scale = a.get("scale")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    rows = B * Hq * S
    mexpr, kind = None, 0
    mask = ctx.tensor(a.get("attn_mask"))
    if mask is not None:
        try:
            mst = broadcast_strides(ctx.shape(mask), [B, Hq, S, L])
        except ValueError as e:
            raise ctx.fail(str(e)) from None
        kind = 1 if ctx.dtype(mask).is_floating_point is False and ctx.ctype(mask) == "bool" else 2
        moff = offset(["b_", "hh", "s_", "t"], mst)
        mexpr = ctx.load_as(mask, moff, "bool" if kind == 1 else "float")
    skip = "t > s_" if a.get("is_causal") else None
    # the query row s_ only where the mask or the causal skip reads it (unused: an NVRTC warning)
    s_row = f"const int s_ = h % {S}; " if re.search(r"\bs_\b", f"{mexpr} {skip}") else ""
    setup = [f"{s_row}const int hh = (h / {S}) % {Hq}; const int b_ = h / {S * Hq};",
             f"const int kh = b_ * {Hk} + hh / {Hq // Hk};"]
    _attend_rows(ctx, rows=rows, D=D, Dv=Dv, q_off=f"h * {D}", k_row=f"(kh * {L} + t) * {D}",
                 v_row=f"(kh * {L} + t) * {Dv}", n_keys=str(L), scale=scale, out_off=f"h * {Dv}",
                 q=q, k=k, v=v, mask_expr=mexpr, mask_kind=kind, setup=setup,
                 skip=skip, softcap=float(a.get("softcap") or 0.0))
