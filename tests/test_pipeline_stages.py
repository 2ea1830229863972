"""The pipeline is one list of named stages (fusec/pipeline.py) that the artifact cache wraps once
(fusec/cache/artifacts.py ``compile_graph``): every stage logs its line and dumps its artifact,
and a second compile of the same graph is served by the cache without running a stage (issue 30,
item 9). CPU only: NVRTC is replaced by a fake (tests/test_cuda_build.py runs the real one)."""
from __future__ import annotations

import logging

import pytest
import torch

from fusec import pipeline
from fusec.cache import artifacts
from fusec.config import Options
from fusec.pipeline import Dumper
from step_util import neg_mul_graph

PASSES = ["normalize", "fold_constants", "split_linear", "recognize", "check_lengths", "fold_position", "fuse",
          "chain", "prologue", "tile", "schedule"]


@pytest.fixture
def fake_nvrtc(monkeypatch):
    """NVRTC replaced, on its thread, by a function that logs the stage line and returns the plan."""
    def compile_plan(plan):
        logging.getLogger("fusec").info("stage %-13s fake  (0.00 s)", "nvrtc")
        return plan
    monkeypatch.setattr(pipeline, "nvrtc_compile", compile_plan)


def _stages_logged(caplog) -> list[str]:
    return [r.getMessage().split()[1] for r in caplog.records
            if r.name.startswith("fusec") and r.getMessage().startswith("stage ")]


def test_the_stage_list_names_every_stage_in_order():
    opts = Options.from_dict({"num_sms": 4})
    assert [s.name for s in pipeline.stages(opts)] == PASSES
    assert [s.name for s in pipeline.stages(opts, "cuda")] == PASSES + ["render", "nvrtc"]


def test_every_stage_logs_and_dumps(tmp_path, caplog, fake_nvrtc, monkeypatch):
    """With ``dump_dir`` (the cache is not read) one call runs the whole list: a line per stage in
    order and the files of every stage that has one."""
    monkeypatch.setenv("FUSEC_CACHE", "1")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    opts = Options.from_dict({"num_sms": 4, "dump_dir": str(tmp_path / "dump")})
    with caplog.at_level(logging.INFO, logger="fusec"):
        made = artifacts.compile_graph(neg_mul_graph(), [torch.randn(4)], opts, Dumper(opts.dump_dir), target="cuda")
    assert made.kernel() is made.plan and made.plan.source
    logged = _stages_logged(caplog)   # nvrtc's line comes from its thread: before or after the store's
    assert [n for n in logged if n != "nvrtc"] == ["artifacts"] + PASSES + ["render", "artifacts"], logged
    assert logged.count("nvrtc") == 1 and logged.index("nvrtc") > logged.index("render"), logged
    names = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert names == sorted([f"{i:02d}_{n}.txt" for i, n in enumerate(PASSES[:9])] + ["09_kernel.cu", "schedule.json"])


def test_a_second_compile_runs_no_stage(tmp_path, caplog, fake_nvrtc, monkeypatch):
    """The first compile runs every stage and stores the entry; the second is a hit that runs
    none (the simulator target), or for the GPU only ``nvrtc`` (the CUBIN comes from NVRTC's own
    disk cache); a simulator entry gets its kernel rendered once when the GPU asks."""
    monkeypatch.setenv("FUSEC_CACHE", "1")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSEC_DUMP", raising=False)
    opts = Options.from_dict({"num_sms": 4})
    runs = []
    for target in ("sim", "sim", "cuda", "cuda"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fusec"):
            made = artifacts.compile_graph(neg_mul_graph(), [torch.randn(4)], opts, Dumper(None), target=target)
            if made.kernel is not None:
                made.kernel()
        runs.append((made, _stages_logged(caplog)))
    (first, log1), (second, log2), (third, log3), (fourth, log4) = runs
    assert log1 == ["artifacts"] + PASSES + ["artifacts"]   # miss, the stages, stored
    assert log2 == ["artifacts"] and second.plan is None and second.kernel is None
    assert second.schedule.to_json() == first.schedule.to_json()
    assert sorted(log3) == sorted(["artifacts", "render", "artifacts", "nvrtc"])   # hit, render, stored
    assert log4 == ["artifacts", "nvrtc"] and fourth.plan.source == third.plan.source
