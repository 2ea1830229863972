"""The CUDA step's stages beside each other (fusec/runtime/cuda_build.py): NVRTC runs on a
thread from the moment the kernel is rendered while the artifact entry is written. CPU only
(NVRTC compiles sm_90a without a GPU)."""
from __future__ import annotations

import dataclasses
import runpy
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from fusec.errors import JitError  # noqa: E402
from fusec.runtime import artifacts  # noqa: E402


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE", "1")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSEC_DUMP", raising=False)
    return tmp_path / "cache" / "artifacts"


def test_the_kernel_compiles_while_its_entry_is_stored(cache_on, monkeypatch):
    """The CUDA step starts NVRTC as soon as the kernel is rendered (``lowered``'s ``rendered``
    hook, :func:`fusec.cuda.build.jit_started`: NVRTC releases the GIL) and writes the artifact
    entry meanwhile: the hook runs before the entry exists, and the kernel the thread compiled
    is the one :func:`fusec.cuda.build.jit_plan` compiles."""
    from fusec.api import compile_model
    from fusec.cuda.build import jit_plan, jit_started
    seen = []
    real = artifacts.lowered

    def with_hook(*args, **kwargs):
        def rendered(plan):
            seen.append((plan, sorted(cache_on.glob("*.art")) if cache_on.exists() else [], jit_started(plan)))
        return real(*args, **kwargs, rendered=rendered)
    model, args, kwargs = runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "tiny_llama.py"))["build"]()
    monkeypatch.setattr(artifacts, "lowered", with_hook)
    compile_model(model, args, kwargs, {"num_sms": 8, "emit_cuda": True})
    (plan, entries_then, wait), = seen
    assert entries_then == [] and sorted(cache_on.glob("*.art")), entries_then
    kernel = wait()
    assert kernel.cubin.startswith(b"\x7fELF") and kernel.cubin == jit_plan(plan).cubin
    with pytest.raises(JitError):   # NVRTC's error reaches the caller that waits
        jit_started(dataclasses.replace(plan, source=plan.source + "\n#error a broken kernel\n"))()
