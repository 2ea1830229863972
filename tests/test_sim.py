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
    victim = _cross_sm_consumer(s, "matvec_residual")
    saved = victim.waits
    victim.waits = []
    try:
        with pytest.raises(HazardError) as e:
            Simulator(s, numeric=False).step()
        assert e.value.hazards[0]["kind"] == "RAW"
        assert "matvec_residual" in e.value.hazards[0]["second"]
    finally:
        victim.waits = saved


def test_last_tile_merge_needs_its_ticket_edges(monkeypatch):
    """With attention_merge="last_tile" the merging tile reads partials of tiles it has no
    counter wait on; only the tickets order them. Each KV head merges once per step, and
    dropping the ticket edges from the hazard check turns those reads into RAW hazards."""
    from fusec.instructions.attention import AttentionPartial
    from fusec.sim import simulator
    model = hf_tiny.llama(layers=1, heads=4, kv_heads=2)
    cache = hf_tiny.static_cache(model, 64)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 40)), past_key_values=cache, use_cache=True)
    step = ((), {"input_ids": torch.randint(0, 128, (1, 1)), "past_key_values": cache, "use_cache": True})
    opts = {"num_sms": 8, "attention_merge": "last_tile", "simulate": True}
    merged = []
    real = AttentionPartial.run_tile.__func__

    def spy(cls, op, tile, env):
        nc, key = op.attrs["n_chunks"], (op.name, tile.params["group"])
        assert nc > 1
        last = env.peek_ticket(key) % nc == nc - 1
        real(cls, op, tile, env)
        if last:
            merged.append(tile.params["group"])
    monkeypatch.setattr(AttentionPartial, "run_tile", classmethod(spy))
    compile_model(model, *step, opts)
    assert sorted(merged) == [0, 1]
    monkeypatch.setattr(simulator, "_ticket_edges", lambda env: {})
    with pytest.raises(HazardError) as e:
        compile_model(model, *step, opts)
    # the merging tile reads partials that other tiles of its op wrote: RAW, or WAR when the
    # writer comes later in program order than the merging tile
    for h in e.value.hazards:
        assert h["kind"] in ("RAW", "WAR") and h["buffer"].endswith("_part")
        assert "attention_partial" in h["first"] and "attention_partial" in h["second"]


def test_ticket_does_not_hide_a_missing_wait():
    """A ticket orders only the merge after it: a split-KV tile whose counter waits on the QKV
    tiles are removed is a hazard in every interleaving, even when another tile of its KV head
    took the ticket first."""
    import step_util
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    model = hf_tiny.llama(layers=1, heads=4, kv_heads=2)
    cache = hf_tiny.static_cache(model, 64)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 40)), past_key_values=cache, use_cache=True)
    _, g, flat = step_util.capture(model, {"input_ids": torch.randint(0, 128, (1, 1)),
                                           "past_key_values": cache, "use_cache": True})
    s = lower(g, flat, Options.from_dict({"num_sms": 8, "attention_merge": "last_tile"}), Dumper(None))
    victims = [i for i in s.instrs if i.kind == "attention_partial" and i.waits]
    assert len(victims) >= 4
    hazards = 0
    for victim in victims:
        saved, victim.waits = victim.waits, []
        try:
            for seed in range(6):
                args = [a.clone() if isinstance(a, torch.Tensor) else a for a in flat]
                # never a silent pass: the hazard check fails it, or (when the victim runs
                # before q exists at all) the numeric run cannot read q
                with torch.no_grad(), pytest.raises((HazardError, KeyError)) as e:
                    Simulator(s, seed=seed).step(args)
                hazards += e.type is HazardError
        finally:
            victim.waits = saved
    assert hazards >= len(victims)


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
    """Tiles of one op write disjoint regions (no write-write overlap inside an op), except the
    group output of a last-tile merge: every split-KV tile of a KV head declares it, and the
    one that takes the last ticket writes it (the same region, never a partial overlap)."""
    by_op = {}
    ops = compiled.graph.op_by_name()
    for i in compiled.instrs:
        by_op.setdefault(i.op, []).append(i)
    for op, ins in by_op.items():
        regs = [(r.tensor, r.start, r.stop) for i in ins for r in i.tile.writes
                if compiled.graph.tensors[r.tensor].role.value not in ("kv_cache",)]
        if ops[op].kind == "attention_partial" and "out" in ops[op].outputs:
            merged = compiled.graph.root(ops[op].outputs["out"])
            assert sum(t == merged for t, _, _ in regs) == len(ins)   # one declaration per tile
            regs = set(regs)
        regs = sorted(regs)
        for (t1, a1, b1), (t2, a2, b2) in zip(regs, regs[1:]):
            assert t1 != t2 or b1 <= a2, f"{op}: overlapping writes"


def test_first_step_runs_outside_aot_autograds_dispatch_mode(monkeypatch):
    """AOT autograd runs a compiled graph's first call under its check of custom ops' aliasing (a
    Python dispatch mode that sees every torch op); the step itself, the simulator's thousands of
    ops, runs outside it (``fusec.frontend.compiled``; 20-25% of a tiny model's first call)."""
    from fusec.frontend import compiled as compiled_mod
    seen = {"entry": [], "engine": []}
    build, call = compiled_mod.CompiledStep._build, compiled_mod.CompiledStep.__call__

    def spy_build(self, args):
        engine = build(self, args)

        def engine_spy(a):
            seen["engine"].append(torch._C._len_torch_dispatch_stack())
            return engine(a)
        return engine_spy

    def spy_call(self, *args):
        seen["entry"].append(compiled_mod._under_aot_check())
        return call(self, *args)
    monkeypatch.setattr(compiled_mod.CompiledStep, "_build", spy_build)
    monkeypatch.setattr(compiled_mod.CompiledStep, "__call__", spy_call)
    monkeypatch.setenv("FUSEC_CACHE", "0")   # a cold compile: AOT autograd runs
    model = hf_tiny.llama(layers=1)
    cache = hf_tiny.static_cache(model, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
        step = torch.compile(model, backend="fusec")
        for pos in (3, 4):
            step(input_ids=torch.randint(0, 128, (1, 1)), past_key_values=cache, use_cache=True,
                 cache_position=torch.tensor([pos]))
    torch._dynamo.reset()
    assert seen["entry"] == [True, False], seen   # the first call is under AOT's check, not the next
    assert seen["engine"] == [0, 0], seen
