"""The ``torch.compile`` backend (entry point ``torch_dynamo_backends: fusec``).

``torch.compile(model, backend="fusec", options={...})``: a graph that is a single-token
decode step is captured to ATen and compiled for the target; any other graph (a prefill,
an op fusec cannot place, a target that is not available) goes to the fallback backend
with one log line saying why.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .capture import aten_capture, check_decode_step
from .compiled import CompiledStep
from .config import Options
from .errors import FallbackRequired
from .fallbacks import warn as warn_fallback
from .pipeline import Dumper, build_ir

def _target(example_inputs: list[Any], opts: Options) -> str:
    if opts.target:
        return opts.target
    devs = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    return "cuda" if "cuda" in devs else "sim"


def fusec_backend(gm: torch.fx.GraphModule, example_inputs: list[Any],
                  options: dict[str, Any] | None = None, **kwargs: Any) -> Callable:
    """Dynamo backend: compile ``gm`` with fusec, or fall back with one log line.

    Args:
        gm: the FX graph dynamo captured.
        example_inputs: dynamo's example inputs.
        options: see :class:`fusec.config.Options` (``target``, ``num_sms``, ``dump_dir`` ...).

    Raises:
        FusecError: only for invalid options; everything else falls back.
    """
    opts = Options.from_dict({**(options or {}), **kwargs})
    try:
        check_decode_step(gm)
        target = _target(example_inputs, opts)
        if target == "cuda" and not torch.cuda.is_available():
            raise FallbackRequired("target 'cuda' but no CUDA device is available")
        dump = Dumper(opts.dump_dir)

        def compiler(aten_gm: torch.fx.GraphModule, ex: list[Any]) -> Callable:
            return CompiledStep(aten_gm, build_ir(aten_gm, ex, dump), opts, dump, target)

        return aten_capture(gm, example_inputs, compiler)
    except FallbackRequired as e:
        warn_fallback("fusec: %s; using %s", e, opts.fallback)
        return fallback(gm, example_inputs, opts.fallback)


def fallback(gm: torch.fx.GraphModule, example_inputs: list[Any], kind: str) -> Callable:
    """Compile ``gm`` with inductor (when ``kind == 'inductor'`` and it works) or run it eagerly."""
    if kind == "inductor":
        try:
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        except Exception as e:  # inductor needs a C++ compiler; eager always works
            warn_fallback("fusec: inductor fallback failed (%s); running eagerly", type(e).__name__)
    return gm.forward
