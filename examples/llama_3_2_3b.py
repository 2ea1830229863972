"""Llama-3.2-3B (published configuration, random bf16 weights): one decode step after an 8-token prefill.

A model of Issue 13's table (``benchmarks/decode.py --example examples/llama_3_2_3b.py``): the
1B's configuration with the 3B's widths and depth (hidden 3072, 28 layers, 24 query / 8 KV
heads of 128, FFN 8192, tied embedding).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import llama_3_2_1b as _base  # noqa: E402

NAME = "Llama-3.2-3B"
CONFIG = {**_base.CONFIG, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
          "num_attention_heads": 24, "head_dim": 128}
MAX_CACHE_LEN, PREFILL_LEN, DTYPE = _base.MAX_CACHE_LEN, _base.PREFILL_LEN, _base.DTYPE


def make_config():
    """Return the Llama-3.2-3B ``LlamaConfig`` (llama3 RoPE scaling, theta 500000)."""
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def build(device="cpu"):
    """Return ``(model, args, kwargs)`` for one bf16 decode step of a random Llama-3.2-3B on ``device``."""
    return _common.decode_step(make_config(), DTYPE, MAX_CACHE_LEN, PREFILL_LEN, device)
