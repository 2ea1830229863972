"""The batch benchmark's constructed "echo" weights (benchmarks/batch.py ``echo_weights``), CPU.

Issue 32's prompt-lookup row needs text whose drafts are accepted; a random-weight Llama-3.2-1B's
greedy text does not repeat (docs/batch.md), so the bench scales every layer's output projections
of the tied-embedding model until greedy repeats its last token. A tiny random model's greedy text
repeats its last token with or without them (its layers add little to the residual stream at
HF's 0.02 init), so this checks the row's path, not the need: with echo weights HF greedy repeats
the last token, and ``fusec.generate`` with prompt lookup returns exactly those tokens at three or
more tokens per step, on the simulator, without a fallback. The GPU row at the 1B's widths
reports both weights' acceptance.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fusec
import hf_tiny
from fusec.fallbacks import FallbackWatch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import batch  # noqa: E402


def test_echo_weights_repeat_the_last_token_and_prompt_lookup_accepts_its_drafts():
    m = hf_tiny.llama(hidden=128, inter=192, vocab=256, seed=3)
    batch.echo_weights(m, batch.ECHO_SCALE)
    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids),
                         eos_token_id=None, pad_token_id=0)
    assert ref[0, 12:].tolist() == [int(ids[0, -1])] * 24, ref[0, 12:].tolist()
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = fusec.generate(m, ids, 24, prompt_lookup_num_tokens=3, eos_token_id=[])
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert torch.equal(out, ref)
    stats = fusec.prompt_lookup.last_stats
    assert stats["tokens"] == 24 and stats["tokens"] / stats["steps"] >= 3, stats


def test_echo_weights_need_tied_embeddings():
    m = hf_tiny.qwen3()   # its LM head is not the embedding
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        batch.echo_weights(m, batch.ECHO_SCALE)
