"""LayerNorm in a folded prologue (fusec/instructions/prologue.py ``MEMBER_KINDS``): the
``layernorm`` op's generated CUDA form (fusec/cuda/gen/semantic.py) against PyTorch on the host,
the LayerNorm families' folds, and their decode on the simulator against the unfolded step
and eager. The GPU runs them in tests/test_gpu_families.py (gpt_neox, falcon, phi2, stablelm,
olmo, starcoder2, gpt2)."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
import step_util
from gen_host import check_graph, compiler


@pytest.mark.skipif(compiler() is None, reason="needs a host C++ compiler")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_layernorm_generated_form_matches_torch_on_the_host(dtype, tol, tmp_path):
    """Every ``layernorm`` op of GPT-NeoX (weight and bias) and OLMo (no weight, no bias), run by
    its generated function on the host from PyTorch's inputs."""
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    import test_families as fam
    for factory in (hf_tiny.gpt_neox, fam.olmo):
        model = factory().to(dtype)
        _, g, flat = step_util.capture(model, _decode_kwargs(model))
        g = lower(g, flat, Options.from_dict({"num_sms": 8, "prologue": False, "chain": False}), Dumper(None)).graph
        (tmp_path / factory.__name__).mkdir()
        with torch.no_grad():
            # a folder per library: dlopen would hand back the first one loaded from a path
            res = check_graph(g, flat, select=lambda op: op.kind == "layernorm", workdir=tmp_path / factory.__name__)
        assert res and all(r.max_err <= tol for r in res), res


def _decode_kwargs(model):
    cache = hf_tiny.static_cache(model, 32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 4), generator=gen), past_key_values=cache, use_cache=True)
    return {"input_ids": torch.randint(0, 128, (1, 1), generator=gen), "past_key_values": cache, "use_cache": True}


@pytest.mark.parametrize("factory", [hf_tiny.gpt_neox, hf_tiny.falcon])
def test_layernorm_folds_and_decodes_like_unfolded_and_eager(factory):
    """GPT-NeoX (two LayerNorms per layer, parallel residual) and Falcon: a LayerNorm is a
    prologue member; six decode steps on the simulator equal the step with the fold off bit for
    bit, and eager within bf16 tolerance, no fallback."""
    s = step_util.lowered(factory().to(torch.bfloat16))
    assert any("layernorm" in o.attrs["pre_steps"] for o in s.graph.ops if "pre" in o.attrs)
    step_util.assert_option_changes_no_value(factory().to(torch.bfloat16), {"prologue": False}, seed=7)


def test_a_norm_read_by_two_parallel_blocks_folds_into_both():
    """Cohere's parallel block: one LayerNorm (decomposed into ATen ops) feeds both the q/k/v and
    the MLP. Folded into the q/k/v alone, the MLP would wait for all of the q/k/v; so each of
    the two computes it in its own prologue (the MLP on tensors of its own), none of the norm's
    ops stands alone, and decode equals the unfolded step bit for bit and eager."""
    import test_families as fam
    s = step_util.lowered(fam.cohere().to(torch.bfloat16))
    folds = [(o.kind, o.attrs["pre_steps"]) for o in s.graph.ops if "pre" in o.attrs]
    norm = "_to_copy > mean > sub > pow > mean > sub > add > rsqrt > mul > mul > _to_copy"
    n = fam.cohere().config.num_hidden_layers
    assert folds == [("matvec_group", norm), ("rms_gate_up_silu", norm)] * n + [("matvec", norm)], folds
    mlp = [o for o in s.graph.ops if o.kind == "rms_gate_up_silu"]
    qkv = [o for o in s.graph.ops if o.kind == "matvec_group"]
    for a, b in zip(qkv, mlp):   # the MLP's copy: tensors of its own, written by no other op
        mine = {t for m in b.attrs["pre"] for t in m.fresh_outputs()}
        theirs = {t for m in a.attrs["pre"] for t in m.fresh_outputs()}
        assert mine and not mine & theirs
        assert b.attrs["pre_keep"] == [] and a.attrs["pre_keep"] == []
    standalone = {o.kind for o in s.graph.ops if o.kind.startswith("aten.") and o.layer is not None}
    assert not standalone & {"aten.mean.dim", "aten.rsqrt.default", "aten.pow.Tensor_Scalar"}, standalone
    step_util.assert_option_changes_no_value(fam.cohere().to(torch.bfloat16), {"prologue": False}, seed=5)


def test_the_parallel_residual_folds_into_both_layernorms():
    """GPT-NeoX (parallel residual, two LayerNorms per layer): the residual sum ``attn + mlp + h``
    feeds the next layer's q/k/v LayerNorm and its MLP's LayerNorm. It folds into the q/k/v,
    whose writer tile writes the sum (the layer after reads it), and a copy of the adds alone
    (not the q/k/v's LayerNorm, which the MLP does not use) heads the MLP's prologue before its
    own LayerNorm: no chain of adds stands between the layers."""
    s = step_util.lowered(hf_tiny.gpt_neox().to(torch.bfloat16))
    ops = s.graph.ops
    assert not [o for o in ops if o.kind == "chain" and "layernorm" in o.attrs["steps"]]
    folded = [o for o in ops if "pre" in o.attrs and o.attrs["pre_steps"] == "add > add > layernorm"]
    qkv = [o for o in folded if o.attrs["pre_keep"]]
    mlp = folded[folded.index(qkv[0]) + 1:][:1]   # the next layer's MLP (the LM head after it)
    assert len(qkv) == 1 and len(mlp) == 1, [(o.name, o.attrs["pre_keep"]) for o in folded]
    norm_w = [[m.inputs for m in o.attrs["pre"] if m.kind == "layernorm"][0] for o in (qkv[0], mlp[0])]
    assert norm_w[0] != norm_w[1]   # each its own LayerNorm's weights


def test_a_layernorm_family_reaches_rms_qkv_rope():
    """StarCoder2 (LayerNorm with bias, q/k/v biases, full RoPE): its q/k/v, RoPE and KV writes
    are one ``rms_qkv_rope`` per layer that does not norm x itself (``norm`` False): the
    LayerNorm in front folds in as its prologue, and with the fold off the kind stages the
    LayerNorm's output as it is (the NORM=false instantiation). No RoPE or KV write stands
    alone; both steps decode alike and like eager, no fallback; both kernels compile for sm_90a
    without warnings or spills."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    for options in ({}, {"prologue": False}):
        s = step_util.lowered(hf_tiny.starcoder2().to(torch.bfloat16), **options)
        kinds = s.graph.count_kinds(members=False)
        qkv = [o for o in s.graph.ops if o.kind == "rms_qkv_rope"]
        assert len(qkv) == hf_tiny.starcoder2().config.num_hidden_layers, kinds
        every = s.graph.count_kinds()   # chain members by their kinds too
        assert not {"rope", "kv_write"} & set(every), every
        assert all(o.attrs["norm"] is False and "norm_w" not in o.inputs and "bq" in o.inputs for o in qkv)
        assert all(("pre" in o.attrs) == ("prologue" not in options) for o in qkv)
        kernel = compile_cuda(render(s).source, "fusec_step.cu")
        assert "warning" not in kernel.log, kernel.log
        kernel.assert_no_spills()
    step_util.assert_option_changes_no_value(hf_tiny.starcoder2().to(torch.bfloat16), {"prologue": False}, seed=11)
