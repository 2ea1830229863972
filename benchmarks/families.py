"""Decode-step time per decoder family: fusec (default options) against HF eager and inductor, on one GPU.

Per family (``--config published``: the published widths, vocabulary and decoder depth
(``--layers full``, the default; ``--layers N`` for N layers), random bf16 weights;
``--config tiny``: the hidden-64 models of ``tests/test_gpu_families.py``): bf16 on CUDA, a
``StaticCache`` (``--max-cache-len``, default 1024), an eager prefill of ``--prefill`` (default
600) random tokens, then one decode step at a time, random tokens:

- fusec: ``torch.compile(model, backend="fusec")`` called as
  ``compiled(input_ids=tok, past_key_values=cache)`` in a plain Python loop (what a user gets):
  3 warm-up calls (the first compiles: ``compile s``), then ``--steps`` calls, each between two
  CUDA events, median;
- eager: the same loop on the HF model itself, its own cache;
- fusec graph (optional, recorded as an error on any exception): the compiled call captured in
  a CUDA graph, replayed with the KV position put back before each replay (outside the timed
  window);
- floor: the bytes one step must read (``step_read_bytes``: the weights) over ``--bandwidth``
  (the H200's measured read bandwidth); ``share`` = floor / fusec graph, ``excess us/layer`` =
  (fusec graph - floor) per decoder layer;
- inductor (``--peer inductor``, the default; ``--peer none`` leaves it out): the HF model under
  ``torch.compile`` with inductor's default options, its own cache, the same prefill, warm-up
  and loop, then timed under a CUDA graph exactly as the fusec graph is; any exception is
  recorded in the row. ``inductor/fusec`` = inductor graph ms / fusec graph ms.

A ``FallbackWatch`` is open around everything fusec does: a row whose step fell back (or never
reached fusec) is marked in the table, not hidden. ``rel_err`` (JSON) is fusec's first-step
logits against eager's on the same prefill and token (``inductor_rel_err`` the peer's). Writes
the JSON after every family (``--out``) and prints the table last. At full depth every family
takes minutes (two compiles, three prefills); ``--families a,b`` runs a subset.

Run on the GPU machine:  PYTHONPATH=. python3 benchmarks/families.py --out build/families-bench.json
Check the published configurations on a CPU (meta device, no GPU; layers, weights, floor):  ... --dry-run
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
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "examples")]
import _common  # noqa: E402  (examples/: bf16 default dtype, skip torch's init)
import llama_3_2_1b  # noqa: E402
from test_gpu_families import FAMILIES  # noqa: E402

log = logging.getLogger("bench.families")

DEVICE = "cuda"
WARMUP = 3
PREFILL, MAX_CACHE_LEN = 600, 1024   # the defaults of --prefill and --max-cache-len
H200_READ_BANDWIDTH = 4.21e12        # B/s, streaming read measured on the H200 (docs/performance.md)


class Published(NamedTuple):
    """One checkpoint's published configuration."""
    label: str
    layers: int            # the checkpoint's num_hidden_layers (``--layers full``)
    config_cls: str        # transformers' configuration class
    model_cls: str         # transformers' causal-LM class
    kwargs: dict[str, Any]  # config.json's other keys that matter (not num_hidden_layers)


#: Published widths and depths, from each checkpoint's config.json (legacy keys such as
#: ``rope_theta`` and ``rotary_pct``: transformers 5 folds them into ``rope_parameters``).
#: Cohere is left out: command-r's config (hidden 8192, vocab 256000) is far larger than the
#: rest, so "cohere" runs its tiny model.
PUBLISHED: dict[str, Published] = {
    "llama": Published("Llama-3.2-1B", llama_3_2_1b.CONFIG["num_hidden_layers"], "LlamaConfig", "LlamaForCausalLM",
                       {k: v for k, v in llama_3_2_1b.CONFIG.items() if k != "num_hidden_layers"}),
    "smollm2": Published("SmolLM2-360M", 32, "LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=960, intermediate_size=2560, num_attention_heads=15, num_key_value_heads=5,
        head_dim=64, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=2)),   # pad: the Instruct config's
    "qwen3": Published("Qwen3-0.6B", 28, "Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)),
    "qwen2": Published("Qwen2.5-0.5B", 24, "Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=True, use_sliding_window=False, bos_token_id=151643, eos_token_id=151643)),
    "gemma": Published("Gemma-2B", 18, "GemmaConfig", "GemmaForCausalLM", dict(
        hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        vocab_size=256000, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh", pad_token_id=0, bos_token_id=2, eos_token_id=1)),
    # Phi-3-mini-4k; its sliding_window (2047) is left out: while max_cache_len stays below it
    # (default 1024) the step computes the same, and the cache stays a plain StaticCache.
    "phi3": Published("Phi-3-mini-4k", 32, "Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=32064, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, pad_token_id=32000, bos_token_id=1, eos_token_id=32000)),
    "olmo2": Published("OLMo-2-0425-1B", 16, "Olmo2Config", "Olmo2ForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=100352, rms_norm_eps=1e-6, rope_theta=500000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, pad_token_id=100277, bos_token_id=None, eos_token_id=100257)),
    "gpt_neox": Published("Pythia-1B", 16, "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=8, vocab_size=50304, rotary_pct=0.25,
        rotary_emb_base=10000, use_parallel_residual=True, layer_norm_eps=1e-5, hidden_act="gelu",
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)),
    "stablelm": Published("StableLM-2-1.6B", 24, "StableLmConfig", "StableLmForCausalLM", dict(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=100352, partial_rotary_factor=0.25, rope_theta=10000.0, use_qkv_bias=True,
        layer_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=100257, eos_token_id=100257)),
    "olmo": Published("OLMo-1B-hf", 16, "OlmoConfig", "OlmoForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=50304, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=1, bos_token_id=None, eos_token_id=50279)),
    "granite": Published("Granite-3.1-2B", 40, "GraniteConfig", "GraniteForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=49155, rms_norm_eps=1e-5, rope_theta=5000000.0, max_position_embeddings=131072,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
        logits_scaling=8.0, tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # sliding-window cache layers (a Python position counter, fusec.frontend.host_scalars)
    "mistral_sw": Published("Mistral-7B-v0.1", 32, "MistralConfig", "MistralForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32768,
        sliding_window=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "gemma2": Published("Gemma-2-2B", 26, "Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        vocab_size=256000, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", pad_token_id=0, bos_token_id=2,
        eos_token_id=1)),
    "gemma3": Published("Gemma-3-1B", 26, "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        vocab_size=262144, rms_norm_eps=1e-6, max_position_embeddings=32768, sliding_window=512,
        query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", pad_token_id=0, bos_token_id=2,
        eos_token_id=1)),
    "falcon": Published("Falcon-7B", 32, "FalconConfig", "FalconForCausalLM", dict(
        hidden_size=4544, num_attention_heads=71, multi_query=True, parallel_attn=True,
        new_decoder_architecture=False, bias=False, vocab_size=65024, layer_norm_epsilon=1e-5,
        bos_token_id=11, eos_token_id=11)),
    "gpt2": Published("GPT-2", 12, "GPT2Config", "GPT2LMHeadModel", dict(
        n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, bos_token_id=50256, eos_token_id=50256)),
    "phi2": Published("Phi-2", 32, "PhiConfig", "PhiForCausalLM", dict(
        hidden_size=2560, intermediate_size=10240, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=51200, partial_rotary_factor=0.4, rope_theta=10000.0, layer_norm_eps=1e-5,
        max_position_embeddings=2048, hidden_act="gelu_new", tie_word_embeddings=False, bos_token_id=50256,
        eos_token_id=50256)),
    "starcoder2": Published("StarCoder2-3B", 30, "Starcoder2Config", "Starcoder2ForCausalLM", dict(
        hidden_size=3072, intermediate_size=12288, num_attention_heads=24, num_key_value_heads=2,
        vocab_size=49152, rope_theta=999999.4420358813, norm_epsilon=1e-5, max_position_embeddings=16384,
        sliding_window=4096, use_bias=True, hidden_act="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0)),
}


def build(name: str, config: str, device: str | torch.device,
          layers: int | None = None, attn: str = "sdpa") -> tuple[torch.nn.Module, str]:
    """The family's model in bf16 on ``device`` (eval, no grad) and its configuration label.

    ``layers``: the decoder depth of a published configuration (None: the checkpoint's own,
    ``Published.layers``); a tiny model keeps its own. ``attn``: the published configuration's
    ``attn_implementation`` ("sdpa" or "eager"; a tiny model keeps its own)."""
    if config == "published" and name in PUBLISHED:
        import transformers
        pub = PUBLISHED[name]
        n = pub.layers if layers is None else layers
        cfg = getattr(transformers, pub.config_cls)(**{**pub.kwargs, "num_hidden_layers": n,
                                                       "attn_implementation": attn})
        torch.manual_seed(0)
        with _common._default_dtype(torch.bfloat16), torch.device(device), _common._skip_torch_default_init():
            model = getattr(transformers, pub.model_cls)(cfg)
        suffix = "" if attn == "sdpa" else f", {attn} attention"
        return model.eval().requires_grad_(False), f"{pub.label} ({n} layers{suffix})"
    model = FAMILIES[name]().to(device=device, dtype=torch.bfloat16)
    return model, f"tiny ({model.config.num_hidden_layers} layers)"


def step_read_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step (batch 1) must read at the least: every parameter once.

    A parameter that several modules share counts once (an input embedding tied to the LM
    head: the head reads all of it). A table that only embeddings use (an untied input
    embedding, GPT-2's learned positions) reads one row, the token's or the position's. Not
    counted: the KV cache, buffers (RoPE tables) and activations. Reads only sizes (numel,
    element size), so a model on the meta device works; the model is left as it is.
    ``floor ms = step_read_bytes(model) / bandwidth * 1e3``.
    """
    params: dict[int, torch.nn.Parameter] = {}
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            params[id(p)] = p
            owners.setdefault(id(p), []).append(module)
    total = 0
    for key, p in params.items():
        rows = p.shape[0] if all(isinstance(m, torch.nn.Embedding) for m in owners[key]) else 1
        total += p.numel() // rows * p.element_size()
    return total


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


@contextlib.contextmanager
def recorded(row: dict[str, Any], key: str):
    """Run the block; an exception in it becomes ``row[key]`` (one line), not the family's failure."""
    try:
        yield
    except Exception as exc:
        row[key] = one_line(exc)
        log.warning("%s: %s", key, row[key])
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def loop_ms(step, toks: list[torch.Tensor]) -> tuple[float, float]:
    """(median ms of each call, ms per call over the whole loop) of ``step(tok)`` for each token."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in toks]
    for (a, b), tok in zip(ev, toks):
        a.record()
        step(tok)
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev), ev[0][0].elapsed_time(ev[-1][1]) / len(ev)


def time_engine(step, toks: list[torch.Tensor]) -> tuple[float, torch.Tensor, float, float]:
    """One engine's plain loop: (seconds of the first call, the one that compiles; its logits in
    float64; then ``loop_ms`` over ``toks[WARMUP:]`` after the rest of the warm-up)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = step(toks[0]).double()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    for tok in toks[1:WARMUP]:
        step(tok)
    return (seconds, first, *loop_ms(step, toks[WARMUP:]))


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
    model, label = build(name, args.config, DEVICE, args.layers, args.attn)
    layers, read = model.config.num_hidden_layers, step_read_bytes(model)
    row: dict[str, Any] = {"config": label, "layers": layers, "params": sum(p.numel() for p in model.parameters()),
                           "read_bytes": read, "floor_ms": read / args.bandwidth * 1e3}
    vocab = model.config.vocab_size
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    prompt = torch.randint(1, vocab, (1, args.prefill), device=DEVICE, generator=gen)
    toks = [t.clone() for t in torch.randint(1, vocab, (WARMUP + args.steps, 1, 1), device=DEVICE, generator=gen)]

    def prefilled() -> StaticCache:
        """A new StaticCache holding the eager prefill of ``prompt``: every engine its own."""
        cache = StaticCache(config=model.config, max_cache_len=args.max_cache_len)
        model(input_ids=prompt, past_key_values=cache)
        return cache
    with torch.no_grad():
        fcache, ecache = prefilled(), prefilled()

        def fusec_step(tok):
            return compiled(input_ids=tok, past_key_values=fcache).logits

        def eager_step(tok):
            return model(input_ids=tok, past_key_values=ecache).logits
        _, ref, row["eager_ms"], row["eager_loop_mean_ms"] = time_engine(eager_step, toks)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusec", options=args.options) if args.options else \
            torch.compile(model, backend="fusec")
        with FallbackWatch() as w:
            row["compile_s"], out, row["fusec_ms"], row["fusec_loop_mean_ms"] = time_engine(fusec_step, toks)
            row["rel_err"] = rel_err(out, ref)
            with recorded(row, "fusec_graph_error"):   # optional: capture may not work for every path
                row["fusec_graph_ms"] = graph_ms(fusec_step, fcache, toks[-1].clone(), args.steps)
        if args.peer == "inductor":
            with recorded(row, "inductor_error"):
                icache = prefilled()
                torch._dynamo.reset()   # the same forward: fusec's frames out of the way
                inductor = torch.compile(model)

                def inductor_step(tok):
                    return inductor(input_ids=tok, past_key_values=icache).logits
                row["inductor_compile_s"], out, row["inductor_ms"], row["inductor_loop_mean_ms"] = time_engine(
                    inductor_step, toks)
                row["inductor_rel_err"] = rel_err(out, ref)
                row["inductor_graph_ms"] = graph_ms(inductor_step, icache, toks[-1].clone(), args.steps)
    row["fallbacks"], row["fusec_compiled_steps"] = w.fallbacks, w.compiled
    row["fell_back"] = bool(w.fallbacks) or w.compiled == 0
    row["speedup"] = row["eager_ms"] / row["fusec_ms"]
    graph = row.get("fusec_graph_ms")
    if graph:
        row["share"] = row["floor_ms"] / graph
        row["excess_us_per_layer"] = (graph - row["floor_ms"]) * 1000 / layers
        if "inductor_graph_ms" in row:
            row["inductor_over_fusec"] = row["inductor_graph_ms"] / graph
    return row


def dry_run(names: list[str], args: argparse.Namespace) -> int:
    """Build each model on the meta device (tiny ones on the CPU); print its depth, size and floor."""
    from transformers import StaticCache
    print(f"{'family':<10} {'config':<28} {'layers':>6} {'hidden':>6} {'heads':>6} {'vocab':>6} {'params':>13} "
          f"{'read GB':>7} {'floor ms':>8}  rope / cache layers")
    for name in names:
        dev = "meta" if args.config == "published" and name in PUBLISHED else "cpu"
        model, label = build(name, args.config, dev, args.layers, args.attn)
        c = model.config
        kinds = {type(x).__name__ for x in StaticCache(config=c, max_cache_len=args.max_cache_len).layers}
        heads = f"{c.num_attention_heads}/{getattr(c, 'num_key_value_heads', None) or c.num_attention_heads}"
        read = step_read_bytes(model)
        print(f"{name:<10} {label:<28} {c.num_hidden_layers:>6} {c.hidden_size:>6} {heads:>6} {c.vocab_size:>6} "
              f"{sum(p.numel() for p in model.parameters()):>13,} {read / 1e9:>7.3f} "
              f"{read / args.bandwidth * 1e3:>8.3f}  {getattr(c, 'rope_parameters', None)} / {','.join(sorted(kinds))}")
        del model
    return 0


def print_table(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    def f(v: Any, spec: str) -> str:
        return format(v, spec) if isinstance(v, float) else format("-", ">" + spec.split(".")[0])
    if args.options:
        print(f"\nNON-DEFAULT fusec options: {json.dumps(args.options)}")
    print(f"\nbf16 decode step, batch 1, StaticCache {args.max_cache_len}, prefill {args.prefill}; median of "
          f"{args.steps} plain-loop calls (graph: CUDA-graph replays of the compiled call); floor: the bytes "
          f"a step reads / {args.bandwidth / 1e12:.2f} TB/s; share = floor / fusec graph")
    print(f"{'family':<10} | {'config':<27} | {'fusec ms/step':>13} | {'eager ms/step':>13} | {'speed-up':>8} | "
          f"{'fell back?':<10} | {'compile s':>9} | {'fusec graph ms':>14} | {'floor ms':>8} | {'share':>6} | "
          f"{'excess us/layer':>15} | {'inductor graph ms':>17} | {'inductor/fusec':>14}")
    notes = []
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<10} | {r.get('config', '?'):<27} | ERROR: {r['error']}")
            continue
        notes += [f"{name}: {k}: {r[k]}" for k in ("fusec_graph_error", "inductor_error") if k in r]
        fb = "YES" if r["fell_back"] else "no"
        share = f"{r['share']:6.1%}" if "share" in r else f"{'-':>6}"
        ratio = f"{r['inductor_over_fusec']:13.2f}x" if "inductor_over_fusec" in r else f"{'-':>14}"
        print(f"{name:<10} | {r['config']:<27} | {f(r['fusec_ms'], '13.3f')} | {f(r['eager_ms'], '13.3f')} | "
              f"{f(r['speedup'], '7.2f')}x | {fb:<10} | {f(r['compile_s'], '9.1f')} | "
              f"{f(r.get('fusec_graph_ms'), '14.3f')} | {f(r['floor_ms'], '8.3f')} | {share} | "
              f"{f(r.get('excess_us_per_layer'), '15.1f')} | {f(r.get('inductor_graph_ms'), '17.3f')} | {ratio}")
    for line in notes:
        print(line)


def layers_arg(text: str) -> int | None:
    """``--layers``: "full" (None: each checkpoint's published depth) or a count of at least 1."""
    if text == "full":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'full' or a count of at least 1, not {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--config", choices=("published", "tiny"), default="published")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of: %(default)s")
    ap.add_argument("--layers", type=layers_arg, default="full", metavar="full|N",
                    help="decoder layers of a published configuration: 'full' (default) is each "
                         "checkpoint's own, N overrides (the tiny models keep theirs)")
    ap.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa",
                    help="the published configurations' attn_implementation (default %(default)s)")
    ap.add_argument("--prefill", type=int, default=PREFILL, help="eager prefill tokens (default %(default)s)")
    ap.add_argument("--max-cache-len", type=int, default=MAX_CACHE_LEN,
                    help="StaticCache length (default %(default)s)")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per engine (default %(default)s)")
    ap.add_argument("--peer", choices=("inductor", "none"), default="inductor",
                    help="also time HF's model under torch.compile (inductor), CUDA graph (default %(default)s)")
    ap.add_argument("--bandwidth", type=float, default=H200_READ_BANDWIDTH,
                    help="read bandwidth in B/s for the floor (default %(default).3g: the H200's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--options", type=json.loads, default=None,
                    help="fusec options as JSON (NOT the default configuration: recorded in the JSON and the table title)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "families-bench.json")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: build each model on the meta device, print layers, sizes and floor")
    ap.add_argument("--verbose", action="store_true", help="also fusec's own INFO lines (stages, kernel builds)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if args.prefill < 1 or args.steps < 1 or args.bandwidth <= 0:
        ap.error("--prefill and --steps take a count of at least 1, --bandwidth a positive number")
    if args.prefill + WARMUP + args.steps + 3 > args.max_cache_len:
        ap.error(f"--prefill + {WARMUP} warm-up + --steps + 3 must fit --max-cache-len: "
                 f"--steps at most {args.max_cache_len - args.prefill - WARMUP - 3} here")
    if args.dry_run:
        return dry_run(names, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:
        logging.getLogger("fusec").setLevel(logging.WARNING)   # fallbacks and warnings still show
    if not torch.cuda.is_available():
        log.error("needs a CUDA GPU (use --dry-run on a CPU)")
        return 2
    import transformers
    from torch._dynamo import list_backends, register_backend
    if "fusec" not in list_backends():   # a source tree on PYTHONPATH: no entry point installed
        from fusec.frontend.backend import fusec_backend
        register_backend(fusec_backend, "fusec")
    results: dict[str, Any] = {"config": {
        "config": args.config, "layers": "full" if args.layers is None else args.layers, "steps": args.steps,
        "max_cache_len": args.max_cache_len, "prefill": args.prefill, "warmup": WARMUP, "peer": args.peer,
        "bandwidth": args.bandwidth, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "transformers": transformers.__version__, "options": args.options}, "families": {}}
    rows = results["families"]
    for name in names:
        t0 = time.perf_counter()
        log.info("%s: start", name)
        try:
            rows[name] = bench_family(name, args)
            r = rows[name]
            log.info("%s: fusec %.3f ms, eager %.3f ms, graph %s (floor %.3f), inductor graph %s, compile %.1f s, "
                     "rel err %.2e, fallbacks %d (%.0f s)", name, r["fusec_ms"], r["eager_ms"],
                     r.get("fusec_graph_ms", r.get("fusec_graph_error")), r["floor_ms"],
                     r.get("inductor_graph_ms", r.get("inductor_error")), r["compile_s"], r["rel_err"],
                     len(r["fallbacks"]), time.perf_counter() - t0)
        except Exception as exc:   # one family failing must not stop the others
            log.error("%s failed:\n%s", name, traceback.format_exc())
            rows[name] = {"config": args.config, "error": one_line(exc)}
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    log.info("wrote %s", args.out)
    print_table(rows, args)
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
