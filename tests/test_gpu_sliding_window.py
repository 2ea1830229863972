"""GPU: a rolled sliding window (HF rolls the cache each step once the window is full) runs as ONE
kernel per decode step, against eager.

Tiny Gemma-3 (five sliding layers to one full, window 8) and Mistral with a window of 8 on every
layer (its positions pass every cache's rows, as Mistral-7B-v0.1's past 4096), fp32 on the GPU,
a 32-row StaticCache, a 4-token prompt, then 12 decode steps through the filling and the rolled
window: every step's logits within 1e-3 of eager's on its own cache, the caches equal eager's
after the steps (the roll leaves HF's layout), no fallback, and each step after the first of its
graph (which compiles, and writes the device position counter once) launches exactly one CUDA
kernel, ``fusec_step``: the roll (``kv_roll``) and the host's positions are inside it. With
``mode="reduce-overhead"`` the step replays its own CUDA graph of that launch (the device
position counter advances inside the kernel).
"""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch

pytestmark = pytest.mark.gpu


def _kernels(fn) -> tuple[object, list[str]]:
    """``fn()``'s result and the names of the CUDA kernels it launched (no copies or memsets)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    # (a token tensor at a new address moves its pointer-table entry: a 4-byte driver memset,
    # not a kernel, left out as test_gpu.py's one-kernel test does)
    return out, [ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA
                 and "memset" not in ev.name.lower() and "memcpy" not in ev.name.lower()]


@pytest.mark.parametrize("name,mode", [("gemma3", None), ("mistral_sw", None), ("gemma3", "reduce-overhead")])
def test_rolled_window_is_one_kernel_per_step(name, mode):
    from transformers import StaticCache
    model = (hf_tiny.gemma3(window=8, layers=6) if name == "gemma3" else hf_tiny.mistral_sw(window=8)).cuda()
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        p = torch.randint(0, 128, (1, 4), generator=gen).cuda()
        for c in caches:
            model(input_ids=p, past_key_values=c)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusec", mode=mode)
        errs, launches = [], []
        with FallbackWatch() as w:
            for i in range(12):
                tok = torch.randint(0, 128, (1, 1), generator=gen).cuda()
                a, names = _kernels(lambda: compiled(input_ids=tok, past_key_values=caches[0]).logits)
                b = model(input_ids=tok, past_key_values=caches[1]).logits
                errs.append(((a - b).norm() / b.norm()).item())
                if i not in (0, 4):   # position 4: the first call of each graph (filling, rolled)
                    launches.append(names)
        torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert max(errs) < 1e-3, errs
    assert all(n == ["fusec_step"] for n in launches), launches
    for x, y in zip(caches[0].layers, caches[1].layers):
        assert (x.keys - y.keys).abs().max() < 1e-4 and (x.values - y.values).abs().max() < 1e-4
