"""The CUDA target: lower, render, compile with NVRTC and load, as one function."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from .codegen import describe, render
from .config import Options
from .ir import Graph
from .jit import compile_cuda
from .pipeline import Dumper, lower
from .runtime import CudaStep
from .schedule import Schedule

log = logging.getLogger("fusec")


def build_cuda_step(g: Graph, args: list[Any], opts: Options, dump: Dumper) -> tuple[CudaStep, Schedule]:
    """Compile ``g`` for the GPU of its inputs; ``num_sms`` defaults to that GPU's SM count.

    Raises:
        FallbackRequired: an op has no CUDA form; JitError: NVRTC failed; CudaError, FusecError.
    """
    dev = next(a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if opts.num_sms is None:
        opts = dataclasses.replace(opts, num_sms=sms)
    sched = lower(g, args, opts, dump)
    t0 = time.perf_counter()
    plan = render(sched, profile=opts.profile, defines=opts.defines)
    dump.text("kernel.cu", plan.source)
    kernel = compile_cuda(plan.source, "fusec_step.cu")
    res = kernel.resources.get("fusec_step", {})
    log.info("stage %-13s %s, %d registers, %d B stack, %d B spills  (%.2f s%s)", "codegen+jit",
             describe(plan), res.get("registers", -1), res.get("stack_frame_bytes", -1),
             res.get("spill_store_bytes", -1), time.perf_counter() - t0, ", cached" if kernel.cache_hit else "")
    step = CudaStep(sched.graph, plan, kernel, args, watchdog_s=opts.watchdog_s,
                    check_watchdog=opts.check_watchdog, graph_launch=opts.graph_launch)
    return step, sched
