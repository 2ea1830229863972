"""The CUDA target's stages after lowering: render (``codegen``) and NVRTC (``jit``).

:func:`compile_kernel` renders a schedule and compiles it (no GPU needed: the CLI's
``--emit-cuda`` and CI use it). Each stage logs one line with its time: ``codegen`` (render),
``jit`` (NVRTC or its cache). Loading a compiled kernel onto a GPU is the runtime's
(:func:`fusec.runtime.cuda_build.build_cuda_step`); this module imports nothing of it.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from fusec.cuda.codegen import KernelPlan, describe, render
from fusec.config import Options
from fusec.cuda.jit import CompiledKernel, compile_cuda
from fusec.pipeline import Dumper
from fusec.ir.schedule import Schedule

log = logging.getLogger("fusec")


def render_plan(sched: Schedule, opts: Options, dump: Dumper | None = None) -> KernelPlan:
    """Stage ``codegen``: the megakernel's CUDA source and buffer layout (``dump`` gets ``kernel.cu``).

    Raises:
        FallbackRequired: an op has no CUDA form.
    """
    t0 = time.perf_counter()
    plan = render(sched, profile=opts.profile, defines=opts.defines)
    if dump is not None:
        dump.text("kernel.cu", plan.source)
    d = describe(plan)
    log.info("stage %-13s %d instructions, %d counter waits, %d buffers, %d B dynamic shared memory, "
             "%d threads, %d lines of CUDA  (%.2f s)", "codegen", d["instructions"], d["waits"], d["buffers"],
             d["smem_bytes"], d["threads"], len(plan.source.splitlines()), time.perf_counter() - t0)
    return plan


def jit_plan(plan: KernelPlan) -> CompiledKernel:
    """Stage ``jit``: ``plan``'s source compiled for sm_90a by NVRTC, or found in its disk cache.

    Raises:
        JitError: NVRTC failed.
    """
    t0 = time.perf_counter()
    kernel = compile_cuda(plan.source, "fusec_step.cu")
    res = kernel.resources.get("fusec_step", {})
    if res.get("registers") is None:   # NVRTC 12.9+ found it in its own cache (CUDA_CACHE_PATH)
        what = "no ptxas report (NVRTC's own cache)"
    else:
        what = (f"{res.get('registers')} registers, {res.get('stack_frame_bytes')} B stack, "
                f"{res.get('spill_store_bytes')} B spills")
    log.info("stage %-13s NVRTC %s: %s  (%.2f s%s)", "jit", ".".join(map(str, kernel.nvrtc_version)), what,
             time.perf_counter() - t0, ", cached" if kernel.cache_hit else "")
    return kernel


def jit_started(plan: KernelPlan) -> Callable[[], CompiledKernel]:
    """Stage ``jit`` (:func:`jit_plan`) started on a thread of its own; returns a function that
    waits for it and returns the kernel. NVRTC releases the GIL while it compiles, so the caller
    meanwhile does other work (the artifact entry of the step, 0.6 s for Llama-3.2-1B on the
    H200, beside NVRTC's 1.6 s).

    Raises (from the returned function): what :func:`jit_plan` raises."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusec-jit")
    future = pool.submit(jit_plan, plan)
    pool.shutdown(wait=False)   # the thread ends with the compile
    return future.result


def compile_kernel(sched: Schedule, opts: Options, dump: Dumper | None = None,
                   plan: KernelPlan | None = None) -> tuple[KernelPlan, CompiledKernel]:
    """Render ``sched`` into the megakernel's CUDA source and compile it for sm_90a with NVRTC.

    Returns:
        (plan, kernel): the rendered source with its buffer layout, and the CUBIN with its
        resource usage (registers, stack, spills). ``dump`` gets ``kernel.cu``. A ``plan``
        given (rendered before, from the artifact cache) is compiled as it is.
    Raises:
        FallbackRequired: an op has no CUDA form; JitError: NVRTC failed.
    """
    if plan is None:
        plan = render_plan(sched, opts, dump)
    return plan, jit_plan(plan)
