"""Compiled-in values on the GPU, compared byte for byte once per ``generate()`` call.

A step compiles in the values of some small weights (``Schedule.compiled_in``: RoPE's
``inv_freq`` folded into the position tables, Gemma's ``1 + w``). :class:`fusec.frontend.compiled.CompiledStep`
sees at every call a write that moves a version counter (``load_state_dict``, an in-place op on
the parameter) or an address (a parameter rebound through ``.data``), and on the CPU it compares
the values themselves. On the GPU, reading the values at every call would synchronize the host
with the device at every step; a write through ``.data`` (``p.data.copy_(w)``), which moves no
version counter, went unseen there (issue 30, item 4).

:class:`ValueSnapshot` keeps a device copy of a built step's compiled-in GPU tensors, as bytes.
:func:`check_at_next_call` (called by :func:`fusec.generate` and by HF ``generate()`` through
fusec once per call, before its first decode step) moves a process-wide epoch; the next call of
each step then compares its compiled-in tensors with the snapshot (a concatenation and one
``torch.equal``: one synchronization per step and ``generate()`` call, a few hundred KiB at
most), and a difference makes the step build again (one log line). A plain decode loop over
``torch.compile(model, backend="fusec")`` calls neither: there a write through ``.data`` on the
GPU is seen only after :func:`check_at_next_call` (``fusec.check_weights_at_next_call``).
No comparison runs while a CUDA graph is being captured (it would synchronize); the first call
outside one does it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

#: the process-wide epoch: a snapshot compares at the first call after it moved
EPOCH = [0]


def check_at_next_call() -> None:
    """Make every fusec step compare its compiled-in GPU values with what it was built with at
    its next call (outside a CUDA graph capture), once: a value written since through ``.data``
    makes that step build again. :func:`fusec.generate` and HF ``generate()`` through fusec call
    this at their start; call it in a plain decode loop after writing weights through ``.data``."""
    EPOCH[0] += 1


def _bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, flattened and concatenated on their device (uint8 [total])."""
    return torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors])


class ValueSnapshot:
    """A device copy of a step's compiled-in GPU tensors (bytes) and the epoch last compared.

    Args:
        names: the graph inputs' names (for the log line), one per tensor.
        indices: their positions in the step's flat inputs.
        tensors: the values the step was built with (on one GPU; any dtype and shape).
    """

    def __init__(self, names: Sequence[str], indices: Sequence[int], tensors: Sequence[torch.Tensor]):
        if not tensors:
            raise ValueError("a ValueSnapshot of no tensors")
        self.names, self.indices = list(names), list(indices)
        self.sizes = [t.numel() * t.element_size() for t in tensors]
        self.data = _bytes(tensors).clone()
        self.epoch = EPOCH[0]

    def due(self) -> bool:
        """Whether the epoch moved since the last comparison and no CUDA graph is being captured."""
        return self.epoch != EPOCH[0] and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    def changed(self, args: Sequence[object]) -> str | None:
        """The name of the first compiled-in tensor whose bytes in ``args`` (the step's flat
        inputs) differ from the snapshot's, or None; marks the epoch compared (synchronizes)."""
        self.epoch = EPOCH[0]
        now = [args[i] for i in self.indices]
        if any(not isinstance(t, torch.Tensor) for t in now):
            return next(n for n, t in zip(self.names, now) if not isinstance(t, torch.Tensor))
        sizes = [t.numel() * t.element_size() for t in now]
        if sizes == self.sizes and torch.equal(_bytes(now), self.data):
            return None
        start = 0
        for name, t, size, old in zip(self.names, now, sizes, self.sizes):
            if size != old or not torch.equal(_bytes([t]), self.data[start:start + old]):
                return name
            start += old
        return self.names[0]   # (unreachable: some tensor differs)
