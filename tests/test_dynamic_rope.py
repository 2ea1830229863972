"""HF's dynamic RoPE updates (LongRoPE: Phi-3/3.5/4-mini long context; dynamic NTK) compiled as one
graph (``fusec.frontend.hf_rope``): before, their ``if seq_len > ...`` broke dynamo's graph, the
pieces without attention went to inductor with a fallback line at every step, and ``fusec compile``
failed. CPU simulator against eager, positions crossing the original length."""
from __future__ import annotations

import copy

import pytest
import torch

import fusec
import hf_tiny
from fusec.fallbacks import FallbackWatch

OPTS = {"num_sms": 8}


def _loop(model, prompt_len: int, n: int, seed: int = 5, prompt=None):
    """``n`` decode steps of ``model`` under ``torch.compile(backend="fusec")`` and of an eager
    copy, each on its own StaticCache after the same random prompt. Returns (each step's relative
    logits error, the fallback lines, the compiled steps' count, the eager copy)."""
    from transformers import StaticCache
    gen = torch.Generator().manual_seed(seed)
    eager = copy.deepcopy(model)
    caches = [StaticCache(config=model.config, max_cache_len=48) for _ in range(2)]
    p = torch.randint(0, 128, (1, prompt_len), generator=gen) if prompt is None else prompt
    errs = []
    compiled = torch.compile(model, backend="fusec", options=OPTS)
    with FallbackWatch() as w, torch.no_grad():
        for m, c in zip((model, eager), caches):
            m(input_ids=p, past_key_values=c, use_cache=True)
        for _ in range(n):
            tok = torch.randint(0, 128, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = eager(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            errs.append(((a - b).norm() / b.norm()).item())
    return errs, w.fallbacks, w.compiled, eager


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_is_one_graph_across_the_switch(partial, steps):
    """Phi-3 with LongRoPE (``partial=0.75``: Phi-4-mini's partial rotary), a 10-token prompt and
    12 decode steps: positions cross ``original_max_position_embeddings`` (16), where the short
    factors give way to the long ones. Every step matches eager (fp32, 1e-4), no fallback line
    (there was one per step and piece before), one fusec compile for all of them."""
    torch._dynamo.reset()
    errs, fallbacks, compiled, _ = _loop(hf_tiny.phi3_longrope(partial), 10, 12)
    torch._dynamo.reset()
    assert not fallbacks, fallbacks
    assert max(errs) < 1e-4 and min(errs) > 0, errs
    assert compiled == 1 and len(steps) == 1


def test_dynamic_ntk_state_follows_eager(steps):
    """Llama with dynamic NTK scaling (max_position_embeddings 16): 12 steps growing past 16, then
    a new 4-token sequence (HF resets to the original table) and 4 more steps. Every step matches
    eager, no fallback line, and the rotary module's state (``inv_freq``, the remembered length)
    equals the eager copy's after both. At most three fusec compiles: the first call sees HF's
    remembered length as a Python int, later calls the 0-d tensor the step stores, and after the
    eager prefill's reset ``inv_freq`` is the ``original_inv_freq`` object (dynamo guards that
    its inputs are distinct tensors: a graph for each aliasing, as for HF's own compiled
    generate)."""
    model = hf_tiny.llama_dynamic_ntk()
    torch._dynamo.reset()
    errs, fallbacks, _, eager = _loop(model, 10, 12)
    rot, ref = model.model.rotary_emb, eager.model.rotary_emb
    assert int(rot.max_seq_len_cached) == int(ref.max_seq_len_cached) == 22
    assert torch.equal(rot.inv_freq.float(), ref.inv_freq.float())
    # a new, short sequence on the same (compiled) model and the same eager copy: both reset
    from transformers import StaticCache
    gen = torch.Generator().manual_seed(9)
    p = torch.randint(0, 128, (1, 4), generator=gen)
    caches = [StaticCache(config=model.config, max_cache_len=48) for _ in range(2)]
    compiled = torch.compile(model, backend="fusec", options=OPTS)
    with FallbackWatch() as w, torch.no_grad():
        for m, c in zip((model, eager), caches):
            m(input_ids=p, past_key_values=c, use_cache=True)
        for _ in range(4):
            tok = torch.randint(0, 128, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = eager(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            errs.append(((a - b).norm() / b.norm()).item())
    torch._dynamo.reset()
    assert not fallbacks and not w.fallbacks, (fallbacks, w.fallbacks)
    assert max(errs) < 1e-4 and min(errs) > 0, errs
    assert int(rot.max_seq_len_cached) == int(ref.max_seq_len_cached) == 16
    assert torch.equal(rot.inv_freq.float(), ref.inv_freq.float())
    assert 1 <= len(steps) <= 3


def test_dynamic_ntk_longer_than_the_cache(steps):
    """Dynamic NTK whose ``max_position_embeddings`` (64, as in published configs) is longer than
    the StaticCache (48 rows): the remembered length starts past the cache's rows, where a
    position table would end (the step's state is a float32 tensor, not a position counter;
    as an int64 one, the second step raised IndexFaultError at a table lookup of 64). Every step
    equals eager, no fallback, the state stays at 64 as eager's, and the kernel of the step that
    reads the state compiles with NVRTC."""
    model = hf_tiny.llama_dynamic_ntk(max_positions=64)
    torch._dynamo.reset()
    errs, fallbacks, _, eager = _loop(model, 10, 8)
    torch._dynamo.reset()
    assert not fallbacks, fallbacks
    assert max(errs) < 1e-4 and min(errs) > 0, errs
    assert int(model.model.rotary_emb.max_seq_len_cached) == int(eager.model.rotary_emb.max_seq_len_cached) == 64
    assert len(steps) <= 2
    from fusec.cuda.codegen import render   # the step with the state as an input: a CUDA kernel
    from fusec.cuda.jit import compile_cuda
    kernel = compile_cuda(render(steps[-1].schedule).source, "fusec_step.cu")
    assert "warning" not in kernel.log, kernel.log


def _greedy_against_generate(model, eager, prompt_len: int, n: int, cache_len: int):
    """``n`` greedy tokens of an eager loop through a StaticCache (on ``eager``) and of
    ``fusec.generate`` (on ``model``) after the same random prompt. Returns (eager's tokens,
    fusec's new tokens, the FallbackWatch of the generate call)."""
    from transformers import StaticCache
    prompt = torch.randint(2, 128, (1, prompt_len), generator=torch.Generator().manual_seed(3))
    ref, cache, ids = [], StaticCache(config=eager.config, max_cache_len=cache_len), prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = eager(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1).view(1, 1)
            ref.append(int(nxt))
            ids = nxt
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, prompt, n, eos_token_id=[], options=OPTS)
    torch._dynamo.reset()
    return ref, out[0, prompt_len:].tolist(), w


def test_generate_with_longrope_equals_eager_greedy():
    """``fusec.generate`` on LongRoPE Phi-3 from a 12-token prompt, 10 new tokens (crossing 16):
    the tokens of an eager greedy loop through a StaticCache, no fallback. (Not HF's generate():
    transformers 5.17's Phi-3 ``prepare_inputs_for_generation`` drops the cache at the switch and
    then feeds the model one token without any cache at every later step.)"""
    model = hf_tiny.phi3_longrope()
    ref, got, w = _greedy_against_generate(model, model, 12, 10, 32)
    assert not w.fallbacks, w.fallbacks
    assert got == ref


def test_hf_generate_past_the_longrope_switch_says_the_model_replaced_the_static_cache():
    """HF's generate() on LongRoPE Phi-3 with a static cache, crossing 16 positions: Phi-3's own
    ``prepare_inputs_for_generation`` drops the cache at the switch and HF continues on a
    DynamicCache, which fusec does not compile; its line says that the model replaced the static
    cache (not only to pass one, which the caller did), and the tokens are HF's own."""
    from transformers.generation import CompileConfig
    model = hf_tiny.phi3_longrope()
    prompt = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    kw = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8, pad_token_id=1,
              eos_token_id=[], cache_implementation="static")
    with torch.no_grad():
        ref = model.generate(prompt, **kw)
        cc = CompileConfig(backend="fusec")
        cc._compile_all_devices = True   # HF compiles on CUDA only unless told (this machine has no GPU)
        torch._dynamo.reset()
        with FallbackWatch() as w:
            out = model.generate(prompt, compile_config=cc, **kw)
        torch._dynamo.reset()
    assert torch.equal(out, ref)
    grown = [f for f in w.fallbacks if "grows by concatenation" in f]
    assert grown and all("the model's own generation code replaced it" in f for f in grown), w.fallbacks


@pytest.mark.parametrize("max_positions", [16, 64])
def test_generate_with_dynamic_ntk_compiles_once(max_positions):
    """``fusec.generate`` on dynamic NTK (16: growing past it from a 10-token prompt; 64: longer
    than the cache): the tokens of an eager greedy loop on a copy, no fallback, one compile (the
    remembered length is a tensor before the first trace), the same remembered length."""
    model = hf_tiny.llama_dynamic_ntk(max_positions=max_positions)
    eager = copy.deepcopy(model)
    ref, got, w = _greedy_against_generate(model, eager, 10, 12, 64)
    assert not w.fallbacks, w.fallbacks
    assert got == ref
    assert w.compiled == 1, w.compiled
    assert int(model.model.rotary_emb.max_seq_len_cached) == int(eager.model.rotary_emb.max_seq_len_cached)


@pytest.mark.parametrize("factory", [hf_tiny.phi3_longrope, hf_tiny.llama_dynamic_ntk])
def test_cli_path_captures_one_graph_and_the_kernel_compiles(factory):
    """``fusec.api.compile_model`` (the CLI's path, ``fullgraph=True``) captures the step (it raised
    CaptureError at the graph break before), the simulated step matches eager, and the kernel
    compiles with NVRTC for sm_90a."""
    from fusec.api import compile_model
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    model = factory()
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 18)), past_key_values=cache, use_cache=True)
    res = compile_model(model, (), {"input_ids": torch.randint(0, 128, (1, 1)), "past_key_values": cache,
                                    "use_cache": True}, {"num_sms": 8, "simulate": True})
    assert res.simulated and "numeric" in res.simulated, res.simulated
    kernel = compile_cuda(render(res.schedule).source, "fusec_step.cu")
    assert "warning" not in kernel.log, kernel.log


def test_classes_decorated_after_install_get_the_polyfill():
    """A rotary class defined after ``install`` (a model module imported later) is registered when
    HF's decorator runs; eager calls of it are HF's own."""
    from transformers import modeling_rope_utils
    from fusec.frontend import hf_rope
    hf_rope.install()

    def forward(self, x, position_ids):
        return x

    wrapped = modeling_rope_utils.dynamic_rope_update(forward)
    assert id(wrapped) in hf_rope._REGISTERED
    assert wrapped.__wrapped__ is forward
