"""Query-head groups of split-KV attention (fusec.instructions.attention_rules.q_groups): a GQA group of
more than MAX_TILE_HEADS query heads (Falcon-7B's 71 over one KV head, StarCoder2-3B's 12) is cut
into equal parts, each its own tile group reading the shared KV head; decode through
torch.compile equals eager on the CPU simulator, and the kernel compiles."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.instructions.attention_rules import MAX_TILE_HEADS, REFERENCE_ROWS, auto_q_groups, q_groups, tile_heads


def test_the_parts_are_the_fewest_equal_ones_of_at_most_max_tile_heads():
    for rep in range(1, 130):
        k = q_groups(rep)
        assert rep % k == 0 and rep // k <= MAX_TILE_HEADS
        assert all(rep % j or rep // j > MAX_TILE_HEADS for j in range(1, k))   # no fewer would do
    assert [q_groups(r) for r in (1, 4, 7, 8, 12, 16, 71)] == [1, 1, 1, 1, 2, 2, 71]


def test_the_tile_heads_knob_bounds_the_parts():
    """FUSEC_ATTN_TILE_HEADS (the defines option) caps a tile's heads below MAX_TILE_HEADS:
    Qwen2.5-0.5B's 7 heads per KV head become 7 tile groups of one at 1 (and at 2..6: 7 has no
    other divisor), Llama's 4 become 2 of 2 at 2; 0, the default, leaves the cut to
    auto_q_groups; a value outside 0..8 is a FusecError naming the knob and its range."""
    from fusec.config import Options
    from fusec.errors import FusecError
    assert tile_heads({}) == 0
    assert [tile_heads({"defines": Options.from_dict({"defines": {"FUSEC_ATTN_TILE_HEADS": n}}).defines})
            for n in (0, 1, 3, "8")] == [0, 1, 3, 8]
    for bad in (-1, 9, 100):
        with pytest.raises(FusecError, match=rf"FUSEC_ATTN_TILE_HEADS={bad} is out of range; it takes 0 to 8"):
            Options.from_dict({"defines": {"FUSEC_ATTN_TILE_HEADS": bad}})
    assert [q_groups(7, n) for n in (1, 2, 6, 7, 8)] == [7, 7, 7, 1, 1]
    assert [q_groups(4, n) for n in (1, 2, 3, 4)] == [4, 2, 2, 1]


#: published shapes (query heads per KV head, KV heads, head_dim) -> the rule's cut at a bf16
#: cache of 1024 / 4096 rows on 132 SMs (and at more rows: a capacity counts as at most
#: REFERENCE_ROWS = 4096)
PUBLISHED_CUTS = {
    "Qwen2.5-0.5B": ((7, 2, 64), (7, 7)),     # 2 groups of 64-66 partials -> 14 of 8-9 (measured faster)
    "SmolLM2-360M": ((3, 5, 64), (3, 3)),     # 5 of 26 -> 15 of 8 (measured faster at 600)
    "Gemma-2-2B": ((2, 4, 256), (2, 1)),      # at 4096 a cut tile would read 256 KiB (measured even)
    "Llama-3.2-1B": ((4, 8, 64), (1, 1)),     # 8 groups of 16 partials already
    "Qwen3-0.6B": ((2, 8, 128), (1, 1)),      # likewise (cut: 8% slower at 3000)
    "Qwen2.5-7B": ((7, 4, 128), (7, 1)),      # at 4096 cut tiles would read 512 KiB
    "Gemma-3-1B": ((4, 1, 256), (4, 4)),      # 1 group of 132 partials -> 4 of 33
    "Falcon-7B": ((71, 1, 64), (71, 71)),     # at most MAX_TILE_HEADS a tile, whatever it costs
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_CUTS))
def test_the_default_rule_cuts_few_kv_head_groups_within_the_tile_bytes(name):
    """auto_q_groups (FUSEC_ATTN_TILE_HEADS = 0): the fewest equal parts whose merge has at most 16
    partials and whose tile reads at most 128 KiB of K and V at the capacity, taken as at most
    4096 rows (the 32768 rows of a length-polymorphic step: HF generate(), fusec.generate, cut
    as 4096 are); a cache of 64 rows has 4 splits and is never cut; fp32 doubles the bytes."""
    (rep, n_kv, d), want = PUBLISHED_CUTS[name]
    got = tuple(auto_q_groups(rep, n_kv, rows, d, 2, 132) for rows in (1024, 4096))
    assert got == want
    assert REFERENCE_ROWS == 4096
    assert all(auto_q_groups(rep, n_kv, rows, d, 2, 132) == want[1] for rows in (8192, 32768, 131072))
    assert auto_q_groups(rep, n_kv, 64, d, 2, 132) == q_groups(rep)
    for rows in (64, 1024, 4096, 32768):
        for itemsize in (2, 4):
            k = auto_q_groups(rep, n_kv, rows, d, itemsize, 132)
            assert rep % k == 0 and rep // k <= MAX_TILE_HEADS and k >= q_groups(rep)


def test_the_default_cuts_a_qwen2_shaped_group_and_equals_eager(steps):
    """Default options (132 SMs) on a Qwen2.5-shaped GQA (7 query heads over each of 2 KV heads,
    head_dim 16) over a 1024-row StaticCache: the rule cuts each group into 7 tile groups of one
    head (14 groups of 8 splits of 128 rows instead of 2 of 64 of 16); decode after prefills of
    5 and 300 tokens equals eager on the simulator, no fallback."""
    import step_util
    model = hf_tiny.llama(hidden=224, heads=14, kv_heads=2, head_dim=16)
    errs, w = step_util.prompts_against_eager(model, {}, (5, 300), cache_len=1024)
    assert max(errs.values()) < 1e-4, errs
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    att = [o for st in steps for o in st.schedule.graph.ops if o.kind == "attention_partial"]
    assert att and all(o.attrs.get("q_groups") == 7 and o.attrs["n_chunks"] == 8 for o in att), \
        [o.attrs for o in att]


@pytest.mark.parametrize("heads", [1, 2])
def test_a_group_cut_by_the_tile_heads_knob_equals_eager(heads, steps):
    """A Qwen2.5-shaped GQA group (7 query heads over 1 KV head) cut by FUSEC_ATTN_TILE_HEADS
    into 7 tile groups of one head: decode after prefills of 3, 17 and 40 tokens equals eager
    on the simulator, no fallback, the op carries q_groups 7."""
    import step_util
    model = hf_tiny.llama(hidden=112, heads=7, kv_heads=1, head_dim=16)
    options = {"num_sms": 24, "defines": {"FUSEC_ATTN_TILE_HEADS": heads}}
    errs, w = step_util.prompts_against_eager(model, options, (3, 17, 40))
    assert max(errs.values()) < 1e-4, errs
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    att = [o for st in steps for o in st.schedule.graph.ops if o.kind == "attention_partial"]
    assert att and all(o.attrs.get("q_groups") == 7 for o in att)


def _falcon_mqa():
    """A tiny Falcon-7B-shaped layer: multi-query (one KV head), parallel attention and MLP, 12
    query heads of 16 (two groups of 6), fp32."""
    from transformers import FalconConfig, FalconForCausalLM
    torch.manual_seed(0)
    cfg = FalconConfig(vocab_size=128, hidden_size=192, num_hidden_layers=2, num_attention_heads=12,
                       multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False,
                       attn_implementation="sdpa")
    return FalconForCausalLM(cfg).eval().requires_grad_(False)


#: name -> (factory, query heads per KV head, expected q_groups)
MODELS = {
    "falcon_mqa_12": (_falcon_mqa, 12, 2),
    # a prime group: one query head per tile group, eleven groups on one KV head
    "llama_11_1": (lambda: hf_tiny.llama(hidden=88, heads=11, kv_heads=1, head_dim=8), 11, 11),
    # 16 over each of 2 KV heads: 2 parts of 8 per KV head, groups 0, 1 read KV head 0
    "llama_32_2": (lambda: hf_tiny.llama(hidden=128, heads=32, kv_heads=2, head_dim=8), 16, 2),
}


@pytest.mark.parametrize("merge", ["last_tile", "reduce"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_decode_of_cut_groups_equals_eager(name, merge, steps):
    """torch.compile(backend="fusec") decode after prefills of 3, 17 and 40 tokens (StaticCache
    of 64), two steps each, against eager: the attention op carries q_groups, no fallback."""
    import step_util
    factory, rep, parts = MODELS[name]
    errs, w = step_util.prompts_against_eager(factory(), {"num_sms": 24, "attention_merge": merge}, (3, 17, 40))
    assert max(errs.values()) < 1e-4, errs
    assert not w.fallbacks, w.fallbacks
    assert w.compiled >= 1
    att = [o for st in steps for o in st.schedule.graph.ops if o.kind == "attention_partial"]
    assert att and all(o.attrs["n_q"] // o.attrs["n_kv"] == rep for o in att)
    assert all(o.attrs.get("q_groups", 1) == parts for o in att)


def test_a_group_of_at_most_max_tile_heads_lowers_as_before(steps):
    """Llama's GQA 4: no q_groups attr, so the graph, its dump and the kernel text are unchanged."""
    model = hf_tiny.llama(heads=8, kv_heads=2, head_dim=8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 24})
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
        compiled(input_ids=torch.randint(0, 128, (1, 1)), past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    att = [o for st in steps for o in st.schedule.graph.ops if o.kind == "attention_partial"]
    assert att and not any("q_groups" in o.attrs for o in att)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cut_group_kernels_compile_without_spills(dtype, tmp_path):
    """The kernel of Falcon-7B's attention (71 query heads of 64 over one KV head, 132 SMs,
    1024 rows: 71 groups of one head) compiles with NVRTC for sm_90a without spills: the
    template's KS (groups per KV head) indexes the shared KV head."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from test_attention_split import _lowered

    def falcon_shape():   # Llama-shaped: head_dim free of the width, so the weights stay small
        return hf_tiny.llama(hidden=142, heads=71, kv_heads=1, head_dim=64)
    sched = _lowered(falcon_shape, dtype, 132, 1024)
    att = [o for o in sched.graph.ops if o.kind == "attention_partial"]
    assert att and all(o.attrs["q_groups"] == 71 and o.attrs["n_chunks"] == 1 for o in att)
    src = render(sched).source
    assert "attention_partial_merge<" in src and ", 71, 64, " in src   # NKV: the 71 groups
    compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path)).assert_no_spills()


def test_hf_generate_cuts_a_qwen2_shaped_group_at_its_run_time_capacity(steps):
    """HF generate() through ``CompileConfig(backend="fusec")`` with default options on a
    Qwen2.5-shaped GQA (7 query heads over each of 2 KV heads): its length-polymorphic step (a
    32768-row capacity, counted as REFERENCE_ROWS) gets the rule's cut, 7 tile groups of one head
    per KV head; two calls with prompts of 5 and 37 tokens give eager generate()'s greedy tokens,
    no fallback, one step compiled for both."""
    from fusec.fallbacks import FallbackWatch
    from transformers.generation import CompileConfig
    model = hf_tiny.llama(hidden=224, heads=14, kv_heads=2, head_dim=16)
    model.generation_config.pad_token_id = 0
    cc = CompileConfig(backend="fusec")
    cc._compile_all_devices = True   # HF compiles on CUDA only unless told (this machine has no GPU)
    gen = torch.Generator().manual_seed(11)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        for n in (5, 37):
            ids = torch.randint(1, 128, (1, n), generator=gen)
            kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
            ours = model.generate(ids, compile_config=cc, **kw)
            ref = model.generate(ids, disable_compile=True, **kw)
            assert torch.equal(ours, ref), (n, ours, ref)
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    assert len(steps) == 1
    att = [o for o in steps[0].schedule.graph.ops if o.kind == "attention_partial"]
    assert att and all(o.attrs.get("q_groups") == 7 for o in att), [o.attrs for o in att]
    assert steps[0].graph.lengths, "not the length-polymorphic step"
