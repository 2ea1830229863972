"""Families new in the fourteenth session on the CPU simulator, against eager (fp32, 1e-4, no
fallback): the sliding-window ones (Mistral with ``sliding_window``, Gemma-2, Gemma-3), whose
HF cache layers count positions in a Python int that fusec computes on the host
(``fusec.frontend.host_scalars``), and Falcon, GPT-2, Phi-2 and StarCoder2."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch
from test_families import _decode_against_eager

FAMILIES = {"mistral_sw": hf_tiny.mistral_sw, "gemma2": hf_tiny.gemma2, "gemma3": hf_tiny.gemma3,
            "falcon": hf_tiny.falcon, "gpt2": hf_tiny.gpt2, "phi2": hf_tiny.phi2, "starcoder2": hf_tiny.starcoder2}


def _steps_against_eager(model, prompt_len: int, n: int, seed: int, **options):
    """``n`` decode steps of ``model`` compiled with fusec (``options`` besides ``num_sms=8``) and
    of eager ``model``, each on its own StaticCache (32 rows) after the same random prompt.
    Returns (the two caches, the fallback lines, each step's relative logits error)."""
    from transformers import StaticCache
    gen = torch.Generator().manual_seed(seed)
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    errs = []
    with torch.no_grad():
        p = torch.randint(0, 128, (1, prompt_len), generator=gen)
        for c in caches:
            model(input_ids=p, past_key_values=c, use_cache=True)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusec", options={"num_sms": 8, **options})
        with FallbackWatch() as w:
            for _ in range(n):
                tok = torch.randint(0, 128, (1, 1), generator=gen)
                a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
                b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
                errs.append(((a - b).norm() / b.norm()).item())
    torch._dynamo.reset()
    return caches, w.fallbacks, errs


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_eager_with_one_kernel(name, steps):
    """8 decode steps against eager with no fallback and ONE kernel for all of them: a
    sliding-window family's Python token counter is symbolic from the first trace
    (``fusec.frontend.counters.mark_cache_counters_dynamic``), so dynamo does not specialize the
    first step on its value and compile a second step at the next call."""
    _decode_against_eager(FAMILIES[name](), n=8)
    assert len(steps) == 1, len(steps)


def test_host_counter_outputs_are_written_back(steps):
    """The Python counter the graph returns is stored back by dynamo: after the steps it equals
    eager's, layer by layer, and the step's tensor counter and K cache agree."""
    caches, fallbacks, errs = _steps_against_eager(hf_tiny.mistral_sw(), 3, 5, seed=3)
    assert not fallbacks, fallbacks
    assert max(errs) < 1e-4, errs
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert a.cumulative_length_int == b.cumulative_length_int == 8
        assert int(a.cumulative_length) == int(b.cumulative_length)
        assert (a.keys - b.keys).abs().max() < 1e-5


def test_window_that_fills_on_every_layer_stays_in_fusec(windowed_run):
    """Mistral whose every layer has an 8-token window (Mistral-7B-v0.1 past 4096 tokens): once
    the window is full (HF rolls it), the positions pass every cache's rows; the position tables
    cover option ``position_rows`` (32768 by default for a graph whose positions the host
    computes), so 12 steps from position 4 run in fusec (the filling window's step and the
    rolled one), every step equals eager and the caches equal eager's. Before, the tables
    stopped at the longest cache and those steps ran eagerly."""
    _, caches, fallbacks, errs, steps, _ = windowed_run("mistral_sw")
    assert not fallbacks, fallbacks
    assert max(errs) < 1e-4, errs
    assert len(steps) == 2 and steps[-1].schedule.graph.count_kinds().get("kv_roll") == 4
    tables = [t for t in steps[-1].schedule.graph.tensors.values() if t.name.startswith("table_")]
    assert tables and all(t.shape[0] == 32768 for t in tables), [(t.name, t.shape) for t in tables]
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert (a.keys - b.keys).abs().max() < 1e-5 and (a.values - b.values).abs().max() < 1e-5


def _record_splits(monkeypatch) -> list:
    """Every host-scalar split (:class:`fusec.frontend.host_scalars.HostSplit`) the backend makes
    from now on while ``monkeypatch`` holds."""
    import fusec.frontend.backend as backend
    made: list = []
    split = backend.split_host_scalars

    def record(gm):
        s = split(gm)
        made.append(s)
        return s
    record.keeps_cache = True   # only records: the run-wide artifact cache stays on (conftest.py)
    monkeypatch.setattr(backend, "split_host_scalars", record)
    return made


@pytest.fixture
def splits(monkeypatch):
    """Every host-scalar split the backend makes while the test runs."""
    return _record_splits(monkeypatch)


#: the 8-token-window models of the window tests below, by name
_WINDOWED = {"mistral_sw": lambda: hf_tiny.mistral_sw(window=8), "gemma2": lambda: hf_tiny.gemma2(window=8),
             "gemma3": lambda: hf_tiny.gemma3(window=8, layers=6)}


@pytest.fixture(scope="module")
def windowed_run():
    """``run(name)``: 12 steps from position 4 of the 8-token-window model ``name`` (Mistral, or
    Gemma-2/3 with Gemma-3's five sliding layers to one full) against eager, as
    :func:`_steps_against_eager` (seed 9): (the model, the two caches, the fallback lines, each
    step's error, the CompiledSteps made, the host-scalar splits made). Made once per model in
    this file (the window, rolled-window and host-position tests read the same run; none of them
    writes to it)."""
    import step_util
    runs: dict = {}

    def run(name):
        if name not in runs:
            with pytest.MonkeyPatch.context() as m:
                made = step_util.record_compiled_steps(m)
                split = _record_splits(m)
                model = _WINDOWED[name]()
                caches, fallbacks, errs = _steps_against_eager(model, 4, 12, seed=9)
            runs[name] = (model, caches, tuple(fallbacks), tuple(errs), tuple(made), tuple(split))
        return runs[name]
    return run


@pytest.mark.parametrize("name", ["mistral_sw", "gemma3"])
def test_host_positions_are_device_counters_written_once(name, windowed_run, monkeypatch):
    """The host's positions (HF's ``s`` and, rolled, its window offset ``Max(0, s - W + 1)``,
    which dynamo's ``is_full`` guard makes ``s - W + 1``) reach the step as one device counter
    per host integer that the step advances itself (a STATE input, as HF's tensor counters):
    over 12 steps through the filling and the rolled window the host writes each graph's counter
    once (its first call), not once per step (a ``fill_`` kernel per value and step before),
    and every step equals eager. A step on another cache (another count) writes it again and
    stays correct."""
    from transformers import StaticCache
    model, caches, fallbacks, errs, steps, splits = windowed_run(name)
    assert not fallbacks, fallbacks
    assert max(errs) < 1e-4, errs
    made = [s for s in splits if s is not None]
    assert len(made) == 2 and all(s.counted == [s.counted[0]] for s in made), [s.counted for s in made]
    assert [s.fills for s in made] == [1, 1], [s.fills for s in made]
    for st in steps:
        g = st.schedule.graph
        ctr = g.inputs[-1]
        assert g.tensors[ctr].role.name == "STATE" and g.tensors[ctr].dtype == torch.int64, g.tensors[ctr]
    # two caches at other counts, alternately: each call finds the other's count on the device
    splits = _record_splits(monkeypatch)
    pairs = [[StaticCache(config=model.config, max_cache_len=32) for _ in range(2)] for _ in range(2)]
    gen = torch.Generator().manual_seed(10)
    errs = []
    with torch.no_grad():
        for n, pair in zip((10, 12), pairs):
            p = torch.randint(0, 128, (1, n), generator=gen)
            for c in pair:
                model(input_ids=p, past_key_values=c, use_cache=True)
        compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})
        for i in range(4):
            tok = torch.randint(0, 128, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=pairs[i % 2][0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=pairs[i % 2][1], use_cache=True).logits
            errs.append(((a - b).norm() / b.norm()).item())
    torch._dynamo.reset()
    assert max(errs) < 1e-4, errs
    assert splits[-1].fills == 4, splits[-1]


def test_position_past_the_tables_runs_eagerly_with_one_line(steps):
    """A host position past option ``position_rows`` (here 12 rows): that step runs eagerly with
    one line naming the tables' range, and every step still equals eager."""
    _, fallbacks, errs = _steps_against_eager(hf_tiny.mistral_sw(window=8), 4, 12, seed=4, position_rows=12)
    assert max(errs) < 1e-4, errs
    assert fallbacks and all("outside the kernel's position tables, [0, 12)" in f for f in fallbacks), fallbacks
    assert steps, "the steps before position 12 ran in fusec"


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_rolled_window_stays_in_fusec(name, windowed_run):
    """Gemma-2 (alternating) and Gemma-3 (five sliding layers to one full, as published) with an
    8-token window in a 32-row StaticCache: 12 steps from position 4 pass the window, where HF
    rolls the sliding layers' caches (``roll``: an index by ``(arange + 1) % W``, folded to a
    constant). Every step runs in fusec (no fallback line; the roll's ``fmod`` was an unsupported
    op) and equals eager; one step for the filling window and one for the rolled one (HF's
    ``is_full`` is a Python branch); the rolled step's kernel compiles with NVRTC. In the filling
    step every layer's attention is the split-KV kind: a sliding layer's window mask is proven
    causal over its own cache's rows (its ``kv_offset``, ``max(count - W + 1, 0)``, is 0 wherever
    dynamo's ``is_full`` guard lets that graph run: a constant, not a host input, so no mask is
    read); before, the sliding layers' SDPA ran as one generated op on one SM.""" 
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    model, _, fallbacks, errs, steps, _ = windowed_run(name)
    assert not fallbacks, fallbacks
    assert max(errs) < 1e-4 and min(errs) > 0, errs
    assert len(steps) == 2, len(steps)
    filling = steps[0].schedule.graph.count_kinds()
    assert filling.get("attention_partial") == model.config.num_hidden_layers, filling
    assert not [k for k in filling if "sdpa" in k], filling
    masked = [o.name for o in steps[0].schedule.graph.ops if o.kind == "attention_partial" and "mask" in o.inputs]
    assert not masked, masked   # proven causal: rows 0..p read, no mask
    rolled = steps[-1].schedule
    kinds = rolled.graph.count_kinds()
    sliding = sum(bool(layer.is_sliding) for layer in hf_tiny.static_cache(model, 32).layers)
    assert kinds.get("kv_roll") == 2 * sliding, kinds   # the roll as a kind, not index ops on one SM
    assert kinds.get("attention_partial") == model.config.num_hidden_layers, kinds
    assert not [k for k in kinds if "sdpa" in k or "index_put" in k or k == "aten.copy.default"], kinds
    kernel = compile_cuda(render(rolled).source, "fusec_step.cu")
    assert "warning" not in kernel.log, kernel.log


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_rolled_window_in_pieces_leaves_hf_layout(name, steps, monkeypatch):
    """The roll in pieces over the SMs (``kv_roll``, each piece's last row from a halo saved
    before any piece writes): with the piece size floor off, 8-row windows split into 4 pieces
    per head on 8 SMs. 10 steps past the window: every step equals eager with the simulator's
    hazard check on, the caches equal eager's after the steps (HF's layout, not a ring buffer),
    and an eager step on the compiled cache then equals eager's (HF's next roll reads it); the
    kernel compiles with NVRTC."""
    import fusec.instructions.kv_roll as kv_roll
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    monkeypatch.setattr(kv_roll, "MIN_PIECE_BYTES", 0)
    model = hf_tiny.gemma3(window=8, layers=6) if name == "gemma3" else hf_tiny.gemma2(window=8)
    caches, fallbacks, errs = _steps_against_eager(model, 4, 10, seed=7)
    assert not fallbacks, fallbacks
    assert max(errs) < 1e-4, errs
    rolled = steps[-1].schedule
    kinds = rolled.graph.count_kinds()
    assert kinds.get("kv_roll") and kinds.get("aten.index_select.default") == kinds["kv_roll"], kinds
    pieces = [o.attrs["pieces"] for o in rolled.graph.ops if o.kind == "kv_roll"]
    assert set(pieces) == {4}, pieces
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert (a.keys - b.keys).abs().max() < 1e-5 and (a.values - b.values).abs().max() < 1e-5
    tok = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        a, b = (model(input_ids=tok, past_key_values=c, use_cache=True).logits for c in caches)
    assert ((a - b).norm() / b.norm()).item() < 1e-4
    kernel = compile_cuda(render(rolled).source, "fusec_step.cu")
    assert "warning" not in kernel.log, kernel.log


def test_generate_on_a_sliding_window_model_equals_hf_greedy():
    """fusec.generate on Mistral with a sliding window (longer than the cache it makes): the same
    tokens as HF's greedy generate(), no fallback (steps launched one by one: the Python counter
    cannot be replayed from a CUDA graph)."""
    import fusec
    model = hf_tiny.mistral_sw(window=128)
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(9))
    with FallbackWatch() as w:
        out = fusec.generate(model, prompt, 12, eos_token_id=[], options={"num_sms": 8})
    ref = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                         attention_mask=torch.ones_like(prompt))
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert torch.equal(out, ref), (out, ref)


class _CounterCache:
    """A KV cache with a Python position counter, as HF's sliding-window layer keeps one."""

    def __init__(self, length=32):
        self.k, self.v, self.count = torch.zeros(1, 4, length, 16), torch.zeros(1, 4, length, 16), 3


class _CounterModel(torch.nn.Module):
    """One attention layer over a :class:`_CounterCache` at position ``count``, plus ``extra(count)``
    added to the output as a float ramp: what a host value feeds."""

    def __init__(self, extra):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.kv, self.o = torch.nn.Linear(64, 64), torch.nn.Linear(64, 128), torch.nn.Linear(64, 64)
        self.extra = extra

    def forward(self, x, c):
        q = self.q(x).view(1, 1, 4, 16).transpose(1, 2)
        k, v = self.kv(x).view(1, 1, 8, 16).transpose(1, 2).chunk(2, dim=1)
        s = c.count
        pos = torch.arange(1) + s
        c.k.index_copy_(2, pos, k)
        c.v.index_copy_(2, pos, v)
        mask = (torch.arange(c.k.shape[2]) <= pos).view(1, -1)
        att = torch.nn.functional.scaled_dot_product_attention(q, c.k, c.v, attn_mask=mask)
        c.count = s + 1
        return self.o(att.transpose(1, 2).reshape(1, 1, 64)) + self.extra(s)


def _DIVISOR(s):   # the counter as a divisor: not split, specialized
    return (torch.arange(64) // (s + 1)).float()


@pytest.mark.parametrize("extra", [
    lambda s: (torch.arange(64) + 2 * s).float(),      # a position the host computes, past the cache at 16
    _DIVISOR,
], ids=["twice", "divisor"])
def test_counter_uses_stay_correct(extra):
    """20 steps against eager: a host-computed position past the cache's rows stays in fusec (the
    position tables cover option ``position_rows``, 32768 by default for host positions: no
    fallback), a counter used otherwise than as an added position falls back per value (eagerly:
    inductor gave wrong values there: the option names inductor, the default outside this
    suite, so that the switch to eager is what keeps the values right); every step equals eager."""
    model = _CounterModel(extra).eval()
    ce, cc = _CounterCache(), _CounterCache()
    gen = torch.Generator().manual_seed(1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8, "fallback": "inductor"})
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(20):
            x = torch.randn(1, 1, 64, generator=gen)
            b = model(x, ce)
            a = compiled(x, cc)
            assert ((a - b).norm() / b.norm()).item() < 1e-4
    torch._dynamo.reset()
    assert cc.count == ce.count == 23
    assert bool(w.fallbacks) == (extra is _DIVISOR), w.fallbacks


def test_one_call_captures_after_the_backend_specialize_the_counter(steps):
    """After ``torch.compile(backend="fusec")`` made the token counter symbolic for this process,
    fusec's one-call captures (``fusec.api.compile_model``, the CLI's path) still specialize it
    (``fusec.frontend.counters.counters_specialized``): they lowered to NotLengthPolymorphic on
    Gemma-2, Gemma-3 and Mistral with a window before (CI of the nineteenth session), and the
    backend's setting is back in place after them."""
    import step_util
    from fusec.api import compile_model
    from fusec.frontend.counters import CACHE_COUNTER_SOURCES
    model = hf_tiny.gemma2()
    _decode_against_eager(model, n=2)
    assert len(steps) == 1
    assert CACHE_COUNTER_SOURCES in torch.compiler.config.dynamic_sources
    sched = step_util.lowered(model)
    assert sched.instrs
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
    res = compile_model(model, (), {"input_ids": torch.randint(0, 128, (1, 1)), "past_key_values": cache,
                                    "use_cache": True}, {"num_sms": 8})
    assert res.schedule.instrs
    assert CACHE_COUNTER_SOURCES in torch.compiler.config.dynamic_sources


@pytest.mark.parametrize("name", ["gemma2", "mistral_sw"])
def test_one_row_window_past_its_window_equals_eager(name, steps):
    """A window of one row (``sliding_window=1``) past its window, 6 steps from position 3: HF's
    window offset ``s - W + 1`` is the position ``s`` itself, so both host values are the one
    device counter, and the rolled cache's one-row mask (all True) equals the causal mask at
    position 0, the only position its rows hold. The cache is written at a constant row (the
    roll's last row), which does not bound the position: ``recognize`` keeps the mask (it read
    position ``s``, out of the cache's one row, an IndexFaultError, before). Logits and every
    layer's K/V cache equal eager's, with no fallback line."""
    model = hf_tiny.gemma2(window=1) if name == "gemma2" else hf_tiny.mistral_sw(window=1)
    caches, fallbacks, errs = _steps_against_eager(model, 3, 6, seed=12)
    assert not fallbacks, fallbacks
    assert max(errs) < 1e-4, errs
    assert steps
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert (a.keys - b.keys).abs().max() < 1e-5 and (a.values - b.values).abs().max() < 1e-5


def test_a_k_token_step_on_a_full_window_falls_back_with_a_line_that_says_so():
    """Two query tokens a step (option ``query_tokens=2``, speculative decoding's verification
    shape) on a Mistral sliding window of 8 rows: before the window fills the step is fusec's;
    where the new tokens fill it or it is full, HF's sliding-window cache concatenates them to
    its window (cache_utils.py) and fusec falls back with a line that says that, not that a
    DynamicCache was passed (it said so before); the logits equal eager's either way."""
    from transformers import StaticCache
    model = hf_tiny.mistral_sw(window=8)
    gen = torch.Generator().manual_seed(4)
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8, "query_tokens": 2})
    with torch.no_grad():
        p = torch.randint(0, 128, (1, 3), generator=gen)
        for c in caches:
            model(input_ids=p, past_key_values=c, use_cache=True)
        for n in (1, 5):   # position 3 (the window not full), then 5 to 13 (it fills and rolls)
            with FallbackWatch() as w:
                for _ in range(n):
                    tok = torch.randint(0, 128, (1, 2), generator=gen)
                    a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
                    b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
                    assert ((a - b).norm() / b.norm()).item() < 1e-4
            if n == 1:
                assert not w.fallbacks and w.compiled, w.fallbacks
    torch._dynamo.reset()
    full = [f for f in w.fallbacks if "sliding-window cache concatenates the 2 new tokens" in f]
    assert full and "cache_utils.py" in full[0], w.fallbacks
    assert not any("DynamicCache" in f for f in w.fallbacks), w.fallbacks
    # a DynamicCache's K-token step concatenates too: its line still says so
    with FallbackWatch() as w, torch.no_grad():
        from transformers import DynamicCache
        cache = DynamicCache()
        model(input_ids=torch.randint(0, 128, (1, 3), generator=gen), past_key_values=cache, use_cache=True)
        compiled(input_ids=torch.randint(0, 128, (1, 2), generator=gen), past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    assert any("(a DynamicCache)" in f for f in w.fallbacks), w.fallbacks
    assert not any("sliding-window" in f for f in w.fallbacks), w.fallbacks
