"""The fused Llama kinds of a batch step (docs/batch.md, issue 32): at B > 1 sequences of one query
token each, ``rms_qkv_rope`` (RMSNorm + q/k/v + RoPE + KV append) and ``rms_gate_up_silu``
(RMSNorm + gate/up + SiLU product) take the batch (attribute ``batch``; templates
``rms_qkv_rope_seqs`` and ``rms_gate_up_silu_seqs``: each weight row loaded once for the B
sequences), instead of batched matvecs with generic RoPE, KV writes and SiLU product on one SM
each. Checked on the CPU simulator against eager per sequence (left-padded prompts: each
sequence's RoPE at its own position), through HF generate(), and by NVRTC compiles at
Llama-3.2-1B's widths without spills."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import hf_tiny
from test_batch_decode import _assert_fused, _left_padded, batch_steps_against_eager
from fusec.fallbacks import FallbackWatch

_spec = importlib.util.spec_from_file_location("layer_ops", Path(__file__).resolve().parent.parent / "tools" / "layer_ops.py")
layer_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layer_ops)


@pytest.mark.parametrize("batch", [2, 3, 4])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_batch_layer_is_the_fused_kinds(factory, batch, steps):
    """A batch of left-padded prompts of different lengths (so each sequence's position differs),
    3 decode steps through ``torch.compile(backend="fusec")`` (default options) against eager:
    every sequence's logits (< 1e-5 fp32) and both caches (each sequence's row written at the
    step's one cache position), no fallback; each layer is the batched fused kinds (Qwen3 with
    its per-head q/k norms, whole heads per tile), and what is left of one tile in a layer is
    the cache counter's ``table_lookup`` (docs/batch.md)."""
    model = factory(layers=2)
    errs, w, caches = batch_steps_against_eager(model, batch, 500 + 10 * batch + (factory is hf_tiny.qwen3), n=3)
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert steps and not any(s.fallen_back for s in steps)
    for layer_a, layer_b in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(layer_a.keys, layer_b.keys, atol=1e-5)
        assert torch.allclose(layer_a.values, layer_b.values, atol=1e-5)
    layers = model.config.num_hidden_layers
    for s in steps:
        g = s.schedule.graph
        assert g.batch() == batch
        _assert_fused(g, batch, layers, head_norm=factory is hf_tiny.qwen3)
        tiles: dict[str, int] = {}
        for ins in s.schedule.instrs:
            tiles[ins.op] = tiles.get(ins.op, 0) + 1
        assert all(tiles[o.name] > 1 for o in g.ops if o.kind in ("rms_qkv_rope", "rms_gate_up_silu"))
        rows = layer_ops.layer_rows(s.schedule, 0)
        assert [(k, w) for k, n, w in rows if n == 1] == [("table_lookup", "")], rows


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_batch_fused_kinds_at_other_prompt_lengths(factory, steps):
    """Prompts of 11, 1 and 6 tokens (left-padded to 11: positions 10, 0 and 5 at the first step)
    in a cache of 32 rows: the same against eager, fused kinds, no fallback."""
    model = factory(seed=3)
    errs, w, _ = batch_steps_against_eager(model, 3, 77, n=3, length=32, lengths=(11, 1, 6))
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    for s in steps:
        _assert_fused(s.schedule.graph, 3, model.config.num_hidden_layers, head_norm=factory is hf_tiny.qwen3)


def test_batch_fused_kinds_at_one_shared_position(steps):
    """A batch of prompts of one length called without ``attention_mask`` and ``position_ids``:
    HF derives the positions from the cache position, one for every sequence, so the cos/sin
    are the position tables' row at it (input ``rope_pos``), read by every sequence; eager's
    logits, no fallback."""
    from step_util import rel
    model = hf_tiny.llama(layers=2, seed=4)
    gen = torch.Generator().manual_seed(4)
    caches = [hf_tiny.static_cache(model, 24) for _ in range(2)]
    ids = torch.randint(1, 128, (3, 5), generator=gen)
    with torch.no_grad():
        for c in caches:
            model(input_ids=ids, past_key_values=c, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(3):
            tok = torch.randint(1, 128, (3, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            assert max(rel(a[i], b[i]) for i in range(3)) < 1e-5
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
    for s in steps:
        _assert_fused(s.schedule.graph, 3, model.config.num_hidden_layers, head_norm=False, seq_rope=False)


def test_batch_refusals_leave_the_layer_as_before(steps):
    """OLMo-2's q/k norms over the whole projection are batch-1 only in ``rms_qkv_rope``: at B = 2
    its q/k/v stay batched matvecs with generic RoPE and KV writes, while its MLP (gate/up over
    the residual stream, no norm of its own; the post-norm and residual add its prologue) is a
    batched ``rms_gate_up_silu``; eager's logits, no fallback."""
    errs, w, _ = batch_steps_against_eager(hf_tiny.olmo2(), 2, 12, n=2)
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    for s in steps:
        g = s.schedule.graph
        kinds = g.count_kinds()
        assert "rms_qkv_rope" not in kinds and kinds.get("rope") and kinds.get("kv_write"), kinds
        gu = [o for o in g.ops if o.kind == "rms_gate_up_silu"]
        assert gu and all(o.attrs["batch"] == 2 and o.attrs["norm"] is False for o in gu)
        assert any("pre" in o.attrs for o in gu)


def test_batch_fused_kinds_take_a_folded_prologue(steps):
    """Gemma-2's post-norms and residual adds fold into the batched fused kinds that read them
    (their prologue computes the B rows, then the kind's own RMSNorm: templates with ``STAGED``);
    eager's logits at B = 2, no fallback."""
    errs, w, _ = batch_steps_against_eager(hf_tiny.gemma2(), 2, 13, n=2)
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    for s in steps:
        g = s.schedule.graph
        fused = [o for o in g.ops if o.kind in ("rms_qkv_rope", "rms_gate_up_silu")]
        assert fused and all(o.attrs["batch"] == 2 for o in fused)
        assert {o.kind for o in fused if "pre" in o.attrs} == {"rms_qkv_rope", "rms_gate_up_silu"}


def test_batched_calls_match_their_templates():
    """The batched variants' template arguments are ``rms_qkv_rope_seqs``'s and
    ``rms_gate_up_silu_seqs``'s parameters, in order, with the C++ defaults (the batch-1
    variants are checked by tests/test_kind_rules.py)."""
    from test_kind_rules import _template_params
    from fusec.instructions import KINDS
    from fusec.ir import Op
    for kind in ("rms_qkv_rope", "rms_gate_up_silu"):
        call = KINDS[kind].call
        probe = Op("o", kind, {"bq": "b"}, {}, attrs={"batch": 4})
        fn = call.fn(probe)
        assert fn == kind + "_seqs"
        params = _template_params(fn, fn)
        targs = [a for a in call.targs if a.when is None or a.when(probe)]
        assert len(targs) == len(params), ([a.name for a in targs], params)
        for a, p in zip(targs, params):
            if a.default is not None:
                assert "=" in p and p.split("=")[1].strip() == str(a.default), (a.name, p)
        names = [p.split("=")[0].split()[-1] for p in params]
        assert names[names.index("H") + 1:][:2] == (["NQ", "NKV"] if kind == "rms_qkv_rope" else ["F", "B"])


#: Llama-3.2-1B's widths (benchmarks/families.py), one layer and a small vocabulary
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, num_hidden_layers=1, vocab_size=256, rope_theta=500000.0, tie_word_embeddings=True)
#: Qwen3-0.6B's widths, likewise (per-head q/k norms over 128 values)
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, num_hidden_layers=1, vocab_size=256, tie_word_embeddings=True)


def _batch_schedule(batch: int, dtype: torch.dtype, family: str = "llama", defines: dict | None = None):
    """The schedule of one decode step of ``batch`` left-padded sequences of a one-layer model of
    Llama-3.2-1B's widths (``family`` "qwen3": Qwen3-0.6B's; random weights, a 64-row
    StaticCache), captured and lowered for 132 SMs (not run); ``defines``: kernel knobs."""
    import transformers
    import step_util
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    torch.manual_seed(0)
    cfg, cls = (transformers.Qwen3Config(**QWEN3_06B), transformers.Qwen3ForCausalLM) if family == "qwen3" else \
        (transformers.LlamaConfig(**LLAMA_1B), transformers.LlamaForCausalLM)
    model = cls(cfg).to(dtype).eval()
    gen = torch.Generator().manual_seed(batch)
    ids, mask = _left_padded(model, batch, gen, lengths=(5, 2, 7, 3) * 4)
    cache = hf_tiny.static_cache(model, 64)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], 1)
    full = torch.zeros(batch, 64, dtype=torch.long)
    full[:, : mask.shape[1]] = mask
    kw = dict(input_ids=torch.randint(1, 256, (batch, 1), generator=gen), past_key_values=cache, use_cache=True,
              attention_mask=full, position_ids=mask.sum(-1, keepdim=True) - 1)
    _, g, flat = step_util.capture(model, kw)
    return lower(g, flat, Options.from_dict({"num_sms": 132, **({"defines": defines} if defines else {})}), Dumper(None))


@pytest.mark.parametrize("family,batch,dtype", [("llama", 4, torch.bfloat16), ("llama", 8, torch.bfloat16),
                                                ("llama", 16, torch.bfloat16), ("llama", 4, torch.float32),
                                                ("qwen3", 16, torch.bfloat16), ("qwen3", 4, torch.float32)])
def test_batch_fused_kinds_compile_without_spills_at_published_widths(family, batch, dtype, tmp_path):
    """At Llama-3.2-1B's widths the batch step's layer is the two batched fused kinds, and the
    kernel (``rms_qkv_rope_seqs``: B staged normed rows of 2048, 32 + 8 + 8 heads of 64, each
    sequence's cos/sin row; ``rms_gate_up_silu_seqs``: 8192 rows) compiles with NVRTC for sm_90a:
    neither kind function has a stack frame or spills, nor does the kernel spill, within the
    CTA's shared memory. Likewise at Qwen3-0.6B's widths (whole heads of 128 with their per-head
    norms: ``qkv_heads_seqs``). The default renders the B RMSNorms over the whole CTA
    (``FUSEC_RMS_ROWS_CTA`` 1, ``rms_rows_cta``: where a thread has at most 4 chunks, as at B = 8
    of the 1B and B = 16 of Qwen3-0.6B)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import MAX_SMEM_BYTES, render
    from fusec.cuda.jit import compile_cuda
    from fusec.instructions import KINDS
    sched = _batch_schedule(batch, dtype, family)
    g = sched.graph
    _assert_fused(g, batch, 1, head_norm=family == "qwen3")
    src = render(sched).source
    assert "#define FUSEC_RMS_ROWS_CTA 1" in src
    t = "__nv_bfloat16" if dtype == torch.bfloat16 else "float"
    h, heads, f, norm = (1024, "16, 8, 128", 3072, "true") if family == "qwen3" else (2048, "32, 8, 64", 8192, "false")
    assert re.search(rf"rms_qkv_rope_seqs<[^()]*, {h}, {heads}, {batch}, {batch}, true, {norm}>\(", src)
    assert re.search(rf"rms_gate_up_silu_seqs<{', '.join([t] * 5)}, {h}, {f}, {batch}>\(", src)
    kernel = compile_cuda(src, "fusec_step.cu", options=("-Xptxas", "-v"), cache_dir=str(tmp_path))
    assert "warning" not in kernel.log, kernel.log
    for fn in ("rms_qkv_rope_seqs", "rms_gate_up_silu_seqs"):
        res = [r for f, r in kernel.resources.items() if f.startswith(f"_Z{len(fn)}{fn}")]
        assert len(res) == 1 and not any(res[0][k] for k in ("stack_frame_bytes", "spill_store_bytes",
                                                              "spill_load_bytes")), (fn, res)
    assert all(r["spill_store_bytes"] == r["spill_load_bytes"] == 0 for r in kernel.resources.values())
    assert 4 * max(KINDS[o.kind].smem_floats(o, g) for o in g.ops if o.kind in KINDS) <= MAX_SMEM_BYTES
