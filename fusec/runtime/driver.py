"""The CUDA driver API as the runtime uses it (cuda-python's bindings): the module, imported on
first use; a call's result checked; the resources one step owns, released together; the stream
capture mode relaxed for a moment."""
from __future__ import annotations

import functools
from typing import Any

from fusec.errors import CudaError


@functools.cache
def driver():
    """cuda-python's driver module (imported once, on first use: the CPU path never needs it)."""
    from cuda.bindings import driver
    return driver


def check(res: Any, what: str) -> Any:
    """``res`` (a driver call's result: an error code, or a tuple of it and the values) with the
    error checked: the values (one, several or none).

    Raises:
        CudaError: the call failed; the message names ``what`` and the driver's error name.
    """
    drv = driver()
    err = res[0] if isinstance(res, tuple) else res
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


class Owned:
    """Driver resources of one CudaStep (page-locked host memory, device memory, a graph exec),
    released together by its finalizer, in the CUDA context they were made in; errors are
    ignored there (a finalizer may run at interpreter exit)."""

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self.host: list[int] = []
        self.dev: list[int] = []
        self.graphs: list[Any] = []
        self.streams: list[Any] = []

    def release(self) -> None:
        try:
            drv = driver()
            drv.cuCtxPushCurrent(self.ctx)
            for g in self.graphs:
                drv.cuGraphExecDestroy(g)
            for st in self.streams:
                drv.cuStreamDestroy(st)
            for p in self.dev:
                drv.cuMemFree(p)
            for p in self.host:
                drv.cuMemFreeHost(p)
            drv.cuCtxPopCurrent()
        except Exception:   # noqa: BLE001 - nothing to do about it at teardown
            pass
        self.graphs, self.streams, self.dev, self.host = [], [], [], []


class RelaxedCapture:
    """This thread's stream-capture mode relaxed for a moment: lets a call made during a capture
    fill (and if needed allocate) its private pointer table outside the graph, work the
    capture does not record (:meth:`fusec.runtime.cuda_step.CudaStep._launch_captured`)."""

    def __enter__(self) -> None:
        drv = driver()
        self.prev = check(drv.cuThreadExchangeStreamCaptureMode(
            drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED), "cuThreadExchangeStreamCaptureMode")

    def __exit__(self, *exc: Any) -> None:
        driver().cuThreadExchangeStreamCaptureMode(self.prev)
