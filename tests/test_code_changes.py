"""A model's code changed within one process between two generate() calls (a module function
rebound, a forward hook added) is seen: the steps kept for the model trace again and give
eager's tokens (``fusec.frontend.code_fingerprint.CodeWatch``). Dynamo's guards cannot: a loaded
precompiled step keeps no guard on globals, and dynamo skips guards on module hooks, so a plain
``torch.compile`` step served the graph traced before, with no line."""
from __future__ import annotations

import logging

import pytest
import torch

import fusec
import hf_tiny
from fusec.fallbacks import FallbackWatch

OPTS = {"num_sms": 8, "check_hazards": False}


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE", "1")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))


def _loud(model):
    """Attention's share of the logits large enough for a change in it to move greedy tokens."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(30)
            layer.self_attn.q_proj.weight.mul_(10)
    return model


def _hf(model, prompt, n, **kw):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, cache_implementation="static",
                          pad_token_id=0, eos_token_id=None, **kw)


def _records(caplog, what):
    return [r.getMessage() for r in caplog.records if what in r.getMessage()]


def test_a_rebound_function_traces_again_in_fusec_generate_and_hf_generate(cache_on, caplog, monkeypatch):
    """``apply_rotary_pos_emb`` rebound between calls, three times to new functions made by one
    factory (one code object; the patch undone in between, so a new function may take a freed
    one's address): fusec.generate and HF generate() through fusec trace again each time and give
    eager's tokens; putting the original back serves the first entry again."""
    import transformers.models.llama.modeling_llama as ml
    from transformers.generation import CompileConfig
    caplog.set_level(logging.INFO, logger="fusec")
    model = _loud(hf_tiny.llama(seed=5))
    prompt = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    cc = CompileConfig(backend="fusec", options={**OPTS, "generate_loop": "hf"})
    cc._compile_all_devices = True   # HF compiles on CUDA only unless told (this machine has no GPU)
    original = ml.apply_rotary_pos_emb

    def patched(scale):   # a decode step's queries scaled, a prefill's kept
        return lambda q, k, cos, sin, *a, **kw: original(q if q.shape[2] > 1 else q * scale, k, cos, sin, *a, **kw)

    def run(ref):
        assert torch.equal(fusec.generate(model, prompt, 8, eos_token_id=[], options=OPTS), ref)
        assert torch.equal(_hf(model, prompt, 8, compile_config=cc), ref)
    with FallbackWatch() as w:
        ref = _hf(model, prompt, 8)
        run(ref)
        seen = set()
        for scale in (0.0, 3.0, -2.0):
            monkeypatch.setattr(ml, "apply_rotary_pos_emb", patched(scale))
            new = _hf(model, prompt, 8)
            seen.add(tuple(new[0].tolist()))
            run(new)
            monkeypatch.setattr(ml, "apply_rotary_pos_emb", original)
        assert len(seen) == 3 and tuple(ref[0].tolist()) not in seen   # each patch moves the tokens
        # each patch (the undo in between runs nothing): fusec.generate's and generate()'s steps traced again
        assert len(_records(caplog, "the model's code changed")) == 2 * 3
        run(ref)
        assert len(_records(caplog, "the model's code changed")) == 2 * 4
    assert not w.fallbacks, w.fallbacks


@pytest.mark.parametrize("factory,cache", [(hf_tiny.llama, "0"), (hf_tiny.llama, "1"),
                                           (lambda seed: hf_tiny.mistral_sw(seed=seed, window=8), "1")],
                         ids=["plain-torch-compile", "precompiled", "sliding-window"])
def test_a_forward_hook_added_between_calls_is_seen(factory, cache, tmp_path, monkeypatch, caplog):
    """A forward hook zeroing layer 0's attention output, registered between two fusec.generate
    calls: the second call's tokens are eager's with the hook, on a plain torch.compile step (the
    cache off), a precompiled one, and a sliding-window model's (its step is never precompiled);
    removing the hook gives the first tokens again."""
    monkeypatch.setenv("FUSEC_CACHE", cache)
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="fusec")
    model = _loud(factory(seed=5))
    prompt = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    with FallbackWatch() as w:
        ref = _hf(model, prompt, 8)
        assert torch.equal(fusec.generate(model, prompt, 8, eos_token_id=[], options=OPTS), ref)
        h = model.model.layers[0].self_attn.register_forward_hook(lambda m, i, o: (o[0] * 0.0,) + tuple(o[1:]))
        hooked = _hf(model, prompt, 8)
        assert not torch.equal(hooked, ref)
        assert torch.equal(fusec.generate(model, prompt, 8, eos_token_id=[], options=OPTS), hooked)
        h.remove()
        assert torch.equal(fusec.generate(model, prompt, 8, eos_token_id=[], options=OPTS), ref)
    assert not w.fallbacks, w.fallbacks
    assert len(_records(caplog, "the model's code changed")) == 2


def test_nothing_changed_traces_nothing_again_in_a_new_process(tmp_path):
    """A new process: fusec.generate, then HF generate() through fusec on the same model (whose
    device loop reuses fusec.generate's step): no "code changed" line and nothing compiled the
    second time (the first trace imports fusec's backend, which patches transformers; a watch
    that looked before that saw a change)."""
    import subprocess
    import sys
    script = tmp_path / "run.py"
    script.write_text(
        "import logging, torch, fusec\n"
        "from fusec.fallbacks import FallbackWatch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, CompileConfig\n"
        "logging.basicConfig(); logging.getLogger('fusec').setLevel(logging.INFO)\n"
        "torch.manual_seed(0)\n"
        "model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        "    num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()\n"
        "ids = torch.randint(0, 128, (1, 5))\n"
        "cc = CompileConfig(backend='fusec'); cc._compile_all_devices = True\n"
        "with FallbackWatch() as w: fusec.generate(model, ids, max_new_tokens=4, options={'num_sms': 8})\n"
        "print('first', w.compiled)\n"
        "cc.options = {'num_sms': 8}\n"
        "with FallbackWatch() as w: model.generate(ids, max_new_tokens=4, do_sample=False,\n"
        "    cache_implementation='static', compile_config=cc)\n"
        "print('second', w.compiled, len(w.fallbacks))\n")
    env = {**__import__("os").environ, "FUSEC_CACHE": "1", "FUSEC_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "first 1" in res.stdout and "second 0 0" in res.stdout, (res.stdout, res.stderr[-2000:])
    assert "code changed" not in res.stderr, res.stderr[-2000:]
