"""Rendering and NVRTC compile-check of small megakernels (CPU only: NVRTC needs no GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hf_tiny
from fusec.api import CompileResult
from fusec.config import Options
from fusec.pipeline import Dumper, lower
from fusec.cuda.codegen import WORD, render
from fusec.cuda.knobs import LATENCY_KNOBS_OFF
from fusec.cuda.jit import compile_cuda, compile_ptx


_STEPS: dict = {}
_CAPTURES: dict = {}


def _tiny_decode_step(factory, dtype, num_sms, **options):
    """What compile_model returns (schedule and graph) for one decode step of a tiny HF model
    after a 3-token prefill, lowered with ``num_sms`` and ``options``.

    Tests that ask for the same factory and dtype share one capture (a dynamo and AOT trace,
    about a second; lowering copies its graph), and those with the same SM count and options
    one lowering too (these tests only render the schedule, which reads it)."""
    key = (factory, dtype, num_sms, tuple(sorted(options.items())))
    if key not in _STEPS:
        if (factory, dtype) not in _CAPTURES:
            _CAPTURES[factory, dtype] = _capture_decode_step(factory, dtype)
        g, flat = _CAPTURES[factory, dtype]
        opts = Options.from_dict({"num_sms": num_sms, **options})
        _STEPS[key] = CompileResult(lower(g, flat, opts, Dumper(None)), opts, None)
    return _STEPS[key]


def _capture_decode_step(factory, dtype):
    """(IR graph, flat inputs) of the step (step_util.capture: compile_model's capture)."""
    import step_util
    model = factory().to(dtype)
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
    _, g, flat = step_util.capture(model, {"input_ids": torch.randint(0, 128, (1, 1)),
                                           "past_key_values": cache, "use_cache": True})
    return g, flat


@pytest.mark.parametrize("factory,dtype", [(hf_tiny.llama, torch.bfloat16), (hf_tiny.qwen3, torch.float32)])
def test_tiny_kernel_renders_and_compiles(factory, dtype):
    res = _tiny_decode_step(factory, dtype, 12)
    plan = render(res.schedule)
    s = res.schedule
    assert len(plan.words) == WORD * len(s.instrs)
    # every instruction word: op index (its counter), its id, and its wait list as scheduled
    cws = s.counter_waits()
    for q, sm_queue in enumerate(s.queues):
        for k, iid in enumerate(sm_queue):
            w = plan.words[(plan.queue_off[q] + k) * WORD:(plan.queue_off[q] + k + 1) * WORD]
            assert w[7] == iid and res.graph.ops[w[0]].name == s.instrs[iid].op
            pairs = plan.waits[2 * w[5]:2 * (w[5] + w[6])]
            assert list(zip(pairs[::2], pairs[1::2])) == cws[iid]
    for kind in ("rms_qkv_rope", "attention_partial", "matvec_residual", "rms_gate_up_silu", "rms_lm_head"):
        assert f"{kind}<" in plan.source
    # the run-wide NVRTC cache (FUSEC_CACHE_DIR, tests/conftest.py): the dispatch-by-kind test
    # below compiles this same source
    k = compile_cuda(plan.source, "fusec_step.cu")
    k.assert_no_spills()


def test_last_tile_merge_renders_tickets_and_compiles(tmp_path):
    """attention_merge="last_tile": no attention_reduce; each attention op owns one spare counter
    (ticket) per KV head, after the op counters, and the kernel compiles. Rendered with one
    dispatch case per op, whose calls hold the counter offsets as literals."""
    res = _tiny_decode_step(hf_tiny.llama, torch.bfloat16, 8, attention_merge="last_tile")
    kinds = res.graph.count_kinds()
    assert "attention_reduce" not in kinds
    plan = render(res.schedule, defines={"FUSEC_DISPATCH_BY_KIND": 0})
    n_ops, n_att = len(res.graph.ops), kinds["attention_partial"]
    n_kv = next(o for o in res.graph.ops if o.kind == "attention_partial").attrs["n_kv"]
    assert plan.n_counters == n_ops + n_att * n_kv
    for k in range(n_att):
        assert f"(counters + {n_ops + k * n_kv})" in plan.source
    assert plan.source.count("attention_partial_merge<") == n_att   # one call per attention op
    k = compile_cuda(plan.source, "fusec_step.cu", cache_dir=str(tmp_path))
    k.assert_no_spills()


def test_reduce_merge_renders_and_compiles(tmp_path):
    """attention_merge="reduce": a separate attention_reduce op, no spare counters."""
    res = _tiny_decode_step(hf_tiny.llama, torch.bfloat16, 8, attention_merge="reduce")
    assert res.graph.count_kinds()["attention_reduce"] == res.graph.count_kinds()["attention_partial"]
    plan = render(res.schedule)
    assert plan.n_counters == len(res.graph.ops) and "attention_partial_merge<" not in plan.source
    compile_cuda(plan.source, "fusec_step.cu", cache_dir=str(tmp_path)).assert_no_spills()


def test_profile_and_defines_render_and_compile(tmp_path):
    res = _tiny_decode_step(hf_tiny.llama, torch.bfloat16, 8)
    plain = render(res.schedule)
    prof = render(res.schedule, profile=True, defines={"FUSEC_LOADS_IN_FLIGHT": 16, "FUSEC_POLL_SLEEP": 0})
    assert not plain.profile and prof.profile
    assert "unsigned long long* prof" in prof.source and "unsigned long long* prof" not in plain.source
    assert "#define FUSEC_LOADS_IN_FLIGHT 16" in prof.source and "#define FUSEC_POLL_SLEEP 0" in prof.source
    assert prof.words == plain.words and prof.waits == plain.waits   # same schedule, more timestamps
    assert "#define FUSEC_MARKS" in prof.source and "#define FUSEC_MARKS" not in plain.source
    k = compile_cuda(prof.source, "fusec_step.cu", cache_dir=str(tmp_path))
    k.assert_no_spills()


def _llama_64():
    return hf_tiny.llama(hidden=64, inter=128, heads=8, kv_heads=2, head_dim=64)


def _llama_512():
    return hf_tiny.llama(hidden=512, inter=1024, heads=8, kv_heads=2, head_dim=64)


@pytest.mark.parametrize("hidden", [64, 512])
def test_batched_matvec_paths_render_and_compile(hidden, tmp_path):
    """bf16 rows of 64 (shorter than a warp's 16-byte step) and 512 (the batched path, one
    batch), with 16 loads in flight: the kernel compiles without spills."""
    factory = _llama_512 if hidden == 512 else _llama_64
    res = _tiny_decode_step(factory, torch.bfloat16, 8)
    plan = render(res.schedule, defines={"FUSEC_LOADS_IN_FLIGHT": 16})
    assert "#define FUSEC_LOADS_IN_FLIGHT 16" in plan.source and "dot_rows<" in plan.source
    k = compile_cuda(plan.source, "fusec_step.cu", cache_dir=str(tmp_path))
    k.assert_no_spills()




@pytest.mark.parametrize("factory,dtype", [(hf_tiny.llama, torch.bfloat16), (hf_tiny.qwen3, torch.float32)])
def test_dispatch_by_kind_calls_what_each_op_called(factory, dtype):
    """FUSEC_DISPATCH_BY_KIND: the layers of a kind share a case, and each op's case with its
    table row put back in is exactly the call the per-op dispatch makes; the kernel compiles.
    Two layers: the point is that they share a case."""
    import functools
    import re
    from fusec.cuda import codegen
    res = _tiny_decode_step(functools.partial(factory, layers=2), dtype, 12)
    per_op = render(res.schedule, defines={"FUSEC_DISPATCH_BY_KIND": "0"})   # as FUSEC_DEFINES gives it
    by_kind = render(res.schedule)   # the default
    assert "fusec_case_of" not in per_op.source
    calls = {}   # op index -> call text of the per-op switch
    for m in re.finditer(r"      case (\d+):  // [^\n]*\n        ([^\n]*);\n", per_op.source):
        calls[int(m.group(1))] = m.group(2)
    assert len(calls) == len(res.graph.ops)
    cases = [{"op": k, "call": calls[k], "kind": op.kind} for k, op in enumerate(res.graph.ops)]
    shared, rows, width = codegen.dispatch_by_kind(cases)
    assert len(shared) < len(cases)   # two layers share their cases
    for kc in shared:
        for k in kc["ops"]:
            back = re.sub(r"A\[(\d+)\]", lambda m: str(rows[k][int(m.group(1))]), kc["call"])
            assert back == calls[k], (k, back, calls[k])
    assert "switch (fusec_case_of[in.op])" in by_kind.source   # FUSEC_STAGE_QUEUE 0
    assert "switch (s_case_of[in.op])" in by_kind.source   # and 1 (the default): tables staged
    assert by_kind.source.count("\n          break;") == len(shared) + 1   # a case per shared call, default
    # the default render: the source test_tiny_kernel_renders_and_compiles compiled (run-wide cache)
    compile_cuda(by_kind.source, "fusec_step.cu").assert_no_spills()


def test_single_split_attention_knob_renders_and_compiles(tmp_path):
    """FUSEC_ATTN_SINGLE: the merge kind calls attention_partial_single (split 0 alone over the
    valid rows at short positions, writing the output itself) and compiles without spills; its
    numbers are checked on the GPU (test_gpu.py, test_kernel_knobs_match_eager)."""
    res = _tiny_decode_step(hf_tiny.llama, torch.bfloat16, 8)
    plain = render(res.schedule, defines={"FUSEC_ATTN_SINGLE": 0})
    single = render(res.schedule)   # the default: 256
    assert "#define FUSEC_ATTN_SINGLE 0" in plain.source and "#define FUSEC_ATTN_SINGLE 256" in single.source
    assert single.words == plain.words and single.waits == plain.waits   # same schedule
    k = compile_cuda(single.source, "fusec_step.cu", cache_dir=str(tmp_path))
    k.assert_no_spills()
    base = compile_cuda(plain.source, "fusec_step.cu", cache_dir=str(tmp_path))
    single_fn = lambda kern: [n for n in kern.resources if "attention_partial_single" in n]  # noqa: E731
    assert len(single_fn(k)) == 1 and not single_fn(base), sorted(k.resources)


@pytest.mark.parametrize("factory,dtype,merge,defines", [
    (hf_tiny.llama, torch.bfloat16, "last_tile", LATENCY_KNOBS_OFF),
    (hf_tiny.qwen3, torch.float32, "reduce", LATENCY_KNOBS_OFF),
    (hf_tiny.llama, torch.bfloat16, "reduce", {"FUSEC_MERGE_ONE_PASS": 0}),
    (hf_tiny.qwen3, torch.float32, "last_tile", {"FUSEC_EARLY_EPILOGUE_LOADS": 0}),
    (hf_tiny.qwen2_bias, torch.bfloat16, "last_tile", {"FUSEC_EARLY_EPILOGUE_LOADS": 0}),
    (hf_tiny.llama, torch.float32, "last_tile", {"FUSEC_STAGE_BATCH": 0, "FUSEC_ATTN_Q_EARLY": 0}),
    (hf_tiny.qwen3, torch.bfloat16, "reduce", {"FUSEC_ATTN_KV_EARLY": 0}),
    (hf_tiny.llama, torch.bfloat16, "last_tile", {"FUSEC_ATTN_KV_EARLY": 0, "FUSEC_STAGE_QUEUE": 0}),
    (hf_tiny.qwen3, torch.float32, "reduce", {"FUSEC_POLL_SLEEP": 0}),
    (hf_tiny.llama, torch.bfloat16, "last_tile", {"FUSEC_ATTN_LANES": 2}),
    (hf_tiny.qwen3, torch.float32, "reduce", {"FUSEC_ATTN_LANES": 0}),
    # the register limits of the lanes path (q chunks in registers, V in the K batch) at 16 and 8
    # query heads per KV head, and the value pass's reduce-scatter
    (lambda: hf_tiny.qwen3(hidden=256, inter=256, heads=16, kv_heads=1, head_dim=64), torch.float32, "last_tile",
     {"FUSEC_ATTN_LANES": 2}),
    (lambda: hf_tiny.llama(hidden=512, inter=1024, heads=8, kv_heads=1, head_dim=64), torch.bfloat16, "last_tile",
     {"FUSEC_ATTN_LANES": 2, "FUSEC_ATTN_V_SCATTER": 1}),
    (hf_tiny.qwen3, torch.float32, "reduce", {"FUSEC_ATTN_V_SCATTER": 1})])
def test_latency_knobs_render_and_compile(factory, dtype, merge, defines, tmp_path):
    """The latency knobs (on by default, fusec.cuda.knobs) off, all or one by one (FUSEC_MERGE_ONE_PASS
    for both merges; FUSEC_EARLY_EPILOGUE_LOADS with biases and Qwen3's head norm), and
    FUSEC_ATTN_KV_EARLY's other values with the queue staged or not, the poll without a sleep, and
    the split-KV scores by lanes (FUSEC_ATTN_LANES) and the value pass's reduce-scatter
    (FUSEC_ATTN_V_SCATTER): the kernel compiles without
    spills or warnings (the defaults: every family's emission test; numbers: the GPU knob and
    family tests)."""
    res = _tiny_decode_step(factory, dtype, 8, attention_merge=merge)
    plan = render(res.schedule, defines=defines)
    assert all(f"#define {k} {v}" in plan.source for k, v in defines.items())
    k = compile_cuda(plan.source, "fusec_step.cu", cache_dir=str(tmp_path))
    k.assert_no_spills()
    assert "warning" not in k.log, k.log


def test_early_epilogue_loads_put_the_residual_load_before_the_weight_loads():
    """What FUSEC_EARLY_EPILOGUE_LOADS is for, read in the PTX (tools/kernel_ptx.py): off, the
    O-/down-projection's residual load (a bf16 scalar) comes after the row's weight loads and
    shuffles (one more L2 round trip per tile); on, before its weight loads."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import kernel_ptx
    res = _tiny_decode_step(_llama_512, torch.bfloat16, 8)
    order = {}
    for on in (0, 1):
        ptx = compile_ptx(render(res.schedule, defines={"FUSEC_EARLY_EPILOGUE_LOADS": on}).source)
        body = next(b for n, b in kernel_ptx.functions(ptx).items() if "matvec_residual" in n).splitlines()
        residual = next(i for i, line in enumerate(body) if "ld.global.cg.b16" in line)
        weights = next(i for i, line in enumerate(body) if "ld.global.nc.L1::no_allocate" in line)
        order[on] = residual < weights
    assert order == {0: False, 1: True}, order


def test_every_knob_is_documented_and_read_by_a_template():
    """fusec/cuda/knobs.py: unique FUSEC_ names with int defaults and a description, and every
    knob is read somewhere in templates/ or in the kernel code an instruction kind writes itself
    (fusec/instructions/: a folded prologue's ``#if FUSEC_PROLOGUE_REGS``); a knob nothing reads
    would do nothing."""
    import fusec.instructions
    from fusec import template_dir
    from fusec.cuda.knobs import KNOBS, LATENCY_KNOBS_OFF, TABLE
    names = [k.name for k in TABLE]
    assert len(set(names)) == len(names) == len(KNOBS)
    assert all(k.name.startswith("FUSEC_") and isinstance(k.default, int) and len(k.doc) > 20 for k in TABLE)
    assert set(LATENCY_KNOBS_OFF) <= set(KNOBS)
    text = "".join(p.read_text() for p in Path(template_dir()).iterdir() if p.suffix in (".j2", ".cuh"))
    text += "".join(p.read_text() for p in Path(fusec.instructions.__file__).parent.glob("*.py"))
    unread = [n for n in names if n not in text.replace(f"#define {n}", "")]
    assert not unread, unread
