"""Split-KV attention (``attention_partial``) for a batch of B > 1 sequences of one query token
each (docs/batch.md, issue 32): HF's StaticCache holds ``[B, Hkv, L, D]`` contiguous and the
queries are ``[B, Hq, 1, D]``, so the batch is one attention over B·Hkv KV heads and B·Hq query
heads, its tiles spread over many SMs instead of the generic attention's one tile; each
sequence's query-head groups read its row of the ``[B, 1, 1, L]`` mask of left-padded prompts
(attr ``mask_rows``). Decode through ``torch.compile(backend="fusec")`` equals eager per
sequence; the kind's tiles over run-time lengths equal SDPA per sequence; a batch-1 step renders
as before; the batch kernel compiles with NVRTC without spills at Llama-3.2-1B's widths."""
from __future__ import annotations

import re

import pytest
import torch

import hf_tiny
from test_attention_groups import _falcon_mqa
from test_batch_decode import batch_steps_against_eager
from fusec.ir import Graph, Op, Role, TensorInfo

#: a cache of 96 rows: several splits per group take rows (FUSEC_ATTN_SPLIT_ROWS 32 with a mask:
#: 3 active splits of all 96 rows), so the merge of a group's splits runs
LENGTH = 96


def _attention_ops(step) -> list[Op]:
    """The step's attention ops of any kind (a chain's members too)."""
    g = step.schedule.graph
    return [o for o in g.ops for o in (o.attrs["ops"] if o.kind == "chain" else [o]) if o.kind.startswith("attention")]


def _tiles_per_op(step) -> dict[str, int]:
    n: dict[str, int] = {}
    for ins in step.schedule.instrs:
        n[ins.op] = n.get(ins.op, 0) + 1
    return n


def _check_split(steps, model, batch: int, mask_kind: int = 1, q_groups: int = 1, merge: str = "last_tile",
                 bound: bool = True) -> None:
    """Every recorded step's attentions are ``attention_partial`` ops over the batch's B·Hkv KV
    heads (none the generic ``attention``), each sequence's groups reading its mask row, tiled
    one per (group, split) over many SMs; ``bound``: the mask proven to attend no row past the
    position (attr ``mask_bound``: HF's mask built in the step from a ``[B, L]`` attention_mask;
    a 4-D mask the caller passes is an input, never proven)."""
    cfg = model.config
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", None) or 1
    if getattr(cfg, "multi_query", False):
        hkv = 1
    assert steps and not any(s.fallen_back for s in steps)
    for s in steps:
        g = s.schedule.graph
        assert g.batch() == batch   # after fuse too: the batched linears stay batched matvecs
        assert "linear" not in g.count_kinds()
        ops = _attention_ops(s)
        assert "attention" not in {o.kind for o in ops}, [o.kind for o in ops]
        part = [o for o in ops if o.kind == "attention_partial"]
        assert len(part) == cfg.num_hidden_layers
        assert (len([o for o in ops if o.kind == "attention_reduce"]) == len(part)) == (merge == "reduce")
        tiles = _tiles_per_op(s)
        for o in part:
            a = o.attrs
            assert a["batch"] == batch and a["mask_rows"] == batch and a["mask_kind"] == mask_kind
            assert a.get("mask_bound", False) == bound, a
            assert a["n_q"] == batch * hq and a["n_kv"] == batch * hkv and a.get("q_groups", 1) == q_groups
            assert g.tensors[o.inputs["mask"]].shape[0] == batch
            groups = batch * hkv * q_groups
            assert a["n_chunks"] > 1 and tiles[o.name] == groups * a["n_chunks"]


@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_batch_attention_is_split_kv_and_equals_eager(factory, batch, steps):
    """Left-padded prompts of different lengths, 4 decode steps with default options over a
    96-row StaticCache (:func:`test_batch_decode.batch_steps_against_eager`): every sequence's
    logits and the caches equal eager's, no fallback, and the attention is ``attention_partial``
    over B·Hkv KV heads with the per-sequence bool mask (HF's ``[B, 1, 1, L]``)."""
    model = factory()
    errs, w, caches = batch_steps_against_eager(model, batch, 40 + batch + (factory is hf_tiny.qwen3), length=LENGTH)
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert sum(s.calls for s in steps) == 4
    for layer_a, layer_b in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(layer_a.keys, layer_b.keys, atol=1e-5)
        assert torch.allclose(layer_a.values, layer_b.values, atol=1e-5)
    _check_split(steps, model, batch)


#: name -> (factory, batch, query heads per tile group's KV head cut into q_groups parts)
GQA = {
    # 16 query heads over each of 2 KV heads: 2 parts of 8 per KV head, 4 groups per sequence
    "llama_32_2": (lambda: hf_tiny.llama(hidden=128, heads=32, kv_heads=2, head_dim=8), 4, 2),
    # Falcon-7B-shaped multi-query: 12 query heads over one KV head, 2 parts of 6
    "falcon_mqa_12": (_falcon_mqa, 2, 2),
}


@pytest.mark.parametrize("name", sorted(GQA))
def test_batch_attention_of_cut_gqa_groups_equals_eager(name, steps):
    """A GQA group of more than 8 query heads is cut into ``q_groups`` tile groups per KV head, in
    a batch too: group ``gi`` reads KV head ``gi // q_groups`` of the flat B·Hkv and mask row
    ``gi // (groups per sequence)``; eager's logits per sequence, no fallback."""
    factory, batch, parts = GQA[name]
    model = factory()
    errs, w, _ = batch_steps_against_eager(model, batch, 3, n=3, length=LENGTH)
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    _check_split(steps, model, batch, q_groups=parts)


@pytest.mark.parametrize("mask_dtype,mask_kind,merge", [(torch.bool, 1, "reduce"), (torch.float32, 2, "last_tile"),
                                                        (torch.float32, 2, "reduce")])
def test_batch_attention_with_a_4d_mask_equals_eager(mask_dtype, mask_kind, merge, steps):
    """The decode calls pass the 4-D mask ``[B, 1, 1, L]`` themselves, bool (``mask_kind`` 1) or
    additive float (0 attends, the lowest float masks: ``mask_kind`` 2), with the last-tile
    merge or ``attention_merge="reduce"`` (``attention_reduce`` over the B·Hq heads): eager's
    logits per sequence at B = 3, no fallback."""
    model = hf_tiny.llama()
    errs, w, _ = batch_steps_against_eager(model, 3, 8, n=3, length=LENGTH, mask_dtype=mask_dtype,
                                           options={"attention_merge": merge})
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    _check_split(steps, model, 3, mask_kind=mask_kind, merge=merge, bound=False)


def _batch_attention_graph(batch: int, hq: int, hkv: int, d: int, cap: int, nc: int, chunk: int, mask_kind: int,
                           q_groups: int = 1) -> Graph:
    """One batched ``attention_partial`` op (last-tile merge) over caches ``[B, hkv, s0<=cap, d]``
    and a mask ``[B, 1, 1, s0]`` (``mask_kind`` 1 bool, 2 additive; 0: none), fp32."""
    g = Graph()
    f32 = torch.float32
    ins = [TensorInfo("q", (batch, hq, 1, d), f32, Role.INPUT, input_index=0),
           TensorInfo("k", (batch, hkv, cap, d), f32, Role.KV_CACHE, input_index=1, sym={2: "s0"}),
           TensorInfo("v", (batch, hkv, cap, d), f32, Role.KV_CACHE, input_index=2, sym={2: "s0"}),
           TensorInfo("pos", (), torch.int64, Role.STATE, input_index=3)]
    if mask_kind:
        ins.append(TensorInfo("mask", (batch, 1, 1, cap), torch.bool if mask_kind == 1 else f32, Role.INPUT,
                              input_index=4, sym={3: "s0"}))
    for t in ins:
        g.add_tensor(t)
    g.add_tensor(TensorInfo("o_part", (batch * hq, nc, d), f32))
    g.add_tensor(TensorInfo("ml_part", (batch * hq, nc, 2), f32))
    g.add_tensor(TensorInfo("out", (batch, hq, 1, d), f32, Role.OUTPUT))
    g.inputs, g.outputs = [t.name for t in ins], ["out"]
    g.lengths = {"s0": cap}
    op_in = {"q": "q", "kcache": "k", "vcache": "v", "pos": "pos"}
    attrs = {"scale": d ** -0.5, "n_q": batch * hq, "n_kv": batch * hkv, "head_dim": d, "chunk": chunk,
             "n_chunks": nc, "mask_kind": mask_kind, "batch": batch}
    if mask_kind:
        op_in["mask"] = "mask"
        attrs["mask_rows"] = batch
    if q_groups > 1:
        attrs["q_groups"] = q_groups
    g.ops = [Op("att", "attention_partial", op_in, {"o_part": "o_part", "ml_part": "ml_part", "out": "out"},
                attrs=attrs)]
    return g


@pytest.mark.parametrize("mask_kind,q_groups", [(1, 1), (2, 1), (1, 2), (0, 1)])
def test_batch_tiles_equal_sdpa_per_sequence_at_run_time_lengths(mask_kind, q_groups):
    """The kind's tiles (its Python semantics, the simulator's) of a batch of 3 over caches of a
    run-time length (blocks of 16 rows, 3 splits, the block loop) equal SDPA per sequence with
    each sequence's own mask row (first rows masked differently per sequence, as left padding
    does); every tile's run-time regions read its sequence's KV head and mask row only."""
    from fusec.instructions import kind_of
    from fusec.ir.env import Env
    from fusec.ir.semantics import attend
    batch, hq, hkv, d, nc, chunk, cap = 3, 8, 2, 8, 3, 16, 160
    g = _batch_attention_graph(batch, hq, hkv, d, cap, nc, chunk, mask_kind, q_groups)
    op = g.ops[0]
    cls = kind_of(op)
    groups = batch * hkv * q_groups
    gen = torch.Generator().manual_seed(11)
    for n, pos in ((150, 149), (57, 56), (9, 8)):
        q = torch.randn(batch, hq, 1, d, generator=gen)
        k, v = (torch.randn(batch, hkv, n, d, generator=gen) for _ in range(2))
        args = [q, k, v, torch.tensor(pos)]
        mask = None
        if mask_kind == 1:
            mask = torch.rand(batch, 1, 1, n, generator=gen) > 0.3
            for b in range(batch):   # left padding: sequence b's first rows masked
                mask[b, ..., : min(n - 1, 7 * b + 5)] = False
            mask[..., -1] = True
        elif mask_kind == 2:
            mask = torch.randn(batch, 1, 1, n, generator=gen)
        if mask is not None:
            args.append(mask)
        env = Env(g, args)
        assert env.lengths == {"s0": n}
        for tile in cls.tiles(op, g, 1):
            gi = tile.params["group"]
            b = gi // (groups // batch)
            reads, _ = cls.runtime_regions(op, tile, env)
            kv_head = gi // q_groups
            for r in reads:
                if r.tensor in ("k", "v"):   # its sequence's KV head, of the run-time rows
                    assert kv_head * n * d <= r.start < r.stop <= (kv_head + 1) * n * d
                    assert b * hkv <= kv_head < (b + 1) * hkv
                if r.tensor == "mask":
                    assert (r.start, r.stop) == (b * n, (b + 1) * n)
            cls.run_tile(op, tile, env)
        rows = n if mask_kind else pos + 1
        for b in range(batch):
            want = attend(q[b, :, 0], k[b], v[b], rows, d ** -0.5, None if mask is None else mask[b].reshape(-1),
                          mask_kind)
            got = env.read("out")[b, :, 0]
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (n, b, (got - want).abs().max())


def test_batch_of_several_query_tokens_stays_generic():
    """K > 1 query tokens per sequence without a mask (the mask makes the K rows causal:
    tests/test_multi_token.py takes them with HF's), a query whose batch differs from its
    caches', or more than MAX_SEQS sequences, is not taken by the rule (``takes_attention``):
    those stay the generic attention."""
    from fusec.instructions.attention import takes_attention

    def graph(b, k_tokens, cache_b):
        g = Graph()
        for t in (TensorInfo("q", (b, 4, k_tokens, 16), torch.float32, Role.INPUT),
                  TensorInfo("k", (cache_b, 2, 32, 16), torch.float32, Role.KV_CACHE),
                  TensorInfo("v", (cache_b, 2, 32, 16), torch.float32, Role.KV_CACHE),
                  TensorInfo("out", (b, 4, k_tokens, 16), torch.float32)):
            g.add_tensor(t)
        att = Op("att", "attention", {"q": "q", "k": "k", "v": "v"}, {"out": "out"}, attrs={"scale": 0.25})
        g.ops = [att]
        g.record_rows()   # B and K, as graph_from_aten records them
        return g, {"_anchor": att}
    assert takes_attention(*graph(4, 1, 4)) and takes_attention(*graph(1, 1, 1))
    assert not takes_attention(*graph(4, 2, 4))     # K = 2 query tokens per sequence, no mask
    assert not takes_attention(*graph(1, 4, 1))     # a K-token step of one sequence, no mask
    assert not takes_attention(*graph(17, 1, 17))   # more than MAX_SEQS sequences


#: the attention calls of tiny Llama's batch-1 steps before batches (bf16, 12 SMs, a 32-row cache):
#: unmasked, and with a one-row mask (the call passes the mask pointer itself); the masked call's
#: MK is 4 since the mask (HF's causal part AND the attention_mask's) is proven to attend no row
#: past the write position (fusec.ir.mask_proofs.bounded_by_positions; it was 1)
BATCH1_CALLS = {
    False: "attention_partial_merge<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 4, 2, 16, 32, 2, 1, false>("
           "((__nv_bfloat16*)bufs[A[0]]), ((__nv_bfloat16*)bufs[A[1]]), ((__nv_bfloat16*)bufs[A[2]]), "
           "((i64*)bufs[A[3]]), ((float*)bufs[A[4]]), ((float*)bufs[A[5]]), ((__nv_bfloat16*)bufs[A[6]]), "
           "(counters + A[7]), 32, 0.25f, in.p0, in.p1, smem);",
    True: "attention_partial_merge<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 4, 2, 16, 32, 2, 1, false, 4, bool>("
          "((__nv_bfloat16*)bufs[A[0]]), ((__nv_bfloat16*)bufs[A[1]]), ((__nv_bfloat16*)bufs[A[2]]), "
          "((i64*)bufs[A[3]]), ((float*)bufs[A[4]]), ((float*)bufs[A[5]]), ((__nv_bfloat16*)bufs[A[6]]), "
          "(counters + A[8]), 32, 0.25f, in.p0, in.p1, smem, ((bool*)bufs[A[7]]));",
}


@pytest.mark.parametrize("masked", [False, True])
def test_batch1_attention_renders_as_before(masked):
    """A batch-1 step's ``attention_partial`` carries neither ``batch`` nor ``mask_rows`` and
    renders the call it did before batches (with a one-row mask: the mask pointer itself; the
    bound mask's MK 4)."""
    import step_util
    from fusec.config import Options
    from fusec.cuda.codegen import render
    from fusec.pipeline import Dumper, lower
    model = hf_tiny.llama().to(torch.bfloat16)
    cache = hf_tiny.static_cache(model, 32)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 3), generator=gen), past_key_values=cache, use_cache=True)
    kw = {"input_ids": torch.randint(0, 128, (1, 1), generator=gen), "past_key_values": cache, "use_cache": True}
    if masked:
        m = torch.zeros(1, 32, dtype=torch.long)
        m[:, :4] = 1
        kw.update(attention_mask=m, position_ids=torch.full((1, 1), 3))
    _, g, flat = step_util.capture(model, kw)
    sched = lower(g, flat, Options.from_dict({"num_sms": 12}), Dumper(None))
    att = [o for o in sched.graph.ops if o.kind == "attention_partial"]
    assert att and not any("batch" in o.attrs or "mask_rows" in o.attrs for o in att)
    assert all(o.attrs["mask_kind"] == int(masked) and o.attrs.get("mask_bound", False) == masked for o in att)
    calls = {c for c in re.findall(r"attention_partial_merge<[^;]*;", render(sched).source) if "bufs" in c}
    assert calls == {BATCH1_CALLS[masked]}


def _width_graph(batch: int, dtype: torch.dtype, rows: int, runtime: bool,
                 bound: bool = False) -> tuple[Graph, list]:
    """An IR graph of one ``attention`` at Llama-3.2-1B's widths (32 query heads over 8 KV heads of
    64) for B sequences: q ``[B, 32, 1, 64]``, caches ``[B, 8, rows, 64]``, HF's bool mask ``[B,
    1, 1, rows]`` (``runtime``: the rows a run-time length of capacity ``rows``), no weights read.
    (graph, flat inputs)"""
    g, flat = Graph(), []
    hq, hkv, d = 32, 8, 64
    sym = {2: "s0"} if runtime else {}
    ins = [TensorInfo("q", (batch, hq, 1, d), dtype, Role.INPUT),
           TensorInfo("k", (batch, hkv, rows, d), dtype, Role.KV_CACHE, sym=sym),
           TensorInfo("v", (batch, hkv, rows, d), dtype, Role.KV_CACHE, sym=sym),
           TensorInfo("pos", (1,), torch.int64, Role.INPUT),
           TensorInfo("mask", (batch, 1, 1, rows), torch.bool, Role.INPUT, sym={3: "s0"} if runtime else {})]
    for t in ins:
        t.input_index = len(flat)
        g.add_tensor(t)
        flat.append(torch.empty(t.shape, dtype=t.dtype))
    g.add_tensor(TensorInfo("out", (batch, hq, 1, d), dtype, Role.OUTPUT))
    g.inputs, g.outputs = [t.name for t in ins], ["out"]
    if runtime:
        g.lengths = {"s0": rows}
    g.ops.append(Op("att", "attention", {"q": "q", "k": "k", "v": "v", "pos": "pos", "mask": "mask"}, {"out": "out"},
                    attrs={"scale": d ** -0.5, "mask_kind": 1, **({"mask_bound": True} if bound else {})}))
    return g, flat


@pytest.mark.parametrize("batch,dtype,rows,runtime,bound", [(4, torch.bfloat16, 1024, False, False),
                                                            (16, torch.bfloat16, 4096, True, False),
                                                            (16, torch.float32, 1024, False, False),
                                                            (16, torch.bfloat16, 4096, True, True)])
def test_batch_attention_compiles_without_spills_at_llama_1b_widths(batch, dtype, rows, runtime, bound, tmp_path):
    """The batch's ``attention_partial_merge`` at Llama-3.2-1B's attention widths (B·8 KV heads
    on 132 SMs: 4 splits per group at B = 4, one at B = 16, which runs its rows in blocks of 512,
    the knob FUSEC_ATTN_BLOCK_ROWS: MB) compiles with NVRTC for sm_90a without spills or a stack
    frame; its mask argument is the group's sequence row (``in.p0`` over the 8 groups of a
    sequence, times the mask's rows: a literal, or the run-time length's slot); a mask proven to
    attend no row past the position (``bound``: attr ``mask_bound``) renders MK 4."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.config import Options
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from fusec.pipeline import Dumper, lower
    g, flat = _width_graph(batch, dtype, rows, runtime, bound)
    sched = lower(g, flat, Options.from_dict({"num_sms": 132}), Dumper(None))
    (op,) = [o for o in sched.graph.ops if o.kind == "attention_partial"]
    assert op.attrs["n_kv"] == 8 * batch and op.attrs["n_chunks"] == (4 if batch == 4 else 1)
    assert op.attrs["chunk"] == (256 if batch == 4 else 512)
    src = render(sched).source
    calls = re.findall(r"attention_partial_merge<[^;]*;", src)
    t = "__nv_bfloat16" if dtype == torch.bfloat16 else "float"
    length = r"FUSEC_LEN\(bufs\[A\[\d+\]\]\)" if runtime else str(rows)
    mb = "true" if batch == 16 else "false"
    want = (rf"attention_partial_merge<{t}, {t}, {t}, {32 * batch}, {8 * batch}, 64, {op.attrs['chunk']}, "
            rf"{op.attrs['n_chunks']}, 1, "
            rf"{mb}, {4 if bound else 1}, bool>\(.*, smem, \(\(\(const bool\*\)bufs\[A\[\d+\]\]\) \+ \(size_t\)\(in\.p0 / 8\) \* {length}\)\);")
    assert any(re.fullmatch(want, c) for c in calls), calls
    kernel = compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path))
    kernel.assert_no_spills()
    assert all(r["stack_frame_bytes"] == 0 for r in kernel.resources.values())
