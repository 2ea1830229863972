"""Per-SM timelines of decode steps of a published family at several batch sizes (GPU machine only).

For each ``--batches`` B: the published ``--family`` (default llama: Llama-3.2-1B; the names of
``benchmarks/families.py``) at full depth (``--layers`` N: N decoder layers) (random bf16 weights), B
random prompts of ``--prefill`` tokens prefilled eagerly into a ``StaticCache`` of 1024 rows,
then ``torch.compile(model, backend="fusec", options={"profile_dir": OUT/bB, "profile_step": 3})``
(a profiling build: NOT the default kernel, a few % slower) runs 3 steps. Prints the step span,
the per-kind busy time and layer ``--layer``'s ops (when each was ready and done, µs), the
same table ``fusec timeline OUT/bB/timeline.json --layer N`` prints, with each op's template marks
(``FUSEC_MARK``: median µs after its tiles' waits; what each mark is, in the template).

Usage (GPU):  PYTHONPATH=. python3 tools/profile_batch.py --out $OUT --batches 1 8 --tokens 4
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import families  # noqa: E402


def profile(model, batch: int, out: Path, prefill: int, layer: int, extra: dict, k: int = 1) -> None:
    """Profile step 3 of a ``[batch, k]`` decode step (k query tokens: the option ``query_tokens=k``)
    and print its summary and layer ``layer``."""
    from transformers import StaticCache

    from fusec.fallbacks import FallbackWatch
    from fusec.runtime.profile import Timeline
    gen = torch.Generator(device="cuda").manual_seed(batch)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (batch, prefill), device="cuda", generator=gen)
    cache = StaticCache(config=model.config, max_cache_len=1024)
    d = out / f"{model.config.model_type}-b{batch}" if k == 1 else out / f"{model.config.model_type}-k{k}"
    if k > 1:
        extra = {"query_tokens": k, **extra}
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusec",
                                 options={"profile_dir": str(d), "profile_step": 3, **extra})
        with FallbackWatch() as w:
            for _ in range(3):
                compiled(input_ids=torch.randint(1, vocab, (batch, k), device="cuda", generator=gen),
                         past_key_values=cache)
        torch.cuda.synchronize()
    print(f"\n=== batch {batch} tokens {k} {extra or ''}: fallbacks {w.fallbacks[:1]} compiled {w.compiled}")
    tl = Timeline.load(d / "timeline.json")
    s = tl.summary()
    print(f"span {s['span_us']:.1f} us, instructions {s['instructions']}, idle share {s['idle_share_mean']:.2f}")
    for k, v in s["per_kind"].items():
        print(f"  {k:<22} n {v['count']:5d} busy {v['busy_us']:9.1f} us mean {v['mean_us']:6.2f} "
              f"wait {v['wait_us']:9.1f} GB/s(busy) {v['gbps_busy']:7.0f}")
    print(f"layer {layer}:")
    for r in tl.op_windows(layer):
        print(f"  {r['op'][:28]:<28} {r['kind']:<18} tiles {r['tiles']:4d} ready {r['first_ready']:8.1f} "
              f"end {r['last_end']:8.1f} window {r['window_us']:6.1f} busy {r['mean_busy_us']:6.2f} "
              f"GB/s {r['gbps_window']:6.0f} marks {' '.join('-' if m is None else f'{m:.2f}' for m in r['marks_us'])}")
    torch._dynamo.reset()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llama")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--tokens", type=int, nargs="*", default=[],
                    help="also profile batch-1 steps of K query tokens (option query_tokens=K)")
    ap.add_argument("--prefill", type=int, default=600)
    ap.add_argument("--layer", type=int, default=5)
    ap.add_argument("--options", default="{}", help="extra fusec options (JSON), e.g. knobs")
    ap.add_argument("--out", default="build/profile-batch")
    args = ap.parse_args()
    import json
    logging.basicConfig(level=logging.WARNING)
    model, label = families.build(args.family, "published", "cuda", layers=args.layers)
    print(label)
    for b in args.batches:
        profile(model, b, Path(args.out), args.prefill, args.layer, json.loads(args.options))
    for k in args.tokens:
        profile(model, 1, Path(args.out), args.prefill, args.layer, json.loads(args.options), k=k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
