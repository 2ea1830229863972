"""The callable a compilation returns: runs the decode step on its target."""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .config import Options
from .errors import FusecError
from .ir import Graph
from .pipeline import Dumper, lower
from .schedule import Schedule

log = logging.getLogger("fusec")


class CompiledStep:
    """Runs one captured decode step; the passes run at the first call (real inputs needed).

    Called with the flat inputs of the ATen graph (parameters lifted), it returns the list of
    graph outputs and updates KV caches and position counters in place. On ``target="cuda"``
    the outputs are the kernel's own buffers, overwritten by the next step (as with CUDA
    graphs): clone them to keep them.

    If lowering fails with a :class:`FusecError` at the first call (an op without a CUDA form,
    say), the step runs the captured ATen graph eagerly from then on, with one log line.
    """

    def __init__(self, aten_gm: torch.fx.GraphModule, g: Graph, opts: Options, dump: Dumper, target: str):
        self.aten_gm = aten_gm
        self.graph = g
        self.opts = opts
        self.dump = dump
        self.target = target
        self.schedule: Schedule | None = None
        self.engine: Callable[[list[Any]], list[torch.Tensor]] | None = None
        self.fallen_back = False

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        if self.fallen_back:
            return self.aten_gm(*args)
        if self.engine is None:
            try:
                self.engine = self._build(list(args))
            except FusecError as e:
                log.warning("fusec: running this graph eagerly: %s", e)
                self.fallen_back = True
                return self.aten_gm(*args)
        with torch.no_grad():
            return self.engine(list(args))

    def _build(self, args: list[Any]) -> Callable[[list[Any]], list[torch.Tensor]]:
        if self.target == "sim":
            from .sim import Simulator
            self.schedule = lower(self.graph, args, self.opts, self.dump)
            sim = Simulator(self.schedule, seed=self.opts.seed, check=self.opts.check_hazards)
            return lambda a: [o.clone() for o in sim.step(a)]
        from .gpu import build_cuda_step
        step, self.schedule = build_cuda_step(self.graph, args, self.opts, self.dump)
        return lambda a: step(*a)
