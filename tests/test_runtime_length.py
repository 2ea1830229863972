"""A length-polymorphic step (the KV cache's rows a run-time length, docs/ir.md): one lowered
schedule serves caches of any length up to its capacity, in the simulator (against HF eager)
and in the kernel source (the length is read from the pointer table's length slot).

The graphs are made polymorphic by hand here: a decode step traced at capacity C, then every
KV-cache input marked ``sym={2: "s0"}`` and ``g.lengths = {"s0": C}`` before lowering (what the
frontend does for a symbolic cache length)."""
from __future__ import annotations

import copy
import re

import pytest
import torch

import hf_tiny
import step_util
from fusec.config import Options
from fusec.errors import FusecError
from fusec.ir import Graph, Op, Role, TensorInfo
from fusec.ir.env import Env
from fusec.pipeline import Dumper, lower
from fusec.sim import Simulator


def _prefilled(model, rows: int, prompt: torch.Tensor):
    cache = hf_tiny.static_cache(model, rows)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    return cache


def _cache_tensors(cache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        out += [layer.keys, layer.values]
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            out.append(layer.cumulative_length)
    return out


def polymorphic_capture(model, cap: int) -> tuple:
    """(IR graph marked polymorphic, flat inputs of the capture, the capture's cache, token-id
    input index) of a decode step of ``model`` traced with a cache of ``cap`` rows."""
    prompt = torch.randint(0, model.config.vocab_size, (1, 3), generator=torch.Generator().manual_seed(1))
    cache = _prefilled(model, cap, prompt)
    tok = torch.zeros(1, 1, dtype=torch.long)
    _, g, flat = step_util.capture(model, {"input_ids": tok, "past_key_values": cache, "use_cache": True})
    mark_polymorphic(g, cap)
    ids = next(k for k, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.data_ptr() == tok.data_ptr())
    return g, flat, cache, ids


def polymorphic_step(model, cap: int, num_sms: int, captured: tuple | None = None, **options):
    """(schedule, flat inputs of the capture, the capture's cache, token-id input index) of a
    decode step of ``model`` traced with a cache of ``cap`` rows and lowered length-polymorphic;
    ``captured``: :func:`polymorphic_capture` of that model and capacity, made before (lowering
    copies the graph: captures are shared by tests that lower one model with other options)."""
    g, flat, cache, ids = captured if captured is not None else polymorphic_capture(model, cap)
    sched = lower(g, flat, Options.from_dict({"num_sms": num_sms, **options}), Dumper(None))
    return sched, flat, cache, ids


def mark_polymorphic(g: Graph, cap: int) -> None:
    """Every KV-cache input's rows become the run-time length s0 of capacity ``cap``."""
    for name in g.inputs:
        t = g.tensors[name]
        if t.role == Role.KV_CACHE:
            assert t.shape[2] == cap
            t.sym = {2: "s0"}
    g.lengths = {"s0": cap}


def _logits(outs, vocab):
    return next(o for o in outs if o.shape[-1] == vocab and o.numel() == vocab)


def _run_lengths(model, sched, flat, cap_cache, ids_at, lengths, positions, seed=0):
    """For each cache length n and position: the polymorphic schedule in the simulator (hazard
    check on) on a StaticCache of n rows against HF eager on a copy of it; logits and the caches
    after the step agree."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    sim = Simulator(sched, seed=seed)
    cap_tensors = {t.data_ptr(): k for k, t in enumerate(_cache_tensors(cap_cache))}
    for n in lengths:
        prompt = torch.randint(0, vocab, (1, 2), generator=gen)
        cache = _prefilled(model, n, prompt)
        for pos in positions(n):
            step_util.random_cache_state(cache, pos, gen)
            ref = copy.deepcopy(cache)
            tok = torch.randint(0, vocab, (1, 1), generator=gen)
            mine = _cache_tensors(cache)
            args = []
            for k, a in enumerate(flat):
                if k == ids_at:
                    a = tok
                elif isinstance(a, torch.Tensor) and a.data_ptr() in cap_tensors:
                    a = mine[cap_tensors[a.data_ptr()]]
                args.append(a)
            with torch.no_grad():
                got = _logits(sim.step(args), vocab).reshape(-1)
                want = model(input_ids=tok, past_key_values=ref, use_cache=True).logits.reshape(-1)
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < 1e-4, f"cache of {n} rows, position {pos}: relative error {rel:.2e}"
            for l1, l2 in zip(cache.layers, ref.layers):
                assert l1.keys.shape[2] == n
                assert torch.allclose(l1.keys, l2.keys, atol=1e-5) and torch.allclose(l1.values, l2.values, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_one_schedule_serves_every_cache_length(heads, kv_heads):
    """A schedule lowered for capacity 256 runs caches of 24, 57 and 200 rows at their first,
    middle and last positions (GQA and MHA), as HF eager on the same caches."""
    from fusec.fallbacks import FallbackWatch
    model = hf_tiny.llama(layers=2, heads=heads, kv_heads=kv_heads)
    with FallbackWatch() as w:
        sched, flat, cap_cache, ids = polymorphic_step(model, 256, num_sms=8)
    assert not w.fallbacks, w.fallbacks
    kinds = sched.graph.count_kinds()
    assert kinds["rms_qkv_rope"] == 2 and kinds["attention_partial"] == 2
    assert {k for k in kinds if k.startswith("aten.") or k in ("kv_write", "attention")} <= {"aten.copy_.default"}
    _run_lengths(model, sched, flat, cap_cache, ids, [24, 57, 200], lambda n: [0, n // 2, n - 1])


def test_splits_of_several_blocks_rescale_as_one_softmax():
    """Capacity 1024 over 2 splits per KV head (4 SMs): a split may hold 512 rows, two blocks of
    256 (the knob FUSEC_ATTN_BLOCK_ROWS 256; the online-softmax rescaling); at positions past 512
    both splits run two blocks; with the generic (unfused) attention too."""
    from fusec.instructions.attention import AttentionPartial
    model = hf_tiny.llama(layers=2, heads=4, kv_heads=2)
    captured = polymorphic_capture(model, 1024)   # one trace, lowered twice
    sched, flat, cap_cache, ids = polymorphic_step(model, 1024, num_sms=4, captured=captured,
                                                   defines={"FUSEC_ATTN_BLOCK_ROWS": 256})
    att = [op for op in sched.graph.ops if op.kind == "attention_partial"]
    assert att and all(op.attrs["chunk"] == 256 and op.attrs["n_chunks"] == 2 for op in att)
    assert all(AttentionPartial.multi_block(op, sched.graph) for op in att)
    _run_lengths(model, sched, flat, cap_cache, ids, [700, 1024], lambda n: [n - 1, 600])
    # no fused kinds: the generic kv_write / attention over the run-time length
    sched, flat, cap_cache, ids = polymorphic_step(model, 1024, num_sms=4, captured=captured, max_fusions=0)
    assert "attention" in sched.graph.count_kinds() and "kv_write" in sched.graph.count_kinds()
    _run_lengths(model, sched, flat, cap_cache, ids, [40, 700], lambda n: [n - 1])


def _attention_graph(cap: int, nq: int, nkv: int, d: int, nc: int, chunk: int, mask_kind: int) -> Graph:
    """One ``attention_partial`` op (last-tile merge) over caches [1, nkv, s0<=cap, d], with a
    mask [s0] (``mask_kind`` 1 bool, 2 additive) when ``mask_kind``."""
    g = Graph()
    f32 = torch.float32
    ins = [TensorInfo("q", (nq * d,), f32, Role.INPUT, input_index=0),
           TensorInfo("k", (1, nkv, cap, d), f32, Role.KV_CACHE, input_index=1, sym={2: "s0"}),
           TensorInfo("v", (1, nkv, cap, d), f32, Role.KV_CACHE, input_index=2, sym={2: "s0"}),
           TensorInfo("pos", (), torch.int64, Role.STATE, input_index=3)]
    if mask_kind:
        ins.append(TensorInfo("mask", (cap,), torch.bool if mask_kind == 1 else f32, Role.INPUT, input_index=4,
                              sym={0: "s0"}))
    for t in ins:
        g.add_tensor(t)
    g.add_tensor(TensorInfo("o_part", (nq, nc, d), f32))
    g.add_tensor(TensorInfo("ml_part", (nq, nc, 2), f32))
    g.add_tensor(TensorInfo("out", (nq * d,), f32, Role.OUTPUT))
    g.inputs, g.outputs = [t.name for t in ins], ["out"]
    g.lengths = {"s0": cap}
    op_in = {"q": "q", "kcache": "k", "vcache": "v", "pos": "pos"}
    if mask_kind:
        op_in["mask"] = "mask"
    g.ops = [Op("att", "attention_partial", op_in, {"o_part": "o_part", "ml_part": "ml_part", "out": "out"},
                attrs={"scale": d ** -0.5, "n_q": nq, "n_kv": nkv, "head_dim": d, "chunk": chunk,
                       "n_chunks": nc, "mask_kind": mask_kind})]
    return g


@pytest.mark.parametrize("mask_kind", [0, 1, 2])
def test_block_loop_equals_one_softmax_with_masks(mask_kind):
    """The split-KV kind's Python semantics (the template's block loop) over blocks of 16 rows
    equal SDPA over the run-time rows, with a bool mask whose first blocks are masked whole
    (their m = -inf until a later block), an additive mask, and none; every tile's run-time
    regions lie in the caches' run-time extent."""
    from fusec.instructions import kind_of
    from fusec.ir.semantics import attend
    nq, nkv, d, nc, chunk, cap = 4, 2, 8, 3, 16, 160
    g = _attention_graph(cap, nq, nkv, d, nc, chunk, mask_kind)
    gen = torch.Generator().manual_seed(3)
    for n, pos in ((150, 149), (100, 40), (7, 6)):
        q = torch.randn(nq * d, generator=gen)
        k, v = (torch.randn(1, nkv, n, d, generator=gen) for _ in range(2))
        args = [q, k, v, torch.tensor(pos)]
        mask = None
        if mask_kind == 1:
            mask = torch.rand(n, generator=gen) > 0.3
            mask[: min(n, 40)] = False          # the first blocks of split 0 masked whole
            mask[-1] = True
        elif mask_kind == 2:
            mask = torch.randn(n, generator=gen)
        if mask is not None:
            args.append(mask)
        env = Env(g, args)
        assert env.lengths == {"s0": n} and env.shape("k") == (1, nkv, n, d)
        op = g.ops[0]
        cls = kind_of(op)
        for tile in cls.tiles(op, g, 1):
            reads, _ = cls.runtime_regions(op, tile, env)
            for r in reads:
                if r.tensor in ("k", "v"):
                    assert 0 <= r.start < r.stop <= nkv * n * d
            cls.run_tile(op, tile, env)
        rows = n if mask_kind else pos + 1
        want = attend(q.reshape(nq, d), k[0], v[0], rows, d ** -0.5, mask, mask_kind).reshape(-1)
        got = env.read("out")
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (n, pos, (got - want).abs().max())


def test_env_learns_lengths_and_refuses_disagreeing_inputs():
    g = _attention_graph(64, 2, 1, 4, 2, 32, 0)
    k = torch.zeros(1, 1, 10, 4)
    env = Env(g, [torch.zeros(8), k, torch.zeros(1, 1, 10, 4), torch.tensor(3)])
    assert env.lengths == {"s0": 10} and env.length("k", 2) == 10 and env.length("k", 3) == 4
    assert env.shape("q") == (8,)
    with pytest.raises(FusecError, match=r"run-time length s0: input k has 10 rows.*input v has 12"):
        Env(g, [torch.zeros(8), k, torch.zeros(1, 1, 12, 4), torch.tensor(3)])


def test_capacity_does_not_move_the_schedule():
    """The cost model counts at most 4096 rows of a cache or a position table (a table_lookup
    reads one row): a step of capacity 32768 is placed as the static step of a 4096-row cache
    (a table_lookup costed at its capacity-sized table moved 711 of the 1449 instructions of a
    2-layer step at Llama-3.2-1B's widths, and cost the 1B's step 58 us on the H200)."""
    from fusec.api import compile_model
    model = hf_tiny.llama(layers=2, heads=4, kv_heads=2)
    cache = _prefilled(model, 4096, torch.randint(0, 128, (1, 3)))
    static = compile_model(model, (), {"input_ids": torch.zeros(1, 1, dtype=torch.long), "past_key_values": cache,
                                       "use_cache": True}, {"num_sms": 8}).schedule
    poly, *_ = polymorphic_step(model, 32768, num_sms=8)
    assert [(i.op, i.sm, i.waits) for i in static.instrs] == [(i.op, i.sm, i.waits) for i in poly.instrs]
    assert [(i.tile.weight_bytes, i.tile.act_bytes) for i in static.instrs] == \
        [(i.tile.weight_bytes, i.tile.act_bytes) for i in poly.instrs]


# ---- the kernel source ----

def _poly_source(cap: int, num_sms: int = 4, **defines):
    from fusec.cuda.codegen import render
    model = hf_tiny.llama(layers=2, heads=4, kv_heads=2).to(torch.bfloat16)
    sched, *_ = polymorphic_step(model, cap, num_sms=num_sms)
    return sched, render(sched, defines=defines or None)


def test_kernel_reads_the_length_from_its_slot_and_compiles(tmp_path):
    """The polymorphic kernel names no cache length: two capacities with the same splits and
    block (4096, 16384: two splits of several blocks of 512) give the same source but for the RoPE
    tables' rows (RP, table_lookup's bound); the length is FUSEC_LEN of the slot "#len:s0"; the
    kernel compiles without spills, with the default knobs, all latency knobs off and the scalar
    score path."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from fusec.cuda.knobs import LATENCY_KNOBS_OFF
    s1, p1 = _poly_source(4096)
    s2, p2 = _poly_source(16384)
    assert p1.words == p2.words and p1.waits == p2.waits           # one schedule
    assert p1.buffers.count("#len:s0") == 1 and p1.buffers == p2.buffers
    slot = p1.buffers.index("#len:s0")
    assert f"FUSEC_LEN(bufs[{slot}])" in p1.source or "FUSEC_LEN(bufs[A[" in p1.source
    assert "#define FUSEC_LEN(b) ((int)(long long)(b))" in p1.source
    for cap, src in ((4096, p1.source), (16384, p2.source)):
        # the capacity appears only as the tables' rows
        for line in src.splitlines():
            if re.search(rf"\b{cap}\b", line):
                assert "table_lookup" in line or "rms_qkv_rope<" in line, line
    assert re.sub(r"\b4096\b", "CAP", p1.source) == re.sub(r"\b16384\b", "CAP", p2.source)
    assert "attention_partial_merge<" in p1.source and ", true>(" in p1.source   # MB: splits of several blocks
    compile_cuda(p1.source, "fusec_step.cu", cache_dir=str(tmp_path)).assert_no_spills()
    for defines in (LATENCY_KNOBS_OFF, {"FUSEC_ATTN_LANES": 0}, {"FUSEC_DISPATCH_BY_KIND": 0}):
        plan = render(s1, defines=defines)
        k = compile_cuda(plan.source, "fusec_step.cu", cache_dir=str(tmp_path))
        k.assert_no_spills()
        assert "warning" not in k.log, k.log


def test_generic_kv_write_and_attention_take_the_length_as_a_parameter(tmp_path):
    """Unfused (max_fusions=0): the generated kv_write and attention functions take the length
    as an int parameter (passed from the slot) and run on the host as PyTorch does, at a
    run-time length below the capacity."""
    from fusec.cuda.gen import generate
    from gen_host import check_graph, compiler
    from fusec.cuda.codegen import Buffers
    if compiler() is None:
        pytest.skip("no host C++ compiler")
    model = hf_tiny.llama(layers=2, heads=4, kv_heads=2)
    sched, flat, cap_cache, ids = polymorphic_step(model, 64, num_sms=4, max_fusions=0)
    g = sched.graph
    bufs = Buffers(g)
    sems = [op for op in g.ops if op.kind in ("kv_write", "attention")]
    assert len(sems) == 6   # per layer: the K and V writes, the attention
    for op in sems:
        gen = generate(op, g, bufs)
        assert "#len:s0" in gen["roots"] and "FUSEC_LEN(bufs[" in gen["call"]
        assert re.search(r"\bint p\d+\b", gen["source"].splitlines()[1])
    small = _prefilled(model, 20, torch.randint(0, 128, (1, 2)))
    step_util.random_cache_state(small, 11, torch.Generator().manual_seed(0))
    cap_tensors = {t.data_ptr(): k for k, t in enumerate(_cache_tensors(cap_cache))}
    mine = _cache_tensors(small)
    args = [mine[cap_tensors[a.data_ptr()]] if isinstance(a, torch.Tensor) and a.data_ptr() in cap_tensors else a
            for a in flat]
    checks = check_graph(g, args, select=lambda op: op.kind in ("kv_write", "attention"), workdir=tmp_path)
    assert len(checks) == 6 and all(c.max_err < 1e-5 for c in checks), checks


# ---- the kernel on the GPU ----

def _gpu_case(cap, num_sms, defines):
    model = hf_tiny.llama(layers=2, heads=4, kv_heads=2).cuda()
    prompt = torch.randint(0, 128, (1, 3), device="cuda")
    cache = _prefilled(model, cap, prompt)
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    _, g, flat = step_util.capture(model, {"input_ids": tok, "past_key_values": cache, "use_cache": True})
    mark_polymorphic(g, cap)
    opts = {"defines": defines} if defines else {}
    if num_sms:
        opts["num_sms"] = num_sms
    step, sched = step_util.build(g, flat, **opts)
    assert step.plan.buffers.count("#len:s0") == 1
    ids = next(k for k, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.data_ptr() == tok.data_ptr())
    return model, step, sched, flat, cache, ids


@pytest.mark.gpu
@pytest.mark.parametrize("cap,num_sms,defines,lengths", [
    (1024, 4, None, [(700, [699, 600]), (1024, [1023]), (40, [39, 3]), (300, [299])]),
    (1024, 4, {"FUSEC_ATTN_LANES": 0}, [(1024, [1023, 100])]),
    (1024, 4, {"FUSEC_ATTN_LANES": 2, "FUSEC_ATTN_SINGLE": 0}, [(900, [899, 20])]),
    (1024, 4, {"FUSEC_ATTN_SINGLE": 0, "FUSEC_MERGE_ONE_PASS": 0, "FUSEC_EARLY_EPILOGUE_LOADS": 0,
               "FUSEC_ATTN_Q_EARLY": 0, "FUSEC_STAGE_BATCH": 0, "FUSEC_ATTN_KV_EARLY": 0,
               "FUSEC_ATTN_LANES": 0, "FUSEC_ATTN_V_SCATTER": 0}, [(1000, [999])]),
    (1024, 4, {"FUSEC_ATTN_PREFETCH": 2, "FUSEC_DISPATCH_BY_KIND": 0}, [(800, [799])]),
    (32768, None, None, [(100, [99, 5]), (20000, [19999]), (32768, [32767, 300])]),
    (32768, None, {"FUSEC_MERGE_LANES": 0}, [(20000, [19999]), (32768, [32767])]),
], ids=["blocks", "scalar-scores", "lanes2", "knobs-off", "prefetch", "gpu-sms-32k", "gpu-sms-32k-merge-one-thread"])
def test_polymorphic_kernel_matches_eager_on_the_gpu(cap, num_sms, defines, lengths):
    """One kernel per capacity on the H200 against HF eager (fp32, 1e-4), on caches of several
    lengths that all live at the SAME addresses (views of one buffer per cache, as the caching
    allocator may hand out): the length slot is rewritten at each new length. Splits of several
    blocks (4 SMs: 2 splits of up to 512 rows; the GPU's SMs at 32768 rows: 66 splits of up to 497)
    with the knob paths; then a launch captured in a torch CUDA graph at one length replays that
    length."""
    model, step, sched, flat, cap_cache, ids = _gpu_case(cap, num_sms, defines)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    cap_tensors = {t.data_ptr(): k for k, t in enumerate(_cache_tensors(cap_cache))}
    big = {k: torch.empty(t.numel(), dtype=t.dtype, device="cuda") for k, t in enumerate(_cache_tensors(cap_cache))
           if t.dim() == 4}

    def args_for(cache, tok):
        mine = _cache_tensors(cache)
        out = []
        for k, a in enumerate(flat):
            if k == ids:
                a = tok
            elif isinstance(a, torch.Tensor) and a.data_ptr() in cap_tensors:
                j = cap_tensors[a.data_ptr()]
                a = mine[j]
                if j in big:   # the same address at every length
                    view = big[j][:a.numel()].view(a.shape)
                    view.copy_(a)
                    a = view
            out.append(a)
        return out

    for n, positions in lengths:
        cache = _prefilled(model, n, torch.randint(0, vocab, (1, 2), generator=gen).cuda())
        for pos in positions:
            step_util.random_cache_state(cache, pos, gen)
            ref = copy.deepcopy(cache)
            tok = torch.randint(0, vocab, (1, 1), generator=gen).cuda()
            args = args_for(cache, tok)
            with torch.no_grad():
                got = _logits(step(*args), vocab).reshape(-1).clone()
                want = model(input_ids=tok, past_key_values=ref, use_cache=True).logits.reshape(-1)
            rel = step_util.rel(got, want)
            assert rel < 1e-4, f"cache of {n} rows, position {pos}: relative error {rel:.2e}"
            ref_tensors = _cache_tensors(ref)
            for j in big:   # the K/V rows the kernel wrote, in the views it was given
                a = big[j][:ref_tensors[j].numel()].view(ref_tensors[j].shape)
                assert step_util.rel(a, ref_tensors[j]) < 1e-5
    step.raise_if_watchdog()
    # a launch captured at one length replays that length
    n, pos = lengths[0][0], lengths[0][1][0]
    cache = _prefilled(model, n, torch.randint(0, vocab, (1, 2), generator=gen).cuda())
    step_util.random_cache_state(cache, pos, gen)
    saved = copy.deepcopy(cache)
    tok = torch.randint(0, vocab, (1, 1), generator=gen).cuda()
    args = args_for(cache, tok)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        outs = step(*args)
    step_util.random_cache_state(cache, 0, gen)   # an eager call at another length in between
    short = _prefilled(model, 17, torch.randint(0, vocab, (1, 2), generator=gen).cuda())
    with torch.no_grad():
        step(*args_for(short, tok))
    args = args_for(saved, tok)   # the captured caches' contents and positions back
    for layer, layer0 in zip(cache.layers, saved.layers):
        layer.cumulative_length.copy_(layer0.cumulative_length)
    ref = copy.deepcopy(saved)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        want = model(input_ids=tok, past_key_values=ref, use_cache=True).logits.reshape(-1)
    assert step_util.rel(_logits(outs, vocab).reshape(-1), want) < 1e-4
    step.raise_if_watchdog()
