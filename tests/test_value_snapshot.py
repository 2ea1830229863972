"""The GPU's check of compiled-in values (issue 30, item 4; fusec/frontend/value_snapshot.py):
a snapshot of a step's compiled-in tensors, compared byte for byte at the first call after
``check_at_next_call`` (once per generate() call), names the tensor written through ``.data``.
The class is device-agnostic, so its logic is checked here on CPU tensors; the kernel path is
``tests/test_gpu_generate.py::test_a_weight_written_through_data_between_generate_calls_rebuilds``."""
from __future__ import annotations

import pytest
import torch

import fusec
from fusec.frontend import value_snapshot
from fusec.frontend.value_snapshot import ValueSnapshot


def _weights():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, generator=g), torch.randn(4, 3, generator=g).to(torch.bfloat16),
            torch.tensor(2.5)]


def test_a_snapshot_is_compared_once_per_epoch_and_names_what_changed():
    w = _weights()
    args = ["token", w[0], None, w[1], w[2]]
    snap = ValueSnapshot(["inv_freq", "norm_w", "scale"], [1, 3, 4], w)
    assert not snap.due()                 # built in this epoch
    value_snapshot.check_at_next_call()
    assert snap.due()
    assert snap.changed(args) is None     # nothing written
    assert not snap.due()                 # compared once
    version = w[1]._version
    w[1].data.copy_(w[1] * 2)             # through .data: no version counter moves
    assert w[1]._version == version
    assert not snap.due()                 # seen at the next epoch only
    fusec.check_weights_at_next_call()    # the public name of the same epoch
    assert snap.due() and snap.changed(args) == "norm_w"
    args[1] = torch.cat([w[0], w[0]])     # another shape in its place
    value_snapshot.check_at_next_call()
    assert snap.changed(args) == "inv_freq"


def test_a_negative_zero_or_a_nan_payload_is_a_change():
    """Bytes, not values: -0.0 written over 0.0 is a write (equal as values; the step compiled
    in the old bytes), and the same NaN bytes are not (unequal as values)."""
    w = [torch.tensor([0.0, float("nan"), 1.0])]
    snap = ValueSnapshot(["w"], [0], w)
    assert snap.changed([w[0].clone()]) is None
    assert snap.changed([torch.tensor([-0.0, float("nan"), 1.0])]) == "w"


def test_strided_and_odd_tensors_are_compared_by_their_bytes():
    """A column, a strided slice, a [4, 1] view, bool and 0-d tensors (a view whose last stride is
    not 1 cannot be viewed as bytes in place: copied first)."""
    w = torch.arange(20.0).view(4, 5)
    ts = [w[:, 0], torch.arange(8.0)[::2], w[:, :1], torch.tensor([True, False]), torch.tensor(3, dtype=torch.int8)]
    snap = ValueSnapshot([f"t{i}" for i in range(len(ts))], list(range(len(ts))), ts)
    assert snap.changed(ts) is None
    w[2, 0] = -1.0
    assert snap.changed(ts) == "t0"


def test_an_empty_snapshot_is_refused():
    with pytest.raises(ValueError, match="no tensors"):
        ValueSnapshot([], [], [])


def test_a_cpu_step_keeps_no_snapshot_and_generate_moves_the_epoch(monkeypatch):
    """On the CPU the step digests its compiled-in values at every call (no snapshot: Llama's
    ``inv_freq`` is compiled in, on the CPU), and ``fusec.generate`` moves the epoch once per call."""
    import hf_tiny
    import step_util
    from fusec.fallbacks import FallbackWatch
    model = hf_tiny.llama()
    made = step_util.record_compiled_steps(monkeypatch)
    before = value_snapshot.EPOCH[0]
    ids = torch.randint(1, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    with FallbackWatch() as w:
        fusec.generate(model, ids, 3, eos_token_id=[], options={"num_sms": 8})
    torch._dynamo.reset()
    assert w.compiled and not w.fallbacks
    assert value_snapshot.EPOCH[0] == before + 1
    built = [s for s in made if s.schedule is not None]
    assert built and all(s.schedule.compiled_in and s._watched and s._snapshot is None for s in built)
