"""activation: a GELU applied to a matvec kind's output rows as the kind's epilogue.

Between the two projections of a non-gated MLP (Falcon, GPT-NeoX/Pythia, StarCoder2, Phi-2,
GPT-2) stands one activation over the wide intermediate vector: ``aten.gelu`` (exact or the
tanh approximation) or HF's ``NewGELUActivation`` (``gelu_new``, eight ATen ops). Standalone it
is a dependency level of its own (a few tiles over 8-18k elements); as the down projection's
prologue (:mod:`fusec.instructions.prologue`) every tile of that projection recomputes it over
the whole vector, and past the prologue's limits (Falcon-7B's 18176, Phi-2's eight-op chain)
it cannot be one. As the producing projection's epilogue each output element is computed once,
by the warp whose row it is, right after its dot product: no level, no recomputation.

The rule table (one rule per activation form, declared on each kind that takes it: ``matvec``,
``matvec_group`` and the column-tiled ``matvec_cols``): the activation's only tensor input is
(a view of) the whole of one output of the kind's op, read by nothing else and no graph output;
every op of the activation gives that output's dtype. The fused op is the kind's op with that
output replaced by the activation's output and attributes ``act`` (a name of :data:`ACTS`) and,
for ``matvec_group``, ``act_outs`` (the indices j of the outputs ``out_j`` it applies to; one
activation per op).

Numerics are eager's: the row's fp32 dot (plus the bias) rounded to the output dtype as the
linear's output, then the activation in fp32 rounded to the output dtype as PyTorch's own op
rounds (``gelu_new``: each of its eight ops rounded, ``pow(y, 3)`` as ``y * y * y`` rounded after
each product, as PyTorch's CUDA kernel computes it in a 16-bit dtype). Template: ``ACT`` (the
code of :data:`ACTS`; ``act_epilogue`` in ``templates/common.cuh``).

Source: the activations' definitions in PyTorch (``torch.nn.functional.gelu``) and
transformers (``NewGELUActivation``, ``activations.py``); the fold is the GEMM epilogue fusion
of CUTLASS's epilogue visitors, for a row-tiled matvec.
"""
from __future__ import annotations

from typing import Callable

import torch

from fusec.ir import Graph, Op
from fusec.ir.pattern import Pat, lit, op, var
from fusec.instructions.call import Int
from fusec.instructions.rule import Ctx, Fusion, Rule

#: the activations an epilogue applies, by the template's ACT code (0: none); 1 and 2 are the
#: GELUs of ``gate_act`` (``rms_gate_up_silu``'s ACT) too
ACTS = {"gelu_tanh": 1, "gelu": 2, "gelu_new": 3}

#: sqrt(2 / pi), ``gelu_new``'s constant
GELU_NEW_K = 0.7978845608028654


def gelu_new_pattern(y: Pat) -> Pat:
    """HF's NewGELUActivation over ``y`` as dynamo traces it (eight ATen ops: ``0.5 * y * (1 +
    tanh(k * (y + 0.044715 * y ** 3)))``), the constant k bound to ``"k"``."""
    return op("aten.mul.Tensor", op("aten.mul.Tensor", y, 0.5), op("aten.add.Tensor", op("aten.tanh.default", op(
        "aten.mul.Tensor", op("aten.add.Tensor", y, op("aten.mul.Tensor", op("aten.pow.Tensor_Scalar", y, 3.0), 0.044715),
                              commutative=True), lit("k"))), 1.0), commutative=True)


_GELU_NEW_Y = gelu_new_pattern(var("y"))


def gelu_new(y: torch.Tensor) -> torch.Tensor:
    """HF's NewGELUActivation on ``y`` op by op in ``y``'s dtype (each op rounds, as the traced
    chain does; ``pow(y, 3)`` as PyTorch's CUDA kernel computes it in a 16-bit dtype, ``y * y * y``
    rounded after each product)."""
    cube = y * y * y
    return 0.5 * y * (1.0 + torch.tanh(GELU_NEW_K * (y + 0.044715 * cube)))


def apply(act: str | None, y: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """The epilogue on ``y`` (fp32, the rows' dot plus bias, unrounded): ``y`` itself with no
    ``act``, else ``y`` rounded to ``dt`` and the activation applied as eager applies it (in
    ``dt``). Raises KeyError for an activation not in :data:`ACTS`."""
    if act is None:
        return y
    if act not in ACTS:
        raise KeyError(f"activation epilogue {act!r} is none of {sorted(ACTS)}")
    yd = y.to(dt)
    if act == "gelu_new":
        return gelu_new(yd)
    return torch.nn.functional.gelu(yd, approximate="tanh" if act == "gelu_tanh" else "none")


def act_of(op: Op, j: int | None = None) -> str | None:
    """The activation ``op`` applies to its output (``matvec_group``: to ``out_j``), or None."""
    act = op.attrs.get("act")
    if act is None or j is None:
        return act
    return act if j in op.attrs.get("act_outs", ()) else None


def code(op: Op, g: Graph | None = None) -> int:
    """The template's ACT: the code of ``op``'s activation (:data:`ACTS`), 0 for none."""
    return ACTS[op.attrs["act"]] if "act" in op.attrs else 0


#: ACT: the activation's code (:func:`code`); C++ default 0
ACT = Int("ACT", code, default=0)
#: ACT_OUTS: the bit mask of the outputs ``out_j`` of a ``matvec_group`` the activation applies to
ACT_OUTS = Int("ACT_OUTS", lambda op, g: sum(1 << j for j in op.attrs.get("act_outs", ())), default=0)


def _gelu(c: Ctx, anchor: Op) -> tuple[str, str, list[Op]] | None:
    """(activation, its input tensor, its ops) for an ``aten.gelu`` anchor, or None."""
    approx = (anchor.attrs.get("kwargs") or {}).get("approximate", "none")
    if approx not in ("none", "tanh") or set(anchor.inputs) != {"in0"}:
        return None
    return ("gelu" if approx == "none" else "gelu_tanh"), anchor.inputs["in0"], [anchor]


def _gelu_new(c: Ctx, anchor: Op) -> tuple[str, str, list[Op]] | None:
    """(``"gelu_new"``, y, the chain's eight ops) for the chain's last ``aten.mul`` anchor: its
    constant sqrt(2 / pi) and adds of alpha 1 (:func:`gelu_new_pattern`), or None."""
    m = c.matcher.match_op(_GELU_NEW_Y, anchor)
    if m is None or not isinstance(m["k"], float) or abs(m["k"] - GELU_NEW_K) > 1e-12:
        return None
    ops = list({id(o): o for o in m["_ops"]}.values())
    if any(o.attrs.get("kwargs", {}).get("alpha", 1) != 1 for o in ops):
        return None
    return "gelu_new", m["y"], ops


def _outputs(p: Op) -> list[str]:
    """The output slots of ``p`` an activation may take: ``out`` or ``out0``..``out3``."""
    return [s for s in p.outputs if s == "out" or (s.startswith("out") and s[3:].isdigit())]


def epilogue_match(kind: str, form: Callable[[Ctx, Op], tuple[str, str, list[Op]] | None],
                   grouped: bool = False) -> Callable[[Ctx, Op], Fusion | None]:
    """The ``match`` of an epilogue rule (module docstring) for ops of ``kind`` and one activation
    ``form`` (its recognizer at the anchor); ``grouped``: outputs ``out_j`` (``act_outs``)."""
    def match(c: Ctx, anchor: Op) -> Fusion | None:
        found = form(c, anchor)
        if found is None:
            return None
        act, y, ops = found
        g = c.g
        p = c.prod(y, kind)
        out = anchor.outputs.get("out")
        if p is None or out is None or p.attrs.get("act") not in (None, act) or "pre" in p.attrs:
            return None   # (one activation per op)
        slot = next((s for s in _outputs(p) if g.root(p.outputs[s]) == g.root(y)), None)
        if slot is None or (slot == "out") == grouped:
            return None
        j = int(slot[3:]) if grouped else None
        if j in p.attrs.get("act_outs", ()) or (not grouped and "act" in p.attrs):
            return None   # the output is an activation's already: this one is a second
        made = g.tensors[p.outputs[slot]]
        if g.tensors[y].numel != made.numel or g.tensors[out].numel != made.numel or \
                g.tensors[out].alias_of is not None or made.alias_of is not None or \
                any(g.tensors[t].dtype != made.dtype for o in ops for t in o.fresh_outputs()):
            return None

        def build() -> list[Op]:
            attrs = dict(p.attrs, act=act)
            if grouped:
                attrs["act_outs"] = sorted(set(p.attrs.get("act_outs", ())) | {j})
            return [Op(p.name, p.kind, dict(p.inputs), {**p.outputs, slot: out}, attrs, p.mutates, p.source, p.layer)]
        keep = tuple(t for s, t in p.outputs.items() if s != slot) + (out,)
        return Fusion([p, *ops], keep, build, place="first")
    return match


def epilogue_rules(kind: str, priority: int, grouped: bool = False) -> tuple[Rule, ...]:
    """The rules that make an activation over an output of ``kind``'s ops that op's epilogue:
    ``aten.gelu`` (at ``priority``) and ``gelu_new``'s chain (``priority + 1``; module docstring).
    ``priority``: after the rule that makes ``kind``'s ops."""
    return (Rule(match=epilogue_match(kind, _gelu, grouped), anchors=("aten.gelu.default",), priority=priority),
            Rule(match=epilogue_match(kind, _gelu_new, grouped), anchors=("aten.mul.Tensor",), priority=priority + 1))
