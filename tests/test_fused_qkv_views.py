"""Fused q/k/v products split after the product (issue 31): one rule, the pieces as row blocks.

Falcon-7B (multi-query), GPT-NeoX / Pythia and GPT-2 compute q, k and v as ONE product and cut
it afterwards; the cut, the RoPEs and the KV writes stood alone as one-tile levels (Falcon-7B 8
ops per layer, 4 of one tile; GPT-2 7 (2); Pythia 7 (2), ``tools/layer_ops.py``). Every cut is
described by :func:`fusec.ir.pieces.pieces` as blocks of rows of the product, and:

* Falcon-7B's (``view(.., H + 2, D)``, ``[..., :-2, :]``, ``[..., [-2], :]``, ``[..., [-1], :]``)
  are single row ranges: ``split_linear`` makes linears over row views of the weight, and
  ``rms_qkv_rope`` takes them as Llama's separate projections;
* GPT-NeoX's (``view(.., H, 3 * D)``, ``chunk(3, -1)``) are H blocks of D rows, 3 * D apart:
  ``rms_qkv_rope`` reads them as views of the fused weight (and bias) with the head stride
  ``w_stride`` (template ``WS``);
* GPT-2's (``Conv1D``: ``split(E, dim=2)``, no RoPE) are column ranges of ``c_attn``'s
  ``matvec_cols``: its tiles write the k and v columns into the caches' rows at the position
  (``fusec/instructions/kv_epilogue.py``) and q is a view of the product.

Each layer is then Llama's six ops, one of one tile (the position lookup). CPU: decode through
``torch.compile(backend="fusec")`` with default options against eager after several prompt
lengths (simulator), no fallback, the fused kinds in the schedule and the layer counted as
``tools/layer_ops.py`` counts it; the templates at Pythia-1B's and GPT-2's published widths
compile with NVRTC (sm_90a) without spills (Falcon-7B's: ``tests/test_mlp_folds.py``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hf_tiny
import step_util
from fusec.ir import Graph, Op, Ref, Role, TensorInfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from layer_ops import layer_rows  # noqa: E402

A = torch.ops.aten
PROMPTS = (1, 6, 19)


def _biased(m):
    """``m`` with every bias drawn at random (HF initializes them to zero: a bias read at the
    wrong row or column would not show)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return m


#: family -> (tiny model of 3 layers, the kind its q/k/v (KV writes) lower to)
FAMILIES = {
    "falcon_7b": (lambda: hf_tiny.falcon_7b(layers=3), "rms_qkv_rope"),
    "gpt_neox": (lambda: _biased(hf_tiny.gpt_neox(layers=3)), "rms_qkv_rope"),
    "gpt2": (lambda: _biased(hf_tiny.gpt2(layers=3)), "matvec_cols"),
}
#: what stood alone before (in a chain or not): the cuts, the RoPEs, the KV writes
CUTS = {"kv_write", "rope", "aten.split_with_sizes.default", "aten.split.Tensor", "aten.index.Tensor",
        "aten.select.int"}


def _fused(g: Graph, kind: str) -> list[Op]:
    """The ops that took the q/k/v (``rms_qkv_rope``) or the KV writes (a ``matvec_cols`` with
    ``kv_cols``)."""
    return [o for o in g.ops if o.kind == kind and (kind != "matvec_cols" or "kv_cols" in o.attrs)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_qkv_layer_is_six_ops_and_decodes_like_eager(family, steps):
    """Decode after prompts of 1, 6 and 19 tokens equals eager (fp32, 1e-5), no fallback; every
    layer's q/k/v (GPT-2: its KV writes) is the fused kind, nothing of the cut, the RoPE or the
    KV writes stands alone or in a chain, and the middle layer is 6 ops, 1 of one tile (the
    position lookup; before: Falcon-7B 8 (4), GPT-2 7 (2), GPT-NeoX 7 (2))."""
    factory, kind = FAMILIES[family]
    model = factory()
    errs, w = step_util.prompts_against_eager(model, {}, PROMPTS)
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    assert max(errs.values()) < 1e-5, errs
    sched = steps[-1].schedule
    g = sched.graph
    assert len(_fused(g, kind)) == model.config.num_hidden_layers
    assert not CUTS & set(g.count_kinds()), g.count_kinds()
    rows = layer_rows(sched, 1)
    one = [k for k, n, _ in rows if n == 1]
    assert len(rows) == 6 and one == ["table_lookup"], rows


def test_falcon7b_qkv_reads_row_ranges_of_the_fused_weight(steps):
    """Falcon-7B's multi-query pieces are single row ranges: ``split_linear`` views rows
    [0, H*D), [H*D, (H+1)*D), [(H+1)*D, (H+2)*D) of ``query_key_value``'s weight, no head
    stride; the MLP's up projection a ``matvec`` with its own copy of the LayerNorm."""
    model = hf_tiny.falcon_7b()
    s = step_util.lowered(model)
    g = s.graph
    h, d = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    k = model.config.hidden_size
    for o in _fused(g, "rms_qkv_rope"):
        spans = [g.span(o.inputs[w]) for w in ("wq", "wk", "wv")]
        assert len({r for r, _, _ in spans}) == 1 and "w_stride" not in o.attrs
        assert [(a, e) for _, a, e in spans] == [(0, h * d * k), (h * d * k, (h + 1) * d * k),
                                                 ((h + 1) * d * k, (h + 2) * d * k)]
        assert (o.attrs["n_q"], o.attrs["n_kv"]) == (h, 1) and o.attrs["pre_steps"].endswith("layernorm")
    assert not [o for o in g.ops if o.kind == "matvec_group"]


def test_gpt_neox_qkv_reads_the_interleaved_weight_through_a_head_stride():
    """GPT-NeoX's q/k/v rows are [H, 3, D]: ``rms_qkv_rope`` reads views of the fused weight and
    bias at rows 0, D and 2 * D with ``w_stride`` 3 * D; the kernel passes WS = 3 * D."""
    from fusec.cuda.codegen import render
    model = _biased(hf_tiny.gpt_neox())
    s = step_util.lowered(model)
    g = s.graph
    d = model.config.hidden_size // model.config.num_attention_heads
    k, n = model.config.hidden_size, 3 * model.config.hidden_size
    qkv = _fused(g, "rms_qkv_rope")
    assert len(qkv) == model.config.num_hidden_layers
    for o in qkv:
        assert o.attrs["w_stride"] == 3 * d and o.attrs["rotary_dim"] == 8
        ws = [g.span(o.inputs[w]) for w in ("wq", "wk", "wv")]
        bs = [g.span(o.inputs[b]) for b in ("bq", "bk", "bv")]
        assert [a for _, a, _ in ws] == [0, d * k, 2 * d * k] and all(e <= n * k for _, _, e in ws)
        assert [a for _, a, _ in bs] == [0, d, 2 * d] and all(e <= n for _, _, e in bs)
    src = render(s).source
    assert src.count(f", {3 * d}>(") >= 1, [line for line in src.splitlines() if "rms_qkv_rope<" in line]


def test_gpt2_kv_writes_are_the_projections_epilogue():
    """GPT-2's ``c_attn``: the k and v columns [E, 2E), [2E, 3E) go into the caches (``kv_cols``),
    q is a view of the product at 0 that the attention reads; the kernel passes KV = 2."""
    from fusec.cuda.codegen import render
    model = _biased(hf_tiny.gpt2())
    s = step_util.lowered(model)
    g = s.graph
    e = model.config.n_embd
    ops = _fused(g, "matvec_cols")
    assert len(ops) == model.config.n_layer
    for o in ops:
        assert o.attrs["kv_cols"] == [[e, 2 * e], [2 * e, 3 * e]] and o.attrs["kv_head_dim"] == e // 4
        assert set(o.mutates) == {"cache0", "cache1"}
        att = next(a for a in g.ops if a.kind == "attention_partial" and g.root(a.inputs["kcache"]) ==
                   g.root(o.outputs["cache0"]))
        assert g.span(att.inputs["q"]) == (o.outputs["out"], 0, e)
    src = render(s).source
    assert f", 2, {e}, {2 * e}, {e // 4}, {e}>(" in src   # KV, KC0, KC1, KVD, KVN (TC float: the default)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_decodes_like_eager(family, steps):
    """bf16: the fused kinds round where eager's ops round (the product, the RoPE; a cache row
    holds the product's rounded value): decode within bf16 tolerance of eager, no fallback, the
    q/k/v (GPT-2: the KV writes) in the fused kind."""
    factory, kind = FAMILIES[family]
    model = factory().to(torch.bfloat16)
    errs, w = step_util.prompts_against_eager(model, {}, (1, 6))
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    assert max(errs.values()) < 2e-2, errs
    assert len(_fused(steps[-1].schedule.graph, kind)) == model.config.num_hidden_layers


# ---- the pieces of a product, on a hand-made graph ----

def _cut_graph() -> tuple[Graph, dict[str, Op]]:
    """A product ``y`` [1, 24] viewed ``v4`` [1, 1, 6, 4] and ``v3`` [1, 2, 12], cut by one op
    of each form (names: the op's)."""
    g = Graph()
    f = torch.float32
    g.add_tensor(TensorInfo("y", (1, 24), f, Role.INPUT, input_index=0))
    g.add_tensor(TensorInfo("v4", (1, 1, 6, 4), f, alias_of="y"))
    g.add_tensor(TensorInfo("v3", (1, 2, 12), f, alias_of="y"))
    g.add_tensor(TensorInfo("i2", (1,), torch.int64, Role.CONSTANT, value=torch.tensor([-2])))
    g.add_tensor(TensorInfo("i02", (2,), torch.int64, Role.CONSTANT, value=torch.tensor([0, 2])))
    g.add_tensor(TensorInfo("i34", (2,), torch.int64, Role.CONSTANT, value=torch.tensor([3, 4])))
    ops = {}

    def op(name, target, src, args, outs, extra=None):
        ins = {"in0": src, **(extra or {})}
        ops[name] = Op(name, str(target), ins, outs, attrs={"target": target, "args": (Ref("in0"), *args), "kwargs": {}})
        for t in outs.values():
            g.add_tensor(TensorInfo(t, (1,), f))
    op("slice", A.slice.Tensor, "v4", (2, 0, -2), {"out": "q"})
    op("index", A.index.Tensor, "v4", ([None, None, Ref("in1")],), {"out": "k"}, {"in1": "i2"})
    op("index2", A.index.Tensor, "v4", ([None, None, Ref("in1")],), {"out": "k2"}, {"in1": "i34"})
    op("gather", A.index.Tensor, "v4", ([None, None, Ref("in1")],), {"out": "kg"}, {"in1": "i02"})
    op("select", A.select.int, "v4", (2, 5), {"out": "v"})
    op("step2", A.slice.Tensor, "v4", (2, 0, 6, 2), {"out": "s2"})
    op("chunk", A.split.Tensor, "v3", (4, -1), {"out0": "c0", "out1": "c1", "out2": "c2"})
    op("lead", A.split.Tensor, "v3", (1, 1), {"out0": "l0", "out1": "l1"})
    return g, ops


def test_pieces_as_row_blocks():
    """Each form's rows of the product's 24: a slice, an index by a constant (negative counts
    from the end), consecutive indices and a select along the heads dim are single ranges; a
    chunk of the last dim of a [2, 12] view takes 2 blocks, 12 apart (of a product of two rows of
    12: one range of each); a gather by non-consecutive indices, a slice with a step and a cut
    of a dim outside the row are not pieces."""
    from fusec.ir.pieces import Rows, pieces
    g, ops = _cut_graph()
    assert pieces(g, ops["slice"], 24) == [(Rows(0, 16, 16, 1), "q")]
    assert pieces(g, ops["index"], 24) == [(Rows(16, 4, 4, 1), "k")]
    assert pieces(g, ops["index2"], 24) == [(Rows(12, 8, 8, 1), "k2")]
    assert pieces(g, ops["select"], 24) == [(Rows(20, 4, 4, 1), "v")]
    got = pieces(g, ops["chunk"], 24)
    assert got == [(Rows(0, 4, 12, 2), "c0"), (Rows(4, 4, 12, 2), "c1"), (Rows(8, 4, 12, 2), "c2")]
    assert got[1][0].indices() == [4, 5, 6, 7, 16, 17, 18, 19] and got[1][0].stop == 20
    assert pieces(g, ops["gather"], 24) is None and pieces(g, ops["step2"], 24) is None
    assert pieces(g, ops["chunk"], 12)[1] == (Rows(4, 4, 4, 1), "c1")   # rows of 12: a range of each
    assert pieces(g, ops["lead"], 12) is None   # cuts the rows' dim, not within a row


# ---- the templates at published widths (NVRTC, sm_90a) ----

def _pythia_1b_layer():
    """One Pythia-1B layer at its published attention widths (hidden 2048, 8 heads of 256,
    rotary 64; small MLP and vocabulary), random biases."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(hidden_size=2048, intermediate_size=256, num_hidden_layers=1, num_attention_heads=8,
                        vocab_size=128, max_position_embeddings=512, rotary_pct=0.25, attn_implementation="sdpa")
    return _biased(GPTNeoXForCausalLM(cfg).eval().requires_grad_(False))


def _gpt2_layer():
    """One GPT-2 layer at its published widths (768, 12 heads of 64; small vocabulary)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_embd=768, n_layer=1, n_head=12, n_positions=512, attn_implementation="sdpa")
    return _biased(GPT2LMHeadModel(cfg).eval().requires_grad_(False))


PUBLISHED = {"gpt_neox": (_pythia_1b_layer, "rms_qkv_rope", "_Z12rms_qkv_rope"),
             "gpt2": (_gpt2_layer, "matvec_cols", "_Z11matvec_cols")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_published_width_templates_compile_without_spills(family, dtype, tmp_path):
    """Pythia-1B's ``rms_qkv_rope`` with WS = 768 (and biases, partial rotary, the LayerNorm
    prologue) and GPT-2's ``matvec_cols`` with the two-cache epilogue: each instantiation's
    device function compiles with no stack frame and no spill (ptxas ``-v``), and the whole
    kernel has no local memory, bf16 and fp32."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from test_attention_split import _lowered
    factory, kind, mangled = PUBLISHED[family]
    sched = _lowered(factory, dtype, 132, 256)
    fused = _fused(sched.graph, kind)
    assert len(fused) == 1
    if kind == "rms_qkv_rope":
        assert fused[0].attrs["w_stride"] == 3 * 256 and fused[0].attrs["rotary_dim"] == 64
    kernel = compile_cuda(render(sched).source, "fusec_step.cu", options=("-Xptxas", "-v"), cache_dir=str(tmp_path))
    assert "warning" not in kernel.log, kernel.log
    lines = kernel.log.splitlines()
    props = [lines[i + 1] for i, line in enumerate(lines) if f"Function properties for {mangled}" in line]
    assert props and all("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in p for p in props), \
        (props, kernel.log)
    kernel.assert_no_spills()
