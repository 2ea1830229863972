"""runtime: load the megakernel's CUBIN with the driver API and launch one decode step.

One cooperative launch per step: grid = number of SMs scheduled (one CTA per SM, all resident),
on torch's current stream. Token ids and positions are read by the kernel from the caller's
device tensors; KV caches and position counters are written in place.

The host never waits for the device on the default path: a call makes no sync and no
host<->device copy.
- Status: the kernel writes its records (the first index fault; the watchdog's stuck waits) to
  page-locked host memory mapped into the device (``cuMemHostAlloc`` with
  ``CU_MEMHOSTALLOC_DEVICEMAP``), then sets a flag word there; the abort flag the watchdog spins
  on stays in device memory. Before each launch the call reads that flag (a plain memory read,
  when ``check_watchdog`` is on, the default); if an earlier step recorded something, it waits
  for the device (the error path only), raises :class:`WatchdogError` (after resetting counters,
  epochs and records) or :class:`IndexFaultError` (after clearing the fault) and does not
  launch. So a fault raises at the NEXT call, or at :meth:`CudaStep.raise_if_watchdog`, the
  explicit check that synchronizes first.
- Inputs: per call the guards compare each input's data pointer with the last call's and fully
  re-check (shape, dtype, device, contiguity, 16-byte alignment) only the ones that changed; a
  changed pointer is written into the kernel's device pointer table ``bufs`` by one or two
  4-byte ``cuMemsetD32Async`` on the launch stream (the value travels in the call: no staging
  buffer, stream-ordered, capturable). A read-only input (token ids) passed as a non-contiguous
  or unaligned view is copied into an aligned buffer of the step's own, on the launch stream,
  at every call that passes such a view.
- Run-time lengths (a length-polymorphic kernel, :attr:`fusec.ir.Graph.lengths`): the pointer
  table's length slots (``"#len:" + symbol`` in ``plan.buffers``) hold each symbol's size at the
  call (the KV caches' rows, any size in ``[1, capacity]``; every input of one symbol must
  agree). An input with symbolic dims has its sizes compared at every call even when its pointer
  did not change (the caching allocator may give a cache of another length the old address); a
  changed length is written like a pointer (a stream-ordered memset).
- CUDA graphs: a call made while torch's current stream is capturing (``torch.cuda.graph``)
  launches the kernel with a device pointer table of its own, written at capture time with the
  pointers of the tensors passed then (outside the graph: a copy on a side stream, waited for,
  in relaxed capture mode) and never written again (captured launches with the same pointers
  share it). The graph holds the kernel node (after the copy of an input staged as above); it
  bakes the tensors seen at capture time (replay with the same tensors, updated in place, and the
  same lengths: the table holds the capture's), and
  its replays never disturb the eager calls' table. It must not outlive this CudaStep (which
  owns that table). The status is not checked during a capture (its error path synchronizes).
- Outputs: views of the step's own buffers; a buffer still referenced by the caller at the
  next (uncaptured) call is left to the caller and the kernel gets a new one, its address
  written like a moved input's (:mod:`fusec.runtime.outputs`): no output is overwritten while
  held, as in eager.
- ``graph_launch`` (option ``mode`` "reduce-overhead" / "max-autotune"): the step records a
  CUDA graph of its own single launch at its first call outside a capture and replays it with
  ``cuGraphLaunch``. Its kernel node's parameters point to device arrays allocated once here
  (instruction words, counters, the pointer table ``bufs``...), never reallocated, so the graph
  stays valid when an input moves: the call rewrites ``bufs`` before the replay as above. If the
  graph cannot be instantiated the step logs one warning and launches directly.
"""
from __future__ import annotations

import ctypes
import logging
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from fusec.abi import PROF_MARKS, ST_HEAD, WD_HEAD, WD_REC, WORD, Prof, Status, kernel_params
from fusec.cuda.codegen import LEN_PREFIX, KernelPlan
from fusec.errors import CudaError, FusecError, KernelRecordError
from fusec.ir import Graph, Role
from fusec.cuda.jit import CompiledKernel
from fusec.runtime import driver as cu
from fusec.runtime.outputs import StepOutputs
from fusec.runtime.status import status_error

log = logging.getLogger("fusec.runtime.cuda_step")

#: the step inputs' addresses compared with the last call's (:meth:`CudaStep._unmoved`): torch's
#: C++ comparison where the build has it (CUDA builds: its CUDA-graph trees use it), else mapped
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
_DATA_PTR = torch.Tensor.data_ptr


def _refs(objs: Sequence[Any]) -> list[Any] | None:
    """Weak references to ``objs`` (None if one cannot have any: no fast check then)."""
    try:
        return [weakref.ref(o) for o in objs]
    except TypeError:
        return None


#: index in the launch's parameter array of the pointer table (a captured launch passes its own)
_BUFS_PARAM = [p.name for p in kernel_params(False)].index("bufs_g")


class CudaStep:
    """A loaded megakernel and its device state (instruction words, counters, buffers).

    Args:
        g: the scheduled graph; plan: :func:`fusec.cuda.codegen.render` output; kernel: its CUBIN.
        flat_args: the first call's inputs (they fix the device and the input layouts).
        watchdog_s: seconds a counter wait may spin before the kernel gives up.
        check_watchdog: read the host-mapped status at every call (no sync) and raise what an
            earlier step recorded; off, only :meth:`raise_if_watchdog` reports.
        graph_launch: replay the launch from a CUDA graph recorded at the first call.
    """

    def __init__(self, g: Graph, plan: KernelPlan, kernel: CompiledKernel, flat_args: list[Any],
                 watchdog_s: float = 2.0, check_watchdog: bool = True, graph_launch: bool = False):
        drv = cu.driver()
        self.g, self.plan = g, plan
        self.check_watchdog = check_watchdog
        self.graph_launch = graph_launch
        dev = next(a.device for a in flat_args if isinstance(a, torch.Tensor) and a.is_cuda)
        self.device = dev
        torch.cuda.set_device(dev)
        torch.cuda.current_stream(dev)  # make torch's primary context current
        cu.check(drv.cuInit(0), "cuInit")
        self._owned = cu.Owned(cu.check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent"))
        weakref.finalize(self, self._owned.release)
        self.module = cu.check(drv.cuModuleLoadData(kernel.cubin), "cuModuleLoadData")
        self.func = cu.check(drv.cuModuleGetFunction(self.module, b"fusec_step"), "cuModuleGetFunction")
        cu.check(drv.cuFuncSetAttribute(self.func,
                                   drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                   plan.smem_bytes), "cuFuncSetAttribute(max dynamic shared memory)")
        per_sm = cu.check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.func, plan.threads, plan.smem_bytes),
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
        # device status: the index-fault word (int64 [0], taken by the kernel's atomicCAS; 3
        # spare), then the watchdog wd (int32: WD_HEAD words, [0] the abort flag the spin polls,
        # then one record per SM); their records are reported to the host-mapped status when they fire
        n_wd = WD_HEAD + WD_REC * plan.num_sms
        self.status = torch.zeros(4 + (n_wd + 1) // 2, dtype=torch.int64, device=dev)
        self.fault = self.status[:4]
        self.wd = self.status[4:].view(torch.int32)
        # host-mapped status (page-locked, read without a sync): ST_HEAD int64, then WD_REC int32 per SM
        self._status_bytes = 8 * ST_HEAD + 4 * WD_REC * plan.num_sms
        host = self._host_alloc(self._status_bytes, drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE)
        ctypes.memset(host, 0, self._status_bytes)
        self._status_host = host
        self._head = (ctypes.c_int64 * ST_HEAD).from_address(host)
        self._recs = (ctypes.c_int32 * (WD_REC * plan.num_sms)).from_address(host + 8 * ST_HEAD)
        status_dev = int(cu.check(drv.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
        self.input_pos = {name: g.inputs.index(name) for name in plan.buffers if name in g.inputs}
        self.slot = {name: k for k, name in enumerate(plan.buffers)}
        self.owned: dict[str, torch.Tensor] = {}
        for name in plan.buffers:
            if name in self.input_pos or name.startswith(LEN_PREFIX):   # (a length slot: no tensor)
                continue
            info = g.tensors[name]
            if info.role == Role.CONSTANT:
                self.owned[name] = info.value.to(dev).contiguous()
            else:
                fill = float("nan") if info.dtype.is_floating_point else -7
                self.owned[name] = torch.full(info.shape, fill, dtype=info.dtype, device=dev)
        # the pointer table: ptrs mirrors what the device table `bufs` holds once the stream
        # reaches the last call's writes; seen[i]: input i's data pointer at the last call
        self.ptrs = [0] * len(plan.buffers)
        self.seen: list[int | None] = [None] * len(g.inputs)
        for k, name in enumerate(plan.buffers):
            if name in self.owned:
                self.ptrs[k] = self.owned[name].data_ptr()
        # read-only inputs (token ids, masks) get an aligned buffer of their own, allocated now
        # (outside any capture); a call that passes one as a non-contiguous or unaligned view
        # copies it there (stream-ordered) instead of failing the guard
        written = {t for op in g.ops for s_, t in op.outputs.items() if s_ in op.mutates}
        self._staging = {name: torch.empty(g.tensors[name].shape, dtype=g.tensors[name].dtype, device=dev)
                         for name in self.input_pos
                         if g.tensors[name].role == Role.INPUT and name not in written}
        self._told_staging = False
        self._init_lengths()
        for name, i in self.input_pos.items():
            self.ptrs[self.slot[name]] = self._input_ptr(name, flat_args[i])
            self.seen[i] = flat_args[i].data_ptr()
        for k, n in self._lengths(flat_args).items():
            self.ptrs[k] = n
        for i in self._sizes:
            self._sizes[i] = flat_args[i].shape
        self._init_unmoved(flat_args)
        self.bufs = torch.tensor(self.ptrs, dtype=torch.int64, device=dev)   # never reallocated
        self._bufs_addr = self.bufs.data_ptr()
        # captured launches: device pointer tables, one per distinct set of pointers (filled
        # once from a page-locked staging table by a copy on the side stream, then frozen and
        # shared by every captured launch with those pointers); unused ones in _tables
        self._table_bytes = 8 * len(self.ptrs)
        self._tables: list[int] = []
        self._frozen: dict[tuple[int, ...], int] = {}
        self._frozen_bufs: list[dict[str, torch.Tensor]] = []
        self._grow_tables(4)
        self._stage = self._host_alloc(self._table_bytes, drv.CU_MEMHOSTALLOC_PORTABLE)
        self._side = cu.check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self._owned.streams.append(self._side)
        # the launch's parameter values, by the kernel's parameter names (fusec.abi.PARAMS)
        vals = {name: ctypes.c_void_p(t.data_ptr()) for name, t in
                (("instrs", self.words), ("queue_off", self.queue_off), ("waits_g", self.waits),
                 ("counters", self.counters), ("epochs", self.epochs), ("bufs_g", self.bufs), ("wd", self.wd))}
        vals["timeout_ns"] = ctypes.c_ulonglong(int(watchdog_s * 1e9))
        for sym_name, value in ((b"fusec_fault", self.fault.data_ptr()), (b"fusec_status", status_dev)):
            sym, _ = cu.check(drv.cuModuleGetGlobal(self.module, sym_name), f"cuModuleGetGlobal({sym_name.decode()})")
            addr = ctypes.c_uint64(value)   # the kernel's status pointers, set once
            cu.check(drv.cuMemcpyHtoD(sym, ctypes.addressof(addr), 8), f"cuMemcpyHtoD({sym_name.decode()})")
        self.prof: torch.Tensor | None = None
        if plan.profile:   # (SM, fetched, waits satisfied, done, marks...) per instruction, globaltimer ns
            self.prof = torch.zeros(len(plan.words) // WORD, len(Prof) + PROF_MARKS, dtype=torch.int64, device=dev)
            vals["prof"] = ctypes.c_void_p(self.prof.data_ptr())
        self._vals = [vals[p.name] for p in kernel_params(plan.profile)]
        self._params = self._param_array(self._vals)
        self._graph: Any = None          # the instantiated graph of one launch (graph_launch)
        self._graph_tried = False
        # the outputs: views of the step's buffers, a buffer still referenced at the next launch
        # handed over to its holder (fusec.runtime.outputs)
        self.outputs = StepOutputs(g, self.owned, g.inputs)

    @staticmethod
    def _param_array(vals: list[Any]) -> Any:
        return (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])

    def _host_alloc(self, nbytes: int, flags: int) -> int:
        host = int(cu.check(cu.driver().cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc"))
        self._owned.host.append(host)
        return host

    def _grow_tables(self, n: int) -> None:
        """n more device pointer tables for captured launches."""
        dev = int(cu.check(cu.driver().cuMemAlloc(n * self._table_bytes), "cuMemAlloc(pointer tables)"))
        self._owned.dev.append(dev)
        self._tables += [dev + k * self._table_bytes for k in reversed(range(n))]

    def _write_ptr(self, k: int, p: int, stream: Any) -> None:
        """bufs[k] = p, stream-ordered: a 4-byte memset per changed half (capturable, no staging)."""
        drv = cu.driver()
        old, addr = self.ptrs[k], self._bufs_addr + 8 * k
        self.ptrs[k] = p
        for half in (0, 1):
            v = (p >> (32 * half)) & 0xFFFFFFFF
            if v != (old >> (32 * half)) & 0xFFFFFFFF:
                cu.check(drv.cuMemsetD32Async(addr + 4 * half, v, 1, stream), "cuMemsetD32Async(pointer table)")

    def _init_lengths(self) -> None:
        """The run-time lengths' bookkeeping: the length slots (symbol -> index in ``bufs``) and
        the inputs with symbolic dims (input index -> name, its (dim, symbol) pairs), whose
        sizes ``_sizes`` holds as of the last call (None: not yet seen)."""
        self._len_slot = {name[len(LEN_PREFIX):]: k for k, name in enumerate(self.plan.buffers)
                          if name.startswith(LEN_PREFIX)}
        self._sym_in: dict[int, tuple[str, tuple[tuple[int, str], ...]]] = {
            i: (name, tuple(sorted(self.g.tensors[name].sym.items())))
            for name, i in self.input_pos.items() if self.g.tensors[name].sym}
        self._sizes: dict[int, Any] = {i: None for i in self._sym_in}

    def _lengths(self, args: Sequence[Any]) -> dict[int, int]:
        """Length slot -> the run-time length of its symbol in this call's ``args`` (the size at
        the symbolic dims of the inputs, which must agree; an input's shape is checked by
        :meth:`_guard`). Raises :class:`FusecError` naming two inputs that disagree."""
        got: dict[str, tuple[int, str]] = {}
        for i, (name, dims) in self._sym_in.items():
            shape = args[i].shape
            for dim, sym in dims:
                n = int(shape[dim])
                if sym not in got:
                    got[sym] = (n, name)
                elif got[sym][0] != n:
                    raise FusecError(f"run-time length {sym}: input {got[sym][1]} has {got[sym][0]} rows (at its "
                                     f"dim of {sym}), input {name} has {n}; the KV caches (and a mask over them) "
                                     f"of one call must have one length")
        return {k: got[sym][0] if sym in got else self.g.lengths[sym] for sym, k in self._len_slot.items()}

    def _init_unmoved(self, flat_args: Sequence[Any] | None = None) -> None:
        """The inputs :meth:`_unmoved` compares at once: all but those with a staging buffer
        (token ids, masks, positions: few, checked one by one); ``flat_args``: the inputs the
        table holds now (None: the first call takes the full check)."""
        idx = [i for name, i in self.input_pos.items() if name not in self._staging]
        self._fast_get = (operator.itemgetter(*idx) if len(idx) > 1 else
                          (lambda a: (a[idx[0]],)) if idx else (lambda a: ()))
        self._fast_idx = idx
        self._fast_sym = [i for i in idx if i in self._sym_in]
        self._rest = [(name, i) for name, i in self.input_pos.items() if name in self._staging]
        self._fast_seen = [self.seen[i] for i in idx]
        self._fast_all = list(range(len(idx)))
        # weak references to the input objects of the last call whose table update completed
        # (None: the next call takes the full check; a call that raised may have written some
        # entries). Weak: a step kept on the model must not keep the last call's KV cache alive;
        # not ids: a new view made at a freed one's id and address must be checked
        self._fast_refs: list[Any] | None = None if flat_args is None else _refs(self._fast_get(flat_args))

    def _unmoved(self, args: Sequence[Any]) -> bool:
        """Whether every input without a staging buffer is the same tensor object as at the
        last call, at the same address, with the same run-time lengths: then none of their
        table entries changes (the weights and KV caches of a decode loop, about 200 inputs for
        a 16-layer model: their addresses compared in C; one by one in Python the checks cost
        about 0.2 ms per call).
        A parameter rebound through ``.data`` keeps its object and moves its address: seen
        here. A new object (a view at the same address) takes the full check; an in-place
        change of an object's strides (``transpose_``) at the same address is not seen."""
        sub, refs = self._fast_get(args), self._fast_refs
        if refs is None or len(refs) != len(sub) or any(r() is not t for r, t in zip(refs, sub)):
            return False
        if _PTRS_EQUAL is not None:
            if not _PTRS_EQUAL(list(sub), self._fast_seen, self._fast_all):
                return False
        elif list(map(_DATA_PTR, sub)) != self._fast_seen:
            return False
        sizes = self._sizes
        return all(args[i].shape == sizes[i] for i in self._fast_sym)

    def _update_inputs(self, args: Sequence[Any], stream: Any) -> None:
        if self._unmoved(args):
            self._update_each(args, stream, self._rest)
            return
        self._fast_refs = None
        self._update_each(args, stream, self.input_pos.items())
        self._fast_seen = [self.seen[i] for i in self._fast_idx]
        self._fast_refs = _refs(self._fast_get(args))

    def _update_each(self, args: Sequence[Any], stream: Any, inputs: Any) -> None:
        """Input by input (``(name, index)`` pairs): a moved, restrided, resized or staged
        input's table entry, and the length slots when a run-time length changed."""
        resized = False
        for name, i in inputs:
            a = args[i]
            p = a.data_ptr() if isinstance(a, torch.Tensor) else None
            buf = self._staging.get(name)
            staged = buf is not None and self.ptrs[self.slot[name]] == buf.data_ptr()   # copied at every call
            sym = i in self._sym_in
            if sym and p is not None and a.shape != self._sizes[i]:
                resized = True   # another length, maybe at the same address (the caching allocator)
            elif p is not None and p == self.seen[i] and not staged and a.is_contiguous():
                continue   # (a strided view at the last call's address is checked, or staged, below)
            ptr = self._input_ptr(name, a)
            if p != self.seen[i]:
                log.debug("input %s moved: %#x -> %#x", name, self.seen[i] or 0, p)
            self.seen[i] = p
            if sym:
                self._sizes[i] = a.shape
            if ptr != self.ptrs[self.slot[name]]:
                self._write_ptr(self.slot[name], ptr, stream)
        if resized:
            try:
                lengths = self._lengths(args)
            except FusecError:
                for i in self._sizes:   # compared again at the next call
                    self._sizes[i] = None
                raise
            for k, n in lengths.items():
                if n != self.ptrs[k]:
                    self._write_ptr(k, n, stream)

    def _input_ptr(self, name: str, a: Any) -> int:
        """The device address the kernel reads input ``name`` from at this call: ``a``'s own
        address, or, for a read-only input passed as a
        non-contiguous or non-16-byte-aligned view (a token id sliced out of a longer tensor,
        ``ids[:, -1:]``), that of the input's staging buffer, into which ``a`` is copied on
        torch's current stream (capturable; one small copy per call). Raises
        :class:`FusecError` (:meth:`_guard`) for a wrong device, dtype or shape, and for a
        misaligned input that the kernel writes."""
        buf = self._staging.get(name)
        if buf is None or not isinstance(a, torch.Tensor) or (a.is_contiguous() and a.data_ptr() % 16 == 0):
            self._guard(name, a)
            return a.data_ptr()
        self._guard(name, a, layout=False)
        if not self._told_staging:
            self._told_staging = True
            log.info("input %s is a view (strides %s, address %% 16 = %d): copied to an aligned buffer "
                     "at each call (pass a contiguous tensor to save that copy)",
                     name, a.stride(), a.data_ptr() % 16)
        # (an input of a run-time length fills the front of its buffer, sized for the capacity)
        (buf if buf.shape == a.shape else buf.view(-1)[:a.numel()].view(a.shape)).copy_(a)
        return buf.data_ptr()

    def _guard(self, name: str, a: Any, layout: bool = True) -> None:
        info = self.g.tensors[name]
        where = f"input {name} ({info.role.value})"
        if not isinstance(a, torch.Tensor):
            raise FusecError(f"{where}: expected a tensor, got {type(a).__name__}")
        if a.device != self.device:
            raise FusecError(f"{where}: on {a.device}, the kernel was built for {self.device}")
        if a.dtype != info.dtype or not self._shape_ok(info, a.shape):
            dims = [f"{info.sym[d]} in [1, {self.g.lengths.get(info.sym[d], n)}]" if d in info.sym else n
                    for d, n in enumerate(info.shape)]
            raise FusecError(f"{where}: {a.dtype}{list(a.shape)}, the kernel was built for "
                             f"{info.dtype}[{', '.join(map(str, dims))}]")
        if layout and not a.is_contiguous():
            raise FusecError(f"{where}: not contiguous (strides {list(a.stride())}); the kernel reads and writes "
                             f"it as one contiguous buffer: store it contiguous")
        if layout and a.data_ptr() % 16:
            raise FusecError(f"{where}: data pointer not 16-byte aligned")

    def _shape_ok(self, info: Any, shape: Sequence[int]) -> bool:
        """``shape`` is ``info``'s IR shape, but for a symbolic dim any size in [1, capacity]."""
        if not info.sym:
            return tuple(shape) == tuple(info.shape)
        return len(shape) == len(info.shape) and all(
            1 <= n <= self.g.lengths.get(info.sym[d], m) if d in info.sym else n == m
            for d, (n, m) in enumerate(zip(shape, info.shape)))

    def _launch(self, params: Any, stream: Any) -> None:
        cu.check(cu.driver().cuLaunchCooperativeKernel(self.func, self.plan.num_sms, 1, 1, self.plan.threads, 1, 1,
                                                self.plan.smem_bytes, stream, ctypes.addressof(params)),
            "cuLaunchCooperativeKernel")

    def _launch_captured(self, args: Sequence[Any], stream: Any) -> None:
        """The launch inside a capture, with a device pointer table that holds this call's
        pointers and is never written again (shared by the captured launches with the same
        pointers). A new one is written now, outside the graph (a copy on the side stream,
        waited for, in relaxed capture mode): the graph holds the kernel node (after the copy
        of an input passed as an unaligned view, :meth:`_input_ptr`) and bakes the tensors seen
        at capture time."""
        drv = cu.driver()
        ptrs = list(self.ptrs)
        for name, i in self.input_pos.items():
            ptrs[self.slot[name]] = self._input_ptr(name, args[i])
        for k, n in self._lengths(args).items():   # this call's lengths, frozen with its pointers
            ptrs[k] = n
        key = tuple(ptrs)
        dev = self._frozen.get(key)
        if dev is None:
            with cu.RelaxedCapture():
                if not self._tables:
                    self._grow_tables(2 * len(self._owned.dev) + 2)
                dev = self._tables.pop()
                (ctypes.c_uint64 * len(ptrs)).from_address(self._stage)[:] = ptrs
                cu.check(drv.cuMemcpyHtoDAsync(dev, self._stage, self._table_bytes, self._side),
                    "cuMemcpyHtoDAsync(pointer table)")
                cu.check(drv.cuStreamSynchronize(self._side), "cuStreamSynchronize(side stream)")
            self._frozen[key] = dev
            # the buffers this table points to live as long as the step (a graph replays into
            # them), even one the eager calls later hand over to a caller (fusec.runtime.outputs)
            self._frozen_bufs.append(dict(self.owned))
        vals = list(self._vals)
        vals[_BUFS_PARAM] = ctypes.c_void_p(dev)
        self._launch(self._param_array(vals), stream)

    def _record_graph(self) -> None:
        """Record and instantiate a graph of one launch (stream capture on a side stream); on
        failure log one line and keep launching directly."""
        drv = cu.driver()
        self._graph_tried = True
        side, graph = self._side, None
        try:
            cu.check(drv.cuStreamBeginCapture(side, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                "cuStreamBeginCapture")
            launched = drv.cuLaunchCooperativeKernel(self.func, self.plan.num_sms, 1, 1, self.plan.threads, 1, 1,
                                                     self.plan.smem_bytes, side, ctypes.addressof(self._params))
            graph = cu.check(drv.cuStreamEndCapture(side), "cuStreamEndCapture")
            cu.check(launched, "cuLaunchCooperativeKernel (captured)")
            self._graph = cu.check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
            self._owned.graphs.append(self._graph)
        except CudaError as e:
            self._graph = None
            log.warning("fusec: CUDA graph of the step's launch not instantiated (%s): launching directly", e)
        finally:
            if graph is not None:
                drv.cuGraphDestroy(graph)

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        drv = cu.driver()
        stream = drv.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        capturing = cu.check(drv.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
        if capturing != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
            self._launch_captured(args, stream)
        else:
            if self.check_watchdog and self._head[Status.ANY]:
                self._raise_recorded()        # an earlier step recorded a fault: the error path
            self._update_inputs(args, stream)
            for name, p in self.outputs.before_launch():
                self._write_ptr(self.slot[name], p, stream)
            if self.graph_launch and not self._graph_tried:
                self._record_graph()
            if self._graph is not None:
                cu.check(drv.cuGraphLaunch(self._graph, stream), "cuGraphLaunch")
            else:
                self._launch(self._params, stream)
        return self.outputs.views(args)

    def profile_records(self) -> torch.Tensor:
        """The last step's per-instruction records, int64 [instructions, len(Prof) + PROF_MARKS]
        on the CPU: (SM, fetched, waits satisfied, done: :class:`fusec.abi.Prof`, then the
        template's FUSEC_MARK timestamps, 0 where not taken) in %globaltimer ns (synchronizes).

        Raises:
            FusecError: the kernel was built without ``profile``.
        """
        if self.prof is None:
            raise FusecError("this kernel was built without profile=True: no timeline recorded")
        return self.prof.cpu()

    def recorded_error(self) -> KernelRecordError | None:
        """The error the host-mapped status records now, or None (reads memory only: no sync,
        so a step still running may record later)."""
        n = self.plan.num_sms
        recs = [self._recs[WD_REC * k:WD_REC * (k + 1)] for k in range(n)]
        return status_error(list(self._head), recs, self._op_name)

    def _op_name(self, op: int) -> str:
        return self.g.ops[op].name if 0 <= op < len(self.g.ops) else "?"

    def raise_if_watchdog(self) -> None:
        """The explicit, synchronizing check: wait for the device, then raise what the steps
        recorded: WatchdogError if a counter wait timed out (after resetting counters, epochs
        and the records), IndexFaultError if a run-time token id or position was out of range:
        its access was skipped, so that step's outputs (and a KV row it may have written) are
        invalid, and the record is cleared."""
        self._raise_recorded()

    def _raise_recorded(self) -> None:
        torch.cuda.synchronize(self.device)     # every step launched so far has written its records
        err = self.recorded_error()
        if self._head[Status.WATCHDOG]:
            self.reset()
        elif self._head[Status.ANY]:
            self.fault.zero_()
            ctypes.memset(self._status_host, 0, 8 * ST_HEAD)
        if err is not None:
            raise err

    def reset(self) -> None:
        """Zero counters, epochs, the watchdog and the index-fault records (after an aborted
        step; synchronizes)."""
        torch.cuda.synchronize(self.device)
        self.counters.zero_()
        self.epochs.zero_()
        self.status.zero_()
        ctypes.memset(self._status_host, 0, self._status_bytes)
