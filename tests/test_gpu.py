"""GPU tests (H200): the megakernel against PyTorch, the watchdog and index faults (reported
without a host sync), CUDA graphs (captured by torch, or the step's own), one launch per step."""
from __future__ import annotations

import copy
import runpy
from pathlib import Path

import pytest
import torch

import step_util
import hf_tiny
from fusec.cuda.knobs import LATENCY_KNOBS_OFF
from fusec.fallbacks import FallbackWatch

pytestmark = pytest.mark.gpu
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llama_3_2_1b.py"


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_tiny_fp32_decode_matches_eager(factory):
    model, cache = step_util.tiny_on_gpu(factory, torch.float32)
    ref = copy.deepcopy(cache)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"fallback": "eager"})
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for step in range(20):
            tok = torch.randint(0, 128, (1, 1), generator=gen).cuda()
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.clone()
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert torch.isfinite(a).all()
            assert step_util.rel(a, b) < 1e-4, step
    for l1, l2 in zip(cache.layers, ref.layers):
        assert step_util.rel(l1.keys, l2.keys) < 1e-5 and step_util.rel(l1.values, l2.values) < 1e-5
        assert int(l1.cumulative_length) == int(l2.cumulative_length)
    torch._dynamo.reset()


@pytest.mark.parametrize("hidden,inter", [(512, 1024), (320, 640), (896, 4864)])
def test_mid_size_matvec_paths_match_eager(hidden, inter):
    """Shapes where the batched 16-byte matvec path runs with whole warp steps (K a multiple of
    32 lanes x 16 B) and with chunks past them (K = 320 in fp32, 896 in bf16: Qwen2.5-0.5B's
    width), against eager in fp32 (1e-4); and the bf16 path against bf16 eager on the same cache
    (a gross-error bound: both round). No fallback."""
    from fusec.fallbacks import FallbackWatch
    factory = lambda: hf_tiny.llama(layers=2, hidden=hidden, inter=inter, heads=8, kv_heads=2, head_dim=64,  # noqa: E731
                                    vocab=256)
    gen = torch.Generator().manual_seed(5)
    toks = [torch.randint(0, 128, (1, 1), generator=gen).cuda() for _ in range(6)]
    model, cache = step_util.tiny_on_gpu(factory, torch.float32)
    ref_cache = copy.deepcopy(cache)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    with FallbackWatch() as w, torch.no_grad():
        for tok in toks:
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.clone()
            b = model(input_ids=tok, past_key_values=ref_cache, use_cache=True).logits
            assert step_util.rel(a, b) < 1e-4
    torch._dynamo.reset()
    bf = copy.deepcopy(model).to(torch.bfloat16)
    torch.manual_seed(0)
    cache = hf_tiny.static_cache(bf, 64)
    with torch.no_grad():
        bf(input_ids=torch.randint(0, 128, (1, 5), device="cuda"), past_key_values=cache, use_cache=True)
    eager_cache = copy.deepcopy(cache)
    compiled = torch.compile(bf, backend="fusec")
    with FallbackWatch() as w2, torch.no_grad():
        for tok in toks[:3]:
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.float()
            e = bf(input_ids=tok, past_key_values=eager_cache, use_cache=True).logits.float()
            assert torch.isfinite(a).all() and step_util.rel(a, e) < 5e-2
    torch._dynamo.reset()
    assert not w.fallbacks and not w2.fallbacks, (w.fallbacks, w2.fallbacks)
    assert w.compiled >= 1 and w2.compiled >= 1


@pytest.mark.parametrize("family", ["llama", "olmo2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_last_round_rows_match_eager_and_the_unsplit_kernel(family, dtype):
    """The rows of a matvec tile past its last full round of warps split along K over the idle
    warps (matvec_split.cuh matvec_split_rows, FUSEC_SPLIT_LAST_ROUND): a down projection with
    4104-wide rows (whole warp steps and a chunk past them, in fp32 and bf16) over 64 or 896 output rows, so
    that the tiles on 132 SMs hold 1 row (OLMo-2's post-norm MLP: plain ``matvec``, each row over
    16 warps) or 6-7 rows (Llama: ``matvec_residual``, 2 warps a row; the kinds and tiles are
    checked on the CPU: tests/test_matvec_widths.py). Six steps each: fp32
    within 1e-4 of eager, bf16 within bf16's gross-error bound of eager and within 1e-2 of the
    kernel without the split (FUSEC_SPLIT_LAST_ROUND 0: one warp per row); no fallback."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    def factory():
        if family == "llama":
            return hf_tiny.llama(layers=2, hidden=896, inter=4104, heads=8, kv_heads=2, head_dim=64, vocab=256)
        return hf_tiny._small(Olmo2Config, Olmo2ForCausalLM, intermediate_size=4104)
    gen = torch.Generator().manual_seed(21)
    toks = [torch.randint(0, 128, (1, 1), generator=gen).cuda() for _ in range(6)]
    model, cache = step_util.tiny_on_gpu(factory, dtype)
    logits = {}
    with torch.no_grad(), FallbackWatch() as w:
        for split in (1, 0):
            c, ref = copy.deepcopy(cache), copy.deepcopy(cache)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="fusec", options={"defines": {"FUSEC_SPLIT_LAST_ROUND": split}})
            logits[split] = []
            for tok in toks:
                a = compiled(input_ids=tok, past_key_values=c, use_cache=True).logits.float()
                b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits.float()
                assert torch.isfinite(a).all() and step_util.rel(a, b) < (1e-4 if dtype == torch.float32 else 5e-2)
                logits[split].append(a)
    torch._dynamo.reset()
    assert w.compiled >= 2 and not w.fallbacks, w.fallbacks
    for a, b in zip(logits[1], logits[0]):
        assert step_util.rel(a, b) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("defines", [{"FUSEC_LOADS_IN_FLIGHT": 4},
                                     {"FUSEC_ATTN_PREFETCH": 0}, {"FUSEC_ATTN_PREFETCH": 2},
                                     {"FUSEC_STAGE_QUEUE": 0}, {"FUSEC_DISPATCH_BY_KIND": 0},
                                     {"FUSEC_DISPATCH_BY_KIND": 0, "FUSEC_STAGE_QUEUE": 0},
                                     {"FUSEC_ABORT_EVERY_INSTR": 1}, {"FUSEC_ABORT_EVERY_INSTR": 1, "FUSEC_STAGE_QUEUE": 0},
                                     # the latency knobs (on by default since 2026-12-02): all off (the path
                                     # before), each off in one set, and FUSEC_ATTN_KV_EARLY's other value
                                     LATENCY_KNOBS_OFF, {"FUSEC_ATTN_SINGLE": 0},
                                     {"FUSEC_MERGE_ONE_PASS": 0, "FUSEC_EARLY_EPILOGUE_LOADS": 0},
                                     {"FUSEC_ATTN_Q_EARLY": 0, "FUSEC_STAGE_BATCH": 0, "FUSEC_ATTN_KV_EARLY": 0},
                                     # the counter polled without sleeping
                                     {"FUSEC_POLL_SLEEP": 0},
                                     # the split-KV scores by lanes, with the value rows in the K batch or not
                                     {"FUSEC_ATTN_LANES": 0}, {"FUSEC_ATTN_LANES": 2, "FUSEC_ATTN_SINGLE": 0},
                                     # the value pass's butterfly sums instead of the reduce-scatter
                                     {"FUSEC_ATTN_V_SCATTER": 0},
                                     # the RMSNorm prologue by elements, not 16-byte chunks
                                     {"FUSEC_NORM_VEC": 0}])
def test_kernel_knobs_match_eager(defines):
    """A non-default setting of each kernel knob (fusec.cuda.knobs) against eager, in bf16, on
    shapes where the batched matvec and the vector attention paths run; 5e-2 is a gross-error
    bound (both round to bf16), 12 steps after a 9-token prompt (positions 9-20: the split-KV
    chunk is 16 rows, so FUSEC_ATTN_SINGLE's one-split path runs up to 15 and the merge after),
    then both caches' positions reset to 5 and 4 steps more on the same kernel (one split again,
    after steps whose tickets wrapped)."""
    factory = lambda: hf_tiny.llama(layers=2, hidden=512, inter=1024, heads=8, kv_heads=2, head_dim=64,  # noqa: E731
                                    vocab=256)
    gen = torch.Generator().manual_seed(7)
    toks = [torch.randint(0, 128, (1, 1), generator=gen).cuda() for _ in range(12)]
    model, cache = step_util.tiny_on_gpu(factory, torch.bfloat16, max_len=64, prompt=9)
    ref_cache = copy.deepcopy(cache)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"fallback": "eager", "defines": defines})
    with torch.no_grad(), FallbackWatch() as watch:
        for tok in toks:
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.float()
            b = model(input_ids=tok, past_key_values=ref_cache, use_cache=True).logits.float()
            assert torch.isfinite(a).all() and step_util.rel(a, b) < 5e-2
        for c in (cache, ref_cache):
            for layer in c.layers:
                layer.cumulative_length.fill_(5)
        for tok in toks[:4]:
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.float()
            b = model(input_ids=tok, past_key_values=ref_cache, use_cache=True).logits.float()
            assert torch.isfinite(a).all() and step_util.rel(a, b) < 5e-2
    assert not watch.fallbacks, f"the kernel did not run (a fallback compares eager with eager): {watch.fallbacks}"
    torch._dynamo.reset()


def test_watchdog_reports_a_missing_producer():
    """A wait on a counter nobody signals: the step returns at once (no sync), the kernel gives
    up on the GPU; raise_if_watchdog (synchronizing) reports it, and so does the next call
    (before launching). Counters are reset: the repaired step runs again."""
    from fusec.errors import WatchdogError
    model, cache = step_util.tiny_on_gpu(hf_tiny.llama, torch.bfloat16)
    kwargs = {"input_ids": torch.randint(0, 128, (1, 1), device="cuda"), "past_key_values": cache,
              "use_cache": True}
    _, g, flat = step_util.capture(model, kwargs)
    step, sched = step_util.build(g, flat, watchdog_s=0.2)
    step(*flat)  # a good step first
    step.raise_if_watchdog()
    victim = next(i for i in range(len(step.plan.words) // 8) if step.plan.words[i * 8 + 6] > 0)
    woff = 2 * step.plan.words[victim * 8 + 5]    # waits are (counter, tiles) pairs
    good = step.plan.waits[woff]
    step.waits[woff] = step.plan.n_counters      # a counter that no instruction signals
    step(*flat)                                  # returns: the status is read at the next call
    with pytest.raises(WatchdogError) as e:
        step.raise_if_watchdog()
    f = e.value.fields
    assert f["counter"] == step.plan.n_counters and f["value"] == 0 and f["target"] == 2
    assert f["instruction"] == step.plan.words[victim * 8 + 7]
    assert 0 <= f["sm"] < step.plan.num_sms and f["stuck_sms"] >= 1
    assert "watchdog" in str(e.value)
    step.waits[woff] = good                      # repaired; the counters were reset (epoch 1)
    step(*flat)
    step.raise_if_watchdog()
    step.waits[woff] = step.plan.n_counters      # again, now reported by the next call
    step(*flat)
    torch.cuda.synchronize()                     # the watchdog has fired and written its records
    with pytest.raises(WatchdogError) as e:
        step(*flat)
    f = e.value.fields
    assert f["counter"] == step.plan.n_counters and f["target"] == 2
    assert f["instruction"] == step.plan.words[victim * 8 + 7]


def test_out_of_range_token_raises_index_fault():
    """An out-of-range token id: the step returns (no sync), the NEXT call raises (before
    launching) with code, value and bound; raise_if_watchdog reports it too. The record is
    cleared: the following steps are clean."""
    from fusec.errors import IndexFaultError
    model, cache = step_util.tiny_on_gpu(hf_tiny.llama, torch.bfloat16)
    ids = torch.randint(0, 128, (1, 1), device="cuda")
    kwargs = {"input_ids": ids, "past_key_values": cache, "use_cache": True}
    _, g, flat = step_util.capture(model, kwargs)
    step, sched = step_util.build(g, flat)
    step(*flat)  # a good step first
    step.raise_if_watchdog()
    vocab = model.config.vocab_size
    ids.fill_(vocab + 3)                      # same tensor: the kernel reads the new id
    step(*flat)                               # returns: nothing was recorded before this launch
    torch.cuda.synchronize()
    ids.fill_(1)
    with pytest.raises(IndexFaultError) as e:
        step(*flat)
    assert e.value.code == 1 and e.value.value == vocab + 3 and e.value.bound == vocab
    assert e.value.fields == {"code": 1, "value": vocab + 3, "bound": vocab}
    assert "token id" in str(e.value)
    step(*flat)                               # the record was reset: the next step is clean
    step.raise_if_watchdog()
    ids.fill_(vocab + 5)
    step(*flat)
    with pytest.raises(IndexFaultError) as e:
        step.raise_if_watchdog()              # the explicit check: synchronizes, then reads
    assert e.value.code == 1 and e.value.value == vocab + 5 and e.value.bound == vocab
    ids.fill_(2)
    step(*flat)
    step.raise_if_watchdog()


def test_default_plain_loop_makes_no_host_sync():
    """Default options: a plain loop of compiled decode steps (a new token tensor each step, so
    the pointer table is rewritten every step) makes no torch-level sync and matches eager."""
    model, cache = step_util.tiny_on_gpu(hf_tiny.llama, torch.float32)
    ref = copy.deepcopy(cache)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"fallback": "eager"})
    gen = torch.Generator().manual_seed(11)
    toks = [torch.randint(0, 128, (1, 1), generator=gen).cuda() for _ in range(10)]
    with torch.no_grad(), FallbackWatch() as w:
        for tok in toks[:2]:                  # compile and warm up (syncs allowed here)
            compiled(input_ids=tok, past_key_values=cache, use_cache=True)
            model(input_ids=tok, past_key_values=ref, use_cache=True)
        torch.cuda.synchronize()
        outs = []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for tok in toks[2:]:
                outs.append(compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.clone())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for step, (tok, a) in enumerate(zip(toks[2:], outs)):
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert torch.isfinite(a).all() and step_util.rel(a, b) < 1e-4, step
    assert not w.fallbacks, f"the kernel did not run: {w.fallbacks}"
    for l1, l2 in zip(cache.layers, ref.layers):
        assert int(l1.cumulative_length) == int(l2.cumulative_length)
    torch._dynamo.reset()


def test_compiled_step_replays_from_a_torch_cuda_graph():
    """The compiled step captured in torch.cuda.graph (default options) and replayed with a
    static token tensor: the kernel advances the cache positions itself, so each replay is the
    next step; matches eager (fp32). Eager calls after the replays still see their own
    tensors (the graph's pointer table is its own)."""
    model, cache = step_util.tiny_on_gpu(hf_tiny.llama, torch.float32)
    ref = copy.deepcopy(cache)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"fallback": "eager"})
    gen = torch.Generator().manual_seed(12)
    toks = [torch.randint(0, 128, (1, 1), generator=gen).cuda() for _ in range(10)]
    static = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    with torch.no_grad(), FallbackWatch() as w:
        for tok in toks[:2]:                  # compile and warm up, eagerly
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.clone()
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert step_util.rel(a, b) < 1e-4
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = compiled(input_ids=static, past_key_values=cache, use_cache=True).logits
        for step, tok in enumerate(toks[2:8]):
            static.copy_(tok)
            graph.replay()
            a = logits.clone()
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert torch.isfinite(a).all() and step_util.rel(a, b) < 1e-4, step
        for tok in toks[8:]:                  # eager calls again, with other tensors
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.clone()
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert step_util.rel(a, b) < 1e-4
    assert not w.fallbacks, f"the kernel did not run: {w.fallbacks}"
    for l1, l2 in zip(cache.layers, ref.layers):
        assert int(l1.cumulative_length) == int(l2.cumulative_length) == 5 + len(toks)
        assert step_util.rel(l1.keys, l2.keys) < 1e-5 and step_util.rel(l1.values, l2.values) < 1e-5
    torch._dynamo.reset()


def test_reduce_overhead_mode_matches_eager():
    """mode="reduce-overhead": the step replays a CUDA graph of its own launch (recorded at the
    first call); a new token tensor each step rewrites the pointer table under the graph.
    Matches eager (fp32), no fallback, no "graph not instantiated" line."""
    model, cache = step_util.tiny_on_gpu(hf_tiny.llama, torch.float32)
    ref = copy.deepcopy(cache)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"fallback": "eager", "mode": "reduce-overhead"})
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad(), FallbackWatch() as w:
        for step in range(8):
            tok = torch.randint(0, 128, (1, 1), generator=gen).cuda()
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.clone()
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert torch.isfinite(a).all() and step_util.rel(a, b) < 1e-4, step
    assert not w.fallbacks, f"the kernel did not run: {w.fallbacks}"
    assert not [m for m in w.warnings if "CUDA graph" in m], w.warnings
    for l1, l2 in zip(cache.layers, ref.layers):
        assert int(l1.cumulative_length) == int(l2.cumulative_length)
    torch._dynamo.reset()
    # the step itself: its graph exists and replays
    _, g, flat = step_util.capture(model, {"input_ids": torch.randint(0, 128, (1, 1), device="cuda"),
                                           "past_key_values": cache, "use_cache": True})
    step, _ = step_util.build(g, flat, mode="reduce-overhead")
    out = step(*flat)[0].clone()
    assert step._graph is not None
    step(*flat)
    step.raise_if_watchdog()
    assert torch.isfinite(out).all()


def test_one_kernel_launch_per_decode_step():
    model, cache = step_util.tiny_on_gpu(hf_tiny.llama, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={})
    with torch.no_grad():
        for _ in range(2):
            compiled(input_ids=torch.randint(0, 128, (1, 1), device="cuda"), past_key_values=cache, use_cache=True)
        toks = [torch.randint(0, 128, (1, 1), device="cuda") for _ in range(3)]
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for tok in toks:
                compiled(input_ids=tok, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    names = sorted({e.name for e in kernels})
    assert [e.name for e in kernels].count("fusec_step") == 3, names
    assert len(kernels) == 3, names   # nothing else runs on the GPU for a decode step
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def llama_1b():
    model, _, kwargs = runpy.run_path(str(EXAMPLE))["build"]()
    model = model.to("cuda")
    cache = hf_tiny.static_cache(model, 4096)
    ref32 = copy.deepcopy(model).float()
    return model, ref32, cache


@pytest.mark.parametrize("position", [0, 127, 2047, 4095])
def test_llama_1b_logits_against_fp32(llama_1b, position):
    model, ref32, cache = llama_1b
    gen = torch.Generator().manual_seed(1000 + position)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device="cuda"), past_key_values=cache, use_cache=True)
        step_util.random_cache_state(cache, position, gen)
        tok = torch.randint(0, 128256, (1, 1), generator=gen).cuda()
        _, g, flat = step_util.capture(model, {"input_ids": tok, "past_key_values": cache, "use_cache": True})
        step_util.random_cache_state(cache, position, torch.Generator().manual_seed(2000 + position))
        eager_cache = copy.deepcopy(cache)
        ref_cache = copy.deepcopy(cache)
        for l in ref_cache.layers:
            l.keys, l.values = l.keys.float(), l.values.float()
        step, sched = step_util.build(g, flat)
        step_util.poison(step)
        logits = step(*flat)[0].float().clone()
        eager = model(input_ids=tok, past_key_values=eager_cache, use_cache=True).logits.float()
        ref = ref32(input_ids=tok, past_key_values=ref_cache, use_cache=True).logits.float()
    e_fusec, e_eager = step_util.rel(logits.reshape(-1), ref.reshape(-1)), step_util.rel(eager.reshape(-1), ref.reshape(-1))
    print(f"position {position}: rel L2 vs fp32 fusec {e_fusec:.3e} eager bf16 {e_eager:.3e}")
    assert torch.isfinite(logits).all()
    assert e_fusec <= 1.5 * e_eager
    row = slice(position, position + 1)
    for l1, l2, l3 in zip(cache.layers, eager_cache.layers, ref_cache.layers):
        assert int(l1.cumulative_length) == int(l2.cumulative_length) == position + 1
        for a, b, r in ((l1.keys, l2.keys, l3.keys), (l1.values, l2.values, l3.values)):
            # the new row: as close to the fp32 model's as bf16 eager's is (x1.5, + rounding slack)
            assert step_util.rel(a[:, :, row], r[:, :, row]) <= 1.5 * step_util.rel(b[:, :, row], r[:, :, row]) + 4e-3
            assert torch.equal(a[:, :, :position], b[:, :, :position])        # older rows untouched


def test_llama_1b_1000_steps_track_eager(llama_1b):
    """1,000 consecutive steps fed the same tokens as eager: finite logits every step, and a KV
    cache as close to the fp32 model's as bf16 eager's is."""
    model, ref32, _ = llama_1b
    from transformers import StaticCache
    steps, start = 1000, 16
    gen = torch.Generator().manual_seed(7)
    caches = [StaticCache(config=model.config, max_cache_len=start + steps + 8) for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device="cuda"), past_key_values=c, use_cache=True)
        ours, eager = caches
        step_util.random_cache_state(ours, start, gen)
        for l1, l2 in zip(ours.layers, eager.layers):
            l2.keys.copy_(l1.keys); l2.values.copy_(l1.values); l2.cumulative_length.fill_(start)
        ref = StaticCache(config=ref32.config, max_cache_len=start + steps + 8)
        ref32(input_ids=torch.zeros(1, 1, dtype=torch.long, device="cuda"), past_key_values=ref, use_cache=True)
        for l1, l3 in zip(ours.layers, ref.layers):
            l3.keys.copy_(l1.keys.float()); l3.values.copy_(l1.values.float()); l3.cumulative_length.fill_(start)
        toks = torch.randint(0, 128256, (steps, 1, 1), generator=gen).cuda()
        tok = toks[0].clone()
        _, g, flat = step_util.capture(model, {"input_ids": tok, "past_key_values": ours, "use_cache": True})
        for l in ours.layers:
            l.cumulative_length.fill_(start)
        step, _ = step_util.build(g, flat, check_watchdog=True)
        for i in range(steps):
            tok.copy_(toks[i])
            step_util.poison(step)
            logits = step(*flat)[0]
            assert torch.isfinite(logits).all(), i
            del logits   # (held at the next call, its poisoned buffer would go to this test, not the kernel)
            model(input_ids=toks[i], past_key_values=eager, use_cache=True)
            ref32(input_ids=toks[i], past_key_values=ref, use_cache=True)
    end = start + steps
    for l1, l2, l3 in zip(ours.layers, eager.layers, ref.layers):
        assert int(l1.cumulative_length) == int(l2.cumulative_length) == end
        for a, b, r in ((l1.keys, l2.keys, l3.keys), (l1.values, l2.values, l3.values)):
            new = slice(start, end)
            assert step_util.rel(a[:, :, new], r[:, :, new]) <= 1.5 * step_util.rel(b[:, :, new], r[:, :, new]) + 1e-3


def test_token_views_run_the_megakernel():
    """Token ids a user slices out of a longer tensor (``seq[:, -1:]`` of the growing sequence:
    every other step its address is not 16-byte aligned), on the first call and on later ones,
    then one unaligned view whose ids change in place between calls, then captured in
    torch.cuda.graph from an unaligned view of a static tensor: default
    options, fusec's logits match eager's (fp32, 1e-4) at every step with no fallback; the
    kernel reads each call's token (the staging copy is stream-ordered and captured)."""
    model, cache = step_util.tiny_on_gpu(hf_tiny.llama, torch.float32)
    ref = copy.deepcopy(cache)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    gen = torch.Generator().manual_seed(21)
    seq = torch.randint(0, 128, (1, 6), generator=gen).cuda()     # the last id is 40 bytes in
    unaligned = 0
    with torch.no_grad(), FallbackWatch() as w:
        for step in range(6):
            tok = seq[:, -1:]
            unaligned += tok.data_ptr() % 16 != 0
            a = compiled(input_ids=tok, past_key_values=cache, use_cache=True).logits.clone()
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert 0 < step_util.rel(a, b) < 1e-4, step
            nxt = torch.randint(0, 128, (1, 1), generator=gen).cuda()
            seq = torch.cat([seq, nxt], dim=1)
        held = torch.zeros(1, 3, dtype=torch.long, device="cuda")
        same = held[:, 1:2]                                        # one unaligned address, new ids
        for step in range(3):
            tok = torch.randint(0, 128, (1, 1), generator=gen).cuda()
            held[:, 1:2].copy_(tok)
            a = compiled(input_ids=same, past_key_values=cache, use_cache=True).logits.clone()
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert 0 < step_util.rel(a, b) < 1e-4, step
        static = torch.zeros(1, 3, dtype=torch.long, device="cuda")
        view = static[:, 1:2]                                      # 8 bytes in
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = compiled(input_ids=view, past_key_values=cache, use_cache=True).logits
        for step in range(4):
            tok = torch.randint(0, 128, (1, 1), generator=gen).cuda()
            static[:, 1:2].copy_(tok)
            graph.replay()
            a = logits.clone()
            b = model(input_ids=tok, past_key_values=ref, use_cache=True).logits
            assert 0 < step_util.rel(a, b) < 1e-4, step
    assert unaligned == 3
    assert not w.fallbacks, f"the kernel did not run: {w.fallbacks}"
    torch._dynamo.reset()


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_decode_matches_eager(dtype, factory):
    """A batch of 4 left-padded prompts (tests/test_batch_decode.py) on the GPU: the batched
    fused kinds (``rms_qkv_rope_seqs`` with each sequence's RoPE row, Qwen3's per-head norms over
    whole heads; ``rms_gate_up_silu_seqs``), the batched linears and the per-sequence masked
    attention of the megakernel give every sequence eager's logits (fp32: 1e-4; bf16: 3e-2), one
    fusec step, no fallback."""
    from test_batch_decode import batch_steps_against_eager
    model = factory().to(device="cuda", dtype=dtype)
    errs, w, _ = batch_steps_against_eager(model, 4, 11, n=6, device="cuda")
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert max(errs) < (1e-4 if dtype == torch.float32 else 3e-2), errs
