"""fuse: map semantic subgraphs onto the instruction kinds of DESIGN.md section 4.

Expects: a recognized, position-folded graph. Guarantees, with the same values:

* RMSNorm -> Q/K/V linears [with biases, Qwen2] -> [per-head q/k RMSNorm] -> RoPE (tables)
  -> KV-cache writes becomes one ``rms_qkv_rope`` op;
* ``attention`` becomes one ``attention_partial`` (split-KV) whose last tile per KV head
  merges the group (``attention_merge="last_tile"``, the default), or ``attention_partial`` +
  ``attention_reduce`` (``attention_merge="reduce"``);
* RMSNorm -> gate and up linears -> ``silu_mul`` or ``gelu_mul`` becomes ``rms_gate_up_silu``
  (attr ``act``);
* linear + residual ``aten.add`` becomes ``matvec_residual``;
* RMSNorm -> a single linear becomes ``rms_lm_head``; an ``argmax`` over its logits (greedy
  decoding inside the step, :func:`fusec.generate`) becomes that op's ``token`` output;
* any other ``linear`` (batch 1) becomes ``matvec``, its rows spread over every SM;
* ``aten.embedding`` becomes ``embedding``.

A subgraph fuses only if none of its inner tensors is read outside it. Everything else is
left as it is and runs as a generic instruction. ``max_fusions`` (for bisecting) caps how
many fusions are applied.
"""
from __future__ import annotations

import logging
import math

import torch

from fusec.ir import Graph, Op

from fusec.passes import dce

log = logging.getLogger("fusec.passes.fuse")


class _Ctx:
    def __init__(self, g: Graph, budget: int | None):
        self.g = g
        self.budget = budget
        self.refresh()

    def refresh(self) -> None:
        self.prods = self.g.producers()
        self.users = self.g.users()

    def prod(self, t: str, kind: str | tuple[str, ...]) -> Op | None:
        p = self.prods.get(self.g.root(t))
        kinds = (kind,) if isinstance(kind, str) else kind
        return p if p is not None and p.kind in kinds else None

    def private(self, inner: list[Op], keep: tuple[str, ...] = ()) -> bool:
        """True if every fresh output of ``inner`` (but ``keep``) is read only inside ``inner``."""
        names = {o.name for o in inner}
        kept = {self.g.root(t) for t in keep}
        for o in inner:
            for t in o.fresh_outputs():
                r = self.g.root(t)
                if r in kept:
                    continue
                if r in {self.g.root(x) for x in self.g.outputs}:
                    return False
                if any(u.name not in names for u in self.users.get(r, [])):
                    return False
        return True

    def allow(self) -> bool:
        if self.budget is None:
            return True
        if self.budget <= 0:
            return False
        self.budget -= 1
        return True

    def replace(self, inner: list[Op], new: list[Op]) -> None:
        """Put ``new`` where the last of ``inner`` was; drop ``inner``."""
        names = {o.name for o in inner}
        last = max(i for i, o in enumerate(self.g.ops) if o.name in names)
        ops = []
        for i, o in enumerate(self.g.ops):
            if i == last:
                ops.extend(new)
            if o.name not in names:
                ops.append(o)
        self.g.ops = ops
        self.refresh()


def _qkv(c: _Ctx, att: Op, num_sms: int) -> bool:
    g = c.g
    rope_q = c.prod(att.inputs["q"], "rope")
    kw = [o for o in g.ops[: g.ops.index(att)] if o.kind == "kv_write"]
    wk = next((o for o in reversed(kw) if g.root(o.outputs["cache"]) == g.root(att.inputs["k"])), None)
    wv = next((o for o in reversed(kw) if g.root(o.outputs["cache"]) == g.root(att.inputs["v"])), None)
    if rope_q is None or wk is None or wv is None or g.root(wk.inputs["pos"]) != g.root(wv.inputs["pos"]):
        return False
    rope_k = c.prod(wk.inputs["val"], "rope")
    lin_v = c.prod(wv.inputs["val"], "linear")
    if rope_k is None or lin_v is None:
        return False
    inner = [rope_q, rope_k, wk, wv, lin_v]
    norms = {}
    lins = {}
    for name, rope in (("q", rope_q), ("k", rope_k)):
        src = rope.inputs["x"]
        hn = c.prod(src, "rmsnorm")
        if hn is not None:
            norms[name] = hn
            inner.append(hn)
            src = hn.inputs["x"]
        lin = c.prod(src, "linear")
        if lin is None:
            return False
        lins[name] = lin
        inner.append(lin)
    lins["v"] = lin_v
    if set(norms) not in (set(), {"q", "k"}):
        return False
    biased = ["b" in l.inputs for l in lins.values()]
    if any(biased) and not all(biased):   # Qwen2 biases q, k and v; a partial set stays unfused
        return False
    xs = {g.root(l.inputs["x"]) for l in lins.values()}
    if len(xs) != 1:
        return False
    rms = c.prod(lins["q"].inputs["x"], "rmsnorm")
    if rms is None:
        return False
    inner.append(rms)
    cos_k, sin_k = (c.prod(rope_k.inputs[s], "table_lookup") for s in ("cos", "sin"))
    cos_q, sin_q = (c.prod(rope_q.inputs[s], "table_lookup") for s in ("cos", "sin"))
    if None in (cos_k, sin_k, cos_q, sin_q) or cos_k is not cos_q or sin_k is not sin_q:
        return False
    if cos_q.inputs["pos"] != sin_q.inputs["pos"] or not c.private(inner, (rope_q.outputs["out"],)):
        return False
    kc = g.tensors[g.root(wk.outputs["cache"])]
    d = kc.shape[3]
    nq = g.tensors[lins["q"].inputs["w"]].shape[0] // d
    nkv = kc.shape[1]
    if kc.shape[0] != 1 or g.tensors[lins["k"].inputs["w"]].shape[0] != nkv * d or nq % nkv:
        return False
    if not c.allow():
        return False
    ins = {"x": rms.inputs["x"], "norm_w": rms.inputs["w"], "wq": lins["q"].inputs["w"],
           "wk": lins["k"].inputs["w"], "wv": lins["v"].inputs["w"],
           "cos_table": cos_q.inputs["table"], "sin_table": sin_q.inputs["table"],
           "rope_pos": cos_q.inputs["pos"], "kv_pos": wk.inputs["pos"]}
    attrs = {"eps": rms.attrs["eps"], "norm_dtype": g.tensors[rms.outputs["out"]].dtype,
             "dtype": g.tensors[rope_q.outputs["out"]].dtype, "n_q": nq, "n_kv": nkv, "head_dim": d,
             "w_fp32": rms.attrs.get("w_fp32", False)}
    if all(biased):
        ins["bq"], ins["bk"], ins["bv"] = (lins[h].inputs["b"] for h in "qkv")
    if norms:
        ins["q_norm_w"], ins["k_norm_w"] = norms["q"].inputs["w"], norms["k"].inputs["w"]
        attrs["qk_eps"] = norms["q"].attrs["eps"]
    fused = Op(g.fresh_name("rms_qkv_rope"), "rms_qkv_rope", ins,
               {"q": rope_q.outputs["out"], "kcache": wk.outputs["cache"], "vcache": wv.outputs["cache"]},
               attrs=attrs, mutates=("kcache", "vcache"), source=rope_q.source)
    c.replace(inner, [fused])
    return True


def _split_attention(c: _Ctx, att: Op, num_sms: int, merge: str) -> None:
    g = c.g
    kc = g.tensors[g.root(att.inputs["k"])]
    _, nkv, L, d = kc.shape
    nq = g.tensors[att.inputs["q"]].numel // d
    n_chunks = max(1, min(math.ceil(L / 16), num_sms // nkv))
    chunk = math.ceil(math.ceil(L / n_chunks) / 16) * 16
    n_chunks = math.ceil(L / chunk)
    o_part = g.new_tensor(f"{att.name}_o_part", (nq, n_chunks, d), torch.float32)
    ml_part = g.new_tensor(f"{att.name}_ml_part", (nq, n_chunks, 2), torch.float32)
    attrs = {"scale": att.attrs["scale"], "n_q": nq, "n_kv": nkv, "head_dim": d,
             "chunk": chunk, "n_chunks": n_chunks, "mask_kind": att.attrs.get("mask_kind", 0)}
    ins = {"q": att.inputs["q"], "kcache": att.inputs["k"], "vcache": att.inputs["v"],
           "pos": att.inputs["pos"]}
    if "mask" in att.inputs:
        ins["mask"] = att.inputs["mask"]
    part = Op(g.fresh_name(f"{att.name}_partial"), "attention_partial", ins,
              {"o_part": o_part, "ml_part": ml_part}, attrs=attrs, source=att.source)
    if merge == "last_tile":
        part.outputs["out"] = att.outputs["out"]
        c.replace([att], [part])
        return
    red = Op(g.fresh_name(f"{att.name}_reduce"), "attention_reduce",
             {"o_part": o_part, "ml_part": ml_part}, {"out": att.outputs["out"]},
             attrs=dict(attrs), source=att.source)
    c.replace([att], [part, red])


def _gate_up(c: _Ctx, s: Op) -> bool:
    lg, lu = c.prod(s.inputs["gate"], "linear"), c.prod(s.inputs["up"], "linear")
    if lg is None or lu is None or "b" in lg.inputs or "b" in lu.inputs:
        return False
    if c.g.root(lg.inputs["x"]) != c.g.root(lu.inputs["x"]):
        return False
    rms = c.prod(lg.inputs["x"], "rmsnorm")
    inner = [lg, lu, s] + ([rms] if rms else [])
    if rms is None or not c.private(inner, (s.outputs["out"],)) or not c.allow():
        return False
    fused = Op(c.g.fresh_name("rms_gate_up_silu"), "rms_gate_up_silu",
               {"x": rms.inputs["x"], "norm_w": rms.inputs["w"], "wg": lg.inputs["w"], "wu": lu.inputs["w"]},
               {"out": s.outputs["out"]},
               attrs={"eps": rms.attrs["eps"], "norm_dtype": c.g.tensors[rms.outputs["out"]].dtype,
                      "act": s.attrs.get("act", "silu"), "w_fp32": rms.attrs.get("w_fp32", False)},
               source=s.source)
    c.replace(inner, [fused])
    return True


def _residual(c: _Ctx, add: Op) -> bool:
    args = add.attrs["args"]
    if len(args) != 2 or add.attrs["kwargs"].get("alpha", 1) != 1:
        return False
    a, b = add.inputs.get("in0"), add.inputs.get("in1")
    if a is None or b is None:
        return False
    g = c.g
    for res, y in ((a, b), (b, a)):
        lin = c.prod(y, "linear")
        out = g.tensors[add.outputs["out"]]
        if lin is None or "b" in lin.inputs or g.tensors[res].numel != out.numel \
                or g.tensors[y].numel != out.numel or not c.private([lin, add], (add.outputs["out"],)):
            continue
        if not c.allow():
            return False
        fused = Op(c.g.fresh_name("matvec_residual"), "matvec_residual",
                   {"x": lin.inputs["x"], "w": lin.inputs["w"], "residual": res},
                   {"out": add.outputs["out"]}, source=add.source)
        c.replace([lin, add], [fused])
        return True
    return False


def _lm_head(c: _Ctx, lin: Op) -> bool:
    rms = c.prod(lin.inputs["x"], "rmsnorm")
    if rms is None or "b" in lin.inputs or not c.private([rms, lin], (lin.outputs["out"],)) \
            or not c.allow():
        return False
    fused = Op(c.g.fresh_name("rms_lm_head"), "rms_lm_head",
               {"x": rms.inputs["x"], "norm_w": rms.inputs["w"], "w": lin.inputs["w"]},
               {"out": lin.outputs["out"]},
               attrs={"eps": rms.attrs["eps"], "norm_dtype": c.g.tensors[rms.outputs["out"]].dtype,
                      "w_fp32": rms.attrs.get("w_fp32", False)},
               source=lin.source)
    c.replace([rms, lin], [fused])
    return True


def _lm_head_argmax(c: _Ctx, am: Op, num_sms: int) -> bool:
    """``argmax(logits, -1)`` of an ``rms_lm_head``'s logits (batch 1): the LM-head tiles keep
    their rows' best candidate and the tile with the last ticket merges them into the token."""
    g = c.g
    head = c.prod(am.inputs["in0"], "rms_lm_head") if "in0" in am.inputs else None
    if head is None or "token" in head.outputs:
        return False
    args, nd = am.attrs["args"], len(g.tensors[am.inputs["in0"]].shape)
    dim = args[1] if len(args) > 1 else am.attrs["kwargs"].get("dim")
    if g.tensors[head.outputs["out"]].numel != g.tensors[head.inputs["w"]].shape[0] or \
            g.tensors[am.outputs["out"]].numel != 1 or (dim is not None and dim % nd != nd - 1) or not c.allow():
        return False
    head.outputs["cand"] = g.new_tensor(f"{head.name}_cand", (num_sms, 2), torch.float32)
    head.outputs["token"] = am.outputs["out"]
    c.replace([am], [])
    return True


def _matvec(c: _Ctx, lin: Op) -> bool:
    """A linear layer no other fusion took (batch 1: x is one vector) becomes ``matvec``."""
    g = c.g
    w = g.tensors[lin.inputs["w"]]
    if len(w.shape) != 2 or g.tensors[lin.inputs["x"]].numel != w.shape[1] or \
            ("b" in lin.inputs and g.tensors[lin.inputs["b"]].numel != w.shape[0]) or not c.allow():
        return False
    ins = {k: lin.inputs[k] for k in ("x", "w", "b") if k in lin.inputs}
    c.replace([lin], [Op(lin.name, "matvec", ins, dict(lin.outputs), source=lin.source)])
    return True


def _embedding(c: _Ctx, o: Op) -> bool:
    args = o.attrs["args"]   # (weight, indices[, padding_idx, scale_grad, sparse]): the rest is training-only
    if len(args) < 2 or c.g.tensors[o.inputs["in1"]].numel != 1 or not c.allow():
        return False
    fused = Op(o.name, "embedding", {"table": o.inputs["in0"], "ids": o.inputs["in1"]},
               {"out": o.outputs["out"]}, source=o.source)
    c.replace([o], [fused])
    return True


def run(g: Graph, num_sms: int = 132, max_fusions: int | None = None,
        attention_merge: str = "last_tile") -> Graph:
    c = _Ctx(g, max_fusions)
    counts: dict[str, int] = {}

    def each(kind, fn):
        for o in [o for o in g.ops if o.kind == kind]:
            if o in g.ops and fn(c, o):
                counts[fn.__name__] = counts.get(fn.__name__, 0) + 1

    each("attention", lambda c, o: _qkv(c, o, num_sms))
    for o in [o for o in g.ops if o.kind == "attention"]:
        if c.allow():
            _split_attention(c, o, num_sms, attention_merge)
    each("silu_mul", _gate_up)
    each("gelu_mul", _gate_up)
    each("aten.add.Tensor", _residual)
    each("linear", _lm_head)
    each("aten.argmax.default", lambda c, o: _lm_head_argmax(c, o, num_sms))
    each("linear", _matvec)
    each("aten.embedding.default", _embedding)
    log.debug("fusions: %s", counts)
    return dce.run(g)
