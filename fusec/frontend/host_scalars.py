"""Host scalars: Python integers a decode step counts with, split off dynamo's graph.

Some models keep a Python ``int`` that the step updates. HF's sliding-window cache layer
(``StaticSlidingWindowLayer``: Mistral with ``sliding_window``, Gemma-2, Gemma-3, StarCoder2) adds
the step's token count to ``cumulative_length_int``, branches on it (whether the window is full)
and, without ``cache_position``, takes the step's position from it. After the second step dynamo
makes that attribute a ``SymInt`` input and the graph returns ``s + 1`` for it to store back.
:func:`split_host_scalars` takes the scalar arithmetic out of the graph: the host computes it
from each call's integers (a few Python additions); a value that int64 tensor ops only add,
subtract or multiply (the position ``arange + s``) reaches the kernel as a 0-dim device tensor.
Where every such value is its integer plus a constant (HF's position ``s`` and window offset
``s - W + 1``), that tensor is a device counter the step itself advances by one, as HF's
tensor counters are: the tensor graph computes the values from it and adds one at its end, and
the host writes it (one ``fill_``) only when its own count differs from what the device holds
(the first call, another cache, a step that did not add one): a decode loop launches the step
alone, and a CUDA graph's replays advance the positions. Other values are filled each call. The kernel takes such a value for a position (its tables cover ``[0, bound)``:
the backend makes that option ``position_rows``, 32768 by default, past every cache's rows, as
a rolled sliding window's positions go), so the host checks each call's value against that range
and runs an out-of-range call eagerly (one log line). A graph with any other use of a host value (a size, a
comparison, a float) is not split: the backend handles it as before (it specializes on the
value, or falls back). The megakernel is compiled once for every value of the counter.
"""
from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any, Callable

import torch

from fusec.fallbacks import ran_fallback, warn as warn_fallback

_SCALARS = (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)


def _example(n: torch.fx.Node) -> Any:
    """The value dynamo (``example_value``) or AOT (``val``) recorded for ``n``."""
    return n.meta.get("example_value", n.meta.get("val"))


def _is_scalar(n: torch.fx.Node) -> bool:
    return isinstance(_example(n), _SCALARS)


@dataclasses.dataclass
class HostSplit:
    """``gm`` split into the tensor graph and the host scalars.

    Attributes:
        host_inputs: positions (in ``gm``'s placeholders) of the integer inputs the tensor graph
            does not take.
        host_outputs: positions (in ``gm``'s output tuple) of the scalar outputs the host computes.
        tensor_gm: ``gm`` without them; its placeholders are ``gm``'s others, in order, then one
            per host value that a tensor op reads (the derived inputs: 0-dim int64 tensors, in
            ``derived_tensors``, which the wrapper fills each call).
        bound: the rows of the position tables (at least the KV-cache length L; the backend raises
            it to option ``position_rows``); a call whose derived values are not all in
            ``[0, bound)`` runs ``tensor_gm`` eagerly instead of the compiled step.
        host_fn: takes all of ``gm``'s arguments, returns the host outputs' values, then the
            derived inputs' values.
        n_outputs, n_inputs: the lengths of ``gm``'s output tuple and placeholders.
        derived_tensors: the 0-dim int64 device tensors of the derived inputs, in order; with
            ``counted``, one device counter per host integer instead (module docstring).
        counted: for each counter, the position (in ``gm``'s placeholders) of the host integer
            it holds; None where the derived values are filled each call.
        expected: the value each counter holds on the device after the steps queued so far (None:
            unknown, written at the next call).
        fills: how many times the wrapper wrote a counter or a derived value (``fill_``).
    """

    host_inputs: list[int]
    host_outputs: list[int]
    tensor_gm: torch.fx.GraphModule
    host_fn: Callable[..., tuple]
    n_outputs: int
    n_inputs: int
    derived_tensors: list[torch.Tensor]
    bound: int
    bound_args: list[int] = dataclasses.field(default_factory=list)
    counted: list[int] | None = None
    expected: list[int | None] = dataclasses.field(default_factory=list)
    fills: int = 0

    def example_inputs(self, example_inputs: list[Any]) -> list[Any]:
        """The tensor graph's example inputs from ``gm``'s."""
        skip = set(self.host_inputs)
        return [x for i, x in enumerate(example_inputs) if i not in skip] + list(self.derived_tensors)

    def wrap(self, inner: Callable[..., Any]) -> Callable[..., tuple]:
        """A callable over all of ``gm``'s arguments: ``inner`` (compiled from ``tensor_gm``) on
        the tensor graph's arguments, the host outputs computed here, merged in ``gm``'s order."""
        skip = set(self.host_inputs)
        keep = [i for i in range(self.n_inputs) if i not in skip]
        host_at = set(self.host_outputs)
        n_host = len(self.host_outputs)

        warned: list[bool] = []

        def run(*args: Any) -> tuple:
            values = self.host_fn(*args)
            derived = values[n_host:]
            step = inner
            bound = max([self.bound, *(int(args[i].shape[2]) for i in self.bound_args)])
            if not all(0 <= int(v) < bound for v in derived):
                step = self.tensor_gm.forward   # the kernel's position tables cover [0, bound) only
                if not warned:
                    warned.append(warn_fallback("fusec: a position computed on the host (%s) is outside the "
                                                "kernel's position tables, [0, %d) (option position_rows, or the "
                                                "longest KV cache); such steps run eagerly",
                                                [int(v) for v in derived], bound))
                else:
                    ran_fallback(warned[0])
            positions = self._counters(args) if self.counted is not None else self._filled(derived)
            tensors = iter(step(*[args[i] for i in keep], *positions))
            if self.counted is not None and not _capturing():   # the step added one to each counter
                self.expected = [int(args[i]) + 1 for i in self.counted]
            # (a CUDA graph's capture ran nothing and its replays run no Python: unknown, the
            # next call outside a capture writes the counters from the host's integers)
            scalars = iter(values[:n_host])
            return tuple(next(scalars) if i in host_at else next(tensors) for i in range(self.n_outputs))

        return run

    def _filled(self, derived: list[Any]) -> list[torch.Tensor]:
        self.fills += len(derived)
        return [t.fill_(v) for t, v in zip(self.derived_tensors, derived)]

    def _counters(self, args: tuple) -> list[torch.Tensor]:
        """The device counters, each written only where the host's integer differs from what the
        device holds (``expected``); unknown until the step has run."""
        want = [int(args[i]) for i in self.counted]
        if len(self.expected) != len(want):
            self.expected = [None] * len(want)
        for k, (t, v) in enumerate(zip(self.derived_tensors, want)):
            if self.expected[k] != v:
                t.fill_(v)
                self.fills += 1
        self.expected = [None] * len(want)
        return self.derived_tensors


def _capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def split_host_scalars(gm: torch.fx.GraphModule) -> HostSplit | None:
    """Split the host scalars off dynamo's graph ``gm``, or None when it has none.

    Expects: dynamo's graph (nodes carry ``example_value``), returning a tuple or list.
    A host scalar is a scalar-valued placeholder (``SymInt`` ...) or scalar arithmetic over host
    scalars and constants (``operator.add``, ``max`` ...). Those a tensor op reads become inputs
    of the tensor graph (computed by the host per call); the others leave it.
    Guarantees: the tensor graph computes the same tensor outputs from the other arguments and
    the derived ones; the split callable (:meth:`HostSplit.wrap`) returns what ``gm`` returns.
    """
    nodes = list(gm.graph.nodes)
    out = next(n for n in nodes if n.op == "output")
    outs = out.args[0]
    if not isinstance(outs, (tuple, list)):
        return None
    host: set[str] = set()
    # a symbolic graph's sizes (the ``Sym(s53)`` of a cache length, and arithmetic on them only)
    # stay in the tensor graph; the host reads them too, where a host scalar is computed with them
    sizes: set[str] = set()
    size_symbols = _size_symbols(nodes)
    for n in nodes:
        if n.op == "placeholder" and _is_scalar(n):
            (sizes if _is_size(n, size_symbols) else host).add(n.name)
        elif n.op == "call_function" and _is_scalar(n) and n.all_input_nodes:
            ins = {a.name for a in n.all_input_nodes}
            if ins <= host | sizes:
                (host if ins & host else sizes).add(n.name)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    host_inputs = [i for i, n in enumerate(placeholders) if n.name in host]
    host_outputs = [i for i, o in enumerate(outs) if isinstance(o, torch.fx.Node) and o.name in host]
    if not host_inputs:
        return None
    # host values a tensor op reads: inputs of the tensor graph, as positions bounded by the KV
    # cache's length; any other use leaves the graph to the backend's other paths
    derived = [n for n in nodes if n.name in host
               and any(u.op != "output" and u.name not in host for u in n.users)]
    pinned = {n.name: v for n in derived if (v := _pinned(n)) is not None}
    derived = [n for n in derived if n.name not in pinned]
    bound = _kv_length(placeholders)
    bound_args = _symbolic_kv_inputs(placeholders)
    buffers = [_value_operand_buffer(n, host) for n in derived]
    if derived and ((bound is None and not bound_args) or any(b is None for b in buffers)):
        return None

    hg = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for n in nodes:
        if n.op == "placeholder":
            env[n.name] = hg.placeholder(n.name)
        elif n.name in host or n.name in sizes:
            env[n.name] = hg.node_copy(n, lambda a: env[a.name])
    hg.output(tuple([env[outs[i].name] for i in host_outputs] + [env[n.name] for n in derived]))
    counted = _affine(derived, placeholders, host)
    host_fn = torch.fx.GraphModule(torch.nn.Module(), hg)

    tg = copy.deepcopy(gm.graph)
    by_name = {n.name: n for n in tg.nodes}
    t_out = by_name[out.name]
    to_host = set(host_outputs)
    t_out.args = (type(outs)(o for i, o in enumerate(t_out.args[0]) if i not in to_host),)
    last = [n for n in tg.nodes if n.op == "placeholder"][-1]
    if counted is not None:
        buffers, counters = _count_on_device(tg, last, t_out, derived, counted, buffers, by_name)
    else:
        for n, buf in zip(derived, buffers):
            with tg.inserting_after(last):
                ph = tg.placeholder(f"host_{n.name}")
            ph.meta["example_value"] = buf
            by_name[n.name].replace_all_uses_with(ph)
            last = ph
    for name, value in pinned.items():   # a constant wherever this graph runs
        old_node = by_name[name]
        for u in list(old_node.users):
            u.args = torch.fx.node.map_aggregate(u.args, lambda a: value if a is old_node else a)
            u.kwargs = torch.fx.node.map_aggregate(u.kwargs, lambda a: value if a is old_node else a)
    for n in reversed(list(tg.nodes)):
        if n.name in host and not n.users:
            tg.erase_node(n)
    tensor_gm = torch.fx.GraphModule(gm, tg)
    return HostSplit(host_inputs, host_outputs, tensor_gm, host_fn, len(outs), len(placeholders),
                     buffers, bound or 0, bound_args, counters if counted is not None else None)


def _affine(derived: list[torch.fx.Node], placeholders: list[torch.fx.Node],
            host: set[str]) -> list[tuple[int, int]] | None:
    """For each derived value, (the position of the host integer ``s`` among ``placeholders``,
    ``c``) when the value is ``s + c`` (HF's position ``s``, its window offset ``s - W + 1``);
    None if any is not."""
    by_symbol = {}
    for i, p in enumerate(placeholders):
        v = _example(p)
        if p.name in host and isinstance(v, torch.SymInt) and v.node.expr.is_Symbol:
            by_symbol[v.node.expr] = i
    out = []
    for n in derived:
        v = _example(n)
        e = _without_max(v.node.expr, v.node.shape_env) if isinstance(v, torch.SymInt) else None
        if e is None or len(e.free_symbols) != 1:
            return None
        s = next(iter(e.free_symbols))
        c = e - s
        if s not in by_symbol or not c.is_Integer:
            return None
        out.append((by_symbol[s], int(c)))
    return out or None


def _without_max(expr: Any, shape_env: Any) -> Any:
    """``expr`` with each ``Max(a, b)`` / ``Min(a, b)`` replaced by the argument that dynamo's
    guards make the larger (smaller) wherever this graph runs, or None where they do not decide.
    HF's rolled window, guarded ``s >= W``: ``Max(0, s - W + 1)`` is ``s - W + 1``; its window
    before it is full, guarded ``s < L`` with a symbolic cache length ``L`` (a second length):
    ``Max(0, s - L + 1)`` is 0."""
    def pick(e: Any) -> Any:
        if len(e.args) != 2:
            raise ValueError(e)
        a, b = e.args
        sign = _sign(a - b, shape_env)
        if sign is None:
            raise ValueError(e)
        big, small = (a, b) if sign >= 0 else (b, a)
        return big if "Max" in type(e).__name__ else small
    try:
        return expr.replace(lambda e: type(e).__name__ in ("Max", "Min"), pick)
    except ValueError:
        return None


def _sign(expr: Any, shape_env: Any) -> int | None:
    """1 where ``expr >= 0``, -1 where ``expr <= 0`` wherever this graph runs, else None: first
    from the symbols' ranges (``bound_sympy``), then from dynamo's guards taken as axioms (a
    relation between two symbols, ``s < L``, which no range shows)."""
    import sympy
    try:
        r = shape_env.bound_sympy(expr)
        if r.lower >= 0:
            return 1
        if r.upper <= 0:
            return -1
    except Exception:   # noqa: BLE001 - an expression sympy cannot bound: try the guards
        pass
    try:   # torch's ShapeEnv: the guards recorded so far as axioms, no new guard added
        axioms = shape_env.get_axioms()
        same = _equal_symbols(axioms)   # Eq(s36, s27): one symbol for both
        expr, axioms = expr.xreplace(same), tuple(a.xreplace(same) for a in axioms)
        for want, sign in ((sympy.Ge(expr, 0), 1), (sympy.Le(expr, 0), -1)):
            if shape_env._maybe_evaluate_static(want, axioms=axioms) == sympy.true:
                return sign
    except Exception:   # noqa: BLE001 - a ShapeEnv without these (another torch): undecided
        pass
    return None


def _equal_symbols(axioms: tuple) -> dict:
    """A substitution that makes the symbols that ``Eq(a, b)`` axioms (dynamo's guards: two cache
    lengths equal) relate one symbol each, the least by name."""
    parent: dict = {}

    def find(x):
        while x in parent:
            x = parent[x]
        return x
    for a in axioms:
        if type(a).__name__ == "Equality" and all(getattr(x, "is_Symbol", False) for x in a.args):
            x, y = sorted((find(a.args[0]), find(a.args[1])), key=str)
            if x != y:
                parent[y] = x
    return {s: find(s) for s in parent}


def _count_on_device(tg: torch.fx.Graph, last: torch.fx.Node, t_out: torch.fx.Node, derived: list[torch.fx.Node],
                     counted: list[tuple[int, int]], buffers: list[torch.Tensor],
                     by_name: dict[str, torch.fx.Node]) -> tuple[list[torch.Tensor], list[int]]:
    """In the tensor graph ``tg``: one counter placeholder per host integer (after ``last``),
    each derived value ``counter + c``, and ``counter.add_(1)`` before the output ``t_out``.
    Returns the counters' example tensors and their host integers' positions."""
    counters: list[int] = []
    phs: dict[int, torch.fx.Node] = {}
    bufs: list[torch.Tensor] = []
    for (i, _), buf in zip(counted, buffers):
        if i not in phs:
            with tg.inserting_after(last):
                phs[i] = last = tg.placeholder(f"host_counter_{len(counters)}")
            last.meta["example_value"] = buf
            counters.append(i)
            bufs.append(buf)
    for n, (i, c) in zip(derived, counted):
        with tg.inserting_after(last):
            val = phs[i] if c == 0 else tg.call_function(operator.add, (phs[i], c))
        if c:
            last = val
        by_name[n.name].replace_all_uses_with(val)
    for ph in phs.values():
        with tg.inserting_before(t_out):
            tg.call_function(torch.Tensor.add_, (ph, 1))
    return bufs, counters


def _pinned(n: torch.fx.Node) -> int | None:
    """The one value a host integer can take in this graph, or None: dynamo's guards bound its
    symbols and relate them (the graph runs only where they hold), and some expressions have one
    value under them. HF's sliding-window layer before its window is full: dynamo guards
    ``cumulative_length_int < L`` (its ``is_full`` branch; ``L`` the layer's rows, the window or
    a shorter cache, a symbol under a second cache length), so the mask's ``kv_offset =
    max(cumulative_length_int - L + 1, 0)`` is 0 in that graph, and a mask over positions alone
    is what ``recognize`` can prove causal."""
    v = _example(n)
    if not isinstance(v, torch.SymInt):
        return None
    shape_env = v.node.shape_env
    try:
        r = shape_env.bound_sympy(v.node.expr)
        if r.is_singleton() and r.lower.is_integer:
            return int(r.lower)
    except Exception:   # noqa: BLE001 - an expression sympy cannot bound: try without its Max
        pass
    e = _without_max(v.node.expr, shape_env)
    return int(e) if e is not None and e.is_Integer else None


def _size_symbols(nodes: list[torch.fx.Node]) -> set[Any]:
    """The symbols of the tensor placeholders' symbolic sizes (a cache length dynamo made
    symbolic: ``s53`` of ``f32[1, 2, s53, 16]``)."""
    out: set[Any] = set()
    for n in nodes:
        v = n.meta.get("example_value") if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor):
            for d in v.shape:
                if isinstance(d, torch.SymInt):
                    out |= d.node.expr.free_symbols
    return out


def _is_size(n: torch.fx.Node, sizes: set[Any]) -> bool:
    """Whether the scalar placeholder ``n`` stays in the tensor graph: a tensor input's symbolic
    size (the ``Sym(s53)`` dynamo passes with a symbolic cache length), or an integer dynamo
    specialized (HF generate()'s ``logits_to_keep`` under ``dynamic=True``: a constant its guards
    keep). Not a host scalar."""
    v = _example(n)
    if (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, torch.SymInt)
                                                            and v.node.maybe_as_int() is not None):
        return True
    return isinstance(v, torch.SymInt) and bool(v.node.expr.free_symbols) and v.node.expr.free_symbols <= sizes


def _symbolic_kv_inputs(placeholders: list[torch.fx.Node]) -> list[int]:
    """The placeholders (indices) of the 4-D floating inputs whose dim 2 (the KV-cache length)
    is symbolic: the bound of a call's host positions is read from their sizes at the call."""
    out = []
    for i, n in enumerate(placeholders):
        v = n.meta.get("example_value")
        if isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point() and isinstance(v.shape[2], torch.SymInt):
            out.append(i)
    return out


def _kv_length(placeholders: list[torch.fx.Node]) -> int | None:
    """The KV-cache length (dim 2 of the 4-D floating inputs, as ``fusec.ir.position``), or None."""
    lengths = [v.shape[2] for v in (n.meta.get("example_value") for n in placeholders)
               if isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point()
               and isinstance(v.shape[2], int)]
    return max(lengths) if lengths else None


#: tensor arithmetic whose scalar operand may as well be a 0-dim tensor (same values and dtype:
#: a 0-dim tensor takes part in type promotion as a Python scalar does)
_ARITH = {operator.add, operator.sub, operator.mul, torch.add, torch.sub, torch.mul}


def _value_operand_buffer(n: torch.fx.Node, host: set[str]) -> torch.Tensor | None:
    """A 0-dim int64 tensor to carry host value ``n`` into the tensor graph when every tensor op
    that reads it only adds, subtracts or multiplies it (a position ``arange + past_seen``), on
    those ops' device; None otherwise (a size, a comparison, a float: the graph is not split)."""
    if not isinstance(_example(n), (torch.SymInt, int)):
        return None
    device = None
    for u in n.users:
        if u.op == "output" or u.name in host:
            continue
        val = u.meta.get("example_value")
        if u.op != "call_function" or u.target not in _ARITH or not isinstance(val, torch.Tensor) \
                or n in u.kwargs.values() or val.dtype != torch.int64:
            return None
        device = val.device
    return None if device is None else torch.zeros((), dtype=torch.int64, device=device)
