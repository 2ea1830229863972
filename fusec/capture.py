"""Capture: dynamo FX graph -> AOT autograd (inference, functionalized) -> core ATen.

Input mutations stay in the graph (``keep_inference_input_mutations``) so that KV-cache writes
and position counters remain in-place writes of the caller's tensors. SDPA is swapped for
``fusec::sdpa`` first (see :mod:`fusec.custom_ops`) so attention stays one node.
"""
from __future__ import annotations

import copy
import logging
import re
from typing import Any, Callable

import torch
from torch._decomp import core_aten_decompositions
from torch._functorch.aot_autograd import aot_module_simplified

from .custom_ops import SDPA_TARGETS, rewrite_sdpa
from .errors import NotDecodeStepError

log = logging.getLogger("fusec.capture")

_IGNORED_CALLS = ("_log_api_usage_once",)


def node_source(node: torch.fx.Node) -> str:
    """``file:line code`` of the innermost model frame recorded for an FX node, or ''."""
    st = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)', st)
    if not frames:
        return ""
    f, line, code = frames[-1]
    return f"{f.split('/')[-1]}:{line} {code.strip()}"


def _val(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def check_decode_step(gm: torch.fx.GraphModule) -> None:
    """Raise :class:`NotDecodeStepError` unless every attention call sees one query token.

    A decode step (batch 1, one new token) has at least one SDPA call whose query is
    [1, heads, 1, head_dim]; a prefill has more than one query position.
    """
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            q = _val(node.args[0] if node.args else node.kwargs.get("query"))
            if q is None:
                continue
            n += 1
            if q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != 1:
                raise NotDecodeStepError(
                    f"not a single-token decode step: attention query has shape {tuple(q.shape)} "
                    f"(batch and query length must be 1) at {node_source(node) or node.name}")
    if n == 0:
        raise NotDecodeStepError("not a decode step: the graph has no attention call")


def strip_ignored_calls(gm: torch.fx.GraphModule) -> None:
    """Remove side-effect-only calls such as ``_log_api_usage_once`` from a dynamo graph."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and getattr(node.target, "__name__", "") in _IGNORED_CALLS:
            if not node.users:
                gm.graph.erase_node(node)
    gm.recompile()


def aten_capture(gm: torch.fx.GraphModule, example_inputs: list[Any],
                 compiler: Callable[[torch.fx.GraphModule, list[Any]], Callable]) -> Callable:
    """Lower a dynamo graph to core ATen with AOT autograd and hand it to ``compiler``.

    Args:
        gm: the graph dynamo captured (left unmodified; a copy is rewritten).
        example_inputs: dynamo's example inputs.
        compiler: called as ``compiler(aten_gm, flat_example_inputs)``; returns the callable
            that runs the step on the flat inputs (parameters lifted to inputs).

    Returns the AOT-wrapped callable taking dynamo's inputs.
    Errors raised by ``compiler`` propagate unchanged.
    """
    gm2 = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    strip_ignored_calls(gm2)
    rewrite_sdpa(gm2)
    return aot_module_simplified(gm2, example_inputs, fw_compiler=compiler,
                                 decompositions=core_aten_decompositions(),
                                 keep_inference_input_mutations=True)
