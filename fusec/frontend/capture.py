"""Capture: dynamo FX graph -> AOT autograd (inference, functionalized) -> core ATen.

Input mutations stay in the graph (``keep_inference_input_mutations``) so that KV-cache writes
and position counters remain in-place writes of the caller's tensors. SDPA is swapped for
``fusec::sdpa`` first (see :mod:`fusec.frontend.custom_ops`) so attention stays one node.
"""
from __future__ import annotations

import copy
import functools
import logging
import operator
import re
import time
from typing import Any, Callable

import torch
from torch._decomp import core_aten_decompositions

from fusec.frontend.custom_ops import SDPA_TARGETS, rewrite_sdpa
from fusec.frontend.eager_attention import find_eager_attention, rewrite_eager_attention, softmaxes
from fusec.config import MAX_QUERY_ROWS, MAX_QUERY_TOKENS
from fusec.errors import BatchSizeVaries, NotDecodeStepError

log = logging.getLogger("fusec.frontend.capture")
stage_log = logging.getLogger("fusec")

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


#: ``GraphModule.meta`` key of a specialized graph's concrete sizes (:func:`concrete_sizes`)
CONCRETE_SIZES = "fusec_concrete_sizes"


def concrete_sizes(placeholders: list[torch.fx.Node], args: Any) -> dict[Any, int]:
    """Each symbol of dynamo's recorded input sizes (a placeholder's tensor dim, or an integer
    placeholder, that varied between calls: ``s0``) mapped to its value in ``args``, one call's
    inputs in placeholder order; sizes that are expressions of symbols are left out."""
    sizes: dict[Any, int] = {}
    for node, a in zip(placeholders, args):
        v = _val(node)
        if isinstance(v, torch.Tensor) and isinstance(a, torch.Tensor) and v.dim() == a.dim():
            pairs = zip(v.shape, a.shape)
        elif isinstance(v, torch.SymInt) and isinstance(a, (int, torch.SymInt)):
            pairs = [(v, a)]
        else:
            continue
        for d, n in pairs:
            if isinstance(d, torch.SymInt) and d.node.expr.is_symbol:
                sizes[d.node.expr] = int(n)
    return sizes


def _concrete(d: Any, sizes: dict[Any, int]) -> Any:
    """``d`` (a recorded size) as an int where it is one, where dynamo specialized its symbol to
    a constant, or where its symbols have values in ``sizes``; else the symbolic size."""
    if not isinstance(d, torch.SymInt):
        return d
    known = d.node.maybe_as_int()
    if known is not None:
        return known
    if not sizes:
        return d
    v = d.node.expr.xreplace(sizes)
    return int(v) if isinstance(v, int) or v.is_number else d


def check_decode_step(gm: torch.fx.GraphModule, query_tokens: int = 1) -> None:
    """Raise :class:`NotDecodeStepError` unless every attention call sees a fixed number of query
    tokens per sequence, at most ``query_tokens`` (the option of that name, at most
    :data:`fusec.config.MAX_QUERY_TOKENS`), and reads a static KV cache.

    A decode step (a batch of B sequences, K new tokens each: K = 1, or speculative decoding's
    verification of K draft tokens) has at least one SDPA call, or eager attention that
    :func:`fusec.frontend.eager_attention.rewrite_eager_attention` makes one, whose query is
    [B, heads, K, head_dim] with B and K fixed sizes (docs/batch.md says which kinds take B * K
    > 1 rows and which ops then stay generic); a prefill has more query positions, and a batch
    size or a query length that varies between calls (a symbolic dim 0 or 2) is refused
    (:class:`~fusec.errors.BatchSizeVaries` where only the batch size varies: the backend then
    compiles one step per batch size), as is a
    step of more than :data:`fusec.config.MAX_QUERY_ROWS` rows B * K (more than 16 sequences of
    one token, or fewer of K > 1 tokens: no fused kind takes them, every op would run generic on
    one SM).
    A key that is a ``torch.cat`` of the past keys and the new one (HF ``DynamicCache``) changes
    shape every step: the message says to use a StaticCache. Eager attention that is not SDPA
    (its weights returned): the message says why, at the model's source line.
    """
    eager, refused = find_eager_attention(gm)
    if refused:
        r = refused[0]
        raise NotDecodeStepError(f"{r.reason} at {node_source(r.node) or r.node.name}: {r.hint}")
    calls = [(node, node.args[0] if node.args else node.kwargs.get("query"),
              node.args[1] if len(node.args) > 1 else node.kwargs.get("key"))
             for node in gm.graph.nodes if node.op == "call_function" and node.target in SDPA_TARGETS]
    calls += [(a.out, a.query, a.key) for a in eager]
    sizes = getattr(gm, "meta", {}).get(CONCRETE_SIZES) or {}   # a graph specialized to one call's sizes
    n = 0
    varies: BatchSizeVaries | None = None   # raised after every other check passed
    batch_symbols: set[Any] = set()
    for node, query, _ in calls:
        q = _val(query)
        if q is None:
            continue
        n += 1
        shape = [_concrete(d, sizes) for d in q.shape]
        if len(shape) != 4 or not isinstance(shape[0], int) or not isinstance(shape[2], int) \
                or not 1 <= shape[2] <= query_tokens or shape[0] * shape[2] > MAX_QUERY_ROWS:
            text = ", ".join(str(d) if isinstance(d, int) else f"{d} (varies between calls)" for d in shape)
            what = (f"a {len(shape)}-D query" if len(shape) != 4 else
                    "a query length that varies" if not isinstance(shape[2], int) else
                    "a batch size that varies" if not isinstance(shape[0], int) else
                    f"{shape[0]} sequences, more than {MAX_QUERY_ROWS}" if shape[2] == 1 else
                    f"{shape[0]} sequences of {shape[2]} query tokens, {shape[0] * shape[2]} rows, more "
                    f"than {MAX_QUERY_ROWS}" if shape[2] <= query_tokens else
                    f"{shape[2]} query tokens, more than {query_tokens}" +
                    ("" if query_tokens >= MAX_QUERY_TOKENS or shape[2] > MAX_QUERY_TOKENS else
                     f"; a prompt's prefill runs outside fusec (prefill it eagerly, then pass one new token "
                     f"per step); a verification step of speculative decoding takes option "
                     f"query_tokens={shape[2]}"))
            msg = (f"not a decode step of at most {query_tokens} query token{'s' if query_tokens != 1 else ''} "
                   f"({what}): attention query has shape ({text}) "
                   f"(the batch and the query length must be fixed sizes, the query length at most "
                   f"{query_tokens}) at {node_source(node) or node.name}")
            if len(shape) == 4 and not isinstance(shape[0], int) and isinstance(shape[2], int) \
                    and 1 <= shape[2] <= query_tokens:
                varies = varies or BatchSizeVaries(msg, shape=f"({text})")
                batch_symbols |= shape[0].node.expr.free_symbols
                continue
            raise NotDecodeStepError(msg)
    if n == 0:
        softmax = next(iter(softmaxes(gm)), None)
        if softmax is not None:   # attention written as plain ops in a form fusec does not match
            raise NotDecodeStepError(
                f"the graph has no attention call fusec recognizes (a softmax at "
                f"{node_source(softmax) or softmax.name} is neither SDPA nor eager attention in a form fusec "
                f"matches: matmul, scale, an additive mask or a bool mask filled with -inf, softmax, matmul; "
                f"ALiBi's baddbmm, BLOOM's, is not among them); a model compiles whose attention calls "
                f"torch.nn.functional.scaled_dot_product_attention (HF: attn_implementation=\"sdpa\" where "
                f"the family has it) or HF's eager form")
        raise NotDecodeStepError("not a decode step: the graph has no attention call")
    for _, query, key in calls:
        grown = _concatenated(key)
        if grown is None:
            continue
        q = _val(query)
        tokens = _concrete(q.shape[2], sizes) if q is not None and q.dim() == 4 else 1
        if tokens != 1 and _window_slice(grown):
            raise NotDecodeStepError(
                f"HF's sliding-window cache concatenates the {tokens} new tokens to its window where they "
                f"fill it or it is full, at {node_source(grown)}: attention over the window's rows and the "
                "new ones, not a static KV cache of fixed rows; fusec takes a step of several query "
                "tokens on a sliding-window model until they would fill its window, and one-token steps "
                "at any length")
        raise NotDecodeStepError(
            "the KV cache grows by concatenation (a DynamicCache) at "
            f"{node_source(grown) or grown.name}: fusec compiles decode steps over a static KV "
            "cache; pass a transformers StaticCache (generate(): cache_implementation=\"static\"), or, "
            "where one was passed, the model's own generation code replaced it (Phi-3's LongRoPE "
            "prefills again into a new cache once the sequence passes original_max_position_embeddings)")
    if not varies and _no_cache(gm, calls, sizes):
        raise NotDecodeStepError(
            "the step has no KV cache: its attention reads only the new tokens' keys and nothing is "
            "written in place (a call with use_cache=False); fusec compiles decode steps that read a "
            "static KV cache: pass a transformers StaticCache as past_key_values")
    if varies:
        varies.symbols = frozenset(batch_symbols)
        raise varies


def _no_cache(gm: torch.fx.GraphModule, calls: list, sizes: dict) -> bool:
    """Whether every attention call's keys are as many as its queries and the graph writes no
    tensor in place (no cache update): a forward without a KV cache."""
    for _, query, key in calls:
        q, k = _val(query), _val(key)
        if q is None or k is None or q.dim() != 4 or k.dim() != 4:
            return False
        if _concrete(k.shape[-2], sizes) != _concrete(q.shape[-2], sizes):
            return False
    for n in gm.graph.nodes:   # a write: setitem, an in-place method or op (operator.and_ is none)
        if n.op == "call_function" and n.target in (operator.setitem, operator.iadd, operator.imul):
            return False
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "") \
            if n.op == "call_function" and getattr(n.target, "__module__", None) not in ("_operator", "operator") else ""
        base = name.split(".")[0] if isinstance(name, str) else ""   # aten's "index_copy_.default"
        if name == "__setitem__" or (base.endswith("_") and not base.startswith("_")):
            return False
    return bool(calls)


_VIEW_CALLS = {"view", "reshape", "expand", "contiguous", "transpose", "permute", "to", "clone",
               "unsqueeze", "flatten", "__getitem__", "getitem", "expand_as", "repeat_interleave"}


def _window_slice(cat: torch.fx.Node) -> bool:
    """Whether the ``torch.cat`` node ``cat`` (an attention key's) starts with a slice of a tensor
    (HF's sliding-window cache: ``cat((self.keys[:, :, 1:, :], key_states))`` where the new tokens
    fill its window or it is full) rather than the whole past (a ``DynamicCache``:
    ``cat([self.keys, key_states])``)."""
    parts = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    first = parts[0] if isinstance(parts, (list, tuple)) and parts else None
    if not isinstance(first, torch.fx.Node) or first.op != "call_function" or len(first.args) < 2:
        return False
    index = first.args[1]
    return getattr(first.target, "__name__", "") == "getitem" and isinstance(index, tuple) \
        and any(isinstance(i, slice) and i != slice(None) for i in index)


def _concatenated(node: Any) -> torch.fx.Node | None:
    """The ``torch.cat`` node that ``node`` (an attention key) is, seen through views, or None."""
    for _ in range(64):
        if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
            return None
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if name == "cat" or node.target is torch.cat:
            return node
        if name not in _VIEW_CALLS or not node.args:
            return None
        node = node.args[0]
    return None


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

    Logs the stage line ``capture``: dynamo's time tracing the frame before it called the
    backend (when dynamo is compiling a frame: not for a re-capture at a new concrete size) and
    AOT autograd's time.
    """
    t0 = time.perf_counter()
    dynamo_s = dynamo_seconds()
    gm2 = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    strip_ignored_calls(gm2)
    rewrite_eager_attention(gm2)
    rewrite_sdpa(gm2)
    owned = model_tensors(gm2, example_inputs)

    def fw(aten_gm: torch.fx.GraphModule, ex: list[Any]) -> Callable:
        n_aten = sum(1 for n in aten_gm.graph.nodes if n.op == "call_function")
        stage_log.info("stage %-13s %4d ATen ops, %d inputs; %sAOT %.2f s", "capture", n_aten, len(ex),
                       f"dynamo {dynamo_s:.2f} s, " if dynamo_s is not None else "", time.perf_counter() - t0)
        lifted = len(ex) - len(owned)   # AOT lifts the graph module's own parameters first
        if owned and lifted >= 0:
            aten_gm.meta[MODEL_TENSORS] = [True] * lifted + owned
            aten_gm.meta[INPUT_NAMES] = [""] * lifted + input_names(gm2)
        return compiler(aten_gm, ex)
    # imported here: 0.2-0.5 s of torch modules that a warm start (AOT skipped) never needs
    from torch._functorch.aot_autograd import aot_module_simplified
    return aot_module_simplified(gm2, example_inputs, fw_compiler=fw,
                                 decompositions=decompositions(),
                                 keep_inference_input_mutations=True)


def decompositions() -> dict:
    """``core_aten_decompositions()`` as a plain dict, a new one per call (AOT autograd only reads
    it, a caller may change its own). Building and materializing torch's table takes 50-100 ms, on
    every compile; it is built once per state of what it is made from: torch's Python
    decompositions, the operators with a CompositeImplicitAutograd kernel and the ops loaded in the
    ``torch.ops`` namespaces other than aten (a custom op registered later is in the next table, as
    it was before)."""
    from torch._decomp import global_decomposition_table
    cia = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    namespaces = tuple((name, len(getattr(getattr(torch.ops, name), "_dir", ())))
                       for name in list(torch.ops._dir) if name != "aten")   # torch caches aten's part
    key = (len(global_decomposition_table["post_autograd"]), tuple(sorted(cia)), namespaces)
    return dict(_decomposition_table(key))


@functools.lru_cache(maxsize=4)
def _decomposition_table(key: tuple) -> dict:
    """The materialized table for ``key`` (:func:`decompositions`'s); never handed out itself."""
    return dict(core_aten_decompositions().items())


def dynamo_seconds() -> float | None:
    """Seconds since dynamo started compiling the current frame (its tracing, when called from a
    backend), or None outside a dynamo compilation. Reads dynamo's compile-metrics context, a
    private API: any change there gives None, never an error."""
    try:
        from torch._dynamo.utils import get_metrics_context
        mc = get_metrics_context()
        start = getattr(mc, "_start_time_ns", 0)
        if mc.in_progress() and start:
            return max(0.0, (time.time_ns() - start) / 1e9)
    except Exception:   # noqa: BLE001 - a timing line must never break a compile
        pass
    return None


#: key of ``GraphModule.meta`` on the ATen graph: per flat input, whether it is a parameter or
#: buffer of the model (True) or a tensor the caller passed (False)
MODEL_TENSORS = "fusec_model_tensors"
#: key of a dynamo placeholder's ``meta``: :func:`model_tensors`'s answer, kept by
#: :func:`mark_model_tensors` for a later capture (dynamo drops its ``grapharg`` meta once the
#: backend has returned)
MODEL_TENSOR = "fusec_model_tensor"


#: key of an ATen graph's ``meta``: per input, the caller's name for it (:func:`input_names`)
INPUT_NAMES = "fusec_input_names"


def input_names(gm: torch.fx.GraphModule) -> list[str]:
    """Per placeholder of a dynamo graph, the caller's name for it as messages should say it:
    dynamo's source without its frame prefix (``L['kwargs']['attention_mask'].size()[1]`` ->
    ``attention_mask.size()[1]``), else the placeholder's name."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        ga = n.meta.get("grapharg")
        src = getattr(getattr(ga, "source", None), "name", None) if ga is not None else None
        src = src() if callable(src) else src
        out.append(re.sub(r"^L(\['kwargs'\])?\['(\w+)'\]", r"\2", src) if isinstance(src, str) else n.name)
    return out


def model_tensors(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> list[bool]:
    """Per graph input of a dynamo graph: True for the model's parameters and buffers and the
    Python floats dynamo passes as 0-d tensors under ``dynamic=True`` (an RMSNorm's
    ``variance_epsilon``: fusec compiles their values in and checks them at every call) (dynamo's
    source ``L['self']...._parameters[...]`` / ``._buffers[...]``; without dynamo's record of it,
    as under ``aot_compile``, the placeholder name made from it, ``l_self_..._parameters_...``;
    or an ``nn.Parameter``, or what :func:`mark_model_tensors` recorded), False for what the caller passes (token ids,
    masks, ``inputs_embeds``, cache tensors). Empty if the placeholders and the inputs do not
    line up."""
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(nodes) != len(example_inputs):
        return []
    out = []
    for n, x in zip(nodes, example_inputs):
        if MODEL_TENSOR in n.meta:
            out.append(n.meta[MODEL_TENSOR])
            continue
        ga = n.meta.get("grapharg")
        if ga is not None and getattr(ga, "pass_arg_as_tensor", False):
            owned = True   # a Python float dynamo passes as a 0-d tensor (dynamic=True): a model constant
        elif ga is not None and getattr(ga, "source", None) is not None:
            src = ga.source.name
            owned = "._parameters[" in src or "._buffers[" in src
        else:   # no record (dynamo's aot_compile): the placeholder's name spells the source
            owned = "_parameters_" in n.name or "_buffers_" in n.name
        out.append(isinstance(x, torch.nn.Parameter) or owned)
    return out


def mark_model_tensors(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """Record :func:`model_tensors` on ``gm``'s placeholders while dynamo's sources are there,
    for a graph captured again later (:class:`fusec.frontend.backend.SpecializingStep`): a
    buffer such as RoPE's ``inv_freq`` then stays a weight and its tables fold."""
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, flag in zip(nodes, model_tensors(gm, example_inputs)):
        n.meta[MODEL_TENSOR] = flag
