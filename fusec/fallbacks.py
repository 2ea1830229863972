"""Fallback lines: how fusec says that a graph went to another backend, and how to watch for it.

Every fallback is one WARNING line on the ``fusec`` logger (a graph fusec does not compile, a
kernel that could not be built, an inductor fallback that failed); :func:`warn` marks its
record with the attribute :data:`MARK`, so callers that must not measure or test another
backend by mistake (benchmarks, GPU tests) recognize it without parsing the message.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("fusec")

MARK = "fusec_fallback"   # LogRecord attribute set (True) on every fallback line


def warn(msg: str, *args: Any) -> str:
    """Log one fallback line (``logging`` %-style ``msg`` and ``args``) on the ``fusec`` logger;
    returns the line (the ``reason`` of the graph's :class:`FallbackRun`)."""
    log.warning(msg, *args, extra={MARK: True})
    return msg % args if args else msg


#: the :class:`FallbackWatch` objects open now (nested ones too: fusec.generate opens its own)
_OPEN: list["FallbackWatch"] = []


def ran_fallback(reason: str) -> None:
    """One call ran a graph that went to another backend when it was compiled (``reason``: its
    fallback line, logged once, then): every open :class:`FallbackWatch` counts it."""
    for w in _OPEN:
        w._runs.append(reason)


class FallbackRun:
    """The callable of a graph that fell back (inductor's or the eager graph's): each call tells
    the open watches (:func:`ran_fallback`), so that a later call of the same graph, which logs
    nothing (dynamo reuses its compiled code), still shows in ``FallbackWatch.fallbacks``.

    Args:
        fn: the fallback's callable (dynamo's calling convention: ``_boxed_call`` is kept).
        reason: the fallback line logged when the graph was compiled.
    """

    def __init__(self, fn: Any, reason: str):
        self.fn, self.reason = fn, reason
        if getattr(fn, "_boxed_call", False):
            self._boxed_call = True

    def __call__(self, *args: Any) -> Any:
        if _OPEN:
            ran_fallback(self.reason)
        return self.fn(*args)


#: decode steps fusec compiled in this process (:class:`fusec.frontend.compiled.CompiledStep` built an
#: engine); :class:`FallbackWatch` reports how many while it was open
COMPILED = [0]


def note_compiled() -> None:
    """Count one compiled decode step (called by the compiled step after its first build)."""
    COMPILED[0] += 1


#: the engine (kernel and buffers) the last call of a fusec-compiled step launched: a CUDA graph
#: captured over a call holds that launch, so a later call that dispatched to another compiled
#: step (dynamo's guards chose another cache entry, nothing compiled) must capture again
#: (fusec.generation.session)
LAUNCHED: list = [None]


class FallbackWatch(logging.Handler):
    """While open (``with FallbackWatch() as w:``), collects the ``fusec`` logger's warnings.

    The lines still reach the user: when nothing else would print them (no logging set up), the
    watch also writes them to stderr, as Python's last-resort handler would.

    Attributes:
        warnings: every WARNING-or-above message, in order.
        fallbacks: the messages of fallback lines (:func:`warn`) among them, and for a graph that
            fell back in an earlier call and ran again while the watch was open (dynamo reuses
            it without a new line) its line once more, marked ``[ran again]``.
        fallback_runs: calls of graphs that fell back (:class:`FallbackRun`) while open, the
            first call's included (a CUDA graph's replays run no Python and are not counted).
        compiled: decode steps fusec compiled while the watch was open (0 after a call that
            should have compiled means fusec never ran: HF skipping compilation on a CPU, say);
            read inside the ``with`` block, the count so far.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.warnings: list[str] = []
        self.fallbacks: list[str] = []
        self._start = 0
        self._echo = False
        self._compiled = 0
        self._fallback_runs = 0
        self._runs: list[str] = []

    @property
    def compiled(self) -> int:
        """Decode steps fusec compiled while open (so far, while it is)."""
        return COMPILED[0] - self._start if self in _OPEN else self._compiled

    @property
    def fallback_runs(self) -> int:
        """Calls of graphs that fell back while open (so far, while it is)."""
        return len(self._runs) if self in _OPEN else self._fallback_runs

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if self._echo:
            import sys
            print(msg, file=sys.stderr)
        self.warnings.append(msg)
        if getattr(record, MARK, False):
            self.fallbacks.append(msg)

    def __enter__(self) -> "FallbackWatch":
        # a logging set-up that drops warnings (a root level of ERROR) must not hide fallbacks
        self._level = log.level
        if log.getEffectiveLevel() > logging.WARNING:
            log.setLevel(logging.WARNING)
        self._echo = not log.hasHandlers()   # nothing configured: logging's last resort would print
        self._start = COMPILED[0]
        self._runs = []
        log.addHandler(self)
        _OPEN.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        log.removeHandler(self)
        log.setLevel(self._level)
        if self in _OPEN:
            _OPEN.remove(self)
        self._compiled = COMPILED[0] - self._start
        self._fallback_runs = len(self._runs)
        for reason in dict.fromkeys(self._runs):   # in order, once each
            if reason not in self.fallbacks:   # not logged while open: compiled before, ran again
                self.fallbacks.append(f"{reason} [ran again: a graph that fell back when it was compiled]")
