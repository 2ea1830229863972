"""A small declarative pattern language over the IR (in the spirit of tinygrad's UPat and
Inductor's pattern matcher).

A pattern is a tree: :func:`op` matches a tensor produced by an op of a given kind and
matches that op's arguments positionally; :func:`sem` matches a tensor produced by a semantic
op (or an instruction kind) and matches its input slots by name (:data:`ABSENT`: the slot must
be missing; :func:`opt`: matched only if present), binding the op itself; :func:`var` binds a
tensor name; :func:`lit` binds a literal argument; :func:`cast` matches an optional dtype
conversion. Views that only reshape bytes are aliases in the IR, so patterns see through them.
:meth:`Matcher.match_op` matches a pattern's root against an op instead of a tensor (the
anchor of a fusion rule, :mod:`fusec.instructions.rule`).

Example (RMSNorm as HF writes it)::

    xf = cast(var("x"))
    normed = op("aten.mul.Tensor", xf, op("aten.rsqrt.default", op("aten.add.Tensor",
             op("aten.mean.dim", op("aten.pow.Tensor_Scalar", xf, 2), [-1], True), lit("eps"))))
    rms = op("aten.mul.Tensor", var("w"), cast(normed), commutative=True)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from fusec.ir import Graph, Op, Ref

_CASTS = ("aten._to_copy.default", "prims.convert_element_type.default")


@dataclasses.dataclass
class Pat:
    """A pattern node; build with :func:`op`, :func:`var`, :func:`lit`, :func:`cast`."""

    what: str                       # "op" | "sem" | "var" | "lit" | "cast" | "opt" | "absent"
    kinds: tuple[str, ...] = ()
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    name: str = ""
    commutative: bool = False
    where: Callable[[Graph, str], bool] | None = None
    bind: str = ""                  # name under which an op pattern's matched tensor is bound
    partial: bool = False           # True: trailing op args not given in the pattern are ignored


def op(kinds: str | tuple[str, ...], *args: Any, commutative: bool = False, bind: str = "",
       partial: bool = False, **kwargs: Any) -> Pat:
    """Match a tensor produced by an op whose kind is in ``kinds``; arguments positionally."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    return Pat("op", kinds, args, kwargs, commutative=commutative, bind=bind, partial=partial)


def sem(kinds: str | tuple[str, ...], name: str = "", bind: str = "", **slots: Any) -> Pat:
    """Match a tensor produced by an op whose kind is in ``kinds``, its input slots by name
    (``slots``: slot -> pattern, :data:`ABSENT` or :func:`opt`; unnamed slots are free); the op
    is bound to ``name``, the matched tensor to ``bind``."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    return Pat("sem", kinds, (), slots, name=name, bind=bind)


def opt(p: Pat) -> Pat:
    """In :func:`sem`: match the slot against ``p`` if the op has it; a missing slot matches."""
    return Pat("opt", args=(p,))


#: In :func:`sem`: the slot must be missing.
ABSENT = Pat("absent")


def var(name: str, where: Callable[[Graph, str], bool] | None = None) -> Pat:
    """Bind any tensor to ``name`` (the same name twice must be the same tensor)."""
    return Pat("var", name=name, where=where)


def lit(name: str) -> Pat:
    """Bind a literal (non-tensor) argument to ``name``."""
    return Pat("lit", name=name)


def cast(p: Pat) -> Pat:
    """Match ``p`` itself or ``p`` behind one dtype conversion."""
    return Pat("cast", args=(p,))


class Matcher:
    """Matches patterns against a graph; ``producers`` is refreshed by :meth:`refresh`."""

    def __init__(self, g: Graph):
        self.g = g
        self.refresh()

    def refresh(self) -> None:
        self.producers = self.g.producers()

    def producer(self, t: str) -> Op | None:
        return self.producers.get(self.g.root(t))

    def match(self, p: Pat, value: Any) -> dict[str, Any] | None:
        """Return bindings (with ``"_ops"``: the matched ops) if ``p`` matches ``value``."""
        b: dict[str, Any] = {"_ops": []}
        return b if self._m(p, value, b) else None

    def match_op(self, p: Pat, o: Op) -> dict[str, Any] | None:
        """Like :meth:`match`, with ``p``'s root (an :func:`op` or :func:`sem` pattern) matched
        against the op ``o`` itself."""
        b: dict[str, Any] = {"_ops": []}
        if p.what == "sem":
            return b if self._sem(p, o, b) else None
        return b if p.what == "op" and self._op(p, o, None, b) else None

    # The recursive matcher works on a bindings dict and undoes nothing: callers copy.
    def _m(self, p: Any, v: Any, b: dict[str, Any]) -> bool:
        if not isinstance(p, Pat):
            if isinstance(p, (list, tuple)):
                if not isinstance(v, (list, tuple)) or len(p) != len(v):
                    return False
                return all(self._m(pi, vi, b) for pi, vi in zip(p, v))
            return p == v
        if p.what == "lit":
            if isinstance(v, str) and v in self.g.tensors:
                return False
            return self._bind(b, p.name, v)
        if p.what == "var":
            if not (isinstance(v, str) and v in self.g.tensors):
                return False
            if p.where is not None and not p.where(self.g, v):
                return False
            return self._bind(b, p.name, v)
        if p.what == "cast":
            prod = self.producer(v) if isinstance(v, str) and v in self.g.tensors else None
            if prod is not None and prod.kind in _CASTS:
                trial = _copy(b)
                if self._m(p.args[0], _resolve(prod, prod.attrs["args"][0]), trial):
                    trial["_ops"].append(prod)
                    b.clear(); b.update(trial)
                    return True
            return self._m(p.args[0], v, b)
        if not (isinstance(v, str) and v in self.g.tensors):
            return False
        prod = self.producer(v)
        if prod is None:
            return False
        return self._sem(p, prod, b, v) if p.what == "sem" else self._op(p, prod, v, b)

    def _sem(self, p: Pat, prod: Op, b: dict[str, Any], v: str | None = None) -> bool:
        if prod.kind not in p.kinds:
            return False
        trial = _copy(b)
        for slot, sp in p.kwargs.items():
            if isinstance(sp, Pat) and sp.what == "absent":
                if slot in prod.inputs:
                    return False
                continue
            if isinstance(sp, Pat) and sp.what == "opt":
                if slot not in prod.inputs:
                    continue
                sp = sp.args[0]
            if slot not in prod.inputs or not self._m(sp, prod.inputs[slot], trial):
                return False
        if p.name and not self._bind(trial, p.name, prod):
            return False
        if p.bind and v is not None and not self._bind(trial, p.bind, v):
            return False
        trial["_ops"].append(prod)
        b.clear(); b.update(trial)
        return True

    def _op(self, p: Pat, prod: Op, v: str | None, b: dict[str, Any]) -> bool:
        if prod.kind not in p.kinds:
            return False
        args = _resolve(prod, prod.attrs.get("args", ()))
        kwargs = _resolve(prod, prod.attrs.get("kwargs", {}))
        if len(args) < len(p.args) or (len(args) > len(p.args) and not p.partial):
            return False
        orders = [list(range(len(p.args)))]
        if p.commutative and len(p.args) >= 2:
            orders.append([1, 0] + list(range(2, len(p.args))))
        for order in orders:
            trial = _copy(b)
            if all(self._m(p.args[i], args[j], trial) for i, j in enumerate(order)) and \
                    all(self._m(pv, kwargs.get(k), trial) for k, pv in p.kwargs.items()):
                trial["_ops"].append(prod)
                if p.bind and not self._bind(trial, p.bind, v):
                    continue   # a name bound twice must be the same tensor (GELU_NEW's y)
                b.clear(); b.update(trial)
                return True
        return False

    @staticmethod
    def _bind(b: dict[str, Any], name: str, v: Any) -> bool:
        if name in b:
            return b[name] == v
        b[name] = v
        return True


def _copy(b: dict[str, Any]) -> dict[str, Any]:
    c = dict(b)
    c["_ops"] = list(b["_ops"])
    return c


def _resolve(op: Op, a: Any) -> Any:
    """Replace :class:`Ref` placeholders in an argument template by tensor names."""
    if isinstance(a, Ref):
        return op.inputs[a.slot]
    if isinstance(a, (list, tuple)):
        return type(a)(_resolve(op, x) for x in a)
    if isinstance(a, dict):
        return {k: _resolve(op, x) for k, x in a.items()}
    return a

