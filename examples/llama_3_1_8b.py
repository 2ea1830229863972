"""Llama-3.1-8B (exact configuration, random bf16 weights): one decode step after an 8-token prefill.

The second model of the compile-time rows of ``make bench`` (``benchmarks/decode.py
--compile-models examples/llama_3_1_8b.py``). 16 GB of bf16 weights: build it on the GPU
(``build(device="cuda")``); on a CPU, building and capturing it needs well over 32 GB of memory.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import llama_3_2_1b as _base  # noqa: E402

#: the 1B's configuration with the 8B's widths, depth, untied head and RoPE scaling factor
CONFIG = {**_base.CONFIG, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
          "head_dim": 128, "tie_word_embeddings": False,
          "rope_parameters": {**_base.CONFIG["rope_parameters"], "factor": 8.0}}
NAME = "Llama-3.1-8B"
MAX_CACHE_LEN, PREFILL_LEN, DTYPE = _base.MAX_CACHE_LEN, _base.PREFILL_LEN, _base.DTYPE


def make_config():
    """Return the Llama-3.1-8B ``LlamaConfig`` (llama3 RoPE scaling, factor 8, theta 500000)."""
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def build(device="cuda"):
    """Return ``(model, args, kwargs)`` for one bf16 decode step of a random Llama-3.1-8B on ``device``."""
    return _common.decode_step(make_config(), DTYPE, MAX_CACHE_LEN, PREFILL_LEN, device)
