"""torch.compile(model, backend="fusec") on the CPU simulator against eager, HF models."""
from __future__ import annotations

import logging

import pytest
import torch

import hf_tiny

CASES = {
    # name: (factory, kwargs)
    "llama_gqa1": (hf_tiny.llama, dict(heads=4, kv_heads=4)),
    "llama_gqa4": (hf_tiny.llama, dict(heads=8, kv_heads=2, head_dim=8)),
    "llama_gqa8": (hf_tiny.llama, dict(heads=8, kv_heads=1, head_dim=8)),
    "llama_odd_dims": (hf_tiny.llama, dict(hidden=96, inter=200, heads=6, kv_heads=2, head_dim=16,
                                           vocab=300, layers=3)),
    "qwen3": (hf_tiny.qwen3, dict(hidden=80, inter=136, heads=4, kv_heads=2, head_dim=20, vocab=200)),
}


def _caches_close(c1, c2, tol=1e-5):
    for l1, l2 in zip(c1.layers, c2.layers):
        for a, b in ((l1.keys, l2.keys), (l1.values, l2.values)):
            scale = b.abs().max().clamp_min(1e-6)
            assert ((a - b).abs().max() / scale) <= tol
        assert int(l1.cumulative_length) == int(l2.cumulative_length)


@pytest.mark.parametrize("merge", ["last_tile", "reduce"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_matches_eager(case, merge, caplog):
    factory, kw = CASES[case]
    model = factory(**kw)
    vocab = model.config.vocab_size
    ours, ref = hf_tiny.static_cache(model, 40), hf_tiny.static_cache(model, 40)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 24, "fallback": "eager",
                                                                "attention_merge": merge})
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    prompt = torch.randint(0, vocab, (1, 12), generator=gen)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fusec"):
        compiled(input_ids=prompt, past_key_values=ours, use_cache=True)   # prefill: falls back
        model(input_ids=prompt, past_key_values=ref, use_cache=True)
        assert sum("not a decode step of at most 1 query token (12 query tokens, more than 1)" in r.message for r in caplog.records) == 1
        for step in range(16):
            tok = torch.randint(0, vocab, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=ours, use_cache=True).logits
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert torch.isfinite(a).all()
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < 1e-4, f"step {step}: relative error {rel:.2e}"
            _caches_close(ours, ref)
    torch._dynamo.reset()


def test_llama_fuses_into_instruction_kinds():
    """Structure: every decoder layer becomes the DESIGN.md instruction kinds, nothing generic
    but the position-counter updates."""
    from fusec.api import compile_model
    model = hf_tiny.llama(layers=3)
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 4)), past_key_values=cache, use_cache=True)
    res = compile_model(model, (), {"input_ids": torch.randint(0, 128, (1, 1)),
                                    "past_key_values": cache, "use_cache": True},
                        {"num_sms": 16})
    kinds = res.graph.count_kinds()
    assert kinds["embedding"] == 1
    assert kinds["rms_qkv_rope"] == 3
    assert kinds["attention_partial"] == 3 and "attention_reduce" not in kinds   # last-tile merge
    assert kinds["matvec_residual"] == 6
    assert kinds["rms_gate_up_silu"] == 3
    assert kinds["rms_lm_head"] == 1
    leftovers = {k for k in kinds if k.startswith("aten.") or k in ("linear", "rmsnorm", "rope")}
    assert leftovers <= {"aten.copy_.default"}, leftovers


def _steps_against_eager(model, compiled, batch: int, gen: torch.Generator, length: int = 16,
                         prompt: int = 3, steps: int = 2) -> list[float]:
    """A ``prompt``-token random prefill of ``batch`` sequences into two StaticCaches of ``length``
    rows, then ``steps`` random decode tokens through ``compiled`` and eagerly: each step's
    relative logits error (fp32, the whole batch)."""
    caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
    ids = torch.randint(0, 128, (batch, prompt), generator=gen)
    errs = []
    with torch.no_grad():
        for c in caches:
            model(input_ids=ids, past_key_values=c, use_cache=True)
        for _ in range(steps):
            ids = torch.randint(0, 128, (batch, 1), generator=gen)
            a = compiled(input_ids=ids, past_key_values=caches[0], use_cache=True).logits
            e = model(input_ids=ids, past_key_values=caches[1], use_cache=True).logits
            errs.append(((a - e).norm() / e.norm()).item())
    return errs


def test_a_batch_size_that_varies_compiles_a_step_per_batch_size(caplog):
    """A plain loop over batches of 2, 3, 2, 3 and 17 sequences (a StaticCache each): the second
    batch size makes dynamo's batch dim symbolic, and fusec compiles one step per batch size (one
    log line saying so) instead of falling back: every batch of at most 16 runs fusec with
    eager's logits; the batch of 2 again compiles once more (dynamo tries its newest graph, the
    symbolic one, first), the batch of 3 again reuses its step, and 17 sequences (more than a
    step takes) fall back with one line naming that count."""
    model = hf_tiny.llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8, "fallback": "eager"})
    gen = torch.Generator().manual_seed(2)
    from fusec.fallbacks import FallbackWatch
    seen = []
    with caplog.at_level(logging.INFO, logger="fusec"):
        for b in (2, 3, 2, 3, 17):
            with FallbackWatch() as w:
                errs = _steps_against_eager(model, compiled, b, gen)
            assert max(errs) < 1e-5, (b, errs)
            seen.append((b, len(w.fallbacks), w.compiled))
    torch._dynamo.reset()
    assert seen == [(2, 0, 1), (3, 0, 1), (2, 0, 1), (3, 0, 0), (17, 1, 0)], seen
    msgs = [r.message for r in caplog.records]
    assert sum("the batch size varies between calls" in m and "one step per batch size" in m for m in msgs) == 1
    refused = [m for m in msgs if "not a decode step of at most 1 query token" in m]
    assert len(refused) == 1 and "(17 sequences, more than 16)" in refused[0], refused


def test_after_the_batch_varies_each_batch_size_serves_every_cache_length():
    """A batch of 2, then a batch of 3 over StaticCaches of 16 to 32 rows (a plain loop): once
    the batch size varied, each batch size's step still serves every cache length as at a fixed
    batch (dynamo makes the length symbolic at the second length: one more compile, then none),
    not one compile per (batch size, length); every step's logits are eager's."""
    model = hf_tiny.llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
    gen = torch.Generator().manual_seed(5)
    from fusec.fallbacks import FallbackWatch
    seen = []
    for b, length in [(2, 16), (3, 16), (3, 20), (3, 24), (3, 28), (3, 32)]:
        with FallbackWatch() as w:
            errs = _steps_against_eager(model, compiled, b, gen, length=length, prompt=4, steps=1)
        assert all(0 < e < 1e-5 for e in errs), (b, length, errs)
        seen.append((b, length, len(w.fallbacks), w.compiled))
    torch._dynamo.reset()
    assert seen == [(2, 16, 0, 1), (3, 16, 0, 1), (3, 20, 0, 1), (3, 24, 0, 0), (3, 28, 0, 0), (3, 32, 0, 0)], seen


def test_a_dynamic_cache_with_a_varying_batch_falls_back_once_per_graph():
    """HF's default DynamicCache (its keys grow by ``torch.cat``) over batches of 2 and 3, 10 steps
    each: the graph with the symbolic batch is refused for the cache, not taken per batch size and
    refused again at every step: at most one fallback line per dynamo graph, each naming the
    DynamicCache."""
    model = hf_tiny.llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8, "fallback": "eager"})
    gen = torch.Generator().manual_seed(6)
    from fusec.fallbacks import FallbackWatch
    lines = []
    for b in (2, 3):
        with torch.no_grad():
            pkv = model(input_ids=torch.randint(1, 128, (b, 4), generator=gen), use_cache=True).past_key_values
        with FallbackWatch() as w, torch.no_grad():
            for _ in range(10):
                compiled(input_ids=torch.randint(1, 128, (b, 1), generator=gen), past_key_values=pkv, use_cache=True)
        lines += w.fallbacks
    torch._dynamo.reset()
    assert 1 <= len(lines) <= 4 and all("DynamicCache" in m for m in lines), lines


def test_a_call_without_a_cache_names_the_missing_cache():
    """``use_cache=False`` on one token: the fallback line says the step has no KV cache and to
    pass a StaticCache (it named an unsupported ``cumsum`` in HF's packed-sequence mask, a new
    user's find); the logits are eager's."""
    from fusec.fallbacks import FallbackWatch
    model = hf_tiny.llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
    tok = torch.tensor([[5]])
    with FallbackWatch() as w, torch.no_grad():
        got = compiled(input_ids=tok, use_cache=False).logits
        want = model(input_ids=tok, use_cache=False).logits
    torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    assert len(w.fallbacks) == 1 and "the step has no KV cache" in w.fallbacks[0] \
        and "StaticCache" in w.fallbacks[0], w.fallbacks


class _SetitemCache(torch.nn.Module):
    """A decoder layer whose one-row KV cache is written by item assignment (gpt-fast's style):
    at position 0 the attention reads one key for one query, and the step writes its cache."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)
        self.register_buffer("kc", torch.zeros(1, 2, 1, 16))
        self.register_buffer("vc", torch.zeros(1, 2, 1, 16))

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, 1, 3, 2, 16).permute(2, 0, 3, 1, 4)
        self.kc[:, :, 0:1] = k
        self.vc[:, :, 0:1] = v
        out = torch.nn.functional.scaled_dot_product_attention(q, self.kc, self.vc)
        return self.o(out.transpose(1, 2).reshape(1, 1, 32))


def test_a_cache_written_by_item_assignment_is_a_cache():
    """Keys as many as the queries, but the step writes its cache by ``setitem``: not taken for
    a call without a cache (a try-to-break helper's find: such a step fell back)."""
    from fusec.frontend.capture import _no_cache
    seen = []

    def record(gm, example_inputs):
        from fusec.frontend.custom_ops import SDPA_TARGETS
        calls = [(n, n.args[0], n.args[1]) for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
        seen.append(_no_cache(gm, calls, {}))
        return gm.forward
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(_SetitemCache().eval(), backend=record)(torch.randn(1, 1, 32))
    torch._dynamo.reset()
    assert seen == [False]


@pytest.mark.parametrize("batch", [2, 3])
def test_dynamic_true_at_a_fixed_batch_runs_fusec(batch):
    """``torch.compile(model, backend="fusec", dynamic=True)`` at a fixed batch: dynamo makes the
    batch (and the floats it passes as 0-d tensors) symbolic; fusec compiles one step for the
    batch size (the floats specialized by a capture in dynamo's context) instead of falling back,
    a second cache of the same shape reuses it, and the logits are eager's. A batch of 2 equals
    the tiny model's KV heads and its 16-row cache its head size: dynamo specializes the batch's
    symbol to a constant, which is a fixed size, not one that varies."""
    model = hf_tiny.llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", dynamic=True, options={"num_sms": 8})
    gen = torch.Generator().manual_seed(3)
    from fusec.fallbacks import FallbackWatch
    with FallbackWatch() as w:
        errs = [e for _ in range(2) for e in _steps_against_eager(model, compiled, batch, gen, prompt=4)]
    torch._dynamo.reset()
    assert all(0 < e < 1e-5 for e in errs), errs
    assert not w.fallbacks and w.compiled == 1, (w.fallbacks, w.compiled)


@pytest.mark.parametrize("cache", [True, False])
def test_token_views_of_a_growing_sequence_compile_twice_and_run_fusec(steps, cache, tmp_path, monkeypatch):
    """A plain loop that passes ``ids[:, -1:]`` of the growing sequence (a view whose stride
    changes every step): dynamo compiles once for the first stride and once with the stride
    dynamic, and every step after runs fusec (fp32, its logits differ from eager's by rounding
    only, never exactly: eager would mean dynamo gave up after its recompile limit); with no
    fallback line; with fusec's artifact cache on and cold (a user's first run; AOT then runs)
    and off. (A guard on the symbolic stride, added when fusec compared AOT's inputs with
    dynamo's, used to make dynamo recompile at every step until it gave up.)"""
    from transformers import StaticCache
    if cache:
        monkeypatch.setenv("FUSEC_CACHE", "1")
        monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    from fusec.fallbacks import FallbackWatch
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(17)
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    ids = torch.randint(0, 128, (1, 4), generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
    with torch.no_grad(), FallbackWatch() as w:
        for c in caches:
            model(input_ids=ids, past_key_values=c, use_cache=True)
        for step in range(11):
            a = compiled(input_ids=ids[:, -1:], past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=ids[:, -1:], past_key_values=caches[1], use_cache=True).logits
            assert 0 < ((a - b).norm() / b.norm()).item() < 1e-4, step
            ids = torch.cat([ids, torch.randint(0, 128, (1, 1), generator=gen)], dim=1)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert len(steps) == 2, len(steps)
