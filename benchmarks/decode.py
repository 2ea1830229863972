"""Decode-step latency of Llama-3.2-1B (bf16, batch 1, static KV cache) on one GPU.

DESIGN.md section 6, first slice: in ONE process, fusec's megakernel and the HF model under
torch.compile (inductor) with CUDA graphs, at given KV positions. Each engine's step is
captured in a CUDA graph and replayed; CUDA events; median of ``--steps`` replays after
warm-up. Fresh random KV-cache contents and tokens (never zeros). Prints a table last and
writes the full numbers as JSON.

Run on the GPU machine:  python3 benchmarks/decode.py --positions 127 2047 --out bench.json
"""
from __future__ import annotations

import argparse
import json
import logging
import runpy
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def read_bandwidth(dev, gib: float = 4.0) -> float:
    """Streaming read bandwidth (bytes/s): a sum over a buffer several times the L2."""
    x = torch.randn(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        x.sum()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        x.sum()
    ev[1].record()
    torch.cuda.synchronize()
    return 10 * x.numel() * 2 / (ev[0].elapsed_time(ev[1]) * 1e-3)


def fill_cache(cache, position: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        layer.cumulative_length.fill_(position)


def time_graph(fn, steps: int, warmup: int = 10) -> list[float]:
    """Capture ``fn`` in a CUDA graph, replay it; per-replay milliseconds."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    out = []
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * steps)]
    for i in range(steps):
        ev[2 * i].record()
        graph.replay()
        ev[2 * i + 1].record()
    torch.cuda.synchronize()
    return [ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in range(steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, nargs="+", default=[127, 2047, 4095 - 300])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--engines", nargs="+", default=["fusec", "inductor"])
    ap.add_argument("--out", default="bench.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ex = runpy.run_path(str(ROOT / "examples" / "llama_3_2_1b.py"))
    from transformers import StaticCache
    dev = torch.device("cuda")
    model = ex["_common"].make_llama(ex["make_config"](), torch.bfloat16, seed=0).to(dev)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = read_bandwidth(dev)
    floor_ms = weight_bytes / bw * 1e3
    results = {"weight_bytes": weight_bytes, "read_bandwidth": bw, "floor_ms": floor_ms, "engines": {}}
    for engine in args.engines:
        torch._dynamo.reset()
        cache = StaticCache(config=model.config, max_cache_len=ex["MAX_CACHE_LEN"])
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128256, (1, 4), device=dev), past_key_values=cache, use_cache=True)
        if engine == "fusec":
            from fusec.backend import fusec_backend   # works without the entry point installed
            step = torch.compile(model, backend=fusec_backend, options={"check_watchdog": False})
        else:
            step = torch.compile(model)   # inductor; the CUDA graph is ours (time_graph)
        tok = torch.randint(0, 128256, (1, 1), device=dev)
        fill_cache(cache, args.positions[0], 1)
        t0 = time.perf_counter()
        with torch.no_grad():
            step(input_ids=tok, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        per = {}
        for pos in args.positions:
            fill_cache(cache, pos, 2 + pos)
            with torch.no_grad():
                ms = time_graph(lambda: step(input_ids=tok, past_key_values=cache, use_cache=True), args.steps)
            per[pos] = {"median_ms": statistics.median(ms), "min_ms": min(ms)}
        results["engines"][engine] = {"compile_s": compile_s, "positions": per}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    ind = results["engines"].get("inductor", {}).get("positions", {})
    print(f"\nLlama-3.2-1B bf16 decode step, batch 1; read bandwidth {bw / 1e12:.2f} TB/s, "
          f"weights {weight_bytes / 1e9:.3f} GB, floor {floor_ms:.3f} ms")
    print(f"{'engine':<10} {'position':>8} {'ms':>8} {'vs inductor':>12} {'floor share':>12} {'compile s':>10}")
    for engine, r in results["engines"].items():
        for pos, v in r["positions"].items():
            ratio = ind[pos]["median_ms"] / v["median_ms"] if pos in ind else float("nan")
            print(f"{engine:<10} {pos:>8} {v['median_ms']:>8.3f} {ratio:>11.2f}x {floor_ms / v['median_ms']:>11.1%} "
                  f"{r['compile_s']:>10.1f}")


if __name__ == "__main__":
    main()
