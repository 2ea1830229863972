"""Warm start: a dynamo graph fusec captured before skips AOT autograd.

A cold compile lowers dynamo's graph to ATen with AOT autograd (``capture``: 2.1-2.6 s of the
Llama-3.2-1B's compile on the H200 machine, docs/compile-time.md) and builds fusec's IR from it.
Where AOT's runtime wrapping is the identity for that graph (:func:`aot_identity_problem` is
None), :func:`remember` stores the IR in the artifact cache under a key of the *dynamo* graph
(:func:`dynamo_key`); a later process with the same key gets the IR back from :func:`recall`
and builds the compiled step over dynamo's inputs directly: no AOT trace, no ``build_ir``. The
step's schedule and kernel then come from the artifact cache as in a cold process
(:mod:`fusec.cache.artifacts`).

AOT's wrapping is the identity when the ATen graph takes dynamo's inputs in dynamo's order
(nothing lifted, deduplicated or merged into a synthetic base: same count, shapes, strides and
dtypes), returns dynamo's outputs (same count, none of them an alias of an input or of
another output), keeps every input mutation inside the graph (``keep_inference_input_mutations``)
and adds no effect tokens or RNG state; grad mode off or no input requiring grad, no autocast.
Anything else, or an AOT version whose metadata does not say, keeps the full capture. The
one thing AOT's wrapper still does then, bumping the version counters of the inputs mutated
inside the graph (the KV cache, the position counters), the warm step does too
(:class:`WarmStep`).

**Key** (sha256): dynamo's graph code (its placeholder names carry each input's source, e.g.
``L_self_modules_model_..._parameters_weight_``), each input's type, shape, stride, dtype,
device type and ``requires_grad``, a digest of each ``get_attr`` constant, the global modes
AOT's tracing depends on (:func:`global_modes`: grad, inference and autocast modes, default
dtype and device, deterministic algorithms, matmul precision), and the versions and source
digest that key an artifact (:func:`fusec.cache.artifacts.artifact_key`). Weight values are
not in it: they are inputs.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from fusec.config import Options
from fusec.ir import Graph


#: the entry's ``kind``: an IR graph keyed by a dynamo graph (artifacts hold schedules)
KIND = "dynamo_ir"


def dynamo_key(gm: torch.fx.GraphModule, example_inputs: list[Any],
               symbolic: list[Any] | None = None, extra: Any = None) -> str | None:
    """The warm-start key of ``gm`` called with ``example_inputs``, or None: autocast on, an
    input that is not a static-shaped tensor (a SymInt, a symbolic size) unless ``symbolic``
    says which sizes are symbolic (:func:`fusec.frontend.symbolic.symbolic_dims`: those dims, a
    contiguous tensor's strides and the integer inputs are left out of the key, so that one key
    serves every cache length), or a graph module that holds parameters or buffers itself (AOT
    lifts them: no warm start). ``extra``: more JSON-able parts (options that change the IR)."""
    from fusec.cache.artifacts import tensor_digest, toolchain
    if any_autocast():
        # AOT runs such a graph with autocast off, and inside its forward compiler autocast
        # already reads off: no warm start under autocast at all
        return None
    inputs: list[Any] = []
    specs = symbolic if symbolic is not None else [None] * len(example_inputs)
    for x, spec in zip(example_inputs, specs):
        if spec == "int":
            inputs.append(["symint"])
            continue
        if isinstance(x, torch.SymInt) and x.node.maybe_as_int() is not None:
            x = x.node.maybe_as_int()   # a size dynamo specialized (HF's logits_to_keep=1)
        if isinstance(x, int) and not isinstance(x, bool) and symbolic is not None:
            inputs.append(["int", x])   # a graph's integer input whose value the graph's guards pin
            continue
        if spec and isinstance(x, torch.Tensor):   # a tensor with symbolic sizes
            layout = symbolic_layout(x)
            if layout is None:
                return None
            inputs.append([type(x).__name__, [-1 if i in spec else int(d) for i, d in enumerate(x.shape)],
                           layout, str(x.dtype), x.device.type, bool(x.requires_grad)])
            continue
        if not isinstance(x, torch.Tensor) or any(not isinstance(d, int) for d in (*x.shape, *x.stride())):
            return None
        inputs.append([type(x).__name__, list(x.shape), list(x.stride()), str(x.dtype), x.device.type,
                       bool(x.requires_grad)])
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        return None   # AOT lifts what the graph module holds: its wrapping is not the identity
    consts = sorted((n.target, tensor_digest(getattr(gm, n.target))) for n in gm.graph.nodes
                    if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Tensor))
    parts = {**toolchain(), "kind": KIND, "code": gm.code, "inputs": inputs, "consts": consts,
             "modes": global_modes(), "extra": extra}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def symbolic_layout(x: torch.Tensor) -> str | None:
    """The memory layout of a tensor with symbolic sizes, in words that hold at every length:
    ``"contiguous"``, ``"expanded:D,..."`` (a contiguous tensor broadcast along dims D with
    stride 0: HF's 4-D attention mask ``[1, 1, 1, L]`` expanded from a 2-D one), or None for any
    other layout (no warm-start key). Decided without installing a guard: ``x`` may be one of
    dynamo's fake tensors with symbolic strides, or a call's real tensor."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    if x.is_contiguous():
        return "contiguous"
    zero, expected = [], 1
    for i in reversed(range(x.dim())):
        size, stride = x.shape[i], x.stride(i)
        if statically_known_true(size == 1):
            continue   # any stride: a size-1 dim is never stepped over
        if statically_known_true(stride == 0):
            zero.append(i)
            continue
        if not statically_known_true(stride == expected):
            return None
        expected = expected * size
    return "expanded:" + ",".join(map(str, sorted(zero))) if zero else "contiguous"


def global_modes() -> dict[str, Any]:
    """The global state that can change the ATen graph AOT makes from one dynamo graph: grad,
    inference and autocast modes, the default dtype and device (tensors created without one),
    deterministic algorithms, fp32 matmul precision."""
    return {"grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
            "autocast": any_autocast(), "default_dtype": str(torch.get_default_dtype()),
            "default_device": str(torch.get_default_device()),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision()}


def any_autocast() -> bool:
    """Autocast on for any device type (``torch.is_autocast_enabled()`` alone asks CUDA only)."""
    try:
        return bool(torch._C._is_any_autocast_enabled())
    except AttributeError:   # an older or newer torch: ask the device types fusec runs on
        return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def _known_equal(x: Sequence[Any], y: Sequence[Any]) -> bool:
    """Whether two shapes or strides are equal, decided without installing a guard: a symbolic
    size or stride (dynamo's ``s72`` for the stride of a token view ``ids[:, -1:]`` of a growing
    ``ids``) that is not provably equal counts as different. Comparing with ``!=`` would add a
    guard pinning it to this call's value, and dynamo would then recompile at every step."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return len(x) == len(y) and all(statically_known_true(a == b) for a, b in zip(x, y))


def aot_identity_problem(gm: torch.fx.GraphModule, example_inputs: list[Any],
                         aten_gm: torch.fx.GraphModule, flat: list[Any]) -> str | None:
    """Why AOT's runtime wrapping of ``gm`` may not be the identity (see the module docstring),
    or None when it is. Called from AOT's forward compiler (``aten_gm``, ``flat``: its graph and
    flat inputs), where AOT's tracing context holds the graph's metadata."""
    if len(flat) != len(example_inputs):
        return f"AOT passes {len(flat)} inputs for dynamo's {len(example_inputs)} (lifted or deduplicated)"
    for i, (a, b) in enumerate(zip(flat, example_inputs)):
        if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)) \
                and not isinstance(a, bool) and not isinstance(b, bool):
            continue   # a symbolic size passed as an integer (the step drops it: Graph.skip_args)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"input {i} is not a tensor"
        if not (_known_equal(a.shape, b.shape) and a.dtype == b.dtype and _known_equal(a.stride(), b.stride())):
            return f"input {i} differs from dynamo's (a synthetic base?)"
    if torch.is_grad_enabled() and any(x.requires_grad for x in example_inputs):
        return "grad mode with inputs that require grad"
    if any_autocast():
        return "autocast (AOT runs the graph with autocast off)"
    meta = _aot_metadata()
    if meta is None:
        return "AOT's metadata is not available"
    try:
        from torch._functorch._aot_autograd.schemas import OutputType
        checks = {
            "outputs alias inputs or each other": any(o.output_type != OutputType.non_alias for o in meta.output_info),
            "input mutations outside the graph": meta.num_mutated_inp_runtime_indices != 0,
            "intermediate bases": meta.num_intermediate_bases != 0,
            "effect tokens": len(getattr(meta, "tokens", {}) or {}) != 0,
            "RNG state": bool(getattr(meta, "is_rng_op_functionalized", False))
            or getattr(meta, "num_graphsafe_rng_states", 0) != 0,
            "tensor subclasses": any(type(m).__name__ == "SubclassCreationMeta"
                                     for m in getattr(meta, "subclass_inp_meta", None) or ()),
            "a grad mode change": getattr(meta, "grad_enabled_mutation", None) is not None,
            "dynamic output sizes": bool(getattr(meta, "dynamic_outputs", False)),
        }
    except Exception as e:   # noqa: BLE001 - another AOT version: keep the full capture
        return f"AOT's metadata is not readable ({type(e).__name__})"
    bad = [what for what, yes in checks.items() if yes]
    if bad:
        return ", ".join(bad)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    n_dynamo = len(out) if isinstance(out, (list, tuple)) else 1
    n_aten = len(next(n for n in aten_gm.graph.nodes if n.op == "output").args[0])
    if not (n_dynamo == n_aten == len(meta.output_info)):
        return f"{n_aten} ATen outputs for dynamo's {n_dynamo}"
    return None


def mutated_inputs(example_inputs: list[Any]) -> list[int]:
    """The inputs whose version counter AOT's wrapper bumps after each call (mutated inside the
    graph and seen by autograd), from AOT's metadata in its forward compiler; the warm step
    bumps the same ones (:class:`WarmStep`)."""
    meta = _aot_metadata()
    return sorted(int(i) for i in getattr(meta, "mutated_graph_handled_indices_seen_by_autograd", ()) or ())


def _aot_metadata() -> Any:
    """AOT autograd's view-and-mutation metadata of the graph it is compiling (its tracing
    context's ``fw_metadata``), or None outside AOT's forward compiler."""
    ctx = torch._guards.TracingContext.try_get()
    return getattr(ctx, "fw_metadata", None) if ctx is not None else None


class WarmStep:
    """The compiled step of a warm start, called with dynamo's inputs: runs ``step`` and bumps the
    version counters of the inputs the step mutates, as AOT's runtime wrapper does."""

    def __init__(self, step: Any, bump: list[int]):
        self.step, self.bump = step, list(bump)

    def __call__(self, *args: Any) -> Any:
        out = self.step(*args)
        for i in self.bump:   # one tensor per call: the form every torch version takes
            torch.autograd.graph.increment_version(args[i])
        return out


def remember(key: str, g: Graph, bump: list[int], opts: Options) -> None:
    """Store the IR ``g`` (as ``build_ir`` made it) and the inputs whose versions the step bumps
    (:func:`mutated_inputs`) under the dynamo key ``key``."""
    from fusec.cache.artifacts import FORMAT, ArtifactCache
    cache = ArtifactCache.for_options(opts)
    if cache is not None:
        cache.store(key, {"format": FORMAT, "key": key, "kind": KIND, "graph": g, "bump": list(bump)})


def recall(key: str, opts: Options) -> tuple[Graph, list[int]] | None:
    """``(IR, inputs to bump)`` stored under ``key``, or None (no entry, or the cache off). The
    backend asks only without ``dump_dir`` (a dump runs every stage)."""
    from fusec.cache.artifacts import ArtifactCache
    cache = ArtifactCache.for_options(opts)
    if cache is None:
        return None
    art = cache.load(key, kind=KIND)
    if art is None or not isinstance(art.get("bump"), list):
        return None
    return art["graph"], art["bump"]
