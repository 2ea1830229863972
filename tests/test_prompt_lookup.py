"""Prompt-lookup decoding in ``fusec.generate(..., prompt_lookup_num_tokens=N)`` (issue 32, item 2):
drafts found on the device, a K = N + 1 query-token verification step compiled by fusec (no
fallback), and an output equal to greedy decoding's token for token (fusec.prompt_lookup)."""
from __future__ import annotations

import pytest
import torch

import fusec
import hf_tiny
from fusec import prompt_lookup
from fusec.errors import FusecError
from fusec.fallbacks import FallbackWatch


#: options of the tests of the host loop (the buffers kept between calls): 8 SMs, no hazard check
FAST = {"num_sms": 8, "check_hazards": False}


def _varied(seed: int):
    """A tiny Llama (fp32) whose greedy text varies and repeats in part (its own LM head, not
    the tied embedding, which makes a tiny model repeat one token): some drafts are accepted,
    others rejected. Seeds 1, 3 and 5 give 14 to 21 distinct tokens in 48."""
    m = hf_tiny.llama(seed=seed)
    g = torch.Generator().manual_seed(seed)
    m.lm_head.weight = torch.nn.Parameter(torch.randn(m.lm_head.weight.shape, generator=g) * 0.3)
    return m, torch.randint(0, m.config.vocab_size, (1, 12), generator=g)


def _hf_greedy(m, ids, n, eos=None):
    with torch.no_grad():
        return m.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                          eos_token_id=eos, pad_token_id=0)


def _reference_draft(hist: list[int], num: int, max_ngram: int = 2) -> list[int] | None:
    """transformers' PromptLookupCandidateGenerator: the first (earliest) match of the last
    n-gram (largest size first) that has a token after it; the tokens after it, up to num."""
    n = len(hist)
    for size in range(max_ngram, 0, -1):
        if size >= n:
            continue
        tail = hist[n - size:]
        for i in range(n - size + 1):
            if hist[i:i + size] == tail and i + size < n:
                return hist[i + size:i + size + num]
    return None


def test_draft_matches_transformers_lookup_on_random_histories():
    gen = torch.Generator().manual_seed(0)
    checked = matched = 0
    for trial in range(300):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        vocab = int(torch.randint(2, 12, (1,), generator=gen))
        cap = n + 6
        hist = torch.randint(0, vocab, (cap,), generator=gen)   # positions >= n: garbage, ignored
        num = int(torch.randint(1, 7, (1,), generator=gen))
        got = prompt_lookup.draft(hist, torch.tensor([n]), num).tolist()
        ref = _reference_draft(hist[:n].tolist(), num)
        checked += 1
        if ref is not None:
            matched += 1
            assert got[:len(ref)] == ref, (trial, hist[:n].tolist(), num, got, ref)
    assert matched > 100 and checked == 300


def test_accept_counts_leading_matches():
    inp = torch.tensor([5, 7, 8, 9, 1])
    assert int(prompt_lookup.accept(inp, torch.tensor([7, 8, 9, 1, 3]))) == 4
    assert int(prompt_lookup.accept(inp, torch.tensor([7, 8, 2, 1, 3]))) == 2
    assert int(prompt_lookup.accept(inp, torch.tensor([6, 8, 9, 1, 3]))) == 0


@pytest.mark.parametrize("seed,num,options", [(1, 3, FAST), (3, 7, None), (5, 1, FAST)])
def test_prompt_lookup_equals_greedy(seed, num, options, steps, caplog):
    """fusec.generate with prompt lookup returns HF greedy's tokens exactly, in fewer steps
    than tokens (drafts were accepted), with a fusec step of N + 1 query tokens, no fallback
    (N = 7 with the default options: 132 SMs, the hazard check every step)."""
    m, ids = _varied(seed)
    ref = _hf_greedy(m, ids, 32)
    torch._dynamo.reset()
    with FallbackWatch() as w, caplog.at_level("INFO", logger="fusec"):
        out = fusec.generate(m, ids, 32, prompt_lookup_num_tokens=num, eos_token_id=[], options=options)
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert torch.equal(out, ref), (out[0, 12:].tolist(), ref[0, 12:].tolist())
    assert any(s.schedule is not None and s.schedule.graph.query_tokens() == num + 1 for s in steps)
    line = next(r.getMessage() for r in caplog.records if "prompt-lookup steps" in r.getMessage())
    n_steps, accepted = (int(t) for t in
                         (line.split(" in ")[1].split()[0], line.split("(")[1].split()[0]))
    assert 0 < accepted and n_steps < 31 and accepted + n_steps == 31, line


def test_prompt_lookup_stops_at_eos_and_streams_the_same_tokens():
    m, ids = _varied(3)
    full = _hf_greedy(m, ids, 48)[0, 12:].tolist()
    eos = full[20]          # a token first produced after some accepted drafts
    ref = _hf_greedy(m, ids, 48, eos=eos)

    class Streamer:
        def __init__(self):
            self.got = []

        def put(self, t):
            self.got += t.reshape(-1).tolist()

        def end(self):
            self.got.append("end")

    s = Streamer()
    torch._dynamo.reset()
    out = fusec.generate(m, ids, 48, prompt_lookup_num_tokens=4, eos_token_id=eos, streamer=s, options=FAST)
    torch._dynamo.reset()
    assert torch.equal(out, ref) and out[0, -1] == eos
    assert s.got == ids[0].tolist() + out[0, 12:].tolist() + ["end"]


def test_prompt_lookup_argument_errors():
    m, ids = _varied(1)
    for bad in (0, 8, 2.0, True):
        with pytest.raises(FusecError, match="prompt_lookup_num_tokens"):
            fusec.generate(m, ids, 4, prompt_lookup_num_tokens=bad)
    with pytest.raises(FusecError, match="greedy"):
        fusec.generate(m, ids, 4, prompt_lookup_num_tokens=3, do_sample=True)


def test_a_second_n_in_one_process_compiles_its_own_step(steps):
    """N = 1, then N = 2 and N = 3 on the same model in one process: each K = N + 1 is a fusec step
    of its own, no fallback (every K compiles VerifyStep.forward, one code object: before, dynamo
    made the second K's query length symbolic and the step fell back), greedy's tokens each time."""
    m, ids = _varied(1)
    ref = _hf_greedy(m, ids, 10)
    torch._dynamo.reset()
    for num in (1, 2, 3):
        with FallbackWatch() as w:
            out = fusec.generate(m, ids, 10, prompt_lookup_num_tokens=num, eos_token_id=[])
        assert not w.fallbacks and w.compiled == 1, (num, w.fallbacks)
        assert torch.equal(out, ref), num
    torch._dynamo.reset()
    assert sorted(s.schedule.graph.query_tokens() for s in steps if s.schedule is not None) == [2, 3, 4]


def _gptj():
    from test_position import _gptj
    return _gptj(64)


def _opt():
    """A tiny OPT: learned positions looked up at position + 2 (a table of 64 + 2 rows)."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, ffn_dim=128,
                                 vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=64)
    return transformers.OPTForCausalLM(cfg).eval()


@pytest.mark.parametrize("factory", [hf_tiny.gpt2, _gptj, _opt], ids=["gpt2-wpe", "gptj-embed_positions", "opt-offset"])
def test_drafts_stay_inside_a_learned_position_table(factory, caplog):
    """GPT-2's learned positions (``wpe``, ``n_positions`` rows), GPT-J's sinusoidal table (a
    buffer indexed by the position) and OPT's learned table of 2 more rows (read at position +
    2): near the table's end the drafts
    per step shrink so that the verification rows stay inside it (greedy reads positions up to
    prompt + max_new_tokens - 1 only); with no room left generation is one token per step; the
    tokens are greedy's either way (before: IndexFaultError on wpe; on GPT-J's and OPT's tables,
    which the check did not see, an index error, until 2026-12-07)."""
    m = factory()
    rows = m.config.max_position_embeddings
    g = torch.Generator().manual_seed(4)
    for prompt, num, fit in ((rows - 10, 6, 4), (rows - 6, 3, 0)):
        ids = torch.randint(1, m.config.vocab_size, (1, prompt), generator=g)
        ref = _hf_greedy(m, ids, 6)
        torch._dynamo.reset()
        caplog.clear()
        with caplog.at_level("INFO", logger="fusec"):
            out = fusec.generate(m, ids, 6, prompt_lookup_num_tokens=num, eos_token_id=[])
        torch._dynamo.reset()
        assert torch.equal(out, ref), (prompt, num)
        assert any(f"prompt_lookup_num_tokens: {num} drafts per step -> {fit}" in r.getMessage()
                   for r in caplog.records)


def test_later_calls_reuse_the_buffers_where_they_fit_and_equal_greedy():
    """A model keeps its last prompt-lookup call's cache and decoder state (on CUDA also its
    captured graph, ``prompt_lookup._Session``): a later call with the same N whose rows fit
    resets them in place and runs on them, a call that needs more rows or another N, or after a
    weight moved to new memory, gets new ones; every call's tokens are greedy's (the reset leaves
    nothing of the call before: a shorter prompt after a longer one, the same prompt again)."""
    m, ids = _varied(3)
    other = torch.randint(0, m.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(9))
    torch._dynamo.reset()

    def run(x, n, num=3):   # the simulator's hazard check is not the point here
        out = fusec.generate(m, x, n, prompt_lookup_num_tokens=num, eos_token_id=[], options=FAST)
        assert torch.equal(out, _hf_greedy(m, x, n, eos=[])), (x.shape, n, num)
        st = prompt_lookup.last_stats   # this call's counts (the first token is the prefill's)
        assert st["tokens"] == n and st["steps"] + st["accepted"] == n - 1, (st, n)
        session = m._fusec_generate_steps.get(prompt_lookup.SESSION)
        assert int(session.dec.limit) == x.shape[1] + n and int(session.dec.n) == x.shape[1] + n
        return session

    with FallbackWatch() as w:
        first = run(ids, 24)
        assert run(other, 10) is first                 # fits: the same buffers, reset
        assert run(ids, 24) is first                   # the first call again, after the other
        bigger = run(ids, 60)                          # 12 + 60 + 4 rows pass the first 64
        assert bigger is not first and bigger.max_len > first.max_len
        assert run(other, 10, num=2) is not bigger     # another N: another step, other buffers
        kept = run(other, 10, num=2)
        with torch.no_grad():                          # a weight moved to new memory
            m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.clone())
        assert run(other, 10, num=2) is not kept
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
