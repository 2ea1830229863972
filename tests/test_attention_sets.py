"""Two tile sets in one split-KV op, chosen by the position at run time
(fusec.instructions.attention_sets): the rule (attention_rules.long_set) gives an op over more
than REFERENCE_ROWS rows its capacity's cut as a second set where it differs from the 4096-row
one; decode equals eager on the CPU simulator on both sides of the switch, with the long set
running past it; the kernel of both sets compiles."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.instructions import attention_sets
from fusec.instructions.attention_rules import REFERENCE_ROWS, _blocks, auto_q_groups, long_set

DEFAULT = {"num_sms": 132, "attention_merge": "last_tile"}


def _long(rep, n_kv, d, rows, options=DEFAULT, itemsize=2):
    cut = auto_q_groups(rep, n_kv, rows, d, itemsize, options["num_sms"])
    nc, _ = _blocks(rows, n_kv * cut, options)
    return long_set(options, rep, n_kv, rows, d, itemsize, cut, nc)


def test_the_rule_gives_few_kv_head_models_a_long_set_past_its_switch():
    """Qwen2.5-0.5B (7 query heads over each of 2 KV heads, 64 wide, bf16) at a 32768-row
    capacity: the short set is the 4096-row cut (14 groups of 9 splits), the long set the
    capacity's (2 groups of 64 splits), switching past 8064 rows (7 x 32 KiB a split: 896 rows of
    256 B, 9 splits); SmolLM2-360M (15 of 8, then 5 of 26) past 3072 (3 x 32 KiB: 384 rows, 8
    splits). Llama-3.2-1B and Gemma-2-2B (never cut), a capacity of at most 4096 rows, the
    tile-heads knob, the reduce merge and FUSEC_ATTN_LONG_SET 0 get none."""
    assert _long(7, 2, 64, 32768) == {"q_groups": 1, "n_chunks": 64, "chunk": 512, "switch_rows": 8064}
    assert _long(3, 5, 64, 32768) == {"q_groups": 1, "n_chunks": 26, "chunk": 512, "switch_rows": 3072}
    assert _long(4, 8, 64, 32768) is None and _long(2, 4, 256, 32768) is None
    assert _long(7, 2, 64, REFERENCE_ROWS) is None and _long(7, 2, 64, 1024) is None
    assert _long(7, 2, 64, 32768, {**DEFAULT, "attention_merge": "reduce"}) is None
    assert _long(7, 2, 64, 32768, {**DEFAULT, "defines": {"FUSEC_ATTN_TILE_HEADS": 1}}) is None
    assert _long(7, 2, 64, 32768, {**DEFAULT, "defines": {"FUSEC_ATTN_LONG_SET": 0}}) is None
    for rows in (8192, 32768, 131072):   # the switch sits past the reference rows, below the capacity
        ls = _long(7, 2, 64, rows)
        assert REFERENCE_ROWS <= ls["switch_rows"] < rows


def _qwen_shaped():
    """Qwen2.5-0.5B's attention shape at a quarter of its width: 14 query heads over 2 KV heads
    of 32, fp32 (a tile's K and V bytes as bf16 heads of 64), two layers."""
    return hf_tiny.llama(hidden=448, inter=128, layers=2, heads=14, kv_heads=2, head_dim=32)


def _smollm2_shaped():
    """SmolLM2-360M's attention shape at half its width: 15 query heads over 5 KV heads of 32,
    fp32 (a tile's K and V bytes as bf16 heads of 64), two layers."""
    return hf_tiny.llama(hidden=480, inter=128, layers=2, heads=15, kv_heads=5, head_dim=32)


def test_decode_on_both_sides_of_the_switch_equals_eager(steps, monkeypatch):
    """torch.compile(backend="fusec"), default options, a 32768-row StaticCache of a
    SmolLM2-shaped model (15 groups of 8 splits, then 5 of 26): after prefills of 100 and 3100
    tokens (switch at 3072 rows) two decode steps each equal eager on the simulator (hazard check
    on), no fallback; the op carries both sets, the first prompt's steps ran only the short set
    and the second's only the long one."""
    import step_util
    picked = []
    real = attention_sets.chosen

    def spy(op, tile, last_row):
        picked.append((last_row, attention_sets.runs_long(op, last_row)))
        return real(op, tile, last_row)
    monkeypatch.setattr("fusec.instructions.attention.chosen", spy)
    errs, w = step_util.prompts_against_eager(_smollm2_shaped(), {}, (100, 3100), cache_len=32768)
    assert max(errs.values()) < 1e-4, errs
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    att = [o for st in steps for o in st.schedule.graph.ops if o.kind == "attention_partial"]
    assert att and all(o.attrs.get("q_groups") == 3 and o.attrs["long_set"]["switch_rows"] == 3072 for o in att)
    assert {long for row, long in picked if row < 3072} == {False}
    assert {long for row, long in picked if row >= 3072} == {True}


def test_a_long_set_tile_without_a_short_tile_is_idle_there():
    """The op's tiles are the larger set's count (the long set's 128 against the short one's
    126): tiles 126-127 have no short tile (-1) and declare the long tiles' regions only."""
    from test_attention_split import _lowered
    sched = _lowered(_qwen_shaped, torch.float32, 132, 32768)
    op = next(o for o in sched.graph.ops if o.kind == "attention_partial")
    ins = [i for i in sched.instrs if i.op == op.name]
    assert len(ins) == 128
    idle = [i.tile for i in ins if i.tile.params["group"] < 0]
    assert [t.index for t in idle] == [126, 127]
    assert all(t.params["long_group"] == 1 for t in idle)
    parts = {r.tensor for t in idle for r in t.writes}
    assert sched.graph.root(op.outputs["o_part"]) not in parts
    assert sched.graph.root(op.outputs["o_part_long"]) in parts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_of_two_sets_compiles_without_spills(dtype, tmp_path):
    """The kernel with both sets (the call picks by attention_long_set; each set's template
    arguments, its own partials and tickets) compiles with NVRTC for sm_90a without spills."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from test_attention_split import _lowered
    sched = _lowered(_qwen_shaped, dtype, 132, 32768)
    src = render(sched).source
    assert "attention_long_set<0, 1>(" in src and "if (in.p2 >= 0) attention_partial_merge<" in src
    compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path)).assert_no_spills()


@pytest.mark.gpu
def test_both_sets_on_the_gpu():
    """GPU, bf16: Qwen2.5-0.5B's attention shape (14 / 2 heads of 64) over a 32768-row
    StaticCache (switch at 8064 rows) at positions 100, 8062, 8063, 8064, 16000 and 32766 (random
    caches; two steps each, so each set's tickets wrap): the default kernel (both sets) is within
    bf16's gross-error bound of eager's logits and within 2e-2 of the uncut kernel's
    (FUSEC_ATTN_TILE_HEADS 8: one set); no fallback."""
    import step_util
    from fusec.fallbacks import FallbackWatch
    from test_attention_split import _qwen2_gqa7
    model = _qwen2_gqa7().to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    toks = [torch.randint(0, 128, (1, 1), generator=gen).cuda() for _ in range(2)]
    logits: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad(), FallbackWatch() as watch:
        for name, defines in (("sets", {}), ("uncut", {"FUSEC_ATTN_TILE_HEADS": 8})):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="fusec", options={"fallback": "eager", "defines": defines})
            logits[name] = []
            state = torch.Generator().manual_seed(12)   # the same caches for both kernels
            for pos in (100, 8062, 8063, 8064, 16000, 32766):
                for a, b in step_util.steps_at_position(model, compiled, toks, pos, state, rows=32768):
                    assert torch.isfinite(a).all() and step_util.rel(a, b) < 5e-2, (name, pos, step_util.rel(a, b))
                    logits[name].append(a)
    torch._dynamo.reset()
    assert not watch.fallbacks, f"the kernel did not run: {watch.fallbacks}"
    errs = [step_util.rel(a, b) for a, b in zip(logits["sets"], logits["uncut"])]
    assert max(errs) < 2e-2, errs


def test_a_batch_long_set_reads_its_own_groups_mask_row():
    """A batch of 2 left-padded sequences (mask_rows 2) over an 8192-row cache, 7 query heads over
    one KV head (2 KV heads in the op): each set's call passes the mask row of its own group
    (the long one from p2, ``in.p2 / 1``; the short one ``in.p0 / 7``): the long call names no
    ``in.p0`` or ``in.p1`` (found by a try-to-break run: it read the short set's group)."""
    import re
    from transformers import StaticCache
    from fusec.cuda.codegen import render
    import step_util
    m = hf_tiny.llama(hidden=224, inter=128, layers=1, heads=7, kv_heads=1, head_dim=32)
    cache = StaticCache(config=m.config, max_cache_len=8192, max_batch_size=2)
    with torch.no_grad():
        m(input_ids=torch.ones(2, 1, dtype=torch.long), past_key_values=cache)
        for layer in cache.layers:
            layer.cumulative_length.fill_(4610)
        am = torch.ones(2, 4611, dtype=torch.long)
        am[1, :1000] = 0
        kw = {"input_ids": torch.ones(2, 1, dtype=torch.long), "past_key_values": cache, "attention_mask": am}
        _, g, flat = step_util.capture(m, kw)
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    sched = lower(g, flat, Options.from_dict({}), Dumper(None))
    op = next(o for o in sched.graph.ops if o.kind == "attention_partial")
    assert op.attrs.get("mask_rows") == 2 and op.attrs["long_set"]["q_groups"] == 1
    src = render(sched).source
    long = re.findall(r"if \(in\.p2 >= 0\) (attention_partial_merge<[^;]*);", src)
    short = re.findall(r"else if \(in\.p0 >= 0\) (attention_partial_merge<[^;]*);", src)
    assert long and short
    assert all("in.p0" not in c and "in.p1" not in c and "(in.p2 / 1)" in c for c in long), long
    assert all("(in.p0 / 7)" in c for c in short), short


def test_a_k_token_step_keeps_one_set(steps):
    """A verification step of K = 2 query tokens (option ``query_tokens``) over a 32768-row cache
    (Qwen2.5-shaped) has no long set: with both, NVRTC spilled 8 B in fusec_step; its logits
    equal eager's on the simulator, no fallback."""
    from fusec.fallbacks import FallbackWatch
    model = _qwen_shaped()
    ours, ref = hf_tiny.static_cache(model, 32768), hf_tiny.static_cache(model, 32768)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"query_tokens": 2})
    with torch.no_grad(), FallbackWatch() as w:
        for c in (ours, ref):
            model(input_ids=torch.arange(1, 6)[None], past_key_values=c, use_cache=True)
        toks = torch.tensor([[7, 9]])
        a = compiled(input_ids=toks, past_key_values=ours, use_cache=True).logits
        b = model(input_ids=toks, past_key_values=ref, use_cache=True).logits
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    assert ((a - b).norm() / b.norm()).item() < 1e-4
    att = [o for st in steps for o in st.schedule.graph.ops if o.kind == "attention_partial"]
    assert att and all("long_set" not in o.attrs and o.attrs["query_tokens"] == 2 for o in att)
