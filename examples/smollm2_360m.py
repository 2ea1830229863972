"""SmolLM2-360M (published configuration, random bf16 weights) over a 32768-row KV cache: one
decode step after an 8-token prefill.

Few KV heads (15 query heads over 5 KV heads of 64): its split-KV op is cut into 15 tile groups
of one head up to 4096 rows and runs the capacity's cut (5 groups of 3) past them, the two tile
sets of ``fusec/instructions/attention_sets.py``; 32768 rows is the capacity of HF
``generate()``'s length-polymorphic step (``tools/long_set_ab.sh examples/smollm2_360m.py``).
32 layers of hidden 960, tied 49152-row embedding. Widths from the checkpoint's config.json.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

NAME = "SmolLM2-360M"
CONFIG = dict(
    hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
    num_key_value_heads=5, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, max_position_embeddings=8192,
    tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=2, attn_implementation="sdpa",
)
MAX_CACHE_LEN, PREFILL_LEN, DTYPE = 32768, 8, torch.bfloat16


def make_config():
    """Return the SmolLM2-360M ``LlamaConfig``."""
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def build(device="cpu"):
    """Return ``(model, args, kwargs)`` for one bf16 decode step of a random SmolLM2-360M on ``device``."""
    return _common.decode_step(make_config(), DTYPE, MAX_CACHE_LEN, PREFILL_LEN, device)
