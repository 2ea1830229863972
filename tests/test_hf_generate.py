"""HF generate() and the call patterns users write, through torch.compile(backend="fusec"),
on the CPU simulator: same tokens / logits as eager, no fallback, fused into the fast kinds."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.frontend.compiled import CompiledStep
from fusec.fallbacks import FallbackWatch




def _compile_config(**kw):
    from transformers.generation import CompileConfig
    cc = CompileConfig(backend="fusec", **kw)   # HF defaults: mode="reduce-overhead", fullgraph=False
    cc._compile_all_devices = True   # HF compiles on CUDA only unless told (this machine has no GPU)
    return cc


def _fast_kinds(step: CompiledStep, generic: tuple[str, ...] = ("aten.copy_.default",)) -> dict[str, int]:
    kinds = step.schedule.graph.count_kinds()
    leftovers = {k for k in kinds if k.startswith(("aten.", "fusec.")) or k in ("linear", "rmsnorm", "rope")}
    assert leftovers <= set(generic), leftovers
    return kinds


@pytest.mark.parametrize("loop", ["device", "hf"])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_generate_greedy_equals_eager(factory, loop, steps, caplog):
    """generate(..., cache_implementation="static", compile_config=CompileConfig(backend="fusec"))
    with HF's defaults: 32 greedy tokens equal eager's, through one fused schedule. By default
    (``generate_loop`` "device") fusec.generate's device loop runs them: its step, whose LM head
    takes the argmax, runs 31 times (the prefill is eager) and HF's decode call is never made;
    with ``generate_loop="hf"`` HF's loop calls the step 31 times and its attention reads
    generate()'s 4-D mask. A pad_token_id is set, as checkpoints do."""
    model = factory()
    model.generation_config.pad_token_id = 0
    model.config.pad_token_id = 0
    prompt = torch.randint(1, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    ref = model.generate(prompt, max_new_tokens=32, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    cc = _compile_config(**({} if loop == "device" else {"options": {"generate_loop": "hf"}}))
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, max_new_tokens=32, do_sample=False, cache_implementation="static",
                             compile_config=cc)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert torch.equal(out, ref)
    (step,) = steps
    assert step.calls == 31 and not step.fallen_back
    # the device loop's step also writes its token back into its input (fusec.generate's DecodeStep)
    kinds = _fast_kinds(step, ("aten.copy_.default",) + (("aten.copy.default",) if loop == "device" else ()))
    assert kinds["rms_qkv_rope"] == kinds["attention_partial"] == model.config.num_hidden_layers
    ran = [r.getMessage() for r in caplog.records if "fusec.generate: 32 new tokens" in r.getMessage()]
    assert len(ran) == (loop == "device"), ran
    assert ("_compiled_call" in model.__dict__) == (loop == "hf")
    if loop == "hf":
        att = [o for o in step.schedule.graph.ops if o.kind == "attention_partial"]
        assert all(o.attrs["mask_kind"] == 1 and "mask" in o.inputs for o in att)


def test_generate_sampling_through_hf_logits_processors():
    """do_sample with temperature, top-k and top-p: HF's processors run on fusec's logits; with
    the same seed the tokens equal eager generate()'s."""
    model = hf_tiny.llama()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
              cache_implementation="static")
    torch.manual_seed(7)
    ref = model.generate(prompt, **kw)
    torch._dynamo.reset()
    torch.manual_seed(7)
    with FallbackWatch() as w:
        out = model.generate(prompt, compile_config=_compile_config(), **kw)
    torch._dynamo.reset()
    assert w.compiled and not w.fallbacks, (w.compiled, w.fallbacks)
    assert out.shape[1] > prompt.shape[1] + 1 and torch.equal(out, ref)


def _loop(model, compiled, cache, ref_cache, n, kwargs_at, gen):
    for i in range(n):
        tok = torch.randint(0, model.config.vocab_size, (1, 1), generator=gen)
        kw = kwargs_at(i)
        a = compiled(input_ids=tok, past_key_values=cache, use_cache=True, **kw).logits
        b = model(input_ids=tok, past_key_values=ref_cache, use_cache=True, **kw).logits
        rel = ((a - b).norm() / b.norm()).item()
        assert 0 < rel < 1e-4, (i, rel)   # 0 would mean eager ran


def _prefilled(model, length, gen, prompt=4):
    caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
    p = torch.randint(0, model.config.vocab_size, (1, prompt), generator=gen)
    for c in caches:
        model(input_ids=p, past_key_values=c, use_cache=True)
    return caches


def test_call_patterns_run_fusec(steps):
    """A plain loop with explicit position_ids and cache_position, with a full-length
    attention_mask, on a fresh (lazily initialized) cache, with a second and third cache length
    and a second model in one process: every decode call runs fusec, never a fallback."""
    gen = torch.Generator().manual_seed(3)
    model = hf_tiny.llama(vocab=160)
    model.config.pad_token_id = 0
    model.model.embed_tokens.padding_idx = 0   # as a checkpoint with pad_token_id builds it
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 16})
    with FallbackWatch() as w, torch.no_grad():
        c, r = _prefilled(model, 24, gen)
        _loop(model, compiled, c, r, 3, lambda i: dict(position_ids=torch.tensor([[4 + i]]),
                                                         cache_position=torch.tensor([4 + i])), gen)

        def mask(i):
            am = torch.zeros(1, 24, dtype=torch.long)
            am[:, : 5 + i] = 1
            return {"attention_mask": am}
        c, r = _prefilled(model, 24, gen)
        _loop(model, compiled, c, r, 3, mask, gen)
        # a fresh cache: the first call initializes it inside the compiled step
        _loop(model, compiled, hf_tiny.static_cache(model, 24), hf_tiny.static_cache(model, 24), 2,
              lambda i: {}, gen)
        for length in (40, 56):   # dynamo marks the length dynamic: fusec specializes per length
            c, r = _prefilled(model, length, gen)
            _loop(model, compiled, c, r, 2, lambda i: {}, gen)
        other = hf_tiny.llama(hidden=96, inter=128, heads=6, kv_heads=3, vocab=160, seed=1)
        compiled_other = torch.compile(other, backend="fusec", options={"num_sms": 16})
        c, r = _prefilled(other, 24, gen)
        _loop(other, compiled_other, c, r, 2, lambda i: {}, gen)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert steps and not any(s.fallen_back for s in steps)
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    for s in steps:   # every graph these patterns made has a CUDA kernel (NVRTC, sm_90a)
        compile_cuda(render(s.schedule).source, "fusec_step.cu")


def test_dynamic_cache_says_what_to_change():
    """A DynamicCache, which fusec cannot compile, gets one fallback line per graph that says what
    to change (a batch of sequences no longer falls back: tests/test_batch_decode.py)."""
    from transformers import DynamicCache
    model = hf_tiny.llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 16, "fallback": "eager"})
    with FallbackWatch() as w, torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(0, 128, (1, 4)), past_key_values=cache, use_cache=True)
        for _ in range(4):
            compiled(input_ids=torch.randint(0, 128, (1, 1)), past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    assert len(w.fallbacks) == 2, w.fallbacks   # the static graph, then the dynamic one: once each
    assert all("StaticCache" in f for f in w.fallbacks)


def test_generate_decode_kernel_compiles_with_nvrtc(steps):
    """The decode step of generate()'s own loop (``generate_loop="hf"``: attention with
    generate()'s bool mask) renders and compiles for sm_90a."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    model = hf_tiny.llama(layers=2)
    model.generation_config.pad_token_id = 0
    torch._dynamo.reset()
    model.generate(torch.randint(1, 128, (1, 4)), max_new_tokens=3, do_sample=False,
                   cache_implementation="static", compile_config=_compile_config(options={"generate_loop": "hf"}))
    torch._dynamo.reset()
    (step,) = steps
    plan = render(step.schedule)
    # 4 query heads over 2 KV heads; a tile group per KV head, or per head where the default
    # tile-heads rule cuts the groups (attention_rules.auto_q_groups; the step's 32768-row capacity
    # counts as its REFERENCE_ROWS)
    (a,) = {(o.attrs["n_kv"], o.attrs.get("q_groups", 1)) for o in step.schedule.graph.ops
            if o.kind == "attention_partial"}
    assert a[0] == 2
    assert f"attention_partial_merge<float, float, float, 4, {a[0] * a[1]}, 16" in plan.source
    # generate()'s mask, bounded by the position (fusec.frontend.mask_bound): MK 4, rows 0 .. pos
    assert ", 4, bool>" in plan.source
    kernel = compile_cuda(plan.source, "fusec_step.cu")
    assert kernel.resources["fusec_step"]["spill_store_bytes"] == 0


class _GreedyStep(torch.nn.Module):
    """One greedy decode step that feeds its token back in place (as fusec.generate does)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, cache):
        logits = self.model(input_ids=tokens, past_key_values=cache, use_cache=True).logits
        nxt = logits[:, -1].argmax(-1)
        tokens.copy_(nxt.view(1, 1))
        return nxt


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_lm_head_argmax_epilogue_matches_eager(factory, steps):
    """argmax over the logits fuses into the LM head (per-tile candidates, last-ticket merge):
    12 fed-back greedy tokens equal eager's, the simulator's hazard check passes, and the kernel
    compiles with NVRTC."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    model = factory(vocab=300)
    gen = torch.Generator().manual_seed(11)
    caches = [hf_tiny.static_cache(model, 32) for _ in range(2)]
    p = torch.randint(0, 300, (1, 4), generator=gen)
    for c in caches:
        model(input_ids=p, past_key_values=c, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(_GreedyStep(model), backend="fusec", options={"num_sms": 7})
    ours, ref = torch.tensor([[17]]), torch.tensor([[17]])
    seen = set()
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(12):
            a, b = compiled(ours, caches[0]), _GreedyStep(model)(ref, caches[1])
            assert int(a) == int(b) == int(ours) == int(ref)
            seen.add(int(a))
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    (step,) = steps
    kinds = step.schedule.graph.count_kinds()
    assert "aten.argmax.default" not in kinds and kinds["rms_lm_head"] == 1
    head = next(o for o in step.schedule.graph.ops if o.kind == "rms_lm_head")
    assert "token" in head.outputs
    src = render(step.schedule).source
    assert "rms_lm_head_argmax<" in src
    assert compile_cuda(src, "fusec_step.cu").resources["fusec_step"]["spill_store_bytes"] == 0


def test_import_fusec_installs_the_generate_hook_before_transformers():
    """``import fusec`` before transformers' modeling_utils is imported: the hook that routes
    generate()'s fusec decode call through one precompiled step (fusec.frontend.hf_generate) is
    installed when modeling_utils is imported, without fusec importing transformers itself."""
    import subprocess
    import sys
    code = ("import sys, fusec\n"
            "assert 'transformers.modeling_utils' not in sys.modules\n"
            "from transformers.modeling_utils import PreTrainedModel\n"
            "print(getattr(PreTrainedModel.get_compiled_call, '_fusec', False))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().splitlines()[-1] == "True", p.stderr[-2000:]


def test_generate_hook_takes_only_fusec_configs_with_dynamic_unset():
    """get_compiled_call gives fusec's decode call for a fusec CompileConfig with ``dynamic``
    unset, and HF's own compiled call for another backend or an explicit ``dynamic``; a second
    call with the same config returns the same object (no new compile)."""
    from transformers.generation import CompileConfig

    from fusec.frontend import hf_generate
    hf_generate.install()
    model = hf_tiny.llama()
    ours = model.get_compiled_call(_compile_config(options={"num_sms": 8}))
    assert isinstance(ours, hf_generate.HFDecodeCall)
    assert model.get_compiled_call(model._last_compile_config) is ours
    for cc in (CompileConfig(backend="eager"), _compile_config(dynamic=False), _compile_config(dynamic=True),
               _compile_config(dynamic=True, options={"num_sms": 8})):   # HF's default mode with options
        assert not isinstance(model.get_compiled_call(cc), hf_generate.HFDecodeCall), cc


def test_generate_on_a_sliding_window_cache_keeps_hfs_compiled_call(steps):
    """A cache with sliding-window layers (their positions counted in Python) cannot have a
    symbolic length: generate()'s own loop (``generate_loop="hf"``) calls HF's own compiled call, and the tokens
    still equal eager's with no fallback."""
    model = hf_tiny.gemma2(window=8)
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    cc = _compile_config(mode=None, options={"num_sms": 16, "generate_loop": "hf"})
    ref = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")
    with FallbackWatch() as w:
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static",
                             compile_config=cc)
    assert torch.equal(out, ref)
    assert not w.fallbacks and w.compiled, (w.fallbacks, w.compiled)
    assert model._compiled_call._prepared is None and model._compiled_call._plain is not None


#: generate()'s decode call's argument names, as HFDecodeCall.step_for takes them
_NAMES = ("input_ids", "past_key_values", "use_cache")


def _decode_step_against_eager(model, call, length: int, gen: torch.Generator) -> None:
    """One decode step through ``call`` (an HFDecodeCall) and through eager, each on its own
    StaticCache of ``length`` rows prefilled with the same random 3-token prompt: logits equal."""
    caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
    prompt = torch.randint(0, 128, (1, 3), generator=gen)
    for c in caches:
        model(input_ids=prompt, past_key_values=c, use_cache=True)
    tok = torch.randint(0, 128, (1, 1), generator=gen)
    a = call.step_for(_NAMES)(tok, caches[0], True).logits
    b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
    assert ((a - b).norm() / b.norm()).item() < 1e-4


def test_a_second_precompiled_trace_of_the_same_model_is_stored(tmp_path, monkeypatch, caplog):
    """Dynamo pickles the model's state when it saves a precompiled step; the model holds
    generate()'s decode call, whose loaded steps' guard managers cannot be pickled. The second
    trace of the same model (here: two static cache lengths, so the first entry's guards do not
    hold) is stored too instead of falling back to a plain torch.compile."""
    import logging

    from transformers.generation import CompileConfig

    from fusec.frontend.hf_generate import HFDecodeCall
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    model = hf_tiny.llama()
    call = HFDecodeCall(model, CompileConfig(backend="fusec", mode=None, options={"num_sms": 8, "cache": True}))
    model._compiled_call = call
    gen = torch.Generator().manual_seed(2)
    with caplog.at_level(logging.INFO, logger="fusec"), torch.no_grad():
        for length in (16, 24):
            _decode_step_against_eager(model, call, length, gen)
    step = call.step_for(_NAMES)
    assert step.compiled is None and len(step.entries) == 2, caplog.text[-2000:]
    assert caplog.text.count("stage precompiled   traced") == 2


def test_a_call_compiled_before_import_is_kept_with_one_line(caplog):
    """A model whose generate() decode call HF compiled before fusec's hook was installed keeps
    that call (no second compile of the same length) and says once how to get one step for
    every length."""
    import logging

    from fusec.frontend import hf_generate
    hf_generate.install()
    model = hf_tiny.llama()
    cc = _compile_config(mode=None)
    plain = torch.compile(model.__call__, backend="fusec")
    model._compiled_call, model._last_compile_config = plain, cc
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert model.get_compiled_call(cc) is plain and model.get_compiled_call(cc) is plain
    assert caplog.text.count("compiled before fusec was imported") == 1, caplog.text


def test_a_precompiled_step_loading_builtins_by_name_is_stored_and_loaded(tmp_path, monkeypatch, caplog):
    """generate()'s traced decode call loads the builtin ``type`` by global name (to rebuild the
    ModelOutput). torch 2.11 saves no builtin with the step and checks, after the trace and at
    load, that the function's globals hold every name the bytecode loads (the H200's torch fell
    back to a plain torch.compile in every process: "Missing required external references:
    ['type']"). Emulated here on torch 2.13 by dropping the builtins it saves: the step is traced
    and stored, and a second PrecompiledStep loads it and gives eager's logits."""
    import builtins
    import dataclasses
    import logging

    from torch._dynamo.convert_frame import GraphRuntimeEnv
    from transformers.generation import CompileConfig

    from fusec.frontend.hf_generate import HFDecodeCall
    original = GraphRuntimeEnv.forward_callable

    def as_torch_2_11(self, *a, **kw):
        used = {k: v for k, v in self.used_globals.items() if not hasattr(builtins, k)}
        return original(dataclasses.replace(self, used_globals=used), *a, **kw)
    monkeypatch.setattr(GraphRuntimeEnv, "forward_callable", as_torch_2_11)
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(5)
    with caplog.at_level(logging.INFO, logger="fusec"), torch.no_grad():
        for _ in range(2):   # the second call object finds the first one's entry
            call = HFDecodeCall(model, CompileConfig(backend="fusec", mode=None, options={"num_sms": 8, "cache": True}))
            _decode_step_against_eager(model, call, 16, gen)
            assert call.step_for(_NAMES).compiled is None, caplog.text[-2000:]
    assert caplog.text.count("stage precompiled   traced") == 1, caplog.text[-2000:]
    assert caplog.text.count("stage precompiled   loaded") == 1, caplog.text[-2000:]
