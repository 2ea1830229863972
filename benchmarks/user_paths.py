"""How users call fusec, timed on the GPU in the benchmark's process (``make bench``).

The decode-step table measures kernels replayed from CUDA graphs; this one measures what a user
gets with DEFAULT options (no ``check_watchdog=False``, no benchmark harness):

- ``plain loop``: ``compiled(input_ids=tok, past_key_values=cache, use_cache=True)`` in a
  Python loop (tokens fed back on the device, one ``synchronize`` at the end), ms per step, and
  its ratio to the fusec kernel's CUDA-graph time at the nearest position of the step table;
- ``HF generate (fusec)``: ``model.generate(ids, cache_implementation="static",
  compile_config=CompileConfig(backend="fusec"))`` with HF's defaults (mode "reduce-overhead");
- ``HF generate (default)``: the same with HF's default ``CompileConfig()`` (inductor,
  reduce-overhead);
- ``fusec.generate``: tokens stay on the GPU, greedy argmax inside the megakernel.

Each generate runs once untimed (compile, warm-up), then is timed ``REPEATS`` times over the whole
call (prefill included; the median is reported) for ``--gen-tokens`` new tokens after a ``--gen-prompt``-token random prompt; tokens/s
= new tokens / seconds. The greedy tokens of each generate are compared with HF generate through
fusec (the step-by-step path): ``same tokens`` counts the positions that agree.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

log = logging.getLogger("bench.user")


#: timed calls of each generate path: the median is reported (one call's time moved by up to
#: 30% between calls on the H200 machine's host, 2026-12-04)
REPEATS = 3


def _median_timed(fn) -> tuple[Any, float, list[float]]:
    """``fn()``'s last result, the median and all of ``REPEATS`` timed calls' seconds."""
    runs = [_timed(fn) for _ in range(REPEATS)]
    secs = sorted(sec for _, sec in runs)
    return runs[-1][0], secs[len(secs) // 2], [sec for _, sec in runs]


def _timed(fn) -> tuple[Any, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def plain_loop(model: torch.nn.Module, max_cache_len: int, steps: int, seed: int) -> dict[str, Any]:
    """ms per step of a default-options fusec plain loop (fallbacks fail it)."""
    from transformers import StaticCache

    from fusec.fallbacks import FallbackWatch
    dev = next(model.parameters()).device
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    gen = torch.Generator(device=dev).manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), device=dev, generator=gen)
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    tok = prompt[:, -1:].clone()
    with FallbackWatch() as w:
        for _ in range(5):   # compile and warm up
            tok = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)

        def loop():
            t = tok
            for _ in range(steps):
                t = compiled(input_ids=t, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            return t
        _, sec = _timed(loop)
    torch._dynamo.reset()
    if w.fallbacks:
        raise RuntimeError(f"fusec fell back: {w.fallbacks[0]}")
    return {"ms_per_step": sec / steps * 1e3, "steps": steps, "start_position": 37}


def hf_generate(model: torch.nn.Module, prompt: torch.Tensor, new: int, backend: str | None,
                options: dict[str, Any] | None = None) -> dict[str, Any]:
    """tokens/s of greedy ``model.generate`` with a static cache and ``CompileConfig(backend=...,
    options=options)`` (None: HF's default CompileConfig), ``new`` tokens per call: the model's
    eos id is unset during the calls (restored after), so no call stops early. (Before 2026-12-05
    the calls passed ``min_new_tokens=new`` instead, a logits processor, which keeps HF's loop
    rather than fusec's device loop: docs/measurements.md.)"""
    from transformers.generation import CompileConfig

    from fusec.fallbacks import FallbackWatch
    cc = CompileConfig() if backend is None else CompileConfig(backend=backend, options=options)
    kw = dict(max_new_tokens=new, do_sample=False, cache_implementation="static", compile_config=cc, pad_token_id=0)
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    torch._dynamo.reset()
    try:
        with FallbackWatch() as w:
            model.generate(prompt, **kw)                       # compile + warm-up
            out, sec, runs = _median_timed(lambda: model.generate(prompt, **kw))
    finally:
        model.generation_config.eos_token_id = eos
    torch._dynamo.reset()
    if backend == "fusec" and w.fallbacks:
        raise RuntimeError(f"fusec fell back: {w.fallbacks[0]}")
    n = out.shape[1] - prompt.shape[1]
    return {"tokens_per_s": n / sec, "seconds": sec, "runs_s": runs, "new_tokens": n, "tokens": out[0].tolist()}


def fusec_generate(model: torch.nn.Module, prompt: torch.Tensor, new: int,
                   lookup: int | None = None, no_eos: bool = False) -> dict[str, Any]:
    """tokens/s of :func:`fusec.generate` (greedy, default options; ``lookup`` N: with
    ``prompt_lookup_num_tokens=N``, and the steps and drafts accepted of the timed call;
    ``no_eos``: ``eos_token_id=[]``, every call ``new`` tokens long)."""
    import fusec

    from fusec.fallbacks import FallbackWatch
    kw = ({} if lookup is None else {"prompt_lookup_num_tokens": lookup}) | ({"eos_token_id": []} if no_eos else {})
    torch._dynamo.reset()
    with FallbackWatch() as w:
        fusec.generate(model, prompt, new, **kw)                 # compile + warm-up
        out, sec, runs = _median_timed(lambda: fusec.generate(model, prompt, new, **kw))
    torch._dynamo.reset()
    if w.fallbacks:
        raise RuntimeError(f"fusec fell back: {w.fallbacks[0]}")
    n = out.shape[1] - prompt.shape[1]
    res = {"tokens_per_s": n / sec, "seconds": sec, "runs_s": runs, "new_tokens": n, "tokens": out[0].tolist()}
    if lookup is not None:
        from fusec import prompt_lookup
        res.update(prompt_lookup.last_stats)
    return res


def run(model: torch.nn.Module, max_cache_len: int, kernel_ms: dict[str, float], steps: int,
        prompt_len: int, new_tokens: int, seed: int) -> dict[str, Any]:
    """Every user path (each failure recorded, never fatal). ``kernel_ms``: the fusec kernel's
    CUDA-graph median per position (string keys), for the plain loop's ratio."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    prompt = torch.randint(1, model.config.vocab_size, (1, prompt_len), device=dev, generator=gen)
    res: dict[str, Any] = {"prompt_len": prompt_len, "new_tokens": new_tokens}
    paths = {"plain loop (fusec, default options)": lambda: plain_loop(model, max_cache_len, steps, seed),
             "HF generate (fusec)": lambda: hf_generate(model, prompt, new_tokens, "fusec"),
             "HF generate (default compile)": lambda: hf_generate(model, prompt, new_tokens, None),
             "fusec.generate": lambda: fusec_generate(model, prompt, new_tokens)}
    for name, fn in paths.items():
        log.info("user path %s: start", name)
        try:
            res[name] = fn()
        except Exception as e:   # one path failing must not stop the others
            res[name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]}
            log.error("user path %s: FAILED: %s", name, res[name]["error"])
    loop = res["plain loop (fusec, default options)"]
    if "ms_per_step" in loop and kernel_ms:
        near = min(kernel_ms, key=lambda p: abs(int(p) - loop["start_position"]))
        loop["kernel_graph_ms"] = kernel_ms[near]
        loop["ratio_to_kernel"] = loop["ms_per_step"] / kernel_ms[near]
    ref = res["HF generate (fusec)"].get("tokens")
    for name in ("HF generate (default compile)", "fusec.generate"):
        toks = res[name].get("tokens")
        if ref and toks:
            res[name]["same_tokens"] = sum(a == b for a, b in zip(ref, toks))
    return res


def print_table(res: dict[str, Any]) -> None:
    """The user-path rows: ms per step or tokens/s, and the ratios the issue asks for."""
    print(f"\nUser paths, default options ({res['prompt_len']}-token prompt, {res['new_tokens']} new tokens, greedy)")
    head = f"{'path':<38} {'ms/token':>9} {'tokens/s':>9}  note"
    print(head)
    print("-" * len(head))
    base = res.get("HF generate (default compile)", {}).get("tokens_per_s")
    for name, v in res.items():
        if not isinstance(v, dict):
            continue
        if "error" in v:
            print(f"{name:<38} {'FAILED':>9}  {v['error'][:90]}")
            continue
        if "ms_per_step" in v:
            note = (f"{v['ratio_to_kernel']:.3f}x the kernel's CUDA-graph time ({v['kernel_graph_ms']:.3f} ms)"
                    if "ratio_to_kernel" in v else "")
            print(f"{name:<38} {v['ms_per_step']:>9.3f} {1e3 / v['ms_per_step']:>9.1f}  {note}")
            continue
        note = []
        if base and name != "HF generate (default compile)":
            note.append(f"{v['tokens_per_s'] / base:.2f}x HF default generate")
        if "same_tokens" in v:
            note.append(f"same tokens {v['same_tokens']}/{len(v['tokens'])}")
        print(f"{name:<38} {1e3 / v['tokens_per_s']:>9.3f} {v['tokens_per_s']:>9.1f}  {'; '.join(note)}")
