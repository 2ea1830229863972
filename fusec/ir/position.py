"""The decode position: which graph inputs are position counters, and evaluation of tensors
that depend only on one counter (RoPE tables, causal masks, KV-cache write indices).

A *position counter* is a 0-d/1-element integer STATE input (HF StaticCache keeps one per
layer as ``cumulative_length``) or a 1-element integer graph INPUT that is not a token id
(``position_ids`` and ``cache_position``, which HF generate() passes to every decode step).
Its values lie in ``[0, L)`` with ``L`` the KV-cache length: a static cache of ``L`` rows has no
position beyond it, and a run-time value outside is an index fault, never a wrong result.
"""
from __future__ import annotations

import logging

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Role

log = logging.getLogger("fusec.ir.position")

MAX_TABLE_BYTES = 64 << 20
MAX_KNOWN_WEIGHT = 1 << 16  # weights up to this many elements may feed position tables


_ID_READERS = ("aten.embedding.default", "aten.index_select.default", "aten.index.Tensor",
               "aten._unsafe_index.Tensor", "embedding")


def token_inputs(g: Graph) -> set[str]:
    """Graph inputs that row indices of a table are computed from (token ids: what reaches
    ``aten.embedding``'s indices, directly or through ops such as ``ids.long()``)."""
    prods = g.producers()
    ids: set[str] = set()
    seen: set[str] = set()
    stack = [g.root(t) for op in g.ops if op.kind in _ID_READERS
             for slot, t in op.inputs.items() if slot not in ("in0", "table")]
    while stack:
        r = stack.pop()
        if r in seen:
            continue
        seen.add(r)
        if r in g.inputs:
            ids.add(r)
        p = prods.get(r)
        if p is not None:
            stack.extend(g.root(x) for x in p.reads())
    return ids


def counters(g: Graph) -> list[str]:
    """Names of position counters: integer STATE inputs with one element, and integer INPUTs
    with one element that are not token ids (``position_ids``, ``cache_position``)."""
    ids = token_inputs(g)
    return [n for n in g.inputs if g.tensors[n].role in (Role.STATE, Role.INPUT) and n not in ids
            and not g.tensors[n].dtype.is_floating_point and g.tensors[n].dtype != torch.bool
            and g.tensors[n].numel == 1]


def cache_length(g: Graph) -> int | None:
    """KV-cache length L (dim 2 of the KV-cache inputs), or None without a cache."""
    ls = {g.tensors[n].shape[2] for n in g.inputs if g.tensors[n].role == Role.KV_CACHE}
    return max(ls) if ls else None


#: views that may take the cache length as a size in a mask's subgraph (their elements' values
#: do not depend on it)
_VIEWS = ("aten.expand.", "aten.view.", "aten._unsafe_view.", "aten.reshape.")


def sizes_only(op) -> bool:
    """Whether an op that took a size computed from the cache length (``attrs["symbolic"]``)
    uses it only as a size, so that a mask proven causal at the capacity is causal at every
    length: a view or expand, or ``arange`` from 0 in steps of 1 (the length its end: each
    element is its index). Anything else (a slice from ``L - k``, a comparison with ``L``, an
    arithmetic ``L % 2``) is a value of the length."""
    if op.kind.startswith(_VIEWS):
        return True
    if op.kind.startswith("aten.arange."):
        args = list(op.attrs.get("args", ()))
        start = args[0] if op.kind.startswith("aten.arange.start") and args else 0
        step = args[2] if op.kind == "aten.arange.start_step" and len(args) > 2 else 1
        return start == 0 and step == 1
    return False


def dependence(g: Graph) -> dict[str, set[str]]:
    """Root tensor -> the set of graph inputs (non-weight) and ``'?'`` it depends on.

    Small weights (``inv_freq``) and constants count as known values; anything produced
    from a non-counter input (tokens, caches) is marked by that input's name.
    """
    dep: dict[str, set[str]] = {}
    for n in g.inputs:
        t = g.tensors[n]
        small_weight = t.role == Role.WEIGHT and t.numel <= MAX_KNOWN_WEIGHT
        dep[n] = set() if small_weight else {n}
    for t in g.tensors.values():
        if t.role == Role.CONSTANT and t.alias_of is None:
            dep[t.name] = set()
    for op in g.ops:
        d: set[str] = set()
        for x in op.reads():
            d |= dep.get(g.root(x), {"?"})
        if op.kind.startswith("fusec.") or op.mutates:
            d = d | {"?"}
        for t in op.fresh_outputs():
            dep[g.root(t)] = d
    return dep


def subgraph_ops(g: Graph, target: str):
    """Ops needed to compute ``target`` (transitively), in program order."""
    prods = g.producers()
    need, stack = set(), [g.root(target)]
    while stack:
        t = stack.pop()
        op = prods.get(t)
        if op is None or op.name in need:
            continue
        need.add(op.name)
        stack.extend(g.root(x) for x in op.reads())
    return [op for op in g.ops if op.name in need]


def evaluate(g: Graph, target: str, counter: str, positions: range, weights: dict[str, torch.Tensor]):
    """Values of ``target`` for each counter value in ``positions`` (a list of tensors).

    Args:
        weights: values of the WEIGHT inputs the subgraph reads (name -> tensor).
    """
    return list(evaluate_many(g, [target], counter, positions, weights)[target].unbind(0))


def evaluate_many(g: Graph, targets: list[str], counter: str, positions: range,
                  weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Like :func:`evaluate` for several targets that depend on the same counter, sharing work:
    each target's values stacked, ``[len(positions), *value shape]``.

    The subgraph runs once over every position at once (``torch.func.vmap`` over the counter's
    value: a RoPE table of 4096 positions is ~20 batched ops instead of ~80,000 small ones); the
    batched values are checked against op-by-op evaluation at seven positions (the ends, the
    quarters, the middle): integers and bools equal, floats within 4 units in the last place.
    Floats are not compared bit for bit because PyTorch's CPU kernels compute a row's tail with a
    scalar function that may differ from the vectorized one by 1 ulp (``sigmoid``, ``pow``): a
    batched row and a one-position row round some elements differently, as the model's own
    device (a GPU) does anyway. Where vmap cannot run the subgraph (an op without a batching rule
    that writes in place, a value read on the host) or a checked position differs more, it runs
    op by op, position by position, with one debug line.
    """
    from fusec.ir.semantics import run_op
    need: set[str] = set()
    for t in targets:
        need |= {o.name for o in subgraph_ops(g, t)}
    ops = [op for op in g.ops if op.name in need]
    info = g.tensors[counter]
    # one Env (its constructor walks every tensor of the graph), fresh outputs per position:
    # each position starts from the constants and weights only, as a new Env would
    env = Env(g, [], device=torch.device("cpu"))
    # only the weights these ops read: the values read are what a compiled artifact depends on
    # (fusec.pipeline.ValueReads)
    reads = {g.root(x) for op in ops for x in op.reads()}
    env.bufs.update({n: weights[n].cpu() for n in sorted(reads) if n in weights})   # small: inv_freq, masks
    base = dict(env.bufs)

    def at(value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env.bufs = dict(base)
        env.bufs[counter] = value
        for op in ops:
            run_op(op, env)
        return tuple(env.read(t).clone() for t in targets)

    def one(p: int) -> tuple[torch.Tensor, ...]:
        return at(torch.full(info.shape, p, dtype=info.dtype))

    per_position = sum(g.tensors[t].nbytes for t in targets)
    batched = _vmapped(at, info, positions, one, per_position) if len(positions) > 3 else None
    if batched is not None:
        return {t: b for t, b in zip(targets, batched)}
    out: dict[str, list[torch.Tensor]] = {t: [] for t in targets}
    for p in positions:
        for t, v in zip(targets, one(p)):
            out[t].append(v)
    return {t: torch.stack(v) for t, v in out.items()}


#: bytes of targets per ``vmap`` chunk: bounds the batched intermediates (a causal mask over a
#: 32k cache is 32k elements per position; all positions at once would be 10^9 per tensor)
VMAP_CHUNK_BYTES = 16 << 20


def _vmapped(at, info, positions: range, one, per_position: int) -> tuple[torch.Tensor, ...] | None:
    """``at`` over every position in ``vmap`` calls of :data:`VMAP_CHUNK_BYTES` of targets each,
    or None (see :func:`evaluate_many`)."""
    import warnings
    values = torch.tensor(list(positions), dtype=info.dtype)
    values = values.reshape(-1, *([1] * len(info.shape))).expand(len(values), *info.shape).contiguous()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "no batching rule for ...": a slower path, same values
            batched = torch.func.vmap(at, chunk_size=max(1, VMAP_CHUNK_BYTES // max(1, per_position)))(values)
    except Exception as e:   # noqa: BLE001 - any failure: evaluate position by position
        log.debug("position subgraph not vmapped (%s: %s); evaluating position by position",
                  type(e).__name__, str(e)[:200])
        return None
    n = len(positions)
    for i in sorted({0, 1, n // 4, n // 2, 3 * n // 4, n - 2, n - 1}):
        for b, v in zip(batched, one(positions[i])):
            if not _close(b[i], v):
                log.debug("vmapped position subgraph differs at position %d; evaluating position by "
                          "position", positions[i])
                return None
    return batched


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dtype; integers and bools equal; floats within 4 ulps (infinities equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    eps = torch.finfo(a.dtype).eps
    return torch.allclose(a.double(), b.double(), rtol=4 * eps, atol=4 * eps, equal_nan=True)


def only_counter(dep: dict[str, set[str]], g: Graph, t: str, ctrs: list[str]) -> str | None:
    """The single counter that ``t`` depends on, if it depends on nothing else variable."""
    d = dep.get(g.root(t))
    if d is None or len(d) != 1:
        return None
    (c,) = tuple(d)
    return c if c in ctrs else None
