"""The runtime's host side without a GPU: the kernel's host-mapped status compiles (NVRTC), the
status records decode into the right errors, and CudaStep's launch path (status check, pointer
table writes, captured launches, the graph of one launch) against a fake driver."""
from __future__ import annotations

import ctypes
import logging
import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fusec.runtime import cuda_step as runtime
from fusec.runtime import driver as cu
from fusec.errors import FusecError, IndexFaultError, WatchdogError
from fusec.abi import ST_HEAD, Status
from fusec.runtime.cuda_step import CudaStep
from fusec.runtime.outputs import StepOutputs
from fusec.runtime.status import status_error

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama.py"


# ---- the kernel source ----

@pytest.fixture(scope="module")
def tiny_schedule():
    from fusec.api import compile_model
    model, args, kwargs = runpy.run_path(str(EXAMPLE))["build"]()
    return compile_model(model, args, kwargs, {"num_sms": 12}).schedule


@pytest.mark.parametrize("profile", [False, True])
def test_kernel_with_host_status_compiles_without_spills(tiny_schedule, profile, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    plan = render(tiny_schedule, profile=profile)
    src = plan.source
    # the layout the host decodes (fusec.abi.Status) is the one the kernel writes
    assert "__device__ long long* fusec_status;" in src

    def body(fn):
        i = src.index(f"void {fn}(")
        return src[i:src.index("\n}\n", i)]
    fault, wait = body("fusec_report_fault"), body("fusec_report_wait")
    for k, name in ((Status.CODE, "code"), (Status.VALUE, "v"), (Status.BOUND, "bound")):
        assert f"s[FUSEC_ST_{k.name}] = {name};" in fault
    for text, flag in ((fault, Status.FAULT), (wait, Status.WATCHDOG)):   # record, fence, then the flags
        assert (text.index("__threadfence_system();") < text.index(f"s[FUSEC_ST_{flag.name}] = 1;")
                < text.index("s[FUSEC_ST_ANY] = 1;"))
    assert "fusec_status + FUSEC_ST_HEAD) + FUSEC_WD_REC * sm" in wait
    assert "fusec_report_fault(code, v, bound)" in src and "fusec_report_wait(blockIdx.x, q, in.op" in src
    # the spin polls the abort flag in device memory, never the host-mapped status
    spin = src[src.index("while ((int)(v - target) < 0)"):src.index("__nanosleep(FUSEC_POLL_SLEEP)")]
    assert "*(volatile int*)wd" in spin
    k = compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path))
    k.assert_no_spills()
    assert k.resources["fusec_step"]["stack_frame_bytes"] == 0
    assert b"fusec_status" in k.cubin and b"fusec_fault" in k.cubin   # globals the runtime sets


# ---- decoding ----

def _head(**words):
    h = [0] * ST_HEAD
    for k, v in words.items():
        h[Status[k.upper()]] = v
    return h


def _rec(sm, q, op, counter, value, target, instr, claimed=1):
    return [claimed, sm, q, op, counter, value, target, instr]


def _names(op):
    return f"op{op}"


def test_nothing_recorded_is_none():
    assert status_error(_head(), [[0] * 8] * 4, _names) is None


def test_fault_record_decodes_to_index_fault():
    e = status_error(_head(any=1, fault=1, code=1, value=303, bound=300), [[0] * 8] * 4, _names)
    assert isinstance(e, IndexFaultError)
    assert (e.code, e.value, e.bound) == (1, 303, 300)
    assert e.fields == {"code": 1, "value": 303, "bound": 300}
    assert "token id" in str(e) and "303" in str(e) and "[0, 300)" in str(e)
    e = status_error(_head(any=1, fault=1, code=9, value=-1, bound=8), [], _names)
    assert "index (code 9)" in str(e)


def test_watchdog_record_names_the_root_cause_of_the_firing_step():
    recs = [_rec(0, 10, 7, 40, 1, 5, 90),
            _rec(1, 3, 2, 12, 4, 5, 31),       # the root cause: smallest instruction of step 5
            [0] * 8,                            # an SM that recorded nothing
            _rec(3, 0, 1, 2, 5, 6, 4),          # a later step (target 6) queued before the host noticed
            _rec(4, 8, 9, 50, 4, 5, 77)]
    e = status_error(_head(any=1, watchdog=1), recs, _names)
    assert isinstance(e, WatchdogError)
    assert e.fields == {"sm": 1, "queue_index": 3, "op": 2, "counter": 12, "value": 4, "target": 5,
                        "instruction": 31, "op_name": "op2", "stuck_sms": 3}
    assert e.sm == 1 and e.instruction == 31 and e.op_name == "op2"
    assert "watchdog" in str(e) and "SM 1 queue[3] op 2 (op2)" in str(e) and "3 SMs stuck" in str(e)


def test_watchdog_wins_over_a_fault_and_may_record_nothing():
    e = status_error(_head(any=1, watchdog=1, fault=1, code=1, value=5, bound=4), [[0] * 8], _names)
    assert isinstance(e, WatchdogError) and e.fields == {}
    assert "recorded no wait" in str(e)


# ---- CudaStep's launch path on a fake driver ----

class FakeDriver:
    """The few driver calls CudaStep.__call__ makes, recorded in ``calls``."""

    class CUresult:
        CUDA_SUCCESS = 0

    CUstreamCaptureStatus = SimpleNamespace(CU_STREAM_CAPTURE_STATUS_NONE=0, CU_STREAM_CAPTURE_STATUS_ACTIVE=1)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1, CU_STREAM_CAPTURE_MODE_RELAXED=2)

    def __init__(self):
        self.calls = []
        self.capturing = 0
        self.instantiate_fails = False
        self.mode = 0          # this thread's capture mode (0: global)
        self.next_alloc = 0xE000

    def CUstream(self, handle):
        return ("stream", handle)

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_FAKE"

    def cuStreamIsCapturing(self, stream):
        return 0, self.capturing

    def cuMemsetD32Async(self, addr, value, n, stream):
        self.calls.append(("memset", addr, value, n))
        return (0,)

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        self.calls.append(("memcpy", dst, src, nbytes, stream, self.mode))
        return (0,)

    def cuStreamSynchronize(self, stream):
        self.calls.append(("stream_sync", stream, self.mode))
        return (0,)

    def cuThreadExchangeStreamCaptureMode(self, mode):
        prev, self.mode = self.mode, mode
        return 0, prev

    def cuMemAlloc(self, nbytes):
        self.calls.append(("alloc", nbytes, self.mode))
        self.next_alloc += 0x1000
        return 0, self.next_alloc

    def cuLaunchCooperativeKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, params):
        bufs = ctypes.c_void_p.from_address(ctypes.c_void_p.from_address(params + 5 * 8).value).value
        self.calls.append(("launch", stream, bufs))
        return (0,)

    def cuStreamCreate(self, flags):
        return 0, "side"

    def cuStreamBeginCapture(self, stream, mode):
        self.calls.append(("begin_capture", stream))
        return (0,)

    def cuStreamEndCapture(self, stream):
        self.calls.append(("end_capture", stream))
        return 0, "graph"

    def cuGraphInstantiate(self, graph, flags):
        return (1, None) if self.instantiate_fails else (0, "exec")

    def cuGraphDestroy(self, graph):
        return (0,)

    def cuStreamDestroy(self, stream):
        return (0,)

    def cuGraphLaunch(self, exec_, stream):
        self.calls.append(("graph_launch", exec_))
        return (0,)


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(cu, "driver", lambda: drv)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: drv.calls.append(("sync",)))
    return drv


BUFS_ADDR = 0x7F00_0000_0000


def _step(n_sms=4, check_watchdog=True, graph_launch=False, staging_a=False):
    """A CudaStep with two inputs (slots 1 and 2 of 3) on the CPU, its memory on the host;
    ``staging_a``: input ``a`` is read-only and has a staging buffer, as ``__init__`` gives
    token ids."""
    step = CudaStep.__new__(CudaStep)
    info = SimpleNamespace(dtype=torch.float32, shape=(4,), role=SimpleNamespace(value="input"), sym={})
    step.g = SimpleNamespace(tensors={"a": info, "b": info}, inputs=["a", "b"], outputs=[], ops=[], lengths={})
    step.plan = SimpleNamespace(num_sms=n_sms, threads=128, smem_bytes=0, profile=False, buffers=["w", "a", "b"])
    step.device = torch.device("cpu")
    step.check_watchdog, step.graph_launch = check_watchdog, graph_launch
    step.func = "func"
    step.input_pos, step.slot = {"a": 0, "b": 1}, {"w": 0, "a": 1, "b": 2}
    step.ptrs, step.seen = [0x1000, 0, 0], [None, None]
    step._bufs_addr, step._table_bytes = BUFS_ADDR, 3 * 8
    step.counters, step.epochs, step.status = torch.ones(5), torch.ones(n_sms), torch.ones(6, dtype=torch.int64)
    step.fault = step.status[:4]
    step._status_bytes = 8 * ST_HEAD + 32 * n_sms
    step._mem = ctypes.create_string_buffer(step._status_bytes)     # the "host-mapped" status
    step._status_host = ctypes.addressof(step._mem)
    step._head = (ctypes.c_int64 * ST_HEAD).from_address(step._status_host)
    step._recs = (ctypes.c_int32 * (8 * n_sms)).from_address(step._status_host + 8 * ST_HEAD)
    step._vals = [ctypes.c_void_p(k + 1) for k in range(5)] + [ctypes.c_void_p(BUFS_ADDR), ctypes.c_void_p(9),
                                                               ctypes.c_ulonglong(10)]
    step._params = CudaStep._param_array(step._vals)
    step._stage_mem = ctypes.create_string_buffer(3 * 8)
    step._stage = ctypes.addressof(step._stage_mem)
    step._tables = [0xD100, 0xD000]
    step._frozen, step._frozen_bufs = {}, []
    step._side = "side"
    step._owned = SimpleNamespace(graphs=[], dev=[0xD000], host=[], streams=["side"])
    step._graph, step._graph_tried = None, False
    step.owned = {}
    step.outputs = StepOutputs(step.g, step.owned, step.g.inputs)
    step._staging = {"a": torch.empty(4)} if staging_a else {}
    step._told_staging = False
    step._init_lengths()
    step._init_unmoved()
    a, b = torch.zeros(4), torch.zeros(4)
    step._update_inputs([a, b], ("stream", 7))   # the first call's table
    return step, a, b


def _split(p):
    return p & 0xFFFFFFFF, p >> 32


def test_first_table_write_and_unchanged_pointers(fake):
    step, a, b = _step()
    assert step.ptrs == [0x1000, a.data_ptr(), b.data_ptr()]
    fake.calls.clear()
    step(a, b)
    assert fake.calls == [("launch", ("stream", 7), BUFS_ADDR)]   # nothing else: no copy, no sync


def test_moved_input_writes_its_changed_halves_before_the_launch(fake):
    step, a, b = _step()
    fake.calls.clear()
    a2 = torch.zeros(4)
    step(a2, b)
    old, new = _split(a.data_ptr()), _split(a2.data_ptr())
    expect = [("memset", BUFS_ADDR + 8 + 4 * h, new[h], 1) for h in (0, 1) if new[h] != old[h]]
    assert expect and fake.calls == expect + [("launch", ("stream", 7), BUFS_ADDR)]
    assert step.ptrs[1] == a2.data_ptr() and step.seen == [a2.data_ptr(), b.data_ptr()]
    step._write_ptr(2, (0x1234 << 32) | 0x5678, ("stream", 7))   # both halves change
    assert fake.calls[-2:] == [("memset", BUFS_ADDR + 16, 0x5678, 1), ("memset", BUFS_ADDR + 20, 0x1234, 1)]
    with pytest.raises(runtime.FusecError, match="input b"):
        step(a2, torch.zeros(5))


def test_recorded_fault_raises_at_the_next_call_instead_of_launching(fake):
    step, a, b = _step()
    fake.calls.clear()
    step._head[Status.CODE], step._head[Status.VALUE], step._head[Status.BOUND] = 1, 305, 300   # as index_ok writes it
    step._head[Status.FAULT] = step._head[Status.ANY] = 1
    with pytest.raises(IndexFaultError) as e:
        step(a, b)
    assert (e.value.code, e.value.value, e.value.bound) == (1, 305, 300)
    assert fake.calls == [("sync",)]                        # the error path waits; no launch
    assert list(step._head) == [0] * ST_HEAD and not step.fault.any()
    assert step.counters.all()                              # a fault does not reset the counters
    fake.calls.clear()
    step(a, b)
    assert fake.calls == [("launch", ("stream", 7), BUFS_ADDR)]


def test_recorded_watchdog_raises_and_resets(fake):
    step, a, b = _step()
    step._recs[8:16] = _rec(1, 3, 0, 12, 4, 2, 31)
    step._head[Status.WATCHDOG] = step._head[Status.ANY] = 1
    with pytest.raises(WatchdogError) as e:
        step(a, b)
    assert e.value.fields["counter"] == 12 and e.value.fields["target"] == 2 and e.value.stuck_sms == 1
    assert e.value.op_name == "?"
    assert not step.counters.any() and not step.epochs.any() and not step.status.any()
    assert not any(bytes(step._mem))


def test_check_watchdog_off_launches_and_raise_if_watchdog_reports(fake):
    step, a, b = _step(check_watchdog=False)
    step._head[Status.CODE], step._head[Status.VALUE], step._head[Status.BOUND] = 4, 64, 64
    step._head[Status.FAULT] = step._head[Status.ANY] = 1
    fake.calls.clear()
    step(a, b)
    assert fake.calls == [("launch", ("stream", 7), BUFS_ADDR)]
    with pytest.raises(IndexFaultError, match="KV-cache write position 64"):
        step.raise_if_watchdog()
    step.raise_if_watchdog()      # cleared


def test_captured_launch_uses_a_private_table_written_outside_the_graph(fake):
    step, a, b = _step()
    step._head[Status.ANY] = step._head[Status.FAULT] = 1    # not looked at during a capture (no sync possible)
    fake.calls.clear()
    fake.capturing = 1
    a2 = torch.zeros(4)
    step(a2, b)
    relaxed = FakeDriver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    # the table: copied and waited for on the side stream in relaxed mode; then the kernel alone
    # on the capturing stream, reading it
    assert fake.calls == [("memcpy", 0xD000, step._stage, 24, "side", relaxed), ("stream_sync", "side", relaxed),
                          ("launch", ("stream", 7), 0xD000)]
    assert fake.mode == 0                             # the capture mode is restored
    assert list((ctypes.c_uint64 * 3).from_address(step._stage)) == [0x1000, a2.data_ptr(), b.data_ptr()]
    assert step.ptrs[1] == a.data_ptr() and step.seen[0] == a.data_ptr()   # the eager table is untouched
    fake.calls.clear()
    step(a2, b)                                       # the same pointers again: the same frozen table
    assert fake.calls == [("launch", ("stream", 7), 0xD000)]
    fake.calls.clear()
    b2 = torch.zeros(4)
    step(a2, b2)                                      # other pointers: another table
    assert fake.calls[0][1] == 0xD100 and fake.calls[-1] == ("launch", ("stream", 7), 0xD100)
    fake.calls.clear()
    step(a, b2)                                       # none left: more are allocated, in relaxed mode
    assert fake.calls[0] == ("alloc", 4 * 24, relaxed)
    assert fake.calls[-1] == ("launch", ("stream", 7), fake.next_alloc) and len(step._tables) == 3
    fake.capturing = 0
    fake.calls.clear()
    with pytest.raises(IndexFaultError):              # outside the capture, the status is read again
        step(a, b)
    assert fake.calls == [("sync",)]


def test_graph_launch_records_one_graph_and_replays_it(fake):
    step, a, b = _step(graph_launch=True)
    fake.calls.clear()
    step(a, b)
    assert fake.calls == [("begin_capture", "side"), ("launch", "side", BUFS_ADDR), ("end_capture", "side"),
                          ("graph_launch", "exec")]
    assert step._owned.graphs == ["exec"]
    fake.calls.clear()
    a2 = torch.zeros(4)
    step(a2, b)                        # a moved input: the table is rewritten, the graph replays
    assert [c[0] for c in fake.calls][-1] == "graph_launch" and fake.calls[0][0] == "memset"
    assert "begin_capture" not in [c[0] for c in fake.calls]


def test_graph_launch_falls_back_to_direct_launches_with_one_line(fake, caplog):
    fake.instantiate_fails = True
    step, a, b = _step(graph_launch=True)
    with caplog.at_level(logging.WARNING, logger="fusec.runtime.cuda_step"):
        step(a, b)
        step(a, b)
    assert len([r for r in caplog.records if "CUDA graph" in r.getMessage()]) == 1
    assert [c[0] for c in fake.calls][-1] == "launch" and step._graph is None


def _unaligned(vals):
    """A view 4 bytes into its storage (not 16-byte aligned)."""
    base = torch.zeros(len(vals) + 1)
    base[1:] = torch.tensor(vals, dtype=torch.float32)
    return base[1:]


def test_unaligned_view_of_a_read_only_input_is_copied_at_every_call(fake):
    """A read-only input passed as an unaligned view: the kernel reads the staging buffer, which
    holds the view's values at each call, even when the same view comes back with new values
    (no pointer write then); an aligned tensor points the table back at itself, and a view
    after it at the buffer again."""
    step, a, b = _step(staging_a=True)
    buf = step._staging["a"]
    v = _unaligned([1, 2, 3, 4])
    fake.calls.clear()
    step(v, b)
    lo, hi = _split(buf.data_ptr())
    assert fake.calls[:-1] == [("memset", BUFS_ADDR + 8, lo, 1)] + ([("memset", BUFS_ADDR + 12, hi, 1)]
                                                                    if hi != _split(a.data_ptr())[1] else [])
    assert step.ptrs[1] == buf.data_ptr() and torch.equal(buf, v)
    v.copy_(torch.tensor([5., 6, 7, 8]))
    fake.calls.clear()
    step(v, b)
    assert torch.equal(buf, v) and fake.calls == [("launch", ("stream", 7), BUFS_ADDR)]
    step(a, b)
    assert step.ptrs[1] == a.data_ptr()
    fake.calls.clear()
    step(a, b)
    assert fake.calls == [("launch", ("stream", 7), BUFS_ADDR)]
    step(v, b)
    assert step.ptrs[1] == buf.data_ptr()


def test_strided_view_at_the_last_address_is_not_read_as_contiguous(fake):
    """A non-contiguous view at the address of the last call's contiguous tensor: a read-only
    input is staged (its elements, not the storage's first ones); any other input raises."""
    step, a, b = _step(staging_a=True)
    base = torch.arange(8.)
    step(base[:4], b)
    v = base[::2]
    assert v.data_ptr() == base.data_ptr()
    step(v, b)
    assert step.ptrs[1] == step._staging["a"].data_ptr() and torch.equal(step._staging["a"], v)
    step(a, base[:4])
    with pytest.raises(FusecError, match="input b .*not contiguous"):
        step(a, base[::2])


def test_staged_view_in_a_capture_and_under_graph_launch(fake):
    """During a capture the frozen table holds the staging buffer (the eager table is left
    alone); with graph_launch the copy is queued before the graph's launch on the same stream."""
    step, a, b = _step(staging_a=True)
    v = _unaligned([1, 2, 3, 4])
    fake.capturing = 1
    step(v, b)
    assert list((ctypes.c_uint64 * 3).from_address(step._stage))[1] == step._staging["a"].data_ptr()
    assert step.ptrs[1] == a.data_ptr()
    fake.capturing = 0
    step, a, b = _step(graph_launch=True, staging_a=True)
    buf = step._staging["a"]
    copy = buf.copy_
    buf.copy_ = lambda x: (fake.calls.append(("copy",)), copy(x))[1]
    step(v, b)
    fake.calls.clear()
    v.copy_(torch.tensor([3., 3, 3, 3]))
    step(v, b)
    assert fake.calls == [("copy",), ("graph_launch", "exec")] and torch.equal(buf, v)


# ---- run-time lengths (a length-polymorphic kernel) on the fake driver ----

CAP = 8   # the capacity of the symbol s0


def _poly_step():
    """A CudaStep whose inputs are ``a`` (static) and two KV caches ``k``, ``v`` [1, 2, s0, 4]
    (s0 <= CAP), with a length slot for s0 (slot 4 of 5), built from a first call at 5 rows."""
    step = CudaStep.__new__(CudaStep)
    role = SimpleNamespace(value="kv_cache")
    cache = SimpleNamespace(dtype=torch.float32, shape=(1, 2, CAP, 4), role=role, sym={2: "s0"})
    plain = SimpleNamespace(dtype=torch.float32, shape=(4,), role=SimpleNamespace(value="input"), sym={})
    step.g = SimpleNamespace(tensors={"a": plain, "k": cache, "v": cache}, inputs=["a", "k", "v"], outputs=[],
                             ops=[], lengths={"s0": CAP})
    step.plan = SimpleNamespace(num_sms=4, threads=128, smem_bytes=0, profile=False,
                                buffers=["w", "a", "k", "v", "#len:s0"])
    step.device = torch.device("cpu")
    step.check_watchdog, step.graph_launch = True, False
    step.func = "func"
    step.input_pos, step.slot = {"a": 0, "k": 1, "v": 2}, {"w": 0, "a": 1, "k": 2, "v": 3, "#len:s0": 4}
    step.ptrs, step.seen = [0x1000, 0, 0, 0, 0], [None, None, None]
    step._bufs_addr, step._table_bytes = BUFS_ADDR, 5 * 8
    step.counters, step.epochs, step.status = torch.ones(5), torch.ones(4), torch.ones(6, dtype=torch.int64)
    step.fault = step.status[:4]
    step._status_bytes = 8 * ST_HEAD + 32 * 4
    step._mem = ctypes.create_string_buffer(step._status_bytes)
    step._status_host = ctypes.addressof(step._mem)
    step._head = (ctypes.c_int64 * ST_HEAD).from_address(step._status_host)
    step._recs = (ctypes.c_int32 * 32).from_address(step._status_host + 8 * ST_HEAD)
    step._vals = [ctypes.c_void_p(k + 1) for k in range(5)] + [ctypes.c_void_p(BUFS_ADDR), ctypes.c_void_p(9),
                                                               ctypes.c_ulonglong(10)]
    step._params = CudaStep._param_array(step._vals)
    step._stage_mem = ctypes.create_string_buffer(5 * 8)
    step._stage = ctypes.addressof(step._stage_mem)
    step._tables = [0xD100, 0xD000]
    step._frozen, step._frozen_bufs = {}, []
    step._side = "side"
    step._owned = SimpleNamespace(graphs=[], dev=[0xD000], host=[], streams=["side"])
    step._graph, step._graph_tried = None, False
    step.owned = {}
    step.outputs = StepOutputs(step.g, step.owned, step.g.inputs)
    step._staging = {}
    step._told_staging = False
    step._init_lengths()
    step._init_unmoved()
    return step


def _caches(rows, kbase=None, vbase=None):
    """K and V caches of ``rows`` rows, views of the front of ``kbase`` / ``vbase`` (storage for
    the capacity: the same address whatever the length, as the caching allocator may give)."""
    kbase = torch.zeros(2 * CAP * 4) if kbase is None else kbase
    vbase = torch.zeros(2 * CAP * 4) if vbase is None else vbase
    return kbase[:2 * rows * 4].view(1, 2, rows, 4), vbase[:2 * rows * 4].view(1, 2, rows, 4)


def test_length_slot_follows_a_same_address_cache_of_another_length(fake):
    """The length slot holds the call's cache length; a cache of another length at the SAME
    address (no pointer write) rewrites the slot (one stream-ordered 4-byte memset, before the
    launch); an unchanged length writes nothing."""
    step = _poly_step()
    kb, vb = torch.zeros(2 * CAP * 4), torch.zeros(2 * CAP * 4)
    a = torch.zeros(4)
    k, v = _caches(5, kb, vb)
    step._update_inputs([a, k, v], ("stream", 7))   # the first call's table (as __init__ makes it)
    assert step.ptrs[4] == 5 and step.ptrs[2] == k.data_ptr() and step.ptrs[3] == v.data_ptr()
    fake.calls.clear()
    step(a, k, v)
    assert fake.calls == [("launch", ("stream", 7), BUFS_ADDR)]   # nothing changed: nothing written
    k3, v3 = _caches(3, kb, vb)
    assert k3.data_ptr() == k.data_ptr() and v3.data_ptr() == v.data_ptr()
    fake.calls.clear()
    step(a, k3, v3)
    assert fake.calls == [("memset", BUFS_ADDR + 8 * 4, 3, 1), ("launch", ("stream", 7), BUFS_ADDR)]
    assert step.ptrs[4] == 3
    k8, v8 = _caches(CAP)                              # moved and longer: pointers and the length
    fake.calls.clear()
    step(a, k8, v8)
    assert ("memset", BUFS_ADDR + 8 * 4, CAP, 1) in fake.calls and fake.calls[-1][0] == "launch"
    assert step.ptrs[2:] == [k8.data_ptr(), v8.data_ptr(), CAP]


def test_lengths_out_of_range_or_disagreeing_raise_and_are_checked_again(fake):
    """A length outside [1, capacity] or two caches of one symbol with different lengths raise a
    FusecError naming the inputs; the next call (same addresses) is checked again, not skipped."""
    step = _poly_step()
    kb, vb = torch.zeros(2 * (CAP + 1) * 4), torch.zeros(2 * (CAP + 1) * 4)
    a = torch.zeros(4)
    k, v = _caches(5, kb, vb)
    step(a, k, v)
    with pytest.raises(FusecError, match=r"input k .*\[1, 2, 9, 4\].*s0 in \[1, 8\]"):
        step(a, kb.view(1, 2, CAP + 1, 4), v)
    with pytest.raises(FusecError, match=r"input k .*\[1, 2, 0, 4\]"):
        step(a, kb[:0].view(1, 2, 0, 4), v)
    k4, _ = _caches(4, kb, vb)
    fake.calls.clear()
    with pytest.raises(FusecError, match=r"run-time length s0: input k has 4 rows.*input v has 5"):
        step(a, k4, v)
    assert not [c for c in fake.calls if c[0] == "launch"]
    with pytest.raises(FusecError, match="run-time length s0"):
        step(a, k4, v)                                  # the same call again: still refused
    k4, v4 = _caches(4, kb, vb)
    step(a, k4, v4)
    assert step.ptrs[4] == 4 and fake.calls[-1][0] == "launch"


def test_captured_launch_freezes_the_lengths_of_its_call(fake):
    """A launch during a capture reads a table frozen with that call's pointers AND lengths: the
    same caches at another length get another table; the eager table keeps its length."""
    step = _poly_step()
    kb, vb = torch.zeros(2 * CAP * 4), torch.zeros(2 * CAP * 4)
    a = torch.zeros(4)
    k, v = _caches(5, kb, vb)
    step(a, k, v)
    fake.capturing = 1
    k6, v6 = _caches(6, kb, vb)
    fake.calls.clear()
    step(a, k6, v6)
    assert fake.calls[-1] == ("launch", ("stream", 7), 0xD000)
    assert list((ctypes.c_uint64 * 5).from_address(step._stage))[2:] == [k.data_ptr(), v.data_ptr(), 6]
    assert step.ptrs[4] == 5                           # the eager table is untouched
    fake.calls.clear()
    step(a, k6, v6)
    assert fake.calls == [("launch", ("stream", 7), 0xD000)]
    k7, v7 = _caches(7, kb, vb)
    step(a, k7, v7)                                    # same pointers, another length: another table
    assert fake.calls[-1] == ("launch", ("stream", 7), 0xD100)
    assert list((ctypes.c_uint64 * 5).from_address(step._stage))[4] == 7
    fake.capturing = 0

