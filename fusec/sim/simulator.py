"""The simulator: runs a schedule SM by SM in a seeded random interleaving.

Each step (epoch ``e``), every SM walks its queue; an instruction may start when each
counter it waits on is at least ``e``; the simulator picks a random SM among those whose
head instruction may start, runs that instruction's Python semantics (numeric mode) and
increments its counter. If work remains and no SM can start, that is a deadlock, reported
with the SM, queue index, instruction, counter, value and target of every blocked SM.
A step that fails (an index fault, a deadlock) restores the regions of the caller's tensors it
wrote (KV-cache rows, position counters) and sets every counter to the step's end before it
raises: it leaves nothing behind, and the next step runs.
After the step, :func:`fusec.sim.hazards.check_hazards` verifies with the exact run-time
regions that every conflicting pair of accesses was ordered: by queue order, counter waits,
or an atomic ticket (the accesses an instruction makes after taking a ticket follow the
instruction that took it before, as on the GPU; see :meth:`fusec.ir.env.Env.take_ticket` and
:meth:`fusec.instructions.base.Instruction.ticket_regions`).
"""
from __future__ import annotations

import logging
import random
from typing import Any

import torch

from fusec.ir.env import Env
from fusec.errors import DeadlockError
from fusec.instructions import kind_of
from fusec.ir.schedule import Schedule
from fusec.sim.hazards import check_hazards

log = logging.getLogger("fusec.sim")


class Simulator:
    """Executes a :class:`Schedule` on the CPU.

    Args:
        schedule: the schedule to run.
        seed: seeds the interleaving (step ``e`` uses ``seed + e``).
        numeric: run each instruction's semantics (False: structure only, for big models).
        check: run the hazard check after every step.
    """

    def __init__(self, schedule: Schedule, seed: int = 0, numeric: bool = True, check: bool = True):
        self.s = schedule
        self.seed = seed
        self.numeric = numeric
        self.check = check
        self.counters = [0] * len(schedule.instrs)
        self.epoch = 0
        self.ops = schedule.graph.op_by_name()

    def step(self, flat_args: list[Any] | None = None) -> list[torch.Tensor] | None:
        """Run one decode step; returns the graph outputs in numeric mode.

        Raises:
            DeadlockError: no SM can start its next instruction while work remains.
            HazardError: two conflicting accesses were not ordered.
        """
        s = self.s
        self.epoch += 1
        e = self.epoch
        env = Env(s.graph, flat_args) if self.numeric else None
        rng = random.Random(self.seed + e)
        heads = [0] * s.num_sms
        counters = self.counters
        instrs, queues = s.instrs, s.queues
        # each SM's head instruction waits for ``missing[sm]`` unfinished instructions; an
        # instruction's id maps to the SMs whose heads wait for it (in the order they were armed)
        missing = [0] * s.num_sms
        blockers: dict[int, list[int]] = {}
        ready: list[int] = []
        regions = {}
        order: list[int] = []
        post_regions = {}
        waits = [tuple(dict.fromkeys(ins.waits)) for ins in instrs]   # as a set, in a fixed order

        def arm(sm: int) -> None:
            q = queues[sm]
            if heads[sm] >= len(q):
                return
            n = 0
            for w in waits[q[heads[sm]]]:
                if counters[w] < e:
                    n += 1
                    blockers.setdefault(w, []).append(sm)
            if n:
                missing[sm] = n
            else:
                ready.append(sm)

        for sm in range(s.num_sms):
            arm(sm)
        remaining = len(instrs)
        inputs = set(s.graph.inputs)
        kinds = {}   # op name -> its instruction class
        undo: list[tuple[str, int, int, torch.Tensor]] = []   # input regions as they were before a write
        try:
            while remaining:
                if not ready:
                    raise self._deadlock(heads, e)
                sm = ready.pop(rng.randrange(len(ready)))
                ins = instrs[queues[sm][heads[sm]]]
                order.append(ins.id)
                if env is not None:
                    op = self.ops[ins.op]
                    cls = kinds.get(ins.op)
                    if cls is None:
                        cls = kinds[ins.op] = kind_of(op)
                    env.current = ins.id
                    regions[ins.id] = got = cls.runtime_regions(op, ins.tile, env)
                    after = cls.ticket_regions(op, ins.tile, env)
                    if after[0] or after[1]:
                        post_regions[ins.id] = after
                    for r in (*got[1], *after[1]):
                        if r.tensor in inputs:
                            undo.append((r.tensor, r.start, r.stop, env.flat(r.tensor)[r.start:r.stop].clone()))
                    cls.run_tile(op, ins.tile, env)
                counters[ins.id] += 1
                remaining -= 1
                heads[sm] += 1
                arm(sm)
                for other in blockers.pop(ins.id, ()):
                    missing[other] -= 1
                    if not missing[other]:
                        ready.append(other)
        except BaseException:
            # a failed step (an index fault, a deadlock) leaves nothing behind: the caller's tensors
            # (KV caches, position counters) as they were, and every counter at this step's end,
            # so that the next step starts where a finished one would (no DeadlockError after it)
            for root, a, b, saved in reversed(undo):
                env.flat(root)[a:b] = saved
            self.counters = [e] * len(self.counters)
            raise
        if self.check:
            check_hazards(s, regions, extra=_ticket_edges(env), order=order, post_regions=post_regions)
        if env is None:
            return None
        return [env.read(t) for t in s.graph.outputs]

    def _deadlock(self, heads: list[int], e: int) -> DeadlockError:
        s = self.s
        blocked = []
        for sm, q in enumerate(s.queues):
            if heads[sm] >= len(q):
                continue
            ins = s.instrs[q[heads[sm]]]
            w = next(w for w in ins.waits if self.counters[w] < e)
            blocked.append({"sm": sm, "queue_index": heads[sm], "instruction": ins.describe(),
                            "counter": w, "value": self.counters[w], "target": e})
        lines = "\n".join(f"  SM {b['sm']} queue[{b['queue_index']}] {b['instruction']} waits on "
                          f"counter {b['counter']}: value {b['value']}, target {b['target']}"
                          for b in blocked[:20])
        return DeadlockError(f"deadlock in step {e}: {len(blocked)} SM(s) blocked\n{lines}", blocked)


def _ticket_edges(env: Env | None) -> dict[int, list[int]]:
    """Happens-before edges of the step's atomic tickets: each instruction that took a ticket
    follows the one that took the same ticket just before it (an acquire-release atomic)."""
    edges: dict[int, list[int]] = {}
    last: dict[Any, int] = {}
    for key, iid in (env.ticket_log if env is not None else ()):
        if iid is None:
            continue
        if key in last:
            edges.setdefault(iid, []).append(last[key])
        last[key] = iid
    return edges
