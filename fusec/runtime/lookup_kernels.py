"""Prompt lookup's per-step bookkeeping on CUDA as two small kernels (fusec.prompt_lookup).

A verification step of :class:`fusec.prompt_lookup.LookupDecoder` is one fusec megakernel plus
its bookkeeping: the drafts (:func:`fusec.prompt_lookup.draft`, prompt lookup's n-gram match:
Saxena 2023, "Prompt Lookup Decoding"; transformers' ``PromptLookupCandidateGenerator``, which
takes the earliest match of the longest n-gram), the acceptance
(:func:`fusec.prompt_lookup.accept`), the history, the counts, the length and every cache
layer's position. As torch ops they are 55 to 110 tiny kernels, about 130 us of GPU time per
1.32 ms step on an H100. Here they are two launches, of the CUDA source
``templates/prompt_lookup.cu.j2``:

- ``lookup_draft`` (one CTA of :data:`THREADS` threads): ``inp[0, 0] = hist[n - 1]`` and
  ``inp[0, 1:] = draft(hist, n, K - 1)``, exactly :func:`~fusec.prompt_lookup.draft`'s result
  (earliest match, the largest n-gram size first, the same clamping). Each thread compares
  :data:`ITEMS` positions per tile; the CTA stops after the first tile where the largest size
  matched, then takes a block-wide min per size (warp shuffles, one shared slot per warp).
- ``lookup_advance`` (one warp): everything :meth:`LookupDecoder.one` does after the step (the
  accepted count ``a`` from a warp ballot, ``hist[n + j] = preds[j]`` for the K rows, ``steps``,
  ``accepted``, ``n = min(n + a + 1, limit)``, each ``StaticLayer.cumulative_length = n - 1``
  through a device table of their addresses, :class:`LengthTable`), ``n`` read first and
  written last.

The source is compiled by NVRTC for sm_90a (:func:`fusec.cuda.jit.compile_cuda`, its disk cache;
a fraction of a second: no header is included) on first use in a process, loaded once per device
with the driver API (cuda-python, as :mod:`fusec.runtime.cuda_step` loads ``fusec_step``) and kept
for the process. Launches go to torch's current stream with ``cuLaunchKernel``, whose parameters
are copied at the call: a launch inside ``torch.cuda.graph`` is captured as a kernel node that
reads the state (``n``, ``hist``...) when replayed, like the torch ops it replaces.

Tensors (all int64, contiguous, on one CUDA device): ``hist`` ``[cap]``, ``n`` / ``limit`` /
``steps`` / ``accepted`` ``[1]``, ``inp`` ``[1, K]`` (K from 1 to 32), ``preds`` ``[K]`` (made
contiguous where it is not), the layers' positions 0-d or ``[1]``.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from fusec.errors import CudaError, FusecError, JitError
from fusec.runtime import driver as cu

log = logging.getLogger("fusec.runtime.lookup_kernels")

#: the CUDA source's template (``templates/``)
TEMPLATE = "prompt_lookup.cu.j2"
#: threads of ``lookup_draft``'s one CTA
THREADS = 1024
#: positions each thread of ``lookup_draft`` compares per tile (loads in flight together)
ITEMS = 4
#: threads of ``lookup_advance``: one warp (one lane per query token, K <= 32)
WARP = 32


@functools.cache
def source(max_ngram: int) -> str:
    """The CUDA source of both kernels for n-grams of at most ``max_ngram`` tokens (>= 1)."""
    import jinja2

    from fusec import template_dir
    if max_ngram < 1:
        raise FusecError(f"prompt lookup kernels: max_ngram={max_ngram} must be >= 1")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    return env.get_template(TEMPLATE).render(max_ngram=max_ngram, threads=THREADS, items=ITEMS)


def compile_source(max_ngram: int, cache_dir: str | None = None) -> Any:
    """``source(max_ngram)`` compiled for sm_90a (:class:`fusec.cuda.jit.CompiledKernel`).

    Raises:
        JitError: NVRTC failed.
    """
    from fusec.cuda.jit import compile_cuda
    return compile_cuda(source(max_ngram), "prompt_lookup.cu", cache_dir=cache_dir)


def _i64(t: torch.Tensor, name: str, device: torch.device, numel: int | None = None) -> None:
    """Raise FusecError unless ``t`` is a contiguous int64 tensor on ``device`` (of ``numel`` elements)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.device != device or not t.is_contiguous() \
            or (numel is not None and t.numel() != numel):
        what = f"{t.dtype}{list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        size = f" of {numel} elements" if numel is not None else ""
        raise FusecError(f"prompt lookup kernels: {name} must be a contiguous int64 tensor{size} on {device}, "
                         f"got {what}")


class LookupKernels:
    """Both kernels loaded on one CUDA device (``lookup_draft``, ``lookup_advance``).

    Raises (constructor):
        JitError: NVRTC failed. CudaError: the driver could not load the CUBIN (a GPU other than
            sm_90) or find a function.
    """

    def __init__(self, device: torch.device, max_ngram: int):
        drv = cu.driver()
        self.device, self.max_ngram = device, max_ngram
        kernel = compile_source(max_ngram)
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)   # torch's primary context current on this thread
            cu.check(drv.cuInit(0), "cuInit")
            # never unloaded: the functions serve every later call of the process
            self.module = cu.check(drv.cuModuleLoadData(kernel.cubin), "cuModuleLoadData(prompt_lookup)")
            self.draft_fn = cu.check(drv.cuModuleGetFunction(self.module, b"lookup_draft"),
                                     "cuModuleGetFunction(lookup_draft)")
            self.advance_fn = cu.check(drv.cuModuleGetFunction(self.module, b"lookup_advance"),
                                       "cuModuleGetFunction(lookup_advance)")
        log.debug("prompt lookup kernels loaded on %s (NVRTC %s)", device,
                  "cache hit" if kernel.cache_hit else "compiled")

    def _launch(self, func: Any, threads: int, vals: Sequence[Any], what: str) -> None:
        """One CTA of ``threads`` threads on torch's current stream; ``vals`` the parameters (ctypes
        values, copied by the driver at the call: also inside a stream capture)."""
        drv = cu.driver()
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        stream = drv.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        if torch.cuda.current_device() != self.device.index:
            with torch.cuda.device(self.device):   # the module's context current
                cu.check(drv.cuLaunchKernel(func, 1, 1, 1, threads, 1, 1, 0, stream, ctypes.addressof(params), 0),
                         f"cuLaunchKernel({what})")
            return
        cu.check(drv.cuLaunchKernel(func, 1, 1, 1, threads, 1, 1, 0, stream, ctypes.addressof(params), 0),
                 f"cuLaunchKernel({what})")

    def draft(self, hist: torch.Tensor, n: torch.Tensor, inp: torch.Tensor) -> None:
        """``inp[0, 0] = hist[n - 1]``, ``inp[0, 1:] = draft(hist, n, K - 1, max_ngram)`` (no sync).

        Args:
            hist: int64 ``[cap]``, the history; n: int64 ``[1]``, its length (1 to cap);
            inp: int64 ``[1, K]``, written.

        Raises:
            FusecError: a tensor of another dtype, shape or device, or not contiguous.
        """
        dev = self.device
        _i64(hist, "hist", dev)
        _i64(n, "n", dev, 1)
        _i64(inp, "inp", dev)
        if inp.dim() != 2 or inp.shape[0] != 1 or hist.dim() != 1:
            raise FusecError(f"prompt lookup kernels: hist [cap] and inp [1, K] expected, got {list(hist.shape)} "
                             f"and {list(inp.shape)}")
        vals = [ctypes.c_void_p(hist.data_ptr()), ctypes.c_void_p(n.data_ptr()), ctypes.c_void_p(inp.data_ptr()),
                ctypes.c_int64(hist.shape[0]), ctypes.c_int32(inp.shape[1] - 1)]
        self._launch(self.draft_fn, THREADS, vals, "lookup_draft")

    def advance(self, inp: torch.Tensor, preds: torch.Tensor, hist: torch.Tensor, n: torch.Tensor,
                limit: torch.Tensor, steps: torch.Tensor, accepted: torch.Tensor, lens: torch.Tensor | None) -> None:
        """Everything :meth:`fusec.prompt_lookup.LookupDecoder.one` does after its step (no sync).

        Args:
            inp: int64 ``[1, K]``, the step's query tokens; preds: int64 ``[K]``, the greedy token
                after each; hist: int64 ``[cap]``, ``n``, ``limit``, ``steps``, ``accepted``:
                int64 ``[1]`` (``hist``, ``n``, ``steps``, ``accepted`` updated);
            lens: int64 ``[layers]``, the addresses of the layers' int64 positions
                (:class:`LengthTable`), each set to the new ``n - 1``; None: none.

        Raises:
            FusecError: a tensor of another dtype, shape or device, or K past 32.
        """
        dev = self.device
        k = inp.shape[-1]
        if preds.dtype == torch.int64 and not preds.is_contiguous():
            preds = preds.contiguous()
        for t, name, numel in ((inp, "inp", None), (preds, "preds", k), (hist, "hist", None), (n, "n", 1),
                               (limit, "limit", 1), (steps, "steps", 1), (accepted, "accepted", 1)):
            _i64(t, name, dev, numel)
        if not 1 <= k <= WARP:
            raise FusecError(f"prompt lookup kernels: K = {k} query tokens, at most {WARP} (one lane each)")
        if lens is not None:
            _i64(lens, "lens", dev)
        vals = [ctypes.c_void_p(t.data_ptr()) for t in (inp, preds, hist, n, limit, steps, accepted)]
        vals += [ctypes.c_void_p(lens.data_ptr() if lens is not None and lens.numel() else 0),
                 ctypes.c_int32(lens.numel() if lens is not None else 0), ctypes.c_int32(k),
                 ctypes.c_int64(hist.shape[0])]
        self._launch(self.advance_fn, WARP, vals, "lookup_advance")


#: the loaded kernels by (device index, max_ngram); None where they could not be loaded
_loaded: dict[tuple[int, int], LookupKernels | None] = {}


def kernels(device: torch.device, max_ngram: int) -> LookupKernels | None:
    """The kernels on CUDA ``device`` (compiled and loaded at the first call of the process);
    None, with one warning, where they cannot be (NVRTC or the driver failed, e.g. a GPU without
    sm_90a): the caller runs the torch ops."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, max_ngram)
    if key in _loaded:
        return _loaded[key]
    where = torch.device("cuda", idx)
    capturing = torch.cuda.is_current_stream_capturing()
    try:
        if capturing:   # loading a module is no stream work: allowed, outside the graph, in relaxed mode
            with cu.RelaxedCapture():
                got: LookupKernels | None = LookupKernels(where, max_ngram)
        else:
            got = LookupKernels(where, max_ngram)
    except (JitError, CudaError, FusecError, ImportError, OSError) as e:
        log.warning("fusec: prompt lookup's CUDA kernels unavailable on %s (%s: %s); its bookkeeping runs as "
                    "torch ops", where, type(e).__name__, str(e).strip()[:300])
        got = None
    _loaded[key] = got
    return got


class LengthTable:
    """A device int64 array of the addresses of a cache's layer positions
    (``StaticLayer.cumulative_length``: in transformers 5 an int64 0-d tensor on the cache's
    device), for ``lookup_advance``; built at the first call and again only when a position
    tensor moves (every table stays alive with this object: a captured graph may read it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._tables: dict[tuple[int, ...], torch.Tensor | None] = {}

    def __call__(self, cache: Any) -> torch.Tensor | None:
        """The table of ``cache.layers``' positions; None where a layer's position is not an
        int64 one-element tensor on the device (the caller sets them with torch ops), or where the
        table would be built inside a stream capture (a host-to-device copy)."""
        try:
            lens = [layer.cumulative_length for layer in cache.layers]
            key = tuple(t.data_ptr() for t in lens)
        except (AttributeError, TypeError):
            return None
        if key in self._tables:
            return self._tables[key]
        if torch.cuda.is_current_stream_capturing():
            return None
        table = None
        if all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.numel() == 1 and t.device == self.device
               for t in lens):
            table = torch.tensor(key, dtype=torch.int64).to(self.device)
        else:
            log.debug("prompt lookup: a cache layer's position is not an int64 element on %s: set by torch ops",
                      self.device)
        self._tables[key] = table
        return table
