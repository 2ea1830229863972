"""Partial rotary embeddings (GPT-NeoX ``rotary_pct``, Phi-2 and StableLM ``partial_rotary_factor``,
Phi-4-mini's partial LongRoPE): HF rotates the first ``rotary_dim`` values of each q/k head and
concatenates the rest (``cat((rope(q[..., :rd]), q[..., rd:]), -1)``). ``recognize`` raises that
to one ``rope`` op with ``rotary_dim`` (passes/recognize.py ``PARTIAL_ROPE``); ``rms_qkv_rope``
takes it like a full RoPE and rotates only the first rd values of each head, the others stored as
projected. Decode on the simulator against eager with several prompt lengths, the schedules (no
standalone rope/slice/cat/KV write), the generic ``rope``'s generated form on the host, and the
template's NVRTC compile at Phi-2's and StableLM-2-1.6B's published widths."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
import step_util
from gen_host import check_graph, compiler


def _biased(m):
    """``m`` with every q/k/v bias random (HF initializes them to zero: a bias read at the wrong
    row would not show)."""
    gen = torch.Generator().manual_seed(3)
    for mod in m.modules():
        for name in ("q_proj", "k_proj", "v_proj"):
            lin = getattr(mod, name, None)
            if lin is not None and lin.bias is not None:
                lin.bias.normal_(generator=gen)
    return m


def phi2():
    return _biased(hf_tiny.phi2())   # head_dim 16, rotary_dim 8, biases


def stablelm():
    return hf_tiny.stablelm()        # GQA, head_dim 16, rotary_dim 4, biases


def phi4_mini():
    return hf_tiny.phi3_longrope(partial=0.75)   # fused qkv_proj, rotary_dim 12, LongRoPE


def gpt_neox():
    return hf_tiny.gpt_neox()        # fused q/k/v interleaved per head (a head stride), rotary_dim 8


FUSED = {"phi2": (phi2, 8), "stablelm": (stablelm, 4), "phi4_mini": (phi4_mini, 12), "gpt_neox": (gpt_neox, 8)}
STANDALONE = {"rope", "kv_write", "aten.slice.Tensor", "aten.cat.default"}


@pytest.mark.parametrize("family", sorted(FUSED))
def test_partial_rotary_reaches_rms_qkv_rope_and_decodes_like_eager(family, steps):
    """Each layer's q/k/v, partial RoPE and KV writes are one ``rms_qkv_rope`` with
    ``rotary_dim`` < ``head_dim``; nothing of the RoPE stands alone (not even inside a chain);
    decode after prompts of 1, 6 and 19 tokens matches eager, no fallback, default options."""
    factory, rd = FUSED[family]
    model = factory()
    errs, w = step_util.prompts_against_eager(model, {}, (1, 6, 19))
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    assert max(errs.values()) < 1e-5, errs
    g = steps[-1].schedule.graph
    qkv = [o for o in g.ops if o.kind == "rms_qkv_rope"]
    assert len(qkv) == model.config.num_hidden_layers
    assert all(o.attrs["rotary_dim"] == rd < o.attrs["head_dim"] for o in qkv), [o.attrs for o in qkv]
    kinds = g.count_kinds()   # chain and prologue members by their own kinds
    assert not STANDALONE & set(kinds), kinds


@pytest.mark.parametrize("family", ["phi2", "stablelm"])
def test_partial_rotary_bf16_over_many_tiles(family, steps):
    """bf16 at 16 and 132 SMs (a tile's units cross rotary_dim / 2 inside a head, or hold one
    pair): each step equals the step with the prologue fold off bit for bit, and eager within
    bf16's tolerance, no fallback; the step of the default options takes the partial RoPE into
    ``rms_qkv_rope``."""
    factory, _ = FUSED[family]
    for sms in (16, 132):
        made = len(steps)
        step_util.assert_option_changes_no_value(factory().to(torch.bfloat16), {"prologue": False}, seed=3,
                                                 num_sms=sms)
        default = steps[made]   # compiled first: the default options at ``sms`` SMs
        assert default.schedule.num_sms == sms
        assert any("rotary_dim" in o.attrs for o in default.schedule.graph.ops if o.kind == "rms_qkv_rope")


def test_phi2_qkv_takes_the_layernorm_and_the_up_projection_its_own_copy():
    """Phi-2's parallel block: the LayerNorm feeds q/k/v and the MLP's up projection. The q/k/v
    are ``rms_qkv_rope`` with the LayerNorm as its prologue; the up projection a ``matvec`` that
    computes its own copy of it (``pre_steps`` ending in ``layernorm``); no ``matvec_group``."""
    model = phi2().to(torch.bfloat16)
    s = step_util.lowered(model)
    ops = s.graph.ops
    qkv = [o for o in ops if o.kind == "rms_qkv_rope"]
    assert all(o.attrs["pre_steps"].endswith("layernorm") and o.attrs["norm"] is False for o in qkv)
    ups = [o for o in ops if o.kind == "matvec" and o.attrs.get("pre_steps", "").endswith("layernorm")
           and s.graph.tensors[o.outputs["out"]].numel == model.config.intermediate_size]
    assert len(ups) == len(qkv) and not [o for o in ops if o.kind == "matvec_group"]


@pytest.mark.skipif(compiler() is None, reason="needs a host C++ compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_generic_partial_rope_generated_form_matches_torch_on_the_host(dtype, tol, tmp_path):
    """The generic ``rope`` op with ``rotary_dim`` (GPT-NeoX's, kept generic: no fusion), run by
    its generated function on the host from PyTorch's inputs: rotated values and the
    pass-through ones."""
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    model = hf_tiny.gpt_neox().to(dtype)
    cache = hf_tiny.static_cache(model, 32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 4), generator=gen), past_key_values=cache, use_cache=True)
    kw = {"input_ids": torch.randint(0, 128, (1, 1), generator=gen), "past_key_values": cache, "use_cache": True}
    _, g, flat = step_util.capture(model, kw)
    g = lower(g, flat, Options.from_dict({"num_sms": 8, "prologue": False, "chain": False, "max_fusions": 0}),
              Dumper(None)).graph
    with torch.no_grad():
        res = check_graph(g, flat, select=lambda op: op.kind == "rope" and "rotary_dim" in op.attrs,
                          workdir=tmp_path)
    assert len(res) == 4 and all(r.max_err <= tol for r in res), res


#: (hidden, heads, kv heads, partial rotary factor): Phi-2 (head_dim 80, rotary 32) and
#: StableLM-2-1.6B (head_dim 64, rotary 16), benchmarks/families.py
PUBLISHED = {"phi2": (2560, 32, 32, 0.4), "stablelm": (2048, 32, 32, 0.25)}


def _published(family: str):
    """One layer at the family's published attention widths (a small MLP and vocabulary: the
    ``rms_qkv_rope`` instantiation depends on the q/k/v's shapes only), random biases."""
    hidden, heads, kv, partial = PUBLISHED[family]
    kw = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=256,
              num_hidden_layers=1, partial_rotary_factor=partial)
    if family == "phi2":
        from transformers import PhiConfig, PhiForCausalLM
        return _biased(hf_tiny._small(PhiConfig, PhiForCausalLM, **kw))
    from transformers import StableLmConfig, StableLmForCausalLM
    return _biased(hf_tiny._small(StableLmConfig, StableLmForCausalLM, use_qkv_bias=True, **kw))


@pytest.fixture(scope="module")
def published_kernel(tmp_path_factory):
    """``kernel(family, dtype)``: (the ``rms_qkv_rope`` op, the step's kernel compiled with NVRTC
    for sm_90a and ptxas's per-function report) at the family's published attention widths; made
    once per family and dtype in this file (the function test and the whole-kernel test below
    read the same compile)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    from test_attention_split import _lowered
    made: dict = {}

    def kernel(family: str, dtype):
        if (family, dtype) not in made:
            sched = _lowered(lambda: _published(family), dtype, 132, 256)
            (qkv,) = [o for o in sched.graph.ops if o.kind == "rms_qkv_rope"]
            made[family, dtype] = qkv, compile_cuda(render(sched).source, "fusec_step.cu", options=("-Xptxas", "-v"),
                                                    cache_dir=str(tmp_path_factory.mktemp("nvrtc")))
        return made[family, dtype]
    return kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_published_partial_rotary_template_compiles_without_spills(family, dtype, published_kernel):
    """``rms_qkv_rope`` at Phi-2's (2560 hidden, 32 heads of 80, rotary 32) and StableLM-2-1.6B's
    (2048, 32 of 64, rotary 16) widths, bf16 and fp32: its device function (out of line,
    ``FUSEC_KIND_FN``) compiles with no stack frame and no spill (ptxas ``-v``), no warning."""
    qkv, kernel = published_kernel(family, dtype)
    hidden, heads, _, partial = PUBLISHED[family]
    assert qkv.attrs["rotary_dim"] == int(hidden // heads * partial) < qkv.attrs["head_dim"]
    assert "warning" not in kernel.log, kernel.log
    lines = kernel.log.splitlines()
    props = [lines[i + 1] for i, l in enumerate(lines) if "Function properties for _Z12rms_qkv_rope" in l]
    assert len(props) == 1, kernel.log
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in props[0], props


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_published_partial_rotary_kernel_has_no_spills(family, dtype, published_kernel):
    """The whole step's kernel at those widths: no local memory anywhere. (Phi-2 in fp32, head_dim
    80, spilled 12 bytes in its entry function at the 128-register cap while its split-KV
    attention took the scalar value pass of heads whose 16-byte chunks per row are not a power
    of two; with the padded lanes, 2026-12-06, it does not: tests/test_attention_head_dims.py.)"""
    _, kernel = published_kernel(family, dtype)
    kernel.assert_no_spills()
