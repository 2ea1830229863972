"""Exception types raised by fusec.

Every error names what went wrong in the user's terms (op, shape, file, line) so that a
message alone is enough to act on. The CLI turns a :class:`FusecError` into a one-line
message and a non-zero exit code; the torch.compile backend turns a
:class:`FallbackRequired` into one log line and a fallback backend.
"""
from __future__ import annotations


class FusecError(Exception):
    """Base class of every error fusec raises on purpose."""


class FallbackRequired(FusecError):
    """The graph is valid PyTorch but fusec cannot place it (prefill, unsupported op).

    The backend catches this and hands the graph to a fallback backend with one log line.
    """


class NotDecodeStepError(FallbackRequired):
    """The captured graph is not a decode step of at most the option ``query_tokens``'s query tokens
    per sequence (for example a prefill), or has no attention or a growing KV cache."""


class BatchSizeVaries(NotDecodeStepError):
    """A decode step whose batch size is symbolic (dynamo made dim 0 dynamic after a call with
    another batch size, or ``dynamic=True``): one step cannot serve every batch size, so the
    backend compiles one per batch size seen (:class:`fusec.frontend.backend.PerBatchStep`)
    instead of falling back. ``symbols``: dynamo's symbols the batch sizes are made of;
    ``shape``: the attention query's shape as the message writes it."""

    def __init__(self, message: str, symbols: frozenset = frozenset(), shape: str = ""):
        super().__init__(message)
        self.symbols, self.shape = symbols, shape


class UnsupportedOpError(FallbackRequired):
    """The graph holds an ATen op that no instruction kind or generic kind can execute."""


class NotLengthPolymorphic(FusecError):
    """A graph with a symbolic KV-cache length uses that length other than as the cache's rows
    (a size of another tensor, a value in arithmetic): one compiled step cannot serve every
    length, and the step is compiled per length instead. The message names the op or tensor."""


class CapacityExceeded(FusecError):
    """A call's KV cache is longer than the capacity its length-polymorphic step was built for,
    and the step cannot rebuild itself (it came from a warm start): the caller captures the graph
    again for ``rows`` (:class:`fusec.frontend.backend.SymbolicStep`)."""

    def __init__(self, message: str, rows: int):
        super().__init__(message)
        self.rows = rows


class CaptureError(FusecError):
    """Capturing the model (dynamo / AOT autograd) failed or produced an unusable graph."""


class IRError(FusecError):
    """The IR violates an invariant; the message names the pass that broke it."""


class DeadlockError(FusecError):
    """The simulator found no runnable instruction while work remained.

    Attributes:
        blocked: one dict per blocked SM with keys ``sm``, ``queue_index``, ``instruction``,
            ``counter``, ``value``, ``target``.
    """

    def __init__(self, message: str, blocked: list[dict]):
        super().__init__(message)
        self.blocked = blocked


class HazardError(FusecError):
    """Two accesses to overlapping memory are not ordered by counters or queue order.

    Attributes:
        hazards: one dict per hazard with keys ``kind`` ("RAW", "WAR", "WAW"), ``buffer``,
            ``first`` and ``second`` (instruction descriptions) and ``region``.
    """

    def __init__(self, message: str, hazards: list[dict]):
        super().__init__(message)
        self.hazards = hazards


class JitError(FusecError):
    """NVRTC failed to compile a kernel; the message carries the full NVRTC log."""


class ModelFileError(FusecError):
    """A model file given to the CLI is missing, has no build(), or build() returns the wrong shape."""


class KernelRecordError(FusecError):
    """A failure the megakernel recorded on the device and the host read back; ``fields`` holds
    the record, each field also an attribute."""

    def __init__(self, message: str, fields: dict):
        super().__init__(message)
        self.fields = fields
        for k, v in fields.items():
            setattr(self, k, v)


class WatchdogError(KernelRecordError):
    """A counter wait on the GPU ran past its timeout; the megakernel exited instead of hanging.

    Attributes:
        sm, queue_index, op, counter, value, target, instruction: the record the kernel wrote
        (``op`` is the opcode: the op's index in the schedule; ``op_name`` names it).
    """


class CudaError(FusecError):
    """A CUDA driver call failed; the message names the call and the error."""


class IndexFaultError(KernelRecordError, IndexError):
    """A run-time index read by the megakernel (token id, position) was out of range; the
    kernel skipped the access instead of faulting, so the step's outputs are invalid. Also an
    :class:`IndexError`, the error eager PyTorch raises for the same index (``aten.embedding``,
    ``index_copy_``), so that code catching that one catches this one.

    Attributes:
        code: which index, a :class:`fusec.abi.Fault` code (token id, table-lookup position or
            gathered index, RoPE position, KV-cache write position, attention position); value:
            the index; bound: its exclusive upper bound.
    """


class SimulationMismatchError(FusecError):
    """``--simulate``: a value the simulated step produced differs from eager execution of the
    same captured ATen graph on the same inputs.

    Attributes:
        mismatches: one dict per differing tensor with keys ``name``, ``role``, ``shape``,
            ``dtype``, ``error`` (relative error, or the number of differing elements for
            integer tensors) and ``tolerance``.
    """

    def __init__(self, message: str, mismatches: list[dict]):
        super().__init__(message)
        self.mismatches = mismatches


class SimulatorWarning(UserWarning):
    """A step runs on fusec's CPU simulator because its tensors are on the CPU (shown once per
    process): it checks the kernel's schedule tile by tile in Python, far slower than eager."""
