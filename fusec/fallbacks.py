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


def warn(msg: str, *args: Any) -> None:
    """Log one fallback line (``logging`` %-style ``msg`` and ``args``) on the ``fusec`` logger."""
    log.warning(msg, *args, extra={MARK: True})


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
        fallbacks: the messages of fallback lines (:func:`warn`) among them.
        compiled: decode steps fusec compiled while the watch was open (0 after a call that
            should have compiled means fusec never ran: HF skipping compilation on a CPU, say).
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.warnings: list[str] = []
        self.fallbacks: list[str] = []
        self._start = 0
        self._echo = False
        self.compiled = 0

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
        log.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        log.removeHandler(self)
        log.setLevel(self._level)
        self.compiled = COMPILED[0] - self._start
