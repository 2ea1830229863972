"""Tiny Hugging Face decoder models for tests (fp32, random weights, static KV cache)."""
from __future__ import annotations

import torch


def llama(hidden=64, inter=96, layers=1, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0):
    """A tiny ``LlamaForCausalLM`` with llama3 RoPE scaling, fp32, eval mode.

    One layer unless asked: a layer is about 0.4 CPU-s of every compile (dynamo's trace, AOT's,
    the passes) and half of each simulator step; a test whose point is the hand-off between
    layers (per-layer counts, a kind's layers sharing a case, the GPU tests) asks for two."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64},
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def qwen3(hidden=64, inter=96, layers=1, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0):
    """A tiny ``Qwen3ForCausalLM`` (per-head q/k RMSNorm), fp32, eval mode; one layer unless asked (:func:`llama`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    m = Qwen3ForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # make the per-head norms non-trivial
        for layer in m.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return m


def static_cache(model, max_len: int):
    from transformers import StaticCache
    return StaticCache(config=model.config, max_cache_len=max_len)


def _small(cfg_cls, model_cls, seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                attn_implementation="sdpa")
    base.update(kw)
    return model_cls(cfg_cls(**base)).eval().requires_grad_(False)


def qwen2_bias(seed=0):
    """A tiny ``Qwen2ForCausalLM`` (q/k/v biases, made non-zero), fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    m = _small(Qwen2Config, Qwen2ForCausalLM, seed, tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in m.model.layers:
        for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            p.bias.normal_(generator=gen)
    return m


def gemma(seed=0):
    """A tiny ``GemmaForCausalLM`` (GeGLU tanh MLP, 1 + w RMSNorm, scaled embedding), fp32."""
    from transformers import GemmaConfig, GemmaForCausalLM
    m = _small(GemmaConfig, GemmaForCausalLM, seed, head_dim=16)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(-0.5, 0.5)
    return m


def phi3_fused(seed=0):
    """A tiny ``Phi3ForCausalLM`` (fused qkv and gate_up projections), fp32."""
    from transformers import Phi3Config, Phi3ForCausalLM
    return _small(Phi3Config, Phi3ForCausalLM, seed, pad_token_id=0, eos_token_id=1, bos_token_id=1)


def gpt_neox(seed=0, layers=2):
    """A tiny ``GPTNeoXForCausalLM`` (LayerNorm with bias, parallel residual, partial rotary,
    fused qkv interleaved per head, GELU), fp32."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                        vocab_size=128, max_position_embeddings=256, rotary_pct=0.5,
                        attn_implementation="sdpa")
    return GPTNeoXForCausalLM(cfg).eval().requires_grad_(False)


def olmo(seed=0):
    """A tiny ``OlmoForCausalLM`` (LayerNorms without weight or bias, RoPE in fp32 on q/k cast
    back to the model dtype), fp32."""
    from transformers import OlmoConfig, OlmoForCausalLM
    return _small(OlmoConfig, OlmoForCausalLM, seed, pad_token_id=1, bos_token_id=None, eos_token_id=2)


def olmo2(seed=0):
    """A tiny ``Olmo2ForCausalLM`` (post-norms, q/k RMSNorm over all heads), fp32."""
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return _small(Olmo2Config, Olmo2ForCausalLM, seed)


def granite(seed=0):
    """A tiny ``GraniteForCausalLM`` (embedding, residual, attention and logits multipliers), fp32."""
    from transformers import GraniteConfig, GraniteForCausalLM
    return _small(GraniteConfig, GraniteForCausalLM, seed, embedding_multiplier=2.0, residual_multiplier=0.5,
                  attention_multiplier=0.2, logits_scaling=4.0)


def _nonzero_norms(m, seed=0):
    """Gemma's norm weights (used as 1 + w, zero at init) drawn from [-0.25, 0.25), so that a
    mistake in where they apply shows."""
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) * 0.5 - 0.25)
    return m


def mistral_sw(window=128, seed=0):
    """A tiny ``MistralForCausalLM`` with a ``sliding_window`` (Mistral-7B-v0.1's config has one):
    HF's StaticCache gives it sliding-window layers, which count positions in a Python int
    (fusec.frontend.host_scalars). ``window`` at least the cache length: the window never
    fills; smaller: it fills and HF rolls it."""
    from transformers import MistralConfig, MistralForCausalLM
    return _small(MistralConfig, MistralForCausalLM, seed, head_dim=16, sliding_window=window)


def gemma2(seed=0, window=128):
    """A tiny ``Gemma2ForCausalLM``: alternating sliding and full layers, four norms per layer,
    attention and final-logit softcap, GeGLU. ``window`` below the cache length: the sliding
    layers' window fills and HF rolls it."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return _nonzero_norms(_small(Gemma2Config, Gemma2ForCausalLM, seed, head_dim=16, sliding_window=window), seed)


def llama_eager(seed=3):
    """A tiny Llama (4 heads over 2 KV heads) with ``attn_implementation="eager"``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return _small(LlamaConfig, LlamaForCausalLM, seed, num_key_value_heads=2, attn_implementation="eager")


def gemma2_eager(seed=0, window=128):
    """:func:`gemma2` with ``attn_implementation="eager"`` (HF's recommendation for Gemma-2: its
    attention logit softcap, here 2.0, applies only there) and q/k projections 8x larger, so that
    the scores reach the softcap's bend."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    m = _nonzero_norms(_small(Gemma2Config, Gemma2ForCausalLM, seed, head_dim=16, sliding_window=window,
                              attn_implementation="eager", attn_logit_softcapping=2.0), seed)
    for layer in m.model.layers:
        layer.self_attn.q_proj.weight.mul_(8)
        layer.self_attn.k_proj.weight.mul_(8)
    return m


def gemma3(seed=0, window=128, layers=2):
    """A tiny ``Gemma3ForCausalLM`` (text): sliding and full layers, q/k norms, four norms per layer
    (``layers=6``: Gemma-3's five sliding layers to one full one)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return _nonzero_norms(_small(Gemma3TextConfig, Gemma3ForCausalLM, seed, head_dim=16, sliding_window=window,
                                 num_hidden_layers=layers), seed)


def falcon(seed=0):
    """A tiny ``FalconForCausalLM`` (new decoder architecture: GQA, parallel attention and MLP)."""
    from transformers import FalconConfig, FalconForCausalLM
    torch.manual_seed(seed)
    cfg = FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       new_decoder_architecture=True, num_kv_heads=2, attn_implementation="sdpa")
    return FalconForCausalLM(cfg).eval().requires_grad_(False)


def without_hf_init(factory):
    """``factory`` with HF's own random init (``_init_weights``' normal draws) skipped while it
    builds the model: the weights keep torch's default init (``nn.Linear``'s kaiming uniform,
    ``nn.Embedding``'s normal), random too. For a test at published widths that reads no weight
    value (render and NVRTC only): one Falcon-7B layer (250M fp32 weights) built in 2.1 s instead
    of 4.8 s, since HF drew every weight a second time."""
    def build():
        import transformers.initialization as init
        import pytest
        with pytest.MonkeyPatch.context() as m:
            m.setitem(init.TORCH_INIT_FUNCTIONS, "normal_", lambda t, mean=0.0, std=1.0, generator=None: t)
            return factory()
    return build


def falcon_7b(hidden=64, heads=4, layers=2, ffn=None, seed=0):
    """A tiny ``FalconForCausalLM`` shaped as Falcon-7B (``new_decoder_architecture`` False: ONE
    LayerNorm ``input_layernorm`` read by both the attention and the MLP (``parallel_attn``),
    multi-query attention (one KV head, ``multi_query``), fused ``query_key_value``, no biases,
    GELU MLP of ``ffn`` (default 4 * hidden), residual ``x + attn + mlp``), fp32. Falcon-7B's
    published widths: ``hidden=4544, heads=71`` (head_dim 64), ``ffn`` 18176."""
    from transformers import FalconConfig, FalconForCausalLM
    torch.manual_seed(seed)
    cfg = FalconConfig(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
                       ffn_hidden_size=ffn, attn_implementation="sdpa")
    return FalconForCausalLM(cfg).eval().requires_grad_(False)


def gpt2(seed=0, layers=2, vocab=128):
    """A tiny ``GPT2LMHeadModel`` (learned positions, Conv1D projections, LayerNorm, gelu_new)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=layers, n_head=4, n_positions=256, attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg).eval().requires_grad_(False)


def phi2(seed=0):
    """A tiny ``PhiForCausalLM`` (Phi-1/1.5/2: partial rotary, parallel block, biases)."""
    from transformers import PhiConfig, PhiForCausalLM
    return _small(PhiConfig, PhiForCausalLM, seed, partial_rotary_factor=0.5)


def stablelm(seed=0, partial=0.25):
    """A tiny ``StableLmForCausalLM`` as StableLM-2 (LayerNorm with bias, GQA, partial rotary,
    q/k/v biases made non-zero), fp32."""
    from transformers import StableLmConfig, StableLmForCausalLM
    m = _small(StableLmConfig, StableLmForCausalLM, seed, partial_rotary_factor=partial, use_qkv_bias=True)
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in m.model.layers:
        for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            p.bias.normal_(generator=gen)
    return m


def starcoder2(seed=0):
    """A tiny ``Starcoder2ForCausalLM`` (LayerNorm with bias, GQA, biased projections)."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM
    return _small(Starcoder2Config, Starcoder2ForCausalLM, seed, sliding_window=None)


def phi3_longrope(partial=1.0, original=16, seed=0):
    """A tiny ``Phi3ForCausalLM`` with LongRoPE (Phi-3/3.5-mini 128k; ``partial=0.75`` as Phi-4-mini):
    short factors up to ``original`` positions, long ones past them, fp32."""
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(seed)
    half = int(16 * partial) // 2
    cfg = Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, pad_token_id=0,
                     eos_token_id=1, bos_token_id=1, attn_implementation="sdpa", partial_rotary_factor=partial,
                     original_max_position_embeddings=original,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                      "partial_rotary_factor": partial,
                                      "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                      "long_factor": [2.0 + 0.3 * i for i in range(half)],
                                      "original_max_position_embeddings": original})
    return Phi3ForCausalLM(cfg).eval().requires_grad_(False)


def llama_dynamic_ntk(max_positions=16, seed=0):
    """A tiny ``LlamaForCausalLM`` with dynamic NTK RoPE scaling (factor 2) past ``max_positions``, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=max_positions,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)
