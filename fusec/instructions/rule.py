"""Fusion rules: how a kind says which subgraphs become one of its ops.

A kind's class lists its rules (``rules = (Rule(...),)``); :func:`fusec.instructions.base.register`
stamps them with the kind, and the ``fuse`` pass (:mod:`fusec.passes.fuse`) applies every
registered kind's rules in ``priority`` order, lowest first. A rule is anchored at one op (the
root of its pattern): for each op of an anchor kind, in program order, the rule proposes
:class:`Fusion` candidates; the pass applies the first whose inner tensors are private (read
only inside it) while the ``max_fusions`` budget lasts.

A declarative rule is a pattern (:mod:`fusec.ir.pattern`, rooted at the anchor), a slot map
(the new op's inputs from the pattern's tensor bindings, its outputs from ``"binding.slot"`` of
a matched op), ``attrs`` computed from the bindings and a ``check`` of the kind's limits
(shapes, attributes). Example, ``matvec_residual``::

    lin = sem("linear", bind="y", x=var("x"), w=var("w"), b=ABSENT)   # a linear without bias
    Rule(op("aten.add.Tensor", var("residual"), lin, commutative=True),
         inputs={"x": "x", "w": "w", "residual": "residual"}, outputs={"out": "_anchor.out"},
         check=_same_size, priority=40)      # _same_size(g, m): alpha 1, no broadcasting

A commutative root is tried in both orders (each order is one candidate). Where the rewrite is
not a slot map (new tensors, an op extended in place) a rule gives ``build`` instead; where the
match is not a tree a rule gives ``match`` (with ``anchors``) instead of a pattern. Either way it
lives with its kind's class.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from fusec.ir import Graph, Op
from fusec.ir.pattern import Matcher, Pat

Bindings = dict[str, Any]


class Ctx:
    """What rules see: the graph, its producers, and the pass's options (``num_sms``,
    ``attention_merge``)."""

    def __init__(self, g: Graph, **options: Any):
        self.g = g
        self.options = options
        self.matcher = Matcher(g)
        self.refresh()

    def refresh(self) -> None:
        self.matcher.refresh()
        self.prods = self.matcher.producers
        self.users = self.g.users()

    def prod(self, t: str, kind: str | tuple[str, ...]) -> Op | None:
        """The op of kind ``kind`` that produces ``t``'s root, else None."""
        p = self.prods.get(self.g.root(t))
        kinds = (kind,) if isinstance(kind, str) else kind
        return p if p is not None and p.kind in kinds else None


@dataclasses.dataclass
class Fusion:
    """One proposed rewrite: ``inner`` ops become ``build()``'s ops, put where the last of
    ``inner`` was (``place="first"``: where the first was, for new ops whose inputs all exist
    there while an inner op's output is read before the last); ``keep``: their outputs that the
    new ops take over (may be read outside)."""

    inner: list[Op]
    keep: tuple[str, ...]
    build: Callable[[], list[Op]]
    place: str = "last"


@dataclasses.dataclass(frozen=True)
class Rule:
    """A fusion rule of one kind (see the module docstring).

    Attributes:
        pattern: rooted at the anchor op; its kinds are the anchors (in that order).
        inputs: new op's input slot -> tensor binding; a binding the match lacks (an
            :func:`~fusec.ir.pattern.opt` slot) leaves the slot out.
        outputs: new op's output slot -> ``"op_binding.slot"`` (``_anchor``: the anchor op).
        attrs: ``(g, m) -> dict`` of the new op's attributes.
        check: ``(g, m) -> bool``: the kind's limits; False leaves the match unfused.
        build: ``(ctx, m) -> [Op]``: a procedural rewrite of the anchor alone, instead of the
            slot maps (other matched ops stay; ``build`` may extend them in place).
        match: ``(ctx, anchor) -> Fusion | None``: a procedural matcher instead of a pattern.
        anchors: the anchor kinds of a ``match`` rule.
        priority: rules apply lowest first.
        keep_name: the new op keeps the anchor's name (else a fresh one from the kind).
        source: the op binding whose ``source`` the new op keeps (default the anchor's).
        kind: the kind the rule makes (set by ``register``).
    """

    pattern: Pat | None = None
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)
    attrs: Callable[[Graph, Bindings], dict] | None = None
    check: Callable[[Graph, Bindings], bool] | None = None
    build: Callable[[Ctx, Bindings], list[Op]] | None = None
    match: Callable[[Ctx, Op], Fusion | None] | None = None
    anchors: tuple[str, ...] = ()
    priority: int = 100
    keep_name: bool = False
    source: str = "_anchor"
    kind: str = ""

    def anchor_kinds(self) -> tuple[str, ...]:
        return self.pattern.kinds if self.pattern is not None else self.anchors

    def candidates(self, ctx: Ctx, anchor: Op) -> Iterator[Fusion]:
        """The fusions this rule proposes at ``anchor``, best first."""
        if self.match is not None:
            f = self.match(ctx, anchor)
            if f is not None:
                yield f
            return
        for p in _orders(self.pattern):
            m = ctx.matcher.match_op(p, anchor)
            if m is None:
                continue
            m["_anchor"] = anchor
            if self.check is not None and not self.check(ctx.g, m):
                continue
            if self.build is not None:
                yield Fusion([anchor], tuple(anchor.fresh_outputs()), lambda m=m: self.build(ctx, m))
            else:
                inner = list({id(o): o for o in m["_ops"]}.values())
                outs = {k: _out(m, v) for k, v in self.outputs.items()}
                yield Fusion(inner, tuple(outs.values()), lambda m=m, outs=outs: [self._new_op(ctx.g, m, outs)])

    def _new_op(self, g: Graph, m: Bindings, outs: dict[str, str]) -> Op:
        anchor = m["_anchor"]
        return Op(anchor.name if self.keep_name else g.fresh_name(self.kind), self.kind,
                  {k: m[v] for k, v in self.inputs.items() if v in m}, outs,
                  attrs=self.attrs(g, m) if self.attrs else {}, source=m[self.source].source)


def _out(m: Bindings, ref: str) -> str:
    op_name, slot = ref.split(".")
    return m[op_name].outputs[slot]


def _orders(p: Pat) -> list[Pat]:
    """``p``, and a commutative root's swapped order as a second candidate."""
    if not (p.what == "op" and p.commutative and len(p.args) >= 2):
        return [p]
    first = dataclasses.replace(p, commutative=False)
    return [first, dataclasses.replace(first, args=(p.args[1], p.args[0], *p.args[2:]))]


def rules_in_order(kinds: dict[str, type]) -> list[Rule]:
    """Every rule of the registered ``kinds``, by priority (registration order among equals)."""
    return sorted((r for cls in kinds.values() for r in getattr(cls, "rules", ())), key=lambda r: r.priority)
