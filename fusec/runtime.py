"""runtime: load the megakernel's CUBIN with the driver API and launch one decode step.

One cooperative launch per step: grid = number of SMs scheduled (one CTA per SM, all resident),
on torch's current stream, so a step can be captured in a CUDA graph. Token ids and positions
are read by the kernel from the caller's device tensors; KV caches and position counters are
written in place. Per call the guards compare each input's data pointer with the last call's
and fully re-check (shape, dtype, device, contiguity, 16-byte alignment) only the ones that
changed; a changed pointer is written to the kernel's pointer table (one small host-to-device
copy, no kernel). After the launch the status (watchdog flag and index-fault record) is read
back in one sync unless ``check_watchdog`` is off; a set watchdog raises :class:`WatchdogError`
and resets the counters, a set fault raises :class:`IndexFaultError`.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from .codegen import PROF_MARKS, WORD, KernelPlan
from .errors import CudaError, FusecError, IndexFaultError, WatchdogError
from .ir import Graph, Role
from .jit import CompiledKernel

log = logging.getLogger("fusec.runtime")

_FAULTS = {1: "token id (embedding row)", 2: "position (table lookup)", 3: "RoPE position",
           4: "KV-cache write position", 5: "attention position"}


@functools.cache
def _driver():
    """cuda-python's driver module (imported once, on first use: the CPU path never needs it)."""
    from cuda.bindings import driver
    return driver


def _ck(res: Any, what: str) -> Any:
    drv = _driver()
    err = res[0] if isinstance(res, tuple) else res
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


class CudaStep:
    """A loaded megakernel and its device state (instruction words, counters, buffers).

    Args:
        g: the scheduled graph; plan: :func:`fusec.codegen.render` output; kernel: its CUBIN.
        flat_args: the first call's inputs (they fix the device and the input layouts).
        watchdog_s: seconds a counter wait may spin before the kernel gives up.
    """

    def __init__(self, g: Graph, plan: KernelPlan, kernel: CompiledKernel, flat_args: list[Any],
                 watchdog_s: float = 2.0, check_watchdog: bool = True):
        drv = _driver()
        self.g, self.plan = g, plan
        self.check_watchdog = check_watchdog
        dev = next(a.device for a in flat_args if isinstance(a, torch.Tensor) and a.is_cuda)
        self.device = dev
        torch.cuda.set_device(dev)
        torch.cuda.current_stream(dev)  # make torch's primary context current
        _ck(drv.cuInit(0), "cuInit")
        self.module = _ck(drv.cuModuleLoadData(kernel.cubin), "cuModuleLoadData")
        self.func = _ck(drv.cuModuleGetFunction(self.module, b"fusec_step"), "cuModuleGetFunction")
        _ck(drv.cuFuncSetAttribute(self.func,
                                   drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                   plan.smem_bytes), "cuFuncSetAttribute(max dynamic shared memory)")
        per_sm = _ck(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.func, plan.threads, plan.smem_bytes),
                     "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        if per_sm < 1 or plan.num_sms > per_sm * sms:
            raise FusecError(f"cooperative launch impossible: {plan.num_sms} CTAs of {plan.threads} threads "
                             f"and {plan.smem_bytes} B shared memory, occupancy {per_sm}/SM on {sms} SMs")
        i32 = dict(dtype=torch.int32, device=dev)
        self.words = torch.tensor(plan.words, **i32)
        self.queue_off = torch.tensor(plan.queue_off, **i32)
        self.waits = torch.tensor(plan.waits, **i32)
        self.counters = torch.zeros(plan.n_counters + 1, **i32)   # +1: a counter nobody signals (tests)
        self.epochs = torch.zeros(plan.num_sms, **i32)
        # status: the index-fault record (int64 [set, code, value, bound]), then the watchdog
        # (int32: header + one record per SM), so one read after a step sees both
        n_wd = 8 + 8 * plan.num_sms
        self.status = torch.zeros(4 + n_wd // 2, dtype=torch.int64, device=dev)
        self.fault = self.status[:4]
        self.wd = self.status[4:].view(torch.int32)
        self.input_pos = {name: g.inputs.index(name) for name in plan.buffers if name in g.inputs}
        self.slot = {name: k for k, name in enumerate(plan.buffers)}
        self.owned: dict[str, torch.Tensor] = {}
        for name in plan.buffers:
            info = g.tensors[name]
            if name in self.input_pos:
                continue
            if info.role == Role.CONSTANT:
                self.owned[name] = info.value.to(dev).contiguous()
            else:
                fill = float("nan") if info.dtype.is_floating_point else -7
                self.owned[name] = torch.full(info.shape, fill, dtype=info.dtype, device=dev)
        self.ptrs = [0] * len(plan.buffers)
        self.seen: list[int | None] = [None] * len(g.inputs)
        for k, name in enumerate(plan.buffers):
            if name in self.owned:
                self.ptrs[k] = self.owned[name].data_ptr()
        self.bufs = torch.zeros(len(plan.buffers), dtype=torch.int64, device=dev)
        self._update_inputs(flat_args)
        self._vals = [ctypes.c_void_p(t.data_ptr()) for t in
                      (self.words, self.queue_off, self.waits, self.counters, self.epochs, self.bufs, self.wd)]
        self._vals.append(ctypes.c_ulonglong(int(watchdog_s * 1e9)))
        sym, _ = _ck(drv.cuModuleGetGlobal(self.module, b"fusec_fault"), "cuModuleGetGlobal(fusec_fault)")
        fault_addr = ctypes.c_uint64(self.fault.data_ptr())   # the kernel's fault pointer, set once
        _ck(drv.cuMemcpyHtoD(sym, ctypes.addressof(fault_addr), 8), "cuMemcpyHtoD(fusec_fault)")
        self.prof: torch.Tensor | None = None
        if plan.profile:   # (SM, fetched, waits satisfied, done, marks...) per instruction, globaltimer ns
            self.prof = torch.zeros(len(plan.words) // WORD, 4 + PROF_MARKS, dtype=torch.int64, device=dev)
            self._vals.append(ctypes.c_void_p(self.prof.data_ptr()))
        self._params = (ctypes.c_void_p * len(self._vals))(*[ctypes.addressof(v) for v in self._vals])
        # per output: its own buffer viewed in the output's shape, or (input index, shape)
        self._outs: list[torch.Tensor | tuple[int, tuple[int, ...]]] = []
        for t in g.outputs:
            r, shape = g.root(t), tuple(g.tensors[t].shape)
            self._outs.append(self.owned[r].view(shape) if r in self.owned else (g.inputs.index(r), shape))

    def _update_inputs(self, args: Sequence[Any]) -> None:
        changed = False
        for name, i in self.input_pos.items():
            a = args[i]
            p = a.data_ptr() if isinstance(a, torch.Tensor) else None
            if p is not None and p == self.seen[i]:
                continue
            self._guard(name, a)
            if self.seen[i] is not None:
                log.debug("input %s moved: %#x -> %#x", name, self.seen[i], p)
            self.seen[i] = p
            self.ptrs[self.slot[name]] = p
            changed = True
        if changed:
            self.bufs.copy_(torch.tensor(self.ptrs, dtype=torch.int64))

    def _guard(self, name: str, a: Any) -> None:
        info = self.g.tensors[name]
        where = f"input {name} ({info.role.value})"
        if not isinstance(a, torch.Tensor):
            raise FusecError(f"{where}: expected a tensor, got {type(a).__name__}")
        if a.device != self.device:
            raise FusecError(f"{where}: on {a.device}, the kernel was built for {self.device}")
        if a.dtype != info.dtype or tuple(a.shape) != tuple(info.shape):
            raise FusecError(f"{where}: {a.dtype}{list(a.shape)}, the kernel was built for "
                             f"{info.dtype}{list(info.shape)}")
        if not a.is_contiguous():
            raise FusecError(f"{where}: not contiguous (strides {a.stride()})")
        if a.data_ptr() % 16:
            raise FusecError(f"{where}: data pointer not 16-byte aligned")

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        drv = _driver()
        self._update_inputs(args)
        stream = drv.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        _ck(drv.cuLaunchCooperativeKernel(self.func, self.plan.num_sms, 1, 1, self.plan.threads, 1, 1,
                                          self.plan.smem_bytes, stream, ctypes.addressof(self._params)),
            "cuLaunchCooperativeKernel")
        if self.check_watchdog:
            self.raise_if_watchdog()
        return [o if isinstance(o, torch.Tensor) else args[o[0]].view(o[1]) for o in self._outs]

    def profile_records(self) -> torch.Tensor:
        """The last step's per-instruction records, int64 [instructions, 4 + PROF_MARKS] on the
        CPU: (SM, fetched, waits satisfied, done, then the template's FUSEC_MARK timestamps,
        0 where not taken) in %globaltimer ns (synchronizes).

        Raises:
            FusecError: the kernel was built without ``profile``.
        """
        if self.prof is None:
            raise FusecError("this kernel was built without profile=True: no timeline recorded")
        return self.prof.cpu()

    def raise_if_watchdog(self) -> None:
        """Read the step's status (one synchronizing read); raise WatchdogError if a counter wait
        timed out (after resetting counters, epochs and the records), IndexFaultError if a
        run-time token id or position was out of range: its access was skipped, so the step's
        outputs (and a KV row it may have written) are invalid, and the record is cleared."""
        head = self.status[:5].cpu()
        code_set, code, value, bound = head[:4].tolist()
        if not int(head[4:].view(torch.int32)[0]):      # wd[0], the watchdog's abort flag
            if code_set:
                self.fault.zero_()
                what = _FAULTS.get(code, f"index (code {code})")
                raise IndexFaultError(f"megakernel: {what} {value} out of range [0, {bound}); the step's "
                                      f"outputs are invalid", {"code": code, "value": value, "bound": bound})
            return
        names = ["sm", "queue_index", "op", "counter", "value", "target", "instruction"]
        recs = [dict(zip(names, r[1:])) for r in self.wd[8:].view(-1, 8).tolist() if r[0]]
        n = len(recs)
        self.reset()
        if not recs:
            raise WatchdogError("megakernel watchdog fired but recorded no wait", {})
        f = min(recs, key=lambda r: r["instruction"])   # the root cause: waits point backwards
        f["op_name"] = self.g.ops[f["op"]].name if 0 <= f["op"] < len(self.g.ops) else "?"
        f["stuck_sms"] = n
        raise WatchdogError(
            f"megakernel watchdog: SM {f['sm']} queue[{f['queue_index']}] op {f['op']} ({f['op_name']}) "
            f"instruction #{f['instruction']} waited past the timeout on counter {f['counter']}: "
            f"value {f['value']}, target {f['target']} ({n} SMs stuck)", f)

    def reset(self) -> None:
        """Zero counters, epochs, the watchdog and the index-fault records (after an aborted step)."""
        torch.cuda.synchronize(self.device)
        self.counters.zero_()
        self.epochs.zero_()
        self.status.zero_()
