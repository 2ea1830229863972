"""fold_position: replace tensors that depend only on the decode position by table lookups.

Expects: a recognized graph and the values of the weights it reads. Guarantees: every
tensor that is computed from exactly one position counter (plus weights and constants)
and is read by something that depends on more than that counter becomes
``table_lookup(table, counter)``, where ``table[p]`` is the tensor's value at position
``p`` for every ``p`` in ``[0, L)`` (L = KV-cache length, or option ``position_rows`` when
larger: positions the host computes; fewer where a table of the model's ends before, GPT-J's
``embed_positions``: a later position faults at run time, as eager's index does), evaluated with
the graph's own ops. A table equal to the position itself becomes an alias of the counter. RoPE cos/sin
(from ``inv_freq``, with any scaling) become two small tables; the position-only ops
disappear from the step. Tables larger than ``position.MAX_TABLE_BYTES`` are left alone.
"""
from __future__ import annotations

import logging

import torch

from fusec.ir import position
from fusec.errors import FallbackRequired
from fusec.ir import Graph, Op, Role, TensorInfo

from fusec.passes import dce

log = logging.getLogger("fusec.passes.fold_position")


def _valid_positions(g: Graph, ts: list[str], c: str, length: int, weights: dict[str, torch.Tensor]) -> int:
    """The count P <= ``length`` of positions ``[0, P)`` at which the ops computing ``ts`` from
    the counter ``c`` run: an index into a table of the model's fails past its rows (GPT-J's
    ``embed_positions``: 2048 in its published configuration, while the length-polymorphic step
    of generate() has 32768 rows; eager fails there too). Every position is valid where the last
    one is; else a bisection (such indices fail from some position on). The tables then have P
    rows: the step runs for any cache length, and a position past them faults at run time."""
    def ok(p: int) -> bool:
        try:
            position.evaluate_many(g, ts, c, [p], weights)
        except (IndexError, RuntimeError):
            return False
        return True
    if ok(length - 1):
        return length
    if not ok(0):
        return 0
    lo, hi = 0, length - 1   # ok(lo), not ok(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return hi


def _signature(g: Graph, targets: list[str], counter: str, weights: dict[str, torch.Tensor]) -> tuple:
    """What the tables of ``targets`` depend on, with the counter's name left out: the ops that
    compute them (kinds, literal arguments, shapes, dtypes), their inputs numbered by first use,
    and the values of the weights and constants they read. Two counters with equal signatures
    get equal tables."""
    need: set[str] = set()
    for t in targets:
        need |= {o.name for o in position.subgraph_ops(g, t)}
    ids: dict[str, str] = {g.root(counter): "C"}

    def ident(t: str) -> object:
        r = g.root(t)
        if r not in ids:
            info = g.tensors[r]
            if info.role in (Role.CONSTANT, Role.WEIGHT):
                v = info.value if info.value is not None else weights.get(r)
                ids[r] = ("value", info.dtype, tuple(info.shape),
                          hash(v.numpy().tobytes()) if v is not None and v.dtype != torch.bfloat16 else r)
            else:
                ids[r] = f"t{len(ids)}"
        return (ids[r], tuple(g.tensors[t].shape), g.tensors[t].dtype)

    sig = []
    for o in g.ops:
        if o.name in need:
            lits = {k: v for k, v in o.attrs.items() if k not in ("target",)}
            sig.append((o.kind, repr(lits.get("args")), repr(lits.get("kwargs")),
                        tuple(ident(x) for x in o.reads()), tuple(ident(x) for x in o.fresh_outputs())))
    sig.append(tuple(ident(t) for t in targets))
    return tuple(sig)


def run(g: Graph, weights: dict[str, torch.Tensor] | None = None, rows: int | None = None) -> Graph:
    """``rows``: positions the tables cover at least (option ``position_rows``: positions the
    host computes, which may pass every cache's rows), else the caches' rows."""
    ctrs = position.counters(g)
    length = position.cache_length(g)
    if not ctrs or length is None:
        return g
    length = max(length, rows or 0)
    dep = position.dependence(g)
    prods = g.producers()
    # frontier: position-only tensors read by ops (or outputs) that are not position-only
    frontier: dict[str, str] = {}
    for o in g.ops:
        o_only = all(position.only_counter(dep, g, t, ctrs) for t in o.reads()) and not o.mutates \
            and not o.kind.startswith("fusec.")
        for t in o.reads():
            r = g.root(t)
            c = position.only_counter(dep, g, t, ctrs)
            if c is not None and r in prods and not o_only:
                frontier[r] = c
    for t in g.outputs:
        c = position.only_counter(dep, g, t, ctrs)
        if c is not None and g.root(t) in prods:
            frontier[g.root(t)] = c
    tables = 0
    values = {}
    by_counter: dict[str, list[str]] = {}
    for t, c in frontier.items():
        if g.tensors[t].nbytes * length > position.MAX_TABLE_BYTES:
            log.info("position-dependent tensor %s not tabulated (%d bytes per position)", t,
                     g.tensors[t].nbytes)
            continue
        by_counter.setdefault(c, []).append(t)
    limit = min([length] + [_valid_positions(g, ts, c, length, weights or {}) for c, ts in by_counter.items()])
    if not limit:
        raise FallbackRequired("the position-dependent tensors " + ", ".join(sorted(t for ts in by_counter.values() for t in ts))
                               + " cannot be computed at position 0")
    if limit < length:   # a table of the model's (GPT-J's embed_positions) has fewer rows: so do the
        #                  tables, and a later position faults (table_lookup's index check), as
        #                  eager's index does; the cache may be longer (fusec.generate rounds it up)
        log.info("position-dependent tensors are defined for positions below %d only (a later one faults, "
                 "as in eager)", limit)
        length = limit
    done: dict[tuple, list[torch.Tensor]] = {}   # subgraph signature -> its tables
    for c, ts in by_counter.items():
        sig = _signature(g, ts, c, weights or {})
        if sig not in done:   # every layer's counter drives the same subgraph: evaluate it once
            vals = position.evaluate_many(g, ts, c, range(length), weights or {})
            done[sig] = [vals[t].reshape(length, *g.tensors[t].shape).contiguous() for t in ts]
        for t, table in zip(ts, done[sig]):
            values[t] = table
    for t, table in values.items():
        c, info = frontier[t], g.tensors[t]
        owner = prods[t]
        owner.kind = "__folded__"
        if info.numel == 1 and not info.dtype.is_floating_point and info.dtype == g.tensors[c].dtype \
                and torch.equal(table.reshape(-1), torch.arange(length, dtype=info.dtype)):
            info.alias_of = c
            continue
        name = g.fresh_name(f"table_{t}")
        g.add_tensor(TensorInfo(name, tuple(table.shape), table.dtype, Role.CONSTANT, value=table))
        owner_idx = g.ops.index(owner)
        g.ops[owner_idx] = Op(owner.name, "table_lookup", {"table": name, "pos": c}, {"out": t},
                              source=owner.source)
        tables += 1
    g.ops = [o for o in g.ops if o.kind != "__folded__"]
    log.debug("folded %d position tables", tables)
    return dce.run(g)
