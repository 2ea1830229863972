"""GPU: HF generate() through fusec and the plain-loop call patterns, as a user calls them."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("loop", ["device", "hf"])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_hf_generate_through_fusec_equals_eager(factory, loop):
    """generate(..., cache_implementation="static", compile_config=CompileConfig(backend="fusec"))
    with HF's defaults (mode="reduce-overhead"): 40 greedy tokens equal eager's (fp32), and the
    decode step runs as one megakernel (no fallback): by default as fusec.generate's device loop
    (chunks of 16 steps replayed from a CUDA graph), with ``generate_loop="hf"`` through HF's loop."""
    from transformers.generation import CompileConfig
    model = factory().cuda()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4)).cuda()
    # disable_compile: on CUDA HF compiles a static-cache generate() by itself (its own
    # `_compiled_call`, inductor), which the reference must not be
    ref = model.generate(prompt, max_new_tokens=40, do_sample=False, cache_implementation="static",
                         disable_compile=True)
    torch._dynamo.reset()
    cc = CompileConfig(backend="fusec", options=None if loop == "device" else {"generate_loop": "hf"})
    with FallbackWatch() as w:
        out = model.generate(prompt, max_new_tokens=40, do_sample=False, cache_implementation="static",
                             compile_config=cc)
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert torch.equal(out, ref)
    assert ("_compiled_call" in model.__dict__) == (loop == "hf")


def test_hf_generate_of_a_padded_batch_through_the_device_loop_equals_eager():
    """Four left-padded prompts, eos ids the greedy text meets, 40 new tokens (fp32): HF generate()
    through fusec (the device loop, its CUDA-graph chunks) equals eager generate() token for token."""
    from transformers.generation import CompileConfig
    model = hf_tiny.llama(layers=2).cuda()
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, 128, (4, 9), generator=gen).cuda()
    mask = torch.ones(4, 9, dtype=torch.long, device="cuda")
    mask[1, :4] = mask[3, :2] = 0
    free = model.generate(prompt, attention_mask=mask, max_new_tokens=40, do_sample=False,
                          cache_implementation="static", eos_token_id=[], disable_compile=True)
    eos = [int(free[0, 9 + 20]), int(free[2, 9 + 30])]
    ref = model.generate(prompt, attention_mask=mask, max_new_tokens=40, do_sample=False,
                         cache_implementation="static", eos_token_id=eos, disable_compile=True)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=40, do_sample=False,
                             cache_implementation="static", eos_token_id=eos,
                             compile_config=CompileConfig(backend="fusec"))
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert torch.equal(out, ref)
    assert "_compiled_call" not in model.__dict__


def test_hf_beam_search_runs_on_fusec():
    """Beam search (two left-padded prompts, 4 beams: batch steps of 8 rows) through a fusec
    CompileConfig with HF's defaults (mode="reduce-overhead": the step replayed from a CUDA graph,
    the cache gathered in place between steps): 24 new tokens equal eager beam search's (fp32),
    one compile, no fallback."""
    from transformers.generation import CompileConfig
    model = hf_tiny.llama(layers=2).cuda()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(7)).cuda()
    mask = torch.ones(2, 8, dtype=torch.long, device="cuda")
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, num_beams=4, num_return_sequences=2, max_new_tokens=24, do_sample=False,
              cache_implementation="static")
    ref = model.generate(prompt, **kw)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = model.generate(prompt, compile_config=CompileConfig(backend="fusec"), **kw)
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled == 1, (w.compiled, w.fallbacks)
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())


def test_hf_generate_sampling_runs_on_fusec():
    """Sampling through HF's logits processors (temperature, top-k, top-p) on fusec's logits:
    bf16, 48 tokens, every token in range, no fallback."""
    from transformers.generation import CompileConfig
    model = hf_tiny.llama(layers=2, hidden=256, inter=512, heads=8, kv_heads=2, head_dim=32, vocab=512).cuda().bfloat16()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 512, (1, 5), device="cuda")
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = model.generate(prompt, max_new_tokens=48, min_new_tokens=48, do_sample=True, temperature=0.8,
                             top_k=50, top_p=0.95, cache_implementation="static",
                             compile_config=CompileConfig(backend="fusec"))
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert out.shape == (1, 53) and int(out.min()) >= 0 and int(out.max()) < 512


def test_call_patterns_run_the_megakernel():
    """fp32 plain loops: explicit position_ids/cache_position, a full-length attention_mask, a
    fresh (lazily initialized) cache, a second cache length: fusec's logits match eager's
    (1e-4) with no fallback."""
    gen = torch.Generator().manual_seed(9)
    model = hf_tiny.llama(layers=2, vocab=160).cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")

    def run(length, n, kwargs_at, prefill=True):
        caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
        if prefill:
            p = torch.randint(0, 160, (1, 4), generator=gen).cuda()
            for c in caches:
                model(input_ids=p, past_key_values=c, use_cache=True)
        for i in range(n):
            tok = torch.randint(0, 160, (1, 1), generator=gen).cuda()
            kw = kwargs_at(i)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True, **kw).logits.clone()
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True, **kw).logits
            rel = ((a - b).norm() / b.norm()).item()
            assert 0 < rel < 1e-4, (length, i, rel)

    def mask(i):
        am = torch.zeros(1, 32, dtype=torch.long, device="cuda")
        am[:, : 5 + i] = 1
        return {"attention_mask": am}
    with FallbackWatch() as w, torch.no_grad():
        run(32, 4, lambda i: dict(position_ids=torch.tensor([[4 + i]], device="cuda"),
                                  cache_position=torch.tensor([4 + i], device="cuda")))
        run(32, 4, mask)
        run(32, 3, lambda i: {}, prefill=False)
        run(48, 3, lambda i: {})
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


def test_kept_outputs_of_a_plain_loop_are_never_overwritten(monkeypatch):
    """A plain loop that keeps every step's logits without a copy (fp32: ``.float()`` is no
    copy; ``out.logits[:, -1]``, a view) gets each step's own values, as in eager: the logits
    kept from steps 1..6 equal eager's for those steps after the loop (they were the kernel's
    one buffer, each overwritten by the next step, before fusec.runtime.outputs). Then a loop that
    drops its outputs (``del out``) moves no buffer."""
    import copy

    import step_util
    from fusec.runtime.cuda_step import CudaStep
    made, init = [], CudaStep.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)
    record.keeps_cache = True   # only records (conftest.py)
    monkeypatch.setattr(CudaStep, "__init__", record)
    model, cache = step_util.tiny_on_gpu(lambda: hf_tiny.llama(layers=2), torch.float32)
    ref = copy.deepcopy(cache)
    gen = torch.Generator().manual_seed(9)
    toks = [torch.randint(0, 128, (1, 1), generator=gen).cuda() for _ in range(6)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    kept, kept_last, eager = [], [], []
    with torch.no_grad(), FallbackWatch() as w:
        for t in toks:
            out = compiled(input_ids=t, past_key_values=cache, use_cache=True)
            kept.append(out.logits.float())
            kept_last.append(out.logits[:, -1])
            eager.append(model(input_ids=t, past_key_values=ref, use_cache=True).logits.clone())
    assert w.compiled and not w.fallbacks, w.fallbacks
    errors = [(step_util.rel(a, b), step_util.rel(v, b[:, -1])) for a, v, b in zip(kept, kept_last, eager)]
    assert all(e < 1e-4 and f < 1e-4 for e, f in errors), errors
    assert len({a.data_ptr() for a in kept}) == len(kept)   # six buffers: each one handed over
    del kept, kept_last, out
    moved = sum(s.outputs.moved for s in made)
    assert made and moved >= 5, (len(made), moved)   # steps 2..6 each found the last one held
    with torch.no_grad():
        for t in toks[:3]:
            out = compiled(input_ids=t, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1)
            del out
    torch.cuda.synchronize()
    assert nxt.shape == (1,) and sum(s.outputs.moved for s in made) == moved
    torch._dynamo.reset()
