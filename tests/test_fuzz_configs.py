"""Property test: Llama/Qwen-like decoders of randomly drawn shapes compile and match eager.

200 configurations drawn from a fixed seed (reproducible; ``FUSEC_FUZZ_SEED`` and
``FUSEC_FUZZ_N`` change them): odd hidden (a multiple of the head count, as HF requires) and MLP
widths, head_dim 32 to 256, GQA ratios 1 to
16, 1 or 2 layers, tied or untied embeddings, Qwen2's q/k/v biases, Qwen3's q/k norms, cache
lengths 16 to 80. Each one: two decode steps through ``torch.compile(backend="fusec")`` on the
CPU simulator (hazard check on) against eager in fp32 (relative error < 1e-4, no fallback), the
layers in the fused kinds; every tenth kernel is compiled with NVRTC for sm_90a.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from fusec.fallbacks import FallbackWatch

SEED = int(os.environ.get("FUSEC_FUZZ_SEED", "2026"))
N = int(os.environ.get("FUSEC_FUZZ_N", "200"))


def draw(i: int) -> dict:
    """Configuration ``i`` of the fuzz set (a dict of transformers config fields + family)."""
    r = random.Random(SEED * 100_003 + i)
    family = r.choice(["llama", "qwen2", "qwen3"])
    head_dim = r.choice([32, 48, 64, 80, 96, 128, 160, 256])
    n_kv = r.choice([1, 1, 2, 3])
    rep = r.choice([1, 2, 3, 4, 5, 7, 8, 16])
    heads = n_kv * rep
    if family == "qwen2":   # Qwen2 derives head_dim = hidden / heads: keep the widths small
        head_dim, heads = r.choice([32, 48, 64]), n_kv * min(rep, 4)
        hidden = head_dim * heads
    else:                   # HF asks hidden % heads == 0; head_dim is free
        hidden = heads * r.randrange(2, max(3, 160 // heads + 1))
    return {"family": family, "head_dim": head_dim, "num_key_value_heads": n_kv,
            "num_attention_heads": heads, "hidden_size": hidden,
            "intermediate_size": r.randrange(16, 301), "vocab_size": r.randrange(40, 500),
            "num_hidden_layers": r.choice([1, 2]), "tie_word_embeddings": r.random() < 0.5,
            "cache": r.randrange(16, 81), "prompt": r.randrange(1, 6), "seed": i}


def build(c: dict) -> torch.nn.Module:
    import transformers as T
    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[c["family"]]
    fields = {k: v for k, v in c.items() if k not in ("family", "cache", "prompt", "seed")}
    if c["family"] == "qwen2":
        fields.pop("head_dim")   # Qwen2 derives it: hidden / heads
    torch.manual_seed(c["seed"])
    cfg = getattr(T, cls[0])(max_position_embeddings=512, attn_implementation="sdpa", **fields)
    m = getattr(T, cls[1])(cfg).eval().requires_grad_(False)
    for mod in m.modules():   # non-trivial norms and biases
        if type(mod).__name__.endswith("RMSNorm"):
            mod.weight.uniform_(0.5, 1.5)
        if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
            mod.bias.normal_(0, 0.5)
    return m




@pytest.mark.slow
@pytest.mark.parametrize("i", range(N))
def test_drawn_config_matches_eager(i, steps):
    from transformers import StaticCache
    c = draw(i)
    model = build(c)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(i)
    caches = [StaticCache(config=model.config, max_cache_len=c["cache"]) for _ in range(2)]
    p = torch.randint(0, vocab, (1, c["prompt"]), generator=gen)
    with torch.no_grad():
        for cache in caches:
            model(input_ids=p, past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 1 + i % 23})
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(2):
            tok = torch.randint(0, vocab, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            rel = ((a - b).norm() / b.norm()).item()
            assert 0 < rel < 1e-4, (c, rel)
    torch._dynamo.reset()
    assert not w.fallbacks, (c, w.fallbacks)
    (step,) = steps
    kinds = step.schedule.graph.count_kinds()
    assert kinds.get("rms_qkv_rope") == c["num_hidden_layers"], (c, kinds)
    assert not {k for k in kinds if k.startswith("aten.")} - {"aten.copy_.default"}, (c, kinds)
    if i % 10 == 0:
        from fusec.cuda.codegen import render
        from fusec.cuda.jit import compile_cuda
        compile_cuda(render(step.schedule).source, "fusec_step.cu")
