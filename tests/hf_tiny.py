"""Tiny Hugging Face decoder models for tests (fp32, random weights, static KV cache)."""
from __future__ import annotations

import torch


def llama(hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0):
    """A tiny ``LlamaForCausalLM`` with llama3 RoPE scaling, fp32, eval mode."""
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


def qwen3(hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0):
    """A tiny ``Qwen3ForCausalLM`` (per-head q/k RMSNorm), fp32, eval mode."""
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
