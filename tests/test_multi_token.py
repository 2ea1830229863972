"""Steps of K > 1 query tokens per sequence (speculative decoding's verification of K draft
tokens over a StaticCache) through torch.compile(backend="fusec"), on the CPU simulator: eager's
logits of every one of the K rows and eager's caches, one fusec step, no fallback
(docs/batch.md, "Several query tokens (K > 1)")."""
from __future__ import annotations

import logging

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch

#: prompt lengths prefilled before the K-token steps (one compiled step serves them all)
PROMPTS = (3, 9, 17)


def _ops(g):
    """Every op of a schedule's graph, chains opened."""
    return [o for o in g.ops for o in ([o] if o.kind != "chain" else o.attrs["ops"])]


#: the option that lets a compiled step take K > 1 query tokens (default 1: fusec.config.Options)
OPTS = {"query_tokens": 8}


def k_steps_against_eager(model, k: int, seed: int, prompts=PROMPTS, length: int = 32):
    """For each prompt length of ``prompts``: a random prompt prefilled eagerly on two
    StaticCaches of ``length`` rows, then one step of ``k`` random tokens and one of a single
    token, each through ``torch.compile(model, backend="fusec", options=OPTS)`` and eagerly:
    (the largest relative logits error of any one query row of any step, the FallbackWatch, the
    largest relative error of the caches after the steps)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options=OPTS)
    err, cache_err = 0.0, 0.0
    with FallbackWatch() as w, torch.no_grad():
        for n in prompts:
            caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
            prompt = torch.randint(0, vocab, (1, n), generator=gen)
            for c in caches:
                model(input_ids=prompt, past_key_values=c, use_cache=True)
            for kk in (k, 1):   # the single-token step continues at position n + k
                tok = torch.randint(0, vocab, (1, kk), generator=gen)
                a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits.double()
                b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits.double()
                assert a.shape == (1, kk, vocab)
                # every query row on its own: a row that attends wrong hides in the norm of K rows
                err = max([err] + [((a[0, i] - b[0, i]).norm() / b[0, i].norm()).item() for i in range(kk)])
            for la, lb in zip(caches[0].layers, caches[1].layers):
                assert int(la.cumulative_length) == int(lb.cumulative_length) == n + k + 1
                for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
                    cache_err = max(cache_err, ((x - y).abs().max() / y.abs().max()).item())
    torch._dynamo.reset()
    return err, w, cache_err


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_k_token_steps_match_eager(factory, k, steps):
    """After prompts of 3, 9 and 17 tokens, a step of K random tokens then one of a single token
    (:func:`k_steps_against_eager`): every one of the K logits rows and the caches equal eager's;
    the K-token step is one fusec step (no fallback) whose attention reads HF's causal mask over
    the cache [1, 1, K, L] (``mask_kind`` 1, the GQA expand not materialized) and whose KV writes
    take K rows, with every op generic (no fused kind takes K rows); the single-token step after
    it lowers to the fused kinds as before."""
    model = factory(seed=k)
    err, w, cache_err = k_steps_against_eager(model, k, 3 * k + (factory is hf_tiny.qwen3))
    assert err < 1e-5, err
    assert cache_err < 1e-5, cache_err
    assert not w.fallbacks and w.compiled == 2, (w.fallbacks, w.compiled)
    assert len(steps) == 2 and not any(s.fallen_back for s in steps)
    assert sum(s.calls for s in steps) == 2 * len(PROMPTS)
    multi, single = (steps if steps[0].schedule.graph.query_tokens() == k else steps[::-1])
    g = multi.schedule.graph
    assert g.query_tokens() == k and g.rows() == k and g.batch() == 1
    ops = _ops(g)
    att = [o for o in ops if o.kind == "attention"]
    assert len(att) == model.config.num_hidden_layers
    L = 32
    assert all(o.attrs["mask_kind"] == 1 and tuple(g.tensors[o.inputs["mask"]].shape) == (1, 1, k, L)
               for o in att)
    kw = [o for o in ops if o.kind == "kv_write"]
    assert len(kw) == 2 * model.config.num_hidden_layers
    assert all(g.tensors[o.inputs["pos"]].numel == k for o in kw)
    kinds = g.count_kinds()
    assert "fusec.sdpa.default" not in kinds and "aten.index_put.default" not in kinds
    fused = {"attention_partial", "rms_qkv_rope", "matvec", "matvec_residual", "matvec_group",
             "rms_gate_up_silu", "rms_lm_head", "embedding"}
    assert not fused & set(kinds), kinds
    one = single.schedule.graph
    assert one.query_tokens() == 1 and {"attention_partial", "rms_qkv_rope", "rms_lm_head"} <= set(one.count_kinds())


@pytest.mark.parametrize("factory", [hf_tiny.gpt2, hf_tiny.gemma2, hf_tiny.falcon, hf_tiny.phi2, hf_tiny.olmo2])
def test_k_token_steps_of_other_families_match_eager(factory, steps):
    """Families whose layers differ from Llama's (LayerNorm and Conv1D: GPT-2; sliding and full
    layers, softcaps: Gemma-2; a parallel block: Falcon, Phi-2 with partial RoPE; q/k norms over
    the whole projection: OLMo-2): a K = 4 step after a prompt of 5 tokens, then a single-token
    step: every row's logits and the caches equal eager's, one fusec step each, no fallback."""
    err, w, cache_err = k_steps_against_eager(factory(), 4, 11, prompts=(5,))
    assert err < 1e-5 and cache_err < 1e-5, (err, cache_err)
    assert not w.fallbacks and w.compiled == 2, (w.fallbacks, w.compiled)
    assert sorted(s.schedule.graph.query_tokens() for s in steps) == [1, 4]
    assert not any(s.fallen_back for s in steps)


def test_rows_and_query_tokens_of_a_decode_step():
    """``Graph.rows()`` is B * K, ``Graph.query_tokens()`` K, ``Graph.batch()`` B, recorded off the
    attention queries [B, Hq, K, D] when the graph is built (``Graph.record_rows``) and kept by
    copies and the artifact cache's graph text once the attention is another kind's op or gone
    (the ``fuse`` pass makes it ``attention_partial``)."""
    from fusec.cache.artifacts import graph_text
    from fusec.ir import Graph, Op
    g = Graph()
    q = g.new_tensor("q", (3, 4, 5, 16), torch.float32)
    out = g.new_tensor("out", (3, 4, 5, 16), torch.float32)
    g.ops.append(Op("att", "attention", {"q": q}, {"out": out}))
    g.record_rows()
    assert (g.batch(), g.query_tokens(), g.rows()) == (3, 5, 15)
    for kind in ("attention_partial", "rms_qkv_rope"):
        g.ops[0].kind = kind
        assert (g.batch(), g.query_tokens(), g.rows()) == (3, 5, 15)
    g.ops = []
    c = g.copy()
    assert (c.batch(), c.query_tokens(), c.rows()) == (3, 5, 15)
    assert "rows 3 5" in graph_text(c) and "rows 1 1" in graph_text(Graph())
    assert (Graph().batch(), Graph().query_tokens(), Graph().rows()) == (1, 1, 1)


def test_batch_step_folds_only_into_batched_matvecs_after_its_attention_is_rewritten():
    """The ``prologue`` pass folds into the matvecs of a batch step (B = 2, OLMo-2: its post-norm
    and residual add before the MLP) only where they compute all B rows (``batch`` 2: the
    prologue runs over the B rows, docs/batch.md), even where no ``attention`` op is left to read
    B off (a kind that takes a batch's attention replaces it: here its kind is renamed): B is the
    graph's, recorded at capture."""
    import hf_tiny
    import step_util
    from fusec.config import Options
    from fusec.ir import Role
    from fusec.ir.position import MAX_KNOWN_WEIGHT
    from fusec.passes import prologue
    from fusec.pipeline import ValueReads, stages
    model = hf_tiny.olmo2()
    cache = hf_tiny.static_cache(model, 16)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 128, (2, 4), generator=gen), past_key_values=cache, use_cache=True)
    mask = torch.zeros(2, 16, dtype=torch.long)
    mask[:, :5] = 1
    kw = {"input_ids": torch.randint(1, 128, (2, 1), generator=gen), "past_key_values": cache, "use_cache": True,
          "attention_mask": mask, "position_ids": torch.full((2, 1), 4)}
    _, g, flat = step_util.capture(model, kw)
    assert (g.batch(), g.rows()) == (2, 2)
    weights = ValueReads({n: a for n, a in zip(g.inputs, flat)
                          if g.tensors[n].role == Role.WEIGHT and a.numel() <= MAX_KNOWN_WEIGHT})
    g = g.copy()
    for stage in stages(Options.from_dict({"num_sms": 132}), "sim", weights):
        if stage.name == "prologue":   # the passes before it, as lowering runs them
            break
        g = stage.run(g)
    atts = [o for o in g.ops if o.kind.startswith("attention")]
    assert atts
    for o in atts:
        o.kind = "taken"   # no attention kind left to read B off
    assert (g.batch(), g.rows()) == (2, 2)
    g = prologue.run(g)
    pre = [o for o in g.ops if "pre" in o.attrs]
    assert pre and all(o.kind == "matvec" and o.attrs.get("batch") == 2 for o in pre)


def test_query_length_that_varies_or_exceeds_eight_falls_back_with_a_line(caplog):
    """A K = 2 step runs fusec; then K = 3 on the same compiled model (dynamo recompiles with
    the query length symbolic) falls back with one line saying the query length varies, and a
    prefill of 12 tokens (more than 8) falls back with a line naming its length; every call
    still equals eager."""
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(9)
    caches = [hf_tiny.static_cache(model, 48) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options=OPTS)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fusec"), FallbackWatch() as w:
        prompt = torch.randint(0, 128, (1, 4), generator=gen)
        for c in caches:
            model(input_ids=prompt, past_key_values=c, use_cache=True)
        for k in (2, 3):
            tok = torch.randint(0, 128, (1, k), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            assert ((a - b).norm() / b.norm()).item() < 1e-5
        assert len(w.fallbacks) == 1, w.fallbacks
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusec", options=OPTS)
        fresh = [hf_tiny.static_cache(model, 48) for _ in range(2)]
        prompt = torch.randint(0, 128, (1, 12), generator=gen)
        a = compiled(input_ids=prompt, past_key_values=fresh[0], use_cache=True).logits
        b = model(input_ids=prompt, past_key_values=fresh[1], use_cache=True).logits
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    torch._dynamo.reset()
    assert w.compiled == 1 and len(w.fallbacks) == 2, (w.compiled, w.fallbacks)
    msgs = [r.message for r in caplog.records if "not a decode step of at most 8 query tokens" in r.message]
    assert len(msgs) == 2, msgs
    assert "(a query length that varies)" in msgs[0], msgs
    assert "(12 query tokens, more than 8)" in msgs[1], msgs


def test_by_default_a_short_prefill_falls_back_as_before(caplog):
    """With default options (``query_tokens`` 1) a 4-token call (a short prefill through the
    compiled model has the graph of a K = 4 step) falls back with one line naming the option,
    equal to eager, and the decode step after it compiles in fusec."""
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(12)
    caches = [hf_tiny.static_cache(model, 32) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fusec"), FallbackWatch() as w:
        for n in (4, 1):
            tok = torch.randint(0, 128, (1, n), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            assert ((a - b).norm() / b.norm()).item() < 1e-5
    torch._dynamo.reset()
    assert w.compiled == 1 and len(w.fallbacks) == 1, (w.compiled, w.fallbacks)
    assert "(4 query tokens, more than 1; option query_tokens=4 takes it" in w.fallbacks[0]


def test_hf_assisted_decoding_refuses_a_static_cache():
    """HF's assisted decoding (prompt lookup) never reaches a compiled K-token step: it refuses
    static caches (``cache_implementation="static"``) with a ValueError, and with its dynamic
    cache generate() does not compile (a DynamicCache is not compileable) and calls the plain
    forward. If HF starts to accept static caches here, this test fails: then test that
    generate(prompt_lookup_num_tokens=...) runs fusec's K-token steps (docs/batch.md)."""
    from transformers.generation import CompileConfig
    model = hf_tiny.llama()
    cc = CompileConfig(backend="fusec")
    cc._compile_all_devices = True
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="not supported with Static cache"):
        model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=6, do_sample=False,
                       cache_implementation="static", compile_config=cc)


def test_k_token_kernel_compiles_with_nvrtc(steps):
    """The K = 4 step's megakernel (the K-row linears, the K-row KV writes, the attention of K
    query tokens per head under the causal mask) renders and compiles for sm_90a without
    register spills, fp32 and bf16."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    for dtype in (torch.float32, torch.bfloat16):
        model = hf_tiny.llama().to(dtype)
        caches = hf_tiny.static_cache(model, 32)
        gen = torch.Generator().manual_seed(6)
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 5), generator=gen), past_key_values=caches, use_cache=True)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="fusec", options=OPTS)
            compiled(input_ids=torch.randint(0, 128, (1, 4), generator=gen), past_key_values=caches, use_cache=True)
        torch._dynamo.reset()
        step = steps[-1]
        assert step.schedule.graph.query_tokens() == 4
        src = render(step.schedule).source
        assert "const int b_ = h / 16, k_ = h % 4;" in src   # attention per (head, query token)
        kernel = compile_cuda(src, "fusec_step.cu")
        assert kernel.resources["fusec_step"]["spill_store_bytes"] == 0
