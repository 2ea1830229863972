"""The megakernel's host-mapped status record read as an error: the watchdog's stuck waits and
the first index fault (layouts: :mod:`fusec.abi`). Read by :class:`fusec.runtime.cuda_step.CudaStep`
before each launch and by :meth:`~fusec.runtime.cuda_step.CudaStep.raise_if_watchdog`."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from fusec.abi import Claim, Fault, Status, WdRecord, fault_remedy
from fusec.errors import IndexFaultError, KernelRecordError, WatchdogError


def status_error(head: Sequence[int], records: Sequence[Sequence[int]],
                 op_name: Callable[[int], str]) -> KernelRecordError | None:
    """The error a status record stands for, or None when it records nothing.

    Args:
        head: the ``ST_HEAD`` int64 header words of the host-mapped status (:class:`fusec.abi.Status`).
        records: one row of ``WD_REC`` ints per SM (:class:`fusec.abi.WdRecord`); a row whose
            ``CLAIMED`` is ``Claim.RECORD`` is a record.
        op_name: the op's name for an opcode.

    A watchdog record wins over a fault. The root cause is the record with the smallest
    instruction id (waits point backwards, so its producer is the one that never came) among
    the records of the step that fired: those with the smallest target (the step's epoch;
    a later step, queued before the host noticed, stops at its first wait).
    """
    if head[Status.WATCHDOG]:
        recs = [{f.name.lower(): r[f] for f in WdRecord if f != WdRecord.CLAIMED}
                for r in records if r[WdRecord.CLAIMED] == Claim.RECORD]
        if not recs:
            return WatchdogError("megakernel watchdog fired but recorded no wait", {})
        step = min(r["target"] for r in recs)
        recs = [r for r in recs if r["target"] == step]
        f = dict(min(recs, key=lambda r: r["instruction"]))
        f["op_name"] = op_name(f["op"])
        f["stuck_sms"] = len(recs)
        return WatchdogError(
            f"megakernel watchdog: SM {f['sm']} queue[{f['queue_index']}] op {f['op']} ({f['op_name']}) "
            f"instruction #{f['instruction']} waited past the timeout on counter {f['counter']} "
            f"(op {f['counter']}'s tiles): value {f['value']} in step {f['target']} ({len(recs)} SMs stuck)", f)
    if head[Status.FAULT]:
        code, value, bound = (int(head[k]) for k in (Status.CODE, Status.VALUE, Status.BOUND))
        what = Fault(code).doc if code in list(Fault) else f"index (code {code})"
        if code == Fault.INDEX:
            what = "position (table lookup) or gathered index"
        return IndexFaultError(f"megakernel: {what} {value} out of range [0, {bound}); the step's "
                               f"outputs are invalid; {fault_remedy(code, value, bound, what)}",
                               {"code": code, "value": value, "bound": bound})
    return None
