"""The GPU step's outputs: views of the kernel's own buffers, never overwritten while referenced.

The megakernel writes each output (the logits, say) into a buffer it owns, addressed through its
device pointer table ``bufs``. Returning views of those buffers costs nothing, but the next step
would overwrite what the caller still holds: a loop that keeps each step's logits (in fp32,
where ``.float()`` is no copy) got the last step's values for every step. Eager PyTorch and
inductor's default give every call fresh outputs; inductor's CUDA-graph trees, which reuse
buffers, raise when an overwritten output is read.

:class:`StepOutputs` gives eager's semantics at no cost where nothing is held: before each
launch outside a CUDA-graph capture it compares each output buffer's storage use count
(``torch._C._storage_Use_Count``: one per tensor or view of it, wherever it lives) and the
Python reference counts of the view objects it returns with the counts of its own references;
a buffer someone else still references is handed over to them for good, and the kernel gets a
new one (``torch.empty_like``; its address written into ``bufs`` by the caller's stream-ordered
pointer write). HF ``generate()`` drops each step's outputs (``del
outputs``) before the next, so its steps move nothing; a plain ``out = model(...)`` loop holds
the previous ``out`` during the call, so each of its steps moves the logits' buffer (one
allocation from torch's caching allocator and one or two 4-byte memsets).

A launch captured into a CUDA graph is not checked: its replays write the buffers baked at
capture time, which is what a graph's outputs mean (the caller reads them after each replay).
The buffers are step-local intermediates (the kernel writes them before it reads them in every
step; they start poisoned at load), so a new one needs no contents; constants are never moved.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch

from fusec.ir import Graph, Role

log = logging.getLogger("fusec.runtime.outputs")

_USE_COUNT = torch._C._storage_Use_Count


def _uses(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors and views of it; the temporary storage object
    this call makes counts one, in every call alike)."""
    return _USE_COUNT(t.untyped_storage()._cdata)


class StepOutputs:
    """The outputs of one loaded step (:class:`fusec.runtime.cuda_step.CudaStep`).

    Args:
        g: the scheduled graph (``g.outputs``; each output's root buffer and span).
        owned: the step's own device buffers by name (updated in place when one moves).
        inputs: the graph's input names (an output that aliases an input is a view of the
            caller's tensor at each call: a KV cache written in place).
    """

    def __init__(self, g: Graph, owned: dict[str, torch.Tensor], inputs: Sequence[str]):
        self.g, self.owned = g, owned
        self._inputs = list(inputs)
        self.roots = sorted({g.root(t) for t in g.outputs
                             if g.root(t) in owned and g.tensors[g.root(t)].role != Role.CONSTANT})
        #: buffers handed over to a caller that still held them (a count, for tests and logs)
        self.moved = 0
        self._outs: list[torch.Tensor | tuple[int, tuple[int, ...]]] = []
        self._views: list[tuple[str, torch.Tensor]] = []
        self._build()

    def _build(self) -> None:
        """The output views over the current buffers and each moving buffer's own count (the
        views of the last build dropped first: the counts are of this build's only)."""
        g = self.g
        self._outs, self._views, self._base, self._view_base = [], [], [], []
        outs: list[torch.Tensor | tuple[int, tuple[int, ...]]] = []
        for t in g.outputs:
            info = g.tensors[t]   # (an input's alias of a run-time length: that dim from the input)
            r, shape = g.root(t), tuple(-1 if d in info.sym else n for d, n in enumerate(info.shape))
            if g.is_view(t) and r in self.owned:   # part of a buffer of the step's (TensorInfo.offset)
                _, a, b = g.span(t)
                outs.append(self.owned[r].view(-1)[a:b].view(shape))
                continue
            outs.append(self.owned[r].view(shape) if r in self.owned else (self._inputs.index(r), shape))
        self._outs = outs
        del outs
        moving = set(self.roots)
        # a caller holds a buffer through a view of its own (another TensorImpl: the storage's
        # count) or through the very view objects returned (the same object each call: their
        # Python reference counts); both counted here as this object holds them
        self._base = [(r, _uses(self.owned[r])) for r in self.roots]
        self._views = [(self.g.root(t), o) for t, o in zip(self.g.outputs, self._outs)
                       if isinstance(o, torch.Tensor) and self.g.root(t) in moving]
        self._view_base = [sys.getrefcount(o) for _, o in self._views]

    def before_launch(self) -> list[tuple[str, int]]:
        """Give the kernel a new buffer for each output buffer referenced beyond this object's
        own views (called before a launch that is not being captured). Returns the moved
        buffers' ``(name, new address)``, for the caller to write into the kernel's pointer
        table before the launch (stream-ordered)."""
        held = self._held()
        if not held:
            return []
        moved = []
        try:
            for r in held:
                self.owned[r] = torch.empty_like(self.owned[r])   # (no local name: _build counts)
                moved.append((r, self.owned[r].data_ptr()))
        finally:   # (an allocation that failed: the buffers moved so far are the ones returned)
            self.moved += len(moved)
            if moved and self.moved == len(moved):
                log.debug("outputs %s still referenced at the next launch: handed over, new buffers for the "
                          "kernel", ", ".join(r for r, _ in moved))
            self._build()
        return moved

    def _held(self) -> list[str]:
        """The moving buffers referenced beyond this object's own views, each once. (A function
        of its own: no loop variable of it may hold a view while :meth:`_build` counts.)"""
        held = {r: None for r, n in self._base if _uses(self.owned[r]) > n}
        for (r, o), n in zip(self._views, self._view_base):
            if sys.getrefcount(o) > n:
                held[r] = None
        return list(held)

    def views(self, args: Sequence[Any]) -> list[torch.Tensor]:
        """This call's outputs (views of the step's buffers; an input's alias from ``args``)."""
        return [o if isinstance(o, torch.Tensor) else args[o[0]].view(o[1]) for o in self._outs]
