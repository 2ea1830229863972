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
    model = hf_tiny.llama(layers=2, heads=8, kv_heads=2, head_dim=8)
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


# ---- active splits (kernel knob FUSEC_ATTN_SPLIT_ROWS = R, issue 31) --------------------------

def _qwen2_gqa7():
    """A tiny Qwen2 with Qwen2.5-0.5B's attention shape: 14 query heads over 2 KV heads of 64
    (q/k/v biases non-zero), fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    m = hf_tiny._small(Qwen2Config, Qwen2ForCausalLM, 0, hidden_size=896, intermediate_size=128,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(1)
    for layer in m.model.layers:
        for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            p.bias.normal_(generator=gen)
    return m


def _llama_8_2():
    return hf_tiny.llama(layers=2, heads=8, kv_heads=2, head_dim=8)


#: model -> (factory, SMs: 16 splits per KV head at capacity 256)
ACTIVE_MODELS = {"llama": (lambda: hf_tiny.llama(layers=2, heads=4, kv_heads=2), 32), "qwen2_gqa7": (_qwen2_gqa7, 32),
                 "mha": (lambda: hf_tiny.llama(layers=2, heads=4, kv_heads=4), 64)}

#: key -> (model, its capture): the tests that lower one capture with other options share it (a
#: dynamo and AOT trace, a second or more each; lowering copies the graph)
_CAPTURED: dict = {}


def _shared(key, capture):
    if key not in _CAPTURED:
        _CAPTURED[key] = capture()
    return _CAPTURED[key]


def _polymorphic(key, factory, cap: int):
    """(model, :func:`test_runtime_length.polymorphic_capture` of it at capacity ``cap``), shared."""
    from test_runtime_length import polymorphic_capture

    def capture():
        model = factory()
        return model, polymorphic_capture(model, cap)
    return _shared(("polymorphic", key, cap), capture)


def _split_rows_define(r: int) -> dict:
    return {"defines": {"FUSEC_ATTN_SPLIT_ROWS": r}}


@pytest.mark.parametrize("r", [1, 16, 32, 64, 100])
@pytest.mark.parametrize("n_chunks", [1, 3, 16, 64])
def test_active_splits_hold_about_r_rows_each(n_chunks, r):
    """The first min(n_chunks, max(1, ceil((pos+1)/r))) splits take the valid rows, contiguous and
    even: at most r each while some splits are idle, at least r // 2 when two or more work; R = 0
    keeps every split."""
    from fusec.instructions.attention import active_splits
    for pos in range(0, 600):
        active = active_splits(pos, n_chunks, r)
        assert active == min(n_chunks, max(1, -(-(pos + 1) // r)))
        assert active_splits(pos, n_chunks, 0) == n_chunks
        spans = [split_rows(c, pos, active) for c in range(active)]
        assert spans[0][0] == 0 and spans[-1][1] == pos + 1
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        sizes = [r1 - r0 for r0, r1 in spans]
        assert max(sizes) - min(sizes) <= 1
        assert active == n_chunks or max(sizes) <= r, (pos, active, sizes)
        assert active == 1 or min(sizes) >= r // 2, (pos, active, sizes)


@pytest.mark.parametrize("mask_kind", [0, 1, 2])
@pytest.mark.parametrize("r", [16, 32])
def test_inactive_splits_write_nothing_and_the_merge_reads_the_active_ones(r, mask_kind):
    """One attention_partial op (16 splits of 16 rows, capacity 256) with ``split_rows``: the tiles
    past the active ones write no partial (their slots stay poisoned, NaN) and declare no write;
    every tile still takes its ticket and the 16th merges the active partials into SDPA's output,
    with no mask, a bool mask whose first rows are masked whole, and an additive one (the rule
    then counts the L rows the mask splits)."""
    from fusec.instructions import kind_of
    from fusec.instructions.attention import active_splits
    from fusec.ir.env import Env
    from fusec.ir.semantics import attend
    from test_runtime_length import _attention_graph
    nq, nkv, d, nc, chunk, cap = 4, 2, 8, 16, 16, 256
    g = _attention_graph(cap, nq, nkv, d, nc, chunk, mask_kind)
    op = g.ops[0]
    op.attrs["split_rows"] = r
    cls = kind_of(op)
    gen = torch.Generator().manual_seed(5)
    for n, pos in ((256, 255), (256, r - 1), (200, 2 * r - 1), (40, 3), (7, 6)):
        q = torch.randn(nq * d, generator=gen)
        k, v = (torch.randn(1, nkv, n, d, generator=gen) for _ in range(2))
        args = [q, k, v, torch.tensor(pos)]
        mask = None
        if mask_kind == 1:
            mask = torch.rand(n, generator=gen) > 0.3
            mask[: min(n - 1, 40)] = False
            mask[-1] = True
        elif mask_kind == 2:
            mask = torch.randn(n, generator=gen)
        if mask is not None:
            args.append(mask)
        env = Env(g, args)
        rows = n if mask_kind else pos + 1
        active = active_splits(rows - 1, nc, r)
        assert active == min(nc, -(-rows // r))
        for tile in cls.tiles(op, g, 1):
            _, writes = cls.runtime_regions(op, tile, env)
            assert bool(writes) == (tile.params["chunk"] < active)
            cls.run_tile(op, tile, env)
        assert env.tickets == {("att", 0): nc, ("att", 1): nc}   # every split took its ticket
        o = env.read("o_part").reshape(nq, nc, d)
        assert o[:, active:].isnan().all() and not o[:, :active].isnan().any()
        want = attend(q.reshape(nq, d), k[0], v[0], rows, d ** -0.5, mask, mask_kind).reshape(-1)
        got = env.read("out")
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (n, pos, (got - want).abs().max())


@pytest.mark.parametrize("merge", ["last_tile", "reduce"])
@pytest.mark.parametrize("r", [32, 64])
@pytest.mark.parametrize("model_name", sorted(ACTIVE_MODELS))
def test_active_splits_match_eager_at_every_cache_length(model_name, r, merge):
    """FUSEC_ATTN_SPLIT_ROWS = r through the defines option: lowering records it on the split-KV
    ops (and the reduce reads the position), and one length-polymorphic schedule (capacity 256,
    16 splits per KV head) equals HF eager in the simulator, hazard check on, for caches of 40,
    128 and 256 rows at positions where the valid rows are fewer than r, exactly r, 2r and 3r,
    and the last row; GQA 2, Qwen2.5-0.5B's GQA 7 and MHA; both merges; no fallback."""
    from fusec.fallbacks import FallbackWatch
    from test_runtime_length import _run_lengths, polymorphic_step
    factory, num_sms = ACTIVE_MODELS[model_name]
    with FallbackWatch() as w:
        model, captured = _polymorphic(model_name, factory, 256)
        sched, flat, cap_cache, ids = polymorphic_step(model, 256, num_sms=num_sms, captured=captured,
                                                       attention_merge=merge, **_split_rows_define(r))
    assert not w.fallbacks, w.fallbacks
    ops = sched.graph.ops
    att = [o for o in ops if o.kind == "attention_partial"]
    assert len(att) == 2 and all(o.attrs["n_chunks"] == 16 and o.attrs["split_rows"] == r for o in att)
    assert all(o.attrs["chunk"] == r for o in att)   # the block holds an active split's rows (was 16)
    red = [o for o in ops if o.kind == "attention_reduce"]
    assert len(red) == (2 if merge == "reduce" else 0)
    assert all(o.attrs["split_rows"] == r and "pos" in o.inputs for o in red)
    _run_lengths(model, sched, flat, cap_cache, ids, [40, 128, 256],
                 lambda n: sorted({p for p in (r - 2, r - 1, 2 * r - 1, 3 * r - 1, n - 1) if p < n}))


@pytest.mark.parametrize("merge", ["last_tile", "reduce"])
def test_active_splits_through_torch_compile_with_a_mask(merge, steps):
    """torch.compile with FUSEC_ATTN_SPLIT_ROWS = 32 on a 96-row StaticCache (6 splits per KV
    head): prefills of several lengths, then one compiled step each at positions 5, 31, 63 and
    95 (the last row), without and with a 4-D additive mask over the cache (mask_kind 2: the
    3 active splits of all 96 rows), against eager; no fallback."""
    from fusec.fallbacks import FallbackWatch
    model = _llama_8_2()
    vocab, length = model.config.vocab_size, 96
    gen = torch.Generator().manual_seed(7)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec",
                             options={"num_sms": 64, "attention_merge": merge, **_split_rows_define(32)})
    with FallbackWatch() as w, torch.no_grad():
        for masked in (False, True):
            for pos in (5, 31, 63, 95):
                ours, ref = hf_tiny.static_cache(model, length), hf_tiny.static_cache(model, length)
                prompt = torch.randint(0, vocab, (1, pos), generator=gen)
                for c in (ours, ref):
                    model(input_ids=prompt, past_key_values=c, use_cache=True)
                tok = torch.randint(0, vocab, (1, 1), generator=gen)
                kw = {}
                if masked:
                    m = torch.full((1, 1, 1, length), float("-inf"))
                    m[..., : pos + 1] = 0.0
                    kw = {"attention_mask": m, "cache_position": torch.tensor([pos])}
                a = compiled(input_ids=tok, past_key_values=ours, use_cache=True, **kw).logits
                b = model(input_ids=tok, past_key_values=ref, use_cache=True, **kw).logits
                rel = ((a - b).norm() / b.norm()).item()
                assert rel < 1e-4, f"masked={masked} position {pos}: relative error {rel:.2e}"
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    att = [o for st in steps for o in st.schedule.graph.ops if o.kind == "attention_partial"]
    assert {o.attrs["mask_kind"] for o in att} == {0, 2}   # the unmasked step and the masked one
    assert all(o.attrs["n_chunks"] == 6 and o.attrs["split_rows"] == 32 for o in att)


def _lowered(factory, dtype, num_sms, length, masked=False, **options):
    """The schedule of one decode step of a tiny HF model (bf16 or fp32) after a 3-token prefill
    of a ``length``-row StaticCache, lowered with ``num_sms`` and ``options``; ``masked``: the
    call passes a 4-D additive mask (mask_kind 2). The capture is shared by the calls with the
    same factory, dtype, length and mask."""
    from fusec.pipeline import Dumper, lower
    from fusec.config import Options
    import step_util

    def capture():
        model = factory().to(dtype)
        cache = hf_tiny.static_cache(model, length)
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
        kw = {"input_ids": torch.randint(0, 128, (1, 1)), "past_key_values": cache, "use_cache": True}
        if masked:
            m = torch.full((1, 1, 1, length), float("-inf"), dtype=dtype)
            m[..., :4] = 0.0
            kw.update(attention_mask=m, cache_position=torch.tensor([3]))
        _, g, flat = step_util.capture(model, kw)
        return model, g, flat
    _, g, flat = _shared(("step", factory, dtype, length, masked), capture)
    return lower(g, flat, Options.from_dict({"num_sms": num_sms, **options}), Dumper(None))


def _poly_llama(**options):
    from test_runtime_length import polymorphic_step
    model, captured = _polymorphic("llama_bf16", lambda: hf_tiny.llama(layers=2, heads=4, kv_heads=2).to(torch.bfloat16), 4096)
    return polymorphic_step(model, 4096, num_sms=32, captured=captured, **options)[0]


#: name -> (lowers a schedule with the given options, FUSEC_ATTN_SPLIT_ROWS, extra defines)
NVRTC_CASES = {
    # Qwen2.5-0.5B's attention (14 / 2 heads of 64) at 132 SMs: 64 splits, merged by 4 lanes per
    # element (FUSEC_MERGE_LANES); with the knob 0, one thread per element, in batches past 32 active
    "qwen2_gqa7": (lambda **o: _lowered(_qwen2_gqa7, torch.bfloat16, 132, 1024, **o), 64, {}),
    "qwen2_gqa7_one_thread": (lambda **o: _lowered(_qwen2_gqa7, torch.bfloat16, 132, 1024, **o), 64,
                              {"FUSEC_MERGE_LANES": 0}),
    "qwen2_gqa7_two_pass": (lambda **o: _lowered(_qwen2_gqa7, torch.bfloat16, 132, 1024, **o), 32,
                            {"FUSEC_MERGE_ONE_PASS": 0}),
    # length-polymorphic, capacity 4096 over 16 splits of one block of 256
    "poly_llama": (_poly_llama, 32, {}),
    # R past the block (FUSEC_ATTN_BLOCK_ROWS): active splits of several blocks (MB)
    "qwen2_gqa7_blocks": (lambda **o: _lowered(_qwen2_gqa7, torch.bfloat16, 132, 1024, **o), 320,
                          {"FUSEC_ATTN_BLOCK_ROWS": 256}),
    # a mask: the rows [0, L) over the active splits (mask_kind 2), the reduce's MK
    "masked_llama_fp32": (lambda **o: _lowered(_llama_8_2, torch.float32, 64, 96, masked=True, **o), 32, {}),
}


@pytest.mark.parametrize("merge", ["last_tile", "reduce"])
@pytest.mark.parametrize("case", sorted(NVRTC_CASES))
def test_active_split_kernels_compile_without_spills(case, merge, tmp_path):
    """The kernels of FUSEC_ATTN_SPLIT_ROWS > 0 compile with NVRTC for sm_90a without spills or
    warnings: the reduce merge as attention_reduce_active (with the mask kind, the position and
    the cache's rows), the last-tile merge as before (the knob acts inside the templates)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from fusec.cuda.knobs import KNOBS
    from fusec.instructions.attention import AttentionPartial
    lower, r, extra = NVRTC_CASES[case]
    defines = {"FUSEC_ATTN_SPLIT_ROWS": r, **extra}
    sched = lower(attention_merge=merge, defines=defines)
    plan = render(sched, defines=defines)
    assert f"#define FUSEC_ATTN_SPLIT_ROWS {r}" in plan.source
    assert ("attention_reduce_active<" in plan.source) == (merge == "reduce")
    assert "attention_reduce<" not in plan.source
    att = [o for o in sched.graph.ops if o.kind == "attention_partial"]
    block = defines.get("FUSEC_ATTN_BLOCK_ROWS", KNOBS["FUSEC_ATTN_BLOCK_ROWS"])
    assert all(AttentionPartial.multi_block(o, sched.graph) == (r > block) for o in att)
    assert all(o.attrs["chunk"] >= min(block, r) for o in att)   # an active split is one block, or MB
    if case.startswith("masked"):
        assert all(o.attrs["mask_kind"] == 2 for o in sched.graph.ops if o.kind == "attention_partial")
    kernel = compile_cuda(plan.source, "fusec_step.cu", cache_dir=str(tmp_path))
    kernel.assert_no_spills()
    assert "warning" not in kernel.log, kernel.log


def test_reduce_lowered_without_the_knob_refuses_to_compile_with_it(tmp_path):
    """A reduce schedule lowered with every split (no split_rows) and rendered with
    FUSEC_ATTN_SPLIT_ROWS > 0 would merge partials that no split wrote this step: the template's
    static_assert stops it at compile time."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from fusec.errors import JitError
    off = {"FUSEC_ATTN_SPLIT_ROWS": 0}
    sched = _lowered(hf_tiny.llama, torch.bfloat16, 12, 32, attention_merge="reduce", defines=off)
    assert not any("split_rows" in o.attrs for o in sched.graph.ops)   # 0 lowers as before the knob
    compile_cuda(render(sched, defines=off).source, "fusec_step.cu", cache_dir=str(tmp_path)).assert_no_spills()
    with pytest.raises(JitError, match="lower the step with the defines it is rendered with"):
        compile_cuda(render(sched, defines={"FUSEC_ATTN_SPLIT_ROWS": 32}).source, "fusec_step.cu",
                     cache_dir=str(tmp_path))


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["last_tile", "reduce"])
def test_active_splits_on_the_gpu(merge):
    """H200, bf16: Qwen2.5-0.5B's attention shape (14 / 2 heads of 64) over a 1024-row StaticCache
    (64 splits per KV head) with FUSEC_ATTN_SPLIT_ROWS 0, 32 and 64; at positions 5, 31, 63, 600
    and 1022 (random caches; two steps each, so tickets wrap between them) every kernel's logits
    stay within bf16's gross-error bound of eager's and within 2e-2 of the all-splits kernel's;
    no fallback."""
    import step_util
    from fusec.fallbacks import FallbackWatch
    model = _qwen2_gqa7().to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    toks = [torch.randint(0, 128, (1, 1), generator=gen).cuda() for _ in range(2)]
    logits: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad(), FallbackWatch() as watch:
        for r in (0, 32, 64):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="fusec", options={"fallback": "eager", "attention_merge": merge,
                                                                      **_split_rows_define(r)})
            logits[r] = []
            state = torch.Generator().manual_seed(12)   # the same caches for every r
            for pos in (5, 31, 63, 600, 1022):
                for a, b in step_util.steps_at_position(model, compiled, toks, pos, state):
                    assert torch.isfinite(a).all() and step_util.rel(a, b) < 5e-2, (r, pos, step_util.rel(a, b))
                    logits[r].append(a)
    torch._dynamo.reset()
    assert not watch.fallbacks, f"the kernel did not run: {watch.fallbacks}"
    for r in (32, 64):
        errs = [step_util.rel(a, b) for a, b in zip(logits[r], logits[0])]
        assert max(errs) < 2e-2, (r, errs)
