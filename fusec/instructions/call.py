"""The call a kind's template makes, declared once on the kind's class.

A :class:`Call` lists the template arguments and the function arguments of the kind's device
function, in order, each with how its value comes from the op: the C type of a tensor slot
(:class:`Type`), a compile-time int (:class:`Int`), a flag (:class:`Flag`), a float literal
(:class:`Float`), a buffer pointer (:class:`Ptr`), any other C expression (:class:`Expr`), or a
kernel local (:class:`Local`: ``in.p0``, ``smem``, ``red``). From it come both the arguments
dict that the template's macros read (``a.w``, ``a.K``, ...: :meth:`Call.values`) and the call
itself, ``fn<targs>(args)`` (:meth:`Call.text`), which codegen emits as the kind's ``case``.

An argument with ``default`` (the C++ default of the device function) is left out when it and
every argument after it equal their defaults, so a call names what differs from the defaults.
An argument with ``when`` is passed only when ``when(op)`` holds (a variant such as the
argmax epilogue; its function name may depend on the op too: ``fn`` callable).
``numbering`` names the pointers to number first in ``bufs[]`` (see :meth:`Call.values`).

Example, ``matvec``::

    call = Call("matvec",
                targs=(Type("tx", "x"), Type("tw", "w"), Type("tb", "b", "w"), Type("to", "out"),
                       Int("K", lambda op, g: g.tensors[op.inputs["w"]].shape[1]), Flag("bias", has="b")),
                args=(Ptr("x"), Ptr("w"), Ptr("b"), Ptr("out"), P0, P1, SMEM))
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from fusec.ir import Graph, Op


def _slot(op: Op, s: str) -> str | None:
    return op.inputs.get(s, op.outputs.get(s))


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument: ``name`` is its key in the arguments dict (a :class:`Local` has none)."""

    name: str
    _: dataclasses.KW_ONLY
    default: Any = None
    when: Callable[[Op], bool] | None = None

    def value(self, op: Op, g: Graph, bufs: Any) -> Any:
        raise NotImplementedError

    def text(self, v: Any) -> str:
        return str(v)


@dataclasses.dataclass(frozen=True)
class Type(Arg):
    """C type of the first of ``slots`` the op has (input or output), else ``otherwise``."""

    slots: tuple[str, ...] = ()
    otherwise: str = ""

    def __init__(self, name: str, *slots: str, otherwise: str = "", default: Any = None,
                 when: Callable[[Op], bool] | None = None):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "slots", slots or (name,))
        object.__setattr__(self, "otherwise", otherwise)
        object.__setattr__(self, "default", default)
        object.__setattr__(self, "when", when)

    def value(self, op, g, bufs):
        for s in self.slots:
            t = _slot(op, s)
            if t is not None:
                return bufs.ctype(t)
        if self.otherwise:
            return self.otherwise
        raise NotImplementedError(f"{op.kind}: no tensor for {self.name} ({'/'.join(self.slots)})")


@dataclasses.dataclass(frozen=True)
class Int(Arg):
    """A compile-time int: ``fn(op, g)``."""

    fn: Callable[[Op, Graph], int] = None

    def value(self, op, g, bufs):
        return self.fn(op, g)


@dataclasses.dataclass(frozen=True)
class Flag(Arg):
    """``"true"``/``"false"``: the op has slot ``has``, else ``fn(op)``."""

    has: str = ""
    fn: Callable[[Op], bool] | None = None

    def value(self, op, g, bufs):
        on = self.has in op.inputs if self.has else self.fn(op)
        return "true" if on else "false"


@dataclasses.dataclass(frozen=True)
class Float(Arg):
    """A float literal from attribute ``attr`` (``fallback`` if missing); the call writes ``<v>f``."""

    attr: str = ""
    fallback: float | None = None

    def value(self, op, g, bufs):
        v = op.attrs[self.attr] if self.fallback is None else op.attrs.get(self.attr, self.fallback)
        return repr(float(v))

    def text(self, v):
        return f"{v}f"


@dataclasses.dataclass(frozen=True)
class Ptr(Arg):
    """Pointer expression of tensor slot ``slot`` (default: ``name``), ``nullptr`` if the op has
    none."""

    slot: str = ""

    def value(self, op, g, bufs):
        t = _slot(op, self.slot or self.name)
        return bufs.ptr(t) if t is not None else "nullptr"


@dataclasses.dataclass(frozen=True)
class Expr(Arg):
    """Any other C expression: ``fn(op, g, bufs)`` (a dtype's C name, spare counters)."""

    fn: Callable[[Op, Graph, Any], Any] = None

    def value(self, op, g, bufs):
        return self.fn(op, g, bufs)


@dataclasses.dataclass(frozen=True)
class Local(Arg):
    """A name of the kernel's dispatch loop (``in.p0``, ``smem``), passed as it is; not in the
    arguments dict."""

    def text(self, v):
        return self.name


P0, P1, P2 = Local("in.p0"), Local("in.p1"), Local("in.p2")   # the instruction word's tile parameters
SMEM, RED = Local("smem"), Local("red")                       # dynamic shared memory; 33-float scratch


@dataclasses.dataclass(frozen=True)
class Call:
    """The device call of a kind: ``fn<targs...>(args...)`` (see the module docstring)."""

    fn: str | Callable[[Op], str]
    targs: tuple[Arg, ...] = ()
    args: tuple[Arg, ...] = ()
    numbering: tuple[str, ...] = ()

    def values(self, op: Op, g: Graph, bufs: Any) -> dict[str, Any]:
        """The arguments dict: every non-local argument that applies to ``op``, by name.

        Computed in declaration order (template arguments first), but those named in
        ``numbering`` first, in that order: a pointer's first use numbers its buffer in
        ``bufs[]``, and ``numbering`` keeps the order a kind had before its call was declared."""
        todo = [a for a in (*self.targs, *self.args) if not isinstance(a, Local) and (a.when is None or a.when(op))]
        rank = {n: i for i, n in enumerate(self.numbering)}
        todo.sort(key=lambda a: rank.get(a.name, len(rank)))
        return {a.name: a.value(op, g, bufs) for a in todo}

    def text(self, op: Op, values: dict[str, Any]) -> str:
        """The C call for ``op`` from its ``values``."""
        fn = self.fn(op) if callable(self.fn) else self.fn
        t = self._list(op, self.targs, values)
        return f"{fn}{'<' + t + '>' if self.targs else ''}({self._list(op, self.args, values)})"

    @staticmethod
    def _list(op: Op, args: tuple[Arg, ...], values: dict[str, Any]) -> str:
        used = [a for a in args if a.when is None or a.when(op)]
        while used and used[-1].default is not None and values[used[-1].name] == used[-1].default:
            used.pop()
        return ", ".join(a.text(None if isinstance(a, Local) else values[a.name]) for a in used)
