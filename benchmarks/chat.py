"""The chat row: generate calls with a new prompt length every time, as a chat or agent loop makes them.

Ten calls in one process, prompt lengths 40 to 3000 and 64-256 new tokens (:data:`CALLS`), greedy,
random bf16 weights (``--example``: a published configuration), through each user path with its
DEFAULT options:

- ``fusec.generate``;
- ``HF generate (fusec)``: ``model.generate(..., cache_implementation="static",
  compile_config=CompileConfig(backend="fusec"))`` with HF's defaults (fusec imported: its
  decode call is one precompiled step with a symbolic cache length, fusec.frontend.hf_generate);
- ``HF generate (fusec, dynamic=True)``: the same with ``CompileConfig(dynamic=True)``;
- ``HF generate (default compile)``: HF's default ``CompileConfig()`` (inductor).

Each path runs in a NEW process over fresh empty inductor, Triton, fusec and CUDA cache folders
(``cold``), then again in a second new process over what the first left there (``warm``).
Per call: its wall time (prefill, any compile, decode; synchronized), the fusec steps compiled
meanwhile (``FallbackWatch.compiled``), then the same call once more (``again``: nothing left to
compile) — a call's compile time is ``first - again``. Per path: the total wall time, the steady
time (the sum of ``again``), the time spent compiling (total - steady), the first call's wall time
and the largest cost of a new length after the first call (max over calls 2..10 of first - again).

Run on the GPU machine: ``PYTHONPATH=. python3 benchmarks/chat.py --out build/chat.json``
(``make bench-chat``). Writes every number as JSON and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_time  # noqa: E402

log = logging.getLogger("bench.chat")

#: (prompt tokens, new tokens) of the ten calls: lengths a chat's turns bring, in no order
CALLS = ((40, 64), (350, 128), (1200, 256), (90, 64), (3000, 128), (600, 256), (2000, 64), (150, 256),
         (2600, 128), (800, 192))
PATHS = ("fusec.generate", "HF generate (fusec)", "HF generate (fusec, dynamic=True)",
         "HF generate (default compile)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", default=str(ROOT / "examples" / "llama_3_2_1b.py"))
    ap.add_argument("--paths", nargs="+", default=list(PATHS), help=f"of {PATHS}")
    ap.add_argument("--calls", type=int, default=len(CALLS), help="the first N calls of CALLS")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply prompt and new tokens (a quick run)")
    ap.add_argument("--no-warm", action="store_true", help="skip the second (warm) process")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--verbose", action="store_true",
                    help="print each process's fusec stage lines and per-call lines (where the time goes)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)   # run one path in this process
    return ap.parse_args(argv)


def calls(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [(max(1, int(p * args.scale)), max(1, int(n * args.scale))) for p, n in CALLS[:args.calls]]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _runner(path: str, model: torch.nn.Module):
    """``run(prompt, new) -> output ids`` of one user path with its default options."""
    cpu = next(model.parameters()).device.type == "cpu"
    if path == "fusec.generate":
        import fusec
        return lambda prompt, new: fusec.generate(model, prompt, new, eos_token_id=[])
    from transformers.generation import CompileConfig
    cc = {"HF generate (fusec)": lambda: CompileConfig(backend="fusec"),
          "HF generate (fusec, dynamic=True)": lambda: CompileConfig(backend="fusec", dynamic=True),
          "HF generate (default compile)": CompileConfig}[path]()
    if cpu:
        cc._compile_all_devices = True   # HF compiles on CUDA only unless told (a CPU smoke run)

    def run(prompt: torch.Tensor, new: int) -> torch.Tensor:
        return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              cache_implementation="static", compile_config=cc, pad_token_id=0)
    return run


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One path's ten calls in this process (the caches' folders are the environment's)."""
    from fusec.fallbacks import FallbackWatch
    example = runpy.run_path(args.example)
    dev = torch.device(args.device)
    t0 = time.perf_counter()
    model = example["_common"].make_model(example["make_config"](), torch.bfloat16 if dev.type == "cuda"
                                          else torch.float32, seed=args.seed, device=dev)
    model.generation_config.pad_token_id = 0
    build_s = time.perf_counter() - t0
    run = _runner(args.child, model)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    rows = []
    for prompt_len, new in calls(args):
        prompt = torch.randint(1, model.config.vocab_size, (1, prompt_len), device=dev, generator=gen)
        with FallbackWatch() as w:
            _sync(dev)
            t = time.perf_counter()
            out = run(prompt, new)
            _sync(dev)
            first = time.perf_counter() - t
            t = time.perf_counter()
            again_out = run(prompt, new)
            _sync(dev)
            again = time.perf_counter() - t
        rows.append({"prompt": prompt_len, "new": new, "first_s": first, "again_s": again,
                     "fusec_compiles": w.compiled, "fallbacks": list(w.fallbacks)[:3],
                     "new_tokens": int(out.shape[1] - prompt_len),
                     "same_tokens_again": bool(torch.equal(out, again_out))})
        log.info("%s: prompt %d, %d new: %.2f s (again %.2f s), %d fusec compile(s)%s", args.child, prompt_len,
                 new, first, again, w.compiled, f", FALLBACK {w.fallbacks[0][:120]}" if w.fallbacks else "")
    total, steady = sum(r["first_s"] for r in rows), sum(r["again_s"] for r in rows)
    later = [r["first_s"] - r["again_s"] for r in rows[1:]]
    return {"path": args.child, "model_build_s": build_s, "calls": rows, "total_s": total, "steady_s": steady,
            "compile_s": total - steady, "first_call_s": rows[0]["first_s"],
            "new_length_max_s": max(later) if later else None,
            "fusec_compiles": sum(r["fusec_compiles"] for r in rows),
            "fallbacks": sum(len(r["fallbacks"]) for r in rows)}


def run_path(path: str, args: argparse.Namespace, folders: dict[str, str], which: str) -> dict[str, Any]:
    """``path`` in a new process over the cache ``folders``; its result (or its error)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", path, "--example", args.example,
           "--calls", str(args.calls), "--scale", str(args.scale), "--device", args.device,
           "--seed", str(args.seed)] + (["--verbose"] if args.verbose else [])
    env = {**os.environ, **folders, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log.info("%s (%s process): start", path, which)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if args.verbose:
        for ln in p.stderr.splitlines():
            if (" fusec" in ln or " bench" in ln) and "DEBUG" not in ln:
                print(f"  [{which}] {ln}", flush=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        log.error("%s (%s process) FAILED (exit %d): %s", path, which, p.returncode, " | ".join(tail)[:400])
        return {"path": path, "error": " | ".join(tail)[:400], "process_s": wall}
    res = json.loads(lines[-1])
    res["process_s"] = wall
    return res


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print("\nChat row: ten generate calls, new prompt lengths 40-3000, 64-256 new tokens, default options")
    head = (f"{'path':<36} {'process':<5} {'total s':>8} {'steady s':>8} {'compile s':>9} {'1st call s':>10} "
            f"{'new length s':>12} {'fusec compiles':>14}")
    print(head)
    print("-" * len(head))
    for key, r in results.items():
        path, which = key.rsplit(" / ", 1)
        if "error" in r:
            print(f"{path:<36} {which:<5} FAILED: {r['error'][:80]}")
            continue
        nl = f"{r['new_length_max_s']:.3f}" if r.get("new_length_max_s") is not None else "-"
        fb = f" ({r['fallbacks']} fallbacks)" if r.get("fallbacks") else ""
        print(f"{path:<36} {which:<5} {r['total_s']:>8.2f} {r['steady_s']:>8.2f} {r['compile_s']:>9.2f} "
              f"{r['first_call_s']:>10.2f} {nl:>12} {r['fusec_compiles']:>14}{fb}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.child:
        if not args.verbose:
            logging.getLogger("fusec").setLevel(logging.WARNING)
        print(json.dumps(child(args)), flush=True)
        return 0
    results: dict[str, dict[str, Any]] = {}
    for path in args.paths:
        folders = compile_time.cache_folders(Path(tempfile.mkdtemp(prefix="fusec-chat-")))
        results[f"{path} / cold"] = run_path(path, args, folders, "cold")
        if not args.no_warm:
            results[f"{path} / warm"] = run_path(path, args, folders, "warm")
    out = {"config": {"example": args.example, "calls": calls(args), "device": args.device,
                      "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
           "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    print_table(results)
    return int(any("error" in r for r in results.values()))


if __name__ == "__main__":
    sys.exit(main())
