"""Where HF ``generate()``'s time per token goes, through fusec and through HF's default compile.

Times ``model.generate`` (static cache, greedy, ``--new`` tokens after a 32-token prompt) with
``CompileConfig(backend="fusec")`` and with HF's default ``CompileConfig()``, then profiles one
call of each with cProfile and prints the functions with the most cumulative time per token, and
the host time spent inside the compiled decode call (``model._compiled_call``) per token.

    PYTHONPATH=. python3 tools/hf_generate_host.py             # Llama-3.2-1B on the GPU
    PYTHONPATH=. python3 tools/hf_generate_host.py --tiny --new 8   # a smoke run on the CPU
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def build(tiny: bool, dev: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    if tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    else:
        import llama_3_2_1b
        cfg = LlamaConfig(**llama_3_2_1b.CONFIG)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(dev, torch.float32 if tiny else torch.bfloat16).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--default", action="store_true", help="also HF's default CompileConfig (inductor)")
    a = ap.parse_args()
    import fusec  # noqa: F401  (installs the generate() hook)
    from transformers.generation import CompileConfig
    from fusec.fallbacks import FallbackWatch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(a.tiny, dev)
    prompt = torch.randint(1, model.config.vocab_size, (1, 32), device=dev)
    rows = []
    for name, cc in (("fusec", CompileConfig(backend="fusec")), ("default", CompileConfig())):
        if name == "default" and (dev == "cpu" or not a.default):
            continue
        kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, cache_implementation="static",
                  compile_config=cc, pad_token_id=0)
        torch._dynamo.reset()
        with FallbackWatch() as w:
            model.generate(prompt, **kw)
            model.generate(prompt, **kw)
            times = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                model.generate(prompt, **kw)
                sync()
                times.append(time.perf_counter() - t0)
            from fusec.frontend.hf_generate import HFDecodeCall
            inner = [0.0, 0]
            target = HFDecodeCall if name == "fusec" else None

            if target is not None:
                orig = target.__call__

                def timed(self, *args, **kwargs):
                    t0 = time.perf_counter()
                    try:
                        return orig(self, *args, **kwargs)
                    finally:
                        inner[0] += time.perf_counter() - t0
                        inner[1] += 1
                target.__call__ = timed
            sync()
            t0 = time.perf_counter()
            model.generate(prompt, **kw)
            sync()
            wall = time.perf_counter() - t0
            if target is not None:
                target.__call__ = orig
            prof = cProfile.Profile()
            prof.enable()
            model.generate(prompt, **kw)
            sync()
            prof.disable()
        if name == "fusec" and w.fallbacks:
            print("FELL BACK:", w.fallbacks[:2])
        best = min(times)
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s).sort_stats("cumulative")
        st.print_stats(a.top)
        print(f"\n===== {name}: generate {a.new} tokens: best {best * 1e3:.1f} ms = {best / a.new * 1e3:.3f} ms/token "
              f"(runs {[round(t * 1e3, 1) for t in times]})")
        if inner[1]:
            print(f"  host time inside the compiled decode call: {inner[0] / inner[1] * 1e3:.3f} ms/call over "
                  f"{inner[1]} calls (that run's wall {wall / a.new * 1e3:.3f} ms/token)")
        print(s.getvalue()[:12000])
        st2 = io.StringIO()
        pstats.Stats(prof, stream=st2).sort_stats("tottime").print_stats(a.top)
        print(st2.getvalue()[:8000])
        rows.append((name, best / a.new * 1e3))
    print("\nsummary ms/token:", ", ".join(f"{n} {v:.3f}" for n, v in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
