"""fusec.generate on the CPU simulator: HF generate()'s tokens, EOS, streamer, sampling, errors."""
from __future__ import annotations

import copy
import sys

import pytest
import torch

import fusec
import hf_tiny
from fusec.errors import FusecError
from fusec.fallbacks import FallbackWatch

OPTS = {"num_sms": 8}
FAST = {"num_sms": 8, "check_hazards": False}   # tests of the driver loop: skip the hazard check




@pytest.fixture
def gen_module():
    import fusec.generate  # noqa: F401 - the submodule (the package attribute is the function)
    return sys.modules["fusec.generate"]


def _prompt(seed: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(1, vocab, (1, 5), generator=torch.Generator().manual_seed(seed))


def _hf(model, prompt, n, **kw):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, cache_implementation="static",
                          pad_token_id=0, **kw)


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_greedy_equals_hf_generate(factory, steps):
    """16 greedy tokens equal HF generate(cache_implementation="static")'s, token for token; the
    decode step compiles with fusec (no fallback line), its argmax fused into the LM head."""
    model = factory()
    prompt = _prompt(1)
    ref = _hf(model, prompt, 16)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, prompt, 16, options=OPTS)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert out.dtype == torch.int64 and out.shape == ref.shape == (1, 21)
    assert torch.equal(out, ref)
    (step,) = steps
    assert step.calls == 15 and not step.fallen_back
    copy.deepcopy(model)   # the compiled step kept on the model does not travel with a copy
    g = step.schedule.graph
    assert "aten.argmax.default" not in g.count_kinds()
    assert "token" in next(o for o in g.ops if o.kind == "rms_lm_head").outputs


def test_eos_stream_and_chunks(gen_module, monkeypatch):
    """With chunks of 3 steps (the host one chunk behind): the output stops after the first eos,
    as HF generate's with that eos_token_id; the streamer gets the prompt, then every new token
    in order, then end(); a list of eos ids and eos_token_id=[] (never stop) work."""
    monkeypatch.setattr(gen_module, "CHUNK", 3)
    model = hf_tiny.qwen3(layers=1)
    prompt = _prompt(0)
    full = _hf(model, prompt, 12)[0, 5:].tolist()   # 99, 67, 91, 8, 10, 126, 99, 67, 23, 20, 16, 3
    k = 8                                           # eos in the third decode chunk
    eos = full[k]
    assert eos not in full[:k]
    ref = _hf(model, prompt, 12, eos_token_id=eos)
    assert ref.shape[1] == 5 + k + 1

    class Streamer:
        def __init__(self):
            self.puts, self.ended = [], 0

        def put(self, t):
            assert t.device.type == "cpu"
            self.puts.append(t.clone())

        def end(self):
            self.ended += 1
    s = Streamer()
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(model, prompt, 12, eos_token_id=eos, streamer=s, options=FAST)
        assert torch.equal(out, ref)
        assert torch.equal(s.puts[0], prompt) and s.ended == 1
        assert torch.cat([p.view(-1) for p in s.puts[1:]]).tolist() == full[:k + 1]
        assert len(s.puts) > 3   # chunk by chunk (prefill token, then chunks of 3)
        # several eos ids: the first one produced stops; [] never stops
        out2 = fusec.generate(model, prompt, 12, eos_token_id=[127, full[3]], options=FAST)
        assert out2[0, 5:].tolist() == full[:4]
        out3 = fusec.generate(model, prompt, 12, eos_token_id=[], options=FAST)
        assert out3[0, 5:].tolist() == full
        # eos as the prefill's token: no decode step
        out4 = fusec.generate(model, prompt, 12, eos_token_id=full[0], options=FAST)
        assert out4[0, 5:].tolist() == full[:1]
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


def test_default_eos_is_generation_config():
    """eos_token_id=None takes model.generation_config.eos_token_id, as HF does."""
    model = hf_tiny.qwen3(layers=1)
    prompt = _prompt(0)
    full = _hf(model, prompt, 6)[0, 5:].tolist()
    model.generation_config.eos_token_id = full[2]
    torch._dynamo.reset()
    out = fusec.generate(model, prompt, 6, options=FAST)
    torch._dynamo.reset()
    assert out[0, 5:].tolist() == full[:3]


def test_sampling_reproducible_and_top_k_1_is_greedy():
    """Sampling with a seeded generator (selection as torch ops after the step): same seed, same
    tokens; top_k=1 equals greedy; no fallback."""
    model = hf_tiny.qwen3(layers=1)
    prompt = _prompt(3)
    greedy = _hf(model, prompt, 6)   # qwen3's tiny config has no eos
    torch._dynamo.reset()
    with FallbackWatch() as w:
        runs = {}
        for name, kw in {"top_k": dict(temperature=0.8, top_k=20),
                         "top_p": dict(temperature=1.3, top_k=50, top_p=0.9)}.items():
            a, b, c = (fusec.generate(model, prompt, 6, do_sample=True, options=FAST,
                                      generator=torch.Generator().manual_seed(s), **kw) for s in (5, 5, 6))
            assert torch.equal(a, b), name
            assert a.shape == (1, 11) and torch.equal(a[:, :5], prompt)
            assert ((a >= 0) & (a < 128)).all()
            runs[name] = (a, c)
        one = fusec.generate(model, prompt, 6, do_sample=True, top_k=1, temperature=0.5, options=FAST,
                             generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert torch.equal(one, greedy)
    # sampling is not greedy: over the runs, some token differs from the greedy one
    assert any(not torch.equal(x, greedy) for pair in runs.values() for x in pair)


def test_sampling_inside_the_megakernel(gen_module, monkeypatch, steps):
    """SAMPLE_IN_GRAPH: temperature, top-k and the Gumbel-max argmax compile into the decode
    step (generic instructions in the simulator, no fallback) and draw the same tokens as the
    torch-ops selection with the same seed."""
    model = hf_tiny.qwen3(layers=1)
    prompt = _prompt(3)
    kw = dict(do_sample=True, temperature=1.5, top_k=30, options=FAST)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        outside = fusec.generate(model, prompt, 6, generator=torch.Generator().manual_seed(2), **kw)
        monkeypatch.setattr(gen_module, "SAMPLE_IN_GRAPH", True)
        inside = fusec.generate(model, prompt, 6, generator=torch.Generator().manual_seed(2), **kw)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert torch.equal(inside, outside)
    kinds = steps[-1].schedule.graph.count_kinds()
    assert "aten.topk.default" in kinds and "aten.argmax.default" in kinds, kinds


def test_select_matches_hf_warpers():
    """The on-device selection keeps exactly the tokens HF's temperature / top-k / top-p
    warpers keep: with noise, only kept tokens are ever drawn; argmax of -inf-masked logits."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                         TopPLogitsWarper)

    from fusec.generation.selection import gumbel_ as _gumbel_, select as _select
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=g)
    x = TemperatureLogitsWarper(0.7)(None, logits.clone())
    x = TopKLogitsWarper(10)(None, x)
    x = TopPLogitsWarper(0.8)(None, x)
    kept = set(torch.isfinite(x[0]).nonzero().view(-1).tolist())
    drawn = {int(_select(logits, _gumbel_(torch.rand(1, 50, generator=g)), 0.7, 10, 0.8)) for _ in range(400)}
    assert drawn <= kept and len(drawn) >= 2
    assert int(_select(logits, None, 1.0, None, None)) == int(logits.argmax())


def test_argument_errors():
    model = hf_tiny.llama(layers=1)
    ids = torch.randint(0, 128, (1, 4))
    bad = [
        (dict(input_ids=torch.randint(0, 128, (17, 4))), "the batch must be 1 to 16"),
        (dict(input_ids=ids.float()), "input_ids must be"),
        (dict(input_ids=ids[:, :0]), "prompt is empty"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=(1 << 20) - 3), r"KV cache of 1048577 rows .* max_new_tokens <= 1048572"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, top_p=0.0), "top_p"),
        (dict(do_sample=True, top_p=1.5), "top_p"),
        (dict(do_sample=True, top_k=-1), "top_k"),
        (dict(streamer=object()), "streamer"),
        (dict(eos_token_id="x"), "eos_token_id"),
        (dict(options={"no_such_option": 1}), "unknown fusec option"),
        (dict(model=model.model), "causal LM"),
        (dict(model=torch.nn.Linear(2, 2)), "config"),
        (dict(input_ids=torch.tensor([[1, -3, 2]])), r"input_ids\[0, 1\] = -3 is not a token id .* \[0, 128\)"),
        (dict(input_ids=torch.tensor([[1, 2], [5, 128]])), r"input_ids\[1, 1\] = 128 is not a token id"),
    ]
    for kw, msg in bad:
        args = {"model": model, "input_ids": ids, "max_new_tokens": 4, **kw}
        with pytest.raises(FusecError, match=msg):
            fusec.generate(args.pop("model"), args.pop("input_ids"), args.pop("max_new_tokens"), **args)


def test_a_model_its_authors_mark_not_compilable_is_refused(monkeypatch):
    """GPT-Neo declares ``_can_compile_fullgraph = False`` (its local-attention layers need a
    sliding cache): on a StaticCache its tokens differ from generate()'s own, so fusec.generate
    refuses it with a line that names the flag (before: other tokens, and a fallback line that
    called them correct). A class that inherits PreTrainedModel's default is not refused."""
    import transformers
    cfg = transformers.GPTNeoConfig(hidden_size=64, num_layers=2, attention_types=[[["global", "local"], 1]],
                                    num_heads=4, vocab_size=128, max_position_embeddings=64, window_size=16)
    neo = transformers.GPTNeoForCausalLM(cfg).eval()
    with pytest.raises(FusecError, match=r"GPTNeoForCausalLM .*_can_compile_fullgraph = False"):
        fusec.generate(neo, torch.randint(1, 128, (1, 20)), 4)
    from transformers.models.llama import modeling_llama
    from fusec.generation.arguments import check_model
    assert check_model(hf_tiny.llama()).type == "cpu"   # LlamaPreTrainedModel declares True
    monkeypatch.delattr(modeling_llama.LlamaPreTrainedModel, "_can_compile_fullgraph")
    assert check_model(hf_tiny.llama()).type == "cpu"   # PreTrainedModel's default False: no statement


def test_a_prefill_the_model_refuses_is_named():
    """BLOOM builds its ALiBi bias from a mask as long as the cache (its own generate() pads the
    mask, ``prepare_inputs_for_generation``): fusec.generate's eager prefill raises FusecError
    naming the model, the prefill and the cache, the model's RuntimeError as its cause (before:
    that RuntimeError from inside modeling_bloom.py); the next call on a model that works runs."""
    import transformers
    torch.manual_seed(0)
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=64, n_layer=1, n_head=4,
                                                                   vocab_size=128)).eval()
    with pytest.raises(FusecError, match=r"BloomForCausalLM's prefill of \(1, 20\) tokens on a StaticCache") as e:
        fusec.generate(bloom, torch.randint(3, 128, (1, 20)), 4)
    assert isinstance(e.value.__cause__, RuntimeError)
    model = hf_tiny.llama()
    ids = _prompt(1)
    torch._dynamo.reset()
    assert torch.equal(fusec.generate(model, ids, 3, options=FAST), _hf(model, ids, 3))
    torch._dynamo.reset()


def test_new_tokens_past_a_position_table_are_refused_before_any_work():
    """GPT-2's learned positions (``n_positions`` rows): a prompt of P tokens and N new tokens
    feed positions up to P + N - 2; up to the table's last row the tokens are HF greedy's, one
    more is a FusecError that says how many fit (before: an IndexFaultError after the prefill that
    suggested a longer cache, which a fixed table does not have)."""
    m = hf_tiny.gpt2()
    rows = m.config.max_position_embeddings
    ids = torch.randint(1, m.config.vocab_size, (1, rows - 10), generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(m, ids, 11, eos_token_id=[], options=FAST)
    torch._dynamo.reset()
    assert w.compiled and not w.fallbacks
    want = m.generate(ids, max_new_tokens=11, do_sample=False, attention_mask=torch.ones_like(ids),
                      eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, want)
    with pytest.raises(FusecError, match=f"position table of {rows} rows .* at most 11 new tokens"):
        fusec.generate(m, ids, 12, eos_token_id=[])
    # a left-padded batch: positions count the mask's ones, so padding in every row leaves room
    # (the longest row has 244 tokens: 13 new fit, where the padded width, 246, would allow 11)
    batch = ids.repeat(2, 1)
    mask = torch.ones_like(batch)
    mask[0, :3], mask[1, :2] = 0, 0
    batch[mask == 0] = 0
    torch._dynamo.reset()
    out = fusec.generate(m, batch, 13, attention_mask=mask, eos_token_id=[], options=FAST)
    torch._dynamo.reset()
    want = m.generate(batch, attention_mask=mask, max_new_tokens=13, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    assert torch.equal(out, want)
    with pytest.raises(FusecError, match=f"a prompt of {rows - 12} tokens and max_new_tokens=14 feed positions "
                                         f"up to {rows}, .* at most 13 new tokens"):
        fusec.generate(m, batch, 14, attention_mask=mask, eos_token_id=[])


def test_sampling_arguments_without_do_sample_are_named(caplog):
    """temperature / top_k / top_p without do_sample: greedy decoding, with one warning that
    says they are ignored (HF's generate() warns too); the defaults and the neutral values
    (temperature None or 1, top_k 0, top_p 1) give none."""
    import logging
    from fusec.generation.arguments import check_args
    ids = torch.randint(0, 128, (1, 4))
    with caplog.at_level(logging.WARNING, logger="fusec"):
        check_args(ids, None, 4, False, 1.0, None, None, None, None, None, None, torch.device("cpu"))
        check_args(ids, None, 4, False, None, 0, 1.0, None, None, None, None, torch.device("cpu"))   # neutral
        assert not caplog.records
        check_args(ids, None, 4, False, 0.5, None, None, None, None, None, None, torch.device("cpu"))
    assert [r for r in caplog.records if "do_sample is False" in r.getMessage()]


def test_steps_compiled_without_precompile_each_reach_fusec(monkeypatch):
    """A model whose cache counts positions on the host (sliding-window layers: plain
    ``torch.compile`` of the step, no precompile) sampled at two temperatures, each a step of its
    own: with dynamo's graphs per code object limited to 1, both compile with fusec (each step
    runs its own copy of ``forward``'s code); before, the second ran eagerly without a word."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    model = hf_tiny.mistral_sw()
    torch._dynamo.reset()
    for t in (0.7, 1.3):
        with FallbackWatch() as w:
            fusec.generate(model, _prompt(2), 3, do_sample=True, temperature=t, options=FAST,
                           generator=torch.Generator().manual_seed(0))
        assert w.compiled and not w.fallbacks, (t, w.compiled, w.fallbacks)
    torch._dynamo.reset()


def test_later_calls_run_on_the_kept_buffers_and_equal_hf_generate():
    """A model keeps its last batch-1 call's cache and decoder (on CUDA also the captured graph:
    fusec/generation/session.py): a later call with the same settings whose rows fit resets
    them in place and runs on them (a shorter prompt after a longer one, the first again: HF
    generate()'s tokens, nothing of the call before left); more rows, other settings, a batch,
    a weight moved to new memory, a call that failed midway: new buffers."""
    from fusec.generation import session
    model = hf_tiny.qwen3(layers=1)
    long, short = _prompt(1), torch.randint(1, 128, (1, 3), generator=torch.Generator().manual_seed(8))

    def run(x, n, **kw):
        out = fusec.generate(model, x, n, options=FAST, eos_token_id=[], **kw)
        if not kw:
            assert torch.equal(out, _hf(model, x, n)), (x.shape, n)
        return model._fusec_generate_steps.get(session.DECODE)

    torch._dynamo.reset()
    with FallbackWatch() as w:
        first = run(long, 8)
        assert first is not None and first.max_len == 64
        assert run(short, 6) is first                 # fits: the same buffers, reset
        assert run(long, 8) is first                  # the first call again, after the other
        bigger = run(long, 70)                        # 5 + 70 rows pass the first 64
        assert bigger is not first and bigger.max_len == 128
        sampled = run(short, 4, do_sample=True, generator=torch.Generator().manual_seed(1))
        assert sampled is not bigger                  # other settings: another step, other buffers
        greedy = run(short, 6)
        assert greedy is not sampled
        both = torch.cat([short, short])
        fusec.generate(model, both, 3, options=FAST, eos_token_id=[])
        assert model._fusec_generate_steps.get(session.DECODE) is None   # a batch keeps nothing
        kept = run(short, 6)
        with torch.no_grad():                         # a weight moved to new memory
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
        assert run(short, 6) is not kept
        with pytest.raises(KeyboardInterrupt):        # a call that fails midway drops its buffers
            fusec.generate(model, short, 6, options=FAST, eos_token_id=[], streamer=_Interrupt())
        assert model._fusec_generate_steps.get(session.DECODE) is None
        assert run(short, 6) is not None
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


class _Interrupt:
    """A streamer whose second ``put`` (the first new tokens) raises, as a user's Ctrl-C would."""

    def __init__(self):
        self.puts = 0

    def put(self, t):
        self.puts += 1
        if self.puts == 2:
            raise KeyboardInterrupt

    def end(self):
        pass


class _Nested:
    """A streamer whose second ``put`` runs another fusec.generate call on the same model (a
    chat UI that generates from its callback), keeping that call's output."""

    def __init__(self, call):
        self.call, self.puts, self.inner = call, 0, None

    def put(self, t):
        self.puts += 1
        if self.puts == 2:
            self.inner = self.call()

    def end(self):
        pass


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lookup", [None, 3], ids=["greedy", "prompt_lookup"])
def test_a_call_inside_a_running_call_runs_on_buffers_of_its_own(lookup):
    """fusec.generate called from the streamer of a running call on the same model: the running
    call's kept buffers are busy, so the inner call neither takes nor drops them and keeps
    nothing; both outputs equal HF greedy's, and the outer call's buffers stay kept for the next
    call. Before, the inner call reset the outer's cache and token buffer under it (wrong
    tokens, or an index error), and a prompt-lookup outer call never ended."""
    from fusec import prompt_lookup
    from fusec.generation import session
    model = hf_tiny.llama()
    outer, inner = _prompt(1), torch.randint(1, 128, (1, 3), generator=torch.Generator().manual_seed(2))
    kw = {"options": FAST, "eos_token_id": []} | ({} if lookup is None else {"prompt_lookup_num_tokens": lookup})
    name = session.DECODE if lookup is None else prompt_lookup.SESSION
    torch._dynamo.reset()
    with FallbackWatch() as w:
        s = _Nested(lambda: fusec.generate(model, inner, 24, **kw))
        out = fusec.generate(model, outer, 24, streamer=s, **kw)
        kept = model._fusec_generate_steps[name]
        assert s.inner is not None and not kept.busy
        again = fusec.generate(model, outer, 24, **kw)
        assert model._fusec_generate_steps[name] is kept   # the outer call's buffers, kept
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert torch.equal(out, _hf(model, outer, 24)) and torch.equal(again, out)
    assert torch.equal(s.inner, _hf(model, inner, 24))


@pytest.mark.parametrize("lookup", [None, 3], ids=["greedy", "prompt_lookup"])
def test_calls_in_and_out_of_inference_mode_each_run_on_buffers_they_may_write(lookup):
    """A call under ``torch.inference_mode()`` keeps inference tensors (its cache, its token
    buffer), which no write outside that mode may touch: the next call outside it makes buffers
    of its own (before: "Inplace update to inference tensor outside InferenceMode" from the
    kept cache's reset), and one inside it again does the same; every output equals HF greedy's."""
    from fusec import prompt_lookup
    from fusec.generation import session
    model = hf_tiny.llama()
    ids = _prompt(1)
    kw = {"options": FAST, "eos_token_id": []} | ({} if lookup is None else {"prompt_lookup_num_tokens": lookup})
    name = session.DECODE if lookup is None else prompt_lookup.SESSION
    torch._dynamo.reset()
    with FallbackWatch() as w:
        with torch.inference_mode():
            a = fusec.generate(model, ids, 12, **kw)
        first = model._fusec_generate_steps[name]
        b = fusec.generate(model, ids, 12, **kw)
        second = model._fusec_generate_steps[name]
        with torch.inference_mode():
            c = fusec.generate(model, ids, 12, **kw)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert first.inference and not second.inference and second is not first
    want = _hf(model, ids, 12)
    assert torch.equal(a, want) and torch.equal(b, want) and torch.equal(c, want)


def test_a_kept_graph_knows_the_engine_it_launched():
    """The check that keeps a kept CUDA graph from replaying another compiled step
    (``session.graph_current``): a module attribute changed (B) and changed back (A again)
    makes dynamo dispatch to A's compiled step without compiling anything, so only the engine
    the warm-up launched (``fusec.fallbacks.LAUNCHED``) tells that a graph captured under B is
    not A's. Before, such a graph was replayed: on the GPU the third call followed B's model."""
    from fusec.fallbacks import LAUNCHED
    from fusec.generation import session
    model = hf_tiny.qwen3(layers=1)
    attn = model.model.layers[0].self_attn
    s0 = attn.scaling
    torch._dynamo.reset()
    engines = []
    for scale in (s0, 4 * s0, s0):
        attn.scaling = scale
        with FallbackWatch() as w:
            out = fusec.generate(model, _prompt(1), 6, options=FAST, eos_token_id=[])
        assert not w.fallbacks and torch.equal(out, _hf(model, _prompt(1), 6))
        engines.append(LAUNCHED[0])
    torch._dynamo.reset()
    a, b, a_again = engines
    assert b is not a and a_again is a and not w.compiled   # back to A: nothing compiled
    kept = model._fusec_generate_steps[session.DECODE]
    kept.graph_engine = b
    assert not session.graph_current(kept, w)
    kept.graph_engine = a
    assert session.graph_current(kept, w)
