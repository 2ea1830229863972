"""CUDA forms of generic ops: a table-driven generator of one ``__device__`` function per op.

Any op that no fusion pattern claims runs as a ``generic`` instruction (one tile: the whole op
on one CTA of 512 threads). :func:`generate` gives such an op a CUDA form: it looks up the op's
emitter in :data:`EMITTERS` (keyed by the op's kind, ``aten.add.Tensor``, or its overload
packet, ``aten.add``, or a semantic kind, ``rmsnorm``), which writes the body of a function over
the op's root buffers with every shape a compile-time constant. Bodies are deduplicated by
their text, so the layers of a model share one function per op.

Numerics follow PyTorch: floating ops compute in fp32 (opmath) and round to the output dtype
at the op's output (each IR op is one ATen op), integer ops in int64, logical ops in bool.
Emitter modules: :mod:`.pointwise` (elementwise, casts, creation), :mod:`.reduce` (reductions,
softmax, topk), :mod:`.data` (layout, indexing, scatter), :mod:`.matvec` (mm, addmm, bmm,
``linear``), :mod:`.semantic` (``rmsnorm``, ``rope``, ``silu_mul``, ``kv_write``,
``attention``, ``fusec.sdpa``). :mod:`.host` compiles the same functions as host C++ for the
CPU tests.
"""
from __future__ import annotations

import hashlib
import logging
import re
from typing import Any, Callable

from fusec.ir import Graph, Op
from fusec.cuda.gen.core import LEN_PREFIX, Ctx, Unsupported

log = logging.getLogger("fusec.cuda.gen")

#: op kind or overload packet (``aten.add``) or semantic kind -> emitter(ctx) writing the body
EMITTERS: dict[str, Callable[[Ctx], None]] = {}
#: shared helpers every generated function may use (templates/ folder); emitted once per kernel
HELPERS = "generic_ops.cuh"


def emitter(*kinds: str):
    """Decorator: register an emitter for op kinds (``aten.add`` covers every overload of
    ``aten::add``; ``aten.max.other`` names one overload and wins over ``aten.max``)."""
    def deco(fn):
        for k in kinds:
            if k in EMITTERS:
                raise ValueError(f"emitter for {k} registered twice")
            EMITTERS[k] = fn
        return fn
    return deco


def find_emitter(kind: str) -> Callable[[Ctx], None] | None:
    """The emitter of an op kind: exact kind first, then its overload packet."""
    if kind in EMITTERS:
        return EMITTERS[kind]
    if kind.count(".") >= 2:
        return EMITTERS.get(kind.rsplit(".", 1)[0])
    return None


def supported(kind: str) -> bool:
    return find_emitter(kind) is not None


def generate(op: Op, g: Graph, bufs: Any, ranged: bool = False) -> dict[str, Any]:
    """The CUDA form of ``op``: a ``__device__`` function and the call that runs it.

    Args:
        op: an unfused op (``aten.*``, ``prims.*``, ``fusec.sdpa`` or a semantic kind).
        g: its graph (static shapes and dtypes of every tensor).
        bufs: :class:`fusec.cuda.codegen.Buffers` (the pointer expression of each root buffer).
        ranged: the op runs as tiles of output ranges: the function takes ``int gx_lo, int gx_hi``
            after its buffers and the call passes the instruction word's ``in.p0, in.p1``
            (``"range"`` in the result: the output's element count, for a whole-op call).

    Returns:
        ``{"fn": "gen", "name", "source", "call", "helpers", "params", "roots", "ctypes"}``:
        ``source`` defines the function ``name`` (shared by every op with the same body), ``call``
        is the C statement (without ``;``) of the op's dispatch case; ``params``, ``roots`` and
        ``ctypes`` are the pointer expression, root buffer and C type of each parameter (a
        run-time length's parameter: ``int``, its root ``"#len:" + symbol``, passed by value).

    Raises:
        NotImplementedError: no emitter for the op's kind (codegen turns it into
            FallbackRequired "no CUDA form: ...", naming the op and its source line).
        Unsupported (a FallbackRequired): the emitter cannot express this instance
            (e.g. an fp64 tensor); the message names the op and its source line.
    """
    fn = find_emitter(op.kind)
    if fn is None:
        raise NotImplementedError(f"generic op {op.name} ({op.kind}) has no CUDA form"
                                  f"{' [' + op.source + ']' if op.source else ''}")
    ctx = Ctx(op, g, bufs, ranged=ranged)
    fn(ctx)
    if ranged and not ctx.range_used:
        raise NotImplementedError(f"generic op {op.name} ({op.kind}) was split into output ranges, but its "
                                  "CUDA form is not one elementwise loop over its output")
    # one parameter per root buffer, and no two roots share memory: every pointer is restrict,
    # so that the compiler may issue an unrolled loop's loads before the earlier iterations' stores
    params = ", ".join(f"{ct} {name}" if r.startswith(LEN_PREFIX) else f"{ct}* __restrict__ {name}"
                       for (name, ct, _), r in zip(ctx.params, ctx.roots))
    if ranged:
        params += ", int gx_lo, int gx_hi"
    shapes = "; ".join(f"{ctx.dtype(t)}{list(ctx.shape(t))}".replace("torch.", "")
                       for t in list(op.inputs.values()) + list(op.outputs.values()))
    body = ctx.body()
    digest = hashlib.sha1(f"{op.kind}|{params}|{body}".encode()).hexdigest()[:10]
    stem = re.sub(r"[^0-9a-zA-Z]+", "_", op.kind.split(".")[1] if op.kind.count(".") >= 2 else op.kind)
    name = f"gx_{stem}_{digest}"
    source = (f"// {op.kind}: {shapes}\n"
              f"__device__ __noinline__ void {name}({params}) {{\n{body}\n}}\n")
    call = f"{name}({', '.join([expr for _, _, expr in ctx.params] + (['in.p0', 'in.p1'] if ranged else []))})"
    log.debug("generic op %s (%s) -> %s", op.name, op.kind, name)
    return {"fn": "gen", "name": name, "source": source, "call": call, "helpers": HELPERS,
            "params": [expr for _, _, expr in ctx.params], "roots": list(ctx.roots),
            "ctypes": [ct for _, ct, _ in ctx.params], "range": ctx.numel(ctx.out) if ranged else None}


def generate_inline(op: Op, g: Graph, bufs: Any) -> str:
    """The CUDA form of ``op`` as a block of statements to place inside another function (a
    folded prologue's register form, :mod:`fusec.instructions.prologue_regs`): its buffers are local
    ``__restrict__`` pointers declared at the block's start, its register tensors (``bufs.reg``)
    the arrays of the enclosing code.

    Raises:
        NotImplementedError: no emitter for the op's kind.
        Unsupported: the emitter cannot express this instance.
        RegisterMiss: the op touches a register tensor other than at the element a thread owns.
    """
    fn = find_emitter(op.kind)
    if fn is None:
        raise NotImplementedError(f"generic op {op.name} ({op.kind}) has no CUDA form")
    ctx = Ctx(op, g, bufs)
    fn(ctx)
    decls = " ".join(f"const {ct} {name} = {expr};" if r.startswith(LEN_PREFIX)
                     else f"{ct}* __restrict__ {name} = {expr};"
                     for (name, ct, expr), r in zip(ctx.params, ctx.roots))
    return f"{{ // {op.kind}\n{decls}\n{ctx.body()}\n}}"


from fusec.cuda.gen import pointwise, reduce, data, matvec, semantic  # noqa: E402,F401  (register emitters)
