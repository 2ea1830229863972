"""The schedule: per-SM instruction queues with dependency counters (plain, JSON-ready).

Every op owns one counter, which each of its instructions (tiles placed on SMs) increments
once per step after its stores. An instruction lists the instructions it waits for (all tiles
of each producer op on other SMs); the kernel waits on their ops' counters instead
(:meth:`Schedule.counter_waits`): in step ``e`` (1-based epoch) until the counter of an op
with ``n`` tiles is at least ``n * e``, so counters never need a reset between steps. Queues
are in program order, which is a linear extension of the DAG, and every tile of a producer op
comes before every tile of its consumers in each queue.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch

from fusec.instructions.base import Tile
from fusec.ir import Graph


class TileIndex:
    """Where each op's tiles went: ``op_tiles[op]`` its instruction ids, ``sm_of[id]`` their SMs
    (shared by a schedule's instructions to expand their producer ops into tile waits)."""

    def __init__(self, op_tiles: dict[str, list[int]], sm_of: list[int]):
        self.op_tiles, self.sm_of = op_tiles, sm_of


@dataclasses.dataclass
class Instr:
    """One tile on one SM.

    ``wait_ops``: the producer ops it waits for, in program order (those with a tile on another
    SM); the kernel waits on their counters. ``waits``: the ids of those producer tiles on other
    SMs, which the simulator and the hazard check follow; made from ``wait_ops`` when first read
    (a 1B schedule has ~2 M of them: the kernel and the artifact cache never need them), or set.
    """

    id: int
    op: str
    kind: str
    tile: Tile
    sm: int
    layer: int
    wait_ops: list[str] = dataclasses.field(default_factory=list)
    index: TileIndex | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``waits`` once made (a cache) or as set by hand
    tile_waits: list[int] | None = dataclasses.field(default=None, repr=False)
    #: ``waits`` was set by hand (the simulator's fault-injection tests): it need not match ``wait_ops``
    edited: bool = dataclasses.field(default=False, repr=False)

    @property
    def waits(self) -> list[int]:
        if self.tile_waits is None:
            x = self.index
            self.tile_waits = [] if x is None else \
                [p for o in self.wait_ops for p in x.op_tiles[o] if x.sm_of[p] != self.sm]
        return self.tile_waits

    @waits.setter
    def waits(self, ids: list[int]) -> None:
        self.tile_waits, self.edited = list(ids), True

    def describe(self) -> str:
        return f"#{self.id} {self.kind} {self.tile.key} on SM {self.sm}"


@dataclasses.dataclass
class Schedule:
    """Instructions in program order, their SM queues, and the graph they run."""

    num_sms: int
    instrs: list[Instr]
    queues: list[list[int]]
    graph: Graph
    #: input name -> digest (``artifacts.tensor_digest``) of each small weight whose value the
    #: passes compiled in (``inv_freq``, Gemma's ``1 + w``), as lowered; set by ``artifacts.compile_graph``
    compiled_in: dict[str, str] = dataclasses.field(default_factory=dict)

    def counter_waits(self) -> list[list[tuple[int, int]]]:
        """The kernel's waits per instruction id: (op index = counter id, tiles of that op) per
        producer op, in op order.

        Raises:
            ValueError: an instruction's ``waits`` list part of an op's tiles on other SMs
                (one counter per op cannot express it).
        """
        index = {o.name: k for k, o in enumerate(self.graph.ops)}
        tiles: dict[str, list[Instr]] = {}
        for i in self.instrs:
            tiles.setdefault(i.op, []).append(i)
        out = []
        for ins in self.instrs:
            if not ins.edited:   # as scheduled: every tile of each producer op
                out.append([(index[o], len(tiles[o])) for o in ins.wait_ops])
                continue
            by_op: dict[str, set[int]] = {}
            for w in ins.waits:
                by_op.setdefault(self.instrs[w].op, set()).add(w)
            for o, ws in by_op.items():
                if ws != {i.id for i in tiles[o] if i.sm != ins.sm}:
                    raise ValueError(f"{ins.describe()} waits for part of op {o}'s tiles: one counter "
                                     f"per op cannot express it")
            out.append([(index[o], len(tiles[o])) for o in sorted(by_op, key=index.__getitem__)])
        return out

    def to_json(self) -> dict[str, Any]:
        g = self.graph
        bufs = {}
        for t in g.tensors.values():
            if t.alias_of is None:
                bufs[t.name] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                "role": t.role.value, "bytes": t.nbytes}
        return {
            "num_sms": self.num_sms,
            "counters": len(g.ops),
            "epoch_rule": "each instruction of op k increments counter k once per step; a wait on op k "
                          "(n tiles) in step e (1-based) spins until counter k >= n * e",
            "queues": self.queues,
            "instructions": [{
                "id": i.id, "op": i.op, "kind": i.kind, "tile": i.tile.index, "sm": i.sm,
                "layer": i.layer, "params": i.tile.params, "wait_ops": i.wait_ops, "waits": i.waits,
                "reads": [r.to_json() for r in i.tile.reads],
                "writes": [r.to_json() for r in i.tile.writes],
                "weight_bytes": i.tile.weight_bytes, "act_bytes": i.tile.act_bytes,
            } for i in self.instrs],
            "buffers": bufs,
            "ops": [{"name": o.name, "kind": o.kind, "inputs": o.inputs, "outputs": o.outputs,
                     "layer": o.layer, "source": o.source,
                     "attrs": {k: _jsonable(v) for k, v in o.attrs.items() if k not in ("target", "args", "kwargs")}}
                    for o in g.ops],
        }

    def sm_bytes(self) -> list[int]:
        out = [0] * self.num_sms
        for i in self.instrs:
            out[i.sm] += i.tile.bytes
        return out

    def layer_balance(self) -> dict[int, float]:
        """Per decoder layer: max over SMs of the layer's bytes / mean over SMs."""
        per: dict[int, list[int]] = {}
        for i in self.instrs:
            if i.layer >= 0:
                per.setdefault(i.layer, [0] * self.num_sms)[i.sm] += i.tile.bytes
        return {l: max(v) / (sum(v) / len(v)) for l, v in sorted(per.items()) if sum(v)}

    def summary(self, bandwidth: float = 4.3e12) -> dict[str, Any]:
        b = self.sm_bytes()
        kinds: dict[str, int] = {}
        for i in self.instrs:
            kinds[i.kind] = kinds.get(i.kind, 0) + 1
        bal = self.layer_balance()
        total = sum(b)
        return {
            "instructions": len(self.instrs),
            "instructions_by_kind": dict(sorted(kinds.items())),
            "waits": sum(len(w) for w in self.counter_waits()),   # the kernel's (one per producer op)
            "sm_bytes": {"min": min(b), "median": int(statistics.median(b)), "max": max(b)},
            "total_bytes": total,
            "layer_balance_max": max(bal.values()) if bal else 1.0,
            "layer_balance_mean": sum(bal.values()) / len(bal) if bal else 1.0,
            "predicted_ms_at_bandwidth": total / bandwidth * 1e3,
            "predicted_ms_busiest_sm": max(b) * self.num_sms / bandwidth * 1e3,
        }


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)
