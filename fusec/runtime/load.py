"""Stage ``load``: what the compile stages made (a schedule; for the GPU its kernel's plan and
CUBIN), ready to run: the CPU simulator over the schedule, or the CUDA module and the step's
device state on the GPU of its inputs (:class:`~fusec.runtime.cuda_step.CudaStep`)."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from fusec.config import Options
from fusec.ir.schedule import Schedule

if TYPE_CHECKING:
    from fusec.cuda.codegen import KernelPlan
    from fusec.cuda.jit import CompiledKernel
    from fusec.runtime.cuda_step import CudaStep

log = logging.getLogger("fusec")


def simulator(sched: Schedule, opts: Options) -> Callable[[list[Any]], list[torch.Tensor]]:
    """The step on the CPU simulator: a function of the flat inputs returning fresh outputs."""
    from fusec.sim import Simulator
    t0 = time.perf_counter()
    sim = Simulator(sched, seed=opts.seed, check=opts.check_hazards)
    log.info("stage %-13s simulator, %d instructions on %d SMs  (%.2f s)", "load",
             len(sched.instrs), sched.num_sms, time.perf_counter() - t0)
    return lambda a: [o.clone() for o in sim.step(a)]


def cuda_step(sched: Schedule, plan: "KernelPlan", kernel: "CompiledKernel", args: list[Any],
              opts: Options) -> "CudaStep":
    """The step's CUDA module loaded onto the GPU of ``args``, with its device state.

    Raises:
        CudaError, FusecError."""
    t0 = time.perf_counter()
    from fusec.runtime.cuda_step import CudaStep   # loads the CUDA driver bindings
    step = CudaStep(sched.graph, plan, kernel, args, watchdog_s=opts.watchdog_s,
                    check_watchdog=opts.check_watchdog, graph_launch=opts.graph_launch)
    log.info("stage %-13s CUDA module, %d buffers, %d instructions on %d SMs  (%.2f s)", "load",
             len(plan.buffers), len(sched.instrs), plan.num_sms, time.perf_counter() - t0)
    return step
