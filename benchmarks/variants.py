"""A/B of fusec kernel variants on Llama-3.2-1B (or ``--example``'s model) in one process (tuning, not the peer table).

Each variant is a set of fusec options (``defines`` tuning macros such as
``FUSEC_LOADS_IN_FLIGHT`` or ``FUSEC_ATTN_SINGLE``, ``num_sms``, ``attention_merge`` ...),
run as the ``fusec`` engine of ``benchmarks/decode.py``: the same model, checks (logits
against HF bf16 eager before and after timing, fallbacks fail the variant) and CUDA-graph
timing with position resets. ``--profile DIR`` also records the per-SM timeline of the first
variant (``trace.json``, ``timeline.json``, ``timeline.png``). Other arguments go to
``decode.py`` (``--positions``, ``--steps``, ``--quick`` ...). Prints a table last; JSON to
``--out``.

Run on the GPU machine:
  PYTHONPATH=. python3 benchmarks/variants.py --positions 127 2047 \\
      --variants '[{"name": "base"}, {"name": "lif16", "options": {"defines": {"FUSEC_LOADS_IN_FLIGHT": 16}}}]'
"""
from __future__ import annotations

import argparse
import json
import logging
import runpy
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import decode  # noqa: E402

log = logging.getLogger("variants")


def record_timeline(bench: decode.Bench, options: dict[str, Any], folder: str, position: int) -> None:
    """Compile with ``options`` plus profiling and run 3 steps at ``position``: the fusec backend
    writes the timeline of the third into ``folder``."""
    from fusec.frontend.backend import fusec_backend
    torch._dynamo.reset()
    cache = bench.new_cache()
    tok = torch.randint(0, bench.model.config.vocab_size, (1, 1), device=bench.device)
    step = torch.compile(bench.model, backend=fusec_backend,
                         options={**options, "profile_dir": folder, "profile_step": 3, "check_watchdog": True})
    for _ in range(3):
        for layer in cache.layers:
            layer.cumulative_length.fill_(position)
        step(input_ids=tok, past_key_values=cache, use_cache=True)
    torch.cuda.synchronize()


def _variants(text: str) -> list:
    """``--variants``: the JSON text, or ``@FILE`` to read it from a file."""
    if text.startswith("@"):
        path = Path(text[1:])
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"{path}: no such variants file")
        text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON list of variants: {exc}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", required=True, type=_variants,
                    help="JSON list of {name, options}, or @FILE holding one (benchmarks/*.json)")
    ap.add_argument("--profile", default=None, help="folder: record the first variant's timeline")
    ap.add_argument("--profile-only", action="store_true",
                    help="time nothing: record the first variant's timeline at every --positions "
                         "value into --profile/p<position>")
    ap.add_argument("--out", default="build/variants.json")
    args, rest = ap.parse_known_args()
    dargs = decode.parse_args(["--engines", "fusec", "--no-warm-compile", "--no-compile-time", *rest])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_grad_enabled(False)
    dev = torch.device("cuda")
    ex = runpy.run_path(dargs.example)
    model = decode.build_model(ex, dev, dargs.seed)
    bw = decode.read_bandwidth(dev, dargs.bandwidth_gib)
    floor_ms = sum(p.numel() * p.element_size() for p in model.parameters()) / bw * 1e3
    bench = decode.Bench(model, ex["MAX_CACHE_LEN"], dev, dargs)
    if args.profile_only:
        if not args.profile:
            ap.error("--profile-only needs --profile DIR")
        for pos in dargs.positions:
            record_timeline(bench, args.variants[0].get("options", {}), f"{args.profile}/p{pos}", pos)
        return 0
    rows = []
    for v in args.variants:
        dargs.fusec_options = v.get("options", {})
        row: dict[str, Any] = {"name": v["name"], "options": dargs.fusec_options, "positions": {}}
        rows.append(row)
        try:
            decode.run_engine(decode.make_engine("fusec", bench), bench, row)
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            log.exception("variant %s failed", v["name"])
            row["error"] = f"{type(e).__name__}: {e}"
        torch._dynamo.reset()
    if args.profile and args.variants:
        record_timeline(bench, args.variants[0].get("options", {}), args.profile, dargs.positions[-1])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"floor_ms": floor_ms, "read_bandwidth": bw, "variants": rows}, indent=1))
    layers = model.config.num_hidden_layers
    print(f"\n{ex.get('NAME', Path(dargs.example).stem)}: read bandwidth {bw / 1e12:.2f} TB/s, floor {floor_ms:.3f} ms")
    print(f"{'variant':<24} {'position':>8} {'ms':>8} {'floor share':>12} {'us/layer':>9} {'rel err':>9} "
          f"{'compile s':>10}")
    for r in rows:
        for pos, p in r["positions"].items():
            if "median_ms" in p:
                print(f"{r['name']:<24} {pos:>8} {p['median_ms']:>8.3f} {floor_ms / p['median_ms']:>11.1%} "
                      f"{(p['median_ms'] - floor_ms) * 1e3 / layers:>9.1f} "
                      f"{p['rel_err_vs_hf_eager']:>9.2e} {r.get('compile_in_process_s') or float('nan'):>10.1f}")
        if "error" in r:
            print(f"{r['name']:<24} ERROR {r['error'].splitlines()[0][:100]}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
