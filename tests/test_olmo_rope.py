"""OLMo and OLMo-2's q/k/v reach ``rms_qkv_rope``.

HF's OLMo and OLMo-2 ``apply_rotary_pos_emb`` multiplies q/k of the model dtype by cos/sin kept
in fp32 and casts the fp32 result back (``.to(q_type)``): ``recognize`` makes that one ``rope``
of the model dtype with ``fp32_math`` (passes/recognize.py ``_fp32_ropes``), the same value (fp32
math, one rounding). OLMo-2 norms q over all its Hq*D values and k over Hkv*D (``q_norm`` /
``k_norm`` over the whole projection): ``rms_qkv_rope``'s ``qk_norm`` "proj" mode, where the tile
that takes the step's last q/k ticket norms, rotates and stores all of q and k. Decode through
``torch.compile(backend="fusec")`` against eager over several prompt lengths (fp32 and bf16), the
schedules (one ``rms_qkv_rope`` per layer, no standalone rope, cast, norm or KV write), the rope
against HF's eager function bit for bit, and the template's NVRTC compile at the published
widths."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
import step_util

FAMILIES = {"olmo": hf_tiny.olmo, "olmo2": hf_tiny.olmo2}
#: kinds that stood alone (or in a one-tile chain) around the RoPE before
STANDALONE = {"rope", "kv_write", "rmsnorm", "aten._to_copy.default", "prims.convert_element_type.default"}


def _olmo2_norms(m):
    """``m`` with random q/k norm weights (HF initializes them to one: a weight read at the wrong
    row would not show)."""
    gen = torch.Generator().manual_seed(4)
    for layer in m.model.layers:
        for n in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            n.weight.uniform_(0.5, 1.5, generator=gen)
    return m


def _model(family):
    m = FAMILIES[family]()
    return _olmo2_norms(m) if family == "olmo2" else m


def _loose(g) -> set[str]:
    """The kinds of the step's ops and of its chains' members (not of folded prologues: OLMo's
    LayerNorms cast around themselves, OLMo-2's post-norms fold into the next op)."""
    return {m.kind for o in g.ops for m in (o.attrs["ops"] if o.kind == "chain" else [o])}


def _assert_fused(g, layers: int, proj: bool):
    qkv = [o for o in g.ops if o.kind == "rms_qkv_rope"]
    assert len(qkv) == layers, [o.kind for o in g.ops]
    assert all((o.attrs.get("qk_norm") == "proj") == proj for o in qkv), [o.attrs for o in qkv]
    assert not STANDALONE & _loose(g), _loose(g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_olmo_qkv_rope_kv_write_is_one_rms_qkv_rope_and_decodes_like_eager(family, dtype, steps):
    """Default options: each layer's q/k/v projections, (OLMo-2: q/k norms over the whole
    projection), RoPE in fp32 and KV writes are one ``rms_qkv_rope``; no rope, cast, q/k norm or
    KV write stands alone or in a chain; decode after prompts of 1, 6 and 19 tokens matches eager
    (fp32: 1e-5; bf16: bf16's tolerance), no fallback."""
    model = _model(family).to(dtype)
    errs, w = step_util.prompts_against_eager(model, {}, (1, 6, 19))
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    assert max(errs.values()) < (1e-5 if dtype == torch.float32 else 2e-2), errs
    _assert_fused(steps[-1].schedule.graph, model.config.num_hidden_layers, family == "olmo2")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_olmo_bf16_equals_the_prologue_fold_off_step_over_many_tiles(family):
    """bf16 at 16 and 132 SMs (OLMo-2: many tiles take the q/k ticket, a tile's units cross from
    q to k and from k to v): each step equals the step with the prologue fold off bit for bit,
    and eager within bf16's tolerance, no fallback."""
    for sms in (16, 132):
        s = step_util.lowered(_model(family).to(torch.bfloat16), num_sms=sms)
        qkv = [o for o in s.graph.ops if o.kind == "rms_qkv_rope"]
        assert len(qkv) == 2
        if family == "olmo2":
            tiles = [i for i in s.instrs if i.op == qkv[0].name]
            assert len({i.tile.params["qk_tiles"] for i in tiles}) == 1 and tiles[0].tile.params["qk_tiles"] > 1
        step_util.assert_option_changes_no_value(_model(family).to(torch.bfloat16), {"prologue": False}, seed=3,
                                                 num_sms=sms)


def test_fp32_rope_equals_hf_eager_bit_for_bit():
    """The ``rope`` op of a bf16 x with fp32 cos/sin (``fp32_math``: what the simulator and
    ``rms_qkv_rope`` compute, fp32 products and sum, one rounding) equals HF OLMo's
    ``apply_rotary_pos_emb`` on the CPU bit for bit (the CUDA template may contract a product and
    the sum into an FMA: one fp32 rounding fewer, within one bf16 rounding of it)."""
    from transformers.models.olmo.modeling_olmo import apply_rotary_pos_emb
    from fusec.ir.semantics import rotate
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 1, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 2, 1, 64, generator=gen).to(torch.bfloat16)
    ang = torch.rand(1, 1, 32, generator=gen) * 100
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    qe, ke = apply_rotary_pos_emb(q, k, cos, sin)
    assert qe.dtype == torch.bfloat16
    assert torch.equal(rotate(q, cos[:, None], sin[:, None]).to(torch.bfloat16), qe)
    assert torch.equal(rotate(k, cos[:, None], sin[:, None]).to(torch.bfloat16), ke)
    # the kind's form: pairs (p, p + D/2), y1 * c - y2 * s and y2 * c + y1 * s
    y1, y2 = q.float()[..., :32], q.float()[..., 32:]
    c, s = cos[:, None, :, :32], sin[:, None, :, :32]
    assert torch.equal(torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], -1).to(torch.bfloat16), qe)


#: (hidden, heads, kv heads): OLMo-2-0425-1B and OLMo-1B-hf (benchmarks/families.py)
PUBLISHED = {"olmo2": (2048, 16, 16), "olmo": (2048, 16, 16)}


def _published(family: str):
    """One layer at the family's published attention widths (a small MLP and vocabulary: the
    ``rms_qkv_rope`` instantiation depends on the q/k/v's shapes only)."""
    hidden, heads, kv = PUBLISHED[family]
    kw = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=256,
              num_hidden_layers=1)
    if family == "olmo2":
        from transformers import Olmo2Config, Olmo2ForCausalLM
        return _olmo2_norms(hf_tiny._small(Olmo2Config, Olmo2ForCausalLM, **kw))
    from transformers import OlmoConfig, OlmoForCausalLM
    return hf_tiny._small(OlmoConfig, OlmoForCausalLM, pad_token_id=1, bos_token_id=None, eos_token_id=2, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_published_olmo_template_compiles_without_spills(family, dtype, tmp_path):
    """``rms_qkv_rope`` at OLMo-2-0425-1B's and OLMo-1B-hf's widths (2048 hidden, 16 heads of
    128), bf16 and fp32: its device function compiles with no stack frame and no spill (ptxas
    ``-v``), no warning, and the whole kernel uses no local memory."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from test_attention_split import _lowered
    sched = _lowered(lambda: _published(family), dtype, 132, 256)
    (qkv,) = [o for o in sched.graph.ops if o.kind == "rms_qkv_rope"]
    assert (qkv.attrs.get("qk_norm") == "proj") == (family == "olmo2")
    import step_util
    step_util.compile_kind_without_spills(render(sched).source, tmp_path)
