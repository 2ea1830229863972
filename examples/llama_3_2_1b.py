"""Llama-3.2-1B (exact configuration, random bf16 weights): one decode step after an 8-token prefill.

The benchmark model of DESIGN.md section 6. ``CONFIG`` / ``make_config()`` are reused by the
benchmarks. Transformers 5 takes RoPE settings as ``rope_parameters`` with ``rope_theta``
inside the dict (left out, theta silently defaults to 10000).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

CONFIG = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    bos_token_id=128000,
    eos_token_id=128001,
    attn_implementation="sdpa",
)
NAME = "Llama-3.2-1B"
MAX_CACHE_LEN = 4096
PREFILL_LEN = 8
DTYPE = torch.bfloat16


def make_config():
    """Return the Llama-3.2-1B ``LlamaConfig`` (llama3 RoPE scaling, theta 500000)."""
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def build(device="cpu"):
    """Return ``(model, args, kwargs)`` for one bf16 decode step of a random Llama-3.2-1B.

    ``device``: where the model, its KV cache and the token live (``fusec compile --run``
    builds it on "cuda").
    """
    return _common.decode_step(make_config(), DTYPE, MAX_CACHE_LEN, PREFILL_LEN, device)
