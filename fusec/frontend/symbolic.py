"""Symbolic capture: one compiled step for every KV-cache length.

Dynamo makes the cache length symbolic when it sees a second length (its automatic dynamic
shapes), from the first call with ``dynamic=True``, or where the caller marks it
(``torch._dynamo.mark_dynamic``, as :func:`fusec.generate` does). Such a graph's placeholders
carry fake tensors with symbolic sizes (``s38``) and integer placeholders (``Sym(s38)``).

:func:`symbolic_dims` reads which sizes are symbolic; :func:`fake_inputs` makes fake tensors of
a call's inputs with those sizes symbolic again (one ``ShapeEnv``; sizes share a symbol where
dynamo's graph gives them one, :func:`symbol_names`; duck sizing where its names are lost), and AOT autograd traces the graph over them
(:func:`fusec.frontend.capture.aten_capture`): the ATen graph keeps the length as a symbol.
``fusec.frontend.from_fx.graph_from_aten`` then builds the IR at the length's *capacity*
(:func:`capacity`): every size and every integer argument that depends on the length is
evaluated with the length set to the capacity, and the KV caches' rows (and a mask over them)
are marked ``TensorInfo.sym``. The pass ``check_lengths`` verifies that nothing else of the
step depends on the length; the kernel and the simulator read the rows of each call's caches at
run time (docs/pipeline.md, "symbolic capture"; docs/generated-cuda.md, "Run-time lengths").
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from fusec.config import DEFAULT_MAX_CACHE_LEN, MAX_CACHE_LEN
from fusec.errors import FallbackRequired

log = logging.getLogger("fusec")

#: a placeholder's symbolic sizes: ``"int"`` (an integer placeholder), or the dims of a tensor
SymSpec = str | tuple[int, ...] | None


def _symbolic(d: Any) -> bool:
    """Whether a size is symbolic after dynamo's tracing (a symbol it did not specialize)."""
    return isinstance(d, torch.SymInt) and d.node.maybe_as_int() is None


def symbolic_dims(gm: torch.fx.GraphModule) -> list[SymSpec]:
    """Per placeholder of dynamo's graph: None (static), ``"int"`` (a symbolic integer input) or
    the tuple of a tensor's symbolic dims, read from the placeholders' ``example_value``."""
    out: list[SymSpec] = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if SYMBOLIC_META in n.meta:   # recorded by mark_symbolic (a serialized graph)
            out.append(n.meta[SYMBOLIC_META])
            continue
        v = n.meta.get("example_value")
        if isinstance(v, torch.SymInt):
            out.append("int" if _symbolic(v) else None)
        elif isinstance(v, torch.Tensor):
            dims = tuple(i for i, d in enumerate(v.shape) if _symbolic(d))
            out.append(dims or None)
        else:
            out.append(None)
    return out


#: key of a placeholder's ``meta``: :func:`symbolic_dims`'s answer, kept where dynamo's fake
#: values are dropped (a graph serialized by ``fusec.frontend.precompiled``)
SYMBOLIC_META = "fusec_symbolic"


#: key of a placeholder's ``meta``: the name of dynamo's symbol at each symbolic size
#: (:func:`symbol_names`), so that :func:`fake_inputs` gives sizes one symbol exactly where
#: dynamo's graph does (not where two lengths happen to be equal at the call)
SYMBOL_NAMES_META = "fusec_symbol_names"


def _name(d: Any) -> str:
    """The name of a symbolic size: its expression with dynamo's known equalities applied."""
    return str(d.node.shape_env.replace(d.node.expr))


def symbol_names(gm: torch.fx.GraphModule) -> list[Any] | None:
    """Per placeholder, the names of its symbolic sizes (``{dim: name}`` of a tensor, the name
    of a symbolic integer, None for a static one), read from dynamo's ``example_value`` or
    recorded by :func:`mark_symbolic`; None when a placeholder with symbolic sizes has neither
    (a serialized graph)."""
    out: list[Any] = []
    for n, spec in zip([n for n in gm.graph.nodes if n.op == "placeholder"], symbolic_dims(gm)):
        if spec is None:
            out.append(None)
        elif SYMBOL_NAMES_META in n.meta:
            out.append(n.meta[SYMBOL_NAMES_META])
        else:
            v = n.meta.get("example_value")
            if spec == "int" and isinstance(v, torch.SymInt):
                out.append(_name(v))
            elif isinstance(spec, tuple) and isinstance(v, torch.Tensor) \
                    and all(isinstance(v.shape[i], torch.SymInt) for i in spec):
                out.append({i: _name(v.shape[i]) for i in spec})
            else:
                return None
    return out


def mark_symbolic(gm: torch.fx.GraphModule) -> None:
    """Record :func:`symbolic_dims` on the placeholders (``meta[SYMBOLIC_META]``), and the names
    of dynamo's symbols where it has them (``meta[SYMBOL_NAMES_META]``)."""
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = symbol_names(gm)
    for i, (n, spec) in enumerate(zip(nodes, symbolic_dims(gm))):
        n.meta[SYMBOLIC_META] = spec
        if names is not None and names[i] is not None:
            n.meta[SYMBOL_NAMES_META] = names[i]


def replace_input(g: torch.fx.Graph, node: torch.fx.Node, value: int) -> None:
    """Replace the integer placeholder ``node`` of ``g`` by ``value`` in every use, and erase it."""
    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, lambda x: value if x is node else x)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda x: value if x is node else x)
    g.erase_node(node)


def fix_symbols(gm: torch.fx.GraphModule, args: list[Any], values: dict[Any, int]) -> tuple[torch.fx.GraphModule, list[int]]:
    """``(module, keep)``: ``gm`` with the sizes that depend on the symbols of ``values`` (dynamo's
    symbol -> this call's value; a batch size that varies) made concrete and its other symbolic
    sizes (a cache length) left symbolic, recorded as :func:`mark_symbolic` records them
    (``SYMBOLIC_META``, ``SYMBOL_NAMES_META``); an integer input that is such a size is replaced
    by its value in ``args`` and dropped, as is one dynamo specialized (a plain value in the
    graph): ``keep`` lists the indices of ``args`` the module takes."""
    import copy
    fixed = set(values)
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    specs, names = symbolic_dims(gm), symbol_names(gm)
    g = copy.deepcopy(gm.graph)
    copies = [n for n in g.nodes if n.op == "placeholder"]

    def depends(d: Any) -> bool:
        return _symbolic(d) and bool(d.node.expr.free_symbols & fixed)

    drop = []
    for i, (n, c, spec, a) in enumerate(zip(nodes, copies, specs, args)):
        v = n.meta.get("example_value")
        if isinstance(a, int) and not isinstance(a, bool) and (spec != "int" or depends(v)):
            drop.append(i)   # an integer input of a fixed value (dynamo specialized it), or a batch size
            continue
        if isinstance(spec, tuple) and isinstance(v, torch.Tensor):
            spec = tuple(d for d in spec if not depends(v.shape[d])) or None
        c.meta[SYMBOLIC_META] = spec
        if spec is not None and names is not None and names[i] is not None:
            c.meta[SYMBOL_NAMES_META] = ({d: names[i][d] for d in spec} if isinstance(spec, tuple) else names[i])
        else:
            c.meta.pop(SYMBOL_NAMES_META, None)
    for i in drop:
        replace_input(g, copies[i], int(args[i]))
    return torch.fx.GraphModule(gm, g), [i for i in range(len(args)) if i not in set(drop)]


def is_symbolic(gm: torch.fx.GraphModule) -> bool:
    """Whether any input of dynamo's graph has a symbolic size."""
    return any(s is not None for s in symbolic_dims(gm))


def fake_inputs(gm: torch.fx.GraphModule, args: list[Any]) -> tuple[Any, list[Any]]:
    """``(fake_mode, fakes)``: fake versions of a call's inputs ``args`` with the sizes that are
    symbolic in ``gm`` symbolic again: sizes share one symbol where they share one in dynamo's
    graph (:func:`symbol_names`); without dynamo's names (a serialized graph), duck sizing: equal
    values share one symbol. Two lengths that dynamo keeps apart (two caches of different
    lengths) stay apart even at a call where they are equal."""
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    sym_names = symbol_names(gm)
    kind = DimDynamic.DUCK if sym_names is None else DimDynamic.DYNAMIC
    fakes: list[Any] = []
    groups: dict[str, list[Any]] = {}   # dynamo's symbol -> the sizes made for it
    for k, (name, spec, a) in enumerate(zip(names, symbolic_dims(gm), args)):
        src = LocalSource(name)
        if isinstance(a, torch.Tensor):
            dims = spec if isinstance(spec, tuple) else ()
            ctx = StatelessSymbolicContext(dynamic_sizes=[kind if i in dims else DimDynamic.STATIC
                                                          for i in range(a.dim())])
            fake = mode.from_tensor(a, symbolic_context=ctx, source=src)
            fakes.append(fake)
            if sym_names is not None and sym_names[k] is not None:
                for i, sym in sym_names[k].items():
                    groups.setdefault(sym, []).append(fake.shape[int(i)])
        elif spec == "int" and isinstance(a, int) and not isinstance(a, bool):
            sym = shape_env.create_symbol(a, src, dynamic_dim=kind)
            fakes.append(shape_env.create_symintnode(sym, hint=a, source=src))
            if sym_names is not None and sym_names[k] is not None:
                groups.setdefault(sym_names[k], []).append(fakes[-1])
        else:
            fakes.append(a)
    for sizes in groups.values():   # one symbol for the sizes dynamo's graph gives one
        for d in sizes[1:]:
            if isinstance(d, torch.SymInt) or isinstance(sizes[0], torch.SymInt):
                torch._check(d == sizes[0])
    return mode, fakes


def doubled(rows: int) -> int:
    """The rows a step is built again for when a cache of ``rows`` is longer than its capacity:
    twice as many (``2 * rows - 1``, which :func:`capacity` rounds up to a power of two), at
    most :data:`~fusec.config.MAX_CACHE_LEN` unless ``rows`` is above it already."""
    return min(2 * rows - 1, max(rows, MAX_CACHE_LEN))


def capacity(max_cache_len: int | None, rows: int) -> int:
    """The cache length a length-polymorphic step is built for: ``max_cache_len`` when set (at
    least ``rows``), else the larger of :data:`~fusec.config.DEFAULT_MAX_CACHE_LEN` and ``rows``
    rounded up to a power of two.

    Raises:
        FallbackRequired: ``rows`` above :data:`~fusec.config.MAX_CACHE_LEN`."""
    if rows > MAX_CACHE_LEN:
        raise FallbackRequired(f"a KV cache of {rows} rows is longer than fusec's longest, {MAX_CACHE_LEN} "
                               "(fusec.config.MAX_CACHE_LEN: the position tables and the causal-mask proof grow "
                               "with it); use a shorter cache")
    if max_cache_len is not None and max_cache_len >= rows:
        return int(max_cache_len)
    return max(DEFAULT_MAX_CACHE_LEN, 1 << max(0, int(rows) - 1).bit_length())
