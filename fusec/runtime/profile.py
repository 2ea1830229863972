"""Per-SM timeline of one megakernel step: Chrome/Perfetto trace, Gantt PNG, summary.

The profiling build of the kernel writes one row per instruction into an int64 tensor
``records`` of shape ``[n_instructions, 4]``; row ``i`` belongs to instruction id ``i`` and
holds ``(sm, t_start_ns, t_waited_ns, t_end_ns)`` read from ``%globaltimer`` (absolute
nanoseconds):

- ``t_start``: the instruction was fetched and its dependency waits began;
- ``t_waited``: every counter it waits for was satisfied (its work began);
- ``t_end``: its work was done and its counter released.

Columns after the fourth, if any, are the template's marks (``FUSEC_MARK(k)`` in a template:
when thread 0 passed point k; 0 where not taken). :meth:`Timeline.op_windows` gives their
median offset from ``t_waited`` per op, so the time inside an instruction is seen by phase.

:class:`Timeline` pairs these rows with the schedule's per-instruction metadata and keeps
times in microseconds (float) from the earliest ``t_start``. ``wait`` is
``t_waited - t_start`` and ``busy`` is ``t_end - t_waited``. A timeline saved with
:meth:`Timeline.save` (plain JSON, no matplotlib needed) can be drawn elsewhere with
:func:`render`. matplotlib is imported only by :meth:`Timeline.to_png`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Sequence

log = logging.getLogger("fusec.runtime.profile")

FORMAT = "fusec-timeline"
VERSION = 1


class MatplotlibMissing(ImportError):
    """Raised by :meth:`Timeline.to_png` and :func:`render` when matplotlib is not installed."""


@dataclasses.dataclass(frozen=True)
class InstrMeta:
    """What the timeline keeps of a schedule instruction (``fusec.ir.schedule.Instr``).

    ``sm`` is the SM the schedule placed it on; ``bytes`` is ``tile.bytes`` (weights plus
    activations) and ``weight_bytes`` is ``tile.weight_bytes``; ``waits`` are the counter ids
    it waits for.
    """

    id: int
    op: str
    kind: str
    sm: int
    layer: int
    bytes: int
    weight_bytes: int
    waits: tuple[int, ...]

    @staticmethod
    def of(instr: Any) -> "InstrMeta":
        """From an object with ``.id .op .kind .sm .layer .tile.bytes .tile.weight_bytes .waits``."""
        return InstrMeta(int(instr.id), str(instr.op), str(instr.kind), int(instr.sm),
                         int(instr.layer), int(instr.tile.bytes), int(instr.tile.weight_bytes),
                         tuple(int(w) for w in instr.waits))


class Timeline:
    """Measured per-SM timeline of one step.

    Attributes:
        records: raw rows ``(sm, t_start_ns, t_waited_ns, t_end_ns)``, one per instruction id
            (Python ints, absolute ns).
        meta: :class:`InstrMeta` per instruction id (same order as ``records``).
        marks: per instruction id, the template's mark timestamps (absolute ns, 0 = not
            taken); empty tuples when the records have only 4 columns.
        num_sms: SMs of the schedule (the Gantt chart's rows).
        step_ms: wall time of the step measured outside the kernel, if given (else None).
        t0_ns: the earliest ``t_start``; ``start/waited/end`` are µs floats from it.
    """

    def __init__(self, records: Sequence[Sequence[int]], meta: Sequence[InstrMeta],
                 num_sms: int, step_ms: float | None = None):
        """Prefer :meth:`from_records` or :meth:`from_json`.

        Raises:
            ValueError: no instructions, ``len(records) != len(meta)``, rows of fewer than 4
                integers or of different lengths, an SM outside ``[0, num_sms)``, or times not
                in the order ``t_start <= t_waited <= t_end``.
        """
        full = [tuple(int(v) for v in r) for r in records]
        if not full:
            raise ValueError("profile: no instruction records")
        if len(full) != len(meta):
            raise ValueError(f"profile: {len(full)} records for {len(meta)} instructions")
        if len(full[0]) < 4 or any(len(r) != len(full[0]) for r in full):
            raise ValueError("profile: records must have shape [n_instructions, 4 + marks] "
                             "(sm, t_start_ns, t_waited_ns, t_end_ns, mark_ns...)")
        rows = [r[:4] for r in full]
        self.marks: list[tuple[int, ...]] = [r[4:] for r in full]
        self.records: list[tuple[int, int, int, int]] = rows  # type: ignore[assignment]
        self.meta = list(meta)
        self.num_sms = int(num_sms)
        self.step_ms = None if step_ms is None else float(step_ms)
        bad_sm = [i for i, r in enumerate(rows) if not 0 <= r[0] < self.num_sms]
        if bad_sm:
            raise ValueError(f"profile: SM outside [0, {self.num_sms}) for instruction(s) "
                             f"{bad_sm[:8]}")
        bad_t = [i for i, (_, s, w, e) in enumerate(rows) if not s <= w <= e]
        if bad_t:
            i = bad_t[0]
            raise ValueError(f"profile: {len(bad_t)} record(s) not ordered t_start <= t_waited "
                             f"<= t_end, first instruction {i}: {rows[i]} (unrecorded row?)")
        moved = sum(1 for r, m in zip(rows, self.meta) if r[0] != m.sm)
        if moved:
            log.warning("profile: %d instruction(s) ran on another SM than scheduled", moved)
        self.t0_ns = min(r[1] for r in rows)
        self.sm = [r[0] for r in rows]
        self.start = [(r[1] - self.t0_ns) / 1e3 for r in rows]
        self.waited = [(r[2] - self.t0_ns) / 1e3 for r in rows]
        self.end = [(r[3] - self.t0_ns) / 1e3 for r in rows]

    @classmethod
    def from_records(cls, records: Any, schedule: Any, step_ms: float | None = None) -> "Timeline":
        """Build from the kernel's records and the schedule it ran.

        Args:
            records: int64 ``[n_instructions, 4]`` (torch tensor on any device, numpy array or
                nested sequences); row ``i`` is instruction id ``i``:
                ``(sm, t_start_ns, t_waited_ns, t_end_ns)``, absolute ``%globaltimer`` ns.
            schedule: a ``fusec.ir.schedule.Schedule`` (only ``.instrs[i]`` with ``.id .op .kind
                .sm .layer .tile.bytes .tile.weight_bytes .waits`` and optionally ``.num_sms``
                are read; without ``num_sms`` it is the highest SM + 1).
            step_ms: the step's wall time measured around the launch, kept in the summary.

        Raises:
            ValueError: as :class:`Timeline`, or instruction ids that are not ``0..n-1``.
        """
        if hasattr(records, "detach"):
            records = records.detach().cpu()
        rows = records.tolist() if hasattr(records, "tolist") else [list(r) for r in records]
        metas = sorted((InstrMeta.of(i) for i in schedule.instrs), key=lambda m: m.id)
        if [m.id for m in metas] != list(range(len(metas))):
            raise ValueError("profile: schedule instruction ids are not 0..n-1")
        num_sms = getattr(schedule, "num_sms", None)
        if num_sms is None:
            num_sms = max([m.sm for m in metas] + [int(r[0]) for r in rows] + [-1]) + 1
        return cls(rows, metas, num_sms, step_ms)

    # ---- raw data round trip ------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The raw data as a JSON-ready dict (records in absolute ns, per-instruction metadata)."""
        return {
            "format": FORMAT, "version": VERSION, "num_sms": self.num_sms, "step_ms": self.step_ms,
            "records": [list(r) + list(m) for r, m in zip(self.records, self.marks)],
            "instructions": [{**dataclasses.asdict(m), "waits": list(m.waits)} for m in self.meta],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Timeline":
        """Inverse of :meth:`to_json`. Raises ValueError for another format or version."""
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} file "
                             f"(format={data.get('format')!r}, version={data.get('version')!r})")
        try:
            metas = [InstrMeta(**{**m, "waits": tuple(m["waits"])}) for m in data["instructions"]]
            return cls(data["records"], metas, data["num_sms"], data.get("step_ms"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"profile: malformed {FORMAT} data: {e!r}") from e

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_json` to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f)
        log.info("profile: timeline of %d instructions written to %s", len(self.records), path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Timeline":
        """Read a file written by :meth:`save`. Raises OSError, ValueError (bad JSON or format)."""
        with open(path) as f:
            return cls.from_json(json.load(f))

    # ---- analysis -----------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Numbers of the step, times in µs, bandwidths in GB/s (1e9 bytes/s).

        Keys: ``instructions``, ``num_sms``, ``step_ms``, ``span_us`` (last end - first
        start), ``busy_us`` and ``wait_us`` (sums over instructions), ``bytes``,
        ``gbps_span`` (all bytes / span), ``idle_share_mean`` (mean over all ``num_sms`` of
        ``1 - (busy + wait) / span``; an SM with no instruction counts as 1.0),
        ``idle_share_per_sm`` (list), ``critical_sm`` and ``critical_end_us`` (the SM with the
        latest end), ``per_kind`` (``{kind: {count, busy_us, mean_us, wait_us, bytes,
        gbps_busy (bytes / summed busy time), gbps_span (bytes / span)}}``) and
        ``per_layer`` (``{layer: span_us}``, first start to last end of the layer's
        instructions; layer -1 is work outside the decoder layers).
        """
        span = max(self.end) - min(self.start)
        busy = [e - w for w, e in zip(self.waited, self.end)]
        wait = [w - s for s, w in zip(self.start, self.waited)]
        per_kind: dict[str, dict[str, Any]] = {}
        for m, b, w in zip(self.meta, busy, wait):
            k = per_kind.setdefault(m.kind, {"count": 0, "busy_us": 0.0, "wait_us": 0.0, "bytes": 0})
            k["count"] += 1
            k["busy_us"] += b
            k["wait_us"] += w
            k["bytes"] += m.bytes
        for k in per_kind.values():
            k["mean_us"] = k["busy_us"] / k["count"]
            k["gbps_busy"] = _gbps(k["bytes"], k["busy_us"])
            k["gbps_span"] = _gbps(k["bytes"], span)
        occupied = [0.0] * self.num_sms
        for sm, b, w in zip(self.sm, busy, wait):
            occupied[sm] += b + w
        idle = [1.0 - o / span if span > 0 else 0.0 for o in occupied]
        crit = max(range(len(self.end)), key=lambda i: self.end[i])
        layers: dict[int, list[float]] = {}
        for m, s, e in zip(self.meta, self.start, self.end):
            lo_hi = layers.setdefault(m.layer, [s, e])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], s), max(lo_hi[1], e)
        total_bytes = sum(m.bytes for m in self.meta)
        return {
            "instructions": len(self.meta),
            "num_sms": self.num_sms,
            "step_ms": self.step_ms,
            "span_us": span,
            "busy_us": sum(busy),
            "wait_us": sum(wait),
            "bytes": total_bytes,
            "gbps_span": _gbps(total_bytes, span),
            "idle_share_mean": sum(idle) / len(idle),
            "idle_share_per_sm": idle,
            "critical_sm": self.sm[crit],
            "critical_end_us": self.end[crit],
            "per_kind": dict(sorted(per_kind.items())),
            "per_layer": {l: hi - lo for l, (lo, hi) in sorted(layers.items())},
        }

    def op_windows(self, layer: int | None = None) -> list[dict[str, Any]]:
        """Per op (in first-start order), when its tiles ran: the critical path of a layer.

        Args:
            layer: only this decoder layer's ops (-1: work before the first layer); None: all.

        Returns one dict per op, times in µs from the step's first start: ``op``, ``kind``,
        ``layer``, ``tiles``, ``sms`` (distinct SMs), ``first_fetch`` (earliest t_start),
        ``first_ready`` (earliest t_waited: its first producer level is done), ``last_end``,
        ``window_us`` (last_end - first_ready), ``mean_busy_us``, ``mean_wait_us``, ``bytes``
        and ``gbps_window`` (bytes / window, 1e9 bytes/s; how close the op streams to the
        read bandwidth while it is the level the step waits on).
        """
        by_op: dict[str, list[int]] = {}
        for i, m in enumerate(self.meta):
            if layer is None or m.layer == layer:
                by_op.setdefault(m.op, []).append(i)
        out = []
        for op, ids in by_op.items():
            ready = min(self.waited[i] for i in ids)
            end = max(self.end[i] for i in ids)
            nbytes = sum(self.meta[i].bytes for i in ids)
            out.append({
                "op": op, "kind": self.meta[ids[0]].kind, "layer": self.meta[ids[0]].layer,
                "tiles": len(ids), "sms": len({self.sm[i] for i in ids}),
                "first_fetch": min(self.start[i] for i in ids), "first_ready": ready,
                "last_end": end, "window_us": end - ready,
                "mean_busy_us": sum(self.end[i] - self.waited[i] for i in ids) / len(ids),
                "mean_wait_us": sum(self.waited[i] - self.start[i] for i in ids) / len(ids),
                "bytes": nbytes, "gbps_window": _gbps(nbytes, end - ready),
                "marks_us": self._mark_medians(ids),
            })
        return sorted(out, key=lambda r: (r["first_fetch"], r["op"]))

    def _mark_medians(self, ids: list[int]) -> list[float | None]:
        n = len(self.marks[0]) if self.marks else 0
        out: list[float | None] = []
        for k in range(n):
            offs = sorted((self.marks[i][k] - self.t0_ns) / 1e3 - self.waited[i]
                          for i in ids if self.marks[i][k] > 0)
            out.append(offs[len(offs) // 2] if offs else None)
        return out

    # ---- outputs ------------------------------------------------------------------------

    def to_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write a Chrome trace-event JSON (``{"traceEvents": [...]}``) for ui.perfetto.dev.

        One process ("fusec step", pid 0) with one thread per SM (``tid = sm``, named
        "SM <sm>"). Per instruction: a ``wait`` slice (category "wait") from t_start to
        t_waited when nonzero, then a slice named by its kind (category = kind) from t_waited
        to t_end with args ``{id, op, layer, bytes, waits}`` (``waits``: number of counters).
        ``ts``/``dur`` are µs from the earliest t_start. Raises OSError on a write error.
        """
        ev: list[dict[str, Any]] = [
            {"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": "fusec step"}}]
        ev += [{"ph": "M", "pid": 0, "tid": sm, "name": "thread_name", "args": {"name": f"SM {sm}"}}
               for sm in range(self.num_sms)]
        for m, sm, s, w, e in zip(self.meta, self.sm, self.start, self.waited, self.end):
            if w > s:
                ev.append({"ph": "X", "pid": 0, "tid": sm, "name": "wait", "cat": "wait",
                           "ts": s, "dur": w - s, "args": {"id": m.id}})
            ev.append({"ph": "X", "pid": 0, "tid": sm, "name": m.kind, "cat": m.kind,
                       "ts": w, "dur": e - w,
                       "args": {"id": m.id, "op": m.op, "layer": m.layer, "bytes": m.bytes,
                                "waits": len(m.waits)}})
        other = {"t0_ns": self.t0_ns, "step_ms": self.step_ms, "num_sms": self.num_sms}
        with open(path, "w") as f:
            json.dump({"traceEvents": ev, "displayTimeUnit": "ns", "otherData": other}, f)
        log.info("profile: Chrome trace (%d events) written to %s", len(ev), path)

    def to_png(self, path: str | os.PathLike, title: str = "") -> None:
        """Draw a Gantt chart (16x9 in, 120 dpi): y = SM, x = µs from the step's first start.

        Work is coloured by instruction kind (legend), waits are light grey, idle time is
        white. Uses the Agg canvas without touching pyplot's global backend.

        Raises:
            MatplotlibMissing (an ImportError): matplotlib is not installed.
            OSError: ``path`` cannot be written.
        """
        try:
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
            from matplotlib.ticker import MaxNLocator
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            import matplotlib as mpl
        except ImportError as e:
            raise MatplotlibMissing("fusec timeline PNG needs the 'matplotlib' package "
                                    "(pip install matplotlib); the Chrome trace and the "
                                    "timeline JSON do not") from e
        kinds = sorted({m.kind for m in self.meta})
        cmap = mpl.colormaps["tab10" if len(kinds) <= 10 else "tab20"]
        colour = {k: cmap(i % cmap.N) for i, k in enumerate(kinds)}
        waits: dict[int, list[tuple[float, float]]] = {}
        work: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for m, sm, s, w, e in zip(self.meta, self.sm, self.start, self.waited, self.end):
            if w > s:
                waits.setdefault(sm, []).append((s, w - s))
            work.setdefault((sm, m.kind), []).append((w, e - w))
        fig = Figure(figsize=(16, 9), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        h = 0.8
        for sm, bars in waits.items():
            ax.broken_barh(bars, (sm - h / 2, h), facecolors="#d9d9d9", linewidth=0)
        for (sm, kind), bars in work.items():
            ax.broken_barh(bars, (sm - h / 2, h), facecolors=colour[kind], linewidth=0)
        s = self.summary()
        head = f"span {s['span_us']:.1f} µs, mean idle {100 * s['idle_share_mean']:.0f}%"
        if self.step_ms is not None:
            head += f", step {self.step_ms:.3f} ms"
        ax.set_title(f"{title} ({head})" if title else head)
        ax.set_xlabel("time (µs)")
        ax.set_ylabel("SM")
        ax.set_ylim(self.num_sms - 0.5, -0.5)  # SM 0 on top, as in Perfetto
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(0, max(self.end) or 1.0)
        handles = [Patch(color=colour[k], label=k) for k in kinds]
        handles.append(Patch(color="#d9d9d9", label="wait"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
        log.info("profile: Gantt chart written to %s", path)


def render(timeline_json_path: str | os.PathLike, png_path: str | os.PathLike, title: str = "") -> dict[str, Any]:
    """Draw the PNG of a timeline saved by :meth:`Timeline.save`; returns its summary.

    Raises:
        OSError: a file cannot be read or written.
        ValueError: not a timeline file (bad JSON, format or records).
        MatplotlibMissing (an ImportError): matplotlib is not installed.
    """
    tl = Timeline.load(timeline_json_path)
    tl.to_png(png_path, title=title or os.path.basename(os.fspath(timeline_json_path)))
    return tl.summary()


def _gbps(nbytes: int, us: float) -> float:
    """Bytes over µs in GB/s (1e9 B/s); 0.0 for a zero time."""
    return nbytes / us / 1e3 if us > 0 else 0.0
