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
