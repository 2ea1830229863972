"""Build the IR (:mod:`fusec.ir`) from a core-ATen FX graph produced by AOT autograd."""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusec.frontend.capture import INPUT_NAMES, MODEL_TENSORS, node_source
from fusec.errors import FallbackRequired, NotLengthPolymorphic, UnsupportedOpError
from fusec.instructions.generic import aten_category
from fusec.ir import Graph, Op, Ref, Role, TensorInfo


def _meta(node: torch.fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


@dataclasses.dataclass(frozen=True)
class _Sym:
    """An integer (or bool, float) an ATen node computes from sizes, evaluated: not an op."""

    value: Any
    symbolic: bool = False   # depends on a length (not a constant that dynamo specialized)


def _expr(x: Any) -> Any:
    """The sympy expression of a symbolic value with its shape environment's specializations
    applied (a symbol a guard pinned to a constant becomes that constant)."""
    import sympy
    return sympy.sympify(x.node.shape_env.replace(x.node.expr))


def _depends(x: Any) -> bool:
    """Whether a size value depends on a symbol (after dynamo's specializations)."""
    return isinstance(x, (torch.SymInt, torch.SymBool, torch.SymFloat)) and bool(_expr(x).free_symbols)


class _Sizes:
    """Sizes of a symbolic ATen graph evaluated at the cache length's capacity.

    The length symbols are the free symbols of the KV caches' rows (dim 2 of the 4-D float
    inputs the graph writes); ``capacity_for(rows)`` gives the capacity for the call's rows (the
    largest hint). Any other free symbol raises :class:`NotLengthPolymorphic`."""

    def __init__(self, caches: list[Any], capacity_for: Callable[[int], int] | None):
        self.subs: dict[Any, int] = {}
        syms = set()
        for v in caches:
            d = v.shape[2]
            if _depends(d):
                syms |= _expr(d).free_symbols
        if syms and capacity_for is None:
            raise NotLengthPolymorphic("the graph's sizes are symbolic, and no capacity was given")
        if syms:
            hints = [int(v.shape[2].node.hint) for v in caches if isinstance(v.shape[2], torch.SymInt)]
            cap = capacity_for(max(hints))
            self.subs = {s: cap for s in syms}
        self.names = {s: str(s) for s in syms}

    def value(self, x: Any, what: str) -> Any:
        """``x`` (an int or a Sym value) with the length at its capacity."""
        if not isinstance(x, (torch.SymInt, torch.SymBool, torch.SymFloat)):
            return x
        import sympy
        expr = sympy.sympify(_expr(x).xreplace(self.subs))
        if expr.free_symbols:
            raise NotLengthPolymorphic(f"{what} depends on the symbolic size {x.node.expr}, which is not a "
                                       "KV cache's length: a size of its own, compiled per value (a mask "
                                       "grown each step compiles every step; over the cache's full length, "
                                       "zeros past the current token, it compiles once per cache length)")
        return bool(expr) if isinstance(x, torch.SymBool) else float(expr) if isinstance(x, torch.SymFloat) \
            else int(expr)

    def shape(self, v: torch.Tensor, what: str) -> tuple[tuple[int, ...], dict[int, str]]:
        """A tensor's shape at the capacity, and its dims that are a length (dim -> symbol)."""
        dims, sym = [], {}
        for i, d in enumerate(v.shape):
            dims.append(self.value(d, what))
            if _depends(d):
                sym[i] = str(_expr(d))
        return tuple(dims), sym


def _known_contiguous(v: torch.Tensor) -> bool:
    """Whether ``v`` (a placeholder's example value) is contiguous: False only where its sizes and
    strides are plain ints and say it is not. A symbolic size or stride is left to the call-time
    checks (the kernel's :meth:`fusec.runtime.cuda_step.CudaStep._guard`, the simulator's
    :class:`fusec.ir.env.Env`): asking the fake tensor would add a guard on it."""
    if not all(isinstance(d, int) for d in (*v.shape, *v.stride())):
        return True
    return v.is_contiguous()


def graph_from_aten(gm: torch.fx.GraphModule, example_inputs: list[Any],
                    capacity_for: Callable[[int], int] | None = None) -> Graph:
    """Translate an ATen FX graph into a :class:`Graph`.

    Roles: inputs written by ``copy_`` are KV_CACHE (4-D float) or STATE (others); float
    inputs that are read only are WEIGHT when they are the model's parameters or buffers (the
    capture records which, ``gm.meta[MODEL_TENSORS]``; without that record every float
    read-only input counts as one); other inputs are INPUT (token ids, positions, a float
    ``attention_mask``, ``inputs_embeds``: read at run time, never folded); ``get_attr``
    tensors are CONSTANT. Every ``call_function`` becomes an ``aten.*`` op with an argument template.

    A graph with symbolic sizes (AOT autograd over :func:`fusec.frontend.symbolic.fake_inputs`)
    is built at the KV-cache length's capacity (``capacity_for(rows)``, rows the traced length):
    its integer placeholders are not inputs of the step (``Graph.skip_args``), integer nodes are
    evaluated into the arguments of the ops that use them (which get ``attrs["symbolic"]``),
    tensors whose size is the length get ``TensorInfo.sym`` and ``Graph.lengths`` holds the
    capacity (the pass ``check_lengths`` verifies the rest of the step does not depend on it).
    The step's batch B and query tokens K are recorded on the graph (:meth:`Graph.record_rows`).

    Raises:
        UnsupportedOpError: an op that no instruction kind can place (names op and source line).
        NotLengthPolymorphic: a symbolic size that is not a KV cache's length.
    """
    g = Graph()
    nodes = list(gm.graph.nodes)
    mutated = set()
    for n in nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
            if isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder":
                mutated.add(n.args[0].name)
    caches = [_meta(n) for n in nodes if n.op == "placeholder" and n.name in mutated
              and isinstance(_meta(n), torch.Tensor) and _meta(n).dim() == 4 and _meta(n).is_floating_point()]
    sizes = _Sizes(caches, capacity_for)
    owned = gm.meta.get(MODEL_TENSORS)
    names = gm.meta.get(INPUT_NAMES) or []
    env: dict[str, Any] = {}  # fx node name -> tensor name (or tuple element names, or a _Sym)
    idx = 0
    for n in nodes:
        if n.op == "placeholder":
            v = _meta(n)
            user = names[idx] if idx < len(names) and names[idx] else ""
            what = f"the input {user} (graph input {n.name})" if user else f"graph input {n.name}"
            if isinstance(v, (torch.SymInt, int)) and not isinstance(v, bool):
                g.skip_args.append(idx)   # a size the graph takes as an argument: evaluated here
                env[n.name] = _Sym(sizes.value(v, what), _depends(v))
                idx += 1
                continue
            if not isinstance(v, torch.Tensor):
                raise UnsupportedOpError(f"graph input {n.name} is not a tensor ({type(v).__name__})")
            if n.name in mutated:
                role = Role.KV_CACHE if (v.dim() == 4 and v.is_floating_point()) else Role.STATE
                if not _known_contiguous(v):
                    raise FallbackRequired(
                        f"{what} ({'a KV cache' if role is Role.KV_CACHE else 'state'} the step writes in place, "
                        f"shape {list(v.shape)}) is a strided view (strides {list(v.stride())}): fusec writes "
                        f"it as one contiguous buffer; store the cache's tensors contiguous")
            elif v.is_floating_point() and (owned is None or idx >= len(owned) or owned[idx]):
                role = Role.WEIGHT
            else:
                role = Role.INPUT
            shape, sym = sizes.shape(v, what)
            g.add_tensor(TensorInfo(n.name, shape, v.dtype, role, input_index=len(g.inputs), sym=sym))
            g.inputs.append(n.name)
            env[n.name] = n.name
            idx += 1
        elif n.op == "get_attr":
            val = getattr(gm, n.target)
            # a tensor constant of the ATen graph (HF's sliding-window roll index, one in Falcon's
            # step): a real tensor, copied outside the fake mode AOT autograd may have active
            with unset_fake_temporarily():
                value = val.detach().clone()
            g.add_tensor(TensorInfo(n.name, tuple(val.shape), val.dtype, Role.CONSTANT, value=value))
            env[n.name] = n.name
        elif n.op == "call_function":
            if n.target is operator.getitem:
                env[n.name] = env[n.args[0].name][n.args[1]]
                continue
            val = _meta(n)
            if val is None or isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)):
                # size arithmetic (sym_size, operator.mul, ...) or a run-time assert on sizes: no op;
                # its value goes into the arguments of the ops that use it
                env[n.name] = _Sym(sizes.value(val, f"node {n.name} ({n.target})"), _depends(val))
                continue
            _add_call(g, n, env, sizes)
        elif n.op == "output":
            outs = n.args[0]
            for o in (outs if isinstance(outs, (list, tuple)) else [outs]):
                if o is None or not isinstance(o, torch.fx.Node):
                    raise UnsupportedOpError("graph output is not a tensor")
                g.outputs.append(env[o.name])
    for t in g.outputs:
        if g.tensors[t].role == Role.INTERMEDIATE:
            g.tensors[t].role = Role.OUTPUT
    g.lengths = {name: sizes.subs[s] for s, name in sizes.names.items()}
    g.record_rows()   # B and K off the attention queries, before any pass rewrites the attention
    return g


def _add_call(g: Graph, n: torch.fx.Node, env: dict[str, Any], sizes: _Sizes) -> None:
    target = n.target
    kind = str(target)
    source = node_source(n)
    if aten_category(target) is None:
        raise UnsupportedOpError(f"unsupported op {kind} (node {n.name}) at {source or 'unknown source'}")
    inputs: dict[str, str] = {}
    symbolic = []

    def conv(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if isinstance(env[a.name], _Sym):   # a size computed in the graph: its value here
                if env[a.name].symbolic:
                    symbolic.append(a.name)
                return env[a.name].value
            slot = f"in{len(inputs)}"
            inputs[slot] = env[a.name]
            return Ref(slot)
        if isinstance(a, (torch.SymInt, torch.SymBool, torch.SymFloat)):
            if _depends(a):
                symbolic.append(str(a))
            return sizes.value(a, f"an argument of {kind} (node {n.name})")
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        return a

    args = conv(tuple(n.args))
    kwargs = {k: conv(v) for k, v in n.kwargs.items()}
    val = _meta(n)
    outputs: dict[str, str] = {}
    mutates: tuple[str, ...] = ()
    if target is torch.ops.aten.copy_.default:
        dst = env[n.args[0].name]
        outputs["mut0"] = dst
        mutates = ("mut0",)
        env[n.name] = dst
    elif isinstance(val, torch.Tensor):
        shape, sym = sizes.shape(val, f"the output of {kind} (node {n.name})")
        g.add_tensor(TensorInfo(n.name, shape, val.dtype, sym=sym))
        outputs["out"] = n.name
        env[n.name] = n.name
    elif isinstance(val, (list, tuple)):
        names = []
        for i, v in enumerate(val):
            nm = f"{n.name}_{i}"
            shape, sym = sizes.shape(v, f"the output of {kind} (node {n.name})")
            g.add_tensor(TensorInfo(nm, shape, v.dtype, sym=sym))
            outputs[f"out{i}"] = nm
            names.append(nm)
        env[n.name] = names
    else:
        raise UnsupportedOpError(f"op {kind} at {source} returns {type(val).__name__}, not tensors")
    attrs = {"target": target, "args": args, "kwargs": kwargs}
    if symbolic:   # a size argument that depends on the length (check_lengths refuses it if it stays)
        attrs["symbolic"] = True
    g.ops.append(Op(n.name, kind, inputs, outputs, attrs=attrs, mutates=mutates, source=source))
