"""Test helpers: capture a decode step's ATen graph and IR, build its megakernel directly."""
from __future__ import annotations

import torch

from fusec.frontend.capture import aten_capture
from fusec.frontend.counters import counters_specialized
from fusec.ir import Graph, Op, Ref, Role, TensorInfo
from fusec.config import Options
from fusec.frontend.from_fx import graph_from_aten
from fusec.pipeline import Dumper


def neg_mul_graph() -> Graph:
    """A two-op IR graph, ``z = -x * 2`` over 4 fp32 elements (ops ``a`` and ``b``)."""
    g = Graph()
    g.add_tensor(TensorInfo("x", (4,), torch.float32, Role.INPUT, input_index=0))
    g.add_tensor(TensorInfo("y", (4,), torch.float32))
    g.add_tensor(TensorInfo("z", (4,), torch.float32, Role.OUTPUT))
    g.inputs, g.outputs = ["x"], ["z"]
    g.ops = [Op("a", "aten.neg.default", {"in0": "x"}, {"out": "y"},
                attrs={"target": torch.ops.aten.neg.default, "args": (Ref("in0"),), "kwargs": {}}),
             Op("b", "aten.mul.Tensor", {"in0": "y"}, {"out": "z"},
                attrs={"target": torch.ops.aten.mul.Tensor, "args": (Ref("in0"), 2.0), "kwargs": {}})]
    return g


def record_compiled_steps(monkeypatch) -> list:
    """Every ``fusec.frontend.compiled.CompiledStep`` built from now on while ``monkeypatch``
    holds (a list that grows as they are made)."""
    from fusec.frontend.compiled import CompiledStep
    made: list = []
    init = CompiledStep.__init__

    def record(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)
    record.keeps_cache = True   # only records: the run-wide artifact cache stays on (conftest.py)
    monkeypatch.setattr(CompiledStep, "__init__", record)
    return made


def capture(model, kwargs):
    """(aten graph module, IR graph, flat inputs) of one call of ``model(**kwargs)``."""
    got = []

    def backend(gm, ex, **_):
        def compiler(aten_gm, fake):
            def run(*flat):
                if not got:
                    got.append((aten_gm, graph_from_aten(aten_gm, fake), list(flat)))
                return aten_gm(*flat)
            return run
        return aten_capture(gm, ex, compiler)

    torch._dynamo.reset()
    with torch.no_grad(), counters_specialized():
        torch.compile(model, backend=backend, fullgraph=True)(**kwargs)
    torch._dynamo.reset()
    return got[0]


def lowered(model, **options):
    """The schedule of ``model``'s decode step (a 32-row StaticCache prefilled with 4 random
    tokens, then one random token) lowered with ``num_sms=16`` and ``options``."""
    import hf_tiny
    from fusec.pipeline import lower
    cache = hf_tiny.static_cache(model, 32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 4), generator=gen), past_key_values=cache, use_cache=True)
    kw = {"input_ids": torch.randint(0, 128, (1, 1), generator=gen), "past_key_values": cache, "use_cache": True}
    _, g, flat = capture(model, kw)
    return lower(g, flat, Options.from_dict({"num_sms": 16, **options}), Dumper(None))


def build(g, flat, **options):
    from fusec.frontend.compiled import build_cuda_step
    step, sched = build_cuda_step(g, flat, Options.from_dict(options), Dumper(None))
    return step, sched


def random_cache_state(cache, position: int, gen: torch.Generator):
    """Fill every layer's KV cache with fresh random values and set its position counter."""
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
        layer.cumulative_length.fill_(position)


def steps_at_position(model, compiled, toks, position: int, gen: torch.Generator, rows: int = 1024):
    """A ``rows``-row StaticCache of ``model`` (on the model's device) with random contents and
    its position counter at ``position`` (:func:`random_cache_state`), and a copy: each token of
    ``toks`` through ``compiled`` on the cache and through eager ``model`` on the copy. Returns
    [(compiled logits, eager logits)] in fp32, one pair per token."""
    import copy
    import hf_tiny
    cache = hf_tiny.static_cache(model, rows)
    model(input_ids=toks[0], past_key_values=cache, use_cache=True)   # allocate on the model's device
    random_cache_state(cache, position, gen)
    ref = copy.deepcopy(cache)
    return [(compiled(input_ids=t, past_key_values=cache, use_cache=True).logits.float(),
             model(input_ids=t, past_key_values=ref, use_cache=True).logits.float()) for t in toks]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def poison(step) -> None:
    """Fill the megakernel's own buffers (activations, outputs) with NaN / a sentinel."""
    for name, t in step.owned.items():
        if step.g.tensors[name].role.value != "constant":
            t.fill_(float("nan") if t.dtype.is_floating_point else -7)


def tiny_on_gpu(factory, dtype, max_len=64, prompt=5):
    """A tiny HF model from ``factory`` on the GPU in ``dtype`` and its StaticCache of
    ``max_len`` rows, prefilled eagerly with ``prompt`` random tokens."""
    import hf_tiny
    model = factory().to(device="cuda", dtype=dtype)
    cache = hf_tiny.static_cache(model, max_len)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, prompt), device="cuda"), past_key_values=cache, use_cache=True)
    return model, cache


def steps_against_eager(model, vocab: int, seed: int, n: int = 6, device: str = "cuda"):
    """``n`` decode steps of ``torch.compile(model, backend="fusec")`` (default options) and of
    eager ``model``, each on its own StaticCache (64 rows) after the same random 5-token prompt,
    on ``device``: (each step's relative logits error, the FallbackWatch)."""
    import hf_tiny
    from fusec.fallbacks import FallbackWatch
    caches = [hf_tiny.static_cache(model, 64) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    p = torch.randint(0, vocab, (1, 5), generator=gen).to(device)
    with torch.no_grad():
        for c in caches:
            model(input_ids=p, past_key_values=c)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    errs = []
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(n):
            t = torch.randint(0, vocab, (1, 1), generator=gen).to(device)
            a = compiled(input_ids=t, past_key_values=caches[0]).logits.double()
            b = model(input_ids=t, past_key_values=caches[1]).logits.double()
            errs.append(((a - b).norm() / b.norm()).item())
    torch._dynamo.reset()
    return errs, w


def prompts_against_eager(model, options: dict, prompt_lens, steps: int = 2, cache_len: int = 64,
                          seed: int = 5) -> tuple[dict[int, float], object]:
    """``torch.compile(model, backend="fusec", options=options)`` (CPU, simulator) against eager
    after prefills of each of ``prompt_lens`` random tokens, each pair on its own StaticCache of
    ``cache_len`` rows, ``steps`` decode steps each: ({prompt length: largest relative logits
    error}, the FallbackWatch of the compiled calls)."""
    import hf_tiny
    from fusec.fallbacks import FallbackWatch
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options=options)
    errs: dict[int, float] = {}
    with FallbackWatch() as w, torch.no_grad():
        for n in prompt_lens:
            ours, ref = hf_tiny.static_cache(model, cache_len), hf_tiny.static_cache(model, cache_len)
            prompt = torch.randint(0, vocab, (1, n), generator=gen)
            for c in (ours, ref):
                model(input_ids=prompt, past_key_values=c, use_cache=True)
            for _ in range(steps):
                tok = torch.randint(0, vocab, (1, 1), generator=gen)
                a = compiled(input_ids=tok, past_key_values=ours, use_cache=True).logits.double()
                b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits.double()
                errs[n] = max(errs.get(n, 0.0), ((a - b).norm() / b.norm()).item())
    torch._dynamo.reset()
    return errs, w


def assert_option_changes_no_value(model, off: dict, seed: int, n: int = 6, num_sms: int = 16,
                                   tol: float = 2e-2) -> None:
    """``n`` decode steps of ``model`` (CPU, simulator) through ``torch.compile(backend="fusec")``
    with default options, through it with the options ``off`` added, and eagerly, each on its
    own 32-row StaticCache after the same random 5-token prompt. Asserts what a pass that must
    change no value guarantees: no fallback, both compiles ran, the first two give the same
    logits bit for bit at every step, and they are within ``tol`` (relative) of eager's."""
    from transformers import StaticCache
    from fusec.fallbacks import FallbackWatch
    gen = torch.Generator().manual_seed(seed)
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(3)]
    p = torch.randint(0, 128, (1, 5), generator=gen)
    with torch.no_grad():
        for c in caches:
            model(input_ids=p, past_key_values=c, use_cache=True)
    toks = [torch.randint(0, 128, (1, 1), generator=gen) for _ in range(n)]
    outs = []
    with FallbackWatch() as w, torch.no_grad():
        for cache, opts in ((caches[0], {"num_sms": num_sms}), (caches[1], {"num_sms": num_sms, **off})):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="fusec", options=opts)
            outs.append([compiled(input_ids=t, past_key_values=cache, use_cache=True).logits for t in toks])
        outs.append([model(input_ids=t, past_key_values=caches[2], use_cache=True).logits for t in toks])
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled >= 2, w.fallbacks
    for a, b, e in zip(*outs):
        assert torch.equal(a, b)
        assert 0 < rel(a.float(), e.float()) < tol


def compile_kind_without_spills(source: str, folder, fn: str = "rms_qkv_rope"):
    """NVRTC-compile a rendered kernel (``-Xptxas -v``, cache in ``folder``) and assert: no
    warning, the kind function ``fn`` (one out-of-line instantiation) has no stack frame and no
    spills, and the whole kernel none either. Returns the compiled kernel."""
    from fusec.cuda.jit import compile_cuda
    kernel = compile_cuda(source, "fusec_step.cu", options=("-Xptxas", "-v"), cache_dir=str(folder))
    assert "warning" not in kernel.log, kernel.log
    lines = kernel.log.splitlines()
    mangled = f"_Z{len(fn)}{fn}"
    props = [lines[i + 1] for i, l in enumerate(lines) if f"Function properties for {mangled}" in l]
    assert len(props) == 1, kernel.log
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in props[0], props
    kernel.assert_no_spills()
    return kernel
