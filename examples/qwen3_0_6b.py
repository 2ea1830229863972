"""Qwen3-0.6B (published configuration, random bf16 weights): one decode step after an 8-token prefill.

A model of Issue 13's table (``benchmarks/decode.py --example examples/qwen3_0_6b.py``):
28 layers of hidden 1024, 16 query / 8 KV heads of 128 (per-head q/k RMSNorm), tied 151936-row
embedding. Widths from the checkpoint's config.json.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

NAME = "Qwen3-0.6B"
CONFIG = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=40960,
    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, attn_implementation="sdpa",
)
MAX_CACHE_LEN, PREFILL_LEN, DTYPE = 4096, 8, torch.bfloat16


def make_config():
    """Return the Qwen3-0.6B ``Qwen3Config``."""
    from transformers import Qwen3Config

    return Qwen3Config(**CONFIG)


def build(device="cpu"):
    """Return ``(model, args, kwargs)`` for one bf16 decode step of a random Qwen3-0.6B on ``device``."""
    return _common.decode_step(make_config(), DTYPE, MAX_CACHE_LEN, PREFILL_LEN, device)
