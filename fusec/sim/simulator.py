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

import heapq
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
        # each SM's head instruction waits for ``missing[sm]`` unfinished instructions or ops. An
        # instruction as scheduled (``regular``) waits for every tile of its producer ops on other
        # SMs, its own SM's tiles of them being earlier in its queue (done): it waits for those
        # ops until every tile of theirs is done (``left``). Another (waits set by hand, or a
        # queue out of program order) waits for its listed instructions. ``blockers`` (an
        # instruction id) and ``op_blockers`` (an op) list the SMs whose heads wait for them as
        # (arm order, SM): an SM whose last wait ends is ready in the order the SMs were armed,
        # as when each SM waited for every instruction (the same interleaving for a seed)
        missing = [0] * s.num_sms
        blockers: dict[int, list[tuple[int, int]]] = {}
        op_blockers: dict[str, list[tuple[int, int]]] = {}
        ready: list[int] = []
        regions = {}
        order: list[int] = []
        post_regions = {}
        left: dict[str, int] = {}
        last_on: dict[tuple[str, int], int] = {}   # (op, SM) -> the queue index of its last tile there
        qpos = [0] * len(instrs)
        q_sm = [-1] * len(instrs)   # the SM whose queue holds the instruction
        for ins in instrs:
            left[ins.op] = left.get(ins.op, 0) + (counters[ins.id] < e)
        for sm, q in enumerate(queues):
            for k, iid in enumerate(q):
                last_on[(instrs[iid].op, sm)] = qpos[iid] = k
                q_sm[iid] = sm
        regular = [ins.index is not None and not ins.edited and q_sm[ins.id] == ins.sm
                   and all(last_on.get((o, ins.sm), -1) < qpos[ins.id] for o in ins.wait_ops) for ins in instrs]
        wait_ops = [tuple(dict.fromkeys(ins.wait_ops)) if r else () for ins, r in zip(instrs, regular)]
        armed = [0]

        def arm(sm: int) -> None:
            q = queues[sm]
            if heads[sm] >= len(q):
                return
            iid = q[heads[sm]]
            armed[0] += 1
            key = (armed[0], sm)
            n = 0
            if regular[iid]:
                for o in wait_ops[iid]:
                    if left[o]:
                        n += 1
                        op_blockers.setdefault(o, []).append(key)
            else:
                for w in dict.fromkeys(instrs[iid].waits):   # as a set, in a fixed order
                    if counters[w] < e:
                        n += 1
                        blockers.setdefault(w, []).append(key)
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
                left[ins.op] -= 1
                remaining -= 1
                heads[sm] += 1
                arm(sm)
                waiting = blockers.pop(ins.id, None)
                if not left[ins.op] and ins.op in op_blockers:
                    done = op_blockers.pop(ins.op)
                    waiting = done if waiting is None else list(heapq.merge(waiting, done))
                for _, other in waiting or ():
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
