"""Host side of the per-SM timeline profiler (fusec.runtime.profile), on fake schedules (CPU only)."""
import json
import random
from types import SimpleNamespace

import pytest

from fusec.runtime.profile import MatplotlibMissing, Timeline, render

T0 = 1_700_000_000_000_000  # a plausible absolute %globaltimer value (ns)


def _instr(i, sm, kind, layer, nbytes, waits=()):
    tile = SimpleNamespace(bytes=nbytes, weight_bytes=nbytes // 2)
    return SimpleNamespace(id=i, op=f"op{i}", kind=kind, sm=sm, layer=layer, tile=tile,
                           waits=list(waits))


def _hand():
    """3 instructions on 2 SMs with round numbers (times in ns, from T0)."""
    sched = SimpleNamespace(num_sms=2, instrs=[
        _instr(0, 0, "A", 0, 1000),
        _instr(1, 0, "B", 0, 4000, waits=[0]),
        _instr(2, 1, "A", 1, 3000, waits=[0, 1]),
    ])
    records = [[0, T0 + 1000, T0 + 1000, T0 + 3000],   # µs 0, 0, 2
               [0, T0 + 4000, T0 + 5000, T0 + 6000],   # µs 3, 4, 5
               [1, T0 + 2000, T0 + 4000, T0 + 9000]]   # µs 1, 3, 8
    return sched, records


def _random(seed=0, num_sms=3, n=12):
    """n instructions round-robin on num_sms SMs, with seeded, consistent times."""
    rng = random.Random(seed)
    kinds = ["gemv", "rmsnorm", "attn"]
    instrs, records = [], []
    cursor = [T0 + rng.randrange(0, 3000) for _ in range(num_sms)]
    for i in range(n):
        sm = i % num_sms
        waits = sorted(rng.sample(range(i), min(i, rng.randrange(0, 3))))
        instrs.append(_instr(i, sm, kinds[i % len(kinds)], i // 4, rng.randrange(1, 1 << 20), waits))
        start = cursor[sm] + rng.randrange(0, 500)
        waited = start + (0 if i % 4 == 0 else rng.randrange(1, 2000))
        end = waited + rng.randrange(100, 5000)
        records.append([sm, start, waited, end])
        cursor[sm] = end
    return SimpleNamespace(num_sms=num_sms, instrs=instrs), records


def test_summary_by_hand():
    sched, records = _hand()
    s = Timeline.from_records(records, sched, step_ms=0.01).summary()
    assert s["instructions"] == 3 and s["step_ms"] == 0.01
    assert s["span_us"] == pytest.approx(8.0)
    assert s["busy_us"] == pytest.approx(2 + 1 + 5)
    assert s["wait_us"] == pytest.approx(0 + 1 + 2)
    assert s["bytes"] == 8000
    assert s["gbps_span"] == pytest.approx(8000 / 8e-6 / 1e9)
    a, b = s["per_kind"]["A"], s["per_kind"]["B"]
    assert (a["count"], b["count"]) == (2, 1)
    assert a["busy_us"] == pytest.approx(7.0) and a["mean_us"] == pytest.approx(3.5)
    assert a["wait_us"] == pytest.approx(2.0) and b["wait_us"] == pytest.approx(1.0)
    assert a["gbps_busy"] == pytest.approx(4000 / 7e-6 / 1e9)
    assert a["gbps_span"] == pytest.approx(4000 / 8e-6 / 1e9)
    assert b["gbps_busy"] == pytest.approx(4000 / 1e-6 / 1e9)
    # SM 0: busy 3 + wait 1 of 8 -> idle 0.5; SM 1: busy 5 + wait 2 of 8 -> idle 0.125
    assert s["idle_share_per_sm"] == pytest.approx([0.5, 0.125])
    assert s["idle_share_mean"] == pytest.approx(0.3125)
    assert s["critical_sm"] == 1 and s["critical_end_us"] == pytest.approx(8.0)
    assert s["per_layer"] == pytest.approx({0: 5.0, 1: 7.0})


def test_op_windows_by_hand():
    sched, records = _hand()
    sched.instrs[2].op = "op0"          # two tiles of one op on two SMs
    tl = Timeline.from_records(records, sched)
    assert [r["op"] for r in tl.op_windows()] == ["op0", "op1"]
    a = tl.op_windows()[0]
    assert (a["tiles"], a["sms"], a["bytes"]) == (2, 2, 4000)
    assert (a["first_fetch"], a["first_ready"], a["last_end"]) == pytest.approx((0.0, 0.0, 8.0))
    assert a["window_us"] == pytest.approx(8.0) and a["mean_busy_us"] == pytest.approx(3.5)
    assert a["mean_wait_us"] == pytest.approx(1.0)
    assert a["gbps_window"] == pytest.approx(4000 / 8e-6 / 1e9)
    assert [r["op"] for r in tl.op_windows(layer=0)] == ["op0", "op1"]
    assert tl.op_windows(layer=1)[0]["tiles"] == 1 and tl.op_windows(layer=7) == []


def test_summary_random_consistent():
    sched, records = _random(seed=3)
    tl = Timeline.from_records(records, sched)
    s = tl.summary()
    starts, ends = [r[1] for r in records], [r[3] for r in records]
    assert s["span_us"] == pytest.approx((max(ends) - min(starts)) / 1e3)
    assert min(tl.start) == 0.0
    assert sum(k["count"] for k in s["per_kind"].values()) == 12
    assert sum(k["busy_us"] for k in s["per_kind"].values()) == pytest.approx(
        sum(r[3] - r[2] for r in records) / 1e3)
    assert s["critical_sm"] == records[ends.index(max(ends))][0]
    assert all(0.0 <= x < 1.0 for x in s["idle_share_per_sm"])


def test_chrome_trace(tmp_path):
    sched, records = _random(seed=1)
    tl = Timeline.from_records(records, sched)
    path = tmp_path / "trace.json"
    tl.to_chrome_trace(path)
    ev = json.loads(path.read_text())["traceEvents"]
    meta = [e for e in ev if e["ph"] == "M"]
    assert [e["args"]["name"] for e in meta] == ["fusec step", "SM 0", "SM 1", "SM 2"]
    assert [e["tid"] for e in meta if e["name"] == "thread_name"] == [0, 1, 2]
    slices = [e for e in ev if e["ph"] == "X"]
    waits = [e for e in slices if e["cat"] == "wait"]
    work = [e for e in slices if e["cat"] != "wait"]
    n_waiting = sum(1 for r in records if r[2] > r[1])
    assert 0 < n_waiting < 12  # the generator makes both kinds
    assert len(waits) == n_waiting and len(work) == 12
    assert len(ev) == len(meta) + len(slices)
    for e in slices:
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["pid"] == 0
    by_id = {e["args"]["id"]: e for e in work}
    for i, ins in enumerate(sched.instrs):
        e = by_id[i]
        assert (e["name"], e["cat"], e["tid"]) == (ins.kind, ins.kind, records[i][0])
        assert e["args"] == {"id": i, "op": ins.op, "layer": ins.layer, "bytes": ins.tile.bytes,
                             "waits": len(ins.waits)}
        assert e["ts"] == pytest.approx((records[i][2] - min(r[1] for r in records)) / 1e3)
        assert e["dur"] == pytest.approx((records[i][3] - records[i][2]) / 1e3)


def test_json_round_trip(tmp_path):
    sched, records = _random(seed=2)
    tl = Timeline.from_records(records, sched, step_ms=0.05)
    data = json.loads(json.dumps(tl.to_json()))
    back = Timeline.from_json(data)
    assert back.records == tl.records and back.meta == tl.meta
    assert back.num_sms == 3 and back.step_ms == 0.05
    assert back.summary() == tl.summary()
    tl.save(tmp_path / "t.json")
    assert Timeline.load(tmp_path / "t.json").to_json() == tl.to_json()
    with pytest.raises(ValueError, match="fusec-timeline"):
        Timeline.from_json({"format": "other"})


def test_accepts_tensor():
    torch = pytest.importorskip("torch")
    sched, records = _random(seed=4)
    a = Timeline.from_records(torch.tensor(records, dtype=torch.int64), sched)
    assert a.to_json() == Timeline.from_records(records, sched).to_json()


def test_marks_by_hand(tmp_path):
    """Columns after the fourth are template marks: median offset from t_waited per op, 0 = not
    taken; they survive the JSON round trip."""
    sched, records = _hand()
    sched.instrs[2].op = "op0"
    marked = [r + m for r, m in zip(records, ([T0 + 1500, 0], [T0 + 5200, T0 + 5900], [T0 + 4500, 0]))]
    tl = Timeline.from_records(marked, sched)
    assert tl.records == [tuple(r) for r in records]
    w = {r["op"]: r["marks_us"] for r in tl.op_windows()}
    assert w["op0"][0] == pytest.approx(0.5) and w["op0"][1] is None      # both tiles 0.5 µs after ready
    assert w["op1"] == pytest.approx([0.2, 0.9])
    tl.save(tmp_path / "t.json")
    assert Timeline.load(tmp_path / "t.json").marks == tl.marks
    assert Timeline.from_records(records, sched).op_windows()[0]["marks_us"] == []
    with pytest.raises(ValueError, match="4 \\+ marks"):
        Timeline.from_records([records[0], records[1] + [1], records[2]], sched)


def test_bad_records():
    sched, records = _hand()
    with pytest.raises(ValueError, match="3 instructions"):
        Timeline.from_records(records[:2], sched)
    bad = [r[:] for r in records]
    bad[1][3] = bad[1][2] - 1  # ends before its work began
    with pytest.raises(ValueError, match="first instruction 1"):
        Timeline.from_records(bad, sched)
    bad = [r[:] for r in records]
    bad[2][0] = 5
    with pytest.raises(ValueError, match="SM outside"):
        Timeline.from_records(bad, sched)


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    sched, records = _random(seed=5)
    tl = Timeline.from_records(records, sched, step_ms=0.02)
    png = tmp_path / "t.png"
    tl.to_png(png, title="fake")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    tl.save(tmp_path / "t.json")
    s = render(tmp_path / "t.json", tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000 and s["instructions"] == 12


def test_png_without_matplotlib(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    sched, records = _hand()
    with pytest.raises(ImportError, match="matplotlib") as e:
        Timeline.from_records(records, sched).to_png(tmp_path / "x.png")
    assert isinstance(e.value, MatplotlibMissing)
