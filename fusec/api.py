"""Compile a model for one decode step outside ``torch.compile`` (used by the CLI).

:func:`compile_model` captures ``model(*args, **kwargs)`` once with dynamo, lowers it with
the fusec pipeline and returns a :class:`CompileResult` holding the fused graph and the
schedule. The model runs once eagerly during capture (so its KV cache advances one step).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from .capture import aten_capture, check_decode_step
from .config import Options
from .errors import CaptureError, FusecError
from .ir import Graph
from .pipeline import Dumper, build_ir, lower
from .schedule import Schedule
from .sim import Simulator

log = logging.getLogger("fusec")

NUMERIC_SIM_MAX_BYTES = 256 << 20


class CompileResult:
    """A compiled decode step: the fused IR, its schedule and a summary."""

    def __init__(self, schedule: Schedule, opts: Options, simulated: str | None):
        self.schedule = schedule
        self.opts = opts
        self.simulated = simulated
        self.kernel = None   # fusec.jit.CompiledKernel after emit_cuda()
        self.cuda_source: str | None = None

    def emit_cuda(self) -> None:
        """Render the megakernel and compile it with NVRTC for sm_90a (no GPU needed).

        Raises:
            FallbackRequired: an op has no CUDA form; JitError: NVRTC failed.
        """
        from .codegen import render
        from .jit import compile_cuda
        plan = render(self.schedule, defines=self.opts.defines)
        self.cuda_source = plan.source
        self.kernel = compile_cuda(plan.source, "fusec_step.cu")

    @property
    def graph(self) -> Graph:
        return self.schedule.graph

    def graph_text(self) -> str:
        """The fused op graph, one op per line (see docs/ir.md)."""
        return self.graph.dump()

    def schedule_json(self) -> dict[str, Any]:
        """Per-SM queues, instructions, counters and buffers (JSON-serializable)."""
        return self.schedule.to_json()

    def summary(self) -> dict[str, Any]:
        s = self.schedule.summary(self.opts.bandwidth)
        s["fused_ops_by_kind"] = self.graph.count_kinds()
        s["layer_balance"] = self.schedule.layer_balance()
        s["simulated"] = self.simulated
        return s

    def format_summary(self) -> str:
        s = self.summary()
        mb = 1 / (1 << 20)
        lines = ["fused ops by kind:"]
        lines += [f"  {k:<22} {v}" for k, v in s["fused_ops_by_kind"].items()]
        lines.append(f"instructions: {s['instructions']} on {self.schedule.num_sms} SMs, "
                     f"{s['waits']} counter waits")
        lines += [f"  {k:<22} {v}" for k, v in s["instructions_by_kind"].items()]
        b = s["sm_bytes"]
        lines.append(f"bytes per SM: min {b['min'] * mb:.2f} MiB, median {b['median'] * mb:.2f} MiB, "
                     f"max {b['max'] * mb:.2f} MiB (total {s['total_bytes'] * mb:.1f} MiB)")
        lines.append(f"per-layer balance (max/mean bytes over SMs): worst {s['layer_balance_max']:.3f}, "
                     f"mean {s['layer_balance_mean']:.3f}")
        lines.append(f"predicted step time at {self.opts.bandwidth / 1e12:.1f} TB/s: "
                     f"{s['predicted_ms_at_bandwidth'] * 1e3:.3g} us (all bytes), "
                     f"{s['predicted_ms_busiest_sm'] * 1e3:.3g} us (busiest SM)")
        if self.simulated:
            lines.append(f"simulator: {self.simulated}")
        if self.kernel is not None:
            r = self.kernel.resources.get("fusec_step", {})
            lines.append(f"kernel fusec_step (sm_90a, NVRTC {'.'.join(map(str, self.kernel.nvrtc_version))}): "
                         f"{r.get('registers')} registers, {r.get('stack_frame_bytes')} B stack frame, "
                         f"{r.get('spill_store_bytes')} B spill stores, {r.get('spill_load_bytes')} B spill loads, "
                         f"{r.get('smem_bytes')} B static shared memory, {len(self.cuda_source.splitlines())} lines of CUDA")
        return "\n".join(lines) + "\n"


def compile_model(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
                  options: dict[str, Any] | None = None) -> CompileResult:
    """Capture one decode step of ``model`` and compile it.

    Args:
        model: an ``nn.Module`` (e.g. HF ``LlamaForCausalLM``).
        args, kwargs: one decode step's inputs (batch 1, one token, a static KV cache).
        options: ``num_sms``, ``simulate`` (run one simulated step, numeric if the weights
            are under 256 MiB, else structure-only), ``dump_dir``/``out_dir`` and any
            :class:`fusec.config.Options` key.

    Raises:
        NotDecodeStepError, UnsupportedOpError, CaptureError, DeadlockError, HazardError.
    """
    options = dict(options or {})
    simulate = bool(options.pop("simulate", False))
    emit_cuda = bool(options.pop("emit_cuda", False))
    out_dir = options.pop("out_dir", None)
    if not options.get("dump_dir"):
        options.pop("dump_dir", None)
    opts = Options.from_dict(options)
    dump = Dumper(opts.dump_dir)
    found: list[tuple] = []

    def backend(gm, example_inputs, **_):
        check_decode_step(gm)

        def compiler(aten_gm, ex):
            g = build_ir(aten_gm, ex, dump)

            def run(*flat):
                if not found:
                    found.append((g, list(flat)))
                return aten_gm(*flat)
            return run
        return aten_capture(gm, example_inputs, compiler)

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend, fullgraph=True)(*args, **(kwargs or {}))
    except FusecError:
        raise
    except Exception as e:  # dynamo wraps backend errors; surface ours
        inner = e
        while inner is not None and not isinstance(inner, FusecError):
            inner = inner.__cause__ or inner.__context__
        if inner is not None:
            raise inner from None
        raise CaptureError(f"could not capture the model as one graph: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from e
    finally:
        torch._dynamo.reset()
    if not found:
        raise CaptureError("the model call produced no graph to compile")
    g, flat = found[0]
    log.info("captured: %d ATen ops, %d inputs", len(g.ops), len(g.inputs))
    sched = lower(g, flat, opts, dump)
    simulated = None
    if simulate:
        wbytes = sum(t.nbytes for t in g.tensors.values() if t.role.value == "weight")
        numeric = wbytes <= NUMERIC_SIM_MAX_BYTES
        log.info("simulating one step (%s)", "numeric" if numeric else "structure only")
        sim = Simulator(sched, seed=opts.seed, numeric=numeric)
        with torch.no_grad():
            sim.step(flat if numeric else None)
        simulated = f"one step {'numeric' if numeric else 'structure-only'}: no deadlock, no hazard"
    result = CompileResult(sched, opts, simulated)
    if emit_cuda:
        result.emit_cuda()
    return result
