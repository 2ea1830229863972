"""Run generated generic-op functions on the CPU: the same C++ bodies compiled with the host
C++ compiler against a shim (one "thread", one-lane "warps", plain loads), so that their index
arithmetic, casts and math can be checked against PyTorch without a GPU.

What this checks: everything an op's body computes, element by element, in the order one
thread would; what it does not: the parallel parts (several threads and lanes, warp shuffles,
barriers), which are a few shared helpers in ``templates/generic_ops.cuh``.

Use :func:`check_graph` on an IR graph: it runs the graph op by op with PyTorch (the
simulator's semantics), runs every op that has a generated form on the host from the same
inputs, and reports the largest error of each op.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from fusec import template_dir
from fusec.cuda.gen.core import LEN_PREFIX
from fusec.ir.env import Env
from fusec.ir import Graph, Op

log = logging.getLogger("fusec.cuda.gen")

SHIM = r"""
#define GX_HOST 1
#include <math.h>
#include <string.h>
#include <stdint.h>
#include <limits>
#define __device__
#define __noinline__
#define __forceinline__ inline
#define __restrict__
typedef long long i64;
struct GxDim { unsigned x, y, z; };
static const GxDim threadIdx = {0, 0, 0}, blockDim = {1, 1, 1};
#define GX_LANE 0
#define GX_NLANES 1
#define GX_WARP 0
#define GX_NWARPS 1
#define GX_NTHREADS 1
#define GX_SYNC() do { } while (0)
template <typename T> inline T gx_shfl_xor(T v, int) { return v; }
template <typename T, typename F> inline T gx_block_reduce(T v, F) { return v; }
inline float gx_inf() { return std::numeric_limits<float>::infinity(); }
inline float gx_nan() { return std::numeric_limits<float>::quiet_NaN(); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
struct __nv_bfloat16 { uint16_t x; };
struct __half { _Float16 x; };
inline float to_f(float x) { return x; }
inline float to_f(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.x << 16; float f; memcpy(&f, &u, 4); return f; }
inline float to_f(__half h) { return (float)h.x; }
template <typename T> T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline __nv_bfloat16 from_f<__nv_bfloat16>(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  __nv_bfloat16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) r.x = (uint16_t)((u >> 16) | 0x40);
  else r.x = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return r;
}
template <> inline __half from_f<__half>(float x) { __half h; h.x = (_Float16)x; return h; }
template <typename T> inline float rnd(float x) { return to_f(from_f<T>(x)); }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
extern "C" { long long gx_fault[4] = {0, 0, 0, 0}; }
inline bool index_ok(i64 v, i64 bound, int code) {
  if (v >= 0 && v < bound) return true;
  if (!gx_fault[0]) { gx_fault[0] = 1; gx_fault[1] = code; gx_fault[2] = v; gx_fault[3] = bound; }
  return false;
}
"""

#: the host compiler's optimization level: -O0 compiles twice as fast as -O1 (the zoo's 2800
#: lines: 0.7 s against 1.5 s) and computes the same values: no fast-math, no FMA contraction
#: (``-ffp-contract=off``), SSE floats, the same libm
OPT_LEVEL = "-O0"


def compiler() -> str | None:
    """The host C++ compiler (``$CXX``, else g++ or clang++), or None."""
    for c in (os.environ.get("CXX"), "g++", "clang++"):
        if c and shutil.which(c):
            return c
    return None


def build(gens: list[dict], workdir: str | Path | None = None) -> ctypes.CDLL:
    """Compile generated functions (:func:`fusec.cuda.gen.generate` results) into a shared
    library where ``gx_run_<k>(void** params)`` calls the k-th one.

    Raises:
        RuntimeError: no host compiler, or it rejected the code (its output in the message).
    """
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no host C++ compiler (g++ or clang++) for the host check")
    helpers = (Path(template_dir()) / "generic_ops.cuh").read_text()
    parts = [SHIM, helpers]
    seen = set()
    for k, gen in enumerate(gens):
        if gen["name"] not in seen:
            seen.add(gen["name"])
            parts.append(gen["source"])
        args = ", ".join(f"(int)(long long)p[{j}]" if r.startswith(LEN_PREFIX) else f"({ct}*)p[{j}]"
                         for j, (ct, r) in enumerate(zip(gen["ctypes"], gen["roots"])))
        if gen.get("range") is not None:   # a range-split op, run whole: elements [0, n)
            args += f", 0, {gen['range']}"
        parts.append(f'extern "C" void gx_run_{k}(void** p) {{ {gen["name"]}({args}); }}')
    d = Path(workdir or tempfile.mkdtemp(prefix="fusec_host_"))
    src, lib = d / "ops.cpp", d / "ops.so"
    src.write_text("\n".join(parts))
    res = subprocess.run([cxx, "-std=c++17", OPT_LEVEL, "-fPIC", "-shared", "-ffp-contract=off", "-w",
                          "-o", str(lib), str(src)], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"host compile of {src} failed:\n{res.stderr[-4000:]}")
    return ctypes.CDLL(str(lib))


@dataclasses.dataclass
class OpCheck:
    """One op run on the host against PyTorch: the largest error over its written tensors
    (relative to the reference's largest magnitude for floats, exact for others)."""

    op: str
    kind: str
    max_err: float
    detail: str = ""


def _snapshot(env: Env, g: Graph, root: str) -> torch.Tensor | None:
    """A copy of ``root``'s flat elements; ``root@start:stop`` (a generated function's view
    parameter, ``TensorInfo.offset``) gives elements ``[start, stop)`` of that root."""
    root, _, rng = root.partition("@")
    if root not in env.bufs:
        return None
    flat = env.bufs[root].contiguous().reshape(-1)
    if rng:
        a, b = map(int, rng.split(":"))
        flat = flat[a:b]
    return flat.clone()


def check_graph(g: Graph, flat_args: list, select=None, workdir=None) -> list[OpCheck]:
    """Run ``g`` op by op with PyTorch; run every op for which ``select(op)`` is true (default:
    every op with an emitter) through its generated function on the host, from the same
    inputs, and compare what it writes.

    Returns:
        one :class:`OpCheck` per checked op, in program order.
    """
    from fusec.cuda.codegen import Buffers
    from fusec.ir.semantics import run_op
    from fusec.cuda.gen import find_emitter, generate
    from fusec.instructions.generic import ranged

    select = select or (lambda op: find_emitter(op.kind) is not None)
    bufs = Buffers(g)
    env = Env(g, [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in flat_args])
    jobs: list[tuple[Op, dict, dict, dict]] = []
    gens = []
    # a chain's members run one by one (each is a generated function of its own)
    for op in [m for o in g.ops for m in (o.attrs["ops"] if o.kind == "chain" else [o])]:
        gen = generate(op, g, bufs, ranged=ranged(op, g)) if select(op) else None
        before = {r: _snapshot(env, g, r) for r in (gen["roots"] if gen else [])}
        run_op(op, env)
        if gen is None:
            continue
        written = {g.root(t) for t in op.writes()}
        after = {r: _snapshot(env, g, r) for r in written}
        jobs.append((op, gen, before, after))
        gens.append(gen)
    if not jobs:
        return []
    lib = build(gens, workdir)
    out = []
    for k, (op, gen, before, after) in enumerate(jobs):
        tensors, lengths = [], {}
        for j, r in enumerate(gen["roots"]):
            if r.startswith(LEN_PREFIX):   # a run-time length, passed by value
                sym = r[len(LEN_PREFIX):]
                lengths[j] = env.lengths.get(sym, g.lengths.get(sym, 0))
                tensors.append(None)
                continue
            info = g.tensors[r.partition("@")[0]]
            t = before[r]
            if t is None:   # a fresh output: poisoned, so that an unwritten element shows
                fill = float("nan") if info.dtype.is_floating_point else -7
                t = torch.full((info.numel,), fill if info.dtype != torch.bool else True, dtype=info.dtype)
            tensors.append(t.clone().contiguous())
        arr = (ctypes.c_void_p * max(1, len(tensors)))(*[lengths[j] if t is None else t.data_ptr()
                                                         for j, t in enumerate(tensors)])
        getattr(lib, f"gx_run_{k}")(arr)
        err, detail = 0.0, ""
        for r, ref in after.items():
            got = tensors[gen["roots"].index(r)]
            if ref.dtype.is_floating_point:
                a, b = got.double(), ref.double()
                scale = b[torch.isfinite(b)].abs().max().item() if torch.isfinite(b).any() else 1.0
                same_nan = torch.isnan(a) == torch.isnan(b)
                fin = torch.isfinite(a) & torch.isfinite(b)
                e = ((a - b).abs()[fin].max().item() / max(scale, 1e-30)) if fin.any() else 0.0
                inf_ok = bool(((a == b) | fin | (torch.isnan(a) & torch.isnan(b))).all())
                if not bool(same_nan.all()) or not inf_ok:
                    e = float("inf")
                    detail = f"{r}: non-finite mismatch"
            else:
                e = float((got != ref).sum().item())
                if e:
                    detail = f"{r}: {int(e)} elements differ"
            err = max(err, e)
        out.append(OpCheck(op.name, op.kind, err, detail))
        log.debug("host check %s (%s): %.3g %s", op.name, op.kind, err, detail)
    return out
