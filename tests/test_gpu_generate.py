"""GPU: fusec.generate, tokens on the device, chunks of decode steps replayed from a CUDA graph."""
from __future__ import annotations

import importlib

import pytest
import torch

import fusec
import hf_tiny
from fusec.fallbacks import FallbackWatch
from fusec.generation import session

pytestmark = pytest.mark.gpu


def _bf16_model():
    return hf_tiny.llama(layers=2, hidden=256, inter=512, heads=8, kv_heads=2, head_dim=32, vocab=512).cuda().bfloat16()


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.mistral_sw])
def test_greedy_fp32_equals_hf_eager(factory):
    """fp32 tiny Llama: 32 greedy tokens (prefill, warm-up, one CUDA-graph chunk, plain rest)
    equal HF eager generate()'s with a static cache; no fallback. The same for a tiny Mistral
    with a sliding window (its cache layers count positions in a Python int, computed on the
    host each step: steps launched one by one, no CUDA-graph replay)."""
    model = factory().cuda()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(4)).cuda()
    ref = model.generate(prompt, max_new_tokens=32, do_sample=False, cache_implementation="static",
                         disable_compile=True)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, prompt, 32)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert out.device.type == "cuda" and out.dtype == torch.int64
    assert torch.equal(out, ref)


def test_bf16_64_tokens_without_fallback():
    """bf16: 64 greedy tokens (several CUDA-graph chunks) run without error or fallback, every
    token in range; the same call again gives the same tokens."""
    model = _bf16_model()
    prompt = torch.randint(1, 512, (1, 5), device="cuda")
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, prompt, 64, eos_token_id=[])
        again = fusec.generate(model, prompt, 64, eos_token_id=[])
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert out.shape == (1, 69) and int(out.min()) >= 0 and int(out.max()) < 512
    assert torch.equal(out, again)


def test_sampling_graph_equals_plain_launches(monkeypatch):
    """bf16 sampling (temperature, top-k in the megakernel, top-p as torch ops): the same seed
    gives the same tokens from CUDA-graph replays and from plain launches, and stops at eos."""
    gm = importlib.import_module("fusec.generate")   # the submodule (fusec.generate is the function)
    model = _bf16_model()
    prompt = torch.randint(1, 512, (1, 5), device="cuda")

    def run(eos_token_id=(), **kw):
        return fusec.generate(model, prompt, 40, do_sample=True, eos_token_id=list(eos_token_id), temperature=0.9,
                              top_k=40, generator=torch.Generator(device="cuda").manual_seed(3), **kw)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        graphed = [run(), run(top_p=0.9)]
        monkeypatch.setattr(gm._Decoder, "capture", lambda self: False)
        model._fusec_generate_steps.pop(session.DECODE)   # no kept graph: plain launches from here
        plain = [run(), run(top_p=0.9)]
        eos = int(plain[0][0, 5 + 20])
        stopped = run(eos_token_id=[eos])
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    for a, b in zip(graphed, plain):
        assert torch.equal(a, b)
    first = plain[0][0, 5:].tolist().index(eos)
    assert torch.equal(stopped, plain[0][:, :5 + first + 1])


def test_capture_failure_falls_back_to_plain_launches(monkeypatch):
    """A decode step that cannot be captured (here: a host copy inside it) costs one warning
    line; the steps then run one by one and give the same tokens."""
    import logging
    gm = importlib.import_module("fusec.generate")
    model = _bf16_model()
    prompt = torch.randint(1, 512, (1, 5), device="cuda")
    torch._dynamo.reset()
    ref = fusec.generate(model, prompt, 40, eos_token_id=[])
    model._fusec_generate_steps.pop(session.DECODE)   # the next call captures anew (no kept graph)
    one = gm._Decoder.one

    def syncing(self, j):
        if torch.cuda.is_current_stream_capturing():
            self.tokens.cpu()   # not allowed while capturing
        one(self, j)
    monkeypatch.setattr(gm._Decoder, "one", syncing)
    records = []                      # a handler of our own: works with pytest's -p no:logging too
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log = logging.getLogger("fusec")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with FallbackWatch() as w:
            out = fusec.generate(model, prompt, 40, eos_token_id=[])
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert sum("capturing 16 decode steps in a CUDA graph failed" in m for m in w.warnings) == 1, w.warnings
    assert any("steps launched one by one" in r.getMessage() for r in records)
    assert torch.equal(out, ref)



def test_prompt_lookup_fp32_equals_hf_greedy():
    """Prompt lookup (N = 3, fusec.prompt_lookup) on the GPU: 48 tokens through the K = 4
    verification step, warm-up steps then CUDA-graph chunks, equal HF eager greedy's; no
    fallback; fewer steps than tokens (drafts accepted). A tiny Llama with its own LM head (its
    text varies and repeats in part, as tests/test_prompt_lookup.py's)."""
    import logging
    model = hf_tiny.llama(layers=2, seed=3)
    g = torch.Generator().manual_seed(3)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape, generator=g) * 0.3)
    prompt = torch.randint(0, 128, (1, 12), generator=g)
    model = model.cuda()
    prompt = prompt.cuda()
    ref = model.generate(prompt, max_new_tokens=48, do_sample=False, attention_mask=torch.ones_like(prompt),
                         eos_token_id=None, pad_token_id=0, disable_compile=True)
    records = []

    class Grab(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())
    h = Grab()
    logging.getLogger("fusec").addHandler(h)
    old = logging.getLogger("fusec").level
    logging.getLogger("fusec").setLevel(logging.INFO)
    torch._dynamo.reset()
    try:
        with FallbackWatch() as w:
            out = fusec.generate(model, prompt, 48, prompt_lookup_num_tokens=3, eos_token_id=[])
    finally:
        logging.getLogger("fusec").removeHandler(h)
        logging.getLogger("fusec").setLevel(old)
        torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert torch.equal(out, ref), (out[0, 12:].tolist(), ref[0, 12:].tolist())
    line = next(m for m in records if "prompt-lookup steps" in m)
    assert int(line.split(" in ")[1].split()[0]) < 47, line


@pytest.mark.parametrize("lookup", [None, 3], ids=["greedy", "prompt_lookup"])
def test_later_calls_replay_the_kept_graph_and_equal_hf_greedy(lookup):
    """Later calls replay the CUDA graph the first call captured (fusec/generation/session.py:
    greedy decoding's ``_DecodeSession``, prompt lookup's ``prompt_lookup._Session``): a
    shorter prompt, the first prompt again, a weight changed in place (the graph reads it where
    it is) all equal HF eager greedy's tokens; a weight moved to new memory gets a new graph."""
    from fusec import prompt_lookup
    model = hf_tiny.llama(layers=2, seed=3)
    g = torch.Generator().manual_seed(3)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape, generator=g) * 0.3)
    long = torch.randint(0, 128, (1, 12), generator=g).cuda()
    short = torch.randint(0, 128, (1, 5), generator=g).cuda()
    model = model.cuda()
    name, kw = (session.DECODE, {}) if lookup is None else \
        (prompt_lookup.SESSION, {"prompt_lookup_num_tokens": lookup})

    def run(x, n):
        ref = model.generate(x, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(x),
                             eos_token_id=None, pad_token_id=0, disable_compile=True)
        out = fusec.generate(model, x, n, eos_token_id=[], **kw)
        assert torch.equal(out, ref), (x.shape, n, out[0, x.shape[1]:].tolist(), ref[0, x.shape[1]:].tolist())
        kept = model._fusec_generate_steps[name]
        return kept, (kept.dec.graph if lookup is None else kept.graph)

    torch._dynamo.reset()
    try:
        with FallbackWatch() as w:
            first, graph = run(long, 48)
            assert graph is not None
            assert run(short, 40) == (first, graph)
            assert run(long, 48) == (first, graph)
            with torch.no_grad():
                model.lm_head.weight.mul_(1.5)
            assert run(short, 40) == (first, graph)
            with torch.no_grad():
                model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
            assert run(short, 40)[0] is not first
    finally:
        torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


def test_a_kept_graph_is_captured_again_when_the_warm_up_ran_another_step():
    """A module attribute changed (B) and changed back (A again): dynamo dispatches the third
    call to A's compiled step without compiling, and the graph kept from B's call must not be
    replayed (``session.graph_current``: the engine the warm-up launched is not the one the
    graph captured). Each call equals HF eager greedy's tokens; before, the third followed B."""
    model = hf_tiny.qwen3(layers=1).cuda()
    x = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(1)).cuda()
    attn = model.model.layers[0].self_attn
    s0 = attn.scaling
    torch._dynamo.reset()
    try:
        with FallbackWatch() as w:
            for scale in (s0, 4 * s0, s0, 4 * s0):
                attn.scaling = scale
                out = fusec.generate(model, x, 40, eos_token_id=[])
                ref = model.generate(x, max_new_tokens=40, do_sample=False, cache_implementation="static",
                                     disable_compile=True, pad_token_id=0, eos_token_id=None)
                assert torch.equal(out, ref), (scale / s0, out[0, 9:].tolist(), ref[0, 9:].tolist())
    finally:
        attn.scaling = s0
        torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


def test_draft_model_fp32_equals_hf_greedy():
    """Speculative decoding with a draft model (fusec.prompt_lookup.ModelDrafter) on the GPU: the
    target's LM head moved by noise drafts 3 tokens per step, its 2- and 1-token steps and the
    target's K = 4 verification all fusec steps, warm-up then CUDA-graph chunks; 48 tokens equal
    HF eager greedy's, no fallback, some drafts accepted. Then HF generate(assistant_model=...)
    through a fusec CompileConfig gives the same tokens."""
    import copy

    from transformers.generation import CompileConfig

    from fusec import prompt_lookup
    model = hf_tiny.llama(layers=2, seed=3)
    g = torch.Generator().manual_seed(3)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape, generator=g) * 0.3)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn(draft.lm_head.weight.shape, generator=g) * 0.15)
    prompt = torch.randint(0, 128, (1, 12), generator=g).cuda()
    model, draft = model.cuda(), draft.cuda()
    model.generation_config.pad_token_id = draft.generation_config.pad_token_id = 0
    ref = model.generate(prompt, max_new_tokens=48, do_sample=False, attention_mask=torch.ones_like(prompt),
                         eos_token_id=None, disable_compile=True)
    torch._dynamo.reset()
    try:
        with FallbackWatch() as w:
            out = fusec.generate(model, prompt, 48, assistant_model=draft, num_assistant_tokens=3, eos_token_id=[])
        stats = dict(prompt_lookup.last_stats)
        with FallbackWatch() as w2:
            hf = model.generate(prompt, max_new_tokens=48, do_sample=False, assistant_model=draft,
                                eos_token_id=None, compile_config=CompileConfig(backend="fusec"))
    finally:
        torch._dynamo.reset()
    assert not w.fallbacks and w.compiled and not w2.fallbacks, (w.fallbacks, w2.fallbacks)
    assert torch.equal(out, ref), (out[0, 12:].tolist(), ref[0, 12:].tolist())
    assert torch.equal(hf, ref), (hf[0, 12:].tolist(), ref[0, 12:].tolist())
    assert 0 < stats["accepted"] and stats["steps"] < 47, stats


def _left_padded(vocab: int, lens: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lens`` tokens left-padded with token 0 (input_ids, attention_mask), on CUDA."""
    t = max(lens)
    ids = torch.randint(1, vocab, (len(lens), t), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lens), t, dtype=torch.int64)
    for i, n in enumerate(lens):
        mask[i, t - n:] = 1
        ids[i, :t - n] = 0
    return ids.cuda(), mask.cuda()


def test_batch_4_fp32_equals_hf_eager():
    """fp32 tiny Llama (an LM head of its own, so that greedy does not repeat the last token),
    B = 4 left-padded prompts of lengths 7, 3, 9 and 1: 40 greedy tokens (prefill, warm-up, two
    CUDA-graph chunks of [16, 4] tokens, plain rest) equal HF eager generate(attention_mask)'s;
    with an eos that one sequence meets in its second chunk, that sequence continues with the pad
    token and the others as before, as HF's. No fallback. Not yet run on a GPU."""
    model = hf_tiny.llama(layers=2)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape,
                                                          generator=torch.Generator().manual_seed(11)),
                                              requires_grad=False)
    model = model.cuda()
    ids, mask = _left_padded(128, (7, 3, 9, 1), 5)

    def hf(**kw):
        return model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
                              disable_compile=True, **kw)
    ref = hf(eos_token_id=[])
    full = ref[:, 9:].tolist()
    k, eos = next(((k, t) for k, t in enumerate(full[0]) if 18 <= k and t not in full[0][:k]
                   and all(t not in row for row in full[1:])), (None, None))
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, ids, 40, attention_mask=mask, eos_token_id=[], pad_token_id=0)
        stopped = fusec.generate(model, ids, 40, attention_mask=mask, eos_token_id=eos, pad_token_id=0) \
            if eos is not None else None
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert out.device.type == "cuda" and out.shape == (4, 49)
    assert torch.equal(out, ref)
    if eos is not None:
        assert torch.equal(stopped, hf(eos_token_id=eos))
        assert stopped[0, 9 + k + 1:].eq(0).all()


def test_batch_4_bf16_rows_and_replays():
    """bf16 B = 4, 64 greedy tokens (several CUDA-graph chunks): four copies of one prompt give
    four equal rows; left-padded prompts run without fallback, every token in range, the same
    tokens from a second call. (Not compared with HF's bf16 generate(): HF rounds every op's
    output to bf16, fusec's fused tiles accumulate in fp32, so greedy tokens may part after a
    near tie; fp32 is compared token for token above.) Not yet run on a GPU."""
    model = _bf16_model()
    prompt = torch.randint(1, 512, (1, 6), device="cuda")
    ids, mask = _left_padded(512, (5, 8, 2, 6), 9)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        same = fusec.generate(model, prompt.expand(4, -1).contiguous(), 64, eos_token_id=[])
        out = fusec.generate(model, ids, 64, attention_mask=mask, eos_token_id=[])
        again = fusec.generate(model, ids, 64, attention_mask=mask, eos_token_id=[])
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert all(torch.equal(same[0], row) for row in same[1:])
    assert out.shape == (4, 72) and int(out.min()) >= 0 and int(out.max()) < 512
    assert torch.equal(out, again)


@pytest.mark.parametrize("lookup", [None, 3], ids=["greedy", "prompt_lookup"])
@pytest.mark.parametrize("factory,weights", [
    (lambda: hf_tiny.llama(layers=2, seed=3), lambda m: [m.model.rotary_emb.inv_freq]),
    (hf_tiny.gemma, lambda m: [p for n, p in m.named_parameters() if n.endswith("norm.weight")]),
], ids=["llama-inv_freq", "gemma-norms"])
def test_a_weight_written_through_data_between_generate_calls_rebuilds(factory, weights, lookup, caplog):
    """Issue 30, item 4 on the GPU: values the step compiled in (Llama's ``inv_freq`` in the RoPE
    tables, Gemma's ``1 + w``) written through ``.data`` between two fusec.generate calls (no
    version counter moves, the address stays: the kept CUDA graph would replay the old values)
    are compared at the next call's first step (fusec/frontend/value_snapshot.py): the step builds
    again, with its line, and the tokens equal HF eager greedy's on the new weights; in a plain
    loop the same after ``fusec.check_weights_at_next_call()``."""
    import logging
    from fusec import prompt_lookup
    model = factory().cuda()
    prompt = torch.randint(1, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5)).cuda()
    name, kw = (session.DECODE, {}) if lookup is None else (prompt_lookup.SESSION, {"prompt_lookup_num_tokens": lookup})

    def run():
        ref = model.generate(prompt, max_new_tokens=40, do_sample=False, attention_mask=torch.ones_like(prompt),
                             eos_token_id=None, pad_token_id=0, disable_compile=True)
        out = fusec.generate(model, prompt, 40, eos_token_id=[], **kw)
        assert torch.equal(out, ref), (out[0, 9:].tolist(), ref[0, 9:].tolist())

    torch._dynamo.reset()
    try:
        with FallbackWatch() as w, caplog.at_level(logging.INFO, logger="fusec"):
            run()
            assert name in model._fusec_generate_steps
            for p in weights(model):
                version = p._version
                p.data.copy_(p.detach() * 1.5 + 0.1)
                assert p._version == version
            caplog.clear()
            run()
            assert "changed since the step was built (its bytes differ" in caplog.text
            # a plain loop: the same write is seen after fusec.check_weights_at_next_call()
            caches = [hf_tiny.static_cache(model, 64) for _ in range(2)]
            with torch.no_grad():
                for c in caches:
                    model(input_ids=prompt, past_key_values=c, use_cache=True)
                step = torch.compile(model, backend="fusec")
                tok = prompt[:, :1]
                step(input_ids=tok, past_key_values=caches[0], use_cache=True)
                model(input_ids=tok, past_key_values=caches[1], use_cache=True)
                for p in weights(model):
                    p.data.copy_(p.detach() * 0.5)
                fusec.check_weights_at_next_call()
                a = step(input_ids=tok, past_key_values=caches[0], use_cache=True).logits.float()
                b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits.float()
                assert ((a - b).norm() / b.norm()).item() < 1e-4
    finally:
        torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
