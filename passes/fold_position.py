"""fold_position: replace tensors that depend only on the decode position by table lookups.

Expects: a recognized graph and the values of the weights it reads. Guarantees: every
tensor that is computed from exactly one position counter (plus weights and constants)
and is read by something that depends on more than that counter becomes
``table_lookup(table, counter)``, where ``table[p]`` is the tensor's value at position
``p`` for every ``p`` in ``[0, L)`` (L = KV-cache length), evaluated with the graph's own
ops. A table equal to the position itself becomes an alias of the counter. RoPE cos/sin
(from ``inv_freq``, with any scaling) become two small tables; the position-only ops
disappear from the step. Tables larger than ``position.MAX_TABLE_BYTES`` are left alone.
"""
from __future__ import annotations

import logging

import torch

from fusec import position
from fusec.ir import Graph, Op, Role, TensorInfo

from . import dce

log = logging.getLogger("fusec.passes.fold_position")


def run(g: Graph, weights: dict[str, torch.Tensor] | None = None) -> Graph:
    ctrs = position.counters(g)
    length = position.cache_length(g)
    if not ctrs or length is None:
        return g
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
    for c, ts in by_counter.items():
        vals = position.evaluate_many(g, ts, c, range(length), weights or {})
        for t in ts:
            values[t] = torch.stack([v.reshape(g.tensors[t].shape) for v in vals[t]]).contiguous()
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
