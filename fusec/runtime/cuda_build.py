"""A CUDA step from an IR graph: lowered through the artifact cache, rendered, compiled by NVRTC
(:mod:`fusec.cuda.build`) and loaded onto the GPU of its inputs (stage ``load``)."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from fusec.config import Options
from fusec.cuda.build import jit_plan, jit_started
from fusec.ir import Graph
from fusec.ir.schedule import Schedule
from fusec.pipeline import Dumper
from fusec.runtime.artifacts import lowered

if TYPE_CHECKING:
    from fusec.runtime.cuda_step import CudaStep

log = logging.getLogger("fusec")


def build_cuda_step(g: Graph, args: list[Any], opts: Options, dump: Dumper) -> tuple["CudaStep", Schedule]:
    """Compile ``g`` for the GPU of its inputs; ``num_sms`` defaults to that GPU's SM count.

    Raises:
        FallbackRequired: an op has no CUDA form; JitError: NVRTC failed; CudaError, FusecError.
    """
    dev = next(a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if opts.num_sms is None:
        opts = dataclasses.replace(opts, num_sms=sms)
    jit: list[Callable[[], Any]] = []   # NVRTC started as soon as the kernel is rendered
    sched, plan = lowered(g, args, opts, dump, codegen=True, rendered=lambda p: jit.append(jit_started(p)))
    kernel = jit[0]() if jit else jit_plan(plan)
    t0 = time.perf_counter()
    from fusec.runtime.cuda_step import CudaStep   # loads the CUDA driver bindings
    step = CudaStep(sched.graph, plan, kernel, args, watchdog_s=opts.watchdog_s,
                    check_watchdog=opts.check_watchdog, graph_launch=opts.graph_launch)
    log.info("stage %-13s CUDA module, %d buffers, %d instructions on %d SMs  (%.2f s)", "load",
             len(plan.buffers), len(sched.instrs), plan.num_sms, time.perf_counter() - t0)
    return step, sched
