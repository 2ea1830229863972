"""The simulator catches broken schedules: deadlocks and unordered accesses (hazards)."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.api import compile_model
from fusec.errors import DeadlockError, HazardError
from fusec.sim import Simulator, check_hazards


@pytest.fixture(scope="module")
def compiled():
    model = hf_tiny.llama(layers=2)
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
    res = compile_model(model, (), {"input_ids": torch.randint(0, 128, (1, 1)),
                                    "past_key_values": cache, "use_cache": True}, {"num_sms": 8})
    return res.schedule


def test_schedule_is_clean(compiled):
    check_hazards(compiled)
    for seed in range(3):
        Simulator(compiled, seed=seed, numeric=False).step()


def _cross_sm_consumer(s, kind):
    return next(i for i in s.instrs if i.kind == kind and i.waits)


def test_removed_wait_is_a_hazard(compiled):
    s = compiled
    victim = _cross_sm_consumer(s, "attention_reduce")
    saved = victim.waits
    victim.waits = []
    try:
        with pytest.raises(HazardError) as e:
            Simulator(s, numeric=False).step()
        assert e.value.hazards[0]["kind"] == "RAW"
        assert "attention_reduce" in e.value.hazards[0]["second"]
    finally:
        victim.waits = saved


def test_cyclic_wait_is_a_deadlock(compiled):
    s = compiled
    a = s.instrs[s.queues[0][0]]
    b = s.instrs[s.queues[1][0]]
    sa, sb = list(a.waits), list(b.waits)
    a.waits, b.waits = sa + [b.id], sb + [a.id]
    try:
        with pytest.raises(DeadlockError) as e:
            Simulator(s, numeric=False, check=False).step()
        blocked = {d["sm"]: d for d in e.value.blocked}
        assert blocked[0]["counter"] == b.id and blocked[0]["target"] == 1 and blocked[0]["value"] == 0
        assert blocked[0]["queue_index"] == 0
        assert "SM 0" in str(e.value) and f"counter {b.id}" in str(e.value)
    finally:
        a.waits, b.waits = sa, sb


def test_queues_follow_program_order(compiled):
    for q in compiled.queues:
        assert q == sorted(q)
    for i in compiled.instrs:
        assert all(w < i.id for w in i.waits)
        assert all(compiled.instrs[w].sm != i.sm for w in i.waits)


def test_tiles_cover_outputs_exactly(compiled):
    """Tiles of one op write disjoint regions (no write-write overlap inside an op)."""
    by_op = {}
    for i in compiled.instrs:
        by_op.setdefault(i.op, []).append(i)
    for op, ins in by_op.items():
        regs = sorted((r.tensor, r.start, r.stop) for i in ins for r in i.tile.writes
                      if compiled.graph.tensors[r.tensor].role.value not in ("kv_cache",))
        for (t1, a1, b1), (t2, a2, b2) in zip(regs, regs[1:]):
            assert t1 != t2 or b1 <= a2, f"{op}: overlapping writes"
