"""Position-table evaluation (fusec.ir.position.evaluate_many): the vmapped path agrees with
op-by-op evaluation at every position (integers and bools equal, floats within 4 ulps: CPU kernels
may round a row's scalar tail differently from its vectorized part), on the tables and masks real
families fold, and a subgraph vmap cannot run falls back to op-by-op evaluation."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.api import compile_model
from fusec.ir import position

FAMILIES = {"llama": hf_tiny.llama, "qwen3": hf_tiny.qwen3, "gemma": hf_tiny.gemma,
            "gpt_neox": hf_tiny.gpt_neox, "granite": hf_tiny.granite}


def _compile(make, length: int = 48):
    model = make()
    cache = hf_tiny.static_cache(model, length)
    vocab = model.config.vocab_size
    with torch.no_grad():   # the prefill allocates the static cache
        model(input_ids=torch.randint(0, vocab, (1, 3)), past_key_values=cache, use_cache=True)
    return compile_model(model, (), {"input_ids": torch.randint(0, vocab, (1, 1)),
                                     "past_key_values": cache, "use_cache": True},
                         {"num_sms": 4, "cache": False})


@pytest.fixture(scope="module")
def llama_tables():
    """The tiny Llama compiled with vmap as it is (the reference of the two tests that change it)."""
    return _compile(hf_tiny.llama)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vmapped_tables_equal_op_by_op_at_every_position(family, monkeypatch):
    real = position._vmapped
    seen = []

    def checked(at, info, positions, one, per_position):
        batched = real(at, info, positions, one, per_position)
        seen.append(batched is not None)
        if batched is not None:
            for i, p in enumerate(positions):
                for b, v in zip(batched, one(p)):
                    assert position._close(b[i], v), (family, p, (b[i] - v).abs().max())
        return batched

    monkeypatch.setattr(position, "_vmapped", checked)
    _compile(FAMILIES[family])
    assert seen and all(seen), f"{family}: a position subgraph was not vmapped ({seen})"


def test_a_subgraph_vmap_cannot_run_is_evaluated_op_by_op(monkeypatch, llama_tables):
    """vmap failing (here: forced) leaves the same schedule and tables (within 4 ulps)."""
    want = llama_tables

    def refuse(fn, *a, **k):
        raise RuntimeError("vmap refused for the test")

    monkeypatch.setattr(torch.func, "vmap", refuse)
    got = _compile(hf_tiny.llama)
    assert got.graph_text() == want.graph_text()
    tables = {n: t.value for n, t in want.schedule.graph.tensors.items() if t.value is not None}
    assert tables, "no position table was folded"
    for n, v in tables.items():
        assert position._close(got.schedule.graph.tensors[n].value, v), n


def test_small_vmap_chunks_give_the_same_tables(monkeypatch, llama_tables):
    """Chunked vmap (bounded intermediates for long caches) changes nothing: chunks of one
    position's targets give the tables of one batched call."""
    want = llama_tables
    monkeypatch.setattr(position, "VMAP_CHUNK_BYTES", 1)
    real, used = position._vmapped, []
    monkeypatch.setattr(position, "_vmapped", lambda *a: used.append(real(*a)) or used[-1])
    got = _compile(hf_tiny.llama)
    assert used and all(b is not None for b in used)
    assert got.graph_text() == want.graph_text()
    for n, t in want.schedule.graph.tensors.items():
        if t.value is not None:
            assert position._close(got.schedule.graph.tensors[n].value, t.value), n


def _gptj(positions: int):
    """A tiny ``GPTJForCausalLM`` whose sinusoidal position table (``embed_positions``, indexed by
    the position) has ``positions`` rows."""
    import transformers as T
    torch.manual_seed(0)
    cfg = T.GPTJConfig(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=positions, rotary_dim=8,
                       bos_token_id=0, eos_token_id=0, initializer_range=0.1)
    return T.GPTJForCausalLM(cfg).eval().requires_grad_(False)


def test_a_position_table_shorter_than_the_cache_bounds_the_positions(steps):
    """GPT-J indexes its 64-row position table by the position, and generate()'s step has a
    32768-row capacity: the tables cover the 64 positions the model defines
    (passes/fold_position.py ``_valid_positions``; it raised an index error at position 64) and
    the step still serves every cache length. ``fusec.generate`` and HF ``generate()`` give
    eager's tokens, no fallback, also where fusec.generate's cache (rounded up to 128 rows) is
    longer than the table (a 58-token prompt and 6 new tokens: positions up to 63); a plain loop
    over a 96-row static cache runs fusec too (a position past 63 faults, as eager's index does)."""
    import fusec
    from fusec.errors import IndexFaultError
    from fusec.fallbacks import FallbackWatch
    from transformers.generation import CompileConfig
    model = _gptj(64)
    cc = CompileConfig(backend="fusec")
    cc._compile_all_devices = True
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad(), FallbackWatch() as w:
        for length, new in ((6, 5), (58, 6)):
            ids = torch.randint(1, 128, (1, length), generator=gen)
            want = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
            assert torch.equal(fusec.generate(model, ids, new), want)
            assert torch.equal(model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0,
                                              cache_implementation="static", compile_config=cc), want)
    assert not w.fallbacks and w.fallback_runs == 0 and w.compiled, w.fallbacks
    built = [s for s in steps if s.schedule is not None]
    assert built and all(32768 in s.schedule.graph.lengths.values() for s in built)
    tables = [s.schedule.graph.tensors[o.inputs["table"]].shape[0] for s in built
              for o in s.schedule.graph.ops if o.kind == "table_lookup"]
    assert tables and max(tables) == 64, tables
    ids = torch.randint(1, 128, (1, 6), generator=gen)
    cache, ref = hf_tiny.static_cache(model, 96), hf_tiny.static_cache(model, 96)
    with torch.no_grad():
        for c in (cache, ref):
            model(input_ids=ids, past_key_values=c, use_cache=True)
        compiled = torch.compile(model, backend="fusec")
        with FallbackWatch() as w:
            for t in (3, 9):
                tok = torch.tensor([[t]])
                a = compiled(input_ids=tok, past_key_values=cache).logits
                e = model(input_ids=tok, past_key_values=ref).logits
                assert torch.allclose(a, e, atol=1e-5, rtol=1e-4)
            for c in (cache, ref):
                for layer in c.layers:
                    layer.cumulative_length.fill_(64)
            with pytest.raises(IndexFaultError, match="position table has 64 rows"):
                compiled(input_ids=tok, past_key_values=cache)
            with pytest.raises(RuntimeError, match="index 64 is out of bounds"):   # eager's gather
                model(input_ids=tok, past_key_values=ref)
    assert not w.fallbacks and w.compiled, w.fallbacks
