"""A/B of fusec kernel variants on Llama-3.2-1B in one process (tuning, not the peer table).

Each variant is a set of fusec options (``defines`` tuning macros such as
``FUSEC_LOADS_IN_FLIGHT`` or ``FUSEC_PREFETCH``, ``num_sms`` ...). For each: compile, check the
logits against HF bf16 eager on the same random KV cache (relative L2 at most
``decode.CHECK_TOL``; a fallback to another backend fails the variant), then time the step
captured in a CUDA graph (``decode.GraphStep``: the position counters are reset before every
replay, outside the timed window) at each position. ``--profile DIR`` also records the per-SM
timeline of the first variant (``trace.json``, ``timeline.json``, ``timeline.png``).
Prints a table last; JSON to ``--out``.

Run on the GPU machine:
  PYTHONPATH=. python3 benchmarks/variants.py \\
      --variants '[{"name": "base"}, {"name": "lif16", "options": {"defines": {"FUSEC_LOADS_IN_FLIGHT": 16}}}]'
"""
from __future__ import annotations

import argparse
import json
import logging
import runpy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode import CHECK_TOL, GraphStep, _FusecLog, read_bandwidth, rel_err  # noqa: E402

log = logging.getLogger("variants")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", required=True, help="JSON list of {name, options}")
    ap.add_argument("--positions", type=int, nargs="+", default=[127, 2047, 4095])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", default=None, help="folder: record the first variant's timeline")
    ap.add_argument("--out", default="build/variants.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ex = runpy.run_path(str(ROOT / "examples" / "llama_3_2_1b.py"))
    from transformers import StaticCache

    from fusec.backend import fusec_backend
    dev = torch.device("cuda")
    model = ex["_common"].make_llama(ex["make_config"](), torch.bfloat16, seed=0).to(dev)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = read_bandwidth(dev)
    floor_ms = weight_bytes / bw * 1e3
    cache = StaticCache(config=model.config, max_cache_len=ex["MAX_CACHE_LEN"])
    tok = torch.randint(0, model.config.vocab_size, (1, 1), device=dev)

    def set_position(pos: int) -> None:
        for layer in cache.layers:
            layer.cumulative_length.fill_(pos)

    def fill(pos: int, seed: int) -> None:   # fresh random K/V (never zeros), position pos
        gen = torch.Generator(device=dev).manual_seed(seed)
        for layer in cache.layers:
            layer.keys.normal_(generator=gen)
            layer.values.normal_(generator=gen)
        set_position(pos)

    with torch.no_grad():
        model(input_ids=torch.randint(0, 128256, (1, 4), device=dev), past_key_values=cache, use_cache=True)
        refs = {}
        for pos in args.positions:
            fill(pos, 2 + pos)
            refs[pos] = model(input_ids=tok, past_key_values=cache, use_cache=True).logits.clone()
    rows = []
    for k, v in enumerate(json.loads(args.variants)):
        torch._dynamo.reset()
        opts = {"check_watchdog": False, **v.get("options", {})}
        row = {"name": v["name"], "options": opts, "positions": {}}
        warnings: list[str] = []
        watch = _FusecLog(warnings)
        logging.getLogger("fusec").addHandler(watch)
        try:
            step = torch.compile(model, backend=fusec_backend, options=opts)
            run = lambda: step(input_ids=tok, past_key_values=cache, use_cache=True).logits  # noqa: E731
            with torch.no_grad():
                fill(args.positions[0], 1)
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                row["compile_s"] = time.perf_counter() - t0
                fell_back = [m for m in warnings if "; using " in m or "running this graph eagerly" in m]
                if fell_back:   # the step would be timed on another backend
                    raise RuntimeError(f"fusec fell back: {fell_back[0]}")
                for pos in args.positions:
                    fill(pos, 2 + pos)
                    err = rel_err(run(), refs[pos])
                    if not err <= CHECK_TOL:
                        raise RuntimeError(f"logits at position {pos}: relative L2 error {err:.2e} "
                                           f"against HF eager > {CHECK_TOL:g}")
                    g = GraphStep(run, lambda: set_position(pos))
                    ms = g.time(args.steps, warmup=10)
                    row["positions"][pos] = {"rel_l2_vs_eager": err, "median_ms": statistics.median(ms),
                                             "min_ms": min(ms)}
                if args.profile and k == 0:
                    torch._dynamo.reset()
                    popts = {**opts, "profile_dir": args.profile, "profile_step": 3, "check_watchdog": True}
                    pstep = torch.compile(model, backend=fusec_backend, options=popts)
                    for _ in range(3):
                        fill(args.positions[-1], 7)
                        pstep(input_ids=tok, past_key_values=cache, use_cache=True)
                    torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            log.exception("variant %s failed", v["name"])
            row["error"] = f"{type(e).__name__}: {e}"
        finally:
            logging.getLogger("fusec").removeHandler(watch)
        rows.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"floor_ms": floor_ms, "read_bandwidth": bw, "variants": rows}, indent=1))
    print(f"\nread bandwidth {bw / 1e12:.2f} TB/s, floor {floor_ms:.3f} ms")
    print(f"{'variant':<24} {'position':>8} {'ms':>8} {'floor share':>12} {'rel err':>9} {'compile s':>10}")
    for r in rows:
        for pos, p in r["positions"].items():
            print(f"{r['name']:<24} {pos:>8} {p['median_ms']:>8.3f} {floor_ms / p['median_ms']:>11.1%} "
                  f"{p['rel_l2_vs_eager']:>9.2e} {r.get('compile_s', float('nan')):>10.1f}")
        if "error" in r:
            print(f"{r['name']:<24} ERROR {r['error'].splitlines()[0][:100]}")


if __name__ == "__main__":
    main()
