"""Steps of K > 1 query tokens per sequence (speculative decoding's verification of K draft
tokens over a StaticCache) through torch.compile(backend="fusec"), on the CPU simulator: eager's
logits of every one of the K rows and eager's caches, one fusec step, no fallback
(docs/batch.md, "Several query tokens (K > 1)"). The step's q/k/v (with RoPE and the K-row KV
writes) and gate/up are the fused kinds ``rms_qkv_rope`` and ``rms_gate_up_silu`` of its B·K rows
(tests/test_batch_tokens_fused.py), its other linears batched matvecs of the B·K rows, and its
attention the split-KV ``attention_partial`` with
the K query rows of a head as more query heads of its KV head's group, each under its own row
of HF's causal mask ``[B, 1, K, L]``; NVRTC compiles them without spills at Llama-3.2-1B's
widths."""
from __future__ import annotations

import logging

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch
from fusec.ir import Graph, Op, Role, TensorInfo

#: prompt lengths prefilled before the K-token steps (one compiled step serves them all)
PROMPTS = (3, 9, 17)


def _ops(g):
    """Every op of a schedule's graph, chains opened."""
    return [o for o in g.ops for o in ([o] if o.kind != "chain" else o.attrs["ops"])]


#: the option that lets a compiled step take K > 1 query tokens (default 1: fusec.config.Options)
OPTS = {"query_tokens": 8}


def k_steps_against_eager(model, k: int, seed: int, prompts=PROMPTS, length: int = 32, options: dict | None = None):
    """For each prompt length of ``prompts``: a random prompt prefilled eagerly on two
    StaticCaches of ``length`` rows, then one step of ``k`` random tokens and one of a single
    token, each through ``torch.compile(model, backend="fusec", options=OPTS)`` (and ``options``) and eagerly:
    (the largest relative logits error of any one query row of any step, the FallbackWatch, the
    largest relative error of the caches after the steps)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={**OPTS, **(options or {})})
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


#: cache rows of the K-token tests: with a mask every row is split, FUSEC_ATTN_SPLIT_ROWS (32) makes
#: 3 splits of a group take rows, so the merge of a head's partials runs (and some splits are masked whole)
LENGTH = 96


def tiles_of(step, name: str) -> int:
    """The instructions (tiles) of op ``name`` in ``step``'s schedule."""
    return sum(1 for ins in step.schedule.instrs if ins.op == name)


def _k_token_kinds(step, model, k: int, batch: int = 1) -> None:
    """The K-token step's ops are the fused kinds over its B·K rows: no ``linear`` left; each
    layer's q/k/v with their RMSNorm, RoPE and the K-row KV writes one ``rms_qkv_rope`` and its
    gate/up with their norm and SiLU product one ``rms_gate_up_silu`` (``batch`` B·K, the former
    ``tokens`` K: no ``rope``, ``kv_write`` or q/k/v ``permute`` left), the o and down projections
    ``matvec_residual`` and the lm_head a ``matvec`` with the final norm its prologue (``batch``
    B·K); each attention an ``attention_partial`` (``query_tokens`` K, ``mask_rows`` B·K, HF's
    bool mask [B, 1, K, L]) of several splits per query-head group over B·Hkv KV heads and
    B·Hq·K query rows whose merge writes the output transposed to [B, K, Hq, D] (``out_tokens``:
    the o projection reads it, no permute between them)."""
    g = step.schedule.graph
    cfg = model.config
    layers = cfg.num_hidden_layers
    assert (g.query_tokens(), g.batch(), g.rows()) == (k, batch, batch * k)
    ops = _ops(g)
    kinds = g.count_kinds()
    assert "linear" not in kinds and "attention" not in kinds and "fusec.sdpa.default" not in kinds, kinds
    assert not {"rope", "kv_write", "silu_mul", "rmsnorm"} & {o.kind for o in ops}, kinds
    # the q/k/v permutes are rms_qkv_rope's own: none left in a layer (B > 1: the rotary embedding's
    # transpose of its positions' product, once in front of the layers)
    assert not [o.source for o in ops if o.kind == "aten.permute.default" and o.layer is not None]
    mv = [o for o in ops if o.kind in ("matvec", "matvec_residual")]
    assert len(mv) == 2 * layers + 1 and all(o.attrs.get("batch") == batch * k for o in mv)
    normed = [o for o in mv if o.attrs.get("pre") and o.attrs["pre"][-1].kind == "rmsnorm"]
    assert len(normed) == 1, [o.name for o in normed]   # the lm_head's final norm
    qkv = [o for o in ops if o.kind == "rms_qkv_rope"]
    mlp = [o for o in ops if o.kind == "rms_gate_up_silu"]
    assert len(qkv) == len(mlp) == layers
    assert all(o.attrs["batch"] == batch * k and o.attrs["tokens"] == k for o in qkv)
    assert all(o.attrs["batch"] == batch * k for o in mlp)
    for o in qkv:   # q as the rope made it, [B, Hq, K, D]; the caches written at K positions
        assert tuple(g.tensors[o.outputs["q"]].shape) == (batch, cfg.num_attention_heads, k, cfg.head_dim)
        assert g.tensors[o.inputs["kv_pos"]].numel == k
    emb = [o for o in g.ops if o.kind == "embedding"]
    assert len(emb) == 1 and tiles_of(step, emb[0].name) == batch * k
    att = [o for o in ops if o.kind == "attention_partial"]
    assert len(att) == layers
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    tiles: dict[str, int] = {}
    for ins in step.schedule.instrs:
        tiles[ins.op] = tiles.get(ins.op, 0) + 1
    assert all(tiles[o.name] > 1 for o in qkv + mlp)
    # the o projection reads the attention's output itself (no permute between them)
    assert {g.root(o.outputs["out"]) for o in att} <= {g.root(m.inputs["x"]) for m in mv if "x" in m.inputs}
    for o in att:
        a = o.attrs
        assert a["query_tokens"] == k and a["mask_rows"] == batch * k, a
        assert a["out_tokens"] and tuple(g.tensors[o.outputs["out"]].shape) == (batch, k, hq, cfg.head_dim)
        assert a["n_q"] == batch * hq * k and a["n_kv"] == batch * hkv and a.get("batch", 1) == batch
        if batch == 1:   # HF's causal mask proven: the K write positions are the mask (mask_kind 3)
            assert a["mask_kind"] == 3 and o.inputs["mask"] == o.inputs["pos"], a
            assert g.tensors[o.inputs["mask"]].numel == k and g.tensors[o.inputs["mask"]].dtype == torch.int64
        else:            # left-padded prompts: each sequence's mask rows, over rows 0 .. pos[K - 1]
            assert a["mask_kind"] == 1 and a.get("mask_bound") and o.inputs["pos"] != o.inputs["mask"], a
            assert g.tensors[o.inputs["pos"]].numel == k and g.tensors[o.inputs["pos"]].dtype == torch.int64
            assert tuple(g.tensors[o.inputs["mask"]].shape) == (batch, 1, k, LENGTH)
        groups = a["n_kv"] * a.get("q_groups", 1)
        assert a["n_chunks"] > 1 and tiles[o.name] == groups * a["n_chunks"]


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_k_token_steps_match_eager(factory, k, steps):
    """After prompts of 3, 9 and 17 tokens, a step of K random tokens then one of a single token
    over a 96-row StaticCache (:func:`k_steps_against_eager`): every one of the K logits rows
    and the caches (the K rows each step writes) equal eager's; the K-token step is one fusec
    step (no fallback) whose linears are batched matvecs of the K rows with the norms as their
    prologues and whose attention is the split-KV ``attention_partial`` reading HF's causal
    mask over the cache [1, 1, K, L] row by row (:func:`_k_token_kinds`); the single-token step
    after it lowers to the fused kinds of batch 1 as before."""
    model = factory(seed=k)
    err, w, cache_err = k_steps_against_eager(model, k, 3 * k + (factory is hf_tiny.qwen3), length=LENGTH)
    assert err < 1e-5, err
    assert cache_err < 1e-5, cache_err
    assert not w.fallbacks and w.compiled == 2, (w.fallbacks, w.compiled)
    assert len(steps) == 2 and not any(s.fallen_back for s in steps)
    assert sum(s.calls for s in steps) == 2 * len(PROMPTS)
    multi, single = (steps if steps[0].schedule.graph.query_tokens() == k else steps[::-1])
    _k_token_kinds(multi, model, k)
    one = single.schedule.graph
    assert one.query_tokens() == 1 and {"attention_partial", "rms_qkv_rope", "rms_lm_head"} <= set(one.count_kinds())


def batch_k_steps_against_eager(model, batch: int, k: int, seed: int, length: int = LENGTH):
    """Left-padded random prompts of different lengths (``test_batch_decode.LENGTHS``) prefilled
    eagerly on two StaticCaches of ``length`` rows, then a step of ``k`` random tokens per
    sequence and one of a single token, with the cache-length ``attention_mask`` [B, L] and
    per-sequence ``position_ids`` [B, k], each through ``torch.compile(model, backend="fusec",
    options=OPTS)`` and eagerly: (the largest relative logits error of any query row of any
    sequence, the FallbackWatch, the largest relative error of the caches)."""
    from test_batch_decode import _left_padded
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids, mask = _left_padded(model, batch, gen)
    caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options=OPTS)
    err, cache_err = 0.0, 0.0
    with FallbackWatch() as w, torch.no_grad():
        for c in caches:
            model(input_ids=ids, attention_mask=mask, past_key_values=c, use_cache=True)
        for kk in (k, 1):
            tok = torch.randint(1, vocab, (batch, kk), generator=gen)
            pos = mask.sum(-1, keepdim=True) + torch.arange(kk)
            mask = torch.cat([mask, torch.ones(batch, kk, dtype=torch.long)], 1)
            full = torch.zeros(batch, length, dtype=torch.long)
            full[:, : mask.shape[1]] = mask
            kw = dict(attention_mask=full, position_ids=pos, use_cache=True)
            a = compiled(input_ids=tok, past_key_values=caches[0], **kw).logits.double()
            b = model(input_ids=tok, past_key_values=caches[1], **kw).logits.double()
            assert a.shape == (batch, kk, vocab)
            err = max([err] + [((a[s, i] - b[s, i]).norm() / b[s, i].norm()).item()
                               for s in range(batch) for i in range(kk)])
        for la, lb in zip(caches[0].layers, caches[1].layers):
            for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
                cache_err = max(cache_err, ((x - y).abs().max() / y.abs().max()).item())
    torch._dynamo.reset()
    return err, w, cache_err


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_batch_of_k_token_steps_matches_eager(factory, steps):
    """B = 2 left-padded sequences, a step of K = 4 tokens each, then a single-token step
    (:func:`batch_k_steps_against_eager`): every query row of every sequence and the caches equal
    eager's, no fallback; the K-token step's 8 rows are batched matvecs and its attention
    ``attention_partial`` over the 2·Hkv KV heads with each query row under its sequence's row
    of the mask [2, 1, 4, L] (``mask_rows`` 8, :func:`_k_token_kinds`)."""
    model = factory(seed=5)
    err, w, cache_err = batch_k_steps_against_eager(model, 2, 4, 21 + (factory is hf_tiny.qwen3))
    assert err < 1e-5 and cache_err < 1e-5, (err, cache_err)
    assert not w.fallbacks and w.compiled == 2, (w.fallbacks, w.compiled)
    assert len(steps) == 2 and not any(s.fallen_back for s in steps)
    multi = next(s for s in steps if s.schedule.graph.query_tokens() == 4)
    _k_token_kinds(multi, model, 4, batch=2)


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
    """The ``prologue`` pass folds into the matvec kinds of a batch step (B = 2, OLMo-2: its
    post-norm and residual add before the MLP, a batched ``rms_gate_up_silu``; its final norm
    into the lm_head) only where they compute all B rows (``batch`` 2: the
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
    assert pre and all(o.kind in ("matvec", "rms_gate_up_silu") and o.attrs.get("batch") == 2 for o in pre)


def _prefilled_pair(model, length: int, prompt: torch.Tensor) -> list:
    """Two StaticCaches of ``length`` rows with ``prompt`` prefilled eagerly in each (one for the
    compiled model, one for eager)."""
    caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
    for c in caches:
        model(input_ids=prompt, past_key_values=c, use_cache=True)
    return caches


def _same_step(compiled, model, caches: list, tok: torch.Tensor) -> None:
    """One step of ``tok`` through ``compiled`` and eagerly on the two caches: equal logits."""
    a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
    b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
    assert ((a - b).norm() / b.norm()).item() < 1e-5


def test_query_length_that_varies_or_exceeds_eight_falls_back_with_a_line(caplog):
    """A K = 2 step runs fusec; then K = 3 on the same compiled model (dynamo recompiles with
    the query length symbolic) falls back with one line saying the query length varies, and a
    prefill of 12 tokens (more than 8) falls back with a line naming its length; every call
    still equals eager."""
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(9)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options=OPTS)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fusec"), FallbackWatch() as w:
        caches = _prefilled_pair(model, 48, torch.randint(0, 128, (1, 4), generator=gen))
        for k in (2, 3):
            _same_step(compiled, model, caches, torch.randint(0, 128, (1, k), generator=gen))
        assert len(w.fallbacks) == 1, w.fallbacks
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusec", options=OPTS)
        fresh = [hf_tiny.static_cache(model, 48) for _ in range(2)]
        _same_step(compiled, model, fresh, torch.randint(0, 128, (1, 12), generator=gen))
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
            _same_step(compiled, model, caches, torch.randint(0, 128, (1, n), generator=gen))
    torch._dynamo.reset()
    assert w.compiled == 1 and len(w.fallbacks) == 1, (w.compiled, w.fallbacks)
    assert "(4 query tokens, more than 1; a prompt's prefill runs outside fusec" in w.fallbacks[0]
    assert "speculative decoding takes option query_tokens=4" in w.fallbacks[0]


def test_hf_assisted_decoding_refuses_a_static_cache():
    """HF's own assisted decoding (prompt lookup; fusec's option ``generate_loop="hf"`` keeps it)
    never reaches a compiled K-token step: it refuses static caches
    (``cache_implementation="static"``) with a ValueError, and with its dynamic cache generate()
    does not compile (a DynamicCache is not compileable) and calls the plain forward. By default
    fusec runs such a call as fusec.generate's prompt lookup instead
    (tests/test_hf_device_loop.py). If HF starts to accept static caches here, this test fails:
    then compare HF's path with fusec's (docs/batch.md)."""
    from transformers.generation import CompileConfig
    model = hf_tiny.llama()
    cc = CompileConfig(backend="fusec", options={"generate_loop": "hf"})
    cc._compile_all_devices = True
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="not supported with Static cache"):
        model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=6, do_sample=False,
                       cache_implementation="static", compile_config=cc)


def test_k_token_step_with_the_reduce_merge_matches_eager(steps):
    """With ``attention_merge="reduce"`` a K = 4 step's attention is ``attention_partial`` and
    ``attention_reduce``, the reduce writing the output transposed (``out_tokens``): every row's
    logits and the caches equal eager's after prompts of 3 and 17 tokens, no fallback."""
    model = hf_tiny.llama(seed=2)
    err, w, cache_err = k_steps_against_eager(model, 4, 29, prompts=(3, 17), length=LENGTH,
                                              options={"attention_merge": "reduce"})
    assert err < 1e-5 and cache_err < 1e-5, (err, cache_err)
    assert not w.fallbacks and w.compiled == 2, (w.fallbacks, w.compiled)
    multi = next(s for s in steps if s.schedule.graph.query_tokens() == 4)
    ops = _ops(multi.schedule.graph)
    red = [o for o in ops if o.kind == "attention_reduce"]
    assert len(red) == model.config.num_hidden_layers and all(o.attrs["out_tokens"] for o in red)
    assert not any(o.attrs.get("out_tokens") for o in ops if o.kind == "attention_partial")
    g = multi.schedule.graph
    assert {g.root(o.outputs["out"]) for o in red} <= {g.root(m.inputs["x"]) for m in ops if m.kind == "matvec_residual"}


def test_k_token_kernel_compiles_with_nvrtc(steps):
    """The K = 4 step's megakernel of tiny Llama (``rms_qkv_rope_seqs`` of the 4 rows with
    ``KT`` 4, last, writing the K cache rows; ``rms_gate_up_silu_seqs``, the batched matvecs of
    the 4 rows, ``attention_partial_merge`` with ``QK`` 4 and ``MK`` 3, token k attending the cache
    rows up to its write position)
    renders and compiles for sm_90a without register spills, fp32 and bf16; the merge writes the
    output as HF transposes it (``OHQ`` 4)."""
    import re
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
        calls = {c for c in re.findall(r"attention_partial_merge<[^;]*;", src) if "bufs" in c}
        # MK 3 (the K write positions as the mask), QK 4, OHQ 4: the output written transposed
        # [1, 4, Hq, D] for the o projection
        assert calls and all(re.search(r", 3, i64, 4, 4>\(", c) for c in calls), calls
        assert "matvec_seqs<" in src and "rms_gate_up_silu_seqs<" in src
        qkv = {c for c in re.findall(r"rms_qkv_rope_seqs<[^;]*;", src) if "bufs" in c}
        assert qkv and all(re.search(r", 4>\(", c) for c in qkv), qkv   # ..., WS 0, KT 4
        kernel = compile_cuda(src, "fusec_step.cu")
        kernel.assert_no_spills()


def _k_attention_graph(batch: int, k: int, hq: int, hkv: int, d: int, cap: int, nc: int, chunk: int,
                       mask_kind: int, mask_rows: int, q_groups: int = 1) -> Graph:
    """One ``attention_partial`` op (last-tile merge) of B sequences of K query tokens each,
    fp32: q ``[B, hq, K, d]``, caches ``[B, hkv, s0 <= cap, d]`` of a run-time length, a mask of
    ``mask_rows`` rows over them (B·K: ``[B, 1, K, s0]``; K: ``[1, 1, K, s0]`` for every
    sequence), ``mask_kind`` 1 bool or 2 additive."""
    f32 = torch.float32
    g = Graph()
    ins = [TensorInfo("q", (batch, hq, k, d), f32, Role.INPUT, input_index=0),
           TensorInfo("k", (batch, hkv, cap, d), f32, Role.KV_CACHE, input_index=1, sym={2: "s0"}),
           TensorInfo("v", (batch, hkv, cap, d), f32, Role.KV_CACHE, input_index=2, sym={2: "s0"}),
           TensorInfo("pos", (k,), torch.int64, Role.INPUT, input_index=3),
           TensorInfo("mask", (mask_rows // k, 1, k, cap), torch.bool if mask_kind == 1 else f32, Role.INPUT,
                      input_index=4, sym={3: "s0"})]
    for t in ins:
        g.add_tensor(t)
    g.add_tensor(TensorInfo("o_part", (batch * hq * k, nc, d), f32))
    g.add_tensor(TensorInfo("ml_part", (batch * hq * k, nc, 2), f32))
    g.add_tensor(TensorInfo("out", (batch, hq, k, d), f32, Role.OUTPUT))
    g.inputs, g.outputs = [t.name for t in ins], ["out"]
    g.lengths = {"s0": cap}
    attrs = {"scale": d ** -0.5, "n_q": batch * hq * k, "n_kv": batch * hkv, "head_dim": d, "chunk": chunk,
             "n_chunks": nc, "mask_kind": mask_kind, "query_tokens": k, "mask_rows": mask_rows}
    if batch > 1:
        attrs["batch"] = batch
    if q_groups > 1:
        attrs["q_groups"] = q_groups
    g.ops = [Op("att", "attention_partial", {"q": "q", "kcache": "k", "vcache": "v", "pos": "pos", "mask": "mask"},
                {"o_part": "o_part", "ml_part": "ml_part", "out": "out"}, attrs=attrs)]
    g.batch_size, g.query_len = batch, k
    return g


@pytest.mark.parametrize("batch,mask_kind,mask_rows,q_groups", [(2, 1, 8, 1), (2, 2, 8, 2), (2, 1, 4, 1),
                                                                (1, 1, 4, 4)])
def test_k_token_tiles_equal_sdpa_per_query_row(batch, mask_kind, mask_rows, q_groups):
    """The kind's tiles (the simulator's semantics of the template) for K = 4 query tokens per
    sequence over caches of a run-time length (3 splits of blocks of 16 rows, the block loop)
    equal SDPA for every (sequence, head, token) under its own mask row: a random mask (not only
    causal) of one set of K rows per sequence (``mask_rows`` B·K) or shared (K), bool or
    additive, with a KV head's group of 2 query heads × 4 tokens (8 rows) cut into ``q_groups``
    parts (2: one head's 4 tokens each; 4: two tokens of one head each, so a part's first row is
    not token 0); every tile's run-time regions read its KV head and its sequence's mask rows only."""
    from fusec.instructions import kind_of
    from fusec.ir.env import Env
    from fusec.ir.semantics import attend
    k, hq, hkv, d, nc, chunk, cap = 4, 4, 2, 8, 3, 16, 160
    g = _k_attention_graph(batch, k, hq, hkv, d, cap, nc, chunk, mask_kind, mask_rows, q_groups)
    op = g.ops[0]
    cls = kind_of(op)
    rows_per_group = hq * k // hkv // q_groups
    gen = torch.Generator().manual_seed(17)
    for n in (150, 57, 9):
        q = torch.randn(batch, hq, k, d, generator=gen)
        kc, vc = (torch.randn(batch, hkv, n, d, generator=gen) for _ in range(2))
        shape = (mask_rows // k, 1, k, n)
        if mask_kind == 1:
            mask = torch.rand(shape, generator=gen) > 0.4
            mask[..., -1] = True   # no row masked whole (SDPA's NaN, fusec's 0)
        else:
            mask = torch.randn(shape, generator=gen)
        env = Env(g, [q, kc, vc, torch.arange(n - k, n), mask])
        for tile in cls.tiles(op, g, 1):
            gi = tile.params["group"]
            i0 = gi * rows_per_group                       # the group's first query row
            b = i0 // (hq * k)
            reads, _ = cls.runtime_regions(op, tile, env)
            for r in reads:
                if r.tensor in ("k", "v"):
                    kv = gi // q_groups
                    assert kv * n * d <= r.start < r.stop <= (kv + 1) * n * d and b * hkv <= kv < (b + 1) * hkv
                if r.tensor == "mask":
                    first = b * k if mask_rows == batch * k else 0
                    assert first * n <= r.start < r.stop <= (first + k) * n
            cls.run_tile(op, tile, env)
        got = env.read("out")
        for b in range(batch):
            for t in range(k):
                m = mask[b if mask_rows == batch * k else 0, 0, t]
                want = attend(q[b, :, t], kc[b], vc[b], n, d ** -0.5, m, mask_kind)
                assert torch.allclose(got[b, :, t], want, atol=1e-5, rtol=1e-5), (n, b, t)


def _width_graph(batch: int, k: int, dtype: torch.dtype, rows: int = 1024) -> tuple[Graph, list]:
    """An IR graph of Llama-3.2-1B's widths for B sequences of K query tokens (no weights read):
    the ``linear``s q_proj (2048 -> 2048) and down_proj (8192 -> 2048) over x [B·K, in], and one
    ``attention`` of q [B, 32, K, 64] over caches [B, 8, rows, 64] under HF's bool mask [B, 1, K,
    rows], B and K recorded off it. (graph, flat inputs)"""
    g, flat = Graph(), []

    def inp(name, shape, role, dt=dtype):
        g.add_tensor(TensorInfo(name, shape, dt, role, input_index=len(flat)))
        flat.append(torch.empty(shape, dtype=dt))
    r = batch * k
    for name, n_in, n_out in (("q", 2048, 2048), ("down", 8192, 2048)):
        inp(f"x_{name}", (r, n_in), Role.INPUT)
        inp(f"w_{name}", (n_out, n_in), Role.WEIGHT)
        g.add_tensor(TensorInfo(f"y_{name}", (r, n_out), dtype, Role.OUTPUT))
        g.ops.append(Op(name, "linear", {"x": f"x_{name}", "w": f"w_{name}"}, {"out": f"y_{name}"}))
    inp("q", (batch, 32, k, 64), Role.INPUT)
    inp("k", (batch, 8, rows, 64), Role.KV_CACHE)
    inp("v", (batch, 8, rows, 64), Role.KV_CACHE)
    inp("pos", (k,), Role.INPUT, torch.int64)
    inp("mask", (batch, 1, k, rows), Role.INPUT, torch.bool)
    g.add_tensor(TensorInfo("out", (batch, 32, k, 64), dtype, Role.OUTPUT))
    g.ops.append(Op("att", "attention", {"q": "q", "k": "k", "v": "v", "pos": "pos", "mask": "mask"}, {"out": "out"},
                    attrs={"scale": 0.125, "mask_kind": 1}))
    g.inputs = [t for t, info in g.tensors.items() if info.input_index is not None]
    g.outputs = ["y_q", "y_down", "out"]
    g.record_rows()
    return g, flat


@pytest.mark.parametrize("batch,k,dtype", [(1, 4, torch.bfloat16), (1, 8, torch.bfloat16), (2, 8, torch.bfloat16),
                                           (1, 8, torch.float32)])
def test_k_token_kinds_compile_without_spills_at_llama_1b_widths(batch, k, dtype, tmp_path):
    """At Llama-3.2-1B's widths a step of B sequences of K query tokens takes its linears as
    ``matvec_seqs`` of B·K rows and its attention as ``attention_partial_merge`` with ``QK`` K
    (the 4·K query rows of a KV head cut into parts of 8: ``q_groups`` K / 2); the kernel
    compiles with NVRTC for sm_90a without spills or a stack frame."""
    pytest.importorskip("cuda.bindings.nvrtc")
    import re
    from fusec.config import Options
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from fusec.pipeline import Dumper, lower
    g, flat = _width_graph(batch, k, dtype)
    assert g.rows() == batch * k
    sched = lower(g, flat, Options.from_dict({"num_sms": 132}), Dumper(None))
    ops = sched.graph.op_by_name()
    assert ops["q"].kind == ops["down"].kind == "matvec" and ops["q"].attrs["batch"] == batch * k
    (att,) = [o for o in sched.graph.ops if o.kind == "attention_partial"]
    assert att.attrs["query_tokens"] == k and att.attrs["q_groups"] == k // 2 and att.attrs["n_q"] == 32 * batch * k
    src = render(sched).source
    t = "__nv_bfloat16" if dtype == torch.bfloat16 else "float"
    calls = re.findall(r"attention_partial_merge<[^;]*;", src)
    want = (rf"attention_partial_merge<{t}, {t}, {t}, {32 * batch * k}, {8 * batch * k // 2}, 64, \d+, "
            rf"{att.attrs['n_chunks']}, {k // 2}, (true|false), 1, bool, {k}>\(.*\);")
    assert any(re.fullmatch(want, c) for c in calls), calls
    assert len(re.findall(rf"matvec_seqs<[^()]*, {batch * k}, ", src)) == 2
    kernel = compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path))
    kernel.assert_no_spills()
    assert any("attention_partial_merge" in f for f in kernel.resources)


def test_a_k_token_step_of_more_than_16_rows_falls_back_with_a_line(caplog):
    """B = 3 sequences of K = 8 query tokens (24 rows, more than the fused kinds take) fall back
    with one line naming the rows, equal to eager, instead of compiling a step of generic ops."""
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(13)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options=OPTS)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fusec"), FallbackWatch() as w:
        caches = _prefilled_pair(model, 32, torch.randint(0, 128, (3, 4), generator=gen))
        _same_step(compiled, model, caches, torch.randint(0, 128, (3, 8), generator=gen))
    torch._dynamo.reset()
    assert w.compiled == 0 and len(w.fallbacks) == 1, (w.compiled, w.fallbacks)
    assert "(3 sequences of 8 query tokens, 24 rows, more than 16)" in w.fallbacks[0], w.fallbacks


def test_query_rows_limit_is_the_fused_kinds_rows():
    """The capture's limit on a K-token step's rows is what the fused kinds take."""
    from fusec.config import MAX_QUERY_ROWS
    from fusec.instructions import KINDS
    from fusec.instructions.matvec_rows import MAX_SEQS
    assert MAX_QUERY_ROWS == MAX_SEQS == KINDS["matvec"].max_rows == KINDS["attention_partial"].max_rows

