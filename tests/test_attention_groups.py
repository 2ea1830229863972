"""Query-head groups of split-KV attention (fusec.instructions.attention_rules.q_groups): a GQA group of
more than MAX_TILE_HEADS query heads (Falcon-7B's 71 over one KV head, StarCoder2-3B's 12) is cut
into equal parts, each its own tile group reading the shared KV head; decode through
torch.compile equals eager on the CPU simulator, and the kernel compiles."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.instructions.attention_rules import MAX_TILE_HEADS, q_groups, tile_heads


def test_the_parts_are_the_fewest_equal_ones_of_at_most_max_tile_heads():
    for rep in range(1, 130):
        k = q_groups(rep)
        assert rep % k == 0 and rep // k <= MAX_TILE_HEADS
        assert all(rep % j or rep // j > MAX_TILE_HEADS for j in range(1, k))   # no fewer would do
    assert [q_groups(r) for r in (1, 4, 7, 8, 12, 16, 71)] == [1, 1, 1, 1, 2, 2, 71]


def test_the_tile_heads_knob_bounds_the_parts():
    """FUSEC_ATTN_TILE_HEADS (the defines option) caps a tile's heads below MAX_TILE_HEADS:
    Qwen2.5-0.5B's 7 heads per KV head become 7 tile groups of one at 1 (and at 2..6: 7 has no
    other divisor), Llama's 4 become 2 of 2 at 2; a value outside 1..8 is a FusecError naming
    the knob and its range (0 or -1 read as "no cap" would give the opposite, one head a tile)."""
    from fusec.config import Options
    from fusec.errors import FusecError
    assert tile_heads({}) == MAX_TILE_HEADS
    assert [tile_heads({"defines": Options.from_dict({"defines": {"FUSEC_ATTN_TILE_HEADS": n}}).defines})
            for n in (1, 3, "8")] == [1, 3, 8]
    for bad in (0, -1, 9, 100):
        with pytest.raises(FusecError, match=rf"FUSEC_ATTN_TILE_HEADS={bad} is out of range; it takes 1 to 8"):
            Options.from_dict({"defines": {"FUSEC_ATTN_TILE_HEADS": bad}})
    assert [q_groups(7, n) for n in (1, 2, 6, 7, 8)] == [7, 7, 7, 1, 1]
    assert [q_groups(4, n) for n in (1, 2, 3, 4)] == [4, 2, 2, 1]


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
