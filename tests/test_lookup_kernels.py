"""Prompt lookup's bookkeeping kernels (fusec.runtime.lookup_kernels, templates/prompt_lookup.cu.j2)
on a CPU: the source compiles with NVRTC for sm_90a (no local memory, registers that fit
lookup_draft's CTA), and the CPU path never asks for them. Their results against the torch ops:
tests/test_gpu_lookup_kernels.py."""
from __future__ import annotations

import pytest
import torch

from fusec import prompt_lookup
from fusec.runtime import lookup_kernels

pytest.importorskip("cuda.bindings.nvrtc")


@pytest.mark.parametrize("max_ngram", [prompt_lookup.MAX_NGRAM, 1, 3])
def test_the_source_compiles_for_sm_90a(max_ngram, tmp_path):
    src = lookup_kernels.source(max_ngram)
    assert f"#define PL_MAX_NGRAM {max_ngram}\n" in src and "{{" not in src
    k = lookup_kernels.compile_source(max_ngram, cache_dir=str(tmp_path))
    assert k.cubin.startswith(b"\x7fELF") and not k.cache_hit
    assert {"lookup_draft", "lookup_advance"} <= {f for f, r in k.resources.items() if r["entry"]}
    k.assert_no_spills()
    # lookup_draft's CTA of THREADS threads must fit an SM's 64K registers
    assert k.resources["lookup_draft"]["registers"] * lookup_kernels.THREADS <= 65536
    assert lookup_kernels.compile_source(max_ngram, cache_dir=str(tmp_path)).cache_hit


def test_the_cpu_path_never_asks_for_the_kernels(monkeypatch):
    """A decoder on the CPU (the simulator's) runs the torch ops: kernels() is never called."""
    def refuse(*a, **k):
        raise AssertionError("lookup_kernels.kernels called on the CPU")
    monkeypatch.setattr(lookup_kernels, "kernels", refuse)

    class Layer:
        cumulative_length = torch.tensor(0)

    class Cache:
        layers = [Layer()]

    hist = torch.tensor([1, 2, 3, 1, 2, 0, 0, 0, 0, 0])
    dec = prompt_lookup.LookupDecoder(lambda inp, cache: torch.tensor([3, 1, 9]), Cache(), hist, 5, 6, 3)
    assert not dec.device_kernels
    dec.one()
    assert dec.inp.tolist() == [[2, 3, 1]]          # the last token, then the drafts after "1 2"
    assert int(dec.n) == 6 and hist[5:8].tolist() == [3, 1, 9]   # a = 2 accepted, clamped at the limit
    assert int(dec.steps) == 1 and int(dec.accepted) == 0
    assert int(Cache.layers[0].cumulative_length) == 5


def test_the_position_table_is_built_again_only_when_a_position_moves(monkeypatch):
    """LengthTable (here over CPU tensors: its logic, not a device's) keeps one table per set of
    addresses; a layer whose position is no int64 element gets none (torch ops set them)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    class Layer:
        def __init__(self):
            self.cumulative_length = torch.tensor(0)

    class Cache:
        layers = [Layer(), Layer()]

    table = lookup_kernels.LengthTable(torch.device("cpu"))
    first = table(Cache)
    assert first.tolist() == [la.cumulative_length.data_ptr() for la in Cache.layers]
    assert table(Cache) is first
    Cache.layers[1].cumulative_length = torch.tensor(3)
    second = table(Cache)
    assert second is not first and second[1] == Cache.layers[1].cumulative_length.data_ptr()
    Cache.layers[0].cumulative_length = torch.tensor(0, dtype=torch.int32)
    assert table(Cache) is None
