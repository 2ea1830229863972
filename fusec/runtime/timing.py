"""``fusec compile --run``: run the compiled decode step and time it next to eager.

:func:`time_decode` compiles the model with ``torch.compile(model, backend="fusec")`` and times
``steps`` decode steps of it, then the same steps of the eager model. Both start from the same
state (the KV caches and position counters that ``build()`` returned, restored before each
phase), so step ``i`` of either runs at the same KV position, on the same token. Each step is
timed alone: the device is idle when it starts (synchronized), so a step's time includes its
host-side work (dynamo guards, launches), as a caller of one decode step sees it. On CUDA the
times come from CUDA events, elsewhere (the CPU simulator, for tests) from the host clock.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fusec.fallbacks import FallbackWatch

log = logging.getLogger("fusec")


@dataclass
class DecodeTiming:
    """What :func:`time_decode` measured.

    Attributes:
        fusec_ms, eager_ms: milliseconds of each timed step, in order.
        rel_err: relative L2 error of fusec's first timed step's output (the logits) against
            eager's first timed step (same state, same token), or None if there is no tensor.
        fallbacks: fallback lines (:mod:`fusec.fallbacks`) logged while fusec compiled and ran;
            non-empty means the times are not fusec's.
        position: KV position of the first timed step (the cache length build() left), or None.
    """

    fusec_ms: list[float]
    eager_ms: list[float]
    rel_err: float | None
    fallbacks: list[str] = field(default_factory=list)
    position: int | None = None

    @property
    def fusec_median(self) -> float:
        return statistics.median(self.fusec_ms)

    @property
    def eager_median(self) -> float:
        return statistics.median(self.eager_ms)

    def line(self) -> str:
        """``fusec step: X ms (median of N ...), eager: Y ms, speed-up Z x; ...`` (Z: eager / fusec)."""
        at = f" at KV positions {self.position}..{self.position + len(self.fusec_ms) - 1}" \
            if self.position is not None else ""
        err = f"; first step's output vs eager: rel err {self.rel_err:.2g}" if self.rel_err is not None else ""
        return (f"fusec step: {self.fusec_median:.3f} ms (median of {len(self.fusec_ms)}{at}), "
                f"eager: {self.eager_median:.3f} ms, speed-up {self.eager_median / self.fusec_median:.3g} x{err}")


def state_tensors(*objs: Any) -> list[torch.Tensor]:
    """The tensors a decode step may write among ``objs``: tensors, items of lists, tuples and
    dicts, and the attributes of other objects (an HF cache, its layers), modules excepted;
    at most 6 levels deep."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(o: Any, depth: int) -> None:
        if depth > 6 or id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            for x in o:
                visit(x, depth + 1)
        elif isinstance(o, dict):
            for x in o.values():
                visit(x, depth + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, (type, torch.nn.Module)):
            for x in vars(o).values():
                visit(x, depth + 1)
    visit(objs, 0)
    return out


def first_tensor(out: Any) -> torch.Tensor | None:
    """The logits of a model output (``.logits``, or its first tensor), or None."""
    t = getattr(out, "logits", None)
    if isinstance(t, torch.Tensor):
        return t
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (list, tuple)):
        for x in out:
            if isinstance(x, torch.Tensor):
                return x
    return None


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], tuple[float, Any]]:
    if device.type == "cuda":
        def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end), out
    else:
        def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
            t0 = time.perf_counter()
            out = fn()
            return (time.perf_counter() - t0) * 1e3, out
    return timed


def time_decode(model: torch.nn.Module, args: tuple, kwargs: dict, *, steps: int = 20,
                warmup: int = 3, options: dict[str, Any] | None = None) -> DecodeTiming:
    """Compile ``model`` with the fusec backend and time ``steps`` decode steps against eager.

    ``model(*args, **kwargs)`` must be one decode step that advances its KV cache in place (as
    ``build()`` of a model file returns it); the model and its inputs stay on their device.
    Phases, each starting from the state ``build()`` left (restored by copying): ``warmup``
    fusec steps (the first one compiles), ``steps`` timed fusec steps, ``warmup`` eager steps,
    ``steps`` timed eager steps. The state is restored at the end.

    Args:
        options: fusec options (default none: what ``torch.compile(model, backend="fusec")`` does).
    """
    if steps < 1 or warmup < 0:
        raise ValueError("steps must be >= 1 and warmup >= 0")
    state = state_tensors(args, kwargs)
    saved = [t.detach().clone() for t in state]
    devices = {t.device for t in state} | {p.device for p in model.parameters()}
    device = next((d for d in devices if d.type == "cuda"), next(iter(devices), torch.device("cpu")))
    timed = _timer(device)
    position = _position(kwargs)

    def restore() -> None:
        for t, s in zip(state, saved):
            t.copy_(s)

    def phase(fn: Callable[[], Any]) -> tuple[list[float], torch.Tensor | None]:
        restore()
        for _ in range(warmup):
            fn()
        restore()
        times, first = [], None
        for i in range(steps):
            ms, out = timed(fn)
            times.append(ms)
            if i == 0:   # (a copy: the comparison with eager is of the first timed step)
                t = first_tensor(out)
                first = t.detach().clone() if t is not None else None
                del t
            del out   # (held during the next call, a fusec output would be handed over: not timed)
        return times, first

    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="fusec", options=dict(options or {}))
        with torch.no_grad(), FallbackWatch() as watch:
            fusec_ms, fusec_out = phase(lambda: compiled(*args, **kwargs))
        with torch.no_grad():
            eager_ms, eager_out = phase(lambda: model(*args, **kwargs))
    finally:
        torch._dynamo.reset()
        with torch.no_grad():
            restore()
    rel = None
    if fusec_out is not None and eager_out is not None:
        a, b = fusec_out.double(), eager_out.double()
        rel = ((a - b).norm() / b.norm()).item()
    return DecodeTiming(fusec_ms, eager_ms, rel, list(watch.fallbacks), position)


def _position(kwargs: dict) -> int | None:
    """The KV position the next step writes (an HF cache's length), or None."""
    cache = kwargs.get("past_key_values")
    try:
        n = cache.get_seq_length() if cache is not None else None
        return int(n) if n is not None else None
    except Exception:   # another cache type: the line just leaves the positions out
        return None
