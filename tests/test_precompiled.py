"""fusec.generate's precompiled decode step (fusec/frontend/precompiled.py): traced once, loaded by
a second process without dynamo's trace, traced again for new shapes or a damaged entry, and the
plain torch.compile path when the precompile fails; tokens equal HF generate()'s every time."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fusec
import hf_tiny
from fusec.fallbacks import FallbackWatch

ROOT = Path(__file__).resolve().parent.parent
OPTS = {"num_sms": 8, "check_hazards": False}

#: one process of the two-process test: a tiny Llama with the seed it is given (other weights
#: than the process before), fusec.generate against HF generate(), what the log said; first, before
#: anything is compiled, the code digest of ``hf_tiny.llama(seed=1)`` (for the digest test: two new
#: processes agree, without two more processes that import torch and transformers)
CHILD = textwrap.dedent("""
    import json, logging, sys, torch
    import fusec, hf_tiny
    from fusec.fallbacks import FallbackWatch
    from fusec.frontend.code_fingerprint import model_code_digest
    digest = model_code_digest(hf_tiny.llama(seed=1))
    lines = []
    class Keep(logging.Handler):
        def emit(self, r): lines.append(r.getMessage())
    logging.getLogger("fusec").addHandler(Keep()); logging.getLogger("fusec").setLevel(logging.INFO)
    seed, device, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    model = hf_tiny.llama(seed=seed).to(device)   # fp32: greedy tokens equal HF's on the GPU too
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(seed)).to(device)
    with FallbackWatch() as w:
        out = fusec.generate(model, prompt, n, eos_token_id=[], options={"num_sms": 8, "check_hazards": False})
    ref = model.generate(prompt, max_new_tokens=n, do_sample=False, cache_implementation="static",
                         pad_token_id=0, eos_token_id=None)
    print(json.dumps({"equal": torch.equal(out, ref), "fallbacks": w.fallbacks, "log": lines, "digest": digest}))
""")


def _child(tmp_path: Path, seed: int, device: str, n: int) -> dict:
    env = {**os.environ, "FUSEC_CACHE": "1", "FUSEC_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    p = subprocess.run([sys.executable, str(script), str(seed), device, str(n)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _said(res: dict, what: str) -> bool:
    return any(line.startswith("stage precompiled") and what in line for line in res["log"])


def _two_processes(tmp_path: Path, device: str, n: int) -> list[dict]:
    first = _child(tmp_path, 3, device, n)
    second = _child(tmp_path, 4, device, n)
    return [first, second]


def _second_loaded_what_the_first_traced(first: dict, second: dict) -> None:
    assert first["equal"] and not first["fallbacks"], first
    assert _said(first, "traced") and not _said(first, "loaded"), first["log"]
    assert second["equal"] and not second["fallbacks"], second
    assert _said(second, "loaded") and not _said(second, "traced"), second["log"]
    # fusec's own warm start behind it: the IR from the artifact cache, no AOT trace
    assert any("warm start" in line for line in second["log"]), second["log"]


@pytest.fixture(scope="module")
def cpu_processes(tmp_path_factory) -> list[dict]:
    """The two CPU processes (8 tokens each), shared by the two tests that need new processes."""
    return _two_processes(tmp_path_factory.mktemp("two_processes"), "cpu", 8)


def test_second_process_loads_the_precompiled_step(cpu_processes):
    """A second process (other random weights) loads the step the first traced (dynamo's trace
    skipped), fusec compiles it from its artifact cache, and its tokens equal HF generate()'s."""
    _second_loaded_what_the_first_traced(*cpu_processes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_second_process_loads_the_precompiled_step_gpu(tmp_path):
    """The same on the GPU: the megakernel of a loaded step against HF generate() (fp32), 40
    tokens: 2 plain steps, then chunks of 16 replayed from a CUDA graph of the loaded step."""
    runs = _two_processes(tmp_path, "cuda", 40)
    _second_loaded_what_the_first_traced(*runs)
    for res in runs:
        assert any("replayed from a CUDA graph" in line for line in res["log"]), res["log"]


def _hf(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, cache_implementation="static",
                          pad_token_id=0, eos_token_id=None)


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE", "1")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "artifacts"


def _records(caplog, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if what in r.getMessage()]


def test_one_entry_serves_every_length_and_a_damaged_entry_traces_again(cache_on, caplog):
    """Two prompt lengths (caches of 64 and 128 rows) share one precompiled entry: its trace's
    cache length is symbolic. A new process (nothing kept on the model) at a third length loads it
    without tracing. An entry overwritten with garbage is reported, traced again and rewritten.
    Tokens stay HF's throughout."""
    caplog.set_level(logging.INFO, logger="fusec")
    model = hf_tiny.llama(seed=5)
    short = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    long = torch.randint(1, 128, (1, 62), generator=torch.Generator().manual_seed(2))
    mid = torch.randint(1, 128, (1, 140), generator=torch.Generator().manual_seed(3))
    with FallbackWatch() as w:
        assert torch.equal(fusec.generate(model, short, 4, eos_token_id=[], options=OPTS), _hf(model, short, 4))
        assert torch.equal(fusec.generate(model, long, 4, eos_token_id=[], options=OPTS), _hf(model, long, 4))
    assert not w.fallbacks, w.fallbacks
    entries = sorted(cache_on.glob("*.precompiled.art"))
    assert len(entries) == 1 and len(_records(caplog, "stage precompiled   traced")) == 1
    model.__dict__.pop("_fusec_generate_steps")   # as a new process would: nothing kept on the model
    caplog.clear()
    with FallbackWatch() as w:
        assert torch.equal(fusec.generate(model, mid, 4, eos_token_id=[], options=OPTS), _hf(model, mid, 4))
    assert not w.fallbacks, w.fallbacks
    assert _records(caplog, "stage precompiled   loaded") and not _records(caplog, "stage precompiled   traced")
    for e in entries:
        e.write_bytes(b"not an entry")
    model.__dict__.pop("_fusec_generate_steps")
    caplog.clear()
    with FallbackWatch() as w:
        assert torch.equal(fusec.generate(model, short, 4, eos_token_id=[], options=OPTS), _hf(model, short, 4))
    assert not w.fallbacks, w.fallbacks
    assert _records(caplog, "ignoring unreadable entry") and _records(caplog, "stage precompiled   traced")


def test_precompile_failure_uses_torch_compile(cache_on, caplog, monkeypatch):
    """When torch cannot save the step (here: every guard kept, so an object-identity guard
    cannot be serialized) one line says so, and the step is plain torch.compile with fusec."""
    from fusec.frontend import precompiled
    monkeypatch.setattr(precompiled, "serializable_guards", lambda entries: [True] * len(entries))
    caplog.set_level(logging.INFO, logger="fusec")
    model = hf_tiny.llama(seed=6)
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, prompt, 4, eos_token_id=[], options=OPTS)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert torch.equal(out, _hf(model, prompt, 4))
    said = _records(caplog, "no precompiled step")
    assert len(said) == 1 and "cannot be serialized" in said[0], said
    assert not list(cache_on.glob("*.precompiled.art"))


def test_code_digest_sees_patches_hooks_and_registries(monkeypatch, cpu_processes):
    """The key's code digest changes with a hook, a patched class forward, a rebound module
    function or a registered attention function (dynamo's guards on them cannot be saved), and
    not with other weights; it is the same in another process (no addresses in it)."""
    import transformers.models.llama.modeling_llama as ml
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fusec.frontend.code_fingerprint import model_code_digest
    model = hf_tiny.llama(seed=1)
    base = model_code_digest(model)
    assert model_code_digest(hf_tiny.llama(seed=2)) == base
    h = model.model.layers[0].mlp.register_forward_hook(lambda mod, i, o: o * 3.0)
    hooked = model_code_digest(model)
    h.remove()
    h = model.model.layers[0].mlp.register_forward_hook(lambda mod, i, o: o * 2.0)
    assert len({hooked, model_code_digest(model), base}) == 3   # the hook's constant counts
    h.remove()
    assert model_code_digest(model) == base
    with monkeypatch.context() as m:
        m.setattr(ml.LlamaMLP, "forward", lambda self, x: self.down_proj(self.gate_proj(x)))
        assert model_code_digest(model) != base
    with monkeypatch.context() as m:
        m.setattr(ml, "apply_rotary_pos_emb", lambda q, k, cos, sin, *a, **kw: (q, k))
        assert model_code_digest(model) != base
    before = AttentionInterface._global_mapping["sdpa"]
    try:
        AttentionInterface.register("sdpa", lambda *a, **k: sdpa_attention_forward(*a, **k))
        assert model_code_digest(model) != base
    finally:
        AttentionInterface.register("sdpa", before)
    assert model_code_digest(model) == base
    # two new processes agree (the two-process test's, before they compile anything)
    digests = [res["digest"] for res in cpu_processes]
    assert digests[0] == digests[1] and len(digests[0]) == 64


def test_code_digest_ignores_what_dynamo_puts_into_module_globals():
    """dynamo stores the functions it compiles in the globals of the modules whose frames it
    traced (``transformers.utils.generic.__compiled_fn_47_<uuid>``) until ``torch._dynamo.reset()``:
    neither changes the digest. They did: a process that had compiled an HF model once
    (test_eager_attention.py) traced its precompiled step again at the next call, as a new key."""
    from fusec.frontend.code_fingerprint import model_code_digest
    model = hf_tiny.llama(seed=3)
    base = model_code_digest(model)
    cache = hf_tiny.static_cache(model, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="eager")(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache,
                                              use_cache=True)
    import transformers.utils.generic as generic
    assert any(k.startswith("__compiled_fn") for k in vars(generic)) or \
        any(k.startswith("__compiled_fn") for m in list(sys.modules.values()) if m and
            getattr(m, "__name__", "").startswith("transformers.") for k in vars(m))
    assert model_code_digest(model) == base
    torch._dynamo.reset()
    assert model_code_digest(model) == base
    # a graph break (a pre-hook on each attention) compiled by a backend that returns a plain
    # function of another module: dynamo's compiled functions then carry that module's name,
    # which must not join the modules the digest reads
    hooks = [layer.self_attn.register_forward_pre_hook(_graph_break, with_kwargs=True)
             for layer in model.model.layers]
    base = model_code_digest(model)
    with torch.no_grad():
        torch.compile(model, backend=_plain_backend)(input_ids=torch.randint(0, 128, (1, 1)),
                                                     past_key_values=cache, use_cache=True)
    assert model_code_digest(model) == base
    torch._dynamo.reset()
    for h in hooks:
        h.remove()


def _graph_break(module, args, kwargs):
    torch._dynamo.graph_break()


def _plain_backend(gm, example_inputs):
    """A backend that returns a plain Python function of this module."""
    def run(*args):
        return gm(*args)
    return run


def test_code_digest_sees_a_module_function_with_a_leading_double_underscore():
    """A model module's own ``def __scale`` (not a dunder, not dynamo's) rebound changes the
    digest: only dynamo's prefixes and true dunders are skipped (a loaded step would run the old
    function's graph otherwise)."""
    import types
    from fusec.frontend.code_fingerprint import model_code_digest
    mod = types.ModuleType("fusec_test_dunder_model")
    exec(textwrap.dedent("""
        import torch
        def __scale(x):
            return x * 2.0
        def times3(x):
            return x * 3.0
        def helper(x):
            return globals()["__scale"](x)
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
            def forward(self, x):
                return helper(self.lin(x))
    """), mod.__dict__)
    mod.M.__module__ = mod.__name__
    sys.modules[mod.__name__] = mod
    try:
        model = mod.M()
        base = model_code_digest(model)
        mod.__dict__["__scale"] = mod.times3   # a function of the same module: no module joins
        assert model_code_digest(model) != base
    finally:
        del sys.modules[mod.__name__]


def test_precompiled_step_lowers_as_torch_compile(cache_on, steps, monkeypatch):
    """The precompiled path hands fusec the graph plain torch.compile does: the same input roles
    (RoPE's ``inv_freq`` buffer a weight, so its tables fold and RoPE fuses into the QKV kind;
    under aot_compile dynamo records no input sources, found in review) and the same schedule."""
    import fusec.generate  # noqa: F401 - the submodule (the package attribute is the function)
    gen = sys.modules["fusec.generate"]
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(8))
    fusec.generate(hf_tiny.llama(seed=7), prompt, 2, eos_token_id=[], options=OPTS)
    monkeypatch.setattr(gen, "PRECOMPILE", False)
    torch._dynamo.reset()
    fusec.generate(hf_tiny.llama(seed=7), prompt, 2, eos_token_id=[], options=OPTS)
    torch._dynamo.reset()
    pre, plain = steps[0], steps[-1]
    assert pre is not plain
    assert [pre.graph.tensors[n].role for n in pre.graph.inputs] == \
        [plain.graph.tensors[n].role for n in plain.graph.inputs]
    kinds = pre.schedule.graph.count_kinds()
    assert kinds == plain.schedule.graph.count_kinds() and "rms_qkv_rope" in kinds, kinds
    assert len(pre.schedule.instrs) == len(plain.schedule.instrs)


class RangeOut(torch.nn.Module):
    """A step whose output holds a range and a type (module level: dynamo pickles the module)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x), range(len(x)), type(x)


@pytest.mark.parametrize("fallback", ["inductor", "eager"])
def test_a_step_returning_a_range_is_precompiled(cache_on, caplog, fallback):
    """Dynamo rebuilds a ``range`` in a step's output by loading ``range`` by name and refuses a
    frame whose globals shadow it: the precompiled function's globals hold every builtin but
    ``range`` (a review found the step falling back to a plain torch.compile), and the step's
    output equals eager's. The step has no attention, so fusec hands it to the fallback: with
    ``fallback="eager"`` the loaded graph module itself runs (it had no ``forward`` before)."""
    from fusec.frontend.precompiled import PrecompiledStep
    torch.manual_seed(0)
    m = RangeOut().eval()
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="fusec"), torch.no_grad():
        step = PrecompiledStep(m, m, {"num_sms": 8, "cache": True, "fallback": fallback})
        got, ref = step(x), m(x)
    assert step.compiled is None and _records(caplog, "stage precompiled   traced"), caplog.text[-1500:]
    assert torch.allclose(got[0], ref[0], atol=1e-6) and got[1:] == ref[1:]


def test_a_loaded_step_walks_its_inputs_once(cache_on, monkeypatch):
    """A loaded step's guards fail on dynamo's dim markings of the cache (torch saves guards as
    if no input was marked): the markings come off once, not at every call (the walk over the
    inputs and the markings' removal and restoration cost 0.17-0.37 ms per call for a 16-layer
    cache), and they are back on the cache before a trace, so that a new trace is still symbolic
    in the cache length. Tokens equal HF's throughout."""
    from fusec.frontend import precompiled
    walks = []
    real = precompiled._tensors
    monkeypatch.setattr(precompiled, "_tensors", lambda args: walks.append(1) or real(args))
    model = hf_tiny.llama(seed=5)
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    with FallbackWatch() as w:
        assert torch.equal(fusec.generate(model, prompt, 3, eos_token_id=[], options=OPTS), _hf(model, prompt, 3))
        model.__dict__.pop("_fusec_generate_steps")   # as a new process would: the entry is loaded
        walks.clear()
        assert torch.equal(fusec.generate(model, prompt, 12, eos_token_id=[], options=OPTS), _hf(model, prompt, 12))
    assert not w.fallbacks, w.fallbacks
    assert len(walks) <= 3, f"{len(walks)} walks over the inputs for 11 steps"
    rows = torch.zeros(4, 2, 16, 8)
    torch._dynamo.maybe_mark_dynamic(rows, 2)
    marks = precompiled._Marks()
    assert marks.take((rows,)) and not hasattr(rows, "_dynamo_weak_dynamic_indices")
    marks.restore()
    assert rows._dynamo_weak_dynamic_indices == {2}


def test_two_decode_calls_on_one_cache_keep_the_length_symbolic(cache_on, caplog):
    """HF generate()'s decode calls with other keyword arguments are two precompiled steps on
    one cache: the first takes the cache's dim markings off (its loaded guards need them off);
    the second's trace must still see them, so that it serves a new cache length without
    tracing again (a review found the second step traced per length)."""
    from transformers.generation import CompileConfig

    from fusec.frontend.hf_generate import HFDecodeCall
    caplog.set_level(logging.INFO, logger="fusec")
    model = hf_tiny.llama(seed=5)
    call = HFDecodeCall(model, CompileConfig(backend="fusec", mode=None, options=OPTS))
    gen = torch.Generator().manual_seed(0)

    def step(rows, extra, cache=None):
        if cache is None:
            cache = hf_tiny.static_cache(model, rows)
            model(input_ids=torch.randint(0, 128, (1, 3), generator=gen), past_key_values=cache, use_cache=True)
        tok = torch.randint(0, 128, (1, 1), generator=gen)
        with torch.no_grad():
            return call(input_ids=tok, past_key_values=cache, use_cache=True, **extra), cache

    with FallbackWatch() as w:
        _, cache = step(16, {})
        step(16, {"return_dict": True}, cache=cache)
        traced = len(_records(caplog, "stage precompiled   traced"))
        step(48, {"return_dict": True})
    assert not w.fallbacks, w.fallbacks
    assert traced == 2 and len(_records(caplog, "stage precompiled   traced")) == 2, caplog.text[-2000:]


def test_a_second_model_with_another_head_dim_precompiles_its_own_step(cache_on):
    """Two models in one process whose SDPA scales differ (head_dim 16, then 32): each gets its
    own precompiled step and compiles with fusec. Before, both traces ran one ``_run`` code and
    dynamo's automatic dynamic shapes made the second's scale a dynamic float: the capture
    failed (``TensorifyScalarRestartAnalysis``), the step ran eagerly, and the entry it stored
    made every later process fall back too."""
    from transformers import LlamaConfig, LlamaForCausalLM
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128)
    prompt = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    for extra in ({}, {"head_dim": 32}):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**base, **extra)).eval()
        with FallbackWatch() as w:
            out = fusec.generate(model, prompt, 4, eos_token_id=[], options=OPTS)
        assert w.compiled and not w.fallbacks, (extra, w.fallbacks)
        assert torch.equal(out, _hf(model, prompt, 4)), extra

