"""The pattern of :class:`fusec.instructions.rms_qkv_rope.RmsQkvRope`: at an ``attention``,
the q/k/v projections that feed it (separate linears, or pieces of one fused product), their
optional RMSNorms (before the projections; per head or over the whole projection after them),
RoPE and the KV-cache writes, as one :class:`fusec.instructions.rule.Fusion` (:func:`match_qkv`).

Kept apart from the kind so that the kind's file holds its layout, tiles, call and simulator
tile, and this one how the graph is read.
"""
from __future__ import annotations

import torch

from fusec.ir import Graph, Op
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


def _batch_ok(g: Graph, lin_q: Op, rms: Op | None, wk: Op, batch: int) -> bool:
    """At B > 1: the caches are written at one row for all sequences (HF's StaticCache: one
    ``cache_position``), x is the B sequences' rows ``[B, H]`` and all B of them fit the
    staging budget at once in the dtype the kind stages (the norm's output, or x's own):
    :func:`fusec.instructions.matvec_rows.fused_batch`."""
    h = g.tensors[lin_q.inputs["w"]].shape[1]
    staged = g.tensors[rms.outputs["out"]].dtype if rms is not None else g.tensors[lin_q.inputs["x"]].dtype
    return g.tensors[wk.inputs["pos"]].numel == 1 and fused_batch(g, lin_q.inputs["x"], h, staged.itemsize) == batch


def match_qkv(c: Ctx, att: Op) -> Fusion | None:
    """At an ``attention``: its q is ``rope(linear(...))``, its k/v caches' last ``kv_write``s
    before it (one position) write ``rope(linear(...))`` and ``linear(...)`` (or, for all three,
    pieces of ONE linear's product, each of whole heads a uniform stride apart: GPT-NeoX's
    interleaved q/k/v, :func:`_head_stride`; the kind then reads views of its weight), the three linears
    read one vector (an ``rmsnorm``'s output, the norm then part of the kind; else the vector as
    it is, ``norm`` False: a LayerNorm in front folds in as the kind's prologue, or static-size
    x that no op updates in place), q and k optionally through an ``rmsnorm`` each (both or
    neither; per head, weights of D, or over the whole projection, weights of Hq*D and Hkv*D:
    OLMo-2), with biases on all three or none, and q and k rotated by the same cos/sin
    ``table_lookup``s, over the same first ``rotary_dim`` values of each head (partial rotary, no
    per-head norm then) or all of them. Procedural: the caches are found by program order, and
    the optional parts make several shapes of one subgraph.

    In a step of B > 1 sequences of one query token each (at most
    :data:`fusec.instructions.matvec_rows.MAX_SEQS`; docs/batch.md) the op gets attribute
    ``batch`` B: x is ``[B, H]``, the caches ``[B, Hkv, L, D]`` written at one shared row, and the
    cos/sin either the tables at one position (the step's positions one counter) or the step's
    own rows per sequence (:func:`_seq_cos_sin`: inputs ``cos_table``/``sin_table`` [B, rd] and
    no ``rope_pos``). Refused at B > 1 (the layer stays batched matvecs and generic ops): q/k
    norms over the whole projection (OLMo-2), a step of K > 1 query tokens, a batch whose
    staged x does not fit one group (:func:`_batch_ok`). A per-head norm at B > 1 takes whole
    heads per tile (no ``qk_part``: heads are not split into pieces with tickets)."""
    g = c.g
    rope_q = c.prod(att.inputs["q"], "rope")
    kw = [o for o in g.ops[: g.ops.index(att)] if o.kind == "kv_write"]
    wk = next((o for o in reversed(kw) if g.root(o.outputs["cache"]) == g.root(att.inputs["k"])), None)
    wv = next((o for o in reversed(kw) if g.root(o.outputs["cache"]) == g.root(att.inputs["v"])), None)
    if rope_q is None or wk is None or wv is None or g.root(wk.inputs["pos"]) != g.root(wv.inputs["pos"]):
        return None
    rope_k = c.prod(wk.inputs["val"], "rope")
    src_v = _linear_of(c, wv.inputs["val"])
    if rope_k is None or src_v is None:
        return None
    inner = [rope_q, rope_k, wk, wv]
    norms, lins, rows = {}, {}, {}
    for name, rope in (("q", rope_q), ("k", rope_k)):
        src = rope.inputs["x"]
        hn = c.prod(src, "rmsnorm")
        if hn is not None:
            norms[name] = hn
            inner.append(hn)
            src = hn.inputs["x"]
        got = _linear_of(c, src)
        if got is None:
            return None
        lins[name], rows[name], piece = got
        inner += [lins[name]] + ([piece] if piece is not None else [])
    lins["v"], rows["v"], piece = src_v
    inner += [lins["v"]] + ([piece] if piece is not None else [])
    inner = list({id(o): o for o in inner}.values())
    if set(norms) not in (set(), {"q", "k"}):
        return None
    # q, k and v as pieces of one fused product (all three, or none)
    fused = [r is not None for r in rows.values()]
    if any(fused) and not (all(fused) and len({id(lin) for lin in lins.values()}) == 1):
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
    batch = g.batch()
    if g.query_tokens() != 1 or not 1 <= batch <= MAX_SEQS:
        return None
    cos_k, sin_k = (c.prod(rope_k.inputs[s], "table_lookup") for s in ("cos", "sin"))
    cos_q, sin_q = (c.prod(rope_q.inputs[s], "table_lookup") for s in ("cos", "sin"))
    # at B > 1 the cos/sin may be the step's own [B, .., rd] rows (positions per sequence, which
    # fold_position does not table): both ropes read the same ones (None: the tables)
    seq_cs = None
    if batch > 1 and None in (cos_k, sin_k, cos_q, sin_q):
        seq_cs = _seq_cos_sin(g, rope_q, rope_k, batch)
        if seq_cs is None:
            return None
    elif None in (cos_k, sin_k, cos_q, sin_q) or cos_k is not cos_q or sin_k is not sin_q \
            or cos_q.inputs["pos"] != sin_q.inputs["pos"]:
        return None
    kc = g.tensors[g.root(wk.outputs["cache"])]
    d = kc.shape[3]
    n_rows = {h: rows[h].size if rows[h] is not None else g.tensors[lins[h].inputs["w"]].shape[0] for h in "qkv"}
    nq = n_rows["q"] // d
    nkv = kc.shape[1]
    if kc.shape[0] != batch or n_rows["k"] != nkv * d or nq % nkv or (all(fused) and n_rows["v"] != nkv * d):
        return None
    if batch > 1 and not _batch_ok(g, lins["q"], rms, wk, batch):
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
            if not whole or batch > 1:   # a norm over the whole projection: batch 1 only
                return None
    # q and k rotate the same first rd values of each head (partial rotary: rd < D, not with a
    # per-head norm), over the full head as the rope reads it, with tables rd wide
    rd = rope_q.attrs.get("rotary_dim", d)
    cos_t, sin_t = seq_cs if seq_cs is not None else (cos_q.inputs["table"], sin_q.inputs["table"])
    table = g.tensors[cos_t]
    if rope_k.attrs.get("rotary_dim", d) != rd or not (0 < rd <= d and rd % 2 == 0) or (rd < d and norms) \
            or any(g.tensors[r.inputs["x"]].shape[-1] != d for r in (rope_q, rope_k)) \
            or table.numel != table.shape[0] * rd or g.tensors[sin_t].numel != table.numel \
            or (seq_cs is not None and table.numel != batch * rd):
        return None

    def build() -> list[Op]:
        ins = {"x": rms.inputs["x"], "norm_w": rms.inputs["w"]} if rms is not None else {"x": lins["q"].inputs["x"]}
        if all(fused):   # row views of the fused weight (and bias), heads ws rows apart
            w_of = {h: _rows_view(g, lins[h].inputs["w"], rows[h], d, ws) for h in "qkv"}
            b_of = {h: _rows_view(g, lins[h].inputs["b"], rows[h], d, ws) for h in "qkv" if "b" in lins[h].inputs}
        else:
            w_of = {h: lins[h].inputs["w"] for h in "qkv"}
            b_of = {h: lins[h].inputs["b"] for h in "qkv" if "b" in lins[h].inputs}
        ins.update({"wq": w_of["q"], "wk": w_of["k"], "wv": w_of["v"], "cos_table": cos_t, "sin_table": sin_t})
        if seq_cs is None:   # one position for every sequence: the tables' row at it
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
        if batch > 1:
            attrs["batch"] = batch
        outs = {"q": rope_q.outputs["out"], "kcache": wk.outputs["cache"], "vcache": wv.outputs["cache"]}
        name = g.fresh_name("rms_qkv_rope")
        if norms:
            ins["q_norm_w"], ins["k_norm_w"] = norms["q"].inputs["w"], norms["k"].inputs["w"]
            attrs["qk_eps"] = norms["q"].attrs["eps"]
            if whole:
                attrs["qk_norm"] = "proj"
            attrs["qk_w_fp32"] = bool(norms["q"].attrs.get("w_fp32", False))
            # the q and k heads' projections before their norm, when a head is split over tiles
            # (batch 1 only: at B > 1 a tile holds whole heads)
            if batch == 1:
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
    """Whether a batched op's cos/sin are the step's rows, one per sequence (inputs
    ``cos_table``/``sin_table`` [B, rd], no ``rope_pos``), not tables at one position."""
    return "rope_pos" not in op.inputs
