"""IR invariants, the pattern language, dumps and the pass checker."""
from __future__ import annotations

import json

import pytest
import torch

import hf_tiny
from step_util import neg_mul_graph
from fusec.errors import IRError
from fusec.ir import Op
from fusec.ir.pattern import Matcher, lit, op, var


def test_checker_names_the_pass():
    g = neg_mul_graph()
    g.check("capture")
    g.ops.reverse()  # y read before it is written
    with pytest.raises(IRError, match="reads y before it is written after pass 'fuse'"):
        g.check("fuse")


def test_pattern_binds_literals_and_vars():
    g = neg_mul_graph()
    m = Matcher(g)
    b = m.match(op("aten.mul.Tensor", op("aten.neg.default", var("v")), lit("k")), "z")
    assert b["v"] == "x" and b["k"] == 2.0 and [o.name for o in b["_ops"]] == ["a", "b"]
    assert m.match(op("aten.add.Tensor", var("v"), lit("k")), "z") is None


def test_dag_orders_in_place_writes_after_readers():
    g = neg_mul_graph()
    from fusec.ir import Ref
    g.ops.append(Op("c", "aten.copy_.default", {"in0": "x", "in1": "z"}, {"mut0": "x"},
                    attrs={"target": torch.ops.aten.copy_.default, "args": (Ref("in0"), Ref("in1")),
                           "kwargs": {}}, mutates=("mut0",)))
    dag = g.dag()
    assert dag.has_edge("a", "c") and dag.has_edge("b", "c")


def test_dump_dir_writes_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_DUMP", str(tmp_path))
    from fusec.api import compile_model
    model = hf_tiny.llama(layers=1)
    cache = hf_tiny.static_cache(model, 16)
    with torch.no_grad():  # the prefill allocates the static cache
        model(input_ids=torch.randint(0, 128, (1, 2)), past_key_values=cache, use_cache=True)
    res = compile_model(model, (), {"input_ids": torch.randint(0, 128, (1, 1)),
                                    "past_key_values": cache, "use_cache": True}, {"num_sms": 4})
    names = sorted(p.name for p in tmp_path.iterdir())
    for stage in ("aten", "ir", "normalize", "recognize", "fold_position", "fuse"):
        assert any(n.endswith(f"_{stage}.txt") for n in names), (stage, names)
    sched = json.loads((tmp_path / "schedule.json").read_text())
    assert sched["num_sms"] == 4 and len(sched["queues"]) == 4
    assert len(sched["instructions"]) == len(res.schedule.instrs)
    # one counter per op: every tile of op k adds 1 to counter k (docs/generated-cuda.md, "Epoch rule")
    assert sched["counters"] == len(sched["ops"]) == len({i["op"] for i in sched["instructions"]})
    assert "rms_qkv_rope" in res.graph_text()


def test_a_second_graph_dumps_beside_the_first(tmp_path, monkeypatch):
    """Two graphs compiled in one process with one dump folder: the first's stages stay in the
    folder, the second's go to ``graph2`` (the second used to overwrite the first)."""
    from fusec.api import compile_model
    from fusec.pipeline import Dumper
    monkeypatch.setattr(Dumper, "_graphs", {})
    monkeypatch.setenv("FUSEC_DUMP", str(tmp_path))
    for length in (16, 24):
        model = hf_tiny.llama(layers=1)
        cache = hf_tiny.static_cache(model, length)
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 2)), past_key_values=cache, use_cache=True)
        compile_model(model, (), {"input_ids": torch.randint(0, 128, (1, 1)), "past_key_values": cache,
                                  "use_cache": True}, {"num_sms": 4})
    assert "[1,2,16,16]" in (tmp_path / "01_ir.txt").read_text()   # the first graph's cache rows
    assert "[1,2,24,16]" in (tmp_path / "graph2" / "01_ir.txt").read_text()
