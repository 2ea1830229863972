"""fold_constants: compute at compile time what depends on no run-time value.

Expects: a normalized graph and the values of its small weights (at most
``position.MAX_KNOWN_WEIGHT`` elements: norm weights, ``inv_freq``, embedding scales).
Guarantees: every ATen arithmetic, cast or creation op (not a view, a matmul or a mutation)
whose reads are all constants or small weights, and whose outputs have at most
``MAX_ELEMENTS`` elements each, is gone; its outputs are CONSTANT tensors holding the values
PyTorch computes (Gemma's ``1 + weight`` of its RMSNorm, an ``arange`` that builds positions).
A known 0-d float operand of ``add``/``sub``/``mul``/``div`` (a Python float that dynamo passes as
a 0-d tensor under ``dynamic=True``: an RMSNorm's ``variance_epsilon``) becomes a literal of its
value in the op's result dtype, as the model's source writes it (so that ``recognize``'s patterns
match). An op that takes the cache length of a length-polymorphic graph as a value (``attrs["symbolic"]``
beyond a size: ``position.sizes_only``) is not folded: its value at the capacity is not its value
at every length (``check_lengths`` refuses it later). Values are unchanged. The constants are
taken at compile time (the compiled step checks
the small weights it read at every call: ``CompiledStep``).
"""
from __future__ import annotations

import logging

import torch

from fusec.ir import position
from fusec.ir.env import Env
from fusec.ir import Graph, Role

from fusec.passes import dce

log = logging.getLogger("fusec.passes.fold_constants")

MAX_ELEMENTS = 1 << 16


def _computes(op) -> bool:
    """ATen arithmetic, casts and creation ops; views and matmuls of weights stay, so that the
    patterns of ``recognize`` (``mm(x, permute(w))``) see the weights themselves."""
    from fusec.instructions.generic import aten_category
    return op.kind.startswith(("aten.", "prims.")) and aten_category(op.attrs["target"]) in ("elementwise", "reduce")


def run(g: Graph, weights: dict[str, torch.Tensor] | None = None) -> Graph:
    from fusec.ir.semantics import run_op
    weights = weights or {}
    known = {n for n in g.inputs if n in weights and g.tensors[n].numel <= position.MAX_KNOWN_WEIGHT}
    known |= {t.name for t in g.tensors.values() if t.role == Role.CONSTANT and t.alias_of is None}
    env = Env(g, [], device=torch.device("cpu"))
    kept, folded = [], 0
    for op in g.ops:
        fresh = op.fresh_outputs()
        if (op.mutates or not _computes(op) or not fresh or
                (op.attrs.get("symbolic") and not position.sizes_only(op)) or
                any(g.root(t) not in known for t in op.reads()) or
                any(g.tensors[t].numel > MAX_ELEMENTS for t in fresh)):
            kept.append(op)
            continue
        for t in op.reads():   # only the weights a folded op reads: their values are compiled in
            r = g.root(t)
            if r not in env.bufs and r in weights:
                env.bufs[r] = weights[r]
        run_op(op, env)
        for t in fresh:
            info, r = g.tensors[t], g.root(t)
            info.value = env.read(t).detach().clone().contiguous()
            info.role, info.alias_of = Role.CONSTANT, None
            known.add(t)
            env.bufs[t] = info.value
            if r != t:
                known.add(r)
        folded += 1
    g.ops = kept
    scalars = sum(_scalar_operand(g, op, known, env, weights) for op in g.ops)
    log.debug("folded %d constant ops, %d scalar operands", folded, scalars)
    return dce.run(g)


#: ops whose ``Tensor`` overload takes a Python number for ``other`` with the same result: the
#: 0-d operand is converted to the result dtype before the op in both cases
_SCALAR_OK = {"aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor"}
_COMMUTES = {"aten.add.Tensor", "aten.mul.Tensor"}


def _scalar_operand(g: Graph, op, known: set[str], env: Env, weights: dict[str, torch.Tensor]) -> int:
    """Replace a known 0-d float tensor operand of ``op`` by a literal (module docstring); 1 if
    it did."""
    from fusec.ir import Ref
    if op.kind not in _SCALAR_OK or op.attrs.get("kwargs") or len(op.attrs.get("args", ())) != 2:
        return 0
    args = list(op.attrs["args"])

    def scalar(a) -> bool:
        if not isinstance(a, Ref):
            return False
        t = op.inputs[a.slot]
        info = g.tensors[g.root(t)]
        return g.root(t) in known and info.dtype.is_floating_point and g.tensors[t].shape == () \
            and (info.value is not None or g.root(t) in weights)

    if scalar(args[0]) and not scalar(args[1]) and op.kind in _COMMUTES:
        args.reverse()
    if not scalar(args[1]) or scalar(args[0]) or not isinstance(args[0], Ref):
        return 0
    slot = args[1].slot
    r = g.root(op.inputs[slot])
    value = g.tensors[r].value if g.tensors[r].value is not None else weights[r]
    out = g.tensors[op.outputs["out"]].dtype
    args[1] = float(value.reshape(()).to(out).double())
    op.attrs["args"] = tuple(args)
    del op.inputs[slot]
    return 1
