"""Time NVRTC on example models' megakernels: the default (every kind out of line, one
dispatch case per distinct call) and ``FUSEC_DISPATCH_BY_KIND=0`` (one case per op, the default
before 2026-12-02). No GPU needed: the models are built and lowered on the CPU
(``fusec.api.compile_model``), then each kernel is compiled by NVRTC for sm_90a into a fresh
cache folder, so nothing is reused.

Usage: .venv/bin/python tools/nvrtc_time.py examples/llama_3_2_1b.py [examples/qwen3_0_6b.py ...]
Prints one line per model and variant: NVRTC seconds, registers, spill bytes, source lines.
"""
from __future__ import annotations

import runpy
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fusec.api import compile_model  # noqa: E402
from fusec.cuda.codegen import render  # noqa: E402
from fusec.cuda.jit import compile_cuda  # noqa: E402

VARIANTS = (("default", {}), ("a case per op (FUSEC_DISPATCH_BY_KIND=0)", {"FUSEC_DISPATCH_BY_KIND": 0}))


def main(examples: list[str]) -> int:
    for ex in examples:
        model, args, kwargs = runpy.run_path(ex)["build"]()
        res = compile_model(model, args, kwargs, {"num_sms": 132})
        del model
        for name, defines in VARIANTS:
            plan = render(res.schedule, defines=defines)
            with tempfile.TemporaryDirectory() as cache:
                t0 = time.perf_counter()
                k = compile_cuda(plan.source, "fusec_step.cu", cache_dir=cache)
                seconds = time.perf_counter() - t0
            r = k.resources["fusec_step"]
            print(f"{ex}: {name}: NVRTC {seconds:.1f} s, {r['registers']} registers, "
                  f"{r['spill_store_bytes']} B spills, {len(plan.source.splitlines())} lines", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
