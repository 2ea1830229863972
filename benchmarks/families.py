"""Decode-step time per decoder family: fusec (default options) against HF eager, on one GPU.

Per family (``--config published``: the published widths with 2 decoder layers and the published
vocabulary, random bf16 weights; ``--config tiny``: the hidden-64 models of
``tests/test_gpu_families.py``): bf16 on CUDA, a ``StaticCache`` (max_cache_len 512), an eager
prefill of 16 random tokens, then one decode step at a time, random tokens:

- fusec: ``torch.compile(model, backend="fusec")`` called as
  ``compiled(input_ids=tok, past_key_values=cache)`` in a plain Python loop (what a user gets):
  3 warm-up calls (the first compiles: ``compile s``), then ``--steps`` calls, each between two
  CUDA events, median;
- eager: the same loop on the HF model itself, its own cache;
- fusec graph (optional, skipped on any exception): the compiled call captured in a CUDA graph,
  replayed with the KV position put back before each replay (outside the timed window).

A ``FallbackWatch`` is open around everything fusec does: a row whose step fell back (or never
reached fusec) is marked in the table, not hidden. ``rel_err`` (JSON) is fusec's first-step
logits against eager's on the same prefill and token. Writes the JSON after every family
(``--out``) and prints the table last.

Run on the GPU machine:  PYTHONPATH=. python3 benchmarks/families.py --out build/families-bench.json
Check the published configurations on a CPU (meta device, no GPU):  ... --dry-run
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "examples")]
import _common  # noqa: E402  (examples/: bf16 default dtype, skip torch's init)
import llama_3_2_1b  # noqa: E402
from test_gpu_families import FAMILIES  # noqa: E402

log = logging.getLogger("bench.families")

DEVICE = "cuda"
MAX_CACHE_LEN, PREFILL, WARMUP, LAYERS = 512, 16, 3, 2

#: Published widths, from each checkpoint's config.json (legacy keys such as ``rope_theta``
#: and ``rotary_pct``: transformers 5 folds them into ``rope_parameters``). Only
#: num_hidden_layers is changed (to LAYERS). Cohere is left out: command-r's config (hidden
#: 8192, vocab 256000) is far larger than the rest, so "cohere" runs its tiny model.
PUBLISHED: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "llama": ("Llama-3.2-1B", "LlamaConfig", "LlamaForCausalLM", dict(llama_3_2_1b.CONFIG)),
    "smollm2": ("SmolLM2-360M", "LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=960, intermediate_size=2560, num_attention_heads=15, num_key_value_heads=5,
        head_dim=64, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=2)),   # pad: the Instruct config's
    "qwen3": ("Qwen3-0.6B", "Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)),
    "qwen2": ("Qwen2.5-0.5B", "Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=True, use_sliding_window=False, bos_token_id=151643, eos_token_id=151643)),
    "gemma": ("Gemma-2B", "GemmaConfig", "GemmaForCausalLM", dict(
        hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        vocab_size=256000, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh", pad_token_id=0, bos_token_id=2, eos_token_id=1)),
    # Phi-3-mini-4k; its sliding_window (2047) is left out: it exceeds max_cache_len, so the step
    # computes the same, and the cache stays a plain StaticCache.
    "phi3": ("Phi-3-mini-4k", "Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=32064, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, pad_token_id=32000, bos_token_id=1, eos_token_id=32000)),
    "olmo2": ("OLMo-2-0425-1B", "Olmo2Config", "Olmo2ForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=100352, rms_norm_eps=1e-6, rope_theta=500000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, pad_token_id=100277, bos_token_id=None, eos_token_id=100257)),
    "gpt_neox": ("Pythia-1B", "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=8, vocab_size=50304, rotary_pct=0.25,
        rotary_emb_base=10000, use_parallel_residual=True, layer_norm_eps=1e-5, hidden_act="gelu",
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)),
    "stablelm": ("StableLM-2-1.6B", "StableLmConfig", "StableLmForCausalLM", dict(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=100352, partial_rotary_factor=0.25, rope_theta=10000.0, use_qkv_bias=True,
        layer_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=100257, eos_token_id=100257)),
    "olmo": ("OLMo-1B-hf", "OlmoConfig", "OlmoForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=50304, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=1, bos_token_id=None, eos_token_id=50279)),
    "granite": ("Granite-3.1-2B", "GraniteConfig", "GraniteForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=49155, rms_norm_eps=1e-5, rope_theta=5000000.0, max_position_embeddings=131072,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
        logits_scaling=8.0, tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # sliding-window cache layers (a Python position counter, fusec.frontend.host_scalars)
    "mistral_sw": ("Mistral-7B-v0.1", "MistralConfig", "MistralForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32768,
        sliding_window=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "gemma2": ("Gemma-2-2B", "Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        vocab_size=256000, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", pad_token_id=0, bos_token_id=2,
        eos_token_id=1)),
    "gemma3": ("Gemma-3-1B", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        vocab_size=262144, rms_norm_eps=1e-6, max_position_embeddings=32768, sliding_window=512,
        query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", pad_token_id=0, bos_token_id=2,
        eos_token_id=1)),
    "falcon": ("Falcon-7B", "FalconConfig", "FalconForCausalLM", dict(
        hidden_size=4544, num_attention_heads=71, multi_query=True, parallel_attn=True,
        new_decoder_architecture=False, bias=False, vocab_size=65024, layer_norm_epsilon=1e-5,
        bos_token_id=11, eos_token_id=11)),
    "gpt2": ("GPT-2", "GPT2Config", "GPT2LMHeadModel", dict(
        n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, bos_token_id=50256, eos_token_id=50256)),
    "phi2": ("Phi-2", "PhiConfig", "PhiForCausalLM", dict(
        hidden_size=2560, intermediate_size=10240, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=51200, partial_rotary_factor=0.4, rope_theta=10000.0, layer_norm_eps=1e-5,
        max_position_embeddings=2048, hidden_act="gelu_new", tie_word_embeddings=False, bos_token_id=50256,
        eos_token_id=50256)),
    "starcoder2": ("StarCoder2-3B", "Starcoder2Config", "Starcoder2ForCausalLM", dict(
        hidden_size=3072, intermediate_size=12288, num_attention_heads=24, num_key_value_heads=2,
        vocab_size=49152, rope_theta=999999.4420358813, norm_epsilon=1e-5, max_position_embeddings=16384,
        sliding_window=4096, use_bias=True, hidden_act="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0)),
}


def build(name: str, config: str, device: str | torch.device) -> tuple[torch.nn.Module, str]:
    """The family's model in bf16 on ``device`` (eval, no grad) and its configuration label."""
    if config == "published" and name in PUBLISHED:
        import transformers
        label, cfg_cls, model_cls, kw = PUBLISHED[name]
        cfg = getattr(transformers, cfg_cls)(**{**kw, "num_hidden_layers": LAYERS, "attn_implementation": "sdpa"})
        torch.manual_seed(0)
        with _common._default_dtype(torch.bfloat16), torch.device(device), _common._skip_torch_default_init():
            model = getattr(transformers, model_cls)(cfg)
        return model.eval().requires_grad_(False), f"{label} ({LAYERS} layers)"
    return FAMILIES[name]().to(device=device, dtype=torch.bfloat16), "tiny"


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


def loop_ms(step, toks: list[torch.Tensor]) -> tuple[float, float]:
    """(median ms of each call, ms per call over the whole loop) of ``step(tok)`` for each token."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in toks]
    for (a, b), tok in zip(ev, toks):
        a.record()
        step(tok)
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev), ev[0][0].elapsed_time(ev[-1][1]) / len(ev)


def graph_ms(step, cache, tok: torch.Tensor, steps: int) -> float:
    """Median ms of a CUDA-graph replay of ``step(tok)``, KV positions put back before each."""
    saved = [layer.cumulative_length.clone() for layer in cache.layers]

    def reset() -> None:
        for layer, s in zip(cache.layers, saved):
            layer.cumulative_length.copy_(s)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            reset()
            step(tok)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(tok)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps + WARMUP)]
    for a, b in ev:
        reset()
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    reset()
    return statistics.median(a.elapsed_time(b) for a, b in ev[WARMUP:])


def bench_family(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every number of one family (see the module docstring)."""
    from transformers import StaticCache

    from fusec.fallbacks import FallbackWatch
    model, label = build(name, args.config, DEVICE)
    row: dict[str, Any] = {"config": label, "params": sum(p.numel() for p in model.parameters())}
    vocab = model.config.vocab_size
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    prompt = torch.randint(1, vocab, (1, PREFILL), device=DEVICE, generator=gen)
    toks = [t.clone() for t in torch.randint(1, vocab, (WARMUP + args.steps, 1, 1), device=DEVICE, generator=gen)]
    fcache, ecache = (StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN) for _ in range(2))
    with torch.no_grad():
        for c in (fcache, ecache):
            model(input_ids=prompt, past_key_values=c)

        def fusec_step(tok):
            return compiled(input_ids=tok, past_key_values=fcache).logits

        def eager_step(tok):
            return model(input_ids=tok, past_key_values=ecache).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusec")
        with FallbackWatch() as w:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            a = fusec_step(toks[0]).double()
            torch.cuda.synchronize()
            row["compile_s"] = time.perf_counter() - t0
            e = eager_step(toks[0]).double()
            row["rel_err"] = ((a - e).norm() / e.norm()).item()
            for tok in toks[1:WARMUP]:
                fusec_step(tok)
                eager_step(tok)
            row["fusec_ms"], row["fusec_loop_mean_ms"] = loop_ms(fusec_step, toks[WARMUP:])
            row["eager_ms"], row["eager_loop_mean_ms"] = loop_ms(eager_step, toks[WARMUP:])
            try:
                row["fusec_graph_ms"] = graph_ms(fusec_step, fcache, toks[-1].clone(), args.steps)
            except Exception as exc:   # optional: capture may not work for every path
                row["fusec_graph_error"] = one_line(exc)
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
    row["fallbacks"], row["fusec_compiled_steps"] = w.fallbacks, w.compiled
    row["fell_back"] = bool(w.fallbacks) or w.compiled == 0
    row["speedup"] = row["eager_ms"] / row["fusec_ms"]
    return row


def dry_run(names: list[str], config: str) -> int:
    """Build each model on the meta device (tiny ones on the CPU) and print its size."""
    from transformers import StaticCache
    print(f"{'family':<9} {'config':<28} {'hidden':>6} {'heads':>9} {'vocab':>7} {'params':>13}  rope / cache layers")
    for name in names:
        dev = "meta" if config == "published" and name in PUBLISHED else "cpu"
        model, label = build(name, config, dev)
        c = model.config
        layers = {type(x).__name__ for x in StaticCache(config=c, max_cache_len=MAX_CACHE_LEN).layers}
        heads = f"{c.num_attention_heads}/{getattr(c, 'num_key_value_heads', None) or c.num_attention_heads}"
        print(f"{name:<9} {label:<28} {c.hidden_size:>6} {heads:>9} {c.vocab_size:>7} "
              f"{sum(p.numel() for p in model.parameters()):>13,}  {getattr(c, 'rope_parameters', None)} / "
              f"{','.join(sorted(layers))}")
        del model
    return 0


def print_table(rows: dict[str, dict[str, Any]], steps: int) -> None:
    def f(v: Any, spec: str) -> str:
        return format(v, spec) if isinstance(v, float) else "-"
    print(f"\nbf16 decode step, batch 1, StaticCache {MAX_CACHE_LEN}, prefill {PREFILL}; median of {steps} "
          "plain-loop calls (graph: CUDA-graph replays of the fusec call)")
    print(f"{'family':<9} | {'config':<27} | {'fusec ms/step':>13} | {'eager ms/step':>13} | {'speed-up':>8} | "
          f"{'fell back?':<10} | {'compile s':>9} | {'fusec graph ms':>14}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<9} | {r.get('config', '?'):<27} | ERROR: {r['error']}")
            continue
        fb = "YES" if r["fell_back"] else "no"
        print(f"{name:<9} | {r['config']:<27} | {f(r['fusec_ms'], '13.3f')} | {f(r['eager_ms'], '13.3f')} | "
              f"{f(r['speedup'], '7.2f')}x | {fb:<10} | {f(r['compile_s'], '9.1f')} | "
              f"{f(r.get('fusec_graph_ms'), '14.3f')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--config", choices=("published", "tiny"), default="published")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of: %(default)s")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per engine (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "families-bench.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU: build each model on the meta device, print sizes")
    ap.add_argument("--verbose", action="store_true", help="also fusec's own INFO lines (stages, kernel builds)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if PREFILL + WARMUP + args.steps + 3 > MAX_CACHE_LEN:
        ap.error(f"--steps must stay below {MAX_CACHE_LEN - PREFILL - WARMUP - 3}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:
        logging.getLogger("fusec").setLevel(logging.WARNING)   # fallbacks and warnings still show
    if args.dry_run:
        return dry_run(names, args.config)
    if not torch.cuda.is_available():
        log.error("needs a CUDA GPU (use --dry-run on a CPU)")
        return 2
    import transformers
    from torch._dynamo import list_backends, register_backend
    if "fusec" not in list_backends():   # a source tree on PYTHONPATH: no entry point installed
        from fusec.frontend.backend import fusec_backend
        register_backend(fusec_backend, "fusec")
    results: dict[str, Any] = {"config": {
        "config": args.config, "steps": args.steps, "max_cache_len": MAX_CACHE_LEN, "prefill": PREFILL,
        "warmup": WARMUP, "layers_published": LAYERS, "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "transformers": transformers.__version__}, "families": {}}
    rows = results["families"]
    for name in names:
        t0 = time.perf_counter()
        log.info("%s: start", name)
        try:
            rows[name] = bench_family(name, args)
            r = rows[name]
            log.info("%s: fusec %.3f ms, eager %.3f ms, graph %s, compile %.1f s, rel err %.2e, fallbacks %d (%.0f s)",
                     name, r["fusec_ms"], r["eager_ms"], r.get("fusec_graph_ms", r.get("fusec_graph_error")),
                     r["compile_s"], r["rel_err"], len(r["fallbacks"]), time.perf_counter() - t0)
        except Exception as exc:   # one family failing must not stop the others
            log.error("%s failed:\n%s", name, traceback.format_exc())
            rows[name] = {"config": args.config, "error": one_line(exc)}
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    log.info("wrote %s", args.out)
    print_table(rows, args.steps)
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
