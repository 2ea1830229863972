"""Compile a model for one decode step outside ``torch.compile`` (used by the CLI).

:func:`compile_model` captures ``model(*args, **kwargs)`` once with dynamo, lowers it with
the fusec pipeline and returns a :class:`CompileResult` holding the fused graph and the
schedule. The model runs once eagerly during capture (so its KV cache advances one step).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch

from fusec.frontend.capture import aten_capture, check_decode_step
from fusec.frontend import hf_rope
from fusec.frontend.counters import counters_specialized
from fusec.config import Options
from fusec.errors import CaptureError, FusecError, SimulationMismatchError
from fusec.ir import Graph, Role
from fusec.pipeline import Dumper, build_ir
from fusec.ir.schedule import Schedule
from fusec.sim import Simulator

log = logging.getLogger("fusec")

NUMERIC_SIM_MAX_BYTES = 256 << 20

#: ``--simulate`` numeric check: largest relative error ``||sim - eager|| / ||eager||`` allowed
#: per tensor, by the model's lowest floating precision (weights and KV caches). fp32: the
#: tests' bound. bf16 / fp16: the simulator and eager round intermediates to 16 bits at
#: different points (a fused instruction keeps fp32 where eager rounds), a few units of roundoff
#: (2**-8 = 3.9e-3 in bf16, 2**-11 = 4.9e-4 in fp16) that add up over the layers: random bf16
#: Llamas of 2 to 24 layers measured 6e-3 to 1.2e-2 (fp16: 1e-3). 5e-2 (bf16; the GPU tests'
#: bound) and 1e-2 (fp16) leave room for deeper models and still fail a wrong semantic (a wrong
#: weight, a lost or misplaced write, an offset), whose error is of order 1.
SIM_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


class CompileResult:
    """A compiled decode step: the fused IR, its schedule and a summary."""

    def __init__(self, schedule: Schedule, opts: Options, simulated: str | None, plan: Any = None,
                 kernel: Any = None):
        self.schedule = schedule
        self.opts = opts
        self.simulated = simulated
        self.kernel = kernel   # fusec.cuda.jit.CompiledKernel with emit_cuda
        self.cuda_source: str | None = plan.source if plan is not None else None

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
        s["fused_ops_by_kind"] = self.graph.count_kinds(members=False)
        s["layer_balance"] = self.schedule.layer_balance()
        s["simulated"] = self.simulated
        return s

    def format_summary(self) -> str:
        s = self.summary()
        mb = 1 / (1 << 20)
        g = self.graph
        b, k = g.batch(), g.query_tokens()
        lines = [f"step: {b} sequence{'s' if b != 1 else ''} of {k} query token{'s' if k != 1 else ''}"]
        if self.opts.query_tokens > k:   # the option is a bound: the captured inputs decide K
            lines[0] += (f" (option query_tokens={self.opts.query_tokens} is the most a step takes; "
                         f"the inputs build() returned give {k}: pass input_ids of "
                         f"{self.opts.query_tokens} tokens for a {self.opts.query_tokens}-token step)")
        lines.append("fused ops by kind:")
        lines += [f"  {k:<22} {v}" for k, v in s["fused_ops_by_kind"].items()]
        if any(k.startswith(("aten.", "prims.")) for k in s["fused_ops_by_kind"]):
            lines.append("  (aten.* / prims.*: ops outside the fused kinds, each run by its generated CUDA "
                         "form, e.g. a StaticCache's position-counter copy_ per layer)")
        lines.append(f"instructions: {s['instructions']} on {self.schedule.num_sms} SMs, "
                     f"{s['waits']} counter waits")
        lines += [f"  {k:<22} {v}" for k, v in s["instructions_by_kind"].items()]
        b = s["sm_bytes"]
        lines.append(f"bytes per SM: min {b['min'] * mb:.2f} MiB, median {b['median'] * mb:.2f} MiB, "
                     f"max {b['max'] * mb:.2f} MiB (total {s['total_bytes'] * mb:.1f} MiB)")
        lines.append(f"per-layer balance (max/mean bytes over SMs): worst {s['layer_balance_max']:.3f}, "
                     f"mean {s['layer_balance_mean']:.3f}")
        read = " (the option bandwidth; its default is an H200's measured read bandwidth)" \
            if self.opts.bandwidth == Options().bandwidth else " (the option bandwidth)"
        lines.append(f"predicted step time at {self.opts.bandwidth / 1e12:.1f} TB/s{read}: "
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
        options: ``num_sms``, ``numeric_limit_bytes`` (default 256 MiB of weights),
            ``simulate`` (run one simulated step, compared with eager if the
            weights are under 256 MiB, else structure-only), ``dump_dir``/``out_dir`` and any
            :class:`fusec.config.Options` key.

    With ``simulate`` and weights under :data:`NUMERIC_SIM_MAX_BYTES`, the KV caches and
    counters are copied before the capture's eager run, and :func:`simulate_step` compares the
    simulated step with eager on that pre-step state.

    Raises:
        NotDecodeStepError, UnsupportedOpError, CaptureError, DeadlockError, HazardError,
        SimulationMismatchError.
    """
    options = dict(options or {})
    simulate = bool(options.pop("simulate", False))
    numeric_limit = int(options.pop("numeric_limit_bytes", NUMERIC_SIM_MAX_BYTES))
    emit_cuda = bool(options.pop("emit_cuda", False))
    options.pop("out_dir", None)   # the CLI writes its files itself
    if not options.get("dump_dir"):
        options.pop("dump_dir", None)
    opts = Options.from_dict(options)
    dump = Dumper(opts.dump_dir)
    found: list[tuple] = []

    def backend(gm, example_inputs, **_):
        check_decode_step(gm, opts.query_tokens)

        def compiler(aten_gm, ex):
            g = build_ir(aten_gm, ex, dump)

            def run(*flat):
                if not found:
                    # the eager run below writes the KV caches and counters in place: keep
                    # their pre-step values for the simulator's numeric check
                    pre = None
                    if simulate and weight_bytes(g) <= numeric_limit:
                        mut = set(mutated_inputs(g))
                        pre = [a.detach().clone() if n in mut else a for n, a in zip(g.inputs, flat)]
                    found.append((g, aten_gm, list(flat), pre))
                return aten_gm(*flat)
            return run
        return aten_capture(gm, example_inputs, compiler)

    hf_rope.install()   # HF's dynamic/longrope RoPE updates as one graph (fullgraph=True below)
    torch._dynamo.reset()
    try:
        with torch.no_grad(), counters_specialized():   # one call: its counters' values
            torch.compile(model, backend=backend, fullgraph=True)(*args, **(kwargs or {}))
    except FusecError:
        raise
    except Exception as e:  # dynamo wraps backend errors; surface ours
        inner = e
        while inner is not None and not isinstance(inner, FusecError):
            inner = inner.__cause__ or inner.__context__
        if inner is not None:
            raise inner from None
        raise CaptureError(f"could not capture the model as one graph: {_capture_failure(e)}") from e
    finally:
        torch._dynamo.reset()
    if not found:
        raise CaptureError("the model call produced no graph to compile")
    g, aten_gm, flat, pre = found[0]
    from fusec.cache.artifacts import compile_graph
    made = compile_graph(g, flat, opts, dump, target="cuda" if emit_cuda else "sim")
    simulated = None
    if simulate:   # beside NVRTC, with emit_cuda (it compiles on a thread)
        simulated = simulate_step(g, aten_gm, pre, made.schedule, opts.seed, numeric_limit)
    return CompileResult(made.schedule, opts, simulated, made.plan, made.kernel() if made.kernel else None)


def _capture_failure(e: BaseException) -> str:
    """What dynamo's error ``e`` says in one line: its first line, the root cause of its chain
    (dynamo's first line is often generic: "RuntimeError when making fake tensor call") and the
    innermost frame of the user's code outside torch that it names ("from user code:")."""
    text = str(e)
    parts = [f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"]
    root, seen = e, {id(e)}
    while (root.__cause__ or root.__context__) is not None and id(root.__cause__ or root.__context__) not in seen:
        root = root.__cause__ or root.__context__
        seen.add(id(root))
    if root is not e and str(root) and str(root).splitlines()[0] not in parts[0]:
        parts.append(f"caused by {type(root).__name__}: {str(root).splitlines()[0]}")
    frames = [f for f in re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', text)
              if f"{os.sep}torch{os.sep}" not in f[0]]
    if frames:
        path, line, code = frames[-1]
        parts.append(f"at {os.path.basename(path)}:{line} ({code.strip()})")
    return "; ".join(parts)


def weight_bytes(g: Graph) -> int:
    """Bytes of the graph's weights (its WEIGHT inputs)."""
    return sum(t.nbytes for t in g.tensors.values() if t.role == Role.WEIGHT)


def mutated_inputs(g: Graph) -> list[str]:
    """Graph inputs that the step writes in place (KV caches, position counters), in input order."""
    written = {g.root(t) for op in g.ops for slot, t in op.outputs.items() if slot in op.mutates}
    return [n for n in g.inputs
            if g.tensors[n].role in (Role.KV_CACHE, Role.STATE) or g.root(n) in written]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f}" if n >= 10 << 20 else f"{n / (1 << 20):.2g}"


def _tolerance(g: Graph) -> float:
    dts = {t.dtype for t in g.tensors.values()
           if t.role in (Role.WEIGHT, Role.KV_CACHE) and t.dtype.is_floating_point}
    return max((SIM_TOLERANCE.get(d, 5e-2) for d in dts), default=SIM_TOLERANCE[torch.float32])


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ``||a - b|| / ||b||`` (fp64; absolute when ``b`` is 0) for floating
    tensors, NaN when ``a`` has NaN or Inf that ``b`` has not; the number of differing
    elements for integer and bool tensors."""
    if not b.dtype.is_floating_point:
        return float((a.reshape(b.shape) != b).sum().item())
    a, b = a.detach().reshape(b.shape).double(), b.detach().double()
    bad_a, bad_b = ~torch.isfinite(a), ~torch.isfinite(b)
    if bad_a.any() or bad_b.any():
        if not torch.equal(bad_a, bad_b) or not torch.equal(a[bad_a], b[bad_b]):
            return float("nan")
        a, b = a[~bad_a], b[~bad_b]
    diff, ref = (a - b).norm().item(), b.norm().item()
    return diff / ref if ref > 0 else diff


def simulate_step(g: Graph, aten_gm: Any, pre: list[Any] | None, sched: Schedule, seed: int,
                  numeric_limit: int = NUMERIC_SIM_MAX_BYTES) -> str:
    """Run one step of ``sched`` in the simulator; returns the summary's simulator line.

    With ``pre`` (the flat inputs before any step ran; given when the weights fit
    :data:`NUMERIC_SIM_MAX_BYTES`) the step is numeric: the captured ATen graph ``aten_gm`` and
    the simulator each run on their own copy of the pre-step KV caches and counters, and every
    graph output and every written input buffer must agree within :data:`SIM_TOLERANCE` (for a
    written buffer, over the elements either run changed). Without ``pre``: structure only.

    Raises:
        DeadlockError, HazardError: the schedule is broken.
        SimulationMismatchError: a value differs; the message names the tensor and the error.
    """
    if pre is None:
        wbytes = weight_bytes(g)
        log.info("simulating one step (structure only)")
        Simulator(sched, seed=seed, numeric=False).step(None)
        return (f"one step structure only: the model has {_mib(wbytes)} MiB of weights, over the "
                f"{_mib(numeric_limit)} MiB numeric limit (--numeric-limit-mib); values were not compared; "
                "no deadlock, no hazard")
    log.info("simulating one step (numeric, against eager)")
    mut = mutated_inputs(g)
    index = {n: i for i, n in enumerate(g.inputs)}

    def fresh() -> list[Any]:
        own = set(index[n] for n in mut)
        return [a.clone() if i in own else a for i, a in enumerate(pre)]

    with torch.no_grad():
        ref_in = fresh()
        ref_out = aten_gm(*ref_in)
        ref_out = list(ref_out) if isinstance(ref_out, (list, tuple)) else [ref_out]
        sim_in = fresh()
        sim_out = Simulator(sched, seed=seed, numeric=True).step(sim_in)
    if len(sim_out) != len(ref_out):
        raise SimulationMismatchError(f"simulator: the step returned {len(sim_out)} outputs, eager "
                                      f"{len(ref_out)}", [])
    tol = _tolerance(g)
    checked: list[dict] = []
    for i, (name, a, b) in enumerate(zip(g.outputs, sim_out, ref_out)):
        checked.append({"what": f"output {i}", "name": name, "sim": a, "ref": b})
    sg = sched.graph    # its ops know their decoder layer
    layer = {sg.root(t): op.layer for op in sg.ops for slot, t in op.outputs.items()
             if slot in op.mutates and op.layer is not None}
    for n in mut:
        i = index[n]
        a, b, p = sim_in[i], ref_in[i], pre[i]
        changed = (a != p) | (b != p)       # NaN != NaN: a NaN either run left is compared
        lay = f" of layer {layer[n]}" if n in layer else ""
        checked.append({"what": f"written buffer{lay}", "name": n, "sim": a[changed], "ref": b[changed],
                        "written": int(changed.sum().item())})
    bad, worst = [], 0.0
    for c in checked:
        t = g.tensors[c["name"]]
        err = _error(c["sim"], c["ref"])
        exact = not t.dtype.is_floating_point
        ok = err == 0 if exact else err < tol
        if not exact:
            worst = max(worst, err) if err == err else worst
        if not ok:
            dt = str(t.dtype).replace("torch.", "")
            where = f", over the {c['written']} elements either run wrote" if "written" in c else ""
            how = (f"{int(err)} of {c['ref'].numel()} elements differ" if exact
                   else f"relative error {err:.3g} (tolerance {tol:g}{where})")
            shape = ",".join(map(str, t.shape))
            bad.append({"name": c["name"], "role": t.role.value, "shape": tuple(t.shape), "dtype": dt,
                        "error": err, "tolerance": 0 if exact else tol,
                        "text": f"{c['what']} {c['name']} ({t.role.value}, {dt}[{shape}]): {how}"})
    if bad:
        lines = [b.pop("text") for b in bad]
        more = f" (and {len(bad) - 1} more: {', '.join(b['name'] for b in bad[1:4])}{', ...' * (len(bad) > 4)})" \
            if len(bad) > 1 else ""
        msg = "\n".join([f"simulator disagrees with eager: {lines[0]}{more}; the simulated step's values "
                         "are wrong (an instruction's semantics or the schedule)", *lines[1:]])
        raise SimulationMismatchError(msg, bad)
    n_out = len(g.outputs)
    return (f"one step numeric: {n_out} output{'s' * (n_out != 1)} and {len(mut)} written buffer"
            f"{'s' * (len(mut) != 1)} match eager (max rel err {worst:.2g}, tolerance {tol:g}); "
            "no deadlock, no hazard")
