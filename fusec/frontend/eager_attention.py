"""Eager attention as one SDPA call (:func:`rewrite_eager_attention`).

Source: Hugging Face's ``eager_attention_forward`` (transformers ``models/llama/modeling_llama.py``,
copied by most families; ``attn_implementation="eager"``, which HF picks for
``output_attentions=True`` and some families by default)::

    key_states = repeat_kv(key, n_rep)        # [B, Hkv, L, D] -> [B, Hq, L, D]: x[:, :, None].expand().reshape()
    value_states = repeat_kv(value, n_rep)    # n_rep == 1: the tensor itself
    w = torch.matmul(query, key_states.transpose(2, 3)) * scaling   # query [B, Hq, S, D] -> w [B, Hq, S, L]
    w = w + attention_mask[:, :, :, :L]                             # optional, an additive float mask
    w = softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    w = dropout(w, p=dropout, training=module.training)
    out = torch.matmul(w, value_states)                             # [B, Hq, S, Dv]

Expects: a dynamo FX graph (torch functions, Python operators and tensor methods as
``call_function`` / ``call_method`` nodes, each tensor node with its ``example_value``).

Guarantees: each subgraph that is exactly that computation becomes one
``F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0,
scale=scaling, enable_gqa=Hq != Hkv)`` on the key and value *before* ``repeat_kv`` (so that
:func:`fusec.frontend.custom_ops.rewrite_sdpa` and the rest of the pipeline take over), in
the place of the second matmul; the ops it replaces are erased when nothing else uses them.
Accepted variants: ``torch.matmul`` or ``@``; the key transposed by ``transpose(2, 3)`` /
``transpose(-1, -2)`` / ``permute(0, 1, 3, 2)``; scaling by Python numbers (``*`` or ``/``)
or by a 0-d tensor (then applied to the query, SDPA scale 1) or a symbolic float (dynamo's
``.item()`` of one under ``dynamic=True``: the SDPA scale); no scaling (scale 1); no mask;
``repeat_kv`` by expand + reshape/view or ``repeat_interleave(n, dim=1)``, or none (key and
value already have the query's heads, or one head broadcast); casts (``to``, ``type``,
``float``, ``type_as``) around the softmax; dropout with ``training=False`` or ``p=0``; a
bool mask applied as ``w.masked_fill(m, -inf)`` or ``torch.where(m, w, -inf)`` (or the dtype's
lowest value instead of -inf: nanoGPT's and GPT-2's form), which becomes SDPA's bool mask (True:
attend), ``m``'s negation for ``masked_fill`` (they differ only in a query row that attends
no key, which a decode step never has: it attends its own position).

Gemma-2's attention logit softcapping (``w * scaling; w / c; tanh; * c``, then the mask)
becomes ``torch.ops.fusec.sdpa`` with its ``softcap`` argument ``c`` (SDPA has none), with
the scale the product of every factor (``scaling``): ``c * tanh(s * scaling / c)``.

Not rewritten, and reported by :func:`find_eager_attention` as a :class:`Refusal` (the
decode-step check turns it into the fallback line): attention weights with another user
than the dropout / second matmul (``output_attentions=True`` returns them), a tanh that is
not a softcap (a mask before it, two of them, a factor after it that is not a positive
Python number), dropout in training mode, a mask added before the scaling, and dtypes that
SDPA does not take (a mask of another dtype than the query).

Precision: SDPA semantics compute the softmax in the input dtype where eager computes it in
fp32 and rounds the weights to the query's dtype; in fp32 the two are the same computation,
in bf16/fp16 they differ by rounding (fusec's attention kinds accumulate in fp32).
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from fusec.frontend import custom_ops  # noqa: F401 - registers fusec::sdpa, which a softcapped attention becomes

log = logging.getLogger("fusec.frontend.eager_attention")

_MATMULS = {operator.matmul, torch.matmul, torch.Tensor.matmul}
_SOFTMAXES = {F.softmax, torch.softmax, torch.Tensor.softmax}
_DROPOUTS = {F.dropout, torch.dropout}
_CASTS = {"to", "type", "float", "type_as", "contiguous"}
_MULS = {operator.mul, torch.mul, torch.Tensor.mul, "mul"}
_DIVS = {operator.truediv, torch.div, torch.true_divide, torch.Tensor.div, "div", "true_divide"}
_ADDS = {operator.add, torch.add, torch.Tensor.add, "add"}


@dataclasses.dataclass
class EagerAttention:
    """One matched eager attention: ``out`` (the second matmul, [B, Hq, S, Dv]) equals SDPA of
    ``query`` [B, Hq, S, D], ``key`` [B, Hkv, L, D], ``value`` [B, Hkv, L, Dv] (before
    ``repeat_kv``), ``mask`` (additive, or bool where True attends, broadcast to [B, Hq, S, L];
    negated first where ``mask_negated``; or None) and ``scale``
    (a Python float, or the node of a symbolic float) with the query multiplied (divided) by
    the 0-d tensors or symbolic floats in ``query_factors`` ((node, divide) pairs), the
    scaled scores softcapped by ``softcap`` when it is not 0 (``fusec.sdpa``'s argument)."""
    query: Node
    key: Node
    value: Node
    mask: Node | None
    scale: float | Node
    query_factors: list[tuple[Node, bool]]
    enable_gqa: bool
    out: Node
    replaced: list[Node]   # the ops SDPA replaces, in graph order (erased when unused)
    softcap: float = 0.0   # Gemma-2's logit softcap (0: none): fusec.sdpa's, applied to the scaled scores
    mask_negated: bool = False   # a bool mask of the rows masked out (masked_fill's): SDPA gets its negation


@dataclasses.dataclass
class Refusal:
    """An attention computed as plain ops that is not SDPA: ``reason``, the ``node`` whose
    model source line the message names, and what to do (``hint``)."""
    reason: str
    node: Node
    hint: str = "fusec compiles attention as one SDPA call"


def _val(x: Any) -> Any:
    return x.meta.get("example_value", x.meta.get("val")) if isinstance(x, Node) else None


def _eq(a: Any, b: Any) -> bool:
    """Sizes known equal, without a guard on symbolic sizes."""
    return a == b if isinstance(a, int) and isinstance(b, int) else bool(statically_known_true(a == b))


def _int(d: Any) -> int | None:
    """A size as an int: an int, or a symbolic size that dynamo specialized; else None."""
    return int(d) if isinstance(d, int) or is_concrete_int(d) else None


def _is(node: Any, targets: set) -> bool:
    if not isinstance(node, Node):
        return False
    if node.op == "call_method":
        return node.target in targets
    return node.op == "call_function" and node.target in targets


def _arg(node: Node, i: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call (positional ``i`` of a function; a method's self is 0)."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[i] if len(node.args) > i else default


def _tensor4(node: Any) -> torch.Tensor | None:
    v = _val(node)
    return v if isinstance(v, torch.Tensor) and v.dim() == 4 else None


def _is_cast(node: Any) -> bool:
    """A call that changes at most the dtype of a tensor (shape and device kept)."""
    if not (isinstance(node, Node) and node.op == "call_method" and node.target in _CASTS and node.args):
        return False
    a, b = _val(node.args[0]), _val(node)
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device
            and a.dim() == b.dim() and all(_eq(x, y) for x, y in zip(a.shape, b.shape)))


def _is_tanh(node: Any) -> bool:
    return _is(node, {torch.tanh, torch.Tensor.tanh, "tanh"})


def _scale(node: Node) -> tuple[Node, Any, bool] | None:
    """(scores operand, factor, divide) of a multiplication or division by a Python number, a
    0-d tensor or a symbolic float (``.item()`` of the 0-d tensor that dynamo makes of a float
    attribute under ``dynamic=True``), else None."""
    div = _is(node, _DIVS)
    if not (_is(node, _MULS) or div) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    for x, c in ((a, b), (b, a)) if not div else ((a, b),):
        if not isinstance(_val(x), torch.Tensor):
            continue
        if isinstance(c, (int, float)) and not isinstance(c, bool):
            return x, float(c), div
        cv = _val(c)
        if (isinstance(cv, torch.Tensor) and cv.dim() == 0 and cv.is_floating_point()
                or isinstance(cv, torch.SymFloat)):
            return x, c, div
    return None


_FILLS = {torch.masked_fill, torch.Tensor.masked_fill, "masked_fill"}
_WHERES = {torch.where, "where"}
_NOTS = {operator.invert, torch.logical_not, torch.bitwise_not, "logical_not", "bitwise_not", "__invert__"}


@dataclasses.dataclass
class BoolMask:
    """A bool mask applied by filling the scores with -inf: ``node`` attends where True
    (``torch.where``'s condition) or, with ``negated``, masks where True (``masked_fill``'s)."""
    node: Node
    negated: bool


def _lowest(value: Any, scores: Node) -> bool:
    """``value`` fills a score out of the softmax: -inf, or the scores' dtype's lowest value."""
    v = _val(scores)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not isinstance(v, torch.Tensor) \
            or not v.is_floating_point():
        return False
    return value == float("-inf") or value == torch.finfo(v.dtype).min


def _bool_fill(x: Node) -> tuple[Node, BoolMask] | None:
    """(scores, mask) of ``scores.masked_fill(m, -inf)`` or ``torch.where(m, scores, -inf)``
    with a bool ``m`` (-inf or the dtype's lowest value), else None."""
    if _is(x, _FILLS) and len(x.args) + len(x.kwargs) == 3:
        w, m, value = _arg(x, 0, "input"), _arg(x, 1, "mask"), _arg(x, 2, "value")
        negated = True
    elif _is(x, _WHERES) and len(x.args) == 3 and not x.kwargs:
        m, w, value = x.args
        negated = False
    else:
        return None
    mv = _val(m)
    if not (isinstance(w, Node) and isinstance(m, Node) and isinstance(mv, torch.Tensor)
            and mv.dtype == torch.bool and _lowest(value, w)):
        return None
    return w, BoolMask(m, negated)


def _scores(x: Any, trail: list[tuple[str, Node, Any]]) -> tuple[Node, list] | None:
    """Walk back from the softmax input to ``matmul(q, k^T)``: (the matmul, the ops on the way,
    softmax first) or None. Each op: ('cast' | 'tanh' | 'scale' | 'mask', node, payload)."""
    for _ in range(32):
        if not isinstance(x, Node):
            return None
        if _is(x, _MATMULS | {"matmul"}) and len(x.args) == 2:
            return x, trail
        if _is_cast(x) or _is_tanh(x):
            trail, x = trail + [("tanh" if _is_tanh(x) else "cast", x, None)], x.args[0]
            continue
        sc = _scale(x)
        if sc is not None:
            trail, x = trail + [("scale", x, sc[1:])], sc[0]
            continue
        filled = _bool_fill(x)
        if filled is not None:
            trail, x = trail + [("mask", x, filled[1])], filled[0]
            continue
        if _is(x, _ADDS) and len(x.args) == 2 and not x.kwargs:
            for i in (0, 1):
                mask = x.args[1 - i]
                if isinstance(_val(mask), torch.Tensor):
                    found = _scores(x.args[i], trail + [("mask", x, mask)])
                    if found is not None:
                        return found
        return None
    return None


def _key_of(kt: Any) -> Node | None:
    """The tensor whose last two dims ``kt`` swaps (a 4-D transpose or permute), else None."""
    if not isinstance(kt, Node) or not kt.args or _tensor4(kt) is None:
        return None
    if _is(kt, {torch.transpose, torch.Tensor.transpose, "transpose"}) and len(kt.args) == 3:
        dims = {d % 4 for d in kt.args[1:] if isinstance(d, int)}
        return kt.args[0] if dims == {2, 3} else None
    if _is(kt, {"permute"}):
        perm = kt.args[1] if len(kt.args) == 2 and isinstance(kt.args[1], (tuple, list)) else kt.args[1:]
        return kt.args[0] if [d % 4 for d in perm if isinstance(d, int)] == [0, 1, 3, 2] else None
    return None


def _unrepeat(x: Node) -> tuple[Node, list[Node]]:
    """The key/value before HF's ``repeat_kv`` (``x[:, :, None].expand(B, H, n, L, D)
    .reshape(B, H * n, L, D)``, or ``repeat_interleave(n, dim=1)``) and the ops it took; ``x``
    itself when it is not repeated."""
    out = _tensor4(x)
    if _is(x, {"repeat_interleave", torch.repeat_interleave}) and len(x.args) >= 2:
        src = x.args[0]
        s = _tensor4(src)
        if (s is not None and isinstance(x.args[1], int) and _arg(x, 2, "dim") in (1, -3)
                and _eq(s.shape[1] * x.args[1], out.shape[1])):
            return src, [x]
    if not _is(x, {"reshape", "view", torch.reshape}) or out is None:
        return x, []
    ex = x.args[0]
    e = _val(ex)
    if not (_is(ex, {"expand"}) and isinstance(e, torch.Tensor) and e.dim() == 5):
        return x, []
    un = ex.args[0]
    if _is(un, {"unsqueeze", torch.unsqueeze}) and len(un.args) == 2 and un.args[1] == 2:
        src = un.args[0]
    elif (_is(un, {operator.getitem}) and isinstance(un.args[1], tuple)
          and list(un.args[1][:3]) == [slice(None), slice(None), None]
          and all(i == slice(None) or i is Ellipsis for i in un.args[1][3:])):
        src = un.args[0]
    else:
        return x, []
    s, u = _tensor4(src), _val(un)
    if s is None or not isinstance(u, torch.Tensor) or u.dim() != 5 or not _eq(u.shape[2], 1):
        return x, []
    b, h, n, l, d = e.shape
    if not all(_eq(p, q) for p, q in zip((b, h, l, d), s.shape)) or not all(
            _eq(p, q) for p, q in zip((b, h * n, l, d), out.shape)):
        return x, []
    return src, [un, ex, x]


def _same_shape(a: Node, b: Node) -> bool:
    x, y = _val(a), _val(b)
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == y.dim()
            and all(_eq(p, q) for p, q in zip(x.shape, y.shape)))


def _single_user(node: Node, user: Node) -> bool:
    return list(node.users) == [user]


def _match(sm: Node) -> EagerAttention | Refusal | None:
    """The eager attention around softmax ``sm``, a Refusal, or None (not attention)."""
    dim = _arg(sm, 1, "dim")
    # F.softmax(input, dim, _stacklevel, dtype); torch.softmax(input, dim, dtype); x.softmax(dim, dtype)
    dtype = _arg(sm, 3 if sm.target is F.softmax else 2, "dtype")
    w = _tensor4(sm)
    if w is None or not isinstance(dim, int) or dim % 4 != 3 or dtype not in (None, torch.float32):
        return None
    found = _scores(sm.args[0], [])
    if found is None:
        return None
    mm1, trail = found
    q, kt = mm1.args
    k_states = _key_of(kt)
    if k_states is None or _tensor4(q) is None:
        return None
    ops = list(reversed(trail))   # in graph order, from the first matmul to the softmax
    # forward: casts and dropout, then the second matmul
    fwd, y = [], sm
    while True:
        users = list(y.users)
        if len(users) != 1:
            if not any(_is_cast(u) or _is(u, _DROPOUTS | _MATMULS | {"matmul"}) for u in users):
                return None
            if any(u.op == "output" for u in users):
                return Refusal("eager attention whose weights are returned (output_attentions=True)", sm,
                               "fusec compiles attention as one SDPA call, which does not return them; "
                               "call the model without output_attentions")
            return Refusal(f"eager attention whose weights are also used by {', '.join(u.name for u in users)}",
                           sm)
        u = users[0]
        if _is_cast(u):
            fwd.append(u)
        elif _is(u, _DROPOUTS):
            p, training = _arg(u, 1, "p", 0.5), _arg(u, 2, "training" if u.target is F.dropout else "train", True)
            if p != 0 and training is not False:
                return Refusal(f"eager attention with dropout in training mode (p={p})", u, "call model.eval()")
            fwd.append(u)
        elif _is(u, _MATMULS | {"matmul"}) and len(u.args) == 2 and u.args[0] is y and u.args[1] is not y:
            mm2 = u
            break
        else:
            return None
        y = u
    softcap = _softcap(ops)
    if isinstance(softcap, Refusal):
        return softcap
    kinds = [kind for kind, _, _ in ops]
    if kinds.count("mask") > 1 or ("mask" in kinds and "scale" in kinds[kinds.index("mask"):]):
        return Refusal("eager attention that scales the scores after adding the mask", sm)
    chain = [mm1] + [n for _, n, _ in ops] + [sm] + fwd
    if not all(_same_shape(n, mm1) for n in chain):
        return None
    for a, b in zip(chain, chain[1:] + [mm2]):
        if not _single_user(a, b):
            return Refusal(f"eager attention whose scores ({a.name}) are also used elsewhere", a)
    key, rk = _unrepeat(k_states)
    value, rv = _unrepeat(mm2.args[1])
    qv, kv, vv, wv = _val(q), _tensor4(key), _tensor4(value), _val(mm2.args[0])
    if kv is None or vv is None or not isinstance(wv, torch.Tensor):
        return None
    hq, hk = _int(qv.shape[1]), _int(kv.shape[1])
    if not (hq and hk and hq % hk == 0 and _eq(vv.shape[1], hk) and _eq(kv.shape[2], vv.shape[2])
            and _eq(kv.shape[3], qv.shape[3]) and _eq(kv.shape[0], qv.shape[0])):
        return None
    mask = next((m for kind, _, m in ops if kind == "mask"), None)
    negated, unnegated = False, []
    if isinstance(mask, BoolMask):   # filled with -inf: SDPA's bool mask attends where True
        mask, negated = mask.node, mask.negated
        if negated and _is(mask, _NOTS) and len(mask.args) == 1 and _val(mask.args[0]) is not None \
                and _val(mask.args[0]).dtype == torch.bool:   # masked_fill(~m): SDPA takes m itself
            unnegated, mask, negated = [mask], mask.args[0], False
    elif mask is not None and _val(mask).dtype != qv.dtype:
        return Refusal(f"eager attention with a {_val(mask).dtype} mask on {qv.dtype} scores", mm2)
    if len({qv.dtype, kv.dtype, vv.dtype, wv.dtype}) != 1:
        return Refusal(f"eager attention with mixed dtypes (query {qv.dtype}, key {kv.dtype}, value {vv.dtype}, "
                       f"weights {wv.dtype})", mm2)
    if mask is not None and _val(mask).dim() > 4:
        return Refusal(f"eager attention with a {_val(mask).dim()}-D mask", mm2)
    scale, factors = 1.0, []
    for kind, _, payload in ops:
        if kind == "scale":
            c, div = payload
            if isinstance(c, float):
                scale = scale / c if div else scale * c
            else:
                factors.append((c, div))
    if scale == 1.0 and len(factors) == 1 and not factors[0][1] and isinstance(_val(factors[0][0]), torch.SymFloat):
        scale, factors = factors[0][0], []   # dynamic=True: SDPA's scale is the symbolic float, as HF's SDPA passes it
    return EagerAttention(q, key, value, mask, scale, factors, hq != hk, mm2,
                          rk + rv + [kt] + chain + [mm2] + unnegated, softcap, negated)


def _softcap(ops: list[tuple[str, Node, Any]]) -> float | Refusal:
    """Gemma-2's attention logit softcap in the scores' ops (graph order): ``s * a; tanh; * c``
    (HF: ``w / softcap; tanh; * softcap`` after ``* scaling``) is ``c * tanh(s * a)``, the
    softcap ``c`` of scores scaled by ``a * c`` (the product of every scale, which :func:`_match`
    takes as SDPA's scale). 0.0 without a tanh; a Refusal for any other use of a tanh (two, a
    mask before it, a factor after it that is not a positive Python number)."""
    tanhs = [i for i, (kind, _, _) in enumerate(ops) if kind == "tanh"]
    if not tanhs:
        return 0.0
    t, tanh = tanhs[0], ops[tanhs[0]][1]
    if len(tanhs) > 1 or any(kind == "mask" for kind, _, _ in ops[:t]):
        return Refusal("attention scores through a tanh that is not a logit softcap "
                       + ("(two tanh)" if len(tanhs) > 1 else "(the mask added before it)"), tanh)
    c = 1.0
    for kind, n, payload in ops[t + 1:]:
        if kind == "mask":
            break
        if kind == "scale":
            f, div = payload
            if not isinstance(f, float):
                return Refusal("attention logit softcap by a tensor or symbolic factor", n,
                               "fusec takes a softcap that is a Python number; dynamo makes the config's "
                               "number a symbolic float under torch.compile(dynamic=True) (HF's "
                               "CompileConfig(dynamic=True)), or once the number changed between two calls "
                               "(its automatic dynamic): compile without dynamic=True (fusec's step serves "
                               "every cache length without it), and keep attn_logit_softcapping fixed or "
                               "call torch._dynamo.reset() after changing it")
            c = c / f if div else c * f
    if not c > 0:
        return Refusal(f"attention logit softcap {c} (not positive)", tanh)
    return c


def find_eager_attention(gm: torch.fx.GraphModule) -> tuple[list[EagerAttention], list[Refusal]]:
    """The eager attentions of a dynamo graph (module docstring) that are SDPA, and those that
    are attention but not SDPA (with the reason). Reads the graph only."""
    found, refused = [], []
    for node in softmaxes(gm):
        m = _match(node)
        if isinstance(m, EagerAttention):
            found.append(m)
        elif isinstance(m, Refusal):
            refused.append(m)
    return found, refused


def softmaxes(gm: torch.fx.GraphModule) -> list[Node]:
    """The softmax calls of a dynamo graph (``F.softmax``, ``torch.softmax``, ``x.softmax``),
    in graph order: where an attention written as plain ops would be."""
    return [n for n in gm.graph.nodes if _is(n, _SOFTMAXES | {"softmax"}) and n.args]


def rewrite_eager_attention(gm: torch.fx.GraphModule) -> int:
    """Replace each eager attention (HF's ``eager_attention_forward``) of a dynamo graph that is
    SDPA by one ``F.scaled_dot_product_attention`` call, in place (module docstring: what is
    matched and what is left); return the count. Shapes: query [B, Hq, S, D], key/value
    [B, Hkv, L, D] before ``repeat_kv``, output [B, Hq, S, Dv] in the query's dtype (any float
    dtype; fp32 gives eager's values, see the module docstring on bf16/fp16), where the second
    matmul's was."""
    found, _ = find_eager_attention(gm)
    g = gm.graph
    for a in found:
        with g.inserting_before(a.out):
            q, mask = a.query, a.mask
            if a.mask_negated:
                mask = g.call_function(torch.logical_not, (a.mask,))
                mask.meta["example_value"] = torch.logical_not(_val(a.mask))
            for c, div in a.query_factors:
                meta = dict(q.meta)
                q = g.call_function(operator.truediv if div else operator.mul, (q, c))
                q.meta.update(meta)
            if a.softcap:   # fusec's own op: SDPA has no softcap
                sdpa = g.call_function(torch.ops.fusec.sdpa.default, (q, a.key, a.value, mask, 0.0, False,
                                                                      a.scale, a.enable_gqa, a.softcap))
            else:
                sdpa = g.call_function(F.scaled_dot_product_attention, (q, a.key, a.value),
                                       {"attn_mask": mask, "dropout_p": 0.0, "scale": a.scale,
                                        "enable_gqa": a.enable_gqa})
        sdpa.meta.update(a.out.meta)
        a.out.replace_all_uses_with(sdpa)
        for n in reversed(list(dict.fromkeys(a.replaced))):
            if not n.users:
                g.erase_node(n)
    if found:
        gm.recompile()
        log.info("rewrote %d eager attention(s) as one scaled_dot_product_attention each (fusec.sdpa with "
                 "Gemma-2's softcap)", len(found))
    return len(found)
