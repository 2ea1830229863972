"""A folded prologue in registers: each thread of the consumer's CTA runs the members on its own
elements of the hidden vector (the knob ``FUSEC_PROLOGUE_REGS``; the prologue itself, its members
and its shared-memory form: :mod:`fusec.instructions.prologue`).

Source: the register tiling of elementwise chains in fused kernels (the loop fusion of inductor's
Triton kernels and of Llama's ``rms_prologue`` here, templates/common.cuh), applied to the members'
generated code (:mod:`fusec.cuda.gen`, whose loops and loads take the register form from
:class:`RegisterBufs`).
"""
from __future__ import annotations

from typing import Any

from fusec.ir import Graph, Op


class RegisterBufs:
    """A :class:`fusec.cuda.codegen.Buffers` for a prologue's register form: every tensor of
    ``reg_numel`` elements that the members read or write is an array of registers, one per
    round of the CTA's threads over it (``reg``: its name; element
    ``threadIdx.x + k * GX_NTHREADS`` is ``array[k]``, :meth:`reg_loop`,
    :meth:`fusec.cuda.gen.core.Ctx.loop`); any other member output has no place (RegisterMiss)."""

    def __init__(self, bufs: Any, g: Graph, arrays: dict[tuple, tuple[str, str]], numel: int,
                 member_roots: set[str]):
        self._bufs, self._g, self._arrays, self._member_roots = bufs, g, arrays, member_roots
        self.reg_numel = numel
        #: each buffer pointer the form uses (the kernel's expression, ``Buffers.ptr``) -> the
        #: function's parameter that holds it and its C type (:func:`_as_function`)
        self.params: dict[str, tuple[str, str]] = {}

    def reg_loop(self, var: str, ix: str = "int") -> str:
        """The opening line of a loop over a thread's elements (close it with ``}``): unrolled,
        ``var`` the element, ``gx_k`` its register's index, ``gx_in`` whether ``var`` is one (the
        last round of a size that is not a multiple of the CTA's threads runs past it). Every
        thread runs every round, with no branch: past the end, loads read element 0 of their
        tensor (:meth:`fusec.cuda.gen.core.Ctx.load`), the reductions take nothing
        (:meth:`fusec.cuda.gen.core.Ctx.owned`), and only the stores to memory test ``gx_in``.
        (Inline in the kernel, a branch around each round took Gemma-2's kernel from 116
        registers to 128 and spills; the form is now a function of its own, :func:`_as_function`.)"""
        from fusec.instructions.base import CTA_THREADS
        n = self.reg_numel
        per, full = -(-n // CTA_THREADS), n // CTA_THREADS
        inside = "true" if per == full else f"gx_k < {full} || {var} < {n}"
        return (f"#pragma unroll\nfor (int gx_k = 0; gx_k < {per}; ++gx_k) {{ "
                f"[[maybe_unused]] const {ix} {var} = threadIdx.x + gx_k * GX_NTHREADS; "
                f"[[maybe_unused]] const bool gx_in = {inside};")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bufs, name)

    def reg(self, t: str) -> str | None:
        a = self._arrays.get(self._g.span(t)) if self._g.tensors[t].numel == self.reg_numel else None
        return a[0] if a else None

    def ptr(self, t: str) -> str:
        """A member's pointer to ``t`` (:meth:`param_ptr`); RegisterMiss for a member output,
        which has no place outside the registers."""
        from fusec.cuda.gen.core import RegisterMiss
        if self._g.root(t) in self._member_roots:
            raise RegisterMiss(f"{t} is a member output of {self._g.tensors[t].numel} elements")
        return self.param_ptr(t)

    def param_ptr(self, t: str) -> str:
        """``t``'s pointer inside the form's function: a parameter (the call passes the kernel's
        pointer, so the layers share the function), cast as ``Buffers.ptr`` casts it."""
        expr = self._bufs.ptr(t)   # "((const float*)bufs[3])", a view's "((float*)bufs[3] + 128)"
        ct = expr[2:expr.index("*")]
        name = self.params.setdefault(expr, (f"gp{len(self.params)}", ct))[0]
        return f"(({ct}*){name})"


#: the register form's arrays hold at most this many values per thread in all (512 threads leave
#: 128 registers a thread; Gemma-2-9B's post-norm, add and pre-norm at hidden 3584: 7 arrays of 7)
MAX_REG_VALUES = 64
#: the members the register form runs: elementwise ops (each element from the same element of
#: its operands) and the norms whose reductions mask the elements past the end (``Ctx.owned``);
#: any other reduction's emitter would add them
REGISTER_REDUCTIONS = ("rmsnorm", "layernorm")


def register_form(op: Op, g: Graph, bufs: Any) -> dict[str, Any] | None:
    """The prologue in registers, as a generated function and its call (:func:`_as_function`),
    or None where it cannot be.

    Each thread owns the elements ``threadIdx.x + k * GX_NTHREADS`` of every member tensor of
    x's size (``N``: the hidden vector): it loads its elements of the external inputs once, up
    front (all its loads in flight together, as ``rms_prologue`` does for Llama's RMSNorm), runs
    every member on them in registers, inline, with no barrier but a norm's block reduction,
    and stores its elements of x to shared memory (where the kind reads its staged vector) and,
    on the writer tile, of the kept outputs to global memory; the case calls it, then one
    barrier. The shared-memory form (each member a function over shared memory, a barrier after
    each) took 0.7-1.9 µs more per prologue than Llama's norm on the H100 (OLMo-2, Granite,
    Gemma-2, docs/performance.md). Numerics are the same: each member's output rounded to its
    dtype (an fp32 one through ``gx_opaque``: not contracted into the next member's arithmetic,
    :meth:`fusec.cuda.gen.core.Ctx.store`), the sums in the same order.

    None (the shared-memory form then runs) where a member reads or writes a tensor of x's size
    other than at the element its thread owns (a broadcast, a gather), loops over another size,
    writes a tensor of another size, or the arrays would pass :data:`MAX_REG_VALUES` values."""
    from fusec.cuda.gen import generate_inline
    from fusec.cuda.gen.core import RegisterMiss, Unsupported
    from fusec.errors import FallbackRequired
    from fusec.instructions.base import CTA_THREADS
    from fusec.ir import Role
    from fusec.instructions.generic import generic_kind
    x = op.outputs["x"]
    n = g.tensors[x].numel
    per = -(-n // CTA_THREADS)
    members = op.attrs["pre"]
    if any(m.kind not in REGISTER_REDUCTIONS and generic_kind(m) != "elementwise" for m in members):
        return None
    arrays: dict[tuple, tuple[str, str]] = {}
    first: dict[tuple, str] = {}   # a tensor of each array (the external inputs' loads)
    try:
        for m in members:
            for t in list(m.reads()) + list(m.writes()):
                key = g.span(t)
                if g.tensors[t].numel != n or key[2] - key[1] != n:
                    continue
                ct = bufs.cname(g.tensors[t].dtype)
                if arrays.setdefault(key, (f"gx_r{len(arrays)}", ct))[1] != ct:
                    return None
                first.setdefault(key, t)
    except FallbackRequired:
        return None
    member_roots = {g.root(t) for m in members for t in m.writes()}
    keep = list(op.attrs["pre_keep"])
    if len(arrays) * per > MAX_REG_VALUES or any(g.span(t) not in arrays for t in [x, *keep]):
        return None
    rb = RegisterBufs(bufs, g, arrays, n, member_roots)
    try:
        blocks = [generate_inline(m, g, rb) for m in members]
    except (RegisterMiss, Unsupported, NotImplementedError):
        return None
    each = rb.reg_loop("i") + " "
    decl = " ".join(f"{ct} {name}[{per}];" for name, ct in arrays.values())
    loads = []
    for key, (name, ct) in arrays.items():
        if key[0] in member_roots:
            continue
        fn = "gx_ldg" if g.tensors[g.root(key[0])].role in (Role.WEIGHT, Role.CONSTANT, Role.INPUT) else "gx_ldcg"
        loads.append(f"{name}[gx_k] = {fn}({rb.ptr(first[key])} + (gx_in ? i : 0));")
    xa = arrays[g.span(x)][0]
    stores = [f"if (gx_in) (({bufs.cname(g.tensors[x].dtype)}*)smem)[i] = {xa}[gx_k];"]
    if keep:
        stores.append("if (gx_in && gx_p0 == 0) { " + " ".join(
            f"{rb.param_ptr(t)}[i] = {arrays[g.span(t)][0]}[gx_k];" for t in keep) + " }")
    # gx_in outside the loops: true (a load there is not of an element; the loops shadow it)
    body = "\n".join(["[[maybe_unused]] constexpr bool gx_in = true;", decl, each + " ".join(loads) + " }",
                      *blocks, each + " ".join(stores) + " }"])
    return _as_function(body, rb.params)


def _as_function(body: str, params: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """The register form's statements as a ``__noinline__`` function of its own (registers
    allocated apart from the kernel's dispatch loop: inline, its few live values tipped kernels
    already at 128 registers into spills, fp32 Gemma-3 at its published widths) and the call
    that runs it (``{"name", "source", "call", "helpers"}``, as :func:`fusec.cuda.gen.generate`
    gives): its parameters are the buffer pointers ``params`` (:attr:`RegisterBufs.params`: the
    kernel's expression -> parameter, C type), then ``smem`` and the instruction word's ``p0``
    (``gx_p0``)."""
    import hashlib
    decl = ", ".join([f"{ct}* __restrict__ {name}" for name, ct in params.values()]
                     + ["float* __restrict__ smem", "int gx_p0"])
    name = "gx_prologue_" + hashlib.sha1(f"{decl}|{body}".encode()).hexdigest()[:10]
    source = (f"// a folded prologue, register form\n__device__ __noinline__ void {name}({decl}) {{\n{body}\n"
              f"}}  // {name}\n")
    call = f"{name}({', '.join([*params, 'smem', 'in.p0'])}); __syncthreads();"
    return {"name": name, "source": source, "call": call, "helpers": "generic_ops.cuh"}
