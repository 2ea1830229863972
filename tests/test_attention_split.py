"""Split-KV attention: the run-time even split of the valid cache rows over the tiles of a KV
head (fusec.instructions.attention.split_rows), on the CPU simulator against eager."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.instructions.attention import split_rows


@pytest.mark.parametrize("n_chunks,chunk,length", [(16, 256, 4096), (3, 16, 40), (5, 16, 70)])
def test_splits_cover_the_valid_rows_within_the_chunk_bound(n_chunks, chunk, length):
    for pos in range(length):
        spans = [split_rows(c, pos, n_chunks) for c in range(n_chunks)]
        assert spans[0][0] == 0 and spans[-1][1] == pos + 1
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))          # contiguous, disjoint
        assert all(0 <= r1 - r0 <= chunk for r0, r1 in spans)               # fits the score buffer
        assert max(r1 - r0 for r0, r1 in spans) - min(r1 - r0 for r0, r1 in spans) <= 1


def test_decode_from_an_empty_cache_with_empty_splits():
    """Positions 0..5 with 3 splits per KV head: the first steps leave splits empty."""
    model = hf_tiny.llama(heads=8, kv_heads=2, head_dim=8)
    vocab = model.config.vocab_size
    ours, ref = hf_tiny.static_cache(model, 40), hf_tiny.static_cache(model, 40)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 24})
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for step in range(6):
            tok = torch.randint(0, vocab, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=ours, use_cache=True).logits
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < 1e-4, f"position {step}: relative error {rel:.2e}"
    torch._dynamo.reset()
