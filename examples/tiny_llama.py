"""A tiny random Llama (2 layers, hidden 96): one decode step after a 5-token prefill.

Small enough for unit tests and the simulator: ``fusec compile examples/tiny_llama.py``.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

CONFIG = dict(
    hidden_size=96,
    intermediate_size=200,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=True,
    attn_implementation="sdpa",
)
MAX_CACHE_LEN = 64
PREFILL_LEN = 5
DTYPE = torch.float32


def make_config():
    """Return the tiny ``LlamaConfig``."""
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def build(device="cpu"):
    """Return ``(model, args, kwargs)`` for one decode step of the tiny model (fp32, seed 0).

    ``device``: where the model, its KV cache and the token live (``fusec compile --run``
    builds it on "cuda").
    """
    return _common.decode_step(make_config(), DTYPE, MAX_CACHE_LEN, PREFILL_LEN, device)
