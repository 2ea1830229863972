"""recognize: raise ATen subgraphs to semantic ops with declarative patterns.

Expects: a normalized graph (views are aliases). Guarantees: these subgraphs are replaced,
with the same values, by one op each:

* ``linear(x, w[, b])``     ``mm(x, permute(w, [1, 0]))`` / ``addmm(b, x, permute(w))``, w a weight
* ``rmsnorm(x, w; eps)``    HF ``LlamaRMSNorm``: ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``;
  Gemma's ``(x * rsqrt(mean(x^2) + eps) * w).to(dtype)`` (``w`` = the folded ``1 + weight``)
  as ``rmsnorm`` with ``w_fp32``
* ``silu_mul(gate, up)``    ``gate * sigmoid(gate) * up``
* ``gelu_mul(gate, up; act)``  ``gelu(gate) * up`` (GeGLU; ``act`` "gelu_tanh" or "gelu")
* ``layernorm(x[, w][, b]; eps)``  ``native_layer_norm`` over the last dim of one row, statistics unread
* ``rope(x, cos, sin)``     ``x * cos + cat(-x2, x1) * sin`` (``rotate_half``)
* ``rope(x, cos, sin; rotary_dim)``  partial rotary embeddings (GPT-NeoX ``rotary_pct``, Phi
  and StableLM ``partial_rotary_factor``): ``cat(rope(x[..., :rd], cos, sin), x[..., rd:])``
  over the last dim, cos/sin of width ``rd`` < D; the first ``rotary_dim`` values of each row
  are rotated (half-split within them), the rest pass through unchanged
* ``rope(x, cos, sin; fp32_math)``  HF OLMo's and OLMo-2's ``apply_rotary_pos_emb``: x of the
  model dtype times cos/sin kept in fp32 (PyTorch promotes: the products and the sum are fp32),
  cast back to x's dtype (``.to(q_type)``): ``cast(rope(x, cos, sin))`` is one ``rope`` of x's
  dtype; its math is fp32 rounded once at the end, which the ``rope`` op computes anyway
* ``kv_write(pos, val) -> cache``  ``copy_(cache, index_put(cache, [None, None, pos], val))``;
  readers of the functional result read the cache buffer after the write; ``pos`` one position,
  or K of them (K query tokens per sequence: ``val`` [B, H, K, D], HF's ``index_copy_`` at
  ``cache_position`` [K])
* ``attention(q, k, v, pos[, mask]; scale, mask_kind[, softcap])``  ``fusec.sdpa`` over KV
  caches, seen through the GQA ``repeat_kv`` expand (``softcap``: Gemma-2's logit softcap,
  fusec.sdpa's last argument, only when it is not 0). With a mask that equals ``kv_index <= pos`` for every
  position (checked by evaluating the mask at every position of the cache; one row, or in a batch
  [B, 1, 1, L] whose every sequence's row is causal: no prompt padded) the mask is dropped
  (``mask_kind`` 0). Any other mask over the ``L`` cache rows (HF generate()'s precomputed 4-D
  bool mask, a mask built from a user's ``attention_mask``; in a batch, [B, 1, 1, L] with one
  row per sequence, from left-padded prompts; with K query tokens per sequence, [1 or B, 1, K,
  L] with one row per query token, HF's causal mask over the cache) is read by the attention:
  ``mask_kind`` 1 (bool, True attends) or 2 (additive float); the attention then reads every
  cache row and the mask decides (``pos``, the row the step's ``kv_write`` wrote, only orders it
  after the write). A K-token step's bool mask ``[1, 1, K, L]`` that equals ``row <= pos[k]``
  for token k and its write positions ``pos`` [K] at every counter value (checked by evaluating
  both) is replaced by those positions: ``mask_kind`` 3, ``mask`` and ``pos`` the K write
  positions (:func:`fusec.ir.mask_proofs.token_positions`), so that nothing of the cache's
  length is left outside the caches (one step for every length) and the attention reads rows
  ``0 .. pos[K - 1]`` only.
  A bool mask that stays (a left-padded batch's: HF's causal part AND the padding part) and one of
  whose AND terms, a function of the position, attends no row past the last write position
  (:func:`fusec.ir.mask_proofs.bounded_by_positions`) gets the attr ``mask_bound``: the attention
  reads rows ``0 .. pos[-1]`` under the mask; at one query token, a term that is exactly the
  causal mask of that position (HF's, or the one generate()'s callers AND onto the 4-D masks they
  pass, :mod:`fusec.frontend.mask_bound`) leaves the mask, all True over those rows
  (:func:`fusec.ir.mask_proofs.without_causal_term`).

Anything that does not match stays as it was. Dead ops are removed.
"""
from __future__ import annotations

import logging

import torch

from fusec.ir import mask_proofs, position
from fusec.ir import Graph, Op, Ref, Role
from fusec.ir.pattern import Matcher, cast, lit, op, sem, var
from fusec.ir.semantics import TOKEN_POSITIONS, default_scale

from fusec.passes import dce

log = logging.getLogger("fusec.passes.recognize")


def _is_weight(g: Graph, t: str) -> bool:
    return g.tensors[g.root(t)].role == Role.WEIGHT


def _is_param(g: Graph, t: str) -> bool:
    """A weight, or a constant folded from weights (Gemma's ``1 + weight``)."""
    return g.tensors[g.root(t)].role in (Role.WEIGHT, Role.CONSTANT)


_XF = cast(var("x"))
RMSNORM = op("aten.mul.Tensor", var("w", _is_weight), cast(op(
    "aten.mul.Tensor", _XF, op("aten.rsqrt.default", op(
        "aten.add.Tensor", op("aten.mean.dim", op("aten.pow.Tensor_Scalar", _XF, 2), [-1], True),
        lit("eps"))), commutative=True)), commutative=True)
# Gemma: (x * rsqrt(mean(x^2) + eps) * (1 + w)).to(dtype), the weight in fp32 before one rounding
RMSNORM_W32 = cast(op("aten.mul.Tensor", op(
    "aten.mul.Tensor", _XF, op("aten.rsqrt.default", op(
        "aten.add.Tensor", op("aten.mean.dim", op("aten.pow.Tensor_Scalar", _XF, 2), [-1], True),
        lit("eps"))), commutative=True), var("w", _is_param), commutative=True))
LINEAR = op("aten.mm.default", var("x"), op("aten.permute.default", var("w", _is_weight), [1, 0]))
LINEAR_BIAS = op("aten.addmm.default", var("b"), var("x"),
                 op("aten.permute.default", var("w", _is_weight), [1, 0]))
_GATE = cast(var("gate"))
SILU_MUL = op("aten.mul.Tensor", cast(op("aten.mul.Tensor", _GATE, op("aten.sigmoid.default", _GATE),
                                         commutative=True)), var("up"), commutative=True)
ROPE = op("aten.add.Tensor",
          op("aten.mul.Tensor", var("x"), var("cos"), commutative=True),
          op("aten.mul.Tensor", op("aten.cat.default", [
              op("aten.neg.default", op("aten.slice.Tensor", var("x"), lit("d1"), lit("h"), lit("end"),
                                        partial=True)),
              op("aten.slice.Tensor", var("x"), lit("d2"), 0, lit("h2"), partial=True)], lit("d3")),
             var("sin"), commutative=True), commutative=True)

# HF's partial rotary (GPTNeoX/Phi/StableLM/Phi-3 ``apply_rotary_pos_emb``): the rotated part
# is a full-width RoPE of the first rd values (already a ``rope`` op), the rest passes through
_X_ROT = op("aten.slice.Tensor", var("x"), lit("d1"), 0, lit("rotary_dim"))
_X_PASS = op("aten.slice.Tensor", var("x"), lit("d2"), lit("rd2"), lit("end"))
PARTIAL_ROPE = op("aten.cat.default", [sem("rope", x=_X_ROT, cos=var("cos"), sin=var("sin")), _X_PASS],
                  lit("d3"))

GELU_MUL = op("aten.mul.Tensor", cast(op("aten.gelu.default", var("gate"), partial=True, bind="act")),
              var("up"), commutative=True)

# (pattern, semantic kind, input slots, attribute literals, fixed attributes)
RULES = [
    (LINEAR_BIAS, "linear", ("x", "w", "b"), (), {}),
    (LINEAR, "linear", ("x", "w"), (), {}),
    (RMSNORM_W32, "rmsnorm", ("x", "w"), ("eps",), {"w_fp32": True}),
    (RMSNORM, "rmsnorm", ("x", "w"), ("eps",), {}),
    (SILU_MUL, "silu_mul", ("gate", "up"), (), {}),
    (GELU_MUL, "gelu_mul", ("gate", "up"), (), {}),
    (ROPE, "rope", ("x", "cos", "sin"), (), {}),
    (PARTIAL_ROPE, "rope", ("x", "cos", "sin"), ("rotary_dim",), {}),
]


def _rewrite(g: Graph, pattern, kind: str, slots, lits, fixed) -> int:
    m = Matcher(g)
    n = 0
    new_ops = []
    for o in g.ops:
        out = o.outputs.get("out")
        b = m.match(pattern, out) if out is not None and not o.mutates else None
        if b is None or (kind == "rope" and not (_partial_ok(g, b, out) if "rd2" in b else _rope_ok(g, b))):
            new_ops.append(o)
            continue
        attrs = {**{k: b[k] for k in lits}, **fixed}
        if attrs.get("w_fp32") and g.tensors[b["x"]].dtype == g.tensors[out].dtype == torch.float32:
            attrs["w_fp32"] = False   # in fp32 both orders round alike: keep the plain kernels
        if kind == "gelu_mul":
            gelu = m.producer(b["act"])
            approx = gelu.attrs["kwargs"].get("approximate", gelu.attrs["args"][1] if len(gelu.attrs["args"]) > 1 else "none")
            attrs["act"] = "gelu_tanh" if approx == "tanh" else "gelu"
        new_ops.append(Op(o.name, kind, {s: b[s] for s in slots}, {"out": out}, attrs=attrs,
                          source=o.source))
        n += 1
    g.ops = new_ops
    return n


def _rope_ok(g: Graph, b: dict) -> bool:
    last = len(g.tensors[b["x"]].shape) - 1
    d = g.tensors[b["x"]].shape[-1]
    dims_ok = all(b[k] in (-1, last) for k in ("d1", "d2", "d3"))
    return dims_ok and b["h"] == b["h2"] == d // 2 and b["end"] >= d


def _partial_ok(g: Graph, b: dict, out: str) -> bool:
    """A partial rotary's slices and cat: over the last dim of x (D values), ``[0, rd)`` rotated
    and ``[rd, D)`` passed through in that order, 0 < rd < D, rd even, x and the result of one
    shape and dtype."""
    x = g.tensors[b["x"]]
    last, d, rd = len(x.shape) - 1, x.shape[-1], b["rotary_dim"]
    o = g.tensors[out]
    return all(b[k] in (-1, last) for k in ("d1", "d2", "d3")) and isinstance(rd, int) and 0 < rd < d \
        and rd % 2 == 0 and b["rd2"] == rd and b["end"] >= d and tuple(o.shape) == tuple(x.shape) \
        and o.dtype == x.dtype


def _fp32_ropes(g: Graph) -> int:
    """``cast(rope(x, cos, sin))`` with the ``rope``'s result of another dtype than x (fp32: x
    of the model dtype times fp32 cos/sin, PyTorch's promotion) and the cast back to x's dtype,
    read by nothing else -> one ``rope(x, cos, sin)`` of x's dtype with ``fp32_math`` (and the
    rope's ``rotary_dim``, if any). HF OLMo's and OLMo-2's ``apply_rotary_pos_emb`` computes
    ``(q * cos + rotate_half(q) * sin).to(q.dtype)`` with cos/sin in fp32: the fp32 value rounded
    once to the model dtype, which is what a ``rope`` op computes for any output dtype
    (:func:`fusec.ir.semantics.rotate`, then one rounding): the same value, one op fewer, and
    the q/k reach ``rms_qkv_rope`` (whose match reads ``rope`` ops)."""
    prods, users = g.producers(), g.users()
    n = 0
    replace: dict[str, Op] = {}
    drop: set[str] = set()
    for o in g.ops:
        if o.kind not in ("aten._to_copy.default", "prims.convert_element_type.default") or not o.inputs:
            continue
        src = next(iter(o.inputs.values()))
        rope = prods.get(g.root(src))
        out = o.outputs.get("out")
        if rope is None or rope.kind != "rope" or out is None or rope.name in drop:
            continue
        x, r_out = g.tensors[rope.inputs["x"]], g.tensors[rope.outputs["out"]]
        o_info = g.tensors[out]
        if r_out.dtype == x.dtype or o_info.dtype != x.dtype or tuple(o_info.shape) != tuple(r_out.shape) \
                or g.tensors[src].numel != r_out.numel \
                or [u.name for u in users.get(g.root(rope.outputs["out"]), [])] != [o.name]:
            continue
        attrs = {**rope.attrs, "fp32_math": True}
        replace[o.name] = Op(o.name, "rope", dict(rope.inputs), {"out": out}, attrs=attrs, source=rope.source)
        drop.add(rope.name)
        n += 1
    g.ops = [replace.get(o.name, o) for o in g.ops if o.name not in drop]
    return n


def _layernorms(g: Graph) -> int:
    """``aten.native_layer_norm(x, [H], w, b, eps)`` over one row (x of H elements) whose mean
    and rstd nobody reads -> ``layernorm(x[, w][, b]; eps)``. Several rows (a batch of
    sequences) stay ATen: the ``layernorm`` kind normalizes all of x as one row."""
    users = g.users()
    n = 0
    new_ops = []
    for o in g.ops:
        if o.kind != "aten.native_layer_norm.default":
            new_ops.append(o)
            continue
        x, shape, w, b, eps = (list(o.attrs["args"]) + [None] * 5)[:5]
        xs = o.inputs[x.slot] if isinstance(x, Ref) else None
        stats_read = any(users.get(g.root(o.outputs[s])) for s in ("out1", "out2") if s in o.outputs)
        if xs is None or list(shape) != [g.tensors[xs].shape[-1]] or stats_read or eps is None \
                or g.tensors[xs].numel != g.tensors[xs].shape[-1]:   # the kind takes one row (batch 1)
            new_ops.append(o)
            continue
        ins = {"x": xs}
        if isinstance(w, Ref):
            ins["w"] = o.inputs[w.slot]
        if isinstance(b, Ref):
            ins["b"] = o.inputs[b.slot]
        new_ops.append(Op(o.name, "layernorm", ins, {"out": o.outputs["out0"]}, attrs={"eps": float(eps)},
                          source=o.source))
        n += 1
    g.ops = new_ops
    return n


def _kv_writes(g: Graph) -> int:
    prods = g.producers()
    n = 0
    replace: dict[str, Op] = {}
    drop = set()
    for o in g.ops:
        if o.kind != "aten.copy_.default":
            continue
        cache = o.outputs["mut0"]
        src = prods.get(g.root(o.inputs["in1"]))
        if src is None or src.kind != "aten.index_put.default" or g.root(src.inputs["in0"]) != g.root(cache):
            continue
        args = src.attrs["args"]
        idx = args[1]
        if len(args) > 3 and args[3]:
            continue  # accumulate=True
        if not (len(idx) == 3 and idx[0] is None and idx[1] is None and idx[2] is not None):
            continue
        if g.tensors[g.root(cache)].role != Role.KV_CACHE or not _write_rows(g, src.inputs[idx[2].slot],
                                                                              src.inputs[args[2].slot], cache):
            continue
        kw = Op(src.name, "kv_write", {"pos": src.inputs[idx[2].slot], "val": src.inputs[args[2].slot]},
                {"cache": cache}, mutates=("cache",), source=src.source)
        g.tensors[src.outputs["out"]].alias_of = cache
        replace[src.name] = kw
        drop.add(o.name)
        n += 1
    g.ops = [replace.get(o.name, o) for o in g.ops if o.name not in drop]
    return n


def _write_rows(g: Graph, pos: str, val: str, cache: str) -> bool:
    """Whether ``cache[:, :, pos] = val`` writes whole rows a ``kv_write`` takes: one position
    (a decode step), or K positions (a 1-D int64 ``pos`` of K elements: K query tokens per
    sequence, HF's ``cache_position``) whose K rows ``val`` [B, H, K, D] holds in order."""
    k = g.tensors[pos].numel
    if k == 1:
        return True
    c, v = g.tensors[g.root(cache)], g.tensors[val]
    return g.tensors[pos].dtype == torch.int64 and len(g.tensors[pos].shape) == 1 and len(c.shape) == 4 \
        and tuple(v.shape) == (c.shape[0], c.shape[1], k, c.shape[3])


def _roll_index(g: Graph, t: str, n: int) -> bool:
    """Whether ``t`` is a constant equal to ``(arange(n) + 1) % n``: ``torch.roll(x, -1)`` along
    a dim of ``n`` rows (HF's sliding-window cache, once full, rolls its rows left by one)."""
    info = g.tensors[g.root(t)]
    if info.role != Role.CONSTANT or info.value is None or g.tensors[t].numel != n or info.dtype != torch.int64:
        return False
    return torch.equal(info.value.reshape(-1), (torch.arange(n) + 1) % n)


def _last_row_index(g: Graph, t: str, n: int) -> bool:
    """Whether ``t`` is a one-element constant naming row ``n - 1`` (``-1`` or ``n - 1``)."""
    info = g.tensors[g.root(t)]
    return info.role == Role.CONSTANT and info.value is not None and g.tensors[t].numel == 1 \
        and int(info.value.reshape(-1)[0]) in (-1, n - 1)


def _kv_rolls(g: Graph) -> int:
    """``copy_(cache, [copy(cache,] index_put(index_select(cache, 2, (arange(W) + 1) % W),
    [None, None, -1], val)))`` -> ``kv_roll(src=cache) -> cache`` (rows ``[0, W-1)`` take rows
    ``[1, W)``, in place) then ``kv_write(pos=W-1, val) -> cache``: HF's rolling sliding-window
    update (``StaticSlidingWindowLayer`` once its window is full: ``roll(-1)``, the new row at
    the end, ``copy_`` back), so the cache holds HF's layout after the step, and readers of the
    functional result read the cache after the write (the attention then sees a KV cache). Only
    when nothing else reads the cache in the step; caches of a run-time length stay as they are.
    The ``kv_roll`` ops go first in the step, in layer order (they read nothing the step makes):
    the SMs move every window while the first layer starts, and no layer's QKV waits on its
    roll's latency."""
    prods, users = g.producers(), g.users()
    last_row: dict[int, str] = {}
    replace: dict[str, list[Op]] = {}
    rolls: list[Op] = []
    drop: set[str] = set()
    for o in g.ops:
        if o.kind != "aten.copy_.default":
            continue
        cache = g.root(o.outputs["mut0"])
        info = g.tensors[cache]
        if info.role != Role.KV_CACHE or info.sym or len(info.shape) != 4:
            continue
        n = info.shape[2]
        chain = [o]
        p = prods.get(g.root(o.inputs["in1"]))
        if p is not None and p.kind == "aten.copy.default" and g.root(p.inputs["in0"]) == cache:
            chain.append(p)
            p = prods.get(g.root(p.inputs["in1"]))
        if p is None or p.kind != "aten.index_put.default":
            continue
        args = p.attrs["args"]
        idx = args[1] if len(args) > 1 else None
        if (len(args) > 3 and args[3]) or p.attrs.get("kwargs") or not isinstance(idx, (list, tuple)) \
                or len(idx) != 3 or idx[0] is not None or idx[1] is not None or not isinstance(idx[2], Ref) \
                or not _last_row_index(g, p.inputs[idx[2].slot], n):
            continue
        val = p.inputs[args[2].slot]
        sel = prods.get(g.root(p.inputs[args[0].slot]))
        if sel is None or sel.kind != "aten.index_select.default" or g.root(sel.inputs["in0"]) != cache:
            continue
        sargs = sel.attrs["args"]
        if sargs[1] not in (2, -2) or not _roll_index(g, sel.inputs[sargs[2].slot], n) \
                or g.tensors[val].numel != info.shape[0] * info.shape[1] * info.shape[3] \
                or g.tensors[val].shape[-1] != info.shape[3] or g.tensors[val].dtype != info.dtype:
            continue
        chain += [p, sel]
        names = {c.name for c in chain}
        if any(u.name not in names for u in users.get(cache, [])) or \
                any(u.name not in names for u in users.get(g.root(sel.outputs["out"]), [])):
            continue   # the step reads the cache (or the rolled copy) elsewhere: left as it is
        if n not in last_row:
            last_row[n] = g.new_tensor(f"kv_last_row_{n}", (1,), torch.int64, Role.CONSTANT,
                                       value=torch.tensor([n - 1]))
        rolls.append(Op(sel.name, "kv_roll", {"src": cache}, {"cache": cache}, mutates=("cache",),
                        attrs={"shift": 1}, source=sel.source))
        replace[sel.name] = []
        replace[p.name] = [Op(p.name, "kv_write", {"pos": last_row[n], "val": val}, {"cache": cache},
                              mutates=("cache",), source=p.source)]
        for c in chain[:-1]:   # the functional results read the cache after the write
            if c.kind != "aten.copy_.default":
                g.tensors[c.outputs["out"]].alias_of = cache
        drop |= {c.name for c in chain[:1] + chain[1:-2]}
    g.ops = rolls + [x for o in g.ops if o.name not in drop for x in replace.get(o.name, [o])]
    return len(rolls)


def _cache_of(g: Graph, prods: dict, t: str) -> tuple[str, int] | None:
    """The KV cache that ``t`` reads (directly or through the GQA expand) and the repeat."""
    r = g.root(t)
    if g.tensors[r].role == Role.KV_CACHE:
        return r, 1
    p = prods.get(r)
    if p is not None and p.kind == "aten.expand.default":
        src = g.root(p.inputs["in0"])
        if g.tensors[src].role == Role.KV_CACHE:
            s_in = g.tensors[p.inputs["in0"]].shape
            s_out = g.tensors[p.outputs["out"]].shape
            if len(s_in) == 5 and s_in[2] == 1 and s_out[:2] == s_in[:2] and s_out[3:] == s_in[3:]:
                return src, s_out[2]
    return None


def _attention(g: Graph, weights: dict[str, torch.Tensor]) -> int:
    prods = g.producers()
    dep = position.dependence(g)
    ctrs = position.counters(g)
    checked: dict[str, str | None] = {}
    tokens_checked: dict[tuple[str, int], str | None] = {}
    bounds: dict[tuple[str, int], str | None] = {}
    terms_left: dict[tuple[str, int], str | None] = {}
    n = 0
    new_ops = []
    for o in g.ops:
        if o.kind != "fusec.sdpa.default":
            new_ops.append(o)
            continue
        q, k, v, mask, dropout, is_causal, scale, gqa, *rest = [
            o.inputs[a.slot] if hasattr(a, "slot") else a for a in o.attrs["args"]]
        softcap = float(rest[0]) if rest else 0.0   # Gemma-2's logit softcap (eager attention)
        kc, vc = _cache_of(g, prods, k), _cache_of(g, prods, v)
        if kc and vc and not (g.tensors[q].shape[-1] == g.tensors[kc[0]].shape[-1] == g.tensors[vc[0]].shape[-1]):
            kc = vc = None   # values of another head size than the keys: the attention kinds take one D
        ins: dict[str, str | None] = {}
        mask_kind: int | None = None
        bound = False
        if kc and vc and kc[1] == vc[1] and not dropout and not is_causal and mask is not None:
            rows = g.tensors[kc[0]].shape[2]   # this layer's cache: a sliding window's may be shorter
            if (mask, rows) not in checked:
                checked[mask, rows] = _causal(g, mask, dep, ctrs, weights, rows, (kc[0], vc[0]))
            ins = {"q": q, "k": kc[0], "v": vc[0], "pos": checked[mask, rows]}
            wp = _write_position(g, new_ops, kc[0])
            fixed_row = wp is not None and position.only_counter(dep, g, wp, ctrs) is None
            if fixed_row or (rows != position.cache_length(g) and wp is None):
                ins["pos"] = None   # a cache the step does not write at its position: the proof
                #                     over its rows does not bound the step's positions (a rolled
                #                     window writes its last row, a constant: with W = 1 its one-row
                #                     mask is all True, "causal" at p = 0, while p runs past it)
            mask_kind = 0
            if ins["pos"] is None:   # a mask fusec cannot prove causal: the attention reads it
                ins["pos"], ins["mask"] = _write_position(g, new_ops, kc[0]), mask
                mask_kind = _mask_kind(g, mask, rows, g.tensors[q].shape[0], g.tensors[q].shape[2])
                if mask_kind == 1 and ins["pos"] is not None:
                    if (mask, rows) not in tokens_checked:
                        tokens_checked[mask, rows] = mask_proofs.token_positions(g, mask, dep, ctrs, weights, rows)
                    if tokens_checked[mask, rows] is not None:   # token k: rows 0 .. wp[k]
                        ins["pos"] = ins["mask"] = tokens_checked[mask, rows]
                        mask_kind = TOKEN_POSITIONS
                # the mask stays: is it bounded by the position? Only over a cache the step writes
                # at its position (not a rolled window's fixed row, nor a window's shorter cache)
                if mask_kind == 1 and ins["pos"] is not None and not fixed_row and rows == position.cache_length(g):
                    if (mask, rows) not in bounds:
                        bounds[mask, rows] = mask_proofs.bounded_by_positions(
                            g, mask, dep, ctrs, weights, rows, g.query_tokens())
                    if bounds[mask, rows] is not None:   # rows 0 .. its last element only
                        ins["pos"], bound = bounds[mask, rows], True
                        if g.query_tokens() == 1:   # its causal term, all True over those rows, left out
                            if (mask, rows) not in terms_left:
                                terms_left[mask, rows] = mask_proofs.without_causal_term(
                                    g, mask, ins["pos"], dep, ctrs, weights, rows)
                            ins["mask"] = terms_left[mask, rows] or mask
        if mask_kind is None or ins["pos"] is None:
            log.info("attention %s left generic (mask or cache layout not recognized)", o.name)
            new_ops.append(o)
            continue
        d = g.tensors[q].shape[-1]
        new_ops.append(Op(o.name, "attention", ins, {"out": o.outputs["out"]},
                          attrs={"scale": float(scale) if scale is not None else default_scale(d),
                                 "mask_kind": mask_kind, **({"mask_bound": True} if bound else {}),
                                 **({"softcap": softcap} if softcap else {})},
                          source=o.source))
        n += 1
    g.ops = new_ops
    return n


def _causal(g: Graph, mask: str, dep, ctrs, weights, rows: int, caches: tuple[str, str]) -> str | None:
    """:func:`fusec.ir.mask_proofs.causal_counter` of ``mask`` over ``rows``; where the caches'
    rows are a run-time length (evaluated at the capacity) and the mask is causal only below
    some position P (a sliding window of P rows before it is full: HF's sliding layer holds at
    most P rows, and dynamo's guard keeps its positions below its rows), also its counter, with
    P the capacity of that length (``Graph.lengths``: a longer cache runs eagerly)."""
    syms = {g.tensors[g.root(c)].sym.get(2) for c in caches}
    if None in syms or not syms <= set(g.lengths):
        return mask_proofs.causal_counter(g, mask, dep, ctrs, weights, rows)
    c, below = mask_proofs.causal_below(g, mask, dep, ctrs, weights, rows)
    if c is not None and below < rows:
        log.info("attention mask %s causal below position %d only: caches %s of at most %d rows",
                 mask, below, ", ".join(caches), below)
        for sym in syms:
            g.lengths[sym] = min(g.lengths[sym], below)
    return c


def _write_position(g: Graph, ops_before: list[Op], cache: str) -> str | None:
    """The position tensor of the last ``kv_write`` into ``cache`` before the attention (int64,
    one element, or K of them for K query tokens): the row(s) this step wrote. A masked
    attention reads every row (the mask decides); its ``pos`` input orders it after the write."""
    for o in reversed(ops_before):
        if o.kind == "kv_write" and g.root(o.outputs["cache"]) == cache:
            p = o.inputs["pos"]
            return p if g.tensors[p].dtype == torch.int64 else None
    return None


def _mask_kind(g: Graph, mask: str, length: int, batch: int = 1, tokens: int = 1) -> int | None:
    """1 for a bool mask (True: attend), 2 for an additive float mask, over the ``length`` rows
    of the attention's cache only: one mask for every head (numel == length), or [Bm, 1, Km,
    length] with Bm 1 or ``batch`` (one row per sequence: HF's mask from a left-padded
    ``attention_mask``) and Km 1 or ``tokens`` (one row per query token: HF's causal mask over
    a static cache for K query tokens); None otherwise."""
    info = g.tensors[mask]
    if info.shape[-1] != length:
        return None
    if info.numel != length and (len(info.shape) != 4 or info.shape[0] not in (1, batch)
                                 or info.shape[1] != 1 or info.shape[2] not in (1, tokens)):
        return None
    if info.dtype == torch.bool:
        return 1
    return 2 if info.dtype in (torch.float32, torch.bfloat16, torch.float16) else None


def run(g: Graph, weights: dict[str, torch.Tensor] | None = None) -> Graph:
    """Apply the rules; ``weights`` gives input values needed to evaluate masks."""
    counts = {}
    for pattern, kind, slots, lits, fixed in RULES:
        counts[kind] = counts.get(kind, 0) + _rewrite(g, pattern, kind, slots, lits, fixed)
        dce.run(g)
    counts["rope_fp32"] = _fp32_ropes(g)
    counts["layernorm"] = _layernorms(g)
    counts["kv_roll"] = _kv_rolls(g)
    counts["kv_write"] = _kv_writes(g)
    counts["attention"] = _attention(g, weights or {})
    dce.run(g)
    log.debug("recognized %s", counts)
    return g
