"""fuse: map semantic subgraphs onto the registered instruction kinds by their fusion rules.

Each kind's class declares its rules (:class:`fusec.instructions.rule.Rule`, next to the class
in ``fusec/instructions/``); this pass knows no kind by name. It applies the rules of every
registered kind in ``priority`` order (lowest first, registration order among equals): for each
rule, for each anchor kind of the rule, for each op of that kind in program order (as the graph
stood when the rule started), it takes the rule's candidates in turn.

Expects: a recognized, position-folded graph; the registered kinds' rules.

Guarantees, with the same values:

* a candidate is applied only if none of its inner ops' fresh outputs (but those the new ops
  take over) is read outside it or is a graph output; its new ops go where the last inner op
  was (or the first, for a rule whose new ops read only what exists there: ``Fusion.place``),
  and the inner ops go;
* at most one candidate per anchor op is applied (the first private one), and at most
  ``max_fusions`` in all (for bisecting; ``None``: no cap); a candidate that the budget stops
  ends that anchor's turn;
* whatever no rule takes stays as it is and runs as a generic instruction; dead ops are removed;
* in a step of ``B * K`` > 1 activation rows (B sequences, K query tokens each:
  :meth:`fusec.ir.Graph.rows`) no rule of a kind whose ``max_rows`` is below them is applied
  (docs/batch.md): those subgraphs stay generic, whose semantics take any B and K.

The rules of the kinds today (docs/pipeline.md, "Instruction kinds"), by priority: a rolled
sliding window's ``kv_roll`` into pieces with a halo ``index_select`` before it (5); RMSNorm ->
Q/K/V -> RoPE -> KV write into ``rms_qkv_rope`` (10); attention split into ``attention_partial``
[+ ``attention_reduce``] (20), and a K-token step's transposed attention output (the ``aten.permute``
HF makes for the o projection) into its merge (21); RMSNorm -> gate/up -> SiLU/GELU product into ``rms_gate_up_silu``
(30), and gate/up over an un-normed vector into the same kind with its norm off (35: post-norm
layers such as OLMo-2's); linear + residual add into ``matvec_residual`` (40); RMSNorm ->
linear into ``rms_lm_head`` (50) and its logits' argmax into that op's ``token`` (60); sibling
linears over one input into ``matvec_group`` (65); any other linear into ``matvec`` (70); a
Conv1D product (``addmm`` / ``mm`` of a weight stored [in, out]) into ``matvec_cols``, with the
residual add after it (44) or alone (72, 74); a
GELU (``aten.gelu``, ``gelu_new``'s chain) over an output of a ``matvec``, ``matvec_group`` or
``matvec_cols`` into that op's activation epilogue (66 and 67 for ``matvec_group``, 75 and 76
for ``matvec``, 81 and 82 for ``matvec_cols``: :mod:`fusec.instructions.activation`); the
``kv_write``s of pieces of a ``matvec_cols`` product into its cache epilogue (78: GPT-2's k and
v, :mod:`fusec.instructions.kv_epilogue`); ``aten.embedding`` into ``embedding`` (80); an
``argmax`` over the last dim of up to 16 rows that no ``rms_lm_head`` took into ``argmax_rows`` (85).
"""
from __future__ import annotations

import logging

from fusec.instructions import KINDS
from fusec.instructions.rule import Ctx, Fusion, rules_in_order
from fusec.ir import Graph, Op
from fusec.passes import dce

log = logging.getLogger("fusec.passes.fuse")


def private(c: Ctx, inner: list[Op], keep: tuple[str, ...] = ()) -> bool:
    """True if every fresh output of ``inner`` (but ``keep``) is read only inside ``inner``."""
    g = c.g
    names = {o.name for o in inner}
    kept = {g.root(t) for t in keep}
    outputs = {g.root(x) for x in g.outputs}
    for o in inner:
        for t in o.fresh_outputs():
            r = g.root(t)
            if r in kept:
                continue
            if r in outputs or any(u.name not in names for u in c.users.get(r, [])):
                return False
    return True


def replace(c: Ctx, inner: list[Op], new: list[Op], place: str = "last") -> None:
    """Put ``new`` where the last (``place="first"``: the first) of ``inner`` was; drop ``inner``."""
    names = {o.name for o in inner}
    at = [i for i, o in enumerate(c.g.ops) if o.name in names]
    where = at[0] if place == "first" else at[-1]
    ops = []
    for i, o in enumerate(c.g.ops):
        if i == where:
            ops.extend(new)
        if o.name not in names:
            ops.append(o)
    c.g.ops = ops
    c.refresh()


class _Budget:
    def __init__(self, n: int | None):
        self.n = n

    def take(self) -> bool:
        if self.n is None:
            return True
        if self.n <= 0:
            return False
        self.n -= 1
        return True


def _apply(c: Ctx, f: Fusion, budget: _Budget) -> bool | None:
    """Apply ``f`` if private and the budget allows: True applied, None stopped by the budget,
    False not private."""
    if not private(c, f.inner, f.keep):
        return False
    if not budget.take():
        return None
    replace(c, f.inner, f.build(), f.place)
    return True


def run(g: Graph, num_sms: int = 132, max_fusions: int | None = None,
        attention_merge: str = "last_tile", defines: dict | None = None) -> Graph:
    c = Ctx(g, num_sms=num_sms, attention_merge=attention_merge, defines=defines or {})
    budget = _Budget(max_fusions)
    counts: dict[str, int] = {}
    rows = g.rows()
    for rule in rules_in_order(KINDS):
        if getattr(KINDS.get(rule.kind), "max_rows", 1) < rows:
            continue   # the kind computes fewer rows than the step has: left generic
        for kind in rule.anchor_kinds():
            for o in [o for o in g.ops if o.kind == kind]:
                if o not in g.ops:
                    continue
                for f in rule.candidates(c, o):
                    done = _apply(c, f, budget)
                    if done:
                        counts[rule.kind] = counts.get(rule.kind, 0) + 1
                    if done is not False:
                        break
    log.debug("fusions: %s", counts)
    return dce.run(g)
