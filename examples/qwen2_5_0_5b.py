"""Qwen2.5-0.5B (published configuration, random bf16 weights) over a 32768-row KV cache: one
decode step after an 8-token prefill.

Few KV heads (14 query heads over 2 KV heads of 64, q/k/v biases): its split-KV op is cut into
14 tile groups of one head at short positions and runs the capacity's cut (2 groups of 7) past
4608 rows, the two tile sets of ``fusec/instructions/attention_sets.py``. 32768 rows is the
capacity of HF ``generate()``'s and ``fusec.generate``'s length-polymorphic step
(``benchmarks/variants.py --example examples/qwen2_5_0_5b.py --positions 100 3000 16000``).
24 layers of hidden 896, tied 151936-row embedding. Widths from the checkpoint's config.json.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

NAME = "Qwen2.5-0.5B"
CONFIG = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=32768,
    tie_word_embeddings=True, use_sliding_window=False, bos_token_id=151643, eos_token_id=151643,
    attn_implementation="sdpa",
)
MAX_CACHE_LEN, PREFILL_LEN, DTYPE = 32768, 8, torch.bfloat16


def make_config():
    """Return the Qwen2.5-0.5B ``Qwen2Config``."""
    from transformers import Qwen2Config

    return Qwen2Config(**CONFIG)


def build(device="cpu"):
    """Return ``(model, args, kwargs)`` for one bf16 decode step of a random Qwen2.5-0.5B on ``device``."""
    return _common.decode_step(make_config(), DTYPE, MAX_CACHE_LEN, PREFILL_LEN, device)
