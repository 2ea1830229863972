"""GPU: a published sliding-window configuration (Mistral-7B-v0.1's widths, 2 layers, random bf16
weights) through the three user paths with default options: HF generate() with
CompileConfig(backend="fusec"), fusec.generate and a plain decode loop. Prints, per path,
whether any step fell back, the tokens' agreement with eager greedy, and (plain loop) how many
kernels one step launched. Usage: PYTHONPATH=. python3 tools/user_paths_sliding.py"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "benchmarks")]
import families  # noqa: E402

import fusec  # noqa: E402
from fusec.fallbacks import FallbackWatch  # noqa: E402


def main() -> None:
    from transformers import StaticCache
    from transformers.generation import CompileConfig
    torch.set_grad_enabled(False)
    model, label = families.build("mistral_sw", "published", "cuda", layers=2)
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, 32000, (1, 8), generator=torch.Generator().manual_seed(0)).cuda()
    ref = model.generate(prompt, max_new_tokens=24, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    with FallbackWatch() as w:
        hf = model.generate(prompt, max_new_tokens=24, do_sample=False, cache_implementation="static",
                            compile_config=CompileConfig(backend="fusec"))
    print(f"{label}: HF generate(CompileConfig(backend='fusec')): fallbacks {w.fallbacks}, compiled {w.compiled}, "
          f"tokens equal to eager's: {int((hf == ref).sum())}/{ref.numel()}")
    torch._dynamo.reset()
    with FallbackWatch() as w:
        fg = fusec.generate(model, prompt, 24, eos_token_id=[])
    print(f"fusec.generate: fallbacks {w.fallbacks}, compiled {w.compiled}, "
          f"tokens equal to eager's: {int((fg == ref).sum())}/{ref.numel()}")
    torch._dynamo.reset()
    cache = StaticCache(config=model.config, max_cache_len=512)
    tok = model(input_ids=prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
    step = torch.compile(model, backend="fusec")
    with FallbackWatch() as w:
        for _ in range(4):
            tok = step(input_ids=tok, past_key_values=cache).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(input_ids=tok, past_key_values=cache)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"plain loop: fallbacks {w.fallbacks}, compiled {w.compiled}, kernels in one step: {len(kernels)} "
          f"({sorted(set(kernels))})")


if __name__ == "__main__":
    main()
