"""The GPU step's outputs on the host side, without a GPU (fusec/runtime/outputs.py through
CudaStep's launch path, against tests/test_runtime_status.py's fake driver): an output buffer
the caller still holds at the next launch is handed over and the kernel writes a new one; one
nobody holds stays; a captured launch moves nothing and its buffer stays alive."""
from __future__ import annotations

import pytest
import torch

from fusec.runtime.outputs import StepOutputs
from test_runtime_status import BUFS_ADDR, _step, fake  # noqa: F401  (fake: the fixture)

def _step_with_outputs():
    """:func:`_step` whose buffer ``w`` (slot 0) is the step's own: outputs ``o`` (all of it,
    [2, 2]) and ``v`` (a view of its last two elements), and output ``c`` aliases input ``b``."""
    from fusec.ir import Graph, Role, TensorInfo
    step, a, b = _step()
    g = Graph()
    for name, i in (("a", 0), ("b", 1)):
        g.add_tensor(TensorInfo(name, (4,), torch.float32, Role.INPUT, input_index=i))
        g.inputs.append(name)
    g.add_tensor(TensorInfo("w", (4,), torch.float32, Role.OUTPUT))
    g.add_tensor(TensorInfo("o", (2, 2), torch.float32, Role.OUTPUT, alias_of="w"))
    g.add_tensor(TensorInfo("v", (2,), torch.float32, Role.OUTPUT, alias_of="w", offset=2))
    g.add_tensor(TensorInfo("c", (2, 2), torch.float32, Role.OUTPUT, alias_of="b"))
    g.outputs = ["o", "v", "c"]
    step.g = g
    step.owned = {"w": torch.arange(4.0)}
    step.ptrs[0] = step.owned["w"].data_ptr()
    step.outputs = StepOutputs(g, step.owned, g.inputs)
    return step, a, b


def test_outputs_are_views_of_the_steps_buffer_while_nothing_holds_them(fake):
    """A loop that drops each step's outputs before the next (HF generate()'s ``del outputs``):
    the same buffer every step, no pointer write, the input alias a view of this call's input."""
    step, a, b = _step_with_outputs()
    w = step.owned["w"].data_ptr()
    fake.calls.clear()
    for _ in range(3):
        o, v, c = step(a, b)
        assert o.data_ptr() == w and v.data_ptr() == w + 8 and c.data_ptr() == b.data_ptr()
        assert c.shape == (2, 2) and o.shape == (2, 2) and v.shape == (2,)
        del o, v, c
    assert fake.calls == [("launch", ("stream", 7), BUFS_ADDR)] * 3 and step.outputs.moved == 0


@pytest.mark.parametrize("held", ["whole", "view", "derived"])
def test_held_output_is_handed_over_and_the_kernel_writes_a_new_buffer(fake, held):
    """``out = step(...)`` in a loop holds the previous outputs during the call (or a view made
    from one: ``logits[:, -1]``): the held buffer is the caller's from then on (its values stay),
    and the kernel's pointer to it is rewritten before the launch (stream-ordered)."""
    step, a, b = _step_with_outputs()
    o, v, _ = step(a, b)
    o.fill_(5.0)   # what the "kernel" wrote at that step
    keep = {"whole": o, "view": v, "derived": o[:, -1]}[held]
    expect = keep.clone()
    del o, v
    old = step.owned["w"].data_ptr()
    fake.calls.clear()
    o2, v2, _ = step(a, b)
    new = step.owned["w"].data_ptr()
    assert new != old and step.ptrs[0] == new and step.outputs.moved == 1
    assert o2.data_ptr() == new and v2.data_ptr() == new + 8 and keep.untyped_storage().data_ptr() == old
    halves = [("memset", BUFS_ADDR + 4 * h, (new >> 32 * h) & 0xFFFFFFFF, 1) for h in (0, 1)
              if (new >> 32 * h) & 0xFFFFFFFF != (old >> 32 * h) & 0xFFFFFFFF]
    assert halves and fake.calls == halves + [("launch", ("stream", 7), BUFS_ADDR)]
    o2.fill_(7.0)  # the next step's values land in the new buffer, not in what the caller kept
    assert torch.equal(keep, expect)
    del keep, o2, v2
    fake.calls.clear()
    step(a, b)   # nothing held now: no move
    assert step.outputs.moved == 1 and fake.calls == [("launch", ("stream", 7), BUFS_ADDR)]


def test_a_captured_launch_moves_no_output_and_keeps_its_buffer(fake):
    """Inside a CUDA-graph capture the outputs are the graph's (its replays write them): a held
    output is not moved and the captured table holds the step's buffer. An eager call after it,
    with the graph's outputs held, hands that buffer over, but the step keeps it alive for the
    graph's replays (the table still points to it)."""
    step, a, b = _step_with_outputs()
    o, _, _ = step(a, b)
    w = step.owned["w"].data_ptr()
    fake.capturing = 1
    o2, _, _ = step(a, b)
    assert step.outputs.moved == 0 and o2.data_ptr() == w == o.data_ptr()
    (key, _), = step._frozen.items()
    assert key[0] == w
    kept = step.owned["w"]
    del o
    fake.capturing = 0
    o3, _, _ = step(a, b)   # o2 (the graph's output) is held: moved
    assert step.outputs.moved == 1 and o3.data_ptr() != w and step.owned["w"] is not kept
    import weakref
    ref = weakref.ref(kept)
    del kept, o2
    assert ref() is not None and ref().data_ptr() == w   # kept for the graph


def test_every_held_buffer_is_seen_after_another_moved(fake):
    """Two output buffers, the first held at one call and the second at the next: each held one
    moves, once (a buffer with two held views is not moved twice), and a view kept of the one
    that did not move at the first call is seen at the second (its count taken afresh)."""
    from fusec.ir import Graph, Role, TensorInfo
    step, a, b = _step()
    g = Graph()
    for name, i in (("a", 0), ("b", 1)):
        g.add_tensor(TensorInfo(name, (4,), torch.float32, Role.INPUT, input_index=i))
        g.inputs.append(name)
    for name in ("x", "y"):
        g.add_tensor(TensorInfo(name, (4,), torch.float32, Role.OUTPUT))
    g.add_tensor(TensorInfo("x2", (2, 2), torch.float32, Role.OUTPUT, alias_of="x"))
    g.outputs = ["x", "x2", "y"]
    step.g = g
    step.owned = {"x": torch.zeros(4), "y": torch.zeros(4)}
    step.plan.buffers = ["w", "a", "b", "x", "y"]
    step.slot.update({"x": 3, "y": 4})
    step._bufs_addr, step.ptrs = BUFS_ADDR, step.ptrs + [step.owned["x"].data_ptr(), step.owned["y"].data_ptr()]
    step.outputs = StepOutputs(g, step.owned, g.inputs)
    x, x2, y = step(a, b)
    x.fill_(1.0); y.fill_(1.0)
    del y
    x, x2, y = step(a, b)            # x held (twice): moved once; y not held
    assert step.outputs.moved == 1
    y.fill_(2.0)
    keep_y = y[1:]                   # a view of y's buffer, kept
    del x, x2, y
    step(a, b)
    assert step.outputs.moved == 2 and torch.equal(keep_y, torch.full((3,), 2.0))


def test_a_view_of_a_moved_buffer_is_seen_at_the_next_call(fake):
    """The buffer the kernel got at a move is counted afresh: a view kept of it at the next call
    moves it again (nothing of the move itself left in its count)."""
    step, a, b = _step_with_outputs()
    o, v, _ = step(a, b)
    o, v, _ = step(a, b)          # the first call's o and v held: moved
    assert step.outputs.moved == 1
    o.fill_(3.0)
    keep = o[0]
    del o, v
    step(a, b)
    assert step.outputs.moved == 2 and torch.equal(keep, torch.full((2,), 3.0))
