"""Compile-time rows of ``make bench``: cold and warm compile of an engine, each in a new process.

The cold process runs over fresh empty inductor, Triton and fusec cache folders, the warm one
over what the cold one left there (for fusec: NVRTC's CUBINs and the artifact cache, with the
warm start). Each process is ``benchmarks/decode.py --compile-probe ENGINE``, which builds the
model on the GPU and times ``torch.compile`` to the first step's logits.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("bench")

ROOT = Path(__file__).resolve().parent.parent
#: the compile caches a cold process starts empty; CUDA_CACHE_PATH: the CUDA compute cache, where
#: NVRTC 12.9+ on a machine with a driver also keeps what it compiled (found on the H200
#: machine: a kernel compiled before in another folder came back in 0.1 s, without ptxas report)
CACHE_NAMES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FUSEC_CACHE_DIR", "CUDA_CACHE_PATH")


#: the engine name of the ``fusec.generate`` rows: its first two tokens (prefill, the decode
#: step's compile or load, one step) in new processes (``decode.py`` ``generate_probe``)
GENERATE = "fusec.generate"


def cache_folders(root: Path) -> dict[str, str]:
    """One folder under ``root`` per cache of :data:`CACHE_NAMES` (env name -> path)."""
    return {name: str(root / name.split("_")[0].lower()) for name in CACHE_NAMES}


def compile_in_new_processes(engine: str, example: str | Path, args: argparse.Namespace,
                             script: Path) -> dict[str, Any]:
    """Cold and warm compile seconds of ``engine`` on ``example``'s model, each in a new process:
    the first over fresh empty cache folders, the second over what the first left there.

    ``script``: the benchmark that runs ``--compile-probe ENGINE`` (``benchmarks/decode.py``).
    Returns ``compile_cold_s``, ``compile_warm_s`` (None with ``--no-warm-compile``) and, for
    fusec, each process's stage lines (``compile_cold_stages``, ``compile_warm_stages``).
    Raises RuntimeError when a process fails or fusec falls back.
    """
    root = Path(tempfile.mkdtemp(prefix="fusec-compile-"))
    env = {**os.environ, **cache_folders(root)}
    env.pop("FUSEC_CACHE", None)           # the artifact cache is what "warm" measures
    env.setdefault("PYTHONPATH", str(ROOT))
    cmd = [sys.executable, str(script), "--compile-probe", engine,
           "--compile-example", str(example), "--seed", str(args.seed), "--positions", str(args.positions[0]),
           "--fusec-options", json.dumps(args.fusec_options),
           "--handwritten-attention", args.handwritten_attention,
           "--handwritten-inductor", json.dumps(args.handwritten_inductor)]
    if args.handwritten_fuse:
        cmd.append("--handwritten-fuse")
    out: dict[str, Any] = {"compile_cold_s": None, "compile_warm_s": None}
    try:
        for which in ("cold", "warm") if args.warm_compile else ("cold",):
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            lines = p.stdout.strip().splitlines()
            try:
                res = json.loads(lines[-1])
            except (IndexError, ValueError):
                tail = p.stderr.strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"{which} compile process of {engine} failed (exit {p.returncode}): "
                                   f"{tail[0][:300]}") from None
            if res["fallbacks"]:
                raise RuntimeError(f"fusec fell back to another backend: {res['fallbacks'][0]}")
            out[f"compile_{which}_s"] = res["seconds"]
            if engine in ("fusec", GENERATE):
                out[f"compile_{which}_stages"] = [ln for ln in p.stderr.splitlines() if " fusec: stage " in ln]
            log.info("%s (%s): compile %s %.1f s (new process)", engine, Path(example).stem, which,
                     res["seconds"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def compile_models(examples: list[str], args: argparse.Namespace, script: Path) -> dict[str, Any]:
    """fusec's cold and warm compile of each example model file (``--compile-models``), by file
    stem; a model that fails gets ``error`` and the others still run."""
    out: dict[str, Any] = {}
    for example in examples:
        rec: dict[str, Any] = {}
        out[Path(example).stem] = rec
        try:
            rec.update(compile_in_new_processes("fusec", example, args, script))
            rec["generate"] = compile_in_new_processes(GENERATE, example, args, script)
        except Exception as e:   # one model failing must not lose the rest of the results
            rec["error"] = f"{type(e).__name__}: {str(e).strip()[:500]}"
            log.error("fusec compile of %s: FAILED: %s", example, rec["error"])
    return out


def fmt(x: float | None, spec: str, width: int) -> str:
    """``x`` formatted to ``width``, or a right-aligned dash when missing."""
    if x is None or math.isnan(x):
        return f"{'-':>{width}}"
    return f"{x:>{width}{spec}}"


def print_compile_times(results: dict[str, Any]) -> None:
    """The compile-time rows: each engine on the 1B, then fusec on each ``--compile-models``."""
    rows = [(name, "llama_3_2_1b", rec) for name, rec in results["engines"].items()
            if rec.get("compile_cold_s") is not None]
    rows += [("fusec", model, rec) for model, rec in results.get("compile_times", {}).items()]
    rows = [r for name, model, rec in rows
            for r in [(name, model, rec)] + ([(GENERATE, model, rec["generate"])] if rec.get("generate") else [])]
    if not rows:
        return
    print("\ncompile time, torch.compile to the first logits, each in a new process "
          "(cold: empty cache folders; warm: the caches the cold process filled; fusec.generate: "
          "the call that returns an 8-token prompt's first 2 new tokens)")
    head = f"{'engine':<14} {'model':<16} {'cold s':>7} {'warm s':>7}"
    print(head)
    print("-" * len(head))
    for name, model, rec in rows:
        if rec.get("error"):
            print(f"{name:<14} {model:<16} FAILED  {rec['error'][:100]}")
            continue
        print(f"{name:<14} {model:<16} {fmt(rec.get('compile_cold_s'), '.1f', 7)} "
              f"{fmt(rec.get('compile_warm_s'), '.1f', 7)}")
