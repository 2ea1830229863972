"""One step for every cache length on models with sliding-window layers (CPU simulator).

HF's sliding-window layer (``StaticSlidingWindowLayer``: Mistral with ``sliding_window``,
Gemma-2, Gemma-3) holds ``min(window, max_cache_len)`` rows and counts positions in a Python
int; below its window, its mask's window term is true everywhere. HF ``generate()`` makes a new
cache for each call's length: each new prompt length compiled a new kernel (a per-length step:
the mask's window offset ``max(s - L + 1, 0)`` was not seen to be 0 under dynamo's guard
``s < L``, and the mask over a symbolic length stayed in the step). Now the first call traces
the length as a symbol (``fusec.frontend.static_cache.SlidingLayerRows``), the offset is 0
under the guards (``host_scalars._pinned``), and the mask is proven causal below the window
(``mask_proofs.causal_below``), which bounds that layer's rows (a longer cache runs eagerly).
"""
from __future__ import annotations

import copy

import pytest
import torch

import fusec.fallbacks
import hf_tiny
from fusec.fallbacks import FallbackWatch


def _compile_config():
    from transformers.generation import CompileConfig
    cc = CompileConfig(backend="fusec")
    cc._compile_all_devices = True   # HF compiles on CUDA only unless told (this machine has no GPU)
    return cc


@pytest.mark.parametrize("name", ["gemma2", "mistral_sw"])
def test_hf_generate_compiles_once_over_prompt_lengths(name):
    """HF ``generate()`` through fusec with default options, a window longer than every cache
    (Gemma-2: sliding and full layers; Mistral: every layer slides), three prompt lengths: ONE
    fusec compile in all, no fallback, and each call's tokens are eager greedy's."""
    model = getattr(hf_tiny, name)(window=4096)
    gen = torch.Generator().manual_seed(5)
    cc = _compile_config()
    compiles = []
    torch._dynamo.reset()
    with FallbackWatch() as w:
        for n in (5, 140, 70):   # caches of 64, 192 and 128 rows (generate() rounds up to 64)
            prompt = torch.randint(1, 128, (1, n), generator=gen)
            before = fusec.fallbacks.COMPILED[0]
            out = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static",
                                 compile_config=cc, pad_token_id=0, eos_token_id=None)
            compiles.append(fusec.fallbacks.COMPILED[0] - before)
            ref = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
            assert torch.equal(out, ref), (n, out, ref)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert compiles == [1, 0, 0], compiles


def test_a_sliding_cache_longer_than_its_window_runs_that_call_eagerly(caplog):
    """The mask of Mistral's sliding layer is causal below its window W only, so the step built
    for a symbolic length serves that layer's caches of up to W rows. A cache whose sliding
    layers hold more (one made for a wider window: HF's own never do) runs eagerly, equal to
    eager, with one line naming the bound; a cache within it runs the kernel again after."""
    from transformers import StaticCache

    from fusec.frontend.static_cache import length_symbolic
    window = 16
    model = hf_tiny.mistral_sw(window=window)
    wide = copy.deepcopy(model.config)
    wide.sliding_window = 64
    gen = torch.Generator().manual_seed(2)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 8})

    def run(config, rows: int, prompt_len: int) -> tuple[list[float], list[str]]:
        caches = [StaticCache(config=config, max_cache_len=rows) for _ in range(2)]
        prompt = torch.randint(0, 128, (1, prompt_len), generator=gen)
        errs = []
        with torch.no_grad(), FallbackWatch() as w:
            for c in caches:
                model(input_ids=prompt, past_key_values=c, use_cache=True)
            length_symbolic(caches[0], config.sliding_window)
            for _ in range(3):
                tok = torch.randint(0, 128, (1, 1), generator=gen)
                a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
                b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
                errs.append(((a - b).norm() / b.norm()).item())
        return errs, w.fallbacks

    errs, fallbacks = run(model.config, 12, 4)   # 12 sliding rows < W: the kernel
    assert not fallbacks and max(errs) < 1e-4, (fallbacks, errs)
    caplog.clear()
    errs, fallbacks = run(wide, 24, 4)           # 24 sliding rows > W: eagerly, one line
    assert max(errs) < 1e-4, errs
    assert fallbacks and all("attention mask is causal" in f for f in fallbacks), fallbacks
    assert len({f for f in fallbacks}) == 1, fallbacks
    errs, fallbacks = run(model.config, 10, 3)   # within W again: the kernel
    torch._dynamo.reset()
    assert not fallbacks and max(errs) < 1e-4, (fallbacks, errs)
