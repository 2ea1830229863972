"""The pattern of :class:`fusec.instructions.rms_qkv_rope.RmsQkvRope`: at an ``attention``,
the q/k/v projections that feed it (separate linears, or pieces of one fused product), their
optional RMSNorms (before the projections; per head or over the whole projection after them),
RoPE and the KV-cache writes, as one :class:`fusec.instructions.rule.Fusion` (:func:`match_qkv`).

Kept apart from the kind so that the kind's file holds its layout, tiles, call and simulator
tile, and this one how the graph is read.
"""
from __future__ import annotations

import torch

from fusec.ir import Graph, Op, Role
from fusec.ir.pieces import ALIGN, Rows, piece_of
from fusec.instructions.matvec_rows import MAX_SEQS, fused_batch, rms_attrs
from fusec.instructions.rule import Ctx, Fusion


def _linear_of(c: Ctx, t: str) -> tuple[Op, Rows | None, Op | None] | None:
    """``(linear, rows, piece op)``: the ``linear`` whose output ``t`` is (rows and piece op
    None), or whose product ``t`` is a piece of (:func:`fusec.ir.pieces.piece_of`: a fused
    q/k/v projection's slice, split, select or index); else None."""
    lin = c.prod(t, "linear")
    if lin is not None:
        return lin, None, None
    got = piece_of(c.g, c.prods, t, lambda o: c.g.tensors[o.inputs["w"]].shape[0]
                   if o.kind == "linear" and "w" in o.inputs else None)
    if got is None:
        return None
    piece, lin, rows = got
    return lin, rows, piece


def _head_stride(g: Graph, lin: Op, rows: dict[str, Rows], d: int) -> int | None:
    """The rows between two heads' first rows in the fused weight of ``lin`` whose pieces q, k
    and v take ``rows``: ``d`` where each piece is one range of whole heads (Falcon-7B's, when
    ``split_linear`` did not split it), the blocks' stride where each block is one head
    (GPT-NeoX: ``[H, 3, D]`` rows, stride ``3 * D``); one stride for the three (a piece of one
    head takes any). None where the pieces are not whole heads, overlap, or a view would start
    off a 16-byte boundary."""
    k = g.tensors[lin.inputs["w"]].shape[1]
    strides = set()
    for r in rows.values():
        if r.size == d:
            continue   # one head (a multi-query k or v): any stride addresses it
        if r.contiguous and r.size % d == 0:
            strides.add(d)
        elif r.block == d:
            strides.add(r.stride)
        else:
            return None
    if len(strides) > 1:
        return None
    ws = strides.pop() if strides else d
    taken = [set(r.indices()) for r in rows.values()]
    if sum(len(t) for t in taken) != len(set().union(*taken)):
        return None   # overlapping pieces
    b = lin.inputs.get("b")
    if any((r.start * k * g.tensors[lin.inputs["w"]].dtype.itemsize) % ALIGN
           or (b is not None and (r.start * g.tensors[b].dtype.itemsize) % ALIGN) for r in rows.values()):
        return None
    return ws


def _rows_view(g: Graph, base: str, rows: Rows, d: int, ws: int) -> str:
    """A view of the rows of weight (or bias) ``base`` that heads ``0 .. rows.size / d`` of a
    piece take, heads ``ws`` rows apart: from the piece's first row to its last head's end
    (``[(heads - 1) * ws + d, K]``, or ``[.., ]`` for a bias), at offset ``rows.start`` rows."""
    info = g.tensors[base]
    heads = rows.size // d
    n = (heads - 1) * ws + d
    per_row = info.numel // info.shape[0]
    return g.new_tensor(f"{base}_rows{rows.start}", (n, *info.shape[1:]), info.dtype, alias_of=base,
                        offset=rows.start * per_row)


def _seq_cos_sin(g: Graph, rope_q: Op, rope_k: Op, batch: int) -> tuple[str, str] | None:
    """At B > 1: the cos and sin that both ropes read when they are the step's own rows, one per
    sequence (``[B, .., rd]``: HF's rotary embedding of ``position_ids`` [B, 1], which
    ``fold_position`` does not table: docs/batch.md), as ``(cos, sin)``; None where q and k read
    different ones, or they are not ``batch`` contiguous rows of static size."""
    got = []
    for s in ("cos", "sin"):
        t = rope_q.inputs[s]
        info = g.tensors[t]
        if g.span(t) != g.span(rope_k.inputs[s]) or info.sym or g.tensors[g.root(t)].sym \
                or not info.shape or info.shape[0] != batch or info.numel % batch:
            return None
        got.append(t)
    cos, sin = got
    if g.tensors[cos].dtype != g.tensors[sin].dtype or g.tensors[cos].numel != g.tensors[sin].numel:
        return None
    return cos, sin


def _untranspose(c: Ctx, t: str, nseq: int, k: int) -> tuple[str, Op | None] | None:
    """At K > 1 query tokens: ``(x, permute)`` where ``t`` is an ``aten.permute`` with dims
    ``[0, 2, 1, 3]`` of ``x`` ``[B, K, H, D]`` (HF's ``view(B, K, H, D).transpose(1, 2)`` of a
    projection, which copies at K > 1: ``t`` is ``[B, H, K, D]``), read by nothing else (the
    fusion's inner tensors are private); ``(t, None)`` where no permute makes ``t``; None where
    one does but not this one. At K = 1 ``(t, None)``: the transpose moves only size-1 dims and
    ``normalize`` made it an alias."""
    if k == 1:
        return t, None
    p = c.prod(t, "aten.permute.default")
    if p is None:
        return t, None
    g = c.g
    args = p.attrs.get("args") or ()
    if set(p.inputs) != {"in0"} or len(args) != 2 or list(args[1]) != [0, 2, 1, 3] or "out" not in p.outputs:
        return None
    x, out = g.tensors[p.inputs["in0"]], g.tensors[p.outputs["out"]]
    if g.span(t) != g.span(p.outputs["out"]) or len(x.shape) != 4 or tuple(x.shape[:2]) != (nseq, k) \
            or out.alias_of is not None or x.sym or out.sym or out.dtype != x.dtype \
            or tuple(out.shape) != (x.shape[0], x.shape[2], x.shape[1], x.shape[3]):
        return None
    return p.inputs["in0"], p


def _token_cos_sin(g: Graph, rope_q: Op, rope_k: Op, nseq: int, k: int, rd: int) -> tuple[str, str, bool] | None:
    """At K > 1: the cos and sin that both ropes read, ``(cos, sin, shared)``: the step's rows in
    (sequence, token) order, ``[B, 1, K, rd]`` (HF's rotary embedding of ``position_ids`` [B, K];
    at B = 1 the position tables' K rows at the step's counter, looked up once in front of the
    layers), ``shared`` False; or, at B > 1, the K rows ``[1, 1, K, rd]`` that every sequence
    shares (no ``position_ids``: the positions are the cache's), ``shared`` True. None where q
    and k read different ones, or they are not those rows contiguous, of static size."""
    got = []
    for s in ("cos", "sin"):
        t = rope_q.inputs[s]
        info = g.tensors[t]
        shape = (1,) * (4 - len(info.shape)) + tuple(info.shape)
        if g.span(t) != g.span(rope_k.inputs[s]) or info.sym or g.tensors[g.root(t)].sym or len(shape) != 4 \
                or shape not in ((nseq, 1, k, rd), (1, 1, k, rd)):
            return None
        got.append((t, shape[0] != nseq))
    (cos, shared), (sin, shared_s) = got
    if shared != shared_s or g.tensors[cos].dtype != g.tensors[sin].dtype:
        return None
    return cos, sin, shared


def _batch_ok(g: Graph, lin_q: Op, rms: Op | None, wk: Op, rows: int) -> bool:
    """At R = B·K > 1 rows: the caches are written at one row per query token for all sequences
    (HF's StaticCache: ``cache_position``, K elements, shared by the sequences), x is the step's
    rows ``[R, H]`` and all R of them fit the staging budget at once in the dtype the kind stages
    (the norm's output, or x's own): :func:`fusec.instructions.matvec_rows.fused_batch`."""
    h = g.tensors[lin_q.inputs["w"]].shape[1]
    staged = g.tensors[rms.outputs["out"]].dtype if rms is not None else g.tensors[lin_q.inputs["x"]].dtype
    return g.tensors[wk.inputs["pos"]].numel == g.query_tokens() \
        and fused_batch(g, lin_q.inputs["x"], h, staged.itemsize) == rows


def match_qkv(c: Ctx, att: Op) -> Fusion | None:
    """At an ``attention``: its q is ``rope(linear(...))``, its k/v caches' last ``kv_write``s
    before it (one position per query token) write ``rope(linear(...))`` and ``linear(...)`` (or,
    for all three, pieces of ONE linear's product, each of whole heads a uniform stride apart:
    GPT-NeoX's interleaved q/k/v, :func:`_head_stride`; the kind then reads views of its weight),
    the three linears read one vector (an ``rmsnorm``'s output, the norm then part of the kind;
    else the vector as it is, ``norm`` False: a LayerNorm in front folds in as the kind's
    prologue, or static-size x that no op updates in place), q and k optionally through an
    ``rmsnorm`` each (both or neither; per head, weights of D, or over the whole projection,
    weights of Hq*D and Hkv*D: OLMo-2), with biases on all three or none, and q and k rotated by
    the same cos/sin ``table_lookup``s, over the same first ``rotary_dim`` values of each head
    (partial rotary, no per-head norm then) or all of them. Procedural: the caches are found by
    program order, and the optional parts make several shapes of one subgraph.

    A step of R = B·K > 1 rows (B sequences of K query tokens each, R at most
    :data:`fusec.instructions.matvec_rows.MAX_SEQS`; docs/batch.md) gives the op attribute
    ``batch`` R (template ``rms_qkv_rope_seqs``, row s being sequence s // K's token s % K) and,
    at K > 1, ``tokens`` K: x is ``[R, H]``, the caches ``[B, Hkv, L, D]`` written at K rows
    ``kv_pos`` [K] shared by the sequences (HF's StaticCache ``cache_position``), and the cos/sin
    either the step's own rows per row (inputs ``cos_table``/``sin_table`` [R, rd] and no
    ``rope_pos``: :func:`_seq_cos_sin` at K = 1, :func:`_token_cos_sin` at K > 1) or rows of
    tables at ``rope_pos`` (K = 1: the tables at the step's one position counter; K > 1 with the
    K rows ``[1, 1, K, rd]`` that B > 1 sequences share: those rows as the table, ``rope_pos`` the
    constant 0 .. K - 1). At K > 1 HF transposes q, k and v to ``[B, H, K, D]`` (a copying
    ``aten.permute``, before or after a per-head norm: :func:`_untranspose`); the op absorbs
    the permutes and writes q as the rope's output ``[B, Hq, K, D]``.

    Refused at R > 1 (the layer stays batched matvecs and generic ops): q/k norms over the whole
    projection (OLMo-2), rows whose staged x does not fit one group (:func:`_batch_ok`), cos/sin
    that are neither form above. Refused at K > 1 besides: q/k/v as pieces of one fused product
    (GPT-NeoX's interleaved heads; Falcon-7B's, cut along a view to heads that ``split_linear``
    splits only at K = 1; Phi-3's become separate linears there and are taken), a q, k or v that
    does not come through exactly one such permute of the whole projection (or of its per-head
    norm), KV writes of other than K positions.
    A per-head norm at R > 1 takes whole heads per tile (no ``qk_part``: heads are not split
    into pieces with tickets)."""
    g = c.g
    nseq, ntok = g.batch(), g.query_tokens()
    nrows = nseq * ntok
    if not 1 <= nrows <= MAX_SEQS:
        return None
    rope_q = c.prod(att.inputs["q"], "rope")
    kw = [o for o in g.ops[: g.ops.index(att)] if o.kind == "kv_write"]
    wk = next((o for o in reversed(kw) if g.root(o.outputs["cache"]) == g.root(att.inputs["k"])), None)
    wv = next((o for o in reversed(kw) if g.root(o.outputs["cache"]) == g.root(att.inputs["v"])), None)
    if rope_q is None or wk is None or wv is None or g.root(wk.inputs["pos"]) != g.root(wv.inputs["pos"]):
        return None
    rope_k = c.prod(wk.inputs["val"], "rope")
    got_v = _untranspose(c, wv.inputs["val"], nseq, ntok)
    if rope_k is None or got_v is None:
        return None
    src_v, perm_v = got_v
    inner = [rope_q, rope_k, wk, wv]
    perms = {"v": perm_v}   # at K > 1 the [B, K, H, D] -> [B, H, K, D] permutes, the op's own
    norms, lins, rows = {}, {}, {}
    for name, rope in (("q", rope_q), ("k", rope_k)):
        got = _untranspose(c, rope.inputs["x"], nseq, ntok)   # HF: norm then transpose (Qwen3) ...
        if got is None:
            return None
        src, perms[name] = got
        hn = c.prod(src, "rmsnorm")
        if hn is not None:
            norms[name] = hn
            inner.append(hn)
            src = hn.inputs["x"]
            if perms[name] is None:   # ... or transpose then norm (Gemma-3)
                got = _untranspose(c, src, nseq, ntok)
                if got is None:
                    return None
                src, perms[name] = got
        got = _linear_of(c, src)
        if got is None:
            return None
        lins[name], rows[name], piece = got
        inner += [lins[name]] + ([piece] if piece is not None else [])
    got = _linear_of(c, src_v)
    if got is None:
        return None
    lins["v"], rows["v"], piece = got
    inner += [lins["v"]] + ([piece] if piece is not None else [])
    if ntok > 1:   # one permute each, of the whole [B, K, H, D] projection (or of its per-head norm)
        if any(p is None for p in perms.values()):
            return None
        for h, p in perms.items():
            made = norms[h] if h in norms and c.prod(p.inputs["in0"], "rmsnorm") is norms[h] else lins[h]
            if g.span(p.inputs["in0"]) != g.span(made.outputs["out"]):
                return None
        inner += list(perms.values())
    inner = list({id(o): o for o in inner}.values())
    if set(norms) not in (set(), {"q", "k"}):
        return None
    # q, k and v as pieces of one fused product (all three, or none; not at K > 1)
    fused = [r is not None for r in rows.values()]
    if any(fused) and not (all(fused) and len({id(lin) for lin in lins.values()}) == 1 and ntok == 1):
        return None
    biased = ["b" in l.inputs for l in lins.values()]
    if any(biased) and not all(biased):   # Qwen2 biases q, k and v; a partial set stays unfused
        return None
    if len({g.root(l.inputs["x"]) for l in lins.values()}) != 1:
        return None
    rms = c.prod(lins["q"].inputs["x"], "rmsnorm")
    if rms is not None:
        inner.append(rms)
    else:
        x_root = g.root(lins["q"].inputs["x"])
        if g.tensors[lins["q"].inputs["x"]].sym or g.tensors[x_root].sym \
                or any(g.root(o.outputs[s]) == x_root for o in g.ops for s in o.mutates):
            return None
    cos_k, sin_k = (c.prod(rope_k.inputs[s], "table_lookup") for s in ("cos", "sin"))
    cos_q, sin_q = (c.prod(rope_q.inputs[s], "table_lookup") for s in ("cos", "sin"))
    kc = g.tensors[g.root(wk.outputs["cache"])]
    d = kc.shape[3]
    rd = rope_q.attrs.get("rotary_dim", d)
    # at R > 1 the cos/sin may be the step's own rows (positions per sequence, which fold_position
    # does not table; at K > 1 always rows: K of them per step): both ropes read the same ones
    # (None: the tables at the one position counter)
    seq_cs, shared = None, False
    if ntok > 1:
        got = _token_cos_sin(g, rope_q, rope_k, nseq, ntok, rd)
        if got is None:
            return None
        *seq_cs, shared = got
    elif nseq > 1 and None in (cos_k, sin_k, cos_q, sin_q):
        seq_cs = _seq_cos_sin(g, rope_q, rope_k, nseq)
        if seq_cs is None:
            return None
    elif None in (cos_k, sin_k, cos_q, sin_q) or cos_k is not cos_q or sin_k is not sin_q \
            or cos_q.inputs["pos"] != sin_q.inputs["pos"]:
        return None
    n_rows = {h: rows[h].size if rows[h] is not None else g.tensors[lins[h].inputs["w"]].shape[0] for h in "qkv"}
    nq = n_rows["q"] // d
    nkv = kc.shape[1]
    if kc.shape[0] != nseq or n_rows["k"] != nkv * d or nq % nkv or (all(fused) and n_rows["v"] != nkv * d):
        return None
    if nrows > 1 and not _batch_ok(g, lins["q"], rms, wk, nrows):
        return None
    if ntok > 1 and any(tuple(g.tensors[p.inputs["in0"]].shape) != (nseq, ntok, n_rows[h] // d, d)
                        for h, p in perms.items()):
        return None
    ws = _head_stride(g, lins["q"], rows, d) if all(fused) else d
    if ws is None:
        return None
    # a q/k norm per head (Qwen3, Gemma-3: over each head's D values) or over the whole projection
    # (OLMo-2: all of q's Hq*D values, all of k's Hkv*D, one weight each); both of one form, one
    # eps and one weight order (``w_fp32``: Gemma's weight applied in fp32): the kind has one of each
    whole = False
    if norms:
        qn, kn = norms["q"], norms["k"]
        if qn.attrs["eps"] != kn.attrs["eps"] or qn.attrs.get("w_fp32", False) != kn.attrs.get("w_fp32", False):
            return None
        if not all(g.tensors[hn.inputs["w"]].numel == d and g.tensors[hn.inputs["x"]].shape[-1] == d
                   for hn in norms.values()):
            whole = all(g.tensors[hn.inputs["w"]].numel == g.tensors[hn.inputs["x"]].shape[-1]
                        == g.tensors[hn.inputs["x"]].numel == n * d for hn, n in ((qn, nq), (kn, nkv)))
            if not whole or nrows > 1:   # a norm over the whole projection: one row only
                return None
    # q and k rotate the same first rd values of each head (partial rotary: rd < D, not with a
    # per-head norm), over the full head as the rope reads it, with tables rd wide
    cos_t, sin_t = seq_cs if seq_cs is not None else (cos_q.inputs["table"], sin_q.inputs["table"])
    table = g.tensors[cos_t]
    if rope_k.attrs.get("rotary_dim", d) != rd or not (0 < rd <= d and rd % 2 == 0) or (rd < d and norms) \
            or any(g.tensors[r.inputs["x"]].shape[-1] != d for r in (rope_q, rope_k)) \
            or (ntok == 1 and table.numel != table.shape[0] * rd) or g.tensors[sin_t].numel != table.numel \
            or (seq_cs is not None and ntok == 1 and table.numel != nseq * rd):
        return None

    def build() -> list[Op]:
        ins = {"x": rms.inputs["x"], "norm_w": rms.inputs["w"]} if rms is not None else {"x": lins["q"].inputs["x"]}
        if all(fused):   # row views of the fused weight (and bias), heads ws rows apart
            w_of = {h: _rows_view(g, lins[h].inputs["w"], rows[h], d, ws) for h in "qkv"}
            b_of = {h: _rows_view(g, lins[h].inputs["b"], rows[h], d, ws) for h in "qkv" if "b" in lins[h].inputs}
        else:
            w_of = {h: lins[h].inputs["w"] for h in "qkv"}
            b_of = {h: lins[h].inputs["b"] for h in "qkv" if "b" in lins[h].inputs}
        cs = (cos_t, sin_t)
        if ntok > 1:   # the rows as a table [R, rd] (or the K shared rows [K, rd])
            n_cs = ntok if shared else nrows
            cs = tuple(g.new_tensor(f"{t}_rows", (n_cs, rd), g.tensors[t].dtype, alias_of=t) for t in cs)
        ins.update({"wq": w_of["q"], "wk": w_of["k"], "wv": w_of["v"], "cos_table": cs[0], "sin_table": cs[1]})
        if shared:   # token k of every sequence reads row k of the K shared rows
            ins["rope_pos"] = g.new_tensor(f"{att.name}_token_rows", (ntok,), torch.int64, Role.CONSTANT,
                                           value=torch.arange(ntok, dtype=torch.int64))
        elif seq_cs is None:   # one position for every sequence: the tables' row at it
            ins["rope_pos"] = cos_q.inputs["pos"]
        ins["kv_pos"] = wk.inputs["pos"]
        # without an rmsnorm: x as the linears read it, staged in its own dtype (TN = TX)
        norm = {**rms_attrs(g, rms), "w_fp32": rms.attrs.get("w_fp32", False)} if rms is not None else \
            {"norm": False, "norm_dtype": g.tensors[ins["x"]].dtype, "w_fp32": False}
        attrs = {**norm, "dtype": g.tensors[rope_q.outputs["out"]].dtype, "n_q": nq, "n_kv": nkv, "head_dim": d}
        if rd < d:
            attrs["rotary_dim"] = rd
        if all(biased):
            ins["bq"], ins["bk"], ins["bv"] = (b_of[h] for h in "qkv")
        if ws != d:
            attrs["w_stride"] = ws
        if nrows > 1:
            attrs["batch"] = nrows
        if ntok > 1:
            attrs["tokens"] = ntok
        outs = {"q": rope_q.outputs["out"], "kcache": wk.outputs["cache"], "vcache": wv.outputs["cache"]}
        name = g.fresh_name("rms_qkv_rope")
        if norms:
            ins["q_norm_w"], ins["k_norm_w"] = norms["q"].inputs["w"], norms["k"].inputs["w"]
            attrs["qk_eps"] = norms["q"].attrs["eps"]
            if whole:
                attrs["qk_norm"] = "proj"
            attrs["qk_w_fp32"] = bool(norms["q"].attrs.get("w_fp32", False))
            # the q and k heads' projections before their norm, when a head is split over tiles
            # (one row only: at R > 1 a tile holds whole heads)
            if nrows == 1:
                outs["qk_part"] = g.new_tensor(f"{name}_qk_part", (nq + nkv, d), torch.float32)
        return [Op(name, "rms_qkv_rope", ins, outs, attrs=attrs, mutates=("kcache", "vcache"),
                   source=rope_q.source)]

    return Fusion(inner, (rope_q.outputs["out"],), build)


def proj_norm(op: Op) -> bool:
    """Whether the op's q/k RMSNorms are over the whole projection (OLMo-2; attribute
    ``qk_norm`` "proj"), not per head."""
    return op.attrs.get("qk_norm") == "proj"


def w_stride(op: Op) -> int:
    """Rows between two heads' first rows in ``wq``/``wk``/``wv`` (and the biases): attribute
    ``w_stride`` (views of a fused weight interleaved per head, GPT-NeoX's ``3 * D``), else the
    head's ``head_dim`` (consecutive heads)."""
    return op.attrs.get("w_stride", op.attrs["head_dim"])


def rotary_dim(op: Op) -> int:
    """The rotated values per q/k head: attribute ``rotary_dim`` (partial rotary), else the head."""
    return op.attrs.get("rotary_dim", op.attrs["head_dim"])


def seq_rope(op: Op) -> bool:
    """Whether a batched op's cos/sin are the step's rows, one per row of the op (inputs
    ``cos_table``/``sin_table`` [R, rd], no ``rope_pos``), not rows of tables at ``rope_pos``."""
    return "rope_pos" not in op.inputs


def tokens(op: Op) -> int:
    """K, the query tokens per sequence of an op of R = B·K rows (attribute ``tokens``; absent:
    1). Row s of the op is sequence s // K's token s % K."""
    return op.attrs.get("tokens", 1)
