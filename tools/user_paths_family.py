"""GPU: one published family at FULL depth (random bf16 weights) through the three user paths
with default options, as a user calls them:

- a plain decode loop, ``torch.compile(model, backend="fusec")`` over a StaticCache of 1024 rows
  after a 300-token eager prefill: the first call's seconds, ms per step (wall, the loop's own
  argmax included), fallbacks, and the GPU ops of 10 steps (one ``fusec_step`` per step);
- HF ``generate()`` with ``CompileConfig(backend="fusec")`` and ``fusec.generate``, over prompts of
  40, 700 and 130 tokens (32 new tokens each): seconds per call, steps compiled, fallbacks, and
  the new tokens equal to eager greedy search's (``disable_compile=True``: HF's own generate).

Usage (GPU machine, repository root):
    PYTHONPATH=. python3 tools/user_paths_family.py FAMILY [sdpa|eager]
FAMILY: a name of ``benchmarks/families.py`` (llama, gemma2, qwen2, mistral_sw, ...)."""
from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "benchmarks")]
import families  # noqa: E402

import fusec  # noqa: E402
from fusec.fallbacks import FallbackWatch  # noqa: E402

PROMPTS = (40, 700, 130)
NEW = 32


def plain_loop(model, g: torch.Generator) -> None:
    """The plain loop's line (see the module docstring)."""
    from transformers import StaticCache
    cache = StaticCache(config=model.config, max_cache_len=1024)
    ids = torch.randint(1, model.config.vocab_size, (1, 300), generator=g).cuda()
    tok = model(input_ids=ids, past_key_values=cache).logits[:, -1:].argmax(-1)
    step = torch.compile(model, backend="fusec")
    t0 = time.time()
    with FallbackWatch() as w:
        tok = step(input_ids=tok, past_key_values=cache).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        first = time.time() - t0
        for _ in range(5):
            tok = step(input_ids=tok, past_key_values=cache).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t0, n = time.time(), 30
        for _ in range(n):
            tok = step(input_ids=tok, past_key_values=cache).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        ms = (time.time() - t0) / n * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                tok = step(input_ids=tok, past_key_values=cache).logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
    ops = Counter(e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"plain loop: first call {first:.1f} s, {ms:.3f} ms/step, fallbacks {len(w.fallbacks)}, "
          f"compiled {w.compiled}, GPU ops in 10 steps {dict(ops)}", flush=True)


def generate_calls(model, g: torch.Generator) -> None:
    """The lines of HF generate() and fusec.generate (see the module docstring)."""
    from transformers.generation import CompileConfig
    for path in ("HF generate()", "fusec.generate"):
        for n in PROMPTS:
            p = torch.randint(1, model.config.vocab_size, (1, n), generator=g).cuda()
            ref = model.generate(p, max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                                 disable_compile=True)
            torch.cuda.synchronize()
            t0 = time.time()
            with FallbackWatch() as w:
                if path == "HF generate()":
                    out = model.generate(p, max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                                         compile_config=CompileConfig(backend="fusec"))
                else:
                    out = fusec.generate(model, p, NEW, eos_token_id=[])
                torch.cuda.synchronize()
            dt = time.time() - t0
            new, want = out[0, n:], ref[0, n:]
            k = min(len(new), len(want))
            print(f"{path} prompt {n}: {dt:.2f} s, compiled {w.compiled}, fallbacks {len(w.fallbacks)}, "
                  f"tokens equal to eager's {int((new[:k] == want[:k]).sum())}/{k}", flush=True)
            for f in w.fallbacks[:2]:
                print("    ", f[:300])


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama"
    attn = sys.argv[2] if len(sys.argv) > 2 else "sdpa"
    torch.set_grad_enabled(False)
    model, label = families.build(name, "published", "cuda", attn=attn)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.data.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
    model.generation_config.pad_token_id = 0
    print(label, flush=True)
    plain_loop(model, g)
    torch._dynamo.reset()
    generate_calls(model, g)


if __name__ == "__main__":
    main()
