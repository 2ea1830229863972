"""HF generate() with a fusec CompileConfig runs greedy search as fusec.generate's device loop
(fusec/frontend/hf_device_loop.py), on the CPU simulator: the tokens equal eager generate()'s for
batches with padding and eos ids, a streamer gets what eager's gets, and every call the device loop
does not take (sampling, logits processors, a cache the caller passed, ...) runs HF's loop with
one log line saying why, its tokens equal too."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.errors import FusecError
from fusec.fallbacks import FallbackWatch

RAN = "fusec.generate: "   # the device loop's own info line (fusec.generate's summary)


def _cc(**options):
    from transformers.generation import CompileConfig
    cc = CompileConfig(backend="fusec", options=options or None)
    cc._compile_all_devices = True   # HF compiles on CUDA only unless told (this machine has no GPU)
    return cc


def _model():
    m = hf_tiny.llama()
    m.generation_config.pad_token_id = 0
    return m


def _generate(model, prompt, caplog, **kw):
    """(tokens, fusec's log lines, the watch) of generate(**kw) through fusec; kw also goes to the
    eager reference, whose tokens the result must equal."""
    ref = model.generate(prompt, cache_implementation="static", **kw)
    torch._dynamo.reset()
    caplog.clear()
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, cache_implementation="static", compile_config=_cc(), **kw)
    torch._dynamo.reset()
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())
    assert not w.fallbacks, w.fallbacks
    return out, [r.getMessage() for r in caplog.records], w


def test_a_left_padded_batch_with_eos_ids_equals_eager(caplog):
    """Three prompts, left-padded, two eos ids that the greedy text meets: the device loop's tokens
    (pad after each sequence's first eos, generation stopping once all met one) equal eager's."""
    model = _model()
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(1, 128, (3, 7), generator=gen)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3] = mask[2, :1] = 0
    free = model.generate(prompt, attention_mask=mask, max_new_tokens=24, do_sample=False,
                          cache_implementation="static", eos_token_id=[])
    eos = [int(free[0, 7 + 5]), int(free[1, 7 + 9])]   # tokens greedy search produces: it stops
    out, lines, w = _generate(model, prompt, caplog, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              eos_token_id=eos)
    assert any(line.startswith(RAN) for line in lines), lines
    assert w.compiled and "_compiled_call" not in model.__dict__   # HF's decode call never made
    assert (out[:, 7:] == 0).any() or out.shape[1] < 7 + 24   # some sequence finished


def test_a_streamer_gets_what_eager_generates(caplog):
    """B = 1 with a streamer: the prompt once (generate() puts it), then every new token, as the
    streamer of eager generate() gets them."""
    class Streamer:
        def __init__(self):
            self.got, self.ended = [], 0

        def put(self, t):
            self.got.append(t.reshape(-1).tolist())

        def end(self):
            self.ended += 1

    model = _model()
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    ref_s, s = Streamer(), Streamer()
    ref = model.generate(prompt, max_new_tokens=20, do_sample=False, cache_implementation="static", streamer=ref_s)
    torch._dynamo.reset()
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, max_new_tokens=20, do_sample=False, cache_implementation="static",
                             compile_config=_cc(), streamer=s)
    torch._dynamo.reset()
    assert torch.equal(out, ref) and not w.fallbacks, w.fallbacks
    assert any(r.getMessage().startswith(RAN) for r in caplog.records)
    assert s.got[0] == prompt[0].tolist() == ref_s.got[0] and s.ended == ref_s.ended == 1
    assert sum(s.got[1:], []) == sum(ref_s.got[1:], [])


@pytest.mark.parametrize("kw,why", [
    (dict(do_sample=True, top_k=5), "sampling"),
    (dict(do_sample=False, repetition_penalty=1.3), "logits processors RepetitionPenaltyLogitsProcessor"),
    (dict(do_sample=False, return_dict_in_generate=True), "return_dict_in_generate"),
    (dict(do_sample=False, stop_strings=None, max_time=100.0), "stopping criteria"),
], ids=["sampling", "processor", "dict", "max_time"])
def test_calls_the_device_loop_does_not_take_run_hfs_loop(kw, why, caplog):
    """Each runs HF's loop, which calls the fusec step per token: one line names why, the tokens
    equal eager generate()'s (sampling: the same seed draws the same tokens)."""
    model = _model()
    prompt = torch.randint(1, 128, (1, 4), generator=torch.Generator().manual_seed(8))
    torch.manual_seed(3)
    ref = model.generate(prompt, max_new_tokens=8, cache_implementation="static", **kw)
    torch._dynamo.reset()
    torch.manual_seed(3)
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, max_new_tokens=8, cache_implementation="static", compile_config=_cc(), **kw)
    torch._dynamo.reset()
    lines = [r.getMessage() for r in caplog.records]
    seqs = (out.sequences, ref.sequences) if kw.get("return_dict_in_generate") else (out, ref)
    assert torch.equal(*seqs)
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert any("runs HF's decode loop" in line and why in line for line in lines), lines
    assert not any(line.startswith(RAN) for line in lines), lines


def test_a_cache_the_caller_passes_is_filled_by_hfs_loop(caplog):
    """A StaticCache passed as past_key_values outlives generate(): HF's loop fills it, as eager's."""
    from transformers import StaticCache
    model = _model()
    prompt = torch.randint(1, 128, (1, 4), generator=torch.Generator().manual_seed(9))
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    ref = model.generate(prompt, max_new_tokens=6, do_sample=False, past_key_values=caches[0])
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, past_key_values=caches[1],
                             compile_config=_cc())
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    assert any("a cache the caller passed" in r.getMessage() for r in caplog.records)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-4) and torch.allclose(a.values, b.values, atol=1e-4)
    assert int(caches[1].layers[0].cumulative_length) == int(caches[0].layers[0].cumulative_length) > 0


def test_the_option_generate_loop_is_checked():
    from fusec.config import Options
    assert Options.from_dict({}).generate_loop == "device"
    with pytest.raises(FusecError, match="generate_loop"):
        Options.from_dict({"generate_loop": "python"})


@pytest.mark.parametrize("cache", ["static", None], ids=["static", "dynamic"])
def test_prompt_lookup_through_generate_runs_fusecs_k_token_steps(cache, caplog):
    """generate(prompt_lookup_num_tokens=3, compile_config=fusec): HF's assisted decoding refuses a
    static cache and runs its plain forward on a dynamic one; through fusec it is fusec.generate's
    prompt lookup (steps of 4 query tokens, drafts accepted on the device) on either, and its
    tokens equal eager greedy search's."""
    import fusec
    model = _model()
    prompt = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    ref = model.generate(prompt, max_new_tokens=24, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3,
                             cache_implementation=cache, compile_config=_cc())
    torch._dynamo.reset()
    assert torch.equal(out, ref) and not w.fallbacks and w.compiled, w.fallbacks
    assert any("prompt-lookup steps of K = 4" in r.getMessage() for r in caplog.records)
    stats = fusec.prompt_lookup.last_stats
    assert stats["tokens"] == 24 and stats["accepted"] > 0 and stats["steps"] < 24, stats


def test_prompt_lookup_with_another_ngram_size_runs_hfs_assisted_decoding(caplog):
    """max_matching_ngram_size=3 (fusec drafts from 2-grams): HF's own assisted decoding runs (its
    dynamic cache, its plain forward), one line says why, the tokens equal greedy search's."""
    model = _model()
    prompt = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    ref = model.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="static")
    with caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3,
                             max_matching_ngram_size=3, compile_config=_cc())
    assert torch.equal(out, ref)
    assert any("prompt lookup runs as HF's assisted decoding, its plain forward (max_matching_ngram_size=3"
               in r.getMessage() for r in caplog.records)
    assert not any("prompt-lookup steps" in r.getMessage() for r in caplog.records)


def test_a_model_with_its_own_generation_hooks_keeps_hfs_loop(caplog):
    """Phi-3 LongRoPE: its prepare_inputs_for_generation drops the cache and prefills again when
    the text passes original_max_position_embeddings (16 here), which fusec.generate never calls:
    generate() through fusec keeps HF's loop (one line names the method), tokens equal eager's past
    the switch."""
    model = hf_tiny.phi3_longrope()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    ref = model.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="static",
                             compile_config=_cc())
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    lines = [r.getMessage() for r in caplog.records]
    assert any("Phi3ForCausalLM has its own prepare_inputs_for_generation" in line for line in lines), lines
    assert not any(line.startswith(RAN) for line in lines)


def test_prefill_chunk_size_keeps_hfs_loop(caplog):
    """generate(prefill_chunk_size=8) prefills in chunks (capping the activations' memory);
    fusec.generate prefills in one call: HF's loop runs (its prefill chunks go through the compiled
    call: 8 query tokens, which fall back), one line says why, tokens equal eager's."""
    model = _model()
    prompt = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=4, do_sample=False, prefill_chunk_size=8, cache_implementation="static")
    ref = model.generate(prompt, **kw)
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, compile_config=_cc(), **kw)
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    lines = [r.getMessage() for r in caplog.records]
    assert any("prefill_chunk_size" in line for line in lines) and not any(line.startswith(RAN) for line in lines)


def test_an_error_in_the_device_loop_is_the_calls_error(caplog):
    """GPT-2's learned position table (256 rows) would run out during the device loop: fusec.generate's
    FusecError (before any work since 2026-12-07: the positions the call feeds pass the table;
    eager raises IndexError there, and the loop's IndexFaultError did before) reaches the
    caller, and HF's loop does not run the whole generation again."""
    from fusec.errors import FusecError
    model = hf_tiny.gpt2()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    prompt = torch.randint(1, 128, (1, 240), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="fusec"), pytest.raises(FusecError, match="position table of 256 rows"):
        model.generate(prompt, max_new_tokens=20, do_sample=False, cache_implementation="static",
                       compile_config=_cc())
    torch._dynamo.reset()
    assert not any("runs HF's decode loop" in r.getMessage() for r in caplog.records)
    assert "_compiled_call" not in model.__dict__


def test_an_invalid_option_raises_and_ends_the_streamer():
    """An invalid option is a FusecError naming it; generate() had put the prompt to the streamer,
    so the streamer is ended (a consumer thread waiting for the end would hang otherwise)."""
    class Streamer:
        ended = 0

        def put(self, t):
            pass

        def end(self):
            self.ended += 1

    model, s = _model(), Streamer()
    with pytest.raises(FusecError, match="generate_loop='python'"):
        model.generate(torch.randint(1, 128, (1, 4)), max_new_tokens=3, do_sample=False,
                       cache_implementation="static", compile_config=_cc(generate_loop="python"), streamer=s)
    assert s.ended == 1


def test_prompt_lookup_on_a_sliding_window_model_runs_hfs_assisted_decoding(caplog):
    """Mistral with a sliding window (HF counts its positions in Python; fusec's prompt lookup
    needs them on the device): HF's own assisted decoding runs (dynamic cache), one line says
    why, its tokens equal greedy search's."""
    model = hf_tiny.mistral_sw()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    ref = model.generate(prompt, max_new_tokens=8, do_sample=False)
    with caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3,
                             compile_config=_cc())
    assert torch.equal(out, ref)
    assert any("(a sliding-window model" in r.getMessage() for r in caplog.records)


def test_prompt_lookup_with_a_static_cache_that_fusec_does_not_take_warns_before_hfs_error(caplog):
    """The same model with cache_implementation="static": HF's assisted decoding raises its own
    ValueError (it refuses static caches), which names no reason; fusec's line before it is a
    warning that says why fusec did not take the call and what to change."""
    model = hf_tiny.mistral_sw()
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    with caplog.at_level("INFO", logger="fusec"), pytest.raises(ValueError, match="Static cache"):
        model.generate(prompt, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3,
                       cache_implementation="static", compile_config=_cc())
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("(a sliding-window model" in m and "refuses a static cache" in m
               and "drop cache_implementation='static'" in m for m in warned), warned


def test_a_cpu_model_without_compile_all_devices_names_the_setting(caplog):
    """On a CPU, HF's generate() skips compilation unless compile_config._compile_all_devices is
    set: fusec never runs (nothing compiles, the tokens are eager's), and fusec's line names that
    setting instead of a generic "would not compile"."""
    from transformers.generation import CompileConfig
    from fusec.fallbacks import FallbackWatch
    model = _model()
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    ref = model.generate(prompt, max_new_tokens=4, do_sample=False)
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, cache_implementation="static",
                             compile_config=CompileConfig(backend="fusec"))
    assert torch.equal(out, ref) and w.compiled == 0
    lines = [r.getMessage() for r in caplog.records]
    assert any("compiles only on a CUDA device and the model is on cpu" in m
               and "_compile_all_devices = True" in m for m in lines), lines
    # a warning: fusec, which the caller asked for, runs nowhere in the call, and HF's own line
    # ("unable to meet the criteria for compilation") does not say why
    assert any(r.levelname == "WARNING" and "fusec does not run" in r.getMessage() for r in caplog.records), lines


def test_generate_without_a_static_cache_warns_and_names_it(caplog):
    """A fusec CompileConfig without ``cache_implementation="static"``: generate() makes a
    DynamicCache and compiles nothing (HF's own line says only "unable to meet the criteria"), so
    fusec never runs; fusec's line is a warning naming the cache and the argument to pass (it was
    an info line, invisible by default)."""
    from fusec.fallbacks import FallbackWatch
    model = _model()
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    ref = model.generate(prompt, max_new_tokens=4, do_sample=False)
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, compile_config=_cc())
    assert torch.equal(out, ref) and w.compiled == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("fusec does not run" in m and "static cache (DynamicCache)" in m
               and "cache_implementation='static'" in m for m in warned), warned


def test_fusec_fallbacks_is_an_attribute_after_import_fusec():
    """``import fusec`` then ``fusec.fallbacks.FallbackWatch()`` (the README's words), in a new
    process where nothing imported the submodule first."""
    import subprocess
    import sys
    code = "import fusec; w = fusec.fallbacks.FallbackWatch(); print(type(w).__name__, fusec.errors.FusecError.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["FallbackWatch", "FusecError"], out.stderr[-2000:]
