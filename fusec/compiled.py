"""The callable a compilation returns: runs the decode step on its target."""
from __future__ import annotations

import logging
from typing import Any

import torch

from .config import Options
from .errors import FusecError
from .ir import Graph
from .pipeline import Dumper, lower
from .schedule import Schedule
from .sim import Simulator

log = logging.getLogger("fusec")


class CompiledStep:
    """Runs one captured decode step; the passes run at the first call (real inputs needed).

    Called with the flat inputs of the ATen graph (parameters lifted), it returns the list of
    graph outputs and updates KV caches and position counters in place.

    If lowering fails with a :class:`FusecError` at the first call, the step falls back to
    running the captured ATen graph eagerly, with one log line.
    """

    def __init__(self, aten_gm: torch.fx.GraphModule, g: Graph, opts: Options, dump: Dumper):
        self.aten_gm = aten_gm
        self.graph = g
        self.opts = opts
        self.dump = dump
        self.schedule: Schedule | None = None
        self.sim: Simulator | None = None
        self.fallen_back = False

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        if self.fallen_back:
            return self.aten_gm(*args)
        if self.schedule is None:
            try:
                self.schedule = lower(self.graph, list(args), self.opts, self.dump)
            except FusecError as e:
                log.warning("fusec: running this graph eagerly: %s", e)
                self.fallen_back = True
                return self.aten_gm(*args)
            self.sim = Simulator(self.schedule, seed=self.opts.seed, check=self.opts.check_hazards)
        with torch.no_grad():
            outs = self.sim.step(list(args))
        return [o.clone() for o in outs]
