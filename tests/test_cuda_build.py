"""The CUDA target's last stages beside the cache (fusec/pipeline.py, fusec/cache/artifacts.py):
NVRTC runs on a thread from the moment the kernel is rendered while the artifact entry is
written. CPU only (NVRTC compiles sm_90a without a GPU)."""
from __future__ import annotations

import dataclasses
import runpy
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from fusec.errors import JitError  # noqa: E402
from fusec import pipeline  # noqa: E402


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE", "1")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSEC_DUMP", raising=False)
    return tmp_path / "cache" / "artifacts"


def test_the_kernel_compiles_while_its_entry_is_stored(cache_on, monkeypatch):
    """The stage ``nvrtc`` starts NVRTC on a thread as soon as the kernel is rendered
    (:func:`fusec.pipeline.nvrtc_started`: NVRTC releases the GIL) and the cache writes the
    artifact entry meanwhile: NVRTC starts before the entry exists, and the kernel the thread
    compiled is the one :func:`fusec.pipeline.nvrtc_compile` compiles."""
    from fusec.api import compile_model
    seen = []
    real = pipeline.nvrtc_started

    def started(plan):
        seen.append((plan, sorted(cache_on.glob("*.art")) if cache_on.exists() else []))
        return real(plan)
    model, args, kwargs = runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "tiny_llama.py"))["build"]()
    monkeypatch.setattr(pipeline, "nvrtc_started", started)
    kernel = compile_model(model, args, kwargs, {"num_sms": 8, "emit_cuda": True}).kernel
    (plan, entries_then), = seen
    assert entries_then == [] and sorted(cache_on.glob("*.art")), entries_then
    assert kernel.cubin.startswith(b"\x7fELF") and kernel.cubin == pipeline.nvrtc_compile(plan).cubin
    with pytest.raises(JitError):   # NVRTC's error reaches the caller that waits
        real(dataclasses.replace(plan, source=plan.source + "\n#error a broken kernel\n"))()
