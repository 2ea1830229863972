"""The ops of one decoder layer after lowering, per family, on the CPU (no GPU, no weights read).

Each family of ``benchmarks/families.py`` at its published widths with 3 layers (bf16, random
weights), one decode step through ``torch.compile(backend="fusec")`` after a 4-token prefill of
a 64-row StaticCache, lowered for 132 SMs with default options; prints layer 1's ops in program order with their tile counts and
what a chain or a folded prologue holds. ``--batch B``: a step of B sequences (their
``attention_mask`` [B, 64] and ``position_ids`` [B, 1] passed, as generate() passes them; docs/batch.md).
``--tokens K``: a step of K query tokens per sequence (``input_ids`` [B, K], the option
``query_tokens`` K, as ``benchmarks/batch.py`` passes it; at B > 1 ``position_ids`` [B, K]; docs/batch.md,
"Several query tokens"). An op of one tile that is not a fused kind is a
dependency level on one SM: where a family's layer costs more than Llama's six ops.

Usage: ``.venv/bin/python tools/layer_ops.py [--families llama,phi2,...] [--layers 3] [--batch 4] [--tokens 4]``
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]


def layer_ops(family: str, layers: int = 3, num_sms: int = 132, batch: int = 1,
              tokens: int = 1) -> tuple[str, list[tuple[str, int, str]]]:
    """(label, [(kind, tiles, chain steps or prologue members), ...]) of layer 1 of ``family``,
    as ``torch.compile(model, backend="fusec")`` lowers it on a user's call (host counters
    dynamic, as for HF generate; the step runs once on the simulator): a step of ``batch``
    sequences of ``tokens`` query tokens each (``tokens`` > 1: the option ``query_tokens``)."""
    import pytest
    import torch
    import families
    import hf_tiny
    import step_util
    model, label = families.build(family, "published", "cpu", layers=layers)
    cache = hf_tiny.static_cache(model, 64)
    gen = torch.Generator().manual_seed(1)
    vocab = min(100, model.config.vocab_size)
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (batch, 4), generator=gen), past_key_values=cache, use_cache=True)
    kw = {}
    if batch > 1:   # a batch step: the cache-length mask and per-sequence positions (docs/batch.md)
        mask = torch.zeros(batch, 64, dtype=torch.long)
        mask[:, :4 + tokens] = 1
        kw = {"attention_mask": mask, "position_ids": torch.arange(4, 4 + tokens).expand(batch, tokens)}
    opts = {"num_sms": num_sms}
    if tokens > 1:   # the non-default option a K-token step needs (else it falls back)
        opts["query_tokens"] = tokens
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        made = step_util.record_compiled_steps(mp)
        torch.compile(model, backend="fusec", options=opts)(
            input_ids=torch.randint(0, vocab, (batch, tokens), generator=gen), past_key_values=cache, use_cache=True, **kw)
    torch._dynamo.reset()
    if not made:
        raise RuntimeError(f"{family}: fusec compiled no step (a fallback: see the log)")
    return label, layer_rows(made[-1].schedule, 1)


def layer_rows(sched, layer: int = 1) -> list[tuple[str, int, str]]:
    """``[(kind, tiles, chain steps or prologue members), ...]``: the ops of decoder layer
    ``layer`` of a schedule (:class:`fusec.ir.schedule.Schedule`) in program order, each with
    its tile count (an op of one tile that is not a fused kind is a dependency level on one SM)."""
    tiles: dict[str, int] = {}
    for ins in sched.instrs:
        tiles[ins.op] = tiles.get(ins.op, 0) + 1
    return [(o.kind, tiles.get(o.name, 0), o.attrs.get("steps") or o.attrs.get("pre_steps") or "")
            for o in sched.graph.ops if o.layer == layer]


def main(argv: list[str] | None = None) -> int:
    import families
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(families.PUBLISHED), help="comma-separated (default: all)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    ap.add_argument("--tokens", type=int, default=1, help="query tokens per sequence (default 1; option query_tokens)")
    a = ap.parse_args(argv)
    for fam in a.families.split(","):
        label, rows = layer_ops(fam, a.layers, batch=a.batch, tokens=a.tokens)
        print(f"== {fam}: {label}, layer 1: {len(rows)} ops, {sum(t == 1 for _, t, _ in rows)} of one tile")
        for kind, n, what in rows:
            print(f"   {kind:<24} tiles {n:>4}  {what[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
