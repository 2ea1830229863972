"""The building blocks of the generic-op CUDA generator: an op's bound arguments, its buffers
as function parameters, C literals and index arithmetic over static shapes.

Every tensor of the IR is contiguous in its own static shape (an alias is a contiguous reshape
of its root), so an op is ``out[i] = f(inputs at offsets computed from i)``: :meth:`Ctx.coords`
turns a flat index into coordinates and :func:`offset` coordinates into an element offset
under any strides (0 for a broadcast dim).
"""
from __future__ import annotations

import math
import re
from typing import Any, Sequence

import torch

from fusec.errors import FallbackRequired
from fusec.ir import Graph, Op, Ref, Role

#: ``LEN_PREFIX + symbol`` names a run-time length's slot of the pointer table
#: (:meth:`fusec.cuda.codegen.Buffers.length`; in ``KernelPlan.buffers``, not a buffer) and the root
#: of a generated function's length parameter (:meth:`Ctx.length`)
LEN_PREFIX = "#len:"

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class Unsupported(FallbackRequired):
    """An op whose semantics the generator cannot express; the message names op and source."""


class RegisterMiss(Exception):
    """An op of a folded prologue cannot run in the register form (:meth:`Ctx.loop`): it reads or
    writes a register tensor other than at the element its thread owns, or loops over another
    size. The prologue then runs in its shared-memory form alone
    (:mod:`fusec.instructions.prologue_regs`)."""


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Element strides of a contiguous tensor of ``shape``."""
    st, acc = [], 1
    for s in reversed(list(shape)):
        st.append(acc)
        acc *= int(s)
    return st[::-1]


def broadcast_strides(shape: Sequence[int], out_shape: Sequence[int]) -> list[int]:
    """Strides of a contiguous tensor of ``shape`` read under broadcasting to ``out_shape``
    (right-aligned; size-1 and missing dims get stride 0)."""
    shape, out_shape = list(shape), list(out_shape)
    if len(shape) > len(out_shape):
        if math.prod(shape[: len(shape) - len(out_shape)]) != 1:
            raise ValueError(f"shape {shape} does not broadcast to {out_shape}")
        shape = shape[len(shape) - len(out_shape):]
    st = contiguous_strides(shape)
    pad = len(out_shape) - len(shape)
    out = [0] * pad
    for d, (s, t) in enumerate(zip(shape, st)):
        o = out_shape[pad + d]
        if s == o:
            out.append(t if s != 1 else 0)
        elif s == 1:
            out.append(0)
        else:
            raise ValueError(f"shape {shape} does not broadcast to {out_shape}")
    return out


def offset(coords: Sequence[str], strides: Sequence[int], base: int | str = 0) -> str:
    """C expression of ``base + sum(coords[d] * strides[d])`` (terms with a 0 stride or a
    ``"0"`` coordinate dropped)."""
    terms = [] if base in (0, "0") else [str(base)]
    for c, s in zip(coords, strides):
        if s == 0 or c == "0":
            continue
        terms.append(c if s == 1 else f"{c} * {s}")
    return " + ".join(terms) if terms else "0"


def literal(v: Any, ctype: str) -> str:
    """C literal of the Python scalar ``v`` converted to ``ctype`` ('float', 'i64' or 'bool')
    as PyTorch converts a Scalar argument to the op's compute type."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if ctype == "bool":
        return "true" if v else "false"
    if ctype == "i64":
        if isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError(f"non-finite scalar {v} in an integer op")
            v = int(v)
        v = int(v)
        return f"(i64)({v}LL)" if v != -(2 ** 63) else "(i64)(-9223372036854775807LL - 1)"
    if isinstance(v, bool):
        return "1.f" if v else "0.f"
    if isinstance(v, int):
        return f"(float)({v}LL)" if abs(v) >= 2 ** 24 else f"{v}.f"
    if math.isnan(v):
        return "gx_nan()"
    if math.isinf(v):
        return "gx_inf()" if v > 0 else "(-gx_inf())"
    return f"(float)({float(v)!r})"


def compute_type(dtype: torch.dtype) -> str:
    """The C type an op computes in for values of ``dtype``: float (fp32 opmath), i64 or bool."""
    if dtype in FLOATS:
        return "float"
    if dtype == torch.bool:
        return "bool"
    if dtype in INTS:
        return "i64"
    raise Unsupported(f"dtype {dtype}")


class Ctx:
    """One op being generated: its bound arguments, its buffers as function parameters, and the
    lines of the function body.

    Args:
        op: the op (``aten.*``/``prims.*``/``fusec.*`` with a call template, or a semantic op).
        g: its graph.
        bufs: a :class:`fusec.cuda.codegen.Buffers` (pointer expressions of the root buffers).
        ranged: the op is split into tiles of output ranges (:func:`fusec.instructions.generic.ranged`):
            the function takes ``int gx_lo, int gx_hi`` last and its elementwise loop covers the
            output's flat elements ``[gx_lo, gx_hi)`` only (``range_used`` says the emitter did).
    """

    def __init__(self, op: Op, g: Graph, bufs: Any, ranged: bool = False):
        self.op, self.g, self.bufs = op, g, bufs
        self.ranged, self.range_used = ranged, False
        self.params: list[tuple[str, str, str]] = []    # (param name, C type, pointer expression)
        self.roots: list[str] = []                      # root buffer of each parameter ("root@start:stop": a view)
        self._param_of: dict[str, str] = {}             # root tensor -> param name
        self.lines: list[str] = []
        self._coord_blocks: dict[int, tuple] = {}   # line index -> a coords() block (see body)
        self._n = 0
        self.smem_floats = 0
        self.args = self._bind() if "target" in op.attrs else {}
        #: the register form's tensors (``bufs.reg(t)``: the array that holds t's elements, or
        #: None), where ``bufs`` offers it (:class:`fusec.instructions.prologue_regs.RegisterBufs`)
        self.reg = getattr(bufs, "reg", None)
        self._reg_vars: set[str] = set()

    # --- arguments ---------------------------------------------------------------------------
    def _bind(self) -> dict[str, Any]:
        target = self.op.attrs["target"]
        schema = target._schema
        out: dict[str, Any] = {}
        pos = list(self.op.attrs.get("args", ()))
        kw = dict(self.op.attrs.get("kwargs", {}))
        for i, a in enumerate(schema.arguments):
            if i < len(pos) and not a.kwarg_only:
                out[a.name] = pos[i]
            elif a.name in kw:
                out[a.name] = kw.pop(a.name)
            elif a.has_default_value():
                out[a.name] = a.default_value
            else:
                out[a.name] = None
        out.update(kw)
        return out

    def tensor(self, v: Any) -> str | None:
        """Tensor name of an argument value (a ``Ref``), or None for a scalar / None."""
        return self.op.inputs[v.slot] if isinstance(v, Ref) else None

    def arg_tensor(self, name: str) -> str:
        t = self.tensor(self.args.get(name))
        if t is None:
            raise self.fail(f"argument {name} is not a tensor")
        return t

    @property
    def out(self) -> str:
        """The op's single output tensor (``out`` or ``mut0`` slot)."""
        o = self.op.outputs
        return o.get("out") or o.get("mut0") or next(iter(o.values()))

    def fail(self, why: str) -> Unsupported:
        op = self.op
        src = f" [{op.source}]" if op.source else ""
        return Unsupported(f"generic op {op.name} ({op.kind}): {why}{src}")

    # --- tensors -----------------------------------------------------------------------------
    def shape(self, t: str) -> tuple[int, ...]:
        return tuple(int(s) for s in self.g.tensors[t].shape)

    def numel(self, t: str) -> int:
        return self.g.tensors[t].numel

    def dtype(self, t: str) -> torch.dtype:
        return self.g.tensors[t].dtype

    def ctype(self, t: str) -> str:
        """C type of ``t``'s elements (Unsupported for fp64 and other dtypes fusec has no CUDA type for)."""
        try:
            return self.bufs.cname(self.dtype(t))
        except FallbackRequired:
            raise self.fail(f"dtype {self.dtype(t)} of {t} has no CUDA type in fusec") from None

    def ptr(self, t: str) -> str:
        """Parameter name of ``t``'s root buffer (one parameter per root; one per view of a
        part of a root, ``TensorInfo.offset``, its pointer at the view's first element)."""
        if self.reg is not None and self.reg(t) is not None:
            raise RegisterMiss(f"{self.op.name} ({self.op.kind}) addresses {t}, a register tensor")
        root, start, stop = self.g.span(t)
        key = root if not self.g.is_view(t) else f"{root}@{start}:{stop}"
        if key not in self._param_of:
            name = f"p{len(self.params)}"
            self.ctype(t)
            expr = self.bufs.ptr(t)
            ctype = expr[2:expr.index("*")]   # "((const float*)bufs[3])" -> "const float"
            self.params.append((name, ctype, expr))
            self.roots.append(key)
            self._param_of[key] = name
        return self._param_of[key]

    def length(self, t: str, dim: int) -> str:
        """C expression (an ``int``) of the run-time size of dim ``dim`` of ``t``: the literal size
        of a static dim; for a run-time length (the KV cache's rows in a length-polymorphic
        graph) an ``int`` parameter of the function, which the call passes from the pointer
        table's length slot (:meth:`fusec.cuda.codegen.Buffers.length`): one per symbol, its
        root ``"#len:" + symbol``."""
        sym = self.bufs.symbol(t, dim)
        if sym is None:
            return str(self.shape(t)[dim])
        key = LEN_PREFIX + sym
        if key not in self._param_of:
            name = f"p{len(self.params)}"
            self.params.append((name, "int", self.bufs.length(t, dim)))
            self.roots.append(key)
            self._param_of[key] = name
        return self._param_of[key]

    def readonly(self, t: str) -> bool:
        return self.g.tensors[self.g.root(t)].role in (Role.WEIGHT, Role.CONSTANT, Role.INPUT)

    def owned(self, value: str, identity: str) -> str:
        """A value a reduction takes from the element of the current loop: in a prologue's
        register form, ``identity`` for the elements past the tensor's end that a thread's last
        round runs over (``gx_in`` false, :meth:`loop`), so that they add nothing. The value is
        masked, not the term (``v = owned(x); ss += v * v``): the term keeps its form, and the
        compiler contracts it to the same FMA as in the shared-memory form (the same bits)."""
        return value if self.reg is None else f"(gx_in ? {value} : {identity})"

    def _reg_at(self, t: str, off: str) -> str | None:
        """The register holding element ``off`` of ``t`` in the register form (None: ``t`` is not a
        register tensor). Raises RegisterMiss where ``off`` is not the element this thread owns."""
        name = self.reg(t) if self.reg is not None else None
        if name is None:
            return None
        if off.strip() not in self._reg_vars:
            raise RegisterMiss(f"{self.op.name} ({self.op.kind}) reads {t} at {off}")
        return f"{name}[gx_k]"

    def load(self, t: str, off: str) -> str:
        """C expression loading element ``off`` of ``t`` in its own type (a plain load where the
        buffers put ``t`` in shared memory: a folded prologue's intermediates; the register that
        holds it in a prologue's register form)."""
        r = self._reg_at(t, off)
        if r is not None:
            return r
        if self.reg is not None:
            # the register form runs every round on every thread: past the vector's end a
            # broadcast operand's offset can pass its tensor's end, so it reads element 0 there
            # (a value no store and no reduction takes: Ctx.owned, RegisterBufs.reg_loop)
            off = f"gx_in ? ({off}) : 0"
        in_smem = getattr(self.bufs, "in_smem", None)
        if in_smem is not None and in_smem(t):
            return f"{self.ptr(t)}[{off}]"
        fn = "gx_ldg" if self.readonly(t) else "gx_ldcg"
        return f"{fn}({self.ptr(t)} + ({off}))"

    def load_as(self, t: str, off: str, ctype: str) -> str:
        """Element ``off`` of ``t`` converted to ``ctype``."""
        return f"gx_cast<{ctype}>({self.load(t, off)})"

    def store(self, t: str, off: str, value: str, vtype: str | None = None) -> str:
        """C statement storing ``value`` (converted to ``t``'s type) at element ``off``."""
        ct = self.ctype(t)
        v = value if vtype == ct else f"gx_cast<{ct}>({value})"
        r = self._reg_at(t, off)
        if r is not None and ct == "float":
            # an op's fp32 output is rounded where it is stored: in registers too, so that the
            # compiler does not fuse it into the next op's arithmetic (a product and the add of
            # the op after it into one FMA: not eager's value)
            v = f"gx_opaque({v})"
        return f"{r if r is not None else self.ptr(t) + '[' + off + ']'} = {v};"

    # --- code --------------------------------------------------------------------------------
    def fresh(self, stem: str = "v") -> str:
        self._n += 1
        return f"{stem}{self._n}"

    def emit(self, *lines: str) -> None:
        self.lines.extend(lines)

    def index_type(self, *extra: int) -> str:
        """``int`` when every tensor of the op (and ``extra`` sizes) has fewer than 2^31 elements."""
        sizes = [self.numel(t) for t in list(self.op.inputs.values()) + list(self.op.outputs.values())]
        return "int" if max(sizes + list(extra) + [1]) < 2 ** 31 else "i64"

    def coords(self, shape: Sequence[int], var: str, ix: str) -> list[str]:
        """Emit the decomposition of flat index ``var`` over ``shape`` (row-major); returns one
        C expression per dim ("0" for size-1 dims). The lines are written out by :meth:`body`,
        which leaves out the coordinates no other line reads (a broadcast operand may use only
        some; an unused variable is an NVRTC warning)."""
        dims = [d for d, s in enumerate(shape) if s != 1]
        out = ["0"] * len(shape)
        if not dims:
            return out
        r = self.fresh("r")
        parts = []   # innermost first: (variable, the dim's size, outermost)
        for d in reversed(dims):
            c = self.fresh("c")
            parts.append((c, shape[d], d == dims[0]))
            out[d] = c
        self._coord_blocks[len(self.lines)] = (ix, r, var, parts)
        self.emit(f"// coordinates {r}")   # placeholder, expanded by body()
        return out

    def loop(self, n: int | str, var: str, ix: str, unroll: int | None = None) -> str:
        """Opening line of the CTA-strided loop ``for var in range(n)`` (close it with ``}``); the
        stride is the CTA's thread count as a constant (``GX_NTHREADS``), so a static ``n`` gives a
        static trip count that the compiler unrolls (several loads in flight per thread);
        ``unroll``: a ``#pragma unroll`` factor.

        In a prologue's register form (``bufs.reg_numel``, ``bufs.reg_loop``) the loop must cover
        the register tensors' ``reg_numel`` elements: it is unrolled over the elements
        ``threadIdx.x + gx_k * GX_NTHREADS`` a thread owns, a register tensor's element ``var``
        is ``array[gx_k]``, and every thread runs every round: ``gx_in`` says whether ``var`` is
        an element (a reduction adds only those, :meth:`owned`). Raises RegisterMiss for any
        other size."""
        if self.reg is not None:
            numel = self.bufs.reg_numel
            if not isinstance(n, int) or n != numel:
                raise RegisterMiss(f"{self.op.name} ({self.op.kind}) loops over {n} elements, not {numel}")
            self._reg_vars.add(var)
            return self.bufs.reg_loop(var, ix)
        head = f"#pragma unroll {unroll}\n" if unroll else ""
        return f"{head}for ({ix} {var} = threadIdx.x; {var} < {n}; {var} += GX_NTHREADS) {{"

    def body(self) -> str:
        """The emitted lines, each :meth:`coords` block written out with only the coordinates
        that other lines read (and the divisions that those need)."""
        plain = [ln for k, ln in enumerate(self.lines) if k not in self._coord_blocks]
        used = lambda c: any(re.search(rf"\b{c}\b", ln) for ln in plain)  # noqa: E731
        out = []
        for k, ln in enumerate(self.lines):
            if k not in self._coord_blocks:
                out.append(ln)
                continue
            ix, r, var, parts = self._coord_blocks[k]
            need = [used(c) for c, _, _ in parts]
            if not any(need):
                continue
            out.append(f"{ix} {r} = {var};")
            last = max(i for i, n in enumerate(need) if n)   # no division after the last one used
            for i, (c, size, outer) in enumerate(parts[:last + 1]):
                if outer:
                    out.append(f"const {ix} {c} = {r};")
                elif need[i] and i < last:
                    out.append(f"const {ix} {c} = {r} % {size}; {r} /= {size};")
                elif need[i]:
                    out.append(f"const {ix} {c} = {r} % {size};")
                else:
                    out.append(f"{r} /= {size};")
        return "\n".join("  " + ln for ln in out)
