"""Graphs fusec cannot place fall back with exactly one log line, never a crash."""
from __future__ import annotations

import logging

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch


class CumsumHead(torch.nn.Module):
    """A tiny decoder step with an op fusec does not place (cumsum) after attention."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x, k, v):
        q = self.proj(x).view(1, 2, 1, 16)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.cumsum(o.reshape(1, 32), dim=-1)


def test_unsupported_op_falls_back_with_one_line(caplog):
    torch._dynamo.reset()
    m = CumsumHead().eval()
    x, k, v = torch.randn(1, 1, 32), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="fusec"):
        out = torch.compile(m, backend="fusec", options={"fallback": "eager"})(x, k, v)
    torch.testing.assert_close(out, m(x, k, v))
    lines = [r for r in caplog.records if r.name == "fusec" and r.levelno >= logging.WARNING]
    assert len(lines) == 1
    assert "aten.cumsum" in lines[0].message and "using eager" in lines[0].message


def test_fallback_watch_tells_fallbacks_from_other_warnings():
    """FallbackWatch (what benchmarks and GPU tests use so they never measure another backend)
    marks the fallback lines only: an unsupported op, a target without its device; a profile
    warning on the simulator is a warning, not a fallback; nothing is collected once closed."""
    torch._dynamo.reset()
    m = CumsumHead().eval()
    x, k, v = torch.randn(1, 1, 32), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with torch.no_grad(), FallbackWatch() as w:
        torch.compile(m, backend="fusec", options={"fallback": "eager"})(x, k, v)
    assert len(w.fallbacks) == 1 and "aten.cumsum" in w.fallbacks[0] and w.warnings == w.fallbacks
    torch._dynamo.reset()
    model = hf_tiny.llama()
    cache = hf_tiny.static_cache(model, 16)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
    tok = torch.randint(0, 128, (1, 1))
    with torch.no_grad(), FallbackWatch() as w:
        torch.compile(model, backend="fusec", options={"profile": True, "target": "sim"})(
            input_ids=tok, past_key_values=cache, use_cache=True)
    assert w.fallbacks == [] and any("simulator target has none" in m for m in w.warnings)
    torch._dynamo.reset()
    if not torch.cuda.is_available():
        with torch.no_grad(), FallbackWatch() as w:
            torch.compile(model, backend="fusec", options={"target": "cuda", "fallback": "eager"})(
                input_ids=tok, past_key_values=cache, use_cache=True)
        assert len(w.fallbacks) == 1 and "no CUDA device" in w.fallbacks[0]
        torch._dynamo.reset()
    n = len(w.warnings)
    with torch.no_grad():
        torch.compile(m, backend="fusec", options={"fallback": "eager"})(x, k, v)
    assert len(w.warnings) == n
    torch._dynamo.reset()


def test_prefill_falls_back_and_is_correct(caplog):
    torch._dynamo.reset()
    model = hf_tiny.llama()
    c1, c2 = hf_tiny.static_cache(model, 16), hf_tiny.static_cache(model, 16)
    ids = torch.randint(0, 128, (1, 10))   # a prefill: more query tokens than option query_tokens (1)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="fusec"):
        a = torch.compile(model, backend="fusec", options={"fallback": "eager"})(
            input_ids=ids, past_key_values=c1, use_cache=True).logits
        b = model(input_ids=ids, past_key_values=c2, use_cache=True).logits
    torch.testing.assert_close(a, b)
    msgs = [r.message for r in caplog.records if r.name == "fusec"]
    assert len(msgs) == 1 and "(1, 4, 10, 16)" in msgs[0] and "10 query tokens, more than 1" in msgs[0]


def test_parameters_that_require_grad_outside_no_grad_fall_back_with_one_line(recwarn):
    """A decode step called with grad mode on and parameters that require grad (a model as
    ``from_pretrained`` gives it, called outside ``torch.no_grad()``): one fallback line naming
    ``torch.no_grad()``, no autograd warning (AOT's trace of a backward through fusec's SDPA op
    printed 30 lines), eager's logits; under ``torch.no_grad()`` the same call compiles."""
    torch._dynamo.reset()
    model = hf_tiny.llama().requires_grad_(True)
    caches = [hf_tiny.static_cache(model, 16) for _ in range(3)]
    with torch.no_grad():
        for c in caches:
            model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=c, use_cache=True)
        ref = model(input_ids=torch.tensor([[7]]), past_key_values=caches[0], use_cache=True).logits
    compiled = torch.compile(model, backend="fusec", options={"fallback": "eager"})
    with FallbackWatch() as w:
        out = compiled(input_ids=torch.tensor([[7]]), past_key_values=caches[1], use_cache=True).logits
    assert len(w.fallbacks) == 1 and "torch.no_grad()" in w.fallbacks[0] and "require grad" in w.fallbacks[0]
    assert not [x for x in recwarn if "autograd" in str(x.message) or "backward" in str(x.message)]
    torch.testing.assert_close(out.detach(), ref)
    with FallbackWatch() as w, torch.no_grad():
        out = compiled(input_ids=torch.tensor([[7]]), past_key_values=caches[2], use_cache=True).logits
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_a_graph_that_fell_back_is_reported_by_every_watch_it_runs_in():
    """A graph that went to another backend logs its line once, when it is compiled; later calls
    reuse dynamo's compiled code and log nothing. A watch opened around such a later call must
    still list the fallback (a test or a benchmark would otherwise compare or time the other
    backend as fusec's), and a nested watch (fusec.generate opens one) counts it too."""
    torch._dynamo.reset()
    model = hf_tiny.llama()
    compiled = torch.compile(model, backend="fusec", options={"fallback": "eager"})
    ids = torch.randint(0, 128, (1, 10))   # a prefill: more query tokens than option query_tokens (1)
    with torch.no_grad():
        with FallbackWatch() as first:
            a = compiled(input_ids=ids, past_key_values=hf_tiny.static_cache(model, 16), use_cache=True).logits
        with FallbackWatch() as outer, FallbackWatch() as inner:
            b = compiled(input_ids=ids, past_key_values=hf_tiny.static_cache(model, 16), use_cache=True).logits
            compiled(input_ids=ids, past_key_values=hf_tiny.static_cache(model, 16), use_cache=True)
        with FallbackWatch() as none:   # eager itself: no graph of fusec's runs
            model(input_ids=ids, past_key_values=hf_tiny.static_cache(model, 16), use_cache=True)
    torch._dynamo.reset()
    torch.testing.assert_close(a, b)
    assert len(first.fallbacks) == 1 and "10 query tokens, more than 1" in first.fallbacks[0]
    assert first.fallback_runs == 1
    for w in (outer, inner):
        assert w.fallback_runs == 2 and len(w.fallbacks) == 1, w.fallbacks
        assert w.fallbacks[0].startswith(first.fallbacks[0]) and "[ran again" in w.fallbacks[0]
        assert not w.warnings   # nothing was logged again
    assert none.fallback_runs == 0 and not none.fallbacks


def test_inductor_fallback_runs(monkeypatch):
    """``fallback="inductor"`` (the default outside this suite, tests/conftest.py) hands the graph
    fusec does not take to inductor's compile_fx, and its result equals eager's."""
    import torch._inductor.compile_fx as inductor
    calls = []
    real = inductor.compile_fx
    monkeypatch.setattr(inductor, "compile_fx", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch._dynamo.reset()
    m = CumsumHead().eval()
    x, k, v = torch.randn(1, 1, 32), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with torch.no_grad():
        out = torch.compile(m, backend="fusec", options={"fallback": "inductor"})(x, k, v)
    torch.testing.assert_close(out, m(x, k, v))
    assert calls, "the fallback did not go through inductor"


def test_unknown_option_is_a_clear_error():
    from fusec.config import Options
    from fusec.errors import FusecError
    with pytest.raises(FusecError, match="unknown fusec option"):
        Options.from_dict({"nmu_sms": 3})


def test_option_types_are_checked():
    from fusec.config import Options
    from fusec.errors import FusecError
    with pytest.raises(FusecError, match="num_sms='abc' must be an int"):
        Options.from_dict({"num_sms": "abc"})


def test_attention_merge_option(monkeypatch):
    from fusec.config import Options
    from fusec.errors import FusecError
    assert Options.from_dict({}).attention_merge == "last_tile"
    monkeypatch.setenv("FUSEC_ATTENTION_MERGE", "reduce")
    assert Options.from_dict({}).attention_merge == "reduce"
    assert Options.from_dict({"attention_merge": "last_tile"}).attention_merge == "last_tile"
    with pytest.raises(FusecError, match="attention_merge='tree' must be one of"):
        Options.from_dict({"attention_merge": "tree"})


def test_profile_and_defines_options(monkeypatch):
    from fusec.config import Options
    from fusec.errors import FusecError
    o = Options.from_dict({"profile_dir": "somewhere"})
    assert o.profile and o.profile_step == 3
    monkeypatch.setenv("FUSEC_DEFINES", "FUSEC_LOADS_IN_FLIGHT=16,FUSEC_POLL_SLEEP=0")
    monkeypatch.setenv("FUSEC_PROFILE", "prof")
    o = Options.from_dict({})
    assert o.defines == {"FUSEC_LOADS_IN_FLIGHT": 16, "FUSEC_POLL_SLEEP": 0}   # knobs are ints
    assert o.profile and o.profile_dir == "prof"
    monkeypatch.setenv("FUSEC_DEFINES", "NOVALUE")
    with pytest.raises(FusecError, match="FUSEC_DEFINES"):
        Options.from_dict({})
    monkeypatch.delenv("FUSEC_DEFINES")
    with pytest.raises(FusecError, match="profile_step=0 must be an int >= 1"):
        Options.from_dict({"profile_step": 0})
    with pytest.raises(FusecError, match="defines"):
        Options.from_dict({"defines": ["A=1"]})
    # a misspelt knob would change nothing in the kernel: an error naming it and the variable
    monkeypatch.setenv("FUSEC_DEFINES", "FUSEC_LOADS_IN_FLIGTH=4")
    with pytest.raises(FusecError, match=r"defines \(from FUSEC_DEFINES\): unknown kernel knob.*FUSEC_LOADS_IN_FLIGTH"):
        Options.from_dict({})
    # a value that is not an int would reach NVRTC as an undefined identifier (found by a review)
    monkeypatch.setenv("FUSEC_DEFINES", "FUSEC_LOADS_IN_FLIGHT=abc")
    with pytest.raises(FusecError, match=r"defines \(from FUSEC_DEFINES\): FUSEC_LOADS_IN_FLIGHT='abc' must be an integer"):
        Options.from_dict({})
    for bad in ("1.5", "0x10", 2 ** 40, True, None):
        with pytest.raises(FusecError, match="FUSEC_POLL_SLEEP=.* must be an integer"):
            Options.from_dict({"defines": {"FUSEC_POLL_SLEEP": bad}})
    monkeypatch.delenv("FUSEC_DEFINES")
    with pytest.raises(FusecError, match=r"unknown kernel knob\(s\) \['FUSEC_NOPE'\]"):
        Options.from_dict({"defines": {"FUSEC_NOPE": 1}})
    monkeypatch.setenv("FUSEC_ATTENTION_MERGE", "lasttile")
    with pytest.raises(FusecError, match=r"attention_merge='lasttile' \(from FUSEC_ATTENTION_MERGE\) must be one of"):
        Options.from_dict({})


def test_fallback_watch_sees_fallbacks_under_a_quiet_logging_setup():
    """A user's logging at ERROR must not hide fallback lines from FallbackWatch."""
    import logging

    from fusec.fallbacks import FallbackWatch, warn
    log = logging.getLogger("fusec")
    before = log.level
    root = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        with FallbackWatch() as w:
            warn("fusec: test fallback %d", 1)
        assert w.fallbacks == ["fusec: test fallback 1"]
        assert log.level == before
    finally:
        logging.getLogger().setLevel(root)


def test_fallback_watch_counts_compiled_steps_and_still_prints(capsys):
    """The watch tells whether fusec compiled anything (inside its block: so far), and with no
    logging configured its lines still reach stderr (the watch must not swallow the one log line)."""
    import logging

    import hf_tiny
    from fusec.fallbacks import FallbackWatch, warn
    root_handlers = logging.getLogger().handlers[:]
    logging.getLogger().handlers.clear()
    try:
        with FallbackWatch() as w:
            warn("fusec: test fallback %d", 2)
        assert w.compiled == 0 and "fusec: test fallback 2" in capsys.readouterr().err
        model = hf_tiny.llama()
        cache = hf_tiny.static_cache(model, 16)
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
            with FallbackWatch() as w:
                assert w.compiled == 0
                compiled(input_ids=torch.randint(0, 128, (1, 1)), past_key_values=cache, use_cache=True)
                assert w.compiled == 1   # the count so far, inside the block too (it read 0 until the exit)
                compiled(input_ids=torch.randint(0, 128, (1, 1)), past_key_values=cache, use_cache=True)
            torch._dynamo.reset()
        assert w.compiled == 1 and not w.fallbacks
    finally:
        logging.getLogger().handlers[:] = root_handlers


def test_cuda_target_schedules_one_cta_per_sm_of_the_device(monkeypatch):
    """Without num_sms, a CUDA step is scheduled for its GPU's SM count (an H100 PCIe has 114:
    132 CTAs could not all be resident for the cooperative launch)."""
    import torch
    from fusec.frontend import backend

    class Props:
        multi_processor_count = 114
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: Props)
    assert backend._device_sms([torch.zeros(2), 3]) == 114


def test_a_cpu_model_is_told_it_runs_on_the_simulator(monkeypatch):
    """A model on the CPU compiled with default options runs on the simulator, and the user is
    told so (a SimulatorWarning naming the simulator, its speed and what to do, at the user's
    line), with the step's
    numbers fusec's own (no fallback), once per process: a second compile, inside a
    ``catch_warnings`` block that resets Python's filter, warns nothing (it warned per compile);
    ``target='sim'``, asked for, warns nothing."""
    import warnings
    from fusec.errors import SimulatorWarning
    from fusec.fallbacks import FallbackWatch
    from fusec.frontend import backend
    monkeypatch.setattr(backend, "_SIMULATOR_TOLD", False)   # as in a new process
    model = hf_tiny.llama()
    cache = hf_tiny.static_cache(model, 16)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
    tok = torch.randint(0, 128, (1, 1))
    torch._dynamo.reset()
    with torch.no_grad(), FallbackWatch() as w, \
            pytest.warns(SimulatorWarning, match=r"CPU simulator.*10-100x slower.*CUDA device") as told:
        torch.compile(model, backend="fusec")(input_ids=tok, past_key_values=cache, use_cache=True)
    assert not w.fallbacks and w.compiled == 1
    # attributed to the line that called the model (it named a line inside fusec's backend)
    assert [x.filename for x in told if issubclass(x.category, SimulatorWarning)] == [__file__]
    for options in ({}, {"target": "sim"}):
        torch._dynamo.reset()
        with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.compile(model, backend="fusec", options=options)(
                input_ids=tok, past_key_values=cache, use_cache=True)
        assert not [x for x in seen if issubclass(x.category, SimulatorWarning)], options
    torch._dynamo.reset()
